"""RunOptions.keep_processes (dataflow/driver/warm.py): a clean run's CPU node processes host the
next run of the same placement on the same Ray; anything else ends them. Real Ray, the toy graph."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from dataflow.driver import warm
from dataflow.driver.runtime import RunOptions, load_graph, run_graph
from dataflow.errors import NodeFailed
from tests.ray_cluster import ray_start_cluster

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
    t0 = time.monotonic()
    summary, second, got2 = run(tmp_path / "b", "counter.count=7")
    wall = time.monotonic() - t0
    # the same processes, each hosting the replica of the same slot, and the new run's own work
    assert second == first
    assert squares_of(got1) == [(i, i * i) for i in range(20)]
    assert squares_of(got2) == [(i, i * i) for i in range(7)]
    assert summary.status == "done"
    # the kept processes' start-up in the report is this run's (not from their first run's process start)
    startup = float(re.search(r"where time went: ([\d.]+) s of start-up", summary.report).group(1))
    assert startup <= wall, (startup, wall)
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


def test_cli_runs_joining_a_ray_start_cluster_keep_their_processes_between_commands(tmp_path):
    """--address joins a running cluster (started here with `ray start --head`) instead of starting
    one, ships the project as the job's working dir, and leaves the cluster running. With
    --keep-processes the next command's run takes the processes the last one kept (detached: they
    outlive its driver); edited project files mean new processes; what a driver killed mid-run held,
    and what is kept, the next run ends."""
    def cli(address, env, out, *args, wait=True):
        cmd = [sys.executable, "-m", "dataflow.run", SQUARES, "--address", address, "--out", str(out), *args]
        if not wait:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads((out / "processes.json").read_text()), json.loads((out / "collected.json").read_text())

    with ray_start_cluster() as (address, env):
        env.pop("DATAFLOW_KEEP_PROCESSES", None)   # (tests/conftest.py sets it): only the flag asks
        first, _ = cli(address, env, tmp_path / "a", "--keep-processes")
        second, got = cli(address, env, tmp_path / "b", "--keep-processes", "--set", "counter.count=7")
        assert second == first and squares_of(got) == [(i, i * i) for i in range(7)]
        # a run of edited project files (one more file), killed mid-run
        probe = ROOT / "tests" / "graphs" / f"_edited_{os.getpid()}.py"
        probe.write_text("# not imported\n")
        try:
            killed = cli(address, env, tmp_path / "c", "--keep-processes", "--set", "counter.delay_s=0.2",
                         "--set", "counter.count=500", wait=False)
            held = wait_for_processes(tmp_path / "c")   # (its working_dir was shipped before its processes started)
        finally:
            probe.unlink()
        assert not set(held.values()) & set(first.values())   # other code: new processes,
        assert all_gone(first.values())                       # and the kept ones ended
        killed.kill()
        killed.wait(timeout=30)
        assert all_alive(held.values())   # detached: the driver's death alone does not end them
        last, _ = cli(address, env, tmp_path / "e")   # without the flag: ends what is kept and the orphans
        assert all_gone(held.values()), "orphans"
        assert all_gone(last.values()), "the last run kept nothing"
        status = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "status", f"--address={address}"],
                                env=env, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, "the cluster we joined must still be running"
        free = subprocess.run([sys.executable, "-c", "import ray; ray.init(address=%r, log_to_driver=False); "
                               "print(ray.available_resources().get('CPU'), ray.cluster_resources().get('CPU'))"
                               % address], env=env, capture_output=True, text=True, timeout=120)
        available, total = map(float, free.stdout.split()[-2:])
        assert available == total, free.stdout


def test_keep_processes_on_a_ray_the_command_starts_is_a_one_line_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-m", "dataflow.run", SQUARES, "--keep-processes", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--address" in r.stderr, r.stderr


def wait_for_processes(run_dir: Path, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads((run_dir / "processes.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.1)
    raise AssertionError(f"{run_dir}: no processes.json within {timeout_s} s")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0   # a zombie has ended


def all_alive(pids) -> bool:
    return all(alive(p) for p in pids)


def all_gone(pids, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
