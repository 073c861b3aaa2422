"""Toy node kinds for engine tests: a counting source, a transform, a collecting sink."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

from dataflow import Node


@dataclass(kw_only=True)
class CounterConfig:
    count: int = 20
    """How many integers to emit (0..count-1)."""
    delay_s: float = 0.0
    """Pause between items (to keep a run alive for kill tests)."""


class Counter(Node):
    """Consumes nothing; produces integers on `numbers`; ends when `count` are sent."""

    Config = CounterConfig
    outputs = ("numbers",)

    async def run(self):
        out = self.ctx.outputs["numbers"]
        for i in range(self.config.count):
            if self.config.delay_s:
                await asyncio.sleep(self.config.delay_s)
            await out.send({"value": i, "source": self.ctx.full_name}, origin=self.ctx.full_name)


@dataclass(kw_only=True)
class SquareConfig:
    fail_on: int = -1
    """Raise ValueError when this value arrives (-1: never)."""
    report_pid: bool = False
    """Log this process's pid first (for kill tests)."""


class Square(Node):
    """Consumes `numbers`; produces their squares on `squares`."""

    Config = SquareConfig
    inputs = ("numbers",)
    outputs = ("squares",)

    async def run(self):
        if self.config.report_pid:
            self.ctx.log(f"pid={os.getpid()}")
        out = self.ctx.outputs["squares"]
        async for msg in self.ctx.inputs["numbers"]:
            value = msg.data["value"]
            if value == self.config.fail_on:
                raise ValueError(f"refusing to square {value}")
            with self.ctx.span("square"):
                result = value * value
            await out.send({"value": value, "square": result, "by": self.ctx.full_name}, **msg.meta)


@dataclass(kw_only=True)
class CollectConfig:
    steps_every: int = 5
    """Report a step every this many items."""
    step_delay_s: float = 0.0
    """Pause before reporting each step (lets the upstream nodes finish first)."""


class Collect(Node):
    """Consumes `squares`; writes what it saw to <run_dir>/collected.json; ends the run."""

    Config = CollectConfig
    inputs = ("squares",)

    async def run(self):
        seen = []
        try:
            async for msg in self.ctx.inputs["squares"]:
                seen.append({"value": msg.data["value"], "square": msg.data["square"],
                             "by": msg.data["by"], "origin": msg.meta.get("origin")})
                if len(seen) % self.config.steps_every == 0:
                    await asyncio.sleep(self.config.step_delay_s)
                    if not await self.ctx.step_done({"items": len(seen)}):
                        return
        finally:
            Path(self.ctx.run_dir, "collected.json").write_text(json.dumps(seen))
