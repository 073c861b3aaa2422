"""Group filter: DAPO's dynamic sampling. Drops the prompt groups whose rewards are all equal.

Consumes: `scored` items, one per prompt: its group of scored responses (meta: index, batch).
Produces: `kept`, the items with a learning signal, unchanged, at most prompts_per_step per batch;
          on the versioned edge `dropped` (nodes/prompts.py DROPPED_EDGE), {batch: [prompt ids]}
          of the groups it dropped in every batch not yet trained, for the prompt source to refill.
Waits for: scored items.  Unblocked by: the reward node; the learner's `policy` versions tell it
which batches are trained (it forgets those).

A group whose responses all got the same score (all right, all wrong) has GRPO advantages of zero:
it costs reference and learner time and teaches nothing. DAPO (Yu et al. 2025, arXiv 2503.14476)
drops such groups and samples more prompts until the batch is full; verl calls it
`algorithm.filter_groups` (metric `acc` / `score`; this filter uses `score`, the reward the learner
normalises), with `max_num_gen_batches`. Here the batch fills by refills, not by whole extra
generation batches: each dropped prompt is replaced by the prompt source with one more prompt of
the same batch, so the learner's step k still collects batch k (meta "batch") and trains on
exactly prompts_per_step groups with a signal, and the staleness bound still holds (batch k was
admitted when its first prompts were). Only responses whose reward did not fail count: a group
with fewer than two of them, or whose non-failed scores are equal, is dropped (the learner masks
failed responses out of the loss and out of the group's baseline).

Exactly once: each prompt id's decision is kept until its batch is trained, so a copy re-issued
after a node restart is forwarded again if it was kept (the learner keeps one copy), and skipped
if it was dropped (it was refilled already). A group decided after its batch filled (possible only
with re-issued copies) is counted in filter/surplus_groups, not forwarded. The decisions are
written to a snapshot (<run>/snapshots/) before anything leaves the filter, so a restarted filter
decides alike. After --resume the batches not yet trained start afresh (the source sends them
again), so a checkpoint keeps no decisions.

Metrics, one record per batch once it is full: filter/batch, filter/kept_groups,
filter/dropped_groups, filter/prompts_per_step (prompts it took: kept + dropped),
filter/surplus_groups (so far); with record_prompt_ids the ids kept and dropped.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated

from dataflow import Node, UserError
from dataflow.actor import snapshots
from dataflow.checks import AtLeast, NonNegative
from nodes.prompts import DROPPED_EDGE


@dataclass(kw_only=True)
class GroupFilterConfig:
    prompts_per_step: Annotated[int, AtLeast(1)] = 16
    """Groups with a learning signal per learner step (the graph shares its prompts_per_step)."""
    max_num_gen_batches: Annotated[int, NonNegative] = 10
    """verl's filter_groups.max_num_gen_batches: stop the run once a batch has taken this many
    batches' worth of prompts (x prompts_per_step) and is still not full; 0 = no limit (verl's
    default; its DAPO recipes use 10)."""
    items_per_call: Annotated[int, AtLeast(1)] = 32
    """Items taken from the input at once, as they are available."""
    record_prompt_ids: bool = False
    """Put the ids kept and dropped in each batch's metrics record."""


class TooFewSignalGroups(UserError):
    """max_num_gen_batches batches' worth of prompts did not fill a batch with groups whose rewards
    differ: a verdict about the data and the reward, printed as one line (exit 2)."""


def has_signal(samples: list[dict]) -> bool:
    """Whether a group teaches anything: at least two responses did not fail and their scores
    differ. The learner leaves failed responses out of the group's baseline and gives them
    advantage 0 (rl/algorithm/advantages.py `valid`), so a failed response's 0 is no signal: scores
    [1, 1, failed, 1] give every response advantage 0."""
    scores = [s["score"] for s in samples if not s["failed"]]
    return len(scores) >= 2 and max(scores) > min(scores)


class GroupFilter(Node):
    Config = GroupFilterConfig
    inputs = ("scored",)
    outputs = ("kept",)
    publishes = (DROPPED_EDGE,)
    subscribes = ("policy",)

    async def setup(self):
        self.kept: dict[int, list[int]] = {}     # batch not yet trained -> prompt ids kept, in order
        self.dropped: dict[int, list[int]] = {}  # batch not yet trained -> prompt ids dropped
        self.surplus = 0
        self.progress = 0  # decisions made: a snapshot's "progress", and the version published
        self.full: list[int] = []  # batches filled since the last report

    def state_dict(self) -> dict:
        # A checkpoint: nothing (after --resume the source sends the untrained batches afresh);
        # progress -1 so that a restarted filter loads its snapshot instead (dataflow/actor/snapshots.py).
        return {"progress": -1, "surplus": self.surplus}

    def load_state_dict(self, state: dict) -> None:
        self.surplus = state["surplus"]
        if state["progress"] >= 0:  # a snapshot (a restart): the decisions of the untrained batches
            self.progress = state["progress"]
            self.kept = {int(b): list(ids) for b, ids in state["kept"].items()}
            self.dropped = {int(b): list(ids) for b, ids in state["dropped"].items()}

    def _decide(self, batch: int, pid: int, samples: list[dict]) -> bool | None:
        """True: forward it. False: do not. None: dropped now (refill it)."""
        c = self.config
        kept, dropped = self.kept.setdefault(batch, []), self.dropped.setdefault(batch, [])
        if pid in kept:
            return True   # a copy re-issued after a restart: the learner keeps one
        if pid in dropped:
            return False  # a copy of a dropped group: refilled already
        self.progress += 1
        if len(kept) >= c.prompts_per_step:
            self.surplus += 1
            return False
        if not has_signal(samples):
            dropped.append(pid)
            taken = len(kept) + len(dropped)
            if c.max_num_gen_batches and taken >= c.max_num_gen_batches * c.prompts_per_step:
                raise TooFewSignalGroups(
                    f"batch {batch}: {taken} prompts gave {len(kept)} groups whose rewards differ, of the "
                    f"{c.prompts_per_step} a step needs (filter.max_num_gen_batches={c.max_num_gen_batches} batches' "
                    "worth): nearly every group's responses score alike; check the data and the reward, or "
                    "raise filter.max_num_gen_batches (0 = no limit)")
            return None
        kept.append(pid)
        if len(kept) == c.prompts_per_step:
            self.full.append(batch)
        return True

    def _report(self) -> None:
        for batch in self.full:
            self.ctx.metrics(self._record(batch))
        self.full.clear()

    def _record(self, batch: int) -> dict:
        kept, dropped = self.kept[batch], self.dropped[batch]
        record = {"filter/batch": batch, "filter/kept_groups": len(kept), "filter/dropped_groups": len(dropped),
                  "filter/prompts_per_step": len(kept) + len(dropped), "filter/surplus_groups": self.surplus}
        if self.config.record_prompt_ids:
            record.update({"filter/kept_ids": list(kept), "filter/dropped_ids": list(dropped)})
        return record

    def _snapshot_state(self) -> dict:
        return {"progress": self.progress, "surplus": self.surplus,
                "kept": {str(b): ids for b, ids in self.kept.items()},
                "dropped": {str(b): ids for b, ids in self.dropped.items()}}

    async def _publish_dropped(self) -> None:
        # Versioned by the decisions made, which a restarted filter continues from its snapshot
        # (a subscriber ignores versions older than the newest it holds).
        record = {b: list(ids) for b, ids in self.dropped.items() if ids}
        await self.ctx.publish(DROPPED_EDGE, record, self.progress)

    async def run(self):
        inp, out = self.ctx.inputs["scored"], self.ctx.outputs["kept"]
        if any(self.dropped.values()):  # restarted: the source refills whatever it has not yet
            await self._publish_dropped()
        async for batch in inp.batches(self.config.items_per_call, 0.01):
            forward, refill, before = [], False, self.progress
            async with self.ctx.state_lock:
                trained = self.ctx.latest_version("policy")
                for b in [b for b in self.kept if b < trained]:  # trained: forget it
                    del self.kept[b], self.dropped[b]
                for msg in batch:
                    if msg.meta["batch"] < trained:  # a copy of a trained batch's prompt: the learner drops it
                        forward.append(msg)
                        continue
                    verdict = self._decide(msg.meta["batch"], msg.data["id"], msg.data["samples"])
                    if verdict:
                        forward.append(msg)
                    refill = refill or verdict is None
                state = self._snapshot_state() if self.progress != before else None
            if state is not None:  # before anything leaves: a restarted filter decides alike
                await asyncio.to_thread(snapshots.write_snapshot, self.ctx.run_dir, self.ctx.full_name, state)
            self._report()
            if refill:
                await self._publish_dropped()
            for msg in forward:
                await out.send(msg.data, **msg.meta)
