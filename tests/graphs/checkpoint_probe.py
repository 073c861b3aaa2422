"""counter -> probe, checkpointing every step: what an async_checkpoint write must not see is the
training that goes on while it writes (tests/integration/test_checkpoint.py); and a save that takes long
(counter.slow_save_at), for a node to die during.

The probe keeps a 16 MB tensor `w` that it updates in place every step, as an optimizer does, so
a background write that read the live tensor instead of its captured copy would write a later
step's values; its writes take milliseconds, the next update microseconds."""

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dataflow import Graph, Node
from tests.graphs.toy import Counter, CounterConfig


@dataclass(kw_only=True)
class ProbeConfig:
    size: int = 1 << 22
    """Elements of `w` (float32)."""
    unsaveable_at: int = 0
    """At the checkpoint of this step, state_dict() holds a complex128 tensor, which safetensors
    cannot write: the write fails (0 = never)."""


class Probe(Node):
    """Consumes `numbers`; one step per item: w += value in place (under the state lock); a
    checkpoint every save_interval steps; ends the run at max_steps. After step k, w holds the
    sum of the first k values everywhere."""

    Config = ProbeConfig
    inputs = ("numbers",)

    async def setup(self):
        self.step, self.w = 0, torch.zeros(self.config.size)

    def state_dict(self) -> dict:
        state = {"step": self.step, "w": self.w}
        if self.ctx.checkpoint_step == self.config.unsaveable_at:
            state["unsaveable"] = torch.zeros(1, dtype=torch.complex128)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step, self.w = state["step"], state["w"]

    async def run(self):
        async for msg in self.ctx.inputs["numbers"]:
            async with self.ctx.state_lock:
                self.step += 1
                self.w += msg.data["value"]
                go_on = await self.ctx.step_done({"w": self.w[0].item()})
            if self.ctx.checkpoint_due(self.step):
                await self.ctx.checkpoint(self.step)
            if not go_on:
                return


@dataclass(kw_only=True)
class SourceConfig(CounterConfig):
    slow_save_at: int = 0
    """The checkpoint of this step waits 30 s in the counter's capture (prepare_checkpoint, under
    its state lock), once it has touched <run_dir>/counter_saving (0 = never)."""


class Source(Counter):
    """Counter whose capture can be made slow: the probe (saved first) has its state taken, the
    checkpoint is not committed yet."""

    Config = SourceConfig

    async def prepare_checkpoint(self):
        if self.ctx.checkpoint_step == self.config.slow_save_at:
            (Path(self.ctx.run_dir) / "counter_saving").touch()
            await asyncio.sleep(30)


@dataclass(kw_only=True)
class Config:
    counter: SourceConfig = field(default_factory=lambda: SourceConfig(count=1000))
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    max_steps: int = 6
    save_interval: int = 1
    keep_checkpoints: int = 2
    async_checkpoint: bool = True


config = Config()


def build(config: Config) -> Graph:
    g = Graph("checkpoint_probe", config=config)
    g.node("counter", Source, config.counter, cpus=0.5)
    g.node("probe", Probe, config.probe, cpus=0.5, ends_run=True)
    g.channel("counter.numbers", "probe.numbers", capacity=4, name="numbers")
    return g
