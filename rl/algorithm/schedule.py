"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay (pure Python);
ScheduleConfig is its setting (learner.schedule)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

from dataflow.checks import NonNegative, Range


@dataclass(kw_only=True)
class ScheduleConfig:
    """Learning rate per learner step: lr x rl/algorithm/schedule.lr_multiplier(step)."""
    warmup_steps: Annotated[int, NonNegative] = 0
    """Linear warmup from 0 over this many steps."""
    decay: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: constant, or linear / cosine decay to min_lr_ratio x lr at total_steps."""
    total_steps: Annotated[int, NonNegative] = 0
    """Steps the decay spans (0 = the run's max_steps)."""
    min_lr_ratio: Annotated[float, Range(0, 1)] = 0.0


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, decay: str = "constant",
                  min_lr_ratio: float = 0.0) -> float:
    """Factor on the base learning rate for optimizer step `step` (0-based).

        warmup (step < W):  step / W                                 (0 at step 0, as transformers')
        then, p = (step - W) / (total - W) clipped to [0, 1]:
          constant: 1
          linear:   m + (1 - m) (1 - p)
          cosine:   m + (1 - m) * 0.5 (1 + cos(pi p))
    with m = min_lr_ratio. With m = 0 these are transformers' get_constant_schedule_with_warmup /
    get_linear_schedule_with_warmup / get_cosine_schedule_with_warmup (the schedules verl and TRL
    use); cosine decay from Loshchilov & Hutter 2017, "SGDR" (arXiv 1608.03983), warmup from
    Goyal et al. 2017 (arXiv 1706.02677).
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if decay == "constant":
        return 1.0
    progress = min(max((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0), 1.0)
    if decay == "linear":
        shape = 1.0 - progress
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_multiplier: decay={decay!r}; use constant, linear or cosine")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape
