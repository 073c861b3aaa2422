"""Reward: scores each response with a program (the built-in task's checker or a user function).

Consumes: `samples` from the generator.  Produces: `scored`, the same item with, per response,
"score" (float), "token_rewards" (per response token; the score sits on the last token unless the
task gives per-position credit) and "failed" (bool).
Waits for: generated samples.  Unblocked by: the generator.

A user reward file defines `reward(prompt, response, **fields)`, verl's `compute_score(...)` (one
response, or its batched form) or TRL's `f(prompts, completions, **kwargs)`, plain or async, one
function or several with weights (rl/reward/reward_fn.py; docs/rewards.md). Each function's batch mean is
logged as reward/<name>, and so are the other numeric keys of verl's dict results. Responses are
decoded without special tokens. The calls of a batch run concurrently (`max_concurrency`), each
under `timeout_s` (rl/reward/runner.py: a timed-out thread is abandoned and counted). An exception,
a timeout, or a non-finite / non-number result marks that response failed (score 0, excluded from
the loss by the learner), is counted, and the run goes on; a line on screen reports failures and
timeouts (at most every `log_every_s`). A reward that fails for every response of
`max_failed_batches` consecutive batches stops the run, naming the function, its file and the
first error.

Multi-turn episodes (samples with "env", rl/generation/episodes.py): env.reward=env takes the
episode's reward as the score, the function is not called; function scores the episode's final
assistant message with the function (or the built-in task's scorer); sum adds both. A failed
episode is a failed response (its reason as the error). The score sits on the last sampled token.

Validation items (data "val", nodes/evaluator.py) are scored the same way, keep each response's
decoded "text", and go out on the port `validation` to the evaluator, never on `scored`: the
reference, critic and learner never see them. That port exists on RewardWithValidation, the kind a
graph with validation declares. Every `rollouts_every` learner steps, a few training rollouts
(prompt, response, reward) go to the driver for rollouts.jsonl and TensorBoard (dataflow/driver/loggers.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Annotated

from dataflow import Node, UserError
from dataflow.checks import AtLeast, ExistingPath, NonNegative, Positive
from rl.agent.episode import rollout_fields
from rl.data import fast_tokenizer, tasks
from rl.reward.runner import Request, RewardRunner
from rl.reward.reward_fn import load_rewards


@dataclass(kw_only=True)
class RewardConfig:
    path: Annotated[str, ExistingPath(kind="file")] = ""
    """Python file with the reward function; empty = the built-in task's scorer."""
    function: list[str] | str = ""
    """Name of the function (or class) in `path`, or a list of names, e.g. [accuracy_reward,
    format_reward] (TRL's reward_funcs); empty = `reward`, else verl's `compute_score`."""
    weights: dict | list[float] = field(default_factory=dict)
    """A list: one weight per function of `function` (TRL's reward_weights; default 1 each). A
    dict: the weights of a dict-valued reward's named scores ({} = equal weights of 1)."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments given to every reward call (verl's custom_reward_function.reward_kwargs),
    e.g. '{"format_score": 0.1}'."""
    timeout_s: Annotated[float, Positive] = 10.0
    """Longest one reward call may take before its response is marked failed (a batched
    function: the whole call). Calls run concurrently: a reward that hangs costs about one
    timeout per batch. Above rl/reward/math_reward.py's own 6 s per comparison."""
    max_concurrency: Annotated[int, AtLeast(1)] = 32
    """Reward calls running at once (threads, or coroutines of an async function)."""
    max_failed_batches: Annotated[int, NonNegative] = 3
    """Stop the run when the reward fails for every response of this many consecutive batches of
    `items_per_call` prompts (0 = never stop)."""
    log_every_s: Annotated[float, NonNegative] = 10.0
    """At most one on-screen line about failed rewards per this many seconds."""
    per_token: bool = True
    """Built-in tasks: put per-position credit on each token (else the whole score on the last)."""
    tokenizer_path: Annotated[str, ExistingPath(kind="dir")] = ""
    """Where to load the tokenizer from (the policy's model dir); empty = built-in tokenizer."""
    items_per_call: Annotated[int, AtLeast(1)] = 16
    """Prompts (each with its group of responses) scored together as one batch."""
    rollouts_every: int = 10
    """Every this many learner steps (and at step 1), send a few of the step's training rollouts
    to rollouts.jsonl / TensorBoard (0 = none)."""
    rollouts_per_step: int = 2
    """Prompts per such step whose first response is shown."""


class RewardFailing(UserError):
    """The reward fails for every response, batch after batch: the run cannot learn anything."""


class Reward(Node):
    Config = RewardConfig
    inputs = ("samples",)
    outputs = ("scored",)

    async def setup(self):
        c = self.config
        with self.ctx.span("load tokenizer"):   # spans in setup: the run's start-up parts (setup/reward/...)
            # tokenizer.json alone (rl/data/fast_tokenizer.py): decoding needs no transformers (nor torch)
            self.tokenizer = fast_tokenizer.load(c.tokenizer_path) if c.tokenizer_path else tasks.build_fast_tokenizer()
        with self.ctx.span("load reward file"):
            self.rewards = load_rewards(c.path, c.function, c.weights, c.kwargs) if c.path else None
        self.runner = RewardRunner(self.rewards, c.timeout_s, c.max_concurrency) if self.rewards else None
        self.failed_total = self.scored_total = self.timeouts_total = 0
        self.failing_prompts = 0                       # consecutive prompts with every response failed
        self.streak_first_error = ""
        self.unreported = {"failed": 0, "timed_out": 0, "scored": 0, "first": ""}
        self.last_report = float("-inf")

    def state_dict(self) -> dict:
        return {"failed_total": self.failed_total, "scored_total": self.scored_total,
                "timeouts_total": self.timeouts_total}

    def load_state_dict(self, state: dict) -> None:
        self.failed_total, self.scored_total = state["failed_total"], state["scored_total"]
        self.timeouts_total = state.get("timeouts_total", 0)

    def _score_builtin(self, item: dict) -> None:
        for s in item["samples"]:
            s["text"] = text = self.tokenizer.decode(s["response_ids"], skip_special_tokens=True)
            s["score"], s["failed"], s["error"], s["timed_out"] = float(tasks.score(item["fields"], text)), False, "", False
            if self.config.per_token:
                tokens = self.tokenizer.convert_ids_to_tokens(s["response_ids"])
                s["token_rewards"] = tasks.token_rewards(item["fields"], tokens)
            else:
                s["token_rewards"] = _on_last_token(s)

    async def _score_with_fn(self, items: list[dict]) -> None:
        samples = [(item, s) for item in items for s in item["samples"]]
        texts = await asyncio.to_thread(lambda: [self.tokenizer.decode(s["response_ids"], skip_special_tokens=True)
                                                 for _, s in samples])
        outcomes = await self.runner.score([Request(item["prompt"], text, item["fields"], list(s["response_ids"]))
                                            for (item, s), text in zip(samples, texts)])
        for (item, s), outcome, text in zip(samples, outcomes, texts):
            s["text"] = text
            s["failed"] = outcome.score is None
            s["score"] = 0.0 if outcome.score is None else outcome.score
            s["error"] = "" if outcome.error is None else f"prompt {item['id']}: {outcome.error}"
            s["timed_out"] = outcome.timed_out
            s["token_rewards"] = _on_last_token(s)
        self.ctx.metrics(_component_means(outcomes))

    async def _score_episodes(self, items: list[dict]) -> None:
        """Scores of episodes (module docstring): the environment's reward, the function's score of
        the final assistant message, or both."""
        samples = [(item, s) for item in items for s in item["samples"]]
        scored = [(item, s) for item, s in samples if s["env"]["reward_mode"] in ("function", "sum")]
        if scored and self.runner is not None:
            outcomes = await self.runner.score([Request(item["prompt"], s["env"]["final_text"], item["fields"],
                                                        list(s["response_ids"])) for item, s in scored])
        else:
            outcomes = [None] * len(scored)
        by_sample = {id(s): outcome for (_, s), outcome in zip(scored, outcomes)}
        for item, s in samples:
            env, error, timed_out = s["env"], "", False
            s["text"] = env["final_text"]
            score = env["reward"] if env["reward_mode"] in ("env", "sum") else 0.0
            if env["reward_mode"] in ("function", "sum"):
                if self.runner is None:
                    score = (score or 0.0) + float(tasks.score(item["fields"], env["final_text"]))
                else:
                    outcome = by_sample[id(s)]
                    timed_out = outcome.timed_out
                    error = "" if outcome.error is None else f"prompt {item['id']}: {outcome.error}"
                    score = None if outcome.score is None else (score or 0.0) + outcome.score
            if env["failed"]:
                error, score = f"prompt {item['id']}: episode failed: {env['failed']}", None
            s["failed"], s["score"] = score is None, 0.0 if score is None else float(score)
            s["error"], s["timed_out"] = error, timed_out
            s["token_rewards"] = _on_last_token(s)

    def _account(self, items: list[dict]) -> None:
        """Counters, the on-screen line, and the stop after max_failed_batches all-failed batches."""
        samples = [s for item in items for s in item["samples"]]
        failed = [s for s in samples if s["failed"]]
        timed_out = sum(s["timed_out"] for s in failed)
        self.scored_total += len(samples)
        self.failed_total += len(failed)
        self.timeouts_total += timed_out
        u = self.unreported
        u["scored"] += len(samples)
        if failed:
            u["failed"] += len(failed)
            u["timed_out"] += timed_out
            u["first"] = u["first"] or failed[0]["error"]
            self.ctx.metrics({"reward/failed_total": self.failed_total, "reward/scored_total": self.scored_total,
                              "reward/timeouts_total": self.timeouts_total,
                              "reward/abandoned_running": self.runner.abandoned_running if self.runner else 0})
        if time.monotonic() - self.last_report >= self.config.log_every_s:
            self._report()
        # The streak counts prompts, not the node's batches: a batch is whatever has arrived (one
        # prompt, when the generators are slow), and a few unlucky prompts must not stop a run.
        for item in items:
            if item["samples"] and all(s["failed"] for s in item["samples"]):
                self.streak_first_error = self.streak_first_error if self.failing_prompts else item["samples"][0]["error"]
                self.failing_prompts += 1
            else:
                self.failing_prompts = 0
        k, per_batch = self.config.max_failed_batches, self.config.items_per_call
        if k > 0 and self.failing_prompts >= k * per_batch:
            what = "the episodes" if any("env" in s for item in items for s in item["samples"]) else (
                f"reward function {self.rewards.where}" if self.rewards else "the built-in scorer")
            raise RewardFailing(
                f"{what} failed for every response of {self.failing_prompts} "
                f"consecutive prompts (reward.max_failed_batches={k} batches of reward.items_per_call="
                f"{per_batch}); first error: "
                f"{self.streak_first_error}. Fix the {'environment' if what == 'the episodes' else 'function (or the fields it reads)'}, or set "
                "reward.max_failed_batches=0 to go on regardless")

    def _report(self) -> None:
        """One line for the console about the failures not reported yet (nothing if none)."""
        u = self.unreported
        if u["failed"]:
            timeouts = f", {u['timed_out']} timed out" if u["timed_out"] else ""
            running = self.runner.abandoned_running if self.runner else 0
            abandoned = f", {running} timed-out calls still running" if running else ""
            self.ctx.log(f"reward failed for {u['failed']} of {u['scored']} responses{timeouts}{abandoned} "
                         f"(in all {self.failed_total} of {self.scored_total}; marked failed, left out of the "
                         f"loss); e.g. {u['first']}")
            self.last_report = time.monotonic()
        self.unreported = {"failed": 0, "timed_out": 0, "scored": 0, "first": ""}

    def _rollouts(self, msgs: list) -> None:
        """A few training rollouts of each shown step for the driver (rollouts.jsonl, TensorBoard)."""
        every, rows = self.config.rollouts_every, []
        for msg in msgs:
            step = msg.meta.get("batch", -1) + 1       # the learner step that trains on it
            if every <= 0 or step < 1 or (step % every and step != 1) or not msg.data["samples"]:
                continue
            shown = self.rollouts_shown.setdefault(step, 0)
            if shown < self.config.rollouts_per_step:
                s = msg.data["samples"][0]
                rows.append({"kind": "train", "step": step, "version": msg.data.get("version"), "id": msg.data["id"],
                             **rollout_fields(s, msg.data["prompt"]), "reward": s["score"]})
                self.rollouts_shown[step] = shown + 1
        if rows:
            self.ctx.metrics({"rollouts": rows})
        while len(self.rollouts_shown) > 16:    # steps long past
            del self.rollouts_shown[min(self.rollouts_shown)]

    async def run(self):
        inp, out = self.ctx.inputs["samples"], self.ctx.outputs["scored"]
        validation = self.ctx.outputs.get("validation")
        self.rollouts_shown: dict[int, int] = {}
        try:
            async for batch in inp.batches(self.config.items_per_call, 0.01):
                items = [m.data for m in batch]
                with self.ctx.span("score", items=len(batch)):
                    if any("env" in s for item in items for s in item["samples"]):
                        await self._score_episodes(items)
                    elif self.runner is None:
                        await asyncio.to_thread(lambda items=items: [self._score_builtin(item) for item in items])
                    else:
                        await self._score_with_fn(items)
                self._account(items)
                self._rollouts([m for m in batch if "val" not in m.data])
                for msg, item in zip(batch, items):
                    if "val" in item:   # a validation prompt: to the evaluator only
                        if validation is None:
                            raise UserError("a validation prompt reached the reward node, which has no "
                                            "'validation' port: declare it as RewardWithValidation, wired to "
                                            "an Evaluator (nodes/evaluator.py; docs/observability.md, Validation)")
                        await validation.send(item, **msg.meta)
                        continue
                    for s in item["samples"]:
                        s.pop("text", None)    # the trainers need the tokens only
                    await out.send(item, **msg.meta)
        finally:
            self._report()                             # failures of the last few seconds
            if self.runner is not None:
                self.runner.close()


_ENGINE_NAMES = {"mean", "std", "failed_total", "scored_total", "timeouts_total", "abandoned_running"}


def _component_means(outcomes: list) -> dict[str, float]:
    """reward/<function name> and reward/<verl extra key>: the batch's mean of each (the values a
    function gave; TRL logs rewards/<name>/mean alike)."""
    values: dict[str, list[float]] = {}
    for o in outcomes:
        for name, v in [*o.components.items(), *o.extras.items()]:
            if v is not None:   # a name the engine's own reward/ metrics use gets a suffix
                values.setdefault(f"reward/{name}" + ("/fn" if name in _ENGINE_NAMES else ""), []).append(v)
    return {k: sum(v) / len(v) for k, v in values.items()}


def _on_last_token(s: dict) -> list[float]:
    """The score on the last trained token (an episode's may end with environment tokens)."""
    n, mask = len(s["response_ids"]), s.get("loss_mask")
    last = max((i for i, m in enumerate(mask) if m), default=n - 1) if mask else n - 1
    return [0.0] * last + [s["score"]] + [0.0] * (n - 1 - last) if n else []


class RewardWithValidation(Reward):
    """Reward with the second output port `validation` (to the Evaluator, nodes/evaluator.py)."""
    outputs = ("scored", "validation")
