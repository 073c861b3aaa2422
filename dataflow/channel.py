"""Bounded, pull-based channels between Ray actors, shaped like trio's memory channels.

    producer actor                                          consumer actor
    SendEnd.send() -> Outbox (bounded FIFO of encoded items)
                          ^  channel_take(channel, key, n)  <- pump (one per producer) -> Inbox
                          |  long poll; the reply carries up to n items     ReceiveEnd.recv()
                          '- channel_receiver_closed(channel, key)  <- ReceiveEnd.close()

Items never pass through the driver. A producer's host answers a take as soon as its outbox holds
at least one item (or is closed), with up to `n` items in one reply: under load every round trip
carries a batch, which is where the message rate comes from. A pump asks only for as many items as
its share of the consumer's inbox can hold, so nothing is ever dropped: a full inbox stops the
pump, the outbox fills, and `send()` waits (backpressure). FIFO holds per producer; with several
consumers each item goes to exactly one of them, whichever asks first (balancing by demand).

End of stream is `close()`, never a sentinel: when every producer's outbox is closed and drained,
`recv()` raises EndOfChannel (and `async for` ends). When every consumer has closed its ReceiveEnd,
`send()` raises BrokenChannel. A producer actor that dies makes `recv()` raise ChannelError naming
it. Every async operation is cancellation-safe: cancelled, it leaves the channel unchanged.

Threading: all objects here belong to one event loop (the actor's); they are not thread-safe.
Closing a ReceiveEnd discards what it had prefetched (at most `prefetch` items, plus a reply in
flight), as closing a trio receive channel discards its buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import ray

from dataflow.codec import DEFAULT_MAX_BYTES, DEFAULT_OOB_THRESHOLD, DecodeError, Message, decode, encode

_META_TYPES = (int, float, str, bool, type(None))


class ChannelError(Exception):
    """Base class of channel errors. Raised as such when a producer of a ReceiveEnd failed."""


class EndOfChannel(ChannelError):
    """recv() on a channel whose producers all closed and whose items were all received."""


class BrokenChannel(ChannelError):
    """send() on a channel whose consumers all closed their receive ends."""


class BadItem(ChannelError):
    """recv() met an item that fails to decode (names the channel and the producer)."""

    def __init__(self, message: str, channel: str = "", producer: str = ""):
        super().__init__(message)
        self.channel = channel
        self.producer = producer


class ClosedChannel(ChannelError):
    """An operation on an end that this process already closed."""


class WouldBlock(ChannelError):
    """send_nowait() / recv_nowait() could not complete immediately."""


class _Signal:
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


def _nullcontext(_channel: str):
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- producer side


class ChannelEndpoint:
    """The channel side of one process: its SendEnds (outboxes) by channel name.

    The host actor exposes `take` and `receiver_closed` as the remote methods `channel_take` and
    `channel_receiver_closed`, delegating to these unchanged.
    """

    def __init__(self):
        self._outboxes: dict[str, SendEnd] = {}
        self._registered = _Signal()
        self._early_closed: dict[str, set[str]] = {}

    def register(self, send_end: "SendEnd") -> None:
        """Make `send_end` reachable by consumers' takes (one SendEnd per channel)."""
        if send_end.channel in self._outboxes:
            raise ValueError(f"channel {send_end.channel!r} already has a SendEnd here")
        self._outboxes[send_end.channel] = send_end
        for key in self._early_closed.pop(send_end.channel, ()):
            send_end._receiver_closed(key)
        self._registered.fire()

    async def take(self, channel: str, consumer_key: str, max_items: int) -> tuple[bool, list]:
        """Long poll: waits until the outbox of `channel` holds an item or is closed, then returns
        (closed_and_drained, [(header, buffers), ...] with 1..max_items items, or none when
        closed). Waits for the SendEnd to be registered if a consumer asks before that.
        Plain (header, buffers) pairs: pickling them costs ~0.5 us/item against ~0.2 us for one
        concatenated blob, noise next to the ~30 us per item of the whole path."""
        while (send_end := self._outboxes.get(channel)) is None:
            await self._registered.wait()
        return await send_end._take(consumer_key, max_items)

    def reset_consumer(self, channel: str, consumer_key: str) -> None:
        """Consumer `consumer_key` of `channel` died and was restarted: takes its dead process left
        waiting here return empty (see SendEnd.reset_consumer)."""
        send_end = self._outboxes.get(channel)
        if send_end is not None:
            send_end.reset_consumer(consumer_key)

    async def receiver_closed(self, channel: str, consumer_key: str) -> None:
        """Consumer `consumer_key` closed its ReceiveEnd of `channel`."""
        send_end = self._outboxes.get(channel)
        if send_end is None:
            self._early_closed.setdefault(channel, set()).add(consumer_key)
        else:
            send_end._receiver_closed(consumer_key)


@dataclass(frozen=True, slots=True)
class SendStatistics:
    channel: str
    producer: str
    capacity: int
    current_buffer_used: int
    tasks_waiting_send: int
    sent_total: int
    taken_total: int
    consumers_open: int
    closed: bool


class SendEnd:
    """Producer end of `channel` in this process: a bounded outbox of `capacity` encoded items.
    Consumers reach it once the process's endpoint has it: `endpoint.register(send_end)`.

    `consumer_keys` names every consumer replica (the keys their ReceiveEnds use); send() raises
    BrokenChannel once all of them closed. `producer` is this replica's name, put in each item's
    meta with `seq` and `t_send_us`. `tracer.blocked_output(channel)` wraps time spent waiting for
    space; `on_depth(channel, depth)` is called whenever the outbox depth changes.

    Large buffers ride out of band in the take() reply. `put_large=True` instead ray.puts them at
    send time and the reply carries an ObjectRef; bench/channel.py measured that slower at every
    size (16 MiB: ~140 vs ~200 items/s; 1 MiB: ~2.4x slower), so it is off, kept for the bench.
    """

    def __init__(self, channel: str, *, capacity: int, consumer_keys: Iterable[str],
                 producer: str, tracer: Any = None,
                 on_depth: Callable[[str, int], None] | None = None,
                 oob_threshold: int = DEFAULT_OOB_THRESHOLD, put_large: bool = False):
        if capacity < 1:
            raise ValueError(f"channel {channel!r}: capacity must be >= 1, got {capacity}")
        self.consumer_keys = frozenset(consumer_keys)
        if not self.consumer_keys:
            raise ValueError(f"channel {channel!r}: a SendEnd needs at least one consumer key")
        self.channel = channel
        self.producer = producer
        self.capacity = capacity
        self._items: deque = deque()  # (header, buffers), or (header, ObjectRef) with put_large
        self._has_items = _Signal()   # takes wait on it
        self._has_space = _Signal()   # sends and aclose() wait on it
        self._closed_consumers: set[str] = set()
        self._blocked = tracer.blocked_output if tracer is not None else _nullcontext
        self._on_depth = on_depth
        self._oob_threshold = oob_threshold
        self._put_large = put_large
        self._seq = 0
        self._taken_total = 0
        self._tasks_waiting = 0
        self._closed = False
        self._generation: dict[str, int] = {}  # consumer key -> restarts (reset_consumer)

    def _broken(self) -> bool:
        return self._closed_consumers >= self.consumer_keys

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedChannel(f"channel {self.channel!r}: send on a closed SendEnd")
        if self._broken():
            raise BrokenChannel(f"channel {self.channel!r}: every consumer closed")

    def _depth_changed(self) -> None:
        if self._on_depth is not None:
            self._on_depth(self.channel, len(self._items))

    def _enqueue(self, data: Any, meta: dict) -> None:
        # Encoding here (not before waiting) gives gap-free `seq` even when a waiting send is
        # cancelled, and makes t_send_us the time the item entered the outbox.
        for key, value in meta.items():
            if not isinstance(value, _META_TYPES):
                raise TypeError(f"meta {key!r} must be int/float/str/bool/None, "
                                f"got {type(value).__name__}")
        # Engine keys replace any passed in, so a node may forward `**msg.meta` from upstream.
        meta.update(seq=self._seq, producer=self.producer, t_send_us=time.time_ns() // 1000)
        header, buffers = encode(Message(data, meta), oob_threshold=self._oob_threshold)
        if self._put_large and buffers:
            buffers = ray.put(buffers)
        self._seq += 1
        self._items.append((header, buffers))
        self._has_items.fire()
        self._depth_changed()

    def send_nowait(self, data: Any, **meta) -> None:
        """Enqueue without waiting; raises WouldBlock when the outbox is full."""
        self._check_open()
        if len(self._items) >= self.capacity:
            raise WouldBlock(f"channel {self.channel!r}: outbox full")
        self._enqueue(data, meta)

    async def send(self, data: Any, **meta) -> None:
        """Enqueue `data` with `meta`, waiting while the outbox is full (never drops).

        `meta` values are int/float/str/bool/None (else TypeError); `seq`, `producer` and
        `t_send_us` are set here, replacing values passed for them. `data` is encoded by
        reference: arrays/tensors must not be modified in place until a consumer received them.
        Raises BrokenChannel / ClosedChannel as described above.
        """
        self._check_open()
        if len(self._items) >= self.capacity:
            with self._blocked(self.channel):
                self._tasks_waiting += 1
                try:
                    while len(self._items) >= self.capacity:
                        await self._has_space.wait()
                        self._check_open()
                finally:
                    self._tasks_waiting -= 1
        self._enqueue(data, meta)

    def close(self) -> None:
        """End of stream (idempotent). Consumers receive what is already in the outbox, then
        EndOfChannel. The process must stay alive until they took it: see aclose()."""
        if not self._closed:
            self._closed = True
            self._has_items.fire()
            self._has_space.fire()

    async def aclose(self) -> None:
        """close(), then wait until every item was taken (or no consumer is left to take it).
        A consumer that died without closing is not noticed here: bound this with a timeout."""
        self.close()
        while self._items and not self._broken():
            await self._has_space.wait()

    async def _take(self, consumer_key: str, max_items: int) -> tuple[bool, list]:
        if consumer_key not in self.consumer_keys:
            raise ChannelError(f"channel {self.channel!r}: unknown consumer {consumer_key!r} "
                               f"(expected one of {sorted(self.consumer_keys)})")
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        generation = self._generation.get(consumer_key, 0)
        while (not self._items and not self._closed and consumer_key not in self._closed_consumers
               and self._generation.get(consumer_key, 0) == generation):
            await self._has_items.wait()
        if consumer_key in self._closed_consumers:
            return True, []  # stops a pump whose receive end closed while this take waited
        if self._generation.get(consumer_key, 0) != generation:
            return False, []  # asked for by a process of the consumer that died since
        # No await from here to the return: items popped are always in the reply.
        batch = [self._items.popleft() for _ in range(min(max_items, len(self._items)))]
        self._taken_total += len(batch)
        self._has_space.fire()
        self._depth_changed()
        return self._closed and not self._items, batch

    def reset_consumer(self, consumer_key: str) -> None:
        """The process of consumer `consumer_key` died (and was restarted). A take it left waiting
        would hand the next items to nobody: every take of that key waiting now returns empty
        (a live pump just asks again)."""
        self._generation[consumer_key] = self._generation.get(consumer_key, 0) + 1
        self._has_items.fire()

    def _receiver_closed(self, consumer_key: str) -> None:
        self._closed_consumers.add(consumer_key)
        if self._broken():
            self._items.clear()  # nobody is left to take them; free the memory
        self._has_items.fire()
        self._has_space.fire()

    def statistics(self) -> SendStatistics:
        return SendStatistics(
            channel=self.channel, producer=self.producer, capacity=self.capacity,
            current_buffer_used=len(self._items), tasks_waiting_send=self._tasks_waiting,
            sent_total=self._seq, taken_total=self._taken_total,
            consumers_open=len(self.consumer_keys - self._closed_consumers), closed=self._closed,
        )


# ----------------------------------------------------------------------------- consumer side


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
        self._pump_wake = [_Signal() for _ in producers]
        self._inbox: deque = deque()  # (pump index, header, buffers)
        self._has_items = _Signal()
        self._pumps: list[asyncio.Task] = []
        self._pumps_open = len(producers)
        self._error: tuple[str, BaseException] | None = None
        self._closing: list = []
        self._closed = False
        self._received_total = 0
        self._tasks_waiting = 0
        self._wait_input = tracer.wait_input if tracer is not None else _nullcontext
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
