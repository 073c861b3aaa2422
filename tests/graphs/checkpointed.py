"""counter (slow) -> tally, with checkpoints: the smallest graph whose interrupt checkpoint can be
taken (tests/integration/test_signals.py: SIGTERM to the CLI's whole process group)."""

from dataclasses import dataclass, field

from dataflow import Graph, Node
from tests.graphs.toy import Counter, CounterConfig


class Tally(Node):
    """Consumes `numbers`; one step per item, keeping their sum; ends the run. Its state (the
    step and the sum) is what a checkpoint saves."""

    inputs = ("numbers",)

    async def setup(self):
        self.step, self.total = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.total = state["step"], state["total"]

    async def run(self):
        async for msg in self.ctx.inputs["numbers"]:
            async with self.ctx.state_lock:
                self.step += 1
                self.total += msg.data["value"]
                go_on = await self.ctx.step_done({"total": self.total})
            if self.ctx.checkpoint_due(self.step):
                await self.ctx.checkpoint(self.step)
            if not go_on:
                return


@dataclass(kw_only=True)
class Config:
    counter: CounterConfig = field(default_factory=lambda: CounterConfig(count=1000, delay_s=0.2))
    save_interval: int = 1000
    """Checkpoint every this many steps (and on Ctrl-C / SIGTERM)."""


config = Config()
# What a resumed run may not change without --allow-changed-settings (dataflow/driver/resume.py).
defines_the_run = ("counter.count",)


def build(config: Config) -> Graph:
    g = Graph("checkpointed", save_interval=config.save_interval)
    g.node("counter", Counter, config.counter, cpus=0.5)
    g.node("tally", Tally, cpus=0.5, ends_run=True)
    g.channel("counter.numbers", "tally.numbers", capacity=4, name="numbers")
    return g
