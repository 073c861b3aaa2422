"""env.isolate=true: a gym-style environment in a process of its own, killed when it hangs.

A thread that hangs cannot be stopped (rl/agent/calls.py); a process can. Each episode gets one
worker process (rl/isolated.KillablePool of size 1: a fresh interpreter, not a fork) that imports
the user's file, builds the class and serves reset/step/get_reward/close, so the environment's
state lives there for the whole episode. A call past step_timeout_s kills the process and fails
the episode; the process is killed when the episode ends in any case. It costs a process start
per episode (an interpreter and the env file's imports), so it suits slow, crashing or hanging
environments. Row fields, actions, observations and rewards cross a pipe: they must pickle.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

from rl.agent.calls import EnvCalls, accepted
from rl.agent.envs import GymSession
from rl.isolated import KillablePool, WorkerError

MISSING = "<no such method>"
_env: Any = None                                 # in the worker: the episode's environment
_loop: asyncio.AbstractEventLoop | None = None   # in the worker: one loop for every async call


def ready() -> bool:
    return True


def build(path: str, name: str, kwargs: dict) -> None:
    """In the worker: import the user's file and build its class."""
    global _env
    from rl.agent.config import EnvLoadError
    from rl.rewards import import_user_file
    _env = getattr(import_user_file(path, "environment", EnvLoadError), name)(**kwargs)


def invoke(method: str, args: tuple, kwargs: dict) -> Any:
    """In the worker: the environment's `method` (MISSING when it has none)."""
    global _loop
    fn = getattr(_env, method, None)
    if not callable(fn):
        return MISSING
    result = fn(*args, **accepted(fn, kwargs))
    if inspect.isawaitable(result):
        _loop = _loop or asyncio.new_event_loop()
        result = _loop.run_until_complete(result)
    return result


class IsolatedError(Exception):
    """The environment raised in its process; the message is its "Type: message"."""

    names_its_type = True


class RemoteEnv:
    """The parent's handle on one episode's process: reset/step/get_reward/close block until the
    worker answers (EnvCalls runs them in a thread)."""

    def __init__(self, timeout_s: float):
        """Starts the process (its start-up is bounded by rl/isolated.START_TIMEOUT_S, not by the
        environment's timeouts, and not counted in its time)."""
        self.pool, self.timeout_s = KillablePool(1, preload=(__name__,)), timeout_s
        self.in_flight, self.closed, self._lock = 0, False, threading.Lock()
        self.pool.call(f"{__name__}:ready", (), timeout_s)
        for method in ("reset", "step", "get_reward", "close"):
            setattr(self, method, self._method(method))

    def build(self, path: str, name: str, kwargs: dict) -> RemoteEnv:
        self._call("build", (path, name, kwargs))
        return self

    def _call(self, function: str, args: tuple) -> Any:
        with self._lock:
            self.in_flight += 1
        try:
            return self.pool.call(f"{__name__}:{function}", args, self.timeout_s)
        except WorkerError as e:
            raise IsolatedError(str(e)) from None
        finally:
            with self._lock:
                self.in_flight -= 1
                close_now = self.closed and not self.in_flight
            if close_now:
                self.pool.close()

    def _method(self, name: str):
        def remote(*args, **kwargs):
            value = self._call("invoke", (name, args, kwargs))
            return None if value == MISSING else value
        return remote

    def shutdown(self) -> None:
        """Kill the process now, or when the call still in it returns (KillablePool kills a call
        at its timeout; its close must not race the call's own clean-up)."""
        with self._lock:
            self.closed = True
            close_now = not self.in_flight
        if close_now:
            self.pool.close()


class IsolatedGymSession(GymSession):
    """GymSession whose environment lives in its own process."""

    def __init__(self, cls: type, kwargs: dict, path: str, step_timeout_s: float, name: str):
        super().__init__(cls, kwargs)
        self.path, self.step_timeout_s, self.name = path, step_timeout_s, name
        """`name`: the class's name in the file (what the worker looks up)."""

    async def _build(self, call: EnvCalls) -> RemoteEnv:
        remote = await asyncio.get_running_loop().run_in_executor(call.executor, RemoteEnv, self.step_timeout_s)
        self.env = remote                  # killed at close even if building it fails
        return await call(f"{self.cls.__name__}() in its process", remote.build, self.path, self.name, self.kwargs)

    async def close(self, call: EnvCalls) -> None:
        try:
            if isinstance(self.env, RemoteEnv) and not self.env.in_flight:   # else it hangs: just kill it
                await call("close", self.env.close)
        finally:
            if isinstance(self.env, RemoteEnv):
                self.env.shutdown()
