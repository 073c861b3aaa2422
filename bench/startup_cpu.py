"""Time to the first step, before and after, in pairs run back to back (issue 38, item 1).

    python bench/startup_cpu.py --before /tmp/base --after . --rounds 3 --model /tmp/real/smollm2

`--before` / `--after` are two checkouts of the project (e.g. `git archive main | tar -x -C
/tmp/base`). Each round runs, for each checkout in turn (the order alternates between rounds, so a
machine getting busier does not favour one side):
  - `prompts`: a fresh Python process doing what the prompt source's set-up does with a model
    directory: import nodes.prompts, load the policy's tokenizer, render and tokenize a chat;
  - `reward`: a fresh process doing the reward node's set-up with a reward file and the model's
    tokenizer: import nodes.reward, load the tokenizer, decode;
  - `demo`: the CPU demo, `python -m dataflow.run graphs/ppo.py --set max_steps=2`: seconds from
    the command to its "running" line (start-up) and to its first step line;
  - `tiny` (with --tiny N, in the first N rounds): `bench/real_rl.py --tiny` on SmolLM2 (or
    `bench/real_rl.py` + --real-args on a GPU): seconds from the command to the first step line,
    and the run's start-up parts. With --cache-pair it runs twice per side and round, each pair
    with fresh compile caches (XDG_CACHE_HOME, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR in a new
    temporary directory): `tiny` cold, then `tiny_warm`.

On one H200 (issue 38's goal: SmolLM2 GRPO's first step within 10 s warm, 20 s cold):
    python bench/startup_cpu.py --before /tmp/base --after . --model /tmp/real/smollm2 --rounds 2 \
        --tiny 2 --skip-demo --cache-pair --real-args="--steps 3 --eval-every 3 --val-n 8"
It prints one table (median and range per side) and the raw numbers as JSON (--json).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

PROMPTS = """
import sys, time
t = time.perf_counter()
import nodes.prompts
try:
    from rl.data import policy
except ImportError:      # a checkout before rl/ was split by role
    from rl import policy
tok = policy.load_tokenizer(policy.PolicySpec(path=sys.argv[1]))
text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True)
ids = tok([text], add_special_tokens=False)["input_ids"]
print("SECONDS", time.perf_counter() - t, "transformers" in sys.modules, "torch" in sys.modules)
"""

REWARD = """
import sys, time
t = time.perf_counter()
import nodes.reward
try:
    from rl.data import tasks
except ImportError:      # a checkout before rl/ was split by role
    from rl import tasks
try:
    from rl.data import fast_tokenizer
    tok = fast_tokenizer.load(sys.argv[1])
except ImportError:      # the checkout before: what its reward node loads
    tok = tasks.load_tokenizer(sys.argv[1])
tok.decode([1, 2, 3, 4], skip_special_tokens=True)
print("SECONDS", time.perf_counter() - t, "transformers" in sys.modules, "torch" in sys.modules)
"""


def _env(tree: str, extra: dict | None = None) -> dict:
    return dict(os.environ, PYTHONPATH=tree, RAY_DEDUP_LOGS="0", **(extra or {}))


def snippet(tree: str, code: str, model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, model], cwd=tree, env=_env(tree), capture_output=True,
                         text=True, check=True).stdout
    seconds, transformers, torch = out.split("SECONDS")[1].split()
    return {"s": float(seconds), "transformers": transformers == "True", "torch": torch == "True"}


def timed_run(tree: str, argv: list[str], env: dict | None = None, timeout: float = 900) -> dict:
    """Seconds from the command to its 'running' line and its first step line, the start-up line
    itself and (bench/real_rl.py) its start-up parts, printed after the run: the command is then
    stopped (SIGTERM; Ray is down by then), its held-out evaluation is not what is measured."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=tree, env=_env(tree, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    found = {"lines": []}
    for line in proc.stdout:
        now = time.perf_counter() - t0
        if "running:" in line and "start-up" in line and "running_s" not in found:
            found["running_s"] = round(now, 2)
            found["startup_line"] = line.strip()
        if re.match(r"\s*step\s+1\b", line) and "first_step_s" not in found:
            found["first_step_s"] = round(now, 2)
        if "start-up parts, s: " in line:
            found["parts"] = ast.literal_eval(line.split("start-up parts, s: ", 1)[1].strip())
            proc.terminate()
        found["lines"] = (found["lines"] + [line.rstrip()])[-30:]
    proc.wait(timeout)
    found["rc"] = proc.returncode
    if "first_step_s" not in found:
        sys.stderr.write("\n".join(found["lines"]) + "\n")
    del found["lines"]
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", required=True, help="a converted SmolLM2 directory (examples/smollm2_arithmetic/smollm2.py)")
    p.add_argument("--work", default="/tmp/real", help="bench/real_rl.py's --work (its data)")
    p.add_argument("--tiny", type=int, default=0, metavar="ROUNDS",
                   help="also bench/real_rl.py --tiny in the first ROUNDS rounds (minutes per run)")
    p.add_argument("--real-args", default="--tiny", help="bench/real_rl.py's arguments besides --model/--work/--out")
    p.add_argument("--cache-pair", action="store_true", help="real_rl twice per side and round: cold, then warm caches")
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--json", default="", help="write the raw numbers here")
    args = p.parse_args()
    sides = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    results: dict = {side: {} for side in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for side in order:
            tree = sides[side]
            res = results[side]
            res.setdefault("prompts", []).append(snippet(tree, PROMPTS, args.model))
            res.setdefault("reward", []).append(snippet(tree, REWARD, args.model))
            if not args.skip_demo:
                with tempfile.TemporaryDirectory() as out:
                    res.setdefault("demo", []).append(timed_run(tree, [
                        sys.executable, "-m", "dataflow.run", "graphs/ppo.py", "--set", "max_steps=2", "--out", out]))
            if r < args.tiny:
                with tempfile.TemporaryDirectory() as cache:
                    env = {"XDG_CACHE_HOME": cache, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
                           "TRITON_CACHE_DIR": os.path.join(cache, "triton")} if args.cache_pair else {}
                    for key in ("tiny", "tiny_warm") if args.cache_pair else ("tiny",):
                        with tempfile.TemporaryDirectory() as out:
                            res.setdefault(key, []).append(timed_run(tree, [
                                sys.executable, "bench/real_rl.py", *args.real_args.split(), "--model", args.model,
                                "--work", args.work, "--out", out], env))
            print(f"round {r + 1} {side}: " + json.dumps({k: v[-1] for k, v in res.items()}), flush=True)
    rows = [("prompts set-up (s)", "prompts", "s"), ("reward set-up (s)", "reward", "s"),
            ("demo: command -> running (s)", "demo", "running_s"), ("demo: command -> step 1 (s)", "demo", "first_step_s"),
            ("tiny: command -> running (s)", "tiny", "running_s"), ("tiny: command -> step 1 (s)", "tiny", "first_step_s"),
            ("tiny, warm caches: command -> step 1 (s)", "tiny_warm", "first_step_s")]
    parts = sorted({k for side in sides for x in results[side].get("tiny", []) for k in x.get("parts", {})})
    rows += [(f"tiny: {k} (s)", "tiny", ("parts", k)) for k in parts]
    print(f"\n| measure | before median (min-max) | after median (min-max) | n |\n|---|---|---|---|")
    for label, key, field in rows:
        cells = []
        for side in sides:
            vals = [x.get(field[0], {}).get(field[1]) if isinstance(field, tuple) else x.get(field)
                    for x in results[side].get(key, [])]
            vals = [v for v in vals if v is not None]
            cells.append(f"{statistics.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f})" if vals else "-")
        n = min(len(results[side].get(key, [])) for side in sides)
        if n:
            print(f"| {label} | {cells[0]} | {cells[1]} | {n} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
