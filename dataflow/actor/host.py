"""NodeHost: the Ray actor that hosts one replica of one node.

Lifecycle, driven by the runtime (dataflow/driver/runtime.py):
  1. __init__     light: pins torch threads, builds the tracer.
  2. connect()    gets the wiring (peer actor handles), builds channel ends, the node, node.setup().
  3. run()        runs node.run(); returns a status dict (never raises: failures come back as data
                  with the node name, traceback and the item being processed).
  4. poll()       called by the driver every ~0.5 s: events (logs, step metrics), trace data,
                  channel statistics. wait_state(): what the replica waits for right now (the
                  driver's stall diagnosis, dataflow/driver/stall.py); both in
                  dataflow/actor/host_status.py. Where in the code: the host's StackServer
                  answers the driver outside Ray (dataflow/actor/stacks.py).
  5. stop()       cancels run(); every blocking wait in channels is cancellable.
Checkpoints: checkpoint() from the node, save_state / write_done / load_state from the driver
(dataflow/actor/host_checkpoint.py). Between actors: channel_take / channel_receiver_closed (channel
pulls) and on_publish (versioned edges) are called by peers, never by the driver.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from dataflow import channel as channels
from dataflow import startup_gc
from dataflow.actor import stacks
from dataflow.channel.tracked import TrackedInput
from dataflow.errors import UserError, out_of_memory_line
from dataflow.actor.host_checkpoint import CheckpointCalls
from dataflow.actor.host_status import StatusCalls
from dataflow.node import NodeContext, implementation_of
from dataflow.trace.kernels import KernelRecorder
from dataflow.trace.tracer import Tracer
from dataflow.timeouts import wait_within

if sys.argv and sys.argv[0].endswith("default_worker.py"):
    # A node's Ray worker process: its node module (torch, ...) is unpickled next and connect() sets
    # it up, collecting nothing until then (dataflow/startup_gc.py).
    startup_gc.pause()


@dataclass
class HostSpec:
    node: str
    replica: int
    num_replicas: int
    kind: type
    config: Any
    cpus: float
    gpus: float
    max_steps: int | None
    trace: bool
    run_dir: str
    trace_kernels: bool = False
    save_interval: int = 0
    drop_bad_items: bool = False
    compile_cache: str = ""
    """Where compiled artefacts persist across runs (RunOptions.compile_cache); "" = the libraries' own."""
    max_restarts: int = 0
    """The graph's max_restarts: > 0 means a peer whose process dies comes back (the runtime
    restarts it), so a failed channel pull is retried and a publish skips it meanwhile."""
    memory_note: str = ""
    """NodeSpec.memory_note: what the memory plan gave this node, said by an out-of-memory error."""
    memory_cap: float = 0.0
    """NodeSpec.memory_cap: the fraction its allocator may use when more than `gpus` (0 = gpus)."""
    gpu_turn: str = ""
    """NodeSpec.gpu_turn (NodeContext.gpu_turn)."""

    @property
    def gpu_fraction(self) -> float:
        """The fraction of its GPU this replica's allocator may use."""
        return min(max(self.memory_cap, self.gpus), 1.0)


_ENVIRON = dict(os.environ)  # as the process started: a kept process's next run starts from it

# Where torch.compile (inductor's FX graph and AOTAutograd caches), triton's kernels and vLLM's
# compiled graphs go, under RunOptions.compile_cache: a second run of the same model and shapes
# loads them instead of compiling again.
COMPILE_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "VLLM_CACHE_ROOT": "vllm"}


# How long a consumer keeps asking a producer whose process died: as long as the runtime waits for
# its restart (restarts.RESTART_TIMEOUT_S), which on a loaded machine can take minutes (imports).
RESTART_WAIT_S = 300.0


class NodeHost(CheckpointCalls, StatusCalls):
    def __init__(self, spec: HostSpec, stack_server: stacks.StackServer | None = None,
                 endpoint: channels.ChannelEndpoint | None = None):
        self.spec = spec
        self.name = spec.node if spec.num_replicas == 1 else f"{spec.node}[{spec.replica}]"
        # Each replica computes with the CPUs it was given: oversubscribing threads across the
        # actors of one machine costs more than it gains.
        threads = max(1, int(spec.cpus))
        for var, sub in COMPILE_CACHES.items():   # before anything compiles (they read these when they do)
            if spec.compile_cache:
                os.environ[var] = os.path.join(spec.compile_cache, sub)
            elif _ENVIRON.get(var) is None:   # a kept process (rebind): not the previous run's
                os.environ.pop(var, None)
            else:
                os.environ[var] = _ENVIRON[var]
        self.device = "cpu"
        if "torch" in sys.modules or spec.gpus > 0:  # the node's module (unpickled with spec) uses torch
            import torch

            torch.set_num_threads(threads)
            self.device = "cuda" if spec.gpus > 0 and torch.cuda.is_available() else "cpu"
            if self.device == "cuda" and spec.gpu_fraction < 1:  # a share of a GPU: stay within it (dataflow/placement.py)
                torch.cuda.set_per_process_memory_fraction(spec.gpu_fraction)
        else:
            # A node without torch (plain Python: a toy graph's, a reward's) starts without its
            # ~2 s import; if it imports torch later, its OpenMP pool reads this when torch loads.
            os.environ["OMP_NUM_THREADS"] = str(threads)
        self.tracer = Tracer(self.name, enabled=spec.trace, device=self.device, starting=True)
        self.endpoint = endpoint or channels.ChannelEndpoint()
        self.events: list[dict] = []
        self._event_seq = 0
        self.steps = 0
        self.node = None
        self.ctx: NodeContext | None = None
        self._run_task: asyncio.Task | None = None
        self._last_item: dict[str, dict] = {}
        # versioned edges: edge -> (version, [ObjectRef]); subscribers per published edge
        self._versions: dict[str, tuple[int, list]] = {}
        self._fetched: dict[str, tuple[int, Any]] = {}
        # Created here, not in connect(): a peer may publish (e.g. from its setup) before this
        # host's connect() runs. asyncio.Condition binds its loop at first use (Python >= 3.10).
        self._version_changed = asyncio.Condition()
        self._subscribers: dict[str, list[tuple[str, Any]]] = {}
        self._publish_timeout: dict[str, float] = {}
        self._kernels: KernelRecorder | None = None  # --trace-kernels
        self.state_lock = asyncio.Lock()  # held while saving / loading the node's state
        self.bad_items: dict[str, int] = {}  # channel -> items dropped because they failed to decode
        self._checkpoint_reply: asyncio.Future | None = None
        self._asked = asyncio.Event()  # set when the node asks for a checkpoint (checkpoint_asked)
        self._write: tuple[str, asyncio.Future] | None = None  # background checkpoint write: (path, its task)
        self._staging: dict = {}  # the CPU (pinned) buffers captures copy into, reused (checkpoint.pack)
        self._background: set[asyncio.Task] = set()
        # What the node waits for outside channels, for wait_state(): version waits in progress
        # (edge, min version, why, since us) and the publish waiting for a subscriber's ack.
        self._version_waits: dict[int, tuple[str, int, str, int]] = {}
        self._publishing: tuple[str, int, str, int] | None = None
        self._phase = "created"  # created -> setup -> running -> finished
        self._loop_thread: int | None = None  # the event loop's thread, for the stack server
        import ray

        self.stack_server = stack_server or stacks.StackServer(ray.util.get_node_ip_address(), self._thread_stacks)

    # ---- kept between runs (dataflow/driver/warm.py) ------------------------------------------
    async def release(self) -> bool | str:
        """The run is over and the driver keeps this process for its next run: drop the node and
        everything of this run. True, or why not (the process is then ended) where something of
        the run would outlive it: run() or a background task still going, a checkpoint write,
        torch.distributed, vLLM (its engine's processes and memory pool), GPU memory still allocated
        once the node is gone."""
        if (self._run_task is not None and not self._run_task.done()) or self._background:
            return "its node is still running"
        if self._write is not None and not self._write[1].done():
            return "a checkpoint write is still going"
        if "vllm" in sys.modules:
            return "it loaded vLLM"
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            return "it is in a torch.distributed group"
        self.node = self.ctx = self._node_run = None
        self._versions, self._fetched, self._staging = {}, {}, {}
        if "torch._dynamo" in sys.modules:  # compiled code guarded on this run's modules
            sys.modules["torch._dynamo"].reset()
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            # the GPU back to the next run (and to the other processes on it) but the CUDA context
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if held := torch.cuda.memory_allocated():  # a tensor of this run still referenced somewhere
                return f"{held / 2**20:.0f} MiB of GPU memory still allocated without its node"
        return True

    def rebind(self, spec: HostSpec) -> None:
        """Host the next run's replica here, as a new process would (its __init__). Also right
        after Ray restarted this actor (dataflow/driver/restarts.py), where peers' takes may
        already wait on its endpoint for the outboxes connect() registers: that one is kept."""
        startup_gc.pause()   # resumed when its set-up ends (connect), as in a new process
        self.__init__(spec, stack_server=self.stack_server,
                      endpoint=self.endpoint if self.endpoint.pristine else None)
        self.tracer.loaded_now()

    # ---- set-up -----------------------------------------------------------------------------
    async def connect(self, wiring: dict) -> dict:
        """Build channel ends from the wiring and set the node up. Returns {"device": ...}."""
        self._loop_thread = threading.get_ident()
        outputs = {}
        for port, w in wiring["outputs"].items():
            outputs[port] = channels.SendEnd(
                w["channel"], producer=self.name, capacity=w["capacity"],
                consumer_keys=w["consumers"], tracer=self.tracer)
            self.endpoint.register(outputs[port])
        inputs = {}
        for port, w in wiring["inputs"].items():
            end = channels.ReceiveEnd(
                w["channel"], consumer_key=self.name, producers=w["producers"],
                prefetch=w["prefetch"], tracer=self.tracer,
                on_bad_item=self._drop_bad_item if self.spec.drop_bad_items else None,
                retry_s=RESTART_WAIT_S if self.spec.max_restarts else 0.0)
            inputs[port] = TrackedInput(end, self._last_item)
        for edge, subs in wiring["publishes"].items():
            self._subscribers[edge] = subs
            self._publish_timeout[edge] = wiring["publish_timeout"][edge]
        self.ctx = NodeContext(
            name=self.spec.node, replica=self.spec.replica, num_replicas=self.spec.num_replicas,
            device=self.device, max_steps=self.spec.max_steps, inputs=inputs, outputs=outputs,
            gpu_share=self.spec.gpu_fraction if self.device == "cuda" else 0.0, gpu_turn=self.spec.gpu_turn,
            tracer=self.tracer, run_dir=self.spec.run_dir, _host=self,
            save_interval=self.spec.save_interval, state_lock=self.state_lock)
        if self.spec.trace_kernels and self.device == "cuda":
            self._kernels = KernelRecorder(self.tracer.now_us)
        self._phase = "setup"
        t = time.perf_counter()
        self.tracer.tally = {}  # the spans the node's setup opens (ctx.span): where its start-up went
        try:
            with self.tracer.span("setup"):
                kind = self.spec.kind
                # a declaration (nodes/generator.py, ...): its code, and torch, imported here
                if getattr(kind, "implementation", ""):
                    with self.tracer.span("import node code"):
                        kind = implementation_of(kind)
                self.node = kind(self.spec.config, self.ctx)
                await self.node.setup()
        except Exception as e:
            return self._failure(e, phase="setup")
        finally:
            parts, self.tracer.tally = self.tracer.tally, None
            startup_gc.resume()
        parts = {name: round(us / 1e6, 3) for name, us in parts.items() if name != "setup"}
        return {"status": "ready", "device": self.device, "pid": os.getpid(), "stacks": self.stack_server.address,
                "setup_s": round(time.perf_counter() - t, 3), "setup_parts": parts}

    # ---- running ----------------------------------------------------------------------------
    async def run(self) -> dict:
        self._run_task = asyncio.current_task()
        self._phase = "running"
        self.tracer.started()  # start-up ends: the trace's training window begins
        try:
            self._node_run = self.node.run()  # its await chain: where a waiting node waits (_thread_stacks)
            reason = await self._node_run
            # A node may say why it ended (the prompt source: its data ran out); the driver tells
            # the user when the run ends before its max steps.
            return {"status": "done", "steps": self.steps, "reason": reason if isinstance(reason, str) else None}
        except asyncio.CancelledError:
            return {"status": "stopped", "steps": self.steps}
        except channels.BrokenChannel:
            # Every consumer of an output is gone (the run is ending downstream): a normal stop.
            return {"status": "done", "steps": self.steps}
        except Exception as e:
            return self._failure(e, phase="run")
        finally:
            self._phase = "finished"
            for end in self.ctx.outputs.values():
                end.close()
            for end in self.ctx.inputs.values():
                end.close()

    async def stop(self) -> None:
        """Cancel run(): the node's current wait or await raises CancelledError."""
        if self._run_task is not None and not self._run_task.done():
            self._run_task.cancel()

    def _drop_bad_item(self, e: channels.BadItem) -> None:
        """drop_bad_items: count an undecodable item, log the first one per channel, go on."""
        channel = e.channel
        self.bad_items[channel] = self.bad_items.get(channel, 0) + 1
        if self.bad_items[channel] == 1:
            self.emit({"kind": "log", "text": f"dropped: {e} (drop_bad_items; later ones are only counted)"})
        self.emit({"kind": "metrics", "values": {f"channel/bad_items/{channel}": self.bad_items[channel]}})

    def _failure(self, e: BaseException, phase: str) -> dict:
        if type(e).__name__ == "OutOfMemoryError":   # torch's (CUDA): one line with what to change
            line = out_of_memory_line(e, self.spec.memory_note, self.spec.gpus)
            return {"status": "failed", "phase": phase, "error": f"OutOfMemoryError: {e}", "message": line,
                    "user_error": True, "traceback": traceback.format_exc(), "item": ""}
        item = ""
        if self._last_item:
            port, meta = next(reversed(self._last_item.items()))
            shown = ", ".join(f"{k}={v}" for k, v in meta.items() if k != "t_send_us")
            item = f"last item received on input '{port}': {shown}"
        return {"status": "failed", "phase": phase, "error": f"{type(e).__name__}: {e}", "message": str(e),
                "user_error": isinstance(e, UserError),
                # an echo: it failed because a peer did (a producer's channel, the other end of a push)
                "echo": ((isinstance(e, channels.ChannelError) and not isinstance(e, channels.BadItem))
                         or getattr(e, "peer_gone", False)),
                "traceback": traceback.format_exc(), "item": item}

    # ---- --trace-kernels ---------------------------------------------------------------------
    async def stop_kernel_trace(self) -> dict | None:
        """{"window": [t0, t1], "intervals": [[t0, t1], ...]}: the kernels of this process on the
        tracer clock and the span they were recorded over; None when not profiling."""
        if self._kernels is None:
            return None
        recorded, self._kernels = self._kernels.stop(), None
        return recorded

    # ---- driver calls (poll, wait_state: dataflow/actor/host_status.py) --------------------------
    async def clock(self) -> int:
        return self.tracer.now_us()  # the clock every trace event of this process uses

    def emit(self, event: dict) -> None:
        event["t"] = time.time()
        event["seq"] = self._event_seq
        self._event_seq += 1
        self.events.append(event)

    async def step_done(self, values: dict) -> bool:
        self.steps += 1
        self.emit({"kind": "step", "step": self.steps, "values": values})
        return self.spec.max_steps is None or self.steps < self.spec.max_steps

    # ---- channels (called by peer actors) ---------------------------------------------------
    async def channel_take(self, channel: str, consumer_key: str, max_items: int):
        return await self.endpoint.take(channel, consumer_key, max_items)

    async def channel_receiver_closed(self, channel: str, consumer_key: str) -> None:
        await self.endpoint.receiver_closed(channel, consumer_key)

    async def channel_reset_consumer(self, channel: str, consumer_key: str) -> None:
        self.endpoint.reset_consumer(channel, consumer_key)

    async def peer_restarted(self, replica: str) -> None:
        """`replica`'s process died and was restarted (by the runtime): tell the node, in a task of
        its own (re-issuing items may wait on backpressure)."""
        if self.node is not None:
            task = asyncio.ensure_future(self.node.on_restart(replica))
            self._background.add(task)
            task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            self.emit({"kind": "log", "text": f"on_restart failed: {type(e).__name__}: {e}"})

    # ---- versioned edges --------------------------------------------------------------------
    async def publish(self, edge: str, value: Any, version: int) -> None:
        import ray

        with self.tracer.span("weight push send", edge=edge, version=version):
            ref = ray.put(value)
            self._store_version(edge, version, [ref])
            self._fetched[edge] = (version, value)
            # In the declared order, each subscriber acks before the next hears of it (graph.py).
            for sub_name, handle in self._subscribers.get(edge, []):
                self._publishing = (edge, version, sub_name, self.tracer.now_us())
                try:
                    await wait_within(handle.on_publish.remote(edge, version, [ref]),
                                      self._publish_timeout[edge])
                except asyncio.TimeoutError:
                    raise RuntimeError(f"publishing '{edge}' v{version} from {self.name} to {sub_name}: "
                                       f"no ack within {self._publish_timeout[edge]:g} s") from None
                except Exception as e:
                    if self.spec.max_restarts and isinstance(e, ray.exceptions.RayActorError):
                        continue  # its process died: the runtime hands the latest version to the restarted one
                    raise RuntimeError(f"publishing '{edge}' v{version} from {self.name} to {sub_name} "
                                       f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
                finally:
                    self._publishing = None

    async def redeliver(self, edge: str, replica: str) -> None:
        """Announce the latest version of `edge` to `replica` again (restarted after its process died)."""
        if edge in self._versions:
            version, box = self._versions[edge]
            for sub_name, handle in self._subscribers.get(edge, []):
                if sub_name == replica:
                    await handle.on_publish.remote(edge, version, box)

    async def on_publish(self, edge: str, version: int, boxed_ref: list) -> bool:
        self._store_version(edge, version, boxed_ref)
        async with self._version_changed:
            self._version_changed.notify_all()
        return True

    def _store_version(self, edge: str, version: int, boxed_ref: list) -> None:
        if version >= self._versions.get(edge, (-1, None))[0]:
            self._versions[edge] = (version, boxed_ref)

    def latest_version(self, edge: str) -> int:
        return self._versions.get(edge, (-1, None))[0]

    async def latest(self, edge: str) -> tuple[int, Any]:
        version, box = self._versions.get(edge, (-1, None))
        if version < 0:
            return -1, None
        cached = self._fetched.get(edge)
        if cached is None or cached[0] != version:
            with self.tracer.span("weight push receive", edge=edge, version=version):
                self._fetched[edge] = (version, await box[0])
        return self._fetched[edge]

    async def wait_version(self, edge: str, min_version: int, why: str = "") -> int:
        if self.latest_version(edge) >= min_version:
            return self.latest_version(edge)
        key = id(asyncio.current_task())
        self._version_waits[key] = (edge, min_version, why, self.tracer.now_us())
        try:
            async with self._version_changed:
                await self._version_changed.wait_for(lambda: self.latest_version(edge) >= min_version)
        finally:
            self._version_waits.pop(key, None)
        return self.latest_version(edge)
