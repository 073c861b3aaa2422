"""graphs/grpo.py with small defaults for the CPU validation tests: validation rounds are part of the
RLHF graphs (RLHFConfig.val, add_validation), declared when val.path is set.

    prompts ──> generator ──> reward ──scored──> reference ──> learner
       ▲  ▲          ▲           └──validation──> evaluator       │
       │  └──────────┴──── policy (versioned) ◄────────────────────┘
       └────────────────── validated (versioned) ◄── evaluator
"""

from __future__ import annotations

from dataclasses import dataclass

from graphs import grpo
from graphs.grpo import GRPOGraphConfig


@dataclass(kw_only=True)
class ValidatedGRPOConfig(GRPOGraphConfig):
    group_size: int = 4
    prompts_per_step: int = 8
    max_staleness: int = 0
    max_steps: int = 3
    channel_capacity: int = 16


config = ValidatedGRPOConfig()


def build(cfg: ValidatedGRPOConfig):
    return grpo.build(cfg)
