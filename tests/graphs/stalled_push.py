"""A learner and two generators with weight_transport=collective, whose generator[1] joins the push
group but never receives a push (its receive thread is blocked): tests/integration/test_weight_sync.py checks
that the learner's first push times out as the learner's failure, naming both ends. The learner
fails before it needs any rollout, so the graph has no reward / reference / critic."""

from __future__ import annotations

from dataflow import Graph
from graphs.rlhf import RLHFConfig
from nodes.impl.generator import Generator   # subclassed: the implementation
from nodes.learner import Learner
from nodes.prompts import PromptSource
from dataflow.weights.sync import SYNC_EDGE


class StalledGenerator(Generator):
    async def setup(self):
        await super().setup()
        if self.ctx.replica == 1:      # the receive thread waits for this lock at the next push
            self.weight_sync.receiver._arena_lock.acquire()


config = RLHFConfig(weight_transport="collective", generator_replicas=2, prompts_per_step=8, max_restarts=0)


def build(cfg: RLHFConfig) -> Graph:
    g = Graph("stalled_push", config=cfg)  # the settings the nodes share, as in graphs/ppo.py
    g.node("prompts", PromptSource, cfg.prompts, cpus=0.1)
    g.node("generator", StalledGenerator, cfg.generator, cpus=1, replicas=cfg.generator_replicas)
    g.node("learner", Learner, cfg.learner, cpus=1, ends_run=True)
    g.channel("prompts.prompts", "generator.prompts", capacity=8, name="prompts")
    g.channel("generator.samples", "learner.rollouts", capacity=8, name="samples")
    g.versioned("policy", src="learner", dst=["generator", "prompts"])
    g.versioned(SYNC_EDGE, src="learner", dst=["generator"])
    return g
