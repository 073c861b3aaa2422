"""Multi-turn episodes inside the generator (env.path set; nodes/impl/generator.py's continuous loop).

Each sample of a prompt's group is an episode of the user's environment (rl/agent: its reset, step,
tools, limits and failures). The environment runs inside the generator process: its sync code in
rl/agent's thread pool, its coroutines on this actor's event loop, never in the decode thread.

    start    when a prompt is taken: ep.start() for each sample (reset + the first render), a task
    admit    once every start of the group is done: the prompt ids go into decoder slots that are
             parked, not freed, at the end of each turn (rl/generation/decoding.StaticDecoder keep=True)
    turn     a slot's turn ended: ep.step(sampled, finished) runs as a task while the other slots
             keep decoding; the slot waits, its KV cache kept
    harvest  a finished step: not done -> extend the slot with turn.append_ids (only those tokens
             are prefilled) and decode the next turn; done -> release the slot, the sample is final

A sample: "prompt_ids" (the episode's first render), "response_ids" (sampled and environment ids
interleaved), "loss_mask" (1 sampled, 0 environment), "logprobs" (0 on environment ids),
"token_versions" (the version that sampled each token; an environment token carries the one of the
token before it), "finished" (the last turn ended on a stop token), "turns", and "env": the
episode's reward, failed reason, ended_by, counters, environment seconds, the chat's messages (the
first `first_messages` of them its prompt) and the reward mode (for the reward node,
nodes/reward.py), and the tokens it prefilled against those a re-prefill of the whole history at
every turn would have (env/prefilled_tokens, env/history_tokens on the learner's line).

Noise: a turn's token t uses counter (index of the turn's first token in response_ids) + t, so no
turn replays another's noise and a re-issued episode with a deterministic environment samples the
same tokens. Versions: the weights may switch between two turns (the loop leaves serving() while
every slot waits on its environment); the earlier turns' KV cache is kept, as partial rollouts keep
it (rl/generation/decoding.py), and each token carries its own version.

Trace: each environment call is an "env step" slice on the track "env", of the wait kind on the
channel "environment": while nothing decodes, the generator's time is "waiting on the environment"
in the end-of-run table (dataflow/trace/report.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

ENVIRONMENT = "environment"
"""The trace's idle cause for time spent waiting on environment calls."""


@dataclass
class _Run:
    """One live episode: the rl/agent Episode and the trajectory as the decoder produced it."""
    ep: object
    tag: tuple
    key: int
    temperature: float | None
    slot: int | None = None
    prompt_ids: list = field(default_factory=list)
    response_ids: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    token_versions: list = field(default_factory=list)
    finished: bool = False
    prefilled: int = 0
    """Tokens this episode prefilled: its prompt, then each turn's appended environment tokens (the
    static decoder keeps the cache), or its whole history every turn (the HF loop re-prefills)."""
    history: int = 0
    """Tokens that re-prefilling the whole history at every turn would have prefilled."""

    def count_prefill(self, appended: int, reprefilled: bool) -> None:
        """A turn starts: `appended` new tokens (the prompt, or the environment's reply) were added."""
        whole = len(self.prompt_ids) + len(self.response_ids)
        self.history += whole
        self.prefilled += whole if reprefilled else appended


class Episodes:
    """The episodes of one generator replica (module docstring)."""

    def __init__(self, ctx, factory, decoder, max_new_tokens: int):
        self.ctx, self.factory, self.dec, self.max_new_tokens = ctx, factory, decoder, max_new_tokens
        # environment steps, running or finished and not yet harvested. Finished ones are found by
        # task.done(), not by a done-callback: the callback runs only once the loop turns, and the
        # generator may look before that (it would then see nothing to wait on and spin)
        self.steps: dict[asyncio.Task, _Run] = {}
        self.counts = {"episodes": 0, "failed": 0, "turns": 0}

    # ----- start / admit -------------------------------------------------------------------------
    def start(self, msg, plan: list[tuple[int, float | None]], number_of) -> asyncio.Task:
        """ep.start() of each sample of msg's group, as one task; its result: the group's _Runs.
        number_of(): the group number, read when the task is admitted."""
        # a chat row starts from its messages, not from the prompt source's rendering of them (the
        # environment renders the chat itself, with the tools: the text would be rendered twice)
        fields = dict(msg.data.get("fields", {}))
        prompt = fields.pop("raw_prompt", None) or msg.data["prompt"]
        row = {**fields, "prompt": prompt}
        runs = [_Run(self.factory.episode(row), (None, j), key, temp) for j, (key, temp) in enumerate(plan)]

        async def start_all():
            with self._env_span("env start"):
                ids = await asyncio.gather(*(r.ep.start() for r in runs))
            for r, p in zip(runs, ids):
                r.prompt_ids = list(p)
            return runs
        return asyncio.ensure_future(start_all())

    def admit(self, runs: list[_Run], number: int) -> tuple[list[tuple], list[tuple]]:
        """(decoder requests of the started episodes, [(tag, sample)] of those whose start failed)."""
        requests, failed = [], []
        for r in runs:
            r.tag = (number, r.tag[1])
            self.counts["episodes"] += 1
            if not r.prompt_ids:          # reset or the first render failed: nothing to decode
                failed.append((r.tag, self._final(r)))
                continue
            cap = r.ep.turn_token_limit(self.max_new_tokens)
            r.count_prefill(len(r.prompt_ids), reprefilled=False)
            requests.append((r.prompt_ids, r, r.key, r.temperature, cap))
        return requests, failed

    # ----- turns ---------------------------------------------------------------------------------
    def turn_ended(self, run: _Run, sample: dict) -> None:
        """A turn's sample from the decoder: record it and send it to the environment (a task)."""
        ids = sample["response_ids"]
        run.slot, run.finished = sample["slot"], sample["finished"]
        run.response_ids += ids
        run.loss_mask += [1] * len(ids)
        run.logprobs += sample["logprobs"]
        run.token_versions += sample.get("token_versions") or [self.dec.version] * len(ids)
        self.counts["turns"] += 1
        self.steps[asyncio.ensure_future(self._step(run, ids, sample["finished"]))] = run

    async def _step(self, run: _Run, ids: list[int], finished: bool):
        with self._env_span("env step"):
            return await run.ep.step(ids, finished)

    @property
    def stepped(self) -> bool:
        """An environment step has finished and waits for harvest()."""
        return any(task.done() for task in self.steps)

    def harvest(self) -> tuple[list[tuple], list[tuple]]:
        """(extend requests for the decoder, [(tag, final sample)] of the episodes that ended)."""
        extend, final = [], []
        done = [task for task in self.steps if task.done()]
        for task in done:
            run = self.steps.pop(task)
            turn = task.result()          # an error here is the library's bug: it fails the node
            if turn.done or not turn.append_ids:
                self.dec.release(run.slot)
                final.append((run.tag, self._final(run)))
                continue
            ids = list(turn.append_ids)
            run.response_ids += ids
            run.loss_mask += [0] * len(ids)
            run.logprobs += [0.0] * len(ids)
            run.token_versions += [run.token_versions[-1] if run.token_versions else self.dec.version] * len(ids)
            run.count_prefill(len(ids), reprefilled=False)
            # the next turn's first token is response token len(response_ids): its noise counter
            extend.append((run.slot, ids, len(run.response_ids), run.ep.turn_token_limit(self.max_new_tokens)))
        return extend, final

    @property
    def waiting(self) -> int:
        """Episodes waiting on their environment (steps running or not yet harvested)."""
        return len(self.steps)

    async def wait(self, others: list, timeout_s: float) -> None:
        """Until an environment step (or one of `others`, e.g. start tasks) is done, or timeout_s;
        traced as waiting on the environment."""
        if self.stepped:
            return
        tasks = [t for t in others if not t.done()] + list(self.steps)
        if not tasks:    # nothing to wait on: still yield, so the event loop is never held
            await asyncio.sleep(timeout_s)
            return
        tracer = self.ctx.tracer
        span = tracer.waiting(ENVIRONMENT, "wait environment") if tracer is not None else contextlib.nullcontext()
        with span:
            await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)

    def _env_span(self, name: str):
        tracer = self.ctx.tracer
        return tracer.waiting(ENVIRONMENT, name, track="env") if tracer is not None else contextlib.nullcontext()

    # ----- the final sample ----------------------------------------------------------------------
    def _final(self, run: _Run) -> dict:
        result = run.ep.result()
        if result.failed:
            self.counts["failed"] += 1
        elif result.response_ids != run.response_ids or result.loss_mask != run.loss_mask:
            raise RuntimeError(f"episode {run.tag}: the decoder's trajectory differs from the episode's record "
                               f"({len(run.response_ids)} vs {len(result.response_ids)} tokens)")
        return {"prompt_ids": run.prompt_ids, "response_ids": run.response_ids, "loss_mask": run.loss_mask,
                "logprobs": run.logprobs, "token_versions": run.token_versions, "finished": run.finished,
                "turns": result.turns,
                "env": {"prefilled_tokens": run.prefilled, "history_tokens": run.history,"reward": result.reward, "failed": result.failed, "ended_by": result.ended_by,
                        "counters": result.counters, "env_s": result.env_s, "messages": result.messages,
                        "first_messages": result.first_messages, "final_text": result.final_text, "reward_mode": self.factory.reward_mode}}

    def close(self) -> None:
        for task in self.steps:
            task.cancel()
        self.factory.close()


def episode_metrics(samples: list[dict]) -> dict:
    """The learner's env/* metrics of a batch: per episode, means of turns, environment seconds,
    trained (sampled) tokens, and tokens prefilled against what re-prefilling the history at every
    turn would have cost, tool calls and tool errors (malformed, unknown tool, bad arguments, raised,
    timed out: rl/agent/episode.COUNTERS); env/failed counts. {} when no sample is an episode."""
    episodes = [s for s in samples if "env" in s]
    if not episodes:
        return {}
    n = len(episodes)
    return {"env/turns": sum(s["turns"] for s in episodes) / n,
            "env/failed": sum(bool(s["env"]["failed"]) for s in episodes),
            "env/env_s": sum(s["env"]["env_s"] for s in episodes) / n,
            "env/tool_calls": sum(s["env"]["counters"].get("tool_calls", 0) for s in episodes) / n,
            "env/tool_errors": sum(s["env"]["counters"].get("tool_errors", 0) for s in episodes) / n,
            "env/trained_tokens": sum(sum(s["loss_mask"]) for s in episodes) / n,
            "env/prefilled_tokens": sum(s["env"].get("prefilled_tokens", 0) for s in episodes) / n,
            "env/history_tokens": sum(s["env"].get("history_tokens", 0) for s in episodes) / n}


async def hf_episodes(episodes: Episodes, msgs: list, plans: list, sample, version: int) -> list[list[dict]]:
    """The HF loop's episodes (generator.backend=hf): each prompt's group of episodes, turn by turn
    in lockstep: every live episode's whole history (prompt + response so far) is re-prefilled and
    sampled in one sample_responses call `sample(histories, temperatures, caps)`, then their
    environment steps run concurrently. Simpler than the static decoder's slots (no KV cache kept
    across turns; one slow environment holds the batch's next turn). Returns the final samples per
    prompt, in order."""
    groups = [await episodes.start(m, plan, None) for m, plan in zip(msgs, plans)]
    out: list[list] = [[None] * len(runs) for runs in groups]
    live = []
    for g, runs in enumerate(groups):
        for j, r in enumerate(runs):
            r.tag = (g, j)
            episodes.counts["episodes"] += 1
            if r.prompt_ids:
                live.append(r)
            else:
                out[g][j] = episodes._final(r)
    while live:
        caps = [r.ep.turn_token_limit(episodes.max_new_tokens) for r in live]
        for r in live:
            r.count_prefill(0, reprefilled=True)
        samples = await sample([r.prompt_ids + r.response_ids for r in live], [r.temperature for r in live], max(caps))
        turns = []
        for r, s, cap in zip(live, samples, caps):
            ids, lps = s["response_ids"][:cap], s["logprobs"][:cap]
            finished = bool(ids) and len(ids) == len(s["response_ids"]) and s["finished"]
            r.response_ids += ids
            r.loss_mask += [1] * len(ids)
            r.logprobs += lps
            r.token_versions += [version] * len(ids)
            r.finished = finished
            episodes.counts["turns"] += 1
            turns.append(episodes._step(r, ids, finished))
        still = []
        for r, turn in zip(live, await asyncio.gather(*turns)):
            if turn.done or not turn.append_ids:
                out[r.tag[0]][r.tag[1]] = episodes._final(r)
                continue
            r.response_ids += list(turn.append_ids)
            r.loss_mask += [0] * len(turn.append_ids)
            r.logprobs += [0.0] * len(turn.append_ids)
            r.token_versions += [version] * len(turn.append_ids)
            still.append(r)
        live = still
    return out
