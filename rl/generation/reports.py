"""What the generator's continuous loop (nodes/impl/generator.py) reports besides its samples: the trace
span of the validation prompts it decodes beside training ones, and each weight switch's drain
(generator/drain_s, drain_free_slots in metrics.jsonl: the time the old weights kept serving with
admission stopped, and the fraction of slots idle meanwhile; about 0 with partial rollouts)."""

from __future__ import annotations

import time


class Drain:
    """generator/drain_s, drain_free_slots (module docstring): the first decode round that saw a
    newer version announced, to the end of its serving() block."""

    def __init__(self, ctx, num_slots: int):
        self.ctx, self.num_slots, self.since, self.free = ctx, num_slots, None, []

    def newer(self, seen: bool) -> None:
        self.since = self.since or (time.perf_counter() if seen else None)

    def stepping(self, free_slots: int) -> None:
        if self.since is not None:
            self.free.append(free_slots / self.num_slots)

    def ended(self) -> None:
        if self.since is not None:
            self.ctx.metrics({"generator/drain_s": time.perf_counter() - self.since,
                              "generator/drain_free_slots": sum(self.free) / max(len(self.free), 1)})
            self.since, self.free = None, []


class ValidationSpan:
    """The trace span "generate val" (track "val") while this replica decodes validation prompts,
    beside the training ones in the same decode steps (a span of its own would have to stop them)."""

    def __init__(self, ctx):
        self.ctx, self.span, self.active = ctx, None, 0

    def admitted(self, msg) -> None:
        if "val" in msg.data:
            if self.span is None:
                self.span = self.ctx.span("generate val", track="val", round=msg.data["val"]["round"])
                self.span.__enter__()
            self.active += 1

    def finished(self, msg) -> None:
        if "val" in msg.data:
            self.active -= 1
            if self.active == 0:
                self.close()

    def close(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span, self.active = None, 0
