"""Signals and the cluster address, through the real CLI as a subprocess (each starts its own Ray):

- SIGTERM to the CLI's whole process group (what systemd and Slurm's scancel send) saves the
  interrupt checkpoint like Ctrl-C, exits 130 and leaves no process: Ray's processes are in a
  process group of their own (dataflow/driver/launch.py), so they are still up to take the checkpoint.
- `--address` where nothing listens is a one-line error (exit 2) in seconds; where something
  accepts the connection but never answers as Ray, Ctrl-C still stops the CLI at once. A local Ray
  that cannot start is a one-line error too."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tests.integration.test_runtime import ENV, ROOT, CliProcess, _raylet_session, session_processes, still_running

CHECKPOINTED = "tests/graphs/checkpointed.py"


def test_sigterm_to_the_whole_process_group_saves_the_interrupt_checkpoint(tmp_path):
    run = CliProcess(CHECKPOINTED, "--out", tmp_path)
    try:
        run.wait_for(r"step +3 \|")
        session = _raylet_session(run)
        t_signal = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGTERM)  # the CLI leads its own session: its whole group
        rc = run.wait(timeout=90)
        seconds = time.monotonic() - t_signal
    finally:
        run.kill()
    assert rc == 130, (rc, run.stdout, run.stderr)
    assert seconds < 20, seconds
    assert "[dataflow] interrupted: checkpoint of step" in run.stdout, run.stdout + run.stderr
    checkpoints = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1 and checkpoints[0].suffix == "", checkpoints
    manifest = json.loads((checkpoints[0] / "manifest.json").read_text())
    assert manifest["reason"] == "interrupt" and manifest["step"] >= 3, manifest
    assert "ActorUnavailableError" not in run.stdout + run.stderr and "Traceback" not in run.stderr, run.stderr
    deadline = time.monotonic() + 5
    while (left := still_running(run.tree) + session_processes(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, "\n".join(left)


def test_an_address_where_nothing_listens_is_a_one_line_error(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dataflow.run", "tests/graphs/squares.py", "--address", "127.0.0.1:1",
                        "--out", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert time.monotonic() - t0 < 30
    lines = r.stderr.strip().splitlines()
    assert lines == ["error: --address 127.0.0.1:1: cannot connect (Connection refused); start the cluster there "
                     "(`ray start --head --port=PORT`), or pass the address its head printed; without --address a "
                     "local Ray is started"], r.stderr


def test_a_local_ray_that_cannot_start_is_a_one_line_error(tmp_path):
    """RAY_TMPDIR naming a file: ray.init fails making its temp directory; the CLI says so in one
    line of its own (exit 2), naming what Ray raised and where to look, with no traceback."""
    not_a_dir = tmp_path / "not_a_dir"
    not_a_dir.write_text("")
    r = subprocess.run([sys.executable, "-m", "dataflow.run", "tests/graphs/squares.py", "--out", str(tmp_path / "run")],
                       cwd=ROOT, env={**ENV, "RAY_TMPDIR": str(not_a_dir)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    ours = [line for line in r.stderr.splitlines() if line.startswith(("error:", "[dataflow]"))]
    assert ours == [r.stderr.strip().splitlines()[-1]], r.stderr
    assert ours[0].startswith(f"error: Ray did not start on this machine: NotADirectoryError: [Errno 20] Not a "
                              f"directory: '{not_a_dir}/ray' (Ray writes under RAY_TMPDIR"), r.stderr
    assert "Traceback" not in r.stderr and "running" not in r.stdout, r.stdout + r.stderr


def test_ctrl_c_stops_a_join_that_never_completes(tmp_path):
    """Something accepts TCP connections on the address but never speaks Ray: ray.init would wait
    in Ray's C++ code; Ctrl-C (SIGINT to the group, as a terminal sends it) still ends the CLI."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted = []
    threading.Thread(target=lambda: [accepted.append(server.accept()) for _ in range(16)], daemon=True).start()
    port = server.getsockname()[1]
    run = CliProcess("tests/graphs/squares.py", "--address", f"127.0.0.1:{port}", "--out", tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not accepted and time.monotonic() < deadline:  # the probe connected
            time.sleep(0.1)
        time.sleep(3)  # now inside ray.init
        assert run.proc.poll() is None, run.stderr
        t_signal = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGINT)
        rc = run.wait(timeout=30)
        seconds = time.monotonic() - t_signal
    finally:
        run.kill()
        server.close()
    assert rc == 130, (rc, run.stderr)
    assert seconds < 10, seconds
    assert "[dataflow] interrupted" in run.stderr


def test_a_signal_during_start_up_prints_the_interrupt_line_and_nothing_after(tmp_path):
    """SIGTERM to the group while a node is in its setup (the driver waits for every node's
    connect call): exit 130, the interrupt line is the last thing printed, and no call the
    driver left behind reports the actor's death afterwards ("Task exception was never
    retrieved", ActorDiedError)."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"a": 1}\n')
    run = CliProcess("tests/graphs/jsonl_reader.py", "--set", f"reader.path={data}", "--set", "reader.setup_wait_s=120",
                     "--out", tmp_path / "run")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "setup-started").exists():
            assert run.proc.poll() is None and time.monotonic() < deadline, (run.stdout, run.stderr)
            time.sleep(0.1)
        os.killpg(run.proc.pid, signal.SIGTERM)
        rc = run.wait(timeout=60)
    finally:
        run.kill()
    assert rc == 130, (rc, run.stdout, run.stderr)
    err = run.stderr.strip().splitlines()
    assert err and err[-1] == "[dataflow] interrupted: stopped every node and Ray.", run.stderr
    for noise in ("Task exception was never retrieved", "ActorDiedError", "Traceback"):
        assert noise not in run.stdout + run.stderr, run.stdout + run.stderr
