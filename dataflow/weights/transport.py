"""Transport pieces of the weight push (dataflow/weights/hybrid_engine.py): the process groups of one
learner -> generators edge, waits with timeouts that name both ends, bucket boundaries, and
copies shaped for GPU speed. No model knowledge here."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dataflow.weights.adapters import ALIGN

MAGIC, CLOSE = 0x7E16, -1
OK, REJECTED = 0, 1              # receiver status codes in the ack
BIG_COPY = 4 << 20               # bytes: copies at least this large get their own memcpy


class WeightPushError(RuntimeError):
    """A push failed or stalled; the message names the learner end and the generator end.
    `peer_gone`: the other end closed the connection (its process died): the report then names
    the dead node, not this echo of it (dataflow/driver/failures.is_echo)."""

    peer_gone = False


# ---------------------------------------------------------------------------------------------
# Process groups of one push edge
# ---------------------------------------------------------------------------------------------

class PushGroup:
    """One sender (group rank 0: a learner rank) and its receivers (ranks 1..n: generator ranks).

    Standalone process groups over a TCPStore hosted by the sender, so learners and generators
    keep their own default process groups (they live in different Ray actors). `names[i]` names
    group rank i in errors. Data: gloo on CPU, NCCL when `device` is a CUDA device.
    """

    def __init__(self, *, host: str, port: int, rank: int, names: list[str],
                 device: str | torch.device = "cpu", timeout_s: float = 60.0, on_listen=None):
        """Rank 0 hosts the store on `port`; port 0 lets the OS pick a free one, and `on_listen(port)`
        (called on rank 0 once it listens) tells the others. A port picked ahead of time and bound
        later is a race: any socket on the host (gloo opens many) can take it in between."""
        self.rank, self.names, self.size = rank, list(names), len(names)
        self.device, self.timeout_s = torch.device(device), timeout_s

        def where(p):
            return f"push group {host}:{p} of {self.names[0]} -> {self.names[1:]}: {self.names[rank]}"
        try:
            store = dist.TCPStore(host, port, None, rank == 0, timeout=timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
        except Exception as e:
            raise WeightPushError(f"{where(port)} could not meet the others within {timeout_s:.0f} s "
                                  f"({e})") from e
        self.port = store.port
        if rank == 0 and on_listen is not None:
            on_listen(self.port)
        store.set(f"joined/{rank}", "1")
        keys = [f"joined/{r}" for r in range(self.size)]
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
        except Exception:
            missing = [self.names[r] for r, k in enumerate(keys) if not store.check([k])]
            raise WeightPushError(f"{where(self.port)} could not meet {', '.join(missing)} within "
                                  f"{timeout_s:.0f} s") from None
        # Long group timeout: receivers wait for the next header for as long as training takes;
        # pushes enforce timeout_s themselves through Work.wait(timeout).
        idle = timedelta(days=1)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, self.size, idle)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = idle          # (attribute of the options in torch 2.x)
            self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, self.size, opts)
        else:
            self.data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, self.size, idle)
        self.store = store          # for extra groups on the same rendezvous (the bench's clock)

    def broadcast(self, tensor: torch.Tensor, control: bool = False):
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return (self.control if control else self.data).broadcast([tensor], opts)

    def post_ack(self, status: int):
        """Post the ack: an all-gather of one status code per rank on the data group, queued
        behind the buckets (on NCCL it completes once every bucket landed everywhere, and costs
        microseconds where a gloo round trip costs a few hundred). Returns (work, codes)."""
        codes = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        mine = torch.full((1,), status, dtype=torch.int64, device=self.device)
        return self.data._allgather_base(codes, mine), codes


def wait_all(works, timeout_s: float, what: str, device: torch.device) -> None:
    """Block the host until every work in `works` completed, or raise WeightPushError.

    On CUDA, NCCL's Work.wait(timeout) sleeps 1-10 ms between checks (kSynchronizeBusyWaitMillis,
    by torch version), a large share of a ~3 ms push; so the stream is made to wait instead
    (Work.wait() without a timeout does only that) and a CUDA event recorded behind it is polled.
    """
    try:
        if device.type != "cuda":
            for w in works:
                w.wait(timedelta(seconds=timeout_s))
            return
        for w in works:
            w.wait()
        event = torch.cuda.Event()
        event.record()
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise RuntimeError("timed out")
            time.sleep(0)
    except RuntimeError as e:
        if "timed out" in str(e).lower():
            raise WeightPushError(f"{what}: stalled past {timeout_s:.0f} s ({e})") from e
        error = WeightPushError(f"{what}: failed ({str(e).strip().splitlines()[0]})")
        error.peer_gone = True     # gloo/NCCL: a connection closed or reset by the other end
        raise error from e


def bucket_bounds(total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Arena byte ranges of the buckets of one push (both ends compute them).

    The first buckets are smaller (B/8, B/4, B/2, then B): packing bucket 0 is the one copy that
    no transfer overlaps, so the pipeline's head is kept short.
    """
    bounds, lo, size = [], 0, max(ALIGN, bucket_bytes // 8 // ALIGN * ALIGN)
    while lo < total:
        bounds.append((lo, min(total, lo + size)))
        lo, size = bounds[-1][1], min(bucket_bytes, 2 * size)
    return bounds


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return p.to_local() if isinstance(p, DTensor) else p


def copy_plan(dsts: list[torch.Tensor], srcs: list[torch.Tensor]):
    """Split copies into large ones (one memcpy each, full bandwidth) and a foreach for the many
    small ones (one launch; per-tensor launches would cost more host time than they copy)."""
    big = [(d, s) for d, s in zip(dsts, srcs) if d.numel() * d.element_size() >= BIG_COPY]
    small = [(d, s) for d, s in zip(dsts, srcs) if d.numel() * d.element_size() < BIG_COPY]
    return big, [d for d, _ in small], [s for _, s in small]


def run_copy(plan) -> None:
    big, small_dsts, small_srcs = plan
    for d, s in big:
        d.copy_(s)
    if small_dsts:
        torch._foreach_copy_(small_dsts, small_srcs)
