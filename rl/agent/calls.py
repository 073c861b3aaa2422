"""Calling a user's environment code from the event loop: threads, timeouts, one-line failures.

Sync code runs in a thread pool (never on the loop: SkyRL PR #53, a 3 s environment stalled every
episode of a step); `async def` code is awaited on the loop. Each call waits at most
step_timeout_s and what is left of the episode's episode_timeout_s (environment time only).

A timed-out thread cannot be killed: Python has no way to stop a thread. The episode fails at once
and its thread runs on in the background holding one of the pool's `env.threads` until the call
returns; an environment that hangs for good uses threads up, and later calls then wait for a free
thread inside their own timeouts. An `async def` that blocks (time.sleep inside it) blocks the
loop: write blocking code as a plain `def`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from concurrent.futures import Executor
from typing import Any, Callable


class EnvFailure(Exception):
    """The environment failed this episode; the message is the one-line reason."""


class StepTimeout(EnvFailure):
    """One call ran past step_timeout_s."""


class EpisodeTimeout(EnvFailure):
    """The episode's environment time ran past episode_timeout_s."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, at most `limit` characters (the message alone for an
    error that names its type itself: one raised in an environment's own process)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    line = text if getattr(e, "names_its_type", False) else f"{type(e).__name__}: {text}" if text else type(e).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


class EnvCalls:
    """Runs one episode's calls into user code; `spent_s` is its environment time so far."""

    def __init__(self, executor: Executor, step_timeout_s: float, episode_timeout_s: float):
        self.executor = executor
        self.step_timeout_s = step_timeout_s
        self.episode_timeout_s = episode_timeout_s
        self.spent_s = 0.0

    async def __call__(self, what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) under the timeouts. `what` names it in failures ("step", "tool add").
        Raises StepTimeout, EpisodeTimeout, or EnvFailure("<what> raised Type: message")."""
        left = self.episode_timeout_s - self.spent_s
        if left <= 0:
            raise EpisodeTimeout(f"episode timed out: the environment took over {self.episode_timeout_s:g} s")
        limit = min(self.step_timeout_s, left)
        start = time.monotonic()
        try:
            return await asyncio.wait_for(self._run(fn, args, kwargs), limit)
        except asyncio.TimeoutError:
            if limit < self.step_timeout_s:
                raise EpisodeTimeout(f"episode timed out: the environment took over "
                                     f"{self.episode_timeout_s:g} s (in {what})") from None
            raise StepTimeout(f"{what} timed out after {self.step_timeout_s:g} s") from None
        except (EnvFailure, asyncio.CancelledError):
            raise
        except Exception as e:
            raise EnvFailure(f"{what} raised {one_line(e)}") from e
        finally:
            self.spent_s += time.monotonic() - start

    async def _run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        result = await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(fn, *args, **kwargs))
        if inspect.isawaitable(result):     # a sync callable that returned a coroutine
            result = await result
        return result


def accepted(fn: Callable, kwargs: dict) -> dict:
    """The part of `kwargs` that `fn` takes (all of it when it has **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}
