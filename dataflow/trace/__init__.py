"""Tracing: per-node spans and counters (tracer), the driver's collector, the idle report and plot.

`python -m dataflow.trace out.json [--plot out.png]` prints the idle table of a saved trace.
"""
