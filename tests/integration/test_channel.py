"""dataflow.channel between real Ray actors (the module's Ray instance, tests/conftest.py), plus a few
process-local tests of cancellation on uvloop, where a fake handle stands in for an actor."""

import asyncio
import hashlib
import os
import time

import pytest
import torch
import uvloop

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import ray  # noqa: E402

from dataflow.channel import (  # noqa: E402
    BrokenChannel, ChannelEndpoint, ChannelError, ClosedChannel, EndOfChannel, ReceiveEnd,
    SendEnd, WouldBlock,
)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@ray.remote
class Peer:
    """A stand-in for NodeHost: channel_take / channel_receiver_closed delegate to the endpoint;
    the other methods drive the ends for the tests."""

    def __init__(self, name: str):
        self.name = name
        self.endpoint = ChannelEndpoint()
        self.outs: dict[str, SendEnd] = {}
        self.ins: dict[str, ReceiveEnd] = {}
        self.tasks: dict[str, asyncio.Task] = {}  # channel -> background send

    async def channel_take(self, channel, consumer_key, max_items):
        return await self.endpoint.take(channel, consumer_key, max_items)

    async def channel_receiver_closed(self, channel, consumer_key):
        await self.endpoint.receiver_closed(channel, consumer_key)

    async def open_send(self, channel, capacity, consumer_keys):
        self.outs[channel] = SendEnd(channel, capacity=capacity, consumer_keys=consumer_keys,
                                     producer=self.name)
        self.endpoint.register(self.outs[channel])

    async def open_recv(self, channel, key, producers, prefetch):
        self.ins[channel] = ReceiveEnd(channel, key, producers, prefetch=prefetch)

    async def send(self, channel, items, close=True, **meta):
        for x in items:
            await self.outs[channel].send(x, **meta)
        if close:
            await self.outs[channel].aclose()

    async def send_in_background(self, channel, items, close=True):
        self.tasks[channel] = asyncio.create_task(self.send(channel, items, close))

    async def background_result(self, channel):
        try:
            await asyncio.wait_for(self.tasks.pop(channel), 20)
            return "ok"
        except Exception as e:
            return type(e).__name__

    async def send_nowait(self, channel, x):
        try:
            self.outs[channel].send_nowait(x)
            return "sent"
        except WouldBlock:
            return "WouldBlock"

    async def send_tensors(self, channel, n, numel):
        digests = []
        for i in range(n):
            t = torch.randn(numel, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            digests.append(_digest(t))
            await self.outs[channel].send({"t": t, "i": i})
        await self.outs[channel].aclose()
        return digests

    async def recv_all(self, channel):
        out = []
        async for msg in self.ins[channel]:
            out.append((msg.data, msg.meta))
        with pytest.raises(EndOfChannel):  # the end is sticky
            await self.ins[channel].recv()
        return out

    async def recv_tensors(self, channel):
        return [(m.data["i"], _digest(m.data["t"]), m.data["t"].dtype == torch.bfloat16)
                async for m in self.ins[channel]]

    async def recv_until_error(self, channel):
        got = []
        try:
            async for msg in self.ins[channel]:
                got.append(msg.data)
        except ChannelError as e:
            return got, type(e).__name__, str(e)
        return got, None, None

    async def recv_batch(self, channel, max_items, timeout_s):
        t0 = time.perf_counter()
        try:
            batch = await self.ins[channel].recv_batch(max_items, timeout_s)
        except EndOfChannel:
            return "EndOfChannel", time.perf_counter() - t0
        return [m.data for m in batch], time.perf_counter() - t0

    async def close_recv(self, channel):
        await self.ins[channel].aclose()

    async def stats(self, channel):
        end = self.outs.get(channel) or self.ins[channel]
        return end.statistics()


def get(refs):
    return ray.get(refs, timeout=60)  # a hang fails the test instead of the whole run


@pytest.fixture(scope="module")
def peers(ray_instance):
    """Three named peers on the module's Ray (tests/conftest.py: the one Ray kept between modules; its
    workers import this module by name, tests.integration.test_channel, from the PYTHONPATH it set).
    Killed at the end, so that Ray is left free for the next module."""
    actors = {n: Peer.options(name=n).remote(n) for n in ("a", "b", "c")}
    yield actors
    for actor in actors.values():
        ray.kill(actor)


def wire(channel, producers, consumers, *, capacity, prefetch):
    """Open one channel: SendEnds on `producers`, ReceiveEnds on `consumers` (name -> actor)."""
    get([p.open_send.remote(channel, capacity, list(consumers)) for p in producers.values()])
    get([c.open_recv.remote(channel, key, list(producers.items()), prefetch)
         for key, c in consumers.items()])


def test_order_meta_and_end_of_channel(peers):
    a, b = peers["a"], peers["b"]
    wire("order", {"a": a}, {"b": b}, capacity=8, prefetch=4)
    t0 = time.time_ns() // 1000
    sent = a.send.remote("order", list(range(300)), version=7, tag="x")
    got = get(b.recv_all.remote("order"))
    get(sent)
    assert [d for d, _ in got] == list(range(300))
    assert [m["seq"] for _, m in got] == list(range(300))
    for _, meta in got:
        assert meta["producer"] == "a" and meta["version"] == 7 and meta["tag"] == "x"
        assert t0 <= meta["t_send_us"] <= time.time_ns() // 1000


def test_backpressure_blocks_and_never_drops(peers):
    a, b = peers["a"], peers["b"]
    wire("bp", {"a": a}, {"b": b}, capacity=4, prefetch=2)
    get(a.send_in_background.remote("bp", list(range(50))))
    time.sleep(0.5)  # let the outbox and b's inbox fill; b does not receive yet
    s = get(a.stats.remote("bp"))
    assert s.current_buffer_used == 4 and s.tasks_waiting_send == 1
    assert s.sent_total == 4 + 2  # outbox full + b's prefetch, then send waits
    assert get(a.send_nowait.remote("bp", -1)) == "WouldBlock"
    got = get(b.recv_all.remote("bp"))
    assert [d for d, _ in got] == list(range(50))
    assert get(a.background_result.remote("bp")) == "ok"


def test_fan_in_two_producers(peers):
    a, b, c = peers["a"], peers["b"], peers["c"]
    wire("fanin", {"a": a, "b": b}, {"c": c}, capacity=4, prefetch=4)
    get([p.send_in_background.remote("fanin", [(n, i) for i in range(200)])
         for n, p in (("a", a), ("b", b))])
    got = get(c.recv_all.remote("fanin"))
    for name in ("a", "b"):
        mine = [d for d, m in got if m["producer"] == name]
        assert mine == [[name, i] for i in range(200)]  # all, in order (tuples arrive as lists)
    assert len(got) == 400
    assert get([p.background_result.remote("fanin") for p in (a, b)]) == ["ok", "ok"]


def test_fan_out_each_item_exactly_once(peers):
    a, b, c = peers["a"], peers["b"], peers["c"]
    wire("fanout", {"a": a}, {"b": b, "c": c}, capacity=8, prefetch=4)
    get(a.send_in_background.remote("fanout", list(range(500))))
    got_b, got_c = get([b.recv_all.remote("fanout"), c.recv_all.remote("fanout")])
    seen_b, seen_c = [d for d, _ in got_b], [d for d, _ in got_c]
    assert sorted(seen_b + seen_c) == list(range(500))
    assert seen_b == sorted(seen_b) and seen_c == sorted(seen_c)
    assert seen_b and seen_c  # both consumers got a share
    assert get(a.background_result.remote("fanout")) == "ok"


def test_recv_batch_count_timeout_and_end(peers):
    a, b = peers["a"], peers["b"]
    wire("batch", {"a": a}, {"b": b}, capacity=16, prefetch=16)
    get(a.send.remote("batch", list(range(10)), close=False))
    time.sleep(0.3)  # all 10 prefetched
    items, dt = get(b.recv_batch.remote("batch", 4, 5.0))
    assert items == [0, 1, 2, 3] and dt < 1.0  # full batch: returns at once
    items, dt = get(b.recv_batch.remote("batch", 100, 0.3))
    assert items == list(range(4, 10)) and 0.25 < dt < 2.0  # partial batch: after the timeout
    get(a.send_in_background.remote("batch", [10], close=True))
    items, _ = get(b.recv_batch.remote("batch", 100, 0.01))  # waits past timeout for one
    assert items == [10]
    assert get(b.recv_batch.remote("batch", 5, 0.1))[0] == "EndOfChannel"


def test_broken_channel_after_all_receivers_close(peers):
    a, b, c = peers["a"], peers["b"], peers["c"]
    wire("broken", {"a": a}, {"b": b, "c": c}, capacity=2, prefetch=1)
    get(a.send_in_background.remote("broken", list(range(100))))
    time.sleep(0.3)
    assert get(a.stats.remote("broken")).tasks_waiting_send == 1
    get(b.close_recv.remote("broken"))
    time.sleep(0.2)
    assert get(a.stats.remote("broken")).consumers_open == 1  # c still there: still blocked
    get(c.close_recv.remote("broken"))
    assert get(a.background_result.remote("broken")) == "BrokenChannel"


def test_bf16_tensors_16mb_bit_exact(peers):
    a, b = peers["a"], peers["b"]
    wire("tensors", {"a": a}, {"b": b}, capacity=2, prefetch=2)
    sent_ref = a.send_tensors.remote("tensors", 4, 8 << 20)  # 8 Mi bf16 = 16 MiB each
    got = get(b.recv_tensors.remote("tensors"))
    sent = get(sent_ref)
    assert [(i, d, True) for i, d in enumerate(sent)] == got


def test_killed_producer_raises_instead_of_hanging(peers):
    doomed, b = Peer.remote("doomed"), peers["b"]
    wire("kill", {"doomed": doomed}, {"b": b}, capacity=4, prefetch=2)
    get(doomed.send.remote("kill", [1, 2], close=False))
    ref = b.recv_until_error.remote("kill")
    time.sleep(0.5)
    ray.kill(doomed)
    got, kind, text = get(ref)
    assert got == [1, 2] and kind == "ChannelError" and "'doomed'" in text


# ---------------------------------------------------------------- process-local, on uvloop


class _LocalHandle:
    """Stands in for an actor handle: `.channel_take.remote(...)` runs the endpoint's method as
    a task in this loop, so channel logic can be tested without Ray."""

    class _Method:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args):
            return asyncio.ensure_future(self.fn(*args))

    def __init__(self, endpoint):
        self.channel_take = self._Method(endpoint.take)
        self.channel_receiver_closed = self._Method(endpoint.receiver_closed)


def run_uvloop(coro_fn):
    loop = uvloop.new_event_loop()  # what Ray runs async actors on
    try:
        return loop.run_until_complete(asyncio.wait_for(coro_fn(), 10))
    finally:
        loop.close()


def _local_pair(capacity, prefetch):
    endpoint = ChannelEndpoint()
    send = SendEnd("ch", capacity=capacity, consumer_keys=["c"], producer="p")
    endpoint.register(send)
    return send, ReceiveEnd("ch", "c", {"p": _LocalHandle(endpoint)}, prefetch=prefetch)


async def _collect(recv):
    return [(m.data, m.meta["seq"]) async for m in recv]


def test_cancelled_operations_leave_the_channel_unchanged():
    async def main():
        send, recv = _local_pair(capacity=1, prefetch=1)
        # recv cancelled while waiting: the item sent afterwards is not lost.
        waiting = asyncio.create_task(recv.recv())
        await asyncio.sleep(0.01)
        waiting.cancel()
        await send.send("first")
        # send cancelled while blocked (outbox + inbox full): not enqueued, seq has no gap.
        await send.send("second")
        await asyncio.sleep(0.01)
        blocked = asyncio.create_task(send.send("dropped by cancel"))
        await asyncio.sleep(0.01)
        assert send.statistics().tasks_waiting_send == 1
        blocked.cancel()
        await asyncio.sleep(0)
        assert send.statistics().tasks_waiting_send == 0
        with pytest.raises(WouldBlock):
            send.send_nowait("full")
        # recv_batch cancelled while waiting for more: what it saw stays in the inbox.
        partial = asyncio.create_task(recv.recv_batch(10, 5.0))
        await asyncio.sleep(0.01)
        partial.cancel()
        consumer = asyncio.create_task(_collect(recv))
        await send.send("third")
        send.close()
        send.close()  # idempotent
        with pytest.raises(ClosedChannel):
            await send.send("after close")
        got = await consumer
        assert got == [("first", 0), ("second", 1), ("third", 2)]
        with pytest.raises(EndOfChannel):
            recv.recv_nowait()
        recv.close()
        with pytest.raises(ClosedChannel):
            await recv.recv()

    run_uvloop(main)


def test_local_meta_rules_and_broken():
    async def main():
        send, recv = _local_pair(capacity=2, prefetch=1)
        with pytest.raises(TypeError):
            await send.send(1, bad=[1])
        assert send.statistics().sent_total == 0
        # Forwarding upstream meta is fine: the engine keys are replaced, the rest kept.
        await send.send(1, seq=99, producer="upstream", t_send_us=0, version=3)
        meta = (await recv.recv()).meta
        assert (meta["seq"], meta["producer"], meta["version"]) == (0, "p", 3)
        assert meta["t_send_us"] > 0
        await recv.aclose()
        with pytest.raises(BrokenChannel):
            await send.send(1)

    run_uvloop(main)


def test_consumer_may_start_before_the_producer_registers():
    async def main():
        endpoint = ChannelEndpoint()
        recv = ReceiveEnd("ch", "c", {"p": _LocalHandle(endpoint)}, prefetch=4)
        await asyncio.sleep(0.01)  # the pump's take now waits for the SendEnd
        send = SendEnd("ch", capacity=2, consumer_keys=["c"], producer="p")
        endpoint.register(send)
        await send.send("x")
        send.close()
        assert [m.data async for m in recv] == ["x"]
        # A receiver that closed before the SendEnd existed still counts.
        await endpoint.receiver_closed("early", "c")
        early = SendEnd("early", capacity=2, consumer_keys=["c"], producer="p")
        endpoint.register(early)
        with pytest.raises(BrokenChannel):
            early.send_nowait("y")

    run_uvloop(main)
