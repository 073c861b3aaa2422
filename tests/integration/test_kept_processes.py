"""RunOptions.keep_processes (dataflow/driver/warm.py): a clean run's CPU node processes host the
next run of the same placement on the same Ray; anything else ends them. Real Ray, the toy graph."""

from __future__ import annotations

import asyncio
import json
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


@pytest.mark.parametrize("case", ["failed", "restarts", "not asked"])
def test_a_run_that_may_leak_into_the_next_keeps_nothing(tmp_path, case):
    run(tmp_path / "kept")
    assert warm.kept_processes() == 4
    if case == "failed":
        with pytest.raises(NodeFailed, match="refusing to square 3"):
            run(tmp_path / "b", "square.fail_on=3")
    elif case == "restarts":   # Ray would restart a kept actor with its first run's spec
        _, pids, _ = run(tmp_path / "b", max_restarts=1)
        assert not set(pids.values()) & set(json.loads((tmp_path / "kept" / "processes.json").read_text()).values())
    else:
        run(tmp_path / "b", keep=False)
    assert warm.kept_processes() == 0
    assert free_cpus_within()
