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
import functools

import torch

from rl.model.settings import Precision  # noqa: F401 (the setting's type, torch-free; imported from here too)


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


ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


def cast_model(model: torch.nn.Module, device, dtype: torch.dtype) -> torch.nn.Module:
    """model.to(device, dtype) keeping the rotary embeddings' inverse frequencies in float32, as
    HF's from_pretrained(dtype=...) keeps them. A plain .to(bfloat16) casts those buffers too:
    bf16's 8-bit mantissa then shifts each rotation angle by up to position x 2^-9 radians (about
    one radian at position 500), so the policy attends to a different sequence than the learner's
    fp32-rotary model scores, the further into a long (multi-turn, tool-schema) context the worse."""
    kept = [(module, name, buf) for module in model.modules() for name, buf in module._buffers.items()
            if name in ROTARY_BUFFERS and buf is not None and buf.dtype == torch.float32]
    model.to(device=device, dtype=dtype)
    for module, name, buf in kept:
        module._buffers[name] = buf.to(device=device)
    return model


def prepare_trained(model: torch.nn.Module, device, precision: str) -> torch.nn.Module:
    """A model the node trains: fp32 master weights on `device` (a checkpoint saved in bf16 would
    otherwise load, and train, in bf16), whatever the compute dtype."""
    return model.to(device=device, dtype=torch.float32)


def prepare_frozen(model: torch.nn.Module, device, precision: str) -> torch.nn.Module:
    """A model that is never trained (reference): weights in the compute dtype, no gradients."""
    return cast_model(model, device, compute_dtype(precision, device)).eval().requires_grad_(False)


def micro_slices(n: int, micro_batch_size: int) -> list[slice]:
    """Consecutive slices of range(n) of at most micro_batch_size (0 = one slice of all n)."""
    size = micro_batch_size if micro_batch_size > 0 else max(n, 1)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@functools.cache
def compiler_works(device_type: str) -> str | None:
    """None if torch.compile's default backend builds and runs a kernel on `device_type`, else why
    not (e.g. no C++ compiler on a CPU machine, no triton on a GPU one). Cheap (one elementwise
    kernel), once per process."""
    try:
        x = torch.ones(4, device=device_type)
        torch.compile(lambda t: (t * 2).sin(), dynamic=False)(x).sum().item()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"


def compile_setting(compile: bool | None, packing: bool, gradient_checkpointing: bool = False) -> bool | None:
    """A node's `compile` with its default (None) kept eager where compiling is untried or slow:
    with gradient checkpointing (untried), and with packed passes, whose flex_attention inside
    compiled layers did not finish a GRPO step on an H200
    (bench/results/packing_w2_h200_2026-12-02a.md), while eager packed passes beat padded ones
    (bench/results/packing_w1long_h200_2026-12-02.md).
    That run compiled flex with dynamic=True; compile_layers now compiles flex layers with automatic
    dynamic shapes instead (its docstring), which a GPU run has yet to time before this default
    changes. An explicit True still compiles."""
    if compile is None and (packing or gradient_checkpointing):
        return False
    return compile


def compile_layers(model: torch.nn.Module, compile: bool | None, device) -> bool:
    """torch.compile each decoder layer of `model` in place (compile None = on CUDA); True if it did.

    Why per layer: the layers' elementwise glue (RMSNorm's float32 upcast, rotary, SwiGLU, the
    residual adds, their backward) is many small kernels per layer under autocast; compiled, they
    fuse, while the matmuls stay cuBLAS. Identical layers share one compiled graph (torchtitan
    compiles FSDP2 blocks the same way). Dynamic shapes from the start: batches and lengths vary.
    The graphs compile on first use, from the run's own batches, as torchtitan and verl do. An
    earlier version compiled every variant up front on a dummy batch (padded or not, one row,
    with and without grad): the learner's setup then spent most of its time compiling graphs a
    GRPO step never runs, and its first step still compiled; on first use only the graphs a run
    needs compile, at its sizes (bench/results/trl_smollm2_h200_2026-12-02a.md).
    A machine whose toolchain cannot compile (compiler_works) keeps the layers eager, with one line.

    flex_attention (packed passes on CUDA without flash_attn, rl/update/packing.py) is the exception to
    dynamic=True: it compiles with torch's automatic dynamic shapes (dynamic=None: the first pack
    length static, the second marks the lengths dynamic, later lengths reuse that graph; a pack of
    one flex block, N <= 128, adds one variant once, size 1 being specialized). Under
    dynamic=True every Python int the layer reads becomes a symbol, those of the BlockMask too
    (BLOCK_SIZE, and the mask_mod's closure offsets), and flex_attention's kernel is generated for
    them: on CPU (torch 2.13) it does not build (a C++ error in the flex template, eager layers too
    when flex is compiled dynamic=True); the H200 step that never finished ran it so (that
    this was the cause there is unconfirmed). The same flex under automatic dynamic shapes is what
    transformers compiles for eager layers, which ran on the H200. So call
    this after use_varlen_attention (a later switch to flex keeps dynamic=True)."""
    if not (torch.device(device).type == "cuda" if compile is None else compile):
        return False
    layers = next((m for name, m in model.named_modules()
                   if name.endswith("layers") and isinstance(m, torch.nn.ModuleList)), None)
    if layers is None:
        return False
    failure = compiler_works(torch.device(device).type)
    if failure is not None:
        print(f"compile_layers: torch.compile does not work here ({failure}); running the layers eagerly",
              flush=True)
        return False
    config = getattr(getattr(model, "backbone", model), "config", None)   # ValueModel keeps its trunk there
    dynamic = None if getattr(config, "_attn_implementation", None) == "flex_attention" else True
    for layer in layers:
        layer.compile(dynamic=dynamic)
    return True
