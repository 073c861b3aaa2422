"""ModelConfig: the shape of a random-init policy. A module of its own, without torch: the nodes
without a model (prompts) hold one in their config (rl/data/policy.PolicySpec), and their actor
processes then start without torch's ~2 s import. rl/model/causal_lm.py builds the model from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated

from dataflow.checks import AtLeast, NonNegative


@dataclass(kw_only=True)
class ModelConfig:
    """A randomly initialised policy (no download). Defaults: the built-in tasks' model."""

    family: str = "llama"
    """Architecture: "llama" or "qwen2" (both RoPE, RMSNorm, SwiGLU)."""
    n_layer: Annotated[int, AtLeast(1)] = 2
    """Transformer blocks."""
    n_embd: Annotated[int, AtLeast(1)] = 128
    """Hidden size."""
    n_head: Annotated[int, AtLeast(1)] = 4
    """Attention heads (n_embd must be divisible by it)."""
    n_kv_head: Annotated[int, NonNegative] = 0
    """Key/value heads (grouped-query attention; must divide n_head). 0 = n_head."""
    intermediate_size: Annotated[int, AtLeast(1)] = 256
    """MLP width."""
    max_position_embeddings: Annotated[int, AtLeast(2)] = 64
    """Longest prompt + response, in tokens."""
    seed: int = 0
    """Seed of the random initialisation (the global torch RNG is left untouched)."""

    def __post_init__(self):
        if self.family not in ("llama", "qwen2"):
            raise ValueError(f"ModelConfig.family={self.family!r}; use 'llama' or 'qwen2'")
        # (ranges: the annotations, dataflow/checks.py; a zero must not divide here first)
        if self.n_head > 0 and self.n_embd % self.n_head:
            raise ValueError(f"ModelConfig: n_embd={self.n_embd} is not divisible by "
                             f"n_head={self.n_head}; change one of them")
        if self.n_kv_head > 0 and self.n_head % self.n_kv_head:
            raise ValueError(f"ModelConfig: n_kv_head={self.n_kv_head} must divide "
                             f"n_head={self.n_head} (or be 0 = n_head)")


def as_model_config(values: ModelConfig | dict | None) -> ModelConfig:
    """A ModelConfig from itself, None (defaults), a dict or another dataclass with the same
    field names; unknown keys are rejected with the list of valid ones."""
    if isinstance(values, ModelConfig):
        return values
    if values is None:
        return ModelConfig()
    if dataclasses.is_dataclass(values):
        values = dataclasses.asdict(values)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"ModelConfig: unknown keys {sorted(unknown)}; valid: {sorted(names)}")
    return ModelConfig(**values)
