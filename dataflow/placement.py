"""Resource pools: which GPU of which pool each node replica runs on, decided before anything starts.

    g.pool("rollout", gpus=1)                                 # whole GPUs, reserved for the graph
    g.pool("train", gpus=1)
    g.node("generator", Generator, cfg, pool="rollout", gpus=1)        # a whole GPU per replica
    g.node("learner", Learner, cfg, pool="train", gpus=0.5)            # half of one GPU
    g.node("critic", Critic, cfg, pool="train", gpus=0.5)              # the other half

The rules (plan() applies them, describe() / --describe prints the result):
  1. A pool is `gpus` whole GPUs. Pools are exclusive (no GPU is in two pools), so their sizes add
     up, and the sum must fit the cluster.
  2. A node in a pool asks, per replica, for a share f <= 1 of one GPU (other nodes may share that
     GPU; the replica caps its own CUDA memory at f) or for k whole GPUs (nothing else goes there).
  3. Replicas are placed largest request first (declaration order among equals), each on the GPU
     of its pool with the most free share (the lowest index among equals); k whole GPUs take the k
     lowest fully free ones. Equal requests thus spread round-robin over the pool, and the shares
     on one GPU never add up to more than 1: a request that does not fit is an error.
  4. Each pool is one Ray placement group with one bundle {GPU: 1, CPU: what its replicas ask} per
     GPU (k GPUs of one replica make one bundle of k), STRICT_PACK by default (the pool's GPUs on
     one machine; strategy="PACK" lets a larger pool span machines). Every actor is scheduled into
     its bundle, so colocated replicas really share the GPU Ray reserved for that bundle.
  5. Nodes without a pool keep one bundle each in one PACK placement group: CPU nodes, and `gpus=`
     without a pool for simple use (Ray then picks the GPU).
Ray keeps resource amounts to 4 decimals, so shares are rounded down to 0.0001 (three nodes of 1/3
each still fit one GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dataflow.errors import GraphError, UserError
from dataflow.timeouts import wait_within

NO_POOL = "no pool"
STRATEGIES = ("STRICT_PACK", "PACK")
_EPS = 1e-9


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def share_of(gpus: float) -> float:
    """A GPU request as Ray will schedule it: whole numbers as they are, fractions rounded down to
    Ray's 0.0001 resolution (Ray rounds to nearest, which could make 1/6 + 1/6 + 2/3 exceed 1)."""
    gpus = float(gpus)
    return gpus if gpus.is_integer() else math.floor(gpus * 10_000 + 1e-6) / 10_000


@dataclass
class Slot:
    """Where one node replica runs."""

    replica: str
    node: str
    group: str | None  # a pool's name, NO_POOL, or None (asks for no resources: no placement group)
    bundle: int  # bundle index in that group's placement group
    gpus: float  # the actor's num_gpus: a share <= 1 of one GPU, or whole GPUs
    cpus: float
    devices: tuple[int, ...] = ()  # the GPUs of its pool it runs on


@dataclass
class Group:
    """One Ray placement group: a pool, or the nodes without one."""

    name: str
    strategy: str
    bundles: list[dict]
    where: str = ""
    gpus: int = 0  # a pool's size (0 for the no-pool group)
    usage: list[list[tuple[str, float]]] = field(default_factory=list)  # per pool GPU: (replica, share)


@dataclass
class Plan:
    groups: dict[str, Group]
    slots: dict[str, Slot]  # replica name -> where it runs, in graph order

    @property
    def cpus(self) -> float:
        return sum(s.cpus for s in self.slots.values())

    def text(self) -> str:
        """What --describe prints under `placement:`."""
        pools = [g for g in self.groups.values() if g.name != NO_POOL]
        lines = []
        if pools:
            lines.append(f"{_n(sum(p.gpus for p in pools), 'GPU')} in {_n(len(pools), 'exclusive pool')}, "
                         f"{self.cpus:g} CPUs in all; a share < 1 caps that replica's CUDA memory")
        for p in pools:
            lines.append(f"  pool '{p.name}': {_n(p.gpus, 'GPU')}, {p.strategy}, declared at {p.where}")
            for d, users in enumerate(p.usage):
                used = " + ".join(f"{r} {s:g}" for r, s in users) or "(idle)"
                lines.append(f"    GPU {d}: {used}")
        rest = self.groups.get(NO_POOL)
        if rest is not None:
            names = [s.replica for s in self.slots.values() if s.group == NO_POOL]
            gpus = sum(s.gpus for s in self.slots.values() if s.group == NO_POOL)
            what = (f"one placement group (PACK) of {_n(len(rest.bundles), 'bundle')}, one per node replica, "
                    f"{sum(b.get('CPU', 0) for b in rest.bundles):g} CPUs and {gpus:g} GPUs in all")
            lines.append(f"{what}: {', '.join(names)}" if not pools else f"  no pool: {what}: {', '.join(names)}")
        if not lines:
            lines.append("no resources asked (every node has cpus=0 and gpus=0)")
        return lines[0] + "".join("\n" + line for line in lines[1:])


def plan(graph, cluster: int | list[int] | None = None) -> Plan:
    """Place every replica of `graph`. `cluster`: the GPUs of each machine of the Ray cluster
    (an int: one machine), checked when given. Raises GraphError listing every problem."""
    result, problems = _place(graph)
    if cluster is not None:
        problems += _cluster_problems(graph, result, [cluster] if isinstance(cluster, int) else list(cluster))
    if len(problems) == 1:
        raise GraphError(f"invalid placement for graph '{graph.name}': {problems[0]}")
    if problems:
        raise GraphError(f"invalid placement for graph '{graph.name}':\n  " + "\n  ".join(problems))
    return result


def problems(graph) -> list[str]:
    """The problems plan() would raise for, without a cluster (Graph.validate uses it)."""
    return _place(graph)[1]


def _place(graph) -> tuple[Plan, list[str]]:
    problems: list[str] = []
    pools = getattr(graph, "pools", {})
    slots: dict[str, Slot] = {}
    groups: dict[str, Group] = {}
    for pool in pools.values():
        at = f"{pool.where}: pool '{pool.name}'"
        if pool.name == NO_POOL:
            problems.append(f"{at}: the name is reserved; pick another")
        elif not isinstance(pool.gpus, int) or isinstance(pool.gpus, bool) or pool.gpus < 1:
            problems.append(f"{at}: gpus must be a whole number >= 1 (got {pool.gpus!r}); "
                            "a pool holds whole GPUs, its nodes take fractions of them")
        elif pool.strategy not in STRATEGIES:
            problems.append(f"{at}: strategy must be one of {', '.join(STRATEGIES)} (got {pool.strategy!r})")
        elif not any(n.pool == pool.name for n in graph.nodes.values()):
            problems.append(f"{at} has no nodes; give a node pool='{pool.name}' or remove the pool")
        else:
            groups[pool.name], pool_problems = _place_pool(graph, pool, slots)
            problems += pool_problems
    no_pool = []
    for spec in graph.nodes.values():
        if spec.pool is not None and spec.pool not in pools:
            problems.append(f"{spec.where}: node '{spec.name}': unknown pool '{spec.pool}' (pools: "
                            f"{', '.join(pools) or 'none'}); declare it with g.pool('{spec.pool}', gpus=N) or fix the name")
        elif spec.pool is None:
            for replica in spec.replica_names():
                bundle = {k: v for k, v in (("CPU", float(spec.cpus)), ("GPU", share_of(spec.gpus))) if v}
                # Ray refuses an all-zero bundle: a replica that asks for nothing runs outside the group.
                group, index = (NO_POOL, len(no_pool)) if bundle else (None, -1)
                if bundle:
                    no_pool.append(bundle)
                slots[replica] = Slot(replica, spec.name, group, index, share_of(spec.gpus), float(spec.cpus))
    if no_pool:
        groups[NO_POOL] = Group(NO_POOL, "PACK", no_pool)
    order = [r for spec in graph.nodes.values() for r in spec.replica_names() if r in slots]
    return Plan(groups, {r: slots[r] for r in order}), problems


def _place_pool(graph, pool, slots: dict) -> tuple[Group, list[str]]:
    """Rule 3 for one pool: fills `slots`, returns the pool's Group and its problems."""
    problems, failed = [], set()
    free = [1.0] * pool.gpus
    usage: list[list[tuple[str, float]]] = [[] for _ in range(pool.gpus)]
    requests = [(spec, r) for spec in graph.nodes.values() if spec.pool == pool.name for r in spec.replica_names()]
    requests.sort(key=lambda req: -share_of(req[0].gpus))  # stable: declaration order among equals
    for spec, replica in requests:
        if spec.name in failed:  # one problem per node is enough
            continue
        want = share_of(spec.gpus)
        devices, why = _choose_gpus(want, free, usage)
        if why:
            problems.append(f"{spec.where}: node '{spec.name}' in pool '{pool.name}' ({pool.where}): "
                            f"replica {replica} {why}")
            failed.add(spec.name)
            continue
        for d in devices:
            free[d] -= min(want, 1.0)
            usage[d].append((replica, min(want, 1.0)))
        slots[replica] = Slot(replica, spec.name, pool.name, -1, want, float(spec.cpus), devices)
    # Bundles: one per GPU, except that the k GPUs of one replica make one bundle of k.
    bundles, bundle_of = [], {}
    for d in range(pool.gpus):
        if d not in bundle_of:
            held = next((s.devices for s in slots.values() if s.group == pool.name and d in s.devices), (d,))
            bundle_of.update({g: len(bundles) for g in held})
            bundles.append({"GPU": float(len(held))})
    for s in slots.values():
        if s.group == pool.name:
            s.bundle = bundle_of[s.devices[0]]
            if s.cpus:
                bundles[s.bundle]["CPU"] = bundles[s.bundle].get("CPU", 0.0) + s.cpus
    return Group(pool.name, pool.strategy, bundles, pool.where, pool.gpus, usage), problems


def _choose_gpus(want: float, free: list[float], usage: list) -> tuple[tuple[int, ...], str]:
    """Rule 3 for one replica: the pool GPUs it takes, or why it cannot have any."""
    if want <= 0:
        return (), (f"asks for gpus={want:g}; give it a share of a GPU (gpus=0.5) or whole GPUs "
                    "(gpus=1), or drop pool= to run it on CPU")
    if want < 1:
        d = max(range(len(free)), key=lambda i: (free[i], -i))  # the most free; the lowest on a tie
        if free[d] + _EPS >= want:
            return (d,), ""
        return (), (f"needs {want:g} of a GPU, but the most free on any GPU of the pool is {max(free[d], 0):.4g} "
                    f"({_usage_text(usage)}); lower the shares of the pool's nodes or give the pool more GPUs")
    if want > len(free):
        return (), (f"asks for {want:g} GPUs per replica, but the pool has {len(free)}; lower its gpus "
                    "or give the pool more GPUs")
    whole = [d for d in range(len(free)) if free[d] >= 1 - _EPS]
    if len(whole) < want:
        return (), (f"asks for {want:g} whole GPU(s), but only {len(whole)} of the pool's {len(free)} are free "
                    f"({_usage_text(usage)}); give the pool more GPUs or the node fewer replicas")
    return tuple(whole[:int(want)]), ""


def _usage_text(usage: list) -> str:
    return "; ".join(f"GPU {d}: " + (" + ".join(f"{r} {s:g}" for r, s in users) or "free")
                     for d, users in enumerate(usage))


def _cluster_problems(graph, result: Plan, machines: list[int]) -> list[str]:
    pools = [p for p in getattr(graph, "pools", {}).values() if p.name in result.groups]
    loose = sum(s.gpus for s in result.slots.values() if s.group == NO_POOL)
    need = sum(p.gpus for p in pools) + math.ceil(loose - _EPS)
    have, largest = sum(machines), max(machines, default=0)
    if need == 0:
        return []
    if have == 0:
        return [f"the graph needs {need} GPU(s) ({_needs_text(pools, loose)}), but the Ray cluster has none; "
                "run where Ray sees GPUs (or join a GPU cluster with --address), or run on CPU (no pools, gpus=0)"]
    problems = []
    for p in pools:
        if p.gpus > have:
            problems.append(f"{p.where}: pool '{p.name}' has {p.gpus} GPUs, but the cluster has {have}; make it smaller")
        elif p.strategy == "STRICT_PACK" and p.gpus > largest:
            problems.append(f"{p.where}: pool '{p.name}' (STRICT_PACK) needs its {p.gpus} GPUs on one machine, but "
                            f"the largest has {largest} (GPUs per machine: {', '.join(map(str, machines))}); "
                            "pass strategy='PACK' to let it span machines, or make it smaller")
    if not problems and need > have:
        problems.append(f"the graph needs {need} GPUs ({_needs_text(pools, loose)}; pools are exclusive: no GPU is "
                        f"in two of them), but the cluster has {have}; make the pools smaller, or let nodes share "
                        "one pool with fractional gpus")
    return problems


def _needs_text(pools: list, loose: float) -> str:
    parts = [f"pool '{p.name}' {p.gpus} at {p.where}" for p in pools]
    if loose:
        parts.append(f"nodes without a pool {loose:g}")
    return " + ".join(parts)


# ---- Ray: the only part that needs a cluster ----------------------------------------------------
def cluster_gpus() -> list[int]:
    """GPUs per live machine of the Ray cluster this process is connected to."""
    import ray

    return [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]


async def create_groups(result: Plan, timeout_s: float = 60.0, kept: dict | None = None,
                        detached: set | frozenset = frozenset()) -> dict:
    """One placement group per pool (and one for the nodes without a pool); waits until all are
    placed. Returns {group name: PlacementGroup}; raises UserError naming a group Ray cannot place.
    `kept`: groups already placed, by name (a previous run's); `detached`: the names of groups that
    may outlive this driver (dataflow/driver/warm.py)."""
    import asyncio
    import time

    import ray
    from ray.util.placement_group import placement_group

    deadline, pgs = time.monotonic() + timeout_s, {}
    try:
        for name, g in result.groups.items():
            pgs[name] = (kept or {}).get(name) or placement_group(
                g.bundles, strategy=g.strategy, lifetime="detached" if name in detached else None)
        for name, pg in pgs.items():  # one deadline for all: they are placed concurrently
            try:
                await wait_within(pg.ready(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                g = result.groups[name]
                what = (f"pool '{name}' ({g.where}): {g.strategy} bundles {g.bundles}" if name != NO_POOL
                        else f"the nodes without a pool: PACK bundles {g.bundles}")
                raise UserError(f"this Ray cluster cannot place {what} within {timeout_s:g} s (available: "
                                f"{ray.available_resources()}); lower cpus/gpus/replicas or the pool sizes") from None
    except BaseException:
        remove_groups(pgs)
        raise
    return pgs


def actor_options(slot: Slot, pgs: dict) -> dict:
    """`.options(...)` for the actor of one replica: its resources and its bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {"num_cpus": slot.cpus, "num_gpus": slot.gpus}
    if slot.group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pgs[slot.group], placement_group_bundle_index=slot.bundle)
    return options


def remove_groups(pgs: dict) -> None:
    from ray.util.placement_group import remove_placement_group

    for pg in pgs.values():
        try:
            remove_placement_group(pg)
        except Exception:
            pass
