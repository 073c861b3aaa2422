"""Graph validation and typed --set overrides, in this process (no Ray; the CLI in a process of its own:
tests/integration/test_cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dataflow import ConfigError, Graph, GraphError
from dataflow.config import apply_overrides
from tests.graphs.toy import Collect, Counter, Square, SquareConfig

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).name


def line_of(text: str) -> int:
    """Line number in this file of the first line containing `text` (after this function)."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, l in enumerate(lines, 1) if text in l and "line_of(" not in l)


def valid_graph() -> Graph:
    g = Graph("t")
    g.node("counter", Counter)
    g.node("square", Square)
    g.node("collect", Collect, ends_run=True)
    g.channel("counter.numbers", "square.numbers", capacity=2, name="numbers")
    g.channel("square.squares", "collect.squares", capacity=2, name="squares")
    return g


def problems(g: Graph) -> str:
    with pytest.raises(GraphError) as e:
        g.validate(source="g.py")
    return str(e.value)


def test_valid_graph_passes_and_knows_replicas():
    g = valid_graph()
    g.nodes["square"].replicas = 3
    g.validate()
    assert g.producers("squares") == ["square[0]", "square[1]", "square[2]"]
    assert g.consumers("numbers") == ["square[0]", "square[1]", "square[2]"]


def test_unknown_port_names_node_port_and_line():
    g = Graph("t")
    g.node("counter", Counter)
    g.node("square", Square)
    g.node("collect", Collect)
    g.channel("counter.numbers", "square.numbrs", capacity=2)  # typo on purpose
    g.channel("square.squares", "collect.squares", capacity=2)
    msg = problems(g)
    assert f"{THIS}:{line_of('square.numbrs')}" in msg
    assert "node 'square' (Square) has no input port 'numbrs'" in msg
    assert "input ports: numbers" in msg


def test_duplicate_names():
    g = valid_graph()
    g.node("square", Square)
    g.channel("counter.numbers", "square.numbers", capacity=2, name="numbers")
    msg = problems(g)
    assert "node 'square' is declared twice" in msg
    assert "channel 'numbers' is declared twice" in msg


@pytest.mark.parametrize("capacity", [0, -3, 1.5])
def test_capacity_must_be_positive_integer(capacity):
    g = valid_graph()
    g.channels["numbers"].capacity = capacity
    assert "channel 'numbers'" in problems(g) and "capacity must be an integer >= 1" in problems(g)


def test_channel_without_producer_or_consumer():
    g = Graph("t")
    g.node("counter", Counter)
    g.channel("counter.numbers", [], capacity=1, name="dangling")
    g.channel([], "counter.numbers", capacity=1, name="sourceless")
    msg = problems(g)
    assert "channel 'dangling' has no consumer" in msg
    assert "channel 'sourceless' has no producer" in msg


def test_unconnected_port_is_reported():
    g = Graph("t")
    g.node("counter", Counter)
    msg = problems(g)
    assert "node 'counter': output port 'numbers' is not connected" in msg


def test_cycle_needs_feedback_edge():
    g = Graph("t")
    g.node("a", Square)
    g.node("b", Square)
    g.channel("a.squares", "b.numbers", capacity=1, name="ab")
    g.channel("b.squares", "a.numbers", capacity=1, name="ba")
    msg = problems(g)
    assert "form a cycle" in msg and "feedback=True" in msg
    g.channels["ba"].feedback = True
    g.validate()


def test_wrong_config_type_in_graph_file():
    g = valid_graph()
    g.nodes["square"].config = SquareConfig(fail_on="three")
    assert "setting fail_on must be int (got 'three')" in problems(g)
    g.nodes["square"].config = object()
    assert "config must be a SquareConfig" in problems(g)


def test_bad_resources():
    g = valid_graph()
    g.nodes["square"].gpus = 1.5
    g.nodes["counter"].replicas = 0
    msg = problems(g)
    assert "gpus must be a fraction <= 1 or a whole number" in msg
    assert "replicas must be an integer >= 1" in msg


@dataclass
class Inner:
    lr: float = 1e-3
    name: str = "a"
    flag: bool = False
    choice: "str | None" = None


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    steps: int = 3


def test_overrides_convert_types():
    c = apply_overrides(Outer(), ["inner.lr=2e-4", "steps=7", "inner.flag=true", "inner.choice=none"])
    assert c.inner.lr == 2e-4 and c.steps == 7 and c.inner.flag is True and c.inner.choice is None
    assert Outer().steps == 3  # the original is untouched


@pytest.mark.parametrize("item, expected", [
    ("inner.lrr=1", "unknown setting 'inner.lrr'. Did you mean inner.lr?"),
    ("steps=three", "--set steps=three: expected an integer"),
    ("inner.flag=maybe", "expected a bool"),
    ("inner=3", "is a group of settings"),
    ("steps", "expected key=value"),
])
def test_override_errors(item, expected):
    with pytest.raises(ConfigError) as e:
        apply_overrides(Outer(), [item])
    assert expected in str(e.value)


@pytest.mark.parametrize("graph_file", ["graphs/grpo.py", "graphs/ppo.py", "graphs/dapo.py"])
def test_the_reference_node_runs_only_when_its_logprobs_are_read(graph_file):
    """use_reference=auto: a KL coefficient of 0 leaves the reference out and the samples go from
    its upstream straight to its downstream; > 0, or use_reference=always, keeps it."""
    from dataflow.driver.runtime import load_graph

    def wiring(*sets):
        g, _ = load_graph(str(ROOT / graph_file), list(sets))
        ports = lambda ends: ",".join(f"{node}.{port}" for node, port in ends)   # noqa: E731
        return set(g.nodes), {(ports(c.src), ports(c.dst)) for c in g.channels.values()}

    nodes, channels = wiring("learner.kl.coef=0.05")
    assert "reference" in nodes and any(dst == "reference.scored" for _, dst in channels)
    assert wiring("learner.kl.coef=0", "use_reference=always") == (nodes, channels)
    nodes0, channels0 = wiring("learner.kl.coef=0")
    assert nodes0 == nodes - {"reference"}
    upstream = next(src for src, dst in channels if dst == "reference.scored")
    downstream = next(dst for src, dst in channels if src == "reference.with_ref")
    assert channels0 == {c for c in channels if "reference" not in c[0] + c[1]} | {(upstream, downstream)}
