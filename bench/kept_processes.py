"""Several graph runs from one script, with and without RunOptions.keep_processes (dataflow/driver/warm.py).

    python bench/kept_processes.py --graph graphs/ppo.py --runs 3 --set max_steps=2
    python bench/kept_processes.py --cli --graph graphs/ppo.py --runs 3 --set max_steps=2

--cli: each run is the command `python -m dataflow.run GRAPH --address A [--keep-processes]`
against one `ray start --head` cluster; the wall is the command's, start-up is what it printed.

One Ray for the whole benchmark. Each round runs: `off` (keep_processes=False: every process
starts, and whatever an earlier run kept is ended first), `first` (keep_processes=True, nothing kept
yet: every process starts, and is kept), `kept` (keep_processes=True: the previous run's processes
host it). Rounds repeat the three in that order, so a machine getting busier touches both sides.
Each run prints its wall seconds (run_graph's call) and its start-up (Ray up -> every node set up)
with its parts; the summary compares `off` with `kept`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a cluster of its own: no token to pass around


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="graphs/ppo.py")
    parser.add_argument("--runs", type=int, default=3, help="rounds (off, first, kept)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--out", default="/tmp/kept_processes")
    parser.add_argument("--json", help="write the raw numbers here")
    parser.add_argument("--cli", action="store_true", help="runs are commands joining a `ray start` cluster")
    args = parser.parse_args()
    if args.cli:
        rows = cli_rounds(args)
        summarize(rows, args)
        return

    import ray

    from dataflow.driver import warm
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    # logical CPUs as the CLI gives a graph (dataflow/driver/launch.start_ray): a node's cpus are a share
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    rows = []
    for i in range(args.runs):
        for side in ("off", "first", "kept"):
            keep = side != "off"
            graph, config = load_graph(str(ROOT / args.graph), args.overrides)
            out = f"{args.out}/{side}{i}"
            t0 = time.perf_counter()
            summary = asyncio.run(run_graph(graph, RunOptions(out_dir=out, quiet=True, keep_processes=keep), config))
            wall = time.perf_counter() - t0
            row = {"side": side, "run": i, "wall_s": round(wall, 2), "status": summary.status, "steps": summary.steps,
                   "startup": summary.startup, "kept_after": warm.kept_processes()}
            rows.append(row)
            print(f"{side:5} run {i}: {wall:6.2f} s, start-up {summary.startup.get('total', 0):5.2f} s "
                  f"(actors {summary.startup.get('actors', 0):.2f}, setup {summary.startup.get('setup', 0):.2f}), "
                  f"{summary.steps} steps, {summary.status}", flush=True)
    warm.release_all()
    ray.shutdown()
    summarize(rows, args)


def cli_rounds(args) -> list[dict]:
    """The rounds as commands (--cli): the start-up each printed, parsed from its running line."""
    import re
    import subprocess

    from tests.ray_cluster import ray_start_cluster

    rows = []
    with ray_start_cluster(num_cpus=max(os.cpu_count() or 1, 8)) as (address, env):
        env.pop("DATAFLOW_KEEP_PROCESSES", None)
        for i in range(args.runs):
            for side in ("off", "first", "kept"):
                cmd = [sys.executable, "-m", "dataflow.run", args.graph, "--address", address,
                       "--out", f"{args.out}/cli-{side}{i}-{time.time_ns()}",
                       *(["--keep-processes"] if side != "off" else []),
                       *[a for kv in args.overrides for a in ("--set", kv)]]
                t0 = time.perf_counter()
                r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
                wall = time.perf_counter() - t0
                line = next((x for x in r.stdout.splitlines() if " running: " in x), "")
                numbers = re.search(r"start-up ([\d.]+) s \(actor processes ([\d.]+) s, node setup ([\d.]+) s", line)
                total, actors, setup = map(float, numbers.groups()) if numbers else (0.0, 0.0, 0.0)
                kept = [x for x in r.stdout.splitlines() if x.startswith("[dataflow]") and any(
                    w in x for w in ("not kept", "kept for the next run", "the previous run's"))]
                rows.append({"side": side, "run": i, "wall_s": round(wall, 2), "status": r.returncode,
                             "startup": {"total": total, "actors": actors, "setup": setup}, "kept": kept})
                print(f"{side:5} run {i}: {wall:6.2f} s, start-up {total:5.2f} s (actors {actors:.2f}, "
                      f"setup {setup:.2f}), exit {r.returncode}", flush=True)
                for line in kept:   # what was taken and kept, and why a process was not
                    print(f"      {line}", flush=True)
                if r.returncode:
                    print(r.stderr[-1500:], flush=True)
    return rows


def summarize(rows: list[dict], args) -> None:
    print("\nmedian (range) over the rounds:")
    for side in ("off", "first", "kept"):
        runs = [r for r in rows if r["side"] == side]
        for key, get in (("wall s", lambda r: r["wall_s"]), ("start-up s", lambda r: r["startup"].get("total", 0))):
            values = [get(r) for r in runs]
            print(f"  {side:5} {key:10} {statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
