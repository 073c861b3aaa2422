"""The trace as a PNG (matplotlib, Agg; imported only when a plot is asked for): a timeline of every
node and GPU above a utilization chart.
"""

from __future__ import annotations

from dataflow.trace.chrome import BUCKET_SHIFT
from dataflow.trace.intervals import merge_intervals, spread

COLORS = {"busy": "#2e9e44", "wait_input": "#f0a01e", "blocked_output": "#d62728", "gpu": "#1f6fd1",
          "startup": "#9467bd"}
LABELS = {"busy": "busy", "wait_input": "waiting for input", "blocked_output": "blocked on output",
          "gpu": "GPU busy", "startup": "start-up (set-up, waiting for the others')"}


def plot(path: str, rows: list, summary: dict, t0_us: int, slices_up_to_s: float = 60.0) -> None:
    """PNG: a timeline (one row per node/GPU) above a utilization chart; a title, legend, seconds.
    Start-up is its own band (its slices, or its share) and the run's start-up is shaded; the
    utilization chart is of the training window, with each node's start-up seconds beside it.

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
    train0 = (summary.get("train_window") or [t0_us])[0]
    span_s = max(summary["window_s"] + summary.get("startup_s", 0.0), 1e-6)
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

    handles = [Patch(color=COLORS[k], label=LABELS[k])
               for k in ("busy", "wait_input", "blocked_output", "gpu", "startup")]
    handles.append(Patch(color="#c7c7c7", label="other / GPU idle"))
    top = 1 - 0.75 / height  # inches kept for the title and the legend
    fig.suptitle(f"dataflow trace: where time went ({summary.get('startup_s', 0.0):.3g} s start-up, "
                 f"{summary['window_s']:.3g} s training)", fontsize=13, y=1 - 0.15 / height)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.42 / height), ncol=6, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
