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
from nodes import policy
from nodes.models import pad_batch, save_policy, sequence_logprobs
from nodes.weight_sync import SYNC_EDGE, LearnerWeightSync, WeightSyncConfig
from nodes.rl_math import (AdaptiveKLController, FixedKLController, grpo_advantages, kl_penalty,
                           masked_mean, masked_whiten, ppo_policy_loss)


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
    """How weights reach the generators: object store, or the HybridEngine push (nodes/weight_sync.py)."""
    seed: int = 0


def step_advantages(samples: list[dict], c: LearnerConfig) -> list[list[float]]:
    """Per-token advantages of each sample: the critic's (PPO) or group-normalised scores (GRPO)."""
    if c.algorithm == "grpo":
        scores = torch.tensor([s["score"] for s in samples], dtype=torch.float64)
        per_seq = grpo_advantages(scores, group_size=c.group_size).tolist()
        return [[a] * len(s["response_ids"]) for a, s in zip(per_seq, samples)]
    return [s["advantages"] for s in samples]


def ppo_update(model, optimizer, samples: list[dict], kl_coef: float, pad_id: int, c: LearnerConfig,
               rng: random.Random, stale: bool) -> dict:
    """PPO epochs over minibatches of `samples`; one gradient clip per optimizer step.

    Each sample needs "advantage_tokens" (per response token), "logprobs" (behaviour),
    "ref_logprobs", and "failed". Failed samples are masked out of every loss term.
    An optimizer step whose loss or gradient norm is not finite is skipped (the weights and the
    optimizer state stay as they were); "updates/skipped" counts them, "updates/skipped_last" is
    the run of skipped steps at the end, "updates/skip_reason" says why (the first one).
    """
    keys = ("logprobs", "ref_logprobs", "advantage_tokens")
    device = next(model.parameters()).device
    full = pad_batch(samples, pad_id, token_keys=keys, device=device)
    failed = torch.tensor([0.0 if s["failed"] else 1.0 for s in samples], device=device)
    mask = full["response_mask"] * failed[:, None]
    advantages = masked_whiten(full["advantage_tokens"], mask) if c.whiten_advantages else full["advantage_tokens"]
    # Proximal ("old") log-probs: when every sample came from the current weights, the behaviour
    # log-probs are them (up to float noise) and the extra forward pass is skipped.
    if stale:
        with torch.no_grad():
            old_logprobs, _ = sequence_logprobs(model, full["input_ids"], full["attention_mask"], mask,
                                                temperature=c.temperature, with_entropy=False)
    else:
        old_logprobs = full["logprobs"]
    stats: dict[str, list[float]] = {}
    skipped, skipped_last, total, reason = 0, 0, 0, ""
    model.train()
    for _ in range(c.ppo_epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for start in range(0, len(order), c.minibatch_size):
            idx = torch.tensor(order[start:start + c.minibatch_size], device=device)
            logprobs, entropy = sequence_logprobs(model, full["input_ids"][idx], full["attention_mask"][idx],
                                                  mask[idx], temperature=c.temperature)
            pg_loss, pg_stats = ppo_policy_loss(
                logprobs, old_logprobs[idx], advantages[idx], mask[idx], c.clip_eps,
                behaviour_logprobs=full["logprobs"][idx] if stale else None,
                is_truncation=c.is_truncation if stale else None)
            kl = masked_mean(kl_penalty(logprobs, full["ref_logprobs"][idx], c.kl.estimator), mask[idx])
            ent = masked_mean(entropy, mask[idx])
            loss = pg_loss + kl_coef * kl - c.entropy_coef * ent
            optimizer.zero_grad(set_to_none=True)
            total += 1
            grad_norm = torch.tensor(float("nan"))
            if torch.isfinite(loss):
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c.max_grad_norm)
            if torch.isfinite(loss) and torch.isfinite(grad_norm):
                optimizer.step()
                skipped_last = 0
            else:  # skip this optimizer step
                optimizer.zero_grad(set_to_none=True)
                skipped, skipped_last = skipped + 1, skipped_last + 1
                reason = reason or (f"non-finite loss {loss.item()} (policy {pg_loss.item()}, kl {kl.item()})"
                                    if not torch.isfinite(loss) else f"non-finite gradient norm {grad_norm.item()}")
            for k, v in {"losses/policy": pg_loss.item(), "losses/kl": kl.item(), "entropy": ent.item(),
                         "losses/approx_kl": pg_stats["approx_kl"], "losses/clipfrac": pg_stats["clipfrac"],
                         "losses/is_weight": pg_stats["is_weight_mean"], "grad_norm": grad_norm.item()}.items():
                stats.setdefault(k, []).append(v)
    model.eval()
    return {**{k: sum(v) / len(v) for k, v in stats.items()}, "updates/total": total,
            "updates/skipped": skipped, "updates/skipped_last": skipped_last, "updates/skip_reason": reason}


class Learner(Node):
    Config = LearnerConfig
    inputs = ("rollouts",)
    publishes = ("policy", SYNC_EDGE)

    async def setup(self):
        c = self.config
        self.model, self.tokenizer = policy.load(c.policy)
        self.model.to(self.ctx.device).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=c.lr)
        self.kl_ctl = (AdaptiveKLController(c.kl.coef, c.kl.target, c.kl.horizon) if c.kl.kind == "adaptive"
                       else FixedKLController(c.kl.coef))
        self.rng = random.Random(c.seed)
        self.version = 0  # = steps done = the batch being collected
        self.buckets: dict[int, dict] = {}  # batch -> {prompt id: item}
        self.duplicates = 0
        self.bad_updates = 0  # optimizer steps skipped in a row (non-finite loss or gradient)
        self.weight_sync = LearnerWeightSync(self.ctx, c.weight_sync)
        await self.weight_sync.setup(self.model)

    def state_dict(self) -> dict:
        return {"step": self.version, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "kl": self.kl_ctl.state_dict(), "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl"])
        self.rng.setstate(state["rng"])
        self.version = state["step"]

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
        c = self.config
        await self.weight_sync.publish(self.model, self.version)
        t_last = time.perf_counter()
        try:
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
                        stats = await asyncio.to_thread(
                            ppo_update, self.model, self.optimizer, samples, self.kl_ctl.value,
                            self.tokenizer.pad_token_id, c, self.rng, max(staleness) > 0)
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
                await self.weight_sync.publish(self.model, self.version)
        finally:
            if c.save_final and self.version > 0:
                path = Path(self.ctx.run_dir) / "final"
                save_policy(self.model, self.tokenizer, str(path))
                self.ctx.artifact("final weights", str(path))
