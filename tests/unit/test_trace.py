"""dataflow/trace/: interval math, accounting (tracer, collector), the Chrome file, report (the CLI:
tests/integration/test_cli.py).

No Ray: tracers are driven directly, most with a fake clock so that every number is exact.
"""

import asyncio
import gzip
import json
import random

import pytest

from dataflow.trace import __main__ as trace_cli
from dataflow.trace import chrome as trace_chrome
from dataflow.trace import collector as trace_collector
from dataflow.trace import intervals as trace_intervals
from dataflow.trace import report as trace_report
from dataflow.trace import tracer as trace
from dataflow.trace.chrome import assign_lanes
from dataflow.trace.collector import TraceCollector, measure_clock_offset
from dataflow.trace.intervals import idle_fraction, merge_intervals, union_length
from dataflow.trace.tracer import Tracer



class FakeClock:
    """Stands in for Tracer.now_us: time only moves when the test says so."""

    def __init__(self, t: int = 0):
        self.t = t

    def __call__(self) -> int:
        return self.t


def fake_tracer(name: str, clock: FakeClock, enabled: bool = True) -> Tracer:
    tracer = Tracer(name, enabled=enabled)
    tracer.now_us = clock
    tracer._state_t = tracer._window_start = clock()
    return tracer


def slices(drained: dict) -> list:
    return [e for e in drained["events"] if e[0] == "X"]


# ---- interval math ------------------------------------------------------------------------------
def test_union_length_hand_computed():
    ivs = [(0, 10), (5, 15), (20, 30)]            # overlap + gap: [0,15] + [20,30]
    assert union_length(ivs) == 25
    assert union_length(ivs, window=(0, 40)) == 25
    assert union_length(ivs, window=(8, 25)) == 7 + 5          # clipped at both window edges
    assert union_length(ivs, window=(15, 20)) == 0             # window inside the gap
    assert union_length([(0, 5), (5, 10)]) == 10               # touching
    assert union_length([(2, 4), (0, 10), (3, 3)]) == 10       # contained, empty
    assert union_length([], window=(0, 10)) == 0
    assert union_length([(-5, 50)], window=(0, 10)) == 10      # covers the window


def test_idle_fraction_hand_computed():
    ivs = [(0, 10), (5, 15), (20, 30)]
    assert idle_fraction(ivs, (0, 40)) == pytest.approx(15 / 40)
    assert idle_fraction(ivs, (8, 25)) == pytest.approx(1 - 12 / 17)
    assert idle_fraction([], (0, 40)) == 1.0
    assert idle_fraction([(-1, 100)], (0, 40)) == 0.0
    assert idle_fraction(ivs, (5, 5)) == 0.0                   # empty window


def test_merge_intervals_gap():
    assert merge_intervals([(10, 12), (0, 5), (6, 8)]) == [[0, 5], [6, 8], [10, 12]]
    assert merge_intervals([(10, 12), (0, 5), (6, 8)], gap=1) == [[0, 8], [10, 12]]


def test_assign_lanes():
    # nested -> same lane; touching -> same lane; interleaved -> overflow lane
    assert assign_lanes([(0, 10), (2, 5), (5, 9)]) == [0, 0, 0]
    assert assign_lanes([(0, 10), (10, 20)]) == [0, 0]
    assert assign_lanes([(0, 10), (5, 15)]) == [0, 1]
    assert assign_lanes([(0, 10), (5, 15), (12, 20), (11, 30)]) == [0, 1, 0, 0]  # (12,20) nests in (11,30)
    lanes = assign_lanes([(0, 10), (5, 15), (12, 20), (11, 30)])
    _check_lanes([(0, 10), (5, 15), (12, 20), (11, 30)], lanes)


def _check_lanes(ivs, lanes):
    for lane in set(lanes):
        assert _disjoint_or_nested([iv for iv, ln in zip(ivs, lanes) if ln == lane])


def _disjoint_or_nested(ivs) -> bool:
    for i, (a0, a1) in enumerate(ivs):
        for b0, b1 in ivs[i + 1:]:
            overlap = a0 < b1 and b0 < a1
            nested = (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
            if overlap and not nested:
                return False
    return True


def test_occupancy_per_bin():
    # bins of 10 over [0, 40): [5, 25) covers half of bin 0, all of bin 1, half of bin 2
    assert trace_intervals.occupancy([(5, 25), (38, 100)], 0, 10, 4) == [0.5, 1.0, 0.5, 0.2]
    # float bin edges that do not round-trip (0.1 * 3 != 0.3) still cover every bin
    assert trace_intervals.occupancy([(0.0, 1.0)], 0.0, 0.1, 10) == pytest.approx([1.0] * 10)


def test_measure_clock_offset_uses_min_rtt():
    # remote = local + 1000; the 2nd sample has the shortest round trip and a symmetric delay
    samples = [(0, 1900, 1000), (2000, 3050, 2100), (5000, 6400, 5500)]
    assert measure_clock_offset(samples) == 1000


# ---- process-side accounting --------------------------------------------------------------------
def test_exclusive_states_and_idle_causes():
    u = 100                                        # time unit, us (idle slices < 50 us are no events)
    clock = FakeClock(0)
    t = fake_tracer("learner", clock)
    w = t.wait_input("samples").__enter__()        # 0..10 waiting on samples
    clock.t = 10 * u
    w.__exit__(None, None, None)
    s = t.span("forward/backward").__enter__()     # 10..30 busy
    clock.t = 20 * u
    w2 = t.wait_input("prompts").__enter__()       # 20..40: another task waits (overlaps busy)
    clock.t = 30 * u
    s.__exit__(None, None, None)
    b = t.blocked_output("stats").__enter__()      # 30..35 blocked wins over waiting
    clock.t = 35 * u
    b.__exit__(None, None, None)
    clock.t = 40 * u
    w2.__exit__(None, None, None)
    clock.t = 50 * u                               # 40..50 other
    d = t.drain()
    assert d["window"] == [0, 50 * u]
    assert d["state_us"] == {"busy": 20 * u, "wait_input": 15 * u, "blocked_output": 5 * u, "other": 10 * u}
    assert d["wait_us"] == {"samples": 10 * u, "prompts": 5 * u}   # only idle time counts as a cause
    assert d["blocked_us"] == {"stats": 5 * u}
    assert d["spans"] == {"forward/backward": [1, 20 * u]}
    kinds = sorted((e[1], e[3] // u, e[4] // u, e[5]) for e in d["events"] if e[0] == "X")
    assert kinds == [("blocked stats", 30, 5, "blocked_output"), ("forward/backward", 10, 20, "busy"),
                     ("wait prompts", 20, 20, "wait_input"), ("wait samples", 0, 10, "wait_input")]
    # the next drain starts where this one ended, with fresh totals
    clock.t = 60 * u
    d2 = t.drain()
    assert d2["window"] == [50 * u, 60 * u] and d2["state_us"]["other"] == 10 * u and slices(d2) == []


def test_waiting_on_two_channels_splits_the_time():
    clock = FakeClock(0)
    t = fake_tracer("n", clock)
    a, b = t.wait_input("a").__enter__(), t.wait_input("b").__enter__()
    clock.t = 10
    a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    assert t.drain()["wait_us"] == {"a": 5, "b": 5}


def test_open_span_is_counted_up_to_the_drain():
    clock = FakeClock(0)
    t = fake_tracer("n", clock)
    s = t.span("generate").__enter__()
    clock.t = 100
    d = t.drain()
    assert d["state_us"]["busy"] == 100 and slices(d) == []    # the slice comes when it ends
    clock.t = 150
    s.__exit__(None, None, None)
    clock.t = 200
    d = t.drain()
    assert d["state_us"]["busy"] == 50 and d["state_us"]["other"] == 50
    assert [e[3:5] for e in slices(d)] == [(0, 150)]


def test_disabled_tracer_keeps_aggregates_only():
    clock = FakeClock(0)
    t = fake_tracer("n", clock, enabled=False)
    with t.span("score"):
        clock.t = 7
    t.counter("depth", samples=3)
    t.instant("mark")
    t.complete("wait x", 7, 9, track="io", kind="wait_input", channel="x")
    clock.t = 10
    d = t.drain()
    assert d["events"] == [] and d["state_us"]["busy"] == 7 and d["wait_us"] == {"x": 2}


def test_complete_counter_instant_events():
    clock = FakeClock(1000)
    t = fake_tracer("n", clock)
    t.complete("reference forward", 1000, 1400, args={"batch": 4})
    t.complete("blocked out", 1400, 1500, track="io", kind="blocked_output", channel="out")
    t.counter("channel/samples/depth", depth=3)
    t.instant("version", v=2)
    with pytest.raises(ValueError, match="channel"):
        t.complete("wait", 0, 1, kind="wait_input")
    d = t.drain()
    assert ("X", "reference forward", "compute", 1000, 400, "busy", None, {"batch": 4}) in d["events"]
    assert ("C", "channel/samples/depth", 1000, {"depth": 3}) in d["events"]
    assert ("i", "version", 1000, {"v": 2}) in d["events"]
    assert d["blocked_us"] == {"out": 100}


def test_utilization_counter_integrates_to_the_states():
    bucket = 1 << trace.BUCKET_SHIFT
    clock = FakeClock(3 * bucket - 5000)
    t = fake_tracer("n", clock)
    rng = random.Random(1)
    for _ in range(200):                           # waits and work across many bucket edges
        with t.wait_input("x"):
            clock.t += rng.randrange(0, 3 * bucket)
        with t.span("w"):
            clock.t += rng.randrange(0, bucket)
    clock.t += 10
    d = t.drain()
    util = [(e[2], e[3]) for e in d["events"] if e[0] == "C" and e[1] == trace.UTIL_COUNTER]
    ends = [ts for ts, _ in util[1:]] + [clock.t]
    busy = sum((end - ts) * v["busy"] / 100 for (ts, v), end in zip(util, ends))
    assert busy == pytest.approx(d["state_us"]["busy"], rel=1e-3)   # values are rounded to 0.1%
    assert len(util) <= (clock.t >> trace.BUCKET_SHIFT) - 2


def test_size_rules_tiny_waits_and_rate_cap():
    clock = FakeClock(0)
    t = fake_tracer("n", clock)
    for _ in range(100):                           # 100 waits of 10 us: counted, not events
        with t.wait_input("x"):
            clock.t += 10
    assert t._events == []
    for _ in range(trace.MAX_EVENTS_PER_BUCKET + 5):   # all end inside one bucket
        with t.span("tiny"):
            clock.t += 1
    d = t.drain()
    assert d["wait_us"] == {"x": 1000}
    assert len(slices(d)) == trace.MAX_EVENTS_PER_BUCKET and d["dropped"] == 5
    assert d["spans"]["tiny"][0] == trace.MAX_EVENTS_PER_BUCKET + 5


def test_write_thins_to_max_events_and_size_per_event(tmp_path):
    clock = FakeClock(0)
    t = fake_tracer("generator", clock)
    for i in range(20_000):                        # a pair per 10 ms: under the rate cap
        clock.t = i * 10_000
        with t.span("generate", track="compute"):
            clock.t += 500
        with t.wait_input("prompts"):
            clock.t += 400
    c = TraceCollector(enabled=True, max_events=10_000)
    c.add("generator", t.drain())
    path = tmp_path / "big.json"
    c.write(str(path))
    doc = json.loads(path.read_text())
    body = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    util = [e for e in body if e["name"] == trace.UTIL_COUNTER]     # never thinned: <= 1 per bucket
    assert 0 < len(util) <= 200e6 / (1 << trace.BUCKET_SHIFT) + 1
    assert len(body) - len(util) <= 10_000 and doc["otherData"]["dataflow"]["keep_every"] == 4
    # The 50 MB budget: MAX_TRACE_EVENTS events of this size must fit.
    per_event = path.stat().st_size / len(body)
    assert per_event * trace_collector.MAX_TRACE_EVENTS < 50e6, per_event
    # thinning never changes the totals the report is made from
    assert c.summary()["nodes"]["generator"]["busy"] == pytest.approx(0.05, abs=1e-3)


def test_write_respects_the_byte_budget(tmp_path):
    clock = FakeClock(0)
    t = fake_tracer("generator", clock)
    for i in range(5_000):
        clock.t = i * 10_000
        with t.span("a rather long span name to make events big", track="compute", step=i, tag="x" * 40):
            clock.t += 500
    c = TraceCollector(enabled=True, max_bytes=100_000)
    c.add("generator", t.drain())
    path = tmp_path / "small.json"
    c.write(str(path))
    assert path.stat().st_size <= 100_000
    assert _load(path)["otherData"]["dataflow"]["keep_every"] > 1


# ---- the Chrome file ----------------------------------------------------------------------------
async def _concurrent_work(t: Tracer, seed: int) -> None:
    rng = random.Random(seed)

    async def worker(k):
        for i in range(8):
            with t.wait_input(f"in{k % 2}"):
                await asyncio.sleep(rng.uniform(0, 0.003))
            with t.span("generate", i=i):
                await asyncio.sleep(rng.uniform(0, 0.002))
                with t.span("score"):              # nested inside generate: same track
                    await asyncio.sleep(rng.uniform(0, 0.002))
            with t.blocked_output("samples"):
                await asyncio.sleep(rng.uniform(0, 0.001))
            t.counter("channel/samples/depth", depth=i)

    await asyncio.gather(*(worker(k) for k in range(4)))


def _run_traced(tmp_path, name="trace.json"):
    t = Tracer("generator", enabled=True)
    asyncio.run(_concurrent_work(t, seed=0))
    c = TraceCollector(enabled=True)
    c.set_clock_offset("generator", 0)
    c.add("generator", t.drain())
    path = tmp_path / name
    c.write(str(path))
    return c, path


def _load(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def test_trace_schema(tmp_path):
    _, path = _run_traced(tmp_path)
    doc = _load(path)
    assert doc["displayTimeUnit"] == "ms" and isinstance(doc["traceEvents"], list)
    phases = set()
    for e in doc["traceEvents"]:
        phases.add(e["ph"])
        assert isinstance(e["name"], str) and isinstance(e["pid"], int)
        if e["ph"] == "X":
            for key in ("ts", "dur", "pid", "tid", "name"):
                assert key in e
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            assert e["cat"] in ("busy", "wait_input", "blocked_output")
            if e["cat"] != "busy":
                assert e["args"]["channel"] in ("in0", "in1", "samples")
        elif e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index")
            assert "name" in e["args"] or "sort_index" in e["args"]
        elif e["ph"] == "C":
            assert isinstance(e["args"], dict) and isinstance(e["ts"], (int, float))
    assert {"X", "M", "C"} <= phases
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {"compute", "io"} <= names
    assert "dataflow" in doc["otherData"]


def test_no_overlap_per_track_with_concurrent_tasks(tmp_path):
    _, path = _run_traced(tmp_path)
    doc = _load(path)
    tracks = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert len(tracks) > 2                      # four interleaving tasks need overflow tracks
    for ivs in tracks.values():
        assert _disjoint_or_nested(ivs)
    thread_names = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"]
    assert any("overlap" in n for n in thread_names)


def test_clock_merging_aligns_processes(tmp_path):
    # Process A's clock runs 1000 us ahead of the driver, B's 500 us behind. Both do work at
    # driver time 10_000..12_000; after the measured offsets the slices coincide.
    driver = FakeClock(5_000)
    ca, cb = FakeClock(driver.t + 1000), FakeClock(driver.t - 500)
    a, b = fake_tracer("A", ca), fake_tracer("B", cb)
    c = TraceCollector(enabled=True)
    for name, clk in (("A", ca), ("B", cb)):
        # a fake round trip: 40 us out, 60 us back
        samples = [(driver.t, clk.t + 40, driver.t + 100)]
        c.set_clock_offset(name, measure_clock_offset(samples))
    for clk, tracer, off in ((ca, a, 1000), (cb, b, -500)):
        clk.t = 10_000 + off
        s = tracer.span("work").__enter__()
        clk.t = 12_000 + off
        s.__exit__(None, None, None)
        clk.t = 20_000 + off
        c.add(tracer.process_name, tracer.drain())
    path = tmp_path / "clock.json.gz"                # gzip path is supported too
    c.write(str(path))
    doc = _load(path)
    xs = {e["pid"]: (e["ts"], e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    (ts_a, dur_a), (ts_b, dur_b) = xs.values()
    assert abs(ts_a - ts_b) <= 10 and dur_a == dur_b == 2000   # offsets measured to ±10 us
    summary = c.summary()
    assert summary["nodes"]["A"]["busy"] == pytest.approx(2000 / 15_000)


# ---- report, summary, CLI -----------------------------------------------------------------------
def synthetic_aggregates():
    s = 1_000_000
    return {
        "processes": {
            "generator": {"device": "cuda", "gpu": "GPU h:0", "window": [0, 10 * s],
                          "state_us": {"busy": 6 * s, "wait_input": 3 * s, "blocked_output": 1 * s, "other": 0},
                          "wait_us": {"prompts": 3 * s}, "blocked_us": {"samples": 1 * s},
                          "spans": {"generate": [10, 6 * s]}},
            "learner": {"device": "cuda", "gpu": "GPU h:1", "window": [0, 10 * s],
                        "state_us": {"busy": 2 * s, "wait_input": 7 * s, "blocked_output": 0, "other": 1 * s},
                        "wait_us": {"samples": 7 * s}, "blocked_us": {},
                        "spans": {"forward/backward": [4, 2 * s]}},
            "reward": {"device": "cpu", "gpu": None, "window": [2 * s, 10 * s],
                       "state_us": {"busy": 2 * s, "wait_input": 6 * s, "blocked_output": 0, "other": 0},
                       "wait_us": {"samples": 6 * s}, "blocked_us": {}, "spans": {"score": [5, 2 * s]}},
        },
        "gpus": {"GPU h:0": {"busy_us": 5 * s, "window": [0, 10 * s], "nodes": ["generator"]},
                 "GPU h:1": {"busy_us": 1.5 * s, "window": [0, 10 * s], "nodes": ["learner"]}},
        "dropped": 0,
    }


def test_summary_and_report_table():
    summary = trace_report.summarize(synthetic_aggregates())
    g = summary["nodes"]["generator"]
    assert (g["busy"], g["wait_input"], g["blocked_output"], g["other"]) == pytest.approx((0.6, 0.3, 0.1, 0.0))
    assert summary["nodes"]["reward"]["busy"] == pytest.approx(0.25)          # its own 8 s window
    assert summary["devices"]["GPU h:1"]["idle"] == pytest.approx(0.85)
    assert summary["devices"]["cpu reward"]["idle"] == pytest.approx(0.75)
    top = summary["idle_causes"][0]
    assert (top["who"], top["kind"], top["channel"], top["seconds"]) == ("learner", "wait_input", "samples", 7.0)
    table = trace_report.format_report(summary)
    lines = table.splitlines()
    row = next(line for line in lines if line.strip().startswith("generator"))
    assert row.split()[1:5] == ["60.0%", "30.0%", "10.0%", "0.0%"] and "wait prompts 30%" in row
    gpu_row = next(line for line in lines if line.strip().startswith("GPU h:1"))
    assert "85.0%" in gpu_row and "wait samples 70%" in gpu_row
    assert "1. learner waiting for input on 'samples': 7.00 s (70.0% of its time)" in table
    metrics = trace_report.flat_metrics(summary)
    assert metrics["util/learner/wait_input"] == 0.7 and metrics["util/GPU h:0/idle"] == 0.5


def test_spans_listing_orders_each_nodes_spans_by_time():
    """`python -m dataflow.trace out.json --spans`: per node, count, total seconds and mean ms."""
    aggs = synthetic_aggregates()
    aggs["processes"]["generator"]["spans"] = {"generate": [4, 5_000_000], "extend prefill": [100, 2_000_000]}
    text = trace_report.format_spans(trace_report.summarize(aggs))
    line = next(x for x in text.splitlines() if x.strip().startswith("generator:"))
    assert line.index("generate 4 x, 5.00 s, 1250.0 ms") < line.index("extend prefill 100 x, 2.00 s, 20.0 ms")
    assert "reward: score 5 x, 2.00 s, 400.0 ms" in text


def test_collector_plot_without_events(tmp_path):
    clock = FakeClock(0)
    t = fake_tracer("n", clock, enabled=False)
    with t.span("x"):
        clock.t = 10
    clock.t = 20
    c = TraceCollector(enabled=False)
    c.add("n", t.drain())
    c.plot(str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 5_000
    assert "n" in c.report()


def fake_gpu_drain(name, window, busy, gpu_intervals, waits, gpu_util=()):
    """What a CUDA host's drain() returns, built by hand (no GPU here)."""
    length = window[1] - window[0]
    wait = sum(waits.values())
    return {"process": name, "device": "cuda", "gpu": "GPU host:0", "window": list(window),
            "state_us": {"busy": busy, "wait_input": wait, "blocked_output": 0, "other": length - busy - wait},
            "wait_us": waits, "blocked_us": {}, "spans": {"forward/backward": [1, busy]},
            "events": [("X", "forward/backward", "compute", window[0], busy, "busy", None, None)],
            "dropped": 0, "gpu_intervals": gpu_intervals, "gpu_util": [list(u) for u in gpu_util]}


def test_gpu_process_in_trace_and_report(tmp_path):
    s = 1_000_000
    c = TraceCollector(enabled=True)
    c.set_clock_offset("learner", 0)
    c.add("learner", fake_gpu_drain("learner", (0, 10 * s), 4 * s, [[0, 3 * s]], {"samples": 6 * s}))
    c.add("learner", fake_gpu_drain("learner", (10 * s, 20 * s), 1 * s, [[10 * s, 11 * s]], {"samples": 9 * s}))
    summary = c.summary()
    assert summary["devices"]["GPU host:0"]["idle"] == pytest.approx(0.8)
    assert "GPU host:0" in c.report() and "80.0%" in c.report()
    path = tmp_path / "gpu.json"
    c.write(str(path))
    doc = _load(path)
    gpu_pid = next(e["pid"] for e in doc["traceEvents"] if e["name"] == "process_name"
                   and e["args"]["name"] == "GPU host:0")
    gpu_slices = [(e["ts"], e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == gpu_pid]
    assert gpu_slices == [(0, 3 * s), (10 * s, 1 * s)]
    c.plot(str(tmp_path / "gpu.png"))


def test_gpu_idle_from_nvml_samples_when_they_cover_the_window(tmp_path):
    s = 1_000_000
    # Two processes on one GPU read the same NVML samples (same NVML timestamps): counted once.
    # Samples: (0, 5 s] 50% busy, (5, 10 s] 20% busy -> busy 3.5 s of 10 s -> idle 65%,
    # while the span events cover 8 s (idle 20%: launch gaps inside spans counted as busy).
    util = [(0, 5 * s, 50, 111), (5 * s, 10 * s, 20, 222)]
    c = TraceCollector(enabled=True)
    c.add("learner", fake_gpu_drain("learner", (0, 10 * s), 8 * s, [[0, 8 * s]], {}, util))
    c.add("generator", fake_gpu_drain("generator", (0, 10 * s), 1 * s, [[0, 1 * s]], {}, util))
    gpu = c.summary()["devices"]["GPU host:0"]
    assert gpu["source"] == "nvml"
    assert gpu["idle"] == pytest.approx(0.65)
    assert gpu["span_idle"] == pytest.approx(0.2)
    assert "NVML utilization samples" in c.report() and "65.0%" in c.report()
    # Saved and reloaded, the same numbers; the GPU's utilization counter follows the samples.
    path = tmp_path / "nvml.json"
    c.write(str(path))
    aggs, rows = trace_chrome.load_trace(str(path))
    assert trace_report.summarize(aggs)["devices"]["GPU host:0"]["idle"] == pytest.approx(0.65)
    gpu_util = dict(rows)["GPU host:0"]["util"]
    assert [u["busy"] for _, u in gpu_util] == [50, 20]


def test_nvml_samples_read_by_several_processes_count_once_even_with_different_timestamps():
    """Seen on the H200: three processes on one GPU got the same driver samples under different
    NVML timestamps, ~100 us apart on the driver clock; keyed by timestamp they were summed, and
    NVML said 16.8% idle where the kernel records said 47.0%."""
    s = 1_000_000
    # learner: samples over 2-10 s, (2, 6] 50% busy, (6, 10] 20%. generator: the same ones 100 us
    # later with other timestamps, and (0, 2] 10% from before the learner started. The generator's
    # stream covers more, so it is kept and the learner's copies are dropped: busy 0.2 + 2 + 0.8 s
    # (less the 100 us gap) of 10 s, idle 70%; summed, idle would be 40%.
    learner = [(2 * s, 6 * s, 50, 11), (6 * s, 10 * s, 20, 12)]
    generator = [(0, 2 * s, 10, 20), (2 * s + 100, 6 * s + 100, 50, 21), (6 * s + 100, 10 * s, 20, 22)]
    c = TraceCollector(enabled=False)
    c.add("learner", fake_gpu_drain("learner", (0, 10 * s), 8 * s, [[0, 8 * s]], {}, learner))
    c.add("generator", fake_gpu_drain("generator", (0, 10 * s), 1 * s, [[0, 1 * s]], {}, generator))
    gpu = c.summary()["devices"]["GPU host:0"]
    assert gpu["source"] == "nvml" and gpu["idle"] == pytest.approx(0.70, abs=1e-5)
    one = trace_intervals.one_sample_stream([[list(u[:3]) for u in learner], [list(u[:3]) for u in generator]])
    assert one == [list(u[:3]) for u in generator]
    # A process that covers time nobody else does adds its samples there, and only there.
    late = [[10 * s, 12 * s, 40], [6 * s, 10 * s, 99]]
    assert trace_intervals.one_sample_stream([[list(u[:3]) for u in generator], late]) \
        == [list(u[:3]) for u in generator] + [[10 * s, 12 * s, 40]]


def test_kernel_records_take_precedence_over_nvml_and_spans(tmp_path):
    s = 1_000_000
    util = [(0, 10 * s, 50, 1)]
    c = TraceCollector(enabled=True)
    c.set_clock_offset("learner", 1 * s)   # process clock runs 1 s ahead of the driver's
    c.add("learner", fake_gpu_drain("learner", (1 * s, 11 * s), 8 * s, [[1 * s, 9 * s]], {}, util))
    c.add("generator", fake_gpu_drain("generator", (0, 10 * s), 1 * s, [[0, 1 * s]], {}, util))
    # Kernels (process clocks): learner 2-3 s (driver 1-2 s), generator 1.5-2.5 s: union 1-2.5 s.
    # Recording windows: learner driver 0.5-9, generator 0.2-10 -> common window 0.5-9 s (8.5 s).
    c.add_kernel_intervals("learner", [[2 * s, 3 * s]], [int(1.5 * s), 10 * s])
    assert "GPU host:0" not in c.kernel_idle()          # the generator's records are still missing
    c.add_kernel_intervals("generator", [[int(1.5 * s), int(2.5 * s)]], [int(0.2 * s), 10 * s])
    gpu = c.summary()["devices"]["GPU host:0"]
    assert gpu["source"] == "kernels"
    assert gpu["idle"] == pytest.approx(1 - 1.5 / 8.5)
    k = c.kernel_idle()["GPU host:0"]
    assert k["kernels_idle"] == pytest.approx(1 - 1.5 / 8.5) and k["window_s"] == pytest.approx(8.5)
    assert k["nvml_idle"] == pytest.approx(0.5)
    assert "kernel records" in c.report()
    path = tmp_path / "k.json"
    c.write(str(path))
    aggs, _ = trace_chrome.load_trace(str(path))
    assert trace_report.summarize(aggs)["devices"]["GPU host:0"]["idle"] == pytest.approx(1 - 1.5 / 8.5)


def test_nvml_samples_that_cover_too_little_fall_back_to_span_events():
    s = 1_000_000
    c = TraceCollector(enabled=False)
    c.add("learner", fake_gpu_drain("learner", (0, 10 * s), 8 * s, [[0, 8 * s]], {}, [(0, 2 * s, 10, 1)]))
    gpu = c.summary()["devices"]["GPU host:0"]
    assert gpu["source"] == "cuda events" and gpu["idle"] == pytest.approx(0.2)
    assert "NVML unavailable" in c.report()


def test_sampled_idle_prorates_edges_and_coarsening_keeps_busy_time():
    samples = [[0, 100, 100], [100, 200, 50], [200, 300, 0]]
    assert trace_intervals.sampled_idle(samples, [0, 300]) == pytest.approx(1 - 150 / 300)
    # window (50, 150]: 50 us at 100% + 50 us at 50% = 75 us busy of 100
    assert trace_intervals.sampled_idle(samples, [50, 150]) == pytest.approx(0.25)
    assert trace_intervals.sampled_window(samples, [-50, 250]) == [0, 250]
    many = [[i * 10, (i + 1) * 10, (i * 37) % 101] for i in range(1001)]
    few = trace_intervals.coarsen_samples(many, limit=100)
    assert len(few) <= 100 and few[0][0] == 0 and few[-1][1] == 10010
    busy = lambda xs: sum((b - a) * p / 100 for a, b, p in xs)  # noqa: E731
    assert busy(few) == pytest.approx(busy(many))


def test_long_run_plot_uses_utilization_counters(tmp_path):
    clock = FakeClock(0)
    gen, learner = fake_tracer("generator", clock), fake_tracer("learner", FakeClock(0))
    learner.now_us = clock
    c = TraceCollector(enabled=True)
    for step in range(120):                        # 120 s: generator busy 0.8 s/s, learner 0.3 s/s
        with gen.span("generate"):
            with learner.wait_input("samples"):
                clock.t += 700_000
        with learner.span("forward/backward"):
            with gen.blocked_output("samples"):
                clock.t += 300_000 if step < 60 else 100_000
            with gen.span("generate"):
                clock.t += 0 if step < 60 else 200_000
    c.add("generator", gen.drain())
    c.add("learner", learner.drain())
    png = tmp_path / "long.png"
    c.plot(str(png))
    assert png.stat().st_size > 20_000
    aggs, rows = trace_chrome.rows_from_doc(c._chrome(c.max_events))
    assert [label for label, _ in rows] == ["generator", "learner"] and all("util" in k for _, k in rows)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_busy_intervals_line_up_with_the_spans():
    import time

    import torch

    t = Tracer("learner", enabled=True, device="cuda")
    x = torch.randn(4096, 4096, device="cuda")
    host = []
    for _ in range(6):
        with t.span("forward/backward") as s:
            for _ in range(10):
                x = (x @ x).tanh()
        torch.cuda.synchronize()       # the GPU work ends before the idle gap below
        host.append((s._t0, t.now_us()))
        time.sleep(0.02)
    d = t.drain()
    assert d["gpu"].startswith("GPU ")
    ivs = d["gpu_intervals"]
    assert len(ivs) == 6               # separated by the sleeps, so not merged
    for (a, b), (h0, h1) in zip(ivs, host):
        assert h0 - 200 <= a < b <= h1 + 200, (a, b, h0, h1)   # on the host clock, +-0.2 ms
    window = d["window"]
    gaps = sum(h1 - h0 for h0, h1 in host)
    assert union_length(ivs, window) == pytest.approx(gaps, rel=0.1)
    assert 0.05 < idle_fraction(ivs, window) < 0.95


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_nvml_samples_see_a_known_duty_cycle():
    """~2 s of alternating 60 ms of matmuls and 140 ms of sleep: NVML's busy share must be ~30%."""
    import time

    import torch

    t = Tracer("learner", enabled=False, device="cuda")
    assert t._nvml is not None, "NVML could not be opened on this CUDA machine"
    x = torch.randn(4096, 4096, device="cuda")
    t.drain()
    start = t.now_us()
    for _ in range(15):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.06:
            for _ in range(4):
                x = (x @ x).tanh()
            torch.cuda.synchronize()
        time.sleep(0.14)
    time.sleep(0.5)                    # NVML posts a sample at the end of its period
    samples = [u[:3] for u in t.drain()["gpu_util"]]
    assert samples, "no NVML samples"
    window = trace_intervals.sampled_window(samples, [start, t.now_us()])
    busy = 1 - trace_intervals.sampled_idle(samples, window)
    assert 0.15 < busy < 0.45, (busy, samples)


# ---- start-up: its own state, utilization over the training window -------------------------------
S = 1_000_000  # us per second


def starting_tracer(name: str, clock: FakeClock, loaded_us: int) -> Tracer:
    """A node host's tracer (starting=True), built at clock.t, its process's trace module loaded at loaded_us."""
    t = Tracer(name, enabled=True, starting=True)
    t.now_us = clock
    t._state_t = t._window_start = clock()
    t._loaded = loaded_us
    return t


def test_ten_second_load_then_five_of_work_in_ten_reads_half_busy():
    """The issue's example, exactly: a node that loads its model for 10 s, then works 5 s of a 10 s
    training window, reads 50% busy with 10 s of start-up (it read 75% busy when set-up was busy)."""
    clock = FakeClock(0)
    t = starting_tracer("critic", clock, loaded_us=0)
    with t.span("setup"):
        with t.span("load model"):
            clock.t = 10 * S
    t.started()
    with t.span("critic train"):
        clock.t = 15 * S
    with t.wait_input("with_ref"):
        clock.t = 20 * S
    c = TraceCollector(enabled=True)
    c.launched(0)
    c.add("critic", t.drain())
    s = c.summary()
    n = s["nodes"]["critic"]
    assert (n["busy"], n["wait_input"], n["blocked_output"], n["other"]) == (0.5, 0.5, 0.0, 0.0)
    assert (n["startup_s"], n["window_s"], n["startup_parts"]) == (10.0, 10.0, {"load model": 10.0})
    assert (s["startup_s"], s["window_s"], s["train_window"]) == (10.0, 10.0, [10 * S, 20 * S])
    assert n["spans"] == {"critic train": {"count": 1, "total_s": 5.0}}   # "load model" is no busy span
    assert s["devices"]["cpu critic"]["idle"] == 0.5
    assert s["idle_causes"] == [{"who": "critic", "kind": "wait_input", "channel": "with_ref",
                                 "seconds": 5.0, "fraction": 0.5}]
    lines = c.report().splitlines()
    assert lines[0].startswith("[dataflow] where time went: 10.0 s of start-up (launch -> every node running), "
                               "then the training window, 10.0 s: every % is of it")
    assert next(x for x in lines if x.strip().startswith("critic")).split() == [
        "critic", "50.0%", "50.0%", "0.0%", "0.0%", "10.0", "s", "wait", "with_ref", "50%"]
    assert next(x for x in lines if x.strip().startswith("critic") and "load model" in x).split() == [
        "critic", "10.0", "0.0", "0.0", "10.0", "0.0", "load", "model", "10.0"]


def test_startup_parts_are_exclusive_and_start_at_the_launch(tmp_path, capsys):
    """Every part of a start-up, on the driver clock (the process's clock is 7 s ahead): the launch at
    100 s, the host's module loaded at 102 (process start 2 s), the tracer built at 105 (imports 3 s),
    connect() at 106 (1 s waiting for the other processes), set-up 106-116: load model 8 s with a
    nested 'lora' 1 s, a compile warm-up 1 s, 1 s of the set-up's own; 2 s waiting for the other
    nodes' set-up (and an input waited on meanwhile: no idle cause), run() at 118, then 4 s busy and
    4 s other. The parts add up to the start-up, which adds up with the states to the window; the
    trace file holds them and slices for the parts before the tracer, and the CLI prints the same."""
    off = 7 * S
    clock = FakeClock(105 * S + off)
    t = starting_tracer("learner", clock, loaded_us=102 * S + off)
    clock.t += 1 * S
    with t.span("setup"):
        with t.span("load model"):
            clock.t += 3 * S
            with t.span("lora"):
                clock.t += 1 * S
            clock.t += 4 * S
        with t.span("compile warm-up"):
            clock.t += 1 * S
        clock.t += 1 * S
    with t.wait_input("rollouts"):
        clock.t += 2 * S
    first = t.drain()
    assert first["loaded"] == 102 * S + off and first["wait_us"] == {} and first["run_start"] is None
    t.started()
    with t.span("train step"):
        clock.t += 4 * S
    clock.t += 4 * S
    second = t.drain()
    assert second["loaded"] is None and second["startup_parts"] == {} and second["run_start"] == 118 * S + off
    c = TraceCollector(enabled=True)
    c.launched(100 * S)
    c.set_clock_offset("learner", off)
    c.add("learner", first)
    c.add("learner", second)
    a = c.aggregates()["processes"]["learner"]
    parts = {"process start": 2 * S, "imports": 3 * S, trace.WAITING_PROCESSES: 1 * S, "load model": 7 * S,
             "lora": 1 * S, "compile warm-up": 1 * S, "setup": 1 * S, trace.WAITING_SETUP: 2 * S}
    assert a["startup_parts"] == parts and a["window"] == [100 * S, 126 * S] and a["run_start"] == 118 * S
    assert a["state_us"] == {"busy": 4 * S, "wait_input": 0, "blocked_output": 0, "other": 4 * S, "startup": 18 * S}
    assert sum(parts.values()) == a["state_us"]["startup"] and a["wait_us"] == {}
    n = c.summary()["nodes"]["learner"]
    assert list(n["startup_parts"]) == ["process start", "imports", trace.WAITING_PROCESSES, "load model", "lora",
                                        "compile warm-up", "setup", trace.WAITING_SETUP]   # as they happen
    assert (n["startup_s"], n["setup_s"], n["waiting_s"], n["busy"], n["other"]) == (18.0, 10.0, 3.0, 0.5, 0.5)
    assert n["startup_window"] == [100 * S, 118 * S]
    row = next(x for x in c.report().splitlines() if x.strip().startswith("learner") and "load model" in x)
    assert row.split() == ["learner", "18.0", "2.0", "3.0", "10.0", "3.0", "load", "model", "7.0,", "lora", "1.0,",
                           "compile", "warm-up", "1.0,", "setup", "1.0"]

    path = tmp_path / "t.json"
    c.write(str(path))
    doc = _load(path)
    assert doc["otherData"]["dataflow"]["origin_us"] == 100 * S   # the run's time 0 is the launch
    startup = sorted((e["name"], e["ts"], e["dur"]) for e in doc["traceEvents"] if e.get("cat") == "startup")
    assert startup == [("compile warm-up", 14 * S, 1 * S), ("imports", 2 * S, 3 * S), ("load model", 6 * S, 8 * S),
                       ("lora", 9 * S, 1 * S), ("process start", 0, 2 * S), ("setup", 6 * S, 10 * S)]
    busy = [e for e in doc["traceEvents"] if e.get("cat") == "busy"]
    assert [(e["name"], e["ts"]) for e in busy] == [("train step", 18 * S)]
    png = tmp_path / "t.png"
    assert trace_cli.main([str(path), "--plot", str(png)]) == 0    # `python -m dataflow.trace`, in process
    assert c.report() in capsys.readouterr().out and png.stat().st_size > 10_000


def test_a_restarted_process_starts_up_inside_the_training_window():
    """A replica whose process died and came back: the new process's set-up is time the node
    spent in training ("other"), not start-up, and its parts do not add to the start-up's."""
    clock = FakeClock(0)
    t = starting_tracer("generator", clock, loaded_us=0)
    with t.span("setup"):
        clock.t = 2 * S
    t.started()
    with t.span("generate"):
        clock.t = 6 * S
    c = TraceCollector(enabled=False)
    c.launched(0)
    c.add("generator", t.drain())
    t2 = starting_tracer("generator", clock, loaded_us=6 * S)   # the new process
    with t2.span("setup"):
        clock.t = 9 * S
    t2.started()
    with t2.span("generate"):
        clock.t = 10 * S
    c.add("generator", t2.drain())
    n = c.summary()["nodes"]["generator"]
    assert (n["startup_s"], n["startup_parts"], n["window_s"]) == (2.0, {"setup": 2.0}, 8.0)
    assert (n["busy"], n["other"]) == (5 / 8, 3 / 8)


def test_a_trace_without_startup_parts_still_reads():
    """A trace written before start-up had parts (startup_spans, inclusive): its total still stands apart."""
    aggs = {"processes": {"critic": {
        "device": "cpu", "gpu": None, "window": [0, 100 * S], "run_start": 64 * S,
        "state_us": {"busy": 20 * S, "wait_input": 16 * S, "blocked_output": 0, "other": 0, "startup": 64 * S},
        "wait_us": {"with_ref": 16 * S}, "blocked_us": {}, "spans": {}, "startup_spans": {"setup": [1, 60 * S]},
        "dropped": 0}}, "gpus": {}}
    s = trace_report.summarize(aggs)
    assert s["nodes"]["critic"]["busy"] == 20 / 36 and s["nodes"]["critic"]["startup_parts"] == {}
    assert "start-up (s)" not in trace_report.format_report(s)
