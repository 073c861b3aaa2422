"""GRPO with DAPO's dynamic sampling. Run: python -m dataflow.run graphs/dapo.py [--set key=value ...]

    prompts ──> generator (x replicas, group_size each) ──> reward ──> filter ──> reference ──> learner
     ▲  ▲              ▲                                                 │                       │
     │  └─ dropped ────┼──────────────── (refill: one more prompt each) ◄┘                       │
     └─────────────────┴─────────────────── policy (versioned, latest wins) ◄────────────────────┘

The reference runs only when its log-probs are read: with learner.kl.coef=0 the samples go
straight on (use_reference, graphs/rlhf.py).

The filter (nodes/group_filter.py) drops the groups whose responses all scored alike and the prompt
source refills their batch, so every step trains on prompts_per_step groups with a learning signal
(DAPO, arXiv 2503.14476; verl's filter_groups). Its counts are in metrics.jsonl (filter/*).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from dataflow import Graph, policy_edge, share
from dataflow.checks import AtLeast
from graphs.rlhf import PROGRESS, RLHFConfig, runs
from nodes import DROPPED_EDGE, Generator, GroupFilter, GroupFilterConfig, Learner, PromptSource
from nodes.learner import LearnerConfig


@dataclass(kw_only=True)
class DAPOGraphConfig(RLHFConfig):
    filter: GroupFilterConfig = field(default_factory=GroupFilterConfig)
    group_size: Annotated[int, AtLeast(2, note='a group filter compares responses')] = 8
    """Responses per prompt; advantages are normalised within each group."""
    prompts_per_step: int = 16
    learner: LearnerConfig = field(default_factory=lambda: LearnerConfig(algorithm="grpo"))
    rules: ClassVar[tuple] = RLHFConfig.rules + (
        runs("grpo", "graphs/dapo.py", "for PPO run graphs/ppo.py"),
        share("group_size", "generator.group_size", "learner.group_size"),
        share("prompts_per_step", "filter.prompts_per_step"),
    )


config = DAPOGraphConfig()


def build(cfg: DAPOGraphConfig) -> Graph:
    g = Graph("dapo", config=cfg, progress=PROGRESS)
    g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
    g.node("generator", Generator, cfg.generator, cpus=1, side="rollout", replicas=cfg.generator_replicas)
    g.node("reward", **cfg.reward_node())
    g.node("filter", GroupFilter, cfg.filter, cpus=0.1)
    # filter -> reference; with learner.kl.coef=0 no reference, and filter's port goes on (use_reference)
    with_ref = cfg.add_reference(g, "filter.kept", name="kept")
    g.node("learner", Learner, cfg.learner, cpus=1, side="train", replicas=cfg.learner.num_ranks, ends_run=True)
    cap = cfg.channel_capacity
    g.channel("prompts.prompts", "generator.prompts", capacity=cap, name="prompts")
    g.channel("generator.samples", "reward.samples", capacity=cap, name="samples")
    g.channel("reward.scored", "filter.scored", capacity=cap, name="scored")
    g.channel(with_ref, "learner.rollouts", capacity=cap, name="rollouts")
    # Generators first: the prompt source must not admit a batch before they hold its weights.
    policy_edge(g, src="learner", dst=["generator", "prompts", "filter"], transport=cfg.weight_transport)
    g.versioned(DROPPED_EDGE, src="filter", dst=["prompts"])
    cfg.add_validation(g)   # with val.path: reward -> evaluator, rounds between steps
    g.place(cfg.placement, num_gpus=cfg.num_gpus, gpu_shares=cfg.gpu_shares)
    return g
