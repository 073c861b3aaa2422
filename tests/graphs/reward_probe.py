"""samples -> reward (the real nodes/reward.py) -> tally: the reward node alone, on a real Ray.

The source sends `num_items` prompts of the built-in tokenizer's words, each with `group_size`
responses "<digit> <digit> <eos>" (the <eos> is a special token the reward must not see), one
item at a time so the reward node scores them in batches of `reward.items_per_call`. The tally
reports one step per item it receives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dataflow import Graph, Node
from nodes.reward import Reward, RewardConfig


@dataclass(kw_only=True)
class SamplesConfig:
    num_items: int = 8
    group_size: int = 4


class Samples(Node):
    Config = SamplesConfig
    outputs = ("samples",)

    async def run(self):
        from rl.data.tasks import build_tokenizer

        tok = build_tokenizer()
        for i in range(self.config.num_items):
            samples = [{"response_ids": tok.convert_tokens_to_ids([str(i % 10), str(j % 10), "<eos>"])}
                       for j in range(self.config.group_size)]
            await self.ctx.outputs["samples"].send(
                {"id": i, "prompt": f"copy {i % 10} :", "fields": {"answer": f"{i % 10}"}, "samples": samples},
                index=i)


class Tally(Node):
    inputs = ("scored",)

    async def run(self):
        seen = []
        try:
            async for msg in self.ctx.inputs["scored"]:
                seen.append([{k: s[k] for k in ("score", "failed", "error")} for s in msg.data["samples"]])
                if not await self.ctx.step_done({"items": len(seen)}):
                    return
        finally:
            Path(self.ctx.run_dir, "scored.json").write_text(json.dumps(seen))


@dataclass(kw_only=True)
class Config:
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(items_per_call=2))


config = Config()


def build(config: Config) -> Graph:
    g = Graph("reward_probe")
    g.node("samples", Samples, config.samples, cpus=0.5)
    g.node("reward", Reward, config.reward, cpus=0.5)
    g.node("tally", Tally, None, cpus=0.5, ends_run=True)
    g.channel("samples.samples", "reward.samples", capacity=2, name="samples")
    g.channel("reward.scored", "tally.scored", capacity=2, name="scored")
    return g
