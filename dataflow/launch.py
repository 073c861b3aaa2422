"""Starting and stopping what a run needs: Ray (started here, or joined), each replica's wiring to its
peers, its clock offset, and at the end the stop of every node and the shutdown of actors, placement
groups and Ray. The run itself is dataflow/runtime.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from dataflow import placement
from dataflow.graph import Graph
from dataflow.loading import PROJECT_ROOT
from dataflow.trace.collector import measure_clock_offset

if TYPE_CHECKING:
    from dataflow.runtime import RunOptions

STOP_GRACE_S = 5.0


def start_ray(graph: Graph, options: RunOptions) -> bool:
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
        with keep_sigterm_handler():
            ray.init(address=address, **kwargs)
    else:
        # Logical CPUs: a node's `cpus` is a share, so a 2-core laptop can still host the whole graph.
        needed = math.ceil(placement.plan(graph).cpus)
        with keep_sigterm_handler():
            ray.init(num_cpus=max(os.cpu_count() or 1, needed), **kwargs)
    return True


@contextlib.contextmanager
def keep_sigterm_handler():
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


def wiring(graph: Graph, replica_name: str, hosts: dict) -> dict:
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


async def clock_offset(host) -> int:
    """`host`'s clock minus the driver's, in us (NTP-style, best of 3 round trips): one time base
    for every trace event."""
    samples = []
    for _ in range(3):
        t0 = time.time_ns() // 1000
        remote = await host.clock.remote()
        samples.append((t0, remote, time.time_ns() // 1000))
    return measure_clock_offset(samples)


async def stop_all(hosts: dict, running: dict) -> None:
    """Cancel every still-running node and give them STOP_GRACE_S to close their channels."""
    for name in set(running.values()):
        try:
            hosts[name].stop.remote()
        except Exception:
            pass
    if running:
        await asyncio.wait(running, timeout=STOP_GRACE_S)


async def shutdown(hosts: dict, pg, started_ray: bool, remove_placement_group) -> None:
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
