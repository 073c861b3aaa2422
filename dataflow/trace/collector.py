"""The driver's side of the trace: TraceCollector merges what every process's Tracer drained, puts it
on the driver's clock (measure_clock_offset), and gives the end-of-run table, the metrics, the
Chrome file (size rule 3 of dataflow/trace/tracer.py: thinned to fit MAX_TRACE_EVENTS and
MAX_TRACE_BYTES) and the plot.

Start-up in front of a tracer: each node process's tracer says when its process loaded the trace
module (the host's module); the driver says when it began launching the processes (`launched`: Ray
up). A node's start-up then begins at the launch, with two more parts before its tracer's own
(dataflow/trace/tracer.py): "process start" (launch -> the host's module loaded: placement, the
worker process, Ray's start-up in it) and "imports" (-> the tracer built: the node's module and
what it imports, torch, transformers ...). A restarted replica's new process starts up again
inside the training window: that time is "other" there, not start-up.
"""

from __future__ import annotations

import gzip
import json
import os

from dataflow.trace.chrome import BUCKET_SHIFT, chrome_trace, rows_from_doc
from dataflow.trace.intervals import (coarsen_samples, idle_fraction, merge_intervals, one_sample_stream,
                                      sampled_idle, union_length)
from dataflow.trace.plot import plot as plot_png
from dataflow.trace.report import format_report, summarize

MAX_TRACE_EVENTS = 400_000   # first cap per file (~100 bytes each)
MAX_TRACE_BYTES = 45_000_000  # hard cap per file (uncompressed JSON)


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
        self._launched: int | None = None     # driver clock: when the node processes were asked for

    def launched(self, t_us: int) -> None:
        """When the driver began launching the node processes (driver clock, us): their start-up's start."""
        self._launched = round(t_us)

    def set_clock_offset(self, process_name: str, offset_us: float) -> None:
        self._offsets[process_name] = round(offset_us)

    def add(self, process_name: str, drained: dict, node: bool = True) -> None:
        """Merge one drain of `process_name`. node=False: a track of counters only (the driver's),
        written to the trace but left out of the busy/idle tables."""
        p = self._procs.get(process_name)
        if p is None:
            p = self._procs[process_name] = {
                "device": drained["device"], "gpu": drained.get("gpu"), "window": list(drained["window"]),
                "state_us": {}, "wait_us": {}, "blocked_us": {}, "spans": {}, "startup_parts": {}, "run_start": None,
                "loaded": drained.get("loaded"), "created": drained["window"][0], "dropped": 0, "node": node}
        p["window"] = [min(p["window"][0], drained["window"][0]), max(p["window"][1], drained["window"][1])]
        states = dict(drained["state_us"])
        if p["run_start"] is not None and states.get("startup"):  # a restarted process (module docstring)
            states["other"] = states.get("other", 0) + states.pop("startup")
        else:
            for part, us in drained.get("startup_parts", {}).items():
                p["startup_parts"][part] = p["startup_parts"].get(part, 0) + us
        for group, values in (("state_us", states), ("wait_us", drained["wait_us"]),
                              ("blocked_us", drained["blocked_us"])):
            for k, v in values.items():
                p[group][k] = p[group].get(k, 0) + v
        for name, (count, us) in drained.get("spans", {}).items():
            c = p["spans"].setdefault(name, [0, 0])
            c[0] += count
            c[1] += us
        if drained.get("run_start") is not None and p["run_start"] is None:
            p["run_start"] = drained["run_start"]  # (a restarted replica's process starts up again: the first one counts)
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
            # one stream per GPU at output (intervals.one_sample_stream: timestamps can differ).
            samples = self._gpu_util.setdefault(drained["gpu"], {})
            for t0, t1, pct, nvml_ts in drained["gpu_util"]:
                samples.setdefault(nvml_ts, (process_name, t0, t1, pct))

    # ---- outputs ---------------------------------------------------------------------------------
    def aggregates(self) -> dict:
        """Per-process and per-GPU aggregates on the driver clock (see dataflow/trace/report.py)."""
        return self._aggregates_and_gpu_intervals()[0]

    def _aggregates_and_gpu_intervals(self) -> tuple[dict, dict]:
        """(aggregates, {GPU label: merged busy intervals}), both on the driver clock."""
        procs, gpus, gpu_ivs = {}, {}, {}
        for name, p in self._procs.items():
            off = self._offsets.get(name, 0)
            window = [p["window"][0] - off, p["window"][1] - off]
            run_start = None if p["run_start"] is None else p["run_start"] - off
            procs[name] = dict(p, window=window, run_start=run_start)
            procs[name].update(self._before_tracer(p, off))
            del procs[name]["loaded"], procs[name]["created"]
            window = procs[name]["window"]
            if p["gpu"]:
                g = gpus.setdefault(p["gpu"], {"window": list(window), "nodes": []})
                g["window"] = [min(g["window"][0], window[0]), max(g["window"][1], window[1])]
                g["nodes"].append(name)
                gpu_ivs.setdefault(p["gpu"], []).extend(
                    [a - off, b - off] for a, b in self._gpu_intervals.get(name, []))
        merged = {label: merge_intervals(ivs) for label, ivs in gpu_ivs.items()}
        for label, g in gpus.items():
            # A GPU's training window starts when every node on it runs (their set-up is start-up).
            starts = [procs[n]["run_start"] for n in g["nodes"]]
            if starts and None not in starts:
                g["startup_us"] = max(0, min(max(starts), g["window"][1]) - g["window"][0])
                g["window"][0] += g["startup_us"]
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
                g["util_samples"] = coarsen_samples(one_sample_stream(list(streams.values())))
        dropped = sum(p["dropped"] for p in self._procs.values())
        return {"processes": procs, "gpus": gpus, "dropped": dropped}, merged

    def _before_tracer(self, p: dict, off: int) -> dict:
        """A node process's start-up before its tracer (module docstring), on the driver clock:
        its window, state and parts with "process start" and "imports" in front."""
        if p["loaded"] is None:  # not a starting tracer (the driver's track, a trace of old)
            return {}
        created, loaded = p["created"] - off, min(p["loaded"] - off, p["created"] - off)
        start = loaded if self._launched is None else min(self._launched, loaded)
        parts = {k: us for k, us in (("process start", loaded - start), ("imports", created - loaded)) if us > 0}
        state_us = dict(p["state_us"], startup=p["state_us"].get("startup", 0) + created - start)
        return {"window": [start, p["window"][1] - off], "state_us": state_us,
                "startup_parts": dict(parts, **p["startup_parts"])}

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
            nvml_idle = sampled_idle(g["util_samples"], window) if g.get("util_samples") else None
            out[label] = {"kernels_idle": idle_fraction(kernels[0], window), "nvml_idle": nvml_idle,
                          "events_idle": idle_fraction(merged[label], window),
                          "window_s": (window[1] - window[0]) / 1e6}
        return out

    def summary(self) -> dict:
        """Fractions per node/device and top idle causes (report.summarize)."""
        return summarize(self.aggregates())

    def report(self) -> str:
        """The end-of-run table (printed whether or not the run was traced)."""
        return format_report(self.summary())

    def _chrome(self, max_events: int) -> dict:
        aggs, gpu_intervals = self._aggregates_and_gpu_intervals()
        shifted = {}
        for name, evs in self._events.items():
            off = self._offsets.get(name, 0)
            shifted[name] = [_shift(ev, off) for ev in evs]
        for name, a in aggs["processes"].items():
            shifted.setdefault(name, [])
            t = a["window"][0]   # the parts before the tracer, as slices (_before_tracer)
            for part in ("process start", "imports"):
                us = a.get("startup_parts", {}).get(part)
                if us:
                    shifted[name].append(("X", part, "compute", t, us, "startup", None, None))
                    t += us
        starts = [a["window"][0] for a in aggs["processes"].values()]
        origin = min(starts) if starts else 0
        return chrome_trace(shifted, gpu_intervals if self.enabled else {}, aggs, origin, max_events,
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
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)   # --trace runs/new/trace.json
        with opener(path, "wt") as f:
            f.write(text)

    def plot(self, path: str) -> None:
        """PNG timeline + utilization chart (matplotlib, Agg)."""
        aggs, rows = rows_from_doc(self._chrome(self.max_events))
        plot_png(path, rows, summarize(aggs), t0_us=0)


def _shift(ev, off: int):
    """An event tuple moved from its process clock to the driver clock."""
    if ev[0] == "X":
        return (ev[0], ev[1], ev[2], ev[3] - off) + tuple(ev[4:])
    return (ev[0], ev[1], ev[2] - off) + tuple(ev[3:])
