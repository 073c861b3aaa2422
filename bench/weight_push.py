"""Benchmark: the hybrid engine's weight push against the raw transfer of the same bytes.

    python bench/weight_push.py                    2 GPUs: spawns 2 processes (plain torch, no Ray)
    torchrun --nproc-per-node 2 bench/weight_push.py   the same, launched by torchrun
    python bench/weight_push.py --cpu-smoke        CPU + gloo, tiny model: exercises the code path

Models: Qwen2.5-0.5B and -1.5B shapes (tied embeddings), bf16, random init.
  - 2 GPUs: a learner on GPU 0 pushes to a generator on GPU 1 (WeightPusher -> PushGroup,
    NCCL buckets, gloo control) vs one NCCL broadcast of a flat buffer of the same bytes on the
    same communicator. Both are timed from a common barrier until the *receiver* holds the
    bytes (push: it is staged and acknowledged), max over the two ranks.
  - 1 GPU, colocated: learner and generator models in one process on GPU 0; the in-place push
    (one foreach copy per batch into the generator's parameters) vs one copy_ of a flat buffer
    of the same bytes.
Median of --iters after --warmup. Goals (issue): push <= 1.3x broadcast, colocated <= 1.3x copy.
After timing, the generator's weights are checked bit for bit against the learner's.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # never NVLink multicast on shared hosts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from dataflow.weights.hybrid_engine import PushGroup, WeightPusher, WeightReceiver  # noqa: E402
from dataflow.weights.adapters import Manifest, WeightAdapter  # noqa: E402

MODELS = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960),
    "tiny": dict(vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64),
}


def build(name: str, device: torch.device, seed: int) -> torch.nn.Module:
    """Random-init bf16 model of that shape, allocated directly on `device` (no fp32 detour)."""
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**MODELS[name], tie_word_embeddings=True))
    model.to(torch.bfloat16).to_empty(device=device)
    model.tie_weights()                   # to_empty gave the tied pair two tensors
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def arena_bytes(model) -> int:
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return Manifest.build(WeightAdapter("qwen2").plan(list(shapes)), shapes,
                          torch.bfloat16).total_bytes


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def same_weights(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


class Clock:
    """Aligned start (barrier) and max-over-ranks duration, on a gloo group of its own (the
    push group's control group is busy in the receiver's thread)."""

    def __init__(self, group: PushGroup):
        self.size = group.size
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("bench", group.store), group.rank,
                                        group.size, timedelta(minutes=10))

    def _gather(self, x: float) -> list[float]:
        out = [torch.zeros(1, dtype=torch.float64) for _ in range(self.size)]
        self.pg.allgather([out], [torch.tensor([x], dtype=torch.float64)]).wait()
        return [float(t) for t in out]

    def time(self, fn) -> float:
        self._gather(0.0)                            # barrier
        t0 = time.perf_counter()
        fn()
        return max(self._gather(time.perf_counter() - t0))


def run(rank: int, world: int, args, host: str, port: int) -> None:
    cpu = args.cpu_smoke
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    names = ["learner (GPU 0)", "generator (GPU 1)"] if not cpu else ["learner", "generator"]
    group = PushGroup(host=host, port=port, rank=rank, names=names, device=device, timeout_s=300)
    clock = Clock(group)
    bucket = args.bucket_bytes
    rows = []
    for name in args.models:
        model = build(name, device, seed=rank)     # different weights on the two ranks
        nbytes = arena_bytes(model)
        flat = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        if rank == 0:
            pusher = WeightPusher(group=group, dtype=torch.bfloat16, bucket_bytes=bucket,
                                  timeout_s=300)
        else:
            receiver = WeightReceiver(model, group=group, timeout_s=300)

        def push(v):
            if rank == 0:
                pusher.push(model, v)
            elif not receiver.wait_staged(v, 300):
                raise TimeoutError(f"version {v} never staged")

        def broadcast():
            group.broadcast(flat).wait()
            sync(device)

        ours, raw = [], []
        for v in range(1, args.warmup + args.iters + 1):      # interleaved: same conditions
            ours.append(clock.time(lambda: push(v)))
            raw.append(clock.time(broadcast))
        if rank == 1:
            receiver.apply()
            ok = same_weights(model, build(name, device, seed=0))
        else:
            pusher.close()
        ok = clock._gather(float(ok) if rank == 1 else 1.0)[1] == 1.0
        rows.append((name, nbytes, "2 procs" if cpu else "2 GPUs, NCCL", ours[args.warmup:],
                     raw[args.warmup:], "broadcast", ok))
        # Colocated on one device (rank 0; rank 1 waits at the next barrier).
        if rank == 0:
            gen = build(name, device, seed=1)
            local = WeightReceiver(gen)
            colocated = WeightPusher(local=local, dtype=torch.bfloat16, bucket_bytes=bucket)
            src = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            ours, raw = [], []
            for v in range(1, args.warmup + args.iters + 1):
                sync(device)
                t0 = time.perf_counter()
                colocated.push(model, v)
                sync(device)
                ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                flat.copy_(src)
                sync(device)
                raw.append(time.perf_counter() - t0)
            rows.append((name, nbytes, "1 device, colocated", ours[args.warmup:],
                         raw[args.warmup:], "copy", same_weights(gen, model)))
            del gen, local, colocated, src
        del model, flat
        clock._gather(0.0)
    if rank == 0:
        report(rows, args)


def report(rows, args) -> None:
    device = torch.cuda.get_device_name(0) if not args.cpu_smoke else "CPU (gloo)"
    print(f"\nweight push on {device}, torch {torch.__version__}: median of {args.iters} after "
          f"{args.warmup} warmup; buckets of {args.bucket_bytes / 2**20:g} MiB; goal: ratio <= 1.3")
    print(f"{'model':14} {'MB':>8} {'case':22} {'push ms':>9} {'GB/s':>7} "
          f"{'baseline':10} {'ms':>8} {'ratio':>6}  bit-exact")
    for name, nbytes, case, ours, raw, base, ok in rows:
        o, r = statistics.median(ours), statistics.median(raw)
        print(f"{name:14} {nbytes / 1e6:8.1f} {case:22} {o * 1e3:9.3f} {nbytes / o / 1e9:7.1f} "
              f"{base:10} {r * 1e3:8.3f} {o / r:6.2f}  {ok}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank, world, args, host, port):
    torch.set_num_threads(1 if args.cpu_smoke else torch.get_num_threads())
    run(rank, world, args, host, port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU + gloo, tiny model")
    parser.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if args.models is None:
        args.models = ["tiny"] if args.cpu_smoke else ["qwen2.5-0.5b", "qwen2.5-1.5b"]
    args.bucket_bytes = args.bucket_mb << 20
    if args.cpu_smoke:         # several (tiny) buckets, so double buffering is exercised
        args.iters, args.warmup, args.bucket_bytes = min(args.iters, 3), min(args.warmup, 1), 4096
    elif torch.cuda.device_count() < 2:
        sys.exit(f"needs 2 GPUs (found {torch.cuda.device_count()}); try --cpu-smoke")
    if "RANK" in os.environ:                                  # launched by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != 2:
            sys.exit("run with --nproc-per-node 2")
        run(rank, world, args, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1)
        return
    mp.start_processes(_spawned, args=(2, args, "127.0.0.1", free_port()), nprocs=2,
                       start_method="fork" if args.cpu_smoke else "spawn")


if __name__ == "__main__":
    main()
