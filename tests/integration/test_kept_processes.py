"""RunOptions.keep_processes (dataflow/driver/warm.py): a clean run's CPU node processes host the
next run of the same placement on the same Ray; anything else ends them. Real Ray, the toy graph."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from dataflow.driver import warm
from dataflow.driver.runtime import RunOptions, load_graph, run_graph
from dataflow.errors import NodeFailed

ROOT = Path(__file__).resolve().parents[2]
SQUARES = str(ROOT / "tests" / "graphs" / "squares.py")

pytestmark = pytest.mark.usefixtures("ray_instance")


@pytest.fixture(autouse=True)
def nothing_kept_after():
    yield
    warm.release_all()


def run(run_dir: Path, *overrides: str, keep: bool = True, max_restarts: int = 0):
    graph, config = load_graph(SQUARES, list(overrides))
    graph.max_restarts = max_restarts
    summary = asyncio.run(run_graph(graph, RunOptions(out_dir=str(run_dir), quiet=True, keep_processes=keep), config))
    pids = json.loads((run_dir / "processes.json").read_text())
    collected = json.loads((run_dir / "collected.json").read_text())
    return summary, pids, collected


def squares_of(collected: list) -> list:
    return sorted((c["value"], c["square"]) for c in collected)


def free_cpus_within(timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] - 1e-6:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_kept_process_hosts_the_next_run_of_the_same_placement(tmp_path):
    _, first, got1 = run(tmp_path / "a")
    assert warm.kept_processes() == 4
    summary, second, got2 = run(tmp_path / "b", "counter.count=7")
    # the same processes, each hosting the replica of the same slot, and the new run's own work
    assert second == first
    assert squares_of(got1) == [(i, i * i) for i in range(20)]
    assert squares_of(got2) == [(i, i * i) for i in range(7)]
    assert summary.status == "done"
    warm.release_all()
    assert warm.kept_processes() == 0 and free_cpus_within()


def test_a_different_placement_ends_the_kept_processes_first(tmp_path):
    _, first, _ = run(tmp_path / "a")
    _, second, got = run(tmp_path / "b", "square_replicas=3")   # 5 bundles, not 4
    assert not set(first.values()) & set(second.values())
    assert squares_of(got) == [(i, i * i) for i in range(20)]
    assert warm.kept_processes() == 5


@pytest.mark.parametrize("case", ["failed", "other max_restarts", "not asked"])
def test_a_run_that_may_leak_into_the_next_keeps_nothing(tmp_path, case):
    run(tmp_path / "kept")
    assert warm.kept_processes() == 4
    if case == "failed":
        with pytest.raises(NodeFailed, match="refusing to square 3"):
            run(tmp_path / "b", "square.fail_on=3")
    elif case == "other max_restarts":   # an actor's max_restarts is fixed when Ray makes it
        _, pids, _ = run(tmp_path / "b", max_restarts=1)
        assert not set(pids.values()) & set(json.loads((tmp_path / "kept" / "processes.json").read_text()).values())
        warm.release_all()
    else:
        run(tmp_path / "b", keep=False)
    assert warm.kept_processes() == 0
    assert free_cpus_within()


def test_a_kept_process_that_dies_comes_back_as_the_current_runs_replica(tmp_path):
    """Ray restarts an actor with the spec of the run that made it; the driver rebinds it to the
    current run's before setting it up (restarts.restart). A group with a restart is not kept."""
    _, first, _ = run(tmp_path / "a", max_restarts=2)   # counter: 20 values, no delay
    assert warm.kept_processes() == 4
    killer = threading.Thread(target=kill_when_running, args=(tmp_path / "b", "counter"), daemon=True)
    killer.start()
    summary, second, got = run(tmp_path / "b", "counter.delay_s=0.05", "counter.count=60", max_restarts=2)
    killer.join(timeout=5)
    assert summary.restarts == {"counter": 1}, summary.restarts
    assert second["square[0]"] == first["square[0]"] and second["counter"] != first["counter"]
    # the restarted counter sent this run's 60 values again from 0, not the first run's 20
    assert {v for v, _ in squares_of(got)} == set(range(60)) and all(s == v * v for v, s in squares_of(got))
    assert warm.kept_processes() == 0   # the group had a restart: ended with the run


def kill_when_running(run_dir: Path, replica: str, timeout_s: float = 60.0) -> None:
    """Kill `replica`'s process half a second after the run's processes.json lists it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pids = json.loads((run_dir / "processes.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        time.sleep(0.5)   # running: items are flowing
        os.kill(pids[replica], signal.SIGKILL)
        return
