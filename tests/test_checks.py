"""dataflow/checks.py: constraints declared beside settings, checked over a whole config tree."""

from dataclasses import dataclass, field
from typing import Annotated, Literal

from dataflow.checks import AtLeast, ExistingPath, Fraction, NonNegative, Positive, Range, problems
from dataflow.config import apply_overrides


@dataclass(kw_only=True)
class Inner:
    lr: Annotated[float, Positive] = 1e-3
    share: Annotated[float, Fraction] = 0.5
    path: Annotated[str, ExistingPath(kind="dir")] = ""
    mode: Literal["a", "b"] = "a"


@dataclass(kw_only=True)
class Outer:
    steps: Annotated[int, AtLeast(1)] = 10
    staleness: Annotated[int, NonNegative] = 1
    clip: Annotated[float, Range(0, 1, low_open=True, note="a fraction")] = 0.2
    inner: Inner = field(default_factory=Inner)


def test_defaults_pass_and_set_still_converts_through_annotated_types():
    assert problems(Outer()) == []
    cfg = apply_overrides(Outer(), ["steps=5", "inner.lr=0.5", "inner.mode=b"])
    assert (cfg.steps, cfg.inner.lr, cfg.inner.mode) == (5, 0.5, "b")


def test_every_violation_is_one_line_naming_the_dotted_setting(tmp_path):
    cfg = apply_overrides(Outer(), ["steps=0", "staleness=-1", "clip=0", "inner.lr=-2",
                                    "inner.share=1.5", f"inner.path={tmp_path / 'missing'}"])
    found = problems(cfg)
    assert found == [
        "steps=0: must be >= 1",
        "staleness=-1: must be >= 0",
        "clip=0.0: must be > 0 and <= 1 (a fraction)",
        "inner.lr=-2.0: must be > 0",
        "inner.share=1.5: must be > 0 and <= 1",
        f"inner.path='{tmp_path / 'missing'}': {tmp_path / 'missing'} does not exist",
    ]


def test_non_finite_numbers_and_wrong_kinds_of_path(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    cfg = apply_overrides(Outer(), ["inner.lr=nan", f"inner.path={tmp_path / 'f.txt'}"])
    assert problems(cfg) == ["inner.lr=nan: must be a finite number > 0",
                             f"inner.path='{tmp_path / 'f.txt'}': {tmp_path / 'f.txt'} is not a directory"]
