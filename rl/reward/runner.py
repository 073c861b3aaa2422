"""Running reward calls: concurrently (bounded), each under its timeout, failures marked not raised.

`RewardRunner(rewards, timeout_s, max_concurrency).score(requests)` scores a batch and returns one
Outcome per response: a score, or None and a one-line reason. An exception, a timeout, or a result
that is not a finite number (NaN, inf, a string) marks that response failed; the traceback of an
exception is logged once per distinct (type, place), not per response. None is "no score from this
function" (TRL's skip): the score is the weighted sum of the other functions' values (TRL's
nansum), and a response no function scored is marked failed (TRL's unscorable row).

How a call runs and what a timeout does (threads cannot be killed):
- sync SAMPLE / VERL functions: each call in its own daemon thread, at most `max_concurrency` at
  once. A call past its timeout is ABANDONED: its slot is freed, the thread runs on until it
  returns (sleeping costs nothing; spinning competes for the GIL) and is counted in
  `abandoned_running` until then. So a reward that hangs on every call costs one timeout per
  round of `max_concurrency` calls, not one per response. Chosen over a process pool because a
  process pool needs the function and every argument to pickle, a start-up per worker, and a
  kill + respawn per hung call; threads cost ~0.1-0.5 ms per call. The exception is work that
  holds the GIL in one C call (a huge integer): it freezes the whole process, which only a
  process can bound; the math checker runs in killable worker processes for that reason
  (rl/reward/isolated.py), and a user reward doing such work should do the same.
- async functions: on one event loop in a background thread (a blocking coroutine then blocks
  other rewards, never the node's own loop), at most `max_concurrency` at once, each cancelled at
  its timeout (a coroutine that blocks its loop is abandoned like a thread, 1 s later).
- BATCHED (TRL, verl's batched) functions: one call per batch, under one timeout; it fails as a whole.
Several functions (rl/reward/reward_fn.Rewards) run side by side, sharing the `max_concurrency` slots.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from rl.reward.reward_fn import BATCH_FORMS, BadResult, RewardFn, Rewards
from dataflow.timeouts import wait_within

logger = logging.getLogger(__name__)

ASYNC_GRACE_S = 1.0
"""How long past its timeout an async call may take to notice its cancellation."""


class RewardTimeout(TimeoutError):
    """A reward call ran past its timeout (as opposed to a TimeoutError the reward raised)."""


@dataclass
class Request:
    prompt: Any
    response: str
    fields: dict = field(default_factory=dict)
    response_ids: list = field(default_factory=list)


@dataclass
class Outcome:
    score: float | None
    error: str | None = None
    timed_out: bool = False
    components: dict = field(default_factory=dict)
    """Each function's value for this response (None: it returned None), by function name."""
    extras: dict = field(default_factory=dict)
    """verl dict results' other numeric keys."""


class RewardRunner:
    """Scores batches of requests with one RewardFn or several (Rewards); keeps the async loop and
    abandoned threads."""

    def __init__(self, reward: RewardFn | Rewards, timeout_s: float | None = 5.0, max_concurrency: int = 32):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
        self.rewards = reward if isinstance(reward, Rewards) else Rewards([reward])
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.timeouts_total = 0
        self._abandoned: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._logged_failures: set = set()

    @property
    def abandoned_running(self) -> int:
        """Timed-out sync calls whose threads have not returned yet."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    async def score(self, requests: list[Request]) -> list[Outcome]:
        if not requests:
            return []
        slots = asyncio.Semaphore(self.max_concurrency)
        per_fn = await asyncio.gather(*(
            self._score_batched(fn, requests, slots) if fn.form in BATCH_FORMS else self._score_each(fn, requests, slots)
            for fn in self.rewards.fns))
        outcomes = [self._combine([values[i] for values in per_fn]) for i in range(len(requests))]
        self.timeouts_total += sum(o.timed_out for o in outcomes)
        return outcomes

    def _combine(self, parts: list[Outcome]) -> Outcome:
        """One response's Outcome from each function's: failed if one failed or none gave a score,
        else the weighted sum of the scores given (TRL: nansum of weight * value)."""
        fns, several = self.rewards.fns, len(self.rewards.fns) > 1
        components = {fn.name: p.score for fn, p in zip(fns, parts)}
        extras = {k: v for p in parts for k, v in p.extras.items()}
        for fn, p in zip(fns, parts):
            if p.error is not None:
                return Outcome(None, f"{fn.name}: {p.error}" if several else p.error, p.timed_out, components, extras)
        if all(p.score is None for p in parts):
            why = "every reward function returned None" if several else "returned None"
            return Outcome(None, f"{why} for this completion", False, components, extras)
        total = sum(w * p.score for w, p in zip(self.rewards.weights, parts) if p.score is not None)
        return Outcome(total, None, False, components, extras)

    async def _score_each(self, reward: RewardFn, requests: list[Request], slots) -> list[Outcome]:
        async def one(req: Request) -> Outcome:
            async with slots:
                try:
                    args, kwargs = reward.sample_args(req.prompt, req.response, req.fields)
                    value = await self._call(reward, args, kwargs)
                    return self._value(reward, value)
                except Exception as e:  # noqa: BLE001 - a failed response, not a failed node
                    return self._failure(reward, e)
        return list(await asyncio.gather(*(one(r) for r in requests)))

    async def _score_batched(self, reward: RewardFn, requests: list[Request], slots) -> list[Outcome]:
        n = len(requests)
        try:
            kwargs = reward.batch_args([r.prompt for r in requests], [r.response for r in requests],
                                       [r.fields for r in requests], [r.response_ids for r in requests])
            async with slots:
                values = await self._call(reward, (), kwargs)
            if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or len(values) != n:
                length = f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__
                raise BadResult(f"returned {length} for {n} completions; return a list of {n} floats")
        except Exception as e:  # noqa: BLE001 - failed responses, not a failed node
            return [self._failure(reward, e)] * n
        outcomes = []
        for value in values:
            try:
                outcomes.append(self._value(reward, value))
            except BadResult as e:
                outcomes.append(Outcome(None, str(e)[:300]))
        return outcomes

    @staticmethod
    def _value(reward: RewardFn, value: Any) -> Outcome:
        """One function's result for one response: None (no score), or its score and extras."""
        if value is None:
            return Outcome(None)
        return Outcome(reward.to_score(value), extras=reward.extras(value))

    async def _call(self, reward: RewardFn, args: tuple, kwargs: dict) -> Any:
        """reward.fn(*args, **kwargs) off the caller's loop; RewardTimeout past timeout_s."""
        fn = reward.fn
        if reward.is_async:
            done = asyncio.run_coroutine_threadsafe(self._bounded(fn(*args, **kwargs)), self._async_loop())
            try:
                limit = None if self.timeout_s is None else self.timeout_s + ASYNC_GRACE_S
                return await wait_within(asyncio.wrap_future(done), limit)
            except asyncio.TimeoutError:             # its loop is blocked: abandon it
                done.cancel()
                raise RewardTimeout(f"timed out after {self.timeout_s:g}s (its event loop is blocked)") from None
        loop = asyncio.get_running_loop()
        result = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not result.done():
                result.set_result(value) if ok else result.set_exception(value)

        def target():
            try:
                ok, value = True, fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                ok, value = False, e
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:                  # the caller's loop is gone (node stopped)
                pass

        thread = threading.Thread(target=target, daemon=True, name=f"reward-{reward.name}")
        thread.start()
        try:
            return await wait_within(asyncio.shield(result), self.timeout_s)
        except asyncio.TimeoutError:
            self._abandoned.append(thread)
            # Retrieve its late error, if any, so asyncio does not log "exception never retrieved".
            result.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise RewardTimeout(f"timed out after {self.timeout_s:g}s (call abandoned)") from None

    async def _bounded(self, coro) -> Any:
        """Runs on the reward loop: the coroutine, cancelled past timeout_s."""
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if not done:
            task.cancel()
            raise RewardTimeout(f"timed out after {self.timeout_s:g}s (cancelled)")
        return task.result()

    def _async_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, daemon=True, name="reward-async").start()
        return self._loop

    def _failure(self, reward: RewardFn, e: Exception) -> Outcome:
        if isinstance(e, RewardTimeout):
            return Outcome(None, str(e), timed_out=True)
        if isinstance(e, BadResult):                  # our check of its result: the message says it all
            return Outcome(None, str(e).splitlines()[0][:300])
        frames = traceback.extract_tb(e.__traceback__)
        key = (type(e).__name__, (frames[-1].filename, frames[-1].lineno) if frames else None)
        if key not in self._logged_failures and len(self._logged_failures) < 1000:
            self._logged_failures.add(key)
            logger.warning("reward function %s failed (logged once per kind):\n%s", reward.where,
                           "".join(traceback.format_exception(e)))
        reason = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        return Outcome(None, reason[:300])

    def close(self) -> None:
        """Cancel what runs on the async rewards' loop, then stop it (its thread is a daemon)."""
        if self._loop is not None:
            loop, self._loop = self._loop, None

            def shutdown():
                for task in asyncio.all_tasks(loop):
                    task.cancel()
                loop.call_soon(loop.stop)         # after the cancelled tasks' last steps
            loop.call_soon_threadsafe(shutdown)
