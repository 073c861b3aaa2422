"""The node contract: what a node kind (nodes/*.py) subclasses and what it can ask of the engine.

A node kind is a class with a typed `Config` dataclass, the names of its ports, and one `run()`
loop. The engine builds it inside a NodeHost Ray actor (dataflow/actor/host.py) and hands it a
`NodeContext` for everything that crosses the process boundary: channels, versioned edges,
metrics, trace spans.

A kind may declare itself apart from the code that runs it (`Node.implementation`): the driver
then reads only the declaration, and the implementation's imports (torch, models) happen in the
node's own process (`implementation_of`, called by the host).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dataflow.errors import UserError


class Node:
    """Base class of every node kind.

    Subclasses set `Config` (a dataclass), `inputs` / `outputs` (channel port names),
    `subscribes` / `publishes` (versioned edge names), and implement `run()`. Their docstring
    states the flow: what the node consumes, produces, waits for and is unblocked by.
    """

    Config: ClassVar[type | None] = None
    inputs: ClassVar[tuple[str, ...]] = ()
    outputs: ClassVar[tuple[str, ...]] = ()
    subscribes: ClassVar[tuple[str, ...]] = ()
    publishes: ClassVar[tuple[str, ...]] = ()
    inputs_on_replica_0: ClassVar[bool] = False
    """Only replica 0 reads the input channels (the others get no input ports): a node whose
    replicas are the ranks of one job (dataflow/weights/multirank.py), rank 0 handing out the work.
    A channel with several consumer replicas gives each item to one of them."""
    implementation: ClassVar[str] = ""
    """"module:Class" of the class that runs this kind, a subclass of it ("" = this class runs).
    The built-in model kinds (nodes/generator.py, learner.py, ...) are declarations whose
    implementation is in nodes/impl/: the driver imports a graph's kinds before Ray starts, and
    their implementations import torch. A user's own node kind needs nothing here."""

    @classmethod
    def restart_refusal(cls, config: Any) -> str:
        """Why a replica of this kind with `config` cannot be restarted after its process died
        ("" if it can): its death then ends the run, with this reason in the report."""
        return ""

    def __init__(self, config: Any, ctx: "NodeContext"):
        self.config = config
        self.ctx = ctx

    async def setup(self) -> None:
        """Build models and state. Runs inside the actor before any node's run() starts."""

    async def run(self) -> str | None:
        """The node's loop. Returning ends the node; its outputs are then closed. A source may
        return why it ended (e.g. "the data ran out after 2 passes; set prompts.epochs=0 to
        repeat it"): the driver shows it when the run ends before its max steps."""
        raise NotImplementedError

    # State that a checkpoint saves and a resumed or restarted replica loads (dataflow/actor/checkpoint.py).
    def state_dict(self) -> dict:
        """Tensors, arrays, numbers, strings, lists, tuples and dicts (saved as safetensors + JSON).
        Runs under `ctx.state_lock`; `ctx.checkpoint_step` is the step being saved."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned; called after setup(), before run()."""
        pass

    async def prepare_checkpoint(self) -> None:
        """Runs under `ctx.state_lock` just before state_dict(), on every replica being saved: a
        node whose replicas are the ranks of one job gathers its sharded state here (a collective
        that rank 0 starts, dataflow/weights/multirank.py), since state_dict() must not communicate."""

    async def on_restart(self, replica: str) -> None:
        """Replica `replica` (of another node) died and was restarted: the items it held are lost.
        The prompt source re-issues the prompts not yet trained on here."""


def implementation_of(kind: type) -> type:
    """The class that runs `kind`: `kind` itself when it sets no implementation or already is (a
    subclass of) it, else the class its `implementation` names, which must subclass `kind`."""
    path = getattr(kind, "implementation", "")
    if not path:
        return kind
    module, _, name = path.partition(":")
    try:
        impl = getattr(importlib.import_module(module), name, None)
    except ModuleNotFoundError as e:
        if not (module == e.name or module.startswith(f"{e.name}.")):   # one that the implementation
            raise                                                       # imports: its traceback kept
        impl = None
    if not isinstance(impl, type):
        raise UserError(f"node kind {kind.__qualname__}: implementation={path!r} names no class; give it "
                        "as 'module:Class'")
    if issubclass(kind, impl):   # the implementation itself, or a user's subclass of it
        return kind
    if not issubclass(impl, kind):
        raise UserError(f"node kind {kind.__module__}.{kind.__qualname__}: its implementation {path} does not "
                        f"subclass it; subclass {module}.{name} to change how it runs, or set "
                        f"{kind.__qualname__}.implementation to a subclass of {kind.__qualname__}")
    return impl


@dataclass
class NodeContext:
    """What a node sees of the engine. Built by the host; nodes never construct it."""

    name: str
    replica: int
    num_replicas: int
    device: str
    max_steps: int | None
    gpu_share: float = 0.0
    """This replica's share of its GPU (0 = none; its CUDA memory is capped at it below 1)."""
    gpu_turn: str = ""
    """NodeSpec.gpu_turn: the lock file of a memory plan's phase switch ("" = none)."""
    run_dir: str = "."
    inputs: dict = field(default_factory=dict)   # port -> channel.ReceiveEnd
    outputs: dict = field(default_factory=dict)  # port -> channel.SendEnd
    tracer: Any = None                           # trace.Tracer
    _host: Any = None                            # the NodeHost (for versioned edges and events)
    save_interval: int = 0
    """Checkpoint every this many steps (the graph's save_interval; 0 = off)."""
    checkpoint_step: int | None = None
    """While state_dict() runs: the step the checkpoint is for (batches < it are trained)."""
    state_lock: Any = None
    """asyncio.Lock the host holds while saving or loading state: hold it while changing state
    that state_dict() reads, so a checkpoint never sees half an update."""

    @property
    def full_name(self) -> str:
        return f"{self.name}[{self.replica}]" if self.num_replicas > 1 else self.name

    def span(self, name: str, **args):
        """Context manager marking a unit of busy work (a trace slice; counted in busy %)."""
        if self.tracer is None:
            return contextlib.nullcontext()
        return self.tracer.span(name, **args)

    def log(self, text: str) -> None:
        """A line for the user's console, printed by the driver with this node's name."""
        self._host.emit({"kind": "log", "text": text})

    def metrics(self, values: dict) -> None:
        """Metrics not tied to a step (e.g. a reward node's failure counts)."""
        self._host.emit({"kind": "metrics", "values": dict(values)})

    def artifact(self, name: str, path: str) -> None:
        """Tell the user where an output (final weights, a checkpoint) was written."""
        self._host.emit({"kind": "artifact", "name": name, "path": path})

    async def step_done(self, values: dict) -> bool:
        """Report one training step's metrics. Returns False once the run's max steps is reached."""
        return await self._host.step_done(values)

    async def publish(self, edge: str, value: Any, version: int) -> None:
        """Publish `value` at `version` on a versioned (latest-wins) edge; waits for every ack."""
        await self._host.publish(edge, value, version)

    def subscribers(self, edge: str) -> list[str]:
        """Replica names subscribed to `edge`, which this node publishes ([] if none), in push order."""
        return [name for name, _ in self._host._subscribers.get(edge, [])]

    def latest_version(self, edge: str) -> int:
        """Newest version announced on `edge` (-1 before the first publish)."""
        return self._host.latest_version(edge)

    async def latest(self, edge: str) -> tuple[int, Any]:
        """(version, value) of the newest publish on `edge`, fetched into this process."""
        return await self._host.latest(edge)

    async def wait_version(self, edge: str, min_version: int, why: str = "") -> int:
        """Wait until `edge` has reached `min_version`; returns the version reached. `why` says
        what the wait is for (e.g. "staleness admission, max_staleness=1"): a stalled run's wait
        graph shows it (dataflow/driver/stall.py)."""
        return await self._host.wait_version(edge, min_version, why)

    def checkpoint_due(self, step: int) -> bool:
        """True when step `step` should end with a checkpoint (every save_interval steps)."""
        return self.save_interval > 0 and step > 0 and step % self.save_interval == 0

    async def checkpoint(self, step: int) -> str:
        """Save every node's state for `step` (the driver asks each replica; dataflow/actor/checkpoint.py)
        and return the checkpoint directory. Call it where the run's state is consistent: after
        step `step`'s update, before its new weights are published. Do not hold state_lock.
        With async_checkpoint it returns once every replica's state is copied, and the directory
        is committed later (dataflow/driver/checkpointer.py); a failed write then stops the run."""
        return await self._host.checkpoint(step)
