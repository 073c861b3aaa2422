"""NodeHost's checkpoint calls (dataflow/actor/host.py; the actor is one class, these are its part for
checkpoints: dataflow/actor/checkpoint.py has the files, dataflow/driver/checkpointer.py the driver's side).

    checkpoint(step)                 the node asks (ctx.checkpoint); the driver answers checkpoint_done
    checkpoint_asked()               returns when the node asks: the driver's loop wakes on it
    save_state(path, step, background)   under state_lock: take the state; write it now, or copy it
                                     and write it in a thread (async_checkpoint)
    write_done(path)                 that background write has finished (or raises its error)
    load_state(path, step)           a resumed or restarted replica's state
"""

from __future__ import annotations

import asyncio
import time

from dataflow.actor import checkpoint


class CheckpointCalls:
    """Mixed into NodeHost, whose __init__ sets the attributes used here: node, ctx, state_lock,
    tracer, steps, emit(), _checkpoint_reply, _asked, _write and _staging."""

    async def checkpoint(self, step: int) -> str:
        """The node asks for a checkpoint of `step`: the driver, woken by checkpoint_asked (or at
        its next poll, if it is not watching this replica), has every replica save (this one
        included, via save_state) and answers checkpoint_done. The time the node waited is
        reported as `timing/checkpoint_blocked_s`."""
        t = time.perf_counter()
        self._checkpoint_reply = asyncio.get_running_loop().create_future()
        self.emit({"kind": "checkpoint", "step": step})
        self._asked.set()  # wakes the driver (checkpoint_asked)
        path = await self._checkpoint_reply
        self.emit({"kind": "metrics", "values": {"timing/checkpoint_blocked_s": round(time.perf_counter() - t, 4)}})
        return path

    async def checkpoint_asked(self) -> bool:
        """Returns once this node has asked for a checkpoint since the last such return. The
        driver keeps one of these calls out per replica (Checkpointer.watch_requests) and serves
        the request as soon as it returns, not at its next poll: up to POLL_INTERVAL_S (0.5 s)
        later, with the node waiting all along."""
        await self._asked.wait()
        self._asked.clear()
        return True

    async def checkpoint_done(self, path: str | None, error: str | None = None) -> None:
        if self._checkpoint_reply is not None and not self._checkpoint_reply.done():
            if error:
                self._checkpoint_reply.set_exception(RuntimeError(error))
            else:
                self._checkpoint_reply.set_result(path)

    async def save_state(self, path: str, step: int | None, background: bool = False) -> dict:
        """Write this replica's state (node.state_dict(), RNG states, step counter) under `path`,
        holding state_lock until the files are written. With `background` (async_checkpoint) the
        state is only copied to CPU memory under the lock, and the files are written from that
        copy by a thread after it is released: write_done(path) waits for them. Returns {"step":
        the node's own step}, or {"step": None, "saved": False} from a restarted process not set
        up again yet."""
        if self.node is None:
            return {"step": None, "saved": False}
        await self._previous_write()
        async with self.state_lock:
            self.ctx.checkpoint_step = step
            try:
                await self.node.prepare_checkpoint()
                node_state = self.node.state_dict()
            finally:
                self.ctx.checkpoint_step = None
            own_step = node_state.get("step") if isinstance(node_state, dict) else None
            state = {"node": node_state, "rng": checkpoint.rng_state(), "steps": self.steps}
            if background:
                # The copy is what makes this a consistent cut: training changes the live tensors
                # in place as soon as the lock is released.
                with self.tracer.span("checkpoint capture"):
                    packed = await asyncio.to_thread(checkpoint.pack, state, True, self._staging)
            else:
                with self.tracer.span("checkpoint save"):
                    await asyncio.to_thread(checkpoint.write_state, path, state)
        if background:
            write = asyncio.ensure_future(asyncio.to_thread(checkpoint.write_packed, path, *packed))
            write.add_done_callback(lambda f: f.cancelled() or f.exception())  # reported by write_done
            self._write = (path, write)
        return {"step": own_step}

    async def write_done(self, path: str) -> dict:
        """Wait for the background write of `path` (save_state with background); raises its error.
        {"saved": False} when this process has none: it was restarted since (its state is stale)."""
        if self._write is None or self._write[0] != path:
            return {"step": None, "saved": False}
        await asyncio.shield(self._write[1])  # a cancelled call must not cancel the write
        return {"saved": True}

    async def _previous_write(self) -> None:
        """At most one background write per replica: a new save starts after the last one ended
        (its outcome goes to write_done, or nowhere if the driver gave that save up)."""
        if self._write is not None:
            await asyncio.wait([self._write[1]])
            self._write = None

    async def load_state(self, path: str, step: int) -> None:
        """Load what save_state wrote (after setup, before run); the step counter continues at `step`."""
        state = await asyncio.to_thread(checkpoint.read_state, path)
        async with self.state_lock:
            self.node.load_state_dict(state["node"])
            checkpoint.set_rng_state(state["rng"])
            self.steps = step
