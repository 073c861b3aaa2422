"""Masked reductions over the valid tokens of a batch (pure torch).

Layout convention shared by every function here: per-token tensors are `[batch, T]`, with a float
`mask` of the same shape that is 1 on response tokens (the actions) and 0 on prompt tokens and
padding. Sequences may have different lengths and any padding side: a masked position is treated
as absent, never as a zero-valued token. Per-sequence tensors are `[batch]`.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask), over all elements (dim=None) or along `dim`."""
    x = x * mask.to(x.dtype)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask), over all elements (dim=None) or along `dim`.

    Where the mask sums to 0 the result is 0 (not NaN), so an all-padding row is harmless.
    """
    mask = mask.to(x.dtype)
    total = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1e-8) * (count > 0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements of x (all of them, as one population)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        var = var * count / (count - 1).clamp(min=1.0)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked elements; padding positions become 0.

    Mean and (unbiased) variance are taken over all valid tokens of the batch, as in cleanrl's
    advantage normalization and TRL's `masked_whiten`. With shift_mean=False the mean is added back
    (only the scale changes), which keeps the sign of e.g. rewards.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)
