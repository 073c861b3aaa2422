"""Two Ray nodes: the weight push crosses raylets, not only processes of one.

ray.cluster_utils.Cluster starts a second raylet on this machine (its own object store, workers
and scheduler), which is what a second machine is to Ray; each node gets one logical GPU. With
placement=split on 2 GPUs the generator's pool (one GPU) and the learner's pool (one GPU) cannot
share a node that has one GPU, so the generator and the learner run on different Ray nodes. Both
transports that work across nodes must then deliver the learner's exact weights at every version.
What this cannot cover: two IP addresses (both raylets have this machine's), and NCCL (no GPU here;
the collective push uses gloo, whose rendezvous goes through the same published node address).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.conftest import ROOT

# learner.kl.coef=0: no reference node (the push is between learner and generator), a model
# process less to start in each run.
SMALL = ["prompts_per_step=4", "group_size=2", "learner.micro_batch_size=0", "weight_checksums=true",
         "max_staleness=0", "placement=split", "num_gpus=2", "learner.kl.coef=0"]


@pytest.fixture(scope="module")
def two_ray_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # Both raylets start here and their workers inherit PYTHONPATH (and RAY_AUTH_MODE,
    # tests/conftest.py) from this process, as with the ray_instance fixture: a runtime_env would
    # make every actor's worker wait on Ray's runtime-env agent.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 1})
    cluster.add_node(num_cpus=4, num_gpus=1)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def run_on_two_nodes(tmp_path, *overrides: str) -> list[dict]:
    """GRPO for 3 steps with SMALL and `overrides`; the run's two GPU pools (the generators' and the
    learner's) must land on the two Ray nodes. metrics.jsonl's records."""
    import ray

    from dataflow.placement import plan
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2 and all(n["Resources"].get("GPU") == 1 for n in nodes)
    graph, config = load_graph(str(ROOT / "graphs/grpo.py"), SMALL + list(overrides))
    pools = plan(graph, cluster=[1, 1]).groups
    assert [b["GPU"] for b in pools["rollout"].bundles] == [1.0] and [b["GPU"] for b in pools["train"].bundles] == [1.0]
    before = set(ray.util.placement_group_table())
    # new placement groups for each run (tests/conftest.py keeps processes between a module's runs)
    summary = asyncio.run(run_graph(graph, RunOptions(max_steps=3, out_dir=str(tmp_path), quiet=True,
                                                      keep_processes=False), config))
    assert summary.status in ("done", "max steps reached"), summary.status
    # The run's placement groups (kept in the table after removal): the two GPU pools on two nodes.
    groups = [g for k, g in ray.util.placement_group_table().items() if k not in before]
    gpu_nodes = {g["bundles_to_node_id"][i] for g in groups for i, b in g["bundles"].items() if b.get("GPU")}
    assert len(gpu_nodes) == 2, groups
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    assert [r["version"] for r in records if "step" in r] == [1, 2, 3]
    return records


def test_weights_reach_a_generator_on_another_ray_node_by_collective(two_ray_nodes, tmp_path):
    records = run_on_two_nodes(tmp_path, "weight_transport=collective")
    sums: dict[str, dict[int, float]] = {}
    for r in records:
        if "weights/checksum" in r:
            sums.setdefault(r["node"], {})[r["weights/version"]] = r["weights/checksum"]
    learner, generator = sums.pop("learner"), sums.pop("generator")
    assert len(set(learner.values())) == len(learner) >= 3, "the weights should change at every version"
    assert set(generator) >= {1, 2}
    for version, checksum in generator.items():
        assert checksum == pytest.approx(learner[version], rel=1e-12, abs=0), version


def test_weights_reach_two_generators_on_another_ray_node_by_object_store(two_ray_nodes, tmp_path):
    """The object store across raylets, with two generator replicas (both in the rollout pool, on the
    node without the learner): tests/integration/test_weight_sync.check_generators_serve_the_learners_weights,
    so every version either generator switched to has the learner's checksum, and each push carried
    the whole state in float32 once. (That check on one Ray node was a run of its own in
    test_weight_sync; this run is the same GRPO settings, placed on two nodes: a graph start-up less.)"""
    from rl.data.tasks import build_tokenizer
    from rl.model.causal_lm import ModelConfig, build_policy
    from tests.integration.test_weight_sync import check_generators_serve_the_learners_weights

    # generator.dtype=float32: the weights travel in float32, as on a CPU placement, whose push size
    # the check asserts; the split placement's default, bfloat16, travels in the collective run above.
    records = run_on_two_nodes(tmp_path, "weight_transport=object_store", "prompts_per_step=8", "group_size=4",
                               "channel_capacity=16", "learner.minibatch_size=32", "generator_replicas=2",
                               "generator.dtype=float32")
    check_generators_serve_the_learners_weights(records, "object_store",
                                                build_policy(ModelConfig(), build_tokenizer()).state_dict())
