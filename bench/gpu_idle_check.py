"""Which GPU busy source is right? One process, known workloads, three measures (CUDA machine).

    python3 bench/gpu_idle_check.py

For each workload (a loop of small kernels, launch-bound; the same with larger kernels; bursts
with sleeps) it runs ~2 s eagerly and reports the GPU busy share from
  - ground truth: the same kernel sequence replayed as one CUDA graph (no launch gaps) gives the
    GPU time of the kernels; busy = kernels launched x graph time per kernel / wall time,
  - torch.profiler kernel intervals (CUDA activity only), union over the wall window,
  - NVML's utilization samples over the same window (dataflow.trace's sampler),
  - CUDA events around the whole loop (the span-event measure).
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataflow.trace.tracer import Tracer  # noqa: E402
from dataflow.trace.intervals import idle_fraction, merge_intervals, sampled_idle, sampled_window  # noqa: E402


def workloads():
    small = torch.randn(1 << 16, device="cuda")
    big = torch.randn(2048, 2048, device="cuda")

    def tiny():                       # ~2 us kernels: launch-bound
        small.mul_(1.0001).add_(1e-4)

    def medium():                     # ~30-60 us matmuls
        torch.mm(big, big, out=big2)

    big2 = torch.empty_like(big)

    def bursts():                     # 20 matmuls then a 5 ms host pause
        for _ in range(20):
            torch.mm(big, big, out=big2)
        torch.cuda.synchronize()
        time.sleep(0.005)
    return {"tiny kernels": (tiny, 2), "2048 matmuls": (medium, 1), "bursts + sleep": (bursts, 20)}


def graph_time_per_call(fn, calls: int = 200) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (5 * calls)


def main() -> None:
    import torch.profiler as tp

    tracer = Tracer("check", enabled=False, device="cuda")
    assert tracer._nvml is not None, "NVML unavailable"
    rows = []
    for name, (fn, kernels_per_call) in workloads().items():
        per_call = graph_time_per_call(fn) if name != "bursts + sleep" else None
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        time.sleep(0.4)
        tracer.drain()
        with tp.profile(activities=[tp.ProfilerActivity.CUDA]) as prof:
            with tracer.span("loop"):
                start_us, t0 = tracer.now_us(), time.perf_counter()
                calls = 0
                while time.perf_counter() - t0 < 2.0:
                    fn()
                    calls += 1
                torch.cuda.synchronize()
                end_us = tracer.now_us()
        time.sleep(0.6)                       # NVML posts the last sample at its period's end
        d = tracer.drain()
        wall_us = end_us - start_us
        kernels = [[e.time_range.start, e.time_range.end] for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        # Profiler times are relative to its own start; the window is the kernels' own span
        # (the loop starts launching right away and ends with a sync).
        k0 = min(a for a, _ in kernels)
        prof_busy = 1 - idle_fraction(merge_intervals(kernels), [k0, k0 + wall_us])
        samples = [u[:3] for u in d["gpu_util"]]
        window = sampled_window(samples, [start_us, end_us]) if samples else None
        nvml_busy = 1 - sampled_idle(samples, window) if samples else float("nan")
        truth = calls * per_call / (wall_us / 1e6) if per_call else float("nan")
        rows.append((name, calls * kernels_per_call, wall_us / 1e6, truth, prof_busy, nvml_busy, len(kernels)))
    # Cost of keeping CUDA-only profiling on (CUPTI kernel records): calls/s with and without.
    fn = workloads()["tiny kernels"][0]
    rates = {}
    for label in ("off", "on", "off again"):
        ctx = tp.profile(activities=[tp.ProfilerActivity.CUDA]) if label == "on" else None
        if ctx:
            ctx.__enter__()
        t0, calls = time.perf_counter(), 0
        while time.perf_counter() - t0 < 1.5:
            fn()
            calls += 1
        torch.cuda.synchronize()
        rates[label] = calls / (time.perf_counter() - t0)
        if ctx:
            ctx.__exit__(None, None, None)
    print("tiny-kernel launches/s: " + ", ".join(f"profiler {k} {v:,.0f}" for k, v in rates.items()))
    print(f"{'workload':<16} {'kernels':>8} {'wall s':>7} {'graph truth':>12} {'profiler':>9} {'NVML':>6} {'prof kernels':>12}")
    for name, n, wall, truth, prof, nvml, nk in rows:
        print(f"{name:<16} {n:>8} {wall:>7.2f} {100 * truth:>11.1f}% {100 * prof:>8.1f}% {100 * nvml:>5.1f}% {nk:>12}")


if __name__ == "__main__":
    main()
