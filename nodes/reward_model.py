"""Reward model: scores each response with a sequence-classification model (one scalar logit).

Consumes: `samples` from the generator.  Produces: `scored`, like nodes/reward.py: per response
"score" (the model's logit), "token_rewards" (the score on the last token) and "failed" (a
non-finite score).
Waits for: generated samples.  Unblocked by: the generator.

The model is any local transformers `AutoModelForSequenceClassification` directory with
num_labels=1 (e.g. a trained RM saved with save_pretrained); it reads prompt + response tokens as
the policy produced them, so it must share the policy's tokenizer.

This file declares the kind (its settings and ports: what the driver reads before Ray starts, no
torch); nodes/impl/reward_model.py runs it (Node.implementation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from dataflow import Node
from dataflow.checks import AtLeast, ExistingPath, Finite


@dataclass(kw_only=True)
class RewardModelConfig:
    path: Annotated[str, ExistingPath(kind="dir")] = ""
    """Local directory of a sequence-classification model with num_labels=1 (required)."""
    items_per_call: Annotated[int, AtLeast(1)] = 16
    """Items (prompt groups) scored in one forward pass, as they are available."""
    scale: Annotated[float, Finite] = 1.0
    """Multiply the logit by this (reward models are often trained with arbitrary offsets)."""
    shift: Annotated[float, Finite] = 0.0


class RewardModel(Node):
    Config = RewardModelConfig
    inputs = ("samples",)
    outputs = ("scored",)
    implementation = "nodes.impl.reward_model:RewardModel"
