"""GPU placement presets: where a graph's model nodes run, stated in one line.

    g.node("generator", Generator, cfg.generator, side="rollout", replicas=0)   # 0: one per rollout GPU
    g.node("reference", Reference, cfg.reference, side="train")
    g.node("learner", Learner, cfg.learner, side="train", replicas=dp * tp)     # the ranks of one job
    g.node("reward", RewardModel, cfg.reward_model, side="train", gpus=0.2)     # a fixed share
    g.place("colocated", num_gpus=2, gpu_shares={"learner": 0.5})

A node declared with `side` ("rollout": generation; "train": the nodes that score, train or take
log-probs on the learner's side) gets its pool, its GPU share and, with replicas=0, its replica
count from the preset; nodes without a side keep what they asked for (CPU nodes). The presets:

  cpu        no GPU: every node on CPU; replicas=0 means one.
  colocated  one pool "gpus" of num_gpus GPUs that every side node shares: the rollout nodes get one
             replica per GPU (replicas=0), and every replica the same share, as many per GPU as
             the most crowded GPU holds (ceil(replicas / num_gpus)), so they spread evenly.
  split      pool "rollout" (num_gpus - 1 GPUs, one whole GPU per rollout replica by default) and
             pool "train" (the last GPU, its replicas in equal shares).

A train node with a fixed `gpus` share keeps it; the equal shares of its pool shrink to make room
(on every GPU of a colocated pool). `gpu_shares` names nodes whose replicas get that fraction of a
GPU instead; on a pool of one GPU (colocated with num_gpus=1, split's train GPU) the nodes not named
split what is left. A train node whose replicas are the ranks of one job (dp x tp; NCCL puts one
rank on a GPU) needs as many GPUs in its pool. Every mistake is a ConfigError before anything
starts; dataflow/placement.py then places the pools' replicas on GPUs (and checks the cluster).
"""

from __future__ import annotations

import math

from dataflow.errors import ConfigError

PRESETS = ("cpu", "colocated", "split")
SIDES = ("rollout", "train")


def auto_weight_transport(placement: str, num_gpus: int) -> str:
    """The weight transport `weight_transport=auto` means: cuda_ipc when the learner and every
    generator share one GPU (placement=colocated, num_gpus=1: a device-to-device copy, no CPU round
    trip; bench/results/w1_step_h200_2026-11-30a.md), else object_store (works everywhere, across
    Ray nodes too)."""
    return "cuda_ipc" if placement == "colocated" and num_gpus == 1 else "object_store"


def place(graph, placement: str, *, num_gpus: int = 1, gpu_shares: dict[str, float] | None = None) -> None:
    """Apply preset `placement` to the side nodes of `graph` (declared so far): pools, shares, replicas."""
    if placement not in PRESETS:
        raise ConfigError(f"placement={placement!r}: choose one of {', '.join(PRESETS)}")
    graph.placement = placement
    side = [s for s in graph.nodes.values() if s.side is not None]
    rollout = [s for s in side if s.side == "rollout"]
    fixed = [s for s in side if s.side == "train" and s.gpus > 0]       # a share of their own (a reward model)
    equal = [s for s in side if s not in fixed]                         # rollout + train nodes in equal shares
    if placement == "cpu":
        if fixed:
            raise ConfigError(f"node '{fixed[0].name}' asks for gpus={fixed[0].gpus:g}, but placement=cpu uses no GPU; "
                              "use placement=colocated or split")
        for s in rollout:
            s.replicas = s.replicas or 1
        return
    n = num_gpus
    if n < 1 or (placement == "split" and n < 2):
        raise ConfigError(f"placement={placement} needs num_gpus >= {1 if placement == 'colocated' else 2}"
                          f" (got {n}); split puts the generators and the learner side on different GPUs")
    train_pool_gpus = n if placement == "colocated" else 1
    for s in equal:
        if s.side == "train" and s.replicas > train_pool_gpus and _is_ranks(s):
            what = f"{s.name}.dp x {s.name}.tp" if hasattr(s.config, "dp") and hasattr(s.config, "tp") else f"{s.name}'s"
            raise ConfigError(f"{what} = {s.replicas} ranks need a GPU each (NCCL puts one rank on a "
                              f"GPU), but placement={placement} gives the {s.name} {train_pool_gpus}: use "
                              f"placement=colocated with num_gpus >= {s.replicas} (or placement=cpu, gloo)")
    taken = sum(s.gpus for s in fixed)  # the fixed shares, on every GPU of the train pool
    if placement == "colocated":
        graph.pool("gpus", gpus=n)
        for s in rollout:
            s.replicas = s.replicas or n
        # The most equal shares one GPU has to hold.
        per_gpu = math.ceil(sum(s.replicas for s in equal) / n)
        for s in equal:
            s.pool, s.gpus = "gpus", (1 - taken) / per_gpu
        for s in fixed:
            s.pool = "gpus"
        one_gpu_pools = {"gpus"} if n == 1 else set()
    else:
        graph.pool("rollout", gpus=n - 1)
        graph.pool("train", gpus=1)
        for s in rollout:
            s.replicas = s.replicas or n - 1
            s.pool, s.gpus = "rollout", 1 / math.ceil(s.replicas / (n - 1))
        trainers = [s for s in equal if s.side == "train"]
        for s in trainers:
            s.pool, s.gpus = "train", (1 - taken) / sum(t.replicas for t in trainers)
        for s in fixed:
            s.pool = "train"
        one_gpu_pools = {"train"}
    if gpu_shares:
        _apply_gpu_shares(equal, fixed, gpu_shares, one_gpu_pools)


def _is_ranks(spec) -> bool:
    return getattr(spec.kind, "inputs_on_replica_0", False)


def _apply_gpu_shares(equal: list, fixed: list, shares: dict[str, float], one_gpu_pools: set[str]) -> None:
    """Give the named nodes' replicas their fraction of a GPU; in a pool whose nodes all share one
    GPU, the nodes not named (but the fixed shares) split the rest."""
    known = [s.name for s in equal]
    by_name = {s.name: s for s in equal}
    for name, value in shares.items():
        if name not in by_name:
            raise ConfigError(f"gpu_shares: '{name}' is not a model node on a GPU here; name one of {', '.join(known)}")
        if not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(f"gpu_shares: {name}={value!r}; a share is a fraction of one GPU in (0, 1]")
        by_name[name].gpus = float(value)
    for pool in one_gpu_pools:
        members = [s for s in equal + fixed if s.pool == pool]
        pinned = [s for s in members if s.name in shares or s in fixed]
        rest = [s for s in members if s not in pinned]
        used = sum(s.gpus * s.replicas for s in pinned)
        left = 1.0 - used
        if left < -1e-9 or (rest and left <= 1e-9):
            named = ", ".join(f"{s.name} {s.gpus:g} x {s.replicas}" for s in pinned)
            raise ConfigError(f"gpu_shares: {named} take {used:g} of one GPU, leaving "
                              f"{max(left, 0):g} for {', '.join(s.name for s in rest) or 'nothing'}; lower them")
        for s in rest:
            s.gpus = left / sum(r.replicas for r in rest)
