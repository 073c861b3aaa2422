"""The reward model node's implementation: a sequence classifier's forward pass per arriving item
(score_items). Its settings, ports and flow: nodes/reward_model.py.
"""

from __future__ import annotations

import asyncio
import math
import os

import torch

from dataflow import UserError
from nodes import reward_model as declared
from rl.model.padded_batch import pad_batch


def load_reward_model(path: str):
    from transformers import AutoModelForSequenceClassification

    if not path:
        raise UserError("reward_model.path is empty: set --set reward_model.path=/dir/of/a/sequence/classifier")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"reward_model.path={path}: no config.json there; save the model with save_pretrained")
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
    if model.config.num_labels != 1:
        raise UserError(f"reward_model.path={path}: num_labels={model.config.num_labels}, a reward model has 1")
    return model


def last_token_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] logit of each row at its last real token, found from the attention mask. transformers'
    own pooling takes the last token that is not pad_token_id, which misses a response's final
    eos when pad == eos (a pad-less tokenizer given its eos as pad, rl/data/policy.py): so models with
    the usual `score` head run trunk + head here and pick the column themselves."""
    mask = attention_mask.long()
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = getattr(model, "score", None)
    if base is None or head is None:   # another head layout: transformers' pooling
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    hidden = base(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(-1)
    return head(hidden[torch.arange(len(last), device=last.device), last])[:, 0]


def score_items(model, pad_id: int, items: list[dict], scale: float, shift: float) -> None:
    """Set score / token_rewards / failed on every response of `items` (right-aligned batch)."""
    samples = [s for item in items for s in item["samples"]]
    batch = pad_batch(samples, pad_id, token_keys=(), device=next(model.parameters()).device)
    with torch.no_grad():
        logits = last_token_logits(model, batch["input_ids"], batch["attention_mask"])
    for s, value in zip(samples, logits.float().tolist()):
        value = value * scale + shift
        s["failed"] = not math.isfinite(value)
        s["score"] = value if not s["failed"] else 0.0
        s["error"] = "" if not s["failed"] else f"reward model returned {value}"
        n = len(s["response_ids"])
        s["token_rewards"] = [0.0] * (n - 1) + [s["score"]] if n else []


class RewardModel(declared.RewardModel):
    """The classifier, loaded in setup (the flow: nodes/reward_model.py)."""

    async def setup(self):
        self.model = load_reward_model(self.config.path).to(self.ctx.device).eval()
        # with a `score` head any id pads: the last real token is found from the lengths
        # (last_token_logits); other heads pool by transformers' rule, which needs pad_token_id
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            if getattr(self.model, "score", None) is None:
                raise UserError(f"reward_model.path={self.config.path}: config has no pad_token_id; set it to "
                                "the tokenizer's pad id so the last real token can be found")
            self.pad_id = 0

    async def run(self):
        c = self.config
        inp, out = self.ctx.inputs["samples"], self.ctx.outputs["scored"]
        async for batch in inp.batches(c.items_per_call, 0.01):
            items = [m.data for m in batch]
            with self.ctx.span("reward model forward", items=len(items)):
                await asyncio.to_thread(score_items, self.model, self.pad_id, items, c.scale, c.shift)
            failed = sum(s["failed"] for item in items for s in item["samples"])
            if failed:
                self.ctx.metrics({"reward/failed": failed})
            for msg, item in zip(batch, items):
                await out.send(item, **msg.meta)
