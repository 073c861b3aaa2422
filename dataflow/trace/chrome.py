"""The trace file: Chrome Trace Event JSON (opens in the Perfetto UI or chrome://tracing), with the
exact aggregates stored whole under otherData.dataflow. chrome_trace builds it; load_trace and
rows_from_doc read it back (the CLI, the plot).
"""

from __future__ import annotations

import gzip
import json
import math

from dataflow.trace.intervals import occupancy

UTIL_COUNTER = "utilization %"  # per-bucket share of time busy / waiting / blocked (exact)
BUCKET_SHIFT = 17               # buckets of 2**17 us (~0.13 s): utilization counters, rate cap
TRACK_ORDER = ("compute", "io")  # first tracks of every process; others follow alphabetically


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
            if agg.get("run_start") is not None:
                out[group][name]["run_start"] = agg["run_start"] - origin_us
            if agg.get("kernels"):
                k = agg["kernels"]
                out[group][name]["kernels"] = dict(k, window=[k["window"][0] - origin_us, k["window"][1] - origin_us])
            if agg.get("util_samples"):
                out[group][name]["util_samples"] = [[a - origin_us, b - origin_us, p] for a, b, p in agg["util_samples"]]
    return out


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

    rows: [(label, {"busy"|"startup"|"wait_input"|"blocked_output"|"gpu": [[t0_us, t1_us], ...],
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
