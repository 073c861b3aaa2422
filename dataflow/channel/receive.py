"""The consumer side of a channel: ReceiveEnd, one pump per producer filling a bounded inbox."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import ray

from dataflow.channel.errors import BadItem, ChannelError, ClosedChannel, EndOfChannel, WouldBlock
from dataflow.channel.waiting import Signal, no_span
from dataflow.channel.codec import DEFAULT_MAX_BYTES, DecodeError, Message, decode


@dataclass(frozen=True, slots=True)
class ReceiveStatistics:
    channel: str
    consumer_key: str
    prefetch: int
    current_buffer_used: int
    tasks_waiting_receive: int
    received_total: int
    producers_open: int
    closed: bool


class ReceiveEnd:
    """Consumer end of `channel` for consumer `consumer_key`, pulling from every producer.

    `producers` maps producer name -> actor handle (a dict or (name, handle) pairs); each handle
    must have the remote methods `channel_take` and `channel_receiver_closed`. `prefetch` bounds
    the local inbox: each producer's pump may hold at most `max(1, prefetch // num_producers)`
    items (in the inbox or in flight), so one idle producer cannot starve the others.

    Pumps start at construction when an event loop is running, else at the first recv. Messages
    are decoded zero-copy: their arrays/tensors are read-only (copy before writing). An item that
    fails to decode raises BadItem from recv(); with `on_bad_item`, it is passed (as the BadItem)
    to that callback and skipped instead. With `retry_s` > 0, a take that fails (the producer's
    process died and is being restarted) is retried for up to that many seconds before recv()
    raises ChannelError; the items that were in the dead producer's outbox are lost.
    """

    def __init__(self, channel: str, consumer_key: str,
                 producers: Mapping[str, Any] | Iterable[tuple[str, Any]], *, prefetch: int,
                 tracer: Any = None, on_depth: Callable[[str, int], None] | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, on_bad_item: Callable[[BadItem], None] | None = None,
                 retry_s: float = 0.0):
        producers = dict(producers)
        if not producers:
            raise ValueError(f"channel {channel!r}: a ReceiveEnd needs at least one producer")
        if prefetch < 1:
            raise ValueError(f"channel {channel!r}: prefetch must be >= 1, got {prefetch}")
        self.channel = channel
        self.consumer_key = consumer_key
        self.prefetch = prefetch
        self._names = list(producers)
        self._handles = list(producers.values())
        self._quota = max(1, prefetch // len(producers))
        # Ask again only once a quarter of the quota is free: under load, fewer and larger takes.
        self._low_water = max(1, self._quota // 4)
        self._held = [0] * len(producers)  # per pump: items in the inbox + asked for in flight
        self._pump_wake = [Signal() for _ in producers]
        self._inbox: deque = deque()  # (pump index, header, buffers)
        self._has_items = Signal()
        self._pumps: list[asyncio.Task] = []
        self._pumps_open = len(producers)
        self._error: tuple[str, BaseException] | None = None
        self._closing: list = []
        self._closed = False
        self._received_total = 0
        self._tasks_waiting = 0
        self._wait_input = tracer.wait_input if tracer is not None else no_span
        self._on_depth = on_depth
        self._max_bytes = max_bytes
        self._on_bad_item = on_bad_item
        self._retry_s = retry_s
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop yet (e.g. built in a sync __init__): start at first use
        else:
            self._start()

    def _start(self) -> None:
        if self._pumps or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._pumps = [loop.create_task(self._pump(i), name=f"pump {self.channel}<-{name}")
                       for i, name in enumerate(self._names)]

    async def _pump(self, i: int) -> None:
        handle, name = self._handles[i], self._names[i]
        failing_since = None
        try:
            while True:
                while self._quota - self._held[i] < self._low_water:
                    await self._pump_wake[i].wait()
                n = self._quota - self._held[i]
                self._held[i] += n
                try:
                    closed, items = await handle.channel_take.remote(self.channel, self.consumer_key, n)
                except Exception:
                    self._held[i] -= n
                    now = asyncio.get_running_loop().time()
                    failing_since = failing_since or now
                    if self._retry_s <= 0 or now - failing_since > self._retry_s:
                        raise
                    await asyncio.sleep(0.2)  # the producer is being restarted: ask again
                    continue
                failing_since = None
                if any(isinstance(b, ray.ObjectRef) for _, b in items):  # put_large producer
                    items = [(h, await b if isinstance(b, ray.ObjectRef) else b) for h, b in items]
                self._held[i] -= n - len(items)
                if items:
                    self._inbox.extend((i, h, b) for h, b in items)
                    self._has_items.fire()
                    if self._on_depth is not None:
                        self._on_depth(self.channel, len(self._inbox))
                if closed:
                    return
        except Exception as e:  # dead actor, failed task: surface it in recv(), don't hang
            if self._error is None:
                first_line = (str(e).strip().splitlines() or [""])[0]  # Ray's are long
                self._error = (f"channel {self.channel!r}: producer {name!r} failed: "
                               f"{type(e).__name__}: {first_line}", e)
        finally:
            self._pumps_open -= 1
            self._has_items.fire()

    def _pop(self) -> Message:
        i, header, buffers = self._inbox.popleft()
        self._held[i] -= 1
        if self._quota - self._held[i] >= self._low_water:
            self._pump_wake[i].fire()
        self._received_total += 1
        if self._on_depth is not None:
            self._on_depth(self.channel, len(self._inbox))
        try:
            return decode(header, buffers, max_bytes=self._max_bytes)
        except DecodeError as e:
            raise BadItem(f"channel {self.channel!r}: an item from producer {self._names[i]!r} failed to "
                          f"decode: {e}", self.channel, self._names[i]) from e

    def _pop_good(self, count: int) -> list[Message]:
        """Up to `count` decoded items from the inbox (fewer when on_bad_item skipped some)."""
        out = []
        for _ in range(count):
            try:
                out.append(self._pop())
            except BadItem as e:
                if self._on_bad_item is None:
                    raise
                self._on_bad_item(e)
        return out

    def _check(self) -> None:
        if self._closed:
            raise ClosedChannel(f"channel {self.channel!r}: recv on a closed ReceiveEnd")
        if self._error is not None:
            text, cause = self._error
            raise ChannelError(text) from cause

    def recv_nowait(self) -> Message:
        """The next item if one is here; raises WouldBlock if none yet, EndOfChannel at the end."""
        self._check()
        while self._inbox:
            for msg in self._pop_good(1):
                return msg
        if self._pumps_open == 0:
            raise EndOfChannel(f"channel {self.channel!r}: all producers closed")
        raise WouldBlock(f"channel {self.channel!r}: no item ready")

    async def recv(self) -> Message:
        """The next item, waiting for one. Raises EndOfChannel when all producers closed and
        everything was received; ChannelError naming the producer if one failed."""
        return (await self.recv_batch(1))[0]

    async def recv_batch(self, max_items: int, timeout_s: float | None = None) -> list[Message]:
        """Up to `max_items` items: returns as soon as `max_items` are here, or once `timeout_s`
        (from the call; None = no timeout) has passed with at least one, or at end of stream with
        at least one. Waits past the timeout for the first item. Raises EndOfChannel only when
        closed and empty."""
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self._start()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            self._check()
            # Items stay in the inbox until we return, so a cancelled call loses nothing.
            n = len(self._inbox)
            if n >= max_items or (n and (self._pumps_open == 0 or
                                         (deadline is not None and loop.time() >= deadline))):
                batch = self._pop_good(min(n, max_items))
                if batch:
                    return batch
                continue  # every one of them was bad (and skipped)
            if n == 0 and self._pumps_open == 0:
                raise EndOfChannel(f"channel {self.channel!r}: all producers closed")
            with self._wait_input(self.channel):
                self._tasks_waiting += 1
                try:
                    await self._has_items.wait(
                        None if n == 0 or deadline is None else deadline - loop.time())
                finally:
                    self._tasks_waiting -= 1

    def __aiter__(self) -> "ReceiveEnd":
        return self

    async def __anext__(self) -> Message:
        try:
            return await self.recv()
        except EndOfChannel:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Stop receiving (idempotent): stops the pumps, discards prefetched items, and tells each
        producer (fire and forget; aclose() waits for the acks). Waiting recv() calls raise
        ClosedChannel."""
        if self._closed:
            return
        self._closed = True
        for task in self._pumps:
            task.cancel()
        self._closing = [h.channel_receiver_closed.remote(self.channel, self.consumer_key)
                         for h in self._handles]
        self._inbox.clear()
        self._has_items.fire()

    async def aclose(self) -> None:
        """close(), then wait for the pumps to stop and every producer to acknowledge (producers
        that died are ignored)."""
        self.close()
        await asyncio.gather(*self._pumps, *self._closing, return_exceptions=True)

    def statistics(self) -> ReceiveStatistics:
        return ReceiveStatistics(
            channel=self.channel, consumer_key=self.consumer_key, prefetch=self.prefetch,
            current_buffer_used=len(self._inbox), tasks_waiting_receive=self._tasks_waiting,
            received_total=self._received_total, producers_open=self._pumps_open,
            closed=self._closed,
        )
