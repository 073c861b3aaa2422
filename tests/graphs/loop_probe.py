"""One node that logs which event loop its actor runs on (tests/integration/test_runtime.py)."""

from dataflow import Graph
from tests.graphs.probes import LoopProbe

graph = Graph("loop_probe")
graph.node("probe", LoopProbe, cpus=0.25)
