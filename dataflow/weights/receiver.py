"""Generator side of the HybridEngine push (dataflow/weights/hybrid_engine.py has the whole
push, step by step): a WeightReceiver stages pushed versions in an arena, on a daemon thread
(remote) or written by a colocated WeightPusher (local), and switches the model between responses.

    receiver = WeightReceiver(model, group=push_group, name="generator-0")  # background thread
    with receiver.serving() as version:      # switch to the newest complete version, hold it
        generate(...)                        # weights cannot change until the block exits
    (or receiver.apply() -> version at the engine's own safe point; receiver.poll() peeks)
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from torch import nn

from dataflow.weights.adapters import Manifest, bind_targets, rehome
from dataflow.weights.transport import (CLOSE, MAGIC, OK, REJECTED, PushGroup, WeightPushError, bucket_bounds,
                                        copy_plan, run_copy, wait_all)



class WeightReceiver:
    """Generator side: stages pushed versions and switches between responses (see module doc).

    `model`: the generator's model in the engine form (its parameter names and dtype must match
    what the pusher sends; DTensor parameters receive their local shard). With `group`, a daemon
    thread receives pushes; without, the receiver is the target of a colocated WeightPusher.
    `version` is the version it serves (initially `version`, e.g. 0 for the shared seed).
    """

    def __init__(self, model: nn.Module, *, group: PushGroup | None = None, version: int = 0,
                 name: str = "", timeout_s: float = 60.0):
        self.model, self.group, self.timeout_s = model, group, timeout_s
        self.name = name or (group.names[group.rank] if group else "generator")
        self._version = version
        self._ready: int | None = None        # newest complete staged version, not yet applied
        self._error: Exception | None = None
        self._serve_lock = threading.Lock()   # held while a response is generated
        self._writer_waiting = threading.Event()   # a colocated push wants the serve lock
        self._staged = threading.Condition()       # notified when a version is staged
        self._arena_lock = threading.Lock()   # held while a push lands in the arena
        self._manifest: Manifest | None = None
        self._targets: dict[str, torch.Tensor] = {}
        self._flat: torch.Tensor | None = None       # the model's weights, if rehomed
        self._thread = None
        if group is not None:
            self._thread = threading.Thread(target=self._receive_loop, daemon=True,
                                            name=f"weights:{self.name}")
            self._thread.start()

    @property
    def version(self) -> int:
        """The version whose weights the model holds."""
        return self._version

    def poll(self) -> int | None:
        """The newest completely received version not yet applied (None if none); raises the
        receive thread's error, if it failed."""
        if self._error is not None:
            raise self._error
        ready = self._ready
        return ready if ready is not None and ready > self._version else None

    def wait_staged(self, version: int, timeout_s: float) -> bool:
        """Block until `version` (or a newer one) is staged or served; False on timeout."""
        with self._staged:
            return self._staged.wait_for(lambda: self._error is not None or self._version >= version
                                         or (-1 if self._ready is None else self._ready) >= version,
                                         timeout_s)

    def apply(self, wait: bool = False) -> int:
        """Switch to the newest staged version if there is one; returns the version served.

        Call only where no forward pass is running (between responses). If a push is landing
        right now, keeps the current weights unless `wait`.
        """
        if self.poll() is None or not self._arena_lock.acquire(blocking=wait):
            return self._version
        try:
            if self._ready is not None and self._ready > self._version:
                run_copy(self._apply_plan)
                self._version, self._ready = self._ready, None
        finally:
            self._arena_lock.release()
        return self._version

    @contextlib.contextmanager
    def serving(self, wait: bool = False):
        """`with receiver.serving() as version:` apply the newest version, then keep the weights
        fixed until the block exits (a colocated pusher waits for it)."""
        while self._writer_waiting.is_set():     # Lock is not fair: let a waiting push in first
            time.sleep(0.001)
        with self._serve_lock:
            yield self.apply(wait)

    def _bind(self, manifest: Manifest) -> None:
        """Check the model against the manifest (ValueError), lay plain parameters out in the
        arena's order (`rehome`: then a switch or a colocated push is one copy), map pieces."""
        bind_targets(manifest, self.model)
        params, item = dict(self.model.named_parameters()), manifest.dtype.itemsize
        self._flat = rehome([(params[e.name], e.offset // item) for e in manifest.entries],
                            manifest.total_bytes // item, manifest.dtype)
        self._manifest = manifest
        self._targets = bind_targets(manifest, self.model)
        self._views = self._piece_views()

    def _piece_views(self) -> dict[str, torch.Tensor]:
        """HF parameter -> flat view of where its shard lands in the model (colocated push)."""
        out = {}
        for e in self._manifest.entries:
            flat, start = self._targets[e.name].view(-1), 0
            for name, numel in e.sources:          # fused sources lie back to back
                out[name] = flat[start:start + numel]
                start += numel
        return out

    @contextlib.contextmanager
    def _lock_for_write(self, writer: str, timeout_s: float = -1):
        """Hold the weights against the generator (it waits at its next serving())."""
        self._writer_waiting.set()
        acquired = self._serve_lock.acquire(timeout=timeout_s)
        self._writer_waiting.clear()
        if not acquired:
            raise WeightPushError(f"colocated weight push from {writer} to {self.name}: the "
                                  f"generator held its weights for over {timeout_s:.0f} s")
        try:
            yield
        finally:
            self._serve_lock.release()

    def _receive_loop(self) -> None:
        g = self.group
        if g.device.type == "cuda":
            torch.cuda.set_device(g.device)
        try:
            while True:
                header = torch.zeros(5, dtype=torch.int64)
                g.broadcast(header, control=True).wait()     # idle until the next push
                magic, version, manifest_len, total, bucket = header.tolist()
                assert magic == MAGIC, header
                if version == CLOSE:
                    return
                self._receive(version, manifest_len, total, bucket)
        except Exception as e:                 # surfaced to the generator by poll()/apply()
            self._error = e if isinstance(e, WeightPushError) else WeightPushError(
                f"weight push from {g.names[0]} to {self.name}: {e}")
            with self._staged:
                self._staged.notify_all()

    def _receive(self, version: int, manifest_len: int, total: int, bucket: int) -> None:
        g = self.group
        ends = f"weight push v{version} from {g.names[0]} to {self.name}"
        with self._arena_lock:        # from here on, nothing staged earlier can be applied
            self._ready = None
        if manifest_len:
            data = torch.zeros(manifest_len, dtype=torch.uint8)
            wait_all([g.broadcast(data, control=True)], self.timeout_s, f"{ends}: manifest", data.device)
            manifest = Manifest.from_bytes(data.numpy().tobytes())
            try:
                with self._lock_for_write(g.names[0]):     # rehoming moves the weights
                    self._bind(manifest)
            except ValueError as e:
                self._error, self._targets, self._flat = WeightPushError(f"{ends}: {e}"), {}, None
            with self._arena_lock:
                self._arena = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=g.device)
                if self._flat is not None:         # a switch is one memcpy of the whole arena
                    self._apply_plan = ([(self._flat.view(torch.uint8), self._arena)], [], [])
                elif self._targets:
                    views = manifest.views(self._arena)
                    self._apply_plan = copy_plan(list(self._targets.values()),
                                                  [views[n] for n in self._targets])
        status = REJECTED if self._error is not None else OK
        with self._arena_lock:        # apply() cannot read a half-written arena
            works = [g.broadcast(self._arena[lo:hi]) for lo, hi in bucket_bounds(total, bucket)]
            ack, _ = g.post_ack(status)
            wait_all(works + [ack], self.timeout_s, f"{ends}: {len(works)} buckets", g.device)
        if status == OK:
            with self._staged:
                self._ready = version
                self._staged.notify_all()

    def close(self) -> None:
        """Stop serving pushes (the thread ends at the pusher's close())."""
        self.group = None
