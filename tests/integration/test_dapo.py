"""DAPO's dynamic sampling: the group filter's decisions (no Ray), then graphs/dapo.py end to end on
a real Ray instance: every step trains on prompts_per_step groups with a learning signal, the
dropped ones are refilled into their batch, and the filter's counts are in metrics.jsonl; and so
it goes on after kill -9 of the filter and of the reference (one run checks both)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dataflow.errors import UserError  # noqa: E402
from nodes.group_filter import GroupFilter, GroupFilterConfig, has_signal  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def group(*scores, failed=()):
    return [{"score": s, "failed": i in failed} for i, s in enumerate(scores)]


def test_a_group_has_a_signal_when_its_scores_differ():
    assert has_signal(group(0.0, 1.0))
    assert has_signal(group(0.5, 0.5, 0.25))
    assert not has_signal(group(1.0, 1.0, 1.0))
    assert not has_signal(group(0.0, 0.0))
    assert not has_signal(group(0.0, 0.0, failed=(0, 1)))


def test_failed_responses_are_no_signal():
    """The learner leaves failed responses out of the group baseline (advantage 0), so their 0.0
    must not make a group look informative: [1, 1, FAILED, 1] has no signal, nor has a group
    with one response left; two differing non-failed scores do."""
    assert not has_signal(group(1.0, 1.0, 0.0, 1.0, failed=(2,)))
    assert not has_signal(group(1.0, 0.0, failed=(1,)))
    assert not has_signal(group(1.0, 0.0, 0.0, failed=(1, 2)))
    assert has_signal(group(1.0, 0.0, 0.0, failed=(2,)))
    assert has_signal(group(0.5, 0.0, 0.25, failed=(1,)))


class Metrics:
    """The one NodeContext method the decisions use."""

    def __init__(self):
        self.records = []

    def metrics(self, values):
        self.records.append(values)


def test_filter_decisions_are_kept_per_prompt_and_a_full_batch_takes_no_more():
    ctx = Metrics()
    f = GroupFilter(GroupFilterConfig(prompts_per_step=2, max_num_gen_batches=3, record_prompt_ids=True), ctx)
    asyncio.run(f.setup())
    assert f._decide(0, 10, group(0, 1)) is True
    assert f._decide(0, 11, group(1, 1)) is None          # dropped: the source refills it
    assert f._decide(0, 11, group(0, 1)) is False         # a re-issued copy of a dropped group
    assert f._decide(0, 10, group(1, 1)) is True          # a re-issued copy of a kept one: forwarded again
    assert f._decide(0, 12, group(1, 0)) is True          # the batch is full now
    f._report()
    assert ctx.records == [{"filter/batch": 0, "filter/kept_groups": 2, "filter/dropped_groups": 1,
                            "filter/prompts_per_step": 3, "filter/surplus_groups": 0,
                            "filter/kept_ids": [10, 12], "filter/dropped_ids": [11]}]
    assert f._decide(0, 13, group(0, 1)) is False and f.surplus == 1   # beyond a full batch
    for pid in range(20, 25):
        assert f._decide(1, pid, group(1, 1)) is None
    with pytest.raises(UserError, match=r"batch 1: 6 prompts gave 0 groups whose rewards differ, of the 2 a step "
                                           r"needs \(filter.max_num_gen_batches=3"):
        f._decide(1, 25, group(1, 1))


@pytest.mark.usefixtures("ray_instance")  # one Ray for the module (tests/conftest.py)
def test_dapo_trains_full_batches_of_informative_groups_also_after_its_filter_and_reference_are_killed(tmp_path):
    """One run of 10 steps. Steps 1-3, before any kill: each trains on exactly the prompts_per_step
    groups the filter kept for its batch, the dropped ones refilled. Then kill -9 of the filter
    after step 3 (it comes back with its snapshot of decisions) and of the reference after step 5
    (the prompts of the untrained batches are re-issued through the filter): every step still
    trains on prompts_per_step groups the filter kept, no prompt twice, none it dropped. (One run
    for both: a graph start-up less; steps 1-3 are what a run without kills trains.)"""
    import signal

    from dataflow.driver.runtime import RunOptions, load_graph
    from tests.conftest import run_in_thread, wait_until

    pps, run_dir = 4, tmp_path / "run"
    graph, config = load_graph(str(ROOT / "graphs/dapo.py"), [
        f"prompts_per_step={pps}", "group_size=4", "learner.minibatch_size=16", "learner.record_prompt_ids=true",
        "filter.record_prompt_ids=true", "channel_capacity=16", "generator.prompts_per_call=2"])
    # Up to max_staleness + 1 batches can be past a node when it is killed: 10 steps leave several
    # that need the restarted one, so the run cannot end before its restart is recorded.
    thread, outcome = run_in_thread(graph, config, RunOptions(max_steps=10, out_dir=str(run_dir), quiet=True))
    records = lambda: [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []  # noqa: E731
    steps = lambda: [r for r in records() if "step" in r]  # noqa: E731
    for node, after in (("filter", 3), ("reference", 5)):
        wait_until(lambda: len(steps()) >= after, 300, f"step {after}", thread, outcome)
        os.kill(json.loads((run_dir / "processes.json").read_text())[node], signal.SIGKILL)
    thread.join(600)
    assert outcome.get("summary") is not None and outcome["summary"].status == "max steps reached", outcome
    assert [r["step"] for r in steps()] == list(range(1, 11))

    # Steps 1-3 (batches 0-2), trained before the filter's kill: each batch's record was out
    # before any of its groups left the filter, so there is one each, and no surplus yet.
    filtered = {}
    for r in records():
        if "filter/batch" in r and r["filter/batch"] < 3:
            assert r["filter/batch"] not in filtered, r
            filtered[r["filter/batch"]] = r
    for r in steps()[:3]:
        assert r["staleness/max"] <= 1
        batch = filtered[r["step"] - 1]
        # The step trained on exactly the groups the filter kept for its batch: prompts_per_step of them.
        assert sorted(r["prompt_ids"]) == sorted(batch["filter/kept_ids"]) and len(r["prompt_ids"]) == pps
        # ... and on their group_size samples each (samples_per_s is samples / step_s)
        assert len(r["prompt_ids"]) * 4 == round(r["perf/samples_per_s"] * r["timing/step_s"])
        assert not set(batch["filter/kept_ids"]) & set(batch["filter/dropped_ids"])
        assert (batch["filter/kept_groups"], batch["filter/dropped_groups"], batch["filter/prompts_per_step"]) == \
            (pps, len(batch["filter/dropped_ids"]), pps + len(batch["filter/dropped_ids"]))
        assert batch["filter/surplus_groups"] == 0
    # Batch 0's first prompts are sampled by the initial policy, seeded per prompt id, so the same
    # groups score alike in every run (ids 1 and 3 here): refills were needed (ids past 0..3).
    assert filtered[0]["filter/dropped_ids"] and max(filtered[0]["filter/kept_ids"]) >= pps

    # The whole run, kills included. Each was restarted once; the records' order is when each
    # restart completed, and the filter's (which reloads its snapshot) can complete after the
    # reference's (seen in CI: a flake).
    assert sorted(r["restarted"] for r in records() if r.get("restarted")) == ["filter", "reference"]
    trained = [r["prompt_ids"] for r in steps()]
    assert len(trained) == 10 and all(len(ids) == pps for ids in trained)
    flat = [i for ids in trained for i in ids]
    assert len(flat) == len(set(flat))                       # no prompt trained twice
    dropped = {i for r in records() if "filter/batch" in r for i in r["filter/dropped_ids"]}
    assert not dropped & set(flat)
