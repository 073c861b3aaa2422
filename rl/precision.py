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

from rl.padded_batch import sequence_logprobs

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


def causal_lm_probe(model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The learner's and reference's forward, as they call it."""
    return sequence_logprobs(model, ids, attention_mask, attention_mask.float())[0]


def compile_layers(model: torch.nn.Module, compile: bool | None, device, amp: torch.dtype,
                   train: bool,
                   probe: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = causal_lm_probe
                   ) -> bool:
    """torch.compile each decoder layer of `model` in place (compile None = on CUDA); True if it did.

    Why per layer: the layers' elementwise glue (RMSNorm's float32 upcast, rotary, SwiGLU, the
    residual adds, their backward) is many small kernels per layer under autocast; compiled, they
    fuse, while the matmuls stay cuBLAS. Identical layers share one compiled graph (torchtitan
    compiles FSDP2 blocks the same way).
    Every graph a run needs compiles here, not in its first step (measured on an H200: 16 s more
    in the critic's first step when they did not): dynamic shapes from the start (batches and
    lengths vary), and a dummy batch run without padding (the layers get no mask: sdpa's causal
    path), with padding (a mask tensor) and as one row, under the node's autocast (`amp`; float32:
    none), with a backward when `train`, and without grad (reference; a trained node's value pass
    and proximal log-probs). A missing toolchain so falls back to eager at setup, with one line.
    The layers' own private attribute `_compiled_call_impl` is reset for that: torch has no public
    undo.
    `probe(model, ids, attention_mask)`: the node's forward on a padded batch, giving a tensor
    (default: the learner's and reference's sequence_logprobs; the critic passes its value head's)."""
    if not (torch.device(device).type == "cuda" if compile is None else compile):
        return False
    layers = next((m for name, m in model.named_modules()
                   if name.endswith("layers") and isinstance(m, torch.nn.ModuleList)), None)
    if layers is None:
        return False
    for layer in layers:
        layer.compile(dynamic=True)
    try:
        ids = torch.ones(2, 8, dtype=torch.long, device=device)
        unpadded = torch.ones_like(ids)
        padded = unpadded.clone()
        padded[0, :3] = 0                                  # a left-padded prompt, as pad_batch lays it
        for grad in (True, False) if train else (False,):
            # one row is its own graph (dynamic shapes still specialise a size of 1): a micro-batch
            # split's last slice can be one sample
            for rows, mask in ((2, unpadded), (2, padded), (1, unpadded)):
                with torch.enable_grad() if grad else torch.no_grad(), autocast(amp, device):
                    out = probe(model, ids[:rows], mask[:rows])
                if grad:
                    out.float().sum().backward()
        model.zero_grad(set_to_none=True)
        return True
    except Exception as e:  # e.g. no C++ compiler / triton: eager is correct, just slower
        print(f"compile_layers: torch.compile failed ({type(e).__name__}: {str(e)[:200]}); running the "
              f"layers eagerly", flush=True)
        for layer in layers:
            layer._compiled_call_impl = None
        return False
