"""Where a command's CPU time goes, by process kind: runs the command (default: the test suite) and
samples it and every process under it (psutil, every 0.25 s; a local Ray's daemons and workers are
under the process that started it), keeping each one's last CPU time (user + system) and its most
telling title (a Ray worker's `ray::NodeHost.run` rather than the `ray::IDLE` it shows between
calls). Prints the total and a table by title.

    python bench/suite_cpu.py                       # pytest tests
    python bench/suite_cpu.py -- python -m pytest tests/integration/test_algorithms.py -n 0

A process that lives under 0.25 s may be missed, and one's CPU after its last sample is not
counted: the totals are a floor. Results: bench/results/suite_cpu.md.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
import time

import psutil


def sample(root: psutil.Process, stop: threading.Event, seen: dict) -> None:
    """Every process under `root` (kept once seen, also after it is reparented)."""
    known: dict[int, psutil.Process] = {}
    while not stop.is_set():
        try:
            for p in [root, *root.children(recursive=True)]:
                known.setdefault(p.pid, p)
        except psutil.Error:
            pass
        for pid, p in list(known.items()):
            try:
                with p.oneshot():
                    title, cpu = " ".join(p.cmdline())[:60], p.cpu_times()
            except psutil.Error:
                del known[pid]   # ended: its last sample stays in `seen`
                continue
            old = seen.get(pid, ("", 0.0))[0]
            keep = title if title and not title.startswith("ray::IDLE") else (old or title)
            seen[pid] = (keep, cpu.user + cpu.system)
        stop.wait(0.25)


def kind(title: str) -> str:
    if title.startswith("ray::"):
        return title.split(" ")[0]
    words = title.split(" ")
    return " ".join(words[:3]) if "python" in words[0] else words[0]


def main(argv: list[str]) -> int:
    command = argv[argv.index("--") + 1:] if "--" in argv else [sys.executable, "-m", "pytest", "tests"]
    seen: dict[int, tuple[str, float]] = {}
    stop, t0 = threading.Event(), time.time()
    child = subprocess.Popen(command)
    thread = threading.Thread(target=sample, args=(psutil.Process(child.pid), stop, seen), daemon=True)
    thread.start()
    rc = child.wait()
    wall = time.time() - t0
    stop.set()
    thread.join()
    by_kind: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for title, cpu in seen.values():
        by_kind[kind(title)][0] += 1
        by_kind[kind(title)][1] += cpu
    total = sum(cpu for _, cpu in by_kind.values())
    print(f"rc {rc}; wall {wall:.1f} s; CPU {total:.1f} s (user + system) over {len(seen)} processes")
    print(f"{'CPU s':>8} {'procs':>6}  process")
    for name, (n, cpu) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{cpu:8.1f} {n:6d}  {name}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
