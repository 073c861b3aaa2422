"""Chaos run (not in CI): a CPU run that kills a node every `--every` seconds.

    python bench/chaos.py [--graph ppo|agent] [--minutes 10] [--every 60] [--seed 0] [--out runs/chaos]

1. The chaos run: `python -m dataflow.run graphs/<graph>.py` as a subprocess, recording the prompt
   ids each step trained on; once it is running, every `--every` s one replica is sent SIGKILL
   (pids from <run>/processes.json). Victims go round the graph's node kinds in a seeded random
   order, reshuffled every round, so each kind is killed once per round (a random replica of a kind
   with several); a purely random draw can miss a kind for a whole run. After `--minutes` the run
   gets SIGTERM.
   --graph ppo: graphs/ppo.py with its defaults; kinds prompts, generator, reward, reference, critic
   (each restarted in place).
   --graph agent: graphs/agent.py on the tiny chat model (tests/chat_model.py) and a slow 3-turn
   environment (tests/agent_toy_env.py FailsOnSecondTurn: each step sleeps --env-delay s; the episodes
   of every 4th prompt fail in their second turn); kinds prompts, generator, reward, learner. A killed
   learner stops the run, which is then continued with `--resume <run>` (its recorded settings, no
   --set), as a user would; the clock waits until the resumed run trains again.
2. A clean run of the same settings for as many steps as the chaos run finished (--no-clean: none).
Reports: kills (per kind), restarts (the runs' "restarting it" lines), resumes, samples lost (prompts
of the finished steps never trained on) and duplicated (trained on twice), both must be 0, and the
mean reward of the last 10 steps of each run. Agent: also each step's failed episodes against the
failing prompts it trained (group_size each), and the largest staleness against max_staleness.
Exit status 1 if a sample was lost or duplicated or an agent check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ["--set", "learner.record_prompt_ids=true", "--set", "max_restarts=1000", "--set", "save_interval=20"]
KINDS = {"ppo": ("prompts", "generator", "reward", "reference", "critic"),
         "agent": ("prompts", "generator", "reward", "learner")}
# The agent run: the smallest settings of tests/integration/test_agent_graph.py, with checkpoints often
# enough that a learner kill costs few steps.
AGENT = ["max_new_tokens=4", "group_size=2", "prompts_per_step=4", "learner.minibatch_size=8", "learner.kl.coef=0",
         "channel_capacity=16", "reward.items_per_call=2", "max_staleness=2", "env.name=FailsOnSecondTurn",
         "save_interval=5", "learner.record_prompt_ids=true", "max_restarts=1000"]
AGENT_ROWS = 256
RESTARTING = "its process died; restarting it"


def agent_settings(out: Path, env_delay: float) -> list[str]:
    """AGENT plus the model, data and environment it reads, made under `out` (no download)."""
    sys.path.insert(0, str(ROOT))
    from tests.chat_model import make_chat_model_dir

    if not (out / "model" / "config.json").exists():
        make_chat_model_dir(out / "model", always_emit=None)
    rows = [{"prompt": f"copy {i % 10}", "target": f"{i % 10}{(i + 3) % 10}{(i + 7) % 10}", "fail": int(i % 4 == 0)}
            for i in range(AGENT_ROWS)]
    (out / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = [f"policy.path={out / 'model'}", f"prompts.path={out / 'data.jsonl'}",
             f"env.path={ROOT / 'tests/agent_toy_env.py'}", f'env.kwargs={{"delay_s": {env_delay}}}']
    return [a for s in AGENT + extra for a in ("--set", s)]


def start(out: Path, graph: str, *args: str) -> subprocess.Popen:
    """The CLI on `graph` writing to `out`; its output appended to out.log (one log for every resume)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    log = open(out.with_suffix(".log"), "a")
    log.write(f"\n===== {' '.join(args)}\n")
    log.flush()
    return subprocess.Popen([sys.executable, "-m", "dataflow.run", f"graphs/{graph}.py", "--out", str(out), *args],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def records(out: Path) -> list[dict]:
    """metrics.jsonl's complete lines (the run may be writing the last one as we read)."""
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def steps(out: Path) -> list[dict]:
    return [r for r in records(out) if "step" in r]


def victims(kinds: tuple[str, ...], rng: random.Random):
    """Node kinds to kill, forever: every round is all of `kinds` in a fresh seeded order."""
    while True:
        yield from rng.sample(kinds, len(kinds))


def _log_since(out: Path, offset: int) -> str:
    return out.with_suffix(".log").read_text()[offset:]


def _wait_training(proc: subprocess.Popen, out: Path, offset: int, resumed: bool, timeout_s: float = 600) -> None:
    """Until the run started at log `offset` has trained a step of its own (a resumed run: one
    after the step it resumed at) and written its processes.json."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the chaos run ended early (exit {proc.returncode}); see {out.with_suffix('.log')}")
        if time.monotonic() > deadline:
            raise SystemExit(f"the chaos run trained no step within {timeout_s:.0f} s; see {out.with_suffix('.log')}")
        found = re.search(r"resumed from \S+ at step (\d+)", _log_since(out, offset))
        at = int(found.group(1)) if found else 0
        if (found or not resumed) and (out / "processes.json").exists() and any(r["step"] > at for r in steps(out)):
            return
        time.sleep(0.5)


def chaos(out: Path, graph: str, settings: list[str], minutes: float, every: float,
          rng: random.Random) -> tuple[list[tuple[float, str]], list[int], float]:
    """(kills as (seconds, replica), steps trained again after each resume, wall seconds)."""
    t_start = time.monotonic()
    proc = start(out, graph, *settings, "--max-steps", "100000")
    kills, kinds, redone = [], victims(KINDS[graph], rng), []
    try:
        _wait_training(proc, out, 0, resumed=False)
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
                    killed = True
                except ProcessLookupError:
                    print(f"[chaos] {victim} (pid {pids[victim]}) was already gone", flush=True)
                    killed = False
                if kind == "learner" and killed:
                    proc, again = _resume(proc, out, graph)
                    redone.append(again)
                    next_kill = time.monotonic()  # the clock restarts once the resumed run trains
                next_kill += every
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    return kills, redone, time.monotonic() - t_start


def _resume(proc: subprocess.Popen, out: Path, graph: str) -> tuple[subprocess.Popen, int]:
    """The learner was killed: the run stops naming its last checkpoint; go on with --resume.
    Returns the new run and how many trained steps it goes back over (those after the checkpoint)."""
    rc = proc.wait(120)
    tail = out.with_suffix(".log").read_text()[-3000:]
    if rc != 1 or "--resume" not in tail:
        raise SystemExit(f"the run did not stop as a dead learner should (exit {rc}); see {out.with_suffix('.log')}")
    offset = len(out.with_suffix(".log").read_text())
    last = max((r["step"] for r in steps(out)), default=0)
    (out / "processes.json").unlink(missing_ok=True)   # the resumed run writes its own
    proc = start(out, graph, "--resume", str(out), "--max-steps", "100000")
    _wait_training(proc, out, offset, resumed=True)
    at = int(re.search(r"resumed from \S+ at step (\d+)", _log_since(out, offset)).group(1))
    print(f"[chaos] resumed at step {at}; the killed run had trained {last}", flush=True)
    return proc, last - at


def final_reward(run: list[dict], last: int = 10) -> float:
    return sum(r["reward/mean"] for r in run[-last:]) / min(last, len(run))


def agent_checks(run: list[dict]) -> dict:
    """Failed episodes: each step's samples/failed is group_size x its prompts of a failing row;
    staleness: no step trained a sample older than max_staleness."""
    group = int(next(s for s in AGENT if s.startswith("group_size=")).split("=")[1])
    bound = int(next(s for s in AGENT if s.startswith("max_staleness=")).split("=")[1])
    wrong = [r["step"] for r in run
             if r["samples/failed"] != group * sum(1 for i in r["prompt_ids"] if i % AGENT_ROWS % 4 == 0)]
    worst = max(r["staleness/max"] for r in run)
    return {"failed_episodes": sum(r["samples/failed"] for r in run), "failed_miscounted_steps": wrong,
            "staleness_max": worst, "max_staleness": bound, "ok": not wrong and worst <= bound}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", choices=sorted(KINDS), default="ppo")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every", type=float, default=60.0, help="seconds between kills")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env-delay", type=float, default=0.2, help="agent: seconds each environment step sleeps")
    p.add_argument("--no-clean", action="store_true", help="skip the clean run")
    p.add_argument("--out", default="runs/chaos")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in ("chaos", "clean"):   # a rerun: the CLI refuses an earlier run's directory; its log is appended to
        shutil.rmtree(out / part, ignore_errors=True)
        (out / f"{part}.log").unlink(missing_ok=True)
    settings = SETTINGS if args.graph == "ppo" else agent_settings(out, args.env_delay)

    kills, redone, wall = chaos(out / "chaos", args.graph, settings, args.minutes, args.every, random.Random(args.seed))
    chaos_steps = steps(out / "chaos")
    n = len(chaos_steps)
    trained = [i for r in chaos_steps for i in r["prompt_ids"]]
    per_step = len(chaos_steps[0]["prompt_ids"])
    lost = len(set(range(n * per_step)) - set(trained))
    duplicated = len(trained) - len(set(trained))
    restarts = out.joinpath("chaos.log").read_text().count(RESTARTING)

    clean_steps = []
    if not args.no_clean:
        clean = start(out / "clean", args.graph, *settings, "--max-steps", str(n))
        clean.wait()
        clean_steps = steps(out / "clean")
    per_kind = {k: sum(1 for _, v in kills if v.split("[")[0] == k) for k in KINDS[args.graph]}
    result = {"graph": args.graph, "minutes": args.minutes, "every_s": args.every, "kills": len(kills),
              "kills_per_kind": per_kind, "killed": kills, "restarts": restarts, "resumes": len(redone),
              "steps_trained_again": redone, "steps": n,
              "samples_trained": len(trained), "lost": lost, "duplicated": duplicated,
              "final_reward_chaos": round(final_reward(chaos_steps), 4),
              "final_reward_clean": round(final_reward(clean_steps), 4) if clean_steps else None,
              "clean_steps": len(clean_steps), "chaos_wall_s": round(wall),
              # the last step's run clock (a resumed run's starts again at its start: none then)
              "chaos_seconds": None if redone else chaos_steps[-1]["time_s"],
              "clean_seconds": clean_steps[-1]["time_s"] if clean_steps else None}
    ok = lost == 0 and duplicated == 0
    if args.graph == "agent":
        result["agent"] = agent_checks(chaos_steps)
        ok = ok and result["agent"]["ok"]
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    clean_reward = f"{result['final_reward_clean']:.3f}" if clean_steps else "-"
    print(f"| {args.graph}, {args.minutes:g} min, kill every {args.every:g} s | {len(kills)} | {restarts} | "
          f"{len(redone)} | {n} | {lost} | {duplicated} | {result['final_reward_chaos']:.3f} | {clean_reward} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
