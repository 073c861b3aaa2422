"""Shared fixtures. `ray_instance`: one local Ray per test module (the house rule), started clean.

A module sets RAY_NUM_CPUS to ask for more logical CPUs than the default 4 (Ray schedules on
logical CPUs, so a graph with many actors fits on this 2-core machine)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before Ray starts: no token-auth banner


@pytest.fixture(scope="module")
def ray_instance(request):
    import ray

    if ray.is_initialized():  # another module left one running
        ray.shutdown()
    ray.init(num_cpus=getattr(request.module, "RAY_NUM_CPUS", 4), include_dashboard=False,
             log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}})
    yield
    ray.shutdown()
