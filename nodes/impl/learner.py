"""The learner's implementation: the model, its optimizer and weight sync set up, each step collected,
trained (rl/update/ppo_update.py), reported, checkpointed and published. Its settings, ports and
flow: nodes/learner.py.
"""

from __future__ import annotations

import asyncio
import random
import time

import torch

from dataflow.channel import EndOfChannel
from dataflow.errors import UserError
from dataflow.weights.multirank import RankCommands
from dataflow.weights.sync import LearnerWeightSync
from nodes import learner as declared
from nodes.impl.reference import add_logprobs
from nodes.learner import LearnerConfig  # noqa: F401 (tests, bench)
from rl.model import lora
from rl.data import policy
from rl.update.compile_warm_up import free_step_memory, start_warm_up
from rl.model.gpu_turns import GpuTurn
from rl.algorithm.kl import AdaptiveKLController, FixedKLController
from rl.update.microbatch import enable_gradient_checkpointing
from rl.update.packing import use_varlen_attention
from rl.update.learner_state import LearnerState
from rl.update.step_metrics import step_metrics, step_samples
from rl.update.ppo_update import ppo_update, step_advantages  # noqa: F401 (step_advantages: tests, bench)
from rl.update.settings import check_config
from rl.model.precision import compile_layers, compile_setting, prepare_trained
from rl.algorithm.schedule import lr_multiplier


class BadUpdates(UserError, FloatingPointError):
    """max_bad_updates updates in a row were skipped (non-finite loss or gradients): the run stops
    with one line naming the setting and the last reason (lower the lr, check the rewards)."""


class Learner(LearnerState, RankCommands, declared.Learner):
    """The policy, its optimizer and weight sync, set up and run (the flow: nodes/learner.py)."""

    async def setup(self):
        c = self.config
        self.ranks = None           # dataflow.weights.multirank.TrainRanks when dp x tp > 1
        self._warm_up = None        # rl/update/compile_warm_up.start_warm_up's task (held: a task needs a reference)
        self.turn = GpuTurn(self.ctx.gpu_turn) if self.ctx.gpu_turn else None   # the phase switch's (rl/model/gpu_turns.py)
        if c.num_ranks > 1:
            from dataflow.weights.layout import ParallelLayout
            from dataflow.weights.multirank import join

            self.ranks = await join(self.ctx, ParallelLayout(dp=c.dp, tp=c.tp), c.rendezvous_timeout_s)
        elif self.ctx.num_replicas > 1:
            raise UserError(f"node '{self.ctx.name}' has {self.ctx.num_replicas} replicas but learner.dp x "
                            f"learner.tp = 1; declare it with replicas=dp*tp")
        self._pending_state = None  # dp x tp: a loaded (model, optimizer) state, spread in run()
        self._saved = None          # dp x tp: (model, optimizer) gathered for state_dict()
        with self.ctx.span("import transformers"):   # spans in setup: the run's start-up parts (setup/learner/...)
            policy.import_model_code()
        with self.ctx.span("load model"):
            self.model, self.tokenizer = policy.load(c.policy)
            # fp32 master weights even from a bf16 checkpoint (precision.prepare_trained).
            prepare_trained(self.model, self.ctx.device, c.precision).eval()
        check_config(c, self.ctx.max_steps)
        self.peft = None            # lora.rank > 0: the PeftModel around self.model (LoRA layers inside it)
        if c.lora.rank:             # (check_config refused LoRA with dp x tp > 1)
            with self.ctx.span("lora"):
                self.peft = lora.wrap(self.model, c.lora, self.ctx.device, c.precision)
            trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            self.ctx.log(f"LoRA rank {c.lora.rank}: {len(lora.adapted_layers(self.model))} layers adapted, "
                         f"{trained:,} trained parameters")
        # Before TP / FSDP and compile, which wrap the layers these switch.
        if c.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        if c.packing:
            self.ctx.log(f"packed passes, attention: {use_varlen_attention(self.model, self.ctx.device)}")
        if self.ranks is not None:  # TP over "tp", then FSDP2 over "dp" (dataflow/weights/layout.py)
            try:
                self.ranks.shard(self.model)
            except ValueError as e:
                raise UserError(f"learner.dp={c.dp} learner.tp={c.tp}: {e}") from None
        else:  # sharded ranks stay eager (compiling FSDP2/TP layers is untried here)
            with self.ctx.span("compile set-up"):   # torch.compile's wrappers; the compile itself is the warm-up's
                compiled = compile_layers(self.model, compile_setting(c.compile, c.packing, c.gradient_checkpointing),
                                          self.ctx.device)
            if compiled and c.compile_warm_up:   # the layers compile while the other nodes start
                self._warm_up = start_warm_up(self.ctx, self.model, c, self.tokenizer.pad_token_id, self.turn,
                                              self._reference_logprobs if c.own_reference else None)
        trained = [p for p in self.model.parameters() if p.requires_grad]   # LoRA: the adapter only
        self.optimizer = torch.optim.AdamW(trained, lr=c.lr, betas=tuple(c.betas),
                                           weight_decay=c.weight_decay)
        self.kl_ctl = (AdaptiveKLController(c.kl.coef, c.kl.target, c.kl.horizon) if c.kl.kind == "adaptive"
                       else FixedKLController(c.kl.coef))
        self.rng = random.Random(c.seed)
        self.version = 0  # = steps done = the batch being collected
        self.buckets: dict[int, dict] = {}  # batch -> {prompt id: item}
        self.duplicates = 0
        self.bad_updates = 0  # optimizer steps skipped in a row (non-finite loss or gradient)
        self.weight_sync = LearnerWeightSync(self.ctx, c.weight_sync)
        with self.ctx.span("weight sync setup"):
            await self.weight_sync.setup(self.model, self.ranks,
                                         adapter=lora.LoraWeights(self.model) if self.peft else None)

    async def _handle(self, op: str, args: dict):
        c = self.config
        if op == "train":
            self.rng.setstate(args["rng"])      # every rank shuffles the minibatches alike
            # The schedule is a function of the step (= the version trained from), so every rank
            # and a resumed run (the version is in the checkpoint) set the same learning rate.
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_at(args["version"] - 1)
            waited = 0.0
            if self.turn is not None:           # the generator's KV cache is freed before this returns
                with self.ctx.span("wait for the GPU"):
                    waited = await asyncio.to_thread(self.turn.take)
            try:
                if c.own_reference:
                    with self.ctx.span("reference forward", samples=len(args["samples"])):
                        await asyncio.to_thread(self._reference_logprobs, args["samples"])
                stats = await asyncio.to_thread(ppo_update, self.model, self.optimizer, args["samples"],
                                                args["kl_coef"], self.tokenizer.pad_token_id, c, self.rng,
                                                args["stale"], self.ranks, args["version"] - 1)
            finally:
                if self.turn is not None:
                    with self.ctx.span("free activations"):
                        freed_s = await asyncio.to_thread(free_step_memory, self.model)
                    self.turn.give()
            if self.turn is not None:
                stats.update({"learner/gpu_turn_wait_s": waited, "learner/free_s": freed_s})
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

    def _reference_logprobs(self, samples: list[dict]) -> None:
        """samples' "ref_logprobs": the base policy's, the adapter disabled (learner.own_reference)."""
        c = self.config
        with self.peft.disable_adapter():
            add_logprobs(self.model, self.tokenizer.pad_token_id, [{"samples": samples}], "ref_logprobs",
                         c.micro_batch_size, c.temperature, c.max_tokens_per_micro_batch, c.packing)

    def lr_at(self, step: int) -> float:
        """The learning rate of learner step `step` (0-based), learner.schedule over the run."""
        c, s = self.config, self.config.schedule
        return c.lr * lr_multiplier(step, s.warmup_steps, s.total_steps or self.ctx.max_steps or 0, s.decay,
                                    s.min_lr_ratio)

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
            raise BadUpdates(f"{self.bad_updates} updates in a row were skipped (learner.max_bad_updates="
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
            samples, staleness, token_staleness = step_samples(items, self.version, c.max_staleness)
            # Update -> report, under the state lock: a checkpoint sees a step whole or not at all.
            async with self.ctx.state_lock:
                with self.ctx.span("train step", samples=len(samples), version=self.version):
                    stats = await self._all("train", samples=samples, kl_coef=self.kl_ctl.value,
                                            stale=max(staleness) > 0, rng=self.rng.getstate(),
                                            version=self.version + 1)
                self._count_bad_updates(stats)
                kl_coef = self.kl_ctl.value
                # KL in the reward: the controller sees the rollout's KL (verl's apply_kl_penalty),
                # in the loss: the policy's KL to the reference during the update.
                # No KL stat without a reference node (KL coefficient 0, rl/update/ppo_update.with_reference).
                kl = stats.get("kl/rollout" if c.kl.placement == "reward" else "losses/kl")
                if kl is not None:
                    self.kl_ctl.update(kl, len(samples))
                self.version += 1
                now = time.perf_counter()
                metrics = step_metrics(items, samples, staleness, token_staleness, stats, kl=kl, kl_coef=kl_coef,
                                       lr=self.lr_at(self.version - 1), version=self.version, wait_s=wait_s,
                                       step_s=now - t_last, duplicates=self.duplicates,
                                       record_prompt_ids=c.record_prompt_ids)
                mean = metrics["reward/mean"]
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
