"""Constraints declared beside a setting, checked for the whole config tree before anything starts.

A setting's type says what it is; an `Annotated` constraint says which values are allowed:

    @dataclass(kw_only=True)
    class LearnerConfig:
        lr: Annotated[float, Positive] = 1e-3
        clip_eps: Annotated[float, Range(0, 1, low_open=True)] = 0.2
        max_staleness: Annotated[int, AtLeast(0)] = 1

`--set` conversion ignores the annotation (typing.get_type_hints drops it); `problems(config)`
reads it back (include_extras=True) and returns one line per violated constraint, naming the
setting by its dotted `--set` key, the value and what is allowed. The CLI prints them all and exits
2 before Ray starts (dataflow/driver/loading.py). A `Literal[...]` setting is checked to be one of its
choices too (a graph file may assign it in Python, past --set's conversion). A subclass that
redeclares a field to change its default (`prompts_per_step: int = 16`) keeps the base class's
constraints.

Constraints of one setting only; a rule between settings (split needs num_gpus >= 2) is a config
`check` rule (dataflow/config.py) or belongs to the code that combines them (dataflow/presets.py).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataflow.errors import ConfigError


class SettingProblems(ConfigError):
    """Settings whose values break their declared constraints; one line each (`lines`), which the
    CLI prints as one `error:` line each."""

    def __init__(self, lines: list[str]):
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


class Constraint:
    """A rule for one setting's value. `problem(value)` is None when the value is allowed."""

    def problem(self, value: Any) -> str | None:
        raise NotImplementedError


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Range(Constraint):
    """low <= value <= high (either bound None = open-ended; *_open excludes the bound)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""
    """Said after the allowed range, e.g. "0 = off"."""

    def text(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return " and ".join(parts) + (f" ({self.note})" if self.note else "")

    def problem(self, value: Any) -> str | None:
        if value is None or not _number(value):
            return None  # the type check reports wrong types; None is a type's own choice
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number {self.text()}".rstrip()
        low_bad = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        high_bad = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        return f"must be {self.text()}" if low_bad or high_bad else None


def AtLeast(low: float, note: str = "") -> Range:
    return Range(low=low, note=note)


Positive = Range(low=0, low_open=True)
NonNegative = Range(low=0)
Fraction = Range(low=0, high=1, low_open=True)
"""A share or probability in (0, 1]."""
Finite = Range()
"""Any finite number (no nan, no inf)."""


@dataclass(frozen=True)
class OneOf(Constraint):
    """One of a list of values (for a `str` setting whose choices live elsewhere; a Literal type
    is checked without it)."""

    choices: tuple

    def problem(self, value: Any) -> str | None:
        if value in self.choices:
            return None
        return "choose one of " + ", ".join(map(str, self.choices))


@dataclass(frozen=True)
class Each(Constraint):
    """`rule` holds for every item of a list / tuple, or every value of a dict; `count`, when
    given, is how many items there must be."""

    rule: Constraint
    count: int | None = None

    def problem(self, value: Any) -> str | None:
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        else:
            return None
        if self.count is not None and len(items) != self.count:
            return f"give {self.count} values"
        for key, item in items:
            why = self.rule.problem(item)
            if why:
                return f"{key!r}: {item!r} {why}" if isinstance(value, dict) else f"each value {why} (got {item!r})"
        return None


@dataclass(frozen=True)
class ExistingPath(Constraint):
    """A path that must exist (an empty string means "not set" and passes when optional)."""

    kind: str = "any"
    """"file", "dir" or "any"."""
    optional: bool = True

    def problem(self, value: Any) -> str | None:
        if value in ("", None):
            return None if self.optional else "must be set to a path"
        path = Path(str(value)).expanduser()
        if not path.exists():
            return f"{path} does not exist"
        if self.kind == "file" and not path.is_file():
            return f"{path} is not a file"
        if self.kind == "dir" and not path.is_dir():
            return f"{path} is not a directory"
        return None


def constraints_of(cls: type) -> dict[str, list[Constraint]]:
    """{field name: its constraints} of a dataclass type, from its Annotated field types (and the
    choices of its Literal ones). A base class's constraint holds in a subclass that redeclares
    the field with a plain type (to change its default)."""
    out: dict[str, list[Constraint]] = {}
    for klass in reversed(cls.__mro__):
        own = klass.__dict__.get("__annotations__", {})
        if not own:
            continue
        try:
            hints = typing.get_type_hints(klass, include_extras=True)
        except Exception:
            continue
        for name in own:
            rules = _rules_of(hints.get(name))
            if rules:
                out[name] = rules
    return out


def _rules_of(tp: Any) -> list[Constraint]:
    rules = []
    if typing.get_origin(tp) is typing.Annotated:
        tp, *extras = typing.get_args(tp)
        rules = [a for a in extras if isinstance(a, Constraint)]
    choices = _literal_choices(tp)
    if choices is not None:
        rules.append(OneOf(choices))
    return rules


def _literal_choices(tp: Any) -> tuple | None:
    """The values a Literal type (or an Optional Literal: None too) allows; None if not a Literal."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        literals = [a for a in args if typing.get_origin(a) is typing.Literal]
        if literals and all(a is type(None) or a in literals for a in args):
            return tuple(v for a in literals for v in typing.get_args(a)) + ((None,) if type(None) in args else ())
    return None


def problems(config: Any, prefix: str = "", seen: set[int] | None = None) -> list[str]:
    """One line per setting of the config tree whose value breaks a declared constraint.
    `seen` (ids of the dataclasses checked already) keeps a config shared by several places of
    the tree, or checked again from another root, to one report."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return []
    seen = set() if seen is None else seen
    if id(config) in seen:
        return []
    seen.add(id(config))
    found = []
    rules = constraints_of(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            found += problems(value, f"{prefix}{f.name}.", seen)
            continue
        for rule in rules.get(f.name, ()):
            why = rule.problem(value)
            if why:
                found.append(f"{prefix}{f.name}={value!r}: {why}")
                break
    return found
