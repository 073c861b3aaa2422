"""GRPO with validation rounds, on CPU: what a graph declares for issue 17's validation (the graphs
in graphs/ get the same declarations; README "Validation").

    prompts ──> generator ──> reward ──scored──> reference ──> learner
       ▲  ▲          ▲           └──validation──> evaluator
       │  └──────────┴──── policy (versioned) ◄────────────────┘   │
       └────────────────── validated (versioned) ◄─────────────────┘

Validation needs, besides the GRPO graph: the reward node declared as RewardWithValidation, an
Evaluator node fed by its `validation` port, the versioned edge `validated` from the evaluator to
the prompt source, and one `val` config shared by the prompt source and the evaluator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dataflow import Graph
from nodes.evaluator import VALIDATED, Evaluator, ValidationConfig
from nodes.generator import Generator, GeneratorConfig
from nodes.learner import Learner, LearnerConfig
from nodes.prompts import PromptConfig, PromptSource
from nodes.reference import Reference, ReferenceConfig
from nodes.reward import RewardConfig, RewardWithValidation
from rl.policy import PolicySpec
from rl.tasks import make_task


@dataclass(kw_only=True)
class ValidatedGRPOConfig:
    policy: PolicySpec = field(default_factory=PolicySpec)
    prompts: PromptConfig = field(default_factory=PromptConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    val: ValidationConfig = field(default_factory=ValidationConfig)
    """Validation rounds (nodes/evaluator.py): val.path, val.every, val.n, val.k, ..."""
    loggers: str = ""
    """Metric sinks besides metrics.jsonl: tensorboard, wandb (dataflow/loggers.py)."""
    group_size: int = 4
    prompts_per_step: int = 8
    max_staleness: int = 0
    max_steps: int = 3
    channel_capacity: int = 16


config = ValidatedGRPOConfig()


def build(cfg: ValidatedGRPOConfig) -> Graph:
    for node_cfg in (cfg.generator, cfg.reference, cfg.learner):
        node_cfg.policy = cfg.policy
    cfg.prompts.policy = cfg.policy if cfg.policy.path else cfg.prompts.policy
    cfg.prompts.prompts_per_step = cfg.learner.prompts_per_step = cfg.prompts_per_step
    cfg.prompts.max_staleness = cfg.learner.max_staleness = cfg.max_staleness
    cfg.generator.group_size = cfg.learner.group_size = cfg.group_size
    cfg.learner.temperature = cfg.reference.temperature = cfg.generator.temperature
    cfg.learner.algorithm = "grpo"
    cfg.learner.weight_sync.dtype = "float32"
    cfg.generator.max_new_tokens = make_task(cfg.prompts.task, cfg.prompts.num_digits).max_new_tokens
    if cfg.policy.path:
        cfg.reward.tokenizer_path = cfg.policy.path
    cfg.prompts.val = cfg.val                       # one validation setting, two nodes
    g = Graph("grpo-val", max_steps=cfg.max_steps, loggers=cfg.loggers,
              progress=["reward/mean±reward/std", "staleness/mean"])
    cap = cfg.channel_capacity
    g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
    g.node("generator", Generator, cfg.generator, cpus=1)
    g.node("reward", RewardWithValidation, cfg.reward, cpus=0.1)
    g.node("evaluator", Evaluator, cfg.val, cpus=0.1)
    g.node("reference", Reference, cfg.reference, cpus=0.2)
    g.node("learner", Learner, cfg.learner, cpus=1, ends_run=True)
    g.channel("prompts.prompts", "generator.prompts", capacity=cap, name="prompts")
    g.channel("generator.samples", "reward.samples", capacity=cap, name="samples")
    g.channel("reward.scored", "reference.scored", capacity=cap, name="scored")
    g.channel("reward.validation", "evaluator.validation", capacity=cap, name="validation")
    g.channel("reference.with_ref", "learner.rollouts", capacity=cap, name="rollouts")
    g.versioned("policy", src="learner", dst=["generator", "prompts"])
    g.versioned(VALIDATED, src="evaluator", dst=["prompts"])
    return g
