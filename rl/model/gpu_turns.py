"""The phase switch's turns: the processes that share one GPU's memory by phases (the generator's
KV cache, the learner's step; rl/model/applied_plan.py) take turns holding it through an exclusive
file lock, so the two never hold their lent memory at once, whatever order their work arrives in
(a validation round during a learner step waits for the step's end, a learner step for the last
decode step). flock, not a Ray actor: both ends are on one machine, taking it costs microseconds,
and the kernel drops it when a holder's process dies, so a killed node never leaves the GPU taken.
"""

from __future__ import annotations

import fcntl
import os
import time


class GpuTurn:
    """take() blocks until this process holds the GPU's lent memory; give() lets the others have it."""

    def __init__(self, path: str):
        self.path, self.held, self.fd = path, False, None

    def take(self) -> float:
        """Blocks (call it from a thread) until the turn is this process's; returns the seconds waited."""
        if self.held:
            return 0.0
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        t = time.perf_counter()
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.held = True
        return time.perf_counter() - t

    def give(self) -> None:
        if self.held:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.held = False

    def close(self) -> None:
        self.give()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
