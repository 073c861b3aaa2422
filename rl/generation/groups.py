"""The generator's prompt groups (nodes/generator.py): what each prompt's group samples (a noise key
and a temperature per sample; a validation prompt's greedy first response), the continuous loop's
groups from the `prompts` channel to the `samples` one (PromptGroups), and the item a finished
group sends downstream.
"""

from __future__ import annotations

from collections import deque

from dataflow.channel import EndOfChannel, WouldBlock
from dataflow.errors import UserError
from rl.generation.sampling import sample_key

VAL_NOISE = 1 << 31
"""Sample-index offset of validation responses' noise keys (apart from any training group's)."""


def sample_plan(msg, seed: int, group_size: int, num_slots: int | None = None) -> list[tuple[int, float | None]]:
    """(noise key, temperature or None = the configured one) per sample of a prompt's group.
    A validation prompt (nodes/evaluator.py) gets one greedy response, then val.n at the
    training temperature; its noise depends on its row, not the round, so every round draws
    the same noise and rounds differ only by the weights. num_slots: the decoder's (None: no decoder)."""
    val = msg.data.get("val")
    if val is None:
        return [(sample_key(seed, msg.data["id"], j), None) for j in range(group_size)]
    plan = [(sample_key(seed, val["row"], VAL_NOISE + j), 0.0 if j == 0 else None) for j in range(1 + val["n"])]
    if num_slots is not None and len(plan) > num_slots:
        raise UserError(f"generator: a validation prompt needs 1 + val.n = {len(plan)} decoder slots, the "
                        f"decoder has {num_slots} (generator.prompts_per_call x group_size); "
                        "lower val.n or raise generator.prompts_per_call")
    return plan


def response_cap(msg, key: str) -> int | None:
    """This prompt's response cap (generator.max_new_tokens_key `key`; None = max_new_tokens)."""
    value = msg.data.get("fields", {}).get(key or None)
    return None if value is None else int(value)


def item_fields(msg) -> dict:
    """A prompt's fields for its item: every sample carries its prompt_ids, the item need not."""
    return {k: v for k, v in msg.data.items() if k != "prompt_ids"}


class PromptGroups:
    """The continuous loop's groups: prompts taken from `prompts` but not admitted yet (`waiting`,
    each as take(msg) = (msg, its prompt ids or its episodes' start)), admitted groups collecting
    their samples (`open`, by group number), and finished items the outbox had no room for
    (`ready`, in the order of completion: the loop never waits for room while holding the weights)."""

    def __init__(self, prompts, out, take, val_span):
        self.prompts, self.out, self.take, self.val_span = prompts, out, take, val_span
        self.waiting: deque = deque()      # take(msg) of each prompt taken but not admitted
        self.open: dict[int, list] = {}    # group number -> [msg, samples, still running, version admitted under]
        self.ready: deque = deque()        # finished items the outbox had no room for, in order
        self.ended, self.number = False, 0

    async def take_batch(self, n: int) -> None:
        """Up to n prompts, waiting briefly for the first."""
        try:
            for msg in await self.prompts.recv_batch(n, 0.02):
                self.waiting.append(self.take(msg))
        except EndOfChannel:
            self.ended = True

    def take_one(self) -> bool:
        """One prompt if one is there now (False: none is, or the channel ended)."""
        try:
            self.waiting.append(self.take(self.prompts.recv_nowait()))
            return True
        except WouldBlock:
            return False
        except EndOfChannel:
            self.ended = True
            return False

    def admit(self, msg, size: int, version: int) -> int:
        """Open msg's group of `size` samples under `version`; returns its number (its samples' tags)."""
        number, self.number = self.number, self.number + 1
        self.open[number] = [msg, [None] * size, size, version]
        self.val_span.admitted(msg)
        return number

    def finish(self, n: int, j: int, sample: dict) -> None:
        """Sample j of group n is done; once the whole group is, its item goes out (or waits in `ready`)."""
        group = self.open[n]
        group[1][j] = sample
        group[2] -= 1
        if group[2] == 0:
            del self.open[n]
            msg = group[0]
            self.val_span.finished(msg)
            # the version admitted under: its oldest token's (partial rollout, episodes)
            item = ({**item_fields(msg), "version": group[3], "samples": group[1]},
                    {**msg.meta, "version": group[3]})
            if self.ready or not self.emit(item):   # keep the order of completion
                self.ready.append(item)

    def emit(self, item) -> bool:     # never wait for room while holding the weights
        try:
            self.out.send_nowait(item[0], **item[1])
            return True
        except WouldBlock:
            return False

    def send_ready_now(self) -> None:
        """The ready items the outbox has room for now, in order."""
        while self.ready and self.emit(self.ready[0]):
            self.ready.popleft()

    async def send_ready(self) -> None:
        """Every ready item, waiting for room (outside serving(): the weights are not held)."""
        for item, meta in self.ready:
            await self.out.send(item, **meta)
        self.ready.clear()
