"""Graph declaration: nodes, channels and versioned edges, checked before any actor starts.

A graph file (graphs/ppo.py) is plain Python:

    config = PPOConfig()                      # optional: a dataclass tree that --set overrides
    def build(config) -> Graph:               # or a module-level `graph = Graph(...)`
        g = Graph("ppo", config=config)       # resolves the config's shared settings (dataflow/config.py)
        g.node("prompts", PromptSource, config.prompts)
        g.node("generator", Generator, config.generator, side="rollout", replicas=2)
        g.node("learner", Learner, config.learner, side="train")
        g.channel("prompts.prompts", "generator.prompts", capacity=16)
        g.versioned("policy", src="learner", dst=["generator", "prompts"])
        g.place("colocated", num_gpus=1)      # a GPU preset for the side nodes (dataflow/presets.py)
        return g

or, by hand: g.pool("gpus", gpus=1) and g.node(..., pool="gpus", gpus=0.5) (dataflow/placement.py).
Every declaration remembers the file:line it was made on, so validation errors point at it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from dataflow.errors import GraphError
from dataflow.validation import graph_problems, is_node_class

# Counters of trouble the user must see without opening metrics.jsonl (Graph.alerts): failed and
# timed-out rewards, skipped data lines, channel items dropped undecoded, restarted processes.
DEFAULT_ALERTS = {"reward/failed_total": "total", "reward/timeouts_total": "total", "reward/failed": "count",
                  "data/skipped_lines": "total", "channel/bad_items/": "total", "restarts/total": "total",
                  "prompts/duplicates_dropped": "total"}
RUN_SETTINGS = ("max_steps", "save_interval", "keep_checkpoints", "async_checkpoint", "max_restarts",
                "drop_bad_items", "stall_timeout_s", "stall_action", "stall_warn_s", "loggers")
"""Graph fields that Graph(config=...) takes from the config's fields of the same names."""


def _caller_location() -> str:
    """file:line of the first frame outside the engine's declaration code (where the user declared
    the thing; a pool a preset declares: the g.place line; the weight edges: the policy_edge line)."""
    from dataflow import presets
    from dataflow.weights import edges

    engine = {__file__, presets.__file__, edges.__file__}
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in engine:
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "?"


@dataclass
class NodeSpec:
    name: str
    kind: type
    config: Any
    cpus: float
    gpus: float
    replicas: int
    where: str
    ends_run: bool = False
    pool: str | None = None
    side: str | None = None
    """A GPU preset's side ("rollout" / "train") that places this node (dataflow/presets.py)."""
    memory_cap: float = 0.0
    """The fraction of its GPU this node's allocator may use, where it is more than its share
    `gpus` (0 = its share): a memory plan whose phases take turns on one GPU lends a node the room
    another frees between phases (rl/model/applied_plan.py, phase switch). Ray still counts `gpus`."""
    gpu_turn: str = ""
    """The lock file through which the nodes of a memory plan's phase switch take turns on their
    GPU (rl/model/gpu_turns.py; the plan sets it on the generator and the learner; "" = none)."""
    memory_note: str = ""
    """What a memory plan says this node holds and the setting that lowers it (graphs/rlhf.py sets
    it): an out-of-memory error in the node says it (dataflow/actor/host.py)."""

    @property
    def restartable(self) -> bool:
        """Whether a replica whose process died may be restarted alone: not the run-ending node,
        not a rank of a multi-rank job (inputs_on_replica_0 with several replicas), which cannot
        rejoin its running process group, and not a kind that says it cannot be (restart_refusal)."""
        ranks_of_one_job = self.replicas > 1 and getattr(self.kind, "inputs_on_replica_0", False)
        return not self.ends_run and not ranks_of_one_job and not self.restart_refusal

    @property
    def restart_refusal(self) -> str:
        """The node kind's reason it cannot be restarted with this config ("" if none)."""
        refusal = getattr(self.kind, "restart_refusal", None)
        return refusal(self.config) if refusal is not None else ""

    def replica_names(self) -> list[str]:
        if self.replicas == 1:
            return [self.name]
        return [f"{self.name}[{i}]" for i in range(self.replicas)]


@dataclass
class PoolSpec:
    name: str
    gpus: int
    strategy: str
    where: str


@dataclass
class ChannelSpec:
    name: str
    src: list[tuple[str, str]]  # (node, port) producers
    dst: list[tuple[str, str]]  # (node, port) consumers
    capacity: int
    feedback: bool
    where: str


@dataclass
class VersionedSpec:
    name: str
    src: str
    dst: list[str]
    where: str
    timeout_s: float = 300.0
    auto: bool = False
    """Declared by node() for the ranks of a multi-rank node (listed after the graph's own edges)."""


@dataclass
class Graph:
    """A dataflow graph. Declare with node(), channel(), versioned(); the runtime validates it."""

    name: str = "graph"
    nodes: dict[str, NodeSpec] = field(default_factory=dict)
    channels: dict[str, ChannelSpec] = field(default_factory=dict)
    versioned_edges: dict[str, VersionedSpec] = field(default_factory=dict)
    pools: dict[str, PoolSpec] = field(default_factory=dict)
    progress: list[str] = field(default_factory=list)
    """Metric keys printed on each step's progress line ("a±b" prints a ± b; all when empty)."""
    max_steps: int | None = None
    """Steps after which the run ends (the --max-steps flag overrides it)."""
    save_interval: int = 0
    """Checkpoint every this many steps, and on Ctrl-C / SIGTERM (0 = never; dataflow/actor/checkpoint.py)."""
    keep_checkpoints: int = 3
    """Committed checkpoints kept in the run directory; older ones are deleted once a newer one
    commits (0 = keep all)."""
    async_checkpoint: bool = True
    """Write checkpoints in the background (dataflow/driver/checkpointer.py): training waits only while
    every replica copies its state to CPU memory, not for the files to reach the disk. The copy
    lives until the files are written: host memory for the state is twice its size meanwhile
    (state already on the CPU is copied; state on a GPU is copied to CPU memory by either mode).
    False: training waits until the checkpoint has committed. On by default: a checkpoint holds
    the same state either way (tests/integration/test_checkpoint.py), and a state on the GPU is copied to CPU
    memory by the synchronous save too, so only the wait changes
    (bench/results/checkpoint_blocking_h200_2026-12-03.md)."""
    max_restarts: int = 0
    """Times each replica of a node that does not end the run is restarted after its process
    dies (0 = a death stops the run)."""
    drop_bad_items: bool = False
    """Drop (and count) channel items that fail to decode instead of failing the consumer."""
    loggers: list[str] | str = field(default_factory=list)
    """Metric sinks besides metrics.jsonl: "tensorboard", "wandb" (a list or "tensorboard,wandb";
    dataflow/driver/loggers.py)."""
    stall_timeout_s: float | None = None
    """Seconds without a step after which the run counts as stalled and the driver prints what
    every node waits for (dataflow/driver/stall.py). None = max(300 s, 5 x the slowest step so far);
    a negative value turns the check off. A deadlock (every node waiting, nothing moving) is
    reported after 20 s whatever this is."""
    stall_action: str = "stop"
    """On a stall: "stop" ends the run (exit 1) naming the node(s) at the root of the wait;
    "warn" prints the same report once per stall timeout and keeps waiting."""
    stall_warn_s: float | None = 120.0
    """Seconds without a step after which the driver prints, once per quiet spell, where every
    node is (what it waits for, the busy ones' Python stacks) and the run goes on: an early look
    at a start-up that hangs, before the stall timeout's 300 s floor. At least twice the slowest
    step so far; only when shorter than the stall timeout; None = never (dataflow/driver/stall.py)."""
    alerts: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ALERTS))
    """Counters of things that went wrong, by metric key (or a prefix ending in "/"): any that is
    non-zero is shown on every progress line and in the final summary, not only in metrics.jsonl
    (dataflow/driver/monitor.py). "total": a running total each replica reports (its latest value counts);
    "count": an amount per report (they add up)."""
    config: Any = None
    """The graph's settings (the graph file's config). Given, its `rules` are applied now (shared
    settings, dataflow/config.py) and the run settings above come from its fields of those names."""
    placement: str | None = None
    """The GPU preset place() applied (dataflow/presets.py), if any."""
    memory_plan: Any = None
    """The config's memory plan once computed (graphs/rlhf.py: applied to the nodes' shares and
    settings by load_graph), for --describe and the input check."""
    _problems: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.config is not None:
            from dataflow.config import resolve

            resolve(self.config)
            for name in RUN_SETTINGS:
                if hasattr(self.config, name):
                    setattr(self, name, getattr(self.config, name))

    def node(self, name: str, kind: type, config: Any = None, *, cpus: float = 1.0,
             gpus: float = 0.0, replicas: int = 1, ends_run: bool = False, pool: str | None = None,
             side: str | None = None) -> str:
        """Declare a node: `replicas` Ray actors of `kind`, each with `cpus` CPUs and `gpus` GPUs.
        `pool`: run on the GPUs of that pool (g.pool), `gpus` per replica being a share <= 1 of one
        of them or whole GPUs (dataflow/placement.py has the rules); without a pool, a fraction
        shares a GPU Ray picks. `side`: "rollout" or "train", placed by the preset g.place()
        applies (pool and share; replicas=0: one per GPU of its side; dataflow/presets.py).
        `ends_run`: when this node returns, the run is over.

        A kind whose replicas are the ranks of one job (inputs_on_replica_0, e.g. a dp x tp
        learner) meets its ranks on the versioned edge it both publishes and subscribes to: with
        replicas > 1 that edge (node -> itself) is declared here."""
        where = _caller_location()
        if name in self.nodes:
            self._problems.append(f"{where}: node '{name}' is declared twice (first at {self.nodes[name].where}); give each node its own name")
            return name
        if config is None and isinstance(kind, type) and getattr(kind, "Config", None) is not None:
            config = kind.Config()
        self.nodes[name] = NodeSpec(name, kind, config, cpus, gpus, replicas, where, ends_run, pool, side)
        if is_node_class(kind) and kind.inputs_on_replica_0 and isinstance(replicas, int) and replicas > 1:
            for edge in [e for e in kind.publishes if e in kind.subscribes]:
                self.versioned_edges[edge] = VersionedSpec(edge, name, [name], where, auto=True)
        return name

    def place(self, placement: str, *, num_gpus: int = 1, gpu_shares: dict[str, float] | None = None) -> None:
        """Place the side nodes declared so far by a preset: "cpu", "colocated" (one pool of
        num_gpus GPUs they all share) or "split" (rollout on num_gpus - 1 GPUs, train on the last);
        `gpu_shares` gives named nodes their fraction of a GPU. Rules in dataflow/presets.py;
        a setting that cannot work is a ConfigError here."""
        from dataflow import presets

        presets.place(self, placement, num_gpus=num_gpus, gpu_shares=gpu_shares)

    def pool(self, name: str, *, gpus: int, strategy: str = "STRICT_PACK") -> str:
        """Declare a pool of `gpus` whole GPUs, one Ray placement group, for nodes declared with
        pool=name. Pools are exclusive (no GPU is in two). STRICT_PACK keeps the pool on one machine;
        "PACK" lets a pool larger than a machine span several."""
        where = _caller_location()
        if name in self.pools:
            self._problems.append(f"{where}: pool '{name}' is declared twice (first at {self.pools[name].where})")
            return name
        self.pools[name] = PoolSpec(name, gpus, strategy, where)
        return name

    def channel(self, src: str | list[str], dst: str | list[str], *, capacity: int,
                name: str | None = None, feedback: bool = False) -> str:
        """Declare a bounded FIFO channel from producer port(s) "node.port" to consumer port(s).

        `capacity` bounds the items buffered across all producers. `feedback=True` marks an edge
        that is allowed to close a cycle (the graph must otherwise be acyclic).
        """
        where = _caller_location()
        srcs = [src] if isinstance(src, str) else list(src)
        dsts = [dst] if isinstance(dst, str) else list(dst)
        name = name or (srcs[0] if srcs else f"channel{len(self.channels)}")
        if name in self.channels:
            self._problems.append(f"{where}: channel '{name}' is declared twice (first at {self.channels[name].where}); pass name=... to tell them apart")
            return name
        parsed = {}
        for label, ports in (("src", srcs), ("dst", dsts)):
            parsed[label] = []
            for port in ports:
                node, dot, port_name = port.partition(".")
                if not dot or not port_name:
                    self._problems.append(f"{where}: channel '{name}': {label} '{port}' must be 'node.port'")
                    continue
                parsed[label].append((node, port_name))
        self.channels[name] = ChannelSpec(name, parsed["src"], parsed["dst"], capacity, feedback, where)
        return name

    def versioned(self, name: str, *, src: str, dst: list[str], timeout_s: float = 300.0) -> str:
        """Declare a latest-wins versioned edge (weights, policy version) from `src` to `dst`.

        Subscribers are told of each publish in the order listed, each acking before the next, so a
        node listed later (the prompt source) never sees a version before an earlier one (the
        generators) holds it. A subscriber that does not ack within `timeout_s` fails the publish.
        """
        where = _caller_location()
        known = self.versioned_edges.get(name)
        if known is not None and not (known.auto and (known.src, known.dst) == (src, list(dst))):
            self._problems.append(f"{where}: versioned edge '{name}' is declared twice")
            return name
        self.versioned_edges[name] = VersionedSpec(name, src, list(dst), where, timeout_s)
        for auto in [e for e in self.versioned_edges.values() if e.auto]:  # after the graph's own edges
            self.versioned_edges[auto.name] = self.versioned_edges.pop(auto.name)
        return name

    # ---- validation -------------------------------------------------------------------------
    def validate(self, source: str = "graph") -> None:
        """Raise GraphError listing every problem (file:line, node/channel, what to change); the
        rules are in dataflow/validation.py."""
        problems = graph_problems(self, source)
        if len(problems) == 1:   # one line, as every other mistake is reported
            raise GraphError(problems[0])
        if problems:
            raise GraphError(f"{source}: invalid graph '{self.name}':\n  " + "\n  ".join(problems))

    def producers(self, channel: str) -> list[str]:
        """Replica names producing into `channel`."""
        return [r for node, _ in self.channels[channel].src for r in self.nodes[node].replica_names()]

    def consumers(self, channel: str) -> list[str]:
        """Replica names consuming from `channel` (only replica 0 of an inputs_on_replica_0 kind)."""
        return [r for node, _ in self.channels[channel].dst for r in self._readers(node)]

    def _readers(self, node: str) -> list[str]:
        spec = self.nodes[node]
        names = spec.replica_names()
        return names[:1] if getattr(spec.kind, "inputs_on_replica_0", False) else names
