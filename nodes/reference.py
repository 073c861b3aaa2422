"""Reference: log-probs of the frozen initial policy, for the learner's KL term.

Consumes: `scored` items.  Produces: `with_ref`, the same items with "ref_logprobs" per response.
Waits for: scored samples.  Unblocked by: the reward node.

A node of its own (not a pass inside the learner) so its forward passes overlap generation and
training instead of adding to the learner's step time.

This file declares the kind (its settings and ports: what the driver reads before Ray starts, no
torch); nodes/impl/reference.py runs it (Node.implementation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from dataflow import Node
from dataflow.checks import AtLeast, NonNegative, Positive
from rl.data import policy
from rl.model.settings import Precision
from rl.update.settings import check_micro_batch_settings


@dataclass(kw_only=True)
class ReferenceConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    """The initial policy (the same spec the learner starts from)."""
    items_per_call: Annotated[int, AtLeast(1)] = 32
    """Items (prompt groups) taken from the input at once, as they are available."""
    micro_batch_size: Annotated[int, NonNegative] = 0
    """Samples per forward pass (0 = all of a call's samples at once). Bounds memory: a sample's
    logits are (prompt + response) x vocab values (W1: 0.08 GB in bf16)."""
    max_tokens_per_micro_batch: int = 0
    """Tokens per forward pass instead of a row count (0 = use micro_batch_size; as the learner's
    setting: one of the two must be 0; at least the longest prompt + response). On a GPU placement,
    left at 0 with micro_batch_size 0, the memory plan sets it (docs/gpus.md)."""
    packing: bool = False
    """Run each pass packed, without padding (as learner.packing); "reference/padding_frac" reports
    the padding of the passes."""
    precision: Precision = "auto"
    """auto: bf16 weights on CUDA (frozen, so no fp32 master copy is needed), fp32 on CPU."""
    compile: bool | None = None
    """torch.compile each decoder layer (None = on CUDA without packing; rl/model/precision.compile_setting
    says why, compile_layers how)."""
    temperature: Annotated[float, Positive] = 1.0
    """Temperature of the log-probs: the generators' sampling temperature, as the learner's (the
    graph shares it), so the KL compares two distributions at the same temperature."""


class Reference(Node):
    Config = ReferenceConfig
    inputs = ("scored",)
    outputs = ("with_ref",)
    implementation = "nodes.impl.reference:Reference"

    @staticmethod
    def check_settings(c, max_steps=None) -> None:
        """Its settings that must fit together, before Ray starts (dataflow/driver/preflight.py)."""
        check_micro_batch_settings("reference", c.micro_batch_size, c.max_tokens_per_micro_batch)
