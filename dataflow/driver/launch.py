"""Starting and stopping what a run needs: Ray (started here, or joined), each replica's wiring to its
peers, its clock offset, and at the end the stop of every node and the shutdown of actors, placement
groups and Ray. The run itself is dataflow/driver/runtime.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from dataflow import placement
from dataflow.errors import UserError, one_line
from dataflow.graph import Graph
from dataflow.driver.loading import PROJECT_ROOT
from dataflow.trace.collector import measure_clock_offset
from dataflow.timeouts import wait_within

if TYPE_CHECKING:
    from dataflow.driver.options import RunOptions

STOP_GRACE_S = 5.0
PROBE_TIMEOUT_S = 10.0  # a cluster address that does not accept a TCP connection within this is an error
JOIN_TIMEOUT_S = 120.0  # ray.init against an address that answers (it uploads the project as working_dir)


async def start_ray(graph: Graph, options: RunOptions) -> bool:
    """Start a local Ray instance (or join `address`). Returns True if we started it.

    Joining: the address is probed first with a plain TCP connect (nothing listening is a one-line
    error in seconds, not a hang), then ray.init runs in a thread of its own, so that Ctrl-C and
    SIGTERM stop the CLI at once even while ray.init is stuck in Ray's C++ code, and a cluster
    that accepts the connection but never completes the handshake is an error after JOIN_TIMEOUT_S.
    Starting: Ray's processes go into a process group of their own (own_process_group), so that a
    SIGTERM to the CLI's whole group (systemd, Slurm's scancel) reaches only the CLI, which saves the
    interrupt checkpoint and then stops Ray (dataflow/run.py). It stays on the main thread: Ray
    ties its processes to the life of the thread that starts them (PR_SET_PDEATHSIG)."""
    import ray

    if ray.is_initialized():
        return False
    python_path = os.pathsep.join(p for p in [str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")] if p)
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=options.verbose,
                                  configure_logging=options.verbose)
    address = cluster_address(options)
    if address:
        kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": python_path}, "working_dir": str(PROJECT_ROOT),
                                 "excludes": ["runs/", ".git/", ".venv/", ".whl/", ".gpu/", ".vllm-kit/",
                                              "**/__pycache__/"]}
        where = "--address" if options.address else "RAY_ADDRESS"
        await probe_address(address, where)
        await join_in_thread(address, kwargs, where)
    else:
        # Logical CPUs: a node's `cpus` is a share, so a 2-core laptop can still host the whole graph.
        needed = math.ceil(placement.plan(graph).cpus)
        # Workers find the project through the environment they inherit from this process, not a
        # runtime_env: a job with a runtime_env gets no prestarted workers, and each actor's
        # worker waits on Ray's runtime-env agent (5 actors up in 3.0-4.5 s without one, 6.1-11.3 s
        # with env_vars only, on a 2-core machine).
        os.environ["PYTHONPATH"] = python_path
        # address="local": a new instance even when this machine runs a cluster (`ray start`, or
        # ray.cluster_utils in a test beside this one), which ray.init() with no address would join.
        try:
            with keep_sigterm_handler(), own_process_group():
                ray.init(address="local", num_cpus=max(os.cpu_count() or 1, needed), **kwargs)
        except Exception as e:  # noqa: BLE001 - the machine's to fix (RAY_TMPDIR, a full disk, ...): one line
            ray.shutdown()      # whatever of Ray did start
            raise UserError(f"Ray did not start on this machine: {one_line(e)} ({RAY_START_ADVICE})") from None
    return True


RAY_START_ADVICE = ("Ray writes under RAY_TMPDIR, default /tmp: it must be a writable directory with free space; "
                    "`ray stop --force` ends a stale local instance; Ray's own logs are in its session_latest/logs")


def cluster_address(options: RunOptions) -> str | None:
    """The Ray cluster the run joins (it outlives the run), or None: the run starts its own."""
    return options.address or os.environ.get("RAY_ADDRESS")


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a `host:port` or `ray://host:port` address; None for "auto", "local", ..."""
    m = re.fullmatch(r"(?:ray://)?\[?([\w.\-:]+?)\]?:(\d+)/?", address.strip())
    return (m.group(1), int(m.group(2))) if m else None


async def probe_address(address: str, where: str = "--address") -> None:
    """A TCP connect to the cluster's address (Ray's GCS port): UserError if nothing answers."""
    target = _host_port(address)
    if target is None:
        return  # "auto" and the like: ray.init finds the cluster (or says it found none)
    advice = ("start the cluster there (`ray start --head --port=PORT`), or pass the address its head "
              "printed; without --address a local Ray is started")
    try:
        _, writer = await wait_within(asyncio.open_connection(*target), PROBE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise UserError(f"{where} {address}: no answer within {PROBE_TIMEOUT_S:g} s; {advice}") from None
    except OSError as e:
        raise UserError(f"{where} {address}: cannot connect ({e.strerror or e}); {advice}") from None
    writer.close()


async def join_in_thread(address: str, kwargs: dict, where: str = "--address") -> None:
    """ray.init(address) in a daemon thread, awaited here: a cancel (Ctrl-C, SIGTERM) ends the wait
    at once; a handshake that does not complete within JOIN_TIMEOUT_S is a UserError."""
    import ray

    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def join():
        try:
            ray.init(address=address, **kwargs)
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(lambda e=e: done.done() or done.set_exception(e))

    threading.Thread(target=join, name="ray.init", daemon=True).start()
    try:
        await wait_within(asyncio.shield(done), JOIN_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise UserError(f"{where} {address}: something answers there, but joining it as a Ray cluster did "
                        f"not complete within {JOIN_TIMEOUT_S:g} s (is it a Ray head's GCS port, of the same "
                        f"Ray version, {ray.__version__}?)") from None
    except Exception as e:  # no cluster there, another Ray version, ...: the user's to fix
        raise UserError(f"{where} {address}: joining the Ray cluster failed: {one_line(e)}") from None


@contextlib.contextmanager
def own_process_group():
    """While ray.init starts a local instance: each process Ray starts (gcs_server, raylet, and so
    the workers and agents the raylet starts) leads a process group of its own, so a signal to the
    CLI's group (Ctrl-C in a terminal, `kill -TERM -PGID` from systemd or scancel) reaches the
    CLI only; it stops Ray itself at the end of the run (ray.shutdown). Ray still kills them if the
    CLI dies (its fate sharing, PR_SET_PDEATHSIG, is kept). Done by wrapping the Popen class Ray's
    services module starts its processes with (Ray 2.x): if that name is gone, nothing changes."""
    from ray._private import services

    popen = getattr(services, "ConsolePopen", None)
    if os.name != "posix" or not isinstance(popen, type):
        yield
        return

    class OwnGroupPopen(popen):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("process_group", 0)  # setpgid(0, 0) in the child (Python >= 3.11)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = popen


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
