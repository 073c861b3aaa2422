"""Graphs made to stall on purpose (tests/integration/test_stall.py), and the real prompt source running out.

    never_sends:  silent (never sends) -> sink            root: silent, running its own code
    blocks_loop:  blocking (time.sleep in run()) -> sink  root: blocking, not answering
    admission:    prompts (PromptSource) -> trainer, trainer publishes `policy` after each batch;
                  with trainer_prompts_per_step=8 (twice the source's batch) and
                  prompts.max_staleness=0 the source waits for a version the trainer can publish only
                  after the batch the source holds back: a deadlock, root prompts;
                  with prompts.path + prompts.epochs=1 the data runs out before max_steps.

Run: python -m dataflow.run tests/graphs/stalls.py --set case=never_sends
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal

from dataflow import Graph, Node
from nodes.prompts import PromptConfig, PromptSource


class Silent(Node):
    """Produces `numbers`, but never sends anything: it waits on an event no one sets."""

    outputs = ("numbers",)

    async def run(self):
        await asyncio.Event().wait()


class Blocking(Node):
    """Produces `numbers`, but first blocks its actor's event loop (synchronous sleep)."""

    outputs = ("numbers",)

    async def run(self):
        time.sleep(3600)


class Sink(Node):
    """Consumes `numbers`; one step per item; ends the run."""

    inputs = ("numbers",)

    async def run(self):
        async for msg in self.ctx.inputs["numbers"]:
            if not await self.ctx.step_done({"value": msg.data}):
                return


@dataclass(kw_only=True)
class TrainerConfig:
    prompts_per_step: int = 4
    """Prompts per step (as the prompt source's)."""


class BatchTrainer(Node):
    """Consumes `prompts` in batches of prompts_per_step; after each, a step and a new `policy`
    version (as the learner does: version k+1 once batch k is trained). Ends the run."""

    Config = TrainerConfig
    inputs = ("prompts",)
    publishes = ("policy",)

    async def run(self):
        version = 0
        await self.ctx.publish("policy", version, version)
        batch = []
        async for msg in self.ctx.inputs["prompts"]:
            batch.append(msg.data["id"])
            if len(batch) == self.config.prompts_per_step:
                version += 1
                if not await self.ctx.step_done({"prompts": len(batch)}):
                    return
                batch = []
                await self.ctx.publish("policy", version, version)


@dataclass(kw_only=True)
class StallsConfig:
    case: Literal["never_sends", "blocks_loop", "admission"] = "never_sends"
    stall_timeout_s: float = 3.0
    stall_action: str = "stop"
    max_steps: int = 5
    prompts: PromptConfig = field(default_factory=lambda: PromptConfig(prompts_per_step=4))
    trainer_prompts_per_step: int = 0
    """admission: prompts per trainer step (0 = the source's prompts_per_step)."""


config = StallsConfig()


def build(cfg: StallsConfig) -> Graph:
    g = Graph(f"stall_{cfg.case}", max_steps=cfg.max_steps, stall_timeout_s=cfg.stall_timeout_s,
              stall_action=cfg.stall_action)
    if cfg.case == "admission":
        g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
        g.node("trainer", BatchTrainer, TrainerConfig(prompts_per_step=cfg.trainer_prompts_per_step or cfg.prompts.prompts_per_step),
               cpus=0.1, ends_run=True)
        g.channel("prompts.prompts", "trainer.prompts", capacity=8, name="prompts")
        g.versioned("policy", src="trainer", dst=["prompts"])
        return g
    g.node("source", Silent if cfg.case == "never_sends" else Blocking, cpus=0.1)
    g.node("sink", Sink, cpus=0.1, ends_run=True)
    g.channel("source.numbers", "sink.numbers", capacity=4, name="numbers")
    return g
