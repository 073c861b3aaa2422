"""Answer checkers for reward files: `math_reward` (math-verify) and `gsm8k_reward` (`#### n`).

Both are per-sample rewards, reward(prompt, response, **fields) -> 0.0 or 1.0. The reference
answer is the row's `answer` field, or verl's `reward_model.ground_truth` (so verl-layout rows
work unchanged). Use them as `--set reward.path=rl/reward/math_reward.py --set reward.function=math_reward`
(or `gsm8k_reward`), or import them in a reward file of your own.

math_reward: extraction and equivalence are math-verify's (github.com/huggingface/Math-Verify,
the library verl and TRL use): LaTeX (\\boxed{} first) and plain expressions, numeric equality to
6 decimals, symbolic equality, sets, intervals, matrices. A reference answer without delimiters
("\\frac{1}{2}", "5100") is read as LaTeX math ($...$), as verl reads it (it wraps it in \\boxed{}).
Agreement with math-verify's own test cases: tests/integration/test_math_reward.py.

Timeout and cache: each comparison runs in a worker process (rl/reward/isolated.py) that is killed past
`MATH_TIMEOUT_S` (sympy can hold the GIL for minutes on a model's `10^{10^{10}}`, which no
in-process timeout interrupts); a comparison that times out counts as unequal. Inside the worker
(its main thread) math-verify's own signal timeouts stop Python-level slowness first, so most
slow cases cost no restart. Results are cached per (response, reference answer).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import threading
from decimal import Decimal, InvalidOperation

from rl.reward.isolated import KillablePool, WorkerTimeout, in_worker

MATH_TIMEOUT_S = 6.0
"""Longest one math comparison may take (parse both answers + verify) before it counts as unequal."""
MATH_WORKERS = max(1, min(4, os.cpu_count() or 1))
"""Worker processes that run comparisons; calls beyond that wait for a free one."""

_pool: KillablePool | None = None
_pool_lock = threading.Lock()


def reference_answer(answer=None, reward_model=None) -> str:
    """The reference answer of a row: verl's reward_model["ground_truth"], else `answer`."""
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return str(reward_model["ground_truth"])
    if answer is not None:
        return str(answer)
    raise ValueError("needs the reference answer: the row has neither an `answer` field nor "
                     "verl's reward_model.ground_truth")


def math_reward(prompt, response: str, answer=None, reward_model=None, **fields) -> float:
    """1.0 if math-verify finds the response's final answer equal to the reference, else 0.0."""
    return 1.0 if answers_equal(response, reference_answer(answer, reward_model)) else 0.0


@functools.lru_cache(maxsize=4096)
def answers_equal(response: str, gold: str, timeout_s: float = MATH_TIMEOUT_S) -> bool:
    """math-verify's verdict on `response` against the reference `gold`, in a worker process.
    Cached; a comparison past timeout_s is unequal (and cached as such, so it is not retried)."""
    try:
        return bool(_math_pool().call("rl.reward.math_reward:verify_in_worker", (response, gold, timeout_s), timeout_s))
    except WorkerTimeout:
        return False


def _math_pool() -> KillablePool:
    global _pool
    with _pool_lock:
        if _pool is None:
            if importlib.util.find_spec("math_verify") is None:
                raise ModuleNotFoundError("math_reward needs math-verify: pip install math-verify")
            _pool = KillablePool(MATH_WORKERS, preload=("rl.reward.math_reward",))
        return _pool


@functools.lru_cache(maxsize=1)
def _extraction():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # The configuration of math-verify's own tests (boxed answers first, then any LaTeX, then
    # plain expressions), used for both sides.
    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


_DELIMITED = ("$", "\\(", "\\[", "\\boxed", "\\fbox")


@functools.lru_cache(maxsize=1024)
def _parse_gold(gold: str, timeout: int | None):
    from math_verify import parse

    if not any(d in gold for d in _DELIMITED):
        parsed = parse(f"${gold}$", _extraction(), parsing_timeout=timeout)
        if parsed:
            return parsed
    return parse(gold, _extraction(), parsing_timeout=timeout)


def verify_in_worker(response: str, gold: str, timeout_s: float = MATH_TIMEOUT_S) -> bool:
    """parse + verify with math-verify. Runs in a KillablePool worker, whose main thread lets
    math-verify's signal timeouts work: each of its three steps (parse the reference, parse the
    response, verify) gets a third of timeout_s, in whole seconds. Elsewhere they are off (off the
    main thread they raise) and only the caller's kill bounds the call."""
    from math_verify import parse, verify

    timeout = max(1, int(timeout_s // 3)) if in_worker() else None
    return bool(verify(_parse_gold(gold, timeout), parse(response, _extraction(), parsing_timeout=timeout),
                       timeout_seconds=timeout))


# ---------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------

_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def gsm8k_reward(prompt, response: str, answer=None, reward_model=None, **fields) -> float:
    """1.0 if the response's last `#### <number>` equals the reference number, else 0.0.

    GSM8K's format (verl's gsm8k scorer, method="strict"): the answer must follow "####"; commas
    and a "$" are ignored, numbers compare by value ("72" == "72.0"). The reference may be the
    dataset's whole solution ending in "#### 72", or just "72".
    """
    gold = reference_answer(answer, reward_model)
    if "####" in gold:
        gold = gold.rsplit("####", 1)[1]
    found = _GSM8K_ANSWER.findall(response)
    if not found:
        return 0.0
    pred, gold = found[-1].replace(",", ""), gold.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return 1.0 if Decimal(pred) == Decimal(gold) else 0.0
    except InvalidOperation:
        return 1.0 if pred == gold else 0.0


if in_worker():
    # Imported as a worker's preload: load math-verify's LaTeX grammar now, not in the first
    # call's timeout.
    verify_in_worker("$1$", "1")
