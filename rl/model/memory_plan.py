"""What each model node holds on its GPU, computed before start from the model's shape: a plan of
the colocated shares, a default token budget per micro-batch, and a refusal naming what to change.
rl/model/applied_plan.py decides and applies an RLHF graph's shares, budgets and checkpointing from it.

Pure arithmetic (no torch, no GPU), for llama / qwen2 decoders (RoPE, RMSNorm, SwiGLU):

- weights: every parameter (ModelShape.params, exactly what torch counts) in the node's dtype: the
  learner's fp32 masters; with LoRA its frozen base in the compute dtype (rl/model/lora.wrap) + the fp32
  adapter; generator and reference in their dtype; a LoRA generator also keeps a base copy of the
  adapted weights (dataflow/weights/lora.py).
- grads and AdamW state: 4 bytes per trained parameter for the gradient, 8 for exp_avg and exp_avg_sq,
  and a 4-byte `step` per trained tensor (torch's AdamW, not capturable), exactly as torch holds them.
- autocast weight cache: bf16 autocast over fp32 weights keeps a bf16 copy of every trained linear
  weight for the minibatch (rl/update/ppo_update.py caches them): 2 bytes per linear parameter.
- activations: the bytes autograd keeps for backward per token of a micro-batch, per decoder layer
      32 H + a (4 I + 2 kv_heads head_dim) + 4 heads         (a = 4 in fp32, 2 under bf16 autocast)
  plus 4 (3 H + 2 head_dim) per token outside the layers and a V per kept logit row (the fused
  log-prob kernel keeps no fp32 copy). Fitted to, and checked against, the tensors torch saves on
  CPU (tests/unit/test_memory_plan.py: within ACTIVATION_TOLERANCE). With gradient checkpointing each
  layer keeps only its fp32 input (4 H per token) and one layer is live at a time. Transient
  buffers (the backward's own gradients of activations, the allocator's fragmentation) are not
  modelled: the plan keeps RESERVE of the GPU free for them and the CUDA context.
- weight push buffers (weight_transport=cuda_ipc, dataflow/weights/ipc.py): the learner's two flat
  buffers and each generator's staging copy, every pushed tensor (tied ones once; the float32 adapter
  alone with LoRA) padded to IPC_ALIGN elements, exactly as flat_layout lays them out.
- KV cache: 2 layers kv_heads head_dim bytes per token per slot (rl/generation/decoder_slots.kv_bytes_per_slot),
  slots x (max prompt + max response) tokens; plus a float32 logits row per slot for sampling.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

GiB = 1 << 30
RESERVE = 0.10
"""Fraction of the GPU the plan leaves unassigned: CUDA context, allocator fragmentation, the
gradients of activations in backward, kernels' workspaces."""
ACTIVATION_TOLERANCE = 0.15
"""How far the activation model may be from torch's saved tensors in the tests (relative)."""
IPC_ALIGN = 128
"""Elements each tensor of a cuda_ipc flat buffer is padded to (dataflow/weights/ipc.IPC_ALIGN, which
imports torch; tests/unit/test_memory_plan.py checks they agree)."""
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = False
    qkv_bias: bool = False          # qwen2: q, k, v projections have biases

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelShape":
        heads = cfg["num_attention_heads"]
        return cls(vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate=cfg["intermediate_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
                   qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)))

    @classmethod
    def from_dir(cls, path: str) -> "ModelShape":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf_config(json.load(f))

    def linears(self) -> dict[str, tuple[int, int]]:
        """One decoder layer's linear weights, name -> (out, in)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def linear_params(self) -> int:
        return self.layers * sum(o * i for o, i in self.linears().values())

    def tensor_sizes(self) -> list[int]:
        """The elements of every parameter tensor, a tied one once: embeddings, per layer its linears,
        q/k/v biases (qwen2) and two RMSNorms, the final norm, an untied head."""
        bias = [self.heads * self.head_dim] + [self.kv_heads * self.head_dim] * 2 if self.qkv_bias else []
        layer = [o * i for o, i in self.linears().values()] + bias + [self.hidden] * 2
        head = [] if self.tied else [self.vocab * self.hidden]
        return [self.vocab * self.hidden] + layer * self.layers + [self.hidden] + head

    def params(self) -> int:
        """Every parameter, as sum(p.numel() for p in model.parameters()) counts it (tied once)."""
        return sum(self.tensor_sizes())

    def lora_tensor_sizes(self, rank: int, targets: list[str] | tuple[str, ...] = ("all-linear",)) -> list[int]:
        """The elements of every LoRA adapter tensor: per layer and adapted linear, A (rank x in) and B (out x rank)."""
        chosen = [s for n, s in self.linears().items() if "all-linear" in targets or n in targets]
        return [n for o, i in chosen for n in (rank * i, o * rank)] * self.layers

    def lora_params(self, rank: int, targets: list[str] | tuple[str, ...] = ("all-linear",)) -> tuple[int, int, int]:
        """(adapter parameters, adapter tensors, base parameters of the adapted weights) for LoRA of `rank`."""
        adapter = self.lora_tensor_sizes(rank, targets)
        base = self.layers * sum(o * i for n, (o, i) in self.linears().items() if "all-linear" in targets or n in targets)
        return sum(adapter), len(adapter), base

    def push_bytes(self, dtype_bytes: int, lora_rank: int = 0, lora_targets=("all-linear",)) -> int:
        """The flat buffer one cuda_ipc push fills (dataflow/weights/ipc.flat_layout): every tensor the
        learner sends (the adapter's alone with LoRA), in the travel dtype, each padded to IPC_ALIGN elements."""
        sizes = self.lora_tensor_sizes(lora_rank, lora_targets) if lora_rank else self.tensor_sizes()
        return sum(-(-n // IPC_ALIGN) * IPC_ALIGN for n in sizes) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def activation_bytes_per_token(self, act_bytes: int, checkpointing: bool = False) -> int:
        """Bytes autograd keeps per token of a forward + log-prob pass (module docstring); the logits
        rows are added by activation_bytes()."""
        h = self.hidden
        layer = 32 * h + act_bytes * (4 * self.intermediate + 2 * self.kv_heads * self.head_dim) + 4 * self.heads
        outside = 4 * (3 * h + 2 * self.head_dim)
        if checkpointing:
            return self.layers * 4 * h + layer + outside
        return self.layers * layer + outside

    def activation_bytes(self, tokens: int, logit_rows: int, act_bytes: int, checkpointing: bool = False) -> int:
        return tokens * self.activation_bytes_per_token(act_bytes, checkpointing) + logit_rows * self.vocab * act_bytes


@dataclass
class NodeNeed:
    """One node replica's bytes, by what holds them."""
    node: str
    parts: dict[str, int] = field(default_factory=dict)
    setting: str = ""
    """The setting that shrinks it most, for the refusal line."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def text(self) -> str:
        return f"{self.total / GiB:.2f} GiB (" + ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.parts.items() if v) + ")"


def learner_need(shape: ModelShape, *, on_cuda: bool, micro_batch_tokens: int, logit_rows: int | None = None,
                 lora_rank: int = 0, lora_targets=("all-linear",), checkpointing: bool = False,
                 node: str = "learner") -> NodeNeed:
    """AdamW over fp32 masters (full fine-tuning) or over the LoRA adapter on a frozen base held in
    the compute dtype (bf16 on CUDA); bf16 autocast on CUDA, fp32 on CPU (rl/model/precision.py)."""
    compute = 2 if on_cuda else 4
    params = shape.params()
    if lora_rank:
        trained, tensors, _ = shape.lora_params(lora_rank, lora_targets)
        weights = params * compute + trained * 4
        cache = 0                                   # the frozen base already is bf16; the adapter is small
    else:
        trained, tensors = params, len(shape.tensor_sizes())
        weights = params * 4
        cache = shape.linear_params() * 2 if on_cuda else 0
    rows = micro_batch_tokens if logit_rows is None else logit_rows
    return NodeNeed(node, {"weights": weights, "grads": trained * 4, "optimizer": trained * 8 + tensors * 4,
                           "autocast cache": cache,
                           "activations": shape.activation_bytes(micro_batch_tokens, rows, compute, checkpointing)},
                    f"{node}.max_tokens_per_micro_batch" + ("" if checkpointing else f" or {node}.gradient_checkpointing=true"))


def policy_shape(cfg) -> tuple[ModelShape, int]:
    """(shape, max_position_embeddings) of the graph's policy: its HF directory or the built-in model."""
    if cfg.policy.path:
        with open(os.path.join(cfg.policy.path, "config.json")) as f:
            hf = json.load(f)
        return ModelShape.from_hf_config(hf), hf.get("max_position_embeddings", 2048)
    from rl.data.tasks import build_fast_tokenizer   # the same ids, without importing transformers

    m = cfg.policy.model
    return ModelShape(vocab=len(build_fast_tokenizer()), hidden=m.n_embd, layers=m.n_layer, heads=m.n_head,
                      kv_heads=m.n_kv_head or m.n_head, head_dim=m.n_embd // m.n_head,
                      intermediate=m.intermediate_size, tied=False, qkv_bias=m.family == "qwen2"), \
        m.max_position_embeddings


def generator_need(shape: ModelShape, *, dtype_bytes: int, slots: int, max_len: int, lora_rank: int = 0,
                   lora_targets=("all-linear",)) -> NodeNeed:
    base_copy = shape.lora_params(lora_rank, lora_targets)[2] * dtype_bytes if lora_rank else 0
    return NodeNeed("generator", {"weights": shape.params() * dtype_bytes, "lora base copy": base_copy,
                                  "kv cache": slots * max_len * shape.kv_bytes_per_token(dtype_bytes),
                                  "sampling": slots * shape.vocab * 4},
                    "generator.prompts_per_call (slots = prompts_per_call x group_size) or generator.max_prompt_tokens")


def reference_need(shape: ModelShape, *, dtype_bytes: int, micro_batch_tokens: int) -> NodeNeed:
    """Frozen weights; a no-grad pass keeps one layer's activations and the logits rows at a time."""
    return NodeNeed("reference", {"weights": shape.params() * dtype_bytes,
                                  "activations": shape.activation_bytes(micro_batch_tokens, micro_batch_tokens,
                                                                        dtype_bytes, checkpointing=True)
                                  - micro_batch_tokens * shape.layers * 4 * shape.hidden},
                    "reference.max_tokens_per_micro_batch")


@dataclass
class Plan:
    gpu_bytes: int
    needs: list[NodeNeed]
    shares: dict[str, float]
    problem: str | None = None
    suggested: dict[str, float] | None = None
    """rlhf_plan: the shares the needs suggest (plan_shares), beside the placement's."""
    enforced: bool = True
    """False when the GPU's size was assumed: the problem is printed, not refused."""
    notes: list[str] = field(default_factory=list)
    caps: dict[str, float] = field(default_factory=dict)
    """Node -> the fraction of the GPU its allocator may use, above its share (NodeSpec.memory_cap):
    the phase switch's generator (rl/model/applied_plan.py)."""
    settings: list[tuple[str, object, str]] = field(default_factory=list)
    """What the plan set or kept, (key, value, who): who is "plan" (the user left it at its
    default; rl/model/applied_plan.py chose it) or "you" (the user's own value, kept)."""

    def summary(self) -> str:
        """One line: the settings it applied and kept (--describe shows the bytes)."""
        shown = ", ".join((f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}") + (" (yours)" if who == "you" else "")
                          for k, v, who in self.settings if who != "placement")
        return (f"memory plan ({self.gpu_bytes / GiB:.0f} GiB GPU, {'applied' if self.enforced else 'assumed size, not applied'}): "
                f"{shown or 'nothing to set'} (--describe shows each node's bytes)")

    def text(self) -> str:
        size = f"{self.gpu_bytes / GiB:.0f} GiB" + ("" if self.enforced else " assumed: set gpu_memory_gib")
        lines = [f"memory plan (one GPU of {size}, {RESERVE:.0%} kept free; rl/model/applied_plan.py):"]
        for n in self.needs:
            tip = f" (the needs suggest {self.suggested[n.node]:.2f})" if self.suggested and n.node in self.suggested else ""
            tip += f" (up to {self.caps[n.node]:.2f} between learner steps)" if n.node in self.caps else ""
            lines.append(f"  {n.node:<10} share {self.shares.get(n.node, 0):.2f}{tip}  needs {n.text()}")
        if self.settings:
            lines.append("  settings (plan: chosen by the plan, you: your value, kept):" if self.enforced else
                         "  settings the plan would set (not applied: the GPU size is assumed; set gpu_memory_gib):")
            lines += [f"    {key} = {value:.4g}  ({who})" if isinstance(value, float) else f"    {key} = {value!r}  ({who})"
                      for key, value, who in self.settings]
        lines += [f"  {note}" for note in self.notes]
        if self.problem:
            lines.append(f"  does not fit: {self.problem}")
        return "\n".join(lines)


def plan_shares(needs: list[NodeNeed], gpu_bytes: int, fixed: dict[str, float] | None = None) -> Plan:
    """Shares of one GPU for nodes that share it: each node its need, the room left over split in
    proportion to the needs (so activations and KV cache can grow into it); `fixed` shares (a user's
    gpu_shares) are kept and checked. problem: the first node that does not fit, in one line."""
    usable = gpu_bytes * (1 - RESERVE)
    fixed = fixed or {}
    shares: dict[str, float] = {}
    for n in needs:
        if n.node in fixed:
            shares[n.node] = fixed[n.node]
            if n.total > fixed[n.node] * usable:
                return Plan(gpu_bytes, needs, shares, _refusal(n, fixed[n.node] * usable))
    free = [n for n in needs if n.node not in fixed]
    room = usable - sum(fixed.values()) * usable
    wanted = sum(n.total for n in free)
    if wanted > room:
        worst = max(free, key=lambda n: n.total)
        return Plan(gpu_bytes, needs, {**shares, **{n.node: n.total / usable for n in free}},
                    _refusal(worst, room - (wanted - worst.total)))
    for n in free:
        shares[n.node] = (n.total + (room - wanted) * n.total / max(wanted, 1)) / gpu_bytes
    return Plan(gpu_bytes, needs, shares)


SHRINKABLE = ("activations", "logits gradient", "kv cache", "decoder room", "sampling")
"""The parts a node's `setting` shrinks; the rest (weights, grads, optimizer state) only LoRA or more GPUs do."""


def _refusal(n: NodeNeed, room: float) -> str:
    fixed = n.total - sum(n.parts.get(k, 0) for k in SHRINKABLE)
    share = n.setting[n.setting.find("raise gpu_shares."):] if "raise gpu_shares." in n.setting else ""
    held = ", optimizer state and weight push buffers" if n.parts.get("push buffers") else " and optimizer state"
    what = (f"lower {n.setting}" if fixed < room else
            f"its weights, gradients{held} alone take {fixed / GiB:.1f} GiB: "
            + (f"{share}, " if share else "") + "use learner.lora.rank (e.g. 32), more GPUs, or a smaller model")
    return (f"{n.node} needs {n.total / GiB:.1f} GiB but has {max(room, 0) / GiB:.1f} GiB of the GPU "
            f"({n.text().split(' (', 1)[1].rstrip(')')}); {what}")


def tokens_within(room: float, trainers: dict[str, tuple[int, float, float]], cap: int) -> int:
    """The largest budget (at most cap tokens) whose trainers fit `room` bytes over their static
    bytes, each (replicas on the GPU, bytes per token of a pass, bytes of its optimizer step) needing
    the larger of its pass and its step; -1 where the steps alone do not fit."""
    def need(tokens: int) -> float:
        return sum(k * max(per * tokens, step) for k, per, step in trainers.values())
    if need(0) > room:
        return -1
    low, high = 0, int(cap)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if need(mid) <= room else (low, mid - 1)
    return low


PROMPT_ROOM_MULTIPLE = 64


def default_prompt_room(max_prompt_tokens: int, max_pos: int, response: int) -> int:
    """A decoder slot's tokens for the prompt: generator.max_prompt_tokens, or for 0 the model's
    positions less the response, within [256, 1024] (the generator, the checks and the plan)."""
    return max_prompt_tokens or min(max(max_pos - response, 256), 1024)


def prompt_room(g, max_pos: int, response: int, longest_prompt: int | None) -> tuple[int, bool]:
    """(tokens a decoder slot keeps for the prompt, whether the data chose it). The default
    (default_prompt_room) fits prompts the generator cannot see; the driver has read them all
    (rl/preflight.longest_prompt), so their longest, to PROMPT_ROOM_MULTIPLE, is all a slot needs.
    Not for episodes, whose later turns outgrow the first prompt; a user's
    generator.max_prompt_tokens is kept."""
    default = default_prompt_room(g.max_prompt_tokens, max_pos, response)
    if g.max_prompt_tokens or g.env.path or not longest_prompt:
        return default, False
    room = -(-longest_prompt // PROMPT_ROOM_MULTIPLE) * PROMPT_ROOM_MULTIPLE
    return (room, True) if room < default else (default, False)


def default_micro_batch_tokens(shape: ModelShape, room_bytes: float, static_bytes: int, *, on_cuda: bool,
                               checkpointing: bool, multiple: int = 256) -> int:
    """The largest token budget whose activations (every token a logits row, the worst case) fit
    in `room_bytes` less the node's static bytes; rounded down to `multiple` (0 if none fits)."""
    act = 2 if on_cuda else 4
    per_token = shape.activation_bytes_per_token(act, checkpointing) + shape.vocab * act
    tokens = int((room_bytes - static_bytes) // per_token)
    return max(0, tokens // multiple * multiple)
