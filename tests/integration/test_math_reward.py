"""rl/reward/math_reward.py and rl/reward/isolated.py: math-verify as the math checker (agreement with
math-verify's own test cases, no known false positives, timeouts that hold), the GSM8K checker,
and worker processes that are killed at their timeout."""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rl.reward import math_reward as mr
from rl.reward.isolated import KillablePool, WorkerError, WorkerTimeout

CASES = json.loads((Path(__file__).resolve().parents[1] / "data" / "math_verify_cases.json").read_text())


def test_agreement_with_math_verify_test_cases():
    """Every gold/pred/expected case of math-verify's tests (tests/data/math_verify_cases.json
    names the source), scored as math_reward's comparison of response=pred with answer=gold in
    our one setting: at least 95% agree. The cases that differ are those whose test changes a
    setting (LaTeX-only extraction, 2-decimal precision, strict=False, set-relation comparison, a
    decimal comma). A generous timeout: this measures the verdicts, not the machine's load."""
    cases = CASES["cases"]
    with ThreadPoolExecutor(mr.MATH_WORKERS) as pool:     # called off the main thread, as the node does
        scores = list(pool.map(lambda c: float(mr.answers_equal(c["pred"], c["gold"], 60.0)), cases))
    agree = [s == c["expected"] for s, c in zip(scores, cases)]
    differ = [(c["source"], c["gold"][:40], c["pred"][:40], c["expected"], c["match_types"])
              for c, ok in zip(cases, agree) if not ok]
    print(f"math_reward agrees with {sum(agree)} of {len(cases)} math-verify test cases; differs on {differ}")
    assert sum(agree) >= 0.95 * len(cases), differ
    # No false positive: a case we score 1 against an expected 0 is only one whose test reads
    # LaTeX alone ("Answer $ \n 9 \n $" is 9 to a plain-expression reader too).
    assert all(expected == 1 or match_types == ["latex"] for *_, expected, match_types in differ), differ


@pytest.mark.parametrize("response,answer,expected", [
    # the false positives of the hand-written checker this replaces
    ("\\boxed{\\text{(A)}}", "\\text{(C)}", 0.0),
    ("\\boxed{5100}", "(5,100)", 0.0),
    ("$\\frac{1+\\sqrt{5}}{2}$", "2", 0.0),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}", 1.0),
    ("The answer is \\boxed{\\frac{1+\\sqrt{5}}{2}}.", "\\frac{1+\\sqrt{5}}{2}", 1.0),
    ("so the result is 1/2", "0.5", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("We get \\boxed{2x+1}.", "1+2x", 1.0),
    ("\\boxed{2x+1}", "2*x + 2", 0.0),
    ("The answer is: $x = 3$.", "3", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("first 3 then 7", "7", 1.0),
    ("first 3 then 7", "3", 0.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{x^2 - 1}", "(x-1)(x+1)", 1.0),
    ("no idea", "5", 0.0),
    ("\\boxed{__import__('os').system('echo hi')}", "0", 0.0),
    ("\\boxed{x.__class__}", "1", 0.0),
    ("answer: )))(((", "1", 0.0),
    ("\\boxed{42}", 42, 1.0),                       # a number from a JSON row
])
def test_math_reward(response, answer, expected):
    assert mr.math_reward("prompt", response, answer) == expected


def test_verl_rows_and_missing_answer():
    row = {"data_source": "DigitalLearningGmbH/MATH-lighteval", "reward_model": {"ground_truth": "\\frac{3}{4}"}}
    assert mr.math_reward("p", "so \\boxed{0.75}", **row) == 1.0
    assert mr.math_reward("p", "so \\boxed{0.7}", **row) == 0.0
    with pytest.raises(ValueError, match="neither an `answer` field nor verl's reward_model.ground_truth"):
        mr.math_reward("p", "\\boxed{1}", data_source="x")


def test_pathological_answers_end_within_the_timeout():
    """Answers whose evaluation would take minutes or gigabytes end within the timeout as 0."""
    for response in ["\\boxed{10^{10^{10}}}", "\\boxed{9^9^9^9}", "$((10^{6})!)!$"]:
        start = time.monotonic()
        assert mr.math_reward("p", response, "1") == 0.0
        assert time.monotonic() - start < mr.MATH_TIMEOUT_S + 2.0, response


def test_results_are_cached():
    mr.answers_equal.cache_clear()
    mr.math_reward("p", "\\boxed{0.25}", "1/4")
    mr.math_reward("p", "\\boxed{0.25}", "1/4")
    assert mr.answers_equal.cache_info().hits == 1


@pytest.mark.parametrize("response,answer,expected", [
    ("She pays 3 * 4 = 12 dollars.\n#### 12", "She buys 3 at $4...\n#### 12", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("#### $72.00", "72", 1.0),
    ("#### -5", "-5", 1.0),
    ("12", "12", 0.0),                              # no "####": the format is part of the task
    ("#### 7 ... wait, #### 8", "8", 1.0),           # the last one counts
    ("#### 12", "13", 0.0),
])
def test_gsm8k_reward(response, answer, expected):
    assert mr.gsm8k_reward("p", response, answer) == expected
    assert mr.gsm8k_reward("p", response, reward_model={"ground_truth": answer.rsplit("####")[-1].strip()}) == expected


def test_killable_pool_kills_a_hung_call_and_goes_on():
    pool = KillablePool(1)
    try:
        assert pool.call("math:sqrt", (16.0,), 30.0) == 4.0       # 30 s: the first call starts the worker
        start = time.monotonic()
        with pytest.raises(WorkerTimeout, match="timed out after 0.5s"):
            pool.call("time:sleep", (60,), 0.5)
        assert time.monotonic() - start < 1.5 and pool.killed == 1
        with pytest.raises(WorkerError, match="ValueError: math domain error"):
            pool.call("math:sqrt", (-1.0,), 30.0)
        assert pool.call("math:sqrt", (9.0,), 30.0) == 3.0        # a fresh worker took over
    finally:
        pool.close()
