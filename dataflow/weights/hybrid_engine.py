"""The learner -> generator weight push of the 3D-HybridEngine: reshard, map names, transport.

Learner side (every learner rank, the same calls in the same order):
    pusher = WeightPusher(layout, mesh, group=push_group_or_None, local=receiver_or_None)
    stats = pusher.push(model, version)      # collective over the learner ranks
Generator side (dataflow/weights/receiver.py):
    receiver = WeightReceiver(model, group=push_group, name="generator-0")  # background thread
    with receiver.serving() as version:      # switch to the newest complete version, hold it
        generate(...)                        # weights cannot change until the block exits
    (or receiver.apply() -> version at the engine's own safe point; receiver.poll() peeks)

One push, step by step (see dataflow/weights/reshard.py for 1):
  1. Each learner rank streams its generation shards, batch by batch (micro-DP all-gathers).
  2. Shards are laid out in an *arena*: every engine tensor (dataflow/weights/adapters.py: fused
     qkv / gate_up sources sit back to back) at a 256-byte aligned offset, in the generation
     dtype. The manifest (names, shapes, offsets) is sent on the first push and when it changes.
     Plain parameters (a one-rank learner; the generator's model) are *rehomed* once into one
     buffer in arena order, so whole-model copies are one memcpy (per-tensor copies are markedly
     slower than one flat copy, whatever the batching; bench/weight_push.py compares them).
  3. Remote (`group`, a PushGroup): a gloo header wakes the receivers, which post receives for
     every bucket straight into their staging arena (no unpacking copy). Buckets of about
     bucket_bytes (the first ones smaller, to start the pipeline early) are broadcast from two
     alternating buffers, so the host packs (and gathers) bucket i + 1 while bucket i is on the
     wire; a rehomed learner in the generation dtype sends its own buffer (zero copy).
     Colocated (`local`, a WeightReceiver in the same process and device): shards are copied
     (and cast) straight into the generator's parameters while holding its serve lock, so the
     write falls between two responses (one memcpy when both sides are rehomed).
  4. An ack (an all-gather of status codes queued behind the buckets on the data group) makes
     push() return only when every generator holds the version staged; each switches at its
     next serving()/apply(), by one copy from the staging arena: no response mixes versions.
Every wait has a timeout; a stall or a refusal raises WeightPushError naming both ends.
Headers and manifests travel on gloo over TCP, so an idle generator GPU never spins on a
pending NCCL receive between pushes; buckets and acks use the data group (NCCL on CUDA).
The NCCL path shares all code with gloo but group creation and waiting; the CPU tests cannot
run it: bench/weight_push.py does (H200 pair: within 1.2x of a raw broadcast, 1.1x of a copy).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

# The public API of the hybrid engine lives in five modules; this one re-exports it.
from dataflow.weights.layout import (ParallelLayout, apply_tensor_parallel, apply_training_layout,
                             build_mesh, micro_dp_bytes, naive_bytes)
from dataflow.weights.reshard import CommCounter, Resharder, reshard_for_generation
from dataflow.weights.transport import (CLOSE, MAGIC, OK, REJECTED, PushGroup, WeightPushError,
                                bucket_bounds, copy_plan, local_tensor, run_copy, wait_all)
from dataflow.weights.adapters import ALIGN, Manifest, WeightAdapter, family_of, rehome
from dataflow.weights.receiver import WeightReceiver

__all__ = ["ParallelLayout", "build_mesh", "apply_training_layout", "apply_tensor_parallel",
           "micro_dp_bytes", "naive_bytes", "CommCounter", "Resharder", "reshard_for_generation",
           "WeightAdapter", "Manifest", "PushGroup", "WeightPusher", "WeightReceiver",
           "WeightPushError", "PushStats", "plan_senders", "bucket_bounds"]

# ---------------------------------------------------------------------------------------------
# Learner side
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PushStats:
    version: int
    seconds: float
    bytes: int            # arena bytes delivered per receiver
    num_buckets: int
    comm: CommCounter     # this rank's resharding traffic (cumulative)


class WeightPusher:
    """Learner side of the push; see the module docstring. Construct on every learner rank.

    group: this rank sends to these generator ranks (it is their PushGroup's rank 0).
    local: a WeightReceiver in this process whose model it writes in place (colocated).
    Neither: the rank only takes part in the resharding all-gathers.
    flatten: when this rank's parameters already are its generation shards (a one-rank
    learner: Resharder.identity) and are plain tensors, lay them out once in one buffer in arena
    order (`rehome`). A push is then one copy (colocated) or one broadcast per bucket straight
    from that buffer (remote, same dtype): per-tensor work costs ~1.5x a flat copy on a GPU.
    The first push plans for `model`; a later push re-plans if the parameters were replaced.
    """

    def __init__(self, layout: ParallelLayout = ParallelLayout(), mesh=None, *,
                 group: PushGroup | None = None, local: "WeightReceiver | None" = None,
                 form: str = "hf", dtype: torch.dtype = torch.bfloat16,
                 bucket_bytes: int = 512 << 20, timeout_s: float = 60.0, flatten: bool = True,
                 name: str = ""):
        if bucket_bytes % ALIGN:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be a multiple of {ALIGN}")
        if group is not None and group.rank != 0:
            raise ValueError("WeightPusher: the learner must be rank 0 of its PushGroup")
        self.layout, self.mesh, self.group, self.local = layout, mesh, group, local
        self.form, self.dtype, self.bucket_bytes, self.timeout_s = form, dtype, bucket_bytes, timeout_s
        self.flatten, self.name = flatten, name or (group.names[0] if group else "learner")
        self.counter = CommCounter()
        self._plan_model, self._buffers, self._sent_manifest = None, [], None

    def _plan_is_current(self, model: nn.Module) -> bool:
        """Cheap evidence that the plan still fits: the same model, its first and last
        parameters' data where they were (moving or casting the model changes that). Checking
        every parameter would cost ~0.5 ms, as much as a colocated 1 GB push; after replacing
        Parameter objects, call reset()."""
        return self._plan_model is model and all(local_tensor(p).data_ptr() == ptr
                                                 for p, ptr in self._ends)

    def reset(self) -> None:
        """Re-plan at the next push (after the learner's Parameter objects were replaced)."""
        self._plan_model = None

    def _setup(self, model: nn.Module) -> None:
        self.resharder = Resharder(model, self.layout, self.mesh, self.dtype,
                                   batch_bytes=self.bucket_bytes, counter=self.counter)
        family = family_of(model) if self.form == "fused" else None    # "hf": any model's own names
        plan = WeightAdapter(family, self.form).plan(list(self.resharder.params))
        m = self.manifest = Manifest.build(plan, self.resharder.gen_shapes, self.dtype)
        self.offsets = {n: off for n, (off, _) in m.pieces().items()}
        self.order = [s for e in m.entries for s, _ in e.sources]
        self.bounds = bucket_bounds(m.total_bytes, self.bucket_bytes)
        self._flat = None
        if self.flatten and self.resharder.identity:     # same element offsets as the arena
            item = m.dtype.itemsize
            self._flat = rehome([(self.resharder.params[n], self.offsets[n] // item)
                                 for n in self.order], m.total_bytes // item)
        if self.local is not None:
            with self.local._lock_for_write(self.name, self.timeout_s):
                self.local._bind(m)
        params = list(self.resharder.params.values())
        self._ends = [(p, local_tensor(p).data_ptr()) for p in (params[0], params[-1])]
        self._plan_model = model

    def push(self, model: nn.Module, version: int) -> PushStats:
        """Reshard `model` and deliver it as `version` (collective over the learner ranks).

        Returns once every receiver acknowledged the complete version (remote) or once it is
        written (colocated); raises WeightPushError naming both ends on a stall or a refusal.
        """
        if not self._plan_is_current(model):
            self._setup(model)         # first push, or parameters moved since the last one
        t0 = time.perf_counter()
        item = self.manifest.dtype.itemsize
        if self._flat is not None:     # one piece: the whole arena, in the learner's dtype
            batches, where = iter([[("", self._flat)]]), {"": 0}
        else:
            batches, where = self.resharder.iter_batches(self.order), self.offsets
        with contextlib.ExitStack() as stack:
            if self.local is not None:
                stack.enter_context(self.local._lock_for_write(self.name, self.timeout_s))
                batches = self._write_local(batches, item)
            if self.group is not None:
                self._broadcast(batches, where, version)
            else:
                for _ in batches:
                    pass
            if self.local is not None:
                self.local._version = version
        return PushStats(version, time.perf_counter() - t0, self.manifest.total_bytes,
                         len(self.bounds) if self.group else 0, self.counter)

    def _write_local(self, batches, item: int):
        """Copy each batch into the colocated generator's parameters (the copy casts)."""
        dst_flat = self.local._flat
        for batch in batches:
            if batch[0][0] == "" and dst_flat is not None:     # flat to flat: one copy
                dst_flat.copy_(self._flat)
            elif batch[0][0] == "":
                views = self.local._views
                srcs = [self._flat[self.offsets[n] // item:][:v.numel()] for n, v in views.items()]
                run_copy(copy_plan(list(views.values()), srcs))
            else:
                views = self.local._views
                run_copy(copy_plan([views[n] for n, _ in batch], [t for _, t in batch]))
            yield batch

    def _pack(self, k: int, lo: int, hi: int, pending) -> None:
        """Fill bucket k (arena bytes [lo, hi), buffer k % 2) from `pending` [(arena offset, flat
        shard)]: a shard may span buckets; the copies cast to the generation dtype."""
        m, buf = self.manifest, self._buffers[k % 2]
        item, dsts, srcs = m.dtype.itemsize, [], []
        for offset, flat in pending:
            a, b = max(lo, offset), min(hi, offset + flat.numel() * item)
            if a < b:
                dsts.append(buf[a - lo:b - lo].view(m.dtype))
                srcs.append(flat[(a - offset) // item:(b - offset) // item])
        run_copy(copy_plan(dsts, srcs))

    def _broadcast(self, batches, where: dict[str, int], version: int) -> None:
        g, m, dev = self.group, self.manifest, self.group.device
        ends = f"weight push v{version} from {g.names[0]} to {', '.join(g.names[1:])}"
        manifest = b"" if self._sent_manifest is m else m.to_bytes()
        header = torch.tensor([MAGIC, version, len(manifest), m.total_bytes, self.bucket_bytes])
        # The header (gloo) wakes the receivers; buckets follow at once without waiting for it.
        control = [g.broadcast(header, control=True)]
        if manifest:
            control.append(g.broadcast(torch.frombuffer(bytearray(manifest), dtype=torch.uint8),
                                       control=True))
            self._sent_manifest = m
        zero_copy = self._flat is not None and self._flat.dtype == m.dtype
        if not zero_copy and not self._buffers:
            size = max(hi - lo for lo, hi in self.bounds)
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(2)]
        item = m.dtype.itemsize
        stream = (s for batch in batches for s in batch)
        pending, works = [], []
        for k, (lo, hi) in enumerate(self.bounds):
            if zero_copy:              # the learner's own buffer goes on the wire
                works.append(g.broadcast(self._flat.view(torch.uint8)[lo:hi]))
                continue
            # Pull shards until bucket k is covered: this runs the next batch's gathers while
            # bucket k - 1 is on the wire.
            while not pending or pending[-1][0] + pending[-1][1].numel() * item < hi:
                name, flat = next(stream, (None, None))
                if name is None:
                    break
                pending.append((where[name], flat))
            if k >= 2:                 # bucket k - 2 must have left buffer k % 2: on CUDA a
                if dev.type == "cuda":     # stream dependency, so the host runs ahead
                    works[k - 2].wait()
                else:
                    wait_all([works[k - 2]], self.timeout_s, f"{ends}: bucket {k - 2}", dev)
            self._pack(k, lo, hi, pending)
            works.append(g.broadcast(self._buffers[k % 2][:hi - lo]))
            pending = [(o, f) for o, f in pending if o + f.numel() * item > hi]
        for _ in stream:               # keeps every learner rank's gathers in step
            pass
        ack, codes = g.post_ack(OK)
        wait_all(control, self.timeout_s, f"{ends}: header", torch.device("cpu"))
        wait_all(works + [ack], self.timeout_s, f"{ends}: {len(works)} buckets and the "
              "acknowledgement (a generator stalled or died?)", dev)
        statuses = codes.tolist()
        refused = [g.names[i] for i, s in enumerate(statuses) if s == REJECTED]
        if refused:
            raise WeightPushError(f"{ends}: {', '.join(refused)} rejected the tensors (see the "
                                  "generator's error: wrong adapter form, dtype or shapes?)")

    def close(self) -> None:
        """Tell the receivers to stop their threads (end of training)."""
        if self.group is not None:
            header = torch.tensor([MAGIC, CLOSE, 0, 0, 0])
            wait_all([self.group.broadcast(header, control=True)], self.timeout_s,
                  f"close from {self.group.names[0]}", header.device)


def plan_senders(layout: ParallelLayout, num_replicas: int) -> dict[int, list[tuple[int, int]]]:
    """Disaggregated generators: learner rank -> the (replica, gen_tp_rank) ranks it sends to.

    Generator rank (r, j) needs generation shard j; every learner rank with gen_tp == j holds
    it after resharding, so replicas are dealt round-robin over those holders (spreading the
    sends over the learner ranks instead of funnelling them through rank 0).
    """
    holders: dict[int, list[int]] = {}
    for rank in range(layout.world_size):
        holders.setdefault(layout.coords(rank).gen_tp, []).append(rank)
    plan: dict[int, list[tuple[int, int]]] = {r: [] for r in range(layout.world_size)}
    for replica in range(num_replicas):
        for j in range(layout.tp_gen):
            plan[holders[j][replica % len(holders[j])]].append((replica, j))
    return plan
