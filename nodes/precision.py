"""Numeric precision and micro-batching shared by the learner, critic and reference nodes.

`precision` settings (LearnerConfig, CriticConfig, ReferenceConfig):
  "auto"  bf16 on CUDA, fp32 on CPU (the tests and the CPU demo stay exactly fp32);
  "bf16"  trained models: fp32 master weights and optimizer state, forward/backward under bf16
          autocast; the frozen reference: bf16 weights (nothing to accumulate, half the memory);
  "fp32"  everything fp32.
Why autocast rather than bf16 weights for trained models: AdamW updates of size lr * ~1 on
weights of size ~0.02 fall below bf16's 8-bit mantissa and are lost; fp32 masters keep them.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Literal

import torch

Precision = Literal["auto", "fp32", "bf16"]


def compute_dtype(precision: str, device) -> torch.dtype:
    """The dtype matmuls run in for `precision` on `device` (see the module docstring)."""
    if precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision={precision!r}; use 'auto', 'fp32' or 'bf16'")
    on_cuda = torch.device(device).type == "cuda"
    if precision == "bf16" or (precision == "auto" and on_cuda):
        return torch.bfloat16
    return torch.float32


def autocast(dtype: torch.dtype, device, cache_weights: bool = True):
    """bf16 autocast on `device` when dtype is bf16; a no-op context otherwise.

    cache_weights: keep each fp32 weight's bf16 copy until the context ends (torch's cache), so
    one context around several micro-batches casts the weights once. Off for FSDP-sharded models:
    the cache would hold a full unsharded bf16 copy of every weight for the whole context."""
    if dtype == torch.float32 or dtype == torch.float64:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype, cache_enabled=cache_weights)


def prepare_trained(model: torch.nn.Module, device, precision: str) -> torch.nn.Module:
    """A model the node trains: fp32 master weights on `device` (a checkpoint saved in bf16 would
    otherwise load, and train, in bf16), whatever the compute dtype."""
    return model.to(device=device, dtype=torch.float32)


def prepare_frozen(model: torch.nn.Module, device, precision: str) -> torch.nn.Module:
    """A model that is never trained (reference): weights in the compute dtype, no gradients."""
    return model.to(device=device, dtype=compute_dtype(precision, device)).eval().requires_grad_(False)


def micro_slices(n: int, micro_batch_size: int) -> list[slice]:
    """Consecutive slices of range(n) of at most micro_batch_size (0 = one slice of all n)."""
    size = micro_batch_size if micro_batch_size > 0 else max(n, 1)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def causal_lm_probe(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


def compile_layers(model: torch.nn.Module, compile: bool | None, device, amp: torch.dtype,
                   train: bool,
                   probe: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = causal_lm_probe) -> bool:
    """torch.compile each decoder layer of `model` in place (compile None = on CUDA); True if it did.

    Why per layer: the layers' elementwise glue (RMSNorm's float32 upcast, rotary, SwiGLU, the
    residual adds, their backward) is many small kernels per layer under autocast; compiled, they
    fuse, while the matmuls stay cuBLAS. Identical layers share one compiled graph (torchtitan
    compiles FSDP2 blocks the same way). The first compiles run here, on a two-row dummy batch
    under the autocast the node runs in (`amp`; float32: none) and, when `train`, with a backward
    and once more without grad, so a missing toolchain falls back to eager at setup, with one
    line, not in a step. The layers' own private attribute `_compiled_call_impl` is reset for
    that: torch has no public undo.
    `probe(model, ids)`: the model's forward on token ids, giving a tensor (default: a causal LM's
    logits; the critic passes its value head's)."""
    if not (torch.device(device).type == "cuda" if compile is None else compile):
        return False
    layers = next((m for name, m in model.named_modules()
                   if name.endswith("layers") and isinstance(m, torch.nn.ModuleList)), None)
    if layers is None:
        return False
    for layer in layers:
        layer.compile()
    try:
        ids = torch.ones(2, 8, dtype=torch.long, device=device)
        with torch.enable_grad() if train else torch.no_grad(), autocast(amp, device):
            out = probe(model, ids)
        if train:
            out.float().sum().backward()
            model.zero_grad(set_to_none=True)
            with torch.no_grad(), autocast(amp, device):   # the no-grad passes a trained node also makes
                probe(model, ids)                          # (value pass, proximal log-probs) compile here too
        return True
    except Exception as e:  # e.g. no C++ compiler / triton: eager is correct, just slower
        print(f"compile_layers: torch.compile failed ({type(e).__name__}: {str(e)[:200]}); running the "
              f"layers eagerly", flush=True)
        for layer in layers:
            layer._compiled_call_impl = None
        return False
