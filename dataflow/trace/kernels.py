"""--trace-kernels: every kernel a process runs, from its CUPTI records (torch.profiler, CUDA activity
only), on the tracer clock. The exact GPU busy source of the report (dataflow/trace/tracer.py says
what the others are worth against it); the host starts one at set-up and the driver stops it at
the end of the run.
"""

from __future__ import annotations

from dataflow.trace.intervals import merge_intervals


class KernelRecorder:
    """Record every kernel this process runs. CUDA activity only: no CPU-op tracing, which is
    what makes the profiler expensive (bench/gpu_idle_check.py: launch rate within noise of
    profiling off, kernel busy time within ~1 point of a CUDA-graph ground truth)."""

    def __init__(self, now_us):
        import torch
        import torch.profiler as tp

        self._now_us = now_us
        self._profiler = tp.profile(activities=[tp.ProfilerActivity.CUDA])
        self._profiler.__enter__()
        # Profiler timestamps have their own origin. A marker kernel launched right after a sync at
        # a known tracer time starts within a few us of it: that maps kernel times onto the tracer clock.
        torch.cuda.synchronize()
        self._anchor_us = now_us()
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()

    def stop(self) -> dict:
        """{"window": [t0, t1], "intervals": [[t0, t1], ...]}: the kernels recorded, merged, on the
        tracer clock, and the span they were recorded over."""
        import torch
        from torch.autograd import DeviceType

        torch.cuda.synchronize()
        stop_us = self._now_us()
        self._profiler.__exit__(None, None, None)
        # The raw Kineto records (us from ns): building torch's FunctionEvents for a million kernels
        # would take minutes.
        kernels = sorted((e.start_ns() // 1000, e.end_ns() // 1000, e.name())
                         for e in self._profiler.profiler.kineto_results.events()
                         if e.device_type() == DeviceType.CUDA and e.end_ns() > e.start_ns())
        marker = next((k for k in kernels if "spin" in k[2].lower()), kernels[0] if kernels else None)
        if marker is None:
            return {"window": [self._anchor_us, stop_us], "intervals": []}
        shift = self._anchor_us - marker[0]
        return {"window": [self._anchor_us, stop_us], "intervals": merge_intervals(
            [[a + shift, b + shift] for a, b, _ in kernels if b + shift > self._anchor_us])}
