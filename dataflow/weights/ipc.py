"""weight_transport=cuda_ipc: the pieces both ends share (the flat buffer layout, the seqlock, CUDA IPC
handles), the learner's buffers (share_buffers, write_version) and the generator's end (IpcReceiver).
The protocol and its ordering: dataflow/weights/sync.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch

from dataflow.errors import UserError
from dataflow.timeouts import wait_within
from dataflow.weights.state import unique_state, with_aliases

IPC_ALIGN = 128
"""Elements: each tensor of the flat buffer starts at a multiple of this (256 bytes in bf16)."""

IPC_NEEDS_ONE_GPU = ("weight_transport=cuda_ipc needs every generator on the learner's GPU; "
                     "use object_store or collective")


def flat_layout(shapes: dict[str, tuple[int, ...]], align: int = IPC_ALIGN) -> tuple[list, int]:
    """([(name, offset, shape)], total elements): the tensors of `shapes` (in its order) laid out
    back to back in one flat buffer, each starting at a multiple of `align` elements."""
    layout, offset = [], 0
    for name, shape in shapes.items():
        shape = tuple(int(d) for d in shape)
        layout.append((name, offset, shape))
        numel = 1
        for d in shape:
            numel *= d
        offset += -(-numel // align) * align if numel else 0
    return layout, offset


def ipc_state_split(state: dict[str, torch.Tensor]) -> tuple[dict[str, tuple], dict[str, torch.Tensor]]:
    """(shapes of the floating-point entries: they go in the flat buffer, the other entries
    (integer buffers, if a model has any): CPU copies that ride the edge with each version)."""
    shapes = {k: tuple(v.shape) for k, v in state.items() if v.is_floating_point()}
    extra = {k: v.detach().to("cpu", copy=True) for k, v in state.items() if not v.is_floating_point()}
    return shapes, extra


def pack_state(flat: torch.Tensor, layout: list, state: dict[str, torch.Tensor]) -> None:
    """Copy (casting to flat's dtype, moving to its device) every tensor of `layout` from `state`
    into its view of `flat`."""
    with torch.no_grad():
        for name, view in unpack_state(flat, layout).items():
            view.copy_(state[name].detach(), non_blocking=True)


def unpack_state(flat: torch.Tensor, layout: list) -> dict[str, torch.Tensor]:
    """name -> view of `flat` (no copy) with the shape `layout` gives it."""
    out = {}
    for name, offset, shape in layout:
        numel = 1
        for d in shape:
            numel *= d
        out[name] = flat[offset:offset + numel].view(shape)
    return out


def seqlock_consistent(version: int, before: int, after: int) -> bool:
    """A copy of a buffer holds `version` whole when its header read `version` both before and after
    the copy (the learner writes -1 first, then the data, then the version it wrote)."""
    return before == version and after == version


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index() -> int:
    return torch.cuda.current_device()


def ipc_device(index: int) -> torch.device:
    return torch.device("cuda", index)


def _on(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def require_cuda(device: str, who: str) -> None:
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        raise UserError(f"weight_transport=cuda_ipc needs CUDA, but {who} runs on {device} "
                        "(placement=cpu?): use weight_transport=object_store (or collective)")


def share(tensor: torch.Tensor):
    """The CUDA IPC handle of `tensor` ((rebuild function, its arguments), torch's own reduction)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(tensor)


def open_handle(handle, device_index: int) -> torch.Tensor:
    """The tensor a share() handle names, opened on this process's `device_index` (as OpenRLHF
    does: the learner's CUDA_VISIBLE_DEVICES numbering may differ from ours)."""
    import inspect

    func, args = handle
    args = list(args)
    args[list(inspect.signature(func).parameters).index("storage_device")] = device_index
    return func(*args)


def share_buffers(model: torch.nn.Module | dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """The learner's two flat buffers in `dtype` for the whole state dict (+ an int64 seqlock header
    each), allocated and shared once: {"buffers", "headers", "handles", "layout", "uuid", "device"}.
    `model`: a module, or the state dict itself (a LoRA adapter's tensors). The learner keeps it
    referenced for its lifetime."""
    index = device_index()
    device = ipc_device(index)
    # A tied tensor (lm_head = embeddings) takes one place; its other names ride each version's
    # payload as aliases. keep_vars: a tied DTensor parameter is one object, with no storage to compare.
    state, aliases = unique_state(model if isinstance(model, dict) else model.state_dict(keep_vars=True))
    shapes, _ = ipc_state_split(state)    # a DTensor's shape is the whole tensor's
    layout, total = flat_layout(shapes)
    with _on(device):
        buffers = [torch.zeros(max(total, 1), dtype=dtype, device=device) for _ in range(2)]
        headers = [torch.full((1,), -1, dtype=torch.int64, device=device) for _ in range(2)]
        _sync(device)
        handles = [{"buffer": share(b), "header": share(h)} for b, h in zip(buffers, headers)]
    return {"buffers": buffers, "headers": headers, "handles": handles, "layout": layout,
            "aliases": aliases, "uuid": gpu_uuid(index), "device": device}


def write_version(shared: dict[str, Any], state: dict[str, torch.Tensor], version: int, dtype: torch.dtype,
                  learner: str) -> dict:
    """Seqlock write of `state` into the buffer of `version`'s parity (of `shared`, from share_buffers):
    the layout's tensors, a tied tensor's other names left out; returns the edge payload."""
    slot = version % 2
    buffer, header = shared["buffers"][slot], shared["headers"][slot]
    _, extra = ipc_state_split({k: v for k, v in state.items() if k not in shared["aliases"]})
    device = shared["device"]
    with _on(device):
        header.fill_(-1)
        _sync(device)
        pack_state(buffer, shared["layout"], state)
        _sync(device)
        header.fill_(version)
        _sync(device)
    return {"cuda_ipc": shared["handles"][slot], "slot": slot, "layout": shared["layout"],
            "aliases": shared["aliases"], "gpu_uuid": shared["uuid"], "dtype": str(dtype).removeprefix("torch."),
            "extra": extra, "learner": learner}


class IpcReceiver:
    """A generator's cuda_ipc end: a task that, for each version announced on the edge, opens the
    learner's buffer (once per buffer) and copies it into a private staging buffer right away,
    checking the seqlock header around the copy; apply() copies staging into the model.
    `config` is sync.py's WeightSyncConfig (its timeout_s), `owner` its GeneratorWeightSync (its
    version): read by attribute, not imported, so sync.py alone imports the other."""

    def __init__(self, ctx, config, model: torch.nn.Module, edge: str, device_index: int):
        self.ctx, self.config, self.model, self.edge, self.index = ctx, config, model, edge, device_index
        self.staged = -1                  # the version staging holds whole (-1: none)
        self.seen = -1                    # the newest version announced that was looked at
        self.layout: list | None = None
        self.extra: dict = {}
        self.aliases: dict[str, str] = {}   # a tied tensor's other names -> the name in the buffer
        self.staging: torch.Tensor | None = None
        self.opened: dict[Any, torch.Tensor] = {}   # handle key -> the learner's tensor, opened once
        self.error: BaseException | None = None
        self.changed = asyncio.Condition()
        self.lock = asyncio.Lock()        # staging: one writer (a receipt) or reader (apply) at a time
        self.stream = None
        self.task: asyncio.Task | None = None

    def start(self, owner) -> None:
        self.owner = owner
        self.task = asyncio.ensure_future(self._receive())

    async def _receive(self) -> None:
        try:
            while True:
                await self.ctx.wait_version(self.edge, self.seen + 1)
                version, payload = await self.ctx.latest(self.edge)
                self.seen = max(self.seen, version)
                self._check(version, payload)
                if version <= self.owner.version or version <= self.staged:
                    continue
                async with self.lock:
                    ok, before, after = await asyncio.to_thread(self._stage, version, payload)
                    if ok:
                        self.staged, self.extra = version, payload.get("extra", {})
                    elif before == version:   # the copy began, so staging holds a torn mix
                        self.staged = -1
                if not ok:
                    self.ctx.log(f"weight sync: dropped v{version} (the learner rewrote its buffer during "
                                 f"the copy: header {before} -> {after}); a newer version is coming")
                async with self.changed:
                    self.changed.notify_all()
        except asyncio.CancelledError:
            raise
        except BaseException as e:        # serving() raises it
            self.error = e
            async with self.changed:
                self.changed.notify_all()

    def _check(self, version: int, payload) -> None:
        me = self.ctx.full_name
        if not (isinstance(payload, dict) and "cuda_ipc" in payload):
            kind = ("no weights" if payload is None else
                    "a state dict" if isinstance(payload, dict) else type(payload).__name__)
            raise UserError(f"{me}: '{self.edge}' v{version} carries {kind}, not CUDA IPC handles: this "
                            f"generator uses weight_transport=cuda_ipc, the learner another transport")
        mine = self.uuid()
        if payload["gpu_uuid"] != mine:
            raise UserError(f"{IPC_NEEDS_ONE_GPU} ({payload.get('learner', 'the learner')} is on GPU "
                            f"{payload['gpu_uuid']}, {me} on {mine})")
        if self.layout is None:
            held = str(next(self.model.parameters()).dtype).removeprefix("torch.")
            self.ctx.log(f"weight sync: CUDA IPC from {payload.get('learner', 'the learner')} on GPU {mine}, "
                         f"{len(payload['layout'])} tensors in {payload['dtype']}" +
                         (f" (cast to this generator's {held})" if held != payload["dtype"] else ""))
        self.layout, self.aliases = payload["layout"], payload.get("aliases", {})

    def uuid(self) -> str:
        return gpu_uuid(self.index)

    def open(self, handle) -> torch.Tensor:
        """The learner's tensor `handle` names; opened once (torch's rebuild would count a reference
        per call on the learner's side)."""
        import inspect

        names = list(inspect.signature(handle[0]).parameters)
        key = tuple(repr(handle[1][names.index(n)])      # one allocation (and the tensor's place in it)
                    for n in ("storage_handle", "storage_offset_bytes", "tensor_offset", "tensor_size"))
        if key not in self.opened:
            self.opened[key] = open_handle(handle, self.index)
        return self.opened[key]

    def _stage(self, version: int, payload: dict) -> tuple[bool, int, int]:
        """Copy the buffer holding `version` into staging; (whole?, header before, header after)."""
        buffer, header = self.open(payload["cuda_ipc"]["buffer"]), self.open(payload["cuda_ipc"]["header"])
        if self.staging is None or self.staging.shape != buffer.shape or self.staging.dtype != buffer.dtype:
            self.staging = None
            self.staging = torch.empty_like(buffer)
        return stage_copy(self.staging, buffer, header, version, self._stream())

    def _stream(self):
        if self.stream is None and self.staging.is_cuda:
            self.stream = torch.cuda.Stream(device=self.staging.device)
        return self.stream

    async def apply(self, target: int, current: int) -> int:
        """Wait (up to timeout_s) until staging holds a version >= target, copy it into the model
        (between serving() blocks: nothing generates); returns that version."""
        try:
            await wait_within(self._wait_staged(target), self.config.timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"{self.ctx.full_name}: weights v{target} not staged from the learner's CUDA "
                               f"IPC buffer within {self.config.timeout_s:g} s (serving v{current}, "
                               f"staged v{self.staged})") from None
        # Shielded: a cancelled serving() leaves the copy to finish under the lock (the next
        # serving() copies the same staged version again).
        return await asyncio.shield(asyncio.ensure_future(self._load_staged(current)))

    async def _load_staged(self, current: int) -> int:
        async with self.lock:
            version = self.staged
            if version > current:
                await asyncio.to_thread(self._load)
        return max(version, current)

    async def _wait_staged(self, target: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.error is not None or self.staged >= target)
        if self.error is not None:
            raise self.error

    def _load(self) -> None:
        state = with_aliases({**unpack_state(self.staging, self.layout), **self.extra}, self.aliases)
        with _on(self.staging.device):
            self.owner.load(state)        # full weights, or a LoRA adapter merged (sync.GeneratorWeightSync.load)
            _sync(self.staging.device)    # staging may be rewritten (side stream) once this returns


def stage_copy(staging: torch.Tensor, buffer: torch.Tensor, header: torch.Tensor, version: int,
               stream=None) -> tuple[bool, int, int]:
    """Seqlock read: copy `buffer` into `staging` if `header` reads `version` before and after
    (on `stream`, a side CUDA stream, so generation on the default stream is not waited for).
    Returns (whole?, header before, header after); staging is garbage when not whole."""
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx, torch.no_grad():
        before = int(header.item())       # .item() waits for the current stream
        if before != version:
            return False, before, before
        staging.copy_(buffer)
        if stream is not None:
            stream.synchronize()
        after = int(header.item())
    return seqlock_consistent(version, before, after), before, after
