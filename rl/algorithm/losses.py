"""Policy and value losses, and how a loss matrix is aggregated, as pure torch functions.

Names follow cleanrl's ppo.py (ratio, approx_kl, clipfrac, pg_loss, v_loss); variant and
aggregation names follow verl's core_algos (compute_policy_loss_vanilla / _gspo, agg_loss).

Layout convention shared by every function here: per-token tensors are `[batch, T]`, with a float
`mask` of the same shape that is 1 on response tokens (the actions) and 0 on prompt tokens and
padding. Sequences may have different lengths and any padding side: a masked position is treated
as absent, never as a zero-valued token. Per-sequence tensors are `[batch]`.

Aggregation is split in two so that a minibatch cut into micro-batches (and dp ranks) gives the
unsplit loss exactly: `agg_row_weights` turns the whole minibatch's mask into one weight per row,
and every loss here is  sum_i w_i * sum_t mask_it * loss_it  over whatever rows it is given.
"""

from __future__ import annotations

from typing import Literal

import torch

from rl.algorithm.masked import masked_mean, masked_sum
from rl.algorithm.settings import PolicyLoss  # noqa: F401 (imported from here too)

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def agg_row_weights(mask: torch.Tensor, mode: str, scale_factor: float | None = None) -> torch.Tensor:
    """Per-row weights w_i [B] of a loss aggregation over the batch `mask` [B, T] describes.

    With n_i = valid tokens of row i, N = sum_i n_i, S = rows with n_i > 0 (fully masked rows,
    e.g. failed samples, are not counted, as in verl), C = scale_factor:
        token-mean               L = sum_{i,t} l_it / N              w_i = 1 / N
        seq-mean-token-mean      L = 1/S sum_i (1/n_i sum_t l_it)    w_i = 1 / (S n_i)
        seq-mean-token-sum       L = 1/S sum_i sum_t l_it            w_i = 1 / S
        seq-mean-token-sum-norm  L = 1/S sum_i sum_t l_it / C        w_i = 1 / (S C)
    (l_it counted where mask is 1). Names and definitions of verl's `agg_loss`; the last is
    Dr. GRPO's constant normaliser (Liu et al. 2025, arXiv 2503.20783, C = the generation budget):
    seq-mean-token-sum divided by C, as verl defines it since verl#5417 and TRL's
    loss_type="dr_grpo" does (TRL divides by every row of the batch, S here counts rows with a
    token; the same unless a row is fully masked),
    token-mean is DAPO's token-level loss (Yu et al. 2025, arXiv 2503.14476). Rows with no valid
    token get weight 0; an all-masked batch gets all zeros (never NaN).
    """
    tokens = mask.sum(1)
    has_tokens = (tokens > 0).to(tokens.dtype)
    num_seqs = has_tokens.sum().clamp(min=1.0)
    if mode == "token-mean":
        return has_tokens / tokens.sum().clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        return has_tokens / (tokens.clamp(min=1.0) * num_seqs)
    if mode == "seq-mean-token-sum":
        return has_tokens / num_seqs
    if mode == "seq-mean-token-sum-norm":
        if not scale_factor or scale_factor <= 0:
            raise ValueError("agg_row_weights: seq-mean-token-sum-norm needs a constant scale_factor > 0 "
                             "(Dr. GRPO's normaliser, e.g. the longest response allowed)")
        return has_tokens / (num_seqs * float(scale_factor))
    raise ValueError(f"agg_row_weights: mode={mode!r}; use token-mean, seq-mean-token-mean, "
                     "seq-mean-token-sum or seq-mean-token-sum-norm")


def weighted_token_sum(loss_mat: torch.Tensor, mask: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """sum_i row_weights_i * sum_t mask_it * loss_mat_it (a 0-d tensor)."""
    return (masked_sum(loss_mat, mask, dim=1) * row_weights.to(loss_mat.dtype)).sum()


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, scale_factor: float | None = None) -> torch.Tensor:
    """A loss matrix [B, T] aggregated over one whole batch (see agg_row_weights)."""
    return weighted_token_sum(loss_mat, mask, agg_row_weights(mask, mode, scale_factor))


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, row_weights: torch.Tensor, kind: str = "ppo", clip_eps_low: float = 0.2,
                clip_eps_high: float = 0.2, dual_clip_c: float = 3.0, log_ratio_clamp: float | None = 20.0,
                behaviour_logprobs: torch.Tensor | None = None,
                is_truncation: float | None = None,
                stale_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Surrogate policy loss sum_i w_i sum_t m_it * iw_it * l_it of one of four kinds.

    log_r_t = clamp(logp_t - old_logp_t, -log_ratio_clamp, log_ratio_clamp)   (verl: 20; None = off)
    ratio_t = exp(log_r_t)
      ppo:       l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
                 Schulman et al. 2017 (arXiv 1707.06347); eps_high > eps_low is DAPO's clip-higher
                 (Yu et al. 2025, arXiv 2503.14476).
      dual_clip: ppo's l, and for A < 0 also min(l, -A c)  (c > 1, default 3)
                 Ye et al. 2020, "Mastering Complex Control in MOBA Games" (arXiv 1912.09729).
      gspo:      one ratio per sequence, s_i = exp(1/n_i sum_t log_r_it), on each token as
                 s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)] (the same value, the token's gradient);
                 l = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)).
                 Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv 2507.18071); the
                 paper's clip range is tiny (3e-4 / 4e-4) and its aggregation seq-mean-token-mean.
      reinforce: l = -A r  (no clipping; importance-weighted REINFORCE, Williams 1992; the gradient
                 at r = 1 is the plain policy gradient -A grad log pi).

    Off-policy correction (optional): when the samples were produced by a stale policy, pass its
    per-token log-probs as `behaviour_logprobs`; then old_logprobs are the proximal policy's
    (recomputed by the learner) and each token is weighted by the detached, truncated importance
    weight iw_t = min(exp(old_logp_t - behaviour_logp_t), is_truncation) (no truncation if
    is_truncation is None). This is the decoupled PPO objective of AReaL (Fu et al. 2025,
    arXiv 2505.24298) with truncated IS as in TRL's vLLM importance-sampling correction.
    Without behaviour_logprobs, iw_t = 1. `stale_tokens` [B, T] bool makes it per token
    (behaviour_weights): iw_t = 1 on the tokens it marks False (sampled by the proximal weights
    themselves); None = every token stale.

    logprobs carry the gradient; old_logprobs, behaviour_logprobs and advantages are detached.
    advantages: [B, T] per token, or [B] per sequence, broadcast over the tokens. row_weights [B]:
    the aggregation (agg_row_weights of the whole minibatch, indexed by these rows).
    Returns (loss, stats) with stats (detached 0-d tensors, token means over `mask`):
    approx_kl (k3 estimator of KL(old || new): mean of (ratio - 1) - log ratio), clipfrac
    (tokens whose ratio lies outside [1 - eps_low, 1 + eps_high]), clipfrac_lower (dual_clip: tokens
    where the c bound is the loss), ratio_mean, is_weight_mean.
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.detach().to(logprobs.dtype)
    old_logprobs = old_logprobs.detach()
    log_ratio = logprobs - old_logprobs
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    if kind == "gspo":
        seq_log_ratio = masked_sum(log_ratio.detach(), mask, dim=1) / mask.sum(1).clamp(min=1.0)
        log_ratio = logprobs - logprobs.detach() + seq_log_ratio[:, None]
        if log_ratio_clamp is not None:  # the forward value only: the token's gradient stays
            log_ratio = log_ratio - (log_ratio.detach() - log_ratio.detach().clamp(max=log_ratio_clamp))
    ratio = torch.exp(log_ratio)
    lower, upper = 1.0 - clip_eps_low, 1.0 + clip_eps_high
    clipped_bound = torch.zeros_like(ratio, dtype=torch.bool)
    if kind in ("ppo", "dual_clip", "gspo"):
        token_losses = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, lower, upper))
        if kind == "dual_clip":
            bound = -advantages * dual_clip_c
            clipped_bound = (advantages < 0) & (token_losses > bound)
            token_losses = torch.where(advantages < 0, torch.min(token_losses, bound), token_losses)
    elif kind == "reinforce":
        token_losses = -advantages * ratio
    else:
        raise ValueError(f"policy_loss: kind={kind!r}; use ppo, dual_clip, gspo or reinforce")
    if behaviour_logprobs is not None:
        is_weight = behaviour_weights(old_logprobs, behaviour_logprobs, stale_tokens, is_truncation)
        token_losses = token_losses * is_weight
    else:
        is_weight = torch.ones_like(ratio)
    loss = weighted_token_sum(token_losses, mask, row_weights)
    with torch.no_grad():
        token_log_ratio = (logprobs - old_logprobs).detach()
        if log_ratio_clamp is not None:
            token_log_ratio = token_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
        outside = (ratio < lower) | (ratio > upper) if kind != "reinforce" else torch.zeros_like(clipped_bound)
        stats = {
            "approx_kl": masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, mask),
            "clipfrac": masked_mean(outside.to(mask.dtype), mask),
            "clipfrac_lower": masked_mean(clipped_bound.to(mask.dtype), mask),
            "ratio_mean": masked_mean(ratio.detach(), mask),
            "is_weight_mean": masked_mean(is_weight, mask),
        }
    return loss, stats


def behaviour_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                      stale_tokens: torch.Tensor | None = None, is_truncation: float | None = None) -> torch.Tensor:
    """Decoupled PPO's per-token importance weight of the proximal policy over the behaviour one
    (detached, [B, T]):

        iw_t = min(exp(old_logp_t - behaviour_logp_t), is_truncation)   where stale_tokens_t
        iw_t = 1                                                          elsewhere

    behaviour_logp_t is the log-prob of token t under the weights that sampled it. With partial
    rollouts (nodes/generator.py) one response holds tokens of several versions, so staleness is
    per token: stale_tokens_t = version_t < the version the step trains from (the proximal
    weights). A token sampled by the proximal weights themselves has pi_behaviour = pi_proximal,
    so its weight is 1 exactly, not exp of the generator's rounding and sampling-distribution
    differences (bf16 weights, top_k). stale_tokens None = every token stale (one version per
    sample, stale as a whole). AReaL (Fu et al. 2025, arXiv 2505.24298) tags each token with its
    version and weights each token by its own behaviour log-prob in the same way.
    """
    weight = torch.exp(old_logprobs.detach() - behaviour_logprobs.detach())
    if is_truncation is not None:
        weight = weight.clamp(max=is_truncation)
    if stale_tokens is not None:
        weight = torch.where(stale_tokens.bool(), weight, torch.ones_like(weight))
    return weight


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_eps: float,
                    behaviour_logprobs: torch.Tensor | None = None,
                    is_truncation: float | None = None) -> tuple[torch.Tensor, dict]:
    """PPO's clipped surrogate as a token mean over `mask` (policy_loss with kind="ppo",
    symmetric clip_eps and token-mean weights of this batch)."""
    return policy_loss(logprobs, old_logprobs, advantages, mask, agg_row_weights(mask.to(logprobs.dtype), "token-mean"),
                       "ppo", clip_eps, clip_eps, behaviour_logprobs=behaviour_logprobs, is_truncation=is_truncation)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, dict]:
    """Clipped value loss of PPO2, mean over all valid tokens of the batch.

        v_clipped = old_v + clip(v - old_v, -eps, eps)
        loss      = 0.5 * mean_t max((v - R)^2, (v_clipped - R)^2)

    Source: OpenAI baselines ppo2 / cleanrl ppo.py (`clip_vloss`); as in TRL's PPOTrainer.
    Returns (loss, stats) with stats (a detached 0-d tensor, as policy_loss's): clipfrac
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
