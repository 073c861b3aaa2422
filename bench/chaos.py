"""Chaos run (not in CI): a CPU PPO run that kills a random non-learner node every `--every` seconds.

    python bench/chaos.py [--minutes 10] [--every 60] [--seed 0] [--out runs/chaos]

1. The chaos run: `python -m dataflow.run graphs/ppo.py` as a subprocess, recording the prompt
   ids each step trained on; once it is running, every `--every` s one replica other than the
   learner is sent SIGKILL (pids from <run>/processes.json). Victims go round the node kinds
   (prompts, generator, reward, reference, critic) in a seeded random order, reshuffled every
   round, so each kind is killed once in every 5 kills (a random replica of a kind with several);
   a purely random draw can miss a kind for a whole run. After `--minutes` the run gets SIGTERM.
2. A clean run of the same settings for as many steps as the chaos run finished.
Reports: kills (per kind), restarts (from metrics.jsonl), samples lost (prompts of the finished steps never
trained on) and duplicated (trained on twice), both must be 0, and the mean reward of the last
10 steps of each run. Exit status 1 if a sample was lost or duplicated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ["--set", "learner.record_prompt_ids=true", "--set", "max_restarts=1000", "--set", "save_interval=20"]


def start(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    log = open(out.with_suffix(".log"), "w")
    return subprocess.Popen([sys.executable, "-m", "dataflow.run", "graphs/ppo.py", *SETTINGS, "--out", str(out),
                             *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def records(out: Path) -> list[dict]:
    """metrics.jsonl's complete lines (the run may be writing the last one as we read)."""
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def steps(out: Path) -> list[dict]:
    return [r for r in records(out) if "step" in r]


KINDS = ("prompts", "generator", "reward", "reference", "critic")


def victims(rng: random.Random):
    """Node kinds to kill, forever: every round is all of KINDS in a fresh seeded order."""
    while True:
        yield from rng.sample(KINDS, len(KINDS))


def chaos(out: Path, minutes: float, every: float, rng: random.Random) -> list[tuple[float, str]]:
    proc = start(out, "--max-steps", "100000")
    kills, kinds = [], victims(rng)
    try:
        while not (out / "processes.json").exists() or not steps(out):
            if proc.poll() is not None:
                raise SystemExit(f"the chaos run ended early (exit {proc.returncode}); see {out.with_suffix('.log')}")
            time.sleep(0.5)
        t0 = time.monotonic()
        next_kill = t0 + every
        while time.monotonic() - t0 < minutes * 60:
            if proc.poll() is not None:
                raise SystemExit(f"the chaos run ended early (exit {proc.returncode}); see {out.with_suffix('.log')}")
            if time.monotonic() >= next_kill:
                pids = json.loads((out / "processes.json").read_text())
                kind = next(kinds)
                victim = rng.choice(sorted(n for n in pids if n.split("[")[0] == kind))
                try:
                    os.kill(pids[victim], signal.SIGKILL)
                    kills.append((round(time.monotonic() - t0, 1), victim))
                    print(f"[chaos] t={kills[-1][0]:.0f}s killed {victim} (pid {pids[victim]})", flush=True)
                except ProcessLookupError:
                    print(f"[chaos] {victim} (pid {pids[victim]}) was already gone", flush=True)
                next_kill += every
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return kills


def final_reward(run: list[dict], last: int = 10) -> float:
    return sum(r["reward/mean"] for r in run[-last:]) / min(last, len(run))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every", type=float, default=60.0, help="seconds between kills")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/chaos")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    kills = chaos(out / "chaos", args.minutes, args.every, random.Random(args.seed))
    chaos_steps = steps(out / "chaos")
    n = len(chaos_steps)
    trained = [i for r in chaos_steps for i in r["prompt_ids"]]
    per_step = len(chaos_steps[0]["prompt_ids"])
    lost = len(set(range(n * per_step)) - set(trained))
    duplicated = len(trained) - len(set(trained))
    restarts = max((r.get("restarts/total", 0) for r in records(out / "chaos")), default=0)

    clean = start(out / "clean", "--max-steps", str(n))
    clean.wait()
    clean_steps = steps(out / "clean")
    per_kind = {k: sum(1 for _, v in kills if v.split("[")[0] == k) for k in KINDS}
    result = {"minutes": args.minutes, "every_s": args.every, "kills": len(kills), "kills_per_kind": per_kind,
              "killed": kills, "restarts": restarts, "steps": n,
              "samples_trained": len(trained), "lost": lost, "duplicated": duplicated,
              "final_reward_chaos": round(final_reward(chaos_steps), 4),
              "final_reward_clean": round(final_reward(clean_steps), 4), "clean_steps": len(clean_steps),
              "chaos_seconds": chaos_steps[-1]["time_s"], "clean_seconds": clean_steps[-1]["time_s"]}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"| {args.minutes:g} min, kill every {args.every:g} s | {len(kills)} | {restarts} | {n} | {lost} | "
          f"{duplicated} | {result['final_reward_chaos']:.3f} | {result['final_reward_clean']:.3f} |")
    return 0 if lost == 0 and duplicated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
