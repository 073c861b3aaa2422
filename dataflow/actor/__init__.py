"""What runs in a node replica's process: the NodeHost actor (host.py), its checkpoints and snapshots,
and the Python stacks it reports for the stall watch."""
