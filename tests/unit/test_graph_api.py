"""The graph-file API: shared settings (share / fill / check rules, dataflow/config.py), GPU presets
(g.place + side=, dataflow/presets.py) and the ranks edges node() declares. No Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from dataflow import ConfigError, Graph, GraphError, check, fill, share
from dataflow.checks import problems
from dataflow.config import apply_overrides, resolve
from tests.graphs.toy import Collect, Counter, Square


@dataclass(kw_only=True)
class Part:
    size: int = 1
    mode: str = "auto"


@dataclass(kw_only=True)
class Whole:
    size: int = 4
    a: Part = field(default_factory=Part)
    b: Part = field(default_factory=Part)
    mode: str = "auto"
    rules: ClassVar[tuple] = (
        share("size", "a.size", "b.size"),
        fill("mode", lambda c: "big" if c.size > 8 else "small"),
        fill("a.mode", "mode"),
        check(lambda c: None if c.size > 0 else f"size must be > 0 (got {c.size})"),
    )


def test_share_copies_one_value_into_every_target():
    w = resolve(Whole(size=7))
    assert (w.a.size, w.b.size) == (7, 7)


def test_share_refuses_a_target_set_to_something_else():
    with pytest.raises(ConfigError, match=r"--set a.size=3 disagrees with size \(7\), which the graph shares with "
                                          r"a.size, b.size: set size instead"):
        resolve(apply_overrides(Whole(), ["size=7", "a.size=3"]))
    assert resolve(apply_overrides(Whole(), ["size=7", "a.size=7"])).b.size == 7  # agreeing is fine


def test_fill_takes_a_default_from_other_settings_and_keeps_a_users_value():
    w = resolve(Whole(size=9))
    assert (w.mode, w.a.mode, w.b.mode) == ("big", "big", "auto")
    w = resolve(apply_overrides(Whole(), ["mode=fixed", "a.mode=mine"]))
    assert (w.mode, w.a.mode) == ("fixed", "mine")


def test_check_and_a_rule_naming_no_setting_are_config_errors():
    with pytest.raises(ConfigError, match=r"size must be > 0 \(got 0\)"):
        resolve(Whole(size=0))

    @dataclass
    class Broken:
        x: int = 1
        rules: ClassVar[tuple] = (share("x", "y.z"),)

    with pytest.raises(ConfigError, match="'share x -> y.z' names 'y.z', which is not a setting"):
        resolve(Broken())


def test_apply_overrides_leaves_the_original_untouched():
    base = Whole()
    resolve(apply_overrides(base, ["size=5"]))
    assert (base.size, base.a.size) == (4, 1)


def test_graph_config_resolves_rules_and_takes_the_run_settings():
    @dataclass(kw_only=True)
    class Run(Whole):
        max_steps: int = 7
        max_restarts: int = 2

    g = Graph("t", config=Run(size=3))
    assert (g.max_steps, g.max_restarts, g.keep_checkpoints) == (7, 2, 3)
    assert g.config.a.size == 3


def toy(**square) -> Graph:
    g = Graph("t")
    g.node("counter", Counter)
    g.node("square", Square, **square)
    g.node("collect", Collect, ends_run=True)
    g.channel("counter.numbers", "square.numbers", capacity=2, name="numbers")
    g.channel("square.squares", "collect.squares", capacity=2, name="squares")
    return g


def test_a_side_node_needs_a_preset():
    g = toy(side="rollout", replicas=0)
    with pytest.raises(GraphError, match=r"node 'square' has side='rollout', but no GPU preset places it; call g.place"):
        g.validate()
    g.place("cpu")
    g.validate()
    assert g.nodes["square"].replicas == 1 and g.nodes["square"].pool is None


def test_presets_on_a_toy_graph():
    g = toy(side="rollout", replicas=0)
    g.place("colocated", num_gpus=3)
    assert (g.nodes["square"].replicas, g.nodes["square"].pool, g.nodes["square"].gpus) == (3, "gpus", 1.0)
    assert g.pools["gpus"].gpus == 3 and "test_graph_api.py" in g.pools["gpus"].where  # the g.place line
    with pytest.raises(ConfigError, match="placement='spread': choose one of cpu, colocated, split"):
        toy(side="rollout").place("spread")
    with pytest.raises(ConfigError, match="node 'square' asks for gpus=0.2, but placement=cpu uses no GPU"):
        toy(side="train", gpus=0.2).place("cpu")


def test_node_declares_the_ranks_edge_of_a_multi_rank_kind_after_the_graphs_own_edges():
    from dataflow.weights.multirank import RANKS_EDGE
    from nodes.learner import Learner

    g = Graph("t")
    g.node("learner", Learner, replicas=4)
    g.versioned("policy", src="learner", dst=["learner"])
    assert list(g.versioned_edges) == ["policy", RANKS_EDGE]
    assert (g.versioned_edges[RANKS_EDGE].src, g.versioned_edges[RANKS_EDGE].dst) == ("learner", ["learner"])
    g.versioned(RANKS_EDGE, src="learner", dst=["learner"])  # declaring it by hand as well is harmless
    assert not g._problems
    one = Graph("t")
    one.node("learner", Learner)
    assert RANKS_EDGE not in one.versioned_edges


@pytest.mark.parametrize("name", ["Generator", "RewardModel", "Reference", "Critic", "Learner"])
def test_a_model_kind_is_declared_once_and_run_by_its_implementation(name):
    """nodes/<kind>.py declares the kind (no torch), nodes/impl/<kind>.py runs it: the host runs the
    implementation, which subclasses the declaration and declares no port or setting of its own."""
    import nodes
    from dataflow.node import implementation_of

    kind = getattr(nodes, name)
    running = implementation_of(kind)
    assert running is not kind and issubclass(running, kind) and running.__module__.startswith("nodes.impl.")
    assert implementation_of(running) is running
    for attr in ("Config", "inputs", "outputs", "subscribes", "publishes", "inputs_on_replica_0", "check_settings",
                 "restart_refusal"):
        assert attr not in vars(running), f"{running.__module__}.{name} declares {attr} again"


def test_implementation_of_runs_a_subclass_of_the_implementation_and_refuses_the_declarations():
    from dataflow import Node, UserError
    from dataflow.node import implementation_of
    from nodes.impl.learner import Learner as Running
    from nodes.learner import Learner

    class Mine(Running):   # changes how the learner runs: runs itself
        pass

    class Renamed(Learner):   # the declaration subclassed: the learner's code does not subclass it
        pass

    class Nowhere(Node):
        implementation = "nodes.impl.nowhere:Learner"

    class Plain(Node):   # a user's kind: itself
        pass

    assert implementation_of(Mine) is Mine and implementation_of(Plain) is Plain
    with pytest.raises(UserError, match="does not subclass it; subclass nodes.impl.learner.Learner"):
        implementation_of(Renamed)
    with pytest.raises(UserError, match="implementation='nodes.impl.nowhere:Learner' names no class"):
        implementation_of(Nowhere)


def test_the_rlhf_graphs_share_their_settings():
    import graphs.dapo
    import graphs.grpo
    import graphs.ppo

    cfg = apply_overrides(graphs.ppo.config, ["policy.path=/m", "prompts_per_step=32", "max_staleness=2",
                                              "generator.temperature=0.7", "weight_checksums=true"])
    graphs.ppo.build(cfg)
    for node in (cfg.generator, cfg.reference, cfg.critic, cfg.learner):
        assert node.policy is cfg.policy
    assert (cfg.prompts.prompts_per_step, cfg.learner.prompts_per_step, cfg.critic.train_samples) == (32, 32, 32)
    assert (cfg.prompts.max_staleness, cfg.learner.max_staleness, cfg.learner.temperature) == (2, 2, 0.7)
    assert cfg.learner.weight_sync.checksums and cfg.generator.weight_sync.checksums
    assert cfg.reward.tokenizer_path == "/m" and cfg.generator.max_new_tokens == 3  # the built-in task's
    with pytest.raises(ConfigError, match="--set learner.max_staleness=3 disagrees with max_staleness"):
        graphs.grpo.build(apply_overrides(graphs.grpo.config, ["learner.max_staleness=3"]))
    cfg = apply_overrides(graphs.dapo.config, ["group_size=4", "prompts_per_step=8"])
    g = graphs.dapo.build(cfg)
    g.validate()
    assert (cfg.generator.group_size, cfg.learner.group_size, cfg.filter.prompts_per_step) == (4, 4, 8)
    assert g.versioned_edges["dropped"].dst == ["prompts"]
    assert problems(apply_overrides(graphs.dapo.config, ["group_size=1"])) == [
        "group_size=1: must be >= 2 (a group filter compares responses)"]
