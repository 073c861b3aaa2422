"""rl/algorithm/metrics.py: pass@k against the exact combinatorial definition, and the validation table."""

import itertools
import math
from fractions import Fraction

import pytest

from rl.algorithm.metrics import PromptResult, pass_at_k, validation_metrics


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 - C(n-c, k) / C(n, k) in exact rationals."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def enumerated_pass_at_k(n: int, c: int, k: int) -> float:
    """The definition: the share of k-subsets of the n samples holding a correct one."""
    correct = set(range(c))
    subsets = list(itertools.combinations(range(n), k))
    return sum(bool(correct & set(s)) for s in subsets) / len(subsets)


def test_pass_at_k_equals_the_combinatorial_definition():
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                got = pass_at_k(n, c, k)
                assert got == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)
                assert got == pytest.approx(enumerated_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    # large n (huge binomials): the stable product still matches exact rationals
    for n, c, k in [(200, 3, 50), (1000, 1, 10), (500, 250, 100), (300, 0, 7)]:
        assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-9)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)     # pass@1 = c / n
    for bad in [(4, 5, 1), (4, 2, 0), (4, 2, 5), (3, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(*bad)


def test_validation_metrics_per_data_source_and_overall():
    rows = [PromptResult(1.0, [1.0, 0.0, 0.0, 1.0], "gsm8k"),
            PromptResult(0.0, [0.0, 0.0, 0.0, 0.0], "gsm8k"),
            PromptResult(0.5, [0.6, 0.4, 0.2, 0.0], "math"),
            PromptResult(1.0, [1.0, 1.0, 1.0, 1.0], None)]   # no data source: overall only
    got = validation_metrics(rows, ks=[1, 2, 4], correct_above=0.5)
    # plain loops, float64
    for name, sub in [("val", rows), ("val/gsm8k", rows[:2]), ("val/math", rows[2:3])]:
        assert got[f"{name}/mean@1"] == pytest.approx(sum(r.greedy for r in sub) / len(sub))
        assert got[f"{name}/mean@4"] == pytest.approx(sum(sum(r.samples) for r in sub) / (4 * len(sub)))
        for k in (1, 2, 4):
            want = sum(enumerated_pass_at_k(4, sum(s > 0.5 for s in r.samples), k) for r in sub) / len(sub)
            assert got[f"{name}/pass@{k}"] == pytest.approx(want)
    assert got["val/gsm8k/pass@2"] == pytest.approx((5 / 6 + 0) / 2)
    assert got["val/math/pass@4"] == 1.0 and got["val/math/pass@1"] == 0.25   # 0.6 > 0.5 only
    assert not any(k.startswith("val/None") for k in got)
    greedy_only = validation_metrics([PromptResult(1.0), PromptResult(0.0)], ks=[])
    assert greedy_only == {"val/mean@1": 0.5}
    with pytest.raises(ValueError, match="same number of samples"):
        validation_metrics([PromptResult(1.0, [1.0]), PromptResult(0.0)], ks=[1])
