"""Parallel layouts of the 3D-HybridEngine (HybridFlow, arXiv 2409.19256 §5) and the training one.

The policy trains in a p-d-t layout (pipeline x data x tensor parallel; the data axis is FSDP2,
so its shards are ZeRO-3 shards) and generates in a p_g-t_g layout: each generation replica
spans p_g*t_g ranks. Moving from one to the other is an all-gather inside a *micro-DP group* of
d_g = (p*t) / (p_g*t_g) ranks, never a full all-gather, because the groups are chosen so that
each rank's training shard is a subset of its generation shard.

Rank order (Megatron's, tp fastest): rank = (pp_rank * dp + dp_rank) * tp + tp_rank, i.e. the
DeviceMesh ("pp", "dp", "tp") in row-major order; with pp = 1 it is init_device_mesh(("dp", "tp")).

Grouping rule implemented (`ParallelLayout.coords`), within one dp index:
  gen_pp_rank    = pp_rank // (p / p_g)          gen_tp_rank = tp_rank // (t / t_g)
  micro_dp_rank  = (pp_rank % (p / p_g)) * (t / t_g) + tp_rank % (t / t_g)
  micro-DP group = ranks with equal (dp, gen_pp, gen_tp): a block of t/t_g *consecutive* tp
                   ranks (times p/p_g consecutive stages);
  generation replica = ranks with equal (dp, micro_dp_rank); its generation TP group is
                   tp ranks spaced t/t_g apart.
For p = p_g = 1 this is exactly the paper's Figure 8 (t=4, t_g=2: micro-DP {0,1},{2,3},
generation TP {0,2},{1,3}). Why it is a subset: TP chunk r of t (training) lies inside TP chunk
r // (t/t_g) of t_g (generation) because t_g divides t and torch.chunk splits evenly when the
sharded dimension is divisible by t (checked by `check_model`). The p > 1 rule is our natural
extension (blocks of consecutive stages); PP itself is not implemented yet (pp must be 1).

Bytes. The paper's DP is replicated; ours is FSDP (ZeRO-3). So a rank first completes its TP
shard by an all-gather over dp (the unshard FSDP2 does for every forward anyway: (d-1)/d of the
TP shard), then does the paper's micro-DP all-gather, which moves exactly
`micro_dp_bytes` = ((t*p - t_g*p_g) / (t_g*p_g*t*p)) * M per rank (M: TP-sharded bytes; the
TP-replicated norms need nothing). A full all-gather moves `naive_bytes` = ((N-1)/N) * M with
N = p*t*d. With t_g = 1 both equal the full gather (every replica needs every weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class RankCoords:
    """Where one rank sits in the training and the generation layout."""

    pp: int
    dp: int
    tp: int
    gen_pp: int
    gen_tp: int
    micro_dp: int
    """Index inside the micro-DP group (0 .. d_g - 1)."""
    gen_replica: int
    """Generation replica this rank serves: dp * d_g + micro_dp."""


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Training sizes (pp, dp, tp) and generation sizes (pp_gen, tp_gen) of one model."""

    pp: int = 1
    """Training pipeline stages p (only 1 is implemented)."""
    dp: int = 1
    """Training data-parallel size d; the dp axis is FSDP2 (parameters sharded over it)."""
    tp: int = 1
    """Training tensor-parallel size t."""
    pp_gen: int = 1
    """Generation pipeline stages p_g (must divide pp)."""
    tp_gen: int = 1
    """Generation tensor-parallel size t_g (must divide tp; 1 = full weights per replica)."""

    def __post_init__(self):
        for name in ("pp", "dp", "tp", "pp_gen", "tp_gen"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelLayout.{name}={getattr(self, name)}; sizes are >= 1")
        if self.tp % self.tp_gen:
            raise ValueError(f"ParallelLayout: tp_gen={self.tp_gen} does not divide tp={self.tp}; "
                             "the micro-DP scheme needs each training TP shard inside one "
                             "generation shard: pick tp_gen among the divisors of tp")
        if self.pp % self.pp_gen:
            raise ValueError(f"ParallelLayout: pp_gen={self.pp_gen} does not divide pp={self.pp}; "
                             "pick pp_gen among the divisors of pp")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def micro_dp(self) -> int:
        """d_g = (p * t) / (p_g * t_g): ranks that all-gather together."""
        return (self.pp * self.tp) // (self.pp_gen * self.tp_gen)

    @property
    def num_gen_replicas(self) -> int:
        return self.world_size // (self.pp_gen * self.tp_gen)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the layout's world of {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        dp, pp = rest % self.dp, rest // self.dp
        pp_block, tp_block = self.pp // self.pp_gen, self.tp // self.tp_gen
        micro = (pp % pp_block) * tp_block + tp % tp_block
        return RankCoords(pp=pp, dp=dp, tp=tp, gen_pp=pp // pp_block, gen_tp=tp // tp_block,
                          micro_dp=micro, gen_replica=dp * self.micro_dp + micro)

    def _groups(self, key) -> list[tuple[int, ...]]:
        groups: dict = {}
        for r in range(self.world_size):
            groups.setdefault(key(self.coords(r)), []).append(r)
        return [tuple(g) for g in groups.values()]

    def micro_dp_groups(self) -> list[tuple[int, ...]]:
        """Ranks that all-gather together (ascending, so the gather order is the tp order)."""
        return self._groups(lambda c: (c.dp, c.gen_pp, c.gen_tp))

    def gen_groups(self) -> list[tuple[int, ...]]:
        """One tuple per generation replica, ordered by (gen_pp, gen_tp) rank."""
        return self._groups(lambda c: c.gen_replica)

    def fsdp_groups(self) -> list[tuple[int, ...]]:
        return self._groups(lambda c: (c.pp, c.tp))

    def check_model(self, hf_config) -> None:
        """Raise ValueError when a sharded dimension of the model is not divisible by tp.

        Head counts must divide so that TP splits whole heads; vocab and MLP width so that shards
        are equal and the micro-DP subset property holds (torch.chunk of an uneven size is not).
        """
        dims = {"num_attention_heads": hf_config.num_attention_heads,
                "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None)
                or hf_config.num_attention_heads,
                "intermediate_size": hf_config.intermediate_size,
                "vocab_size": hf_config.vocab_size}
        for name, size in dims.items():
            if size % self.tp:
                raise ValueError(f"ParallelLayout(tp={self.tp}): model {name}={size} is not "
                                 f"divisible by tp; pick a tp that divides it"
                                 + (" (or pad the vocab)" if name == "vocab_size" else ""))


def micro_dp_bytes(layout: ParallelLayout, model_bytes: int) -> Fraction:
    """Paper §5: bytes each rank receives (and, in a ring, sends) in the micro-DP all-gather:
    ((t*p - t_g*p_g) / (t_g*p_g*t*p)) * M, for M bytes of TP-sharded weights."""
    tp, tg = layout.tp * layout.pp, layout.tp_gen * layout.pp_gen
    return Fraction(tp - tg, tg * tp) * model_bytes


def naive_bytes(layout: ParallelLayout, model_bytes: int) -> Fraction:
    """Paper §5: a full all-gather (every rank materialises the whole model, like full_tensor()
    on every parameter): ((t*p*d - 1) / (t*p*d)) * M."""
    n = layout.world_size
    return Fraction(n - 1, n) * model_bytes


def build_mesh(layout: ParallelLayout, device_type: str = "cpu"):
    """The training DeviceMesh ("dp", "tp") over the default process group (pp must be 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    _require_no_pp(layout)
    return init_device_mesh(device_type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))


def _require_no_pp(layout: ParallelLayout) -> None:
    if layout.pp != 1 or layout.pp_gen != 1:
        raise ValueError(f"ParallelLayout(pp={layout.pp}, pp_gen={layout.pp_gen}): pipeline "
                         "parallelism is not implemented yet; set pp=1 and pp_gen=1")


def _decoder(model: nn.Module) -> nn.Module:
    """The Llama/Qwen2 decoder stack (the module holding embed_tokens and layers): model.model
    for a causal LM, model.backbone for rl.model.causal_lm.ValueModel."""
    for module in model.modules():
        if hasattr(module, "embed_tokens") and isinstance(getattr(module, "layers", None),
                                                          nn.ModuleList):
            return module
    raise ValueError(f"{type(model).__name__}: no decoder with embed_tokens and layers found; "
                     "apply_training_layout knows Llama- and Qwen2-style models only")


def apply_training_layout(model: nn.Module, mesh, layout: ParallelLayout,
                          reshard_after_forward: bool = True) -> nn.Module:
    """TP over mesh["tp"] (parallelize_module), then FSDP2 over mesh["dp"]; in place.

    TP plan (Megatron's, as torchtitan's Llama): q/k/v and gate/up column-wise (Shard(0) of the
    weight and of Qwen2's q/k/v biases), o and down row-wise (Shard(1)), so each block does one
    all-reduce per attention and per MLP. Embedding row-wise (vocab-sharded, Shard(0)); lm_head
    column-wise (also Shard(0) of [vocab, hidden]) with logits gathered to Replicate, because HF
    loss and sampling code wants full-vocab logits. Tied embeddings: both sides shard the same
    tensor the same way, but parallelize_module replaces each side's Parameter, so the tie is
    restored afterwards (else the learner would update two copies). Norms (and a critic's value
    head) stay replicated across tp and are FSDP-sharded like everything else.
    FSDP2 per block, then on the root, as usual; TP-then-FSDP gives (_StridedShard(0), Shard(0))
    placements on column-wise weights, which the resharding code expects.
    """
    from torch.distributed.fsdp import fully_shard

    _require_no_pp(layout)
    if tuple(mesh.mesh_dim_names) != ("dp", "tp") or tuple(mesh.shape) != (layout.dp, layout.tp):
        raise ValueError(f"apply_training_layout: mesh {mesh.mesh_dim_names} {tuple(mesh.shape)} "
                         f"does not match layout dp={layout.dp}, tp={layout.tp}; build it with "
                         "build_mesh(layout)")
    config = getattr(model, "config", None) or getattr(_decoder(model), "config")
    layout.check_model(config)
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    decoder = _decoder(model)
    dp_mesh = mesh["dp"]
    for block in decoder.layers:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """The TP half of apply_training_layout (also what a TP generator built from transformers
    needs: its local shards are then exactly the generation shards the pusher delivers)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    decoder = _decoder(model)
    lm_head = getattr(model, "lm_head", None)
    tied = lm_head is not None and lm_head.weight is decoder.embed_tokens.weight
    block_plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                  "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                  "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                  "mlp.down_proj": RowwiseParallel()}
    for block in decoder.layers:
        parallelize_module(block, tp_mesh, block_plan)
    parallelize_module(decoder, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    if lm_head is not None:
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
        if tied:     # parallelize_module gave each side its own Parameter: tie them again
            model.lm_head.weight = decoder.embed_tokens.weight
    return model


def param_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the model's parameters (each tied tensor once), in `dtype` if given."""
    return sum(p.numel() * (dtype.itemsize if dtype else p.element_size())
               for p in model.parameters())
