"""Reward functions as users write them: loading a reward file and telling its form apart.

A reward file defines one of these (found by `name`, default "reward"; a class is built with no
arguments and its instance called), plain or `async def`:

  reward(prompt, response, **fields) -> float | dict
      One response. `fields` are the row's other fields ("answer", verl's "data_source",
      "reward_model", "extra_info", ...); a function without **kwargs only gets those it names.
      A dict of named floats is combined with `weights`.
  compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict
      verl's form, told by its name `compute_score` or a parameter `solution_str`. ground_truth is
      the row's reward_model["ground_truth"], else its "answer"; a dict result gives its "score".
  f(prompts, completions, **kwargs) -> list[float]
      TRL's batched form, told by a parameter `completions`: every response of a batch in one call
      (completions are strings); kwargs hold the rows' other fields as lists, one entry per
      completion, and `completion_ids` (token ids). None in the list marks that one failed.

Responses are decoded without special tokens. How calls are run (concurrently, each under its
timeout, failures marked) is rl/reward_calls.py; answer checkers ship in rl/math_reward.py.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import traceback
from typing import Any, Callable

from dataflow.errors import UserError
from rl.math_reward import gsm8k_reward, math_reward  # noqa: F401 - `reward.path=rl/rewards.py` finds them

SAMPLE, VERL, BATCHED = "reward(prompt, response, **fields)", "verl compute_score", "TRL batched"


class RewardLoadError(UserError, ValueError):
    """A reward file that cannot be used; the message names the file (and line)."""


class BadResult(ValueError):
    """A reward's result (or the row it needs) does not give a score; the message says why."""


class RewardFn:
    """A loaded reward function, its form (SAMPLE, VERL or BATCHED) and whether it is async.

    Build the call for one response with `sample_args`, for a batch with `batch_args` (then
    `fn(**kwargs)`; a coroutine for async functions), and turn each result into a float with
    `to_score` (BadResult if it is not one). For sync SAMPLE/VERL functions, `fn(prompt, response,
    **fields)` does all three.

    Dict results of the SAMPLE form are combined as sum(weights[k] * value[k]). With weights
    configured, the keys must match them exactly (a typo would otherwise silently drop a
    component); with no weights (None or {}) every component has weight 1.
    """

    def __init__(self, fn: Callable, weights: dict[str, float] | None = None, source: str = "",
                 name: str = ""):
        self.fn = fn
        self.weights = dict(weights) if weights else None
        self.source = source
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):               # e.g. a builtin: pass every field
            params = [inspect.Parameter("fields", inspect.Parameter.VAR_KEYWORD)]
        self._takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self._names = {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None))
        if self.name == "compute_score" or "solution_str" in self._names:
            self.form = VERL
        elif "completions" in self._names:
            self.form = BATCHED
        else:
            self.form = SAMPLE
        self._check_signature(params)

    @property
    def where(self) -> str:
        """How messages name it: "name (file)"."""
        return f"{self.name} ({self.source})" if self.source else self.name

    def _check_signature(self, params: list) -> None:
        required = {VERL: ("solution_str", "ground_truth"), BATCHED: ("completions",), SAMPLE: ()}[self.form]
        try:
            if self.form == SAMPLE:
                inspect.Signature(params).bind_partial("prompt", "response")
            missing = [n for n in required if n not in self._names]
            if missing:
                raise TypeError(f"missing parameter {missing[0]!r}")
        except TypeError as e:
            raise RewardLoadError(
                f"{self.where}: its signature does not fit the {self.form} form ({e}); a reward takes "
                "(prompt, response, **fields), verl's compute_score(data_source, solution_str, "
                "ground_truth, extra_info) or TRL's (prompts, completions, **kwargs)") from None

    def _accepted(self, kwargs: dict) -> dict:
        return kwargs if self._takes_all else {k: v for k, v in kwargs.items() if k in self._names}

    def sample_args(self, prompt: Any, response: str, fields: dict) -> tuple[tuple, dict]:
        """(args, kwargs) scoring one response (SAMPLE or VERL form)."""
        fields = {k: v for k, v in fields.items() if k not in ("prompt", "response")}
        if self.form == SAMPLE:
            return (prompt, response), self._accepted(fields)
        reward_model = fields.get("reward_model")
        if isinstance(reward_model, dict) and "ground_truth" in reward_model:
            ground_truth = reward_model["ground_truth"]
        elif "answer" in fields:
            ground_truth = fields["answer"]
        else:
            raise BadResult("compute_score needs a ground truth: the row has neither "
                             "reward_model.ground_truth nor an `answer` field")
        extra_info = fields.get("extra_info")
        return (), self._accepted({"data_source": fields.get("data_source", ""), "solution_str": response,
                                   "ground_truth": ground_truth,
                                   "extra_info": {} if extra_info is None else extra_info})

    def batch_args(self, prompts: list, completions: list[str], fields: list[dict],
                   completion_ids: list[list[int]]) -> dict:
        """kwargs scoring a batch (BATCHED form): TRL's prompts, completions, completion_ids and
        every other field as a list (None where a row lacks it)."""
        keys = dict.fromkeys(k for f in fields for k in f if k not in ("prompt", "completion"))
        kwargs = {k: [f.get(k) for f in fields] for k in keys}
        kwargs.update(prompts=list(prompts), completions=list(completions), completion_ids=completion_ids)
        return self._accepted(kwargs)

    def to_score(self, value: Any) -> float:
        """The float score of one result; BadResult (the reason) if it is not a finite number."""
        if isinstance(value, dict):
            value = self._combine(value)
        if not _is_finite_number(value):
            raise BadResult(f"returned {type(value).__name__} {value!r:.80}, expected a finite float")
        return float(value)

    def _combine(self, value: dict) -> float:
        if self.form == VERL:                         # verl: {"score": ..., other info}
            if "score" not in value:
                raise BadResult(f"returned a dict without 'score' (keys {sorted(value)[:8]})")
            return value["score"]
        if self.weights is not None and set(value) != set(self.weights):
            raise BadResult(f"reward returned keys {sorted(value)} but weights has "
                             f"{sorted(self.weights)}; make them match")
        for key, v in value.items():
            if not _is_finite_number(v):
                raise BadResult(f"component {key!r} is {v!r}, not a finite number")
        weights = self.weights or {}
        return sum(weights.get(k, 1.0) * float(v) for k, v in value.items())

    def __call__(self, prompt: Any, response: str, **fields) -> float:
        """Score one response synchronously (sync SAMPLE or VERL functions)."""
        if self.is_async or self.form == BATCHED:
            raise TypeError(f"{self.where}: an async or batched reward is called through "
                            "rl.reward_calls.RewardRunner")
        args, kwargs = self.sample_args(prompt, response, fields)
        return self.to_score(self.fn(*args, **kwargs))


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(float(value))


def load_reward_fn(path: str, name: str | None = None,
                   weights: dict[str, float] | None = None) -> RewardFn:
    """Load `name` (default "reward") from a Python file as a RewardFn.

    Raises RewardLoadError naming the file: missing file, syntax error (with its line), an
    exception while importing, no such function/class (listing the callables it defines), a
    class that cannot be built with no arguments, or a signature that fits no form.
    """
    name = name or "reward"
    module = import_user_file(path, "reward", RewardLoadError)
    module_name = module.__name__
    obj = getattr(module, name, None)
    if obj is None or not callable(obj):
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module_name)
        raise RewardLoadError(f"{path}: no function or class named {name!r}; it defines "
                              f"{defined or 'no callables'}; set reward.function=... or rename it")
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as e:
            raise RewardLoadError(f"{path}: building class {name}() with no arguments raised "
                                  f"{type(e).__name__}: {e}") from e
    return RewardFn(obj, weights, source=path, name=name)


def import_user_file(path: str, what: str, error: type[UserError] = UserError):
    """Import a user's Python file as a fresh module (its `what`: "reward", "environment", ...).

    Raises `error`, one line naming the file: missing file, syntax error (with its line), or an
    exception while importing (with the file's innermost line). Shared by every user-file loader.
    """
    if not os.path.isfile(path):
        raise error(f"{path}: {what} file does not exist")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        compile(source, path, "exec")
    except SyntaxError as e:
        raise error(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    module_name = f"user_{what}_" + re.sub(r"\W", "_", os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module       # dataclasses and pickling look classes up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        line = _innermost_line(e, path)
        raise error(f"{path}{line}: importing it raised {type(e).__name__}: {e}") from e
    return module


def _innermost_line(exc: BaseException, path: str) -> str:
    """":<line>" of the deepest traceback frame inside `path`, or ""."""
    lines = [fr.lineno for fr in traceback.extract_tb(exc.__traceback__)
             if os.path.abspath(fr.filename) == os.path.abspath(path)]
    return f":{lines[-1]}" if lines else ""
