"""Shared fixtures. `ray_instance`: one local Ray per test module (the house rule), started clean or
kept from the previous module of this pytest process if that module left it clean (every actor and
placement group gone).

A module may set RAY_NUM_CPUS to ask for other than the default 8 logical CPUs (Ray schedules on
logical CPUs, so a graph with many actors fits on this 2-core machine); one default for all lets
consecutive modules share one Ray."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dataflow import startup_gc

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before Ray starts: no token-auth banner
# The prompt cache (rl/data/token_file.encode_cached) of this pytest process's runs in a temporary
# directory, not the user's ~/.cache; the nodes' processes inherit the setting.
if "DATAFLOW_PROMPT_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["DATAFLOW_PROMPT_CACHE"] = tempfile.mkdtemp(prefix="dataflow-prompt-cache-")
    atexit.register(shutil.rmtree, os.environ["DATAFLOW_PROMPT_CACHE"], ignore_errors=True)

# A module's graph runs share its node processes where their placement repeats (RunOptions.keep_processes,
# dataflow/driver/warm.py): each model node's process start and imports are paid once per placement,
# not once per test. The kept processes end with the module (ray_instance, below).
os.environ.setdefault("DATAFLOW_KEEP_PROCESSES", "1")

# Collecting imports torch, transformers and Ray in each pytest process: no garbage collection until
# the tests start (dataflow/startup_gc.py); every test runs with it on.
startup_gc.pause()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    startup_gc.resume()


# The slowest test files, slowest first (by the seconds their tests took on the 2-core machine in a
# `pytest --durations` run; bench/results/suite_cpu.md; test_compiled by its time in CI, whose inductor
# cache starts empty). The two workers take files in collection order as they free up: starting on
# these, the run's tail is short files on both workers.
SLOWEST_FIRST = ("test_runtime", "test_ppo_graph", "test_agent_graph", "test_checkpoint", "test_real_model",
                 "test_multirank", "test_weight_sync", "test_compiled", "test_varlen_nodes", "test_reliability",
                 "test_algorithms", "test_peer_rewards", "test_stall", "test_resume_settings", "test_stops",
                 "test_dapo", "test_validation", "test_multinode", "test_lora", "test_signals", "test_channel",
                 "test_reward_node", "test_placement_on_ray", "test_out_of_memory", "test_math_reward",
                 "test_startup", "test_hybrid_engine", "test_packing")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: a file keeps its order
    # A module with a ray_instance fixture of its own (test_placement_on_ray's: logical GPUs) starts
    # its own Ray: the kept one is stopped before it, not left behind for it to shut down.
    _ray_modules.update(item.path for item in items
                        if "ray_instance" in item.fixturenames and not hasattr(item.module, "ray_instance"))


# The Ray that ray_instance started in this pytest process and keeps between modules: (node id,
# logical CPUs), or None. Starting and stopping a local Ray costs ~3.5 s of CPU on this 2-core machine;
# 23 modules each starting their own was ~80 s of the suite's CPU time.
_kept: tuple[str, int] | None = None
_idle = False  # the kept Ray is between modules: no module is using it
_ray_modules: set = set()  # the test files with a test that asks for ray_instance


def _stop_kept_ray() -> None:
    global _kept, _idle
    import ray

    if _kept is not None and ray.is_initialized() and ray.get_runtime_context().get_node_id() == _kept[0]:
        ray.shutdown()
    _kept, _idle = None, False


def _all_resources_free(timeout_s: float = 10.0) -> bool:
    """Every logical CPU (and everything else) of the local Ray free again: no actor and no
    placement group of a finished module left behind. Ray frees them a moment after the kill."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        if all(free.get(k, 0.0) >= v - 1e-6 for k, v in total.items() if not k.startswith(("memory", "object_store"))):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test file none of whose tests asks for ray_instance (tests/unit's pure tests, modules that
    start their own Ray or cluster) never finds the Ray kept from an earlier module. (The Ray-free
    tests of a file that does ask for it may: as before, they may run while its module's Ray is up.)"""
    if _idle and item.path not in _ray_modules:
        _stop_kept_ray()


@pytest.fixture(scope="module")
def ray_instance(request):
    """One local Ray for the module's tests, with RAY_NUM_CPUS logical CPUs (default 8). The same Ray
    serves the next module that asks for it with the same CPUs, if this module left every resource free
    (all its graphs' actors and placement groups gone); anything else gets a fresh one."""
    global _kept, _idle
    import ray

    cpus = getattr(request.module, "RAY_NUM_CPUS", 8)
    reuse = (_kept is not None and _kept[1] == cpus and ray.is_initialized()
             and ray.get_runtime_context().get_node_id() == _kept[0])
    _idle = False
    if not reuse:
        _stop_kept_ray()
        if ray.is_initialized():  # another module left one running
            ray.shutdown()
        # Workers inherit PYTHONPATH (and RAY_AUTH_MODE, above) from this process, as in
        # dataflow/driver/launch.start_ray: a runtime_env would cost every actor a start through Ray's agent.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
        # address="local": never join a cluster another test module started meanwhile (test_multinode's
        # ray.cluster_utils.Cluster publishes its address, which ray.init() with no address would join).
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        _kept = (ray.get_runtime_context().get_node_id(), cpus)
    yield
    from dataflow.driver import warm

    warm.release_all()
    if (_kept is not None and ray.is_initialized() and ray.get_runtime_context().get_node_id() == _kept[0]
            and _all_resources_free()):
        _idle = True       # kept for the next module
    else:
        _stop_kept_ray()
        if ray.is_initialized():
            ray.shutdown()


def run_then_interrupt(graph_file: str, overrides: list[str], run_dir: Path, after_steps: int,
                       resume: str | None = None) -> None:
    """Run a graph until metrics.jsonl holds `after_steps` steps, then cancel the driver task as
    Ctrl-C / SIGTERM do in the CLI (the runtime saves an interrupt checkpoint)."""
    import asyncio

    from dataflow.driver.runtime import RunOptions, load_graph, run_graph

    def steps() -> int:
        metrics = run_dir / "metrics.jsonl"
        return sum('"step"' in line for line in metrics.read_text().splitlines()) if metrics.exists() else 0

    async def interrupted():
        graph, config = load_graph(str(ROOT / graph_file), overrides)
        task = asyncio.ensure_future(run_graph(graph, RunOptions(max_steps=100, out_dir=str(run_dir), quiet=True,
                                                                 resume=resume), config))
        while not task.done() and steps() < after_steps:
            await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())


def run_in_thread(graph, config, options) -> tuple:
    """(thread, outcome): run_graph in a driver thread, so a test can watch the run directory and
    kill node processes meanwhile. outcome gets "summary" or "error", and "t" (time.monotonic()
    when the run ended)."""
    import asyncio
    import threading
    import time

    from dataflow.driver.runtime import run_graph

    outcome: dict = {}

    def driver():
        try:
            outcome["summary"] = asyncio.run(run_graph(graph, options, config))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e
        outcome["t"] = time.monotonic()

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    return thread, outcome


def wait_until(condition, timeout_s: float, what: str, thread, outcome: dict) -> None:
    """Poll `condition` while the run_in_thread run is alive; fail naming `what` otherwise."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert thread.is_alive(), f"the run ended while waiting for {what}: {outcome.get('error')!r}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


def kill_stops_the_run(pid: int, node: str, thread, outcome: dict, within_s: float):
    """kill -9 `pid` (node replica `node`) of a run_in_thread run, which must then stop within
    `within_s` with a NodeFailed naming `node` and its dead process; returns that error."""
    import os
    import signal
    import time

    from dataflow.errors import NodeFailed

    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    error = outcome["error"]
    assert isinstance(error, NodeFailed) and error.node == node, repr(error)
    assert "its process died" in error.summary
    assert outcome["t"] - t_kill < within_s, outcome["t"] - t_kill
    return error
