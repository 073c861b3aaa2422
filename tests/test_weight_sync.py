"""weight_transport=collective (nodes/weight_sync.py) on CPU, gloo: first the two ends in one
process with stand-in node contexts (rendezvous, the wait for a version, checksums, a stall); then
the PPO graph with two generator replicas against the object-store transport, and a stalled push
failing the run. One Ray instance for the graph runs, which go through runtime.run_graph in-process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from dataflow.errors import NodeFailed  # noqa: E402
from dataflow.hybrid_engine import WeightPushError  # noqa: E402
from dataflow.runtime import RunOptions, load_graph, run_graph  # noqa: E402
from nodes.models import ModelConfig, build_policy  # noqa: E402
from nodes.tasks import build_tokenizer  # noqa: E402
from nodes.weight_sync import (SYNC_EDGE, GeneratorWeightSync, LearnerWeightSync,  # noqa: E402
                               WeightSyncConfig, weights_checksum)

ROOT = Path(__file__).resolve().parent.parent
SMALL = ("prompts_per_step=32", "channel_capacity=16", "critic.minibatch_size=32", "learner.minibatch_size=32")
GENERATORS = ("generator[0]", "generator[1]")


# ---- both ends in one process -----------------------------------------------------------------
class Edges:
    """The versioned edges between one learner and its generators (what NodeHost does over Ray)."""

    def __init__(self):
        self.values: dict[str, tuple[int, object]] = {}
        self.changed = asyncio.Condition()


class StandInContext:
    """The part of NodeContext that nodes/weight_sync.py uses."""

    def __init__(self, edges: Edges, name: str, replica: int = 0, num_replicas: int = 1,
                 subscribers: tuple[str, ...] = ()):
        self.edges, self.name, self.replica, self._subscribers = edges, name, replica, list(subscribers)
        self.full_name = f"{name}[{replica}]" if num_replicas > 1 else name
        self.device = "cpu"
        self.logged: list[dict] = []

    def subscribers(self, edge: str) -> list[str]:
        return self._subscribers if edge == SYNC_EDGE else []

    async def publish(self, edge: str, value, version: int) -> None:
        async with self.edges.changed:
            self.edges.values[edge] = (version, value)
            self.edges.changed.notify_all()

    def latest_version(self, edge: str) -> int:
        return self.edges.values.get(edge, (-1, None))[0]

    async def latest(self, edge: str):
        return self.edges.values.get(edge, (-1, None))

    async def wait_version(self, edge: str, min_version: int) -> int:
        async with self.edges.changed:
            await self.edges.changed.wait_for(lambda: self.latest_version(edge) >= min_version)
        return self.latest_version(edge)

    def span(self, name: str, **args):
        return contextlib.nullcontext()

    def metrics(self, values: dict) -> None:
        self.logged.append(values)

    def log(self, text: str) -> None:
        pass


def tiny_policy(seed: int):
    return build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, intermediate_size=64, seed=seed),
                        build_tokenizer())


def test_collective_sync_in_one_process():
    """Rendezvous in the setups; a generator asking for weights before the first push waits for
    version 0 (then serves the learner's weights, not its own different init); versions pushed
    back to back are served newest first; a generator that stops receiving makes the learner's
    publish fail within its timeout, naming both ends."""
    async def scenario():
        edges = Edges()
        names = ("generator[0]", "generator[1]")
        cfg = WeightSyncConfig(transport="collective", timeout_s=2, rendezvous_timeout_s=30, checksums=True)
        lctx = StandInContext(edges, "learner", subscribers=names)
        gctx = [StandInContext(edges, "generator", i, 2) for i in range(2)]
        learner, gens = LearnerWeightSync(lctx, cfg), [GeneratorWeightSync(c, cfg) for c in gctx]
        model = tiny_policy(seed=0)
        await asyncio.gather(learner.setup(model), *(g.setup(tiny_policy(seed=1)) for g in gens))

        async def serve(g):
            async with g.serving() as version:
                return version, weights_checksum(g.model)

        waiting = [asyncio.ensure_future(serve(g)) for g in gens]
        await asyncio.sleep(0.3)
        assert not any(w.done() for w in waiting), "served before the first push"
        await learner.publish(model, 0)
        want = {0: weights_checksum(model)}
        assert [await w for w in waiting] == [(0, want[0])] * 2
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * version)
            await learner.publish(model, version)
            want[version] = weights_checksum(model)
        assert [await serve(g) for g in gens] == [(2, want[2])] * 2
        assert lctx.logged == [{"weights/version": v, "weights/checksum": c} for v, c in want.items()]
        assert [e["weights/version"] for e in gctx[0].logged] == [0, 2]     # switched to 0, then 2

        stuck = gens[1].receiver._arena_lock
        stuck.acquire()                  # generator[1]'s receive thread waits here from now on
        try:
            with pytest.raises(WeightPushError, match=r"v3 from learner to generator\[0\], generator\[1\].*"
                               r"stalled past 2 s"):
                await learner.publish(model, 3)
        finally:
            stuck.release()
        assert lctx.latest_version("policy") == 2     # a failed push announces nothing

    asyncio.run(asyncio.wait_for(scenario(), 120))


# ---- the PPO graph -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_instance():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


def run(graph_file: str, tmp_path: Path, *overrides: str, max_steps: int) -> list[dict]:
    graph, config = load_graph(str(ROOT / graph_file), list(overrides))
    options = RunOptions(max_steps=max_steps, out_dir=str(tmp_path), quiet=True)
    summary = asyncio.run(run_graph(graph, options, config))
    assert summary.status in ("done", "max steps reached"), summary.status
    return [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_generators_serve_the_learners_weights(ray_instance, tmp_path, transport):
    """Synchronous PPO (batch k is generated at version k), 2 generators, 3 steps: steps and
    versions progress alike on both transports, and every version a generator switched to has the
    checksum the learner logged for it, up to the last version pushed (2: step 3 ends the run)."""
    records = run("graphs/ppo.py", tmp_path, *SMALL, "generator_replicas=2", "max_staleness=0",
                  "weight_checksums=true", f"weight_transport={transport}", max_steps=3)
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["version"] for r in steps] == [1, 2, 3]
    assert all(r["staleness/max"] == 0 for r in steps)
    sums: dict[str, dict[int, float]] = {}
    for r in records:
        if "weights/checksum" in r:
            sums.setdefault(r["node"], {})[r["weights/version"]] = r["weights/checksum"]
    learner = sums.pop("learner")
    assert sorted(learner) == [0, 1, 2]
    assert len(set(learner.values())) == 3, "the weights should change at every version"
    assert set(sums) == set(GENERATORS), "both generators should have switched weights"
    for gen, got in sums.items():
        for version, checksum in got.items():
            assert checksum == pytest.approx(learner[version], rel=1e-12, abs=0), (gen, version)
    served = set().union(*sums.values())
    # Object store: version 0 is the shared seed's (no switch); collective: pushed like the others.
    assert served == ({0, 1, 2} if transport == "collective" else {1, 2})


def test_stalled_push_fails_the_learner_naming_both_ends(ray_instance, tmp_path):
    """generator[1] never takes the push: the learner's push times out (2 s) and the run fails
    with the learner's WeightPushError, naming the learner and the generators."""
    with pytest.raises(NodeFailed) as failed:
        run("tests/graphs/stalled_push.py", tmp_path, "learner.weight_sync.timeout_s=2",
            "generator.weight_sync.timeout_s=60", max_steps=2)
    e = failed.value
    assert e.node == "learner", str(e)
    assert "WeightPushError" in e.summary and "stalled" in e.summary, e.summary
    assert "from learner to generator[0], generator[1]" in e.summary, e.summary
