"""Node processes kept between one driver's graph runs (RunOptions.keep_processes).

A script that runs several graphs on a Ray instance it started itself (a sweep, a notebook, the test
suite) otherwise pays every node's process start and imports (torch, transformers, the node's code:
seconds per model node) again at each run. With keep_processes, a run that ends cleanly keeps its
CPU placement groups and their node processes, each host emptied (NodeHost.release); the next run
whose plan has a group of the same bundles takes them, and each kept host takes its new replica
(NodeHost.rebind) where a new process would have started.

Kept only where nothing of the finished run can reach the next one:
- no GPU in the group (a process keeps its CUDA context and cached memory, which the user's next
  step may want; kept GPU processes are a later change);
- no replica of the group restarted during the run (Ray counts an actor's restarts over its life),
  and the next run asks for the same max_restarts per bundle (an actor's is fixed when it is made;
  a restart there runs the constructor with the spec of the run that made it, so the driver's
  restart rebinds it to the current run's first: dataflow/driver/restarts.py);
- the run ended without a failure, and every host of the group answered release() with True.
What is not kept, or not taken by the next run, is ended as before; release_all() ends the rest
(a kept group holds its CPUs in Ray until then)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from dataflow import placement
from dataflow.timeouts import wait_within

RELEASE_TIMEOUT_S = 10.0  # a host that does not answer release() within this is ended, not kept
LOOSE = ""  # the key of replicas that ask for no resources (no placement group: placement.Slot.group None)


@dataclass
class KeptGroup:
    key: tuple
    ray_node: str             # the Ray instance the processes live in (a new ray.init makes them gone)
    pg: Any                   # its placement group (None for LOOSE)
    hosts: dict = field(default_factory=dict)  # bundle index -> NodeHost actor handle (LOOSE: any index)


_kept: list[KeptGroup] = []


def group_key(plan, name: str, restarts: dict[str, int]) -> tuple:
    """Groups with equal keys are interchangeable: the same strategy, bundles in order, and
    max_restarts of the actor in each bundle (LOOSE: of all its actors, which keepable makes equal)."""
    if name == LOOSE:
        return (LOOSE, sorted({restarts[r] for r, s in plan.slots.items() if s.group is None}))
    group = plan.groups[name]
    per_bundle = {s.bundle: restarts[r] for r, s in plan.slots.items() if s.group == name}
    return (group.strategy, tuple(tuple(sorted(b.items())) for b in group.bundles),
            tuple(per_bundle.get(i, 0) for i in range(len(group.bundles))))


def keepable(plan, restarts: dict[str, int]) -> set[str]:
    """The plan's groups (and LOOSE) whose processes may be kept or taken: CPU only, one actor per
    bundle (LOOSE: one max_restarts for all)."""
    ok: dict[str, bool] = {}
    seen: set = set()
    for slot in plan.slots.values():
        name = slot.group if slot.group is not None else LOOSE
        ok[name] = ok.get(name, True) and slot.gpus == 0 and (name == LOOSE or (name, slot.bundle) not in seen)
        seen.add((name, slot.bundle))
    for name, group in plan.groups.items():
        if any(b.get("GPU", 0) for b in group.bundles):
            ok[name] = False
    if LOOSE in ok and len(group_key(plan, LOOSE, restarts)[1]) > 1:
        ok[LOOSE] = False
    return {name for name, yes in ok.items() if yes}


def _ray_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def take(plan, allowed: set[str], restarts: dict[str, int]) -> dict[str, KeptGroup]:
    """The kept groups this plan reuses, by its group name (LOOSE too); every other kept group is
    ended now, so that its CPUs are free for this run's placement."""
    global _kept
    here, taken, rest = _ray_node(), {}, []
    for kept in _kept:
        if kept.ray_node != here:
            continue  # that Ray is gone, and its processes with it
        name = next((n for n in sorted(allowed - taken.keys()) if group_key(plan, n, restarts) == kept.key), None)
        if name is None:
            rest.append(kept)
        else:
            taken[name] = kept
    _kept = []
    _end(rest)
    return taken


async def keep(plan, allowed: set[str], restarts: dict[str, int], restarted, pgs: dict, hosts: dict) -> None:
    """After a clean run: release the hosts of each allowed group none of whose replicas restarted
    (`restarted`: their names) and keep the groups whose every host said yes, taking them out of
    `pgs` and `hosts` (what the run's shutdown ends)."""
    def group_of(replica: str) -> str:
        slot = plan.slots[replica]
        return slot.group if slot.group is not None else LOOSE

    allowed = allowed - {group_of(r) for r in restarted if r in plan.slots}
    by_group: dict[str, dict[int, str]] = {}
    for replica, slot in plan.slots.items():
        name = group_of(replica)
        if name in allowed and replica in hosts:
            by_group.setdefault(name, {})[slot.bundle if name != LOOSE else len(by_group.get(name, {}))] = replica
    here = _ray_node()
    for name, replicas in by_group.items():
        try:
            answers = await wait_within(asyncio.gather(*(hosts[r].release.remote() for r in replicas.values())),
                                        RELEASE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a host gone or slow: this group is ended with the run
            continue
        if not all(a is True for a in answers):
            continue
        key = group_key(plan, name, restarts)
        _kept.append(KeptGroup(key, here, pgs.pop(name, None), {i: hosts.pop(r) for i, r in replicas.items()}))


def host_for(taken: dict[str, KeptGroup], slot) -> Any:
    """A kept process for this replica's slot, or None (a new one starts)."""
    kept = taken.get(slot.group if slot.group is not None else LOOSE)
    if kept is None or not kept.hosts:
        return None
    return kept.hosts.pop(slot.bundle if slot.group is not None else next(iter(kept.hosts)), None)


def end_unused(taken: dict[str, KeptGroup]) -> None:
    """End the taken processes no replica of this run got (LOOSE ones beyond its count)."""
    for kept in taken.values():
        kept.pg = None  # the run owns the taken groups now (placement.create_groups)
    _end(list(taken.values()))


def release_all() -> None:
    """End every kept process and placement group (their CPUs back to Ray)."""
    global _kept
    rest, _kept = _kept, []
    _end([k for k in rest if k.ray_node == _ray_node()])


def kept_processes() -> int:
    """How many node processes are kept for the next run (on the Ray this process is connected to)."""
    here = _ray_node()
    return sum(len(k.hosts) for k in _kept if k.ray_node == here)


def _end(groups: list[KeptGroup]) -> None:
    import ray

    for kept in groups:
        for host in kept.hosts.values():
            try:
                ray.kill(host)
            except Exception:  # noqa: BLE001 - already gone
                pass
    placement.remove_groups({i: k.pg for i, k in enumerate(groups) if k.pg is not None})
