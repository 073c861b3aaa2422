"""The reference node's implementation: the frozen initial policy's forward passes (add_logprobs,
which the learner's own_reference uses too). Its settings, ports and flow: nodes/reference.py.
"""

from __future__ import annotations

import asyncio

import torch

from dataflow.errors import UserError
from nodes import reference as declared
from rl.data import policy
from rl.update.microbatch import padding_metrics, rank_micro_batches, sample_lengths
from rl.update.settings import check_micro_batch_settings
from rl.model.padded_batch import COLUMN_MULTIPLE, pad_batch, unpad_tokens
from rl.update.packing import micro_batch, micro_batch_logprobs, use_varlen_attention
from rl.model.precision import compile_layers, compile_setting, prepare_frozen


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



class Reference(declared.Reference):
    """The frozen policy, its log-probs per arriving item (the flow: nodes/reference.py)."""

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
