"""The ReceiveEnd a hosted node reads (ctx.inputs[port]): the same calls, and the meta of the last
item handed out kept per channel, so a node's failure names the item it was processing
(dataflow/actor/host.py)."""

from __future__ import annotations

from dataflow.channel.errors import EndOfChannel


class TrackedInput:
    """A ReceiveEnd that remembers the meta of the last item it handed out (for error reports):
    `last_item` (channel -> meta, the latest last) is shared by every input of a node's host."""

    def __init__(self, end, last_item: dict):
        self._end = end
        self._last = last_item
        self.channel = end.channel

    def _seen(self, msg):
        self._last.pop(self.channel, None)
        self._last[self.channel] = msg.meta
        return msg

    async def recv(self):
        return self._seen(await self._end.recv())

    def recv_nowait(self):
        return self._seen(self._end.recv_nowait())

    async def recv_batch(self, max_items: int, timeout_s: float | None = None):
        batch = await self._end.recv_batch(max_items, timeout_s)
        if batch:
            self._seen(batch[-1])
        return batch

    async def batches(self, max_items: int, timeout_s: float):
        """`async for batch in inp.batches(n, t)`: recv_batch until the channel ends."""
        while True:
            try:
                yield await self.recv_batch(max_items, timeout_s)
            except EndOfChannel:
                return

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.recv()
        except EndOfChannel:
            raise StopAsyncIteration from None

    def statistics(self):
        return self._end.statistics()

    def close(self):
        self._end.close()
