"""Where time goes: per-process span recording (Tracer) and driver-side collection (TraceCollector).

Every node replica process has one `Tracer`. Whether or not the run is traced it keeps, at the
cost of a few additions per span, the aggregates behind the end-of-run table:
  - time in four exclusive states. At any instant a process is busy if any busy span is open,
    else blocked on output if a `blocked_output` span is open, else waiting for input if a
    `wait_input` span is open, else "other". Open-span counters make this exact for concurrent
    asyncio tasks: the states add up to the window.
  - of the waiting (blocked) time, how much each input (output) channel accounts for: the idle
    causes. Only time in that exclusive state counts, so the channels add up to the state;
  - count and total time per busy span name;
  - on CUDA, two GPU busy sources. (a) NVML's utilization samples of the process's GPU (what
    nvidia-smi reads: samples every ~0.2 s of the percent of time one or more kernels ran), read
    at each drain (one driver call per ~0.5 s, nothing on the hot path). The per-GPU idle of the
    report comes from it whenever the samples cover the window. (b) CUDA events recorded on the current stream
    around each busy span, resolved lazily at drain() with `Event.query()` (never a sync) and
    placed on the host clock through an anchor event: exact in time but coarse in what counts
    (events bracket spans, not kernels: launch gaps inside a span count as busy). They draw the
    GPU's slices on the timeline and are the fallback when NVML is unavailable.
    With `--trace-kernels` a third, exact source replaces both in the report: every kernel's CUPTI
    record (torch.profiler, CUDA activity only; dataflow/host.py), sent to the driver at the end.
    Measured against a CUDA-graph ground truth (bench/gpu_idle_check.py, H200): kernel records
    within ~1 point; NVML 2x too busy on launch-bound tiny kernels (22.6% vs 10.6%) and a few
    points too idle on back-to-back matmuls; span events count launch gaps as busy.
With `enabled=True` (`--trace`) it also records Chrome trace events: X slices on named tracks
("compute" for work, "io" for waits), C counters and instants.

How the engine uses it:
  host      tracer = Tracer(name, enabled=trace, device=device); clock() returns tracer.now_us();
            poll() returns tracer.drain(); nodes call ctx.span(name, **args).
  channels  `with tracer.wait_input(ch): await <item>` in recv, `with tracer.blocked_output(ch):
            await <room>` in send, `tracer.counter(f"channel/{ch}/depth", depth=n)`.
  driver    collector = TraceCollector(enabled); set_clock_offset(name, measure_clock_offset(
            [(t_send, remote_now, t_recv), ...])); add(name, drained) per poll; at the end
            report() (always), write(path) (--trace), plot(png), flat_metrics(summary()) for JSONL.
`python -m dataflow.trace out.json [--plot out.png]` prints the same table from a saved file; the
Chrome JSON opens in the Perfetto UI or chrome://tracing.

Size rule (the 5-minute CPU demo's trace stays far under 50 MB; about 110 bytes per event):
  1. Wait/blocked slices shorter than MIN_IDLE_EVENT_US (a recv that found an item ready) are not
     events. They still count in every aggregate.
  2. Per process and track (per name for counters and instants) at most MAX_EVENTS_PER_BUCKET events
     are kept per 2**BUCKET_SHIFT us (~0.13 s), i.e. <= ~190 events/s per track: a uniform random
     sample of that bucket's events (reservoir sampling); the rest are counted as dropped (the
     table notes how many). This bounds the memory and the poll messages of a busy process.
  3. At write time, if the run still holds more than MAX_TRACE_EVENTS events, every k-th event of
     each track is kept, with k the smallest that fits; if the JSON still exceeds MAX_TRACE_BYTES
     (long names or args), k grows until it fits. The "utilization %" counters are never thinned.
Whatever is sampled out, the aggregates (and so the table) stay exact: they are kept apart from the
events and stored whole in the file (otherData.dataflow).

"utilization %" counter (traced runs): per process, the share of each 2**BUCKET_SHIFT us spent
busy / waiting / blocked, exact (from the state accounting, not from the sampled slices); one C
event per bucket at most, none while the value repeats. `--plot` draws long runs from it.
Slices on one track never overlap: the writer puts a slice that would overlap another without
nesting in it (two asyncio tasks' spans) on an overflow track "compute (overlap 1)", ...

Threading: a Tracer is used from its actor's event loop thread (list appends and counter updates
without locks; the GIL makes a stray call from another thread safe, not exact).
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import json
import os
import random
import socket
import sys
import time

from dataflow.trace import report as tr
from dataflow.trace.report import flat_metrics, idle_fraction, merge_intervals, union_length  # noqa: F401

MIN_IDLE_EVENT_US = 50
MAX_EVENTS_PER_BUCKET = 25   # -> ~190 events/s per track
MAX_TRACE_EVENTS = 400_000   # first cap per file (~100 bytes each)
MAX_TRACE_BYTES = 45_000_000  # hard cap per file (uncompressed JSON)
BUCKET_SHIFT = tr.BUCKET_SHIFT  # 2**17 us = 131 ms
UTIL_COUNTER = tr.UTIL_COUNTER

BUSY, WAIT_INPUT, BLOCKED_OUTPUT, OTHER = 0, 1, 2, 3
KIND_NAMES = ("busy", "wait_input", "blocked_output")
_KIND_OF = {name: i for i, name in enumerate(KIND_NAMES)}


class Tracer:
    """Recorder for one node replica process. See the module docstring for what it keeps.

    Event tuples in `drain()["events"]` (process clock, integer us):
      ("X", name, track, ts, dur, kind, channel | None, args | None)   kind in KIND_NAMES
      ("C", name, ts, {series: value})
      ("i", name, ts, args | None)
    """

    def __init__(self, process_name: str, enabled: bool, device: str = "cpu"):
        self.process_name = process_name
        self.enabled = enabled
        self.device = device
        # now_us = wall clock at start + monotonic elapsed: never steps backwards inside a run.
        self._base_ns = time.time_ns() - time.perf_counter_ns()
        self._events: list = []
        self._buckets: dict = {}      # track or counter key -> [bucket, seen, sample of events]
        self._dropped = 0
        self._open = [0, 0, 0]        # open spans per kind
        self._open_channels = [None, {}, {}]  # per idle kind: channel -> open spans
        self._util_bucket = None      # utilization counter: current bucket, since when, us per state
        self._util_from = 0
        self._util_acc = [0, 0, 0, 0]
        self._util_last = None
        self._state_t = self._window_start = self.now_us()
        self._reset_aggregates()
        self._gpu = _CudaTimer(device, self.now_us) if device.startswith("cuda") else None
        self._nvml = _NvmlUtilization.open(self._gpu.index, self.now_us) if self._gpu else None

    def now_us(self) -> int:
        """The process clock of every event: wall-clock microseconds, monotonic within the process.
        The host's clock() (offset measurement) must return this."""
        return (time.perf_counter_ns() + self._base_ns) // 1000

    # ---- recording ------------------------------------------------------------------------------
    def span(self, name: str, track: str = "compute", **args) -> "_Span":
        """Context manager around a unit of busy work (counted in busy %; an X slice if enabled)."""
        return _Span(self, name, track, BUSY, None, args or None)

    def wait_input(self, channel: str) -> "_Span":
        """Context manager around waiting for an item on input `channel` (track "io")."""
        return _Span(self, "wait " + channel, "io", WAIT_INPUT, channel, None)

    def blocked_output(self, channel: str) -> "_Span":
        """Context manager around waiting for room in the full output `channel` (track "io")."""
        return _Span(self, "blocked " + channel, "io", BLOCKED_OUTPUT, channel, None)

    def complete(self, name: str, t0_us: int, t1_us: int, track: str = "compute", kind: str = "busy",
                 channel: str | None = None, args: dict | None = None) -> None:
        """A span measured elsewhere (t0/t1 from `now_us()`). Its duration is added to its kind's
        state as if it overlapped nothing else: prefer the context managers when possible."""
        k = _KIND_OF[kind]
        if k != BUSY and channel is None:
            raise ValueError(f"complete({name!r}, kind={kind!r}) needs the channel it waited on")
        dur = t1_us - t0_us
        self._state_us[k] += dur
        if k == BUSY:
            self._count_span(name, dur)
        else:
            d = self._wait_us if k == WAIT_INPUT else self._blocked_us
            d[channel] = d.get(channel, 0) + dur
        if self.enabled:
            self._record_slice(name, track, t0_us, t1_us, k, channel, args)

    def counter(self, name: str, **values) -> None:
        """C event (queue depth, staleness, samples in flight); only recorded when enabled."""
        if self.enabled:
            t = self.now_us()
            self._keep("C:" + name, t, ("C", name, t, values))

    def instant(self, name: str, **args) -> None:
        """A point-in-time marker (only recorded when enabled)."""
        if self.enabled:
            t = self.now_us()
            self._keep("i:" + name, t, ("i", name, t, args or None))

    def drain(self) -> dict:
        """Everything since the last drain; plain lists/dicts/numbers/strings (msgpack/pickle).

        {"process", "device", "gpu": label | None, "window": [t0, t1],
         "state_us": {kind or "other": us}, "wait_us": {channel: us}, "blocked_us": {channel: us},
         "spans": {name: [count, us]}, "events": [...], "dropped": int, "gpu_intervals": [[t0, t1]],
         "gpu_util": [[t0, t1, percent, nvml_timestamp]]}
        Spans still open are accounted in the states up to now and as slices when they end.
        """
        now = self.now_us()
        self._advance(now)
        if self.enabled and self._util_bucket is not None:
            # The bucket so far (re-emitted at the same ts, complete, once it ends): the share
            # up to `now` is then exact even if this is the last drain of the run.
            self._emit_util(self._util_from, now, self._util_acc)
        self._flush_samples()
        out = {"process": self.process_name, "device": self.device,
               "gpu": self._gpu.label if self._gpu else None, "window": [self._window_start, now],
               "state_us": dict(zip(KIND_NAMES + ("other",), self._state_us)),
               "wait_us": self._wait_us, "blocked_us": self._blocked_us, "spans": self._spans,
               "events": self._events, "dropped": self._dropped,
               "gpu_intervals": self._gpu.resolve() if self._gpu else [],
               "gpu_util": self._nvml.read() if self._nvml else []}
        self._window_start = now
        self._events, self._dropped = [], 0
        self._reset_aggregates()
        return out

    # ---- internals (hot path: keep cheap) -------------------------------------------------------
    def _reset_aggregates(self) -> None:
        self._state_us = [0, 0, 0, 0]
        self._wait_us: dict = {}
        self._blocked_us: dict = {}
        self._spans: dict = {}

    def _advance(self, now: int) -> None:
        """Credit the time since the last transition to the current exclusive state and, when
        idle, to the channels waited on (split evenly if several), so that a wait overlapping busy
        work of another task is not reported as an idle cause."""
        o = self._open
        state = BUSY if o[BUSY] else BLOCKED_OUTPUT if o[BLOCKED_OUTPUT] else WAIT_INPUT if o[WAIT_INPUT] else OTHER
        elapsed = now - self._state_t
        self._state_us[state] += elapsed
        if self.enabled:
            self._util_add(state, self._state_t, now)
        self._state_t = now
        if state == WAIT_INPUT or state == BLOCKED_OUTPUT:
            channels = self._open_channels[state]
            d = self._wait_us if state == WAIT_INPUT else self._blocked_us
            share = elapsed / len(channels)
            for ch in channels:
                d[ch] = d.get(ch, 0) + share

    def _util_add(self, state: int, t0: int, t1: int) -> None:
        """Exact per-bucket utilization (the "utilization %" counter): time in `state` from t0 to t1.
        One C event per bucket at most, none while the value repeats (a long wait is one event).
        An event at ts holds the shares of [ts, end of its bucket), or of [ts, drain) if partial."""
        if self._util_bucket is None:
            self._util_bucket, self._util_from = t0 >> BUCKET_SHIFT, t0
        b0, b1 = self._util_bucket, t1 >> BUCKET_SHIFT
        if b1 == b0:
            self._util_acc[state] += t1 - t0
            return
        end0 = (b0 + 1) << BUCKET_SHIFT
        self._util_acc[state] += end0 - t0
        self._emit_util(self._util_from, end0, self._util_acc)
        if b1 > b0 + 1:  # whole buckets in one state: one event holds for all of them
            full = [0, 0, 0, 0]
            full[state] = 1
            self._emit_util(end0, end0 + 1, full)
        self._util_acc = [0, 0, 0, 0]
        self._util_acc[state] = t1 - (b1 << BUCKET_SHIFT)
        self._util_bucket, self._util_from = b1, b1 << BUCKET_SHIFT

    def _emit_util(self, t_from: int, t_to: int, acc: list) -> None:
        scale = 100 / max(1, t_to - t_from)
        values = {"busy": round(acc[BUSY] * scale, 1), "waiting": round(acc[WAIT_INPUT] * scale, 1),
                  "blocked": round(acc[BLOCKED_OUTPUT] * scale, 1)}
        if values != self._util_last:
            self._util_last = values
            self._events.append(("C", UTIL_COUNTER, t_from, values))

    def _open_channel(self, kind: int, channel: str, delta: int) -> None:
        open_ = self._open_channels[kind]
        n = open_.get(channel, 0) + delta
        if n:
            open_[channel] = n
        else:
            del open_[channel]

    def _count_span(self, name: str, dur: int) -> None:
        s = self._spans.get(name)
        if s is None:
            self._spans[name] = [1, dur]
        else:
            s[0] += 1
            s[1] += dur

    def _record_slice(self, name, track, t0, t1, kind, channel, args) -> None:
        if kind != BUSY and t1 - t0 < MIN_IDLE_EVENT_US:
            return
        self._keep(track, t1, ("X", name, track, t0, t1 - t0, KIND_NAMES[kind], channel, args))

    def _keep(self, key: str, t: int, event: tuple) -> None:
        """Rate cap: a uniform sample (reservoir, Algorithm R) of at most MAX_EVENTS_PER_BUCKET
        events per key per 2**BUCKET_SHIFT us. Uniform, so a dense track stays covered end to end
        rather than only at the start of each bucket."""
        b = t >> BUCKET_SHIFT
        slot = self._buckets.get(key)
        if slot is None or slot[0] != b:
            if slot is not None:
                self._events.extend(slot[2])
            self._buckets[key] = [b, 1, [event]]
            return
        slot[1] += 1
        sample = slot[2]
        if len(sample) < MAX_EVENTS_PER_BUCKET:
            sample.append(event)
            return
        self._dropped += 1
        j = int(random.random() * slot[1])
        if j < MAX_EVENTS_PER_BUCKET:
            sample[j] = event

    def _flush_samples(self) -> None:
        """Move every bucket's sample to the events (at drain: a bucket split by a drain may keep
        up to twice the cap)."""
        for slot in self._buckets.values():
            self._events.extend(slot[2])
        self._buckets = {}


class _Span:
    """One open span (a class rather than @contextmanager: about 3x cheaper per use)."""

    __slots__ = ("_tracer", "_name", "_track", "_kind", "_channel", "_args", "_t0", "_cuda")

    def __init__(self, tracer, name, track, kind, channel, args):
        self._tracer, self._name, self._track = tracer, name, track
        self._kind, self._channel, self._args = kind, channel, args
        self._cuda = None

    def __enter__(self):
        t = self._tracer
        self._t0 = now = t.now_us()
        t._advance(now)
        t._open[self._kind] += 1
        if self._kind == BUSY:
            if t._gpu is not None:
                self._cuda = t._gpu.start()
        else:
            t._open_channel(self._kind, self._channel, 1)
        return self

    def __exit__(self, *exc):
        t = self._tracer
        now = t.now_us()
        t._advance(now)
        t._open[self._kind] -= 1
        if self._kind == BUSY:
            t._count_span(self._name, now - self._t0)
            if self._cuda is not None:
                t._gpu.stop(self._cuda)
        else:
            t._open_channel(self._kind, self._channel, -1)
        if t.enabled:
            t._record_slice(self._name, self._track, self._t0, now, self._kind, self._channel, self._args)
        return False


class _CudaTimer:
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


class _NvmlUtilization:
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
    def open(cls, cuda_index: int, now_us) -> "_NvmlUtilization | None":
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
        if rc not in (0, _NvmlUtilization.NOT_FOUND):
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


def measure_clock_offset(samples) -> int:
    """Offset (remote clock - local clock, us) from (t_send_local, t_remote, t_recv_local) triples.

    NTP-style: the sample with the smallest round trip bounds the error best; assume the remote
    read its clock halfway through it. Driver time = remote time - offset.
    """
    t_send, t_remote, t_recv = min(samples, key=lambda s: s[2] - s[0])
    return round(t_remote - (t_send + t_recv) / 2)


class TraceCollector:
    """Driver side: accumulates drained tracer data per process, then reports and writes.

    Call `set_clock_offset(name, offset)` for each process (before or after its `add` calls:
    offsets are applied at output time).
    """

    def __init__(self, enabled: bool, max_events: int = MAX_TRACE_EVENTS, max_bytes: int = MAX_TRACE_BYTES):
        self.enabled = enabled
        self.max_events = max_events
        self.max_bytes = max_bytes
        self._offsets: dict[str, int] = {}
        self._procs: dict[str, dict] = {}
        self._events: dict[str, list] = {}
        self._gpu_intervals: dict[str, list] = {}
        self._kernel_intervals: dict[str, list] = {}
        self._gpu_util: dict[str, dict] = {}  # GPU label -> {nvml ts: (process, t0, t1, percent)}

    def set_clock_offset(self, process_name: str, offset_us: float) -> None:
        self._offsets[process_name] = round(offset_us)

    def add(self, process_name: str, drained: dict, node: bool = True) -> None:
        """Merge one drain of `process_name`. node=False: a track of counters only (the driver's),
        written to the trace but left out of the busy/idle tables."""
        p = self._procs.get(process_name)
        if p is None:
            p = self._procs[process_name] = {
                "device": drained["device"], "gpu": drained.get("gpu"), "window": list(drained["window"]),
                "state_us": {}, "wait_us": {}, "blocked_us": {}, "spans": {}, "dropped": 0, "node": node}
        p["window"] = [min(p["window"][0], drained["window"][0]), max(p["window"][1], drained["window"][1])]
        for group in ("state_us", "wait_us", "blocked_us"):
            for k, v in drained[group].items():
                p[group][k] = p[group].get(k, 0) + v
        for name, (count, us) in drained["spans"].items():
            c = p["spans"].setdefault(name, [0, 0])
            c[0] += count
            c[1] += us
        p["dropped"] += drained.get("dropped", 0)
        if self.enabled and drained["events"]:
            self._events.setdefault(process_name, []).extend(drained["events"])
        if drained.get("gpu_intervals"):
            ivs = self._gpu_intervals.setdefault(process_name, [])
            ivs.extend(drained["gpu_intervals"])
            if len(ivs) > 4096:  # keep memory flat on long runs
                ivs[:] = merge_intervals(ivs)
        if drained.get("gpu_util"):
            # Every process on a GPU reads the same NVML samples: one copy per timestamp here, and
            # one stream per GPU at output (trace_report.one_sample_stream: timestamps can differ).
            samples = self._gpu_util.setdefault(drained["gpu"], {})
            for t0, t1, pct, nvml_ts in drained["gpu_util"]:
                samples.setdefault(nvml_ts, (process_name, t0, t1, pct))

    # ---- outputs ---------------------------------------------------------------------------------
    def aggregates(self) -> dict:
        """Per-process and per-GPU aggregates on the driver clock (see trace_report)."""
        return self._aggregates_and_gpu_intervals()[0]

    def _aggregates_and_gpu_intervals(self) -> tuple[dict, dict]:
        """(aggregates, {GPU label: merged busy intervals}), both on the driver clock."""
        procs, gpus, gpu_ivs = {}, {}, {}
        for name, p in self._procs.items():
            off = self._offsets.get(name, 0)
            window = [p["window"][0] - off, p["window"][1] - off]
            procs[name] = dict(p, window=window)
            if p["gpu"]:
                g = gpus.setdefault(p["gpu"], {"window": list(window), "nodes": []})
                g["window"] = [min(g["window"][0], window[0]), max(g["window"][1], window[1])]
                g["nodes"].append(name)
                gpu_ivs.setdefault(p["gpu"], []).extend(
                    [a - off, b - off] for a, b in self._gpu_intervals.get(name, []))
        merged = {label: merge_intervals(ivs) for label, ivs in gpu_ivs.items()}
        for label, g in gpus.items():
            g["busy_us"] = union_length(merged[label], g["window"])
            kernels = self._kernel_busy(g)
            if kernels is not None:
                g["kernels"] = {"window": kernels[1], "busy_us": union_length(*kernels)}
            samples = self._gpu_util.get(label)
            if samples:
                streams: dict[str, list] = {}
                for name, t0, t1, pct in samples.values():
                    off = self._offsets.get(name, 0)
                    streams.setdefault(name, []).append([t0 - off, t1 - off, pct])
                g["util_samples"] = tr.coarsen_samples(tr.one_sample_stream(list(streams.values())))
        dropped = sum(p["dropped"] for p in self._procs.values())
        return {"processes": procs, "gpus": gpus, "dropped": dropped}, merged

    def add_kernel_intervals(self, process_name: str, intervals: list, window: list) -> None:
        """Kernel [t0, t1] intervals of `process_name` (CUPTI records through torch.profiler under
        --trace-kernels) and the [t0, t1] it recorded over, on that process's tracer clock. A GPU
        whose every process sent them gets its idle from them (the most exact source)."""
        self._kernel_intervals[process_name] = (intervals, window)

    def _kernel_busy(self, gpu: dict) -> tuple[list, list] | None:
        """(merged kernel intervals, window) of one GPU on the driver clock: the window is where
        every process on it was recording (and inside the GPU's own window); None without records."""
        ivs, starts, ends = [], [gpu["window"][0]], [gpu["window"][1]]
        for name in gpu["nodes"]:
            if name not in self._kernel_intervals:
                return None
            off = self._offsets.get(name, 0)
            intervals, window = self._kernel_intervals[name]
            ivs += [[a - off, b - off] for a, b in intervals]
            starts.append(window[0] - off)
            ends.append(window[1] - off)
        return merge_intervals(ivs), [max(starts), min(ends)]

    def kernel_idle(self) -> dict:
        """{GPU label: {"kernels_idle", "nvml_idle", "events_idle", "window_s"}}: idle of each GPU
        with kernel records from the kernels, from NVML's samples (None without them) and from the
        CUDA events around spans, all over the window the kernel records cover."""
        aggs, merged = self._aggregates_and_gpu_intervals()
        out = {}
        for label, g in aggs["gpus"].items():
            kernels = self._kernel_busy(g)
            if kernels is None:
                continue
            window = kernels[1]
            nvml_idle = tr.sampled_idle(g["util_samples"], window) if g.get("util_samples") else None
            out[label] = {"kernels_idle": idle_fraction(kernels[0], window), "nvml_idle": nvml_idle,
                          "events_idle": idle_fraction(merged[label], window),
                          "window_s": (window[1] - window[0]) / 1e6}
        return out

    def summary(self) -> dict:
        """Fractions per node/device and top idle causes (trace_report.summarize)."""
        return tr.summarize(self.aggregates())

    def report(self) -> str:
        """The end-of-run table (printed whether or not the run was traced)."""
        return tr.format_report(self.summary())

    def _chrome(self, max_events: int) -> dict:
        aggs, gpu_intervals = self._aggregates_and_gpu_intervals()
        shifted = {}
        for name, evs in self._events.items():
            off = self._offsets.get(name, 0)
            shifted[name] = [_shift(ev, off) for ev in evs]
        for name in aggs["processes"]:
            shifted.setdefault(name, [])
        starts = [a["window"][0] for a in aggs["processes"].values()]
        origin = min(starts) if starts else 0
        return tr.chrome_trace(shifted, gpu_intervals if self.enabled else {}, aggs, origin, max_events,
                               bucket_us=1 << BUCKET_SHIFT)

    def write(self, path: str) -> None:
        """Chrome Trace Event JSON (gzip if `path` ends with .gz), with the aggregates in otherData.
        At most `max_bytes` of JSON: thinned further (size rule 3) until it fits."""
        max_events = self.max_events
        while True:
            text = json.dumps(self._chrome(max_events), separators=(",", ":"))
            if len(text) <= self.max_bytes or max_events <= 100:
                break
            max_events = int(max_events * 0.95 * self.max_bytes / len(text))
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "wt") as f:
            f.write(text)

    def plot(self, path: str) -> None:
        """PNG timeline + utilization chart (matplotlib, Agg)."""
        aggs, rows = tr.rows_from_doc(self._chrome(self.max_events))
        tr.plot(path, rows, tr.summarize(aggs), t0_us=0)


def _shift(ev, off: int):
    """An event tuple moved from its process clock to the driver clock."""
    if ev[0] == "X":
        return (ev[0], ev[1], ev[2], ev[3] - off) + tuple(ev[4:])
    return (ev[0], ev[1], ev[2] - off) + tuple(ev[3:])


def main(argv=None) -> int:
    """`python -m dataflow.trace out.json [--plot out.png]`: the idle table of a saved trace."""
    p = argparse.ArgumentParser(prog="python -m dataflow.trace", description=main.__doc__)
    p.add_argument("trace", help="trace written with --trace (.json or .json.gz)")
    p.add_argument("--plot", metavar="OUT.png", help="also draw the timeline and utilization chart")
    args = p.parse_args(argv)
    try:
        aggs, rows = tr.load_trace(args.trace)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = tr.summarize(aggs)
    print(tr.format_report(summary))
    if args.plot:
        tr.plot(args.plot, rows, summary, t0_us=0)
        print(f"plot -> {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
