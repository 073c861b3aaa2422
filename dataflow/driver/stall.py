"""No silent stall: when the run makes no progress, say what every node waits for and which node is
at the root of the wait; then stop the run naming it (stall_action="stop") or keep waiting ("warn").

Two triggers, both checked by the driver between polls (StallWatch.check):
  - no step within the stall timeout: the graph's stall_timeout_s, or by default
    max(STALL_FLOOR_S, STALL_FACTOR x the slowest step so far), the floor covering start-up (the
    first step also loads and compiles). A node busy for longer than that (a stuck weight push, a
    generation that never ends) is named as the root.
  - a deadlock, sooner: at DEADLOCK_S apart, two snapshots in which every node that is still
    running waits (on a channel, a version, an ack) and nothing moved in between (no step, no
    item sent or received on any channel, no version published). Nothing can then ever happen,
    so waiting out the timeout would only delay the report (e.g. max_staleness=-1: the prompt
    source waits for a version that the learner publishes only after the prompts it holds back).

The wait graph (wait_graph): one entry per replica, from its host's wait_state()
(dataflow/actor/host.py): the spans open now in its tracer (busy work, waits for input, blocked outputs:
dataflow/trace/tracer.py), its version waits (ctx.wait_version, with the reason the node gave) and
a publish waiting for a subscriber's ack. A replica that waits points at the replicas that could
unblock it: the producers of the channel it reads, the consumers of the one it cannot send on, the
publisher of the version it waits for, the subscriber whose ack it waits for. A replica that does
not wait (busy, running code of its own, not answering, finished) points nowhere.

Where the roots are in their code: with each report the driver asks every running replica for its
threads' Python stacks (each host's StackServer, on a thread and a socket of its own outside Ray,
so a node that blocks its event loop answers too; dataflow/actor/stacks.py). The report shows the roots' stacks in a
few lines each, and <run>/stall-<n>.txt holds every replica's in full.

An early look (Graph.stall_warn_s, default 120 s): a quiet spell longer than that, and than
twice the slowest step, but shorter than the stall timeout prints the same report once and the
run goes on. The 300 s floor exists for slow first steps, yet a hang at start-up then says nothing
for 5 minutes; this says where every node is after 2.

Roots (roots_of): the sinks of that graph, found by its strongly connected components. A sink that
is one replica that does not wait is the root (the node that is busy, or waits on something no
one will produce). A sink that is a cycle is a deadlock: its root is the replica whose wait closes
the cycle (a version wait or a feedback channel: every other edge follows the graph's acyclic
channels), or all of them if none does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from dataflow.actor import stacks as thread_stacks

from dataflow.driver.failures import gather_named
from dataflow.timeouts import wait_within
from dataflow.graph import Graph

STALL_FLOOR_S = 300.0   # default stall timeout before the slowest step says more (start-up, first step)
STALL_FACTOR = 5.0      # default stall timeout: this many times the slowest step so far
DEADLOCK_S = 20.0       # every node waiting, nothing moving, for this long: a deadlock
SNAPSHOT_EVERY_S = 5.0  # how often the driver asks the hosts what they wait for
ANSWER_TIMEOUT_S = 5.0  # a host that does not answer wait_state() within this is "not answering"
STACKS_TIMEOUT_S = 10.0  # a stack server answers on a thread of its own, even from a blocked host:
#                         longer, since only a C call holding the GIL keeps it from answering (a
#                         loaded 2-core CI machine once took over 2 s to answer a spinning node)


class RunStalled(Exception):
    """The run made no progress; `roots` are the replicas at the root of the wait."""

    def __init__(self, roots: list[str], summary: str, report: str):
        super().__init__(summary)
        self.roots, self.summary, self.report = roots, summary, report


@dataclass
class Wait:
    """One replica in the wait graph."""

    replica: str
    what: list[str] = field(default_factory=list)   # what it is doing or waiting for, for the user
    on: dict[str, bool] = field(default_factory=dict)  # replica it waits for -> that wait closes loops
    waiting: bool = False                            # False: busy, its own code, not answering, finished
    finished: bool = False


def wait_graph(graph: Graph, states: dict[str, dict | None]) -> dict[str, Wait]:
    """The wait graph of replicas from their hosts' wait_state() (None: did not answer)."""
    producers = {ch: [p for p in graph.producers(ch) if p in states] for ch in graph.channels}
    consumers = {ch: [c for c in graph.consumers(ch) if c in states] for ch in graph.channels}
    waits = {}
    for name, state in states.items():
        w = waits[name] = Wait(name)
        if state is None:
            w.what.append("does not answer the driver: its event loop is blocked (code that never awaits, "
                          "e.g. a loop or a synchronous call in the node)")
            continue
        if state["phase"] == "finished":
            w.what.append("finished (its run() returned)")
            w.finished = True
            continue
        if state["phase"] != "running":
            w.what.append(f"in {state['phase']}")
            continue
        now, stats = state["now_us"], state["channels"]
        since = lambda t0: f"for {max(0, now - t0) / 1e6:.0f} s"  # noqa: E731
        for kind, span, channel, t0 in state["spans"]:
            if kind == "busy":
                w.what.append(f"busy in '{span}' {since(t0)}")
            elif kind == "wait_input":
                s = stats.get(channel, {})
                open_ = list(producers.get(channel, ()))
                w.what.append(f"waits for input on '{channel}' ({s.get('depth', 0)} buffered; "
                              f"producer{'s' if len(open_) != 1 else ''}: {', '.join(open_) or 'none'}) {since(t0)}")
                feedback = graph.channels[channel].feedback if channel in graph.channels else False
                w.on.update({p: feedback for p in open_})
            else:
                s = stats.get(channel, {})
                w.what.append(f"blocked sending on '{channel}' (full: {s.get('depth', '?')} of "
                              f"{s.get('capacity', '?')}; consumers: {', '.join(consumers.get(channel, ())) or 'none'}) "
                              f"{since(t0)}")
                w.on.update({c: False for c in consumers.get(channel, ())})
        for edge, version, has, why, t0 in state["versions"]:
            spec = graph.versioned_edges.get(edge)
            publishers = [r for r in graph.nodes[spec.src].replica_names() if r in states] if spec else []
            w.what.append(f"waits for '{edge}' version >= {version} (has {has}) from {', '.join(publishers) or '?'}"
                          f"{': ' + why if why else ''} {since(t0)}")
            w.on.update({p: True for p in publishers})
        if state["publishing"]:
            edge, version, subscriber, t0 = state["publishing"]
            w.what.append(f"pushing '{edge}' v{version} to {subscriber}: no ack {since(t0)}")
            w.on.setdefault(subscriber, False)
        busy = any(kind == "busy" for kind, *_ in state["spans"])
        w.waiting = bool(w.on) and not busy
        if not w.what:
            w.what.append("running its own code (in no channel, version or push wait)")
        if busy:
            w.on = {}
    return waits


def roots_of(waits: dict[str, Wait]) -> tuple[list[str], list[str]]:
    """(roots, the cycle they close or []) of the wait graph: see the module docstring."""
    sccs = _strongly_connected(waits)
    component = {r: i for i, scc in enumerate(sccs) for r in scc}
    waited_on = {t for w in waits.values() for t in w.on}
    roots, cycle = [], []
    for i, scc in enumerate(sccs):
        if any(component[t] != i for r in scc for t in waits[r].on):
            continue  # not a sink: something outside it can still unblock it
        if len(scc) == 1 and not waits[scc[0]].on.get(scc[0]):
            r = scc[0]
            if waits[r].finished and r not in waited_on:
                continue  # a source that ended normally: nobody is stuck on it
            roots.append(r)
            continue
        closing = [r for r in scc if any(component[t] == i and loops for t, loops in waits[r].on.items())]
        roots += closing or scc
        cycle += _in_wait_order((closing or scc)[0], set(scc), waits)
    if not roots:  # nothing waits on anyone: every node is busy (or finished)
        roots = [r for r, w in waits.items() if not w.finished]
    return roots, cycle


def _in_wait_order(start: str, members: set[str], waits: dict[str, Wait]) -> list[str]:
    """The cycle's replicas from `start`, each followed by one it waits for, back to `start`."""
    order, current = [start], start
    while True:
        current = next((t for t in waits[current].on if t in members and t not in order[1:]), start)
        order.append(current)
        if current == start or len(order) > len(members):
            return order


def _strongly_connected(waits: dict[str, Wait]) -> list[list[str]]:
    """Tarjan's algorithm over the (small) wait graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for t in waits[v].on:
            if t not in waits:
                continue
            if t not in index:
                visit(t)
                low[v] = min(low[v], low[t])
            elif t in on_stack:
                low[v] = min(low[v], index[t])
        if low[v] == index[v]:
            scc = []
            while True:
                t = stack.pop()
                on_stack.discard(t)
                scc.append(t)
                if t == v:
                    break
            out.append(sorted(scc))

    for v in waits:
        if v not in index:
            visit(v)
    return out


def report(waits: dict[str, Wait], roots: list[str], cycle: list[str], headline: str,
           stacks: dict[str, list | None] | None = None, stacks_file: str | None = None) -> str:
    """The lines the user sees: the headline, each replica and what it waits for, the root, and
    under each root where its code is (`stacks`: replica -> its threads (stacks.capture), None: no answer)."""
    width = max(len(r) for r in waits)
    lines = [headline]
    for r, w in waits.items():
        mark = "   <- root" if r in roots else ""
        lines.append(f"  {r:<{width}}  {w.what[0]}{mark}")
        lines += [f"  {'':<{width}}  {more}" for more in w.what[1:]]
        if stacks is not None and r in roots and r in stacks:
            lines += [f"  {'':<{width}}    {s}" for s in thread_stacks.replica_lines(stacks[r])]
    lines.append("  root of the wait: " + root_summary(waits, roots, cycle))
    if stacks_file:
        lines.append(f"  every replica's threads, in full: {stacks_file}")
    return "\n".join(lines)


def root_summary(waits: dict[str, Wait], roots: list[str], cycle: list[str]) -> str:
    text = "; ".join(f"{r} {waits[r].what[0]}" for r in roots)
    if cycle:
        text += f" (a cycle of waits no node can break: {' -> '.join(cycle)})"
    return text


class StallWatch:
    """The driver's stall timer and deadlock detector (see the module docstring)."""

    def __init__(self, graph: Graph, run_dir: str | Path | None = None, stack_servers: dict | None = None):
        self.graph = graph
        self.run_dir = Path(run_dir) if run_dir is not None else None  # where stall-<n>.txt go
        # replica -> its host's StackServer address; the runtime's dict, kept current across restarts
        self.stack_servers = stack_servers if stack_servers is not None else {}
        self.reports = 0
        self.looked_early = False  # the stall_warn_s report of this quiet spell is out
        self.t_last_step = time.monotonic()
        self.slowest_step_s = 0.0
        self.steps = 0
        self.t_snapshot = 0.0
        self.deadlock_since: tuple[float, tuple] | None = None  # (when, progress signature) all waited
        self.warned_at: float | None = None

    def started(self) -> None:
        self.t_last_step = time.monotonic()

    def stepped(self, steps: int) -> None:
        """The driver saw `steps` steps in all (called after each poll)."""
        if steps != self.steps:
            now = time.monotonic()
            self.slowest_step_s = max(self.slowest_step_s, (now - self.t_last_step) / max(1, steps - self.steps))
            self.t_last_step, self.steps, self.deadlock_since, self.warned_at = now, steps, None, None
            self.looked_early = False

    def timeout_s(self) -> float:
        if self.graph.stall_timeout_s:
            return float(self.graph.stall_timeout_s)
        return max(STALL_FLOOR_S, STALL_FACTOR * self.slowest_step_s)

    def early_look_s(self) -> float | None:
        """When a quiet spell gets its early report (see the module docstring); None: none."""
        warn_s = self.graph.stall_warn_s
        if warn_s is None or warn_s <= 0:
            return None
        at = max(float(warn_s), 2 * self.slowest_step_s)
        return at if at < self.timeout_s() else None

    async def check(self, hosts: dict, running: set[str]) -> None:
        """Raise RunStalled (or, with stall_action="warn", print the report once per timeout)
        when the run is stalled; a no-op between snapshots."""
        if self.graph.stall_timeout_s is not None and self.graph.stall_timeout_s < 0:
            return  # stall detection off
        now = time.monotonic()
        quiet_s = now - self.t_last_step
        timed_out = quiet_s >= self.timeout_s() and (self.warned_at is None or now - self.warned_at >= self.timeout_s())
        early_s = self.early_look_s()
        early = early_s is not None and quiet_s >= early_s and not self.looked_early
        if not (timed_out or early) and now - self.t_snapshot < SNAPSHOT_EVERY_S:
            return
        self.t_snapshot = now
        states = await snapshot({n: h for n, h in hosts.items()}, running)
        waits = wait_graph(self.graph, states)
        progress = _progress(states, self.steps)
        deadlocked = False
        if all(w.waiting or w.finished for w in waits.values()) and any(w.waiting for w in waits.values()):
            if self.deadlock_since is None or self.deadlock_since[1] != progress:
                self.deadlock_since = (now, progress)
            deadlocked = now - self.deadlock_since[0] >= DEADLOCK_S
        else:
            self.deadlock_since = None
        if early and not (timed_out or deadlocked):
            self.looked_early = True
            headline = (f"[dataflow] no step for {quiet_s:.0f} s (the run goes on; stall timeout {self.timeout_s():.0f} s). "
                        "Where each node is:")
            text, _, _ = await self._report(hosts, running, waits, headline)
            print(text + "\n  (Graph(stall_warn_s=...) sets when this shows; None turns it off)", flush=True)
            return
        if not (timed_out or deadlocked) or (deadlocked and not timed_out and self.warned_at is not None):
            return
        if deadlocked:
            headline = (f"[dataflow] stalled: every node waits and nothing has moved for {now - self.deadlock_since[0]:.0f} s "
                        f"(no step for {quiet_s:.0f} s). What each node waits for:")
        else:
            headline = (f"[dataflow] stalled: no step for {quiet_s:.0f} s (stall timeout {self.timeout_s():.0f} s). "
                        "What each node waits for:")
        text, roots, summary = await self._report(hosts, running, waits, headline)
        if self.graph.stall_action == "warn":
            print(text + "\n  (stall_action='warn': still waiting)", flush=True)
            self.warned_at = now
            return
        raise RunStalled(roots, summary, text)

    async def _report(self, hosts: dict, running: set[str], waits: dict[str, Wait],
                      headline: str) -> tuple[str, list[str], str]:
        """(report text, roots, root summary), every replica's stacks written to stall-<n>.txt."""
        roots, cycle = roots_of(waits)
        stacks = await gather_stacks({n: self.stack_servers.get(n) for n in hosts if n in running})
        self.reports += 1
        path = self.run_dir / f"stall-{self.reports}.txt" if self.run_dir is not None else None
        text = report(waits, roots, cycle, headline, stacks, str(path) if path else None)
        if path is not None:
            try:
                thread_stacks.write_file(path, text, stacks)
            except OSError as e:  # a full disk must not hide the report itself
                text = text.replace(str(path), f"{path} (could not write it: {e})")
        return text, roots, root_summary(waits, roots, cycle)


async def snapshot(hosts: dict, running: set[str]) -> dict[str, dict | None]:
    """Every replica's wait_state() (None: no answer within ANSWER_TIMEOUT_S); a replica whose
    run() has returned is "finished" without asking."""
    asking = {n: h.wait_state.remote() for n, h in hosts.items() if n in running}
    try:
        replies = await wait_within(gather_named(asking), ANSWER_TIMEOUT_S)
    except asyncio.TimeoutError:  # ask again one by one, so those that answer still count
        replies = {}
        for name, ref in asking.items():
            try:
                replies[name] = await wait_within(ref, 0.1)
            except Exception:  # noqa: BLE001 - not answering, or dead (its run() result says which)
                replies[name] = None
    states = {n: (r if isinstance(r, dict) else None) for n, r in replies.items()}
    for name in hosts:
        states.setdefault(name, {"phase": "finished"})
    return {n: states[n] for n in hosts}


async def gather_stacks(servers: dict[str, tuple | None]) -> dict[str, list | None]:
    """Every running replica's threads from its stack server (None: no answer within
    STACKS_TIMEOUT_S, e.g. a C call that never releases the GIL)."""
    async def one(address):
        if address is None:
            return None
        try:
            return await wait_within(thread_stacks.ask(address), STACKS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - not answering, or gone
            return None
    replies = await gather_named({n: one(a) for n, a in servers.items()})
    return {n: (r if isinstance(r, list) else None) for n, r in replies.items()}


def _progress(states: dict[str, dict | None], steps: int) -> tuple:
    """What changes whenever anything moves: steps, items through each channel end, versions."""
    sig = [steps]
    for name, s in sorted(states.items()):
        if s and s.get("phase") == "running":
            sig += [(name, ch, st.get("total", 0)) for ch, st in sorted(s["channels"].items())]
            sig += sorted((name, edge, v) for edge, v in s.get("latest", {}).items())
    return tuple(sig)
