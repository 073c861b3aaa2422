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
2 before Ray starts.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
            return f"must be a finite number {self.text()}"
        low_bad = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        high_bad = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        return f"must be {self.text()}" if low_bad or high_bad else None


def AtLeast(low: float, note: str = "") -> Range:
    return Range(low=low, note=note)


Positive = Range(low=0, low_open=True)
NonNegative = Range(low=0)
Fraction = Range(low=0, high=1, low_open=True)
"""A share or probability in (0, 1]."""


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
    """{field name: its constraints} of a dataclass type, from its Annotated field types."""
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:
        return {}
    out = {}
    for name, tp in hints.items():
        if typing.get_origin(tp) is typing.Annotated:
            rules = [a for a in typing.get_args(tp)[1:] if isinstance(a, Constraint)]
            if rules:
                out[name] = rules
    return out


def problems(config: Any, prefix: str = "") -> list[str]:
    """One line per setting of the config tree whose value breaks a declared constraint."""
    if not dataclasses.is_dataclass(config):
        return []
    found = []
    rules = constraints_of(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            found += problems(value, f"{prefix}{f.name}.")
            continue
        for rule in rules.get(f.name, ()):
            why = rule.problem(value)
            if why:
                found.append(f"{prefix}{f.name}={value!r}: {why}")
                break
    return found
