"""The static decoder's per-layer pieces at decode shapes, each way it could be written, timed side
by side inside CUDA graphs (what the decoder replays): which would shorten a decode step.

    python bench/decode_attention.py                  # SmolLM2-135M's shapes, B=256, L=128 and 512
    python bench/decode_attention.py --cpu            # checks only (every variant against sdpa, fp32)

bench/decode_kernels.py found a decode step of SmolLM2 at 256 slots to be a chain of several hundred
small kernels, mostly sdpa's attention, many small GEMMs and the KV-cache writes
(bench/results/decode_kernels_h200_2026-12-03.md). Variants:
  attention over the cache [B, kv, L, d] for q [B, kv, g, d] with an additive mask [B, 1, 1, L]:
    sdpa (default backend choice), sdpa pinned to EFFICIENT / MATH, two matmuls + softmax eager,
    the same compiled (inductor: dynamic shapes, as the decoder's layer halves), and the products
    written as reductions, compiled;
  projections: q, k, v as three GEMMs against one GEMM of the concatenated weight; gate and up
    likewise;
  cache writes: K and V as two index_put calls against one on a stacked [S, 2, kv, L, d] cache.
Prints microseconds per call (CUDA-graph replays, CUDA events) and each variant's max |diff| to the
first of its group.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def attend_sdpa(q, kc, vc, mask, scale):
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=scale)


def backend(which):
    def attend(q, kc, vc, mask, scale):
        with sdpa_kernel([which]):
            return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=scale)
    return attend


def attend_matmul(q, kc, vc, mask, scale):
    scores = torch.matmul(q, kc.transpose(-1, -2)).float() * scale + mask    # [B, kv, g, L]
    return torch.matmul(scores.softmax(-1).to(q.dtype), vc)


def attend_reduce(q, kc, vc, mask, scale):
    """The two products as broadcast-multiply-and-sum: compiled, inductor makes reductions that
    read the cache once (no cuBLAS call for 3-row products). Never run eagerly ([B, kv, g, L, d])."""
    scores = (q.float()[:, :, :, None, :] * kc.float()[:, :, None, :, :]).sum(-1) * scale + mask
    return (scores.softmax(-1)[..., None] * vc.float()[:, :, None, :, :]).sum(-2).to(q.dtype)


def timed_us(fn, reps: int = 200) -> float:
    """Microseconds per call of fn() captured in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--mlp", type=int, default=1536)
    ap.add_argument("--lengths", default="128,512")
    a = ap.parse_args()
    cuda = not a.cpu and torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    B, kv, g, d = a.slots, a.kv_heads, a.heads // a.kv_heads, a.hidden // a.heads
    torch.manual_seed(0)

    def group(name, variants):
        base = None
        for label, fn, *check in variants:
            out = fn()
            out = check[0]() if check else out     # a write's result, read back outside the timing
            base = out if base is None else base
            err = (out.float() - base.float()).abs().max().item()
            us = timed_us(fn) if cuda else float("nan")
            print(f"{name:34s} {label:34s} {us:8.1f} us   max|diff| {err:.2e}", flush=True)

    for L in [int(x) for x in a.lengths.split(",")]:
        q = torch.randn(B, kv, g, d, device=dev, dtype=dt)
        kc = torch.randn(B, kv, L, d, device=dev, dtype=dt)
        vc = torch.randn(B, kv, L, d, device=dev, dtype=dt)
        pos = torch.randint(L // 2, L, (B,), device=dev)
        allowed = (torch.arange(L, device=dev)[None] <= pos[:, None])[:, None, None, :]
        mask = torch.zeros(allowed.shape, device=dev, dtype=dt).masked_fill_(~allowed, float("-inf"))
        s = d ** -0.5
        compiled = torch.compile(attend_matmul, dynamic=True)
        reduced = torch.compile(attend_reduce, dynamic=True)
        variants = [("sdpa (auto)", lambda: attend_sdpa(q, kc, vc, mask, s)),
                    ("sdpa EFFICIENT", lambda: backend(SDPBackend.EFFICIENT_ATTENTION)(q, kc, vc, mask, s)),
                    ("sdpa MATH", lambda: backend(SDPBackend.MATH)(q, kc, vc, mask, s)),
                    ("matmul + softmax, eager", lambda: attend_matmul(q, kc, vc, mask.float(), s)),
                    ("matmul + softmax, compiled", lambda: compiled(q, kc, vc, mask.float(), s)),
                    ("reductions, compiled", lambda: reduced(q, kc, vc, mask.float(), s))]
        if not cuda:
            variants = [v for v in variants if "EFFICIENT" not in v[0]]
        group(f"attention B={B} L={L}", variants)

    x = torch.randn(B, 1, a.hidden, device=dev, dtype=dt)
    wq = torch.randn(a.heads * d, a.hidden, device=dev, dtype=dt) * 0.02
    wk = torch.randn(kv * d, a.hidden, device=dev, dtype=dt) * 0.02
    wv = torch.randn(kv * d, a.hidden, device=dev, dtype=dt) * 0.02
    wqkv = torch.cat([wq, wk, wv])
    group("q, k, v projections", [("three GEMMs", lambda: torch.cat([x @ wq.T, x @ wk.T, x @ wv.T], -1)),
                                  ("one GEMM, concatenated weight", lambda: x @ wqkv.T)])
    wg = torch.randn(a.mlp, a.hidden, device=dev, dtype=dt) * 0.02
    wu = torch.randn(a.mlp, a.hidden, device=dev, dtype=dt) * 0.02
    wgu = torch.cat([wg, wu])
    group("gate, up projections", [("two GEMMs", lambda: torch.cat([x @ wg.T, x @ wu.T], -1)),
                                   ("one GEMM, concatenated weight", lambda: x @ wgu.T)])
    L = 512
    kc, vc = (torch.zeros(B, kv, L, d, device=dev, dtype=dt) for _ in range(2))
    kvc = torch.zeros(B, 2, kv, L, d, device=dev, dtype=dt)
    k, v = torch.randn(B, kv, d, device=dev, dtype=dt), torch.randn(B, kv, d, device=dev, dtype=dt)
    slots, pos = torch.arange(B, device=dev), torch.randint(0, L, (B,), device=dev)

    def two_writes():
        kc[slots, :, pos] = k
        vc[slots, :, pos] = v

    def one_write():
        kvc[slots, :, :, pos] = torch.stack([k, v], 1)

    group("K and V cache writes", [
        ("two index_put", two_writes, lambda: torch.stack([kc[slots, :, pos], vc[slots, :, pos]], 1)),
        ("one index_put, stacked cache", one_write, lambda: kvc[slots, :, :, pos])])


if __name__ == "__main__":
    main()
