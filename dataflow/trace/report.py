"""Pure functions behind the trace: interval math, the Chrome file, the idle summary, table and plot.

No Ray and no torch: the driver's `TraceCollector` (dataflow/trace/tracer.py) and the CLI
(`python -m dataflow.trace out.json`) both call these on plain numbers. All times are integer
microseconds on the driver's clock unless a name says otherwise (`_s` = seconds).

Aggregates (what `summarize` reads, and what the trace file stores under
`otherData.dataflow`) are, per node replica process:
    {"device": str, "gpu": str | None, "window": [t0, t1],
     "state_us": {"busy", "wait_input", "blocked_output", "other"},   # exclusive states, sum = window
     "wait_us": {channel: us}, "blocked_us": {channel: us},           # split of those two states
     "spans": {name: [count, us]}, "dropped": events sampled out in the process}
and per GPU: {"busy_us": |union of busy intervals within window|, "window": [t0, t1], "nodes": [...]}.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math

KINDS = ("busy", "wait_input", "blocked_output")
UTIL_COUNTER = "utilization %"  # per-bucket share of time busy / waiting / blocked (exact)
BUCKET_SHIFT = 17               # buckets of 2**17 us (~0.13 s): utilization counters, rate cap
TRACK_ORDER = ("compute", "io")  # first tracks of every process; others follow alphabetically
COLORS = {"busy": "#2e9e44", "wait_input": "#f0a01e", "blocked_output": "#d62728", "gpu": "#1f6fd1"}
LABELS = {"busy": "busy", "wait_input": "waiting for input", "blocked_output": "blocked on output",
          "gpu": "GPU busy"}


# ---- interval math ------------------------------------------------------------------------------
def merge_intervals(intervals, gap: float = 0) -> list[list]:
    """Sorted, disjoint [t0, t1] covering the same points; intervals closer than `gap` are joined."""
    out: list[list] = []
    for t0, t1 in sorted((a, b) for a, b in intervals if b > a):
        if out and t0 <= out[-1][1] + gap:
            if t1 > out[-1][1]:
                out[-1][1] = t1
        else:
            out.append([t0, t1])
    return out


def union_length(intervals, window=None) -> float:
    """Length of the union of `intervals`, counting only the part inside `window` = (w0, w1) if given."""
    if window is not None:
        w0, w1 = window
        intervals = [(max(a, w0), min(b, w1)) for a, b in intervals]
    return sum(b - a for a, b in merge_intervals(intervals))


def idle_fraction(intervals, window) -> float:
    """1 - |union of busy intervals inside window| / |window|; 0.0 for an empty window."""
    w0, w1 = window
    if w1 <= w0:
        return 0.0
    return 1.0 - union_length(intervals, window) / (w1 - w0)


def sampled_window(samples, window) -> list:
    """The part of `window` that utilization samples [[t0, t1, percent], ...] (sorted) cover."""
    return [max(window[0], samples[0][0]), min(window[1], samples[-1][1])]


def sampled_idle(samples, window) -> float:
    """Idle fraction of `window` from utilization samples, each saying which percent of its
    period (t0, t1] the device was busy; periods cut by the window's edges count pro rata."""
    w0, w1 = window
    busy = sum(p / 100 * max(0, min(b, w1) - max(a, w0)) for a, b, p in samples)
    return max(0.0, 1.0 - busy / max(1, w1 - w0))


def one_sample_stream(streams: list[list]) -> list:
    """Utilization samples [[t0, t1, percent], ...] of one GPU, read by several processes (each its
    own NVML handle), as one stream: the widest process's samples, plus another's only where they
    cover time that none kept so far covers (by more than half). The processes' copies of one driver
    sample do not share a timestamp exactly and sit up to a clock offset apart, so matching them by
    time would double the busy time; a later process still fills the time before the first started."""
    streams = sorted((sorted(s) for s in streams if s), key=lambda s: -(s[-1][1] - s[0][0]))
    kept, covered = [], []   # covered: merged [t0, t1] of the kept samples
    for stream in streams:
        starts = [a for a, _ in covered]
        new = []
        for t0, t1, pct in stream:
            i = max(0, bisect.bisect_right(starts, t0) - 1)
            overlap = 0
            while i < len(covered) and covered[i][0] < t1:
                overlap += max(0, min(t1, covered[i][1]) - max(t0, covered[i][0]))
                i += 1
            if overlap <= 0.5 * (t1 - t0):
                new.append([t0, t1, pct])
        kept += new
        covered = merge_intervals(covered + [[a, b] for a, b, _ in new])
    return sorted(kept)


def coarsen_samples(samples, limit: int = 20_000) -> list:
    """At most `limit` samples (~1 h at 6/s): adjacent pairs merged, busy time kept exactly."""
    while len(samples) > limit:
        merged = []
        for i in range(0, len(samples) - 1, 2):
            (a, m, p), (_, b, q) = samples[i], samples[i + 1]
            merged.append([a, b, (p * (m - a) + q * (b - m)) / max(1, b - a)])
        samples = merged + samples[len(merged) * 2:]
    return samples


def assign_lanes(intervals) -> list[int]:
    """Lane per interval so that slices in one lane are disjoint or properly nested.

    Perfetto cannot draw two slices of one track that overlap without one containing the other
    (two asyncio tasks' spans interleave like that); such a slice goes to the next lane (an overflow
    track). Greedy by start time, longest first, so a parent is placed before what it contains.
    Touching slices (end == next start) share a lane.
    """
    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1]))
    stacks: list[list] = []  # per lane: ends of the open (enclosing) slices, innermost last
    lanes = [0] * len(intervals)
    for i in order:
        t0, t1 = intervals[i]
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= t0:
                stack.pop()
            if not stack or t1 <= stack[-1]:
                break
        else:
            lane, stack = len(stacks), []
            stacks.append(stack)
        stack.append(t1)
        lanes[i] = lane
    return lanes


def thin(events: list, keep_every: int) -> list:
    """Every `keep_every`-th event (per list, so per track when called per track)."""
    return events if keep_every <= 1 else events[::keep_every]


# ---- Chrome Trace Event Format ------------------------------------------------------------------
def occupancy(intervals, start: float, width: float, n: int) -> list[float]:
    """Fraction of each of `n` bins [start + i*width, start + (i+1)*width) covered by `intervals`."""
    out = [0.0] * n
    for a, b in merge_intervals(intervals):
        for k, frac in _spread(a - start, b - start, width, n):
            out[k] += frac
    return out


def chrome_trace(processes: dict, gpus: dict, aggregates: dict, origin_us: int, max_events: int,
                 bucket_us: int) -> dict:
    """Build `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`.

    `processes`: name -> list of event tuples on the driver clock (see trace.Tracer.drain);
    `gpus`: GPU label -> merged busy intervals (driver clock), drawn as slices, plus a
    UTIL_COUNTER: NVML's kernel-time samples when the aggregates hold them, else the slices'
    occupancy per `bucket_us`. `ts` are microseconds since `origin_us` (kept in otherData).
    Above `max_events` slices/counters in total, every k-th event of each track is kept (k the
    smallest that fits) so the file stays small enough to open; the utilization counters (at most
    one per bucket) are always kept whole.
    """
    tracks: dict[tuple, list] = {}  # (pid, track) -> events; other counters/instants: track None
    names = sorted(processes)
    pid_of = {name: pid for pid, name in enumerate(names, start=1)}
    for name in names:
        for ev in processes[name]:
            track = ev[2] if ev[0] == "X" else UTIL_COUNTER if ev[1] == UTIL_COUNTER else None
            tracks.setdefault((pid_of[name], track), []).append(ev)
    for pid, (label, intervals) in enumerate(sorted(gpus.items()), start=len(names) + 1):
        pid_of[label] = pid
        tracks[(pid, "gpu")] = [("X", "busy", "gpu", a, b - a, "busy", None, None) for a, b in intervals]
        samples = aggregates["gpus"][label].get("util_samples")
        if samples:  # kernel time from NVML, one value per sample period
            tracks[(pid, UTIL_COUNTER)] = [("C", UTIL_COUNTER, a, {"busy": round(p, 1)}) for a, _, p in samples]
            continue
        w0, w1 = aggregates["gpus"][label]["window"]
        first = w0 // bucket_us * bucket_us
        fracs = occupancy(intervals, first, bucket_us, max(1, -(-(w1 - first) // bucket_us)))
        tracks[(pid, UTIL_COUNTER)] = [("C", UTIL_COUNTER, first + i * bucket_us, {"busy": round(100 * f, 1)})
                                       for i, f in enumerate(fracs) if i == 0 or f != fracs[i - 1]]
    total = sum(len(v) for k, v in tracks.items() if k[1] != UTIL_COUNTER)
    keep_every = max(1, math.ceil(total / max_events)) if max_events else 1
    thinned = 0

    out: list[dict] = []
    for label, pid in pid_of.items():
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    next_tid: dict[int, int] = {}
    for pid, track in sorted(tracks, key=lambda k: (k[0], _track_rank(k[1]), str(k[1]))):
        evs = tracks[(pid, track)]
        evs.sort(key=lambda ev: ev[3] if ev[0] == "X" else ev[2])  # sampling reorders a process's list
        if track != UTIL_COUNTER:
            kept = thin(evs, keep_every)
            thinned += len(evs) - len(kept)
            evs = kept
        if track is None or track == UTIL_COUNTER:
            for ev in evs:
                if ev[0] == "C":
                    out.append({"name": ev[1], "ph": "C", "ts": ev[2] - origin_us, "pid": pid, "tid": 0,
                                "args": ev[3]})
                else:  # "i": process-scoped instant
                    out.append({"name": ev[1], "ph": "i", "s": "p", "ts": ev[2] - origin_us, "pid": pid,
                                "tid": 0, "args": ev[3] or {}})
            continue
        lanes = assign_lanes([(ev[3], ev[3] + ev[4]) for ev in evs])
        tid_of_lane = {}
        for lane in sorted(set(lanes)):
            tid = next_tid[pid] = next_tid.get(pid, 0) + 1
            tid_of_lane[lane] = tid
            tname = track if lane == 0 else f"{track} (overlap {lane})"
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": tname}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for ev, lane in zip(evs, lanes):
            _, name, _, ts, dur, kind, channel, args = ev
            a = dict(args) if args else {}
            if channel is not None:
                a["channel"] = channel
            out.append({"name": name, "cat": kind, "ph": "X", "ts": ts - origin_us, "dur": dur,
                        "pid": pid, "tid": tid_of_lane[lane], "args": a})
    kept = sum(1 for e in out if e["ph"] != "M")
    other = {"dataflow": {"version": 1, "origin_us": origin_us, "bucket_us": bucket_us,
                          "aggregates": dict(_relative(aggregates, origin_us), thinned=thinned),
                          "events_in_run": total, "events_written": kept, "keep_every": keep_every}}
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def _track_rank(track) -> int:
    """Order of a process's tracks: counters first (Perfetto shows them on top), then TRACK_ORDER."""
    if track is None or track == UTIL_COUNTER:
        return -1
    return TRACK_ORDER.index(track) if track in TRACK_ORDER else len(TRACK_ORDER)


def _relative(aggregates: dict, origin_us: int) -> dict:
    """Aggregates with windows shifted to the trace's time base (ts = t - origin)."""
    out = {"processes": {}, "gpus": {}, "dropped": aggregates.get("dropped", 0)}
    for group in ("processes", "gpus"):
        for name, agg in aggregates[group].items():
            out[group][name] = dict(agg, window=[agg["window"][0] - origin_us, agg["window"][1] - origin_us])
            if agg.get("kernels"):
                k = agg["kernels"]
                out[group][name]["kernels"] = dict(k, window=[k["window"][0] - origin_us, k["window"][1] - origin_us])
            if agg.get("util_samples"):
                out[group][name]["util_samples"] = [[a - origin_us, b - origin_us, p] for a, b, p in agg["util_samples"]]
    return out


def load_trace(path: str) -> tuple[dict, list]:
    """(aggregates, rows) of a trace file written by TraceCollector.write (for the CLI)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    if "dataflow" not in (doc.get("otherData") or {}):
        raise ValueError(f"{path}: no otherData.dataflow section; was it written by dataflow.trace?")
    return rows_from_doc(doc)


def rows_from_doc(doc: dict) -> tuple[dict, list]:
    """(aggregates, rows) of a Chrome trace document built by `chrome_trace`.

    rows: [(label, {"busy"|"wait_input"|"blocked_output"|"gpu": [[t0_us, t1_us], ...],
                    "util": [(ts_us, {"busy": %, ...}), ...]})], one per process in pid order, on
    the file's time base (the same as the aggregates').
    """
    aggregates = doc["otherData"]["dataflow"]["aggregates"]
    names = {ev["pid"]: ev["args"]["name"] for ev in doc["traceEvents"]
             if ev["ph"] == "M" and ev["name"] == "process_name"}
    rows: dict = {pid: {} for pid in names}
    for ev in doc["traceEvents"]:
        if ev["ph"] == "X":
            kind = "gpu" if names.get(ev["pid"]) in aggregates["gpus"] else ev.get("cat", "busy")
            rows.setdefault(ev["pid"], {}).setdefault(kind, []).append([ev["ts"], ev["ts"] + ev["dur"]])
        elif ev["ph"] == "C" and ev["name"] == UTIL_COUNTER:
            rows.setdefault(ev["pid"], {}).setdefault("util", []).append((ev["ts"], ev["args"]))
    counters_only = {n for n, a in aggregates["processes"].items() if not a.get("node", True)}
    return aggregates, [(names.get(pid, str(pid)), rows[pid]) for pid in sorted(rows)
                        if names.get(pid) not in counters_only]


# ---- summary and table --------------------------------------------------------------------------
def summarize(aggregates: dict, top: int = 8) -> dict:
    """Fractions per node and device plus the top idle causes (a plain dict: JSONL, tests).

    A node's four states are exclusive (busy > blocked on output > waiting for input > other, see
    trace.Tracer), so they add up to 1; the per channel fractions split the waiting (blocked) state
    among the channels waited on, so they add up to it. A device's idle fraction is
    1 - |union of busy intervals| / window: for a GPU the intervals come from CUDA events; on a CPU
    run each node's compute is its device and its busy state is the union of its busy spans. Idle
    causes of a device are the waits of the nodes on it (by total time, not intersected with the
    device's idle intervals).

    {"window_s", "nodes": {name: {"busy", "wait_input", "blocked_output", "other", "window_s",
       "device", "gpu", "wait_input_by_channel", "blocked_output_by_channel", "spans", "causes"}},
     "devices": {label: {"idle", "window_s", "nodes", "causes"}},
     "idle_causes": [{"who", "kind", "channel", "seconds", "fraction"}],   # largest first
     "dropped_events", "thinned_events"}
    """
    procs = {n: a for n, a in aggregates["processes"].items() if a.get("node", True)}
    gpus = aggregates["gpus"]
    starts = [a["window"][0] for a in list(procs.values()) + list(gpus.values())]
    ends = [a["window"][1] for a in list(procs.values()) + list(gpus.values())]
    window = [min(starts), max(ends)] if starts else [0, 0]
    nodes, causes = {}, []
    for name in sorted(procs):
        a = procs[name]
        length = max(1, a["window"][1] - a["window"][0])
        fr = {k: a["state_us"].get(k, 0) / length for k in KINDS}
        fr["other"] = max(0.0, 1.0 - sum(fr.values()))
        node_causes = sorted(
            [("wait_input", ch, us) for ch, us in a["wait_us"].items()]
            + [("blocked_output", ch, us) for ch, us in a["blocked_us"].items()], key=lambda c: -c[2])
        nodes[name] = dict(fr, window_s=length / 1e6, device=a["device"], gpu=a.get("gpu"),
                           wait_input_by_channel={ch: us / length for ch, us in a["wait_us"].items()},
                           blocked_output_by_channel={ch: us / length for ch, us in a["blocked_us"].items()},
                           spans={n: {"count": c, "total_s": us / 1e6} for n, (c, us) in a["spans"].items()},
                           causes=[{"kind": k, "channel": ch, "fraction": us / length} for k, ch, us in node_causes])
        causes += [{"who": name, "kind": k, "channel": ch, "seconds": us / 1e6, "fraction": us / length}
                   for k, ch, us in node_causes]
    devices = {}
    for label in sorted(gpus):
        g = gpus[label]
        length = max(1, g["window"][1] - g["window"][0])
        on = [n for n in g["nodes"] if n in nodes]
        span_idle = max(0.0, 1.0 - g["busy_us"] / length)
        idle, source = span_idle, "cuda events"
        samples = g.get("util_samples")
        nvml_same_window = None
        if g.get("kernels"):  # kernel records (--trace-kernels): exact
            k = g["kernels"]
            idle, source = max(0.0, 1.0 - k["busy_us"] / max(1, k["window"][1] - k["window"][0])), "kernels"
            if samples:  # what a run without --trace-kernels reports (NVML), over the kernels' window
                covered = sampled_window(samples, tuple(k["window"]))
                if covered[1] - covered[0] >= 0.5 * (k["window"][1] - k["window"][0]):
                    nvml_same_window = sampled_idle(samples, covered)
        elif samples:  # kernel time sampled by NVML, when its samples cover most of the window
            covered = sampled_window(samples, g["window"])
            if covered[1] - covered[0] >= 0.5 * length:
                idle, source = sampled_idle(samples, covered), "nvml"
        devices[label] = {"idle": idle, "span_idle": span_idle, "source": source, "window_s": length / 1e6,
                          "nodes": on, "causes": _merged_causes(nodes, on)}
        if nvml_same_window is not None:
            devices[label]["nvml_idle_kernel_window"] = nvml_same_window
    for name, n in nodes.items():
        if n["gpu"] is None:  # CPU run: the node's own compute is the device
            devices[f"cpu {name}"] = {"idle": 1.0 - n["busy"], "window_s": n["window_s"], "nodes": [name],
                                      "causes": _merged_causes(nodes, [name])}
    causes.sort(key=lambda c: -c["seconds"])
    return {"window_s": (window[1] - window[0]) / 1e6, "nodes": nodes, "devices": devices,
            "idle_causes": causes[:top], "dropped_events": aggregates.get("dropped", 0),
            "thinned_events": aggregates.get("thinned", 0)}


def _merged_causes(nodes: dict, names: list) -> list:
    out = [dict(c, who=n) for n in names for c in nodes[n]["causes"]]
    return sorted(out, key=lambda c: -c["fraction"])[:3]


def _cause_text(c: dict, with_who: bool = False) -> str:
    verb = "wait" if c["kind"] == "wait_input" else "blocked"
    who = f"{c['who']} " if with_who else ""
    return f"{who}{verb} {c['channel']} {100 * c['fraction']:.0f}%"


def flat_metrics(summary: dict) -> dict:
    """Namespaced scalars for metrics.jsonl: `util/<node>/busy`, `util/<device>/idle`, ..."""
    out = {}
    for name, n in summary["nodes"].items():
        for k in KINDS + ("other",):
            out[f"util/{name}/{k}"] = round(n[k], 4)
    for label, d in summary["devices"].items():
        out[f"util/{label}/idle"] = round(d["idle"], 4)
    return out


def format_report(summary: dict) -> str:
    """The end-of-run table: where each node's time went, device idle, and the top idle causes."""
    nodes, devices = summary["nodes"], summary["devices"]
    if not nodes:
        return "[dataflow] time report: no trace data was collected"
    w = max([len(n) for n in nodes] + [len(d) for d in devices] + [6])
    lines = [f"[dataflow] where time went (window {summary['window_s']:.1f} s; "
             f"exclusive states: busy > blocked > waiting)",
             f"  {'node':<{w}}  {'busy':>6} {'wait-in':>8} {'blocked':>8} {'other':>6}  top idle cause"]
    for name, n in nodes.items():
        cause = _cause_text(n["causes"][0]) if n["causes"] else "-"
        lines.append(f"  {name:<{w}}  {_pct(n['busy']):>6} {_pct(n['wait_input']):>8} "
                     f"{_pct(n['blocked_output']):>8} {_pct(n['other']):>6}  {cause}")
    if devices:
        lines.append(f"  {'device':<{w}}  {'idle':>6}  waiting on (its nodes)")
        for label, d in devices.items():
            causes = ", ".join(_cause_text(c, with_who=len(d["nodes"]) > 1) for c in d["causes"]) or "-"
            lines.append(f"  {label:<{w}}  {_pct(d['idle']):>6}  {causes}")
        sources = {label: d for label, d in devices.items() if "source" in d}
        for label, d in sources.items():
            how = {"kernels": "kernel records (--trace-kernels)",
                   "nvml": "NVML utilization samples (overstates launch-bound work; --trace-kernels is exact)",
                   }.get(d["source"], "CUDA events around spans (NVML unavailable: launch gaps count as busy)")
            also = (f", NVML over the same window {_pct(d['nvml_idle_kernel_window'])}"
                    if "nvml_idle_kernel_window" in d else "")
            lines.append(f"    {label}: idle from {how}; span events say {_pct(d['span_idle'])}{also}")
    if summary["idle_causes"]:
        lines.append("  top idle causes:")
        for i, c in enumerate(summary["idle_causes"], start=1):
            verb = "waiting for input on" if c["kind"] == "wait_input" else "blocked on output to"
            lines.append(f"    {i}. {c['who']} {verb} '{c['channel']}': {c['seconds']:.2f} s "
                         f"({_pct(c['fraction'])} of its time)")
    if summary.get("dropped_events"):
        lines.append(f"  (trace: {summary['dropped_events']} fine-grained events sampled out; totals are exact)")
    return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# ---- plot ---------------------------------------------------------------------------------------
def plot(path: str, rows: list, summary: dict, t0_us: int, slices_up_to_s: float = 60.0) -> None:
    """PNG: a timeline (one row per node/GPU) above a utilization chart; a title, legend, seconds.

    `rows` as from `rows_from_doc`, times shown in seconds since `t0_us`. A run up to
    `slices_up_to_s` long with every slice kept shows its slices (upper band busy, lower band
    waiting / blocked). A longer or sampled one shows, per row, the share of each 1/300 of the
    window (at least a counter bucket) spent busy / blocked / waiting: stacked, from the exact
    utilization counters, since a long run's slices are sampled and too dense to see.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    nodes, devices = summary["nodes"], summary["devices"]
    # GPUs get their own utilization bar; a CPU node's "device" is the node's own busy time.
    util = list(nodes.items()) + [(d, v) for d, v in devices.items() if not d.startswith("cpu ")]
    n_rows = max(1, len(rows))
    tl_in, ut_in = 0.8 + 0.55 * max(2, n_rows), 0.8 + 0.4 * max(2, len(util))  # axes heights, inches
    height = 1.9 + tl_in + ut_in
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(13, height), gridspec_kw={"height_ratios": [tl_in, ut_in]})
    span_s = max(summary["window_s"], 1e-6)
    if span_s <= slices_up_to_s and not summary["dropped_events"] and not summary.get("thinned_events"):
        _draw_slices(ax, rows, n_rows, t0_us, gap=span_s * 1e6 / 2000)  # gap ~ one pixel
        ax.set_title("Timeline (upper band: busy; lower band: waiting for input / blocked on output)",
                     fontsize=10)
    else:
        width = _draw_shares(ax, rows, n_rows, t0_us, span_s)
        ax.set_title(f"Timeline: share of each {width:.2g} s busy / blocked / waiting (row height = 100%)",
                     fontsize=10)
    ax.set_yticks([n_rows - 1 - i for i in range(len(rows))], [label for label, _ in rows])
    ax.set_ylim(-0.6, n_rows - 0.4)
    ax.set_xlim(0, span_s)
    ax.set_xlabel("time since start of run (s)")
    ax.grid(axis="x", alpha=0.3)
    if not any(kinds for _, kinds in rows):
        ax.text(0.5, 0.5, "no events (run without --trace): see the utilization chart", ha="center",
                transform=ax.transAxes, color="gray")

    # Utilization: each node's exclusive states stacked to 100%; a GPU is busy + idle.
    y = list(range(len(util)))[::-1]
    shares = [(v["busy"], v["wait_input"], v["blocked_output"], v["other"]) if "idle" not in v
              else (1 - v["idle"], 0, 0, v["idle"]) for _, v in util]
    left = [0.0] * len(util)
    for j, kind in enumerate(("busy", "wait_input", "blocked_output", "other")):
        colors = [COLORS["gpu"] if kind == "busy" and "idle" in v else COLORS.get(kind, "#c7c7c7")
                  for _, v in util]
        vals = [100 * sh[j] for sh in shares]
        bx.barh(y, vals, left=left, color=colors, height=0.6)
        left = [a + b for a, b in zip(left, vals)]
    for yi, sh in zip(y, shares):
        bx.text(101, yi, f"{100 * sh[0]:.0f}% busy", va="center", fontsize=8)
    bx.set_yticks(y, [n for n, _ in util])
    bx.set_xlim(0, 112)
    bx.set_xticks(range(0, 101, 20))
    bx.set_xlabel("% of the node's (or GPU's) time in the window")
    bx.set_title("Utilization", fontsize=10)

    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in ("busy", "wait_input", "blocked_output", "gpu")]
    handles.append(Patch(color="#c7c7c7", label="other / GPU idle"))
    top = 1 - 0.75 / height  # inches kept for the title and the legend
    fig.suptitle(f"dataflow trace: where time went ({span_s:.3g} s window)", fontsize=13, y=1 - 0.15 / height)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.42 / height), ncol=5, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_slices(ax, rows, n_rows, t0_us, gap) -> None:
    for i, (_, kinds) in enumerate(rows):
        y = n_rows - 1 - i
        for kind in ("busy", "gpu", "wait_input", "blocked_output"):
            merged = merge_intervals(kinds.get(kind, []), gap=gap)
            if merged:
                band = (y - 0.05, 0.42) if kind in ("busy", "gpu") else (y - 0.40, 0.32)
                ax.broken_barh([((a - t0_us) / 1e6, (b - a) / 1e6) for a, b in merged], band,
                               facecolors=COLORS[kind], linewidth=0)


def _draw_shares(ax, rows, n_rows, t0_us, span_s, max_bins: int = 300) -> float:
    """Stacked share of busy / blocked / waiting per bin (no finer than the counters' buckets);
    returns the bin width in seconds."""
    n_bins = max(1, min(max_bins, int(span_s * 1e6) >> BUCKET_SHIFT))
    width = span_s / n_bins
    for i, (_, kinds) in enumerate(rows):
        samples = kinds.get("util")
        if not samples:
            continue
        y = n_rows - 1 - i
        starts = [(ts - t0_us) / 1e6 for ts, _ in samples]
        ends = starts[1:] + [span_s]   # a counter holds its value until the next sample
        xs = [k * width for k in range(n_bins + 1)]
        low = [y - 0.4] * n_bins
        is_gpu = "gpu" in kinds
        for key, color in (("busy", COLORS["gpu" if is_gpu else "busy"]), ("blocked", COLORS["blocked_output"]),
                           ("waiting", COLORS["wait_input"])):
            per_bin = [0.0] * n_bins
            for a, b, (_, v) in zip(starts, ends, samples):
                share = v.get(key, 0) / 100
                if share:
                    for k, frac in _spread(a, b, width, n_bins):
                        per_bin[k] += share * frac
            high = [lo + 0.8 * v for lo, v in zip(low, per_bin)]
            ax.fill_between(xs, low + low[-1:], high + high[-1:], step="post", color=color, linewidth=0)
            low = high
    return width


def _spread(a: float, b: float, width: float, n: int):
    """(bin, fraction of the bin covered) for [a, b) over n bins of `width` starting at 0."""
    a, b = max(a, 0.0), min(b, width * n)
    if b <= a:
        return
    for k in range(min(int(a // width), n - 1), min(int(b // width), n - 1) + 1):
        lo, hi = max(a, k * width), min(b, (k + 1) * width)
        if hi > lo:
            yield k, (hi - lo) / width
