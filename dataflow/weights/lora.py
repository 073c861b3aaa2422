"""Adapter-only weight pushes (learner.lora.rank > 0): what travels, and the generator's merge.

What travels: per adapted linear layer `M` (its weight `M.weight` in the plain HF model), two
float32 tensors "M.lora_A" (r x in) and "M.lora_B" (out x r), B already multiplied by peft's scaling
alpha / r: the adapter, megabytes instead of the model (rl/model/lora.adapter_tensors builds them). They
go over the same transports as full weights (dataflow/weights/sync.py): a state dict on the object
store, a module of these tensors for the collective push (AdapterHolder), the flat buffer of cuda_ipc.

The generator merges: W = W0 + B_s A, computed in float32 and cast to the generator's dtype, so the
decoder runs plain dense weights (full decode speed; vLLM's own LoRA path is slower than merged
weights, see shared/design/MULTITURN_LORA_PEERS.md). W0 is a copy of only the adapted weights,
taken from the generator's model at its first adapter, before anything was merged into it (the
model loaded from the policy dir, which is the learner's frozen base). Each version is recomputed
from W0, never by un-merging the previous version: subtracting B A again in bfloat16 would leave
the rounding of every version in the weights. The price is one more copy of the adapted weights per
generator. The learner computes its checksum of the same merged weights with merged_weight() too,
so equal checksums at equal versions show the generator holds exactly what the learner trains.
A switch happens only where full weights switch today (serving()), so no response mixes versions.
"""

from __future__ import annotations

import torch
from torch import nn

A, B = ".lora_A", ".lora_B"


def is_adapter(state: dict) -> bool:
    """Whether a pushed state dict is an adapter (this module's names), not full weights."""
    return bool(state) and all(k.endswith((A, B)) for k in state)


def merged_weight(base: torch.Tensor, a: torch.Tensor, b_scaled: torch.Tensor) -> torch.Tensor:
    """W0 + B_s A in float32, in W0's dtype and device: the one merge both ends compute."""
    delta = b_scaled.to(base.device, torch.float32) @ a.to(base.device, torch.float32)
    return (base.float() + delta).to(base.dtype)


def targets_of(state: dict[str, torch.Tensor]) -> list[str]:
    """The adapted layers' names (the keys without their .lora_A / .lora_B), sorted."""
    return sorted({k[:-len(A)] for k in state if k.endswith(A)})


def check_shapes(state: dict[str, torch.Tensor], params: dict[str, torch.Tensor], who: str) -> None:
    """ValueError naming the layer when an adapter does not fit the model it is merged into."""
    for target in targets_of(state):
        weight = params.get(f"{target}.weight")
        a, b = state.get(target + A), state.get(target + B)
        if weight is None or b is None:
            raise ValueError(f"{who}: the pushed adapter has '{target}', the model no such linear layer"
                             if weight is None else f"{who}: the pushed adapter has {target}{A} but no {target}{B}")
        if weight.dim() != 2 or tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(weight.shape) or b.shape[1] != a.shape[0]:
            raise ValueError(f"{who}: adapter {target} is B {tuple(b.shape)} x A {tuple(a.shape)}, its weight "
                             f"{tuple(weight.shape)}: the learner and this generator load different models")


class AdapterMerger:
    """The generator's merge: merge(state) writes W0 + B_s A into every adapted weight of `model`."""

    def __init__(self, model: nn.Module, name: str = "generator"):
        self.model, self.name = model, name
        self.base: dict[str, torch.Tensor] | None = None    # target -> pristine W0 (only the adapted ones)

    def merge(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        if self.base is None:          # the first adapter: the model still holds the base weights
            check_shapes(state, params, self.name)
            self.base = {t: params[f"{t}.weight"].detach().clone() for t in targets_of(state)}
        elif set(targets_of(state)) != set(self.base):
            raise ValueError(f"{self.name}: the pushed adapter's layers changed between versions")
        with torch.no_grad():
            for target, w0 in self.base.items():
                params[f"{target}.weight"].copy_(merged_weight(w0, state[target + A], state[target + B]))


def _key(name: str) -> str:
    return name.replace(".", "/")     # a parameter name may hold no dots


class AdapterHolder(nn.Module):
    """The adapter tensors as one module's parameters (float32), the form the collective push and
    cuda_ipc move (they send a module's parameters by name). The learner fills it at each publish
    (fill); the generator builds it zeroed from the shapes the learner announces (shapes)."""

    def __init__(self, shapes: dict[str, list[int]]):
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(_key(name), nn.Parameter(torch.zeros(shape), requires_grad=False))

    def shapes(self) -> dict[str, list[int]]:
        return {k.replace("/", "."): list(p.shape) for k, p in self.named_parameters()}

    def fill(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, p in self.named_parameters():
                p.copy_(state[k.replace("/", ".")])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k.replace("/", "."): p.detach() for k, p in self.named_parameters()}
