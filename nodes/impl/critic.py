"""The critic's implementation: the value model's passes and updates (critic_update, advantages_for).
Its settings, ports and flow (value prefetch, dp x tp ranks): nodes/critic.py.
"""

from __future__ import annotations

import asyncio
import random

import torch

from dataflow.actor import snapshots
from dataflow.errors import UserError
from dataflow.weights.multirank import RankCommands
from nodes import critic as declared
from dataflow.weights.edges import CRITIC_RANKS_EDGE
from nodes.critic import CriticConfig
from rl.data import policy
from rl.update.microbatch import padding_metrics, rank_micro_batches, sample_lengths
from rl.update.settings import check_micro_batch_settings
from rl.model.causal_lm import ValueModel
from rl.model.padded_batch import COLUMN_MULTIPLE, pad_batch, unpad_tokens
from rl.update.packing import micro_batch, micro_batch_values, use_varlen_attention
from rl.model.precision import autocast, compile_layers, compile_setting, compute_dtype, prepare_trained
from rl.algorithm.advantages import gae_advantages
from rl.algorithm.masked import masked_mean
from rl.algorithm.losses import value_loss


def critic_update(model, optimizer, samples: list[dict], pad_id: int, c: CriticConfig, rng: random.Random,
                  ranks=None) -> dict:
    """`c.epochs` passes of clipped value regression on `samples`' returns; returns mean stats.

    Each minibatch runs in slices of c.micro_batch_size samples, each slice's loss weighted by its
    share of the minibatch's valid tokens (the loss is a token mean), so the accumulated gradient
    equals the unsplit minibatch's. `ranks` (dataflow/weights/multirank.TrainRanks; every rank calls with
    the same samples and rng state): each dp rank runs its share of every minibatch the same way,
    as in the learner's ppo_update, so the update equals one rank's."""
    losses, clipfracs = [], []
    device = next(model.parameters()).device
    amp = compute_dtype(c.precision, device)
    layout = "packed" if c.packing else "padded"
    tokens = [0, 0]                     # processed, real: every dp rank's passes
    model.train()
    for _ in range(c.epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for start in range(0, len(order), c.minibatch_size):
            mb = [samples[i] for i in order[start:start + c.minibatch_size]]
            batch = pad_batch(mb, pad_id, token_keys=("values", "returns"), device=device, multiple_of=COLUMN_MULTIPLE)
            mask = batch["loss_mask"]          # an episode's environment tokens are not regressed on
            row_tokens = mask.sum(1).tolist()   # read once: slice weights are Python floats from these
            mb_tokens = max(sum(row_tokens), 1.0)
            lengths = sample_lengths(mb)
            if ranks is not None:  # row len(mb): a mask-0 copy of row 0 that pads short dp shares
                batch = {k: torch.cat([v, v[:1]]) if torch.is_tensor(v) else v for k, v in batch.items()}
                mask = torch.cat([mask, torch.zeros_like(mask[:1])])
                row_tokens.append(0.0)
                lengths.append(lengths[0])
            parts = rank_micro_batches(range(len(mb)), lengths, c.max_tokens_per_micro_batch, c.micro_batch_size,
                                       layout, ranks, pad_index=len(mb), setting="critic.max_tokens_per_micro_batch")
            optimizer.zero_grad(set_to_none=True)
            acc = torch.zeros(2, dtype=torch.float64, device=device)  # read once per minibatch (as ppo_update)
            processed, real = 0, 0
            # per minibatch: weights cast to bf16 once (as ppo_update)
            with autocast(amp, device, cache_weights=ranks is None):
                for rows in parts:
                    # value_loss is a token mean: weighted by the pass's share of the minibatch's
                    # valid tokens (micro_batch_weights), the passes add up to the unsplit loss
                    weight = sum(row_tokens[i] for i in rows) / mb_tokens  # a double: no fp32 rounding
                    part = micro_batch(batch, rows, c.packing)
                    processed += part.num_tokens
                    real += sum(sum(lengths[i]) for i in rows if i != len(mb))
                    values = micro_batch_values(model, part)
                    loss, stats = value_loss(values, part.take(batch["values"]), part.take(batch["returns"]),
                                             part.take(mask), c.value_clip)
                    (loss * weight).backward()
                    acc += torch.stack([loss.detach().double(), stats["clipfrac"].double()]) * weight
                    del values, loss
            sums = dict(zip(("loss", "clipfrac"), acc.tolist()))
            sums.update(processed=processed, real=real)
            if ranks is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), c.max_grad_norm)
            else:  # the global norm over the mesh; the dp shares' weighted stats add up
                ranks.clip_grad_norm_(model.parameters(), c.max_grad_norm)
                sums = ranks.sum_over_dp(sums)
            optimizer.step()
            losses.append(sums["loss"])
            clipfracs.append(sums["clipfrac"])
            tokens[0] += int(sums["processed"])
            tokens[1] += int(sums["real"])
    model.eval()
    return {"critic/value_loss": sum(losses) / len(losses), "critic/clipfrac": sum(clipfracs) / len(clipfracs),
            "critic/tokens_processed": tokens[0], "critic/tokens_real": tokens[1]}


def advantages_for(model, items: list[dict], pad_id: int, c: CriticConfig, device, ranks=None) -> dict:
    """Values of the items' samples, then GAE advantages and returns, written into each sample
    ("values", "advantages", "returns": per response token); returns mean stats and the passes'
    tokens. `ranks`: each dp rank computes the values of its rows (rank_micro_batches: with a token
    budget balanced over ranks, every rank running as many passes), summed over dp (a row's values
    come from one rank, zeros from the others), so every rank ends with all of them."""
    samples = [s for item in items for s in item["samples"]]
    batch = pad_batch(samples, pad_id, token_keys=("token_rewards",), device=device, multiple_of=COLUMN_MULTIPLE)
    lengths = sample_lengths(samples)
    num = len(samples)
    if ranks is not None:  # row `num`: a copy of row 0 that pads short dp shares (its values dropped)
        batch = {k: torch.cat([v, v[:1]]) if torch.is_tensor(v) else v for k, v in batch.items()}
        lengths.append(lengths[0])
    values = torch.zeros(batch["input_ids"].shape, device=batch["input_ids"].device)
    amp = compute_dtype(c.precision, device)
    processed = 0
    with torch.no_grad(), autocast(amp, device):
        for rows in rank_micro_batches(range(num), lengths, c.max_tokens_per_micro_batch, c.micro_batch_size,
                                       "packed" if c.packing else "padded", ranks, pad_index=num,
                                       setting="critic.max_tokens_per_micro_batch"):
            part = micro_batch(batch, rows, c.packing)
            part.put(values, micro_batch_values(model, part).float())
            processed += part.num_tokens
    if ranks is not None:
        values = ranks.gather_over_dp(values).view(ranks.dp_size, *values.shape).sum(0)[:num]
        processed = int(ranks.sum_over_dp({"p": processed})["p"])   # every rank's passes
        batch = {k: v[:num] if torch.is_tensor(v) else v for k, v in batch.items()}
    tokens = {"critic/tokens_processed": processed, "critic/tokens_real": sum(map(sum, lengths[:num]))}
    # GAE over the sampled tokens only: an episode's environment tokens (loss_mask 0) are skipped,
    # the recursion jumping from a turn's last token to the next turn's first (verl's multi-turn
    # GAE, compute_gae_advantage_return with its response_mask); their values, advantages are 0.
    mask = batch["loss_mask"]
    values = values * mask
    advantages, returns = gae_advantages(batch["token_rewards"], values, mask, c.gamma, c.lam)
    for key, tensor in (("values", values), ("advantages", advantages), ("returns", returns)):
        for s, row in zip(samples, unpad_tokens(tensor, batch["response_mask"])):
            s[key] = row
    return {"critic/values": masked_mean(values, mask).item(), "critic/returns": masked_mean(returns, mask).item(),
            **tokens}


class Critic(RankCommands, declared.Critic):
    """The value model and its optimizer, set up and run (the flow: nodes/critic.py)."""

    async def setup(self):
        c = self.config
        if c.num_ranks > 1:
            from dataflow.weights.layout import ParallelLayout
            from dataflow.weights.multirank import join

            self.ranks = await join(self.ctx, ParallelLayout(dp=c.dp, tp=c.tp), c.rendezvous_timeout_s,
                                    edge=CRITIC_RANKS_EDGE)
            c.snapshot_interval = 0  # a dead rank ends the run (module docstring): nothing would load one
        elif self.ctx.num_replicas > 1:
            raise UserError(f"node '{self.ctx.name}' has {self.ctx.num_replicas} replicas but critic.dp x "
                            f"critic.tp = 1; declare it with replicas=dp*tp")
        try:
            check_micro_batch_settings("critic", c.micro_batch_size, c.max_tokens_per_micro_batch)
        except ValueError as e:
            raise UserError(str(e)) from None
        with self.ctx.span("import transformers"):   # start-up parts (setup/critic/...)
            policy.import_model_code()
        with self.ctx.span("load model"):
            base, self.tokenizer = policy.load(c.policy)
            self.model = ValueModel.from_policy(base, gradient_checkpointing=c.gradient_checkpointing)
            prepare_trained(self.model, self.ctx.device, c.precision)  # fp32 masters (rl/model/precision.py)
        self.model.eval()
        if c.packing:  # before TP / FSDP and compile, which wrap the layers
            self.ctx.log(f"packed passes, attention: {use_varlen_attention(self.model, self.ctx.device)}")
        if self.ranks is not None:  # TP over "tp", then FSDP2 over "dp" (dataflow/weights/layout.py)
            try:
                self.ranks.shard(self.model)
            except ValueError as e:
                raise UserError(f"critic.dp={c.dp} critic.tp={c.tp}: {e}") from None
        else:  # sharded ranks stay eager, as the learner's
            compile_layers(self.model, compile_setting(c.compile, c.packing, c.gradient_checkpointing), self.ctx.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr)
        self.rng = random.Random(c.seed)
        self.pending: list[tuple[int, dict]] = []  # (prompt id, sample) not yet trained on
        self.tokens = [0, 0]  # processed, real: the passes since the last padding report
        self.progress = 0  # training passes done (a restart loads the snapshot or checkpoint with more)
        self._saved = None          # dp x tp: (model, optimizer) gathered for state_dict()
        self._pending_state = None  # dp x tp: a loaded (model, optimizer), spread over the ranks in run()

    def state_dict(self) -> dict:
        state = {"rng": self.rng.getstate(), "pending": self.pending, "progress": self.progress}
        if self.ranks is None:
            return {**state, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if not self.ranks.lead:  # rank 0 saves the whole state (one rank's format: any layout resumes)
            return {"progress": self.progress}
        (model, optimizer), self._saved = self._saved, None
        return {**state, "model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        self.progress = state.get("progress", 0)
        if self.ranks is not None and not self.ranks.lead:
            return
        if self.ranks is None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        else:  # spread over the ranks at the start of run() (a collective)
            self._pending_state = (state["model"], state["optimizer"])
        self.rng.setstate(state["rng"])
        self.pending = [tuple(p) for p in state["pending"]]

    async def prepare_checkpoint(self) -> None:
        if self.ranks is not None and self.ranks.lead:
            self._saved = await self._all("gather")

    async def _handle(self, op: str, args: dict):
        """One command; on every rank when dp x tp > 1 (dataflow/weights/multirank.RankCommands)."""
        c = self.config
        if op == "values":
            return await asyncio.to_thread(advantages_for, self.model, args["items"], self.tokenizer.pad_token_id,
                                           c, self.ctx.device, self.ranks)
        if op == "train":
            self.rng.setstate(args["rng"])  # every rank shuffles the minibatches alike
            return await asyncio.to_thread(critic_update, self.model, self.optimizer, args["samples"],
                                           self.tokenizer.pad_token_id, c, self.rng, self.ranks)
        if op == "gather":                  # whole state on rank 0
            return await asyncio.to_thread(self.ranks.full_state, self.model, self.optimizer)
        if op == "load":                    # rank 0's loaded state onto every rank
            model, optimizer = self._pending_state or (None, None)
            self._pending_state = None
            return await asyncio.to_thread(self.ranks.load_full_state, self.model, self.optimizer, model, optimizer)
        raise ValueError(f"unknown critic command {op!r}")

    async def _snapshot(self) -> None:
        """After a training pass (under the state lock): every snapshot_interval passes, the state
        to <run>/snapshots/ (dataflow/actor/snapshots.py), for a restart of this replica."""
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
                await asyncio.to_thread(snapshots.write_snapshot, self.ctx.run_dir, self.ctx.full_name,
                                        self.state_dict())

    async def run(self):
        if self.ranks is not None and not self.ranks.lead:
            return await self._follow()
        await self._lead()
        await self._stop_followers()  # (after a failure the run ends and the ranks with it)

    async def _lead(self):
        c = self.config
        if self._pending_state is not None:  # dp x tp, resumed: every rank takes its shards
            await self._all("load")
        inp, out = self.ctx.inputs["with_ref"], self.ctx.outputs["advantaged"]
        async for batch in inp.batches(c.items_per_call, 0.01):
            items = [m.data for m in batch]
            with self.ctx.span("value forward", items=len(items)):
                value_stats = await self._all("values", items=items)
            self._count_tokens(value_stats)
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
                        stats = await self._all("train", samples=train, rng=self.rng.getstate())
                    await self._snapshot()
                self._count_tokens(stats)
                self.ctx.metrics({**stats, **padding_metrics(*self.tokens, "critic")})
                self.tokens = [0, 0]

    def _count_tokens(self, stats: dict) -> None:
        """Add a pass's tokens (its stats' critic/tokens_*) to those of the next padding report."""
        self.tokens[0] += stats.pop("critic/tokens_processed")
        self.tokens[1] += stats.pop("critic/tokens_real")
