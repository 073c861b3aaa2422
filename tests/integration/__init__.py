"""Integration tests: Ray, graphs, processes and the CLI (`pytest tests/integration`)."""
