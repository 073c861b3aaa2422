"""Policy and value losses as pure torch functions.

Names follow cleanrl's ppo.py (ratio, approx_kl, clipfrac, pg_loss, v_loss).

Layout convention shared by every function here: per-token tensors are `[batch, T]`, with a float
`mask` of the same shape that is 1 on response tokens (the actions) and 0 on prompt tokens and
padding. Sequences may have different lengths and any padding side: a masked position is treated
as absent, never as a zero-valued token. Per-sequence tensors are `[batch]`.
"""

from __future__ import annotations

import torch

from rl.masked import masked_mean


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_eps: float,
                    behaviour_logprobs: torch.Tensor | None = None,
                    is_truncation: float | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate loss, mean over all valid tokens of the batch.

        ratio_t = exp(logp_t - old_logp_t)
        loss    = mean_t  w_t * max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps, 1 + eps))

    Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv 1707.06347).

    Off-policy correction (optional): when the samples were produced by a stale policy, pass its
    per-token log-probs as `behaviour_logprobs`; then old_logprobs are the proximal policy's
    (recomputed by the learner) and each token is weighted by the detached, truncated importance
    weight w_t = min(exp(old_logp_t - behaviour_logp_t), is_truncation) (no truncation if
    is_truncation is None). This is the decoupled PPO objective of AReaL (Fu et al. 2025,
    arXiv 2505.24298) with truncated IS as in TRL's vLLM importance-sampling correction
    (truncation 2-3 is typical). Without behaviour_logprobs, w_t = 1.

    logprobs carry the gradient; old_logprobs, behaviour_logprobs and advantages are detached.
    advantages: [B, T] per token, or [B] per sequence (GRPO), broadcast over the tokens.
    Returns (loss, stats) with stats (detached 0-d tensors on the loss's device, so a training
    loop reads them once per optimizer step instead of syncing with the GPU per call; float()
    reads one): approx_kl (k3 estimator of KL(old || new): mean of (ratio - 1) - log ratio),
    clipfrac (fraction of tokens with |ratio - 1| > clip_eps), ratio_mean, is_weight_mean.
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.detach()
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    token_losses = torch.max(pg_losses, pg_losses_clipped)
    if behaviour_logprobs is not None:
        is_weight = torch.exp(old_logprobs.detach() - behaviour_logprobs.detach())
        if is_truncation is not None:
            is_weight = is_weight.clamp(max=is_truncation)
        token_losses = token_losses * is_weight
    else:
        is_weight = torch.ones_like(ratio)
    loss = masked_mean(token_losses, mask)
    with torch.no_grad():
        stats = {
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "clipfrac": masked_mean(((ratio - 1.0).abs() > clip_eps).to(mask.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "is_weight_mean": masked_mean(is_weight, mask),
        }
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, dict]:
    """Clipped value loss of PPO2, mean over all valid tokens of the batch.

        v_clipped = old_v + clip(v - old_v, -eps, eps)
        loss      = 0.5 * mean_t max((v - R)^2, (v_clipped - R)^2)

    Source: OpenAI baselines ppo2 / cleanrl ppo.py (`clip_vloss`); as in TRL's PPOTrainer.
    Returns (loss, stats) with stats (a detached 0-d tensor, as ppo_policy_loss's): clipfrac
    (fraction of tokens where v is outside the clip range and the clipped term is larger, i.e.
    where clipping removes the gradient; inside the range both terms are equal up to rounding,
    which must not count).
    """
    mask = mask.to(values.dtype)
    old_values, returns = old_values.detach(), returns.detach()
    v_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    v_losses = (values - returns) ** 2
    v_losses_clipped = (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(v_losses, v_losses_clipped), mask)
    with torch.no_grad():
        clipped = ((values - old_values).abs() > clip_eps) & (v_losses_clipped > v_losses)
        clipfrac = masked_mean(clipped.to(mask.dtype), mask)
    return loss, {"clipfrac": clipfrac}
