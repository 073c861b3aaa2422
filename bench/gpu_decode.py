"""Generation speed on one GPU, workload W1 (under 4 minutes on an H200):

    python bench/gpu_decode.py            # CUDA, Qwen2.5-0.5B shape, random init, bf16
    python bench/gpu_decode.py --tiny     # a small shape on CPU (checks that the script runs)

W1: vocab 151936, hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, tied embeddings, bf16;
32 prompts x 8 samples = 256 responses of exactly 256 tokens (min_new_tokens = max_new_tokens:
<eos> masked) from 128-token prompts.

1. Checks (asserts): the static decoder's logits (prefill + teacher-forced decode steps) against the
   HF forward, and the behaviour log-probs of sampled responses against sequence_logprobs, at bf16
   tolerance; a second CUDA-graph run gives the same tokens as the first.
2. Times, for the same prompts:
   (a) with --hf-loop, our per-token HF loop (rl/generation/hf_sampling.py:sample_responses);
   (b) the static decoder eager;
   (c) the static decoder with CUDA graphs, compiled layers and a compiled sampler (the generator's
       default on CUDA); (c') the same with eager layers; (c'') eager layers and an eager sampler;
   (d) transformers' model.generate(cache_implementation="static") and (e) its continuous batching
       with a paged KV cache (model.generate_batch), (e') the same with its CUDA graphs, if they run.
   Prints a table of seconds and response tokens/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from rl.generation.decoding import StaticDecoder, decode_responses  # noqa: E402
from rl.generation.hf_sampling import sample_responses  # noqa: E402
from rl.model.padded_batch import pad_batch, sequence_logprobs  # noqa: E402
from rl.model.precision import cast_model  # noqa: E402

W1 = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
          num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=32768,
          rope_theta=1000000.0, tie_word_embeddings=True)
TINY = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
            tie_word_embeddings=True)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(device, fn):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shape on CPU, fp32")
    p.add_argument("--skip-hf", action="store_true", help="skip (a), (d) and (e)")
    p.add_argument("--hf-loop", action="store_true",
                   help="also time (a), our own per-token loop (on an H200 it did not finish W1 in 4 minutes)")
    p.add_argument("--hf-tokens", type=int, default=64,
                   help="(a) and (d) time this many tokens per response and scale to the full length "
                        "(their per-token cost is about constant; keeps the script under 4 minutes)")
    args = p.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda":
        assert torch.cuda.is_available(), "gpu_decode needs CUDA (or --tiny on CPU)"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = TINY if args.tiny else W1
    n_prompts, group, prompt_len, new = (4, 2, 16, 16) if args.tiny else (32, 8, 128, 256)
    t_start = time.time()

    torch.manual_seed(0)
    eos, pad = 2, 0
    model = Qwen2ForCausalLM(Qwen2Config(**shape, bos_token_id=1, eos_token_id=eos, pad_token_id=pad,
                                         attn_implementation="sdpa"))
    cast_model(model, device, dtype).eval()
    tok = types.SimpleNamespace(pad_token_id=pad, eos_token_id=eos)
    g = torch.Generator().manual_seed(1)
    base = [torch.randint(3, shape["vocab_size"], (prompt_len,), generator=g).tolist() for _ in range(n_prompts)]
    prompts = [p for p in base for _ in range(group)]
    keys = [(i, j) for i in range(n_prompts) for j in range(group)]
    n = len(prompts)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, {dtype}, torch "
          f"{torch.__version__}; {n} responses x {new} tokens from {prompt_len}-token prompts", flush=True)

    # 1. correctness ---------------------------------------------------------------------------
    tol = 1e-4 if dtype == torch.float32 else 0.1
    check = StaticDecoder(model, 8, prompt_len + 32, eos_id=eos, max_new_tokens=32, cuda_graphs=False)
    conts = [torch.randint(3, shape["vocab_size"], (8 + 3 * i,), generator=g).tolist() for i in range(4)]
    sub = [base[i][:prompt_len - 7 * i] for i in range(4)]     # variable prompt lengths
    got = check.teacher_forced_logits(sub, conts)
    err = 0.0
    with torch.no_grad():
        for p_, c, lg in zip(sub, conts, got):
            ref = model(input_ids=torch.tensor([p_ + c], device=device)).logits[0, len(p_) - 1:-1].float()
            err = max(err, (lg - ref).abs().max().item())
    print(f"decoder logits vs HF forward: max abs diff {err:.3e} (tol {tol})", flush=True)
    assert err < tol, err
    del check

    # behaviour log-probs (no min_new_tokens here: masking <eos> shifts them by log(1 - p_eos))
    checked = decode_responses(model, tok, prompts[:64], 32, keys=keys[:64])
    batch = pad_batch(checked, pad, device=device)
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"],
                                  with_entropy=False)
    mask = batch["response_mask"]
    diff = (lp - batch["logprobs"]).abs() * mask
    mean_err, max_err = (diff.sum() / mask.sum()).item(), diff.max().item()
    print(f"behaviour log-probs vs sequence_logprobs: mean abs {mean_err:.3e}, max abs {max_err:.3e}", flush=True)
    assert mean_err < tol / 5 and max_err < 5 * tol, (mean_err, max_err)

    t_build, dec_graphs = timed(device, lambda: StaticDecoder(model, n, prompt_len + new, eos_id=eos,
                                                              max_new_tokens=new, min_new_tokens=new, seed=0))
    print(f"decoder built in {t_build:.1f} s (layers compiled: {dec_graphs.layers_compiled})", flush=True)
    run_c = lambda: decode_responses(model, tok, prompts, new, keys=keys, decoder=dec_graphs)  # noqa: E731
    t_capture, samples_c = timed(device, run_c)       # first run captures the graph(s)
    assert all(len(s["response_ids"]) == new for s in samples_c)

    # 2. timing ----------------------------------------------------------------------------------
    rows = []

    def record(name, seconds, note="", tokens=None):
        tokens = n * new if tokens is None else tokens
        rows.append((name, seconds, tokens / seconds, note))
        print(f"  {name}: {seconds:.2f} s, {tokens / seconds:,.0f} tok/s {note}", flush=True)

    t_c, samples_c2 = timed(device, run_c)
    record("(c) static decoder + CUDA graphs + compiled layers" if device == "cuda"
           else "(c) static decoder (CPU: eager)",
           t_c, f"(build {t_build:.1f} s; first run incl. capture/compile: {t_capture:.1f} s)")
    assert [s["response_ids"] for s in samples_c2] == [s["response_ids"] for s in samples_c]

    if device == "cuda":
        dec_layers = StaticDecoder(model, n, prompt_len + new, eos_id=eos, max_new_tokens=new,
                                   min_new_tokens=new, compile_layers=False)
        run = lambda: decode_responses(model, tok, prompts, new, keys=keys, decoder=dec_layers)  # noqa: E731
        first = run()
        same = sum(a["response_ids"] == b["response_ids"] for a, b in zip(first, samples_c))
        record("(c') CUDA graphs, eager layers", timed(device, run)[0],
               f"({same}/{n} responses identical to (c))")
        del dec_layers

        dec_eager_sampler = StaticDecoder(model, n, prompt_len + new, eos_id=eos, max_new_tokens=new,
                                          min_new_tokens=new, compile_sampler=False, compile_layers=False)
        run = lambda: decode_responses(model, tok, prompts, new, keys=keys, decoder=dec_eager_sampler)  # noqa: E731
        run()
        record("(c'') CUDA graphs, eager layers, eager sampler", timed(device, run)[0])
        del dec_eager_sampler

        dec_eager = StaticDecoder(model, n, prompt_len + new, eos_id=eos, max_new_tokens=new,
                                  min_new_tokens=new, cuda_graphs=False, compile_sampler=False,
                                  compile_layers=False)
        decode_responses(model, tok, prompts[:8], 8, keys=keys[:8], num_slots=8, cuda_graphs=False,
                         compile_sampler=False, compile_layers=False)   # warm-up (cuBLAS handles, allocator)
        t_b, samples_b = timed(device, lambda: decode_responses(model, tok, prompts, new, keys=keys,
                                                                decoder=dec_eager))
        same = sum(a["response_ids"] == b["response_ids"] for a, b in zip(samples_b, samples_c))
        record("(b) static decoder eager", t_b, f"({same}/{n} responses identical to (c))")
        del dec_eager

    if not args.skip_hf:
        k = min(new, args.hf_tokens)
        scaled = f"({k} tokens timed, x{new / k:g})" if k < new else ""
        if args.hf_loop:
            sample_responses(model, tok, prompts[:8], 4, seed=0)   # warm-up
            t_a, _ = timed(device, lambda: sample_responses(model, tok, prompts, k, seed=0, min_new_tokens=k))
            record("(a) HF loop (sample_responses)", t_a * new / k, scaled)

        try:
            ids = torch.tensor(prompts, device=device)      # equal lengths: no padding needed
            gen = lambda k: model.generate(  # noqa: E731
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                do_sample=True, top_k=0, temperature=1.0, cache_implementation="static",
                pad_token_id=pad, eos_token_id=eos)
            t_warm, _ = timed(device, lambda: gen(k))
            t_d, out = timed(device, lambda: gen(k))
            assert out.shape[1] == prompt_len + k
            record("(d) HF generate, static cache", t_d * new / k, f"{scaled} (first call {t_warm:.1f} s)")
        except Exception as e:   # version-dependent; report, do not fail the benchmark
            print(f"  (d) HF generate static cache: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)

        # last: it may switch the model's attention implementation to a paged one.
        # (e) as it comes; (e') with its CUDA graphs on (off unless asked, in transformers 5.x)
        from transformers import GenerationConfig
        cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0,
                               temperature=1.0, eos_token_id=eos, pad_token_id=pad)
        variants = [("(e) HF continuous batching (generate_batch, paged KV cache)", {})]
        try:
            from transformers import ContinuousBatchingConfig
            variants.append(("(e') HF continuous batching, CUDA graphs on",
                             dict(continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=True))))
        except ImportError:
            print("  (e') skipped: this transformers has no ContinuousBatchingConfig", flush=True)
        for name, extra in variants:
            try:
                run_e = lambda: model.generate_batch(inputs=prompts, generation_config=cfg, **extra)  # noqa: E731
                t_first, _ = timed(device, run_e)    # sizes its cache, captures its graphs
                t_e, out = timed(device, run_e)
                made = sum(len(o.generated_tokens) for o in out.values())
                record(name, t_e, f"({len(out)} responses, {made} tokens; first call {t_first:.1f} s)",
                       tokens=made)
            except Exception as e:   # version- and device-dependent; report, do not fail the benchmark
                print(f"  {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)

    print("\n| method | seconds | response tokens/s | note |\n|---|---|---|---|")
    for name, s, tps, note in rows:
        print(f"| {name} | {s:.2f} | {tps:,.0f} | {note} |")
    print(f"\ntotal {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
