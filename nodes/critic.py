"""Critic: values for rollouts as soon as they arrive, GAE advantages, and its own training.

Consumes: `with_ref` items.  Produces: `advantaged`, the same items with per response "values",
"advantages" and "returns" (per response token).
Waits for: scored samples.  Unblocked by: the reference node.

Value prefetch: values are computed per arriving micro-batch, while the generators are still
producing the rest of the step's samples, so the learner never waits for a value pass. Every
`train_samples` samples the critic trains on them (clipped value loss, AdamW, gradient clipping),
between micro-batches; advantages of later samples use the updated critic.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import torch

from dataflow import Node
from nodes import policy
from nodes.models import ValueModel, pad_batch, unpad_tokens
from nodes.rl_math import gae_advantages, masked_mean, value_loss


@dataclass(kw_only=True)
class CriticConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    """The value model's trunk starts as a copy of this policy's."""
    gamma: float = 1.0
    lam: float = 0.95
    lr: float = 1e-3
    epochs: int = 2
    """Passes over each training batch."""
    minibatch_size: int = 64
    train_samples: int = 128
    """Train after this many new samples (usually the learner's samples per step)."""
    value_clip: float = 0.2
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = False
    items_per_call: int = 32
    seed: int = 0


def critic_update(model, optimizer, samples: list[dict], pad_id: int, c: CriticConfig, rng: random.Random) -> dict:
    """`c.epochs` passes of clipped value regression on `samples`' returns; returns mean stats."""
    losses, clipfracs = [], []
    model.train()
    for _ in range(c.epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for start in range(0, len(order), c.minibatch_size):
            mb = [samples[i] for i in order[start:start + c.minibatch_size]]
            batch = pad_batch(mb, pad_id, token_keys=("values", "returns"), device=next(model.parameters()).device)
            values = model(batch["input_ids"], batch["attention_mask"])
            loss, stats = value_loss(values, batch["values"], batch["returns"], batch["response_mask"], c.value_clip)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.max_grad_norm)
            optimizer.step()
            losses.append(loss.item())
            clipfracs.append(stats["clipfrac"])
    model.eval()
    return {"critic/value_loss": sum(losses) / len(losses), "critic/clipfrac": sum(clipfracs) / len(clipfracs)}


class Critic(Node):
    Config = CriticConfig
    inputs = ("with_ref",)
    outputs = ("advantaged",)

    async def setup(self):
        c = self.config
        base, self.tokenizer = policy.load(c.policy)
        self.model = ValueModel.from_policy(base, gradient_checkpointing=c.gradient_checkpointing).to(self.ctx.device)
        self.model.eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr)
        self.rng = random.Random(c.seed)
        self.pending: list[tuple[int, dict]] = []  # (prompt id, sample) not yet trained on

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "rng": self.rng.getstate(), "pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.setstate(state["rng"])
        self.pending = [tuple(p) for p in state["pending"]]

    def _advantages(self, items: list[dict]) -> dict:
        c = self.config
        samples = [s for item in items for s in item["samples"]]
        batch = pad_batch(samples, self.tokenizer.pad_token_id, token_keys=("token_rewards",), device=self.ctx.device)
        with torch.no_grad():
            values = self.model(batch["input_ids"], batch["attention_mask"]) * batch["response_mask"]
        advantages, returns = gae_advantages(batch["token_rewards"], values, batch["response_mask"], c.gamma, c.lam)
        mask = batch["response_mask"]
        for key, tensor in (("values", values), ("advantages", advantages), ("returns", returns)):
            for s, row in zip(samples, unpad_tokens(tensor, mask)):
                s[key] = row
        return {"critic/values": masked_mean(values, mask).item(), "critic/returns": masked_mean(returns, mask).item()}

    async def run(self):
        c = self.config
        inp, out = self.ctx.inputs["with_ref"], self.ctx.outputs["advantaged"]
        async for batch in inp.batches(c.items_per_call, 0.01):
            items = [m.data for m in batch]
            with self.ctx.span("value forward", items=len(items)):
                await asyncio.to_thread(self._advantages, items)
            for msg, item in zip(batch, items):
                await out.send(item, **msg.meta)
            self.pending += [(item["id"], s) for item in items for s in item["samples"]]
            if len(self.pending) >= c.train_samples:
                # In prompt id order, so the same samples train the same way however they arrived;
                # under the state lock, so a checkpoint never sees half a training pass.
                train = [s for _, s in sorted(self.pending, key=lambda p: p[0])]
                async with self.ctx.state_lock:
                    self.pending = []
                    with self.ctx.span("critic train", samples=len(train)):
                        stats = await asyncio.to_thread(critic_update, self.model, self.optimizer, train,
                                                        self.tokenizer.pad_token_id, c, self.rng)
                self.ctx.metrics(stats)
