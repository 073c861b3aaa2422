"""Advantage estimators as pure torch functions.

Names follow cleanrl's ppo.py (advantages, returns).

Layout convention shared by every function here: per-token tensors are `[batch, T]`, with a float
`mask` of the same shape that is 1 on response tokens (the actions) and 0 on prompt tokens and
padding. Sequences may have different lengths and any padding side: a masked position is treated
as absent, never as a zero-valued token. Per-sequence tensors are `[batch]`.
"""

from __future__ import annotations

import torch

from rl.algorithm.masked import masked_whiten


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


def _group_index(num: int, group_size: int | None, group_ids: torch.Tensor | None, device,
                 caller: str) -> tuple[torch.Tensor, int]:
    """(dense group index per sequence [N], number of groups) from blocks or ids."""
    if (group_size is None) == (group_ids is None):
        raise ValueError(f"{caller}: pass exactly one of group_size or group_ids")
    if group_ids is None:
        if num % group_size != 0:
            raise ValueError(f"{caller}: {num} scores is not a multiple of group_size={group_size}; "
                             "send whole groups")
        group_ids = torch.arange(num, device=device) // group_size
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, (int(inverse.max()) + 1 if inverse.numel() else 0)


def _group_sums(values: torch.Tensor, inverse: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add(0, inverse, values)


def grpo_advantages(scores: torch.Tensor, group_size: int | None = None,
                    group_ids: torch.Tensor | None = None, eps: float = 1e-6,
                    normalize_std: bool = True, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Group-relative advantage of each sequence: (score - group mean) / (group std + eps).

    Source: Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), GRPO outcome supervision; std is
    the unbiased sample std as in TRL's GRPOTrainer and verl's compute_grpo_outcome_advantage.
    normalize_std=False gives Dr. GRPO's unscaled version (Liu et al. 2025, arXiv 2503.20783).

    scores: [N] one score per sequence. Groups are either consecutive blocks of `group_size`
    (N must be a multiple) or given by `group_ids` [N] (any integers, any order). `valid` [N] bool
    (default all): only valid members (e.g. not failed) make up a group's mean and std; the others
    get advantage 0. A group whose valid scores are all equal (or of one member) gets advantage 0
    for every member. Returns [N].
    """
    scores = scores.detach()
    inverse, num_groups = _group_index(scores.numel(), group_size, group_ids, scores.device, "grpo_advantages")
    ok = torch.ones_like(scores) if valid is None else valid.to(scores.dtype)
    counts = _group_sums(ok, inverse, num_groups)
    means = _group_sums(scores * ok, inverse, num_groups) / counts.clamp(min=1.0)
    centered = (scores - means[inverse]) * ok
    if not normalize_std:
        return centered
    stds = torch.sqrt(_group_sums(centered ** 2, inverse, num_groups) / (counts - 1).clamp(min=1.0))
    return centered / (stds[inverse] + eps)


def rloo_advantages(scores: torch.Tensor, group_size: int | None = None,
                    group_ids: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE Leave-One-Out: each sequence's baseline is the mean of the OTHER members' scores.

        A_i = r_i - 1/(k-1) sum_{j != i} r_j  =  k/(k-1) (r_i - mean_j r_j)      (k members)

    Source: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et
    al. 2024, "Back to Basics" (arXiv 2402.14740); verl's compute_rloo_outcome_advantage. Groups and
    `valid` as grpo_advantages (only valid members count in k and the baseline; the others get 0);
    a group with one valid member gets advantage 0. Returns [N].
    """
    scores = scores.detach()
    inverse, num_groups = _group_index(scores.numel(), group_size, group_ids, scores.device, "rloo_advantages")
    ok = torch.ones_like(scores) if valid is None else valid.to(scores.dtype)
    counts = _group_sums(ok, inverse, num_groups)[inverse]
    others_sum = _group_sums(scores * ok, inverse, num_groups)[inverse] - scores * ok
    baseline = others_sum / (counts - 1).clamp(min=1.0)
    return (scores - baseline) * ok * (counts > 1).to(scores.dtype)


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor,
                            gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns of the per-token rewards, whitened over the whole batch.

        G_t = r_t + gamma * G_{t'}      (t' = next valid token of the row; 0 after the last)
        A_t = (G_t - mean(G)) / sqrt(var(G) + 1e-8)    over every valid token of the batch

    Source: Hu et al. 2025, "REINFORCE++" (arXiv 2501.03262); verl's
    compute_reinforce_plus_plus_outcome_advantage, OpenRLHF. The rewards normally carry the
    per-token KL penalty (KL in the reward, rl/algorithm/kl.kl_shaped_rewards) and the score on the last
    token. token_rewards, mask: [B, T]; masked positions are skipped as in gae_advantages.
    Returns (advantages, returns), 0 on masked positions.
    """
    mask = mask.to(token_rewards.dtype)
    rewards = token_rewards.detach() * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t] > 0
        running = torch.where(valid, rewards[:, t] + gamma * running, running)
        returns[:, t] = running * mask[:, t]
    return masked_whiten(returns, mask), returns
