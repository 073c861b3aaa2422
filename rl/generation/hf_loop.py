"""The generator's HF loop (nodes/generator.py with backend=hf, or a model the static decoder does
not cover and no vLLM): batches of up to prompts_per_call prompts, each batch sampled by
rl/generation/hf_sampling.sample_responses under one weight version (the weights switch only
between batches); validation prompts in calls of their own (span "generate val"); multi-turn
episodes turn in lockstep, every turn re-prefilling its history (rl/generation/episodes.hf_episodes).
A torch.Generator per call is seeded from (seed, id of the call's first prompt).
"""

from __future__ import annotations

import asyncio

import torch

from rl.generation.episodes import Episodes, hf_episodes
from rl.generation.groups import item_fields
from rl.generation.hf_sampling import sample_responses


class HFLoop:
    """Mixed into nodes/impl/generator.Generator, whose setup sets the attributes used here: config, ctx,
    model, tokenizer, stop_ids, env, weight_sync, prompts_per_call; and _plan, _tokenize and
    _stop_strings are its methods. self.version is the version of the batch being sampled."""

    async def _run_batched(self):
        prompts = self.ctx.inputs["prompts"]
        async for batch in prompts.batches(self.prompts_per_call, 0.02):
            # validation prompts in calls (and trace spans) of their own
            for part, span in (([m for m in batch if "val" not in m.data], "generate"),
                               ([m for m in batch if "val" in m.data], "generate val")):
                if part:
                    await self._generate_batch(part, span)

    async def _generate_batch(self, batch: list, span: str) -> None:
        c = self.config
        plans = [self._plan(m) for m in batch]
        if self.env is not None:
            return await self._episodes_batch(batch, plans, span)
        ids = [self._tokenize(m) for m in batch]
        repeated = [p for p, plan in zip(ids, plans) for _ in plan]
        temps = [c.temperature if t is None else t for plan in plans for _, t in plan]
        first = batch[0].data
        rng = torch.Generator().manual_seed(c.seed * 2**32 + (first["val"]["row"] if "val" in first else first["id"]))
        async with self.weight_sync.serving() as self.version:   # weights switch only here
            with self.ctx.span(span, prompts=len(batch), version=self.version):
                samples = await asyncio.to_thread(
                    sample_responses, self.model, self.tokenizer, repeated, c.max_new_tokens,
                    temps, c.top_k or None, rng, None, c.min_new_tokens, self.stop_ids)
        at = 0
        for msg, plan in zip(batch, plans):
            group = [self._stop_strings(s) for s in samples[at:at + len(plan)]]
            at += len(plan)
            item = {**item_fields(msg), "version": self.version, "samples": group}
            await self.ctx.outputs["samples"].send(item, **{**msg.meta, "version": self.version})

    async def _episodes_batch(self, batch: list, plans: list, span: str) -> None:
        """The HF loop's episodes (rl/generation/episodes.hf_episodes): the weights stay the same
        for the whole batch of episodes (one serving() block), every turn re-prefills its history."""
        c = self.config
        first = batch[0].data
        rng = torch.Generator().manual_seed(c.seed * 2**32 + (first["val"]["row"] if "val" in first else first["id"]))
        episodes = Episodes(self.ctx, self.env, None, c.max_new_tokens)

        async def sample(histories, temps, cap):
            temps = [c.temperature if t is None else t for t in temps]
            return await asyncio.to_thread(sample_responses, self.model, self.tokenizer, histories, cap, temps,
                                           c.top_k or None, rng, None, c.min_new_tokens, self.stop_ids)
        async with self.weight_sync.serving() as self.version:
            with self.ctx.span(span, prompts=len(batch), version=self.version):
                groups = await hf_episodes(episodes, batch, plans, sample, self.version)
        for msg, group in zip(batch, groups):
            item = {**item_fields(msg), "version": self.version, "samples": group}
            await self.ctx.outputs["samples"].send(item, **{**msg.meta, "version": self.version})
