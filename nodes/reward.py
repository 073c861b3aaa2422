"""Reward: scores each response with a program (the built-in task's checker or a user function).

Consumes: `samples` from the generator.  Produces: `scored`, the same item with, per response,
"score" (float), "token_rewards" (per response token; the score sits on the last token unless the
task gives per-position credit) and "failed" (bool).
Waits for: generated samples.  Unblocked by: the generator.

A user reward file defines `reward(prompt, response, **fields)` returning a float or a dict of
named floats (combined with `weights`). Each call has a timeout; an exception, a timeout, or a
non-finite / non-number result marks that response failed (score 0, excluded from the loss by the
learner), is counted in metrics and logged once with its reason, and the run goes on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dataflow import Node
from rl import tasks
from rl.rewards import load_reward_fn, score_safely


@dataclass(kw_only=True)
class RewardConfig:
    path: str = ""
    """Python file with the reward function; empty = the built-in task's scorer."""
    function: str = "reward"
    """Name of the function (or class) in `path`."""
    weights: dict = field(default_factory=dict)
    """Weights of a dict-valued reward's named scores ({} = equal weights of 1)."""
    timeout_s: float = 5.0
    """Longest one reward call may take before the response is marked failed."""
    per_token: bool = True
    """Built-in tasks: put per-position credit on each token (else the whole score on the last)."""
    tokenizer_path: str = ""
    """Where to load the tokenizer from (the policy's model dir); empty = built-in tokenizer."""
    items_per_call: int = 16


class Reward(Node):
    Config = RewardConfig
    inputs = ("samples",)
    outputs = ("scored",)

    async def setup(self):
        c = self.config
        self.tokenizer = tasks.load_tokenizer(c.tokenizer_path) if c.tokenizer_path else tasks.build_tokenizer()
        self.fn = load_reward_fn(c.path, c.function, c.weights) if c.path else None
        self.failed_total = 0
        self.scored_total = 0
        self.reported_reasons: set[str] = set()

    def state_dict(self) -> dict:
        return {"failed_total": self.failed_total, "scored_total": self.scored_total}

    def load_state_dict(self, state: dict) -> None:
        self.failed_total, self.scored_total = state["failed_total"], state["scored_total"]

    def _score_group(self, item: dict) -> dict:
        for s in item["samples"]:
            text = self.tokenizer.decode(s["response_ids"], skip_special_tokens=True)
            if self.fn is None:
                score, error = tasks.score(item["fields"], text), None
            else:
                score, error = score_safely(self.fn, item["prompt"], text, item["fields"], self.config.timeout_s)
            s["failed"] = score is None
            s["score"] = 0.0 if score is None else float(score)
            s["error"] = error or ""
            n = len(s["response_ids"])
            if self.fn is None and self.config.per_token:
                tokens = self.tokenizer.convert_ids_to_tokens(s["response_ids"])
                s["token_rewards"] = tasks.token_rewards(item["fields"], tokens)
            else:
                s["token_rewards"] = [0.0] * (n - 1) + [s["score"]] if n else []
        return item

    async def run(self):
        inp, out = self.ctx.inputs["samples"], self.ctx.outputs["scored"]
        async for batch in inp.batches(self.config.items_per_call, 0.01):
            with self.ctx.span("score", items=len(batch)):
                items = await asyncio.to_thread(lambda: [self._score_group(m.data) for m in batch])
            for msg, item in zip(batch, items):
                for s in item["samples"]:
                    self.scored_total += 1
                    if s["failed"]:
                        self.failed_total += 1
                        if s["error"] not in self.reported_reasons:
                            self.reported_reasons.add(s["error"])
                            self.ctx.log(f"reward failed for prompt {item['id']}: {s['error']} "
                                         "(marked failed; later failures of this kind are only counted)")
                await out.send(item, **msg.meta)
            if any(s["failed"] for item in items for s in item["samples"]):
                self.ctx.metrics({"reward/failed_total": self.failed_total, "reward/scored_total": self.scored_total})
