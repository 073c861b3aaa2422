"""Learner -> generator weights, over one of three transports behind one small interface.

    weight_transport="object_store"  the learner `ray.put`s a CPU copy of its state dict, cast to
                                     `dtype` (the generators' dtype: bfloat16 on GPUs, half the bytes
                                     of fp32 masters), on the versioned edge `policy`; a generator
                                     fetches it at its next generate call and load_state_dict()s it.
                                     The tensors travel as the channel codec's numpy buffers, which
                                     Ray sends out of band: pickled torch tensors cost 1-5 s each
                                     way for SmolLM2-135M's fp32 weights, the buffers under 0.1 s.
    weight_transport="collective"    the HybridEngine push (dataflow/weights/hybrid_engine.py): the learner
                                     hosts a PushGroup (gloo; NCCL when every end has a CUDA device
                                     of its own) and broadcasts its weights with a WeightPusher to a
                                     WeightReceiver in every generator replica. `policy` still
                                     carries the version (value None: nothing rides the object store).
    weight_transport="cuda_ipc"      (dataflow/weights/ipc.py) learner and generators in different
                                     processes on ONE physical GPU (placement=colocated,
                                     num_gpus=1): the learner copies its state dict, cast to
                                     `dtype`, into one of two flat GPU buffers (alternating by
                                     version parity, each with an int64 seqlock header) that it
                                     shared once by CUDA IPC; `policy` carries only the handles and
                                     the layout. A generator opens them, copies the version into a
                                     private GPU staging buffer as soon as it is announced (checking
                                     the header before and after: a copy the learner overwrote
                                     meanwhile is dropped, a newer version is on its way), and
                                     copies staging into its parameters at its next switch. GPU
                                     memory: 2 buffers on the learner, 1 staging buffer per
                                     generator, each the model's size in `dtype`. A generator on
                                     another GPU, or a CPU node, fails (no fallback).

    Learner:    sync = LearnerWeightSync(ctx, config.weight_sync); await sync.setup(model)
                await sync.publish(model, version)      # returns once every generator holds it
    Generator:  sync = GeneratorWeightSync(ctx, config.weight_sync); await sync.setup(model)
                async with sync.serving() as version:   # switch (if newer), then weights fixed
                    generate(...)

Ordering: publish() announces `version` on `policy` only after every generator holds it (object
store: the subscribers' acks; collective: push() returns once every receiver staged it). So a prompt
the source admitted for version v meets a generator that holds v: serving() switches to the newest
version staged, and first waits (bounded) until it reaches the version announced on `policy`.

Rendezvous (collective; dataflow/weights/rendezvous.py), in the nodes' setups (which run
concurrently): the learner opens a TCPStore and publishes its address on the versioned edge
`policy_sync` (graph: learner -> generator); each generator writes its device (type, GPU UUID) and
weight dtype there; the learner picks the backend (NCCL only when every end is on a distinct CUDA
device: two ranks on one GPU cannot use NCCL, as in placement=colocated) and the dtype to push in,
then all ends build the PushGroup. Every wait is
bounded (`rendezvous_timeout_s` in setup, `timeout_s` for a push or a generator's wait for a version)
and fails naming both ends (WeightPushError), which fails the node.

Ordering (cuda_ipc): the payload is announced to the generators first; a generator's serving()
waits (bounded, timeout_s) until it has staged at least the version announced on `policy`. The
learner overwrites a version's buffer only two publishes later, after a whole training step.

LoRA (learner.lora.rank > 0; the learner passes `adapter`, rl/model/lora.LoraWeights): only the
adapter travels, in float32, over the same three transports (a state dict on the object store;
an AdapterHolder module for collective, whose shapes ride the rendezvous; cuda_ipc's flat buffers
laid out for the adapter's tensors),
and each generator merges it into its own base copy at the switch (dataflow/weights/lora.py).

`checksums`: after each publish the learner logs {"weights/version", "weights/checksum"} (ctx.metrics,
so metrics.jsonl), and each generator logs the same for every version it switches to: equal
checksums at equal versions show the transport delivered the learner's weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta
from typing import Any

import torch

from dataflow.errors import UserError
from dataflow.weights import ipc as cuda_ipc
from dataflow.weights.lora import AdapterHolder, AdapterMerger, is_adapter
from dataflow.weights.edges import SYNC_EDGE, WeightSyncConfig  # noqa: F401 (imported from here too)
from dataflow.weights.rendezvous import host_push_group, join_push_group, push_address, push_names, tcp_store
from dataflow.weights.state import (decode_state, encode_state, state_bytes, state_checksum, travel_copy,
                                    unique_state, with_aliases,
                                    weights_checksum)


class LearnerWeightSync:
    """Learner end: setup() (collective: rendezvous, push group; cuda_ipc: the shared buffers),
    publish(model, version)."""

    def __init__(self, ctx, config: WeightSyncConfig, edge: str = "policy"):
        self.ctx, self.config, self.edge = ctx, config, edge
        self.pusher = None
        self.dtype: torch.dtype | None = None     # what the generators hold (collective)
        self.ranks = None                         # a dp x tp learner's dataflow.weights.multirank.TrainRanks
        self.lead = True                          # the rank that publishes (rank 0)
        self.ipc: dict[str, Any] | None = None    # cuda_ipc: buffers, headers, their handles, layout
        self.adapter = None                       # LoRA: rl/model/lora.LoraWeights (tensors(), merged(dtype))
        self.holder: AdapterHolder | None = None  # LoRA over collective: what is pushed

    async def setup(self, model: torch.nn.Module, ranks=None, adapter=None) -> None:
        """One rank, or every rank of a dp x tp learner (`ranks`): rank 0 meets the generators and
        sends; the others only take part in the resharding all-gathers of each push. `adapter`
        (LoRA, one rank): push only the adapter (module docstring)."""
        self.ranks, self.lead = ranks, ranks is None or ranks.lead
        self.adapter = adapter
        if adapter is not None and self.config.transport == "collective":
            self.holder = AdapterHolder({k: list(v.shape) for k, v in adapter.tensors().items()})
        if self.config.transport == "cuda_ipc":
            cuda_ipc.require_cuda(self.ctx.device, self.ctx.full_name)
            if self.lead:
                await asyncio.to_thread(self._ipc_setup, model if adapter is None else adapter.tensors())
            return
        if self.config.transport != "collective":  # object_store: cast on the GPU, copy half the bytes
            travel = _travel_dtype(self.config, None)
            self.dtype = getattr(torch, travel) if travel else None
            return
        from dataflow.weights.hybrid_engine import ParallelLayout, WeightPusher

        if not self.lead:      # rank 0 tells the dtype the generators hold (the gathers cast to it)
            self.dtype = getattr(torch, await asyncio.to_thread(ranks.broadcast))
            self.pusher = WeightPusher(ranks.layout, ranks.mesh, group=None, dtype=self.dtype,
                                       timeout_s=self.config.timeout_s)
            return

        import ray

        c, names = self.config, push_names(self.ctx)
        host, timeout = ray.util.get_node_ip_address(), timedelta(seconds=c.rendezvous_timeout_s)
        self._store = await asyncio.to_thread(tcp_store, host, 0, True, timeout)   # kept: the group meets on it
        lora = {"lora": self.holder.shapes()} if self.holder is not None else {}
        group, backend, dtype = await host_push_group(self.ctx, c, self._store, host, names, lora)
        self.dtype = getattr(torch, dtype)
        if ranks is not None:
            await asyncio.to_thread(ranks.broadcast, str(self.dtype).removeprefix("torch."))
        # dp x tp: the training layout, generation tp 1 (a generator holds the whole model), so each
        # push all-gathers over dp then tp on every rank and rank 0 broadcasts (dataflow/weights/reshard.py).
        layout = ranks.layout if ranks is not None else ParallelLayout(dp=1, tp=1, tp_gen=1)
        self.pusher = WeightPusher(layout, ranks.mesh if ranks is not None else None, group=group,
                                   dtype=torch.float32 if self.holder is not None else self.dtype, timeout_s=c.timeout_s)
        self.ctx.log(f"weight push: {backend} to {', '.join(names[1:])}, {self.dtype}")

    def _ipc_setup(self, model: torch.nn.Module) -> None:
        """The two shared buffers in the travel dtype (dataflow/weights/ipc.py), kept referenced here
        for the learner's lifetime."""
        self.dtype = getattr(torch, _travel_dtype(self.config, "bfloat16"))
        self.ipc = cuda_ipc.share_buffers(model, self._sent_dtype())
        buffers, device = self.ipc["buffers"], self.ipc["device"]
        size = buffers[0].numel() * buffers[0].element_size()
        self.ctx.log(f"weight sync: CUDA IPC on GPU {self.ipc['uuid']} ({device}), 2 buffers of "
                     f"{size / 2**20:.1f} MiB in {self.dtype}, {len(self.ipc['layout'])} tensors")

    async def publish(self, model: torch.nn.Module, version: int) -> None:
        """Deliver `model`'s weights as `version` to every generator, then announce it on the edge.
        A dp x tp learner calls it on every rank (collective); rank 0 publishes. Rank 0 logs one
        record per push: "weights/pushed_version", "weights/push_s" (until every generator holds
        it), "weights/push_mib" (what travelled), "weights/push_adapter"; with `checksums` also
        "weights/version" and "weights/checksum"."""
        t0 = time.perf_counter()
        sent = await (self._publish_adapter(version) if self.adapter is not None else self._deliver(model, version))
        record = {"weights/pushed_version": version, "weights/push_s": time.perf_counter() - t0,
                  "weights/push_mib": sent / 2**20, "weights/push_adapter": self.adapter is not None}
        if self.config.checksums:
            if self.adapter is not None:   # the merged weights a generator holds
                checksum = await asyncio.to_thread(lambda: state_checksum(self.adapter.merged(self.dtype)))
            else:
                checksum = await asyncio.to_thread(weights_checksum, model, self.dtype)
            record.update({"weights/version": version, "weights/checksum": checksum})
        if self.lead:
            self.ctx.metrics(record)

    async def _deliver(self, model: torch.nn.Module, version: int) -> int:
        """publish()'s delivery of the full weights; returns the bytes that travelled (rank 0)."""
        sent = 0
        if self.config.transport == "cuda_ipc":
            if self.ranks is None:
                state = model.state_dict()
            else:              # the whole weights, gathered on rank 0 (CPU)
                state, _ = await asyncio.to_thread(self.ranks.full_state, model)
            if self.lead:
                sent = state_bytes({k: v for k, v in state.items() if k not in self.ipc["aliases"]}, self.dtype)
                with self.ctx.span("weight push", version=version):
                    payload = await asyncio.to_thread(cuda_ipc.write_version, self.ipc, state, version,
                                                      self.dtype, self.ctx.full_name)
                await self.ctx.publish(self.edge, payload, version=version)
        elif self.pusher is None:
            if self.ranks is None:
                state = model.state_dict()
            else:              # the whole weights, gathered on rank 0
                state, _ = await asyncio.to_thread(self.ranks.full_state, model)
            state, aliases = unique_state(state)   # a tied tensor travels once
            state = {k: travel_copy(v, self.dtype) for k, v in state.items()}
            if self.lead:
                sent = state_bytes(state, None)
                await self.ctx.publish(self.edge, {**encode_state(state), "aliases": aliases}, version=version)
        else:
            with self.ctx.span("weight push", version=version):
                stats = await asyncio.to_thread(self.pusher.push, model, version)
            if self.lead:
                sent = stats.bytes
                await self.ctx.publish(self.edge, None, version=version)
        return sent

    def _sent_dtype(self) -> torch.dtype | None:
        """What travels: the adapter in float32 (megabytes; its delta is merged in float32), else
        the weights in the travel dtype."""
        return torch.float32 if self.adapter is not None else self.dtype

    async def _publish_adapter(self, version: int) -> int:
        """LoRA: the adapter alone (one rank), over the configured transport; returns its bytes."""
        state = self.adapter.tensors()
        with self.ctx.span("weight push", version=version, adapter=True):
            if self.config.transport == "object_store":
                payload = encode_state({k: travel_copy(v, torch.float32) for k, v in state.items()})
            elif self.config.transport == "cuda_ipc":
                payload = await asyncio.to_thread(cuda_ipc.write_version, self.ipc, state, version,
                                                  torch.float32, self.ctx.full_name)
            else:
                self.holder.fill(state)
                await asyncio.to_thread(self.pusher.push, self.holder, version)
                payload = None
        await self.ctx.publish(self.edge, payload, version=version)
        return state_bytes(state, torch.float32)


def _travel_dtype(config: WeightSyncConfig, auto: str | None) -> str | None:
    return auto if config.dtype == "auto" else config.dtype


class GeneratorWeightSync:
    """Generator end: setup() (collective: join the push group, start receiving), serving()."""

    def __init__(self, ctx, config: WeightSyncConfig, edge: str = "policy"):
        self.ctx, self.config, self.edge = ctx, config, edge
        self.model = None
        self.receiver = None
        self.version = 0      # object store, cuda_ipc: the shared seed's weights are version 0
        self.ipc: cuda_ipc.IpcReceiver | None = None
        self.holder: AdapterHolder | None = None   # LoRA over collective: the adapter as received
        self.merger: AdapterMerger | None = None   # LoRA: the base copy and the merge

    async def setup(self, model: torch.nn.Module) -> None:
        self.model = model
        if self.config.transport == "cuda_ipc":
            cuda_ipc.require_cuda(self.ctx.device, self.ctx.full_name)
            self.ipc = cuda_ipc.IpcReceiver(self.ctx, self.config, model, self.edge, cuda_ipc.device_index())
            self.ipc.start(self)
            return
        if self.config.transport != "collective":
            return
        from dataflow.weights.hybrid_engine import WeightReceiver

        c, me = self.config, self.ctx.full_name
        addr = await push_address(self.ctx, c)
        if "lora" in addr:         # only the adapter is pushed: receive it into a holder, merge at switches
            self.holder = AdapterHolder(addr["lora"]).to(self.ctx.device)
        group = await asyncio.to_thread(join_push_group, self.ctx, c, addr, model)
        self.learner = addr["names"][0]
        # Version -1: the learner's first push (version 0) is applied too, so a generator serves
        # exactly the learner's weights from the start (also after the learner resumed).
        self.version = -1
        self.receiver = WeightReceiver(model if self.holder is None else self.holder, group=group, version=-1,
                                       name=me, timeout_s=c.timeout_s)

    @contextlib.asynccontextmanager
    async def serving(self):
        """`async with sync.serving() as version:` switch to the newest weights (at least the version
        announced on the edge), then keep them fixed until the block exits."""
        if self.ipc is not None:
            if self.ipc.error is not None:
                raise self.ipc.error
            target = self.ctx.latest_version(self.edge)
            if max(target, self.ipc.staged) > self.version:
                version = await self.ipc.apply(target, self.version)
                await self._switched(version)
            yield self.version
            return
        if self.receiver is None:
            if self.ctx.latest_version(self.edge) > self.version:
                version, state = await self.ctx.latest(self.edge)
                if isinstance(state, dict) and "cuda_ipc" in state:
                    raise RuntimeError(f"{self.ctx.full_name}: '{self.edge}' v{version} carries CUDA IPC handles: "
                                       "the learner uses weight_transport=cuda_ipc, this generator object_store")
                if state is None:
                    raise RuntimeError(f"{self.ctx.full_name}: '{self.edge}' v{version} carries no weights: "
                                       "the learner uses weight_transport=collective, this generator object_store")
                self.load(with_aliases(decode_state(state), state.get("aliases", {})))
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
        from dataflow.weights.hybrid_engine import WeightPushError

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

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Put a received version into the model: full weights, or an adapter merged into the base."""
        if not is_adapter(state):
            self.model.load_state_dict(state)
            return
        if self.merger is None:
            self.merger = AdapterMerger(self.model, self.ctx.full_name)
        try:
            self.merger.merge(state)
        except ValueError as e:
            raise UserError(str(e)) from None

    async def _switched(self, version: int) -> None:
        if self.holder is not None:     # collective LoRA: the receiver copied the adapter into the holder
            self.load(self.holder.tensors())
        self.version = version
        if self.config.checksums:
            checksum = await asyncio.to_thread(weights_checksum, self.model)
            self.ctx.metrics({"weights/version": version, "weights/checksum": checksum})
