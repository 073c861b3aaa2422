"""Critic: values for rollouts as soon as they arrive, GAE advantages, and its own training.

Consumes: `with_ref` items.  Produces: `advantaged`, the same items with per response "values",
"advantages" and "returns" (per response token).
Waits for: scored samples.  Unblocked by: the reference node.

Value prefetch: values are computed per arriving micro-batch, while the generators are still
producing the rest of the step's samples, so the learner never waits for a value pass. Every
`train_samples` samples the critic trains on them (clipped value loss, AdamW, gradient clipping),
between micro-batches; advantages of later samples use the updated critic.

dp x tp ranks (critic.dp, critic.tp; the graph runs dp x tp replicas): the value model is laid out
as the learner's (TP then FSDP2, dataflow/weights/multirank.py); rank 0 reads the input and sends every
value pass and training pass to all ranks, each dp rank computing its share of the rows. A rank's
process cannot rejoin a running process group, so a dead rank ends the run (resume from the last
checkpoint) instead of restarting alone, and snapshots are off.

This file declares the kind (its settings and ports: what the driver reads before Ray starts, no
torch); nodes/impl/critic.py runs it (Node.implementation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from dataflow import Node
from dataflow.checks import AtLeast, NonNegative, Positive, Range
from dataflow.weights.edges import CRITIC_RANKS_EDGE
from rl.data import policy
from rl.model.settings import Precision
from rl.update.settings import check_micro_batch_settings


@dataclass(kw_only=True)
class CriticConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    """The value model's trunk starts as a copy of this policy's."""
    gamma: Annotated[float, Range(0, 1)] = 1.0
    lam: Annotated[float, Range(0, 1)] = 0.95
    lr: Annotated[float, Positive] = 1e-3
    epochs: Annotated[int, AtLeast(1)] = 2
    """Passes over each training batch."""
    minibatch_size: Annotated[int, AtLeast(1)] = 64
    train_samples: Annotated[int, AtLeast(1)] = 128
    """Train after this many new samples (usually the learner's samples per step)."""
    value_clip: Annotated[float, Positive] = 0.2
    max_grad_norm: Annotated[float, Positive] = 1.0
    gradient_checkpointing: bool = False
    items_per_call: Annotated[int, AtLeast(1)] = 32
    micro_batch_size: Annotated[int, NonNegative] = 0
    """Samples per forward/backward pass, in the value pass and in training (gradients accumulate
    into each minibatch's one optimizer step, same result as unsplit; 0 = no split)."""
    max_tokens_per_micro_batch: int = 0
    """Tokens per pass on each GPU instead of a row count, in the value pass and in training (as
    learner.max_tokens_per_micro_batch: one of the two must be 0; rows balanced over dp ranks by
    tokens; on a GPU placement the memory plan sets it, and gradient_checkpointing, as the learner's)."""
    packing: bool = False
    """Run each pass packed, without padding (as learner.packing); "critic/padding_frac" reports
    the padding of the value and training passes since the last report."""
    precision: Precision = "auto"
    """auto: bf16 autocast over fp32 master weights on CUDA, fp32 on CPU (rl/model/precision.py)."""
    compile: bool | None = None
    """torch.compile each decoder layer of the trunk (None = on CUDA, one process, without
    gradient_checkpointing or packing; rl/model/precision.compile_setting says why, compile_layers how)."""
    seed: int = 0
    snapshot_interval: Annotated[int, AtLeast(-1, note='-1 = auto, 0 = off')] = -1
    """Every this many training passes, write the critic's state to <run>/snapshots/<replica>/:
    a critic restarted after its process died loads it, keeping its training since the last
    checkpoint (0 = off: it comes back as of the last checkpoint). Costs one write of the value
    model plus its AdamW state (3x the weights) per pass. -1 = auto: every pass while that state
    is under 256 MB (the built-in models), else off (said once in the log: set it to opt in)."""
    dp: Annotated[int, AtLeast(1)] = 1
    """Data-parallel ranks (FSDP2 over them), as learner.dp; the graph runs dp x tp replicas."""
    tp: Annotated[int, AtLeast(1)] = 1
    """Tensor-parallel ranks, as learner.tp."""
    rendezvous_timeout_s: Annotated[float, Positive] = 600.0

    @property
    def num_ranks(self) -> int:
        """dp x tp: the replicas the graph declares the critic with."""
        return self.dp * self.tp


class Critic(Node):
    Config = CriticConfig
    inputs = ("with_ref",)
    outputs = ("advantaged",)
    publishes = (CRITIC_RANKS_EDGE,)
    subscribes = (CRITIC_RANKS_EDGE,)
    inputs_on_replica_0 = True  # dp x tp ranks: rank 0 reads, all compute (one rank: the same)
    implementation = "nodes.impl.critic:Critic"

    @staticmethod
    def check_settings(c, max_steps=None) -> None:
        """Its settings that must fit together, before Ray starts (dataflow/driver/preflight.py)."""
        check_micro_batch_settings("critic", c.micro_batch_size, c.max_tokens_per_micro_batch)
