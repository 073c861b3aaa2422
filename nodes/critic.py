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

from dataflow import Node, checkpoint
from nodes import policy
from nodes.models import ValueModel, pad_batch, unpad_tokens
from nodes.precision import Precision, autocast, compute_dtype, micro_slices, prepare_trained
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
    micro_batch_size: int = 0
    """Samples per forward/backward pass, in the value pass and in training (gradients accumulate
    into each minibatch's one optimizer step, same result as unsplit; 0 = no split)."""
    precision: Precision = "auto"
    """auto: bf16 autocast over fp32 master weights on CUDA, fp32 on CPU (nodes/precision.py)."""
    seed: int = 0
    snapshot_interval: int = -1
    """Every this many training passes, write the critic's state to <run>/snapshots/<replica>/:
    a critic restarted after its process died loads it, keeping its training since the last
    checkpoint (0 = off: it comes back as of the last checkpoint). Costs one write of the value
    model plus its AdamW state (3x the weights) per pass. -1 = auto: every pass while that state
    is under 256 MB (the built-in models), else off (said once in the log: set it to opt in)."""


def critic_update(model, optimizer, samples: list[dict], pad_id: int, c: CriticConfig, rng: random.Random) -> dict:
    """`c.epochs` passes of clipped value regression on `samples`' returns; returns mean stats.

    Each minibatch runs in slices of c.micro_batch_size samples, each slice's loss weighted by its
    share of the minibatch's valid tokens (the loss is a token mean), so the accumulated gradient
    equals the unsplit minibatch's."""
    losses, clipfracs = [], []
    device = next(model.parameters()).device
    amp = compute_dtype(c.precision, device)
    model.train()
    for _ in range(c.epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for start in range(0, len(order), c.minibatch_size):
            mb = [samples[i] for i in order[start:start + c.minibatch_size]]
            batch = pad_batch(mb, pad_id, token_keys=("values", "returns"), device=device)
            mb_tokens = max(batch["response_mask"].sum().item(), 1.0)
            optimizer.zero_grad(set_to_none=True)
            loss_sum, clipfrac_sum = 0.0, 0.0
            for sl in micro_slices(len(mb), c.micro_batch_size):
                weight = batch["response_mask"][sl].sum().item() / mb_tokens  # a double: no fp32 rounding
                with autocast(amp, device):
                    values = model(batch["input_ids"][sl], batch["attention_mask"][sl])
                loss, stats = value_loss(values.float(), batch["values"][sl], batch["returns"][sl],
                                         batch["response_mask"][sl], c.value_clip)
                (loss * weight).backward()
                loss_sum += loss.item() * weight
                clipfrac_sum += stats["clipfrac"] * weight
                del values, loss
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.max_grad_norm)
            optimizer.step()
            losses.append(loss_sum)
            clipfracs.append(clipfrac_sum)
    model.eval()
    return {"critic/value_loss": sum(losses) / len(losses), "critic/clipfrac": sum(clipfracs) / len(clipfracs)}


class Critic(Node):
    Config = CriticConfig
    inputs = ("with_ref",)
    outputs = ("advantaged",)

    async def setup(self):
        c = self.config
        base, self.tokenizer = policy.load(c.policy)
        self.model = ValueModel.from_policy(base, gradient_checkpointing=c.gradient_checkpointing)
        prepare_trained(self.model, self.ctx.device, c.precision)  # fp32 masters (nodes/precision.py)
        self.model.eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr)
        self.rng = random.Random(c.seed)
        self.pending: list[tuple[int, dict]] = []  # (prompt id, sample) not yet trained on
        self.progress = 0  # training passes done (a restart loads the snapshot or checkpoint with more)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "rng": self.rng.getstate(), "pending": self.pending, "progress": self.progress}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.setstate(state["rng"])
        self.pending = [tuple(p) for p in state["pending"]]
        self.progress = state.get("progress", 0)

    async def _snapshot(self) -> None:
        """After a training pass (under the state lock): every snapshot_interval passes, the state
        to <run>/snapshots/ (dataflow/checkpoint.py), for a restart of this replica."""
        self.progress += 1
        every = self.config.snapshot_interval
        if every < 0:  # auto: decided once, from the size of what a snapshot writes
            state_bytes = 3 * sum(p.numel() * p.element_size() for p in self.model.parameters())
            every = self.config.snapshot_interval = 1 if state_bytes < 256 * 2**20 else 0
            if not every:
                self.ctx.log(f"critic snapshots off: each would write {state_bytes / 2**30:.1f} GiB; a restarted "
                             "critic resumes from the last checkpoint (set critic.snapshot_interval=N to opt in)")
        if every and self.progress % every == 0:
            with self.ctx.span("critic snapshot"):
                await asyncio.to_thread(checkpoint.write_snapshot, self.ctx.run_dir, self.ctx.full_name,
                                        self.state_dict())

    def _advantages(self, items: list[dict]) -> dict:
        c = self.config
        samples = [s for item in items for s in item["samples"]]
        batch = pad_batch(samples, self.tokenizer.pad_token_id, token_keys=("token_rewards",), device=self.ctx.device)
        values = torch.zeros_like(batch["response_mask"])
        amp = compute_dtype(c.precision, self.ctx.device)
        with torch.no_grad(), autocast(amp, self.ctx.device):
            for sl in micro_slices(len(samples), c.micro_batch_size):
                values[sl] = self.model(batch["input_ids"][sl], batch["attention_mask"][sl]).float()
        values = values * batch["response_mask"]
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
                    await self._snapshot()
                self.ctx.metrics(stats)
