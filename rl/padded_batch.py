"""Padded token batches: samples -> [B, T] tensors and back, and the log-probs of a batch.

Token alignment used everywhere here and expected by rl/ (masked, advantages, losses, kl, logprobs): a batch is
`input_ids [B, T]` laid out as [left-padded prompt | right-padded response] (see pad_batch), and
any per-token quantity at column t concerns the action input_ids[:, t]:
  logprobs[:, t] = log pi(input_ids[:, t] | input_ids[:, :t])   (from the logits at t - 1)
  values[:, t]   = V(input_ids[:, :t])                          (the state token t is chosen in)
so masks, rewards, log-probs and values share one [B, T] layout with response_mask = 1 on the
response tokens (their <eos> included).

Position ids are always cumsum(attention_mask) - 1 (mask_position_ids), so a sequence gets the
same log-probs whatever padding surrounds it.
"""

from __future__ import annotations

import torch
from torch import nn

from rl.logprobs import token_logprobs


def mask_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids from the attention mask: cumsum - 1 (0 on the left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


COLUMN_MULTIPLE = 8
"""The model passes' padded widths are multiples of this (pad_batch(multiple_of=...) in the learner,
reference and critic; rl/packing.padded_columns widens their micro-batches to it).
Inductor specializes a compiled layer on whether the sequence length is a multiple of 8 (its
alignment check): on one H200, SmolLM2's learner ran 62 GRPO steps at unaligned widths, then one
aligned width recompiled its layers for 9-12 s of that step (bench/RESULTS.md, thirteenth session).
One alignment for every width keeps one graph; tensor cores like the multiple too."""


def aligned(width: int, multiple: int = COLUMN_MULTIPLE) -> int:
    """The smallest multiple of `multiple` at or above width."""
    return -(-width // multiple) * multiple


def pad_batch(samples: list[dict], pad_id: int, token_keys: tuple[str, ...] = ("logprobs",),
              device: str | torch.device = "cpu", multiple_of: int = 1) -> dict:
    """Padded tensors for a list of samples (dicts with prompt_ids and response_ids).

    Layout: prompts LEFT-padded to the longest prompt P, responses RIGHT-padded to the longest
    response R, so every response starts at column P, and T = P + R rounded up to a multiple of
    `multiple_of` (extra right padding; the model passes' batches use COLUMN_MULTIPLE). Returns
      input_ids [B, T] long, attention_mask [B, T] long (1 = real token),
      response_mask [B, T] float (1 = response token), prompt_len P,
      loss_mask [B, T] float: response_mask times each sample's "loss_mask" (a multi-turn episode's:
      1 on the sampled tokens, 0 on the environment's; absent = all ones): the tokens that are
      trained, counted, and enter KL, entropy and advantages. response_mask keeps the layout
      (per-token lists are read back with it: unpad_tokens),
      and for each key in token_keys (per-response-token lists, e.g. behaviour "logprobs",
      "token_rewards") a float [B, T] tensor laid on the response columns, 0 elsewhere.
    """
    num = len(samples)
    prompt_len = max(len(s["prompt_ids"]) for s in samples)
    response_len = max(len(s["response_ids"]) for s in samples)
    total = aligned(prompt_len + response_len, multiple_of)
    input_ids = torch.full((num, total), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((num, total), dtype=torch.long)
    response_mask = torch.zeros((num, total), dtype=torch.float32)
    loss_mask = torch.zeros((num, total), dtype=torch.float32)
    per_token = {k: torch.zeros((num, total), dtype=torch.float32) for k in token_keys}
    for i, s in enumerate(samples):
        p, r = s["prompt_ids"], s["response_ids"]
        start, end = prompt_len - len(p), prompt_len + len(r)
        input_ids[i, start:end] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention_mask[i, start:end] = 1
        response_mask[i, prompt_len:end] = 1
        if s.get("loss_mask") is None:
            loss_mask[i, prompt_len:end] = 1
        elif len(s["loss_mask"]) != len(r):
            raise ValueError(f"pad_batch: sample {i} has {len(s['loss_mask'])} 'loss_mask' values for "
                             f"{len(r)} response tokens")
        else:
            loss_mask[i, prompt_len:end] = torch.tensor(s["loss_mask"], dtype=torch.float32)
        for k in token_keys:
            if len(s[k]) != len(r):
                raise ValueError(f"pad_batch: sample {i} has {len(s[k])} {k!r} values for "
                                 f"{len(r)} response tokens")
            per_token[k][i, prompt_len:end] = torch.tensor(s[k], dtype=torch.float32)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask,
             "response_mask": response_mask, "loss_mask": loss_mask, **per_token}
    batch = {k: v.to(device) for k, v in batch.items()}
    batch["prompt_len"] = prompt_len
    return batch


def unpad_tokens(x: torch.Tensor, response_mask: torch.Tensor) -> list[list[float]]:
    """Inverse of pad_batch for one [B, T] per-token tensor: each row's response-token values."""
    rows = x.detach().float().cpu().tolist()
    masks = (response_mask > 0).cpu().tolist()
    return [[v for v, m in zip(row, mrow) if m] for row, mrow in zip(rows, masks)]


def sequence_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      response_mask: torch.Tensor, temperature: float = 1.0,
                      with_entropy: bool = True,
                      entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [B, T], entropy [B, T] or None) of the tokens in input_ids, token-aligned.

    logprobs[:, t] = log softmax(logits[:, t - 1] / temperature)[input_ids[:, t]] and entropy[:, t]
    the entropy of that distribution, both 0 where response_mask is 0. Keeps the autograd graph
    (wrap in torch.no_grad() for old/ref log-probs). Only the logits from the first response
    column on are computed (logits_to_keep).

    Memory and time (a 152k vocab makes the logits the largest tensor of a step): the softmax math
    is rl/logprobs.token_logprobs, float32 a few rows at a time from half-precision logits
    (float64 models stay float64), no float32 copy of the logits kept for backward.
    entropy_grad=False computes the entropy as a detached metric (the learner does this when
    entropy_coef is 0).
    """
    num_tokens = input_ids.shape[1]
    cols = torch.nonzero(response_mask.sum(0) > 0)
    first = int(cols[0]) if len(cols) else num_tokens - 1
    keep = num_tokens - max(first, 1) + 1              # logits at columns first-1 .. T-1
    start = num_tokens - keep + 1                      # first column whose log-prob is computed
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=mask_position_ids(attention_mask), use_cache=False, logits_to_keep=keep)
    logits = out.logits                                # column j predicts column start + j
    del out
    # The last column predicts past the end: give it token 0 and drop its result (not slicing the
    # logits keeps them one contiguous [B * keep, V] block for the chunked kernel).
    targets = torch.cat([input_ids[:, start:], torch.zeros_like(input_ids[:, :1])], dim=1)
    token_lp, token_ent = token_logprobs(logits, targets, temperature, with_entropy=with_entropy,
                                         entropy_grad=entropy_grad)
    mask = response_mask[:, start:].to(token_lp.dtype)
    logprobs = torch.zeros(input_ids.shape, dtype=token_lp.dtype, device=token_lp.device)
    logprobs[:, start:] = token_lp[:, :-1] * mask
    entropy = None
    if with_entropy:
        entropy = torch.zeros_like(logprobs)
        entropy[:, start:] = token_ent[:, :-1] * mask
    return logprobs, entropy
