"""The learner's update (nodes.impl.learner.ppo_update) on the built-in task, CPU: step time, padding and
peak memory for padded / token-budget / packed micro-batches and gradient checkpointing.

    python3 bench/varlen_cpu.py --digits 2,24 --out /tmp/varlen_cpu.json

Samples: the built-in copy task (rl/data/tasks.py) answered by the untrained built-in policy (rl/models
ModelConfig defaults, 2 layers x 128), GRPO's default shape (16 prompts x group 8 = 128 samples),
sampled at T=1 with <eos> allowed, so response lengths vary from 1 to the cap. One optimizer step
over all 128 (one minibatch, GRPO advantages, KL in the loss). Each variant runs in a fresh
subprocess, one thread: median of --reps timed steps after one warm-up (wall time, and the
process's CPU time, which a shared machine's load disturbs less), and the peak resident set size of
the process (ru_maxrss) minus its RSS once the model and samples are ready (so the warm-up's
gradients and AdamW state count too, equally for every variant; torch's CPU allocator is not
visible to tracemalloc). A CPU number on a tiny model, not a GPU one.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "padded whole minibatch": {},
    "padded mb=16 rows": dict(micro_batch_size=16),
    "padded budget": dict(max_tokens_per_micro_batch="BUDGET"),
    "packed budget": dict(max_tokens_per_micro_batch="BUDGET", packing=True),
    "packed budget + gc": dict(max_tokens_per_micro_batch="BUDGET", packing=True, gradient_checkpointing=True),
    "padded whole minibatch + gc": dict(gradient_checkpointing=True),
}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def samples_for(digits: int, prompts: int = 16, group: int = 8) -> tuple:
    from nodes.impl.reference import add_logprobs
    from rl.model.causal_lm import ModelConfig, build_policy
    from rl.generation.hf_sampling import sample_responses
    from rl.data.tasks import build_tokenizer, make_task, score

    tok = build_tokenizer()
    model = build_policy(ModelConfig(), tok)
    task = make_task("copy", digits)
    records = task.take(prompts)
    ids = [tok(p["prompt"])["input_ids"] for p in records for _ in range(group)]
    samples = sample_responses(model, tok, ids, task.max_new_tokens, seed=0)
    items = [{"samples": samples[group * i:group * (i + 1)], "fields": p} for i, p in enumerate(records)]
    add_logprobs(model, tok.pad_token_id, items, "ref_logprobs")
    for item in items:
        for s in item["samples"]:
            s.update(score=score(item["fields"], tok.decode(s["response_ids"], skip_special_tokens=True)),
                     failed=False, finished=True)
    return tok, model, [s for item in items for s in item["samples"]]


def child(digits: int, variant: str, budget: int, reps: int) -> dict:
    import torch

    from nodes.impl.learner import LearnerConfig, ppo_update
    from rl.update.microbatch import enable_gradient_checkpointing
    from rl.update.packing import use_varlen_attention

    torch.set_num_threads(1)
    tok, model, samples = samples_for(digits)
    settings = {k: (budget if v == "BUDGET" else v) for k, v in VARIANTS[variant].items()}
    gc = settings.pop("gradient_checkpointing", False)
    cfg = LearnerConfig(algorithm="grpo", group_size=8, minibatch_size=len(samples), lr=1e-6, **settings)
    if gc:
        enable_gradient_checkpointing(model)
    if cfg.packing:
        use_varlen_attention(model, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    base = rss_mb()
    times, cpu_times, stats = [], [], {}
    for _ in range(reps + 1):
        t, cpu = time.perf_counter(), time.process_time()
        stats = ppo_update(model, opt, [dict(s) for s in samples], 0.01, tok.pad_token_id, cfg, random.Random(0),
                           stale=False)
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lengths = [len(s["response_ids"]) for s in samples]
    return {"digits": digits, "variant": variant, "budget": budget if "BUDGET" in VARIANTS[variant].values() else 0,
            "s_per_step": statistics.median(times[1:]), "cpu_s_per_step": statistics.median(cpu_times[1:]), "padding_frac": stats["learner/padding_frac"],
            "tokens_processed": stats["learner/tokens_processed"], "tokens_real": stats["learner/tokens_real"],
            "peak_rss_over_base_mb": peak - base, "response_len_min_mean_max": [min(lengths), statistics.mean(lengths),
                                                                                max(lengths)],
            "prompt_len": len(samples[0]["prompt_ids"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--digits", default="2,24", help="copy-task digits, comma-separated (2 = the default task)")
    ap.add_argument("--budget", type=int, default=512, help="max_tokens_per_micro_batch of the budget variants")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1], args.budget, args.reps)))
        return
    rows = []
    for digits in (int(d) for d in args.digits.split(",")):
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--child", str(digits), variant, "--budget",
                                  str(args.budget), "--reps", str(args.reps)], capture_output=True, text=True,
                                 cwd=ROOT, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"digits {digits:>2} {variant:<28} {r['s_per_step']:.3f} s/step ({r['cpu_s_per_step']:.3f} CPU s)  padding {100 * r['padding_frac']:5.1f}%"
                  f"  processed {r['tokens_processed']:>6} real {r['tokens_real']:>6}"
                  f"  peak RSS +{r['peak_rss_over_base_mb']:.0f} MB", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
