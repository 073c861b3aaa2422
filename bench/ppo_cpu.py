"""Side-by-side runs of the built-in task in one invocation on one Ray instance (CPU).

    python bench/ppo_cpu.py [--graph graphs/ppo.py] [--target 0.8] [--max-steps 300] [--set k=v ...]
    python bench/ppo_cpu.py --compare algorithms --set prompts.num_digits=3   # PPO vs GRPO

--compare modes (default): the same graph with max_staleness=0 (synchronous on-policy, the
baseline) and max_staleness=N (asynchronous). --compare algorithms: graphs/ppo.py vs
graphs/grpo.py with the same settings and samples per step. Prints, for each run, the wall time
until the step mean reward first reaches --target, steps, samples/s, and the ratio of the two.
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
    p.add_argument("--compare", choices=("modes", "algorithms"), default="modes")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()

    import ray

    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(4, os.cpu_count() or 1),
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    if args.compare == "modes":
        runs = [(f"sync (max_staleness=0)", args.graph, ["max_staleness=0"]),
                (f"async (max_staleness={args.async_staleness})", args.graph, [f"max_staleness={args.async_staleness}"])]
    else:  # the same samples per step: 256 PPO samples = 32 prompts x 8 GRPO responses
        runs = [("ppo", str(ROOT / "graphs/ppo.py"), ["prompts_per_step=256"]),
                ("grpo (8 per prompt)", str(ROOT / "graphs/grpo.py"), ["prompts_per_step=32", "group_size=8"])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, graph_file, extra) in enumerate(runs):
            overrides = args.overrides + extra + [f"target_reward={args.target}"]
            result = run_once(graph_file, overrides, args.max_steps, f"{tmp}/{i}")
            rows.append(summarize(name, result, args.target))
            print(f"{name}: {rows[-1]}", flush=True)
    ray.shutdown()
    print(f"\nto reward {args.target} (time from the graph running; start-up excluded); settings: {args.overrides}")
    print(f"| mode | steps | final reward | time to {args.target} (s) | samples/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['steps']} | {r['final_reward']:.3f} | {r['time_to_target_s']:.1f} | {r['samples_per_s']:.0f} |")
    s, a = rows
    print(f"\n{a['mode']} / {s['mode']}: samples/s x{a['samples_per_s'] / s['samples_per_s']:.2f}, "
          f"time to target x{a['time_to_target_s'] / s['time_to_target_s']:.2f} (lower is better)")


if __name__ == "__main__":
    main()
