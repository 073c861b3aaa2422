"""Generator: samples responses with a transformers causal LM, tagged with the policy version.

Consumes: `prompts` {"id", "prompt", "fields"}.
Produces: `samples`, one item per prompt: {"id", "prompt", "fields", "version",
          "samples": [{"prompt_ids", "response_ids", "logprobs", "finished"} x group_size]}.
Waits for: prompts (admitted by the prompt source under the staleness bound).
Unblocked by: the prompt source; new weights arrive on the versioned edge `policy` at any time.

Weights switch only between generate calls, so no response mixes versions, and prompts already
taken are generated (with the weights in hand at that moment), never lost. Generation runs in a
worker thread so the actor keeps answering channel pulls and weight pushes meanwhile.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from dataflow import Node
from dataflow.channel import EndOfChannel
from nodes import policy
from nodes.models import sample_responses


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
    seed: int = 0


class Generator(Node):
    Config = GeneratorConfig
    inputs = ("prompts",)
    outputs = ("samples",)
    subscribes = ("policy",)

    async def setup(self):
        self.model, self.tokenizer = policy.load(self.config.policy)
        self.model.to(self.ctx.device).eval()
        self.version = 0
        # Each replica samples its own stream, reproducibly.
        self.rng = torch.Generator().manual_seed(self.config.seed * 1000 + self.ctx.replica)

    async def _sync_weights(self) -> None:
        if self.ctx.latest_version("policy") > self.version:
            version, state = await self.ctx.latest("policy")
            self.model.load_state_dict(state)
            self.version = version

    async def run(self):
        c = self.config
        prompts, out = self.ctx.inputs["prompts"], self.ctx.outputs["samples"]
        while True:
            try:
                batch = await prompts.recv_batch(c.prompts_per_call, timeout_s=0.02)
            except EndOfChannel:
                return
            await self._sync_weights()
            ids = [self.tokenizer(m.data["prompt"])["input_ids"] for m in batch]
            repeated = [p for p in ids for _ in range(c.group_size)]
            with self.ctx.span("generate", prompts=len(batch), version=self.version):
                samples = await asyncio.to_thread(
                    sample_responses, self.model, self.tokenizer, repeated, c.max_new_tokens,
                    c.temperature, c.top_k or None, self.rng)
            for i, msg in enumerate(batch):
                group = samples[i * c.group_size:(i + 1) * c.group_size]
                item = {**msg.data, "version": self.version, "samples": group}
                await out.send(item, **{**msg.meta, "version": self.version})
