"""RunOptions: how the CLI (dataflow/run.py) or a script asks the driver to run a graph. A module of
its own: the driver's parts (launch.py, monitor.py) read it, and runtime.py runs with it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def default_compile_cache() -> str:
    """~/.cache/dataflow/compile (or under $XDG_CACHE_HOME): kept across runs and reboots."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dataflow", "compile")


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
    compile_cache: str = field(default_factory=default_compile_cache)
    """Where compiled artefacts (torch.compile, triton, vLLM) persist across runs; "" = each
    library's own default (torch's is under /tmp)."""
