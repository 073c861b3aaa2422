"""Learner -> generator weights, over one of two transports behind one small interface.

    weight_transport="object_store"  the learner `ray.put`s a CPU copy of its state dict on the
                                     versioned edge `policy`; a generator fetches it at its next
                                     generate call and load_state_dict()s it.
    weight_transport="collective"    the HybridEngine push (dataflow/hybrid_engine.py): the learner
                                     hosts a PushGroup (gloo; NCCL when every end has a CUDA device
                                     of its own) and broadcasts its weights with a WeightPusher to a
                                     WeightReceiver in every generator replica. `policy` still
                                     carries the version (value None: nothing rides the object store).

    Learner:    sync = LearnerWeightSync(ctx, config.weight_sync); await sync.setup(model)
                await sync.publish(model, version)      # returns once every generator holds it
    Generator:  sync = GeneratorWeightSync(ctx, config.weight_sync); await sync.setup(model)
                async with sync.serving() as version:   # switch (if newer), then weights fixed
                    generate(...)

Ordering: publish() announces `version` on `policy` only after every generator holds it (object
store: the subscribers' acks; collective: push() returns once every receiver staged it). So a prompt
the source admitted for version v meets a generator that holds v: serving() switches to the newest
version staged, and first waits (bounded) until it reaches the version announced on `policy`.

Rendezvous (collective), in the nodes' setups (which run concurrently): the learner opens a TCPStore
and publishes its address on the versioned edge `policy_sync` (graph: learner -> generator); each
generator writes its device (type, GPU UUID) and weight dtype there; the learner picks the backend
(NCCL only when every end is on a distinct CUDA device: two ranks on one GPU cannot use NCCL, as in
placement=colocated) and the dtype to push in, then all ends build the PushGroup. Every wait is
bounded (`rendezvous_timeout_s` in setup, `timeout_s` for a push or a generator's wait for a version)
and fails naming both ends (WeightPushError), which fails the node.

`checksums`: after each publish the learner logs {"weights/version", "weights/checksum"} (ctx.metrics,
so metrics.jsonl), and each generator logs the same for every version it switches to: equal
checksums at equal versions show the transport delivered the learner's weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch

from dataflow.errors import UserError

SYNC_EDGE = "policy_sync"
"""Versioned edge (learner -> generators) carrying the collective transport's rendezvous address."""


@dataclass(kw_only=True)
class WeightSyncConfig:
    transport: Literal["object_store", "collective"] = "object_store"
    """object_store: state dict through Ray's object store. collective: HybridEngine push
    (gloo/NCCL broadcast from the learner; llama / qwen2 models)."""
    backend: Literal["auto", "gloo"] = "auto"
    """collective: auto = NCCL when every end has a CUDA device of its own, else gloo."""
    timeout_s: float = 120.0
    """collective: a push, or a generator's wait for a version, that takes longer fails naming both ends."""
    rendezvous_timeout_s: float = 600.0
    """collective: how long the learner and the generators wait for each other in their setups
    (which include loading the models)."""
    checksums: bool = False
    """Log a checksum of the weights per version (learner: pushed; generator: switched to)."""


def weights_checksum(model: torch.nn.Module, dtype: torch.dtype | None = None) -> float:
    """Order-sensitive checksum of the parameters (by name), optionally cast to `dtype` first."""
    with torch.no_grad():
        sums = [p.detach().to(dtype or p.dtype).double().sum() * (i + 1)
                for i, (_, p) in enumerate(sorted(model.named_parameters()))]
        return float(torch.stack(sums).sum().item()) if sums else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _device_info(device: str, model: torch.nn.Module | None = None) -> dict:
    info = {"device": "cuda" if device.startswith("cuda") else "cpu", "uuid": ""}
    if info["device"] == "cuda":
        info["uuid"] = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    if model is not None:
        info["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return info


def _group_device(backend: str) -> str:
    return f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"


class LearnerWeightSync:
    """Learner end: setup() (collective: rendezvous, push group), publish(model, version)."""

    def __init__(self, ctx, config: WeightSyncConfig, edge: str = "policy"):
        self.ctx, self.config, self.edge = ctx, config, edge
        self.pusher = None
        self.dtype: torch.dtype | None = None     # what the generators hold (collective)

    async def setup(self, model: torch.nn.Module) -> None:
        if self.config.transport != "collective":
            return
        from dataflow.hybrid_engine import ParallelLayout, PushGroup, WeightPusher, WeightPushError
        from dataflow.weight_adapters import family_of

        try:
            family_of(model)
        except ValueError as e:
            raise UserError(f"weight_transport=collective: {e}; use weight_transport=object_store") from None
        import ray

        c, me = self.config, self.ctx.full_name
        names = [me] + list(self.ctx.subscribers(SYNC_EDGE))
        if len(names) < 2:
            raise UserError(f"weight_transport=collective: no generator subscribes to '{SYNC_EDGE}' "
                            f"(declare g.versioned('{SYNC_EDGE}', src='{self.ctx.name}', dst=[...]))")
        host, port = ray.util.get_node_ip_address(), _free_port()
        timeout = timedelta(seconds=c.rendezvous_timeout_s)
        self._store = await asyncio.to_thread(_tcp_store, host, port, True, timeout)
        await self.ctx.publish(SYNC_EDGE, {"host": host, "port": port, "names": names}, version=0)
        keys = [f"end/{i}" for i in range(1, len(names))]
        try:
            await asyncio.to_thread(self._store.wait, keys, timeout)
        except Exception:
            missing = [names[i + 1] for i, k in enumerate(keys) if not self._store.check([k])]
            raise WeightPushError(f"weight push rendezvous of {me} at {host}:{port}: "
                                  f"{', '.join(missing)} did not join within {c.rendezvous_timeout_s:g} s") from None
        ends = [_device_info(self.ctx.device)] + [json.loads(self._store.get(k)) for k in keys]
        dtypes = {e["dtype"] for e in ends[1:]}
        if len(dtypes) != 1:
            raise WeightPushError(f"weight push from {me}: the generators hold different dtypes "
                                  f"{dict(zip(names[1:], (e['dtype'] for e in ends[1:])))}")
        self.dtype = getattr(torch, dtypes.pop())
        own_gpus = all(e["device"] == "cuda" for e in ends) and len({e["uuid"] for e in ends}) == len(ends)
        backend = "nccl" if own_gpus and c.backend == "auto" else "gloo"
        push_port = _free_port()
        self._store.set("plan", json.dumps({"backend": backend, "port": push_port}))
        group = await asyncio.to_thread(lambda: PushGroup(
            host=host, port=push_port, rank=0, names=names, device=_group_device(backend),
            timeout_s=c.rendezvous_timeout_s))
        self.pusher = WeightPusher(ParallelLayout(dp=1, tp=1, tp_gen=1), None, group=group,
                                   dtype=self.dtype, timeout_s=c.timeout_s)
        self.ctx.log(f"weight push: {backend} to {', '.join(names[1:])}, {self.dtype}")

    async def publish(self, model: torch.nn.Module, version: int) -> None:
        """Deliver `model`'s weights as `version` to every generator, then announce it on the edge."""
        if self.pusher is None:
            state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            await self.ctx.publish(self.edge, state, version=version)
        else:
            with self.ctx.span("weight push", version=version):
                await asyncio.to_thread(self.pusher.push, model, version)
            await self.ctx.publish(self.edge, None, version=version)
        if self.config.checksums:
            checksum = await asyncio.to_thread(weights_checksum, model, self.dtype)
            self.ctx.metrics({"weights/version": version, "weights/checksum": checksum})


def _tcp_store(host: str, port: int, is_master: bool, timeout: timedelta):
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, is_master, timeout, wait_for_workers=False)


class GeneratorWeightSync:
    """Generator end: setup() (collective: join the push group, start receiving), serving()."""

    def __init__(self, ctx, config: WeightSyncConfig, edge: str = "policy"):
        self.ctx, self.config, self.edge = ctx, config, edge
        self.model = None
        self.receiver = None
        self.version = 0      # object store: the shared seed's weights are version 0

    async def setup(self, model: torch.nn.Module) -> None:
        self.model = model
        if self.config.transport != "collective":
            return
        from dataflow.hybrid_engine import PushGroup, WeightPushError, WeightReceiver

        c, me = self.config, self.ctx.full_name
        try:
            await asyncio.wait_for(self.ctx.wait_version(SYNC_EDGE, 0), c.rendezvous_timeout_s)
        except asyncio.TimeoutError:
            raise WeightPushError(f"{me}: no weight push address from the learner on '{SYNC_EDGE}' "
                                  f"within {c.rendezvous_timeout_s:g} s") from None
        _, addr = await self.ctx.latest(SYNC_EDGE)
        names = addr["names"]
        if me not in names:
            raise WeightPushError(f"{me}: not among the weight push receivers {names[1:]} of {names[0]}")
        rank, timeout = names.index(me), timedelta(seconds=c.rendezvous_timeout_s)

        def join():
            try:
                store = _tcp_store(addr["host"], addr["port"], False, timeout)
                store.set(f"end/{rank}", json.dumps(_device_info(self.ctx.device, model)))
                plan = json.loads(store.get("plan"))
            except Exception as e:
                raise WeightPushError(f"weight push rendezvous of {names[0]} at {addr['host']}:"
                                      f"{addr['port']}: {me} could not join ({e})") from None
            if plan["backend"] == "nccl" and not self.ctx.device.startswith("cuda"):
                raise WeightPushError(f"{names[0]} chose NCCL but {me} is on {self.ctx.device}")
            return PushGroup(host=addr["host"], port=plan["port"], rank=rank, names=names,
                             device=_group_device(plan["backend"]), timeout_s=c.rendezvous_timeout_s)

        group = await asyncio.to_thread(join)
        self.learner = names[0]
        # Version -1: the learner's first push (version 0) is applied too, so a generator serves
        # exactly the learner's weights from the start (also after the learner resumed).
        self.version = -1
        self.receiver = WeightReceiver(model, group=group, version=-1, name=me, timeout_s=c.timeout_s)

    @contextlib.asynccontextmanager
    async def serving(self):
        """`async with sync.serving() as version:` switch to the newest weights (at least the version
        announced on the edge), then keep them fixed until the block exits."""
        if self.receiver is None:
            if self.ctx.latest_version(self.edge) > self.version:
                version, state = await self.ctx.latest(self.edge)
                if state is None:
                    raise RuntimeError(f"{self.ctx.full_name}: '{self.edge}' v{version} carries no weights: "
                                       "the learner uses weight_transport=collective, this generator object_store")
                self.model.load_state_dict(state)
                await self._switched(version)
            yield self.version
            return
        target = max(0, self.ctx.latest_version(self.edge))
        hold = asyncio.ensure_future(asyncio.to_thread(self._hold, target))
        try:
            release, version = await asyncio.shield(hold)
        except asyncio.CancelledError:   # the thread may still take the weights: give them back
            hold.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result()[0]())
            raise
        try:
            if version != self.version:
                await self._switched(version)
            yield version
        finally:
            release()

    def _hold(self, target: int):
        """(release, version): serve lock held, weights at >= target (waits up to timeout_s)."""
        from dataflow.hybrid_engine import WeightPushError

        deadline = time.monotonic() + self.config.timeout_s
        while True:
            cm = self.receiver.serving(wait=True)
            version = cm.__enter__()          # raises the receive thread's error, if any
            if version >= target:
                return (lambda: cm.__exit__(None, None, None)), version
            cm.__exit__(None, None, None)     # the newest version is still landing: wait for it
            left = deadline - time.monotonic()
            if left <= 0 or not self.receiver.wait_staged(target, left):
                raise WeightPushError(f"{self.ctx.full_name}: weights v{target} from {self.learner} not "
                                      f"received within {self.config.timeout_s:g} s (serving v{version})")

    async def _switched(self, version: int) -> None:
        self.version = version
        if self.config.checksums:
            checksum = await asyncio.to_thread(weights_checksum, self.model)
            self.ctx.metrics({"weights/version": version, "weights/checksum": checksum})
