"""graphs/grpo.py with validation rounds: exactly what a graph declares for issue 17's validation
(README "Validation"), small defaults for CPU tests.

    prompts ──> generator ──> reward ──scored──> reference ──> learner
       ▲  ▲          ▲           └──validation──> evaluator       │
       │  └──────────┴──── policy (versioned) ◄────────────────────┘
       └────────────────── validated (versioned) ◄── evaluator

Besides GRPO's: a `val` setting shared into the prompt source (and given to the evaluator), the
reward node declared as RewardWithValidation, an Evaluator fed by its `validation` port, and the
versioned edge `validated` from the evaluator to the prompt source; the `loggers` setting is a run
setting Graph(config=) picks up. Without val.path none of it is declared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dataflow import Graph, check, share
from graphs.grpo import GRPOGraphConfig
from graphs.rlhf import PROGRESS
from nodes.evaluator import VALIDATED, Evaluator, ValidationConfig
from nodes.generator import Generator
from nodes.learner import Learner
from nodes.prompts import PromptSource
from nodes.reference import Reference
from nodes.reward import RewardWithValidation


def _validation_problem(cfg) -> str | None:
    if cfg.val.path and cfg.reward_kind != "function":
        return ("val.path needs reward_kind=function: validation scores with the training's reward "
                "function (a reward model is not wired for it)")
    return None


@dataclass(kw_only=True)
class ValidatedGRPOConfig(GRPOGraphConfig):
    val: ValidationConfig = field(default_factory=ValidationConfig)
    """Validation rounds (nodes/evaluator.py): val.path, val.every, val.n, val.k, ..."""
    loggers: str = ""
    """Metric sinks besides metrics.jsonl: tensorboard, wandb, or both (dataflow/loggers.py)."""
    group_size: int = 4
    prompts_per_step: int = 8
    max_staleness: int = 0
    max_steps: int = 3
    channel_capacity: int = 16
    rules: ClassVar[tuple] = GRPOGraphConfig.rules + (check(_validation_problem), share("val", "prompts.val"))


config = ValidatedGRPOConfig()


def build(cfg: ValidatedGRPOConfig) -> Graph:
    cfg.learner.algorithm = "grpo"
    g = Graph("grpo-val", config=cfg, progress=PROGRESS)
    g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
    g.node("generator", Generator, cfg.generator, cpus=1, side="rollout", replicas=cfg.generator_replicas)
    validating = bool(cfg.val.path)
    reward = cfg.reward_node()
    if validating:
        reward["kind"] = RewardWithValidation
    g.node("reward", **reward)
    g.node("reference", Reference, cfg.reference, cpus=0.2, side="train")
    g.node("learner", Learner, cfg.learner, cpus=1, side="train", replicas=cfg.learner.dp * cfg.learner.tp,
           ends_run=True)
    cap = cfg.channel_capacity
    g.channel("prompts.prompts", "generator.prompts", capacity=cap, name="prompts")
    g.channel("generator.samples", "reward.samples", capacity=cap, name="samples")
    g.channel("reward.scored", "reference.scored", capacity=cap, name="scored")
    g.channel("reference.with_ref", "learner.rollouts", capacity=cap, name="rollouts")
    g.versioned("policy", src="learner", dst=["generator", "prompts"])
    if validating:
        g.node("evaluator", Evaluator, cfg.val, cpus=0.1)
        g.channel("reward.validation", "evaluator.validation", capacity=cap, name="validation")
        g.versioned(VALIDATED, src="evaluator", dst=["prompts"])
    g.place(cfg.placement, num_gpus=cfg.num_gpus, gpu_shares=cfg.gpu_shares)
    return g
