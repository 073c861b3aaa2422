"""Reward functions as users write them: loading a reward file and telling its form apart.

A reward file defines one or more of these, plain or `async def` (found by name: `reward.function`
names one, or a list; empty = `reward`, else verl's `compute_score`; a class is built with no
arguments and its instance called). docs/rewards.md has the table of forms and peers.

  reward(prompt, response, **fields) -> float | dict
      One response. `fields` are the row's other fields ("answer", verl's "data_source",
      "reward_model", "extra_info", ...); a function without **kwargs only gets those it names.
      A dict of named floats is combined with `weights` (a dict).
  compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict
      verl's form, told by its name `compute_score` or a parameter `solution_str`. ground_truth is
      the row's reward_model["ground_truth"], else its "answer"; a dict result gives its "score"
      (its other numeric keys are logged). kwargs: `reward.kwargs` (verl's reward_kwargs).
  compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list
      verl's batched form (its BatchRewardManager), told by a parameter `solution_strs`.
  f(prompts, completions, completion_ids, **kwargs) -> list[float | None]
      TRL's form (GRPOTrainer), told by a parameter `completions`: every response of a batch in
      one call. When the rows' prompts are chats, `prompts` are their message lists and each
      completion is [{"role": "assistant", "content": text}] (TRL's conversational format), else
      both are strings. kwargs hold the rows' other columns as lists, one entry per completion.

None from a function means "no score from this function" (TRL's skip): with several functions
the response's score is the weighted sum of the others (TRL's nansum); with none left it is
marked failed. Several functions are weighted by `weights` (a list, one per function; default 1).
`reward.kwargs` go to every call (verl's reward_kwargs; they override a field of the same name).
Responses are decoded without special tokens. How calls are run (concurrently, each under its
timeout, failures marked) is rl/reward/runner.py; answer checkers ship in rl/reward/math_reward.py.
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
from rl.reward.math_reward import gsm8k_reward, math_reward  # noqa: F401 - `reward.path=rl/reward/reward_fn.py` finds them

SAMPLE, VERL, VERL_BATCHED, BATCHED = ("reward(prompt, response, **fields)", "verl compute_score",
                                       "verl batched compute_score", "TRL batched")
BATCH_FORMS = (VERL_BATCHED, BATCHED)   # one call per batch of responses
VERL_FORMS = (VERL, VERL_BATCHED)       # a dict result is {"score": ..., other info}
DEFAULT_NAMES = ("reward", "compute_score")
"""Looked up in this order when reward.function is empty (verl's default name second)."""


class RewardLoadError(UserError, ValueError):
    """A reward file that cannot be used; the message names the file (and line)."""


class BadResult(ValueError):
    """A reward's result (or the row it needs) does not give a score; the message says why."""


class RewardFn:
    """A loaded reward function, its form (SAMPLE, VERL, VERL_BATCHED or BATCHED) and whether it
    is async.

    Build the call for one response with `sample_args`, for a batch with `batch_args` (then
    `fn(**kwargs)`; a coroutine for async functions), and turn each result into a float with
    `to_score` (BadResult if it is not one; None is the caller's: "no score"). For sync
    SAMPLE/VERL functions, `fn(prompt, response, **fields)` does all three.

    Dict results of the SAMPLE form are combined as sum(weights[k] * value[k]). With weights
    configured, the keys must match them exactly (a typo would otherwise silently drop a
    component); with no weights (None or {}) every component has weight 1. `kwargs` go to every
    call (verl's reward_kwargs); each must be a parameter of the function or meet its **kwargs.
    """

    def __init__(self, fn: Callable, weights: dict[str, float] | None = None, source: str = "",
                 name: str = "", kwargs: dict | None = None):
        self.fn = fn
        self.weights = dict(weights) if weights else None
        self.kwargs = dict(kwargs or {})
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
        if "solution_strs" in self._names:
            self.form = VERL_BATCHED
        elif self.name == "compute_score" or "solution_str" in self._names:
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
        required = {VERL: ("solution_str", "ground_truth"), VERL_BATCHED: ("solution_strs", "ground_truths"),
                    BATCHED: ("completions",), SAMPLE: ()}[self.form]
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
                "ground_truth, extra_info) or TRL's (prompts, completions, **kwargs); docs/rewards.md") from None
        unknown = [k for k in self.kwargs if k not in self._names and not self._takes_all]
        if unknown:
            raise RewardLoadError(f"{self.where}: reward.kwargs has {unknown[0]!r}, which it does not take "
                                  "(no such parameter and no **kwargs); remove it or add the parameter")

    def _accepted(self, kwargs: dict) -> dict:
        return kwargs if self._takes_all else {k: v for k, v in kwargs.items() if k in self._names}

    def sample_args(self, prompt: Any, response: str, fields: dict) -> tuple[tuple, dict]:
        """(args, kwargs) scoring one response (SAMPLE or VERL form)."""
        fields = {k: v for k, v in fields.items() if k not in ("prompt", "response")}
        if self.form == SAMPLE:
            return (prompt, response), {**self._accepted(fields), **self.kwargs}
        return (), {**self._accepted(_verl_args(response, fields)), **self.kwargs}

    def batch_args(self, prompts: list, completions: list[str], fields: list[dict],
                   completion_ids: list[list[int]]) -> dict:
        """kwargs scoring a batch. TRL's form, as GRPOTrainer calls it: prompts, completions,
        completion_ids and every other column as a list (None where a row lacks it); when every
        row's prompt is a chat (its messages kept as fields["raw_prompt"], rl/data/prompts.py), prompts are
        the message lists and completions [{"role": "assistant", "content": text}]. verl's batched
        form: data_sources, solution_strs, ground_truths, extra_infos."""
        if self.form == VERL_BATCHED:
            rows = [_verl_args(c, f) for c, f in zip(completions, fields)]
            kwargs = {"data_sources": [r["data_source"] for r in rows], "solution_strs": list(completions),
                      "ground_truths": [r["ground_truth"] for r in rows], "extra_infos": [r["extra_info"] for r in rows]}
            return {**self._accepted(kwargs), **self.kwargs}
        chats = [f.get("raw_prompt") for f in fields]
        if chats and all(isinstance(c, list) for c in chats):   # TRL's is_conversational
            prompts = chats
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        keys = dict.fromkeys(k for f in fields for k in f if k not in ("prompt", "completion", "raw_prompt"))
        kwargs = {k: [f.get(k) for f in fields] for k in keys}
        kwargs.update(prompts=list(prompts), completions=list(completions), completion_ids=completion_ids)
        return {**self._accepted(kwargs), **self.kwargs}

    def to_score(self, value: Any) -> float:
        """The float score of one result; BadResult (the reason) if it is not a finite number."""
        if isinstance(value, dict):
            value = self._combine(value)
        if not _is_finite_number(value):
            raise BadResult(f"returned {type(value).__name__} {value!r:.80}, expected a finite float")
        return float(value)

    def extras(self, value: Any) -> dict[str, float]:
        """verl's dict result: its numeric keys other than "score" (logged, as verl's reward_extra_info)."""
        if self.form not in VERL_FORMS or not isinstance(value, dict):
            return {}
        return {str(k): float(v) for k, v in value.items()
                if k != "score" and not isinstance(v, bool) and _is_finite_number(v)}

    def _combine(self, value: dict) -> float:
        if self.form in VERL_FORMS:                   # verl: {"score": ..., other info}
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
        if self.is_async or self.form in BATCH_FORMS:
            raise TypeError(f"{self.where}: an async or batched reward is called through "
                            "rl.reward.runner.RewardRunner")
        args, kwargs = self.sample_args(prompt, response, fields)
        return self.to_score(self.fn(*args, **kwargs))


def _verl_args(response: str, fields: dict) -> dict:
    """compute_score's arguments for one response, as verl's reward managers build them."""
    reward_model = fields.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        ground_truth = reward_model["ground_truth"]
    elif "answer" in fields:
        ground_truth = fields["answer"]
    else:
        raise BadResult("compute_score needs a ground truth: the row has neither "
                        "reward_model.ground_truth nor an `answer` field")
    extra_info = fields.get("extra_info")
    return {"data_source": fields.get("data_source", ""), "solution_str": response, "ground_truth": ground_truth,
            "extra_info": {} if extra_info is None else extra_info}


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(float(value))


class Rewards:
    """The reward functions of a run, with one weight each (TRL's reward_funcs / reward_weights)."""

    def __init__(self, fns: list[RewardFn], weights: list[float] | None = None):
        self.fns = fns
        self.weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]

    @property
    def where(self) -> str:
        return ", ".join(fn.where for fn in self.fns)


def load_rewards(path: str, function: str | list[str] | None = None, weights: dict | list | None = None,
                 kwargs: dict | None = None) -> Rewards:
    """The functions `function` names in the file at `path` (a name or a list; empty: `reward`,
    else `compute_score`). `weights`: a list (one per function, TRL's reward_weights) or a dict
    (the named scores of a dict-valued reward). RewardLoadError naming the file and setting."""
    names = [function] if isinstance(function, str) else list(function or [])
    names = [n.strip() for n in names if n and n.strip()]
    per_function = list(weights) if isinstance(weights, (list, tuple)) else None
    if per_function is not None and len(per_function) != max(len(names), 1):
        raise RewardLoadError(f"reward.weights has {len(per_function)} values for {max(len(names), 1)} reward "
                              f"function(s) ({', '.join(names) or 'the default'}); give one weight per function")
    if per_function is not None and not all(_is_finite_number(w) for w in per_function):
        raise RewardLoadError(f"reward.weights={per_function}: every weight must be a finite number")
    if len(set(names)) != len(names):
        raise RewardLoadError(f"reward.function={names} names a function twice; each is logged on its own")
    module = import_user_file(path, "reward", RewardLoadError)
    fns = [_reward_in(module, path, name, None if per_function is not None else weights, kwargs)
           for name in names or [None]]
    return Rewards(fns, per_function)


def load_reward_fn(path: str, name: str | None = None, weights: dict[str, float] | None = None,
                   kwargs: dict | None = None) -> RewardFn:
    """Load one function `name` (empty: `reward`, else `compute_score`) from a Python file.

    Raises RewardLoadError naming the file: missing file, syntax error (with its line), an
    exception while importing, no such function/class (listing the callables it defines), a
    class that cannot be built with no arguments, or a signature that fits no form.
    """
    return _reward_in(import_user_file(path, "reward", RewardLoadError), path, name, weights, kwargs)


def _reward_in(module, path: str, name: str | None, weights, kwargs) -> RewardFn:
    if not name:   # verl's files define compute_score and no reward: used as they are
        name = next((n for n in DEFAULT_NAMES if callable(getattr(module, n, None))), DEFAULT_NAMES[0])
        looked_for = " or ".join(repr(n) for n in DEFAULT_NAMES)
    else:
        looked_for = repr(name)
    obj = getattr(module, name, None)
    if obj is None or not callable(obj):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_") and (
            getattr(v, "__module__", None) == module.__name__ or inspect.isfunction(v)))
        raise RewardLoadError(f"{path}: no function or class named {looked_for}; it defines "
                              f"{defined or 'no callables'}; set reward.function=... or rename it")
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as e:
            raise RewardLoadError(f"{path}: building class {name}() with no arguments raised "
                                  f"{type(e).__name__}: {e}") from e
    return RewardFn(obj, weights, source=path, name=name, kwargs=kwargs)


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
