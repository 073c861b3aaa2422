"""KL estimators, KL-shaped rewards, the KL coefficient's controllers and their settings (KLConfig: learner.kl).

Layout convention shared by every function here: per-token tensors are `[batch, T]`, with a float
`mask` of the same shape that is 1 on response tokens (the actions) and 0 on prompt tokens and
padding. Sequences may have different lengths and any padding side: a masked position is treated
as absent, never as a zero-valued token. Per-sequence tensors are `[batch]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from dataflow.checks import NonNegative, Positive
from rl.algorithm.masked import masked_mean


@dataclass(kw_only=True)
class KLConfig:
    kind: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adaptive toward `target` (Ziegler et al. 2019)."""
    coef: Annotated[float, NonNegative] = 0.01
    """KL coefficient (initial one when adaptive)."""
    target: Annotated[float, Positive] = 0.1
    horizon: Annotated[float, Positive] = 10000.0
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (rl/algorithm/kl.kl_penalty; k3 is verl's low_var_kl: unbiased and non-negative)."""
    placement: Literal["loss", "reward"] = "loss"
    """loss: coef x KL(policy || reference) in the loss (GRPO's). reward: -coef x KL_t of the rollout
    (old policy vs reference) folded into the rewards before the advantages, the adaptive controller
    fed the rollout's mean per-sequence KL (verl's use_kl_in_reward; REINFORCE++). Needs a
    learner-side advantage (not gae: the critic computes GAE before the learner sees the batch)."""
    clamp: Annotated[float, NonNegative] = 0.0
    """Each token's KL estimate is clamped to [-clamp, clamp] (verl's low_var_kl uses 10; 0 = off).
    Off by default: k3 is large exactly on the tokens the policy has made rare, and clamping there
    drops the KL's pull back toward the reference: on the CPU demo (PPO, 120 steps) clamp=10 halved
    the reported KL and collapsed the entropy (0.03 vs 0.22; reward 0.74-0.80 vs 0.88, the code
    before the clamp 0.94). k3 stays finite without it: its log-ratio is clamped inside (20)."""


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
