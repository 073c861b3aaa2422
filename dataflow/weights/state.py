"""What a weight push carries, apart from how it travels (dataflow/weights/sync.py): the object
store's encoding of a state dict, the copy that travels, its size, and the checksums both ends log."""

from __future__ import annotations

import torch

from dataflow.channel import codec


def weights_checksum(model: torch.nn.Module, dtype: torch.dtype | None = None) -> float:
    """Order-sensitive checksum of the parameters (by name), optionally cast to `dtype` first.
    Sharded (DTensor) parameters are gathered whole first: a collective for a multi-rank learner."""
    from torch.distributed.tensor import DTensor

    return state_checksum({n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()},
                          dtype)


# Elements per step of state_checksum's float64 sum: an 8 MB buffer, reused for every tensor.
CHECKSUM_CHUNK = 1 << 20


def state_checksum(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> float:
    """weights_checksum of named tensors (a LoRA learner's merged weights, rl/model/lora.merged_state):
    the sum over tensors (sorted by name, the i-th weighted by i + 1) of each one's elements, cast
    to `dtype`, summed in float64. In float64 chunks through one reused buffer, not a float64 copy
    of each tensor (`.double().sum()`, or `.sum(dtype=float64)`, which on CPU casts the same way):
    0.055 CPU-s instead of 0.155 for a 135M fp32 model on one thread. The same order for any tensor dtype, so a generator's
    bf16 weights and a learner's fp32 ones cast to bf16 give the same sum."""
    if not state:
        return 0.0
    with torch.no_grad():
        buf = torch.empty(min(CHECKSUM_CHUNK, max(1, *(t.numel() for t in state.values()))), dtype=torch.float64,
                          device=next(iter(state.values())).device)
        sums = []
        for i, (_, p) in enumerate(sorted(state.items(), key=lambda kv: kv[0])):
            flat = p.detach().reshape(-1)
            if buf.device != flat.device:
                buf = torch.empty(buf.numel(), dtype=torch.float64, device=flat.device)
            total = torch.zeros((), dtype=torch.float64, device=flat.device)
            for start in range(0, flat.numel(), buf.numel()):
                chunk = flat[start:start + buf.numel()].to(dtype or p.dtype)
                part = buf[:chunk.numel()]
                part.copy_(chunk)
                total += part.sum()
            sums.append(total * (i + 1))
        return float(torch.stack(sums).sum().item())


def state_bytes(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> int:
    """Bytes of `state` with its floating tensors in `dtype` (None: as they are)."""
    return sum(t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
               for t in state.values())


def unique_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`state` with each tensor once, and the names dropped -> the name kept for the same tensor.
    A model's state_dict() lists a tied tensor under every name (an lm_head tied to the embeddings
    is a quarter of Qwen2.5-0.5B's weights): sent once, re-aliased on arrival (with_aliases)."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        key = _identity(t) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
        else:
            kept[name] = t
            if key is not None:
                seen[key] = name
    return kept, aliases


def _identity(t: torch.Tensor) -> tuple:
    """What makes two entries one tensor: the same storage view. A tensor without storage of its
    own (a DTensor's data_ptr() is 0, as a meta tensor's; some subclasses raise) is only itself:
    a tied parameter is one object in state_dict(keep_vars=True)."""
    try:
        ptr = t.data_ptr()
    except RuntimeError:
        ptr = 0
    return (t.device, t.dtype, ptr, tuple(t.shape), tuple(t.stride())) if ptr else ("object", id(t))


def with_aliases(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """unique_state's inverse: every dropped name back, naming the kept tensor (no copy)."""
    return {**state, **{name: state[kept] for name, kept in aliases.items()}} if aliases else state


def encode_state(state: dict[str, torch.Tensor]) -> dict:
    """A state dict as the channel codec's header and flat numpy buffers (views, no copy)."""
    header, buffers = codec.encode(codec.Message(state))
    return {"state_dict": header, "buffers": buffers}


def decode_state(payload: dict) -> dict[str, torch.Tensor]:
    """encode_state's state dict: read-only tensors over the object store's memory (load_state_dict
    copies them). No size limit: one tensor of a large model can pass the codec's 1 GiB default."""
    return codec.decode(payload["state_dict"], payload["buffers"], max_bytes=1 << 62).data


def travel_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A CPU copy of `t` for the object store, floating point cast to `dtype` first (on its device)."""
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t.to("cpu", copy=True)
