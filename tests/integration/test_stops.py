"""A node's deliberate stop, through the CLI's entry (dataflow.run.main, what `python -m
dataflow.run` runs, on this module's Ray instance): a verdict about the user's data or settings is
its sentence on one line and exit 2, no traceback (a bug keeps its traceback: tests/integration/test_runtime.py).

- DAPO's filter (nodes/group_filter.py) finding no group whose rewards differ within
  filter.max_num_gen_batches batches' worth of prompts;
- the reward node (nodes/reward.py) after reward.max_failed_batches batches in which every
  response's reward failed (on tests/graphs/reward_probe.py, the reward node alone: its stop and
  the CLI's line do not depend on what feeds it, and a GRPO graph would start a learner and a
  generator only to be stopped).
The signal during start-up is tests/integration/test_signals.py's (a subprocess: it signals the process group)."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from dataflow.run import main

pytestmark = pytest.mark.usefixtures("ray_instance")  # one Ray for the module (tests/conftest.py)

FAST = ["--set", "learner.kl.coef=0", "--set", "prompts_per_step=2", "--set", "group_size=2",
        "--set", "learner.minibatch_size=4", "--set", "channel_capacity=8"]   # no reference node


def cli(capsys, graph: str, *args: str) -> SimpleNamespace:
    """main(argv) as `python -m dataflow.run graph args...` runs it: its exit status and output."""
    capsys.readouterr()
    returncode = main([graph, *map(str, args)])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=returncode, stdout=out.out, stderr=out.err)


def test_the_filter_stop_is_one_line(tmp_path, capsys):
    reward = tmp_path / "same.py"
    reward.write_text("def reward(prompt, response, **fields):\n    return 1.0\n")
    r = cli(capsys, "graphs/dapo.py", "--set", f"reward.path={reward}", "--set", "filter.max_num_gen_batches=2", *FAST,
            "--out", tmp_path / "run")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [
        "error: node 'filter' (run): batch 0: 4 prompts gave 0 groups whose rewards differ, of the 2 a step needs "
        "(filter.max_num_gen_batches=2 batches' worth): nearly every group's responses score alike; check the data "
        "and the reward, or raise filter.max_num_gen_batches (0 = no limit)"], r.stderr
    assert "Traceback" not in r.stdout


def test_the_reward_stop_is_one_line(tmp_path, capsys):
    reward = tmp_path / "verl_reward.py"
    reward.write_text(textwrap.dedent('''
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            raise KeyError("label")
    '''))
    r = cli(capsys, "tests/graphs/reward_probe.py", "--set", f"reward.path={reward}", "--set",
            "reward.max_failed_batches=1", "--set", "reward.items_per_call=1", "--out", tmp_path / "run")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"error: node 'reward' (run): reward function compute_score ({reward}) failed for every "
                           "response of 1 consecutive prompts (reward.max_failed_batches=1 batches of "
                           "reward.items_per_call=1); first error: prompt "), line
    assert "KeyError: 'label'" in line and line.endswith("or set reward.max_failed_batches=0 to go on regardless")
    assert "Traceback" not in r.stdout
