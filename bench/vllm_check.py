"""generator.backend=vllm on a GPU (issue 19): correctness, generation speed and GRPO end to end,
static decoder and vLLM side by side in one run; also the static decoder's flash-attention path
run with vLLM's bundled FlashAttention (item 7).

    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site:$PWD python3 bench/vllm_check.py --out $OUT/vllm \\
        [--model-dir models/smollm2] [--parts correctness,speed,flash,grpo] [--grpo-steps 8]

Parts (each writes into OUT/results.json as it finishes, so a cut-off call keeps what ran):
  correctness  W1 (and --model-dir) through rl/generation/vllm_engine.VllmDecoder, the generator's own path:
               behaviour log-probs (processed, at the sampling temperature) against the learner's
               recomputation (rl/model/padded_batch.sequence_logprobs on the generator's bf16 copy) on the same
               tokens, before and after a weight push (mean / max abs diff; the push is checked to
               have landed: the old samples' log-probs move); greedy responses against the static
               decoder's on the same weights (identical responses, mean agreeing prefix).
  speed        W1: 256 prompts x 256 tokens (eos suppressed, token-id prompts: vLLM gets no
               tokenizer); --model-dir: 64 chat prompts x 8, T=1, stop at eos, max 512. Static
               decoder vs VllmDecoder (step loop, log-probs) vs llm.generate with and without
               log-probs (vLLM's batch API, same engine); median of 3 after a warm-up.
  flash        the static decoder with attention="flash" through an adapter from its
               flash_attn_with_kvcache call to vllm.vllm_flash_attn.flash_attn_varlen_func (0.26
               bundles no flash_attn_with_kvcache): W1 speed and teacher-forced logits vs sdpa.
  sleep        W1 on an engine whose worker has a process of its own (executor "mp", the tensor
               parallel path: weights go as CUDA IPC handles): behaviour vs recomputed log-probs after a
               push, after sleep level 1 and after sleep level 2 (weights freed), each with a push
               while asleep; sleep and wake times, GPU memory freed.
  grpo         W1 GRPO (sync, one H200, colocated) for --grpo-steps through the graph
               (bench/gpu_step.py's variant runner), generator.backend=static vs vllm, and vllm with
               sleep mode (the engine frees its KV cache while the learner trains): --grpo-variants.

Expect ~6-8 min for correctness+speed+flash (two vLLM engine starts, ~1 min each cold) and ~5 min
for grpo: run them as two calls (--parts correctness,speed,flash then --parts grpo) under a
10-minute limit. No CPU mode: vLLM's engine needs CUDA (the CPU-testable parts are in
tests/integration/test_vllm_backend.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import gpu_step  # noqa: E402  (bench/gpu_step.py: the W1 workload and the graph variant runner)
import torch  # noqa: E402

from rl.data import policy  # noqa: E402
from rl.generation.decoding import StaticDecoder, sample_key  # noqa: E402
from rl.model.padded_batch import pad_batch, sequence_logprobs  # noqa: E402
from rl.model.precision import cast_model  # noqa: E402
from rl.generation.vllm_engine import VllmDecoder  # noqa: E402
from rl.generation.vllm_sampling import sampling_params  # noqa: E402

T0 = time.time()
# vLLM's behaviour log-probs may differ from the learner's recomputation as much as our own
# decoder's do on the same prompts (bf16 on both sides, other kernels), with 10% to spare:
# mean and p99 of the absolute difference per token (the maxima are bf16 ties, for either)
TOLERANCE = 1.1
RESULTS: dict = {}


def log(text: str) -> None:
    print(f"[vllm_check +{time.time() - T0:6.1f}s] {text}", flush=True)


def save(out: Path) -> None:
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def sync_time(fn, reps: int = 3):
    """(median seconds over `reps` after one warm-up, last result)."""
    result = fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


# ---- the two decoders, driven alike ----------------------------------------------------------------
def drive(dec, prompts: list[list[int]], group: int, temperature: float | None = None, seed: int = 0) -> list[dict]:
    """Every prompt's `group` samples (in order) through a StaticDecoder or VllmDecoder, slots
    refilled as sequences finish (what the generator's continuous loop does, without Ray)."""
    queue = [(p, (i, j), sample_key(seed, i, j), temperature) for i, p in enumerate(prompts) for j in range(group)]
    queue.reverse()
    out: dict = {}
    dec.refresh()
    while queue or dec.active:
        take = min(dec.free_slots(), len(queue))
        if take:
            dec.add([queue.pop() for _ in range(take)])
        for tag, sample in dec.step():
            out[tag] = sample
    return [out[i, j] for i in range(len(prompts)) for j in range(group)]


def static(model, slots: int, max_len: int, stop_ids, new: int, min_new: int, **kw) -> StaticDecoder:
    return StaticDecoder(model, slots, max_len, eos_id=stop_ids, max_new_tokens=new, min_new_tokens=min_new,
                         temperature=1.0, seed=0, **kw)


def engine(model_dir: str, model, slots: int, max_len: int, stop_ids, new: int, min_new: int, version,
           util: float) -> VllmDecoder:
    t = time.time()
    dec = VllmDecoder(model_dir, model, num_slots=slots, max_len=max_len, stop_ids=stop_ids, max_new_tokens=new,
                      min_new_tokens=min_new, temperature=1.0, seed=0, gpu_memory_utilization=util,
                      version=version, loaded=0, log=log)
    log(f"vLLM engine for {model_dir} up in {time.time() - t:.0f} s")
    return dec


@torch.no_grad()
def recompute(model, samples: list[dict], temperature: float = 1.0, rows: int = 32) -> list[list[float]]:
    """The learner's log-probs of each sample's response tokens (rl/model/padded_batch.sequence_logprobs)."""
    out = []
    for at in range(0, len(samples), rows):
        part = samples[at:at + rows]
        b = pad_batch(part, 0, token_keys=(), device=next(model.parameters()).device)
        lp, _ = sequence_logprobs(model, b["input_ids"], b["attention_mask"], b["response_mask"],
                                  temperature, with_entropy=False)
        P = b["prompt_len"]
        out += [lp[i, P:P + len(s["response_ids"])].float().tolist() for i, s in enumerate(part)]
    return out


def diff(samples: list[dict], reference: list[list[float]]) -> dict:
    d = torch.tensor([abs(a - b) for s, r in zip(samples, reference) for a, b in zip(s["logprobs"], r)])
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "p99_abs": float(d.quantile(0.99)),
            "tokens": int(d.numel())}


def agreement(a: list[dict], b: list[dict]) -> dict:
    same = sum(x["response_ids"] == y["response_ids"] for x, y in zip(a, b))

    def prefix(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n / max(len(x), len(y), 1)

    return {"identical": same, "of": len(a),
            "mean_prefix_agreement": statistics.mean(prefix(x["response_ids"], y["response_ids"]) for x, y in zip(a, b))}


# ---- workloads ---------------------------------------------------------------------------------------
# The W1 model dir (~1 GB) goes outside --out: the device returns only small files from $OUT.
W1_DIR = Path(os.environ.get("VLLM_CHECK_W1_DIR", "/tmp/vllm_check_w1"))


def w1_setup():
    shape = gpu_step.SHAPES["w1"]
    paths = gpu_step.build_workload(W1_DIR, shape, num_prompts=1024)
    model, tok = policy.load(policy.PolicySpec(path=paths["model"]))
    cast_model(model, "cuda", torch.bfloat16).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(4, shape["vocab"]) for _ in range(shape["prompt_len"])] for _ in range(256)]
    return shape, paths, model, tok, prompts


def chat_prompts(tok, n: int = 64) -> list[list[int]]:
    rng = random.Random(0)
    asks = ["What is {a} + {b}? Answer with only the number.", "Explain in a few sentences why {a} is {kind}.",
            "Write a short poem about the number {a}.", "List {k} facts about the sea."]
    out = []
    for i in range(n):
        a, b, k = rng.randrange(10, 99), rng.randrange(10, 99), rng.randrange(2, 6)
        text = asks[i % len(asks)].format(a=a, b=b, k=k, kind="even" if a % 2 == 0 else "odd")
        out.append(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    return [list(p) for p in out]


# ---- parts ---------------------------------------------------------------------------------------------
def check_model(name: str, model, prompts, stop_ids, group: int, dec: VllmDecoder, version: list) -> dict:
    """Behaviour vs recomputed log-probs before and after a push, greedy vs the static decoder."""
    row: dict = {"workload": name}
    batch = prompts[:32]
    new, min_new = dec.max_new_tokens, dec._params["min_new_tokens"]
    before = drive(dec, batch, group)
    row["logprobs_before_push"] = diff(before, recompute(model, before))
    # the yardstick for the tolerance: our own decoder's behaviour log-probs against the same
    # recomputation (bf16 both sides; only the kernels and summation orders differ)
    sd = static(model, len(batch) * group, max(len(p) for p in batch) + new, stop_ids, new, min_new)
    own = drive(sd, batch, group)
    row["static_logprobs_vs_learner"] = diff(own, recompute(model, own))
    del sd
    perturb(model, 1)       # the push: a new version
    version[0] = 1
    t = time.time()
    dec.refresh()
    row["weight_load_s"] = time.time() - t
    after = drive(dec, batch, group)
    row["logprobs_after_push"] = diff(after, recompute(model, after))
    row["old_samples_vs_new_weights"] = diff(before, recompute(model, before))   # large: the push landed
    greedy_v = drive(dec, prompts[:64], 1, temperature=0.0)
    sd = static(model, 64, max(len(p) for p in prompts) + new, stop_ids, new, min_new)
    greedy_s = drive(sd, prompts[:64], 1, temperature=0.0)
    row["greedy_vs_static"] = agreement(greedy_v, greedy_s)
    row["finished_frac"] = statistics.mean(s["finished"] for s in after)
    del sd
    log(f"{name} correctness: {json.dumps(row)}")
    return row


def n_tokens(samples) -> int:
    return sum(len(x["response_ids"]) for x in samples)


def static_speed(name: str, model, prompts, stop_ids, new: int, min_new: int, group: int) -> dict:
    """The static decoder as the generator builds it on CUDA (CUDA graphs, compiled layers)."""
    d = static(model, len(prompts) * group, max(len(p) for p in prompts) + new, stop_ids, new, min_new)
    s, samples = sync_time(lambda: drive(d, prompts, group))
    log(f"{name} static decoder: {s:.2f} s, {n_tokens(samples) / s:,.0f} tok/s (layers compiled: {d.layers_compiled})")
    return {"workload": name, "variant": "static decoder", "s": s, "tok_per_s": n_tokens(samples) / s}


def vllm_speed(name: str, prompts, stop_ids, new: int, min_new: int, group: int, dec: VllmDecoder) -> list[dict]:
    s, samples = sync_time(lambda: drive(dec, prompts, group))
    rows = [{"workload": name, "variant": "vLLM VllmDecoder (step loop, logprobs)", "s": s,
             "tok_per_s": n_tokens(samples) / s}]
    log(f"{name} VllmDecoder: {s:.2f} s, {n_tokens(samples) / s:,.0f} tok/s")
    reqs = [{"prompt_token_ids": p} for p in prompts for _ in range(group)]
    for lp in (True, False):
        params = [sampling_params(temperature=1.0, top_k=0, max_new_tokens=new, min_new_tokens=min_new,
                                  stop_ids=stop_ids, seed=sample_key(0, i, j), logprobs=lp)
                  for i in range(len(prompts)) for j in range(group)]
        s, res = sync_time(lambda: dec.llm.generate(reqs, params, use_tqdm=False))
        n = sum(len(r.outputs[0].token_ids) for r in res)
        label = "vLLM llm.generate (" + ("logprobs" if lp else "no logprobs") + ")"
        rows.append({"workload": name, "variant": label, "s": s, "tok_per_s": n / s})
        log(f"{name} {label}: {s:.2f} s, {n / s:,.0f} tok/s")
    return rows


def flash_adapter():
    """flash_attn_with_kvcache(q, k_cache, v_cache, k=, v=, cache_seqlens=, softmax_scale=, causal=)
    as rl/generation/decoding.py calls it, on vllm.vllm_flash_attn.flash_attn_varlen_func: append k/v at
    cache_seqlens, then attend with the cache [S, L, kv, d] seen as pages of 16 tokens (the same
    memory; L must be a multiple of 16), one query token per row."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    def with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal=True):
        B, _, H, D = q.shape
        S, L, KV, _ = k_cache.shape
        rows = torch.arange(B, device=q.device)
        pos = cache_seqlens.long()
        k_cache[rows, pos] = k[:, 0]
        v_cache[rows, pos] = v[:, 0]
        pages = L // 16
        table = (rows[:, None] * pages + torch.arange(pages, device=q.device)[None]).int()
        o = flash_attn_varlen_func(
            q.reshape(B, H, D), k_cache.view(S * pages, 16, KV, D), v_cache.view(S * pages, 16, KV, D),
            max_seqlen_q=1, cu_seqlens_q=torch.arange(B + 1, device=q.device, dtype=torch.int32),
            max_seqlen_k=L, seqused_k=(pos + 1).int(), softmax_scale=softmax_scale, causal=True,
            block_table=table)
        return o.view(B, 1, H, D)

    return with_kvcache


def flash_part(model, prompts, stop_ids, new: int) -> dict:
    import rl.generation.decoding as decoding

    # StaticDecoder takes its flash kernel from rl.generation.decoding's name flash_with_kvcache (imported there
    # from rl/generation/decoder_forward.py): the decoder's own flash path runs with this adapter inside
    adapter, original = flash_adapter(), decoding.flash_with_kvcache
    decoding.flash_with_kvcache = lambda: adapter
    try:
        return _flash_rows(model, prompts, stop_ids, new)
    finally:
        decoding.flash_with_kvcache = original


def _flash_rows(model, prompts, stop_ids, new: int) -> dict:
    max_len = -(-(max(len(p) for p in prompts) + new) // 16) * 16
    row: dict = {}
    cont = [[(7 * i + t) % 1000 + 4 for t in range(32)] for i in range(8)]
    logits = {}
    for attention in ("sdpa", "flash"):
        d = static(model, 8, max_len, stop_ids, new, new, attention=attention)
        logits[attention] = d.teacher_forced_logits(prompts[:8], cont)
    row["teacher_forced_logits_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(logits["sdpa"], logits["flash"]))
    for attention in ("sdpa", "flash"):
        d = static(model, len(prompts), max_len, stop_ids, new, new, attention=attention)
        s, samples = sync_time(lambda: drive(d, prompts, 1))
        row[f"{attention}_s"] = s
        row[f"{attention}_tok_per_s"] = sum(len(x["response_ids"]) for x in samples) / s
        row[f"{attention}_layers_compiled"] = d.layers_compiled
    log(f"flash: {json.dumps(row)}")
    return row


def perturb(model, seed: int) -> None:
    """A new weight version: every weight moved by ~10% of its spread."""
    with torch.no_grad():
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            p.add_((noise * 0.1 * p.float().std()).to(p.dtype))


def sleep_part(model_dir: str, model, prompts, stop_ids, new: int) -> dict:
    """Sleep mode and the multi-process weight path, on one engine whose worker runs in a process of
    its own (executor "mp", what tensor parallel uses: weights go as CUDA IPC handles). After each
    event (a push; sleep level 1 with a push while asleep; sleep level 2, weights freed, with a push
    while asleep) the behaviour log-probs are checked against the learner's recomputation on the
    same weights: a stale or garbage weight would show as a gap far above the awake one."""
    from rl.generation.vllm_engine import VllmConfig

    batch, group, version = prompts[:32], 8, [0]
    t = time.time()
    dec = VllmDecoder(model_dir, model, num_slots=256, max_len=len(batch[0]) + new, stop_ids=stop_ids,
                      max_new_tokens=new, min_new_tokens=new, temperature=1.0, seed=0, gpu_memory_utilization=0.3,
                      config=VllmConfig(sleep_level=1, sleep_idle_s=3600), executor="mp",
                      version=lambda: version[0], loaded=0, log=log)
    row: dict = {"engine_start_s": time.time() - t, "remote_workers": dec.remote_workers}

    def check(name: str) -> None:
        samples = drive(dec, batch, group)
        row[name] = diff(samples, recompute(model, samples))
        log(f"sleep part, {name}: {row[name]}")

    check("awake")
    perturb(model, 1)
    version[0] = 1
    t = time.time()
    dec.refresh()                       # the push, through CUDA IPC handles to the worker process
    row["push_ipc_s"] = time.time() - t
    check("after_push_ipc")
    for level in (1, 2):
        dec.config.sleep_level = level
        free = torch.cuda.mem_get_info()[0]
        t = time.time()
        dec._sleep()
        row[f"sleep{level}_s"] = time.time() - t
        row[f"sleep{level}_freed_gib"] = (torch.cuda.mem_get_info()[0] - free) / 2**30
        perturb(model, 1 + level)       # the learner trains while the engine sleeps
        version[0] += 1
        t = time.time()
        dec.refresh()                   # wake up, then load the new version
        row[f"wake{level}_and_load_s"] = time.time() - t
        check(f"after_sleep{level}_and_push")
    dec.close()
    return row


def grpo_part(args, out: Path) -> list[dict]:
    shape = gpu_step.SHAPES["w1"]
    paths = gpu_step.build_workload(W1_DIR, shape, num_prompts=1024)
    rows = []
    for variant in args.grpo_variants.split(","):
        backend, _, sleep = variant.partition("-sleep")
        sets = [f"generator.backend={backend}"] + ([f"generator.vllm.sleep_level={sleep}"] if sleep else [])
        a = argparse.Namespace(gpus=1, micro_batch=0, ref_micro_batch=0, tiny=False, steps=args.grpo_steps,
                               warmup=2, trace_kernels=[], set=sets)
        row = gpu_step.dataflow_variant(a, shape, paths, "grpo", "sync", out / f"grpo-{variant}", args.grpo_timeout)
        row["backend"] = variant
        rows.append(row)
        RESULTS["grpo"] = rows
        save(out)
    return rows


def table() -> str:
    lines = ["", "== vllm_check ==", "%-8s %-8s %-46s %s" % ("part", "workload", "variant", "value")]
    add = lambda part, work, what, value: lines.append("%-8s %-8s %-46s %s" % (part, work, what, value))  # noqa: E731
    for r in RESULTS.get("correctness", []):
        for key in ("static_logprobs_vs_learner", "logprobs_before_push", "logprobs_after_push",
                    "old_samples_vs_new_weights"):
            if key not in r:
                continue
            v = r[key]
            add("logprob", r["workload"], key, "mean %.4f max %.3f (%d tokens)" % (v["mean_abs"], v["max_abs"], v["tokens"]))
        if "static_logprobs_vs_learner" in r:   # the tolerance: our own decoder's gap, x1.1
            ours, theirs = r["static_logprobs_vs_learner"], r["logprobs_before_push"]
            ok = all(theirs[k] <= TOLERANCE * ours[k] for k in ("mean_abs", "p99_abs"))
            add("logprob", r["workload"], f"vLLM mean and p99 within {TOLERANCE}x of static's",
                "yes" if ok else "NO (%.4f / %.3f against %.4f / %.3f)" % (
                    theirs["mean_abs"], theirs["p99_abs"], ours["mean_abs"], ours["p99_abs"]))
        g = r["greedy_vs_static"]
        add("greedy", r["workload"], "vLLM vs static, identical responses",
            "%d/%d (mean prefix %.2f)" % (g["identical"], g["of"], g["mean_prefix_agreement"]))
    for r in RESULTS.get("speed", []):
        add("speed", r["workload"], r["variant"], "%.2f s  %8.0f tok/s" % (r["s"], r["tok_per_s"]))
    f = RESULTS.get("flash") or {}
    if "flash_s" in f:
        add("flash", "W1", "static decoder sdpa vs flash (vllm_flash_attn)",
            "%.2f s vs %.2f s, logits diff %.3g" % (f["sdpa_s"], f["flash_s"], f["teacher_forced_logits_max_abs_diff"]))
    elif f:
        add("flash", "W1", "static decoder flash path", f.get("error", "?")[:80])
    sl = RESULTS.get("sleep") or {}
    for key in ("awake", "after_push_ipc", "after_sleep1_and_push", "after_sleep2_and_push"):
        if key in sl:
            add("sleep", "W1", "mp worker: " + key, "mean %.4f max %.3f" % (sl[key]["mean_abs"], sl[key]["max_abs"]))
    for level in (1, 2):
        if f"sleep{level}_s" in sl:
            add("sleep", "W1", f"level {level}: sleep / wake+load s, GiB freed", "%.2f / %.2f, %.1f" % (
                sl[f"sleep{level}_s"], sl[f"wake{level}_and_load_s"], sl[f"sleep{level}_freed_gib"]))
    for r in RESULTS.get("grpo", []):
        add("grpo", "W1", "backend=%s (sync, 1 GPU)" % r["backend"],
            "%.2f s/step, peak %s GB" % (r["s_per_step"], r.get("peak_mem_gb")) if r.get("s_per_step") else r["status"])
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model-dir", default="", help="SmolLM2-135M-Instruct directory (examples/smollm2_arithmetic/smollm2.py)")
    p.add_argument("--parts", default="correctness,speed,flash,grpo")
    p.add_argument("--workloads", default="W1,SmolLM2",
                   help="which workloads the correctness and speed parts run (SmolLM2 needs --model-dir)")
    p.add_argument("--grpo-steps", type=int, default=8)
    p.add_argument("--grpo-timeout", type=float, default=300.0)
    p.add_argument("--grpo-variants", default="static,vllm,vllm-sleep1",
                   help="generator backends for the grpo part; vllm-sleepN: generator.vllm.sleep_level=N")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/vllm_check.py needs a CUDA GPU (vLLM's engine); the CPU parts are tests/integration/test_vllm_backend.py")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts, workloads = set(args.parts.split(",")), set(args.workloads.split(","))
    RESULTS.update(machine=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), parts=sorted(parts))
    try:
        if parts & {"correctness", "speed", "flash"}:
            shape, paths, model, tok, prompts = w1_setup()
            stop, new = [tok.eos_token_id], shape["response_len"]
            if "flash" in parts:
                try:
                    RESULTS["flash"] = flash_part(model, prompts, stop, new)
                except Exception as e:
                    RESULTS["flash"] = {"error": f"{type(e).__name__}: {e}"}
                    log(f"flash failed: {RESULTS['flash']['error']}")
                save(out)
            if "speed" in parts and "W1" in workloads:   # static first: torch.compile before vLLM's engine is in the process
                RESULTS.setdefault("speed", []).append(static_speed("W1", model, prompts, stop, new, new, 1))
                save(out)
            if parts & {"correctness", "speed"} and "W1" in workloads:
                version = [0]
                dec = engine(paths["model"], model, 256, shape["prompt_len"] + new, stop, new, new,
                             lambda: version[0], 0.3)
                if "speed" in parts:
                    RESULTS["speed"].extend(vllm_speed("W1", prompts, stop, new, new, 1, dec))
                    save(out)
                if "correctness" in parts:
                    RESULTS.setdefault("correctness", []).append(check_model("W1", model, prompts, stop, 8, dec, version))
                    save(out)
                dec.close()
                del dec
            del model
            torch.cuda.empty_cache()
            if args.model_dir and parts & {"correctness", "speed"} and "SmolLM2" in workloads:
                model, tok = policy.load(policy.PolicySpec(path=args.model_dir))
                cast_model(model, "cuda", torch.bfloat16).eval()
                stop = policy.stop_token_ids(model, tok)
                prompts = chat_prompts(tok)
                if "speed" in parts:
                    RESULTS.setdefault("speed", []).append(static_speed("SmolLM2", model, prompts, stop, 512, 0, 8))
                version = [0]
                dec = engine(args.model_dir, model, 512, max(len(x) for x in prompts) + 512, stop, 512, 0,
                             lambda: version[0], 0.3)
                if "speed" in parts:
                    RESULTS["speed"].extend(vllm_speed("SmolLM2", prompts, stop, 512, 0, 8, dec))
                    save(out)
                if "correctness" in parts:
                    RESULTS.setdefault("correctness", []).append(check_model("SmolLM2", model, prompts, stop, 8, dec, version))
                    save(out)
        if "sleep" in parts:
            shape, paths, model, tok, prompts = w1_setup()
            RESULTS["sleep"] = sleep_part(paths["model"], model, prompts, [tok.eos_token_id], shape["response_len"])
            save(out)
            del model
            torch.cuda.empty_cache()
        if "grpo" in parts:
            grpo_part(args, out)
    finally:
        save(out)
        print(table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
