"""A sink that reports trouble counters as the real nodes do (tests/integration/test_stall.py): a running total
in a metrics record (like the reward node's reward/failed_total) and one in each step's record
(like the learner's prompts/duplicates_dropped)."""

from __future__ import annotations

from dataflow import Node


class TroubledSink(Node):
    """Consumes `numbers`; per item: reward/failed_total grows by 2 (metrics), then a step."""

    inputs = ("numbers",)

    async def run(self):
        failed = 0
        async for msg in self.ctx.inputs["numbers"]:
            failed += 2
            self.ctx.metrics({"reward/failed_total": failed})
            if not await self.ctx.step_done({"value": msg.data["value"], "prompts/duplicates_dropped": 0}):
                return
