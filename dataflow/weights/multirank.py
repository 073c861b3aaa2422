"""One node as dp x tp ranks inside a graph: the replicas of a node are the ranks of one torch
process group and one DeviceMesh ("dp", "tp"); rank 0 leads, the others follow its commands.

    ranks = await join(ctx, ParallelLayout(dp=2, tp=2), timeout_s)   # in setup(), every replica
    ranks.shard(model)              # TP over "tp" then FSDP2 over "dp" (dataflow/weights/layout.py)
    op = ranks.broadcast(op_or_None)   # rank 0 sends, the others receive (blocking: use a thread)

Rendezvous: replica 0 hosts a TCPStore and publishes its address on the versioned edge
RANKS_EDGE (graph: node -> itself); every replica writes its device there; replica 0 picks the
backend: NCCL when every rank is on a CUDA device of its own, gloo when all are on CPU (ranks
sharing a GPU are refused: NCCL cannot put two ranks on one device). The default process group
is this node's: a process hosts one replica, and the weight push groups are standalone ones.

Why a leader: only rank 0 reads the node's inputs (Node.inputs_on_replica_0: a channel shared
by several consumer replicas hands each item to one of them), reports steps and publishes.
Every collective (a training step, a value pass, a weight push, a state gather) is started by a
command that rank 0 broadcasts (`RankCommands`, used by the learner and the critic), one at a
time, so all ranks issue the same collectives in the same order, whatever the engine asks of
each replica in between: a checkpoint's gather runs in Node.prepare_checkpoint on rank 0 as one
more command, and state_dict() never communicates. A rank cannot rejoin a running process group,
so the runtime does not restart one alone (NodeSpec.restartable): a dead rank ends the run.

Arithmetic that differs from one rank (all in `TrainRanks`): each dp rank trains on its share of
every minibatch, the FSDP gradient reduction *sums* over dp (divide factor 1) because the loss
of each share is already weighted by its share of the minibatch's tokens, the gradient norm is
the global one over the 2-D mesh, and reported loss statistics are summed over dp.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
from datetime import timedelta

import torch
import torch.distributed as dist

from dataflow.errors import UserError
from dataflow.weights.edges import CRITIC_RANKS_EDGE, RANKS_EDGE  # noqa: F401 (imported from here too)
from dataflow.weights.layout import ParallelLayout, apply_training_layout, build_mesh
from dataflow.weights.rendezvous import device_info, tcp_store
from dataflow.timeouts import wait_within



async def join(ctx, layout: ParallelLayout, timeout_s: float = 600.0,
               collective_timeout_s: float = 3600.0, edge: str = RANKS_EDGE) -> "TrainRanks":
    """Make this replica rank `ctx.replica` of a process group of all the node's replicas (in
    every replica's setup, concurrently) and build the training mesh. `edge`: the versioned edge
    (node -> itself) that carries replica 0's rendezvous address."""
    import ray

    world, rank, me = layout.world_size, ctx.replica, ctx.full_name
    if ctx.num_replicas != world:
        raise UserError(f"node '{ctx.name}': dp x tp = {layout.dp} x {layout.tp} = {world} ranks, but "
                        f"the graph declares {ctx.num_replicas} replica(s); declare it with replicas={world}")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        host = ray.util.get_node_ip_address()
        store = await asyncio.to_thread(tcp_store, host, 0, True, timeout)
        port = store.port
        await ctx.publish(edge, {"host": host, "port": port}, version=0)
    else:
        try:
            await wait_within(ctx.wait_version(edge, 0), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"{me}: no rendezvous address from {ctx.name}[0] on edge '{edge}' "
                               f"within {timeout_s:g} s (is g.versioned('{edge}', src='{ctx.name}', "
                               f"dst=['{ctx.name}']) declared?)") from None
        _, addr = await ctx.latest(edge)
        host, port = addr["host"], addr["port"]
        store = await asyncio.to_thread(tcp_store, host, port, False, timeout)

    def meet():
        store.set(f"rank/{rank}", json.dumps(device_info(ctx.device)))
        keys = [f"rank/{r}" for r in range(world)]
        try:
            store.wait(keys, timeout)
        except Exception:
            missing = [f"{ctx.name}[{r}]" for r, k in enumerate(keys) if not store.check([k])]
            raise RuntimeError(f"{me}: rendezvous at {host}:{port}: {', '.join(missing)} did not join "
                               f"within {timeout_s:g} s") from None
        ends = [json.loads(store.get(k)) for k in keys]
        kinds = {e["device"] for e in ends}
        if kinds == {"cpu"}:
            backend, device = "gloo", "cpu"
        elif kinds == {"cuda"} and len({e["uuid"] for e in ends}) == world:
            backend, device = "nccl", "cuda"
        else:
            where = ", ".join(f"{ctx.name}[{r}]: {e['device']} {e['uuid'][:12]}" for r, e in enumerate(ends))
            raise UserError(f"node '{ctx.name}' as {world} ranks needs every rank on a GPU of its own "
                            f"(NCCL) or every rank on CPU (gloo); got {where}. Give the node whole GPUs "
                            "or a pool with at least dp x tp GPUs (placement=colocated, num_gpus >= dp*tp)")
        kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_timeout_s), **kwargs)
        return backend, device

    backend, device = await asyncio.to_thread(meet)
    mesh = build_mesh(layout, device)
    return TrainRanks(layout, mesh, rank, backend, device, store)


class TrainRanks:
    """This process's rank of a multi-rank node: its mesh coordinates and the collectives the
    node's code needs (see the module docstring)."""

    def __init__(self, layout: ParallelLayout, mesh, rank: int, backend: str, device: str, store=None):
        self.layout, self.mesh, self.rank, self.backend, self.device = layout, mesh, rank, backend, device
        self._store = store           # replica 0 hosts it: keep it alive
        self.world = layout.world_size
        self.dp_rank, self.tp_rank = (int(x) for x in mesh.get_coordinate())
        self.dp_size = layout.dp
        self.dp_group = mesh.get_group("dp")

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return f"TrainRanks(rank {self.rank} of dp={self.layout.dp} x tp={self.layout.tp}, {self.backend})"

    # ---- model -------------------------------------------------------------------------------
    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """TP then FSDP2 (apply_training_layout); gradients are summed over dp, not averaged, since
        each dp rank's loss is already weighted by its share of the minibatch (ppo_update)."""
        from torch.distributed.fsdp import FSDPModule

        apply_training_layout(model, self.mesh, self.layout)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                # Plain SUM: with factor 1 FSDP2 would pick PREMUL_SUM(1.0) for fp32/bf16, which
                # gloo lacks (and a multiply by 1 is no work worth saving on NCCL either).
                m.set_force_sum_reduction_for_comms(True)
        return model

    # ---- commands and small collectives --------------------------------------------------------
    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (pickled; blocking: call it from a thread)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _flag_device(self):
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def sum_over_dp(self, values: dict[str, float]) -> dict[str, float]:
        """Per-key sums over the dp ranks (tp ranks of one dp group hold equal values)."""
        if self.dp_size == 1:
            return dict(values)
        keys = list(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self._flag_device())
        dist.all_reduce(t, group=self.dp_group)
        return dict(zip(keys, t.tolist()))

    def gather_over_dp(self, rows: torch.Tensor) -> torch.Tensor:
        """The dp ranks' `rows` (equal shapes: dp_share pads them) concatenated in dp order, on
        every rank: with contiguous dp_share()s that is the whole batch, padding at the end."""
        if self.dp_size == 1:
            return rows
        device = self._flag_device()
        parts = [torch.empty_like(rows, device=device) for _ in range(self.dp_size)]
        dist.all_gather(parts, rows.to(device).contiguous(), group=self.dp_group)
        return torch.cat(parts).to(rows.device)

    def dp_share(self, idx: torch.Tensor, pad_index: int) -> torch.Tensor:
        """This dp rank's contiguous share of the minibatch indices `idx`, padded with `pad_index`
        (a row whose mask is 0) to ceil(len/dp), so every rank runs the same number of forward /
        backward passes (each is a collective under FSDP and TP)."""
        per = math.ceil(len(idx) / self.dp_size)
        mine = idx[self.dp_rank * per:(self.dp_rank + 1) * per]
        if len(mine) < per:
            mine = torch.cat([mine, torch.full((per - len(mine),), pad_index, dtype=idx.dtype, device=idx.device)])
        return mine

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the global gradient, whatever mesh each parameter
        lives on (TP-replicated norms are 1-D on dp, the rest 2-D): each rank adds the squares of
        its local shards, divided by how many ranks hold the same elements, then one all-reduce."""
        from torch.distributed.tensor import DTensor, Replicate

        grads = [p.grad for p in parameters if p.grad is not None]
        total = torch.zeros((), dtype=torch.float64, device=self._flag_device())
        locals_ = []
        for g in grads:
            if isinstance(g, DTensor):
                local, copies = g.to_local(), self.world // g.device_mesh.size()
                for dim, pl in enumerate(g.placements):
                    if isinstance(pl, Replicate):
                        copies *= g.device_mesh.size(dim)
            else:
                local, copies = g, self.world
            locals_.append(local)
            total += local.detach().double().pow(2).sum().to(total.device) / copies
        dist.all_reduce(total)
        norm = total.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if torch.isfinite(norm):
            for local in locals_:
                local.detach().mul_(coef.to(device=local.device, dtype=local.dtype))
        return norm.to(locals_[0].dtype if locals_ else torch.float32).cpu()   # as torch's: grads' dtype

    # ---- whole state (checkpoints, final weights, the object-store weight push) ----------------
    def _full(self, t: torch.Tensor, cache: dict) -> torch.Tensor:
        """The whole tensor on CPU (a DTensor is gathered: collective); `cache` dedupes tied ones."""
        from torch.distributed.tensor import DTensor

        if id(t) not in cache:
            full = t.full_tensor() if isinstance(t, DTensor) else t
            cache[id(t)] = full.detach().to("cpu", copy=True)
        return cache[id(t)]

    def full_state(self, model: torch.nn.Module, optimizer=None) -> tuple[dict, dict | None]:
        """(model state dict, optimizer state dict) as full CPU tensors on rank 0 ({} / None
        elsewhere); collective. The formats are a one-rank model's and optimizer's (optimizer
        state keyed by parameter index), so checkpoints move between layouts.

        (torch.distributed.checkpoint's get_model_state_dict(full_state_dict=True) left these
        FSDP2 + TP parameters as DTensors on torch 2.13, hence the explicit full_tensor().)"""
        cache: dict = {}
        msd = {k: self._full(v, cache) for k, v in model.state_dict().items()}
        osd = None
        if optimizer is not None:
            raw = optimizer.state_dict()
            osd = {"param_groups": copy.deepcopy(raw["param_groups"]),
                   "state": {i: {k: self._full(v, cache) if torch.is_tensor(v) else v for k, v in st.items()}
                             for i, st in raw["state"].items()}}
        if not self.lead:
            return {}, None
        return msd, osd

    def load_full_state(self, model: torch.nn.Module, optimizer, model_state: dict | None,
                        optim_state: dict | None) -> None:
        """Distribute rank 0's full state dicts (as full_state returns them) over the ranks;
        collective. Each rank receives the whole thing and keeps its shards (simple; a resume
        is rare: a streaming scatter would cap the memory at one tensor)."""
        from torch.distributed.tensor import DTensor

        model_state, optim_state = self.broadcast((model_state, optim_state) if self.lead else None)

        def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            """`full` laid out as `like` (a DTensor for a DTensor: optimizer state must be one)."""
            if isinstance(like, DTensor):
                return DTensor.from_local(_local_piece(full.to(like.device, like.dtype), like), like.device_mesh,
                                          like.placements, shape=like.shape, stride=like.stride(),
                                          run_check=False)
            return full.to(like.device, like.dtype)

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        targets = model.state_dict(keep_vars=True)
        missing = sorted(set(targets) - set(model_state))
        if missing:
            raise KeyError(f"load_full_state: the state has no {missing[:5]}")
        with torch.no_grad():
            for k, t in targets.items():
                local(t).copy_(local(shard_like(model_state[k], t)))
        if optimizer is not None and optim_state is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            state = {int(i): {k: shard_like(v, params[int(i)]) if torch.is_tensor(v) and
                              tuple(v.shape) == tuple(params[int(i)].shape) else v for k, v in st.items()}
                     for i, st in optim_state["state"].items()}
            optimizer.load_state_dict({"param_groups": optim_state["param_groups"], "state": state})


class RankCommands:
    """Mixin of a node whose replicas may be the ranks of one job (`self.ranks`: a TrainRanks, or
    None for one rank): rank 0 runs every operation that communicates through `_all`, which
    broadcasts it to the others, and they run `_follow` instead of the node's loop. One command at a
    time (a lock on rank 0), so the ranks issue the same collectives in the same order even when
    a checkpoint's gather (prepare_checkpoint) arrives while rank 0's loop is busy."""

    ranks: "TrainRanks | None" = None
    _stopped = False

    async def _handle(self, op: str, args: dict):
        raise NotImplementedError

    async def _all(self, op: str, **args):
        """Run `op` on every rank (one rank: just _handle)."""
        if self.ranks is None:
            return await self._handle(op, args)
        if self._stopped:
            raise RuntimeError(f"{self.ctx.full_name}: the other ranks have stopped; cannot run '{op}'")
        async with self._lock():
            await asyncio.to_thread(self.ranks.broadcast, (op, args))
            return await self._handle(op, args)

    def _lock(self) -> asyncio.Lock:
        if getattr(self, "_command_lock", None) is None:
            self._command_lock = asyncio.Lock()
        return self._command_lock

    async def _follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it says stop."""
        while True:
            op, args = await asyncio.to_thread(self.ranks.broadcast)
            if op == "stop":
                return
            async with self.ctx.state_lock:
                await self._handle(op, args)

    async def _stop_followers(self) -> None:
        """Rank 0 at a normal end: the other ranks' _follow returns (no command runs after this)."""
        if self.ranks is None or self._stopped:
            return
        async with self._lock():
            await asyncio.to_thread(self.ranks.broadcast, ("stop", {}))
            self._stopped = True


def _local_piece(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's local tensor of DTensor `like`, cut from the whole tensor `full` without any
    communication. distribute_tensor cannot make _StridedShard placements (torch 2.13), which
    TP-then-FSDP2 gives (dataflow/weights/reshard.py): the tensor is cut by TP first, then each TP chunk
    by FSDP, so plain Shard placements are applied before strided ones; uneven sizes as torch.chunk."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from dataflow.weights.reshard import _chunk_sizes

    mesh, coords = like.device_mesh, like.device_mesh.get_coordinate()
    steps = [(i, pl) for i, pl in enumerate(like.placements) if isinstance(pl, (Shard, _StridedShard))]
    steps.sort(key=lambda step: isinstance(step[1], _StridedShard))
    t = full
    for i, pl in steps:
        sizes = _chunk_sizes(t.shape[pl.dim], mesh.size(i))
        t = t.narrow(pl.dim, sum(sizes[:coords[i]]), sizes[coords[i]])
    return t.contiguous()
