"""The producer side of a channel: SendEnd (a bounded outbox of encoded items that consumers take
from) and ChannelEndpoint (a process's outboxes, reached by the consumers' remote takes)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ray

from dataflow.channel.errors import BrokenChannel, ChannelError, ClosedChannel, WouldBlock
from dataflow.channel.waiting import Signal, no_span
from dataflow.channel.codec import DEFAULT_OOB_THRESHOLD, Message, encode

_META_TYPES = (int, float, str, bool, type(None))


class ChannelEndpoint:
    """The channel side of one process: its SendEnds (outboxes) by channel name.

    The host actor exposes `take` and `receiver_closed` as the remote methods `channel_take` and
    `channel_receiver_closed`, delegating to these unchanged.
    """

    def __init__(self):
        self._outboxes: dict[str, SendEnd] = {}
        self._registered = Signal()
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

    @property
    def pristine(self) -> bool:
        """No SendEnd registered yet (takes that arrived early may be waiting for one)."""
        return not self._outboxes

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
    size (bench/results/channels_cpu_2026-11-29.md), so it is off, kept for the bench.
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
        self._has_items = Signal()   # takes wait on it
        self._has_space = Signal()   # sends and aclose() wait on it
        self._closed_consumers: set[str] = set()
        self._blocked = tracer.blocked_output if tracer is not None else no_span
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
