"""Sample shaping before the advantages: DAPO's overlong reward shaping (pure torch).

Per-sequence tensors are `[batch]`.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each response's score.

        L_exp   = max_len - buffer_len
        penalty = min(0, -(length - L_exp) / buffer_len * penalty_factor)

    0 up to L_exp tokens, then falling linearly to -penalty_factor at max_len (the generation cap),
    so a response that runs into the cap is told so gradually rather than cut to nothing.
    Source: Yu et al. 2025, "DAPO" (arXiv 2503.14476) section 3.4, eq. 13; verl's DAPO reward
    manager (overlong_buffer.len / .penalty_factor). lengths [B] response tokens -> [B] (<= 0).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong_penalty: buffer_len={buffer_len} must be in (0, max_len={max_len}]")
    exceed = lengths.to(torch.float64) - (max_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
