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

This file declares the kind (its settings and ports: what the driver reads before Ray starts, no
torch); nodes/impl/learner.py runs it (Node.implementation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from dataflow import Node
from dataflow.checks import AtLeast, Each, Finite, NonNegative, Positive, Range
from dataflow.weights.edges import RANKS_EDGE, SYNC_EDGE, WeightSyncConfig
from rl.algorithm.schedule import ScheduleConfig
from rl.algorithm.settings import KLConfig, PolicyLoss
from rl.data import policy
from rl.model.settings import LoraConfig, Precision
from rl.update.settings import check_config


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


class Learner(Node):
    Config = LearnerConfig
    check_settings = staticmethod(check_config)  # before Ray starts (dataflow/driver/preflight.py), and in setup
    inputs = ("rollouts",)
    publishes = ("policy", SYNC_EDGE, RANKS_EDGE)
    subscribes = (RANKS_EDGE,)
    # dp x tp ranks: rank 0 alone reads the rollouts, reports, checkpoints and publishes; it
    # broadcasts each step's samples and every collective to the others (RankCommands).
    inputs_on_replica_0 = True
    implementation = "nodes.impl.learner:Learner"
