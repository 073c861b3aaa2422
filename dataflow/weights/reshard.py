"""Training layout -> generation shards, by all-gathers inside micro-DP groups only (paper §5).

Each learner rank turns its DTensor parameters into its *generation shard* of every parameter:
chunk gen_tp of t_g along the TP-sharded dim (the full tensor when t_g = 1 or the parameter is
TP-replicated). Two all-gathers per parameter, both batched over many parameters per call:
  1. "fsdp": over the dp axis (the FSDP2 unshard every forward does anyway): the rank's FSDP
     piece -> its whole training TP shard. Placement on dp: Shard(k), or _StridedShard(k, t)
     when TP shards the same dim (TP was applied first; the local piece is FSDP piece i of TP
     chunk j, so the dp pieces concatenated in dp order are TP chunk j).
  2. "micro_dp": over the micro-DP group (d_g consecutive tp ranks, see dataflow/weights/layout.py):
     training TP shards -> the generation shard. Nothing to do for TP-replicated params.
Local shards are cast to the generation dtype *before* any communication: one cast, and bf16
halves the bytes moved. A CommCounter records what each stage moved; the tests check the
"micro_dp" figure against the paper's formula and the total against a naive full_tensor().
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
import math

import torch
import torch.distributed as dist
from torch import nn

from dataflow.weights.layout import ParallelLayout

# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; older torch lacks the latter.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommCounter:
    """Bytes this rank sent and received, per stage, counted where the collective is issued.

    An all-gather of n bytes per rank in a group of g moves (g - 1) * n bytes in and out of each
    rank (ring algorithm); padding of uneven shards is counted too, since it travels.
    """

    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)

    def add(self, stage: str, sent: int, received: int) -> None:
        self.sent[stage] = self.sent.get(stage, 0) + sent
        self.received[stage] = self.received.get(stage, 0) + received

    def reset(self) -> None:
        self.sent.clear()
        self.received.clear()


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter is laid out in training: global shape and the dims dp / tp shard."""

    name: str
    shape: tuple[int, ...]
    dp_dim: int | None
    tp_dim: int | None

    def tp_local_shape(self, layout: ParallelLayout) -> tuple[int, ...]:
        return _divide(self.shape, self.tp_dim, layout.tp)

    def gen_shape(self, layout: ParallelLayout) -> tuple[int, ...]:
        return _divide(self.shape, self.tp_dim, layout.tp_gen)


def _divide(shape, dim, n):
    if dim is None:
        return tuple(shape)
    if shape[dim] % n:
        raise ValueError(f"dim {dim} of shape {tuple(shape)} is not divisible by {n}; "
                         "TP-sharded dims must divide evenly (ParallelLayout.check_model)")
    return tuple(s // n if d == dim else s for d, s in enumerate(shape))


def _chunk_sizes(n: int, k: int) -> list[int]:
    """Sizes torch.chunk (and FSDP2, DTensor Shard) gives: ceil(n/k) each, the tail shorter."""
    c = math.ceil(n / k)
    return [max(0, min(c, n - i * c)) for i in range(k)]


def param_spec(name: str, p: torch.Tensor, layout: ParallelLayout) -> ParamSpec:
    """Read a parameter's DTensor placements (by mesh axis name) into a ParamSpec."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(p, DTensor):
        return ParamSpec(name, tuple(p.shape), None, None)
    dims: dict[str, int | None] = {"dp": None, "tp": None}
    strided = None
    for axis, pl in zip(p.device_mesh.mesh_dim_names, p.placements):
        if axis not in dims:
            raise ValueError(f"{name}: mesh axis {axis!r} is not one of ('dp', 'tp')")
        if isinstance(pl, _StridedShard):
            dims[axis], strided = pl.dim, pl
        elif isinstance(pl, Shard):
            dims[axis] = pl.dim
        elif isinstance(pl, Partial):
            raise ValueError(f"{name}: Partial placement on {axis}; parameters are never partial")
        else:
            assert isinstance(pl, Replicate), pl
    if strided is not None and not (dims["dp"] == dims["tp"] == strided.dim
                                    and strided.split_factor == layout.tp):
        raise NotImplementedError(f"{name}: placements {p.placements}; expected "
                                  f"_StridedShard({strided.dim}, sf={layout.tp}) on dp over "
                                  "Shard on tp (TP applied before FSDP)")
    if strided is None and dims["dp"] is not None and dims["dp"] == dims["tp"]:
        raise NotImplementedError(f"{name}: dp and tp both Shard({dims['dp']}) without "
                                  "_StridedShard (FSDP applied before TP?); apply TP first")
    return ParamSpec(name, tuple(p.shape), dims["dp"], dims["tp"])


class Resharder:
    """One learner rank's view: its groups, every parameter's spec, and the gathers.

    Construct on every learner rank at the same point (it creates the micro-DP process groups,
    a collective over the members). `iter_batches` is collective too: every learner rank must
    call it with the same names in the same order.
    """

    def __init__(self, model: nn.Module, layout: ParallelLayout, mesh=None,
                 dtype: torch.dtype | None = None, batch_bytes: int = 512 << 20,
                 counter: CommCounter | None = None):
        if layout.world_size > 1 and mesh is None:
            raise ValueError(f"Resharder: layout {layout} spans {layout.world_size} ranks; pass "
                             "its training mesh (build_mesh(layout))")
        self.layout, self.dtype, self.batch_bytes = layout, dtype, batch_bytes
        self.counter = counter if counter is not None else CommCounter()
        self.params = dict(model.named_parameters())
        self.specs = {n: param_spec(n, p, layout) for n, p in self.params.items()}
        # Layout rank from the mesh coordinates (the mesh may not start at global rank 0).
        self.rank = layout.rank(0, *mesh.get_coordinate()) if mesh is not None else 0
        self.coords = layout.coords(self.rank)
        self.fsdp_group = mesh.get_group("dp") if layout.dp > 1 else None
        self.micro_group = None
        if layout.micro_dp == layout.tp and layout.tp > 1:
            self.micro_group = mesh.get_group("tp")          # t_g = 1: the whole TP group
        elif layout.micro_dp > 1:
            mine = next(g for g in layout.micro_dp_groups() if self.rank in g)
            c = [layout.coords(r) for r in mine]
            global_ranks = [int(mesh.mesh[x.dp, x.tp]) for x in c]
            # Only the members create it (local synchronization), so other ranks need not know.
            self.micro_group = dist.new_group(global_ranks, use_local_synchronization=True)

        lay = layout
        self.gen_shapes = {n: s.gen_shape(lay) for n, s in self.specs.items()}
        """Shape of this rank's generation shard of every parameter."""
        self.fsdp_gather = {n for n, s in self.specs.items() if s.dp_dim is not None and lay.dp > 1}
        self.micro_gather = {n for n, s in self.specs.items()
                             if s.tp_dim is not None and lay.micro_dp > 1}
        self.identity = not (self.fsdp_gather or self.micro_gather)
        """Every local tensor already is its generation shard (a one-rank learner, or t_g = t
        with dp = 1): a push is then pure copying, and callers may cache the local tensors."""
        self._batches: dict[tuple[str, ...], list[list[str]]] = {}

    def local(self, name: str) -> torch.Tensor:
        """The parameter's local tensor (its DTensor shard), detached, uncast."""
        from torch.distributed.tensor import DTensor

        p = self.params[name]
        return (p.to_local() if isinstance(p, DTensor) else p).detach()

    def batches(self, names: list[str]) -> list[list[str]]:
        """`names` cut into consecutive batches of about batch_bytes (generation dtype)."""
        key = tuple(names)
        if key not in self._batches:
            out, size = [[]], 0
            for n in names:
                nbytes = math.prod(self.gen_shapes[n]) * (self.dtype or self.params[n].dtype).itemsize
                if out[-1] and size + nbytes > self.batch_bytes:
                    out.append([])
                    size = 0
                out[-1].append(n)
                size += nbytes
            self._batches[key] = out
        return self._batches[key]

    def iter_batches(self, names: list[str] | None = None
                     ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Lists of (name, generation shard flattened to 1-D), in `names` order, per batch.

        One batch is one pair of batched all-gathers, so a consumer sending batch i overlaps the
        gathers of batch i + 1, and at most one batch of gathered shards is alive at a time.
        Gathered shards are in the generation dtype (cast before the gather). A shard that needs
        no gather is a view of the parameter's local tensor, uncast: the consumer's copy casts it
        (still exactly one cast), and must happen before the learner steps again.
        """
        for batch in self.batches(list(self.params) if names is None else names):
            yield self._reshard_batch(batch)

    def iter_shards(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for batch in self.iter_batches(names):
            yield from batch

    def _reshard_batch(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        lay = self.layout
        fsdp = [n for n in names if n in self.fsdp_gather]
        micro = [n for n in names if n in self.micro_gather]
        local = {}
        for n in names:
            t = self.local(n)
            if n in self.fsdp_gather or n in self.micro_gather:
                t = t.to(self.dtype or t.dtype).contiguous()   # the one cast, before any comm:
            local[n] = t                                       # bf16 halves the bytes moved
        # 1. FSDP unshard: dp pieces -> training TP shard.
        if fsdp:
            sizes = [_chunk_sizes(self.specs[n].tp_local_shape(lay)[self.specs[n].dp_dim], lay.dp)
                     for n in fsdp]
            full = _gather_cat([local[n] for n in fsdp], [self.specs[n].dp_dim for n in fsdp],
                               sizes, self.fsdp_group, self.counter, "fsdp")
            local.update(zip(fsdp, full))
        # 2. micro-DP all-gather: training TP shards -> generation shard.
        if micro:
            sizes = [[local[n].shape[self.specs[n].tp_dim]] * lay.micro_dp for n in micro]
            full = _gather_cat([local[n] for n in micro], [self.specs[n].tp_dim for n in micro],
                               sizes, self.micro_group, self.counter, "micro_dp")
            local.update(zip(micro, full))
        for n in names:
            assert tuple(local[n].shape) == self.gen_shapes[n], (n, local[n].shape)
        return [(n, local[n].reshape(-1)) for n in names]


def _gather_cat(pieces: list[torch.Tensor], dims: list[int], sizes: list[list[int]], group,
                counter: CommCounter, stage: str) -> list[torch.Tensor]:
    """All-gather many tensors in one collective and concatenate each along its dim.

    pieces[k] is this rank's piece of tensor k; sizes[k][r] its size along dims[k] on group rank
    r. Each piece travels in a slot as large as the largest peer piece (uneven FSDP shards).
    """
    g = len(sizes[0])
    units = [math.prod(s for i, s in enumerate(p.shape) if i != d) for p, d in zip(pieces, dims)]
    slots = [max(sz) * u for sz, u in zip(sizes, units)]
    send = torch.empty(sum(slots), dtype=pieces[0].dtype, device=pieces[0].device)
    offset = 0
    for p, slot in zip(pieces, slots):
        send[offset:offset + p.numel()].copy_(p.reshape(-1))
        offset += slot
    out = torch.empty(g * send.numel(), dtype=send.dtype, device=send.device)
    _all_gather(out, send, group=group)
    nbytes = send.numel() * send.element_size()
    counter.add(stage, (g - 1) * nbytes, (g - 1) * nbytes)
    out = out.view(g, -1)
    results, offset = [], 0
    for p, d, sz, u, slot in zip(pieces, dims, sizes, units, slots):
        parts = []
        for r in range(g):
            shape = list(p.shape)
            shape[d] = sz[r]
            parts.append(out[r, offset:offset + sz[r] * u].view(shape))
        results.append(torch.cat(parts, dim=d))
        offset += slot
    return results


def reshard_for_generation(model: nn.Module, layout: ParallelLayout, mesh=None,
                           dtype: torch.dtype | None = None,
                           counter: CommCounter | None = None) -> dict[str, torch.Tensor]:
    """This rank's generation shard of every parameter in `dtype`, as a dict of new tensors
    (collective: every learner rank calls it). To stream instead, use Resharder.iter_batches."""
    resharder = Resharder(model, layout, mesh, dtype, counter=counter)
    return {n: t.view(resharder.gen_shapes[n]).to(dtype or t.dtype, copy=True)
            for n, t in resharder.iter_shards()}
