"""Settings of multi-turn episodes: the user's environment file and the limits of one episode.

graphs/agent.py exposes them as `env.*` (`--set env.path=my_env.py`); docs/agents.md explains them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from dataflow.checks import AtLeast, ExistingPath, NonNegative, Positive
from dataflow.errors import UserError


class EnvLoadError(UserError, ValueError):
    """An environment file or setting that cannot be used; the message names the file."""


@dataclass(kw_only=True)
class EnvConfig:
    path: Annotated[str, ExistingPath(kind="file")] = ""
    """The user's environment or tool file ("" = single-turn: one response per prompt, no env)."""
    name: str = ""
    """Class in `path` ("" = the only class with reset+step, else the only class with reset and
    public methods: TRL's environment_factory form)."""
    tools: list[str] = field(default_factory=list)
    """Names of typed, documented functions in `path`: the built-in tool-calling environment."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the class's constructor (one instance per episode)."""
    reward: Literal["env", "function", "sum"] = "env"
    """The episode's reward: env = the sum of step rewards (+ get_reward() where defined);
    function = the reward node's function on the final chat; sum = both added."""
    max_turns: Annotated[int, AtLeast(1)] = 4
    """Model turns per episode; the episode ends (counted) after this many."""
    max_episode_tokens: Annotated[int, AtLeast(1)] = 1024
    """Sampled + environment tokens after the prompt; the episode ends (counted) where the next
    observation would not leave room for one more sampled token."""
    max_observation_tokens: Annotated[int, AtLeast(1)] = 256
    """Tokens of one observation; longer message contents are cut to fit (counted). The chat
    template's own tokens are never cut."""
    max_turn_tokens: Annotated[int, NonNegative] = 0
    """Sampled tokens per turn (0 = generator.max_new_tokens)."""
    step_timeout_s: Annotated[float, Positive] = 30.0
    """Longest one environment call (constructor, reset, step, a tool, get_reward, close) may take;
    past it the episode fails (a tool's call returns an error message instead)."""
    episode_timeout_s: Annotated[float, Positive] = 300.0
    """Longest the environment may take in one episode, all its calls together, each measured from
    the call to its answer (decoding time is not counted: a slow GPU or a weight push never fails
    an episode)."""
    threads: Annotated[int, AtLeast(1)] = 256
    """Threads running sync environment code (one pool per generator, started as needed; async
    methods run on the event loop). An environment that sleeps or waits on I/O holds a thread, not
    the loop. Give at least as many as episodes run at once (the generator's slots: 256 on a GPU by
    default): a call waiting for a free thread waits inside its step_timeout_s."""
    isolate: bool = False
    """Run a gym-style environment in a process of its own per episode, killed when a call runs
    past step_timeout_s (a hung thread cannot be killed). Costs a process start per episode."""
    non_append_template: Literal["keep", "error"] = "keep"
    """When the chat template re-renders earlier turns differently once a message is added (not
    append-only): keep = keep the history as sampled and render the new messages alone (counted in
    non_append_renders); error = fail the episode with the reason."""
