"""rl/rewards.py: user reward files, failure-safe scoring with timeouts, the math checker."""

import logging
import math
import threading
import time

import pytest

from rl import rewards


def write(tmp_path, text, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_function_and_class_rewards_with_fields(tmp_path):
    path = write(tmp_path, """
def reward(prompt, response, answer):
    return float(response == answer)

def loose(prompt, response, **fields):
    return len(fields)

class Judge:
    def __init__(self):
        self.bonus = 0.5
    def __call__(self, prompt, response, **fields):
        return self.bonus
""")
    fn = rewards.load_reward_fn(path)
    # fields it does not name (task, id) are not passed to it
    assert fn("p", "42", answer="42", task="x", id=3) == 1.0
    assert rewards.load_reward_fn(path, name="loose")("p", "r", a=1, b=2) == 2
    assert rewards.load_reward_fn(path, name="Judge")("p", "r") == 0.5


def test_dict_rewards_are_weighted(tmp_path):
    path = write(tmp_path, """
def reward(prompt, response, **fields):
    return {"correct": 1.0, "format": 0.5}
""")
    fn = rewards.load_reward_fn(path, weights={"correct": 2.0, "format": -1.0})
    assert fn("p", "r") == pytest.approx(1.5)
    assert rewards.load_reward_fn(path)("p", "r") == pytest.approx(1.5)      # no weights: all 1
    assert rewards.load_reward_fn(path, weights={})("p", "r") == pytest.approx(1.5)
    score, error = rewards.score_safely(rewards.load_reward_fn(path, weights={"correct": 1.0}),
                                        "p", "r", {})
    assert score is None and "make them match" in error and "'format'" in error
    nan = write(tmp_path, "def reward(prompt, response):\n    return {'a': float('nan')}\n", "n.py")
    score, error = rewards.score_safely(rewards.load_reward_fn(nan), "p", "r", {})
    assert score is None and "component 'a' is nan" in error


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(rewards.RewardLoadError, match="absent.py: reward file does not exist"):
        rewards.load_reward_fn(str(tmp_path / "absent.py"))
    bad = write(tmp_path, "def reward(prompt, response):\n    return (1\n\nx = 1\n", "bad.py")
    with pytest.raises(rewards.RewardLoadError, match=r"bad\.py:\d: syntax error"):
        rewards.load_reward_fn(bad)
    boom = write(tmp_path, "import math\nraise RuntimeError('no gpu')\n", "boom.py")
    with pytest.raises(rewards.RewardLoadError, match=r"boom\.py:2: importing it raised RuntimeError"):
        rewards.load_reward_fn(boom)
    other = write(tmp_path, "def score(prompt, response):\n    return 1.0\n", "other.py")
    with pytest.raises(rewards.RewardLoadError, match=r"other\.py: no function or class named "
                                                      r"'reward'; it defines \['score'\]"):
        rewards.load_reward_fn(other)
    assert rewards.load_reward_fn(other, name="score")("p", "r") == 1.0


def fails(prompt, response, **fields):
    raise KeyError("answer")


def test_score_safely_failures(caplog):
    assert rewards.score_safely(lambda p, r, **f: 0.25, "p", "r", {"x": 1}) == (0.25, None)
    assert rewards.score_safely(lambda p, r: 1, "p", "r", {"prompt": "dropped"}) == (1.0, None)
    with caplog.at_level(logging.WARNING, logger="nodes.rewards"):
        for _ in range(3):
            score, error = rewards.score_safely(fails, "p", "r", {}, timeout_s=1.0)
            assert score is None and error == "KeyError: 'answer'"
    assert sum("Traceback" in rec.getMessage() for rec in caplog.records) == 1   # logged once
    for value, word in [(float("nan"), "nan"), (math.inf, "inf"), ("0.5", "str"), (None, "None")]:
        score, error = rewards.score_safely(lambda p, r, v=value: v, "p", "r", {})
        assert score is None and word in error and "finite float" in error


@pytest.mark.parametrize("spin", [False, True])
def test_timeout_bounds_a_hanging_function(spin):
    stop = threading.Event()

    def hang(prompt, response):
        end = time.monotonic() + 5.0
        while time.monotonic() < end and not stop.is_set():
            if not spin:
                time.sleep(0.01)
    start = time.monotonic()
    score, error = rewards.score_safely(hang, "p", "r", {}, timeout_s=0.3)
    elapsed = time.monotonic() - start
    stop.set()  # the abandoned thread would otherwise spin on and slow the tests after this one
    assert score is None and "timed out after 0.3s" in error
    assert elapsed < 0.6                                 # honoured within 2x


@pytest.mark.parametrize("response,answer,expected", [
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
    ("\\boxed{9^9^9^9}", "1", 0.0),
    ("\\boxed{x.__class__}", "1", 0.0),
    ("answer: )))(((", "1", 0.0),
])
def test_math_reward(response, answer, expected):
    start = time.monotonic()
    assert rewards.math_reward("prompt", response, answer) == expected
    assert time.monotonic() - start < 2.5


def test_extract_answer_and_cache():
    assert rewards.extract_answer("a \\boxed{\\frac{1}{\\sqrt{4}}} b") == "\\frac{1}{\\sqrt{4}}"
    assert rewards.extract_answer("Answer: 12\nthanks") == "12"
    assert rewards.extract_answer("values -3.5 and 7/8") == "7/8"
    assert rewards.extract_answer("nothing") is None
    rewards.answers_equal.cache_clear()
    rewards.math_reward("p", "\\boxed{0.25}", "1/4")
    rewards.math_reward("p", "\\boxed{0.25}", "1/4")
    assert rewards.answers_equal.cache_info().hits >= 1
