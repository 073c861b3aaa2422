"""Worker processes whose calls can be killed: for work that may hold the GIL for minutes.

Why not a thread: a reward call in a thread cannot be stopped. A hang that waits (a sleep, a
socket) only leaves an abandoned thread behind, but a C-level computation holds the GIL and
freezes every thread of the process, the node's event loop and its channels included. Math answers
do this: sympy evaluating `\\boxed{10^{10^{10}}}` builds a ten-billion-digit integer in one C
call, and no Python-level timeout (threads, or math-verify's own signal.alarm) can interrupt it.
A worker process can be killed, so the math checker (rl/reward/math_reward.py) runs in these.

Workers are fresh interpreters (`python -m rl.reward.isolated FD`), not forks: the caller is a Ray
worker with many threads (fork is unsafe), and multiprocessing's spawn/forkserver would re-import
the caller's __main__ (Ray's worker script). A worker imports `preload` once, then serves calls
of importable functions ("module:function", args) over a socketpair, one at a time.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

_IN_WORKER = False
START_TIMEOUT_S = 120.0
"""Longest a worker may take to start and import its preload (seconds on a loaded machine)."""


def in_worker() -> bool:
    """True inside a pool worker: code there may use signal-based timeouts (its main thread)."""
    return _IN_WORKER


class WorkerTimeout(TimeoutError):
    pass


class WorkerError(RuntimeError):
    """The called function raised in the worker (message: "Type: text"), or the worker died."""


class KillablePool:
    """Up to `size` worker processes, started on first use; `call` blocks the calling thread.

    call(target, args, timeout_s): runs target(*args) in an idle worker; past timeout_s the worker
    is killed (SIGKILL) and WorkerTimeout raised; a replacement starts on the next call. Time
    spent waiting for an idle worker is not part of the timeout. Thread-safe.
    """

    def __init__(self, size: int, preload: tuple[str, ...] = ()):
        if size < 1:
            raise ValueError(f"KillablePool: size={size} must be >= 1")
        self.size = size
        self.preload = tuple(preload)
        self.killed = 0                       # workers killed for a timeout (a metric)
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: set = set()            # (process, connection) of every live worker
        self._count = 0                       # live workers and those starting

    def call(self, target: str, args: tuple, timeout_s: float):
        worker = self._take()
        proc, conn = worker
        try:
            conn.send((target, args))
            ready = conn.poll(timeout_s)
        except (OSError, EOFError):
            ready = False
        if not ready:
            died = proc.poll() is not None
            self._discard(worker, kill=True)
            if died:
                raise WorkerError(f"worker process died (exit status {proc.returncode})")
            with self._lock:
                self.killed += 1
            raise WorkerTimeout(f"timed out after {timeout_s:g}s (worker process killed)")
        try:
            ok, value = conn.recv()
        except (OSError, EOFError):
            self._discard(worker, kill=True)
            raise WorkerError(f"worker process died (exit status {proc.poll()})") from None
        self._idle.put(worker)
        if not ok:
            raise WorkerError(value)
        return value

    def close(self) -> None:
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            self._discard(worker, kill=True)

    def _take(self):
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                with self._lock:
                    start = self._count < self.size
                    self._count += start
                if start:
                    try:
                        worker = self._start()
                    except BaseException:
                        with self._lock:
                            self._count -= 1
                        raise
                    with self._lock:
                        self._workers.add(worker)
                else:
                    worker = self._idle.get()
            if worker[0].poll() is None:
                return worker
            self._discard(worker, kill=False)   # died while idle: take another

    def _start(self):
        """A new worker, once it has imported `preload` (its start-up is not part of a call's timeout)."""
        parent, child = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        proc = subprocess.Popen([sys.executable, "-m", "rl.reward.isolated", str(child.fileno()), *self.preload],
                                pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        child.close()
        conn = Connection(parent.detach())
        try:
            ready = conn.poll(START_TIMEOUT_S) and conn.recv() == "ready"
        except (OSError, EOFError):
            ready = False
        if not ready:
            proc.kill()
            proc.wait()
            conn.close()
            raise WorkerError(f"a worker process (python -m rl.reward.isolated, preload {list(self.preload)}) did not "
                              f"start within {START_TIMEOUT_S:g}s (exit status {proc.returncode}; its stderr "
                              "is in this process's log)")
        return proc, conn

    def _discard(self, worker, kill: bool) -> None:
        proc, conn = worker
        with self._lock:
            if worker in self._workers:
                self._workers.discard(worker)
                self._count -= 1
        if kill and proc.poll() is None:
            proc.kill()
        proc.wait()
        conn.close()


def _serve(fd: int, preload: list[str]) -> None:
    conn = Connection(fd)
    for name in preload:
        importlib.import_module(name)
    conn.send("ready")
    functions: dict = {}
    while True:
        try:
            target, args = conn.recv()
        except EOFError:                      # the parent closed its end or exited
            return
        try:
            fn = functions.get(target)
            if fn is None:
                module, name = target.split(":")
                fn = functions[target] = getattr(importlib.import_module(module), name)
            reply = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - reported to the caller as text (exceptions may not pickle)
            reply = (False, f"{type(e).__name__}: {e}".splitlines()[0][:300])
        conn.send(reply)


if __name__ == "__main__":
    import rl.reward.isolated as this  # the importable module (this file runs as __main__)

    this._IN_WORKER = True
    sys.stdout = sys.stderr                   # a stray print must not reach the caller's console as ours
    this._serve(int(sys.argv[1]), sys.argv[2:])
