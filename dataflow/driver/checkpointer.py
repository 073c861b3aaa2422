"""The driver's side of checkpoints (the files: dataflow/actor/checkpoint.py).

    Checkpointer(graph, hosts, monitor)
      .save(step, reason, requester)   every replica saves; the requester (ctx.checkpoint) is answered
      .wait()                          until the checkpoint written in the background has committed
      .raise_if_failed()               a failed background write stops the run (NodeFailed)
      .watch_requests(replicas)        calls that return when a replica asks: the driver's loop waits on them

A save has two phases. Capture: each replica, holding its state lock, takes node.state_dict()
(after prepare_checkpoint) and its RNG states. Write + commit: the replicas write their files into
step_<k>.tmp/, then the driver writes the manifest and renames the directory to step_<k>.

Synchronous (async_checkpoint=False): a replica writes while it holds the lock, and the
requester's ctx.checkpoint returns once the checkpoint has committed: training waits for the
files to reach the disk (seconds per checkpoint even for a small model's learner and its
optimizer state).

Asynchronous (async_checkpoint=True, as torch.distributed.checkpoint's async_save and torchtitan
do it): capture copies every tensor to CPU memory under the lock, ctx.checkpoint returns once
every replica has captured, and each replica writes from its copy in a thread while training
goes on; the driver commits step_<k> when every write has succeeded. The checkpoint is the same
consistent cut as a synchronous one (the copy is taken at the same point), and at most one is in
flight: the next save, the end of the run, an interrupt save and a node failure's report all wait
for it to commit first, so they and keep_checkpoints' pruning only ever see committed
checkpoints. A write that fails leaves step_<k>.tmp (never read) and the previous checkpoints
intact, says why on the console, and stops the run naming the requesting node, as a failed
synchronous save does through its ctx.checkpoint. Interrupt checkpoints are always synchronous:
the run is ending anyway.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dataflow.actor.checkpoint import begin, checkpoints_dir, commit, prune, read_manifest, replica_state_dir, step_dir
from dataflow.errors import NodeFailed
from dataflow.driver.failures import awaitable, result_of, unless_the_run_ends
from dataflow.timeouts import wait_within


class Checkpointer:
    """Every checkpoint of one run, saved through its hosts; one in flight at a time."""

    def __init__(self, graph, hosts: dict, monitor):
        self.graph, self.hosts, self.monitor = graph, hosts, monitor
        self._writing: asyncio.Future | None = None  # the background write + commit of the last save
        self._failure: NodeFailed | None = None
        self._asked: dict[str, asyncio.Future | None] = {}  # replica -> its checkpoint_asked() call

    def watch_requests(self, replicas) -> set[asyncio.Future]:
        """One checkpoint_asked() call out per replica in `replicas` (those running): the driver's
        loop waits on them beside the run() calls, so a node's ctx.checkpoint is served at once
        instead of at the next poll. A replica whose call failed (its process died) is not
        watched again: its requests, after a restart, wait for the polls as before. Without a
        save_interval nothing is watched (a node's own ctx.checkpoint then waits for a poll)."""
        if not self.graph.save_interval:
            return set()
        for name in [n for n in self._asked if n not in replicas]:
            self._stop_watching(name)
        for name in replicas:
            fut = self._asked.get(name)
            if fut is not None and fut.done():
                self._asked[name] = None if isinstance(result_of(fut), BaseException) else \
                    asyncio.ensure_future(awaitable(self.hosts[name].checkpoint_asked.remote()))
            elif name not in self._asked:
                self._asked[name] = asyncio.ensure_future(awaitable(self.hosts[name].checkpoint_asked.remote()))
        return {f for f in self._asked.values() if f is not None}

    def stop_watching(self) -> None:
        for name in list(self._asked):
            self._stop_watching(name)

    def _stop_watching(self, name: str) -> None:
        fut = self._asked.pop(name)
        if fut is not None:
            fut.cancel()
            fut.add_done_callback(result_of)  # (its error, if it had one, is not news)

    async def save(self, step: int | None, reason: str, requester: str | None = None) -> None:
        """Every replica saves its state for `step` (None: the step the run-ending node is at);
        the requesting node is answered once the state is taken: after the commit, or with
        async_checkpoint, after the capture (the commit follows in the background)."""
        await self.wait()  # at most one in flight: the previous checkpoint commits first
        if step is not None:
            self.raise_if_failed()  # no checkpoint after one that failed (an interrupt's may still be taken)
        background = self.graph.async_checkpoint and step is not None
        first = [n for n in self.hosts if self.graph.nodes[n.split("[")[0]].ends_run]
        manifest = {"graph": self.graph.name, "reason": reason,
                    **({"settings": self.monitor.settings} if self.monitor.settings else {})}
        try:
            taken = await capture(self.hosts, first, self.monitor.run_dir, step, manifest,
                                  after_first=lambda: self.monitor.poll(self.hosts),
                                  previous=self.monitor.last_checkpoint, background=background)
        except Exception as e:
            await self._answer(requester, None, self._failed(step, e))
            return
        if background:
            await self._answer(requester, step_dir(self.monitor.run_dir, taken.step), None)
            self._writing = asyncio.ensure_future(self._commit_in_background(taken, reason, requester))
        else:
            await self._answer(requester, *await self._commit(taken, reason))

    async def save_unless_the_run_ends(self, step: int, requester: str | None, running: dict, ends_run) -> dict:
        """save(step, "interval", requester), raced against the nodes' run() calls (`running`:
        future -> replica; failures.unless_the_run_ends): {} once saved, or at once {replica:
        result} of those that ended the run meanwhile (`ends_run`). A save waits for every
        replica's capture, which under load or behind a busy state lock takes seconds; a node
        that dies meanwhile is reported now, not after it.

        Such a save is abandoned: step_<k>.tmp is left uncommitted (never read), as a background
        write is when a replica's process dies during it (_commit's died_ok). Finishing it would
        hold up the report of the failure for as long as the live replicas take to capture (one
        that waits on the dead node: until its own timeout), and a run that is ending has its
        previous checkpoint to resume from. A replica whose process Ray restarts does not end
        the run: the save goes on, with its previous state (Captured.commit), as before."""
        _, ending = await unless_the_run_ends(self.save(step, "interval", requester), running, ends_run)
        last = self.monitor.last_checkpoint
        if ending and not (last and Path(last).name == f"step_{step}"):  # (cancelled after its commit: kept)
            tmp = step_dir(self.monitor.run_dir, step).with_suffix(".tmp")
            self.monitor.say(f"[dataflow] checkpoint of step {step} not committed: {', '.join(ending)} failed or "
                             f"died while it was being taken ({tmp.name} is left unread)")
        return ending

    async def wait(self) -> None:
        """Until the checkpoint being written in the background (if any) has committed or failed."""
        if self._writing is not None:
            await asyncio.shield(self._writing)  # a Ctrl-C while waiting must not cancel the write
            self._writing = None

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def _commit_in_background(self, taken: "Captured", reason: str, requester: str | None) -> None:
        _, error = await self._commit(taken, reason, died_ok=True)
        if error:
            self._failure = NodeFailed(requester or "driver", f"{error} (written in the background: async_checkpoint)")

    async def _commit(self, taken: "Captured", reason: str, died_ok: bool = False) -> tuple[Path | None, str | None]:
        """(checkpoint dir, None), or (None, the error). `died_ok` (a background write): a replica
        whose process died while writing is not the checkpoint's failure but that node's, which the
        run reports (or restarts it) from its run() result; the checkpoint is only not committed."""
        from ray.exceptions import RayActorError

        try:
            path = await taken.commit()
        except Exception as e:
            if died_ok and isinstance(e, RayActorError):
                self.monitor.say(f"[dataflow] checkpoint of step {taken.step} not committed: a node's process "
                                 f"died while writing it ({taken.tmp.name} is left unread)")
                return None, None
            return None, self._failed(taken.step, e)
        monitor = self.monitor
        monitor.last_checkpoint = path
        monitor.artifacts["last checkpoint"] = str(path)
        try:
            prune(monitor.run_dir, self.graph.keep_checkpoints, path)
        except OSError as e:  # a full or read-only disk must not stop training
            monitor.say(f"[dataflow] could not delete old checkpoints (keep_checkpoints={self.graph.keep_checkpoints}): {e}")
        monitor.say(f"[dataflow] {'interrupted: ' if reason == 'interrupt' else ''}checkpoint of step "
                    f"{taken.step} saved: {path}")
        return path, None

    def _failed(self, step: int | None, e: BaseException) -> str:
        error = f"checkpoint of step {step} failed: {type(e).__name__}: {e}"
        self.monitor.say(f"[dataflow] {error}")
        return error

    async def _answer(self, requester: str | None, path: Path | None, error: str | None) -> None:
        if requester is not None:
            try:
                await self.hosts[requester].checkpoint_done.remote(str(path) if path else None, error)
            except Exception:
                pass  # the requester died: its run() result reports it


# ---- one save ---------------------------------------------------------------------------------------
async def save(hosts: dict, first: list[str], run_dir: str | Path, step: int | None, manifest: dict,
               after_first=None, previous: Path | None = None, timeout_s: float = 600.0) -> Path:
    """capture() with the files written while each replica holds its state lock, then commit."""
    taken = await capture(hosts, first, run_dir, step, manifest, after_first, previous, timeout_s)
    return await taken.commit(timeout_s)


async def capture(hosts: dict, first: list[str], run_dir: str | Path, step: int | None, manifest: dict,
                  after_first=None, previous: Path | None = None, timeout_s: float = 600.0,
                  background: bool = False) -> "Captured":
    """Ask every host to save its replica's state for `step` into step_<step>.tmp; commit() of
    the result renames it to step_<step>.

    The replicas in `first` (the coordinating node's) save first; with step=None (an interrupt)
    the step is the one the first of them reports its state is for. `after_first` (a coroutine
    function) runs once they have saved: the driver polls there, so metrics.jsonl has the step's
    record before the checkpoint exists. With `background` (the graph's async_checkpoint; never
    for an interrupt) a replica only copies its state to CPU memory here and writes the files in
    a thread of its own: commit() waits for those writes."""
    first = [n for n in first if n in hosts]
    rest = [n for n in hosts if n not in first]
    if step is None:
        if not first:
            raise RuntimeError("no run-ending node to take the step of an interrupt checkpoint from")
        # The step is known once the coordinator's state is taken: save it aside, then move it.
        scratch = checkpoints_dir(run_dir) / "interrupt.tmp"
        if scratch.exists():
            shutil.rmtree(scratch)
        reply = await wait_within(hosts[first[0]].save_state.remote(str(scratch / first[0]), None), timeout_s)
        step = reply["step"]
        if step is None:
            raise RuntimeError(f"node '{first[0]}' keeps no 'step' in its state_dict()")
        tmp = begin(run_dir, step)
        (scratch / first[0]).rename(tmp / first[0])
        shutil.rmtree(scratch)
        taken = Captured(hosts, tmp, step, manifest, previous, {first[0]: reply}, set(first), background=False)
        first = first[1:]
    else:
        tmp = begin(run_dir, step)
        taken = Captured(hosts, tmp, step, manifest, previous, {}, set(first), background)
    replies = await wait_within(asyncio.gather(
        *(hosts[n].save_state.remote(str(tmp / n), step, taken.background) for n in first)), timeout_s)
    taken.results.update(zip(first, replies))
    if after_first is not None:
        await after_first()
    replies = await wait_within(asyncio.gather(
        *(hosts[n].save_state.remote(str(tmp / n), step, taken.background) for n in rest),
        return_exceptions=True), timeout_s)
    taken.results.update(zip(rest, replies))
    return taken


@dataclass
class Captured:
    """A checkpoint whose every replica has taken its state (capture()); commit() finishes it."""

    hosts: dict
    tmp: Path
    step: int
    manifest: dict
    previous: Path | None
    results: dict[str, Any]
    """Replica -> its save_state reply, or the exception in its place."""
    first: set[str]
    background: bool

    async def commit(self, timeout_s: float = 600.0) -> Path:
        """Wait for the replicas' background writes (if any), then commit. A replica whose
        process is dead (being restarted) keeps its state from the `previous` checkpoint, if that
        has one (the manifest lists it under "stale"); the coordinating node's may not. A failure
        raises and leaves step_<k>.tmp, which is never read. Returns the checkpoint directory."""
        from ray.exceptions import RayActorError

        if self.background:
            writing = [n for n, r in self.results.items() if isinstance(r, dict) and r.get("saved") is not False]
            done = await wait_within(asyncio.gather(
                *(self.hosts[n].write_done.remote(str(self.tmp / n)) for n in writing),
                return_exceptions=True), timeout_s)
            self.results.update(zip(writing, done))
        stale = {}
        for name, result in self.results.items():
            dead = isinstance(result, RayActorError) or (isinstance(result, dict) and result.get("saved") is False)
            if isinstance(result, BaseException) and (name in self.first or not dead):
                raise result
            if dead:
                if name in self.first:
                    raise RuntimeError(f"'{name}' restarted before its checkpoint state was written")
                # its process died mid-run (the runtime is restarting it)
                old = replica_state_dir(self.previous, name) if self.previous is not None else None
                if (self.tmp / name).exists():  # what it wrote before it died is incomplete
                    shutil.rmtree(self.tmp / name)
                if old is not None:
                    shutil.copytree(old, self.tmp / name)
                stale[name] = read_manifest(self.previous)["step"] if old is not None else None
        return commit(self.tmp, {**self.manifest, "step": self.step, "replicas": sorted(self.hosts),
                                 "stale": stale, "time": time.time()})
