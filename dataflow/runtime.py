"""The driver: loads a graph file, starts one Ray actor per node replica, wires them, watches them.

    load_graph(path, overrides) -> Graph        (user mistakes raise UserError, nothing started)
    describe(graph) -> str                      (--describe)
    await run_graph(graph, options) -> summary  (the run, top to bottom, in one function)

The driver never touches items: channels pull directly between node actors. It only polls each
host for events (progress, logs, trace data) and waits on the hosts' run() calls, so a node that
raises or dies is reported by name within a poll interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dataflow import checkpoint
from dataflow.config import apply_overrides, flatten
from dataflow.errors import ConfigError, NodeFailed, UserError
from dataflow import placement
from dataflow.graph import Graph
from dataflow.host import HostSpec, NodeHost
from dataflow.trace.tracer import TraceCollector, Tracer, measure_clock_offset

PROJECT_ROOT = Path(__file__).resolve().parent.parent
POLL_INTERVAL_S = 0.5
STOP_GRACE_S = 5.0
ROOT_CAUSE_GRACE_S = 2.0  # how long a channel error waits for the failure of the node it names
RESTART_TIMEOUT_S = 300.0  # for a restarted replica's set-up


# ---- loading ------------------------------------------------------------------------------------
def load_graph(path: str, overrides: list[str] = ()) -> tuple[Graph, Any]:
    """Import a graph file and build its Graph with --set overrides applied. Returns (graph, config)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{path}: no such graph file")
    for p in (str(PROJECT_ROOT), str(file.resolve().parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    module_name = f"dataflow_graph_{file.stem}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise UserError(f"{path}:{e.lineno}: syntax error: {e.msg}\n    {(e.text or '').strip()}") from None
    except Exception as e:
        raise UserError(f"{_user_frame(e, file)}: {type(e).__name__}: {e}") from None
    # Node classes defined in the graph file itself travel to the actors by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)

    config = getattr(module, "config", None)
    if overrides:
        if config is None or not dataclasses.is_dataclass(config):
            raise ConfigError(f"{path}: --set given, but the graph file defines no `config` dataclass to set")
        config = apply_overrides(config, list(overrides))
    if hasattr(module, "build"):
        try:
            graph = module.build(config) if config is not None else module.build()
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{_user_frame(e, file)}: build() raised {type(e).__name__}: {e}") from None
    elif isinstance(getattr(module, "graph", None), Graph):
        graph = module.graph
    else:
        raise UserError(f"{path}: defines neither `build(config) -> Graph` nor `graph = Graph(...)`; add one")
    if not isinstance(graph, Graph):
        raise UserError(f"{path}: build() returned {type(graph).__name__}, expected a dataflow Graph")
    graph.validate(source=path)
    return graph, config


def _user_frame(e: BaseException, file: Path) -> str:
    """file:line of the deepest traceback frame inside the graph file (else the file)."""
    where = str(file)
    for frame in traceback.extract_tb(e.__traceback__):
        if Path(frame.filename).resolve() == file.resolve():
            where = f"{file}:{frame.lineno}"
    return where


def describe(graph: Graph, config: Any = None) -> str:
    lines = [f"graph '{graph.name}'", "nodes:"]
    for n in graph.nodes.values():
        res = f"cpus={n.cpus:g} gpus={n.gpus:g}" + (f" pool={n.pool}" if n.pool else "")
        lines.append(f"  {n.name:<12} {n.kind.__name__:<16} replicas={n.replicas} {res}"
                     f"{'  (ends the run)' if n.ends_run else ''}")
    lines.append("channels:")
    for c in graph.channels.values():
        src = ", ".join(f"{a}.{b}" for a, b in c.src)
        dst = ", ".join(f"{a}.{b}" for a, b in c.dst)
        lines.append(f"  {c.name:<12} {src} -> {dst}  capacity={c.capacity}{'  feedback' if c.feedback else ''}")
    if graph.versioned_edges:
        lines.append("versioned edges (latest wins):")
        for e in graph.versioned_edges.values():
            lines.append(f"  {e.name:<12} {e.src} -> {', '.join(e.dst)}")
    lines.append("placement: " + placement.plan(graph).text())
    if config is not None and dataclasses.is_dataclass(config):
        lines.append("settings (--set key=value):")
        lines += [f"  {k} = {v!r}" for k, v in flatten(config)]
    return "\n".join(lines)


# ---- running ------------------------------------------------------------------------------------
@dataclass
class RunOptions:
    address: str | None = None
    max_steps: int | None = None
    trace_path: str | None = None
    trace_kernels: bool = False
    out_dir: str | None = None
    verbose: bool = False
    quiet: bool = False
    resume: str | None = None
    """A checkpoint directory (or a run directory: its latest checkpoint) to continue from."""


@dataclass
class RunSummary:
    status: str
    steps: int
    seconds: float
    run_dir: str
    metrics_path: str
    artifacts: dict = field(default_factory=dict)
    report: str = ""
    restarts: dict = field(default_factory=dict)
    """Replica -> times its process died and it was restarted."""


async def run_graph(graph: Graph, options: RunOptions, config: Any = None) -> RunSummary:
    """Run `graph` to its end (sources exhausted, max steps, or a failure). Raises NodeFailed."""
    import ray

    resume, resume_step = None, 0
    if options.resume:
        resume = checkpoint.resolve(options.resume)
        manifest = checkpoint.read_manifest(resume)
        if manifest.get("graph") != graph.name:
            raise UserError(f"--resume {resume}: a checkpoint of graph '{manifest.get('graph')}', not '{graph.name}'")
        resume_step = manifest["step"]
    default_dir = resume.parent.parent if resume else f"runs/{graph.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(options.out_dir or default_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint.clear_snapshots(run_dir)
    max_steps = options.max_steps if options.max_steps is not None else graph.max_steps
    started_ray = _start_ray(graph, options)
    monitor = _Monitor(graph, run_dir, options, config, resume, resume_step)
    hosts: dict[str, Any] = {}
    running: dict[asyncio.Future, str] = {}  # run() calls in flight -> replica name
    pgs: dict = {}  # placement groups by pool name
    try:
        # 1. Place (dataflow/placement.py): check the plan against the cluster's GPUs, then one
        #    placement group per pool (and one for the nodes without a pool), each actor in its bundle.
        plan = placement.plan(graph, placement.cluster_gpus())
        pgs = await placement.create_groups(plan)
        actor_cls = ray.remote(NodeHost)
        for replica_name, slot in plan.slots.items():
            spec = graph.nodes[slot.node]
            host_spec = HostSpec(node=spec.name, replica=spec.replica_names().index(replica_name),
                                 num_replicas=spec.replicas, kind=spec.kind, config=spec.config,
                                 cpus=spec.cpus, gpus=slot.gpus, max_steps=max_steps,
                                 trace=options.trace_path is not None, run_dir=str(run_dir.resolve()),
                                 trace_kernels=options.trace_kernels, save_interval=graph.save_interval,
                                 drop_bad_items=graph.drop_bad_items, max_restarts=graph.max_restarts)
            # Ray restarts a dead actor in place (same handle, same bundle); never the run-ending node
            # or a rank of a multi-rank job (NodeSpec.restartable).
            restarts = graph.max_restarts if spec.restartable else 0
            hosts[replica_name] = actor_cls.options(name=None, max_restarts=restarts,
                                                    **placement.actor_options(slot, pgs)).remote(host_spec)

        # 2. Clocks: one time base for every trace event (NTP-style offset per process).
        for name, host in hosts.items():
            await _measure_clock(monitor, name, host)

        # 3. Wire and set up every node (models are built here, in parallel).
        setups = await _gather_setups({n: h.connect.remote(_wiring(graph, n, hosts)) for n, h in hosts.items()})
        for name, result in setups.items():
            _raise_if_failed(name, result)
        monitor.processes({n: r["pid"] for n, r in setups.items()})
        if resume is not None:  # every replica's state, before any node runs
            await _load_states(hosts, resume, resume_step)
            monitor.say(f"[dataflow] resumed from {resume} at step {resume_step}")
        monitor.started()

        # 4. Run until the sources end, a run-ending node returns, or something fails.
        running.update({asyncio.ensure_future(_awaitable(h.run.remote())): n for n, h in hosts.items()})
        status = "done"
        while running:
            done, _ = await asyncio.wait(running, timeout=POLL_INTERVAL_S)
            await monitor.poll(hosts)
            results = {running.pop(fut): _result(fut) for fut in done}
            for name in [n for n, r in results.items() if _restartable(graph, n, r, monitor)]:
                del results[name]
                running[await _restart(graph, hosts, name, monitor)] = name
            while monitor.checkpoint_requests:  # a node asked for a checkpoint (ctx.checkpoint)
                requester, step = monitor.checkpoint_requests.pop(0)
                await _save_checkpoint(graph, hosts, monitor, step, "interval", requester)
            if any(_failed(r) for r in results.values()):
                await _wait_for_root_cause(results, running)
                await monitor.poll(hosts)  # the failed node's last logs
                _raise_first_failure(results)
            if any(graph.nodes[name.split("[")[0]].ends_run for name in results):
                status = "max steps reached" if max_steps and monitor.step >= max_steps else "done"
                await _stop_all(hosts, running)
                break
        await monitor.poll(hosts)
        if options.trace_kernels:
            kernels = await _gather_named({n: h.stop_kernel_trace.remote() for n, h in hosts.items()})
            for name, recorded in kernels.items():
                if isinstance(recorded, dict):
                    monitor.trace.add_kernel_intervals(name, recorded["intervals"], recorded["window"])
        return monitor.finish(status)
    except BaseException as e:
        if isinstance(e, asyncio.CancelledError) and graph.save_interval and running:
            await _save_checkpoint(graph, hosts, monitor, None, "interrupt")  # Ctrl-C / SIGTERM
        if isinstance(e, NodeFailed):  # where to continue from
            e.last_checkpoint = str(monitor.last_checkpoint or checkpoint.latest(run_dir) or "") or None
        if options.trace_path:  # a failed or interrupted run's timeline is the one worth reading
            monitor.trace.write(options.trace_path)
        raise
    finally:
        _discard(running)
        monitor.metrics_file.close()
        await _shutdown(hosts, pgs, started_ray, placement.remove_groups)


async def _measure_clock(monitor: "_Monitor", name: str, host) -> None:
    samples = []
    for _ in range(3):
        t0 = time.time_ns() // 1000
        remote = await host.clock.remote()
        samples.append((t0, remote, time.time_ns() // 1000))
    monitor.trace.set_clock_offset(name, measure_clock_offset(samples))


def _restartable(graph: Graph, name: str, result: Any, monitor: "_Monitor") -> bool:
    """The process of a replica that may be restarted died (Ray restarts its actor in place)."""
    from ray.exceptions import RayActorError

    return (isinstance(result, RayActorError) and graph.nodes[name.split("[")[0]].restartable
            and monitor.restarts.get(name, 0) < graph.max_restarts)


async def _restart(graph: Graph, hosts: dict, name: str, monitor: "_Monitor") -> asyncio.Future:
    """Bring back replica `name`, whose process died: Ray restarts its actor (same handle, a fresh
    process); here it gets the latest versions of its edges, is set up again, loads its latest state
    (its snapshot, if newer than the last checkpoint: dataflow/checkpoint.py), and runs. Takes its dead process left waiting at its producers
    are dropped, and every node hears of the restart: the prompt source re-issues the prompts
    not yet trained on (the items the dead process held are lost). Returns its run() future."""
    n = monitor.restarts[name] = monitor.restarts.get(name, 0) + 1
    monitor.say(f"[dataflow] {name}: its process died; restarting it ({n} of at most {graph.max_restarts})")
    monitor.driver_tracer.instant("restart", node=name, attempt=n)
    node, host = name.split("[")[0], hosts[name]
    try:
        await _wait_until_alive(host)
        for edge in graph.versioned_edges.values():  # before setup: a setup may wait for a version
            if node in edge.dst:
                await asyncio.gather(*(hosts[p].redeliver.remote(edge.name, name)
                                       for p in graph.nodes[edge.src].replica_names()))
        reply = await asyncio.wait_for(_awaitable(host.connect.remote(_wiring(graph, name, hosts))), RESTART_TIMEOUT_S)
    except Exception as e:
        raise NodeFailed(name, f"its process died and the restart failed: {_death_summary(e)}") from None
    _raise_if_failed(name, reply)
    last = monitor.last_checkpoint
    try:
        await _measure_clock(monitor, name, host)
        # its latest state: a snapshot it wrote since the last checkpoint (the critic's), else that checkpoint's
        state_dir = checkpoint.restore_dir(monitor.run_dir, last, name)
        if state_dir is not None:
            await host.load_state.remote(str(state_dir), checkpoint.read_manifest(last)["step"] if last else 0)
    except Exception as e:
        raise NodeFailed(name, f"restarted after its process died, then: {_death_summary(e)}") from None
    # (a producer that is itself dead has a fresh outbox when it comes back: nothing to reset there)
    await _gather_named({(p, ch.name): hosts[p].channel_reset_consumer.remote(ch.name, name)
                         for ch in graph.channels.values() if any(n == node for n, _ in ch.dst)
                         for p in graph.producers(ch.name)})
    run = asyncio.ensure_future(_awaitable(host.run.remote()))
    await _gather_named({other: h.peer_restarted.remote(name) for other, h in hosts.items() if other != name})
    monitor.restarted(name, reply["pid"], state_dir)
    return run


async def _wait_until_alive(host, timeout_s: float = RESTART_TIMEOUT_S) -> None:
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


async def _load_states(hosts: dict, resume: Path, step: int) -> None:
    dirs = {n: checkpoint.replica_state_dir(resume, n) for n in hosts}
    loads = await _gather_named({n: hosts[n].load_state.remote(str(d), step) for n, d in dirs.items() if d})
    for name, result in loads.items():
        if isinstance(result, BaseException):
            raise NodeFailed(name, f"loading its state from {resume} failed: {_death_summary(result)}")


async def _save_checkpoint(graph: Graph, hosts: dict, monitor: "_Monitor", step: int | None, reason: str,
                           requester: str | None = None) -> Path | None:
    """Every replica saves its state for `step` (None: the step the run-ending node is at), then
    the checkpoint is committed (dataflow/checkpoint.py). Answers the requesting node."""
    first = [n for n in hosts if graph.nodes[n.split("[")[0]].ends_run]
    path, error = None, None
    try:
        path = await checkpoint.save(hosts, first, monitor.run_dir, step, {"graph": graph.name, "reason": reason},
                                     after_first=lambda: monitor.poll(hosts), previous=monitor.last_checkpoint)
    except Exception as e:
        error = f"checkpoint of step {step} failed: {type(e).__name__}: {e}"
        monitor.say(f"[dataflow] {error}")
    if requester is not None:
        try:
            await hosts[requester].checkpoint_done.remote(str(path) if path else None, error)
        except Exception:
            pass  # the requester died: its run() result reports it
    if path is not None:
        monitor.last_checkpoint = path
        monitor.artifacts["last checkpoint"] = str(path)
        try:
            checkpoint.prune(monitor.run_dir, graph.keep_checkpoints, path)
        except OSError as e:  # a full or read-only disk must not stop training
            monitor.say(f"[dataflow] could not delete old checkpoints (keep_checkpoints={graph.keep_checkpoints}): {e}")
        monitor.say(f"[dataflow] {'interrupted: ' if reason == 'interrupt' else ''}checkpoint of step "
                    f"{checkpoint.read_manifest(path)['step']} saved: {path}")
    return path


def _start_ray(graph: Graph, options: RunOptions) -> bool:
    """Start a local Ray instance (or join `address`). Returns True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    env = {"PYTHONPATH": os.pathsep.join(p for p in [str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")] if p)}
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=options.verbose,
                                  configure_logging=options.verbose, runtime_env={"env_vars": env})
    address = options.address or os.environ.get("RAY_ADDRESS")
    if address:
        kwargs["runtime_env"] = {"env_vars": env, "working_dir": str(PROJECT_ROOT),
                                 "excludes": ["runs/", ".git/", ".venv/", ".whl/", "**/__pycache__/"]}
        with _keep_sigterm_handler():
            ray.init(address=address, **kwargs)
    else:
        # Logical CPUs: a node's `cpus` is a share, so a 2-core laptop can still host the whole graph.
        needed = math.ceil(placement.plan(graph).cpus)
        with _keep_sigterm_handler():
            ray.init(num_cpus=max(os.cpu_count() or 1, needed), **kwargs)
    return True


@contextlib.contextmanager
def _keep_sigterm_handler():
    """ray.init installs SIGTERM handlers of its own (exit at once; for a local instance, kill its
    processes and exit) over the program's. When the program handles SIGTERM itself (the CLI stops
    the run like Ctrl-C: dataflow/run.py), keep its handler, also while ray.init runs: a SIGTERM
    during start-up then stops the run once Ray is up, and Ray is shut down with it (no stray agents)."""
    import ray._private.utils as ray_utils

    handler = signal.getsignal(signal.SIGTERM)
    if handler in (signal.SIG_DFL, signal.SIG_IGN, None) or threading.current_thread() is not threading.main_thread():
        yield  # nobody else handles SIGTERM: Ray's handlers clean up
        return
    set_handler = getattr(ray_utils, "set_sigterm_handler", None)
    if set_handler is not None:
        ray_utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        if set_handler is not None:
            ray_utils.set_sigterm_handler = set_handler
        signal.signal(signal.SIGTERM, handler)


def _wiring(graph: Graph, replica_name: str, hosts: dict) -> dict:
    node = replica_name.split("[")[0]
    wiring: dict[str, Any] = {"outputs": {}, "inputs": {}, "publishes": {}, "publish_timeout": {}}
    for ch in graph.channels.values():
        producers = graph.producers(ch.name)
        for n, port in ch.src:
            if n == node:
                wiring["outputs"][port] = {"channel": ch.name, "consumers": graph.consumers(ch.name),
                                           "capacity": max(1, math.ceil(ch.capacity / len(producers)))}
        for n, port in ch.dst:
            if n == node and replica_name in graph.consumers(ch.name):  # (inputs_on_replica_0)
                wiring["inputs"][port] = {"channel": ch.name, "producers": [(p, hosts[p]) for p in producers],
                                          "prefetch": max(1, math.ceil(ch.capacity / len(graph.consumers(ch.name))))}
    for edge in graph.versioned_edges.values():
        if edge.src == node:
            wiring["publishes"][edge.name] = [(r, hosts[r]) for d in edge.dst for r in graph.nodes[d].replica_names()]
            wiring["publish_timeout"][edge.name] = edge.timeout_s
    return wiring


async def _awaitable(ref):
    return await ref


async def _gather_named(refs: dict) -> dict:
    names = list(refs)
    results = await asyncio.gather(*(_awaitable(refs[n]) for n in names), return_exceptions=True)
    return dict(zip(names, results))


async def _gather_setups(refs: dict) -> dict:
    """Like _gather_named, but returns at the first failure: a node whose setup waits for a peer
    (e.g. the weight push rendezvous, dataflow/weights/sync.py) would otherwise hold up the report of
    that peer's failed setup until its own wait timed out."""
    futures = {asyncio.ensure_future(_awaitable(ref)): name for name, ref in refs.items()}
    results, pending = {}, set(futures)
    while pending and not any(_failed(r) for r in results.values()):
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        results.update({futures[f]: _result(f) for f in done})
    _discard(pending)
    return results


def _result(fut: asyncio.Future) -> Any:
    try:
        return fut.result()
    except BaseException as e:  # the actor died, or Ray could not run the call
        return e


def _discard(futures) -> None:
    """Drop the run() calls still out when a failure or Ctrl-C ends the run, without asyncio
    logging "Task exception was never retrieved" for each actor that the shutdown kills."""
    for fut in futures:
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled():
            fut.exception()


def _failed(result: Any) -> bool:
    return isinstance(result, BaseException) or (isinstance(result, dict) and result.get("status") == "failed")


def _is_echo(result: Any) -> bool:
    """A node that failed only because a producer it reads from failed or died."""
    return isinstance(result, dict) and result.get("status") == "failed" and result.get("channel_error", False)


async def _wait_for_root_cause(results: dict, running: dict) -> None:
    """When every failure so far is a consumer's channel error, wait briefly for the failure of
    the node it names (a killed actor is noticed by its consumers and the driver at about the
    same time), so that node is reported instead of its echo downstream."""
    deadline = time.monotonic() + ROOT_CAUSE_GRACE_S
    while running and all(_is_echo(r) for r in results.values() if _failed(r)):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        done, _ = await asyncio.wait(running, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        results.update({running.pop(fut): _result(fut) for fut in done})


def _raise_first_failure(results: dict) -> None:
    """Raise for the root cause: a dead actor, else a node's own error, else a channel error."""
    failures = [(name, r) for name, r in results.items() if _failed(r)]
    failures.sort(key=lambda f: 0 if isinstance(f[1], BaseException) else 2 if _is_echo(f[1]) else 1)
    for name, result in failures:
        _raise_if_failed(name, result)


def _raise_if_failed(name: str, result: Any) -> None:
    if isinstance(result, BaseException):
        summary = _death_summary(result)
        raise NodeFailed(name, summary)
    if isinstance(result, dict) and result.get("status") == "failed":
        if result.get("user_error"):  # a mistake the user can fix (missing file, bad setting)
            raise UserError(f"node '{name}' ({result['phase']}): {result['message']}")
        raise NodeFailed(name, f"{result['error']} (during {result['phase']})", result["traceback"], result["item"])


def _death_summary(e: BaseException) -> str:
    from ray.exceptions import ActorDiedError, RayActorError

    if isinstance(e, (ActorDiedError, RayActorError)):
        text = str(e)
        if "SIGKILL" in text or "killed" in text.lower() or "exit" in text.lower():
            return "its process died (killed or crashed); see the node's log with --verbose"
        return "its actor died: " + text.strip().splitlines()[0]
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


async def _stop_all(hosts: dict, running: dict) -> None:
    """Cancel every still-running node and give them STOP_GRACE_S to close their channels."""
    for name in set(running.values()):
        try:
            hosts[name].stop.remote()
        except Exception:
            pass
    if running:
        await asyncio.wait(running, timeout=STOP_GRACE_S)


async def _shutdown(hosts: dict, pg, started_ray: bool, remove_placement_group) -> None:
    import ray

    for host in hosts.values():
        try:
            ray.kill(host)
        except Exception:
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:
            pass
    if started_ray:
        ray.shutdown()


class _Monitor:
    """Turns host events into progress lines, metrics.jsonl and the trace/idle report."""

    def __init__(self, graph: Graph, run_dir: Path, options: RunOptions, config: Any,
                 resume: Path | None = None, resume_step: int = 0):
        self.graph = graph
        self.options = options
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        if resume is not None:  # keep the records up to the checkpoint's step, then append
            checkpoint.continue_metrics(resume.parent.parent / "metrics.jsonl", self.metrics_path, resume_step)
        self.metrics_file = open(self.metrics_path, "a" if resume is not None else "w")
        self.checkpoint_requests: list[tuple[str, int]] = []
        self.last_checkpoint: Path | None = resume
        self.restarts: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.acked: dict[str, tuple[int, int]] = {}  # replica -> (pid, seq) of the last event handled
        self.trace = TraceCollector(enabled=options.trace_path is not None)
        # Run-level counters (queue depths, staleness) live on a driver track of the same trace.
        self.driver_tracer = Tracer("driver", enabled=options.trace_path is not None)
        self.t_start = time.time()
        self.t_running = None
        self.step = resume_step
        self.depths: dict[str, int] = {}
        self.artifacts: dict[str, str] = {}
        if config is not None and dataclasses.is_dataclass(config):
            (run_dir / "config.json").write_text(json.dumps({k: _jsonable(v) for k, v in flatten(config)}, indent=1))

    def processes(self, pids: dict) -> None:
        """Which process hosts which replica: <run>/processes.json (for kill tests and operators)."""
        self.pids.update(pids)
        (self.run_dir / "processes.json").write_text(json.dumps(self.pids, indent=1))

    def restarted(self, name: str, pid: int, state_dir: Path | None) -> None:
        self.processes({name: pid})
        record = {"time_s": round(time.time() - (self.t_running or self.t_start), 3), "node": "driver",
                  "restarted": name, "state_from": str(state_dir) if state_dir else None,
                  "restarts/total": sum(self.restarts.values()),
                  **{f"restarts/{n}": k for n, k in self.restarts.items()}}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()

    def started(self) -> None:
        self.t_running = time.time()
        self.say(f"[dataflow] graph '{self.graph.name}' running: {len(self.graph.nodes)} nodes, "
                 f"start-up {self.t_running - self.t_start:.1f} s; metrics -> {self.metrics_path}")

    def say(self, text: str) -> None:
        if not self.options.quiet:
            print(text, flush=True)

    async def poll(self, hosts: dict) -> None:
        replies = await _gather_named({n: h.poll.remote(self.acked.get(n)) for n, h in hosts.items()})
        depths: dict[str, int] = {}
        for name, reply in replies.items():
            if isinstance(reply, BaseException):
                continue  # a dead host is reported by its run() result
            self.trace.add(name, reply["trace"])
            for key, value in reply["depths"].items():
                ch = key.split(":", 1)[1]
                depths[ch] = depths.get(ch, 0) + value
            pid, seq = self.acked.get(name, (reply["pid"], -1))
            if pid != reply["pid"]:  # a restarted process: its events count from 0
                seq = -1
            for event in reply["events"]:
                if event["seq"] > seq:  # not handled yet (a lost reply's events come again)
                    self._handle(name, event)
                    seq = event["seq"]
            self.acked[name] = (reply["pid"], seq)
        self.depths = depths
        if depths:
            self.driver_tracer.counter("queue depth", **depths)
            self.driver_tracer.counter("samples in flight", items=sum(depths.values()))
        self.trace.add("driver", self.driver_tracer.drain(), node=False)

    def _handle(self, name: str, event: dict) -> None:
        kind = event["kind"]
        if kind == "log":
            self.say(f"[{name}] {event['text']}")
        elif kind == "artifact":
            self.artifacts[event["name"]] = event["path"]
        elif kind == "checkpoint":
            self.checkpoint_requests.append((name, event["step"]))
        elif kind in ("step", "metrics"):
            values = event["values"]
            record = {"time_s": round(event["t"] - (self.t_running or self.t_start), 3), "node": name}
            if kind == "step":
                self.step = event["step"]
                record["step"] = event["step"]
            record.update({k: _jsonable(v) for k, v in values.items()})
            record.update({f"queue/{ch}": d for ch, d in self.depths.items()})
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
            if kind == "step":
                self.say(self._progress_line(event["step"], values))
                if "staleness/mean" in values:
                    self.driver_tracer.counter("staleness", mean=values["staleness/mean"],
                                               max=values.get("staleness/max", 0))

    def _progress_line(self, step: int, values: dict) -> str:
        parts = [f"step {step:>4}"]
        keys = self.graph.progress or [k for k, v in values.items() if isinstance(v, (int, float))]
        for key in keys:
            if "±" in key:
                a, b = key.split("±")
                if a in values:
                    parts.append(f"{a.split('/')[0]} {values[a]:.3f} ± {values.get(b, float('nan')):.3f}")
            elif key in values:
                v = values[key]
                label = key.split("/")[0] if key.endswith("/mean") else key.split("/")[-1]
                parts.append(f"{label} {v:.4g}" if isinstance(v, float) else f"{label} {v}")
        if self.depths:
            parts.append("queues " + " ".join(f"{c}:{d}" for c, d in self.depths.items()))
        return " | ".join(parts)

    def finish(self, status: str) -> RunSummary:
        self.metrics_file.close()
        seconds = time.time() - self.t_start
        report = self.trace.report()
        for label, k in self.trace.kernel_idle().items():
            nvml = "n/a" if k["nvml_idle"] is None else f"{100 * k['nvml_idle']:.1f}%"
            report += (f"\n  {label}: GPU idle {100 * k['kernels_idle']:.1f}% from kernel records (used above), "
                       f"{nvml} from NVML samples, {100 * k['events_idle']:.1f}% from CUDA events around spans "
                       f"(same window, {k['window_s']:.1f} s)")
        if self.options.trace_path:
            self.trace.write(self.options.trace_path)
            self.artifacts["trace"] = self.options.trace_path
        return RunSummary(status, self.step, seconds, str(self.run_dir), str(self.metrics_path),
                          dict(self.artifacts), report, dict(self.restarts))


def _jsonable(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "item"):
        return v.item()
    return str(v)
