"""Generator: samples responses with a transformers causal LM, tagged with the policy version.

Consumes: `prompts` {"id", "prompt", "fields"}.
Produces: `samples`, one item per prompt: {"id", "prompt", "fields", "version",
          "samples": [{"prompt_ids", "response_ids", "logprobs", "finished"} x group_size]}.
Waits for: prompts (admitted by the prompt source under the staleness bound).
Unblocked by: the prompt source; new weights arrive on the versioned edge `policy` at any time
(weight_sync.transport=collective: by the learner's HybridEngine push; nodes/weight_sync.py).

Weights switch only between generate calls, so no response mixes versions, and prompts already
taken are generated (with the weights in hand at that moment), never lost. Generation runs in a
worker thread so the actor keeps answering channel pulls and weight pushes meanwhile.
Each call samples from a torch.Generator seeded with (seed, id of its first prompt): the same
prompts in the same call give the same responses on any replica, after a restart or a resume.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from dataflow import Node
from nodes import policy
from nodes.models import sample_responses
from nodes.weight_sync import SYNC_EDGE, GeneratorWeightSync, WeightSyncConfig


@dataclass(kw_only=True)
class GeneratorConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    """The model to sample from (the learner pushes its weights here)."""
    group_size: int = 1
    """Responses per prompt (GRPO groups; 1 for PPO)."""
    max_new_tokens: int = 8
    """Longest response in tokens."""
    temperature: float = 1.0
    top_k: int = 0
    """Sample from the k most likely tokens (0 = all)."""
    prompts_per_call: int = 32
    """Prompts batched into one generate call (taken as they are available, up to this many)."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How the learner's weights arrive (must match the learner's; nodes/weight_sync.py)."""
    seed: int = 0


class Generator(Node):
    Config = GeneratorConfig
    inputs = ("prompts",)
    outputs = ("samples",)
    subscribes = ("policy", SYNC_EDGE)

    async def setup(self):
        self.model, self.tokenizer = policy.load(self.config.policy)
        self.model.to(self.ctx.device).eval()
        self.version = 0
        self.weight_sync = GeneratorWeightSync(self.ctx, self.config.weight_sync)
        await self.weight_sync.setup(self.model)

    async def run(self):
        c = self.config
        prompts, out = self.ctx.inputs["prompts"], self.ctx.outputs["samples"]
        async for batch in prompts.batches(c.prompts_per_call, 0.02):
            ids = [self.tokenizer(m.data["prompt"])["input_ids"] for m in batch]
            repeated = [p for p in ids for _ in range(c.group_size)]
            rng = torch.Generator().manual_seed(c.seed * 2**32 + batch[0].data["id"])
            async with self.weight_sync.serving() as self.version:   # weights switch only here
                with self.ctx.span("generate", prompts=len(batch), version=self.version):
                    samples = await asyncio.to_thread(
                        sample_responses, self.model, self.tokenizer, repeated, c.max_new_tokens,
                        c.temperature, c.top_k or None, rng)
            for i, msg in enumerate(batch):
                group = samples[i * c.group_size:(i + 1) * c.group_size]
                item = {**msg.data, "version": self.version, "samples": group}
                await out.send(item, **{**msg.meta, "version": self.version})
