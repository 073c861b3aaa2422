"""Node processes kept between graph runs on one Ray (RunOptions.keep_processes).

A script that runs several graphs (a sweep, a notebook, the test suite), or a user who runs
`python -m dataflow.run --address ... --keep-processes` again and again against a Ray started with
`ray start --head`, otherwise pays every node's process start and imports (torch, transformers, the
node's code: seconds per model node) at each run. With keep_processes, a run that ends cleanly keeps
its placement groups and their node processes, each host emptied (NodeHost.release); the next run
whose plan has a group of the same bundles takes them, and each kept host takes its new replica
(NodeHost.rebind) where a new process would have started.

The kept processes outlive the driver that made them: they and their placement groups are detached,
and a detached registry actor (KeptRegistry, one per Ray and version of this file) lists them. It
also lists what each live driver holds, so that what a driver killed mid-run held is ended by the
next driver that asks.

Kept only where nothing of the finished run can reach the next one:
- the same code: a driver that joined a cluster ships the project as a working_dir package named by
  a hash of its files, so an edited file means new processes (and the kept ones are ended);
- no replica of the group restarted during the run (Ray counts an actor's restarts over its life),
  and the next run asks for the same max_restarts per bundle (an actor's is fixed when it is made;
  a restart there runs the constructor with the spec of the run that made it, so the driver's
  restart rebinds it to the current run's first: dataflow/driver/restarts.py);
- the run ended without a failure, and every host of the group answered release() with True (not
  while a write or torch.distributed is alive; on a GPU once its memory is back to the allocator).
What is not kept, or not taken by the next run, is ended as before; release_all() ends the rest
(kept processes hold their CPUs and GPUs in Ray until then)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

from dataflow import placement
from dataflow.timeouts import wait_within

RELEASE_TIMEOUT_S = 10.0  # a host that does not answer release() within this is ended, not kept
LOOSE = ""  # the key of replicas that ask for no resources (no placement group: placement.Slot.group None)
# One registry per version of this file: a registry runs the code of the driver that made it, so a
# driver with other code ends the other versions' registries (and what they keep) first.
REGISTRY_PREFIX, NAMESPACE = "kept-processes-", "dataflow"
REGISTRY = REGISTRY_PREFIX + hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:12]


class KeptRegistry:
    """The kept groups of one Ray, each a dict {"key", "code", "pg", "hosts": {bundle: handle}}
    (plain data: a later driver's code may differ from the one that made this actor), and what
    each live driver (by job id) holds of the detached kind ({"pg", "hosts"})."""

    def __init__(self):
        self.kept: list[dict] = []
        self.lent: dict[str, list[dict]] = {}

    def swap(self, job: str) -> list[dict]:
        """Every kept group, lent to `job` from now on (none is kept any more)."""
        self._end_orphans()
        kept, self.kept = self.kept, []
        self.lent.setdefault(job, []).extend(kept)
        return kept

    def lend(self, job: str, groups: list[dict]) -> None:
        self.lent.setdefault(job, []).extend(groups)

    def settle(self, job: str, kept: list[dict]) -> None:
        """`job` is done with what it held (ended, or `kept` for the next run)."""
        self.lent.pop(job, None)
        self.kept.extend(kept)

    def end_all(self) -> int:
        """End what is kept (and what drivers that are gone held); what live drivers hold stays."""
        self._end_orphans()
        kept, self.kept = self.kept, []
        _end(kept)
        return sum(len(g["hosts"]) for g in kept)

    def count(self) -> int:
        return sum(len(g["hosts"]) for g in self.kept)

    def _end_orphans(self) -> None:
        """End what drivers that are gone held (killed mid-run: nothing of theirs ended it)."""
        import ray._private.state

        try:  # Ray's job table (a private API: where it changes, orphans wait for release_all or `ray stop`)
            dead = {j["JobID"] for j in ray._private.state.jobs() if j.get("IsDead")}
        except Exception:  # noqa: BLE001
            return
        for job in [j for j in self.lent if j in dead]:
            _end(self.lent.pop(job))


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
    """The plan's groups (and LOOSE) whose processes may be kept or taken: one actor per bundle
    (LOOSE: one max_restarts for all)."""
    ok: dict[str, bool] = {}
    seen: set = set()
    for slot in plan.slots.values():
        name = slot.group if slot.group is not None else LOOSE
        ok[name] = ok.get(name, True) and (name == LOOSE or (name, slot.bundle) not in seen)
        seen.add((name, slot.bundle))
    if LOOSE in ok and len(group_key(plan, LOOSE, restarts)[1]) > 1:
        ok[LOOSE] = False
    return {name for name, yes in ok.items() if yes}


def _registry():
    import ray

    _end_other_versions()
    return ray.remote(KeptRegistry).options(name=REGISTRY, namespace=NAMESPACE, lifetime="detached",
                                            get_if_exists=True, num_cpus=0).remote()


_versions_checked_by: tuple | None = None   # the driver (cluster, job id) that looked for other versions


def _end_other_versions() -> None:
    """Once per driver: a registry of other code can only come from a driver that ran before it."""
    global _versions_checked_by
    import ray

    driver = (ray.get_runtime_context().gcs_address, _job())
    if _versions_checked_by == driver:
        return
    _versions_checked_by = driver
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == NAMESPACE and actor["name"].startswith(REGISTRY_PREFIX) and actor["name"] != REGISTRY:
            try:
                other = ray.get_actor(actor["name"], namespace=NAMESPACE)
                ray.get(other.end_all.remote(), timeout=RELEASE_TIMEOUT_S)
                ray.kill(other)
            except Exception:  # noqa: BLE001 - gone meanwhile, or ended by another driver
                pass


def _existing_registry():
    import ray

    _end_other_versions()
    try:
        return ray.get_actor(REGISTRY, namespace=NAMESPACE)
    except ValueError:
        return None


def _job() -> str:
    import ray

    return ray.get_runtime_context().get_job_id()


def code_identity() -> str:
    """What the node processes this driver starts import: its job's working_dir package (a hash of
    the project's files) when it joined a cluster; "" when they import the machine's files."""
    import ray

    return str((ray.get_runtime_context().runtime_env or {}).get("working_dir", ""))


async def take(plan, allowed: set[str], restarts: dict[str, int]) -> dict[str, dict]:
    """The kept groups this plan reuses, by its group name (LOOSE too); every other kept group is
    ended now, so that its CPUs and GPUs are free for this run's placement."""
    if not allowed:
        await release_all_async()  # a run that keeps nothing takes nothing either (the resources)
        return {}
    kept = await _registry().swap.remote(_job())
    code, taken, rest = code_identity(), {}, []
    for group in kept:
        name = next((n for n in sorted(allowed - taken.keys())
                     if group["code"] == code and tuple(group["key"]) == group_key(plan, n, restarts)), None)
        if name is None:
            rest.append(group)
        else:
            taken[name] = group
    _end(rest)
    return taken


async def lend(hosts: dict, pgs: dict, plan, allowed: set[str]) -> None:
    """Tell the registry what of the allowed groups this driver made (detached: if the driver is
    killed, the next one ends them)."""
    if not allowed:
        return
    groups = [{"pg": pgs.get(name), "hosts": {r: hosts[r] for r, s in plan.slots.items()
                                              if (s.group if s.group is not None else LOOSE) == name and r in hosts}}
              for name in allowed]
    await _registry().lend.remote(_job(), groups)


async def keep(plan, allowed: set[str], restarts: dict[str, int], restarted, pgs: dict,
               hosts: dict) -> tuple[list[dict], dict[str, str]]:
    """After a clean run: release the hosts of each allowed group none of whose replicas restarted
    (`restarted`: their names); the groups whose every host said yes are taken out of `pgs` and
    `hosts` (what the run's shutdown ends) and returned, for settle(), with why each replica that
    said no did (its process and its group's are ended with the run)."""
    def group_of(replica: str) -> str:
        slot = plan.slots[replica]
        return slot.group if slot.group is not None else LOOSE

    allowed = allowed - {group_of(r) for r in restarted if r in plan.slots}
    by_group: dict[str, dict[int, str]] = {}
    for replica, slot in plan.slots.items():
        name = group_of(replica)
        if name in allowed and replica in hosts:
            by_group.setdefault(name, {})[slot.bundle if name != LOOSE else len(by_group.get(name, {}))] = replica
    code, kept, refused = code_identity(), [], {}
    for name, replicas in by_group.items():
        try:
            answers = await wait_within(asyncio.gather(*(hosts[r].release.remote() for r in replicas.values())),
                                        RELEASE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a host gone or slow: this group is ended with the run
            continue
        refused.update({r: a for r, a in zip(replicas.values(), answers) if a is not True})
        if not all(a is True for a in answers):
            continue
        kept.append({"key": group_key(plan, name, restarts), "code": code, "pg": pgs.pop(name, None),
                     "hosts": {i: hosts.pop(r) for i, r in replicas.items()}})
    return kept, refused


async def settle(kept: list[dict]) -> None:
    """The run is over: `kept` waits for the next run; the rest of what it held the run ends."""
    try:
        await _registry().settle.remote(_job(), kept)
    except Exception:  # noqa: BLE001 - the registry was ended meanwhile (a driver with other code)
        _end(kept)


def host_for(taken: dict[str, dict], slot) -> Any:
    """A kept process for this replica's slot, or None (a new one starts)."""
    kept = taken.get(slot.group if slot.group is not None else LOOSE)
    if kept is None or not kept["hosts"]:
        return None
    return kept["hosts"].pop(slot.bundle if slot.group is not None else next(iter(kept["hosts"])), None)


def end_unused(taken: dict[str, dict]) -> None:
    """End the taken processes no replica of this run got (LOOSE ones beyond its count)."""
    for kept in taken.values():
        kept["pg"] = None  # the run owns the taken groups now (placement.create_groups)
    _end(list(taken.values()))


def release_all() -> int:
    """End every kept process and placement group on the Ray this process is connected to (their
    CPUs and GPUs back to Ray). Returns how many processes were ended."""
    import ray

    registry = _existing_registry() if ray.is_initialized() else None
    return ray.get(registry.end_all.remote()) if registry is not None else 0


async def release_all_async() -> None:
    registry = _existing_registry()
    if registry is not None:
        await registry.end_all.remote()


def kept_processes() -> int:
    """How many node processes are kept for the next run (on the Ray this process is connected to)."""
    import ray

    registry = _existing_registry() if ray.is_initialized() else None
    return ray.get(registry.count.remote()) if registry is not None else 0


def _end(groups: list[dict]) -> None:
    import ray

    for group in groups:
        for host in group["hosts"].values():
            try:
                ray.kill(host)
            except Exception:  # noqa: BLE001 - already gone
                pass
    placement.remove_groups({i: g["pg"] for i, g in enumerate(groups) if g["pg"] is not None})
