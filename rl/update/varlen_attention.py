"""Packed attention through torch's own FlashAttention varlen kernel, as the transformers attention
implementation "torch_varlen" (rl/update/packing.use_varlen_attention picks it on CUDA when the
flash_attn package is missing, which it is on most machines: it has no wheel for every torch).

Why not flex_attention, the other kernel torch ships: on an H200, GRPO with packed passes under
flex did not finish a single step, compiled layers or eager
(bench/results/packing_w2_h200_2026-12-02a.md, bench/results/w2_step_h200_2026-12-02a.md).
transformers compiles flex for each new pack length, and every micro-batch has a new one.
torch.nn.attention.varlen.varlen_attn (torch >= 2.10, CUDA) runs FlashAttention-2's varlen kernels
from cumulative sequence lengths: nothing to compile, no [N, N] mask, no work across rows.

The rows' boundaries come in as the keyword arguments transformers already forwards to every
attention call for packed flash attention (cu_seq_lens_q / max_length_q: PackedBatch.attention_kwargs),
so nothing is derived from position ids per layer (a host sync each). Padded batches (a 2-D mask)
still run: their real tokens are gathered, attended as sequences, and put back (as flash-attn does).

Off CUDA, and for float32/float64 inputs the kernel does not take, each sequence goes through
sdpa on its own: exact, O(sum of L^2), no [N, N] mask. That path is what the CPU tests check against
the padded computation; the kernel's bf16 numbers are checked on the GPU (bench/varlen.py).
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
import torch.nn.functional as F

NAME = "torch_varlen"


@lru_cache(maxsize=1)
def _kernel():
    """(varlen_attn, its causal keyword, whether it takes enable_gqa), or None without it. torch
    2.10 spells causal `is_causal=True`; 2.11 on `window_size=(-1, 0)`; GQA came later."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def kernel_available() -> bool:
    """torch's varlen kernel exists and CUDA is there to run it."""
    return _kernel() is not None and torch.cuda.is_available()


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                       max_len: int, scale: float | None = None) -> torch.Tensor:
    """Causal attention within each sequence of a packed layout: q [N, Hq, D], k and v [N, Hkv, D]
    (Hq a multiple of Hkv: grouped-query heads), sequence s = tokens cu_seqlens[s]:cu_seqlens[s+1].
    Returns [N, Hq, Dv]."""
    kernel = _kernel()
    if kernel is not None and q.is_cuda and q.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        # fp32 master weights under bf16 autocast: the projections come out bf16, but RoPE's fp32
        # cos/sin promote q and k back to fp32. sdpa would run them at the autocast dtype; so here.
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if kernel is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        varlen_attn, causal, takes_gqa = kernel
        extra = dict(causal)
        if k.shape[1] != q.shape[1]:
            if takes_gqa:
                extra["enable_gqa"] = True
            else:                                   # older torch: one KV head per query head
                groups = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **extra)
    bounds = cu_seqlens.tolist()
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:                             # [H, L, D] per sequence
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]).transpose(0, 1)
    return out


def _bounds_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens and the longest sequence of one packed row whose positions restart at 0 per
    sequence (a host sync: callers that know the lengths pass cu_seq_lens_q instead)."""
    n = position_ids.shape[-1]
    starts = torch.nonzero(position_ids.reshape(-1)[:n] == 0).squeeze(1)
    cu = torch.cat([starts, starts.new_tensor([n])])
    return cu, int((cu[1:] - cu[:-1]).max())


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             sliding_window=None, softcap=None, cu_seq_lens_q=None, max_length_q=None,
                             position_ids=None, **kwargs):
    """A transformers attention function (query [B, Hq, S, D], key/value [B, Hkv, S, D]) returning
    ([B, S, Hq, D], None) as flash_attention_2 does."""
    if dropout or sliding_window is not None or softcap is not None:
        raise NotImplementedError(
            f"{NAME} attention: attention dropout, sliding windows and logit softcapping are not "
            "supported; set the node's packing=false, or install flash-attn for this model")
    b, hq, s, _ = query.shape
    if key.shape[2] != s:
        raise NotImplementedError(f"{NAME} attention: queries and keys of different lengths (a KV cache)")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))          # [B, S, H, D]
    if attention_mask is not None:                   # padded rows: attend over each row's real tokens
        keep = attention_mask.reshape(-1).nonzero().squeeze(1)
        lens = attention_mask.sum(1)
        cu = F.pad(lens.cumsum(0), (1, 0))
        flat = sequence_attention(q.reshape(b * s, hq, -1)[keep], k.reshape(b * s, k.shape[2], -1)[keep],
                                  v.reshape(b * s, v.shape[2], -1)[keep], cu, int(lens.max()), scaling)
        out = flat.new_zeros(b * s, hq, flat.shape[-1]).index_copy(0, keep, flat)
        return out.view(b, s, hq, -1), None
    if b > 1:                                        # unpadded rows of equal length
        cu = torch.arange(0, b * s + 1, s, device=query.device)
        out = sequence_attention(q.reshape(b * s, hq, -1), k.reshape(b * s, k.shape[2], -1),
                                 v.reshape(b * s, v.shape[2], -1), cu, s, scaling)
        return out.view(b, s, hq, -1), None
    if cu_seq_lens_q is None:
        if position_ids is None:
            cu_seq_lens_q, max_length_q = torch.tensor([0, s], device=query.device), s
        else:
            cu_seq_lens_q, max_length_q = _bounds_from_positions(position_ids)
    return sequence_attention(q[0], k[0], v[0], cu_seq_lens_q, max_length_q, scaling)[None], None


def register() -> None:
    """Make NAME a transformers attention implementation (in this process: each Ray actor calls it
    through use_varlen_attention). Its mask is flash attention's: None, or the 2-D padding mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
