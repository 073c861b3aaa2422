"""The model side of the static decoder (rl/generation/decoding.StaticDecoder): which models it covers, a
decoder layer cut in two around attention, and the forward passes over the slot KV cache (prefill
of new prompts, one decode step of every slot, teacher forcing for tests), layer by layer from the
HF model's own modules.

The functions taking `dec` read the decoder's buffers (caches, lengths, the token to feed) and are
its methods (`_prefill`, `_decode_logits`, `teacher_forced_logits`); they live here so that
rl/generation/decoding.py keeps to the slots, the sampling state and the public API (the decode
steps and their CUDA graphs: rl/generation/decoder_steps.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

def unsupported_reason(model: nn.Module) -> str | None:
    """Why `model` cannot use the static decoder (None: it can)."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family not in ("llama", "qwen2"):
        return f"model_type {family!r} (the static decoder covers llama and qwen2)"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):   # position-independent inv_freq only
        return f"rope type {rope_type!r}"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(model, "lm_head"):
        return "not a plain HF LlamaForCausalLM / Qwen2ForCausalLM module layout"
    return None


def qkv(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [B, T, h, d], k and v [B, T, kv, d] with RoPE applied (x: [B, T, hidden]; cos, sin
    [B, T, d]). Head counts come from the projections' shapes, so under torch.compile they are
    constants of the weights."""
    from transformers.models.llama.modeling_llama import rotate_half
    B, T = x.shape[:2]
    d = attn.head_dim
    q = attn.q_proj(x).view(B, T, -1, d)
    k = attn.k_proj(x).view(B, T, -1, d)
    v = attn.v_proj(x).view(B, T, -1, d)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]     # [B, T, 1, d]: broadcast over heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def attention_input(layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """A decoder layer's part before attention: RMSNorm, the q/k/v projections and RoPE."""
    return qkv(layer.self_attn, layer.input_layernorm(h), cos, sin)


def attention_output(layer: nn.Module, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """A decoder layer's part after attention (o [B, T, heads x d]): o_proj, the residual add,
    RMSNorm, the SwiGLU MLP and its residual add."""
    h = h + layer.self_attn.o_proj(o)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def flash_with_kvcache():
    try:
        from flash_attn import flash_attn_with_kvcache
        return flash_attn_with_kvcache
    except Exception:
        return None


def compile_layer_halves(dec) -> None:
    """torch.compile attention_input and attention_output, now, on a dummy decode step of 3
    rows. Their glue is most of a layer's kernels (RMSNorm's float32 upcast, rotary, SwiGLU,
    residual adds: ~45 per layer eager, for 7 matmuls), and at batch 256 those launches, not
    the math, set a decode step's time even inside a CUDA graph. The weights are graph inputs,
    so one graph serves every layer; dynamic=True makes it serve every batch bucket too. The dummy
    batch size is one no head count or head size has: dynamo's duck sizing would otherwise tie
    the batch to that dimension (SmolLM2 has 3 KV heads: with 3 rows a second batch size
    recompiled, seen on an H200).
    Prefill and the episodes' extend prefill ([n, T] tokens) run the same halves: eager, their
    ~45 launches per layer were most of an extend's ~100 ms on an H200 (a trace's "extend prefill"
    spans, 7-turn episodes). Their graphs compile here too, beside the decode step's: T > 1 (a
    size-1 dimension is specialised, so T = 1 is a graph of its own), on both sides of inductor's
    fusion-size guard (hidden x tokens >= 5242880; a long admission prefill crosses it). A batch
    of one row runs as two (two_rows_at_least), so it needs no graph of its own."""
    cfg = dec.model.config
    dims = {dec.n_head, dec.n_kv, dec.n_head // dec.n_kv, dec.head_dim, cfg.hidden_size,
            getattr(cfg, "intermediate_size", 0), dec.n_head * dec.head_dim, dec.n_kv * dec.head_dim}
    B, inner = min(next(b for b in (3, 5, 7, 11, 13, 17) if b not in dims), dec.num_slots), dec.model.model
    long = -(-5242880 // (cfg.hidden_size * B)) + 1
    while long in dims:
        long += 1
    first, second = (two_rows_at_least(torch.compile(f, dynamic=True)) for f in (attention_input, attention_output))
    try:
        with torch.no_grad():
            for T in (1, 2, long):      # decode, prefill / extend, a long prefill
                pos = torch.arange(T, device=dec._device)[None].expand(B, T)
                h = inner.embed_tokens(torch.zeros_like(pos))
                cos, sin = inner.rotary_emb(h, pos)
                q, _, _ = first(inner.layers[0], h, cos, sin)
                # o as the decode step makes it (a view of sdpa's [B, kv, g, d] output), or
                # prefill's (sdpa's output transposed back)
                o = (q.view(B, dec.n_kv, -1, dec.head_dim).clone().reshape(B, 1, -1) if T == 1 else
                     q.transpose(1, 2).contiguous().transpose(1, 2).reshape(B, T, -1))
                second(inner.layers[0], h, o)
    except Exception as e:  # e.g. no C++ compiler / triton: eager is correct, just slower
        print(f"StaticDecoder: torch.compile of the decoder layers failed ({type(e).__name__}: "
              f"{str(e)[:200]}); decoding with eager layers", flush=True)
        return
    dec._attention_input, dec._attention_output = first, second
    dec.layers_compiled = True


def two_rows_at_least(compiled):
    """`compiled` (a layer half) with a one-row batch run as two copies of the row. Dynamo
    specializes a size-1 dimension, so one prompt's prefill or one episode's extend (turns end one
    at a time) would compile both halves again in the middle of a run, with every slot waiting.
    Only the first copy's outputs are returned."""
    def call(layer, *tensors):
        if tensors[0].shape[0] != 1:
            return compiled(layer, *tensors)
        out = compiled(layer, *(torch.cat([t, t]) for t in tensors))
        return tuple(o[:1] for o in out) if isinstance(out, tuple) else out[:1]
    return call


def prefill(dec, ids: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Right-padded prompts [n, P] -> K/V into `slots`, float32 logits [n, V] at each last token.
    Causal attention needs no padding mask: a real token never sees the pads after it."""
    inner = dec.model.model
    n, P = ids.shape
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h, dec.positions[:P][None].expand(n, P))
    g = dec.n_head // dec.n_kv
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        q, k, v = dec._attention_input(layer, h, cos, sin)
        if dec._flash:
            dec.k_cache[i][slots, :P], dec.v_cache[i][slots, :P] = k, v
        else:
            dec.k_cache[i][slots, :, :P] = k.transpose(1, 2)
            dec.v_cache[i][slots, :, :P] = v.transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1),
            v.transpose(1, 2).repeat_interleave(g, 1), is_causal=True, scale=attn.scaling)
        h = dec._attention_output(layer, h, o.transpose(1, 2).reshape(n, P, -1))
    last = h[torch.arange(n, device=h.device), lens - 1]
    return dec.model.lm_head(inner.norm(last)).float()


def extend_prefill(dec, ids: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """Right-padded continuations [n, A] of live slots (a multi-turn episode's next turn: the last
    sampled token, then the environment's tokens) -> their K/V into `slots` at positions
    starts .. starts + lens - 1, float32 logits [n, V] at each last token. The slots' earlier K/V
    stay as they are and are attended to: only the appended tokens are computed (no re-prefill of
    the history). A padding position's K/V is never written."""
    inner = dec.model.model
    n, A = ids.shape
    pos = starts[:, None] + torch.arange(A, device=ids.device)[None]          # [n, A]
    real = torch.arange(A, device=ids.device)[None] < lens[:, None]            # [n, A]
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h, pos)
    L = int((starts + lens).max())
    # query i of row r sees cache positions <= starts[r] + i (its history and the new tokens before it)
    allowed = dec.positions[None, None, :L] <= pos[:, :, None]                 # [n, A, L]
    mask = torch.zeros(allowed.shape, device=h.device, dtype=h.dtype).masked_fill_(~allowed, float("-inf"))
    rows, cols = real.nonzero(as_tuple=True)
    slot_of, at = slots[rows], pos[rows, cols]
    g = dec.n_head // dec.n_kv
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        q, k, v = dec._attention_input(layer, h, cos, sin)                     # k, v [n, A, kv, d]
        if dec._flash:
            dec.k_cache[i][slot_of, at], dec.v_cache[i][slot_of, at] = k[rows, cols], v[rows, cols]
            kc, vc = dec.k_cache[i][slots, :L].transpose(1, 2), dec.v_cache[i][slots, :L].transpose(1, 2)
        else:
            dec.k_cache[i][slot_of, :, at] = k[rows, cols]
            dec.v_cache[i][slot_of, :, at] = v[rows, cols]
            kc, vc = dec.k_cache[i][slots, :, :L], dec.v_cache[i][slots, :, :L]   # [n, kv, L, d]
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), kc.repeat_interleave(g, 1), vc.repeat_interleave(g, 1),
            attn_mask=mask[:, None], scale=attn.scaling)
        h = dec._attention_output(layer, h, o.transpose(1, 2).reshape(n, A, -1))
    last = h[torch.arange(n, device=h.device), lens - 1]
    return dec.model.lm_head(inner.norm(last)).float()


def decode_logits(dec, B: int, L: int | None = None) -> torch.Tensor:
    """One token for slots [0, B): writes its K/V at `lengths`, float32 logits [B, V].
    Attends over cache positions [0, L) (default all: a fixed shape for CUDA graphs; eager
    callers pass max(lengths) + 1 to skip the empty tail)."""
    inner = dec.model.model
    L = L or dec.max_len
    pos = dec.lengths[:B]
    h = inner.embed_tokens(dec.last[:B, None])   # [B, 1, hidden], not a view (as compiled)
    cos, sin = inner.rotary_emb(h, pos[:, None])
    # An additive mask [B, 1, 1, L] in the model's dtype, made once per step: sdpa turns a boolean
    # mask into this form itself, in every one of the layers' calls (two more kernels per layer).
    allowed = (dec.positions[None, :L] <= pos[:, None])[:, None, None, :]
    mask = torch.zeros(allowed.shape, device=h.device, dtype=h.dtype).masked_fill_(~allowed, float("-inf"))
    rows, g = dec.slot_ids[:B], dec.n_head // dec.n_kv
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        q, k, v = dec._attention_input(layer, h, cos, sin)
        kc, vc = dec.k_cache[i][:B], dec.v_cache[i][:B]
        if dec._flash is not None:
            # appends k/v at cache_seqlens and attends over the cache in one kernel. Run on an
            # H200 only through vLLM's bundled FlashAttention 3 (bench/vllm_check.py's adapter,
            # 2026-12-03): logits as sdpa's, 7% slower at W1's 384 positions; flash-attn's own
            # flash_attn_with_kvcache has not run (it installs on no machine here).
            o = dec._flash(q, kc, vc, k=k, v=v, cache_seqlens=pos.int(),
                           softmax_scale=attn.scaling, causal=True)
        else:
            # eager between the compiled halves: a compiled graph reading the cache would
            # specialise on L < max_len (and B < num_slots) and compile again at the full size
            kc[rows, :, pos] = k[:, 0]
            vc[rows, :, pos] = v[:, 0]
            # GQA for one query token: the g query heads sharing a KV head become g query rows.
            o = F.scaled_dot_product_attention(
                q.view(B, dec.n_kv, g, dec.head_dim), kc[:, :, :L], vc[:, :, :L],
                attn_mask=mask, scale=attn.scaling)
        h = dec._attention_output(layer, h, o.reshape(B, 1, -1))
    return dec.model.lm_head(inner.norm(h[:, 0])).float()


@torch.no_grad()
def teacher_forced_logits(dec, prompts: list[list[int]], continuations: list[list[int]]
                          ) -> list[torch.Tensor]:
    """Per sequence, float32 logits [len(cont), V] predicting each continuation token, through
    prefill and decode steps fed the given tokens (tests and benchmarks: compare with HF).
    Uses slots [0, n): call it on an idle decoder."""
    if dec.active or len(prompts) > dec.num_slots:
        raise ValueError("teacher_forced_logits needs an idle decoder with enough slots")
    n, dev = len(prompts), dec._device
    was_training = dec.model.training
    dec.model.eval()
    ids = torch.zeros(n, max(len(p) for p in prompts), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p, dtype=torch.long)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    logits = dec._prefill(ids.to(dev), lens, dec.slot_ids[:n])
    dec.lengths[:n] = lens
    out = [[logits[i]] for i in range(n)]
    for t in range(max(len(c) for c in continuations) - 1):
        dec.last[:n] = torch.tensor([c[t] if t < len(c) else 0 for c in continuations], device=dev)
        logits = dec._decode_logits(n)
        dec.lengths[:n] += 1
        for i in range(n):
            if t + 1 < len(continuations[i]):
                out[i].append(logits[i])
    dec.lengths[:n] = 0
    dec.model.train(was_training)
    return [torch.stack(o) for o in out]
