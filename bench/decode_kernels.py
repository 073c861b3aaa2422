"""What one decode step of the static decoder is made of, on a GPU: the time of a CUDA-graph
replay and its kernels, grouped by name (count per step, GPU us per step).

    python bench/decode_kernels.py --model /tmp/real/smollm2 [--slots 256] [--prompt 64] [--at 32]

The slots are filled with `--prompt`-token prompts (random ids: the step's kernels depend on the
shapes, not the text) and advanced `--at` tokens, so the step attends over a 64-aligned bound as
in a run. Sampling never stops a row (min_new_tokens = max_new_tokens). Prints the replay time
(CUDA events over 200 replays), the kernel time that profiling one replay sums to, and the top
kernels: where a launch-bound step's time goes.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rl.generation.decoding import StaticDecoder, sample_key  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--at", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    dec = StaticDecoder(model, a.slots, a.prompt + a.new, eos_id=0, max_new_tokens=a.new,
                        min_new_tokens=a.new, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab, (a.slots, a.prompt), generator=g).tolist()
    dec.add([(p, i, sample_key(0, i, 0)) for i, p in enumerate(prompts)])
    for _ in range(a.at // 8):
        dec.step(8)
    torch.cuda.synchronize()
    B = a.slots
    L = min(dec.max_len, -(-(a.prompt + a.at + 8) // 64) * 64)
    print(f"layers compiled: {dec.layers_compiled}; attention: {'flash' if dec._flash else 'sdpa'}; "
          f"B={B} L={L}", flush=True)
    dec._run_step(B, L)                 # captures (B, L)
    torch.cuda.synchronize()
    graph = dec._graphs[B, L, False]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 200
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / n
    import torch.profiler as tp
    steps = 5
    with tp.profile(activities=[tp.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    by_name: dict = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.time_range.elapsed_us()
    total_us = sum(v[1] for v in by_name.values()) / steps
    count = sum(v[0] for v in by_name.values()) / steps
    print(f"replay: {step_ms:.3f} ms per step; kernels per step: {count:.0f}; kernel time per step "
          f"{total_us / 1000:.3f} ms ({100 * total_us / 1000 / step_ms:.0f}% of the replay)")
    print(f"{'kernels/step':>12} {'us/step':>9} {'us each':>8}  name")
    for name, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:a.top]:
        print(f"{c / steps:12.0f} {us / steps:9.1f} {us / c:8.2f}  {name[:110]}")


if __name__ == "__main__":
    main()
