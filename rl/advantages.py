"""Advantage estimators as pure torch functions.

Names follow cleanrl's ppo.py (advantages, returns).

Layout convention shared by every function here: per-token tensors are `[batch, T]`, with a float
`mask` of the same shape that is 1 on response tokens (the actions) and 0 on prompt tokens and
padding. Sequences may have different lengths and any padding side: a masked position is treated
as absent, never as a zero-valued token. Per-sequence tensors are `[batch]`.
"""

from __future__ import annotations

import torch




def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over the valid tokens of each row.

        delta_t = r_t + gamma * V(s_{t'}) - V(s_t)        t' = next valid token of the row
        A_t     = delta_t + gamma * lam * A_{t'}
        returns = A_t + V(s_t)

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation" (arXiv 1506.02438); reversed loop as in cleanrl ppo.py.

    rewards, values, mask: [B, T]. values[b, t] is the value of the state in which token t is
    chosen. Masked positions are skipped (the recursion jumps over them), and after a row's last
    valid token the bootstrap value and advantage are 0 (the episode ends at EOS or truncation).
    Returns (advantages, returns), both 0 on masked positions and detached from the graph.
    """
    mask = mask.to(values.dtype)
    rewards, values = rewards.detach(), values.detach()
    num_tokens = rewards.shape[1]
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(num_tokens)):
        valid = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        # Padding neither resets nor advances the recursion: carry the state through it.
        last_gae = torch.where(valid, gae, last_gae)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = gae * mask[:, t]
    returns = (advantages + values) * mask
    return advantages, returns


def grpo_advantages(scores: torch.Tensor, group_size: int | None = None,
                    group_ids: torch.Tensor | None = None, eps: float = 1e-6,
                    normalize_std: bool = True) -> torch.Tensor:
    """Group-relative advantage of each sequence: (score - group mean) / (group std + eps).

    Source: Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), GRPO outcome supervision; std is
    the unbiased sample std as in TRL's GRPOTrainer. normalize_std=False gives Dr. GRPO's
    unscaled version (Liu et al. 2025, arXiv 2503.20783).

    scores: [N] one score per sequence. Groups are either consecutive blocks of `group_size`
    (N must be a multiple) or given by `group_ids` [N] (any integers, any order). A group whose
    scores are all equal (or of size 1) gets advantage 0 for every member. Returns [N].
    """
    if (group_size is None) == (group_ids is None):
        raise ValueError("grpo_advantages: pass exactly one of group_size or group_ids")
    scores = scores.detach()
    if group_ids is None:
        if scores.numel() % group_size != 0:
            raise ValueError(f"grpo_advantages: {scores.numel()} scores is not a multiple of "
                             f"group_size={group_size}; send whole groups")
        group_ids = torch.arange(scores.numel(), device=scores.device) // group_size
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    counts = zeros.index_add(0, inverse, torch.ones_like(scores))
    means = zeros.index_add(0, inverse, scores) / counts
    centered = scores - means[inverse]
    if not normalize_std:
        return centered
    sq = zeros.index_add(0, inverse, centered ** 2)
    stds = torch.sqrt(sq / (counts - 1).clamp(min=1.0))
    return centered / (stds[inverse] + eps)
