"""How the channel ends wait: a broadcast wake-up (Signal), and the stand-in for a tracer's wait spans
when an end has no tracer."""

from __future__ import annotations

import asyncio
import contextlib


class Signal:
    """Wakes every waiter, which then re-checks its own condition.

    Broadcast instead of handing a wake-up to one waiter: a waiter cancelled just after being
    woken then cannot swallow a wake-up that another task needed (the classic lost wake-up).
    """

    __slots__ = ("_waiters",)

    def __init__(self):
        self._waiters: list[asyncio.Future] = []

    async def wait(self, timeout: float | None = None) -> None:
        """Return at the next fire(), or after `timeout` seconds (None: no limit)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append(fut)
        timer = None if timeout is None else loop.call_later(max(0.0, timeout), _wake, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            if fut in self._waiters:  # cancelled or timed out: not swapped out by fire()
                self._waiters.remove(fut)

    def fire(self) -> None:
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                _wake(fut)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def no_span(_channel: str):
    return contextlib.nullcontext()
