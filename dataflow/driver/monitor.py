"""The driver's view of a running graph: host events in, progress lines, metrics.jsonl, the trace
and the end-of-run summary out (Monitor); which process hosts which replica, and its restarts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dataflow.actor import checkpoint
from dataflow.config import flatten
from dataflow.driver.failures import awaitable, discard, result_of
from dataflow.graph import Graph
from dataflow.driver.loggers import RunLoggers
from dataflow.trace.collector import TraceCollector
from dataflow.trace.tracer import Tracer

if TYPE_CHECKING:
    from dataflow.driver.options import RunOptions


@dataclass
class RunSummary:
    status: str
    steps: int
    seconds: float
    run_dir: str
    metrics_path: str
    artifacts: dict = field(default_factory=dict)
    report: str = ""
    restarts: dict = field(default_factory=dict)
    """Replica -> times its process died and it was restarted."""
    alerts: dict = field(default_factory=dict)
    """The graph's alert counters that are not zero (Graph.alerts): failed rewards, skipped lines..."""
    notes: list = field(default_factory=list)
    """Lines the user must read about how the run ended (e.g. the data ran out before max steps)."""
    startup: dict = field(default_factory=dict)
    """Where the start-up went, s: "total" (Ray up -> every node set up), "ray" (before that),
    "actors" (every actor process answering), "setup" (then every node's setup), "setup/<replica>";
    from the CLI also "driver" (its own seconds before Ray: process start, the graph, the checks) and
    "driver/<part>"."""


POLL_TIMEOUT_S = 5.0  # a host that does not answer a poll within this is skipped until it does


class Monitor:
    """Turns host events into progress lines, metrics.jsonl and the trace/idle report."""

    def __init__(self, graph: Graph, run_dir: Path, options: RunOptions, config: Any,
                 resume: Path | None = None, resume_step: int = 0):
        self.graph = graph
        self.options = options
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        if resume is not None:  # keep the records up to the checkpoint's step, then append
            checkpoint.continue_metrics(resume.parent.parent / "metrics.jsonl", self.metrics_path, resume_step)
        self.metrics_file = open(self.metrics_path, "a" if resume is not None else "w")
        self.checkpoint_requests: list[tuple[str, int]] = []
        self.last_checkpoint: Path | None = resume
        self.restarts: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.stack_servers: dict[str, list] = {}  # replica -> its StackServer's address (dataflow/actor/stacks.py)
        self.acked: dict[str, tuple[int, int]] = {}  # replica -> (pid, seq) of the last event handled
        self.trace = TraceCollector(enabled=options.trace_path is not None)
        # Run-level counters (queue depths, staleness) live on a driver track of the same trace.
        self.driver_tracer = Tracer("driver", enabled=options.trace_path is not None)
        self.t_start = time.time()
        self.trace.launched(self.t_start * 1e6)  # the nodes' start-up counts from here (Ray up), as RunSummary.startup
        self.t_running = None
        self.ray_s = 0.0                             # ray.init (or connecting), before t_start
        self.phases: dict[str, float] = {}           # start-up phase -> its end, s after t_start
        self.setup_s: dict[str, float] = {}          # replica -> its node's setup seconds
        self.setup_parts: dict[str, dict[str, float]] = {}  # replica -> {span its setup opened: seconds}
        self.startup: dict[str, float] = {}          # RunSummary.startup, set by started()
        self.step = resume_step
        self.depths: dict[str, int] = {}
        self.artifacts: dict[str, str] = {}
        self.notes: list[str] = []
        self._polls: dict[str, asyncio.Future] = {}  # replica -> its poll() in flight
        self._alert_totals: dict[tuple[str, str], float] = {}  # (key, replica) -> latest running total
        self._alert_counts: dict[str, float] = {}  # key -> sum of the amounts reported
        # The run's settings, which --resume starts from (dataflow/driver/resume.py): here and in every
        # checkpoint's manifest.
        self.settings: dict | None = None
        self.padding_tokens: dict[str, float] = {}  # "<node>/tokens_processed|real" summed: padding in the summary
        if config is not None and dataclasses.is_dataclass(config):
            self.settings = {k: _jsonable(v) for k, v in flatten(config)}
            (run_dir / "config.json").write_text(json.dumps(self.settings, indent=1))
        self.loggers = RunLoggers(run_dir, graph.loggers, self.settings, graph.name, resume is not None)  # dataflow/driver/loggers.py

    def processes(self, pids: dict, stack_servers: dict) -> None:
        """Which process hosts which replica: <run>/processes.json (for kill tests and operators)."""
        self.pids.update(pids)
        self.stack_servers.update(stack_servers)
        (self.run_dir / "processes.json").write_text(json.dumps(self.pids, indent=1))

    def restarted(self, name: str, setup: dict, state_dir: Path | None) -> None:
        """`setup`: its host's connect() reply, from its new process."""
        self.processes({name: setup["pid"]}, {name: setup["stacks"]})
        record = {"time_s": round(time.time() - (self.t_running or self.t_start), 3), "node": "driver",
                  "restarted": name, "state_from": str(state_dir) if state_dir else None,
                  "restarts/total": sum(self.restarts.values()),
                  **{f"restarts/{n}": k for n, k in self.restarts.items()}}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()

    def mark(self, phase: str, setup_s: dict[str, float] | None = None,
             setup_parts: dict[str, dict[str, float]] | None = None) -> None:
        """The end of a start-up phase ("actors": every actor process answers; "setup": every node
        set up, with each replica's own setup seconds and the spans its setup opened), for the
        running line and RunSummary.startup."""
        self.phases[phase] = time.time() - self.t_start
        if setup_s is not None:
            self.setup_s = setup_s
        if setup_parts is not None:
            self.setup_parts = setup_parts

    def started(self) -> None:
        """Say where the start-up went (also RunSummary.startup): it counts from Ray being up
        (ray_s before it) to every node set up (and its state loaded on --resume)."""
        self.t_running = time.time()
        total = self.t_running - self.t_start
        actors = self.phases.get("actors", 0.0)
        setup = self.phases.get("setup", total) - actors
        slowest = max(self.setup_s, key=self.setup_s.get) if self.setup_s else None
        parts = f"actor processes {actors:.1f} s, node setup {setup:.1f} s" + (
            f" (slowest {slowest}: {self.setup_s[slowest]:.1f} s)" if slowest else "")
        driver = self.options.driver_parts
        before = f"Ray started {self.ray_s:.1f} s before" + (
            f", after the command's own {sum(driver.values()):.1f} s ("
            + ", ".join(f"{name} {s:.1f}" for name, s in driver.items()) + ")" if driver else "")
        self.say(f"[dataflow] graph '{self.graph.name}' running: {len(self.graph.nodes)} nodes, "
                 f"start-up {total:.1f} s ({parts}; {before}); metrics -> {self.metrics_path}")
        self.startup = {**({"driver": round(sum(driver.values()), 3)} if driver else {}),
                        **{f"driver/{name}": round(s, 3) for name, s in driver.items()},
                        "total": round(total, 3), "ray": round(self.ray_s, 3), "actors": round(actors, 3),
                        "setup": round(setup, 3), **{f"setup/{n}": s for n, s in self.setup_s.items()},
                        **{f"setup/{n}/{part}": s for n, parts in self.setup_parts.items() for part, s in parts.items()}}

    def say(self, text: str) -> None:
        if not self.options.quiet:
            print(text, flush=True)

    async def poll(self, hosts: dict, timeout_s: float = POLL_TIMEOUT_S) -> None:
        """Handle every host's events since the last poll. One poll per host is in flight at a
        time: a host whose event loop is blocked (a node that never awaits) does not hold up the
        others, the progress lines or the stall check (dataflow/driver/stall.py); its events come later.
        Waits at most `timeout_s` for them."""
        for name, host in hosts.items():
            if name not in self._polls:
                self._polls[name] = asyncio.ensure_future(awaitable(host.poll.remote(self.acked.get(name))))
        await asyncio.wait(self._polls.values(), timeout=timeout_s)
        replies = {n: result_of(f) for n, f in self._polls.items() if f.done()}
        for name in replies:
            del self._polls[name]
        depths: dict[str, int] = {}
        for name, reply in replies.items():
            if isinstance(reply, BaseException):
                continue  # a dead host is reported by its run() result
            self.trace.add(name, reply["trace"])
            for key, value in reply["depths"].items():
                ch = key.split(":", 1)[1]
                depths[ch] = depths.get(ch, 0) + value
            pid, seq = self.acked.get(name, (reply["pid"], -1))
            if pid != reply["pid"]:  # a restarted process: its events count from 0
                seq = -1
            for event in reply["events"]:
                if event["seq"] > seq:  # not handled yet (a lost reply's events come again)
                    self._handle(name, event)
                    seq = event["seq"]
            self.acked[name] = (reply["pid"], seq)
        self.depths = depths
        if depths:
            self.driver_tracer.counter("queue depth", **depths)
            self.driver_tracer.counter("samples in flight", items=sum(depths.values()))
        self.trace.add("driver", self.driver_tracer.drain(), node=False)

    def _handle(self, name: str, event: dict) -> None:
        kind = event["kind"]
        if kind == "log":
            self.say(f"[{name}] {event['text']}")
        elif kind == "artifact":
            self.artifacts[event["name"]] = event["path"]
        elif kind == "checkpoint":
            self.checkpoint_requests.append((name, event["step"]))
        elif kind in ("step", "metrics"):
            values = dict(event["values"])
            rollouts = values.pop("rollouts", None)   # to rollouts.jsonl and TensorBoard, not here
            record = {"time_s": round(event["t"] - (self.t_running or self.t_start), 3), "node": name}
            if kind == "step":
                self.step = event["step"]
                record["step"] = event["step"]
            record.update({k: _jsonable(v) for k, v in values.items()})
            for k in (k for k in values if k.endswith(("/tokens_processed", "/tokens_real"))):
                self.padding_tokens[k] = self.padding_tokens.get(k, 0) + values[k]
            record.update({f"queue/{ch}": d for ch, d in self.depths.items()})
            self._count_alerts(name, values)
            if values:
                self.metrics_file.write(json.dumps(record) + "\n")
                self.metrics_file.flush()
            line = self.loggers.record(record, self.step, rollouts)   # validation rounds print a line
            if line:
                self.say(line)
            if kind == "step":
                self.say(self._progress_line(event["step"], values))
                if "staleness/mean" in values:
                    self.driver_tracer.counter("staleness", mean=values["staleness/mean"],
                                               max=values.get("staleness/max", 0))

    def _progress_line(self, step: int, values: dict) -> str:
        parts = [f"step {step:>4}"]
        keys = self.graph.progress or [k for k, v in values.items() if isinstance(v, (int, float))]
        for key in keys:
            if "±" in key:
                a, b = key.split("±")
                if a in values:
                    parts.append(f"{a.split('/')[0]} {values[a]:.3f} ± {values.get(b, float('nan')):.3f}")
            elif key in values:
                v = values[key]
                label = key.split("/")[0] if key.endswith("/mean") else key.split("/")[-1]
                parts.append(f"{label} {v:.4g}" if isinstance(v, float) else f"{label} {v}")
        if self.depths:
            parts.append("queues " + " ".join(f"{c}:{d}" for c, d in self.depths.items()))
        alerts = self.alerts()
        if alerts:
            parts.append("! " + " ".join(f"{k} {_short(v)}" for k, v in alerts.items()))
        return " | ".join(parts)

    def _count_alerts(self, replica: str, values: dict) -> None:
        for key, value in values.items():
            mode = self.graph.alerts.get(key) or next(
                (m for prefix, m in self.graph.alerts.items() if prefix.endswith("/") and key.startswith(prefix)), None)
            if mode is None or not isinstance(value, (int, float)):
                continue
            if mode == "count":
                self._alert_counts[key] = self._alert_counts.get(key, 0) + value
            else:
                self._alert_totals[(key, replica)] = value

    def alerts(self) -> dict:
        """The graph's alert counters that are not zero, summed over replicas (Graph.alerts)."""
        found = dict(self._alert_counts)
        for (key, _), value in self._alert_totals.items():
            found[key] = found.get(key, 0) + value
        if self.restarts and "restarts/total" in self.graph.alerts:
            found["restarts/total"] = sum(self.restarts.values())
        return {k: v for k, v in sorted(found.items()) if v}

    def close(self) -> None:
        discard(self._polls.values())
        self._polls = {}
        self.metrics_file.close()

    def finish(self, status: str) -> RunSummary:
        self.metrics_file.close()
        seconds = time.time() - self.t_start
        report = self.trace.report()
        for label, k in self.trace.kernel_idle().items():
            nvml = "n/a" if k["nvml_idle"] is None else f"{100 * k['nvml_idle']:.1f}%"
            report += (f"\n  {label}: GPU idle {100 * k['kernels_idle']:.1f}% from kernel records (used above), "
                       f"{nvml} from NVML samples, {100 * k['events_idle']:.1f}% from CUDA events around spans "
                       f"(same window, {k['window_s']:.1f} s)")
        padding = {k.split("/")[0]: 1 - self.padding_tokens.get(k.replace("processed", "real"), 0) / v
                   for k, v in self.padding_tokens.items() if k.endswith("/tokens_processed") and v}
        if padding:
            report += "\n  padding (of the tokens processed): " + ", ".join(
                f"{n} {100 * f:.1f}%" for n, f in padding.items())
        if self.options.trace_path:
            self.trace.write(self.options.trace_path)
            self.artifacts["trace"] = self.options.trace_path
        report += ("\n" + self.loggers.close()).rstrip()   # the validation rounds, before and after
        return RunSummary(status, self.step, seconds, str(self.run_dir), str(self.metrics_path),
                          dict(self.artifacts), report, dict(self.restarts), self.alerts(), list(self.notes),
                          dict(self.startup))


def _short(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if hasattr(v, "item"):
        return v.item()
    return str(v)
