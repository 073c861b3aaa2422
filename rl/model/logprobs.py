"""Token log-probs and entropy over the vocab: the plain gather and the fused chunked kernel.

Layout convention shared by every function here: per-token tensors are `[batch, T]`, with a float
`mask` of the same shape that is 1 on response tokens (the actions) and 0 on prompt tokens and
padding. Sequences may have different lengths and any padding side: a masked position is treated
as absent, never as a zero-valued token. Per-sequence tensors are `[batch]`.
"""

from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token]: gather of the token's logit minus logsumexp over the vocab.

    Avoids materializing the full log_softmax; half-precision logits are upcast to float32
    first. logits [..., V], tokens [...] -> [...].
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _chunk_stats(logits: torch.Tensor, tokens: torch.Tensor, inv_temp: float, with_entropy: bool):
    """One chunk's (log-prob of the token, entropy or None, logsumexp) of softmax(logits * inv_temp).

    logits [R, V] in any float dtype, the math in float32 (float64 stays float64); tokens [R]."""
    z = logits.to(torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype)
    z = z * inv_temp if inv_temp != 1.0 else z
    lse = torch.logsumexp(z, dim=-1)
    logprob = z.gather(-1, tokens[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if with_entropy else None
    return logprob, entropy, lse


def _chunk_grad(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None, inv_temp: float) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk, in the logits' dtype. With z = logits * inv_temp, p = softmax(z):
    d logprob/dz_j = [j = token] - p_j and d entropy/dz_j = -p_j (z_j - lse + entropy)."""
    z = logits.to(lse.dtype)
    z = z * inv_temp if inv_temp != 1.0 else z
    p = torch.exp(z - lse[:, None])
    grad = p * -grad_logprob[:, None]
    if grad_entropy is not None:
        grad = grad - p * (z - (lse - entropy)[:, None]) * grad_entropy[:, None]
    # + grad_logprob at the token's column; a where, not a scatter, so a compiled kernel fuses it
    is_token = torch.arange(logits.shape[-1], device=logits.device) == tokens[:, None]
    grad = torch.where(is_token, grad + grad_logprob[:, None], grad)
    return (grad * inv_temp if inv_temp != 1.0 else grad).to(logits.dtype)


_compiled_fns: dict[str, object] = {}


def _compiled(name: str, fn, example: tuple, on_cuda: bool, compile: bool | None):
    """torch.compile'd `fn` (one fused kernel over all rows, no float32 temporaries), or None to
    run it eagerly in chunks: off CUDA by default, or when compiling failed (e.g. no compiler
    toolchain; said once). The first use compiles on `example`, a two-row slice of the real input,
    so a failure shows before any real work (dynamic shapes: the real sizes reuse the kernel)."""
    if not (on_cuda if compile is None else compile):
        return None
    if name not in _compiled_fns:
        try:
            _compiled_fns[name] = torch.compile(fn, dynamic=True)
            _compiled_fns[name](*example)
        except Exception as e:
            print(f"token_logprobs: torch.compile failed ({type(e).__name__}: {str(e)[:200]}); "
                  f"running eagerly in chunks", flush=True)
            _compiled_fns[name] = None
    return _compiled_fns[name]


class _TokenLogprobs(torch.autograd.Function):
    """Chunked log-softmax-gather and entropy over the vocab (see token_logprobs)."""

    @staticmethod
    def forward(ctx, logits, tokens, inv_temp, with_entropy, entropy_grad, chunk_rows, compile):
        flat, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
        out_dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        n = flat.shape[0]
        logprob = torch.empty(n, dtype=out_dtype, device=logits.device)
        entropy = torch.empty(n, dtype=out_dtype, device=logits.device) if with_entropy else None
        lse = torch.empty(n, dtype=out_dtype, device=logits.device)
        stats = _compiled(f"stats{int(with_entropy)}", _chunk_stats,
                          (flat[:2], flat_tokens[:2], inv_temp, with_entropy), logits.is_cuda, compile)
        rows = n if stats is not None else chunk_rows
        for i in range(0, n, rows):
            lp, ent, m = (stats or _chunk_stats)(flat[i:i + rows], flat_tokens[i:i + rows], inv_temp, with_entropy)
            logprob[i:i + rows], lse[i:i + rows] = lp, m
            if with_entropy:
                entropy[i:i + rows] = ent
        ctx.inv_temp, ctx.chunk_rows, ctx.compile = inv_temp, chunk_rows, compile
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(logits, tokens, lse, entropy if ctx.entropy_grad else None)
        shape = logits.shape[:-1]
        if not with_entropy:
            return logprob.view(shape), None
        entropy = entropy.view(shape)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprob.view(shape), entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        logits, tokens, lse, entropy = ctx.saved_tensors
        flat, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
        grad_logprob = grad_logprob.reshape(-1).to(lse.dtype)
        if not ctx.entropy_grad or grad_entropy is None:
            grad_entropy = entropy = None
        else:
            grad_entropy = grad_entropy.reshape(-1).to(lse.dtype)

        def part(i, j):  # rows i..j-1 of every per-row argument
            return (flat[i:j], flat_tokens[i:j], lse[i:j], None if entropy is None else entropy[i:j],
                    grad_logprob[i:j], None if grad_entropy is None else grad_entropy[i:j], ctx.inv_temp)
        grad_fn = _compiled(f"grad{int(grad_entropy is not None)}", _chunk_grad, part(0, 2), logits.is_cuda,
                            ctx.compile)
        rows = flat.shape[0] if grad_fn is not None else ctx.chunk_rows
        grad = torch.empty_like(flat)
        for i in range(0, flat.shape[0], rows):
            grad[i:i + rows] = (grad_fn or _chunk_grad)(*part(i, i + rows))
        return grad.view(logits.shape), None, None, None, None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = True, entropy_grad: bool = True, chunk_elems: int = 1 << 25,
                   compile: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(logits / T)[token], entropy of softmax(logits / T) or None), fused and chunked.

    The log-probs of logprobs_from_logits and the entropy -sum p log p (float32 math for half-precision
    logits), without their float32 copy of the whole [..., V] logits: a few rows at a time
    (<= chunk_elems values) are upcast, and backward recomputes each chunk's softmax from the saved
    half-precision logits and the per-row logsumexp. compile (None = on CUDA): torch.compile the
    math into one kernel over all rows instead (no float32 temporaries, so no chunks).
    entropy_grad=False: the entropy is a metric (no gradient). logits [..., V], tokens [...]."""
    chunk_rows = max(1, chunk_elems // logits.shape[-1])
    return _TokenLogprobs.apply(logits, tokens, 1.0 / temperature, with_entropy, entropy_grad, chunk_rows, compile)
