"""W1-long: the learner's update and the reference pass on the W1 model with long-tailed response
lengths, padded (today) vs token-budget micro-batches, padded or packed (rl/update/microbatch.py,
rl/update/packing.py). In this process, no Ray, no generation: synthetic samples of the lengths below.

    python3 bench/varlen.py --out OUT                       # GPU (W1 model shape, bf16 autocast)
    python3 bench/varlen.py --tiny --out /tmp/varlen_tiny   # CPU smoke (tiny model, fp32)

Workload: 32 prompts x group 8 = 256 samples, 128-token prompts; each prompt's response length
drawn from a log-normal with median 43 and sigma 1.93, capped at 512 (so ~10% of prompts hit the
cap: the shape measured with SmolLM2-135M-Instruct on chat prompts, issue 21); the 8 samples of a
prompt share its length (a per-row length in the dataset that the generator honours).
--per-sample draws one length per sample instead.

Learner variants (one optimizer step over the 256 samples = one minibatch, the PPO loss with KL;
the proximal log-probs are the behaviour ones, as W1's one-minibatch step):
  today          nodes.impl.learner.ppo_update with micro_batch_size rows, sliced from the whole [B, T]
  padded-rows    the bench's loop over the same slices (so the loops compare like for like)
  padded-budget  token-budget micro-batches, each padded to its own rows (padded_columns)
  packed-budget  token-budget packed micro-batches (packed_sequence_logprobs), per attention kind
  packed+gc      packed-budget with gradient checkpointing (memory vs time)
Reference variants: nodes.impl.reference.add_logprobs (today) vs packed token-budget no-grad passes.
Reported per variant: s/step (median of --reps after one warm-up), real tokens/s (prompt +
response tokens of the samples per second), response tokens/s, padding % (padding_stats), passes,
peak GB (torch.cuda.max_memory_allocated). And the bf16 agreement of packed vs padded log-probs on
the same rows (max and mean |diff|; float64 equality is tests/unit/test_packing.py).
Writes OUT/results.json (rewritten after every variant).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

SHAPES = {
    "w1": dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
               prompt_len=128, response_cap=512, prompts=32, group=8),
    "tiny": dict(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                 prompt_len=16, response_cap=64, prompts=8, group=4),
}
T0 = time.time()


def log(text: str) -> None:
    print(f"[varlen {time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {text}", flush=True)


def response_lengths(shape: dict, per_sample: bool, seed: int = 0) -> list[int]:
    """Long-tailed lengths: log-normal, median 43 tokens (scaled to the cap), sigma 1.93, capped."""
    rng = random.Random(seed)
    median = 43 * shape["response_cap"] / 512
    draws = shape["prompts"] * (shape["group"] if per_sample else 1)
    lengths = [max(1, min(shape["response_cap"], round(rng.lognormvariate(math.log(median), 1.93))))
               for _ in range(draws)]
    return lengths if per_sample else [n for n in lengths for _ in range(shape["group"])]


def build(shape: dict, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                      intermediate_size=shape["intermediate"],
                      max_position_embeddings=shape["prompt_len"] + shape["response_cap"],
                      tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=torch.float32)


def make_samples(shape: dict, lengths: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    samples = []
    for r in lengths:
        ids = torch.randint(1, shape["vocab"], (shape["prompt_len"] + r,), generator=g).tolist()
        samples.append({"prompt_ids": ids[:shape["prompt_len"]], "response_ids": ids[shape["prompt_len"]:],
                        "logprobs": [-11.0] * r, "ref_logprobs": [-11.0] * r,
                        "advantage_tokens": [float(len(samples) % 2) - 0.5] * r,
                        "advantages": [float(len(samples) % 2) - 0.5] * r, "score": 0.0, "failed": False,
                        "finished": True})
    return samples


def bench_train_step(model, opt, samples, plan: list[list[int]], layout: str, amp, device,
                     full_width: bool = False) -> None:
    """One optimizer step: ppo_update's loss (policy + KL, token means over the minibatch) over
    `plan`'s micro-batches (rl/update/packing.micro_batch), each weighted by its token share
    (rl/update/microbatch.micro_batch_weights). full_width: padded micro-batches keep the whole batch's
    columns, as ppo_update's slices do today."""
    from rl.algorithm.kl import kl_penalty
    from rl.algorithm.losses import ppo_policy_loss
    from rl.algorithm.masked import masked_mean
    from rl.update.microbatch import micro_batch_weights
    from rl.model.padded_batch import pad_batch, sequence_logprobs
    from rl.update.packing import micro_batch, micro_batch_logprobs
    from rl.model.precision import autocast

    keys = ("logprobs", "ref_logprobs", "advantage_tokens")
    full = pad_batch(samples, 0, token_keys=keys, device=device)
    mask = full["response_mask"]
    weights = micro_batch_weights([plan], mask.sum(1).tolist())[0]
    model.train()
    opt.zero_grad(set_to_none=True)
    with autocast(amp, device):
        for rows, w in zip(plan, weights):
            if full_width:
                idx = torch.tensor(rows, device=device)
                lp, _ = sequence_logprobs(model, full["input_ids"][idx], full["attention_mask"][idx], mask[idx],
                                          entropy_grad=False)
                take = lambda x, idx=idx: x[idx]
            else:
                mb = micro_batch(full, rows, packing=layout == "packed")
                lp, _ = micro_batch_logprobs(model, mb, entropy_grad=False)
                take = mb.take
            m = take(mask)
            pg, _ = ppo_policy_loss(lp, take(full["logprobs"]), take(full["advantage_tokens"]), m, 0.2)
            kl = masked_mean(kl_penalty(lp, take(full["ref_logprobs"]), "k3"), m)
            ((pg + 0.01 * kl) * w).backward()
            del lp
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.eval()


def bench_reference(model, samples, plan, amp, device) -> None:
    from rl.model.padded_batch import pad_batch
    from rl.update.packing import micro_batch, micro_batch_logprobs
    from rl.model.precision import autocast

    full = pad_batch(samples, 0, token_keys=(), device=device)
    out = torch.zeros_like(full["response_mask"])
    with torch.no_grad(), autocast(amp, device):
        for rows in plan:
            mb = micro_batch(full, rows, packing=True)
            mb.put(out, micro_batch_logprobs(model, mb, with_entropy=False)[0])
    out.cpu()


def bf16_agreement(model, samples, rows, amp, device) -> dict:
    """max / mean |packed - padded sdpa| of the response log-probs of `rows` under the run's autocast."""
    from rl.model.padded_batch import pad_batch, sequence_logprobs
    from rl.update.packing import pack_rows, packed_sequence_logprobs
    from rl.model.precision import autocast

    full = pad_batch([samples[i] for i in rows], 0, token_keys=(), device=device)
    packed_kind = model.config._attn_implementation
    with torch.no_grad(), autocast(amp, device):
        # The padded reference runs under sdpa (the padded passes' attention): under the packed
        # kind itself, torch_varlen's padded path is the same kernel on the same tokens (diff 0).
        model.set_attn_implementation("sdpa")
        padded, _ = sequence_logprobs(model, full["input_ids"], full["attention_mask"], full["response_mask"],
                                      with_entropy=False)
        model.set_attn_implementation(packed_kind)
        packed = pack_rows(full["input_ids"], full["attention_mask"], full["response_mask"])
        diff = (packed.to_padded(packed_sequence_logprobs(model, packed, with_entropy=False)[0]) - padded).abs()
    mask = full["response_mask"] > 0
    return {"max_abs_diff": diff[mask].max().item(), "mean_abs_diff": diff[mask].mean().item(),
            "dtype": str(amp), "rows": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU-sized model and batch (a smoke run)")
    ap.add_argument("--out", default="/tmp/varlen_bench")
    ap.add_argument("--micro-batch", type=int, default=16, help="today's rows per micro-batch")
    ap.add_argument("--max-tokens", default="", help="token budgets per micro-batch, comma-separated "
                    "(default: 8192,16384; tiny: 256,512)")
    ap.add_argument("--attn", default="auto", help="attention kinds for the packed variants, comma-separated: "
                    "auto (flash_attention_2 if installed, else torch_varlen (torch's FlashAttention varlen "
                    "kernel) or flex_attention on CUDA, sdpa on CPU), flash_attention_2, torch_varlen, "
                    "flex_attention, sdpa (dense block-diagonal mask)")
    ap.add_argument("--per-sample", action="store_true", help="one length per sample, not per prompt")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions after one warm-up (default 3; tiny 1)")
    ap.add_argument("--skip", default="", help="variants to skip, comma-separated (e.g. today,padded-rows)")
    args = ap.parse_args()

    from nodes.impl.learner import LearnerConfig, ppo_update
    from nodes.impl.reference import add_logprobs
    from rl.update.microbatch import enable_gradient_checkpointing, padding_stats, plan_micro_batches, sample_lengths
    from rl.update.packing import use_varlen_attention
    from rl.model.precision import compute_dtype, micro_slices

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    shape = SHAPES["tiny" if args.tiny else "w1"]
    budgets = [int(x) for x in (args.max_tokens or ("256,512" if args.tiny else "8192,16384")).split(",")]
    reps = args.reps or (1 if args.tiny else 3)
    skip = set(filter(None, args.skip.split(",")))
    amp = compute_dtype("auto", device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    lengths = response_lengths(shape, args.per_sample)
    samples = make_samples(shape, lengths)
    lens = sample_lengths(samples)
    n, real = len(samples), sum(p + r for p, r in lens)
    width = shape["prompt_len"] + max(lengths)
    workload = {"samples": n, "prompt_len": shape["prompt_len"], "response_mean": statistics.mean(lengths),
                "response_median": statistics.median(lengths),
                "at_cap_frac": sum(r == shape["response_cap"] for r in lengths) / n, "real_tokens": real,
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": str(amp),
                "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    log(f"workload: {json.dumps(workload)}")
    model = build(shape, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    results = {"workload": workload, "rows": []}

    def timed(fn) -> float:
        times = []
        for _ in range(reps + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    def run(name: str, fn, stats: dict, passes: int) -> None:
        if name.split(" ")[0] in skip:
            return
        row = {"variant": name, "status": "ok", "passes": passes, **stats}
        try:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            s = timed(fn)
            row.update(s_per_step=s, tokens_per_s=real / s, response_tokens_per_s=sum(lengths) / s)
            if device == "cuda":
                row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as e:  # e.g. out of memory, or an attention kind missing: report, go on
            row["status"] = f"error {type(e).__name__}: {str(e)[:300]}"
            opt.zero_grad(set_to_none=True)
        results["rows"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        log(f"{name}: {row['status']} {row.get('s_per_step', float('nan')):.3f} s/step, padding "
            f"{100 * row.get('perf/padding_frac', 0):.1f}%, {passes} passes, {row.get('peak_mem_gb', 0):.1f} GB")

    # today: rows in ppo_update's shuffled order, micro_batch_size at a time, all at the batch's width
    order = list(range(n))
    random.Random(0).shuffle(order)
    slices = [order[sl] for sl in micro_slices(n, args.micro_batch)]
    today_pad = padding_stats([[lens[i] for i in rows] for rows in slices], "padded", width=width)
    cfg = LearnerConfig(minibatch_size=n, micro_batch_size=args.micro_batch, lr=1e-6)
    run(f"today mb={args.micro_batch}", lambda: ppo_update(model, opt, samples, 0.01, 0, cfg, random.Random(0), False),
        today_pad, len(slices))
    run(f"padded-rows mb={args.micro_batch}",
        lambda: bench_train_step(model, opt, samples, slices, "padded", amp, device, full_width=True),
        today_pad, len(slices))
    for budget in budgets:
        plan = plan_micro_batches(lens, budget, layout="padded")[0]
        run(f"padded-budget max_tokens={budget}",
            lambda: bench_train_step(model, opt, samples, plan, "padded", amp, device),
            padding_stats([[lens[i] for i in rows] for rows in plan], "padded"), len(plan))
    items = [{"samples": [dict(s) for s in samples[i:i + shape["group"]]]} for i in range(0, n, shape["group"])]
    run(f"reference-today mb={args.micro_batch}",
        lambda: add_logprobs(model, 0, items, "ref_logprobs", args.micro_batch),
        padding_stats([[lens[i] for i in range(sl.start, sl.stop)] for sl in micro_slices(n, args.micro_batch)],
                      "padded", width=width), len(micro_slices(n, args.micro_batch)))

    for attn in args.attn.split(","):
        try:
            kind = use_varlen_attention(model, device, attn)
        except Exception as e:
            results["rows"].append({"variant": f"packed attn={attn}", "status": f"error {type(e).__name__}: {e}"})
            continue
        results.setdefault("bf16_agreement", {})[kind] = bf16_agreement(model, samples, order[:16], amp, device)
        log(f"packed vs padded log-probs ({kind}): {results['bf16_agreement'][kind]}")
        for budget in budgets:
            plan = plan_micro_batches(lens, budget)[0]
            stats = padding_stats([[lens[i] for i in rows] for rows in plan], "packed")
            run(f"packed-budget max_tokens={budget} attn={kind}",
                lambda: bench_train_step(model, opt, samples, plan, "packed", amp, device), stats, len(plan))
            run(f"reference-packed max_tokens={budget} attn={kind}",
                lambda: bench_reference(model, samples, plan, amp, device), stats, len(plan))
    if "packed+gc" not in skip:  # last: transformers has no supported way back
        enable_gradient_checkpointing(model)
        for budget in budgets:
            plan = plan_micro_batches(lens, budget)[0]
            run(f"packed+gc max_tokens={budget} attn={model.config._attn_implementation}",
                lambda: bench_train_step(model, opt, samples, plan, "packed", amp, device),
                padding_stats([[lens[i] for i in rows] for rows in plan], "packed"), len(plan))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
