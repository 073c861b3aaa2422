"""The model settings the node configs share (precision, learner.lora), without torch: the node
declarations (nodes/learner.py, critic.py, reference.py) hold them, and the driver imports those
before Ray starts. rl/model/precision.py and lora.py, which apply them, import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from dataflow.checks import NonNegative, Positive, Range

Precision = Literal["auto", "fp32", "bf16"]
"""A node's `precision` setting (rl/model/precision.py's docstring says what each does)."""


@dataclass(kw_only=True)
class LoraConfig:
    rank: Annotated[int, NonNegative] = 0
    """LoRA rank r (0 = off: full fine-tuning). verl's rule of thumb: 32 or more; TRL's GRPO recipe
    trains rank 1 (shared/design/MULTITURN_LORA_PEERS.md)."""
    alpha: Annotated[float, Positive] = 32.0
    """The adapter's output is scaled by alpha / rank."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """The linear layers that get an adapter, by name (q_proj,v_proj,...), or all-linear: every
    linear layer but the output head."""
    dropout: Annotated[float, Range(0, 1, high_open=True)] = 0.0
    """Dropout on the adapter's input during the update (peft's lora_dropout)."""
