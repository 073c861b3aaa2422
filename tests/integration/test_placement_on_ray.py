"""Placement on a real Ray instance with 3 *logical* GPUs (this machine has none, but Ray schedules GPU
resources without looking at hardware): placement groups per pool, fractional GPU actors, and a
placement the cluster cannot hold refused before anything is created. The plans themselves:
tests/unit/test_placement.py."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from dataflow import Graph, GraphError
from dataflow.placement import plan
from tests.graphs.toy import Collect, Counter, Square
from tests.unit.test_placement import gpu_usage, toy

ROOT = Path(__file__).resolve().parents[2]


def report_where(ctx) -> None:
    """What Ray gave this actor, written to <run_dir>/where-<replica>.json."""
    import ray

    rc = ray.get_runtime_context()
    info = {"gpu_ids": [str(i) for i in ray.get_gpu_ids()], "pg": rc.get_placement_group_id(),
            "resources": rc.get_assigned_resources(), "device": ctx.device}
    Path(ctx.run_dir, f"where-{ctx.full_name}.json").write_text(json.dumps(info))


class WhereCounter(Counter):
    async def setup(self):
        report_where(self.ctx)


class WhereSquare(Square):
    async def setup(self):
        report_where(self.ctx)


class WhereCollect(Collect):
    async def setup(self):
        report_where(self.ctx)


@pytest.fixture(scope="module")
def ray_instance():
    """Ray with 3 *logical* GPUs: this machine has none, but Ray schedules GPU resources without
    looking at hardware, so real placement groups and fractional GPU actors can be checked
    (torch sees no CUDA, so the nodes compute on CPU)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # Workers inherit PYTHONPATH (and RAY_AUTH_MODE, tests/conftest.py) from this process, as with
    # tests/conftest.py's ray_instance: a runtime_env would make every actor wait on Ray's agent.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    ray.init(address="local", num_cpus=2, num_gpus=3, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()


def test_cpu_only_graph_runs_on_ray(ray_instance, tmp_path):
    from dataflow.driver.runtime import RunOptions, run_graph

    g = toy(counter={"cpus": 0}, square={"cpus": 0.2, "replicas": 2}, collect={"cpus": 0.2})  # counter: no bundle
    g.validate()
    # as a user's run: nothing kept for a next run (tests/conftest.py keeps processes between a module's runs)
    summary = asyncio.run(run_graph(g, RunOptions(out_dir=str(tmp_path), quiet=True, keep_processes=False)))
    assert summary.status == "done"
    assert all(pg["state"] == "REMOVED" for pg in ray_instance.util.placement_group_table().values())


def test_pools_on_ray_with_logical_gpus(ray_instance, tmp_path):
    """Pool 'a' (2 GPUs): counter 0.5 and square[1] 0.5 share GPU 0, square[0] 0.5 on GPU 1; pool
    'b' (1 GPU): collect alone. Each pool is its own placement group; every actor gets its share."""
    from dataflow.driver.runtime import RunOptions, run_graph

    g = Graph("t")
    g.pool("a", gpus=2)
    g.pool("b", gpus=1)
    g.node("counter", WhereCounter, pool="a", gpus=0.5, cpus=0.2)
    g.node("square", WhereSquare, pool="a", gpus=0.5, cpus=0.2, replicas=2)
    g.node("collect", WhereCollect, pool="b", gpus=1, cpus=0.2, ends_run=True)
    g.channel("counter.numbers", "square.numbers", capacity=2, name="numbers")
    g.channel("square.squares", "collect.squares", capacity=2, name="squares")
    g.validate()
    assert gpu_usage(plan(g, cluster=[3])) == {"a": [{"counter": 0.5, "square[1]": 0.5}, {"square[0]": 0.5}],
                                                "b": [{"collect": 1.0}]}
    summary = asyncio.run(run_graph(g, RunOptions(out_dir=str(tmp_path), quiet=True)))
    assert summary.status == "done"
    where = {r: json.loads((tmp_path / f"where-{r}.json").read_text())
             for r in ("counter", "square[0]", "square[1]", "collect")}
    assert where["counter"]["gpu_ids"] == where["square[1]"]["gpu_ids"]  # colocated on one GPU
    gpus = [where[r]["gpu_ids"][0] for r in ("counter", "square[0]", "collect")]
    assert len(set(gpus)) == 3 and all(len(w["gpu_ids"]) == 1 for w in where.values())
    assert where["counter"]["pg"] == where["square[0]"]["pg"] == where["square[1]"]["pg"] != where["collect"]["pg"]
    assert where["square[0]"]["resources"]["GPU"] == 0.5 and where["collect"]["resources"]["GPU"] == 1
    assert all(w["device"] == "cpu" for w in where.values())  # no CUDA here: no memory cap either


def test_a_placement_the_cluster_cannot_hold_fails_before_anything_is_created(ray_instance, tmp_path):
    from dataflow.driver.runtime import RunOptions, run_graph

    g = toy(square={"pool": "p", "gpus": 0.5})
    g.pool("p", gpus=4)
    g.validate()
    before = len(ray_instance.util.placement_group_table())
    with pytest.raises(GraphError, match="pool 'p' has 4 GPUs, but the cluster has 3; make it smaller"):
        asyncio.run(run_graph(g, RunOptions(out_dir=str(tmp_path), quiet=True)))
    assert len(ray_instance.util.placement_group_table()) == before  # no placement group (so no actor)
