"""Small causal LMs for the built-in tasks: build/load, a value model (the HF sampling loop:
rl/generation/hf_sampling.py).

Every per-token tensor here and in rl/ uses the [B, T] token layout of rl/model/padded_batch.py
(pad_batch): [left-padded prompt | right-padded response], a quantity at column t concerning the
action input_ids[:, t]; values[:, t] = V(input_ids[:, :t]), the state token t is chosen in.

Position ids are always cumsum(attention_mask) - 1 (padded_batch.mask_position_ids), so a
sequence gets the same log-probs whatever padding surrounds it (sampling with a KV cache and a
fresh forward agree to ~1e-6).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from rl.model.model_config import ModelConfig, as_model_config  # noqa: F401 - importable from here too
from rl.model.padded_batch import mask_position_ids
from rl.data.tasks import load_tokenizer


# transformers' model classes are imported where used: they take ~2.5 s to import, and the driver
# imports this module (through the graph's node classes) without ever building a model.
def _hf_config(cfg: ModelConfig, tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    cls = LlamaConfig if cfg.family == "llama" else Qwen2Config
    return cls(vocab_size=len(tokenizer), hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer,
               num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head or cfg.n_head,
               intermediate_size=cfg.intermediate_size,
               max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)


def build_policy(model_config: ModelConfig | dict | None, tokenizer) -> nn.Module:
    """A random-init causal LM (LlamaForCausalLM / Qwen2ForCausalLM) sized by `model_config`.

    The vocab comes from the tokenizer; embeddings are tied; the same seed gives the same weights.
    """
    cfg = as_model_config(model_config)
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    hf_config = _hf_config(cfg, tokenizer)
    cls = LlamaForCausalLM if cfg.family == "llama" else Qwen2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = cls(hf_config)
    return model


def save_policy(model: nn.Module, tokenizer, path: str) -> None:
    """Write a normal HF model directory (config, safetensors weights, tokenizer)."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def load_policy(path: str):
    """(model, tokenizer) from a local HF model directory; never downloads.

    Raises FileNotFoundError naming the directory and the missing file when the directory, its
    config.json, its weights (model.safetensors[.index.json] or pytorch_model.bin) or its
    tokenizer.json is missing.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: model directory does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: missing config.json; not a saved HF model directory")
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    if not any(os.path.isfile(os.path.join(path, w)) for w in weights):
        raise FileNotFoundError(f"{path}: missing weights (model.safetensors); the save was "
                                "incomplete: save again with save_policy()")
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model, tokenizer


class ValueModel(nn.Module):
    """Critic: a causal LM backbone (no LM head) and a scalar head.

    forward(input_ids, attention_mask) -> values [B, T], token-aligned (module docstring):
    values[:, t] is the head applied to the hidden state at t - 1; values[:, 0] = 0.
    Build from a ModelConfig (random init) or from_policy (a copy of the policy's trunk).
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, seed: int = 0,
                 gradient_checkpointing: bool = False):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # Small init: initial values ~0, so early advantages are ~the rewards themselves.
            nn.init.normal_(self.value_head.weight, std=0.1 / hidden_size ** 0.5)
            nn.init.zeros_(self.value_head.bias)
        if gradient_checkpointing:
            self.backbone.activation_checkpointing_enable()

    @classmethod
    def from_config(cls, model_config: ModelConfig | dict | None, tokenizer,
                    gradient_checkpointing: bool = False) -> "ValueModel":
        cfg = as_model_config(model_config)
        policy = build_policy(cfg, tokenizer)
        return cls(policy.model, policy.config.hidden_size, seed=cfg.seed,
                   gradient_checkpointing=gradient_checkpointing)

    @classmethod
    def from_policy(cls, policy: nn.Module, gradient_checkpointing: bool = False) -> "ValueModel":
        return cls(copy.deepcopy(policy.model), policy.config.hidden_size,
                   gradient_checkpointing=gradient_checkpointing)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None = None, **attention_kwargs) -> torch.Tensor:
        """attention_mask None: a packed batch (rl/update/packing.packed_values): position_ids restart at
        every row, and each row's first token gets 0 (attention_kwargs: the rows' boundaries,
        PackedBatch.attention_kwargs). Always through this module (not the backbone alone), so
        FSDP2's hooks on it gather its parameters."""
        if position_ids is None:
            position_ids = mask_position_ids(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False, **attention_kwargs).last_hidden_state
        v = self.value_head(hidden).squeeze(-1)
        v = v if v.dtype == torch.float64 else v.float()  # fp32 out of bf16 autocast; a float64 test model stays exact
        shifted = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)
        return shifted if attention_mask is not None else shifted * (position_ids > 0)
