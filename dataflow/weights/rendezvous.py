"""Meeting points of a process group between node actors: a TCPStore, and what each end
tells the others about its device (the weight push's group: sync.py; a multi-rank node's: multirank.py).
The weight push's rendezvous itself (weight_transport=collective; sync.py's module docstring says
the steps) is here too: the learner's end meets the generators on its store (host_push_group), each
generator finds the address (push_address) and joins (join_push_group).
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import torch

from dataflow.errors import UserError
from dataflow.timeouts import wait_within
from dataflow.weights.edges import SYNC_EDGE


def device_info(device: str, model: torch.nn.Module | None = None) -> dict:
    """What an end tells the others: {"device": "cuda" | "cpu", "uuid": its GPU's, or ""} (+ "dtype" of
    `model`'s weights)."""
    info = {"device": "cuda" if device.startswith("cuda") else "cpu", "uuid": ""}
    if info["device"] == "cuda":
        info["uuid"] = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    if model is not None:
        info["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return info


def tcp_store(host: str, port: int, is_master: bool, timeout: timedelta):
    """The rendezvous TCPStore at host:port (is_master: hosted here); does not wait for the others.
    A host passes port 0 and publishes `store.port`: the OS picks a port as it binds, where a port
    picked ahead of time could be taken before it is bound."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, is_master, timeout, wait_for_workers=False)


def group_device(backend: str) -> str:
    """The device a PushGroup end sends from: its CUDA device under NCCL, else the CPU."""
    return f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"


def push_names(ctx) -> list[str]:
    """The push group's ends: the learner (`ctx`'s replica), then every generator subscribed to SYNC_EDGE."""
    names = [ctx.full_name] + list(ctx.subscribers(SYNC_EDGE))
    if len(names) < 2:
        raise UserError(f"weight_transport=collective: no generator subscribes to '{SYNC_EDGE}' "
                        f"(declare g.versioned('{SYNC_EDGE}', src='{ctx.name}', dst=[...]))")
    return names


async def host_push_group(ctx, c, store, host: str, names: list[str], lora: dict):
    """The learner's end, on the store it hosts at `host` (and keeps): publish the address on
    SYNC_EDGE (with `lora`, the adapter's shapes, if any), wait for every generator's device and
    dtype, pick the backend and open the PushGroup as rank 0. Returns (group, backend, dtype name)."""
    from dataflow.weights.transport import PushGroup, WeightPushError

    me, timeout = names[0], timedelta(seconds=c.rendezvous_timeout_s)
    port = store.port
    await ctx.publish(SYNC_EDGE, {"host": host, "port": port, "names": names, **lora}, version=0)
    keys = [f"end/{i}" for i in range(1, len(names))]
    try:
        await asyncio.to_thread(store.wait, keys, timeout)
    except Exception:
        missing = [names[i + 1] for i, k in enumerate(keys) if not store.check([k])]
        raise WeightPushError(f"weight push rendezvous of {me} at {host}:{port}: "
                              f"{', '.join(missing)} did not join within {c.rendezvous_timeout_s:g} s") from None
    ends = [device_info(ctx.device)] + [json.loads(store.get(k)) for k in keys]
    dtypes = {e["dtype"] for e in ends[1:]}
    if len(dtypes) != 1:
        raise WeightPushError(f"weight push from {me}: the generators hold different dtypes "
                              f"{dict(zip(names[1:], (e['dtype'] for e in ends[1:])))}")
    dtype = dtypes.pop()
    own_gpus = all(e["device"] == "cuda" for e in ends) and len({e["uuid"] for e in ends}) == len(ends)
    backend = "nccl" if own_gpus and c.backend == "auto" else "gloo"
    def tell_plan(push_port: int):     # the generators read it, then join the group on that port
        store.set("plan", json.dumps({"backend": backend, "port": push_port}))

    group = await asyncio.to_thread(lambda: PushGroup(
        host=host, port=0, rank=0, names=names, device=group_device(backend),
        timeout_s=c.rendezvous_timeout_s, on_listen=tell_plan))
    return group, backend, dtype


async def push_address(ctx, c) -> dict:
    """A generator's end: the learner's push address from SYNC_EDGE (waiting for it, bounded), with
    this replica among its receivers."""
    from dataflow.weights.transport import WeightPushError

    me = ctx.full_name
    try:
        await wait_within(ctx.wait_version(SYNC_EDGE, 0), c.rendezvous_timeout_s)
    except asyncio.TimeoutError:
        raise WeightPushError(f"{me}: no weight push address from the learner on '{SYNC_EDGE}' "
                              f"within {c.rendezvous_timeout_s:g} s") from None
    _, addr = await ctx.latest(SYNC_EDGE)
    names = addr["names"]
    if me not in names:
        raise WeightPushError(f"{me}: not among the weight push receivers {names[1:]} of {names[0]}")
    return addr


def join_push_group(ctx, c, addr: dict, model: torch.nn.Module):
    """A generator's end (in a thread: it blocks): tell the learner this replica's device and
    `model`'s dtype on its store, read the plan, join the PushGroup."""
    from dataflow.weights.transport import PushGroup, WeightPushError

    me, names = ctx.full_name, addr["names"]
    rank, timeout = names.index(me), timedelta(seconds=c.rendezvous_timeout_s)
    try:
        store = tcp_store(addr["host"], addr["port"], False, timeout)
        store.set(f"end/{rank}", json.dumps(device_info(ctx.device, model)))
        plan = json.loads(store.get("plan"))
    except Exception as e:
        raise WeightPushError(f"weight push rendezvous of {names[0]} at {addr['host']}:"
                              f"{addr['port']}: {me} could not join ({e})") from None
    if plan["backend"] == "nccl" and not ctx.device.startswith("cuda"):
        raise WeightPushError(f"{names[0]} chose NCCL but {me} is on {ctx.device}")
    return PushGroup(host=addr["host"], port=plan["port"], rank=rank, names=names,
                     device=group_device(plan["backend"]), timeout_s=c.rendezvous_timeout_s)
