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
from dataflow.checks import AtLeast, NonNegative, Positive
from rl import policy
from rl.models import pad_batch, sequence_logprobs, unpad_tokens
from rl.precision import Precision, compile_layers, micro_slices, prepare_frozen


@dataclass(kw_only=True)
class ReferenceConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    """The initial policy (the same spec the learner starts from)."""
    items_per_call: Annotated[int, AtLeast(1)] = 32
    """Items (prompt groups) taken from the input at once, as they are available."""
    micro_batch_size: Annotated[int, NonNegative] = 0
    """Samples per forward pass (0 = all of a call's samples at once). Bounds memory: a sample's
    logits are (prompt + response) x vocab values (W1: 0.08 GB in bf16)."""
    precision: Precision = "auto"
    """auto: bf16 weights on CUDA (frozen, so no fp32 master copy is needed), fp32 on CPU."""
    compile: bool | None = None
    """torch.compile each decoder layer (None = on CUDA; rl/precision.compile_layers)."""
    temperature: Annotated[float, Positive] = 1.0
    """Temperature of the log-probs: the generators' sampling temperature, as the learner's (the
    graph shares it), so the KL compares two distributions at the same temperature."""


def add_logprobs(model, pad_id: int, items: list[dict], key: str, micro_batch_size: int = 0,
                 temperature: float = 1.0) -> None:
    """Set samples[key] = per-token log-probs of softmax(logits / temperature) under `model` for
    every response of `items`, `micro_batch_size` samples per forward pass (0 = all at once), in
    the model's own dtype."""
    samples = [s for item in items for s in item["samples"]]
    device = next(model.parameters()).device
    batch = pad_batch(samples, pad_id, token_keys=(), device=device)
    rows = []
    with torch.no_grad():
        for sl in micro_slices(len(samples), micro_batch_size):
            logprobs, _ = sequence_logprobs(model, batch["input_ids"][sl], batch["attention_mask"][sl],
                                            batch["response_mask"][sl], temperature=temperature,
                                            with_entropy=False)
            rows += unpad_tokens(logprobs, batch["response_mask"][sl])
    for s, row in zip(samples, rows):
        s[key] = row


class Reference(Node):
    Config = ReferenceConfig
    inputs = ("scored",)
    outputs = ("with_ref",)

    async def setup(self):
        self.model, self.tokenizer = policy.load(self.config.policy)
        prepare_frozen(self.model, self.ctx.device, self.config.precision)
        # no autocast: the reference's weights are in the compute dtype already
        compile_layers(self.model, self.config.compile, self.ctx.device, torch.float32, train=False)

    async def run(self):
        inp, out = self.ctx.inputs["scored"], self.ctx.outputs["with_ref"]
        async for batch in inp.batches(self.config.items_per_call, 0.01):
            items = [m.data for m in batch]
            with self.ctx.span("reference forward", items=len(items)):
                await asyncio.to_thread(add_logprobs, self.model, self.tokenizer.pad_token_id, items,
                                        "ref_logprobs", self.config.micro_batch_size, self.config.temperature)
            for msg, item in zip(batch, items):
                await out.send(item, **msg.meta)
