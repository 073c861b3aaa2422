"""rl/reward/reward_fn.py and rl/reward/runner.py: reward files in each form users write (ours, verl's,
TRL's, async), their load errors, and running calls concurrently under a timeout with failures
marked."""

import asyncio
import logging
import math
import threading
import time

import pytest

from rl.reward import reward_fn as rewards
from rl.reward.runner import Request, RewardRunner


def write(tmp_path, text, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def score(fn, requests, timeout_s=2.0, max_concurrency=32):
    """[(score, error)] of RewardRunner.score on `requests` ((prompt, response, fields) tuples)."""
    runner = RewardRunner(fn, timeout_s, max_concurrency)
    try:
        outcomes = asyncio.run(runner.score([Request(p, r, f, [1, 2]) for p, r, f in requests]))
    finally:
        runner.close()
    return [(o.score, o.error) for o in outcomes]


VERL_ROW = {"data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": "42"},
            "extra_info": {"split": "train", "index": 7}, "ability": "math"}


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
    assert fn.form == rewards.SAMPLE and not fn.is_async
    # fields it does not name (task, id) are not passed to it
    assert fn("p", "42", answer="42", task="x", id=3) == 1.0
    assert rewards.load_reward_fn(path, name="loose")("p", "r", a=1, b=2) == 2
    assert rewards.load_reward_fn(path, name="Judge")("p", "r") == 0.5
    assert score(fn, [("p", "42", {"answer": "42"}), ("p", "41", {"answer": "42"})]) == [(1.0, None), (0.0, None)]


def test_verl_compute_score_gets_the_row_mapped(tmp_path):
    """verl's form, told by its name: ground_truth from reward_model.ground_truth (else answer),
    data_source and extra_info from the row; a dict result gives its "score"."""
    path = write(tmp_path, """
seen = []
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    seen.append((data_source, solution_str, ground_truth, extra_info))
    if solution_str == "dict":
        return {"score": 0.25, "acc": True}
    return float(solution_str.strip() == ground_truth)

def by_signature(data_source, solution_str, ground_truth, extra_info, **kwargs):
    return {"acc": 1.0}
""")
    fn = rewards.load_reward_fn(path, name="compute_score")
    assert fn.form == rewards.VERL
    assert score(fn, [("p", " 42", VERL_ROW), ("p", "dict", VERL_ROW), ("p", "7", {"answer": "7"}),
                      ("p", "7", {"task": "x"})]) == [
        (1.0, None), (0.25, None), (1.0, None),
        (None, "compute_score needs a ground truth: the row has neither reward_model.ground_truth nor an "
               "`answer` field")]
    seen = fn.fn.__globals__["seen"]
    assert seen[0] == ("openai/gsm8k", " 42", "42", {"split": "train", "index": 7})
    assert seen[2] == ("", "7", "7", {})                                 # a plain row
    other = rewards.load_reward_fn(path, name="by_signature")
    assert other.form == rewards.VERL
    assert score(other, [("p", "x", VERL_ROW)]) == [(None, "returned a dict without 'score' (keys ['acc'])")]


def test_trl_batched_reward_gets_columns_as_lists(tmp_path):
    path = write(tmp_path, """
calls = []
def accuracy(prompts, completions, answer, **kwargs):
    calls.append((prompts, completions, answer, sorted(kwargs)))
    return [None if c == "skip" else float(c == a) for c, a in zip(completions, answer)]

def short(completions, **kwargs):
    return [1.0]
""")
    fn = rewards.load_reward_fn(path, name="accuracy")
    assert fn.form == rewards.BATCHED
    rows = [("p0", "1", {"answer": "1", "tag": "a"}), ("p1", "2", {"answer": "3", "tag": "b"}),
            ("p2", "skip", {"answer": "4"})]
    assert score(fn, rows) == [(1.0, None), (0.0, None), (None, "returned None for this completion")]
    calls = fn.fn.__globals__["calls"]
    assert calls == [(["p0", "p1", "p2"], ["1", "2", "skip"], ["1", "3", "4"], ["completion_ids", "tag"])]
    assert score(rewards.load_reward_fn(path, name="short"), rows) == [
        (None, "returned 1 values for 3 completions; return a list of 3 floats")] * 3


CHAT = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "add 1 + 2 ="}]


def outcomes(fns, requests, weights=None):
    """RewardRunner.score's Outcomes for several functions (rl.reward.reward_fn.Rewards)."""
    runner = RewardRunner(rewards.Rewards(fns, weights), 2.0, 32)
    try:
        return asyncio.run(runner.score([Request(p, r, f, [1, 2, 3]) for p, r, f in requests]))
    finally:
        runner.close()


def test_trl_conversational_rows_get_messages_and_several_functions_are_weighted(tmp_path):
    """TRL's GRPOTrainer convention: a row whose prompt is a chat gives `prompts` as its messages
    and each completion as [{"role": "assistant", "content": text}]; other columns as lists;
    completion_ids; None skips one function's value (the others' weighted sum counts, TRL's
    nansum) and a response no function scored is failed (TRL's unscorable row)."""
    path = write(tmp_path, """
calls = []
def accuracy(prompts, completions, solution, completion_ids, **kwargs):
    calls.append((prompts, completions, solution, completion_ids, sorted(kwargs)))
    return [None if s is None else float(c[0]["content"] == s) for c, s in zip(completions, solution)]

def format_reward(completions, **kwargs):
    return [None if c[0]["content"] == "none" else 1.0 for c in completions]
""")
    loaded = rewards.load_rewards(path, ["accuracy", "format_reward"], [1.0, 0.2])
    assert [fn.form for fn in loaded.fns] == [rewards.BATCHED] * 2 and loaded.weights == [1.0, 0.2]
    row = {"solution": "3", "level": 1, "raw_prompt": CHAT}
    requests = [("<rendered 0>", "3", row), ("<rendered 0>", "4", row),
                ("<rendered 1>", "3", {**row, "solution": None}), ("<rendered 1>", "none", {**row, "solution": None})]
    got = outcomes(loaded.fns, requests, loaded.weights)
    assert [(o.score, o.error) for o in got] == [
        (1.2, None), (0.2, None), (0.2, None), (None, "every reward function returned None for this completion")]
    assert got[0].components == {"accuracy": 1.0, "format_reward": 1.0}
    assert got[2].components == {"accuracy": None, "format_reward": 1.0}
    [(prompts, completions, solution, ids, others)] = loaded.fns[0].fn.__globals__["calls"]
    assert prompts == [CHAT] * 4                                     # the messages, not the rendered text
    assert completions == [[{"role": "assistant", "content": c}] for c in ("3", "4", "3", "none")]
    assert solution == ["3", "3", None, None] and ids == [[1, 2, 3]] * 4
    assert others == ["level"]                                       # the row's other columns, no raw_prompt
    # a plain-text row: strings, as TRL passes them for a standard (non-chat) dataset
    loaded.fns[0].fn.__globals__["calls"].clear()
    outcomes(loaded.fns[:1], [("text prompt", "3", {"solution": "3"})])
    assert loaded.fns[0].fn.__globals__["calls"][0][:2] == (["text prompt"], ["3"])
    with pytest.raises(rewards.RewardLoadError, match=r"reward.weights has 1 values for 2 reward function"):
        rewards.load_rewards(path, ["accuracy", "format_reward"], [1.0])


def test_trls_own_reward_functions_run_unchanged(tmp_path):
    """trl.rewards' accuracy_reward and think_format_reward (TRL's GRPO docs use them), imported by
    a reward file as a TRL user writes it, on conversational completions (trl: the test extra)."""
    path = write(tmp_path, """
from trl.rewards import accuracy_reward, think_format_reward
""")
    loaded = rewards.load_rewards(path, ["accuracy_reward", "think_format_reward"], [1.0, 0.5])
    row = {"solution": "3", "raw_prompt": CHAT}
    got = outcomes(loaded.fns, [("p", "<think>\n1 + 2\n</think>\nThe answer is $\\boxed{3}$", row),
                                ("p", "The answer is $\\boxed{4}$", row), ("p", "no think, 3", row)],
                   loaded.weights)
    assert [(o.score, o.error) for o in got] == [(1.5, None), (0.0, None), (0.0, None)]
    assert got[0].components == {"accuracy_reward": 1.0, "think_format_reward": 1.0}


def test_verl_default_name_kwargs_extras_and_batched_form(tmp_path):
    """A file with verl's compute_score and no `reward` is used with no reward.function; reward.kwargs
    reach every call (verl's reward_kwargs; an unknown one is a load error); a dict result's other
    numeric keys are kept for the metrics; verl's batched form takes lists, returns a list."""
    path = write(tmp_path, """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0):
    if solution_str.strip() == ground_truth:
        return {"score": 1.0, "acc": 1.0, "pred": solution_str}
    return {"score": format_score, "acc": 0.0, "pred": solution_str}

def batched(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [{"score": float(s == g) + kwargs["bonus"], "acc": float(s == g)} if d else None
            for d, s, g in zip(data_sources, solution_strs, ground_truths)]
""")
    [fn] = rewards.load_rewards(path, "", {}, {"format_score": 0.1}).fns
    assert fn.name == "compute_score" and fn.form == rewards.VERL
    got = outcomes([fn], [("p", "42", VERL_ROW), ("p", "41", VERL_ROW)])
    assert [(o.score, o.extras) for o in got] == [(1.0, {"acc": 1.0}), (0.1, {"acc": 0.0})]
    with pytest.raises(rewards.RewardLoadError, match=r"reward.kwargs has 'bonus', which it does not take"):
        rewards.load_rewards(path, "", {}, {"bonus": 1})
    [batched] = rewards.load_rewards(path, "batched", {}, {"bonus": 0.5}).fns
    assert batched.form == rewards.VERL_BATCHED
    got = outcomes([batched], [("p", "42", VERL_ROW), ("p", "4", VERL_ROW), ("p", "7", {"answer": "7"})])
    assert [(o.score, o.error, o.extras) for o in got] == [
        (1.5, None, {"acc": 1.0}), (0.5, None, {"acc": 0.0}), (None, "returned None for this completion", {})]


def test_async_rewards_of_each_form(tmp_path):
    path = write(tmp_path, """
import asyncio
async def reward(prompt, response, answer):
    await asyncio.sleep(0.01)
    return float(response == answer)

async def batched(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [len(c) for c in completions]

class Judge:
    async def __call__(self, data_source, solution_str, ground_truth, extra_info):
        return 0.5
""")
    fn = rewards.load_reward_fn(path)
    assert fn.is_async and fn.form == rewards.SAMPLE
    assert score(fn, [("p", "1", {"answer": "1"}), ("p", "2", {"answer": "1"})]) == [(1.0, None), (0.0, None)]
    batched = rewards.load_reward_fn(path, name="batched")
    assert batched.is_async and batched.form == rewards.BATCHED
    assert score(batched, [("p", "ab", {}), ("p", "abc", {})]) == [(2.0, None), (3.0, None)]
    judge = rewards.load_reward_fn(path, name="Judge")
    assert judge.is_async and judge.form == rewards.VERL
    assert score(judge, [("p", "x", VERL_ROW)]) == [(0.5, None)]


def test_dict_rewards_are_weighted(tmp_path):
    path = write(tmp_path, """
def reward(prompt, response, **fields):
    return {"correct": 1.0, "format": 0.5}
""")
    fn = rewards.load_reward_fn(path, weights={"correct": 2.0, "format": -1.0})
    assert fn("p", "r") == pytest.approx(1.5)
    assert rewards.load_reward_fn(path)("p", "r") == pytest.approx(1.5)      # no weights: all 1
    assert rewards.load_reward_fn(path, weights={})("p", "r") == pytest.approx(1.5)
    [(value, error)] = score(rewards.load_reward_fn(path, weights={"correct": 1.0}), [("p", "r", {})])
    assert value is None and "make them match" in error and "'format'" in error
    nan = write(tmp_path, "def reward(prompt, response):\n    return {'a': float('nan')}\n", "n.py")
    assert score(rewards.load_reward_fn(nan), [("p", "r", {})]) == [(None, "component 'a' is nan, not a finite number")]


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(rewards.RewardLoadError, match="absent.py: reward file does not exist"):
        rewards.load_reward_fn(str(tmp_path / "absent.py"))
    bad = write(tmp_path, "def reward(prompt, response):\n    return (1\n\nx = 1\n", "bad.py")
    with pytest.raises(rewards.RewardLoadError, match=r"bad\.py:\d: syntax error"):
        rewards.load_reward_fn(bad)
    boom = write(tmp_path, "import math\nraise RuntimeError('no gpu')\n", "boom.py")
    with pytest.raises(rewards.RewardLoadError, match=r"boom\.py:2: importing it raised RuntimeError"):
        rewards.load_reward_fn(boom)
    other = write(tmp_path, "def score(prompt, response):\n    return 1.0\n\ndef one(text):\n    return 1.0\n",
                  "other.py")
    with pytest.raises(rewards.RewardLoadError, match=r"other\.py: no function or class named "
                                                      r"'reward' or 'compute_score'; it defines \['one', 'score'\]"):
        rewards.load_reward_fn(other)
    assert rewards.load_reward_fn(other, name="score")("p", "r") == 1.0
    with pytest.raises(rewards.RewardLoadError, match=r"one \(.*other\.py\): its signature does not fit the "
                                                      r"reward\(prompt, response, \*\*fields\) form"):
        rewards.load_reward_fn(other, name="one")


def fails(prompt, response, **fields):
    raise KeyError("answer")


def test_failures_are_marked_and_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger="rl.reward.runner"):
        assert score(rewards.RewardFn(fails), [("p", "r", {})] * 3) == [(None, "KeyError: 'answer'")] * 3
    assert sum("Traceback" in rec.getMessage() for rec in caplog.records) == 1   # logged once
    for value, word in [(float("nan"), "nan"), (math.inf, "inf"), ("0.5", "str")]:
        [(result, error)] = score(rewards.RewardFn(lambda p, r, v=value: v), [("p", "r", {})])
        assert result is None and word in error and "finite float" in error
    # None is "no score" (TRL's skip) in every form: with one function, the response failed
    assert score(rewards.RewardFn(lambda p, r: None), [("p", "r", {})]) == [(None, "returned None for this completion")]
    # "prompt"/"response" fields are not passed twice
    assert score(rewards.RewardFn(lambda p, r, **f: len(f)), [("p", "r", {"prompt": "x", "a": 1})]) == [(1.0, None)]


@pytest.mark.parametrize("kind", ["sleep", "async", "async_blocking"])
def test_a_hanging_reward_costs_one_timeout_per_batch(kind):
    """16 hanging calls with a 0.5 s timeout: the batch ends in about one timeout (not 16 x 0.5 s
    = 8 s), every response marked timed out; the abandoned threads are counted while they run.
    (A call that spins instead of sleeping also times out, but 16 spinning threads share the GIL
    with the caller's loop, so how long that batch takes measures the machine, not this code.)"""
    stop = threading.Event()

    def hang(prompt, response):
        end = time.monotonic() + 5.0
        while time.monotonic() < end and not stop.is_set():
            time.sleep(0.01)

    async def hang_async(prompt, response):
        if kind == "async_blocking":
            time.sleep(0.6 + 1.0)          # blocks its loop past the timeout and the grace
        await asyncio.sleep(60)

    fn = rewards.RewardFn(hang_async if kind.startswith("async") else hang)
    runner = RewardRunner(fn, timeout_s=0.5, max_concurrency=16)
    start = time.monotonic()
    outcomes = asyncio.run(runner.score([Request("p", str(i)) for i in range(16)]))
    elapsed = time.monotonic() - start
    try:
        assert all(o.score is None and o.timed_out and "timed out after 0.5s" in o.error for o in outcomes)
        assert runner.timeouts_total == 16
        if kind == "sleep":
            assert runner.abandoned_running == 16
        assert elapsed < (2.5 if kind == "async_blocking" else 1.5), elapsed
    finally:
        stop.set()  # end the abandoned threads
        runner.close()
    time.sleep(0.1)
    assert runner.abandoned_running == 0


def test_concurrency_is_bounded():
    running, peak, lock = [0], [0], threading.Lock()

    def slow(prompt, response):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return 1.0
    assert score(rewards.RewardFn(slow), [("p", "r", {})] * 12, max_concurrency=3) == [(1.0, None)] * 12
    assert peak[0] == 3
