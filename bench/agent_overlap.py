"""Environment latency against step time (issue 36, item 7): graphs/agent.py with an environment
whose step takes 0, 0.2 and 1 s, side by side in one call.

    PYTHONPATH=/tmp/site:$PWD python3 bench/agent_overlap.py --model /tmp/real/smollm2 --out $OUT/overlap   # one H200
    PYTHONPATH=$PWD python bench/agent_overlap.py --tiny --out /tmp/overlap_cpu                           # CPU smoke

Workload: bench/latency_env.py (every step sleeps --latencies s in the generator's env thread
pool; 3 model turns per episode), 32 prompts x group 8 = 256 concurrent episodes per step (the
decoder holds them all: generator.prompts_per_call = prompts per step), --turn-tokens sampled
tokens per turn (min = max, so every turn has the same length whatever the model), max_staleness
1, placement colocated on one GPU. --tiny: tests/chat_model.py's tiny chat model on CPU, 4 prompts
x group 2, 3 steps: a smoke of the flow, not a measurement. env.threads = episodes per step, so a
sleeping step never waits for a thread.

Per latency, over the steps after --warmup: s/step and its ratio to the 0 s run (goal: 1 s of
latency costs under 20% of step time); the GPU's idle fraction (trace, GPU only) and the
generator's time waiting on the environment (trace report); env seconds per episode and turns per
episode (learner metrics); and prefill tokens per turn when the generator reports them (metrics
whose name holds "prefill" or "extend"), beside the episode's length (response_length: sampled +
environment tokens): prefilled tokens per turn near the observation's few tokens, not the
history's hundreds, show the history is not prefilled again.
Writes OUT/results.json, OUT/table.md and OUT/latency_<s>/ (log, metrics, trace).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_step import log, run_logged, steady_stats, trace_idle  # noqa: E402

FULL = dict(prompts=32, group=8, steps=8, warmup=2, turn_tokens=64)
TINY = dict(prompts=4, group=2, steps=3, warmup=1, turn_tokens=8)


def workload(out: Path, args) -> tuple[str, str]:
    """(model dir, prompts file): the tiny chat model built here with --tiny, else --model."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(max(args.prompts * (args.steps + 2), 64)):
            target = f"{i % 10}{(i * 7) % 10}{(i * 3) % 10}"
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"copy {target[0]}"}], "target": target}) + "\n")
    if not args.tiny:
        return args.model, str(prompts)
    from tests.chat_model import make_chat_model_dir
    model = out / "tiny_model"
    if not (model / "config.json").exists():
        make_chat_model_dir(str(model), always_emit=None)
    return str(model), str(prompts)


def prefill_stats(records: list[dict], warmup: int) -> dict:
    """Generator metrics about prefilled tokens (names holding "prefill" or "extend"), summed over
    the steady steps; empty when the generator reports none."""
    keys = sorted({k for r in records for k in r if ("prefill" in k or "extend" in k) and isinstance(r[k], (int, float))})
    steady_from = [r["time_s"] for r in records if "step" in r and str(r.get("node", "")).startswith("learner")]
    t0 = steady_from[warmup - 1] if warmup and len(steady_from) >= warmup else 0.0
    return {k: sum(r[k] for r in records if k in r and r.get("time_s", 0) > t0) for k in keys}


def variant(args, latency: float, model: str, prompts: str, out: Path) -> dict:
    name = f"latency_{latency:g}s"
    vdir = out / name
    vdir.mkdir(parents=True, exist_ok=True)
    episodes = args.prompts * args.group
    sets = [f"policy.path={model}", f"prompts.path={prompts}", f"prompts_per_step={args.prompts}",
            f"group_size={args.group}", f"learner.minibatch_size={episodes}", "learner.lr=1e-6",
            f"max_new_tokens={args.turn_tokens}", f"generator.min_new_tokens={args.turn_tokens}",
            f"generator.prompts_per_call={args.prompts}", "max_staleness=1", "learner.save_final=false",
            f"env.path={ROOT / 'bench' / 'latency_env.py'}", f'env.kwargs={{"latency_s": {latency}, "turns": {args.turns}}}',
            f"env.max_turns={args.turns}", f"env.max_turn_tokens={args.turn_tokens}", f"env.threads={episodes}",
            f"env.max_episode_tokens={4 * args.turns * args.turn_tokens + 64}"]
    sets += ["placement=cpu"] if args.tiny else ["placement=colocated", "num_gpus=1"]
    trace = vdir / "trace.json.gz"
    shutil.rmtree(vdir / "run", ignore_errors=True)   # a rerun: the CLI refuses an earlier run's directory
    cmd = [sys.executable, "-m", "dataflow.run", str(ROOT / "graphs" / "agent.py"), "--max-steps", str(args.steps),
           "--trace", str(trace), "--out", str(vdir / "run")]
    for s in sets + args.set:
        cmd += ["--set", s]
    log(f"{name}: start")
    t = time.time()
    rc = run_logged(cmd, vdir / "run.log", args.timeout, name)
    row = {"variant": name, "latency_s": latency, "rc": rc, "wall_s": time.time() - t}
    metrics = vdir / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    row.update(steady_stats(records, args.warmup, episodes))
    steady = [r for r in records if "step" in r and str(r.get("node", "")).startswith("learner")][args.warmup:]
    for key in ("env/turns", "env/env_s", "env/failed", "env/trained_tokens"):
        values = [r[key] for r in steady if key in r]
        if values:
            row[key] = statistics.mean(values)
    row["prefill"] = prefill_stats(records, args.warmup)
    if trace.exists():
        try:
            from dataflow.trace.chrome import load_trace
            from dataflow.trace.report import summarize
            summary = summarize(load_trace(str(trace))[0])
            gen = next(v for k, v in summary["nodes"].items() if k.startswith("generator"))
            row["generator_busy"] = gen["busy"]
            row["generator_wait_env"] = gen.get("wait_input_by_channel", {}).get("environment", 0.0)
            if not args.tiny:
                row.update(trace_idle(trace, args.warmup))
        except Exception as e:  # the metrics above stand without the trace
            row["trace_error"] = f"{type(e).__name__}: {e}"
    if rc != 0:
        row["log_tail"] = (vdir / "run.log").read_text()[-1500:]
    log(f"{name}: rc {rc} in {row['wall_s']:.0f} s; s/step {row.get('s_per_step', float('nan')):.2f}")
    return row


def table(rows: list[dict]) -> str:
    base = next((r.get("s_per_step") for r in rows if r["latency_s"] == 0 and r.get("s_per_step")), None)

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = ["| env latency s | rc | s/step | vs 0 s | GPU idle (steady) | generator waiting on env | "
             "env s/episode | turns/episode | prefill metrics (steady, summed) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        idle = r.get("idle_steady") or r.get("idle") or {}
        wait_env = r.get("generator_wait_env")
        ratio = r["s_per_step"] / base if base and r.get("s_per_step") else None
        lines.append(f"| {r['latency_s']:g} | {r['rc']} | {f(r.get('s_per_step'), '.2f')} | {f(ratio, '.2f')} | "
                     f"{f(statistics.mean(idle.values()) if idle else None, '.1%')} | {f(wait_env, '.1%')} | "
                     f"{f(r.get('env/env_s'), '.2f')} | {f(r.get('env/turns'), '.2f')} | "
                     f"{json.dumps(r['prefill']) if r['prefill'] else 'none reported'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="/tmp/real/smollm2", help="instruct model dir (a chat template); not with --tiny")
    p.add_argument("--tiny", action="store_true", help="CPU smoke: " + ", ".join(f"{k}={v}" for k, v in TINY.items()))
    p.add_argument("--latencies", default="0,0.2,1", help="seconds per environment step, comma-separated")
    p.add_argument("--turns", type=int, default=3)
    for k, v in FULL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v} (--tiny: {TINY[k]})")
    p.add_argument("--timeout", type=float, default=900, help="per latency run, s")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more graph settings")
    args = p.parse_args()
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    out = Path(args.out)
    model, prompts = workload(out, args)
    rows = [variant(args, float(x), model, prompts, out) for x in args.latencies.split(",")]
    text = table(rows)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
