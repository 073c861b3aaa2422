"""KL estimators, KL-shaped rewards and the KL coefficient's controllers (their settings, KLConfig:
learner.kl, are in rl/algorithm/settings.py, torch-free, and importable from here too).

Layout convention shared by every function here: per-token tensors are `[batch, T]`, with a float
`mask` of the same shape that is 1 on response tokens (the actions) and 0 on prompt tokens and
padding. Sequences may have different lengths and any padding side: a masked position is treated
as absent, never as a zero-valued token. Per-sequence tensors are `[batch]`.
"""

from __future__ import annotations

import math

import torch

from rl.algorithm.masked import masked_mean
from rl.algorithm.settings import KLConfig  # noqa: F401 (imported from here too)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1",
               clamp: float | None = 10.0, log_ratio_clamp: float | None = 20.0) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

        log_r = logp - ref_logp
        k1 = log_r                                  (unbiased, can be negative; verl "kl")
        k2 = 0.5 * log_r^2                          (biased, low variance; verl "mse")
        k3 = exp(-log_r') - 1 + log_r'              (unbiased, >= 0; verl "low_var_kl")
             with log_r' = clamp(log_r, -log_ratio_clamp, log_ratio_clamp) so exp cannot overflow
        each estimate is then clamped to [-clamp, clamp]   (clamp=None: off)

    Source: J. Schulman, "Approximating KL Divergence" (2020, joschu.net/blog/kl-approx.html);
    the clamps are verl's kl_penalty (20 inside, 10 outside): one token whose probability fell to
    ~0 gives a finite, bounded penalty instead of an inf that would skip the whole minibatch.
    Returns the same shape as the inputs; mask it yourself.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio ** 2
    elif kind == "k3":
        if log_ratio_clamp is not None:
            log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"kl_penalty: kind={kind!r}; use 'k1', 'k2' or 'k3'")
    return kl.clamp(-clamp, clamp) if clamp is not None else kl


def sequence_kl(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of a per-token KL estimate over its valid tokens [B] (0 for an empty row).

    What verl's adaptive controller is fed with KL in the reward (apply_kl_penalty: the batch mean
    of these is `current_kl`)."""
    return masked_mean(kl, mask, dim=1)


def kl_shaped_rewards(token_rewards: torch.Tensor, kl: torch.Tensor, kl_coef: float,
                      mask: torch.Tensor) -> torch.Tensor:
    """r'_t = r_t - kl_coef * kl_t on every valid token, 0 elsewhere: KL in the reward.

    Source: Ziegler et al. 2019 (arXiv 1909.08593), R = r - beta * log(pi / pi_ref), per token as
    in verl's apply_kl_penalty (token_level_rewards = token_level_scores - beta * kld) and
    OpenRLHF's REINFORCE++. token_rewards, kl, mask: [B, T].
    """
    mask = mask.to(kl.dtype)
    return (token_rewards.to(kl.dtype) - kl_coef * kl) * mask


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
        """Nothing to restore: a fixed coefficient is a setting, not state, so a run resumed with
        `--set learner.kl.coef=...` (0 -> 0.05 included, which also adds the reference node)
        trains with the coefficient it names, not the checkpoint's."""


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
        """The coefficient it had steered to, if the checkpoint's controller was adaptive too (a
        run that was fixed starts adapting from the configured coefficient). `target` and
        `horizon` are settings: a resumed run takes them from its configuration."""
        if "target" in state:
            self.value = float(state["value"])
