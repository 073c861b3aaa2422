"""Seeded sampling for the static decoder: the noise of a token is a hash of (seed, prompt id,
sample index, token index), so a prompt's response does not depend on its batch, slot or replica.

sample_tokens applies temperature (per row; 0 = greedy), top_k and the eos mask, then Gumbel-max.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def _fmix32(h):
    """murmur3's 32-bit finaliser on int64 tensors or Python ints holding values in [0, 2**32).
    Products may wrap in int64; the low 32 bits (all we keep) are still exact."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def sample_key(seed: int, prompt_id: int, index: int) -> int:
    """The noise key of sample `index` of prompt `prompt_id` (a 32-bit int)."""
    k = _fmix32(seed & M32) ^ (seed >> 32 & M32)
    for part in (prompt_id & M32, prompt_id >> 32 & M32, index & M32):
        k = _fmix32(k ^ part)
    return k


def gumbel_noise(keys: torch.Tensor, steps: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 Gumbel(0, 1) noise, a pure function of (key, step, vocab index)."""
    row = _fmix32(keys ^ steps)                               # [B]
    h = _fmix32(row[:, None] ^ vocab_hash[None, :])           # [B, V]
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))          # uniform in (0, 1), 24 bits
    return -torch.log(-torch.log(u))


def sample_tokens(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor,
                  vocab_hash: torch.Tensor, temperature: float | torch.Tensor, top_k: int,
                  eos_id: int | torch.Tensor, min_new_tokens: int,
                  noise_steps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], behaviour log-probs [B]) for float32 logits [B, V]; steps [B] = tokens already
    generated per row (the noise counter, and what min_new_tokens compares with). Only tensor ops:
    capturable in a CUDA graph. temperature 0: greedy, log-probs of the temperature-1 distribution.
    `temperature`: one for every row, or a float32 tensor [B] of per-row temperatures where 0 means
    greedy for that row (no top_k there either): a tensor, not a Python branch, so one captured
    graph serves any mix (validation's greedy rows beside sampled ones; nodes/generator.py).
    eos_id: one id, or a long tensor of stop ids on the logits' device (all masked before
    min_new_tokens).
    noise_steps [B]: the noise counter where it is not `steps` (a multi-turn episode: the token's
    index in the whole episode, so a later turn never replays an earlier turn's noise; None = steps)."""
    noise_steps = steps if noise_steps is None else noise_steps
    if min_new_tokens > 0:
        block = steps < min_new_tokens
        logits = logits.clone()
        if isinstance(eos_id, torch.Tensor):
            logits[:, eos_id] = torch.where(block[:, None], float("-inf"), logits[:, eos_id])
        else:
            logits[:, eos_id] = torch.where(block, float("-inf"), logits[:, eos_id])
    if isinstance(temperature, torch.Tensor):
        greedy = (temperature <= 0)[:, None]                                   # [B, 1]
        logits = logits / torch.where(greedy, 1.0, temperature[:, None])
        if top_k and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill((logits < kth) & ~greedy, float("-inf"))
        logp = torch.log_softmax(logits, dim=-1)
        sampled = (logp + gumbel_noise(keys, noise_steps, vocab_hash)).argmax(-1)
        tokens = torch.where(greedy[:, 0], logits.argmax(-1), sampled)   # as the float path's greedy
    elif temperature > 0:
        logits = logits / temperature
        if top_k and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        logp = torch.log_softmax(logits, dim=-1)
        tokens = (logp + gumbel_noise(keys, noise_steps, vocab_hash)).argmax(-1)
    else:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
