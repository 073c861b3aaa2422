"""RunOptions: how the CLI (dataflow/run.py) or a script asks the driver to run a graph. A module of
its own: the driver's parts (launch.py, monitor.py) read it, and runtime.py runs with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunOptions:
    address: str | None = None
    max_steps: int | None = None
    trace_path: str | None = None
    trace_kernels: bool = False
    out_dir: str | None = None
    verbose: bool = False
    quiet: bool = False
    resume: str | None = None
    """A checkpoint directory (or a run directory: its latest checkpoint) to continue from."""
