"""One episode: the user's environment, the chat so far, and the token trajectory.

    ep = factory.episode(row)
    prompt_ids = await ep.start()        # [] when it failed (ep.failed says why)
    while True:
        sampled = <decode up to ep.turn_token_limit(max_new_tokens) tokens>
        turn = await ep.step(sampled, finished)   # finished: it stopped on a stop token
        if turn.done: break
        <append turn.append_ids and decode again>
    result = ep.result()

The episode keeps the trajectory as the generator built it (prompt_ids, response_ids, loss_mask:
1 on sampled ids, 0 on the environment's) so a test or a caller can check it. Each turn's
environment ids are rendered by rl/agent/render.py. Limits end an episode and are counted
(ended_by): max_turns, max_episode_tokens; an observation longer than max_observation_tokens is cut.
Failures end it with a one-line reason (failed): the environment raised, timed out or returned
garbage, the template was not append-only with non_append_template=error, or env.reward=env and
the environment gave no reward. A failed episode is left out of the loss by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl.agent.calls import EnvCalls, EnvFailure, one_line
from rl.agent.envs import Garbage, Step
from rl.agent.render import TemplateMismatch


COUNTERS = ("tool_calls", "tool_errors", "malformed_tool_calls", "unknown_tool_calls", "bad_tool_arguments",
            "tool_exceptions", "tool_timeouts", "truncated_observations", "non_append_renders", "truncated_turns",
            "close_errors")
"""Every episode's counters (EpisodeResult.counters), all present: tool_errors is the sum of the five
kinds after it; truncated_turns are turns cut by the token limit (finished=False)."""


def transcript(messages: list[dict]) -> str:
    """Messages as one readable text, a `[role] content` line each: what rollouts.jsonl,
    TensorBoard and wandb show of an episode (the chat the environment rendered, turn by turn)."""
    return "\n".join(f"[{m.get('role')}] {m.get('content')}" for m in messages)


def rollout_fields(sample: dict, prompt) -> dict:
    """What a shown rollout (rollouts.jsonl, TensorBoard, wandb) says of one sample: its prompt and
    response text; for an episode the chat's transcript instead, first messages then the turns (the
    prompt source's text is not what the environment rendered), with its turns and how it ended."""
    env = sample.get("env")
    if env is None:
        return {"prompt": prompt, "response": sample.get("text", "")}
    first = env.get("first_messages", 0)
    return {"prompt": transcript(env["messages"][:first]), "response": transcript(env["messages"][first:]),
            "turns": sample.get("turns"), "ended_by": env.get("ended_by")}


@dataclass
class Turn:
    append_ids: list[int]
    """Environment ids to append after the sampled ones (empty when done)."""
    done: bool
    env_s: float = 0.0
    """Seconds this turn spent in the environment (for trace spans)."""


@dataclass
class EpisodeResult:
    reward: float | None
    """The environment's part of the reward: the sum of its step rewards plus get_reward() where
    defined; None when it gave none. With env.reward=function/sum the reward node adds its
    function's score of `messages`."""
    step_rewards: list[float | None]
    turns: int
    failed: str | None
    """Why the episode failed (one line), or None."""
    ended_by: str
    """done (the environment said so), no_tool_call, max_turns, max_episode_tokens, failed."""
    counters: dict[str, int]
    messages: list[dict]
    """The whole chat: the first messages, then assistant texts and observations."""
    prompt_ids: list[int]
    response_ids: list[int]
    """Sampled and environment ids interleaved, everything after prompt_ids."""
    loss_mask: list[int]
    env_s: float
    """Environment time of the whole episode."""

    @property
    def final_text(self) -> str:
        """The last assistant message's text (what a single-turn reward function scores)."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    first_messages: int = 0
    """How many of `messages` came before the first turn (the prompt)."""
    final_reward: float | None = None
    """get_reward()'s value (TRL's form), part of `reward`."""

    @property
    def completion_messages(self) -> list[dict]:
        """The chat after the prompt (TRL passes these to conversational reward functions)."""
        return self.messages[self.first_messages:]


class Episode:
    def __init__(self, factory: Any, session: Any, row: dict):
        # factory: rl/agent/loading.EnvFactory (not imported: loading imports this module)
        self.factory, self.cfg, self.session, self.row = factory, factory.cfg, session, row
        self.calls = EnvCalls(factory.executor, self.cfg.step_timeout_s, self.cfg.episode_timeout_s)
        self.messages: list[dict] = []
        self.prompt_ids: list[int] = []
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.step_rewards: list[float | None] = []
        self.final_reward: float | None = None
        self.turns = 0
        self.failed: str | None = None
        self.ended_by = ""
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._first = 0
        self._closed = False

    @property
    def done(self) -> bool:
        return bool(self.ended_by)

    @property
    def tokens_left(self) -> int:
        """Tokens the episode may still add (sampled + environment) under max_episode_tokens."""
        return max(0, self.cfg.max_episode_tokens - len(self.response_ids))

    def turn_token_limit(self, max_new_tokens: int) -> int:
        """Most tokens the next turn may sample: max_turn_tokens (0 = max_new_tokens), within
        what the episode has left."""
        return min(self.cfg.max_turn_tokens or max_new_tokens, self.tokens_left)

    async def start(self) -> list[int]:
        """Build the environment, reset it on the row, render the first prompt (chat template,
        tools, generation prompt). [] when that failed (self.failed says why)."""
        try:
            self.messages = await self.session.reset(self.calls, self.row)
        except EnvFailure as e:
            await self._end("failed", f"reset: {e}" if isinstance(e, Garbage) else str(e))
            return []
        self._first = len(self.messages)
        try:
            self.prompt_ids = self.factory.renderer.first(self.messages)
        except Exception as e:       # the chat template refused the messages (a role it does not know, ...)
            await self._end("failed", f"rendering the first messages: {one_line(e)}")
            return []
        return list(self.prompt_ids)

    async def step(self, sampled_ids: list[int], finished: bool) -> Turn:
        """The model's turn `sampled_ids` (ending with its stop token when `finished`) goes to
        the environment; returns the ids to append, or done."""
        if self.done:
            raise RuntimeError(f"episode already ended ({self.ended_by})")
        spent = self.calls.spent_s
        sampled_ids = list(sampled_ids)
        self.turns += 1
        self.response_ids += sampled_ids
        self.loss_mask += [1] * len(sampled_ids)
        self.counters["truncated_turns"] += 0 if finished else 1
        self.messages.append({"role": "assistant", "content": self._text(sampled_ids, skip_special=True)})
        try:
            out: Step = await self.session.step(self.calls, self._text(sampled_ids, skip_special=False))
        except EnvFailure as e:
            await self._end("failed", str(e))
            return Turn([], True, self.calls.spent_s - spent)
        for key, n in out.counters.items():
            self.counters[key] = self.counters.get(key, 0) + n
        self.step_rewards.append(out.reward)
        if out.done or self.turns >= self.cfg.max_turns:
            reason = "max_turns" if not out.done else ("no_tool_call" if self.factory.form != "gym" else "done")
            await self._end(reason)
            return Turn([], True, self.calls.spent_s - spent)
        try:
            ids, new = self._observation(sampled_ids, out.messages)
        except TemplateMismatch as e:
            await self._end("failed", str(e))
            return Turn([], True, self.calls.spent_s - spent)
        except Exception as e:       # the template refused the messages (Gemma's: roles must alternate)
            await self._end("failed", f"rendering the observation: {one_line(e)}")
            return Turn([], True, self.calls.spent_s - spent)
        if len(self.response_ids) + len(ids) >= self.cfg.max_episode_tokens:
            await self._end("max_episode_tokens")
            return Turn([], True, self.calls.spent_s - spent)
        self.messages += new
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        return Turn(ids, False, self.calls.spent_s - spent)

    def _text(self, ids: list[int], skip_special: bool) -> str:
        if ids and ids[-1] in self.factory.stop_ids:
            ids = ids[:-1]
        return self.factory.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def _observation(self, sampled_ids: list[int], new: list[dict]) -> tuple[list[int], list[dict]]:
        """The turn's environment ids and messages, contents cut to fit max_observation_tokens."""
        renderer, limit = self.factory.renderer, self.cfg.max_observation_tokens
        ids, alone = renderer.observation(sampled_ids, self.messages, new)
        if len(ids) > limit:
            self.counters["truncated_observations"] += 1
            for _ in range(3):         # re-encoding a cut text can differ by a token or two
                new = self._cut(new, len(ids) - limit)
                ids, alone = renderer.observation(sampled_ids, self.messages, new)
                if len(ids) <= limit:
                    break
        self.counters["non_append_renders"] += int(alone)
        return ids, new

    def _cut(self, new: list[dict], excess: int) -> list[dict]:
        """`new` with `excess` tokens fewer in its contents, taken from the last message first."""
        tok, out = self.factory.tokenizer, [dict(m) for m in new]
        for m in reversed(out):
            if excess <= 0:
                break
            content = tok.encode(m["content"], add_special_tokens=False)
            keep = max(0, len(content) - excess)
            excess -= len(content) - keep
            m["content"] = tok.decode(content[:keep])
        return out

    async def _end(self, ended_by: str, failed: str | None = None) -> None:
        self.ended_by, self.failed = ended_by, failed
        if failed is None:
            try:
                extra = await self.session.final_reward(self.calls)
            except EnvFailure as e:
                self.ended_by, self.failed = "failed", f"get_reward: {e}" if isinstance(e, Garbage) else str(e)
            else:
                self.final_reward = extra
                if self.cfg.reward == "env" and self.reward is None:
                    self.ended_by = "failed"
                    self.failed = ("env.reward=env, but the environment gave no reward (every step's reward "
                                   "was None); return a number from step or set env.reward=function")
        await self.close()

    async def close(self) -> None:
        """Close the environment (once; a close that raises or hangs is only counted). The
        episode closes itself when it ends; call this when abandoning one early."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.session.close(self.calls)
        except EnvFailure:
            self.counters["close_errors"] += 1

    @property
    def reward(self) -> float | None:
        given = [r for r in self.step_rewards + [self.final_reward] if r is not None]
        return float(sum(given)) if given else None

    def result(self) -> EpisodeResult:
        return EpisodeResult(reward=self.reward, step_rewards=list(self.step_rewards), turns=self.turns,
                             failed=self.failed, ended_by=self.ended_by or "running",
                             counters=dict(self.counters), messages=[dict(m) for m in self.messages],
                             prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids),
                             loss_mask=list(self.loss_mask), env_s=self.calls.spent_s,
                             first_messages=self._first, final_reward=self.final_reward)
