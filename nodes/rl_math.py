"""RLHF algorithm math as pure torch functions (no Ray, no models, no state but the KL controllers).

Layout convention shared by every function here: per-token tensors are `[batch, T]`, with a float
`mask` of the same shape that is 1 on response tokens (the actions) and 0 on prompt tokens and
padding. Sequences may have different lengths and any padding side: a masked position is treated
as absent, never as a zero-valued token. Per-sequence tensors are `[batch]`.

Names follow cleanrl's ppo.py (advantages, returns, ratio, approx_kl, clipfrac, pg_loss, v_loss).
"""

from __future__ import annotations

import math

import torch


# ---------------------------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------------------------

def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask), over all elements (dim=None) or along `dim`.

    Where the mask sums to 0 the result is 0 (not NaN), so an all-padding row is harmless.
    """
    mask = mask.to(x.dtype)
    total = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1e-8) * (count > 0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements of x (all of them, as one population)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        var = var * count / (count - 1).clamp(min=1.0)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked elements; padding positions become 0.

    Mean and (unbiased) variance are taken over all valid tokens of the batch, as in cleanrl's
    advantage normalization and TRL's `masked_whiten`. With shift_mean=False the mean is added back
    (only the scale changes), which keeps the sign of e.g. rewards.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------

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


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

        log_r = logp - ref_logp
        k1 = log_r                      (unbiased, can be negative)
        k2 = 0.5 * log_r^2              (biased, low variance)
        k3 = exp(-log_r) - 1 + log_r    (unbiased, >= 0)

    Source: J. Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx.html).
    Returns the same shape as the inputs; mask it yourself.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio ** 2
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl_penalty: kind={kind!r}; use 'k1', 'k2' or 'k3'")


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token]: gather of the token's logit minus logsumexp over the vocab.

    Avoids materializing the full log_softmax; half-precision logits are upcast to float32
    first. logits [..., V], tokens [...] -> [...].
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _chunk_stats(logits: torch.Tensor, tokens: torch.Tensor, inv_temp: float, with_entropy: bool):
    """One chunk's (log-prob of the token, entropy or None, logsumexp) of softmax(logits * inv_temp).

    logits [R, V] in any float dtype, the math in float32 (float64 stays float64); tokens [R]."""
    z = logits.to(torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype)
    z = z * inv_temp if inv_temp != 1.0 else z
    lse = torch.logsumexp(z, dim=-1)
    logprob = z.gather(-1, tokens[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if with_entropy else None
    return logprob, entropy, lse


def _chunk_grad(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None, inv_temp: float) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk, in the logits' dtype. With z = logits * inv_temp, p = softmax(z):
    d logprob/dz_j = [j = token] - p_j and d entropy/dz_j = -p_j (z_j - lse + entropy)."""
    z = logits.to(lse.dtype)
    z = z * inv_temp if inv_temp != 1.0 else z
    p = torch.exp(z - lse[:, None])
    grad = p * -grad_logprob[:, None]
    if grad_entropy is not None:
        grad = grad - p * (z - (lse - entropy)[:, None]) * grad_entropy[:, None]
    # + grad_logprob at the token's column; a where, not a scatter, so a compiled kernel fuses it
    is_token = torch.arange(logits.shape[-1], device=logits.device) == tokens[:, None]
    grad = torch.where(is_token, grad + grad_logprob[:, None], grad)
    return (grad * inv_temp if inv_temp != 1.0 else grad).to(logits.dtype)


_compiled_fns: dict[str, object] = {}


def _compiled(name: str, fn, example: tuple, on_cuda: bool, compile: bool | None):
    """torch.compile'd `fn` (one fused kernel over all rows, no float32 temporaries), or None to
    run it eagerly in chunks: off CUDA by default, or when compiling failed (e.g. no compiler
    toolchain; said once). The first use compiles on `example`, a two-row slice of the real input,
    so a failure shows before any real work (dynamic shapes: the real sizes reuse the kernel)."""
    if not (on_cuda if compile is None else compile):
        return None
    if name not in _compiled_fns:
        try:
            _compiled_fns[name] = torch.compile(fn, dynamic=True)
            _compiled_fns[name](*example)
        except Exception as e:
            print(f"token_logprobs: torch.compile failed ({type(e).__name__}: {str(e)[:200]}); "
                  f"running eagerly in chunks", flush=True)
            _compiled_fns[name] = None
    return _compiled_fns[name]


class _TokenLogprobs(torch.autograd.Function):
    """Chunked log-softmax-gather and entropy over the vocab (see token_logprobs)."""

    @staticmethod
    def forward(ctx, logits, tokens, inv_temp, with_entropy, entropy_grad, chunk_rows, compile):
        flat, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
        out_dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        n = flat.shape[0]
        logprob = torch.empty(n, dtype=out_dtype, device=logits.device)
        entropy = torch.empty(n, dtype=out_dtype, device=logits.device) if with_entropy else None
        lse = torch.empty(n, dtype=out_dtype, device=logits.device)
        stats = _compiled(f"stats{int(with_entropy)}", _chunk_stats,
                          (flat[:2], flat_tokens[:2], inv_temp, with_entropy), logits.is_cuda, compile)
        rows = n if stats is not None else chunk_rows
        for i in range(0, n, rows):
            lp, ent, m = (stats or _chunk_stats)(flat[i:i + rows], flat_tokens[i:i + rows], inv_temp, with_entropy)
            logprob[i:i + rows], lse[i:i + rows] = lp, m
            if with_entropy:
                entropy[i:i + rows] = ent
        ctx.inv_temp, ctx.chunk_rows, ctx.compile = inv_temp, chunk_rows, compile
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(logits, tokens, lse, entropy if ctx.entropy_grad else None)
        shape = logits.shape[:-1]
        if not with_entropy:
            return logprob.view(shape), None
        entropy = entropy.view(shape)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprob.view(shape), entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, tokens, lse, entropy = ctx.saved_tensors
        flat, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
        grad_logprob = grad_logprob.reshape(-1).to(lse.dtype)
        if not ctx.entropy_grad or grad_entropy is None:
            grad_entropy = entropy = None
        else:
            grad_entropy = grad_entropy.reshape(-1).to(lse.dtype)

        def part(i, j):  # rows i..j-1 of every per-row argument
            return (flat[i:j], flat_tokens[i:j], lse[i:j], None if entropy is None else entropy[i:j],
                    grad_logprob[i:j], None if grad_entropy is None else grad_entropy[i:j], ctx.inv_temp)
        grad_fn = _compiled(f"grad{int(grad_entropy is not None)}", _chunk_grad, part(0, 2), logits.is_cuda,
                            ctx.compile)
        rows = flat.shape[0] if grad_fn is not None else ctx.chunk_rows
        grad = torch.empty_like(flat)
        for i in range(0, flat.shape[0], rows):
            grad[i:i + rows] = (grad_fn or _chunk_grad)(*part(i, i + rows))
        return grad.view(logits.shape), None, None, None, None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = True, entropy_grad: bool = True, chunk_elems: int = 1 << 25,
                   compile: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(logits / T)[token], entropy of softmax(logits / T) or None), fused and chunked.

    The log-probs of logprobs_from_logits and the entropy -sum p log p (float32 math for half-precision
    logits), without their float32 copy of the whole [..., V] logits: a few rows at a time
    (<= chunk_elems values) are upcast, and backward recomputes each chunk's softmax from the saved
    half-precision logits and the per-row logsumexp. compile (None = on CUDA): torch.compile the
    math into one kernel over all rows instead (no float32 temporaries, so no chunks).
    entropy_grad=False: the entropy is a metric (no gradient). logits [..., V], tokens [...]."""
    chunk_rows = max(1, chunk_elems // logits.shape[-1])
    return _TokenLogprobs.apply(logits, tokens, 1.0 / temperature, with_entropy, entropy_grad, chunk_rows, compile)


# ---------------------------------------------------------------------------------------------
# KL-shaped rewards and the KL coefficient
# ---------------------------------------------------------------------------------------------

def per_token_rewards(score: torch.Tensor, kl: torch.Tensor, kl_coef: float,
                      mask: torch.Tensor) -> torch.Tensor:
    """r_t = -kl_coef * kl_t on every valid token, plus the sequence score on the last valid one.

    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"
    (arXiv 1909.08593), R(x, y) = r(x, y) - beta * log(pi(y|x) / rho(y|x)); Stiennon et al. 2020.
    score: [B]; kl, mask: [B, T]. Rows without a valid token get all-zero rewards.
    """
    mask = mask.to(kl.dtype)
    rewards = -kl_coef * kl * mask
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.argmax(positions * (mask > 0), dim=1)          # index of last valid token
    has_token = mask.sum(1) > 0
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += score.to(kl.dtype) * has_token
    return rewards


class FixedKLController:
    """A constant KL coefficient (`value`), with the same interface as AdaptiveKLController."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """KL coefficient steered toward a target KL.

        e     = clip(current_kl / target - 1, -0.2, 0.2)
        value = value * (1 + e * n_steps / horizon)

    Source: Ziegler et al. 2019 (arXiv 1909.08593), section 2.2. `n_steps` is the number of
    samples (or steps, consistently with `horizon`) since the last update.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController: target={target} and horizon={horizon} "
                             "must be > 0")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        if not math.isfinite(current_kl):
            return self.value  # a NaN KL must not poison the coefficient
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])
