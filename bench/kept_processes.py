"""Several graph runs from one script, with and without RunOptions.keep_processes (dataflow/driver/warm.py).

    python bench/kept_processes.py --graph graphs/ppo.py --runs 4 --set max_steps=2

One Ray for the whole benchmark; the runs alternate between the two sides in pairs (off, on, off,
on, ...), so a machine getting busier does not favour one. Each run prints its wall seconds
(run_graph's call), its start-up (Ray up -> every node set up) and its parts; the first `on` run
starts its processes (nothing is kept yet), the later ones take the previous `on` run's. An `off`
run ends what the previous `on` run kept before it places anything (warm.take), so each `off` run
starts every process, as a run without the option does."""

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", default="graphs/ppo.py")
    parser.add_argument("--runs", type=int, default=4, help="runs per side")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--out", default="/tmp/kept_processes")
    parser.add_argument("--json", help="write the raw numbers here")
    args = parser.parse_args()

    import ray

    from dataflow.driver import warm
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    rows = []
    for i in range(args.runs):
        for keep in (False, True):
            graph, config = load_graph(str(ROOT / args.graph), args.overrides)
            out = f"{args.out}/{'on' if keep else 'off'}{i}"
            t0 = time.perf_counter()
            summary = asyncio.run(run_graph(graph, RunOptions(out_dir=out, quiet=True, keep_processes=keep), config))
            wall = time.perf_counter() - t0
            row = {"keep": keep, "run": i, "wall_s": round(wall, 2), "status": summary.status, "steps": summary.steps,
                   "startup": summary.startup, "kept_after": warm.kept_processes()}
            rows.append(row)
            print(f"{'on ' if keep else 'off'} run {i}: {wall:6.2f} s, start-up {summary.startup.get('total', 0):5.2f} s "
                  f"(actors {summary.startup.get('actors', 0):.2f}, setup {summary.startup.get('setup', 0):.2f}), "
                  f"{summary.steps} steps, {summary.status}", flush=True)
    warm.release_all()
    ray.shutdown()
    print("\nmedian (range) over the runs after the first of each side:")
    for keep in (False, True):
        later = [r for r in rows if r["keep"] == keep and r["run"] > 0]
        for key, get in (("wall s", lambda r: r["wall_s"]), ("start-up s", lambda r: r["startup"].get("total", 0))):
            values = [get(r) for r in later]
            print(f"  keep_processes={keep!s:5} {key:10} {statistics.median(values):6.2f} "
                  f"({min(values):.2f}-{max(values):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
