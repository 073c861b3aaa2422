"""Restarts: a replica whose process died comes back in place, up to the graph's max_restarts.

Ray restarts the actor (same handle, same placement bundle, a fresh process); the driver then
wires it again, sets it up, loads its latest state and runs it, and tells its peers. Never the
run-ending node, nor a rank of a multi-rank node (NodeSpec.restartable).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from dataflow.actor import checkpoint, snapshots
from dataflow.errors import NodeFailed
from dataflow.driver.failures import awaitable, death_summary, discard, failed, gather_named, raise_if_failed
from dataflow.timeouts import wait_within
from dataflow.graph import Graph
from dataflow.driver.launch import clock_offset, wiring

if TYPE_CHECKING:
    from dataflow.driver.monitor import Monitor

RESTART_TIMEOUT_S = 300.0  # for a restarted replica's set-up


def restartable(graph: Graph, name: str, result: Any, monitor: Monitor) -> bool:
    """The process of a replica that may be restarted died (Ray restarts its actor in place)."""
    from ray.exceptions import RayActorError

    return (isinstance(result, RayActorError) and graph.nodes[name.split("[")[0]].restartable
            and monitor.restarts.get(name, 0) < graph.max_restarts)


def refusals(graph: Graph, results: dict, restarts: dict[str, int]) -> dict[str, str]:
    """Replica -> why its dead process is not restarted though the graph restarts nodes, for the
    run's failure report: its kind said why (Node.restart_refusal), or it used up max_restarts.
    (`restarts`: replica -> restarts so far. The run-ending node and the ranks of a multi-rank
    node are never restarted; their report names the checkpoint to resume from.)"""
    from ray.exceptions import RayActorError

    why = {}
    for name, result in results.items():
        spec = graph.nodes[name.split("[")[0]]
        if not isinstance(result, RayActorError) or graph.max_restarts == 0:
            continue
        if spec.restart_refusal:
            why[name] = spec.restart_refusal
        elif spec.restartable and restarts.get(name, 0) >= graph.max_restarts:
            why[name] = f"it was restarted {restarts[name]} time(s) already (max_restarts={graph.max_restarts})"
    return why


def ends_the_run(graph: Graph, name: str, result: Any, monitor: Monitor) -> bool:
    """A run() result the run cannot go on after: a failure, unless it is a death that is restarted."""
    return failed(result) and not restartable(graph, name, result, monitor)


async def restart(graph: Graph, hosts: dict, name: str, monitor: Monitor, spec: Any = None) -> asyncio.Future:
    """Bring back replica `name`, whose process died: Ray restarts its actor (same handle, a fresh
    process); here it gets the latest versions of its edges, is set up again, loads its latest state
    (its snapshot, if newer than the last checkpoint: dataflow/actor/snapshots.py), and runs. The takes
    its dead process left waiting at its producers are dropped, and every node hears of the restart:
    the prompt source re-issues the prompts not yet trained on (the items the dead process held are
    lost). `spec`: this run's HostSpec for it; Ray's restart runs the actor's constructor with the
    spec of the run that created it, which for a process kept from an earlier run
    (dataflow/driver/warm.py) is that run's. Returns its run() future."""
    n = monitor.restarts[name] = monitor.restarts.get(name, 0) + 1
    monitor.say(f"[dataflow] {name}: its process died; restarting it ({n} of at most {graph.max_restarts})")
    monitor.driver_tracer.instant("restart", node=name, attempt=n)
    node, host = name.split("[")[0], hosts[name]
    try:
        await wait_until_alive(host)
        if spec is not None:
            await host.rebind.remote(spec)
        for edge in graph.versioned_edges.values():  # before setup: a setup may wait for a version
            if node in edge.dst:
                await asyncio.gather(*(hosts[p].redeliver.remote(edge.name, name)
                                       for p in graph.nodes[edge.src].replica_names()))
        reply = await wait_within(awaitable(host.connect.remote(wiring(graph, name, hosts))), RESTART_TIMEOUT_S)
    except Exception as e:
        raise NodeFailed(name, f"its process died and the restart failed: {death_summary(e)}") from None
    raise_if_failed(name, reply)
    last = monitor.last_checkpoint
    try:
        monitor.trace.set_clock_offset(name, await clock_offset(host))
        # its latest state: a snapshot it wrote since the last checkpoint (the critic's), else that checkpoint's
        state_dir = snapshots.restore_dir(monitor.run_dir, last, name)
        if state_dir is not None:
            await host.load_state.remote(str(state_dir), checkpoint.read_manifest(last)["step"] if last else 0)
    except Exception as e:
        raise NodeFailed(name, f"restarted after its process died, then: {death_summary(e)}") from None
    # (a producer that is itself dead has a fresh outbox when it comes back: nothing to reset there)
    await gather_named({(p, ch.name): hosts[p].channel_reset_consumer.remote(ch.name, name)
                        for ch in graph.channels.values() if any(n == node for n, _ in ch.dst)
                        for p in graph.producers(ch.name)})
    run = asyncio.ensure_future(awaitable(host.run.remote()))
    # Recorded once it runs, before the peers hear of it: the driver cancels a restart when another
    # node ends the run meanwhile (failures.unless_the_run_ends), and this one is running by then.
    monitor.restarted(name, reply, state_dir)
    try:
        await gather_named({other: h.peer_restarted.remote(name) for other, h in hosts.items() if other != name})
    except BaseException:  # cancelled: the run ends, and the driver never sees this run() call
        discard([run])
        raise
    return run


async def wait_until_alive(host, timeout_s: float = RESTART_TIMEOUT_S) -> None:
    """Until Ray has restarted the actor (a call to it while it restarts fails at once)."""
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await host.clock.remote()
            return
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
