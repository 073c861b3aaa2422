"""GRPO as a streaming graph. Run: python -m dataflow.run graphs/grpo.py [--set key=value ...]

    prompts ──> generator (x replicas, group_size responses per prompt) ──> reward ──> reference ──> learner
       ▲              ▲                                                                              │
       └──────────────┴────────────────────── policy (versioned, latest wins) ◄──────────────────────┘

The reference runs only when its log-probs are read: with learner.kl.coef=0 the samples go
straight on (use_reference, graphs/rlhf.py).

No critic: the learner normalises each prompt's group of scores (DeepSeekMath's GRPO) and uses the
same clipped objective, KL-in-loss and staleness bound as graphs/ppo.py (the settings both share
are declared once in graphs/rlhf.py; --describe lists them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from dataflow import Graph, policy_edge, share
from dataflow.checks import AtLeast
from graphs.rlhf import PROGRESS, RLHFConfig, runs
from nodes import Generator, Learner, PromptSource
from nodes.learner import LearnerConfig


@dataclass(kw_only=True)
class GRPOGraphConfig(RLHFConfig):
    group_size: Annotated[int, AtLeast(1)] = 8
    """Responses per prompt; advantages are normalised within each group."""
    prompts_per_step: int = 16
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(algorithm="grpo"))
    rules: ClassVar[tuple] = RLHFConfig.rules + (share("group_size", "generator.group_size", "learner.group_size"),
                                                 runs("grpo", "graphs/grpo.py", "for PPO run graphs/ppo.py"))


config = GRPOGraphConfig()


def build(cfg: GRPOGraphConfig) -> Graph:
    g = Graph("grpo", config=cfg, progress=PROGRESS)
    g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
    g.node("generator", Generator, cfg.generator, cpus=1, side="rollout", replicas=cfg.generator_replicas)
    g.node("reward", **cfg.reward_node())
    # reward -> reference; with learner.kl.coef=0 no reference, and reward's port goes on (use_reference)
    with_ref = cfg.add_reference(g, "reward.scored")
    g.node("learner", Learner, cfg.learner, cpus=1, side="train", replicas=cfg.learner.num_ranks, ends_run=True)
    cap = cfg.channel_capacity
    g.channel("prompts.prompts", "generator.prompts", capacity=cap, name="prompts")
    g.channel("generator.samples", "reward.samples", capacity=cap, name="samples")
    g.channel(with_ref, "learner.rollouts", capacity=cap, name="rollouts")
    # Generators first: the prompt source must not admit a batch before they hold its weights.
    policy_edge(g, src="learner", dst=["generator", "prompts"], transport=cfg.weight_transport)
    cfg.add_validation(g)   # with val.path: reward -> evaluator, rounds between steps
    g.place(cfg.placement, num_gpus=cfg.num_gpus, gpu_shares=cfg.gpu_shares)
    return g
