"""Reference: log-probs of the frozen initial policy, for the learner's KL term.

Consumes: `scored` items.  Produces: `with_ref`, the same items with "ref_logprobs" per response.
Waits for: scored samples.  Unblocked by: the reward node.

A node of its own (not a pass inside the learner) so its forward passes overlap generation and
training instead of adding to the learner's step time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated

import torch

from dataflow import Node
from dataflow.errors import UserError
from dataflow.checks import AtLeast, NonNegative, Positive
from rl.data import policy
from rl.update.microbatch import check_micro_batch_settings, padding_metrics, rank_micro_batches, sample_lengths
from rl.model.padded_batch import COLUMN_MULTIPLE, pad_batch, unpad_tokens
from rl.update.packing import micro_batch, micro_batch_logprobs, use_varlen_attention
from rl.model.precision import Precision, compile_layers, compile_setting, prepare_frozen


@dataclass(kw_only=True)
class ReferenceConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    """The initial policy (the same spec the learner starts from)."""
    items_per_call: Annotated[int, AtLeast(1)] = 32
    """Items (prompt groups) taken from the input at once, as they are available."""
    micro_batch_size: Annotated[int, NonNegative] = 0
    """Samples per forward pass (0 = all of a call's samples at once). Bounds memory: a sample's
    logits are (prompt + response) x vocab values (W1: 0.08 GB in bf16)."""
    max_tokens_per_micro_batch: int = 0
    """Tokens per forward pass instead of a row count (0 = use micro_batch_size; as the learner's
    setting: one of the two must be 0; at least the longest prompt + response). On a GPU placement,
    left at 0 with micro_batch_size 0, the memory plan sets it (docs/gpus.md)."""
    packing: bool = False
    """Run each pass packed, without padding (as learner.packing); "reference/padding_frac" reports
    the padding of the passes."""
    precision: Precision = "auto"
    """auto: bf16 weights on CUDA (frozen, so no fp32 master copy is needed), fp32 on CPU."""
    compile: bool | None = None
    """torch.compile each decoder layer (None = on CUDA without packing; rl/model/precision.compile_setting
    says why, compile_layers how)."""
    temperature: Annotated[float, Positive] = 1.0
    """Temperature of the log-probs: the generators' sampling temperature, as the learner's (the
    graph shares it), so the KL compares two distributions at the same temperature."""


def add_logprobs(model, pad_id: int, items: list[dict], key: str, micro_batch_size: int = 0,
                 temperature: float = 1.0, max_tokens: int = 0, packing: bool = False) -> dict:
    """Set samples[key] = per-token log-probs of softmax(logits / temperature) under `model` for
    every response of `items`, in the model's own dtype: `micro_batch_size` samples per forward
    pass (0 = all at once), or passes of at most `max_tokens` tokens (rl/update/microbatch.py), each
    packed or padded to its own rows' columns (`packing`, rl/update/packing.py). Returns the passes'
    padding ("reference/padding_frac", tokens processed and real)."""
    samples = [s for item in items for s in item["samples"]]
    device = next(model.parameters()).device
    batch = pad_batch(samples, pad_id, token_keys=(), device=device, multiple_of=COLUMN_MULTIPLE)
    lengths = sample_lengths(samples)
    logprobs = torch.zeros(batch["response_mask"].shape, dtype=torch.float64, device=device)
    processed = 0
    with torch.no_grad():
        for rows in rank_micro_batches(range(len(samples)), lengths, max_tokens, micro_batch_size,
                                       "packed" if packing else "padded",
                                       setting="reference.max_tokens_per_micro_batch"):
            mb = micro_batch(batch, rows, packing)
            part, _ = micro_batch_logprobs(model, mb, temperature=temperature, with_entropy=False)
            mb.put(logprobs, part)
            processed += mb.num_tokens
    for s, row in zip(samples, unpad_tokens(logprobs, batch["response_mask"])):
        s[key] = row
    return padding_metrics(processed, sum(p + r for p, r in lengths), "reference")


class Reference(Node):
    Config = ReferenceConfig

    @staticmethod
    def check_settings(c, max_steps=None) -> None:
        """Its settings that must fit together, before Ray starts (dataflow/driver/preflight.py)."""
        check_micro_batch_settings("reference", c.micro_batch_size, c.max_tokens_per_micro_batch)
    inputs = ("scored",)
    outputs = ("with_ref",)

    async def setup(self):
        c = self.config
        try:
            check_micro_batch_settings("reference", c.micro_batch_size, c.max_tokens_per_micro_batch)
        except ValueError as e:
            raise UserError(str(e)) from None
        with self.ctx.span("import transformers"):   # start-up parts (setup/reference/...)
            policy.import_model_code()
        with self.ctx.span("load model"):
            self.model, self.tokenizer = policy.load(c.policy)
            prepare_frozen(self.model, self.ctx.device, c.precision)
        if c.packing:
            self.ctx.log(f"packed passes, attention: {use_varlen_attention(self.model, self.ctx.device)}")
        compile_layers(self.model, compile_setting(c.compile, c.packing), self.ctx.device)

    async def run(self):
        inp, out = self.ctx.inputs["scored"], self.ctx.outputs["with_ref"]
        c = self.config
        # Padding reported once per learner step (the items' meta "batch"): the passes' tokens add
        # up until an item of a later batch arrives (a call's items may straddle two: rounded).
        tokens, reported_batch = [0, 0], None
        async for batch in inp.batches(c.items_per_call, 0.01):
            items = [m.data for m in batch]
            newest = max(m.meta.get("batch", 0) for m in batch)
            if reported_batch is not None and newest > reported_batch and tokens[0]:
                self.ctx.metrics(padding_metrics(*tokens, "reference"))
                tokens = [0, 0]
            reported_batch = newest
            with self.ctx.span("reference forward", items=len(items)):
                padding = await asyncio.to_thread(add_logprobs, self.model, self.tokenizer.pad_token_id, items,
                                                  "ref_logprobs", c.micro_batch_size, c.temperature,
                                                  c.max_tokens_per_micro_batch, c.packing)
            tokens[0] += padding["reference/tokens_processed"]
            tokens[1] += padding["reference/tokens_real"]
            for msg, item in zip(batch, items):
                await out.send(item, **msg.meta)
        if tokens[0]:
            self.ctx.metrics(padding_metrics(*tokens, "reference"))
