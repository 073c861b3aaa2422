"""The driver: starts one Ray actor per node replica, wires them, watches them, until the run ends.

    load_graph(path, overrides) -> Graph        (user mistakes raise UserError, nothing started)
    describe(graph) -> str                      (--describe)
    await run_graph(graph, options) -> summary  (the run, top to bottom, in one function)

The driver never touches items: channels pull directly between node actors. It only polls each
host for events (progress, logs, trace data) and waits on the hosts' run() calls, so a node that
raises or dies is reported by name as soon as Ray tells of it, also while a poll, a restart or a
checkpoint save is in progress (failures.unless_the_run_ends).

Its parts are the other files of dataflow/driver/; docs/architecture.md maps every file of the engine.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from pathlib import Path
from typing import Any

from dataflow.actor import checkpoint, snapshots
from dataflow import placement
from dataflow.driver.checkpointer import Checkpointer
from dataflow.errors import NodeFailed, UserError
from dataflow.driver.failures import (awaitable, death_summary, discard, failed, gather_named, gather_setups,
                                      raise_first_failure, raise_if_failed, result_of, unless_the_run_ends,
                                      wait_for_root_cause)
from dataflow.graph import Graph
from dataflow.actor.host import HostSpec, NodeHost
from dataflow.driver.launch import clock_offset, cluster_address, shutdown, start_ray, stop_all, wiring
from dataflow.driver.loading import describe, load_graph
from dataflow.driver.monitor import Monitor, RunSummary
from dataflow.driver.options import RunOptions
from dataflow.driver.restarts import ends_the_run, refusals, restart, restartable
from dataflow.driver.resume import checkpoint_to_resume
from dataflow.driver.stall import StallWatch
from dataflow.driver import warm

__all__ = ["RunOptions", "RunSummary", "describe", "load_graph", "run_graph"]

POLL_INTERVAL_S = 0.5
LAST_LOGS_S = 1.0  # how long a failure's report waits for the hosts' last events


async def run_graph(graph: Graph, options: RunOptions, config: Any = None) -> RunSummary:
    """Run `graph` to its end (sources exhausted, max steps, or a failure). Raises NodeFailed."""
    import ray

    resume, resume_step = None, 0
    if options.resume:
        resume = checkpoint_to_resume(options.resume)  # intact, or a UserError naming the one to use
        manifest = checkpoint.read_manifest(resume)
        if manifest.get("graph") != graph.name:
            raise UserError(f"--resume {resume}: a checkpoint of graph '{manifest.get('graph')}', not '{graph.name}'")
        resume_step = manifest["step"]
    default_dir = resume.parent.parent if resume else f"runs/{graph.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(options.out_dir or default_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    snapshots.clear_snapshots(run_dir)
    max_steps = options.max_steps if options.max_steps is not None else graph.max_steps
    t_ray = time.time()
    started_ray = await start_ray(graph, options)
    monitor = Monitor(graph, run_dir, options, config, resume, resume_step)
    monitor.ray_s = monitor.t_start - t_ray
    stall = StallWatch(graph, run_dir, monitor.stack_servers)
    hosts: dict[str, Any] = {}
    running: dict[asyncio.Future, str] = {}  # run() calls in flight -> replica name
    checkpoints = Checkpointer(graph, hosts, monitor)
    pgs: dict = {}  # placement groups by pool name
    keepable, kept = set(), []  # groups whose processes may be kept for the next run, and those kept
    try:
        # 1. Place (dataflow/placement.py): check the plan against the cluster's GPUs, then one
        #    placement group per pool (and one for the nodes without a pool), each actor in its bundle.
        #    With keep_processes, a previous run's processes of the same placement are taken instead
        #    of new ones (dataflow/driver/warm.py).
        plan = placement.plan(graph, placement.cluster_gpus())
        restarts = {r: graph.max_restarts if graph.nodes[s.node].restartable else 0 for r, s in plan.slots.items()}
        ray_outlives_run = not started_ray or cluster_address(options) is not None
        keepable = warm.keepable(plan, restarts) if options.keep_processes and ray_outlives_run else set()
        taken = await warm.take(plan, keepable, restarts) if ray_outlives_run else {}  # (a new Ray keeps nothing)
        specs: dict[str, HostSpec] = {}  # a restart rebinds its replica's process to this run's (restarts.restart)
        try:
            pgs = await placement.create_groups(plan, kept={n: k["pg"] for n, k in taken.items() if k["pg"] is not None},
                                                detached=keepable)
        except BaseException:
            warm.end_unused(taken)  # (the kept groups' placement groups went with the failure)
            raise
        actor_cls = ray.remote(NodeHost)
        rebinds = []
        for replica_name, slot in plan.slots.items():
            spec = graph.nodes[slot.node]
            host_spec = HostSpec(node=spec.name, replica=spec.replica_names().index(replica_name),
                                 num_replicas=spec.replicas, kind=spec.kind, config=spec.config,
                                 cpus=spec.cpus, gpus=slot.gpus, max_steps=max_steps,
                                 trace=options.trace_path is not None, run_dir=str(run_dir.resolve()),
                                 trace_kernels=options.trace_kernels, save_interval=graph.save_interval,
                                 drop_bad_items=graph.drop_bad_items, max_restarts=graph.max_restarts,
                                 memory_note=spec.memory_note, memory_cap=spec.memory_cap,
                                 gpu_turn=spec.gpu_turn,
                                 compile_cache=os.path.abspath(options.compile_cache) if options.compile_cache else "")
            specs[replica_name] = host_spec
            kept_host = warm.host_for(taken, slot)
            if kept_host is not None:
                hosts[replica_name] = kept_host
                rebinds.append(kept_host.rebind.remote(host_spec))
                continue
            # Ray restarts a dead actor in place (same handle, same bundle); never the run-ending node
            # or a rank of a multi-rank job (NodeSpec.restartable).
            detached = {"lifetime": "detached"} if (slot.group if slot.group is not None else warm.LOOSE) in keepable else {}
            hosts[replica_name] = actor_cls.options(name=None, max_restarts=restarts[replica_name], **detached,
                                                    **placement.actor_options(slot, pgs)).remote(host_spec)
        warm.end_unused(taken)
        await warm.lend(hosts, pgs, plan, keepable)
        await asyncio.gather(*rebinds)
        if rebinds:
            monitor.say(f"[dataflow] {len(rebinds)} of {len(hosts)} node processes are the previous run's (keep_processes)")

        # 2. Clocks: one time base for every trace event (NTP-style offset per process).
        for name, host in hosts.items():
            monitor.trace.set_clock_offset(name, await clock_offset(host))
        monitor.mark("actors")   # every actor process is up (its first call answered)

        # 3. Wire and set up every node (models are built here, in parallel).
        setups = await gather_setups({n: h.connect.remote(wiring(graph, n, hosts)) for n, h in hosts.items()})
        for name, result in setups.items():
            raise_if_failed(name, result)
        monitor.processes({n: r["pid"] for n, r in setups.items()}, {n: r["stacks"] for n, r in setups.items()})
        monitor.mark("setup", {n: r.get("setup_s", 0.0) for n, r in setups.items()},
                     {n: r.get("setup_parts", {}) for n, r in setups.items()})
        if resume is not None:  # every replica's state, before any node runs
            await _load_states(hosts, resume, resume_step)
            monitor.say(f"[dataflow] resumed from {resume} at step {resume_step}")
        monitor.started()
        stall.started()

        # 4. Run until the sources end, a run-ending node returns, something fails, or the run
        #    stalls (no step for too long: RunStalled names the node at the root of the wait).
        running.update({asyncio.ensure_future(awaitable(h.run.remote())): n for n, h in hosts.items()})
        status, ended = "done", {}  # replica -> why it ended, if it said (a source whose data ran out)
        ends = functools.partial(ends_the_run, graph, monitor=monitor)  # (replica, its run() result) -> bool
        while running:
            # The first run() to end (a node that died, failed or returned) and a node asking for a
            # checkpoint are handled at once; otherwise the loop wakes every POLL_INTERVAL_S to
            # poll the hosts' events.
            asked = checkpoints.watch_requests(set(running.values()))
            done, _ = await asyncio.wait([*running, *asked], timeout=POLL_INTERVAL_S,
                                         return_when=asyncio.FIRST_COMPLETED)
            done = {fut for fut in done if fut in running}
            # A poll waits for every host's answer, under load for seconds: raced like a save, below.
            _, ending = await unless_the_run_ends(monitor.poll(hosts), running, ends)
            results = {running.pop(fut): result_of(fut) for fut in done} | ending
            ended.update({n: r["reason"] for n, r in results.items() if isinstance(r, dict) and r.get("reason")})
            # A restart, or a save (a node asked for a checkpoint: ctx.checkpoint), takes seconds
            # under load; each is raced against the run() calls, so that a node that ends the run
            # meanwhile is reported now, not after it (a save so cut short is not committed).
            to_restart = [n for n, r in results.items() if restartable(graph, n, r, monitor)]
            for name in to_restart:
                del results[name]
            for name in to_restart:
                if any(failed(r) for r in results.values()):
                    break  # the run ends (a failure that is not restarted): no more restarts
                restarting = restart(graph, hosts, name, monitor, specs[name])
                run, ending = await unless_the_run_ends(restarting, running, ends)
                results.update(ending)
                if not ending:
                    running[run] = name
            while monitor.checkpoint_requests and not any(failed(r) for r in results.values()):
                requester, step = monitor.checkpoint_requests.pop(0)
                results.update(await checkpoints.save_unless_the_run_ends(step, requester, running, ends))
            checkpoints.raise_if_failed()  # an async_checkpoint write that failed
            if any(failed(r) for r in results.values()):
                await wait_for_root_cause(results, running)
                # The failed node's last logs, from the hosts that answer soon: one whose process is
                # being restarted answers only once it is up (5 s under load, POLL_TIMEOUT_S, measured).
                await monitor.poll(hosts, timeout_s=LAST_LOGS_S)
                raise_first_failure(results, refusals(graph, results, monitor.restarts))
            if any(graph.nodes[name.split("[")[0]].ends_run for name in results):
                status = "max steps reached" if max_steps and monitor.step >= max_steps else "done"
                await stop_all(hosts, running)
                break
            stall.stepped(monitor.step)
            await stall.check(hosts, set(running.values()))
        await checkpoints.wait()  # the run ends once its last checkpoint has committed
        checkpoints.raise_if_failed()
        await monitor.poll(hosts)
        if status == "done" and ended:  # the run ended because its input did
            short = f" after {monitor.step} of {max_steps} steps" if max_steps and monitor.step < max_steps else ""
            monitor.notes += [f"the run ended{short}: {name}: {why}" for name, why in ended.items()]
        if options.trace_kernels:
            kernels = await gather_named({n: h.stop_kernel_trace.remote() for n, h in hosts.items()})
            for name, recorded in kernels.items():
                if isinstance(recorded, dict):
                    monitor.trace.add_kernel_intervals(name, recorded["intervals"], recorded["window"])
        summary = monitor.finish(status)
        if keepable:
            kept, refused = await warm.keep(plan, keepable, restarts, monitor.restarts, pgs, hosts)  # out of pgs and hosts
            for replica, why in refused.items():
                monitor.say(f"[dataflow] {replica}'s process is not kept for the next run: {why}")
            if held := sum(len(group["hosts"]) for group in kept):
                monitor.say(f"[dataflow] {held} node processes kept for the next run of this placement; they hold "
                            "their CPUs and GPUs until a run without keep_processes or `ray stop` ends them")
        return summary
    except BaseException as e:
        await checkpoints.wait()  # a checkpoint being written in the background commits first
        if isinstance(e, asyncio.CancelledError) and graph.save_interval and running:
            await checkpoints.save(None, "interrupt")  # Ctrl-C / SIGTERM
        if isinstance(e, NodeFailed):  # where to continue from
            e.last_checkpoint = str(monitor.last_checkpoint or checkpoint.latest(run_dir) or "") or None
        if options.trace_path:  # a failed or interrupted run's timeline is the one worth reading
            monitor.trace.write(options.trace_path)
        raise
    finally:
        discard(running)
        checkpoints.stop_watching()
        monitor.close()
        if keepable:
            await warm.settle(kept)  # for the next run; the rest of what this run held is ended below
        await shutdown(hosts, pgs, started_ray, placement.remove_groups)


async def _load_states(hosts: dict, resume: Path, step: int) -> None:
    dirs = {n: checkpoint.replica_state_dir(resume, n) for n in hosts}
    loads = await gather_named({n: hosts[n].load_state.remote(str(d), step) for n, d in dirs.items() if d})
    for name, result in loads.items():
        if isinstance(result, BaseException):
            raise NodeFailed(name, f"loading its state from {resume} failed: {death_summary(result)}")
