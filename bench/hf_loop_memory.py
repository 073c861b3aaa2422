"""The HF loop's sampling (rl/generation/hf_sampling.sample_responses) with and without a grad
graph, side by side on a CPU: time and peak memory of one batch on a real model.

    python3 bench/hf_loop_memory.py /tmp/real/smollm2 --prompts 32 --prompt-tokens 300 --new-tokens 32

Why: the generator's HF loop samples in asyncio.to_thread, where grad mode is on, and the
generator's weights require grad; sample_responses lost its @torch.no_grad() in 0f3da4b, so every
decode step's activations were kept until the call returned (an agent run with generator.backend=hf
ran out of GPU memory). "grad" calls the undecorated function (__wrapped__), as that code did;
"no_grad" the function as it is. Each mode runs in a fresh subprocess; peak memory is the
process's ru_maxrss minus its RSS once the model is loaded (torch's CPU allocator is invisible to
tracemalloc). Random prompt ids, never-matching stop ids: every row decodes the full --new-tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(args) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.generation import hf_sampling

    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    assert any(p.requires_grad for p in model.parameters())     # as the generator holds it
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, tok.vocab_size, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.prompts)]
    fn = hf_sampling.sample_responses if args.mode == "no_grad" else hf_sampling.sample_responses.__wrapped__
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    out = fn(model, tok, prompts, args.new_tokens, temperature=1.0, seed=0, stop_ids=[-1])
    seconds = time.perf_counter() - t
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return {"mode": args.mode, "seconds": round(seconds, 2), "peak_mib": round(peak_mib),
            "tokens": sum(len(o["response_ids"]) for o in out)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a local HF model directory")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--mode", choices=("grad", "no_grad"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(one(args)))
        return
    rows = []
    for mode in ("grad", "no_grad"):
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode],
                              capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("| mode | seconds | peak memory over the loaded model (MiB) | tokens |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['seconds']} | {r['peak_mib']} | {r['tokens']} |")
    grad, plain = rows
    print(f"no_grad: {grad['seconds'] / plain['seconds']:.2f}x faster, {grad['peak_mib'] / max(1, plain['peak_mib']):.1f}x "
          "less peak memory")


if __name__ == "__main__":
    main()
