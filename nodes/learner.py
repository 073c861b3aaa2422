"""Learner: PPO / GRPO policy updates, then a versioned weight push to every generator.

Consumes: `advantaged` items (PPO: from the critic) or `with_ref` items (GRPO: straight from the
reference node).  Produces: weights on the versioned edge `policy` (version = updates done).
Waits for: the complete batch of the step it is on.  Unblocked by: the critic / reference node.

Step k trains on exactly the prompts the source admitted for batch k (meta "batch"), so the
staleness of every sample is k - sample.version <= max_staleness by construction (admission
control in nodes/prompts.py); the learner reports it, and refuses a sample that breaks the bound.
The step is a flat sequence of phases: collect -> advantages -> proximal log-probs (only when a
sample is stale) -> PPO epochs over minibatches -> KL controller -> report -> checkpoint (every
save_interval steps) -> publish. Collect keeps one copy of each prompt id (a prompt re-issued
after a node restart arrives twice). A minibatch update with a non-finite loss or gradient is
skipped and logged; max_bad_updates of them in a row stop the run.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from dataflow import Node
from dataflow.channel import EndOfChannel
from dataflow.errors import UserError
from dataflow.weights.multirank import RANKS_EDGE, RankCommands
from rl import policy
from rl.models import pad_batch, save_policy, sequence_logprobs
from rl.precision import Precision, autocast, compile_layers, compute_dtype, micro_slices, prepare_trained
from dataflow.weights.sync import SYNC_EDGE, LearnerWeightSync, WeightSyncConfig
from rl.kl import AdaptiveKLController, FixedKLController, kl_penalty
from rl.advantages import grpo_advantages
from rl.masked import masked_mean, masked_whiten
from rl.losses import ppo_policy_loss


@dataclass(kw_only=True)
class KLConfig:
    kind: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adaptive toward `target` (Ziegler et al. 2019)."""
    coef: float = 0.01
    """KL coefficient (initial one when adaptive)."""
    target: float = 0.1
    horizon: float = 10000.0
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator used in the loss (k3 is unbiased and non-negative)."""


@dataclass(kw_only=True)
class LearnerConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    algorithm: Literal["ppo", "grpo"] = "ppo"
    """ppo: per-token advantages from the critic (GAE). grpo: group-normalised scores."""
    prompts_per_step: int = 64
    """Prompt groups per step (must equal the prompt source's)."""
    group_size: int = 1
    max_staleness: int = 1
    """The bound the prompt source enforces; a sample beyond it is an error."""
    lr: float = 1e-3
    ppo_epochs: int = 1
    minibatch_size: int = 128
    """Samples per optimizer step."""
    micro_batch_size: int = 0
    """Samples per forward/backward pass; their gradients accumulate into each minibatch's one
    optimizer step, with the same result as the whole minibatch at once (0 = the whole minibatch).
    Bounds memory: the logits of a sample are (prompt + response) x vocab floats (W1: 0.16 GB)."""
    precision: Precision = "auto"
    """auto: bf16 autocast over fp32 master weights on CUDA, fp32 on CPU; or bf16 / fp32 (rl/precision.py)."""
    compile: bool | None = None
    """torch.compile each decoder layer (None = on CUDA, one process; rl/precision.compile_layers)."""
    clip_eps: float = 0.2
    is_truncation: float = 2.0
    """Cap of the importance weight pi_old / pi_behaviour for stale samples (decoupled PPO)."""
    kl: KLConfig = field(default_factory=KLConfig)
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    whiten_advantages: bool = True
    temperature: float = 1.0
    """Sampling temperature of the generators (log-probs are computed at the same one)."""
    target_reward: float = 0.0
    """End the run once the step's mean reward reaches this (0 = off)."""
    save_final: bool = True
    """Save the final policy to <run dir>/final (a normal HF model directory)."""
    max_bad_updates: int = 10
    """Stop the run after this many optimizer steps in a row were skipped for a non-finite loss
    or gradient (each one is skipped and logged; 0 = never stop)."""
    record_prompt_ids: bool = False
    """Put the ids of the prompts each step trained on in its metrics ("prompt_ids")."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How weights reach the generators: object store, or the HybridEngine push (dataflow/weights/sync.py)."""
    dp: int = 1
    """Data-parallel ranks: FSDP2 shards the model over them, each trains on its share of every
    minibatch. The graph runs the learner as dp x tp replicas (dataflow/weights/multirank.py)."""
    tp: int = 1
    """Tensor-parallel ranks (column/row-wise plans of Llama / Qwen2 blocks, dataflow/weights/layout.py):
    attention heads, KV heads, MLP width and vocab must divide by it."""
    rendezvous_timeout_s: float = 600.0
    """dp x tp > 1: how long the ranks wait for each other in their setups."""
    seed: int = 0


def step_advantages(samples: list[dict], c: LearnerConfig) -> list[list[float]]:
    """Per-token advantages of each sample: the critic's (PPO) or group-normalised scores (GRPO)."""
    if c.algorithm == "grpo":
        scores = torch.tensor([s["score"] for s in samples], dtype=torch.float64)
        per_seq = grpo_advantages(scores, group_size=c.group_size).tolist()
        return [[a] * len(s["response_ids"]) for a, s in zip(per_seq, samples)]
    return [s["advantages"] for s in samples]


def ppo_update(model, optimizer, samples: list[dict], kl_coef: float, pad_id: int, c: LearnerConfig,
               rng: random.Random, stale: bool, ranks=None) -> dict:
    """PPO epochs over minibatches of `samples`; one gradient clip per optimizer step.

    Each sample needs "advantage_tokens" (per response token), "logprobs" (behaviour),
    "ref_logprobs", and "failed". Failed samples are masked out of every loss term.
    An optimizer step whose loss or gradient norm is not finite is skipped (the weights and the
    optimizer state stay as they were); "updates/skipped" counts them, "updates/skipped_last" is
    the run of skipped steps at the end, "updates/skip_reason" says why (the first one).

    Micro-batches (c.micro_batch_size): each minibatch is run in slices of that many samples whose
    gradients accumulate before its one optimizer step. Every loss term is a mean over the valid
    tokens of the whole minibatch, so micro-batch j's loss is weighted by n_j / n (its share of
    those tokens): the summed gradient (and every reported stat) equals the unsplit minibatch's.
    Forward/backward run under c.precision's autocast (rl/precision.py).

    `ranks` (dataflow/weights/multirank.TrainRanks; every rank calls with the same samples and rng state):
    each dp rank runs its share of every minibatch, weighted by its share of the minibatch's
    tokens like a micro-batch (FSDP sums the gradients over dp), so the update equals one rank's.
    """
    keys = ("logprobs", "ref_logprobs", "advantage_tokens")
    device = next(model.parameters()).device
    amp = compute_dtype(c.precision, device)
    full = pad_batch(samples, pad_id, token_keys=keys, device=device)
    failed = torch.tensor([0.0 if s["failed"] else 1.0 for s in samples], device=device)
    mask = full["response_mask"] * failed[:, None]
    if ranks is not None:  # row len(samples): a mask-0 copy of row 0 that pads short dp shares
        full = {k: torch.cat([v, v[:1]]) if torch.is_tensor(v) else v for k, v in full.items()}
        mask = torch.cat([mask, torch.zeros_like(mask[:1])])
    advantages = masked_whiten(full["advantage_tokens"], mask) if c.whiten_advantages else full["advantage_tokens"]
    # Every epoch's sample order, drawn up front (the same rng draws as shuffling per epoch).
    orders = []
    for _ in range(c.ppo_epochs):
        orders.append(list(range(len(samples))))
        rng.shuffle(orders[-1])
    # Proximal ("old") log-probs: the current weights' (decoupled PPO). When every sample came from
    # the current weights, the behaviour log-probs are them (up to float noise). Otherwise the first
    # minibatch of the first epoch needs no extra pass either: nothing has changed the weights
    # before it, so its own forward pass gives them (taken there, detached). Only the other rows
    # get a no-grad forward here; with one minibatch and one epoch (W1), none does. dp x tp ranks
    # recompute every row: a dp rank's forward covers only its share of that minibatch, and the
    # other shares' rows come back to it in later minibatches.
    reuse_first = stale and ranks is None
    old_logprobs, first_rows = full["logprobs"], set()
    if stale:
        old_logprobs = torch.zeros_like(full["logprobs"])
        first_rows = set(orders[0][:c.minibatch_size]) if reuse_first else set()
        rest = torch.tensor([i for i in range(len(samples)) if i not in first_rows], dtype=torch.long)
        with torch.no_grad(), autocast(amp, device):
            for sl in micro_slices(len(rest), c.micro_batch_size):
                rows = rest[sl].to(device)
                logprobs, _ = sequence_logprobs(model, full["input_ids"][rows], full["attention_mask"][rows],
                                                mask[rows], temperature=c.temperature, with_entropy=False)
                old_logprobs[rows] = logprobs.to(old_logprobs.dtype)
    # Valid tokens per row, read once: the slice weights below are Python floats from these, and
    # the per-slice stats stay on the device until the minibatch ends, so the GPU is waited for
    # once per optimizer step, not once per micro-batch (the CPU keeps queueing kernels ahead).
    row_tokens = mask.sum(1).tolist()
    stat_keys = ("loss", "policy", "kl", "entropy", "approx_kl", "clipfrac", "is_weight")
    stats: dict[str, list[float]] = {}
    skipped, skipped_last, total, reason = 0, 0, 0, ""
    model.train()
    for epoch, order in enumerate(orders):
        for start in range(0, len(order), c.minibatch_size):
            mb_rows = torch.tensor(order[start:start + c.minibatch_size])
            mb_tokens = max(sum(row_tokens[i] for i in mb_rows.tolist()), 1.0)
            if ranks is not None:  # this dp rank's share (the tp ranks of a dp group: the same)
                mb_rows = ranks.dp_share(mb_rows, pad_index=len(samples))
            mb_idx = mb_rows.to(device)
            optimizer.zero_grad(set_to_none=True)
            total += 1
            acc = torch.zeros(len(stat_keys), dtype=torch.float64, device=device)
            # One autocast context per minibatch, not per micro-batch: autocast caches the bf16 copy
            # of each fp32 weight until the context ends, so the weights are cast once per optimizer
            # step (on W1, 16 micro-batches recast them 16 times). It ends before optimizer.step,
            # which changes the weights. The loss math stays fp32/float64 under it (autocast lowers
            # only matmul-like ops), and backward runs on autograd's own thread. Sharded (ranks):
            # no cache, see rl/precision.autocast.
            with autocast(amp, device, cache_weights=ranks is None):
                for sl in micro_slices(len(mb_idx), c.micro_batch_size):
                    idx = mb_idx[sl]
                    # This slice's share of the minibatch's valid tokens (0 when all of them are failed);
                    # a Python float (double), so the weighting adds no float32 rounding.
                    weight = sum(row_tokens[i] for i in mb_rows[sl].tolist()) / mb_tokens
                    logprobs, entropy = sequence_logprobs(model, full["input_ids"][idx], full["attention_mask"][idx],
                                                          mask[idx], temperature=c.temperature,
                                                          entropy_grad=c.entropy_coef != 0)
                    if reuse_first and epoch == 0 and start == 0:   # see first_rows above
                        old_logprobs[idx] = logprobs.detach().to(old_logprobs.dtype)
                    pg_loss, pg_stats = ppo_policy_loss(
                        logprobs, old_logprobs[idx], advantages[idx], mask[idx], c.clip_eps,
                        behaviour_logprobs=full["logprobs"][idx] if stale else None,
                        is_truncation=c.is_truncation if stale else None)
                    kl = masked_mean(kl_penalty(logprobs, full["ref_logprobs"][idx], c.kl.estimator), mask[idx])
                    ent = masked_mean(entropy, mask[idx])
                    loss = (pg_loss + kl_coef * kl - c.entropy_coef * ent) * weight
                    terms = (pg_loss, kl, ent, pg_stats["approx_kl"], pg_stats["clipfrac"], pg_stats["is_weight_mean"])
                    acc[0] += loss.detach().double()
                    acc[1:] += torch.stack([t.detach().double() for t in terms]) * weight
                    # Always backward (on every rank alike: a collective under FSDP); a non-finite
                    # loss makes the gradient non-finite, and the step is skipped below.
                    loss.backward()
                    del logprobs, entropy, loss
            sums = dict(zip(stat_keys, acc.tolist()))   # the one wait for the GPU of this minibatch
            if ranks is not None:  # the minibatch's stats: the dp shares' weighted parts add up
                sums = ranks.sum_over_dp(sums)
            finite = math.isfinite(sums["loss"])          # equal on every rank
            grad_norm = torch.tensor(float("nan"))
            if finite:
                clip = torch.nn.utils.clip_grad_norm_ if ranks is None else ranks.clip_grad_norm_
                grad_norm = clip(model.parameters(), c.max_grad_norm)  # ranks: the global norm
            if finite and torch.isfinite(grad_norm):
                optimizer.step()
                skipped_last = 0
            else:  # skip this optimizer step
                optimizer.zero_grad(set_to_none=True)
                skipped, skipped_last = skipped + 1, skipped_last + 1
                reason = reason or (f"non-finite loss {sums['loss']} (policy {sums['policy']}, kl {sums['kl']})"
                                    if not finite else f"non-finite gradient norm {grad_norm.item()}")
            for k, v in {"losses/policy": sums["policy"], "losses/kl": sums["kl"], "entropy": sums["entropy"],
                         "losses/approx_kl": sums["approx_kl"], "losses/clipfrac": sums["clipfrac"],
                         "losses/is_weight": sums["is_weight"], "grad_norm": grad_norm.item()}.items():
                stats.setdefault(k, []).append(v)
    model.eval()
    return {**{k: sum(v) / len(v) for k, v in stats.items()}, "updates/total": total,
            "updates/skipped": skipped, "updates/skipped_last": skipped_last, "updates/skip_reason": reason}


class Learner(RankCommands, Node):
    Config = LearnerConfig
    inputs = ("rollouts",)
    publishes = ("policy", SYNC_EDGE, RANKS_EDGE)
    subscribes = (RANKS_EDGE,)
    # dp x tp ranks: rank 0 alone reads the rollouts, reports, checkpoints and publishes; it
    # broadcasts each step's samples and every collective to the others (RankCommands).
    inputs_on_replica_0 = True

    async def setup(self):
        c = self.config
        self.ranks = None           # dataflow.weights.multirank.TrainRanks when dp x tp > 1
        if c.dp * c.tp > 1:
            from dataflow.weights.layout import ParallelLayout
            from dataflow.weights.multirank import join

            self.ranks = await join(self.ctx, ParallelLayout(dp=c.dp, tp=c.tp), c.rendezvous_timeout_s)
        elif self.ctx.num_replicas > 1:
            raise UserError(f"node '{self.ctx.name}' has {self.ctx.num_replicas} replicas but learner.dp x "
                            f"learner.tp = 1; declare it with replicas=dp*tp")
        self._pending_state = None  # dp x tp: a loaded (model, optimizer) state, spread in run()
        self._saved = None          # dp x tp: (model, optimizer) gathered for state_dict()
        self.model, self.tokenizer = policy.load(c.policy)
        # fp32 master weights even from a bf16 checkpoint (precision.prepare_trained).
        prepare_trained(self.model, self.ctx.device, c.precision).eval()
        if self.ranks is not None:  # TP over "tp", then FSDP2 over "dp" (dataflow/weights/layout.py)
            try:
                self.ranks.shard(self.model)
            except ValueError as e:
                raise UserError(f"learner.dp={c.dp} learner.tp={c.tp}: {e}") from None
        else:  # sharded ranks stay eager (compiling FSDP2/TP layers is untried here)
            compile_layers(self.model, c.compile, self.ctx.device, compute_dtype(c.precision, self.ctx.device),
                           train=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr)
        self.kl_ctl = (AdaptiveKLController(c.kl.coef, c.kl.target, c.kl.horizon) if c.kl.kind == "adaptive"
                       else FixedKLController(c.kl.coef))
        self.rng = random.Random(c.seed)
        self.version = 0  # = steps done = the batch being collected
        self.buckets: dict[int, dict] = {}  # batch -> {prompt id: item}
        self.duplicates = 0
        self.bad_updates = 0  # optimizer steps skipped in a row (non-finite loss or gradient)
        self.weight_sync = LearnerWeightSync(self.ctx, c.weight_sync)
        await self.weight_sync.setup(self.model, self.ranks)

    def state_dict(self) -> dict:
        if self.ranks is None:
            return {"step": self.version, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "kl": self.kl_ctl.state_dict(), "rng": self.rng.getstate()}
        # dp x tp: rank 0 saves the whole state (the one-rank format, so any layout can resume
        # from it), gathered by every rank in prepare_checkpoint.
        if not self.ranks.lead:
            return {"step": self.version}
        (model, optimizer), self._saved = self._saved, None
        return {"step": self.version, "model": model, "optimizer": optimizer, "kl": self.kl_ctl.state_dict(),
                "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        if self.ranks is not None:  # spread over the ranks at the start of run() (a collective)
            self.version = state["step"]
            if self.ranks.lead:
                self._pending_state = (state["model"], state["optimizer"])
                self.kl_ctl.load_state_dict(state["kl"])
                self.rng.setstate(state["rng"])
            return
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl"])
        self.rng.setstate(state["rng"])
        self.version = state["step"]

    async def prepare_checkpoint(self) -> None:
        """dp x tp: the whole state onto rank 0 (a collective: at a save_interval checkpoint or
        on Ctrl-C, whenever rank 0's loop is between commands)."""
        if self.ranks is not None and self.ranks.lead:
            self._saved = await self._all("gather", optimizer=True)

    async def _handle(self, op: str, args: dict):
        c = self.config
        if op == "train":
            self.rng.setstate(args["rng"])      # every rank shuffles the minibatches alike
            stats = await asyncio.to_thread(ppo_update, self.model, self.optimizer, args["samples"],
                                            args["kl_coef"], self.tokenizer.pad_token_id, c, self.rng,
                                            args["stale"], self.ranks)
            if self.ranks is not None and not self.ranks.lead:   # rank 0 counts its steps in _lead
                self.version = args["version"]
            return stats
        if op == "publish":
            return await self.weight_sync.publish(self.model, args["version"])
        if op == "gather":                      # whole state on rank 0
            return await asyncio.to_thread(self.ranks.full_state, self.model,
                                           self.optimizer if args["optimizer"] else None)
        if op == "load":                        # rank 0's loaded state onto every rank
            model, optimizer = self._pending_state or (None, None)
            self._pending_state = None
            return await asyncio.to_thread(self.ranks.load_full_state, self.model, self.optimizer, model, optimizer)
        raise ValueError(f"unknown learner command {op!r}")

    def _weights(self) -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    async def _collect(self, batch_index: int) -> list | None:
        """The items of `batch_index`, one per prompt, in prompt id order (waiting for them); None
        once the input has ended. A second copy of a prompt (re-issued after a node restart) is
        dropped and counted, so every prompt is trained on exactly once."""
        inp = self.ctx.inputs["rollouts"]
        while len(self.buckets.get(batch_index, ())) < self.config.prompts_per_step:
            try:
                for msg in await inp.recv_batch(self.config.prompts_per_step, timeout_s=0.05):
                    batch, item = msg.meta["batch"], msg.data
                    if batch < batch_index or item["id"] in self.buckets.get(batch, ()):
                        self.duplicates += 1
                    else:
                        self.buckets.setdefault(batch, {})[item["id"]] = item
            except EndOfChannel:
                return None
        bucket = self.buckets.pop(batch_index)
        return [bucket[i] for i in sorted(bucket)]

    def _count_bad_updates(self, stats: dict) -> None:
        """Log skipped updates; raise once max_bad_updates in a row were skipped."""
        skipped, reason = stats["updates/skipped"], stats.pop("updates/skip_reason")
        if not skipped:
            self.bad_updates = 0
            return
        all_skipped = skipped == stats["updates/total"]
        self.bad_updates = self.bad_updates + skipped if all_skipped else stats["updates/skipped_last"]
        self.ctx.log(f"step {self.version + 1}: skipped {skipped} of {stats['updates/total']} updates: {reason}")
        if self.config.max_bad_updates and self.bad_updates >= self.config.max_bad_updates:
            raise FloatingPointError(f"{self.bad_updates} updates in a row were skipped (learner.max_bad_updates="
                                     f"{self.config.max_bad_updates}); the last reason: {reason}")

    async def run(self):
        if self.ranks is not None and not self.ranks.lead:
            return await self._follow()
        ended = False
        try:
            await self._lead()
            ended = True
        finally:
            await self._finish(ended)

    async def _finish(self, ended: bool) -> None:
        """Save the final weights (one rank: also after a failure; dp x tp: gathered, so only after
        a normal end, when the other ranks still follow) and release the other ranks."""
        c = self.config
        if c.save_final and self.version > 0 and (self.ranks is None or ended):
            model = self.model
            if self.ranks is not None:          # a plain copy with the gathered weights
                weights, _ = await self._all("gather", optimizer=False)
                model, _ = policy.load(c.policy)
                prepare_trained(model, "cpu", c.precision).load_state_dict(weights)
            path = Path(self.ctx.run_dir) / "final"
            save_policy(model, self.tokenizer, str(path))
            self.ctx.artifact("final weights", str(path))
        if ended:
            await self._stop_followers()

    async def _lead(self):
        c = self.config
        if self._pending_state is not None:    # dp x tp, resumed: every rank takes its shards
            await self._all("load")
        await self._all("publish", version=self.version)
        t_last = time.perf_counter()
        while True:
            t_wait = time.perf_counter()
            items = await self._collect(self.version)
            if items is None:
                return
            wait_s = time.perf_counter() - t_wait
            samples = [s for item in items for s in item["samples"]]
            for item in items:
                for s in item["samples"]:
                    s["version"] = item["version"]
            staleness = [self.version - s["version"] for s in samples]
            if max(staleness) > c.max_staleness:
                raise RuntimeError(f"sample of version {min(s['version'] for s in samples)} reached learner "
                                   f"version {self.version}: staleness {max(staleness)} > max_staleness {c.max_staleness}")
            for s, adv in zip(samples, step_advantages(samples, c)):
                s["advantage_tokens"] = adv
            # Update -> report, under the state lock: a checkpoint sees a step whole or not at all.
            async with self.ctx.state_lock:
                with self.ctx.span("train step", samples=len(samples), version=self.version):
                    stats = await self._all("train", samples=samples, kl_coef=self.kl_ctl.value,
                                            stale=max(staleness) > 0, rng=self.rng.getstate(),
                                            version=self.version + 1)
                self._count_bad_updates(stats)
                kl_coef = self.kl_ctl.value
                self.kl_ctl.update(stats["losses/kl"], len(samples))
                self.version += 1
                now = time.perf_counter()
                ok = [s["score"] for s in samples if not s["failed"]]
                mean = sum(ok) / max(len(ok), 1)
                std = math.sqrt(sum((x - mean) ** 2 for x in ok) / max(len(ok), 1))
                metrics = {
                    "reward/mean": mean, "reward/std": std, "kl": stats["losses/kl"], "entropy": stats["entropy"],
                    "staleness/mean": sum(staleness) / len(staleness), "staleness/max": max(staleness),
                    "perf/samples_per_s": len(samples) / (now - t_last), "kl_coef": kl_coef,
                    "samples/failed": len(samples) - len(ok), "response_length/mean":
                        sum(len(s["response_ids"]) for s in samples) / len(samples),
                    "timing/wait_batch_s": wait_s, "timing/step_s": now - t_last, "version": self.version,
                    "prompts/duplicates_dropped": self.duplicates,
                    **{k: v for k, v in stats.items() if k not in ("losses/kl", "entropy")},
                }
                if c.record_prompt_ids:
                    metrics["prompt_ids"] = [item["id"] for item in items]
                t_last = now
                go_on = await self.ctx.step_done(metrics)
            # Checkpoint before the new weights go out: in synchronous mode nothing of the next
            # batch exists yet, so every node's state is the state after this step.
            if self.ctx.checkpoint_due(self.version):
                await self.ctx.checkpoint(self.version)
            if not go_on:
                return
            if c.target_reward and mean >= c.target_reward:
                self.ctx.log(f"mean reward {mean:.3f} reached target_reward {c.target_reward}: stopping")
                return
            await self._all("publish", version=self.version)
