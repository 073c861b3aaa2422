"""The three forms of a user's environment file, each as one episode's session.

    GymSession   a class with reset(**row) and step(action) (sync or async), one instance per episode;
                 step returns (observation, reward, done[, info]), gymnasium's 5-tuple
                 (terminated/truncated), or a dict {observation, reward, done, info}
    ToolSession  typed tool functions (env.tools), or TRL's environment_factory class (reset(**row)
                 starts the episode, its public methods are the tools, optional get_reward())

A session's methods take the episode's EnvCalls (rl/agent/calls.py), which runs the user's code
under the timeouts, and return plain messages; what it returns that is not usable raises Garbage.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from rl.agent import tools as T
from rl.agent.calls import EnvCalls, EnvFailure, EpisodeTimeout, StepTimeout, accepted, one_line


class Garbage(EnvFailure):
    """The environment returned something that is not an observation, reward or done flag."""


@dataclass
class Step:
    messages: list[dict]
    """The observation as chat messages (empty when done)."""
    reward: float | None = None
    done: bool = False
    counters: dict[str, int] = field(default_factory=dict)


def prompt_messages(prompt: Any) -> list[dict]:
    """A data row's prompt as messages: a text is one user message; a list of messages is kept."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return [dict(m) for m in prompt]
    raise Garbage(f"the row's prompt is {type(prompt).__name__}, expected a text or a list of messages")


def as_messages(value: Any, what: str) -> list[dict]:
    """An observation as messages: a text (one user message), a message dict, or a list of them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    items = [value] if isinstance(value, dict) else value
    if isinstance(items, (list, tuple)) and items and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in items):
        return [dict(m) for m in items]
    raise Garbage(f"{what} returned {type(value).__name__} {value!r:.60} as the observation; return a text, "
                  'a message {"role": ..., "content": "..."} or a list of messages')


def as_reward(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise Garbage(f"{what} returned the reward {value!r:.60}; return a finite number or None")


def as_done(value: Any, what: str) -> bool:
    if not isinstance(value, str) and value in (True, False):
        return bool(value)
    raise Garbage(f"{what} returned done={value!r:.60}; return True or False")


class GymSession:
    def __init__(self, cls: type, kwargs: dict):
        self.cls, self.kwargs, self.env = cls, kwargs, None

    async def reset(self, call: EnvCalls, row: dict) -> list[dict]:
        self.env = await self._build(call)
        first = await call("reset", self.env.reset, **accepted(self.env.reset, row))
        if first is None:
            return prompt_messages(row.get("prompt"))
        return as_messages(first, "reset")

    async def _build(self, call: EnvCalls) -> Any:
        return await call(f"{self.cls.__name__}()", self.cls, **self.kwargs)

    async def step(self, call: EnvCalls, text: str) -> Step:
        out = await call("step", self.env.step, text)
        if isinstance(out, dict):
            if "observation" not in out and "observations" not in out or "done" not in out:
                raise Garbage(f"step returned a dict with keys {sorted(out)[:6]}; it needs observation, "
                              "reward and done")
            obs, reward, done = out.get("observation", out.get("observations")), out.get("reward"), out["done"]
        elif isinstance(out, tuple) and len(out) in (3, 4):
            obs, reward, done = out[:3]
        elif isinstance(out, tuple) and len(out) == 5:    # gymnasium: terminated, truncated
            obs, reward, done = out[0], out[1], as_done(out[2], "step") or as_done(out[3], "step")
        else:
            raise Garbage(f"step returned {type(out).__name__} {out!r:.60}; return (observation, reward, "
                          "done[, info]) or a dict with those keys")
        done = as_done(done, "step")
        reward = as_reward(reward, "step")
        return Step([] if done else as_messages(obs, "step"), reward, done)

    async def final_reward(self, call: EnvCalls) -> float | None:
        get_reward = getattr(self.env, "get_reward", None)
        return None if get_reward is None else as_reward(await call("get_reward", get_reward), "get_reward")

    async def close(self, call: EnvCalls) -> None:
        if self.env is not None and callable(getattr(self.env, "close", None)):
            await call("close", self.env.close)


class ToolSession:
    """The built-in tool-calling environment: calls in a turn are run and answered; a turn without
    a call ends the episode. With `cls` (TRL's form) the tools are an instance's methods."""

    def __init__(self, tools: dict[str, Callable], schemas: list[dict], in_template: bool,
                 cls: type | None = None, kwargs: dict | None = None):
        self.tools, self.schemas, self.in_template = dict(tools), schemas, in_template
        self.cls, self.kwargs, self.env = cls, kwargs or {}, None

    async def reset(self, call: EnvCalls, row: dict) -> list[dict]:
        messages = prompt_messages(row.get("prompt"))
        if self.cls is not None:
            self.env = await call(f"{self.cls.__name__}()", self.cls, **self.kwargs)
            self.tools = {name: getattr(self.env, name) for name in self.tools}
            extra = await call("reset", self.env.reset, **accepted(self.env.reset, row))
            if extra is not None:        # TRL: a text returned by reset is appended to the last user message
                if not isinstance(extra, str):
                    raise Garbage(f"reset returned {type(extra).__name__}; TRL's environment_factory form "
                                  "returns None or a text (appended to the last user message)")
                users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
                if users:
                    messages[users[-1]] = {**messages[users[-1]], "content": messages[users[-1]]["content"] + extra}
                else:
                    messages.append({"role": "user", "content": extra})
        return messages if self.in_template else T.system_message(self.schemas, messages)

    async def step(self, call: EnvCalls, text: str) -> Step:
        calls = T.parse_tool_calls(text)
        if not calls:
            return Step([], None, True)
        counters = {"tool_calls": len(calls), "tool_errors": 0}
        results = []
        for c in calls:
            name, content = c.name or "invalid", await self._answer(call, c, counters)
            results.append((name, content))
        return Step(T.result_messages(results, self.in_template), None, False, counters)

    async def _answer(self, call: EnvCalls, c: T.ToolCall, counters: dict) -> str:
        problem, kind = c.error, "malformed_tool_calls"
        fn = self.tools.get(c.name)
        if not problem and fn is None:
            problem, kind = f"unknown tool {c.name!r}; the tools are {sorted(self.tools)}", "unknown_tool_calls"
        if not problem:
            problem, kind = T.argument_problem(fn, c.name, c.arguments), "bad_tool_arguments"
        if not problem:
            try:
                return T.result_text(await call(f"tool {c.name}", fn, **c.arguments))
            except EpisodeTimeout:
                raise                         # the episode's environment time is up: it fails
            except StepTimeout as e:
                problem, kind = str(e), "tool_timeouts"
            except EnvFailure as e:
                problem, kind = f"{c.name} raised {one_line(e.__cause__ or e)}", "tool_exceptions"
        counters["tool_errors"] += 1
        counters[kind] = counters.get(kind, 0) + 1
        return T.error_result(problem)

    async def final_reward(self, call: EnvCalls) -> float | None:
        get_reward = getattr(self.env, "get_reward", None) if self.env is not None else None
        return None if get_reward is None else as_reward(await call("get_reward", get_reward), "get_reward")

    async def close(self, call: EnvCalls) -> None:
        if self.env is not None and callable(getattr(self.env, "close", None)):
            await call("close", self.env.close)
