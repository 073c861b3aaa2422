"""PPO as a streaming graph. Run: python -m dataflow.run graphs/ppo.py [--set key=value ...]

    prompts ──> generator (x replicas) ──> reward ──> reference ──> critic ──> learner
       ▲              ▲                                                          │
       └──────────────┴────────────── policy (versioned, latest wins) ◄──────────┘

Each arrow is a bounded channel: scoring, reference log-probs and critic values run on samples as
they stream out of the generators, overlapping rollout. The learner trains step k on prompt batch
k, then pushes version k+1 to the generators; the prompt source admits batch k only once version
>= k - max_staleness exists (max_staleness=0: synchronous on-policy PPO).

Out of the box: the built-in task (nodes/tasks.py: copy 3 digits, per-position credit) on a tiny
random-init Llama, CPU only. Your own model, data and reward:
    --set policy.path=/path/to/hf_model_dir --set prompts.path=data.jsonl \
    --set reward.path=my_reward.py --set max_new_tokens=64
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dataflow import ConfigError, Graph
from nodes.critic import Critic, CriticConfig
from nodes.generator import Generator, GeneratorConfig
from nodes.learner import KLConfig, Learner, LearnerConfig
from nodes.policy import PolicySpec
from nodes.prompts import PromptConfig, PromptSource
from nodes.reference import Reference, ReferenceConfig
from nodes.reward import Reward, RewardConfig
from nodes.reward_model import RewardModel, RewardModelConfig
from nodes.tasks import make_task


@dataclass(kw_only=True)
class PPOGraphConfig:
    policy: PolicySpec = field(default_factory=PolicySpec)
    """The policy every node starts from (a local HF dir, or the built-in tiny model)."""
    prompts: PromptConfig = field(default_factory=PromptConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reward_kind: Literal["function", "model"] = "function"
    """function: a program scores responses (`reward`). model: a sequence classifier (`reward_model`)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    max_new_tokens: int = 0
    """Longest response (0 = what the built-in task needs; set it for your own data)."""
    max_staleness: int = 1
    """Policy versions the generators may run ahead of the learner (0 = synchronous)."""
    prompts_per_step: int = 256
    generator_replicas: int = 1
    channel_capacity: int = 64
    gpus: dict = field(default_factory=dict)
    """GPUs per node replica, e.g. '{"generator": 0.5, "learner": 0.5}' (fractions share a GPU)."""
    max_steps: int = 200
    """Stop after this many learner steps (--max-steps overrides)."""
    target_reward: float = 0.0
    """Stop as soon as the mean reward reaches this (0 = off)."""


config = PPOGraphConfig()


def wire_policy(cfg) -> int:
    """Give every node the same policy, batch size and staleness bound; returns max_new_tokens."""
    for node_cfg in (cfg.generator, cfg.reference, cfg.critic, cfg.learner):
        node_cfg.policy = cfg.policy
    cfg.prompts.prompts_per_step = cfg.learner.prompts_per_step = cfg.prompts_per_step
    cfg.prompts.max_staleness = cfg.learner.max_staleness = cfg.max_staleness
    cfg.learner.temperature = cfg.generator.temperature
    cfg.learner.target_reward = cfg.target_reward
    if cfg.policy.path:  # the reward node decodes responses with the policy's own tokenizer
        cfg.reward.tokenizer_path = cfg.policy.path
    if cfg.max_new_tokens:
        return cfg.max_new_tokens
    if cfg.prompts.path:
        raise ValueError("set max_new_tokens=N when prompts.path points at your own data")
    return make_task(cfg.prompts.task, cfg.prompts.num_digits).max_new_tokens


def node_gpus(cfg, name: str) -> float:
    unknown = set(cfg.gpus) - {"prompts", "generator", "reward", "reference", "critic", "learner"}
    if unknown:
        raise ConfigError(f"--set gpus: unknown node(s) {', '.join(sorted(unknown))}")
    return float(cfg.gpus.get(name, 0.0))


def add_rollout_nodes(g: Graph, cfg) -> str:
    """prompts -> generator -> reward -> reference, shared by the PPO and GRPO graphs.
    Returns the port that carries finished rollouts (with rewards and reference log-probs)."""
    g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
    g.node("generator", Generator, cfg.generator, cpus=1, replicas=cfg.generator_replicas,
           gpus=node_gpus(cfg, "generator"))
    if cfg.reward_kind == "model":
        g.node("reward", RewardModel, cfg.reward_model, cpus=0.2, gpus=node_gpus(cfg, "reward"))
    else:
        g.node("reward", Reward, cfg.reward, cpus=0.1)
    g.node("reference", Reference, cfg.reference, cpus=0.2, gpus=node_gpus(cfg, "reference"))
    cap = cfg.channel_capacity
    g.channel("prompts.prompts", "generator.prompts", capacity=cap, name="prompts")
    g.channel("generator.samples", "reward.samples", capacity=cap, name="samples")
    g.channel("reward.scored", "reference.scored", capacity=cap, name="scored")
    # Generators first: the prompt source must not admit a batch before they hold its weights.
    g.versioned("policy", src="learner", dst=["generator", "prompts"])
    return "reference.with_ref"


PROGRESS = ["reward/mean±reward/std", "kl", "entropy", "staleness/mean", "perf/samples_per_s"]


def build(cfg: PPOGraphConfig) -> Graph:
    cfg.generator.max_new_tokens = wire_policy(cfg)
    cfg.learner.algorithm = "ppo"
    cfg.critic.train_samples = cfg.prompts_per_step
    g = Graph("ppo", max_steps=cfg.max_steps, progress=PROGRESS)
    rollouts = add_rollout_nodes(g, cfg)
    g.node("critic", Critic, cfg.critic, cpus=0.5, gpus=node_gpus(cfg, "critic"))
    g.node("learner", Learner, cfg.learner, cpus=1, ends_run=True, gpus=node_gpus(cfg, "learner"))
    g.channel(rollouts, "critic.with_ref", capacity=cfg.channel_capacity, name="with_ref")
    g.channel("critic.advantaged", "learner.rollouts", capacity=cfg.channel_capacity, name="rollouts")
    return g
