"""The reward node on multi-turn samples (nodes/reward.Reward._score_episodes): env.reward=env takes
the episode's reward, function scores the final assistant message with the user's function, sum adds
both; a failed episode is a failed response; the score sits on the last sampled token. And the
end-of-run table names environment waits "waiting on the environment"."""

from __future__ import annotations

import asyncio

from dataflow.trace.report import format_report
from nodes.reward import Reward, RewardConfig
from rl.reward.runner import RewardRunner
from rl.reward.reward_fn import load_reward_fn


def _item(mode: str, env_reward, failed=None):
    env = {"reward": env_reward, "failed": failed, "final_text": "the answer is 7", "reward_mode": mode}
    return {"id": 3, "prompt": "q", "fields": {"answer": "7"},
            "samples": [{"response_ids": [5, 6, 7, 8, 9], "loss_mask": [1, 1, 0, 1, 0], "env": env}]}


def _reward_node(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("def reward(prompt, response, answer):\n    return float(response.endswith(answer)) * 10\n")
    node = Reward.__new__(Reward)
    node.config = RewardConfig(path=str(path))
    node.runner = RewardRunner(load_reward_fn(str(path)), 5.0, 4)
    return node


def test_episode_scores_by_mode(tmp_path):
    node = _reward_node(tmp_path)
    items = [_item("env", 0.5), _item("function", 0.5), _item("sum", 0.5), _item("env", 0.5, failed="step timed out")]
    asyncio.run(node._score_episodes(items))
    node.runner.close()
    scores = [(i["samples"][0]["score"], i["samples"][0]["failed"]) for i in items]
    assert scores == [(0.5, False), (10.0, False), (10.5, False), (0.0, True)]
    assert items[3]["samples"][0]["error"] == "prompt 3: episode failed: step timed out"
    # the score on the last sampled token (index 3), not on the trailing environment token
    assert items[2]["samples"][0]["token_rewards"] == [0.0, 0.0, 0.0, 10.5, 0.0]


def test_the_report_names_environment_waits():
    node = {"busy": 0.2, "wait_input": 0.7, "blocked_output": 0.0, "other": 0.1,
            "causes": [{"kind": "wait_input", "channel": "environment", "fraction": 0.7}]}
    summary = {"window_s": 10.0, "nodes": {"generator": node},
               "devices": {"cuda:0": {"idle": 0.7, "nodes": ["generator"], "causes": [
                   {"who": "generator", "kind": "wait_input", "channel": "environment", "fraction": 0.7}]}},
               "idle_causes": [{"who": "generator", "kind": "wait_input", "channel": "environment",
                                "seconds": 7.0, "fraction": 0.7}]}
    text = format_report(summary)
    assert "waiting on the environment 70%" in text
    assert "1. generator waiting on the environment: 7.00 s (70.0% of its time)" in text
