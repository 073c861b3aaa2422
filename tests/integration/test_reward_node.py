"""nodes/reward.py on a real Ray instance (tests/graphs/reward_probe.py: samples -> reward ->
tally): peers' reward forms through the node, responses without special tokens, failures on
screen, and the stop after max_failed_batches batches where every response failed."""

from __future__ import annotations

import asyncio
import json
import re
import textwrap
from pathlib import Path

import pytest

from dataflow.errors import UserError
from dataflow.driver.runtime import RunOptions, load_graph, run_graph

ROOT = Path(__file__).resolve().parents[2]
PROBE = str(ROOT / "tests" / "graphs" / "reward_probe.py")

pytestmark = pytest.mark.usefixtures("ray_instance")  # one Ray for the module (tests/conftest.py)


def run(tmp_path: Path, reward_file: str, *overrides: str):
    graph, config = load_graph(PROBE, [f"reward.path={reward_file}", *overrides])
    return asyncio.run(run_graph(graph, RunOptions(out_dir=str(tmp_path / "run")), config))


def test_batched_async_reward_and_failures_on_screen(tmp_path, capsys):
    """A TRL-style async batched reward gets the responses decoded without <eos>; a response it
    gives None is marked failed and the console says so, with the count."""
    path = tmp_path / "trl_reward.py"
    path.write_text(textwrap.dedent('''
        async def accuracy(prompts, completions, answer, **kwargs):
            assert not any("<eos>" in c for c in completions), completions
            return [None if c.endswith("3") else float(c.split()[0] == a) for c, a in zip(completions, answer)]
    '''))
    summary = run(tmp_path, str(path), "reward.function=accuracy")
    assert summary.status == "done", summary.status
    scored = json.loads((tmp_path / "run" / "scored.json").read_text())
    assert len(scored) == 8 and all(len(group) == 4 for group in scored)
    # responses "<i> <j> <eos>": score 1 (the first digit is the answer) unless j == 3 (None: failed)
    assert all(s["failed"] == (j == 3) and s["score"] == (0.0 if j == 3 else 1.0)
               for group in scored for j, s in enumerate(group))
    out = capsys.readouterr().out
    assert re.search(r"\[reward\] reward failed for \d+ of \d+ responses", out), out
    assert "returned None for this completion" in out
    records = map(json.loads, Path(summary.metrics_path).read_text().splitlines())
    failed_totals = [r["reward/failed_total"] for r in records if "reward/failed_total" in r]
    assert failed_totals[-1] == 8


def test_a_reward_failing_every_response_stops_the_run(tmp_path):
    """verl's compute_score raising on every call: after 2 batches of 2 prompts
    (max_failed_batches=2, items_per_call=2) the run stops with one message naming the function,
    its file and the first error."""
    path = tmp_path / "verl_reward.py"
    path.write_text(textwrap.dedent('''
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            raise KeyError("label")
    '''))
    with pytest.raises(UserError) as info:
        run(tmp_path, str(path), "reward.function=compute_score", "reward.max_failed_batches=2")
    message = str(info.value)
    assert (f"reward function compute_score ({path}) failed for every response of 4 consecutive prompts "
            "(reward.max_failed_batches=2 batches of reward.items_per_call=2)") in message
    assert "first error: prompt 0: KeyError: 'label'" in message
    assert "reward.max_failed_batches=0" in message
