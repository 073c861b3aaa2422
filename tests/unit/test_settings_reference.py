"""docs/settings.md is generated from the config dataclasses (graphs/settings_reference.py) and must
not go stale: this fails when a setting, its type, default, constraint or docstring changed and the
page was not regenerated (`python -m graphs.settings_reference --write`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from dataflow.checks import AtLeast, Range
from dataflow.config import fill, share
from graphs.settings_reference import PAGE, constraint_text, field_doc, render, settings


@dataclass(kw_only=True)
class _Inner:
    lr: Annotated[float, Range(0, 1, low_open=True)] = 0.5
    """The step size."""
    steps: int = 3


@dataclass(kw_only=True)
class _Outer:
    size: Annotated[int, AtLeast(1)] = 4
    """How many.

    Second paragraph."""
    mode: Literal["a", "b"] = "a"
    inner: _Inner = field(default_factory=_Inner)
    """The inner group."""
    rules: ClassVar[tuple] = (share("size", "inner.steps"), fill("inner.lr", lambda c: 0.1))


@dataclass(kw_only=True)
class _Sub(_Outer):
    size: int = 8   # redeclared to change the default: keeps the base's docstring and constraint


def test_rows_carry_type_default_constraint_and_attribute_docstring():
    rows = {r["key"]: r for r in settings(_Sub())}
    assert rows["size"]["default"] == 8 and rows["size"]["type"] == "int"
    assert rows["size"]["allowed"] == ">= 1"
    assert rows["size"]["doc"] == "How many.\n\nSecond paragraph."
    assert rows["mode"]["type"] == "'a' | 'b'" and rows["mode"]["allowed"] == ""   # a Literal's choices are its type
    assert rows["inner"]["group"] == "_Inner" and rows["inner"]["doc"] == "The inner group."
    assert rows["inner.lr"]["allowed"] == "> 0 and <= 1" and rows["inner.lr"]["doc"] == "The step size."
    assert rows["inner.steps"]["doc"] == ""
    assert field_doc(_Sub, "size") == field_doc(_Outer, "size")
    assert constraint_text(AtLeast(0, note="0 = off")) == ">= 0 (0 = off)"


def test_settings_page_is_current():
    expected = render()
    assert PAGE.exists(), "docs/settings.md is missing: python -m graphs.settings_reference --write"
    assert PAGE.read_text() == expected, "docs/settings.md is stale: python -m graphs.settings_reference --write"
    for key in ("learner.lr", "generator.backend", "prompts.path", "filter.max_num_gen_batches", "val.every"):
        assert f"| `{key}` |" in expected
    # a group the graph shares from another setting is named once, where it is set
    assert "| `prompts.policy.path` |" not in expected and "The graph copies `policy` here" in expected
