"""Interval math of the trace, on plain numbers (no Ray, no torch): unions, idle fractions, utilization
samples, occupancy per bin. Intervals are [t0, t1] pairs; samples are [t0, t1, percent] triples.
"""

from __future__ import annotations

import bisect


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


def occupancy(intervals, start: float, width: float, n: int) -> list[float]:
    """Fraction of each of `n` bins [start + i*width, start + (i+1)*width) covered by `intervals`."""
    out = [0.0] * n
    for a, b in merge_intervals(intervals):
        for k, frac in spread(a - start, b - start, width, n):
            out[k] += frac
    return out


def spread(a: float, b: float, width: float, n: int):
    """(bin, fraction of the bin covered) for [a, b) over n bins of `width` starting at 0."""
    a, b = max(a, 0.0), min(b, width * n)
    if b <= a:
        return
    for k in range(min(int(a // width), n - 1), min(int(b // width), n - 1) + 1):
        lo, hi = max(a, k * width), min(b, (k + 1) * width)
        if hi > lo:
            yield k, (hi - lo) / width
