"""RunOptions: how the CLI (dataflow/run.py) or a script asks the driver to run a graph. A module of
its own: the driver's parts (launch.py, monitor.py) read it, and runtime.py runs with it."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field


def process_age_s() -> float | None:
    """Seconds since this process started (the interpreter's launch, before any import), from
    /proc/self/stat; None where there is no /proc (the CLI then reports its parts without it)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class DriverClock:
    """The CLI's own start-up before Ray: its process start to the first import of the CLI
    ("python, imports"), then each named part (`with clock.part("graph"):`). RunOptions carries
    the parts to the running line, so the whole wait from the command to the first step is shown."""

    def __init__(self, since_process_start: bool = True):
        age = process_age_s() if since_process_start else None
        self.parts: dict[str, float] = {} if age is None else {"python, imports": age}

    @contextlib.contextmanager
    def part(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0


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
    driver_parts: dict[str, float] = field(default_factory=dict)
    """Seconds the CLI spent before run_graph, by part (DriverClock); shown on the running line."""
    keep_processes: bool = field(default_factory=lambda: os.environ.get("DATAFLOW_KEEP_PROCESSES") == "1")
    """Keep the node processes of a run that ends cleanly for the next run on the same Ray (a
    script running several graphs, or CLI runs joining a `ray start` cluster with --address;
    placement groups that saw no restart; not on a Ray the run started itself, which ends with it):
    the next run of the same placement skips their start and imports. dataflow/driver/warm.py; a
    run without it, warm.release_all() or `ray stop` ends them. Default: $DATAFLOW_KEEP_PROCESSES=1."""
    compile_cache: str = field(default_factory=default_compile_cache)
    """Where compiled artefacts (torch.compile, triton, vLLM) persist across runs; "" = each
    library's own default (torch's is under /tmp)."""
