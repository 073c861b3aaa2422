"""Where the time went, from the trace's aggregates: the idle summary (a plain dict), its metrics and
the end-of-run table.

No Ray and no torch: the driver's `TraceCollector` (dataflow/trace/collector.py) and the CLI
(`python -m dataflow.trace out.json`) both call these on plain numbers. All times are integer
microseconds on the driver's clock unless a name says otherwise (`_s` = seconds).

Aggregates (what `summarize` reads, and what the trace file stores under
`otherData.dataflow`) are, per node replica process:
    {"device": str, "gpu": str | None, "window": [t0, t1], "run_start": t | None,
     "state_us": {"busy", "wait_input", "blocked_output", "other", "startup"},  # exclusive, sum = window
     "wait_us": {channel: us}, "blocked_us": {channel: us},           # split of those two states
     "spans": {name: [count, us]}, "startup_parts": {part: us},       # parts: exclusive, sum = startup
     "dropped": events sampled out in the process}
and per GPU: {"busy_us": |union of busy intervals within window|, "window": [t0, t1], "nodes": [...],
"startup_us"}: its window starts when every node on it runs.

Start-up (a node's time from the launch of the run's processes until its run() began: its process
start, imports, set-up, and waiting for the other nodes'; dataflow/trace/tracer.py, collector.py)
is its own state: every fraction here (busy, waits, idle causes, device idle) is of the training
window only (TRAINING_WINDOW), and the start-up seconds stand beside them, per node and per part.
A trace written before start-up was its own state has none: its fractions are of the whole window.
"""

from __future__ import annotations

from dataflow.trace.intervals import sampled_idle, sampled_window
from dataflow.trace.tracer import WAITING_PROCESSES, WAITING_SETUP

KINDS = ("busy", "wait_input", "blocked_output")
# TRAINING_WINDOW: from the run() start of the last node (all set up and running) to the run's end;
# a node's own: from its run() start (ms apart). Not from the first step: the pipeline filling up
# (a learner waiting for its first rollouts) is training time the table must show.
BEFORE_SETUP = ("process start", "imports", WAITING_PROCESSES)   # start-up parts outside the set-up
WAITING = (WAITING_PROCESSES, WAITING_SETUP)


def summarize(aggregates: dict, top: int = 8) -> dict:
    """Fractions per node and device plus the top idle causes (a plain dict: JSONL, tests).

    A node's four states are exclusive (busy > blocked on output > waiting for input > other, see
    trace.Tracer), so they add up to 1; the per channel fractions split the waiting (blocked) state
    among the channels waited on, so they add up to it. A device's idle fraction is
    1 - |union of busy intervals| / window: for a GPU the intervals come from CUDA events; on a CPU
    run each node's compute is its device and its busy state is the union of its busy spans. Idle
    causes of a device are the waits of the nodes on it (by total time, not intersected with the
    device's idle intervals).

    {"window_s" (training), "startup_s" (the run's: launch -> every node running),
     "train_window": [t0, t1] (TRAINING_WINDOW),
     "nodes": {name: {"busy", "wait_input", "blocked_output", "other", "window_s", "startup_s",
       "startup_parts": {part: s} (in the order they happen, set-up parts largest first; they add
       up to startup_s), "setup_s", "waiting_s" (of them), "startup_window": [t0, run start],
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
    run_starts = [a["run_start"] for a in procs.values() if a.get("run_start") is not None]
    train_window = [min(max(run_starts), window[1]), window[1]] if run_starts else list(window)
    nodes, causes = {}, []
    for name in sorted(procs):
        a = procs[name]
        startup_us = a["state_us"].get("startup", 0)
        length = max(1, a["window"][1] - a["window"][0] - startup_us)
        fr = {k: a["state_us"].get(k, 0) / length for k in KINDS}
        fr["other"] = max(0.0, 1.0 - sum(fr.values()))
        node_causes = sorted(
            [("wait_input", ch, us) for ch, us in a["wait_us"].items()]
            + [("blocked_output", ch, us) for ch, us in a["blocked_us"].items()], key=lambda c: -c[2])
        parts = _ordered_parts(a.get("startup_parts", {}))
        run_start = a.get("run_start")
        nodes[name] = dict(fr, window_s=length / 1e6, startup_s=startup_us / 1e6, startup_parts=parts,
                           setup_s=sum(v for k, v in parts.items() if k not in BEFORE_SETUP + WAITING),
                           waiting_s=sum(parts.get(k, 0.0) for k in WAITING),
                           startup_window=[a["window"][0], a["window"][0] if run_start is None else run_start],
                           device=a["device"], gpu=a.get("gpu"),
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
                          "startup_s": g.get("startup_us", 0) / 1e6, "nodes": on, "causes": _merged_causes(nodes, on)}
        if nvml_same_window is not None:
            devices[label]["nvml_idle_kernel_window"] = nvml_same_window
    for name, n in nodes.items():
        if n["gpu"] is None:  # CPU run: the node's own compute is the device
            devices[f"cpu {name}"] = {"idle": 1.0 - n["busy"], "window_s": n["window_s"], "startup_s": n["startup_s"],
                                      "nodes": [name], "causes": _merged_causes(nodes, [name])}
    causes.sort(key=lambda c: -c["seconds"])
    return {"window_s": (train_window[1] - train_window[0]) / 1e6, "startup_s": (train_window[0] - window[0]) / 1e6,
            "train_window": train_window, "nodes": nodes, "devices": devices,
            "idle_causes": causes[:top], "dropped_events": aggregates.get("dropped", 0),
            "thinned_events": aggregates.get("thinned", 0)}


def _ordered_parts(parts_us: dict) -> dict:
    """{part: s} in the order they happen: before the set-up, its parts (largest first), after it."""
    setup = sorted((k for k in parts_us if k not in BEFORE_SETUP + WAITING), key=lambda k: -parts_us[k])
    return {k: parts_us[k] / 1e6 for k in [*BEFORE_SETUP, *setup, WAITING_SETUP] if k in parts_us}


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
        out[f"util/{name}/startup_s"] = round(n["startup_s"], 3)
    for label, d in summary["devices"].items():
        out[f"util/{label}/idle"] = round(d["idle"], 4)
    return out


def format_report(summary: dict) -> str:
    """The end-of-run table: where each node's time went, device idle, and the top idle causes."""
    nodes, devices = summary["nodes"], summary["devices"]
    if not nodes:
        return "[dataflow] time report: no trace data was collected"
    w = max([len(n) for n in nodes] + [len(d) for d in devices] + [6])
    startup = summary.get("startup_s", 0.0)
    lines = [f"[dataflow] where time went: {startup:.1f} s of start-up (launch -> every node running), then the "
             f"training window, {summary['window_s']:.1f} s: every % is of it (exclusive states: busy > blocked > waiting)",
             f"  {'node':<{w}}  {'busy':>6} {'wait-in':>8} {'blocked':>8} {'other':>6} {'start-up':>9}  top idle cause"]
    for name, n in nodes.items():
        cause = _cause_text(n["causes"][0]) if n["causes"] else "-"
        lines.append(f"  {name:<{w}}  {_pct(n['busy']):>6} {_pct(n['wait_input']):>8} "
                     f"{_pct(n['blocked_output']):>8} {_pct(n['other']):>6} {n.get('startup_s', 0.0):>7.1f} s  {cause}")
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
    lines += _startup_lines(nodes, w)
    if summary["idle_causes"]:
        lines.append("  top idle causes (training window):")
        for i, c in enumerate(summary["idle_causes"], start=1):
            verb = "waiting for input on" if c["kind"] == "wait_input" else "blocked on output to"
            what = ("waiting on the environment" if c["kind"] == "wait_input" and c["channel"] == "environment"
                    else f"{verb} '{c['channel']}'")    # a generator's env calls (rl/generation/episodes.py)
            lines.append(f"    {i}. {c['who']} {what}: {c['seconds']:.2f} s ({_pct(c['fraction'])} of its time)")
    if summary.get("dropped_events"):
        lines.append(f"  (trace: {summary['dropped_events']} fine-grained events sampled out; totals are exact)")
    return "\n".join(lines)


def _startup_lines(nodes: dict, w: int) -> list[str]:
    """Start-up per node, in exclusive parts that add up to it (summarize's startup_parts)."""
    parted = {name: n for name, n in nodes.items() if n.get("startup_parts")}
    if not parted:
        return []
    lines = [f"  {'start-up (s)':<{w}}  {'total':>6} {'process':>8} {'imports':>8} {'set-up':>7} {'waiting':>8}"
             "  set-up parts, largest first"]
    for name, n in parted.items():
        p = n["startup_parts"]
        setup = [(part, sec) for part, sec in p.items() if part not in BEFORE_SETUP + WAITING]
        shown = [f"{part} {sec:.1f}" for part, sec in setup[:4] if sec >= 0.05]
        more = len(setup) - len(shown)   # the rest are shorter than the shortest shown
        lines.append(f"  {name:<{w}}  {n['startup_s']:>6.1f} {p.get('process start', 0.0):>8.1f} "
                     f"{p.get('imports', 0.0):>8.1f} {n['setup_s']:>7.1f} {n['waiting_s']:>8.1f}  "
                     + ", ".join(shown + ([f"+{more} more ({sum(s for _, s in setup[len(shown):]):.1f} s)"] if more else []))
                     or "-")
    lines.append("    (process: launch -> the node's process up; imports: its modules; set-up: its "
                 "setup(), 'setup' = outside its named parts; waiting: for the other nodes' processes and set-up)")
    return lines


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_spans(summary: dict, top: int = 12) -> str:
    """Per node, its busy spans by total time (count, total s, mean ms): what each node's busy
    time was made of (`python -m dataflow.trace out.json --spans`). Nested spans each count
    their whole time (a generator's "decode steps" inside its "generate")."""
    lines = ["  busy spans per node (count, total s, mean ms), training window and start-up together:"]
    for name, n in summary["nodes"].items():
        spans = sorted(n.get("spans", {}).items(), key=lambda kv: -kv[1]["total_s"])[:top]
        if spans:
            lines.append(f"  {name}: " + "; ".join(
                f"{s} {v['count']} x, {v['total_s']:.2f} s, {1000 * v['total_s'] / max(v['count'], 1):.1f} ms"
                for s, v in spans))
    return "\n".join(lines)
