"""GPU busy sources of a Tracer on CUDA: CUDA events around busy spans (CudaTimer) and NVML's
utilization samples (NvmlUtilization), both on the tracer's host clock. What each is worth against
exact kernel records: dataflow/trace/tracer.py.
"""

from __future__ import annotations

import ctypes
import os
import socket

from dataflow.trace.intervals import merge_intervals


class CudaTimer:
    """GPU busy intervals from CUDA events around busy spans, on the host clock.

    An anchor event recorded right after a device sync has a known host time; an event's host
    time is anchor + anchor.elapsed_time(event). Pairs are resolved only once `query()` says both
    completed (no sync). The anchor moves to the newest resolved end event whenever nothing is
    pending (every later event is recorded after it), so elapsed times stay short: they are float32
    milliseconds. Resolved events are reused: creating one costs more than recording it.
    """

    def __init__(self, device: str, now_us):
        import torch

        self._torch = torch
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        physical = visible[index] if index < len(visible) else str(index)
        self.label = f"GPU {socket.gethostname()}:{physical}"
        self.index = self._index = index
        self._free: list = []
        self._pending: list = []
        torch.cuda.synchronize(index)
        self._anchor = self.start()
        self._anchor_us = now_us()

    def start(self):
        ev = self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)
        ev.record(self._torch.cuda.current_stream(self._index))
        return ev

    def stop(self, start_event) -> None:
        self._pending.append((start_event, self.start()))

    def resolve(self) -> list:
        """Merged [t0, t1] host-clock intervals of every pair that has completed."""
        out, keep = [], []
        last = None
        for ev0, ev1 in self._pending:
            if ev1.query() and ev0.query():
                b = self._anchor_us + round(self._anchor.elapsed_time(ev1) * 1000)
                out.append([self._anchor_us + round(self._anchor.elapsed_time(ev0) * 1000), b])
                self._free.append(ev0)
                if last is not None:
                    self._free.append(last[0])
                last = (ev1, b)
            else:
                keep.append((ev0, ev1))
        self._pending = keep
        if last is not None:
            if keep:
                self._free.append(last[0])
            else:
                self._free.append(self._anchor)
                self._anchor, self._anchor_us = last
        return merge_intervals(out)


class NvmlUtilization:
    """Kernel-time utilization samples of one GPU from NVML (libnvidia-ml, through ctypes: no extra
    package), on the tracer clock.

    nvmlDeviceGetSamples(GPU_UTILIZATION) returns the driver's recent samples: (timestamp, percent
    of the period since the previous sample during which one or more kernels executed). A sample
    period is ~1/6 s on data-center GPUs, so a read every ~0.5 s (each drain) loses none (the
    buffer holds several seconds). Every process on a GPU reads the same samples; the collector
    keeps one copy per NVML timestamp. Kernels of processes outside the run count too.
    """

    GPU_UTILIZATION_SAMPLES = 1
    NOT_FOUND = 6  # no sample newer than the one asked after

    class _Sample(ctypes.Structure):
        _fields_ = [("timestamp", ctypes.c_ulonglong), ("value", ctypes.c_ulonglong)]

    @classmethod
    def open(cls, cuda_index: int, now_us) -> "NvmlUtilization | None":
        """The sampler of CUDA device `cuda_index`, or None where NVML cannot be used (the report
        then falls back to CUDA events and says so)."""
        try:
            return cls(cuda_index, now_us)
        except (OSError, RuntimeError, AttributeError):
            return None

    def __init__(self, cuda_index: int, now_us):
        import torch

        lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._call(lib.nvmlInit_v2)
        self._lib, self._handle = lib, ctypes.c_void_p()
        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)  # NVML ignores CUDA_VISIBLE_DEVICES
        self._call(lib.nvmlDeviceGetHandleByUUID, (uuid if uuid.startswith("GPU-") else "GPU-" + uuid).encode(),
                   ctypes.byref(self._handle))
        samples = self._fetch(0)
        if not samples:
            raise RuntimeError("NVML returned no utilization samples")
        self._last = samples[-1][0]
        # NVML stamps samples with the CPU's wall clock in us, as the tracer clock is; if a driver
        # ever used another clock, align its newest sample with now (error: one sample period).
        self._shift = 0 if abs(now_us() - self._last) < 5_000_000 else now_us() - self._last

    @staticmethod
    def _call(fn, *args) -> int:
        rc = fn(*args)
        if rc not in (0, NvmlUtilization.NOT_FOUND):
            raise RuntimeError(f"NVML {fn.__name__} returned error {rc}")
        return rc

    def _fetch(self, after: int) -> list:
        kind, count = ctypes.c_int(), ctypes.c_uint(0)
        get = self._lib.nvmlDeviceGetSamples
        if self._call(get, self._handle, self.GPU_UTILIZATION_SAMPLES, ctypes.c_ulonglong(after),
                      ctypes.byref(kind), ctypes.byref(count), None) or not count.value:
            return []
        buf = (self._Sample * count.value)()
        if self._call(get, self._handle, self.GPU_UTILIZATION_SAMPLES, ctypes.c_ulonglong(after),
                      ctypes.byref(kind), ctypes.byref(count), buf):
            return []
        # The value is a union; utilization is an unsigned int (kind 1), the low 32 bits here.
        rows = sorted((s.timestamp, s.value & 0xFFFFFFFF) for s in buf[:count.value])
        return [r for r in rows if r[0] > after]

    def read(self) -> list:
        """[[t0, t1, percent, nvml_ts]] for the samples since the last read (t1 = the sample's time,
        t0 = the previous one's, on the tracer clock)."""
        try:
            samples = self._fetch(self._last)
        except RuntimeError:
            return []
        out, prev = [], self._last
        for ts, pct in samples:
            out.append([prev + self._shift, ts + self._shift, min(100, int(pct)), ts])
            prev = ts
        self._last = prev
        return out
