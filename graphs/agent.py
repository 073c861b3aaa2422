"""GRPO over multi-turn episodes. Run:
    python -m dataflow.run graphs/agent.py --set env.path=my_env.py [--set env.name=MyEnv] [...]

    prompts ──> generator (x replicas) ─────────────────────────────> reward ──> reference ──> learner
       ▲        ┌─────────────────────────────────────────────┐                                  │
       │        │ group_size episodes per prompt, each:       │                                  │
       │        │   decode a turn ──> env.step (in a thread   │                                  │
       │        │   or on the loop) ──> append its tokens to  │                                  │
       │        │   the slot's KV cache ──> next turn ...     │                                  │
       │        │ THE ENVIRONMENT RUNS HERE, in the generator │                                  │
       │        └─────────────────────────────────────────────┘                                  │
       └──────────────┴──────────────────── policy (versioned, latest wins) ◄────────────────────┘

Where the environment runs: inside each generator replica (rl/generation/episodes.py): the user's
env file (env.path: a gym-style class, typed tool functions, or TRL's environment_factory class;
rl/agent) is loaded there, one instance per episode; its sync methods run in the generator's
thread pool (env.threads), its coroutines on the generator's event loop, while the other slots
keep decoding. It scales with generator replicas. A slow environment shows in the trace as
"env step" slices and in the end-of-run table as the generator "waiting on the environment".

Each sample of a group is one episode: prompt ids (the env's first render), then sampled and
environment tokens interleaved with a loss mask (environment tokens never trained, counted, or in
KL / entropy), per-token behaviour log-probs and weight versions. GRPO normalises each prompt's
group of episode rewards. env.reward: env (the episode's reward, default), function (the reward
node's function on the final answer: reward.path or the built-in task), sum (both).
A failed episode (the env raised, hung, returned garbage) is counted ("samples/failed" on the
progress line), left out of the loss, and reward.max_failed_batches batches of only failed
episodes stop the run with one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dataflow import Graph, check, fill, policy_edge, share
from graphs.grpo import GRPOGraphConfig
from graphs.rlhf import PROGRESS, RLHFConfig, runs
from nodes import Generator, Learner, PromptSource
from rl.agent import EnvConfig


def _env_problem(cfg) -> str | None:
    if not cfg.env.path:
        return "graphs/agent.py runs episodes of an environment: set env.path=FILE (docs/agents.md)"
    if cfg.prompts.apply_chat_template:
        # the environment renders the chat (with the tools) itself; a rendered string would be
        # rendered again inside it as one user message
        return ("graphs/agent.py: prompts.apply_chat_template=true renders string prompts before the environment "
                "renders them again; unset it (a string row is the user's message), or write chat rows "
                "(a list of messages, a system message first if you want one)")
    return None


@dataclass(kw_only=True)
class AgentGraphConfig(GRPOGraphConfig):
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment or tools every episode runs (rl/agent/config.py): env.path, env.name,
    env.tools, env.reward, env.max_turns, env.max_episode_tokens, timeouts."""
    # grpo.py's rules with this file named in the algorithm refusal. An episode's response (sampled
    # and environment tokens) runs to env.max_episode_tokens, not to one turn's max_new_tokens: that
    # is the learner's length cap (overlong shaping, seq-mean-token-sum-norm's divisor, the compile
    # warm-up's sample lengths), so it replaces rlhf.py's fill from generator.max_new_tokens.
    rules: ClassVar[tuple] = tuple(r for r in RLHFConfig.rules if r.targets != ("learner.max_new_tokens",)) + (
        fill("learner.max_new_tokens", "env.max_episode_tokens"),
        share("group_size", "generator.group_size", "learner.group_size"),
        runs("grpo", "graphs/agent.py", "episodes train with group advantages"),
        check(_env_problem), share("env", "generator.env"))

    def preflight(self) -> list[str]:
        """As graphs/rlhf.py's; with env.reward=env no reward function scores anything, so the data
        needs no answer field (the environment's reward is the score)."""
        from rl.preflight import pipeline_problems

        reward = self.reward if self.env.reward != "env" and self.reward_kind == "function" else None
        return pipeline_problems(self.prompts, self.generator, reward, None, max_new_tokens_key="max_new_tokens")


config = AgentGraphConfig()


def build(cfg: AgentGraphConfig) -> Graph:
    # tool calls per episode beside the turns: a tool-using run whose model stopped calling shows it
    tools = ["env/tool_calls", "env/tool_errors"] if cfg.env.tools else []
    g = Graph("agent", config=cfg, progress=PROGRESS + ["samples/failed", "env/turns"] + tools)
    g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
    # the environment runs inside the generator (module docstring)
    g.node("generator", Generator, cfg.generator, cpus=1, side="rollout", replicas=cfg.generator_replicas)
    g.node("reward", **cfg.reward_node())
    with_ref = cfg.add_reference(g, "reward.scored")
    g.node("learner", Learner, cfg.learner, cpus=1, side="train", replicas=cfg.learner.num_ranks, ends_run=True)
    cap = cfg.channel_capacity
    g.channel("prompts.prompts", "generator.prompts", capacity=cap, name="prompts")
    g.channel("generator.samples", "reward.samples", capacity=cap, name="samples")
    g.channel(with_ref, "learner.rollouts", capacity=cap, name="rollouts")
    policy_edge(g, src="learner", dst=["generator", "prompts"], transport=cfg.weight_transport)
    cfg.add_validation(g)
    g.place(cfg.placement, num_gpus=cfg.num_gpus, gpu_shares=cfg.gpu_shares)
    return g
