"""Benchmark: dataflow channels vs ray.util.queue.Queue vs plain ray.put + ray.get.

    /work/venv/bin/python bench/channel.py            (about 1-2 minutes on 2 cores)

Between two Ray actors (producer, consumer) on one machine:
  - 1 KB items (256 int32 token ids in a dict): messages/s with the producer sending flat out and
    the consumer receiving one item at a time (`async for`), then latency send -> recv with items
    paced so that one is in flight at a time (p50 / p99 over the paced run).
  - 16 MiB bf16 tensors: the same, for our channel with large buffers out of band in the take()
    reply (the default), our channel with one ray.put ObjectRef per item (SendEnd(put_large=True)),
    ray.util.queue, and the reference: the producer ray.puts the tensor, the consumer ray.gets it
    (per-item time = put time + get time, no pipelining; rate = 1 / that).
Goals (issue): small-message rate >= 10x ray.util.queue; 16 MiB within 1.5x of put + get.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from ray.util.queue import Queue  # noqa: E402

from dataflow.channel import ChannelEndpoint, ReceiveEnd, SendEnd  # noqa: E402

BIG_NUMEL = 8 << 20  # bf16 elements: 16 MiB


def make_item(kind: str):
    if kind == "small":
        return {"ids": np.arange(256, dtype=np.int32)}
    return torch.ones(BIG_NUMEL if kind == "big" else BIG_NUMEL // 16, dtype=torch.bfloat16)


def now_us() -> int:
    return time.time_ns() // 1000


@ray.remote
class Peer:
    def __init__(self, name: str):
        self.name = name
        self.endpoint = ChannelEndpoint()
        self.ends: dict = {}

    async def channel_take(self, channel, consumer_key, max_items):
        return await self.endpoint.take(channel, consumer_key, max_items)

    async def channel_receiver_closed(self, channel, consumer_key):
        await self.endpoint.receiver_closed(channel, consumer_key)

    async def open_send(self, channel, capacity, put_large=False):
        self.ends[channel] = SendEnd(channel, capacity=capacity, consumer_keys=["consumer"],
                                     producer=self.name, put_large=put_large)
        self.endpoint.register(self.ends[channel])

    async def open_recv(self, channel, producer, prefetch):
        self.ends[channel] = ReceiveEnd(channel, "consumer", {"producer": producer},
                                        prefetch=prefetch)

    async def produce(self, channel, kind, n, pace_s):
        item, end = make_item(kind), self.ends[channel]
        t0 = time.perf_counter()
        for _ in range(n):
            await end.send(item)
            if pace_s:
                await asyncio.sleep(pace_s)
        await end.aclose()
        return t0

    async def consume(self, channel):
        lat = [now_us() - m.meta["t_send_us"] async for m in self.ends[channel]]
        return time.perf_counter(), lat

    async def q_produce(self, q, kind, n, pace_s):
        item = make_item(kind)
        t0 = time.perf_counter()
        for _ in range(n):
            await q.put_async((now_us(), item))
            if pace_s:
                await asyncio.sleep(pace_s)
        return t0

    async def q_consume(self, q, n):
        lat = []
        for _ in range(n):
            t_send, _item = await q.get_async()
            lat.append(now_us() - t_send)
        return time.perf_counter(), lat

    async def put_many(self, n, as_numpy):
        item, refs, times = make_item("big"), [], []
        if as_numpy:  # the same bytes as a numpy view: pickle5 sends it without a copy
            item = item.view(torch.uint8).numpy()
        for _ in range(n):
            t0 = time.perf_counter()
            refs.append(ray.put(item))
            times.append(time.perf_counter() - t0)
        return refs, times

    async def get_many(self, refs):
        times = []
        for ref in refs:
            t0 = time.perf_counter()
            value = await ref
            assert value.nbytes == BIG_NUMEL * 2 if isinstance(value, np.ndarray) else value.numel()
            times.append(time.perf_counter() - t0)
        return times


def pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def run_channel(prod, cons, tag, kind, n_rate, n_lat, pace_s, capacity, prefetch, put_large=False):
    result = {}
    for phase, n, pace in (("rate", n_rate, 0.0), ("lat", n_lat, pace_s)):
        ch = f"{tag}-{phase}"
        ray.get(prod.open_send.remote(ch, capacity, put_large))
        ray.get(cons.open_recv.remote(ch, prod, prefetch))
        t0_ref = prod.produce.remote(ch, kind, n, pace)
        t_end, lat = ray.get(cons.consume.remote(ch))
        t0 = ray.get(t0_ref)
        assert len(lat) == n
        if phase == "rate":
            result["rate"] = n / (t_end - t0)
        else:
            result["p50"], result["p99"] = pct(lat, 50) / 1e3, pct(lat, 99) / 1e3
    return result


def run_queue(prod, cons, kind, n_rate, n_lat, pace_s, capacity):
    result = {}
    for phase, n, pace in (("rate", n_rate, 0.0), ("lat", n_lat, pace_s)):
        q = Queue(maxsize=capacity)
        t0_ref = prod.q_produce.remote(q, kind, n, pace)
        t_end, lat = ray.get(cons.q_consume.remote(q, n))
        t0 = ray.get(t0_ref)
        if phase == "rate":
            result["rate"] = n / (t_end - t0)
        else:
            result["p50"], result["p99"] = pct(lat, 50) / 1e3, pct(lat, 99) / 1e3
        q.shutdown()
    return result


def run_put_get(prod, cons, n, as_numpy=False):
    refs, put_times = ray.get(prod.put_many.remote(n, as_numpy))
    get_times = ray.get(cons.get_many.remote(refs))  # a list of refs inside a list: not resolved
    per_item = [p + g for p, g in zip(put_times, get_times)]
    return {"rate": 1.0 / float(np.mean(per_item)), "p50": pct(per_item, 50) * 1e3,
            "p99": pct(per_item, 99) * 1e3}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-n", type=int, default=20000, help="1 KB items for the rate")
    parser.add_argument("--queue-n", type=int, default=1000, help="1 KB items via ray queue")
    parser.add_argument("--big-n", type=int, default=40, help="16 MiB tensors for the rate")
    args = parser.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO}})  # workers import dataflow
    prod, cons = Peer.remote("producer"), Peer.remote("consumer")
    ray.get([prod.open_send.remote("warm", 1), cons.open_recv.remote("warm", prod, 1)])
    ray.get([prod.produce.remote("warm", "small", 10, 0.0), cons.consume.remote("warm")])

    # Warm the object store: the first writes into fresh shared-memory pages pay page faults,
    # which would penalise whichever 16 MiB case ran first.
    for put_large in (False, True):
        run_channel(prod, cons, f"warm{put_large}", "big", 30, 1, 0.0, 4, 2, put_large)

    rows = {}
    rows["small channel"] = run_channel(prod, cons, "s", "small", args.small_n, 300, 0.002,
                                        capacity=256, prefetch=256)
    rows["small ray.util.queue"] = run_queue(prod, cons, "small", args.queue_n, 300, 0.002, 256)
    rows["1MiB channel (oob in reply)"] = run_channel(prod, cons, "m", "mid", 10 * args.big_n, 20,
                                                      0.01, capacity=8, prefetch=4)
    rows["1MiB channel (ray.put per item)"] = run_channel(
        prod, cons, "mp", "mid", 10 * args.big_n, 20, 0.01, capacity=8, prefetch=4, put_large=True)
    rows["16MiB channel (oob in reply)"] = run_channel(prod, cons, "b", "big", args.big_n, 20,
                                                       0.05, capacity=4, prefetch=2)
    rows["16MiB channel (ray.put per item)"] = run_channel(
        prod, cons, "p", "big", args.big_n, 20, 0.05, capacity=4, prefetch=2, put_large=True)
    rows["16MiB ray.util.queue"] = run_queue(prod, cons, "big", args.big_n, 20, 0.05, 4)
    rows["16MiB ray.put + ray.get"] = run_put_get(prod, cons, args.big_n)
    rows["16MiB ray.put + ray.get (numpy view)"] = run_put_get(prod, cons, args.big_n, True)
    ray.shutdown()

    # Ratios: rate vs the queue for 1 KB; for 16 MiB, time per item (1 / rate) relative to the
    # put + get reference of the tensor (the goal) and of its numpy view (the transport floor).
    small_q = rows["small ray.util.queue"]["rate"]
    ref_t = rows["16MiB ray.put + ray.get"]["rate"]
    ref_np = rows["16MiB ray.put + ray.get (numpy view)"]["rate"]
    ratio = {"small channel": f"{rows['small channel']['rate'] / small_q:.1f}x queue rate"}
    for name in ("16MiB channel (oob in reply)", "16MiB channel (ray.put per item)"):
        r = rows[name]["rate"]
        ratio[name] = f"{ref_t / r:.2f}x put+get time ({ref_np / r:.2f}x numpy view)"
    print(f"| {'case':38} | {'msgs/s':>9} | {'p50 ms':>7} | {'p99 ms':>7} | ratio |")
    print(f"|{'-' * 40}|{'-' * 11}|{'-' * 9}|{'-' * 9}|-------|")
    for name, r in rows.items():
        print(f"| {name:38} | {r['rate']:9.1f} | {r['p50']:7.2f} | {r['p99']:7.2f} "
              f"| {ratio.get(name, '')} |")
    print("goals: 1 KB rate >= 10x ray.util.queue; 16 MiB time per item <= 1.5x put+get")


if __name__ == "__main__":
    main()
