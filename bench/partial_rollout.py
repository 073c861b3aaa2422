"""Partial rollouts against waiting (issue 21 item 4): GRPO async on a long-tailed length workload,
generator.partial_rollout off and on, side by side in one call.

    PYTHONPATH=/tmp/site:$PWD python3 bench/partial_rollout.py --out $OUT/x        # GPU: one H200, W1 model
    PYTHONPATH=$PWD python3 bench/partial_rollout.py --tiny --out /tmp/partial_cpu  # CPU: tiny model

Workload (W1-long): bench/gpu_step.py's W1 workload on disk (a Qwen2.5-0.5B-shaped model built from
its config, random init, bf16; no download), 128-token prompts, and per prompt a response length
drawn from bench/varlen.py's long-tailed distribution (log-normal, median 43 x cap / 512, sigma
1.93, capped at 512: ~10% of prompts hit the cap) written into the prompt's row ("max_new_tokens",
which generator.max_new_tokens_key honours; <eos> suppressed with min_new_tokens = cap, so every
response is exactly its row's length). GRPO, 32 prompts x 8 per step, max_staleness 1 (the
generator decodes batch k+1 while the learner trains on batch k), 256 decoder slots (one batch),
one optimizer step per batch (lr 1e-6), placement=colocated on one GPU (learner share 0.5, token
budget micro-batches of 16384 for the learner and the reference). --tiny: the same on CPU with
bench/gpu_step.py's tiny shape (2 layers x 64, 16-token prompts), 16 prompts x 4, cap 256.

The two variants differ only in generator.partial_rollout. Off (today): when the learner's new
weights are announced while batch k+1's long responses still decode, the generator stops admitting
batch k+2 and the slots drain before the switch. On: it switches between two decode steps, the long
responses go on under the new weights (KV cache kept, each token tagged with its version) and batch
k+2 starts at once in the free slots.

--variants base,packed is issue 21 item 6's before/after on W1-long, in one call: base = today's
defaults (on-policy, 16-row padded micro-batches, waiting for the tail), packed = max_staleness 1,
packed token-budget passes and partial rollouts (VARIANTS). With --tiny the micro-batching is the
CPU default in every variant (a smoke of the flow, not of packing).

Reported per variant, over the steps after --warmup: s/step (wall time between the learner's step
records) and response tokens/s; the generator's busy % and waiting-for-prompts % (the trace's node
states, whole run); drain s/step (generator/drain_s summed over the steady window per step: time the
old weights kept serving with admission stopped) and the mean fraction of decoder slots idle during
those drains; responses with two versions per step and the mean per-token staleness (learner);
the learner's padding; on a GPU, its idle % over the steady window (trace). Writes OUT/results.json and OUT/<variant>/.
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

from gpu_step import SHAPES, build_workload, log, run_logged, steady_stats, trace_idle  # noqa: E402

LONG = {"w1": dict(cap=512, prompts_per_step=32, group=8, budget=16384),
        "tiny": dict(cap=256, prompts_per_step=16, group=4, budget=0)}


def long_tailed_prompts(paths: dict, cap: int, seed: int = 0) -> str:
    """prompts.jsonl with each row's response length ("max_new_tokens") from bench/varlen.py."""
    from varlen import response_lengths

    rows = [json.loads(line) for line in Path(paths["prompts"]).read_text().splitlines() if line.strip()]
    lengths = response_lengths({"response_cap": cap, "prompts": len(rows), "group": 1}, False, seed)
    out = Path(paths["prompts"]).with_name(f"prompts_long{cap}.jsonl")
    out.write_text("".join(json.dumps({**r, "max_new_tokens": n}) + "\n" for r, n in zip(rows, lengths)))
    log(f"lengths: median {statistics.median(lengths):.0f}, mean {statistics.mean(lengths):.1f}, "
        f"{sum(n == cap for n in lengths) / len(lengths):.0%} at the cap {cap}")
    return str(out)


# --variants: name -> (generator.partial_rollout, max_staleness, micro-batching of the learner and
# reference: "rows" = 16-row padded micro-batches, "budget" = token-budget ones (long["budget"]),
# "packed" = token-budget packed passes). off / on are item 4's pair; base / packed are item 6's
# before and after for W1-long: today's defaults (on-policy, row micro-batches, waiting for the
# tail) against async + packing + partial rollouts.
VARIANTS = {"off": (False, 1, "budget"), "on": (True, 1, "budget"),
            "base": (False, 0, "rows"), "packed": (True, 1, "packed")}


def micro_batching(kind: str, budget: int) -> list[str]:
    if kind == "rows":
        return ["learner.micro_batch_size=16", "reference.micro_batch_size=16"]
    sets = [f"learner.max_tokens_per_micro_batch={budget}", f"reference.max_tokens_per_micro_batch={budget}"]
    return sets + (["learner.packing=true", "reference.packing=true"] if kind == "packed" else [])


def variant(args, shape: dict, long: dict, paths: dict, prompts: str, vname: str, out: Path, rep: int = 0) -> dict:
    partial, staleness, batching = VARIANTS[vname]
    name = f"partial_{vname}" + (f"_{rep + 1}" if args.repeats > 1 else "")
    vdir = out / name
    vdir.mkdir(parents=True, exist_ok=True)
    pps, group, cap = long["prompts_per_step"], long["group"], long["cap"]
    sets = [f"policy.path={paths['model']}", f"prompts.path={prompts}", f"reward.path={paths['reward']}",
            f"max_new_tokens={cap}", f"generator.min_new_tokens={cap}", "generator.max_new_tokens_key=max_new_tokens",
            f"generator.max_prompt_tokens={shape['prompt_len']}", f"generator.prompts_per_call={pps}",
            f"generator.partial_rollout={str(partial).lower()}", f"max_staleness={staleness}",
            f"prompts_per_step={pps}", f"group_size={group}", f"learner.minibatch_size={pps * group}",
            "learner.ppo_epochs=1", "learner.lr=1e-6", "learner.kl.coef=0.01", "learner.save_final=false"]
    if args.tiny:
        sets += ["placement=cpu"]
    else:
        sets += ["placement=colocated", "num_gpus=1", 'gpu_shares={"learner":0.5}',
                 *micro_batching(batching, long["budget"])]
    trace = vdir / "trace.json.gz"
    shutil.rmtree(vdir / "run", ignore_errors=True)   # a rerun: the CLI refuses an earlier run's directory
    cmd = [sys.executable, "-m", "dataflow.run", str(ROOT / "graphs/grpo.py"), "--max-steps", str(args.steps),
           "--trace", str(trace), "--out", str(vdir / "run")]
    for s in sets + args.set:
        cmd += ["--set", s]
    log(f"{name}: start")
    t = time.time()
    rc = run_logged(cmd, vdir / "run.log", args.timeout, name)
    row = {"variant": name, "partial_rollout": partial, "rc": rc, "wall_s": time.time() - t}
    metrics = vdir / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    row.update(steady_stats(records, args.warmup, pps * group))
    if "window_s" in row:
        t0, t1 = row["window_s"]
        steady = [r for r in records if "step" in r and str(r.get("node", "")).startswith("learner")][args.warmup:]
        drains = [r for r in records if "generator/drain_s" in r and t0 < r["time_s"] <= t1]
        row["drain_s_per_step"] = sum(r["generator/drain_s"] for r in drains) / len(steady)
        total = sum(r["generator/drain_s"] for r in drains)
        row["drain_free_slots"] = (sum(r["generator/drain_s"] * r["generator/drain_free_slots"] for r in drains) / total
                                   if total else 0.0)
        row["mixed_per_step"] = statistics.mean(r.get("samples/mixed_versions", 0) for r in steady)
        row["token_staleness"] = statistics.mean(r.get("staleness/token_mean", r["staleness/mean"]) for r in steady)
        row["learner_padding"] = statistics.mean(r.get("learner/padding_frac", 0.0) for r in steady)
    if trace.exists():
        try:
            from dataflow.trace.chrome import load_trace
            from dataflow.trace.report import summarize

            nodes = summarize(load_trace(str(trace))[0])["nodes"]
            gen = next(v for k, v in nodes.items() if k.startswith("generator"))
            row["generator_busy"], row["generator_wait_prompts"] = gen["busy"], gen["wait_input"]
            if not args.tiny:
                row.update(trace_idle(trace, args.warmup))
        except Exception as e:  # the metrics above stand without the trace
            row["trace_error"] = f"{type(e).__name__}: {e}"
    if rc != 0:
        row["log_tail"] = (vdir / "run.log").read_text()[-1500:]
    log(f"{name}: rc {rc} in {row['wall_s']:.0f} s; s/step {row.get('s_per_step', float('nan')):.2f}")
    return row


def table(rows: list[dict]) -> str:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    lines = [f"{'variant':<14} {'s/step':>7} {'tok/s':>8} {'gen busy':>8} {'gen wait':>8} {'drain s/step':>12} "
             f"{'idle slots':>10} {'mixed/step':>10} {'tok stale':>9} {'padding':>8} {'GPU idle':>8}"]
    for r in rows:
        gpu = r.get("idle_steady") or r.get("idle") or {}
        lines.append(f"{r['variant']:<14} {f(r.get('s_per_step'), '7.3f')} {f(r.get('response_tokens_per_s'), '8.0f')} "
                     f"{f(r.get('generator_busy'), '8.1%')} {f(r.get('generator_wait_prompts'), '8.1%')} "
                     f"{f(r.get('drain_s_per_step'), '12.3f')} {f(r.get('drain_free_slots'), '10.1%')} "
                     f"{f(r.get('mixed_per_step'), '10.1f')} {f(r.get('token_staleness'), '9.3f')} "
                     f"{f(r.get('learner_padding'), '8.1%')} "
                     f"{f(max(gpu.values()) if gpu else None, '8.1%')}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU: the tiny model (bench/gpu_step.py's tiny shape)")
    ap.add_argument("--steps", type=int, default=0, help="learner steps per variant (default 10 GPU, 12 tiny)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=0, help="per variant, s (default 270 GPU, 400 tiny)")
    ap.add_argument("--variants", default="off,on", help=f"of {','.join(VARIANTS)} (VARIANTS says what each is)")
    ap.add_argument("--repeats", type=int, default=1, help="run the variants this many times, interleaved")
    ap.add_argument("--cap", type=int, default=0, help="longest response (default 512 GPU, 256 tiny)")
    ap.add_argument("--prompts-per-step", type=int, default=0, help="default 32 GPU, 16 tiny")
    ap.add_argument("--group", type=int, default=0, help="default 8 GPU, 4 tiny")
    ap.add_argument("--set", action="append", default=[], help="extra --set for both variants")
    args = ap.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {','.join(VARIANTS)}")
    args.steps = args.steps or (12 if args.tiny else 10)
    args.timeout = args.timeout or (400 if args.tiny else 270)
    kind = "tiny" if args.tiny else "w1"
    shape, long = SHAPES[kind], dict(LONG[kind])
    long.update({k: v for k, v in (("cap", args.cap), ("prompts_per_step", args.prompts_per_step),
                                   ("group", args.group)) if v})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = build_workload(out / "workload", shape, long["prompts_per_step"] * (args.steps + 4))
    prompts = long_tailed_prompts(paths, long["cap"])
    rows = []
    for rep in range(args.repeats):
        for v in args.variants.split(","):
            rows.append(variant(args, shape, long, paths, prompts, v, out, rep))
            (out / "results.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "command": sys.argv,
                                                          "workload": {**shape, **long}, "rows": rows}, indent=1))
    print(table(rows), flush=True)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
