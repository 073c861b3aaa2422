"""How long the learner waits per checkpoint, with and without async_checkpoint (CPU).

    python bench/checkpoint_blocking.py [--graph graphs/grpo.py] [--max-steps 20] [--save-interval 5] [--set k=v ...]

Runs the graph twice on one Ray instance, async_checkpoint=false then true, with the same
settings, and prints per run: the learner's time blocked in ctx.checkpoint for each checkpoint
(`timing/checkpoint_blocked_s`, from the request to the driver's answer: the synchronous save's
files written, fsynced and committed, or the asynchronous one's state copied to CPU memory), the
size of a checkpoint on disk, the median step time and the run's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def one_run(graph_file: str, overrides: list[str], max_steps: int, out: Path) -> dict:
    from dataflow.actor import checkpoint
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph

    graph, config = load_graph(graph_file, overrides)
    t = time.perf_counter()
    asyncio.run(run_graph(graph, RunOptions(max_steps=max_steps, out_dir=str(out), quiet=True), config))
    wall = time.perf_counter() - t
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = checkpoint.latest(out)
    return {"blocked_s": [r["timing/checkpoint_blocked_s"] for r in records if "timing/checkpoint_blocked_s" in r],
            "step_s": statistics.median(r["timing/step_s"] for r in records if "timing/step_s" in r),
            "wall_s": wall, "checkpoint_mb": sum(p.stat().st_size for p in last.rglob("*") if p.is_file()) / 2**20}


def main() -> None:
    import ray

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", default="graphs/grpo.py")
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--save-interval", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args()
    ray.init(num_cpus=4, include_dashboard=False,  # logical CPUs: the graph fits on a 2-core machine
             log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}})
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("false", "true"):
            overrides = args.overrides + [f"save_interval={args.save_interval}", f"async_checkpoint={mode}"]
            r = one_run(str(ROOT / args.graph), overrides, args.max_steps, Path(tmp) / mode)
            blocked = ", ".join(f"{b:.3f}" for b in r["blocked_s"])
            print(f"async_checkpoint={mode:5}  blocked per checkpoint (s): {blocked}  (median "
                  f"{statistics.median(r['blocked_s']):.3f})  checkpoint {r['checkpoint_mb']:.0f} MB  "
                  f"step {r['step_s']:.2f} s (median)  run {r['wall_s']:.0f} s", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
