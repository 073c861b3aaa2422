"""Shared fixtures. `ray_instance`: one local Ray per test module (the house rule), started clean.

A module sets RAY_NUM_CPUS to ask for more logical CPUs than the default 4 (Ray schedules on
logical CPUs, so a graph with many actors fits on this 2-core machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before Ray starts: no token-auth banner


# The slowest test files, slowest first (by the seconds their tests took on the 2-core machine in a
# `pytest --durations` run; bench/results/suite_cpu.md). The two workers take files in collection
# order as they free up: starting on these, the run's tail is short files on both workers.
SLOWEST_FIRST = ("test_multirank", "test_runtime", "test_ppo_graph", "test_weight_sync", "test_checkpoint",
                 "test_real_model", "test_dapo", "test_lora", "test_validation", "test_reliability",
                 "test_multinode", "test_agent_graph", "test_algorithms", "test_resume_settings", "test_compiled",
                 "test_peer_rewards", "test_varlen_nodes", "test_stall", "test_hybrid_engine", "test_stops",
                 "test_placement_on_ray", "test_channel", "test_signals", "test_startup", "test_packing")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: a file keeps its order


@pytest.fixture(scope="module")
def ray_instance(request):
    import ray

    if ray.is_initialized():  # another module left one running
        ray.shutdown()
    # Workers inherit PYTHONPATH (and RAY_AUTH_MODE, above) from this process, as in
    # dataflow/driver/launch.start_ray: a runtime_env would cost every actor a start through Ray's agent.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    # address="local": never join a cluster another test module started meanwhile (test_multinode's
    # ray.cluster_utils.Cluster publishes its address, which ray.init() with no address would join).
    ray.init(address="local", num_cpus=getattr(request.module, "RAY_NUM_CPUS", 4), include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    yield
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
