"""PPO as a streaming graph. Run: python -m dataflow.run graphs/ppo.py [--set key=value ...]

    prompts ──> generator (x replicas) ──> reward ──> reference ──> critic ──> learner
       ▲              ▲                                                          │
       └──────────────┴────────────── policy (versioned, latest wins) ◄──────────┘

The reference runs only when its log-probs are read: with learner.kl.coef=0 the samples go
straight on (use_reference, graphs/rlhf.py).

Each arrow is a bounded channel: scoring, reference log-probs and critic values run on samples as
they stream out of the generators, overlapping rollout. The learner trains step k on prompt batch
k, then pushes version k+1 to the generators; the prompt source admits batch k only once version
>= k - max_staleness exists (max_staleness=0: synchronous on-policy PPO). The settings the nodes
share are declared once (graphs/rlhf.py). Out of the box: the built-in task (rl/data/tasks.py) on a
tiny random-init Llama, on CPU. Yours: --set policy.path=/hf_model_dir --set prompts.path=data.jsonl
--set reward.path=my_reward.py --set max_new_tokens=64. GPUs: --set placement=colocated (or split)
--set num_gpus=N; --describe prints which node runs on which GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dataflow import Graph, policy_edge, share
from graphs.rlhf import PROGRESS, RLHFConfig, runs
from nodes import Critic, Generator, Learner, PromptSource


@dataclass(kw_only=True)
class PPOGraphConfig(RLHFConfig):
    rules: ClassVar[tuple] = RLHFConfig.rules + (
        runs("ppo", "graphs/ppo.py", "for GRPO run graphs/grpo.py or graphs/dapo.py"),
        share("prompts_per_step", "critic.train_samples"),  # the critic trains once per step's samples
    )


config = PPOGraphConfig()


def build(cfg: PPOGraphConfig) -> Graph:
    g = Graph("ppo", config=cfg, progress=PROGRESS)
    g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
    g.node("generator", Generator, cfg.generator, cpus=1, side="rollout", replicas=cfg.generator_replicas)
    g.node("reward", **cfg.reward_node())
    # reward -> reference; with learner.kl.coef=0 no reference, and reward's port goes on (use_reference)
    with_ref = cfg.add_reference(g, "reward.scored")
    g.node("critic", Critic, cfg.critic, cpus=0.5, side="train", replicas=cfg.critic.num_ranks)
    g.node("learner", Learner, cfg.learner, cpus=1, side="train", replicas=cfg.learner.num_ranks, ends_run=True)
    cap = cfg.channel_capacity
    g.channel("prompts.prompts", "generator.prompts", capacity=cap, name="prompts")
    g.channel("generator.samples", "reward.samples", capacity=cap, name="samples")
    g.channel(with_ref, "critic.with_ref", capacity=cap, name="with_ref")
    g.channel("critic.advantaged", "learner.rollouts", capacity=cap, name="rollouts")
    # Generators first: the prompt source must not admit a batch before they hold its weights.
    policy_edge(g, src="learner", dst=["generator", "prompts"], transport=cfg.weight_transport)
    cfg.add_validation(g)   # with val.path: reward -> evaluator, rounds between steps
    g.place(cfg.placement, num_gpus=cfg.num_gpus, gpu_shares=cfg.gpu_shares)
    return g
