"""Per model family: HF parameter names -> the tensors a generation engine loads.

Two forms:
  - "hf": transformers' own names, one tensor per parameter (what nodes/impl/generator.py loads).
  - "fused": vLLM-style names for Llama/Qwen2: self_attn.qkv_proj = cat(q, k, v) and
    mlp.gate_up_proj = cat(gate, up) along dim 0 (weights, and Qwen2's q/k/v biases);
    lm_head is dropped when the embeddings are tied (the engine ties it itself).

Fusing is done on *generation shards*: with t_g > 1 the rank-j tensor is
cat(q_j, k_j, v_j), which is what a TP-sharded fused engine holds on rank j (a chunk of the
full cat(q, k, v) would not be, when q and k/v differ in size as under GQA).

Because every fusion concatenates along dim 0, the fused tensor is its sources laid one after
another in memory: the transport packs each source at its offset, and no cat is ever
materialised. `to_engine` / `to_hf` do the same mapping on whole tensors, for loaders and tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from torch import nn

# family -> {fused module name: the HF module names it concatenates, in order}
FUSIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
    "qwen2": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
}
FORMS = ("hf", "fused")
ALIGN = 256      # bytes: every engine tensor starts at a multiple in the arena (kernels like it)


@dataclass(frozen=True)
class EngineTensor:
    """One tensor the engine loads: `name`, made of `sources` (HF names) concatenated on dim 0."""

    name: str
    sources: tuple[str, ...]


def family_of(model_or_config) -> str:
    """"llama" or "qwen2" from an HF model or config (model_type)."""
    config = getattr(model_or_config, "config", model_or_config)
    family = getattr(config, "model_type", None)
    if family not in FUSIONS:
        raise ValueError(f"no weight adapter for model_type={family!r}; known: {sorted(FUSIONS)}")
    return family


class WeightAdapter:
    """Name mapping of one family to one engine form (see module docstring)."""

    def __init__(self, family: str | None, form: str = "hf"):
        if form not in FORMS:
            raise ValueError(f"WeightAdapter: unknown form {form!r}; use one of {FORMS}")
        # "hf" is every model's own names (any family: Qwen3, Gemma, Mistral, MoE...); only the
        # fused form needs to know which modules to concatenate
        if form == "fused" and family not in FUSIONS:
            raise ValueError(f"WeightAdapter: no fused form for family {family!r}; known: {sorted(FUSIONS)}")
        self.family, self.form = family, form

    def plan(self, hf_names: list[str]) -> list[EngineTensor]:
        """Engine tensors, in HF parameter order (a fused tensor where its first source is).

        `hf_names` are the model's parameter names (named_parameters(), so a tied lm_head is
        already absent). Raises ValueError when a fused group is incomplete.
        """
        if self.form == "hf":
            return [EngineTensor(n, (n,)) for n in hf_names]
        owner: dict[str, tuple[str, tuple[str, ...]]] = {}   # hf name -> (fused name, sources)
        for name in hf_names:
            for fused, parts in FUSIONS[self.family].items():
                for part in parts:
                    marker = f".{part}."
                    if marker in name:
                        prefix, suffix = name.split(marker)
                        sources = tuple(f"{prefix}.{p}.{suffix}" for p in parts)
                        owner[name] = (f"{prefix}.{fused}.{suffix}", sources)
        present = set(hf_names)
        plan, done = [], set()
        for name in hf_names:
            if name not in owner:
                plan.append(EngineTensor(name, (name,)))
                continue
            fused, sources = owner[name]
            if fused in done:
                continue
            missing = [s for s in sources if s not in present]
            if missing:
                raise ValueError(f"WeightAdapter({self.family}, fused): {fused} needs {missing}, "
                                 "which the model does not have")
            plan.append(EngineTensor(fused, sources))
            done.add(fused)
        return plan

    def to_engine(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Engine tensors from HF parameters (a tied "lm_head.weight" key is dropped)."""
        names = [n for n in hf if not (n == "lm_head.weight" and _tied(hf))]
        return {e.name: hf[e.sources[0]] if len(e.sources) == 1
                else torch.cat([hf[s] for s in e.sources]) for e in self.plan(names)}

    def to_hf(self, engine: dict[str, torch.Tensor], hf_shapes: dict[str, torch.Size],
              tie_word_embeddings: bool = False) -> dict[str, torch.Tensor]:
        """Inverse of to_engine: split fused tensors by their sources' row counts (`hf_shapes`
        gives the HF shape of every parameter). With tied embeddings, "lm_head.weight" is the
        embedding tensor itself, as in an HF state_dict."""
        out: dict[str, torch.Tensor] = {}
        for e in self.plan([n for n in hf_shapes if n != "lm_head.weight" or not tie_word_embeddings]):
            rows = [hf_shapes[s][0] for s in e.sources]
            for s, part in zip(e.sources, torch.split(engine[e.name], rows)):
                out[s] = part.view(hf_shapes[s])
        if tie_word_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out


def _tied(hf: dict[str, torch.Tensor]) -> bool:
    emb, head = hf.get("model.embed_tokens.weight"), hf.get("lm_head.weight")
    return emb is not None and head is not None and (head is emb or (
        head.data_ptr() == emb.data_ptr() and head.shape == emb.shape))


# ---------------------------------------------------------------------------------------------
# Manifest: where each engine tensor lives in the arena (the push's wire and staging layout)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    name: str                          # engine tensor name
    shape: tuple[int, ...]
    offset: int                        # bytes into the arena
    sources: tuple[tuple[str, int], ...]   # (HF parameter, numel), back to back from offset


@dataclass(frozen=True)
class Manifest:
    """The arena of one push: every engine tensor at an ALIGN-ed byte offset, in `dtype`. Built
    by the learner from the adapter's plan and the shard shapes, sent once as JSON; receivers
    stage into an arena of this layout and rehome their parameters into the same one."""

    dtype: torch.dtype
    entries: tuple[Entry, ...]
    total_bytes: int

    @classmethod
    def build(cls, plan, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> "Manifest":
        item = dtype.itemsize
        entries, offset = [], 0
        for e in plan:
            parts = [tuple(shapes[s]) for s in e.sources]
            if any(p[1:] != parts[0][1:] for p in parts):
                raise ValueError(f"{e.name}: fused sources {e.sources} differ beyond dim 0: {parts}")
            shape = (sum(p[0] for p in parts), *parts[0][1:]) if len(parts) > 1 else parts[0]
            entries.append(Entry(e.name, shape, offset,
                                 tuple((s, math.prod(p)) for s, p in zip(e.sources, parts))))
            offset += -(-math.prod(shape) * item // ALIGN) * ALIGN
        return cls(dtype, tuple(entries), offset)

    def pieces(self) -> dict[str, tuple[int, int]]:
        """HF parameter -> (byte offset, numel) of its generation shard in the arena."""
        item = self.dtype.itemsize
        out = {}
        for e in self.entries:
            offset = e.offset
            for name, numel in e.sources:
                out[name] = (offset, numel)
                offset += numel * item
        return out

    def to_bytes(self) -> bytes:
        return json.dumps({"dtype": str(self.dtype).removeprefix("torch."),
                           "total": self.total_bytes,
                           "entries": [[e.name, e.shape, e.offset, e.sources]
                                       for e in self.entries]}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        d = json.loads(data)
        entries = tuple(Entry(n, tuple(s), o, tuple((a, b) for a, b in src))
                        for n, s, o, src in d["entries"])
        return cls(getattr(torch, d["dtype"]), entries, d["total"])

    def views(self, arena: torch.Tensor) -> dict[str, torch.Tensor]:
        """Engine name -> typed view of the arena (uint8)."""
        item = self.dtype.itemsize
        return {e.name: arena[e.offset:e.offset + math.prod(e.shape) * item]
                .view(self.dtype).view(e.shape) for e in self.entries}


def bind_targets(manifest: Manifest, model: nn.Module) -> dict[str, torch.Tensor]:
    """Engine name -> the model's parameter (local shard) it lands in; ValueError on mismatch."""
    from torch.distributed.tensor import DTensor

    params = {n: (p.to_local() if isinstance(p, DTensor) else p).data
              for n, p in model.named_parameters()}
    names = {e.name for e in manifest.entries}
    if names != set(params):
        raise ValueError(f"pushed tensors and generator parameters differ: only pushed "
                         f"{sorted(names - set(params))[:5]}, only in generator "
                         f"{sorted(set(params) - names)[:5]} (wrong weight adapter form?)")
    for e in manifest.entries:
        p = params[e.name]
        if tuple(p.shape) != e.shape or p.dtype != manifest.dtype:
            raise ValueError(f"{e.name}: pushed {e.shape} {manifest.dtype}, generator has "
                             f"{tuple(p.shape)} {p.dtype}")
    return {e.name: params[e.name] for e in manifest.entries}


def rehome(tensors: list[tuple[torch.Tensor, int]], numel: int,
           dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Move parameters into one flat buffer: tensors[i] = (parameter, element offset).

    Each parameter keeps its identity (optimizers, tied modules and hooks are unaffected) but its
    data becomes a view of the buffer (`p.data = view`), so whole-model copies and sends are
    one contiguous operation instead of hundreds. Returns None (and changes nothing) unless all
    are plain (not DTensor), contiguous, of one dtype (`dtype`, if given) and on one device.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p, _ in tensors]
    if not params or any(isinstance(p, DTensor) or not p.is_contiguous() for p in params):
        return None
    if len({p.dtype for p in params} | ({dtype} if dtype else set())) != 1 \
            or len({p.device for p in params}) != 1:
        return None
    flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
    with torch.no_grad():
        for p, offset in tensors:
            view = flat[offset:offset + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
    return flat
