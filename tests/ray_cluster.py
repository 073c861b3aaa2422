"""A Ray cluster started the way a user starts one (`ray start --head`), for tests of runs that join
a cluster with --address; ended without `ray stop`, which would stop every Ray instance on the machine
(the test module's own too)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path


@contextlib.contextmanager
def ray_start_cluster(num_cpus: int = 4):
    """Yields (address, env): the head's address and the environment to run `dataflow.run` in."""
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]   # `ray`, also where Ray's scripts are not on PATH
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    with socket.socket() as sock:  # a free port outside Ray's worker port range (10002-19999)
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    temp_dir = tempfile.mkdtemp(dir="/tmp", prefix="dfray")  # short: Ray's socket paths max 107 bytes
    start = subprocess.run([*ray_cli, "start", "--head", f"--port={port}", f"--num-cpus={num_cpus}",
                            "--include-dashboard=false", f"--temp-dir={temp_dir}"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert start.returncode == 0, start.stderr
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        # the processes of this cluster, found by its temp dir, and its Ray client server, whose
        # command line names only the GCS address (an argument ending in :port)
        kill_processes_mentioning(temp_dir)
        kill_processes_mentioning(f":{port}\0")
        shutil.rmtree(temp_dir, ignore_errors=True)


def kill_processes_mentioning(text: str) -> None:
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            if text in (pid_dir / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(pid_dir.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
