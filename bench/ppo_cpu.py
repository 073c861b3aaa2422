"""Synchronous vs asynchronous PPO on the built-in task, side by side in one invocation (CPU).

    python bench/ppo_cpu.py [--graph graphs/ppo.py] [--target 0.8] [--max-steps 300] [--set k=v ...]

Runs the same graph twice on one Ray instance: max_staleness=0 (synchronous on-policy, the
baseline) and max_staleness=N (asynchronous). Prints, for each, the wall time until the step mean
reward first reaches --target, steps, samples/s over the run, and the ratios async / sync.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def run_once(graph_file: str, overrides: list[str], max_steps: int, out_dir: str) -> dict:
    from dataflow.runtime import RunOptions, load_graph, run_graph

    graph, config = load_graph(graph_file, overrides)
    t0 = time.time()
    summary = asyncio.run(run_graph(graph, RunOptions(max_steps=max_steps, out_dir=out_dir, quiet=True), config))
    records = [json.loads(l) for l in Path(summary.metrics_path).read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    return {"wall_s": time.time() - t0, "steps": steps}


def summarize(name: str, result: dict, target: float) -> dict:
    steps = result["steps"]
    reached = next((r for r in steps if r["reward/mean"] >= target), None)
    samples = sum(r["perf/samples_per_s"] * r["timing/step_s"] for r in steps)
    train_s = steps[-1]["time_s"] - steps[0]["time_s"] + steps[0]["timing/step_s"] if steps else float("nan")
    return {"mode": name, "steps": len(steps), "final_reward": steps[-1]["reward/mean"] if steps else float("nan"),
            "time_to_target_s": reached["time_s"] if reached else float("nan"),
            "step_to_target": reached["step"] if reached else None,
            "samples_per_s": samples / train_s if steps else float("nan"), "wall_s": result["wall_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", default=str(ROOT / "graphs/ppo.py"))
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--async-staleness", type=int, default=1)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()

    import ray

    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(4, os.cpu_count() or 1),
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, staleness in (("sync", 0), ("async", args.async_staleness)):
            overrides = args.overrides + [f"max_staleness={staleness}", f"target_reward={args.target}"]
            result = run_once(args.graph, overrides, args.max_steps, f"{tmp}/{name}")
            rows.append(summarize(f"{name} (max_staleness={staleness})", result, args.target))
    ray.shutdown()
    print(f"\n{Path(args.graph).name} to reward {args.target} (time from the graph running; start-up excluded)")
    print(f"| mode | steps | final reward | time to {args.target} (s) | samples/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['steps']} | {r['final_reward']:.3f} | {r['time_to_target_s']:.1f} | {r['samples_per_s']:.0f} |")
    s, a = rows
    print(f"\nasync / sync: samples/s x{a['samples_per_s'] / s['samples_per_s']:.2f}, "
          f"time to target x{a['time_to_target_s'] / s['time_to_target_s']:.2f} (lower is better)")


if __name__ == "__main__":
    main()
