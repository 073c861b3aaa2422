"""The driver: loads a graph file, checks its inputs, starts one Ray actor per node replica, wires and
watches them until the run ends (runtime.py), with checkpoints, restarts, resume and the stall watch."""
