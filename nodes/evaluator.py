"""Evaluator: turns validation rounds into mean@1 / mean@n / pass@k, per data source and overall.

Consumes: `validation` items from the reward node, one per validation prompt: {"id", "prompt",
          "fields", "version", "val": {"round", "row", "size", "n"}, "samples": [the greedy
          response, then val.n sampled ones, each scored with its decoded "text"]}.
Produces: a metrics record per round (`val/step` = the learner step whose weights it validates,
          `val/mean@1`, `val/mean@<n>`, `val/pass@<k>`, the same under `val/<data_source>/`), a few
          of its rollouts (rollouts.jsonl, TensorBoard), and on the versioned edge `validated` the
          newest round reported, as round + 1 (0 = ready), which the prompt source waits for.
Waits for: validation items.  Unblocked by: the reward node.

How a round runs (docs/observability.md, "Validation"): when the learner publishes version v and v is due
(v = 0 with val.before_train, then every val.every steps), the prompt source sends each validation
prompt tagged with round v, before the next training batch; the generators answer it greedily and
val.n times at the training temperature, the reward node scores it with the training's reward and
routes it here (the reference, critic and learner never see it). A round is reported once every
one of its prompts has arrived (a prompt re-issued after a restart counts once). The prompt source
admits the batch that comes after round v (batch v + max_staleness) only once round v is reported:
validation never lets the generators run further ahead than training alone would, and with
max_staleness=0 it evaluates exactly version v. With max_staleness >= 1 the learner may publish
v+1 while the round is still generating; `val/version_min` / `val/version_max` say which weights
answered it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from dataflow import Node
from dataflow.checks import ExistingPath
from dataflow.channel import EndOfChannel
from dataflow.errors import UserError
from rl.agent.episode import rollout_fields
from rl.algorithm.metrics import PromptResult, validation_metrics

VALIDATED = "validated"
"""Versioned edge evaluator -> prompt source: version r + 1 once round r is reported (0 = ready)."""


@dataclass(kw_only=True)
class ValidationConfig:
    path: Annotated[str, ExistingPath()] = ""
    """Validation file (any format prompts.path takes, read with the same prompt settings: chat
    template, field names, max_prompt_tokens); empty = no validation."""
    every: int = 0
    """Validate after every this many learner steps (0 = only before training, with before_train)."""
    before_train: bool = True
    """Validate the starting weights before the first step (reported as val/step 0)."""
    n: int = 4
    """Sampled responses per prompt at the training temperature, besides the greedy one (0 = greedy only)."""
    k: list[int] = field(default_factory=list)
    """pass@k for each k (each <= n); empty = [n]."""
    max_prompts: int = 0
    """Use only the first this many rows of the file (0 = all)."""
    correct_above: float = 0.5
    """A response counts as correct for pass@k when its score is above this. mean@1 and mean@n are
    the mean scores (for a 0/1 reward: accuracies)."""
    data_source_key: str = "data_source"
    """Row field that names a prompt's data source (verl's layout); metrics per source under val/<source>/."""
    rollouts: int = 4
    """Prompts per round whose responses go to rollouts.jsonl / TensorBoard (0 = none)."""
    start_timeout_s: float = 120.0
    """How long the prompt source waits for the evaluator to be up before saying the graph lacks one."""

    def ks(self) -> list[int]:
        return list(self.k) if self.k else ([self.n] if self.n else [])

    def check(self) -> None:
        if self.every < 0 or self.n < 0 or self.max_prompts < 0:
            raise UserError(f"val.every={self.every}, val.n={self.n}, val.max_prompts={self.max_prompts}: "
                            "each must be >= 0")
        if self.path and not self.before_train and self.every == 0:
            raise UserError(f"val.path={self.path} is set, but val.every=0 and val.before_train=false: "
                            "no round would run; set val.every=N (steps)")
        bad = [k for k in self.ks() if not 1 <= k <= self.n]
        if bad:
            raise UserError(f"val.k={list(self.k)}: pass@k needs 1 <= k <= val.n={self.n} (k={bad[0]}); "
                            "raise val.n or drop that k")

    def due(self, version: int) -> bool:
        """Whether the policy of `version` (steps trained) gets a validation round."""
        if not self.path:
            return False
        if version == 0:
            return self.before_train
        return self.every > 0 and version % self.every == 0

    def next_round(self, version: int) -> int:
        """The first version >= `version` that is due (with every=0 and only round 0: a huge number)."""
        if self.due(version):
            return version
        if self.every == 0:
            return 1 << 62
        return (version // self.every + 1) * self.every


class Evaluator(Node):
    Config = ValidationConfig
    inputs = ("validation",)
    publishes = (VALIDATED,)

    async def setup(self):
        self.config.check()
        self.rounds: dict[int, dict] = {}   # round -> {prompt id: item}, until complete
        self.reported: set[int] = set()
        self.duplicates = 0

    async def run(self):
        await self.ctx.publish(VALIDATED, None, 0)   # up: the prompt source may start
        inp = self.ctx.inputs["validation"]
        try:
            while True:
                try:
                    batch = await inp.recv_batch(64, 0.05)
                except EndOfChannel:
                    return
                for msg in batch:
                    item = msg.data
                    r, size = item["val"]["round"], item["val"]["size"]
                    if r in self.reported or item["id"] in self.rounds.get(r, ()):   # re-issued
                        self.duplicates += 1
                        continue
                    got = self.rounds.setdefault(r, {})
                    got[item["id"]] = item
                    if len(got) == size:
                        await self._report(r, self.rounds.pop(r))
        finally:
            for r, got in sorted(self.rounds.items()):   # said, never silently dropped
                if got:
                    size = next(iter(got.values()))["val"]["size"]
                    self.ctx.log(f"validation round of step {r} not reported: the run ended with "
                                 f"{len(got)} of its {size} prompts answered")

    async def _report(self, r: int, items: dict) -> None:
        c = self.config
        rows = sorted(items.values(), key=lambda it: it["val"]["row"])
        results, failed = [], 0
        for item in rows:
            scores = [0.0 if s["failed"] else float(s["score"]) for s in item["samples"]]
            failed += sum(bool(s["failed"]) for s in item["samples"])
            source = item["fields"].get(c.data_source_key) if c.data_source_key else None
            results.append(PromptResult(scores[0], scores[1:], None if source is None else str(source)))
        with self.ctx.span("evaluate", round=r, prompts=len(rows)):
            metrics = validation_metrics(results, c.ks(), c.correct_above)
        versions = [item["version"] for item in rows]
        metrics.update({
            "val/step": r, "val/prompts": len(rows), "val/samples_failed": failed,
            "val/version_min": min(versions), "val/version_max": max(versions),
            "val/response_length/mean": sum(len(it["samples"][0]["response_ids"]) for it in rows) / len(rows),
            "val/duplicates_dropped": self.duplicates,
        })
        shown = [{"kind": "val", "step": r, "version": item["version"], "id": item["id"],
                  **rollout_fields(item["samples"][0], item["prompt"]), "reward": results[i].greedy,
                  "samples": [{"response": rollout_fields(s, None)["response"], "reward": score}
                              for s, score in zip(item["samples"][1:], results[i].samples)]}
                 for i, item in enumerate(rows[:c.rollouts])]
        self.ctx.metrics({**metrics, **({"rollouts": shown} if shown else {})})
        self.reported.add(r)
        if r + 1 > self.ctx.latest_version(VALIDATED):
            await self.ctx.publish(VALIDATED, None, r + 1)
