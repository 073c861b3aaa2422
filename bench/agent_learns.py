"""A tiny model learns a 3-turn environment on CPU: graphs/agent.py with tests/agent_toy_env.py's
CopyDigits (each turn the environment asks for a digit, "copy 4"; a turn answered with it earns 1/3)
on the tiny random chat model of tests/chat_model.py. Prints the mean episode reward of the first and
the last `window` steps, and the wall time.

    PYTHONPATH=. python bench/agent_learns.py [--steps 80] [--lr 5e-3] [--window 5] [--set KEY=VALUE ...] [--json F]

`--set` adds graph settings (e.g. generator.partial_rollout=true, seed=1); `--json` writes the
per-step mean rewards and the wall time, for side-by-side runs.

A benchmark, not a test: the run takes minutes on a loaded 2-core machine (tests/integration/test_agent_graph.py
keeps to seconds-long runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more graph settings")
    ap.add_argument("--json", default="", help="write the per-step rewards and the wall time here")
    args = ap.parse_args()

    import sys
    sys.path.insert(0, str(ROOT))
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph
    from tests.chat_model import make_chat_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="agent_learns_"))
    make_chat_model_dir(tmp / "model", always_emit=None)
    rng = random.Random(0)
    with open(tmp / "train.jsonl", "w") as f:
        for _ in range(256):
            t = "".join(rng.choice("0123456789") for _ in range(3))
            f.write(json.dumps({"prompt": f"copy {t[0]}", "target": t}) + "\n")
    graph, config = load_graph(str(ROOT / "graphs/agent.py"), [
        f"env.path={ROOT / 'tests/agent_toy_env.py'}", "env.name=CopyDigits", f"policy.path={tmp / 'model'}",
        f"prompts.path={tmp / 'train.jsonl'}", "max_new_tokens=2", f"prompts_per_step={args.prompts_per_step}",
        f"group_size={args.group_size}", f"learner.minibatch_size={args.prompts_per_step * args.group_size}",
        f"learner.lr={args.lr}", "learner.kl.coef=0", "max_staleness=1", *args.set])
    t0 = time.perf_counter()
    summary = asyncio.run(run_graph(graph, RunOptions(max_steps=args.steps, out_dir=str(tmp / "run"), quiet=True),
                                    config))
    wall = time.perf_counter() - t0
    steps = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    rewards = [r["reward/mean"] for r in steps if "step" in r]
    w = args.window
    print(f"agent_learns: CopyDigits, 3 turns, tiny chat model, {len(rewards)} steps of "
          f"{args.prompts_per_step} x {args.group_size} episodes, lr {args.lr}")
    print(f"  mean episode reward, first {w} steps: {sum(rewards[:w]) / w:.3f}   last {w} steps: "
          f"{sum(rewards[-w:]) / w:.3f}   (1.0 = every turn right; a random answer ~0.04)")
    print(f"  wall {wall:.0f} s (start-up included); run dir {tmp / 'run'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"sets": args.set, "rewards": rewards, "wall_s": wall,
                                               "step_s": [r.get("timing/step_s") for r in steps if "step" in r]}))


if __name__ == "__main__":
    main()
