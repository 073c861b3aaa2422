"""The learner's algorithm settings that live in rl/algorithm/ (learner.kl, learner.policy_loss),
without torch: the learner's declaration (nodes/learner.py) holds them, and the driver imports it
before Ray starts. rl/algorithm/kl.py and losses.py, which compute with them, import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from dataflow.checks import NonNegative, Positive

PolicyLoss = Literal["ppo", "dual_clip", "gspo", "reinforce"]


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
    drops the KL's pull back toward the reference: on the CPU demo clamp=10 halved the reported KL
    and collapsed the entropy (bench/results/demo_kl_clamp_cpu_2026-12-01.md). k3 stays finite
    without it: its log-ratio is clamped inside (20)."""
