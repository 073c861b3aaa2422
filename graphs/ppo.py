"""PPO as a streaming graph. Run: python -m dataflow.run graphs/ppo.py [--set key=value ...]

    prompts ──> generator (x replicas) ──> reward ──> reference ──> critic ──> learner
       ▲              ▲                                                          │
       └──────────────┴────────────── policy (versioned, latest wins) ◄──────────┘

Each arrow is a bounded channel: scoring, reference log-probs and critic values run on samples as
they stream out of the generators, overlapping rollout. The learner trains step k on prompt batch
k, then pushes version k+1 to the generators; the prompt source admits batch k only once version
>= k - max_staleness exists (max_staleness=0: synchronous on-policy PPO).

Out of the box: the built-in task (rl/tasks.py: copy 3 digits, per-position credit) on a tiny
random-init Llama, CPU only. Your own model, data and reward:
    --set policy.path=/path/to/hf_model_dir --set prompts.path=data.jsonl \
    --set reward.path=my_reward.py --set max_new_tokens=64
On GPUs: --set placement=colocated --set num_gpus=N (every model node on every GPU), or
placement=split (generators on their own GPUs); --describe prints which node runs on which GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from dataflow import ConfigError, Graph
from nodes.critic import Critic, CriticConfig
from nodes.generator import Generator, GeneratorConfig
from nodes.learner import KLConfig, Learner, LearnerConfig
from rl.policy import PolicySpec
from nodes.prompts import PromptConfig, PromptSource
from nodes.reference import Reference, ReferenceConfig
from nodes.reward import Reward, RewardConfig
from nodes.reward_model import RewardModel, RewardModelConfig
from rl.tasks import make_task
from dataflow.weights.sync import SYNC_EDGE
from dataflow.weights.multirank import CRITIC_RANKS_EDGE, RANKS_EDGE


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
    weight_transport: Literal["auto", "object_store", "collective", "cuda_ipc"] = "auto"
    """How the learner's weights reach the generators. auto: cuda_ipc for placement=colocated with
    num_gpus=1 (measured fastest there, bench/RESULTS.md), else object_store. object_store: a state dict through Ray's
    object store. collective: the HybridEngine push (gloo; NCCL when each end has a GPU of its
    own; llama/qwen2 policies), the `policy` edge then carries only the version. cuda_ipc: learner
    and every generator on ONE physical GPU (placement=colocated, num_gpus=1): the learner writes
    its weights, cast to the generators' dtype (learner.weight_sync.dtype), into GPU buffers it
    shares by CUDA IPC and each generator copies them on the GPU; no CPU round trip, costs two
    model-sized buffers on the learner and one per generator. Fails on CPU or across GPUs."""
    weight_checksums: bool = False
    """Log a checksum of the weights per version, learner and generators (metrics.jsonl)."""
    prompts_per_step: int = 256
    generator_replicas: int = 0
    """Generator actors (0 = one per generator GPU, or 1 on CPU)."""
    channel_capacity: int = 64
    placement: Literal["cpu", "colocated", "split"] = "cpu"
    """Where the model nodes run. cpu: no GPU. colocated: one pool of num_gpus GPUs that the
    generators (one per GPU), reference, critic and learner share, in equal shares, as evenly as
    they go. split: the generators get GPUs 0..num_gpus-2 (one whole GPU each), the learner side
    (reference, critic, learner: equal shares) the last GPU. Each share caps that node's GPU memory;
    gpu_shares sets them per node."""
    num_gpus: int = 1
    """GPUs for placement=colocated or split (the cluster must have them; checked at start)."""
    reward_model_gpu_share: float = 0.0
    """With reward_kind=model and a GPU placement: the reward model's share of one GPU of the
    learner's pool (the other shares there shrink to make room). 0 = the reward model on CPU."""
    gpu_shares: dict[str, float] = field(default_factory=dict)
    """A fraction of one GPU for named model nodes (generator, reference, critic, learner), each
    replica, e.g. '{"learner": 0.5}'. Where all of a pool's nodes share one GPU (colocated with
    num_gpus=1, split's learner GPU), the nodes not named split what is left equally; on several
    colocated GPUs they keep their equal shares and the plan checks that everything fits. A share
    caps the node's GPU memory too: give the learner more when a larger micro-batch needs it."""
    max_steps: int = 200
    """Stop after this many learner steps (--max-steps overrides)."""
    target_reward: float = 0.0
    """Stop as soon as the mean reward reaches this (0 = off)."""
    save_interval: int = 0
    """Checkpoint every this many steps and on Ctrl-C (0 = off); continue with --resume DIR."""
    keep_checkpoints: int = 3
    """Checkpoints kept under <run>/checkpoints: older ones are deleted once a newer one is saved
    (0 = keep all)."""
    drop_bad_items: bool = False
    """Drop (and count) channel items that fail to decode, instead of failing the node reading them."""
    max_restarts: int = 3
    """Times a generator, reward, reference, critic or prompt source replica is restarted after its
    process dies (its prompts are re-issued); the learner's death stops the run."""


config = PPOGraphConfig()


def wire_policy(cfg) -> int:
    """Give every node the same policy, batch size and staleness bound; returns max_new_tokens."""
    for node_cfg in (cfg.generator, cfg.reference, cfg.critic, cfg.learner):
        node_cfg.policy = cfg.policy
    cfg.prompts.prompts_per_step = cfg.learner.prompts_per_step = cfg.prompts_per_step
    cfg.prompts.max_staleness = cfg.learner.max_staleness = cfg.max_staleness
    cfg.learner.temperature = cfg.reference.temperature = cfg.generator.temperature
    cfg.learner.target_reward = cfg.target_reward
    if cfg.weight_transport == "auto":  # written back, so config.json records what ran
        one_gpu = cfg.placement == "colocated" and cfg.num_gpus == 1
        cfg.weight_transport = "cuda_ipc" if one_gpu else "object_store"
    for sync in (cfg.learner.weight_sync, cfg.generator.weight_sync):
        sync.transport, sync.checksums = cfg.weight_transport, sync.checksums or cfg.weight_checksums
    if cfg.learner.weight_sync.dtype == "auto":  # weights travel in the generators' dtype
        gen = cfg.generator.dtype
        cfg.learner.weight_sync.dtype = gen if gen != "auto" else "float32" if cfg.placement == "cpu" else "bfloat16"
    if cfg.policy.path:  # the reward node decodes responses with the policy's own tokenizer
        cfg.reward.tokenizer_path = cfg.policy.path
    if cfg.max_new_tokens:
        return cfg.max_new_tokens
    if cfg.prompts.path:
        raise ValueError("set max_new_tokens=N when prompts.path points at your own data")
    return make_task(cfg.prompts.task, cfg.prompts.num_digits).max_new_tokens


def gpu_layout(g: Graph, cfg, trainers: tuple[str, ...]) -> dict[str, dict]:
    """Declare the GPU pools that cfg.placement asks for; returns g.node() keyword arguments
    (pool, gpus, replicas) per node. `trainers`: the learner-side nodes (the learner and critic
    are dp x tp actors each, the others one)."""
    n, share = cfg.num_gpus, cfg.reward_model_gpu_share
    if share and cfg.reward_kind != "model":
        raise ConfigError("reward_model_gpu_share is set, but reward_kind is 'function' (a program on CPU); "
                          "set reward_kind=model or leave the share at 0")
    if not 0 <= share < 1:
        raise ConfigError(f"reward_model_gpu_share must be in [0, 1) (got {share})")
    if cfg.placement == "cpu":
        if share:
            raise ConfigError("reward_model_gpu_share needs placement=colocated or split (placement=cpu uses no GPU)")
        return {"generator": {"replicas": cfg.generator_replicas or 1}}
    if n < 1 or (cfg.placement == "split" and n < 2):
        raise ConfigError(f"placement={cfg.placement} needs num_gpus >= {1 if cfg.placement == 'colocated' else 2}"
                          f" (got {n}); split puts the generators and the learner side on different GPUs")
    for node, ranks in (("learner", _learner_ranks(cfg)), ("critic", _critic_ranks(cfg))):
        pool_gpus = n if cfg.placement == "colocated" else 1   # split: the train pool is one GPU
        if node in trainers and ranks > pool_gpus:
            raise ConfigError(f"{node}.dp x {node}.tp = {ranks} ranks need a GPU each (NCCL puts one rank on a "
                              f"GPU), but placement={cfg.placement} gives the {node} {pool_gpus}: use "
                              f"placement=colocated with num_gpus >= {ranks} (or placement=cpu, gloo)")
    if cfg.placement == "colocated":
        g.pool("gpus", gpus=n)
        gens = cfg.generator_replicas or n
        # The most equal shares one GPU has to hold (the learner and critic are dp x tp actors each).
        per_gpu = math.ceil((gens + _trainer_actors(cfg, trainers)) / n)
        layout = {name: {"pool": "gpus", "gpus": (1 - share) / per_gpu} for name in ("generator", *trainers)}
        train_pool = "gpus"
    else:
        g.pool("rollout", gpus=n - 1)
        g.pool("train", gpus=1)
        gens = cfg.generator_replicas or n - 1
        layout = {"generator": {"pool": "rollout", "gpus": 1 / math.ceil(gens / (n - 1))}}
        actors = _trainer_actors(cfg, trainers)
        layout.update({name: {"pool": "train", "gpus": (1 - share) / actors} for name in trainers})
        train_pool = "train"
    layout["generator"]["replicas"] = gens
    if share:
        layout["reward"] = {"pool": train_pool, "gpus": share}
    if cfg.gpu_shares:
        one_gpu_pools = {"gpus"} if cfg.placement == "colocated" and n == 1 else {"train"}
        actors = {"generator": gens, "learner": _learner_ranks(cfg), "critic": _critic_ranks(cfg)}
        apply_gpu_shares(layout, cfg.gpu_shares, one_gpu_pools, actors)
    return layout


def apply_gpu_shares(layout: dict[str, dict], shares: dict[str, float], one_gpu_pools: set[str],
                     actors: dict[str, int]) -> None:
    """Set the named nodes' per-replica GPU fraction in `layout` (gpu_layout's); in a pool whose
    nodes all share one GPU, the unnamed ones (but a reward model's fixed share) split the rest."""
    known = [n for n in layout if n != "reward"]
    for name, value in shares.items():
        if name not in known:
            raise ConfigError(f"gpu_shares: '{name}' is not a model node on a GPU here; "
                              f"name one of {', '.join(known)}")
        if not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(f"gpu_shares: {name}={value!r}; a share is a fraction of one GPU in (0, 1]")
        layout[name]["gpus"] = float(value)
    for pool in one_gpu_pools:
        members = [n for n, spec in layout.items() if spec.get("pool") == pool]
        used = sum(layout[n]["gpus"] * actors.get(n, 1) for n in members if n in shares or n == "reward")
        rest = [n for n in members if n not in shares and n != "reward"]
        left = 1.0 - used
        if left < -1e-9 or (rest and left <= 1e-9):
            named = ", ".join(f"{n} {layout[n]['gpus']:g} x {actors.get(n, 1)}" for n in members
                              if n in shares or n == "reward")
            raise ConfigError(f"gpu_shares: {named} take {used:g} of one GPU, leaving "
                              f"{max(left, 0):g} for {', '.join(rest) or 'nothing'}; lower them")
        for n in rest:
            layout[n]["gpus"] = left / sum(actors.get(m, 1) for m in rest)


def add_rollout_nodes(g: Graph, cfg, on_gpus: dict[str, dict]) -> str:
    """prompts -> generator -> reward -> reference, shared by the PPO and GRPO graphs; `on_gpus`
    from gpu_layout. Returns the port that carries finished rollouts (with rewards and reference log-probs)."""
    g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
    g.node("generator", Generator, cfg.generator, cpus=1, **on_gpus["generator"])
    if cfg.reward_kind == "model":
        g.node("reward", RewardModel, cfg.reward_model, cpus=0.2, **on_gpus.get("reward", {}))
    else:
        g.node("reward", Reward, cfg.reward, cpus=0.1)
    g.node("reference", Reference, cfg.reference, cpus=0.2, **on_gpus.get("reference", {}))
    cap = cfg.channel_capacity
    g.channel("prompts.prompts", "generator.prompts", capacity=cap, name="prompts")
    g.channel("generator.samples", "reward.samples", capacity=cap, name="samples")
    g.channel("reward.scored", "reference.scored", capacity=cap, name="scored")
    # Generators first: the prompt source must not admit a batch before they hold its weights.
    g.versioned("policy", src="learner", dst=["generator", "prompts"])
    if cfg.weight_transport == "collective":  # the push group's rendezvous (dataflow/weights/sync.py)
        g.versioned(SYNC_EDGE, src="learner", dst=["generator"])
    return "reference.with_ref"


def _learner_ranks(cfg) -> int:
    return cfg.learner.dp * cfg.learner.tp


def _critic_ranks(cfg) -> int:
    return cfg.critic.dp * cfg.critic.tp


def _trainer_actors(cfg, trainers: tuple[str, ...]) -> int:
    """Actors of the learner-side nodes: one each, the learner's and critic's dp x tp ranks."""
    ranks = {"learner": _learner_ranks(cfg), "critic": _critic_ranks(cfg)}
    return sum(ranks.get(name, 1) for name in trainers)


def add_learner(g: Graph, cfg, on_gpus: dict[str, dict]) -> None:
    """The learner: learner.dp x learner.tp replicas, the ranks of one FSDP2 x TP job
    (dataflow/weights/multirank.py), which meet through the versioned edge RANKS_EDGE (learner -> itself)."""
    ranks = _learner_ranks(cfg)
    g.node("learner", Learner, cfg.learner, cpus=1, ends_run=True, replicas=ranks, **on_gpus.get("learner", {}))
    if ranks > 1:
        g.versioned(RANKS_EDGE, src="learner", dst=["learner"])


PROGRESS = ["reward/mean±reward/std", "kl", "entropy", "staleness/mean", "perf/samples_per_s"]


def build(cfg: PPOGraphConfig) -> Graph:
    cfg.generator.max_new_tokens = wire_policy(cfg)
    cfg.learner.algorithm = "ppo"
    cfg.critic.train_samples = cfg.prompts_per_step
    g = Graph("ppo", max_steps=cfg.max_steps, progress=PROGRESS, save_interval=cfg.save_interval,
              keep_checkpoints=cfg.keep_checkpoints, max_restarts=cfg.max_restarts, drop_bad_items=cfg.drop_bad_items)
    on_gpus = gpu_layout(g, cfg, trainers=("reference", "critic", "learner"))
    rollouts = add_rollout_nodes(g, cfg, on_gpus)
    critic_ranks = _critic_ranks(cfg)  # dp x tp replicas, the ranks of one job, as the learner's
    g.node("critic", Critic, cfg.critic, cpus=0.5, replicas=critic_ranks, **on_gpus.get("critic", {}))
    if critic_ranks > 1:
        g.versioned(CRITIC_RANKS_EDGE, src="critic", dst=["critic"])
    add_learner(g, cfg, on_gpus)
    g.channel(rollouts, "critic.with_ref", capacity=cfg.channel_capacity, name="with_ref")
    g.channel("critic.advantaged", "learner.rollouts", capacity=cfg.channel_capacity, name="rollouts")
    return g
