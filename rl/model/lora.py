"""LoRA training of the policy with peft (learner.lora.rank > 0).

The learner wraps its policy with peft's LoRA layers (wrap): the base weights are frozen (held in
the compute dtype: bf16 on CUDA, as the reference node holds its copy), only the adapter's A and B
train (float32) and only they are in the optimizer. The LoRA layers sit inside the plain HF model
(peft injects them in place), so every pass the learner runs (rl/update/ppo_update.py, compiled layers,
gradient checkpointing) is unchanged; the PeftModel wrapper is kept for disable_adapter() and
save_pretrained().

- Reference: the base model is the reference policy, so its log-probs are the learner's own model
  under `peft_model.disable_adapter()` (no second model in memory); the graphs then leave the
  reference node out (graphs/rlhf.py, learner.own_reference).
- Weight push: only the adapter travels (adapter_tensors; dataflow/weights/lora.py merges it).
- Checkpoints: the adapter (trainable_state) and its optimizer state; the base comes from the policy.
- Final output: <run>/final is the merged model (W0 + (alpha/r) B A in float32 on a fresh copy of
  the base, a normal HF model directory), <run>/final_adapter the PEFT adapter directory.

Only nn.Linear layers are adapted (peft's "all-linear" leaves lm_head out). The critic (PPO) keeps
full weights: it is its own model in its own node.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dataflow.errors import UserError
from dataflow.weights.lora import A, B, merged_weight
from rl.model.precision import compute_dtype
from rl.model.settings import LoraConfig  # noqa: F401 (its settings, torch-free; imported from here too)


ADAPTER = "default"          # peft's name of the one adapter


def require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UserError("learner.lora.rank > 0 needs peft: pip install -e '.[lora]' (or pip install peft)") from None


def wrap(model: nn.Module, cfg: LoraConfig, device, precision: str):
    """Inject LoRA layers into `model` (in place) and return the PeftModel around it; the base
    weights frozen in the compute dtype, the adapter trainable in float32."""
    require_peft()
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    targets = "all-linear" if list(cfg.target_modules) == ["all-linear"] else list(cfg.target_modules)
    try:
        wrapped = get_peft_model(model, PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=targets,
                                                       lora_dropout=cfg.dropout, bias="none"))
    except ValueError as e:
        raise UserError(f"learner.lora.target_modules={','.join(cfg.target_modules)}: {e}") from None
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    odd = [name for name, m in adapted.items() if not isinstance(m.get_base_layer(), nn.Linear)]
    if odd:
        raise UserError(f"learner.lora.target_modules: {', '.join(odd)} are not linear layers; name linear "
                        "layers only (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj) or all-linear")
    model.get_input_embeddings().register_forward_hook(_input_requires_grad)
    if compute_dtype(precision, device) == torch.bfloat16:    # the frozen base needs no fp32 master copy
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    return wrapped


def _input_requires_grad(module: nn.Module, inputs, output: torch.Tensor) -> None:
    """The frozen embeddings' output requires grad in grad mode, as every later layer's input does:
    otherwise the first decoder layer sees an input without grad and the compiled layers
    (precision.compile_layers), one graph for all layers in full fine-tuning, compile a second
    graph for it (dynamo guards on requires_grad) in every warm-up and step shape. Costs the
    first layer's input gradient, no parameter's (transformers' enable_input_require_grads, but
    not under no_grad: the reference pass with the adapter disabled keeps one graph too)."""
    if torch.is_grad_enabled():
        output.requires_grad_(True)


def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Name (in the plain HF model) -> peft LoRA layer."""
    from peft.tuners.lora import LoraLayer

    return {name.removeprefix("base_model.model."): m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an adapter-only push sends (dataflow/weights/lora.py): per adapted layer M, "M.lora_A"
    and "M.lora_B" x alpha / r, float32 copies on the model's device."""
    out = {}
    with torch.no_grad():
        for name, layer in adapted_layers(model).items():
            out[name + A] = layer.lora_A[ADAPTER].weight.detach().float().clone()
            out[name + B] = layer.lora_B[ADAPTER].weight.detach().float() * layer.scaling[ADAPTER]
    return out


def plain_name(name: str) -> str:
    """A peft-wrapped model's parameter name as the plain HF model names it."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def merged_state(model: nn.Module, adapter: dict[str, torch.Tensor], dtype: torch.dtype | None = None
                 ) -> dict[str, torch.Tensor]:
    """The plain model's parameters with the adapter merged (dataflow/weights/lora.merged_weight),
    each cast to `dtype` first (the generators' dtype) as a generator holds them."""
    out = {}
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        name, w = plain_name(name), p.detach().to(dtype or p.dtype)
        target = name.removesuffix(".weight")
        out[name] = merged_weight(w, adapter[target + A], adapter[target + B]) if target + A in adapter else w
    return out


class LoraWeights:
    """What the learner's weight sync needs of a LoRA policy (dataflow/weights/sync.py): the adapter
    to send, and the merged weights a generator then holds (for the checksums)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def tensors(self) -> dict[str, torch.Tensor]:
        return adapter_tensors(self.model)

    def merged(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        return merged_state(self.model, self.tensors(), dtype)


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's parameters (all a LoRA checkpoint needs beside the optimizer: the base is the policy)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    mine = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(state) != set(mine):
        raise UserError(f"the checkpoint's adapter has {len(state)} tensors, this learner's {len(mine)} "
                        "(a different learner.lora.rank or target_modules?): resume with the run's settings")
    with torch.no_grad():
        for n, p in mine.items():
            p.copy_(state[n])


def save_outputs(peft_model, tokenizer, base: nn.Module, run_dir: str) -> tuple[str, str]:
    """(merged dir, adapter dir): <run_dir>/final, the base (`base`: a fresh float32 copy of the
    policy, changed in place) with the adapter merged in float32; <run_dir>/final_adapter, the PEFT
    adapter directory (loads with peft.PeftModel.from_pretrained on that base)."""
    from rl.model.causal_lm import save_policy

    adapter = {k: v.cpu() for k, v in adapter_tensors(peft_model).items()}
    params = dict(base.named_parameters())
    with torch.no_grad():
        for target in {k[:-len(A)] for k in adapter if k.endswith(A)}:
            w = params[f"{target}.weight"]
            w.copy_(merged_weight(w, adapter[target + A], adapter[target + B]))
    merged, adapter_dir = Path(run_dir) / "final", Path(run_dir) / "final_adapter"
    save_policy(base, tokenizer, str(merged))
    peft_model.save_pretrained(str(adapter_dir))
    return str(merged), str(adapter_dir)
