"""prompts -> generator (episodes of env.path) -> recorder: the generator's multi-turn samples as
they leave it, on a real Ray (tests/integration/test_agent_graph.py).

The recorder stands in for the learner: it publishes the policy's weights once (version 0, as the
learner does at start, so the generator and the prompt source start), then writes every item it
receives to <run>/samples.jsonl and reports one step per item.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dataflow import Graph, Node, policy_edge
from dataflow.weights.sync import LearnerWeightSync, WeightSyncConfig
from nodes import Generator, PromptSource
from nodes.generator import GeneratorConfig
from nodes.prompts import PromptConfig
from rl.data import policy
from rl.agent import EnvConfig


@dataclass(kw_only=True)
class RecorderConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)


class Recorder(Node):
    Config = RecorderConfig
    inputs = ("samples",)
    publishes = ("policy",)

    async def setup(self):
        self.model, _ = policy.load(self.config.policy)
        self.sync = LearnerWeightSync(self.ctx, WeightSyncConfig())
        await self.sync.setup(self.model)

    async def run(self):
        await self.sync.publish(self.model, 0)
        path = Path(self.ctx.run_dir, "samples.jsonl")
        n = 0
        async for msg in self.ctx.inputs["samples"]:
            with path.open("a") as f:
                f.write(json.dumps(msg.data) + "\n")
            n += 1
            if not await self.ctx.step_done({"items": n}):
                return


@dataclass(kw_only=True)
class Config:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    prompts: PromptConfig = field(default_factory=lambda: PromptConfig(prompts_per_step=4, max_staleness=1000))
    generator: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(group_size=2, max_new_tokens=4))
    env: EnvConfig = field(default_factory=EnvConfig)


config = Config()


def build(c: Config) -> Graph:
    for spec in (c.prompts.policy, c.generator.policy):
        spec.path = spec.path or c.policy.path
    c.generator.env = c.env
    g = Graph("agent_probe")
    g.node("prompts", PromptSource, c.prompts, cpus=0.1)
    g.node("generator", Generator, c.generator, cpus=0.5)
    g.node("recorder", Recorder, RecorderConfig(policy=c.policy), cpus=0.5, ends_run=True)
    g.channel("prompts.prompts", "generator.prompts", capacity=16, name="prompts")
    g.channel("generator.samples", "recorder.samples", capacity=16, name="samples")
    policy_edge(g, src="recorder", dst=["generator", "prompts"], transport="object_store")
    return g
