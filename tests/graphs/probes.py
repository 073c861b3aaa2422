"""Node kinds that probe engine behaviour (tests/integration/test_runtime.py): event loops, setup errors,
large items, versioned edges. Importable by the actors (the project root is on their path)."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dataflow import Node, UserError


# ---- event loop ---------------------------------------------------------------------------------
class LoopProbe(Node):
    """Consumes and produces nothing; logs the class of the event loop its actor runs on."""

    async def run(self):
        loop = type(asyncio.get_running_loop())
        self.ctx.log(f"loop={loop.__module__}.{loop.__qualname__} pid={os.getpid()}")


# ---- set-up errors ------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ReaderConfig:
    path: str = "data.jsonl"
    """JSONL file to read at setup."""
    crash: bool = False
    """Raise a plain RuntimeError at setup (an engine-level failure, not a user mistake)."""
    setup_wait_s: float = 0.0
    """Setup first writes <run_dir>/setup-started, then waits this long (a start-up to interrupt)."""


class JsonlReader(Node):
    """Reads a JSONL file in setup (a missing file is the user's mistake: UserError); logs the count."""

    Config = ReaderConfig

    async def setup(self):
        if self.config.setup_wait_s:
            Path(self.ctx.run_dir, "setup-started").write_text(str(os.getpid()))
            await asyncio.sleep(self.config.setup_wait_s)
        if self.config.crash:
            raise RuntimeError("setup crashed on purpose")
        if not os.path.isfile(self.config.path):
            raise UserError(f"{self.config.path}: no such file; pass the path of a .jsonl dataset "
                            "with --set reader.path=FILE")
        with open(self.config.path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]

    async def run(self):
        self.ctx.log(f"read {len(self.rows)} rows")


# ---- large items --------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TensorSourceConfig:
    count: int = 8
    """How many tensors to send."""
    megabytes: int = 16
    """Size of each float32 tensor."""


class TensorSource(Node):
    """Produces `count` tensors of `megabytes` MB on `tensors`, tensor i filled with i."""

    Config = TensorSourceConfig
    outputs = ("tensors",)

    async def run(self):
        numel = self.config.megabytes * (1 << 20) // 4
        for i in range(self.config.count):
            await self.ctx.outputs["tensors"].send({"index": i, "tensor": torch.full((numel,), float(i))})


class Relay(Node):
    """Consumes `tensors`; produces them unchanged on `tensors_out` (one more actor hop)."""

    inputs = ("tensors",)
    outputs = ("tensors_out",)

    async def run(self):
        async for msg in self.ctx.inputs["tensors"]:
            await self.ctx.outputs["tensors_out"].send(msg.data, **msg.meta)


class TensorSink(Node):
    """Consumes `tensors`; checks each one and reports a step per tensor; ends the run."""

    inputs = ("tensors",)

    async def run(self):
        async for msg in self.ctx.inputs["tensors"]:
            i, t = msg.data["index"], msg.data["tensor"]
            ok = bool((t == float(i)).all())
            if not await self.ctx.step_done({"index": i, "megabytes": t.numel() * 4 / 2**20, "ok": ok}):
                return


# ---- versioned edges ----------------------------------------------------------------------------
@dataclass(kw_only=True)
class PublisherConfig:
    last_version: int = 30
    """Publish versions 0..last_version."""
    interval_s: float = 0.01
    """Pause between publishes."""


class Publisher(Node):
    """Publishes {"version": v, "tensor": full(v)} on `weights` for v = 0..last_version."""

    Config = PublisherConfig
    publishes = ("weights",)

    async def run(self):
        for v in range(self.config.last_version + 1):
            await self.ctx.publish("weights", {"version": v, "tensor": torch.full((256,), float(v))}, v)
            await asyncio.sleep(self.config.interval_s)


@dataclass(kw_only=True)
class SubscriberConfig:
    last_version: int = 30
    """Stop once this version was seen."""
    work_s: float = 0.0
    """Time spent per version seen (a slow subscriber skips versions: latest wins)."""


class Subscriber(Node):
    """Waits for each newer version of `weights`, fetches it with ctx.latest, records
    (version, value's version, value's fill) to <run_dir>/seen-<name>.json."""

    Config = SubscriberConfig
    subscribes = ("weights",)

    async def run(self):
        seen = []
        try:
            while not seen or seen[-1][0] < self.config.last_version:
                await self.ctx.wait_version("weights", seen[-1][0] + 1 if seen else 0)
                version, value = await self.ctx.latest("weights")
                seen.append((version, value["version"], float(value["tensor"][0])))
                await asyncio.sleep(self.config.work_s)
        finally:
            Path(self.ctx.run_dir, f"seen-{self.ctx.full_name}.json").write_text(json.dumps(seen))
