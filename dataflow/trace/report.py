"""Where the time went, from the trace's aggregates: the idle summary (a plain dict), its metrics and
the end-of-run table.

No Ray and no torch: the driver's `TraceCollector` (dataflow/trace/collector.py) and the CLI
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

from dataflow.trace.intervals import sampled_idle, sampled_window

KINDS = ("busy", "wait_input", "blocked_output")


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
    if c["kind"] == "wait_input" and c["channel"] == "environment":
        return f"{who}waiting on the environment {100 * c['fraction']:.0f}%"
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
            what = ("waiting on the environment" if c["kind"] == "wait_input" and c["channel"] == "environment"
                    else f"{verb} '{c['channel']}'")    # a generator's env calls (nodes/generator_episodes.py)
            lines.append(f"    {i}. {c['who']} {what}: {c['seconds']:.2f} s ({_pct(c['fraction'])} of its time)")
    if summary.get("dropped_events"):
        lines.append(f"  (trace: {summary['dropped_events']} fine-grained events sampled out; totals are exact)")
    return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"
