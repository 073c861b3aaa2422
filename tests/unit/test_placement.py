"""Resource pools (dataflow/placement.py): plans are arithmetic, so they are checked here without a
GPU (the memory cap with a faked torch.cuda). Real placement groups with GPU bundles and fractional
GPU actors, on Ray with 3 logical GPUs: tests/integration/test_placement_on_ray.py;
bench/gpu_smoke.py runs a colocated graph on a real GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dataflow import ConfigError, Graph, GraphError  # noqa: E402
from dataflow import placement  # noqa: E402
from dataflow.placement import NO_POOL, plan  # noqa: E402
from tests.graphs.toy import Collect, Counter, Square  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
THIS = __file__  # declarations are located by file:line


def line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, l in enumerate(lines, 1) if text in l and "line_of(" not in l)


def toy(square: dict | None = None, collect: dict | None = None, counter: dict | None = None) -> Graph:
    """counter -> square -> collect, with the given g.node() resource arguments."""
    g = Graph("t")
    g.node("counter", Counter, **(counter or {}))
    g.node("square", Square, **(square or {}))
    g.node("collect", Collect, ends_run=True, **(collect or {}))
    g.channel("counter.numbers", "square.numbers", capacity=2, name="numbers")
    g.channel("square.squares", "collect.squares", capacity=2, name="squares")
    return g


def error(g: Graph, cluster=None) -> str:
    with pytest.raises(GraphError) as e:
        plan(g, cluster)
    return str(e.value)


def gpu_usage(p: placement.Plan) -> dict[str, list[dict[str, float]]]:
    """pool -> per GPU {replica: share}."""
    return {name: [dict(users) for users in g.usage] for name, g in p.groups.items() if name != NO_POOL}


# ---- CPU-only graphs: today's behaviour ------------------------------------------------------------------------
def test_cpu_only_graph_is_one_pack_group_with_a_bundle_per_replica():
    g = toy(square={"cpus": 0.5, "replicas": 3})
    g.validate()
    p = plan(g, cluster=[0])  # no GPU asked: a GPU-less cluster is fine
    assert list(p.groups) == [NO_POOL]
    assert p.groups[NO_POOL].strategy == "PACK"
    assert p.groups[NO_POOL].bundles == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 1.0}]
    assert [(s.replica, s.bundle, s.cpus, s.gpus) for s in p.slots.values()] == [
        ("counter", 0, 1.0, 0.0), ("square[0]", 1, 0.5, 0.0), ("square[1]", 2, 0.5, 0.0),
        ("square[2]", 3, 0.5, 0.0), ("collect", 4, 1.0, 0.0)]
    assert p.cpus == 3.5
    assert "one placement group (PACK) of 5 bundles" in p.text()


def test_gpus_without_a_pool_still_work_as_before():
    g = toy(square={"gpus": 0.5, "replicas": 2})
    g.validate()
    p = plan(g)
    assert p.groups[NO_POOL].bundles[1:3] == [{"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}]
    plan(g, cluster=[1])
    assert "nodes without a pool 1" in error(g, cluster=[0])
    g.nodes["square"].replicas = 3  # 1.5 GPUs of fractions need 2 GPUs
    assert "the graph needs 2 GPUs" in error(g, cluster=[1])


def test_a_replica_that_asks_for_nothing_runs_outside_any_group():
    p = plan(toy(counter={"cpus": 0}))  # Ray refuses an all-zero bundle
    assert p.slots["counter"].group is None and len(p.groups[NO_POOL].bundles) == 2
    assert placement.actor_options(p.slots["counter"], {}) == {"num_cpus": 0.0, "num_gpus": 0.0}


# ---- the rules -------------------------------------------------------------------------------------------------
def test_fractions_share_a_gpu_and_bundles_carry_the_cpus_of_their_replicas():
    g = toy(square={"pool": "p", "gpus": 0.5, "cpus": 2}, collect={"pool": "p", "gpus": 0.5, "cpus": 0.5})
    g.pool("p", gpus=1)
    g.validate()
    p = plan(g, cluster=[1])
    assert p.groups["p"].strategy == "STRICT_PACK"
    assert p.groups["p"].bundles == [{"GPU": 1.0, "CPU": 2.5}]
    assert (p.slots["square"].bundle, p.slots["square"].gpus) == (0, 0.5)
    assert (p.slots["collect"].bundle, p.slots["collect"].gpus) == (0, 0.5)
    assert p.groups[NO_POOL].bundles == [{"CPU": 1.0}]


def test_equal_replicas_spread_round_robin_and_largest_requests_go_first():
    g = toy(square={"pool": "p", "gpus": 0.3, "replicas": 3}, collect={"pool": "p", "gpus": 1})
    g.pool("p", gpus=3)
    p = plan(g, cluster=[4])
    # The whole GPU is placed first (GPU 0) although declared last; the shares take GPU 1, 2, then
    # the most free one again.
    assert gpu_usage(p)["p"] == [{"collect": 1.0}, {"square[0]": 0.3, "square[2]": 0.3}, {"square[1]": 0.3}]


def test_several_whole_gpus_per_replica_make_one_bundle():
    g = toy(square={"pool": "p", "gpus": 2, "replicas": 2}, collect={"pool": "p", "gpus": 0.5})
    g.pool("p", gpus=5)
    p = plan(g, cluster=[8])
    assert [s.devices for s in p.slots.values() if s.group == "p"] == [(0, 1), (2, 3), (4,)]
    assert [p.slots[r].bundle for r in ("square[0]", "square[1]", "collect")] == [0, 1, 2]
    assert [b["GPU"] for b in p.groups["p"].bundles] == [2.0, 2.0, 1.0]
    assert placement.actor_options(p.slots["square[1]"], {"p": None})["num_gpus"] == 2


def test_shares_are_rounded_down_to_what_ray_keeps():
    g = toy(counter={"pool": "p", "gpus": 1 / 6}, square={"pool": "p", "gpus": 1 / 6}, collect={"pool": "p", "gpus": 2 / 3})
    g.pool("p", gpus=1)
    p = plan(g, cluster=[1])
    assert [s.gpus for s in p.slots.values()] == [0.1666, 0.1666, 0.6666]  # Ray would round 2/3 up
    assert placement.share_of(0.3) == 0.3 and placement.share_of(0.25) == 0.25 and placement.share_of(2) == 2


# ---- invalid placements: each fails before start, naming the node, the pool, the line and the fix ---------------
def test_fractions_that_do_not_fit_one_gpu():
    g = toy(square={"pool": "p", "gpus": 0.6}, collect={"pool": "p", "gpus": 0.6})
    g.pool("p", gpus=1)
    msg = error(g)
    node_line, pool_line = line_of('g.node("collect", Collect'), line_of("msg = error(g)") - 1
    assert f"{THIS}:{node_line}: node 'collect' in pool 'p' ({THIS}:{pool_line})" in msg
    assert "replica collect needs 0.6 of a GPU, but the most free on any GPU of the pool is 0.4 (GPU 0: square 0.6)" in msg
    assert "lower the shares of the pool's nodes or give the pool more GPUs" in msg
    with pytest.raises(GraphError, match="needs 0.6 of a GPU"):  # Graph.validate reports it too
        g.validate(source="g.py")


def test_a_node_asking_more_gpus_than_its_pool_has():
    g = toy(square={"pool": "p", "gpus": 4})
    g.pool("p", gpus=2)
    assert "node 'square' in pool 'p'" in error(g) and "asks for 4 GPUs per replica, but the pool has 2" in error(g)
    g = toy(square={"pool": "p", "gpus": 1, "replicas": 3})
    g.pool("p", gpus=2)
    assert "replica square[2] asks for 1 whole GPU(s), but only 0 of the pool's 2 are free" in error(g)


def test_unknown_pool_and_pool_declaration_mistakes():
    g = toy(square={"pool": "trian", "gpus": 0.5})
    g.pool("train", gpus=1)
    msg = error(g)
    node_line = line_of('g.node("square", Square')
    assert f"{THIS}:{node_line}: node 'square': unknown pool 'trian' (pools: train)" in msg
    assert "declare it with g.pool('trian', gpus=N) or fix the name" in msg
    assert "pool 'train' has no nodes; give a node pool='train' or remove the pool" in msg

    g = toy(square={"pool": "p", "gpus": 0.5})
    g.pool("p", gpus=0.5)
    assert "pool 'p': gpus must be a whole number >= 1 (got 0.5)" in error(g)
    g = toy(square={"pool": "p", "gpus": 0.5})
    g.pool("p", gpus=1, strategy="SPREAD")
    assert "strategy must be one of STRICT_PACK, PACK (got 'SPREAD')" in error(g)
    g = toy(square={"pool": "p", "gpus": 0.5})
    g.pool("p", gpus=1)
    g.pool("p", gpus=2)
    with pytest.raises(GraphError, match="pool 'p' is declared twice"):
        g.validate()
    g = toy(square={"pool": "p"})  # gpus=0 in a pool
    g.pool("p", gpus=1)
    assert "node 'square' in pool 'p'" in error(g) and "replica square asks for gpus=0; give it a share of a GPU" in error(g)


def test_pools_larger_than_the_cluster():
    g = toy(square={"pool": "big", "gpus": 1})
    big = g.pool("big", gpus=4)
    where = f"{THIS}:{line_of('big = g.pool')}"
    assert f"{where}: pool 'big' has 4 GPUs, but the cluster has 2; make it smaller" in error(g, cluster=[2])
    assert "but the Ray cluster has none" in error(g, cluster=[0])
    assert "but the Ray cluster has none" in error(g, cluster=[])
    # STRICT_PACK wants one machine; PACK may span machines.
    assert (f"{where}: pool '{big}' (STRICT_PACK) needs its 4 GPUs on one machine, but the largest has 2 "
            "(GPUs per machine: 2, 2); pass strategy='PACK'") in error(g, cluster=[2, 2])
    g.pools["big"].strategy = "PACK"
    plan(g, cluster=[2, 2])


def test_exclusive_pools_whose_sum_exceeds_the_cluster():
    g = toy(square={"pool": "rollout", "gpus": 1}, collect={"pool": "train", "gpus": 0.5})
    g.pool("rollout", gpus=2)
    g.pool("train", gpus=1)
    plan(g, cluster=3)
    msg = error(g, cluster=[2])
    assert "the graph needs 3 GPUs (pool 'rollout' 2 at" in msg and "+ pool 'train' 1 at" in msg
    assert "pools are exclusive: no GPU is in two of them), but the cluster has 2" in msg


# ---- graphs/ppo.py and graphs/grpo.py: colocated and split on 1, 2, 4, 8 GPUs -------------------------------------
def build(graph: str, **settings) -> Graph:
    import graphs.grpo
    import graphs.ppo

    module = graphs.ppo if graph == "ppo" else graphs.grpo
    cfg = type(module.config)(**settings)
    g = module.build(cfg)
    g.validate()
    return g


MODEL_NODES = {"ppo": ["generator", "reference", "critic", "learner"], "grpo": ["generator", "reference", "learner"]}


@pytest.mark.parametrize("graph", ["ppo", "grpo"])
@pytest.mark.parametrize("num_gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("reward_share", [0.0, 0.2])
def test_colocated_plans(graph, num_gpus, reward_share):
    extra = {"reward_kind": "model", "reward_model_gpu_share": reward_share} if reward_share else {}
    g = build(graph, placement="colocated", num_gpus=num_gpus, **extra)
    p = plan(g, cluster=[num_gpus])
    usage = gpu_usage(p)["gpus"]
    assert len(usage) == num_gpus and len(p.groups["gpus"].bundles) == num_gpus
    assert all(sum(u.values()) <= 1 + 1e-9 for u in usage)
    assert all(any(r.startswith("generator") for r in u) for u in usage)  # a generator on every GPU
    placed = {r.split("[")[0] for u in usage for r in u}
    assert placed == set(MODEL_NODES[graph]) | ({"reward"} if reward_share else set())
    assert p.slots["prompts"].group == NO_POOL
    if reward_share:
        assert p.slots["reward"].gpus == reward_share
    with pytest.raises(GraphError, match="cluster has"):
        plan(g, cluster=[num_gpus - 1])


def test_colocated_layouts_read_as_documented():
    p = plan(build("ppo", placement="colocated", num_gpus=1), cluster=[1])
    assert gpu_usage(p)["gpus"] == [{"generator": 0.25, "reference": 0.25, "critic": 0.25, "learner": 0.25}]
    p = plan(build("ppo", placement="colocated", num_gpus=4), cluster=[4])
    assert gpu_usage(p)["gpus"] == [{"generator[0]": 0.5, "reference": 0.5}, {"generator[1]": 0.5, "critic": 0.5},
                                    {"generator[2]": 0.5, "learner": 0.5}, {"generator[3]": 0.5}]


@pytest.mark.parametrize("graph", ["ppo", "grpo"])
@pytest.mark.parametrize("num_gpus", [2, 4, 8])
def test_split_plans(graph, num_gpus):
    g = build(graph, placement="split", num_gpus=num_gpus, reward_kind="model", reward_model_gpu_share=0.1)
    p = plan(g, cluster=[num_gpus])
    usage = gpu_usage(p)
    assert usage["rollout"] == [{f"generator[{i}]" if num_gpus > 2 else "generator": 1.0} for i in range(num_gpus - 1)]
    trainers = MODEL_NODES[graph][1:]
    assert set(usage["train"][0]) == set(trainers) | {"reward"}
    assert sum(usage["train"][0].values()) <= 1 + 1e-9
    assert [b["GPU"] for b in p.groups["rollout"].bundles] == [1.0] * (num_gpus - 1)


def test_gpu_settings_mistakes_are_config_errors():
    with pytest.raises(ConfigError, match="placement=split needs num_gpus >= 2"):
        build("ppo", placement="split", num_gpus=1)
    with pytest.raises(ConfigError, match="reward_kind is 'function'"):
        build("ppo", placement="colocated", reward_model_gpu_share=0.2)
    with pytest.raises(ConfigError, match="needs placement=colocated or split"):
        build("ppo", reward_kind="model", reward_model_gpu_share=0.2)
    import graphs.ppo

    cfg = type(graphs.ppo.config)(placement="colocated", num_gpus=2)
    cfg.critic.dp = 4   # four NCCL ranks on two GPUs: refused before anything starts
    with pytest.raises(ConfigError, match=r"critic.dp x critic.tp = 4 ranks need a GPU each .* num_gpus >= 4"):
        graphs.ppo.build(cfg)
    cfg = type(graphs.ppo.config)(placement="split", num_gpus=4)
    cfg.learner.tp = 2
    with pytest.raises(ConfigError, match=r"learner.dp x learner.tp = 2 ranks .* placement=split gives the learner 1"):
        graphs.ppo.build(cfg)


def test_gpu_shares_give_named_nodes_their_fraction_and_the_rest_split_what_is_left():
    # One shared GPU (W1 PPO: the learner at micro-batch 32 needs ~49 GB, more than a quarter).
    p = plan(build("ppo", placement="colocated", num_gpus=1, gpu_shares={"learner": 0.4}), cluster=[1])
    assert gpu_usage(p)["gpus"] == [{"generator": 0.2, "reference": 0.2, "critic": 0.2, "learner": 0.4}]
    # split: the learner's GPU; a reward model's fixed share stays as set.
    p = plan(build("grpo", placement="split", num_gpus=2, gpu_shares={"learner": 0.6}, reward_kind="model",
                   reward_model_gpu_share=0.1), cluster=[2])
    assert gpu_usage(p)["train"] == [{"reference": 0.3, "learner": 0.6, "reward": 0.1}]
    # Read from the command line as JSON, like any dict setting.
    import graphs.ppo
    from dataflow.config import apply_overrides

    cfg = apply_overrides(graphs.ppo.config, ['gpu_shares={"learner": 0.5, "generator": 0.2}', "placement=colocated"])
    assert plan(graphs.ppo.build(cfg), cluster=[1]).slots["critic"].gpus == pytest.approx(0.15)


def test_gpu_shares_mistakes_are_config_errors():
    with pytest.raises(ConfigError, match=r"gpu_shares: 'learnr' is not a model node .* learner"):
        build("ppo", placement="colocated", gpu_shares={"learnr": 0.5})
    with pytest.raises(ConfigError, match=r"gpu_shares: learner=1.5; a share is a fraction of one GPU in \(0, 1\]"):
        build("ppo", placement="colocated", gpu_shares={"learner": 1.5})
    with pytest.raises(ConfigError, match=r"gpu_shares: critic 0.3 x 1, learner 0.7 x 1 take 1 of one GPU, "
                                          r"leaving 0 for generator, reference; lower them"):
        build("ppo", placement="colocated", gpu_shares={"learner": 0.7, "critic": 0.3})
    with pytest.raises(ConfigError, match="'reward' is not a model node"):
        build("grpo", placement="split", num_gpus=2, gpu_shares={"reward": 0.5})


@pytest.mark.parametrize("graph", ["ppo", "grpo"])
def test_weight_transport_auto_picks_cuda_ipc_only_for_one_shared_gpu(graph):
    import graphs.grpo
    import graphs.ppo

    module = graphs.ppo if graph == "ppo" else graphs.grpo
    for settings, chosen in [({}, "object_store"), ({"placement": "colocated", "num_gpus": 1}, "cuda_ipc"),
                             ({"placement": "colocated", "num_gpus": 2}, "object_store"),
                             ({"placement": "split", "num_gpus": 2}, "object_store"),
                             ({"placement": "colocated", "num_gpus": 1, "weight_transport": "object_store"},
                              "object_store")]:
        cfg = type(module.config)(**settings)
        module.build(cfg)
        assert (cfg.weight_transport, cfg.learner.weight_sync.transport, cfg.generator.weight_sync.transport) \
            == (chosen,) * 3, settings


def test_cpu_placement_is_unchanged():
    g = build("ppo")
    assert not g.pools and all(n.gpus == 0 and n.pool is None for n in g.nodes.values())
    assert g.nodes["generator"].replicas == 1
    assert list(plan(g, cluster=[0]).groups) == [NO_POOL]


# ---- describe, the host's memory cap, and real Ray -------------------------------------------------------------
def test_describe_prints_the_plan():
    from dataflow.driver.runtime import describe

    out = describe(build("ppo", placement="split", num_gpus=3))
    assert "generator    Generator        replicas=2 cpus=1 gpus=1 pool=rollout" in out
    assert "placement: 3 GPUs in 2 exclusive pools" in out
    assert "  pool 'rollout': 2 GPUs, STRICT_PACK, declared at" in out
    assert "    GPU 0: generator[0] 1\n    GPU 1: generator[1] 1" in out
    assert "  pool 'train': 1 GPU, STRICT_PACK" in out
    assert "    GPU 0: reference 0.3333 + critic 0.3333 + learner 0.3333" in out
    assert "  no pool: one placement group (PACK) of 2 bundles, one per node replica" in out


def test_a_fractional_gpu_caps_the_replicas_cuda_memory(monkeypatch):
    """The host calls torch.cuda.set_per_process_memory_fraction(share) for a share < 1 on CUDA
    (CUDA is faked here: this machine has none)."""
    import torch

    from dataflow.actor import host

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, *a: calls.append(f))
    monkeypatch.setattr(host, "Tracer", lambda *a, **k: None)
    threads = torch.get_num_threads()
    try:
        for gpus in (0.25, 1, 0):
            spec = host.HostSpec(node="n", replica=0, num_replicas=1, kind=Square, config=None, cpus=1, gpus=gpus,
                                 max_steps=None, trace=False, run_dir=".")
            h = host.NodeHost(spec)
            assert h.device == ("cuda" if gpus else "cpu")
    finally:
        torch.set_num_threads(threads)
    assert calls == [0.25]
