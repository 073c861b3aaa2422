"""Learner: PPO / GRPO policy updates, then a versioned weight push to every generator.

Consumes: `advantaged` items (PPO: from the critic) or `with_ref` items (GRPO: straight from the
reference node).  Produces: weights on the versioned edge `policy` (version = updates done).
Waits for: the complete batch of the step it is on.  Unblocked by: the critic / reference node.

Step k trains on exactly the prompts the source admitted for batch k (meta "batch"), so the
staleness of every sample is k - sample.version <= max_staleness by construction (admission
control in nodes/prompts.py); the learner reports it, and refuses a sample that breaks the bound.
The step is a flat sequence of phases: collect -> old log-probs, advantages and PPO epochs over
minibatches (rl/update/ppo_update.py) -> KL controller -> report (rl/update/step_metrics.py) ->
checkpoint (every save_interval steps; the state: rl/update/learner_state.py) -> publish. The
algorithm variants (advantage estimators, policy losses, loss aggregation, KL placement, DAPO's
shaping, the learning-rate schedule) are settings of LearnerConfig; their math is in rl/
(docs/algorithms.md). Collect keeps one copy of each prompt id (a prompt re-issued
after a node restart arrives twice). A minibatch update with a non-finite loss or gradient is
skipped and logged; max_bad_updates of them in a row stop the run.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch

from dataflow import Node
from dataflow.channel import EndOfChannel
from dataflow.checks import AtLeast, Each, Finite, NonNegative, Positive, Range
from dataflow.errors import UserError
from dataflow.weights.multirank import RANKS_EDGE, RankCommands
from dataflow.weights.sync import SYNC_EDGE, LearnerWeightSync, WeightSyncConfig
from nodes.reference import add_logprobs
from rl.model import lora
from rl.data import policy
from rl.update.compile_warm_up import free_step_memory, start_warm_up
from rl.model.gpu_turns import GpuTurn
from rl.algorithm.kl import AdaptiveKLController, FixedKLController, KLConfig
from rl.model.lora import LoraConfig
from rl.algorithm.losses import PolicyLoss
from rl.update.microbatch import enable_gradient_checkpointing
from rl.update.packing import use_varlen_attention
from rl.update.learner_state import LearnerState
from rl.update.step_metrics import step_metrics, step_samples
from rl.update.ppo_update import check_config, ppo_update, step_advantages  # noqa: F401 (step_advantages: tests, bench)
from rl.model.precision import Precision, compile_layers, compile_setting, prepare_trained
from rl.algorithm.schedule import ScheduleConfig, lr_multiplier


@dataclass(kw_only=True)
class LearnerConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    algorithm: Literal["ppo", "grpo"] = "ppo"
    """ppo: per-token advantages from the critic (GAE). grpo: group-normalised scores."""
    prompts_per_step: Annotated[int, AtLeast(1)] = 64
    """Prompt groups per step (must equal the prompt source's)."""
    group_size: Annotated[int, AtLeast(1)] = 1
    max_staleness: Annotated[int, NonNegative] = 1
    """The bound the prompt source enforces; a sample beyond it is an error."""
    lr: Annotated[float, Positive] = 1e-3
    ppo_epochs: Annotated[int, AtLeast(1)] = 1
    minibatch_size: Annotated[int, AtLeast(1)] = 128
    """Samples per optimizer step."""
    micro_batch_size: Annotated[int, NonNegative] = 0
    """Samples per forward/backward pass; their gradients accumulate into each minibatch's one
    optimizer step, with the same result as the whole minibatch at once (0 = the whole minibatch).
    Bounds memory: the logits of a sample are (prompt + response) x vocab floats (W1: 0.16 GB)."""
    max_tokens_per_micro_batch: int = 0
    """Tokens per forward/backward pass on each GPU instead of a row count (verl's
    ppo_max_token_len_per_gpu; 0 = use micro_batch_size, which must then be 0 if this is set):
    rows balanced over dp ranks by tokens, as many passes as the longest rank needs, the same
    loss as unsplit. Counted as the pass runs: prompt + response tokens packed, rows x (longest
    prompt + longest response) padded. Must be at least the longest prompt + response. On a GPU
    placement, left at 0 with micro_batch_size 0, the memory plan sets it (docs/gpus.md)."""
    packing: bool = False
    """Run each pass packed: rows end to end without padding, attention kept within each row
    (flash-attn's varlen kernel when installed, else flex_attention on CUDA, sdpa's block mask on
    CPU; rl/update/packing.py); the same gradients as padded. "learner/padding_frac" reports padding."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (less memory,
    about one more forward of time; rl/update/microbatch.enable_gradient_checkpointing). On a GPU
    placement the memory plan turns it on when the smallest token budget does not fit without it."""
    precision: Precision = "auto"
    """auto: bf16 autocast over fp32 master weights on CUDA, fp32 on CPU; or bf16 / fp32 (rl/model/precision.py)."""
    compile: bool | None = None
    """torch.compile each decoder layer (None = on CUDA, one process, without gradient_checkpointing
    or packing; rl/model/precision.compile_setting says why, compile_layers how)."""
    compile_warm_up: bool = True
    """With compiled layers: compile them during start-up, on a made-up step of the update
    (rl/update/compile_warm_up.py), instead of in the first training step."""
    weight_decay: Annotated[float, NonNegative] = 0.01
    """AdamW's decoupled weight decay."""
    betas: Annotated[list[float], Each(Range(0, 1, high_open=True), count=2)] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    advantage: Literal["auto", "gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"] = "auto"
    """gae: the critic's (PPO graph). grpo: group-normalised scores. dr_grpo: scores minus the group
    mean, no std. rloo: leave-one-out baseline. reinforce_pp: whitened returns of the token rewards
    (REINFORCE++). auto: gae in the PPO graph, grpo in the GRPO graph (docs/algorithms.md)."""
    grpo_std_scaling: bool = True
    """advantage=grpo: divide by the group's std (False: Dr. GRPO's unscaled advantage)."""
    gamma: Annotated[float, Range(0, 1)] = 1.0
    """advantage=reinforce_pp: discount of the token rewards' returns."""
    policy_loss: PolicyLoss = "ppo"
    """ppo: clipped surrogate. dual_clip: also bounds negative-advantage tokens at dual_clip_c.
    gspo: one sequence-level ratio. reinforce: importance-weighted, no clipping (rl/algorithm/losses.policy_loss)."""
    loss_agg_mode: Literal["auto", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] = "auto"
    """How token losses make a minibatch's loss (verl's names; rl/algorithm/losses.agg_row_weights): token-mean,
    seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO). auto:
    seq-mean-token-mean for gspo, seq-mean-token-sum-norm for dr_grpo, else token-mean."""
    loss_scale_factor: Annotated[float, NonNegative] = 0.0
    """seq-mean-token-sum-norm's constant divisor (0 = max_new_tokens)."""
    clip_eps: Annotated[float, Range(0, 1, low_open=True, high_open=True)] = 0.2
    clip_eps_low: Annotated[float | None, Range(0, 1, low_open=True, high_open=True)] = None
    """Lower clip range 1 - clip_eps_low (None = clip_eps)."""
    clip_eps_high: Annotated[float | None, Positive] = None
    """Upper clip range 1 + clip_eps_high (None = clip_eps; DAPO's clip-higher: 0.28 with 0.2 low)."""
    dual_clip_c: Annotated[float, Range(1, low_open=True)] = 3.0
    """policy_loss=dual_clip: a negative-advantage token's loss is at most c x |A| (c > 1)."""
    log_ratio_clamp: Annotated[float, NonNegative] = 20.0
    """log(pi / pi_old) is clamped to [-x, x] before exp (verl's 20), so one float32 overflow cannot
    make the minibatch's loss inf and skip it (0 = off)."""
    is_truncation: Annotated[float, Positive] = 2.0
    """Cap of the importance weight pi_old / pi_behaviour for stale samples (decoupled PPO)."""
    kl: KLConfig = field(default_factory=KLConfig)
    entropy_coef: Annotated[float, Finite] = 0.0
    max_grad_norm: Annotated[float, Positive] = 1.0
    whiten_advantages: bool = True
    """advantage=gae: whiten the critic's advantages over the batch's tokens (verl's GAE). The
    learner-side estimators are normalised already and are never whitened again."""
    max_new_tokens: Annotated[int, NonNegative] = 0
    """The longest response the learner sees, the graph fills it: the generators' max_new_tokens,
    or an agent graph's env.max_episode_tokens (sampled and environment tokens). Overlong shaping's
    cap, seq-mean-token-sum-norm's default divisor, the compile warm-up's longest sample."""
    overlong_buffer: Annotated[int, NonNegative] = 0
    """DAPO's overlong shaping: over the last this many tokens before max_new_tokens the score
    falls linearly by up to overlong_penalty (rl/algorithm/shaping.overlong_penalty; 0 = off)."""
    overlong_penalty: Annotated[float, NonNegative] = 1.0
    mask_truncated: bool = False
    """Leave responses that hit the length cap (no stop token) out of the loss (DAPO's overlong
    filtering); they still count in their group's baseline."""
    temperature: Annotated[float, Positive] = 1.0
    """Sampling temperature of the generators (log-probs are computed at the same one)."""
    target_reward: Annotated[float, Finite] = 0.0
    """End the run once the step's mean reward reaches this (0 = off)."""
    save_final: bool = True
    """Save the final policy to <run dir>/final (a normal HF model directory)."""
    max_bad_updates: Annotated[int, NonNegative] = 10
    """Stop the run after this many optimizer steps in a row were skipped for a non-finite loss
    or gradient (each one is skipped and logged; 0 = never stop)."""
    record_prompt_ids: bool = False
    """Put the ids of the prompts each step trained on in its metrics ("prompt_ids")."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How weights reach the generators: object store, or the HybridEngine push (dataflow/weights/sync.py)."""
    dp: Annotated[int, AtLeast(1)] = 1
    """Data-parallel ranks: FSDP2 shards the model over them, each trains on its share of every
    minibatch. The graph runs the learner as dp x tp replicas (dataflow/weights/multirank.py)."""
    tp: Annotated[int, AtLeast(1)] = 1
    """Tensor-parallel ranks (column/row-wise plans of Llama / Qwen2 blocks, dataflow/weights/layout.py):
    attention heads, KV heads, MLP width and vocab must divide by it."""
    rendezvous_timeout_s: Annotated[float, Positive] = 600.0
    """dp x tp > 1: how long the ranks wait for each other in their setups."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA (peft): train only a low-rank adapter on the frozen policy, push only the adapter to the
    generators, which merge it (rl/model/lora.py, dataflow/weights/lora.py). rank 0 = full fine-tuning."""
    own_reference: bool = False
    """Compute the KL term's reference log-probs here, as the policy with its LoRA adapter disabled,
    instead of reading them from a reference node (the graphs set it when lora.rank > 0 and a KL
    term needs them: the reference is then the base the learner holds anyway, no second model)."""
    seed: int = 0

    @property
    def num_ranks(self) -> int:
        """dp x tp: the replicas the graph declares the learner with."""
        return self.dp * self.tp


class BadUpdates(UserError, FloatingPointError):
    """max_bad_updates updates in a row were skipped (non-finite loss or gradients): the run stops
    with one line naming the setting and the last reason (lower the lr, check the rewards)."""


class Learner(LearnerState, RankCommands, Node):
    Config = LearnerConfig
    check_settings = staticmethod(check_config)  # before Ray starts (dataflow/driver/preflight.py), and in setup
    inputs = ("rollouts",)
    publishes = ("policy", SYNC_EDGE, RANKS_EDGE)
    subscribes = (RANKS_EDGE,)
    # dp x tp ranks: rank 0 alone reads the rollouts, reports, checkpoints and publishes; it
    # broadcasts each step's samples and every collective to the others (RankCommands).
    inputs_on_replica_0 = True

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
