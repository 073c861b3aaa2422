"""Where a policy comes from: a local HF model directory, or a random-init model for the built-in
tasks. Generator, reference, learner and critic all load the same PolicySpec, so they start equal."""

from __future__ import annotations

from dataclasses import dataclass, field

from dataflow.errors import UserError
from rl.models import ModelConfig, build_policy, load_policy
from rl.tasks import build_tokenizer


@dataclass(kw_only=True)
class PolicySpec:
    path: str = ""
    """Local HF model directory (config.json, safetensors, tokenizer.json). Empty: build `model`."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Shape of the random-init model used when `path` is empty (built-in tasks)."""


def load(spec: PolicySpec):
    """(model, tokenizer). Never downloads; a missing or incomplete directory is a UserError."""
    if spec.path:
        try:
            return load_policy(spec.path)
        except (FileNotFoundError, OSError, ValueError) as e:
            raise UserError(f"policy.path={spec.path}: {e}") from None
    tokenizer = build_tokenizer()
    return build_policy(spec.model, tokenizer), tokenizer
