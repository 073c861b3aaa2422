"""Where time goes, per node replica process: span recording (Tracer), drained by the driver's
TraceCollector (dataflow/trace/collector.py).

Every node replica process has one `Tracer`. Whether or not the run is traced it keeps, at the
cost of a few additions per span, the aggregates behind the end-of-run table:
  - time in four exclusive states. At any instant a process is busy if any busy span is open,
    else blocked on output if a `blocked_output` span is open, else waiting for input if a
    `wait_input` span is open, else "other". Open-span counters make this exact for concurrent
    asyncio tasks: the states add up to the window.
  - of the waiting (blocked) time, how much each input (output) channel accounts for: the idle
    causes. Only time in that exclusive state counts, so the channels add up to the state;
  - count and total time per busy span name;
  - on CUDA, two GPU busy sources (dataflow/trace/gpu.py). (a) NVML's utilization samples of the
    process's GPU (what nvidia-smi reads: samples every ~0.2 s of the percent of time one or more
    kernels ran), read at each drain (one driver call per ~0.5 s, nothing on the hot path). The per-GPU idle of the
    report comes from it whenever the samples cover the window. (b) CUDA events recorded on the current stream
    around each busy span, resolved lazily at drain() with `Event.query()` (never a sync) and
    placed on the host clock through an anchor event: exact in time but coarse in what counts
    (events bracket spans, not kernels: launch gaps inside a span count as busy). They draw the
    GPU's slices on the timeline and are the fallback when NVML is unavailable.
    With `--trace-kernels` a third, exact source replaces both in the report: every kernel's CUPTI
    record (torch.profiler, CUDA activity only; dataflow/trace/kernels.py), sent to the driver at
    the end.
    Measured against a CUDA-graph ground truth (bench/gpu_idle_check.py, H200): kernel records
    within ~1 point; NVML 2x too busy on launch-bound tiny kernels (22.6% vs 10.6%) and a few
    points too idle on back-to-back matmuls; span events count launch gaps as busy.
Start-up is its own state. In a node's tracer (`starting=True`) all time from its creation until
`started()` (the host calls it when the node's run() begins, after every node of the run is set up)
is "startup", whatever spans are open; waits then are no idle causes, and the spans opened then
("setup", "load model", ...) are drawn as "startup" slices. The start-up is split into exclusive
parts that add up to it (`startup_parts`): the innermost busy span open at each instant ("load
model", "compile warm-up"; "setup" for the set-up's own time), else WAITING_PROCESSES before the
first span and WAITING_SETUP after it. The drain also says when this module was loaded (`loaded`):
the host's module, before the node's module and what it imports (torch ...), so the collector adds
"process start" and "imports" in front (dataflow/trace/collector.py). Utilization and idle causes
are then figures of the training window only (dataflow/trace/report.py), start-up beside them.
It also knows which spans are open right now (open_spans()): what the process is doing or waiting
for at this instant, which the driver's stall diagnosis reads (dataflow/driver/stall.py).
With `enabled=True` (`--trace`) it also records Chrome trace events: X slices on named tracks
("compute" for work, "io" for waits), C counters and instants.

Size rule (the 5-minute CPU demo's trace stays far under 50 MB; about 110 bytes per event):
  1. Wait/blocked slices shorter than MIN_IDLE_EVENT_US (a recv that found an item ready) are not
     events. They still count in every aggregate.
  2. Per process and track (per name for counters and instants) at most MAX_EVENTS_PER_BUCKET events
     are kept per 2**BUCKET_SHIFT us (~0.13 s), i.e. <= ~190 events/s per track: a uniform random
     sample of that bucket's events (reservoir sampling); the rest are counted as dropped (the
     table notes how many). This bounds the memory and the poll messages of a busy process.
  3. At write time (TraceCollector.write), if the run still holds more than MAX_TRACE_EVENTS
     events, every k-th event of each track is kept, with k the smallest that fits; if the JSON
     still exceeds MAX_TRACE_BYTES (long names or args), k grows until it fits. The "utilization %" counters are never thinned.
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

import random
import time

from dataflow.trace.chrome import BUCKET_SHIFT, UTIL_COUNTER
from dataflow.trace.gpu import CudaTimer, NvmlUtilization

MIN_IDLE_EVENT_US = 50
MAX_EVENTS_PER_BUCKET = 25   # -> ~190 events/s per track

BUSY, WAIT_INPUT, BLOCKED_OUTPUT, OTHER, STARTUP = 0, 1, 2, 3, 4
KIND_NAMES = ("busy", "wait_input", "blocked_output")
_KIND_OF = {name: i for i, name in enumerate(KIND_NAMES)}
STATE_NAMES = KIND_NAMES + ("other", "startup")
# Start-up parts with no span open: before the first (the host waits for connect(), which the driver
# calls once every node's process is up) and after the set-up (until every node is set up).
WAITING_PROCESSES = "waiting for the other processes"
WAITING_SETUP = "waiting for the other nodes' set-up"
_LOADED_US = time.time_ns() // 1000  # when this process imported the trace (the host's module)


class Tracer:
    """Recorder for one node replica process. See the module docstring for what it keeps.

    Event tuples in `drain()["events"]` (process clock, integer us):
      ("X", name, track, ts, dur, kind, channel | None, args | None)   kind in KIND_NAMES
      ("C", name, ts, {series: value})
      ("i", name, ts, args | None)
    """

    def __init__(self, process_name: str, enabled: bool, device: str = "cpu", starting: bool = False):
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
        self._live: set = set()       # the spans open now (open_spans(): the driver's stall diagnosis)
        self.tally: dict | None = None  # while a dict: busy span name -> us, never drained (the host's setup parts)
        self._util_bucket = None      # utilization counter: current bucket, since when, us per state
        self._util_from = 0
        self._util_acc = [0, 0, 0, 0, 0]
        self._util_last = None
        self.starting = starting      # until started(): every microsecond is start-up (module docstring)
        self._loaded = _LOADED_US if starting else None  # said once, in the first drain
        self._set_up = False          # a span was opened while starting: the no-span time after it is WAITING_SETUP
        self._starting_spans: list = []  # busy spans opened while starting and still open, in order
        self._run_start = None        # when started() was called (process clock)
        self._state_t = self._window_start = self.now_us()
        self._reset_aggregates()
        self._gpu = CudaTimer(device, self.now_us) if device.startswith("cuda") else None
        self._nvml = NvmlUtilization.open(self._gpu.index, self.now_us) if self._gpu else None

    def now_us(self) -> int:
        """The process clock of every event: wall-clock microseconds, monotonic within the process.
        The host's clock() (offset measurement) must return this."""
        return (time.perf_counter_ns() + self._base_ns) // 1000

    def loaded_now(self) -> None:
        """This process was up and its modules imported before this tracer's run (a kept process,
        dataflow/driver/warm.py): no "process start" or "imports" in front of its start-up."""
        if self._loaded is not None:
            self._loaded = self.now_us()

    def started(self) -> None:
        """The node's run begins: start-up ends here, training time starts."""
        if self.starting:
            now = self.now_us()
            self._advance(now)
            self.starting, self._run_start = False, now
            self._starting_spans = []

    # ---- recording ------------------------------------------------------------------------------
    def span(self, name: str, track: str = "compute", **args) -> "_Span":
        """Context manager around a unit of busy work (counted in busy %; an X slice if enabled)."""
        return _Span(self, name, track, BUSY, None, args or None)

    def wait_input(self, channel: str) -> "_Span":
        """Context manager around waiting for an item on input `channel` (track "io")."""
        return _Span(self, "wait " + channel, "io", WAIT_INPUT, channel, None)

    def waiting(self, channel: str, name: str, track: str = "io") -> "_Span":
        """Context manager around waiting on something that is not an input channel (e.g. a
        generator's environment calls: channel "environment"), counted as waiting for input on
        `channel` while nothing is busy; several may be open at once (concurrent tasks)."""
        return _Span(self, name, track, WAIT_INPUT, channel, None)

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
        if self.starting:  # all start-up, whatever its kind (no idle cause)
            self._state_us[STARTUP] += dur
            self._startup_parts[name] = self._startup_parts.get(name, 0) + dur
            self._set_up = self._set_up or k == BUSY
        else:
            self._state_us[k] += dur
        if k == BUSY:
            self._count_span(name, dur)
        elif not self.starting:
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

    def open_spans(self) -> list[tuple[str, str, str | None, int]]:
        """(kind, name, channel | None, since us) of every span open now, oldest first: what this
        process is doing or waiting for at this instant (dataflow/driver/stall.py)."""
        return sorted(((KIND_NAMES[s._kind], s._name, s._channel, s._t0) for s in self._live), key=lambda s: s[3])

    def drain(self) -> dict:
        """Everything since the last drain; plain lists/dicts/numbers/strings (msgpack/pickle).

        {"process", "device", "gpu": label | None, "window": [t0, t1],
         "state_us": {kind, "other" or "startup": us}, "wait_us": {channel: us}, "blocked_us": {channel: us},
         "spans": {name: [count, us]}, "startup_parts": {part: us}, "run_start": us | None,
         "loaded": us | None (first drain of a starting tracer only),
         "events": [...], "dropped": int, "gpu_intervals": [[t0, t1]],
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
               "state_us": {k: us for k, us in zip(STATE_NAMES, self._state_us) if us or k != "startup"},
               "wait_us": self._wait_us, "blocked_us": self._blocked_us, "spans": self._spans,
               "startup_parts": self._startup_parts, "run_start": self._run_start, "loaded": self._loaded,
               "events": self._events, "dropped": self._dropped,
               "gpu_intervals": self._gpu.resolve() if self._gpu else [],
               "gpu_util": self._nvml.read() if self._nvml else []}
        self._window_start, self._loaded = now, None
        self._events, self._dropped = [], 0
        self._reset_aggregates()
        return out

    # ---- internals (hot path: keep cheap) -------------------------------------------------------
    def _reset_aggregates(self) -> None:
        self._state_us = [0, 0, 0, 0, 0]
        self._wait_us: dict = {}
        self._blocked_us: dict = {}
        self._spans: dict = {}
        self._startup_parts: dict = {}

    def _advance(self, now: int) -> None:
        """Credit the time since the last transition to the current exclusive state and, when
        idle, to the channels waited on (split evenly if several), so that a wait overlapping busy
        work of another task is not reported as an idle cause."""
        o = self._open
        state = STARTUP if self.starting else BUSY if o[BUSY] else BLOCKED_OUTPUT if o[BLOCKED_OUTPUT] \
            else WAIT_INPUT if o[WAIT_INPUT] else OTHER
        elapsed = now - self._state_t
        self._state_us[state] += elapsed
        if state == STARTUP and elapsed:
            part = self._startup_part()
            self._startup_parts[part] = self._startup_parts.get(part, 0) + elapsed
        if self.enabled:
            self._util_add(state, self._state_t, now)
        self._state_t = now
        if state == WAIT_INPUT or state == BLOCKED_OUTPUT:
            channels = self._open_channels[state]
            d = self._wait_us if state == WAIT_INPUT else self._blocked_us
            share = elapsed / len(channels)
            for ch in channels:
                d[ch] = d.get(ch, 0) + share

    def _startup_part(self) -> str:
        """The start-up part now: the innermost (latest opened) busy span, else a wait for the others."""
        if self._starting_spans:
            return self._starting_spans[-1]._name
        return WAITING_SETUP if self._set_up else WAITING_PROCESSES

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
            full = [0, 0, 0, 0, 0]
            full[state] = 1
            self._emit_util(end0, end0 + 1, full)
        self._util_acc = [0, 0, 0, 0, 0]
        self._util_acc[state] = t1 - (b1 << BUCKET_SHIFT)
        self._util_bucket, self._util_from = b1, b1 << BUCKET_SHIFT

    def _emit_util(self, t_from: int, t_to: int, acc: list) -> None:
        scale = 100 / max(1, t_to - t_from)
        values = {"busy": round(acc[BUSY] * scale, 1), "waiting": round(acc[WAIT_INPUT] * scale, 1),
                  "blocked": round(acc[BLOCKED_OUTPUT] * scale, 1)}
        if acc[STARTUP]:
            values["startup"] = round(acc[STARTUP] * scale, 1)
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
        if self.tally is not None:
            self.tally[name] = self.tally.get(name, 0) + dur
        if self.starting:   # its time is in startup_parts (_advance)
            return
        spans = self._spans
        s = spans.get(name)
        if s is None:
            spans[name] = [1, dur]
        else:
            s[0] += 1
            s[1] += dur

    def _record_slice(self, name, track, t0, t1, kind, channel, args) -> None:
        if kind != BUSY and t1 - t0 < MIN_IDLE_EVENT_US:
            return
        label = "startup" if self.starting and kind == BUSY else KIND_NAMES[kind]
        self._keep(track, t1, ("X", name, track, t0, t1 - t0, label, channel, args))

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
        t._live.add(self)
        if self._kind == BUSY:
            if t.starting:
                t._set_up = True
                t._starting_spans.append(self)
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
        t._live.discard(self)
        if self._kind == BUSY:
            if t._starting_spans and self in t._starting_spans:
                t._starting_spans.remove(self)
            t._count_span(self._name, now - self._t0)
            if self._cuda is not None:
                t._gpu.stop(self._cuda)
        else:
            t._open_channel(self._kind, self._channel, -1)
        if t.enabled:
            t._record_slice(self._name, self._track, self._t0, now, self._kind, self._channel, self._args)
        return False
