"""Multi-turn episodes: a user's environment or tools, run turn by turn against the chat template.

A pure library (no Ray): the generator node calls it (docs/agents.md).

    from rl.agent import EnvConfig, load_environment
    factory = load_environment(cfg, tokenizer)    # None when env.path is ""
    ep = factory.episode(row); prompt_ids = await ep.start(); turn = await ep.step(ids, finished)
"""

from rl.agent.config import EnvConfig
from rl.agent.episode import Episode, EpisodeResult, Turn
from rl.agent.loading import EnvFactory, EnvLoadError, environment_problems, load_environment

__all__ = ["EnvConfig", "EnvFactory", "EnvLoadError", "Episode", "EpisodeResult", "Turn", "environment_problems",
           "load_environment"]
