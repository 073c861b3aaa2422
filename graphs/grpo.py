"""GRPO as a streaming graph. Run: python -m dataflow.run graphs/grpo.py [--set key=value ...]

    prompts ──> generator (x replicas, group_size responses per prompt) ──> reward ──> reference ──> learner
       ▲              ▲                                                                              │
       └──────────────┴────────────────────── policy (versioned, latest wins) ◄──────────────────────┘

No critic: the learner normalises each prompt's group of scores (DeepSeekMath's GRPO) and uses the
same clipped objective, KL-in-loss and staleness bound as graphs/ppo.py (whose settings this file
shares; --describe lists them).
"""

from __future__ import annotations

from dataclasses import dataclass

from dataflow import Graph
from nodes.generator import Generator
from nodes.learner import Learner
from nodes.prompts import PromptSource
from nodes.reference import Reference
from nodes.reward import Reward

from graphs.ppo import PPOGraphConfig, wire_policy


@dataclass(kw_only=True)
class GRPOGraphConfig(PPOGraphConfig):
    group_size: int = 8
    """Responses per prompt; advantages are normalised within each group."""
    prompts_per_step: int = 16


config = GRPOGraphConfig()


def build(cfg: GRPOGraphConfig) -> Graph:
    cfg.generator.max_new_tokens = wire_policy(cfg)
    cfg.generator.group_size = cfg.learner.group_size = cfg.group_size
    cfg.learner.algorithm = "grpo"
    g = Graph("grpo", max_steps=cfg.max_steps,
              progress=["reward/mean±reward/std", "kl", "entropy", "staleness/mean", "perf/samples_per_s"])
    g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
    g.node("generator", Generator, cfg.generator, cpus=1, replicas=cfg.generator_replicas)
    g.node("reward", Reward, cfg.reward, cpus=0.1)
    g.node("reference", Reference, cfg.reference, cpus=0.2)
    g.node("learner", Learner, cfg.learner, cpus=1, ends_run=True)
    cap = cfg.channel_capacity
    g.channel("prompts.prompts", "generator.prompts", capacity=cap, name="prompts")
    g.channel("generator.samples", "reward.samples", capacity=cap, name="samples")
    g.channel("reward.scored", "reference.scored", capacity=cap, name="scored")
    g.channel("reference.with_ref", "learner.rollouts", capacity=cap, name="rollouts")
    g.versioned("policy", src="learner", dst=["generator", "prompts"])
    return g
