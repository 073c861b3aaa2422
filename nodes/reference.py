"""Reference: log-probs of the frozen initial policy, for the learner's KL term.

Consumes: `scored` items.  Produces: `with_ref`, the same items with "ref_logprobs" per response.
Waits for: scored samples.  Unblocked by: the reward node.

A node of its own (not a pass inside the learner) so its forward passes overlap generation and
training instead of adding to the learner's step time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from dataflow import Node
from nodes import policy
from nodes.models import pad_batch, sequence_logprobs, unpad_tokens


@dataclass(kw_only=True)
class ReferenceConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    """The initial policy (the same spec the learner starts from)."""
    items_per_call: int = 32
    """Items (prompt groups) batched into one forward pass, as they are available."""


def add_logprobs(model, pad_id: int, items: list[dict], key: str) -> None:
    """Set samples[key] = per-token log-probs under `model` for every response of `items`."""
    samples = [s for item in items for s in item["samples"]]
    batch = pad_batch(samples, pad_id, token_keys=(), device=next(model.parameters()).device)
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                        batch["response_mask"], with_entropy=False)
    for s, row in zip(samples, unpad_tokens(logprobs, batch["response_mask"])):
        s[key] = row


class Reference(Node):
    Config = ReferenceConfig
    inputs = ("scored",)
    outputs = ("with_ref",)

    async def setup(self):
        self.model, self.tokenizer = policy.load(self.config.policy)
        self.model.to(self.ctx.device).eval().requires_grad_(False)

    async def run(self):
        inp, out = self.ctx.inputs["scored"], self.ctx.outputs["with_ref"]
        async for batch in inp.batches(self.config.items_per_call, 0.01):
            items = [m.data for m in batch]
            with self.ctx.span("reference forward", items=len(items)):
                await asyncio.to_thread(add_logprobs, self.model, self.tokenizer.pad_token_id, items, "ref_logprobs")
            for msg, item in zip(batch, items):
                await out.send(item, **msg.meta)
