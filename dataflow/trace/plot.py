"""The trace as a PNG (matplotlib, Agg; imported only when a plot is asked for): a timeline of every
node and GPU above a utilization chart of the training window and a chart of the start-up's parts.
"""

from __future__ import annotations

from dataflow.trace.chrome import BUCKET_SHIFT
from dataflow.trace.intervals import merge_intervals, spread
from dataflow.trace.report import BEFORE_SETUP, WAITING

COLORS = {"busy": "#2e9e44", "wait_input": "#f0a01e", "blocked_output": "#d62728", "gpu": "#1f6fd1",
          "startup": "#9467bd", "starting": "#ddd0ec"}
LABELS = {"busy": "busy", "wait_input": "waiting for input", "blocked_output": "blocked on output",
          "gpu": "GPU busy", "startup": "start-up: process, imports, set-up",
          "starting": "start-up: waiting for the others"}
# The start-up chart's parts: before the set-up, each set-up part (cycling), waiting.
PART_COLORS = {"process start": "#8c6bb1", "imports": "#b69fd6", "waiting": COLORS["starting"]}
SETUP_COLORS = ("#4a1486", "#6a51a3", "#807dba", "#54278f", "#9e9ac8")


def plot(path: str, rows: list, summary: dict, t0_us: int, slices_up_to_s: float = 60.0) -> None:
    """PNG: a timeline (one row per node/GPU) above a utilization chart; a title, legend, seconds.
    Start-up is its own band (its slices, or its share, over a light band from the launch to the
    node's run start) and the run's start-up is shaded; the utilization chart is of the training
    window, with each node's start-up seconds beside it; a third chart splits each node's start-up
    into its parts (process start, imports, set-up parts, waiting for the others).

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
    parted = [(n, v) for n, v in nodes.items() if v.get("startup_parts")]
    tl_in, ut_in = 0.8 + 0.55 * max(2, n_rows), 0.8 + 0.4 * max(2, len(util))  # axes heights, inches
    st_in = 0.8 + 0.4 * max(2, len(parted)) if parted else 0
    height = 2.3 + tl_in + ut_in + st_in
    fig, axes = plt.subplots(2 + bool(parted), 1, figsize=(13, height),
                             gridspec_kw={"height_ratios": [tl_in, ut_in] + ([st_in] if parted else [])})
    ax, bx = axes[0], axes[1]
    train0 = (summary.get("train_window") or [t0_us])[0]
    span_s = max(summary["window_s"] + summary.get("startup_s", 0.0), 1e-6)
    for i, (label, _) in enumerate(rows):   # the light band: a node's whole start-up, waits included
        a, b = nodes.get(label, {}).get("startup_window", (0, 0))
        if b > a:
            ax.broken_barh([((a - t0_us) / 1e6, (b - a) / 1e6)], (n_rows - 1 - i - 0.40, 0.77),
                           facecolors=COLORS["starting"], linewidth=0)
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
    if summary.get("startup_s"):
        ax.axvspan(0, (train0 - t0_us) / 1e6, color=COLORS["startup"], alpha=0.08, linewidth=0)
        ax.text((train0 - t0_us) / 1e6, n_rows - 0.45, " training ->", fontsize=8, va="top", color="gray")
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
    for yi, sh, (_, v) in zip(y, shares, util):
        start = f", start-up {v['startup_s']:.1f} s" if v.get("startup_s") else ""
        bx.text(101, yi, f"{100 * sh[0]:.0f}% busy{start}", va="center", fontsize=8)
    bx.set_yticks(y, [n for n, _ in util])
    bx.set_xlim(0, 125)
    bx.set_xticks(range(0, 101, 20))
    bx.set_xlabel("% of the node's (or GPU's) time in the training window")
    bx.set_title("Utilization over the training window (start-up apart)", fontsize=10)

    if parted:
        _draw_startup_parts(axes[2], parted)
    handles = [Patch(color=COLORS[k], label=LABELS[k])
               for k in ("busy", "wait_input", "blocked_output", "gpu", "startup", "starting")]
    handles.append(Patch(color="#c7c7c7", label="other / GPU idle"))
    top = 1 - 1.0 / height  # inches kept for the title and the legend
    fig.suptitle(f"dataflow trace: where time went ({summary.get('startup_s', 0.0):.3g} s start-up, "
                 f"{summary['window_s']:.3g} s training)", fontsize=13, y=1 - 0.15 / height)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.42 / height), ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_startup_parts(cx, parted) -> None:
    """Each node's start-up in seconds, stacked by part in the order they happen."""
    y = list(range(len(parted)))[::-1]
    total = max(v["startup_s"] for _, v in parted) or 1.0
    for yi, (_, v) in zip(y, parted):
        left, k = 0.0, 0
        for part, sec in v["startup_parts"].items():
            if part in WAITING:
                color = PART_COLORS["waiting"]
            elif part in BEFORE_SETUP:
                color = PART_COLORS[part]
            else:
                color, k = SETUP_COLORS[k % len(SETUP_COLORS)], k + 1
            cx.barh(yi, sec, left=left, color=color, height=0.6, edgecolor="white", linewidth=0.5)
            char = total * 1.12 / 170   # about one 7-point character, in seconds on this axis
            label = next((t for t in (part, "waiting" if part in WAITING else "") if t and sec >= (len(t) + 2) * char), "")
            if label:   # only in a part wide enough to hold it
                light = part in WAITING or part == "imports"
                cx.text(left + sec / 2, yi, label, ha="center", va="center", fontsize=7,
                        color="black" if light else "white", clip_on=True)
            left += sec
        cx.text(left + 0.01 * total, yi, f"{v['startup_s']:.1f} s", va="center", fontsize=8)
    cx.set_yticks(y, [n for n, _ in parted])
    cx.set_xlim(0, total * 1.12)
    cx.set_xlabel("seconds from the launch to the node's run start")
    cx.set_title("Start-up per node by part: process start, imports, set-up parts (darker), waiting for the "
                 "others (light)", fontsize=10)


def _draw_slices(ax, rows, n_rows, t0_us, gap) -> None:
    for i, (_, kinds) in enumerate(rows):
        y = n_rows - 1 - i
        for kind in ("startup", "busy", "gpu", "wait_input", "blocked_output"):
            merged = merge_intervals(kinds.get(kind, []), gap=gap)
            if merged:
                band = (y - 0.05, 0.42) if kind in ("busy", "gpu", "startup") else (y - 0.40, 0.32)
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
        for key, color in (("startup", COLORS["startup"]), ("busy", COLORS["gpu" if is_gpu else "busy"]),
                           ("blocked", COLORS["blocked_output"]), ("waiting", COLORS["wait_input"])):
            per_bin = [0.0] * n_bins
            for a, b, (_, v) in zip(starts, ends, samples):
                share = v.get(key, 0) / 100
                if share:
                    for k, frac in spread(a, b, width, n_bins):
                        per_bin[k] += share * frac
            high = [lo + 0.8 * v for lo, v in zip(low, per_bin)]
            ax.fill_between(xs, low + low[-1:], high + high[-1:], step="post", color=color, linewidth=0)
            low = high
    return width
