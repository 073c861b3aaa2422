"""The engine end to end, with real Ray: the CLI, failures, signals, uvloop, items between actors,
versioned edges.

Most tests share one Ray instance started by this module and call the CLI in-process
(`dataflow.run.main(argv)`: same code path and exit status as `python -m dataflow.run`, but
`run_graph` reuses the running Ray instead of paying its start-up; kill -9 of a node too). The tests
that are about the process itself (exit status of the real CLI, Ctrl-C / SIGTERM, stray processes)
run the CLI as a subprocess, each starting and stopping its own Ray instance.

Exit status contract checked here (dataflow/run.py): 0 done (also "max steps reached"), 1 a node
failed (raised or died), 2 a user mistake (bad --set, graph file, or a node's setup raising
UserError, e.g. a missing dataset file), 130 interrupted (SIGINT or SIGTERM).
"""

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
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ["RAY_AUTH_MODE"] = "disabled"  # before Ray starts: no token-auth banner
import ray  # noqa: E402

from dataflow import Graph, Node  # noqa: E402
from dataflow import run as cli  # noqa: E402
from dataflow.actor.host import HostSpec, NodeHost  # noqa: E402
from dataflow.driver.runtime import RunOptions, run_graph  # noqa: E402
from tests.graphs.probes import (  # noqa: E402
    Publisher, PublisherConfig, Relay, Subscriber, SubscriberConfig, TensorSink, TensorSource,
    TensorSourceConfig,
)

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "tests" / "graphs" / "toy.py"
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
ENV.pop("RAY_ADDRESS", None)
SLOW_COUNTER = ["--set", "counter.delay_s=0.2", "--set", "counter.count=1000"]  # ~200 s if not stopped


# One local Ray for the in-process tests (tests/conftest.py; the subprocess CLIs start their own).
# Its workers inherit PYTHONPATH instead of a runtime_env, which made every actor wait on Ray's agent.
pytestmark = pytest.mark.usefixtures("ray_instance")


def main(capsys, *argv: str) -> tuple[int, str, str]:
    """`python -m dataflow.run ARGV` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# ---- subprocess CLI and its process tree ----------------------------------------------------------
class CliProcess:
    """`python -m dataflow.run ...` in its own session (so a process-group SIGINT is a Ctrl-C that
    reaches only this run's processes), with stdout/stderr read line by line as they come, and
    every process that was ever below it recorded in `tree` (pid, start time) while it runs."""

    def __init__(self, *args: str):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "dataflow.run", *map(str, args)], cwd=ROOT,
                                     env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.tree: set[tuple[int, int]] = set()
        self._changed = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                         for s, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        self._readers.append(threading.Thread(target=self._watch_tree, daemon=True))
        for t in self._readers:
            t.start()

    def _watch_tree(self) -> None:
        while self.proc.poll() is None:
            self.tree |= descendants(self.proc.pid)
            time.sleep(0.1)

    def _read(self, stream, lines: list) -> None:
        for line in stream:
            with self._changed:
                lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match:
        """The first stdout match of `pattern`; fails if the CLI exits or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                m = re.search(pattern, self.stdout)
                if m:
                    return m
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, \
                    f"no {pattern!r} (exit {self.proc.poll()}):\n{self.stdout}\n{self.stderr}"
                self._changed.wait(min(left, 1.0))

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        for t in self._readers:
            t.join(5)
        return rc

    def kill(self) -> None:
        """Clean-up after a failed test: the CLI's process group (only processes this test started)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)


@pytest.fixture
def start_cli():
    started: list[CliProcess] = []

    def start(*args: str) -> CliProcess:
        started.append(CliProcess(*args))
        return started[-1]

    yield start
    for p in started:
        p.kill()


def _processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time, state) of every process."""
    table = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(d)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def descendants(pid: int) -> set[tuple[int, int]]:
    """(pid, start time) of every process below `pid` (Ray's gcs_server, raylet, agents, workers)."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for p, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(p)
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add((child, table[child][1]))
            stack.append(child)
    return found


def still_running(procs: set[tuple[int, int]]) -> list[str]:
    """Those of `procs` still alive (same pid and start time, not a zombie), with command lines."""
    table = _processes()
    alive = []
    for pid, start in procs:
        if pid in table and table[pid][1] == start and table[pid][2] != "Z":
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:150]
            except OSError:
                continue
            alive.append(f"{pid}: {cmd}")
    return alive


def session_processes(session: str) -> list[str]:
    """Live processes whose command line names Ray session `session` (raylet, gcs, agents)."""
    found = []
    for pid, (_, _, state) in _processes().items():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if session in cmd and state != "Z" and pid != os.getpid():
            found.append(f"{pid}: {cmd[:150]}")
    return found


# ---- 1. end to end through the real CLI -----------------------------------------------------------
def test_cli_runs_squares_end_to_end(tmp_path):
    """counter -> square x2 -> collect: every value arrives exactly once, both square replicas did
    work (fan-out by demand) and the one collect received from both (fan-in), metrics and the
    end-of-run summary are written."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dataflow.run", "tests/graphs/squares.py", "--out", str(out)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    collected = json.loads((out / "collected.json").read_text())
    assert sorted(x["value"] for x in collected) == list(range(20))
    assert all(x["square"] == x["value"] ** 2 and x["origin"] == "counter" for x in collected)
    by = Counter(x["by"] for x in collected)
    assert set(by) == {"square[0]", "square[1]"}, by

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [rec for rec in records if "step" in rec]
    assert [(s["node"], s["step"], s["items"]) for s in steps] == [("collect", i, 5 * i) for i in (1, 2, 3, 4)]
    assert json.loads((out / "config.json").read_text())["counter.count"] == 20

    assert "[dataflow] graph 'squares' running: 3 nodes" in r.stdout
    assert re.search(r"start-up [\d.]+ s \(actor processes [\d.]+ s, node setup [\d.]+ s \(slowest", r.stdout), r.stdout
    # and the command's own seconds before Ray, from its process start: parts that add up to it
    # (each of the four printed to 0.1 s)
    own = re.search(r"Ray started [\d.]+ s before, after the command's own ([\d.]+) s \(python, imports ([\d.]+), "
                    r"graph ([\d.]+), checks ([\d.]+)\)", r.stdout)
    assert own, r.stdout
    total, *parts = map(float, own.groups())
    assert 0 < parts[0] and abs(sum(parts) - total) <= 0.2 + 1e-9 and total < wall, (own.group(0), wall)
    assert "step    4 | items 20" in r.stdout
    assert "where time went" in r.stdout and "square[1]" in r.stdout  # the idle table
    assert "[dataflow] done: 4 steps in" in r.stdout
    assert f"metrics: {out}/metrics.jsonl" in r.stdout
    assert "Traceback" not in r.stderr, r.stderr


# ---- 2. --max-steps ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["sources still running", "sources already ended"])
def test_max_steps_ends_the_run(capsys, tmp_path, case):
    """--max-steps 2: the run-ending node returns after its 2nd step and the run stops at once with
    status "max steps reached" and exit 0, whether the source still has ~200 s of items to send or
    had already ended (the status must not depend on which node the driver sees finish last)."""
    if case == "sources still running":
        settings = SLOW_COUNTER
    else:  # 10 items; collect pauses 1 s before each step, so counter and squares are done by then
        settings = ["--set", "counter.count=10", "--set", "collect.step_delay_s=1.0"]
    t0 = time.monotonic()
    rc, out, err = main(capsys, "tests/graphs/squares.py", *settings, "--max-steps", 2, "--out", tmp_path)
    seconds = time.monotonic() - t0
    assert rc == 0, out + err
    assert "[dataflow] max steps reached: 2 steps in" in out, out
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert len(json.loads((tmp_path / "collected.json").read_text())) == 10
    assert seconds < 60, seconds  # nowhere near the ~200 s the slow counter would take


# ---- 3. a node raises ---------------------------------------------------------------------------------
def test_node_exception_stops_graph_and_names_node_item_and_line(capsys, tmp_path):
    rc, out, err = main(capsys, "tests/graphs/squares.py", "--set", "square.fail_on=7", "--out", tmp_path)
    assert rc == 1, out + err
    assert re.search(r"\[dataflow\] node 'square\[[01]\]' failed: ValueError: refusing to square 7 "
                     r"\(during run\)", err), err
    # which item: the 8th number the counter sent (seq counts from 0 per producer)
    assert re.search(r"while processing: last item received on input 'numbers': .*seq=7, producer=counter", err), err
    # the original traceback, down to the line of the node that raised
    raise_line = line_of(TOY, 'raise ValueError(f"refusing to square')
    assert f'File "{TOY}", line {raise_line}, in run' in err, err
    assert err.count("Traceback (most recent call last)") == 1, err
    # and nothing of the driver's own machinery
    for noise in ("dataflow/driver/runtime.py", "dataflow/driver/failures.py", "dataflow/run.py", "never retrieved", "ray/_private"):
        assert noise not in err, (noise, err)
    assert "[dataflow] done" not in out


# ---- 4. kill -9 of a node process -----------------------------------------------------------------------
def test_killed_node_is_reported_by_name_within_seconds(capsys, tmp_path):
    """kill -9 of a node's process while items flow: the CLI (in this process, on the module's Ray:
    a subprocess would pay a Python and a Ray start-up for nothing this checks) exits 1 within
    seconds naming the killed node, not a downstream node that lost its producer."""
    killed: dict = {}

    def kill_after_step_1():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            metrics, pids = tmp_path / "metrics.jsonl", tmp_path / "processes.json"
            if pids.exists() and metrics.exists() and '"step"' in metrics.read_text():  # items are flowing
                killed["pid"] = pid = json.loads(pids.read_text())["square[0]"]
                killed["ours"] = pid in {p for p, _ in descendants(os.getpid())}  # a worker of this run's Ray
                killed["t"] = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.1)

    killer = threading.Thread(target=kill_after_step_1, daemon=True)
    killer.start()
    rc, out, err = main(capsys, "tests/graphs/squares.py", *SLOW_COUNTER, "--set", "square.report_pid=true",
                        "--out", tmp_path)
    seconds = time.monotonic() - killed.get("t", float("nan"))
    killer.join(5)
    assert "pid" in killed, out + err
    assert killed["ours"]
    assert f"[square[0]] pid={killed['pid']}" in out, out   # the node that reported it is the one killed
    assert rc == 1, out + err
    assert seconds < 10, seconds
    assert "[dataflow] node 'square[0]' failed: its process died" in err, err
    assert "never retrieved" not in err, err


# ---- 5. Ctrl-C and SIGTERM ----------------------------------------------------------------------------------
def _raylet_session(run: CliProcess) -> str | None:
    """The Ray session name on the command line of the run's raylet, once it runs."""
    for pid, _ in descendants(run.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"raylet" in cmd.split(b"\0")[0]:
            m = re.search(rb"--session-name=(session_[\w-]+)", cmd)
            return m.group(1).decode() if m else None
    return None


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigterm-during-start-up"])
def test_signal_stops_everything_and_leaves_no_processes(start_cli, tmp_path, how):
    """Ctrl-C (SIGINT to the CLI's whole process group, as a terminal sends it) and SIGTERM (to the
    CLI alone, as `kill` sends it; also while Ray is still starting) stop the run within seconds
    with exit 130; afterwards nothing the run started is left: no process that was ever in the
    CLI's tree (gcs_server, raylet, agents, node workers) and no process naming its Ray session."""
    run = start_cli("tests/graphs/squares.py", *SLOW_COUNTER, "--out", tmp_path)
    if how == "sigterm-during-start-up":
        deadline = time.monotonic() + 120
        while (session := _raylet_session(run)) is None:
            assert time.monotonic() < deadline and run.proc.poll() is None, run.stdout + run.stderr
            time.sleep(0.05)
        assert "running" not in run.stdout  # still starting
    else:
        run.wait_for(r"step +1 \|")
        session = _raylet_session(run)
        assert len(run.tree) >= 5 and session, (run.tree, session)  # Ray's daemons + 4 node actors

    t_signal = time.monotonic()
    if how == "ctrl-c":
        os.killpg(run.proc.pid, signal.SIGINT)
    else:
        os.kill(run.proc.pid, signal.SIGTERM)
    rc = run.wait(timeout=60)
    seconds = time.monotonic() - t_signal
    assert rc == 130, (rc, run.stdout, run.stderr)
    # Within seconds; during start-up the stop first waits for Ray's start to return, which takes
    # seconds more while the other pytest worker loads both cores.
    assert seconds < (25 if how == "sigterm-during-start-up" else 15), seconds
    assert "[dataflow] interrupted: stopped every node and Ray." in run.stderr
    assert "Traceback" not in run.stderr and "never retrieved" not in run.stderr, run.stderr

    deadline = time.monotonic() + 5  # processes killed at shutdown may take a moment to vanish
    while (left := still_running(run.tree) + session_processes(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "\n".join(left)


# ---- 6. uvloop ------------------------------------------------------------------------------------------------
def test_driver_and_node_actors_run_on_uvloop(capsys, tmp_path):
    loops = []

    async def probe():
        loops.append(type(asyncio.get_running_loop()).__module__)
        return SimpleNamespace(report="", status="done", steps=0, seconds=0.0, metrics_path="-", artifacts={})

    assert cli._run_with_signals(probe) == 0
    assert loops == ["uvloop"]  # the CLI's driver loop

    rc, out, err = main(capsys, "tests/graphs/loop_probe.py", "--out", tmp_path)
    assert rc == 0, out + err
    assert re.search(r"\[probe\] loop=uvloop\.Loop pid=\d+", out), out  # a node actor's loop
    assert f"pid={os.getpid()}" not in out  # and it ran in an actor, not here


# ---- 7. --describe -----------------------------------------------------------------------------------------------
def test_describe_starts_nothing(capsys, monkeypatch):
    """--describe loads and validates the graph and prints it; no Ray is started or joined (both
    are booby-trapped here, and the subprocess points RAY_ADDRESS at a port nobody listens on)."""

    def trap(*a, **k):
        raise AssertionError("--describe must not start Ray or run the graph")

    monkeypatch.setattr(ray, "init", trap)
    monkeypatch.setattr("dataflow.driver.runtime.run_graph", trap)
    monkeypatch.setattr("dataflow.driver.runtime.start_ray", trap)
    t0 = time.monotonic()
    rc, out, err = main(capsys, "tests/graphs/squares.py", "--describe")
    assert rc == 0, err
    assert time.monotonic() - t0 < 2
    assert "square" in out and "replicas=2" in out and "placement:" in out

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dataflow.run", "tests/graphs/squares.py", "--describe"],
                       cwd=ROOT, env={**ENV, "RAY_ADDRESS": "127.0.0.1:9"}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "counter.count = 20" in r.stdout
    assert time.monotonic() - t0 < 15  # imports only; starting Ray alone takes longer here


# ---- 8. items never pass through the driver -----------------------------------------------------------------------
def test_items_travel_between_actors_not_through_the_driver(tmp_path, monkeypatch):
    """192 MB of tensors (6 x 32 MB) go source -> relay -> sink, checked at the sink. Every actor
    call the driver makes is recorded: only set-up, clock, run, poll and stop, never channel_take
    (the call whose reply carries items) or on_publish. And the driver's resident memory (sampled
    every 5 ms) never grows by as much as one item while they flow."""
    calls = Counter()
    original = ray.actor.ActorHandle._actor_method_call

    def spy(self, method_name, *args, **kwargs):
        calls[method_name] += 1
        return original(self, method_name, *args, **kwargs)

    monkeypatch.setattr(ray.actor.ActorHandle, "_actor_method_call", spy)

    g = Graph("tensors")
    g.node("source", TensorSource, TensorSourceConfig(count=6, megabytes=32), cpus=0.5)
    g.node("relay", Relay, cpus=0.5)
    g.node("sink", TensorSink, cpus=0.5, ends_run=True)
    g.channel("source.tensors", "relay.tensors", capacity=2, name="raw")
    g.channel("relay.tensors_out", "sink.tensors", capacity=2, name="relayed")
    g.validate()

    rss_page = os.sysconf("SC_PAGE_SIZE")
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], int(Path("/proc/self/statm").read_text().split()[1]) * rss_page)
            time.sleep(0.005)

    baseline = int(Path("/proc/self/statm").read_text().split()[1]) * rss_page
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        summary = asyncio.run(run_graph(g, RunOptions(out_dir=str(tmp_path), quiet=True)))
    finally:
        stop.set()
        sampler.join()

    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(s["index"], s["megabytes"], s["ok"]) for s in steps] == [(i, 32.0, True) for i in range(6)]
    assert summary.status == "done" and summary.steps == 6
    assert calls["channel_take"] == 0 and calls["on_publish"] == 0, calls
    # (stall checks; release and rebind: processes kept between runs, RunOptions.keep_processes, and
    # the registry of kept processes: swap, lend, settle, end_all)
    assert set(calls) <= {"connect", "clock", "run", "poll", "stop", "wait_state", "release", "rebind",
                          "swap", "lend", "settle", "end_all"}, calls
    assert calls["poll"] >= 1 and calls["run"] == 3
    assert peak[0] - baseline < 32 * 2**20, (baseline, peak[0])


# ---- 9. a node's setup fails -----------------------------------------------------------------------------------------
def test_setup_user_mistake_is_a_short_error_exit_2(capsys, tmp_path):
    """A node whose setup raises UserError (here: the JSONL file it was given does not exist) is a
    user mistake: one short message naming the node, exit 2, no traceback. Any other exception in
    setup is a node failure: exit 1 with the original traceback. The same graph with the file
    present runs (so the error is about the file, not the graph)."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": "b"}\n\n{"prompt": "c"}\n')
    rc, out, err = main(capsys, "tests/graphs/jsonl_reader.py", "--set", f"reader.path={data}", "--out", tmp_path / "ok")
    assert rc == 0 and "[reader] read 3 rows" in out, out + err

    missing = tmp_path / "missing.jsonl"
    rc, out, err = main(capsys, "tests/graphs/jsonl_reader.py", "--set", f"reader.path={missing}", "--out", tmp_path / "a")
    assert rc == 2, out + err
    assert err.strip() == (f"error: node 'reader' (setup): {missing}: no such file; pass the path of a .jsonl "
                           "dataset with --set reader.path=FILE"), err
    assert "running" not in out

    rc, out, err = main(capsys, "tests/graphs/jsonl_reader.py", "--set", "reader.crash=true", "--out", tmp_path / "b")
    assert rc == 1, out + err
    assert "[dataflow] node 'reader' failed: RuntimeError: setup crashed on purpose (during setup)" in err, err
    assert 'tests/graphs/probes.py", line' in err and "in setup" in err, err


# ---- versioned edges ----------------------------------------------------------------------------------------------------
def test_versioned_edge_delivers_monotonic_latest_versions(tmp_path):
    """A publisher publishes versions 0..30; a fast and a slow subscriber wait for each newer
    version and fetch it with ctx.latest. Each sees strictly increasing versions ending with the
    last one, every value fetched is the one published with that version, and the slow one
    skipped versions (latest wins: nothing queues up behind a slow subscriber)."""
    last = 30
    g = Graph("pubsub")
    g.node("publisher", Publisher, PublisherConfig(last_version=last), cpus=0.25)
    g.node("fast", Subscriber, SubscriberConfig(last_version=last), cpus=0.25)
    g.node("slow", Subscriber, SubscriberConfig(last_version=last, work_s=0.3), cpus=0.25)
    g.versioned("weights", src="publisher", dst=["fast", "slow"])
    g.validate()
    summary = asyncio.run(run_graph(g, RunOptions(out_dir=str(tmp_path), quiet=True)))
    assert summary.status == "done"
    for name in ("fast", "slow"):
        seen = json.loads((tmp_path / f"seen-{name}.json").read_text())
        versions = [v for v, _, _ in seen]
        assert versions == sorted(set(versions)), (name, versions)  # strictly increasing
        assert versions[-1] == last, (name, versions)
        assert all(v == value_version == fill for v, value_version, fill in seen), (name, seen)
    assert len(json.loads((tmp_path / "seen-slow.json").read_text())) < last + 1

    # where the start-up went (RunSummary.startup, also in the running line): the phases add up
    # to the total, and every replica reports its own setup time
    st = summary.startup
    assert st["ray"] >= 0 and st["actors"] > 0 and st["setup"] >= 0
    assert st["actors"] + st["setup"] == pytest.approx(st["total"], abs=0.01)
    assert {k for k in st if k.startswith("setup/")} == {"setup/publisher", "setup/fast", "setup/slow"}
    assert max(st[f"setup/{n}"] for n in ("publisher", "fast", "slow")) <= st["setup"] + 0.01


class _Learner(Node):
    publishes = ("policy",)

    async def run(self):
        pass


class _FakeSubscriber:
    """Stands in for a subscriber's NodeHost handle: `on_publish.remote(...)` logs when the call
    starts and when it acks (after `ack_s`, or never)."""

    def __init__(self, name: str, log: list, ack_s: float | None):
        self.name, self.log, self.ack_s = name, log, ack_s
        self.on_publish = SimpleNamespace(remote=self._on_publish)

    async def _on_publish(self, edge, version, boxed_ref):
        self.log.append(("start", self.name, version, ray.get(boxed_ref[0])))
        await (asyncio.Event().wait() if self.ack_s is None else asyncio.sleep(self.ack_s))
        self.log.append(("ack", self.name, version))
        return True


def test_publish_tells_subscribers_in_declared_order_each_after_the_previous_ack():
    """NodeHost.publish with fake subscriber handles: the second subscriber is called only after
    the first acked (so it can never observe a version the first does not hold yet), the value
    travels by reference, and a subscriber that never acks fails the publish naming both ends."""
    import torch

    threads = torch.get_num_threads()
    spec = HostSpec(node="learner", replica=0, num_replicas=1, kind=_Learner, config=None, cpus=threads,
                    gpus=0, max_steps=None, trace=False, run_dir=".")
    log: list = []
    subs = [_FakeSubscriber("generator[0]", log, 0.05), _FakeSubscriber("generator[1]", log, 0.01),
            _FakeSubscriber("prompts", log, 0.0)]

    async def publisher(subscribers, timeout_s):
        host = NodeHost(spec)
        wiring = {"outputs": {}, "inputs": {}, "publishes": {"policy": [(s.name, s) for s in subscribers]},
                  "publish_timeout": {"policy": timeout_s}}
        assert (await host.connect(wiring))["status"] == "ready"
        return host

    async def scenario():
        host = await publisher(subs, 5.0)
        for v in (1, 2):
            await host.publish("policy", {"w": v}, v)
        assert host.latest_version("policy") == 2 and (await host.latest("policy")) == (2, {"w": 2})

        host = await publisher([subs[0], _FakeSubscriber("stuck", [], None)], 0.3)
        with pytest.raises(RuntimeError) as e:
            await host.publish("policy", {"w": 3}, 3)
        return str(e.value)

    error = asyncio.run(scenario())
    assert torch.get_num_threads() == threads
    expected = []
    for v in (1, 2):
        for s in subs:
            expected += [("start", s.name, v, {"w": v}), ("ack", s.name, v)]
    assert log[:len(expected)] == expected
    assert "publishing 'policy' v3 from learner to stuck: no ack within 0.3 s" in error


def test_subscriber_keeps_the_latest_version():
    """on_publish of an older version (a late retry or reordering) never replaces a newer one."""
    import torch

    spec = HostSpec(node="generator", replica=0, num_replicas=1, kind=_Learner, config=None,
                    cpus=torch.get_num_threads(), gpus=0, max_steps=None, trace=False, run_dir=".")

    async def scenario():
        host = NodeHost(spec)
        await host.connect({"outputs": {}, "inputs": {}, "publishes": {}, "publish_timeout": {}})
        assert host.latest_version("policy") == -1 and await host.latest("policy") == (-1, None)
        await host.on_publish("policy", 5, [ray.put("five")])
        await host.on_publish("policy", 3, [ray.put("three")])
        assert await host.wait_version("policy", 4) == 5
        return await host.latest("policy")

    assert asyncio.run(scenario()) == (5, "five")


