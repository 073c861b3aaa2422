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
from graphs.ppo import PROGRESS, PPOGraphConfig, add_learner, add_rollout_nodes, gpu_layout, wire_policy


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
    g = Graph("grpo", max_steps=cfg.max_steps, progress=PROGRESS, save_interval=cfg.save_interval,
              keep_checkpoints=cfg.keep_checkpoints, max_restarts=cfg.max_restarts, drop_bad_items=cfg.drop_bad_items)
    on_gpus = gpu_layout(g, cfg, trainers=("reference", "learner"))
    rollouts = add_rollout_nodes(g, cfg, on_gpus)
    add_learner(g, cfg, on_gpus)
    g.channel(rollouts, "learner.rollouts", capacity=cfg.channel_capacity, name="rollouts")
    return g
