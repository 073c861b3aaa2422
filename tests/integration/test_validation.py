"""Validation rounds in a real GRPO run (tests/graphs/validation.py on Ray, CPU): rounds before
training and every val.every steps, greedy + n samples, metrics per data source, the learner never
training on a validation prompt; and the run's sinks: TensorBoard event files, rollouts.jsonl,
wandb offline. One Ray instance for the module; runs go through runtime.run_graph in-process."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dataflow.driver.runtime import RunOptions, load_graph, run_graph  # noqa: E402
from rl.data.tasks import DEFAULT_NUM_DIGITS, make_task  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GRAPH = str(ROOT / "tests" / "graphs" / "validation.py")
RAY_NUM_CPUS = 8
# No KL term, so no reference node: a process less to start in each run; validation reads none.
NO_REFERENCE = "learner.kl.coef=0"
pytestmark = pytest.mark.usefixtures("ray_instance")


def write_val_file(path: Path) -> list[dict]:
    """Held-out copy-task prompts (another seed than training's) from two data sources; the last
    row repeats the first, so greedy answers it identically."""
    rows = [{**r, "data_source": "copy_a" if i % 2 == 0 else "copy_b"}
            for i, r in enumerate(make_task("copy", DEFAULT_NUM_DIGITS, seed=99).take(5))]
    rows.append(dict(rows[0]))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def run(tmp_path: Path, *overrides: str, trace: str | None = None):
    graph, config = load_graph(GRAPH, list(overrides))
    options = RunOptions(out_dir=str(tmp_path), quiet=True, trace_path=trace)
    summary = asyncio.run(run_graph(graph, options, config))
    assert summary.status in ("done", "max steps reached"), summary.status
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    return summary, records, rollouts


def test_validation_rounds_before_and_during_training(tmp_path):
    val_path = tmp_path / "val.jsonl"
    rows = write_val_file(val_path)
    trace = tmp_path / "trace.json"
    summary, records, rollouts = run(
        tmp_path, f"val.path={val_path}", "val.every=2", "val.n=3", "val.k=[1,2,3]", "val.rollouts=6",
        "max_steps=3", "max_staleness=0", "learner.record_prompt_ids=true", "learner.minibatch_size=32",
        "reward.rollouts_every=1", "loggers=tensorboard", NO_REFERENCE, trace=str(trace))

    # Rounds: the starting weights (before step 1) and the weights after step 2, exactly those
    # (max_staleness=0: nothing newer exists while a round runs).
    val = [r for r in records if "val/step" in r]
    assert [r["val/step"] for r in val] == [0, 2]
    for r in val:
        assert r["val/prompts"] == len(rows) and r["val/samples_failed"] == 0
        assert r["val/version_min"] == r["val/version_max"] == r["val/step"]
        for name in ("val", "val/copy_a", "val/copy_b"):
            for metric in ("mean@1", "mean@3", "pass@1", "pass@2", "pass@3"):
                assert 0.0 <= r[f"{name}/{metric}"] <= 1.0, (name, metric)
        assert r["val/pass@1"] <= r["val/pass@2"] <= r["val/pass@3"]
        assert "step" not in r     # a validation record is not a learner step

    # Training is as without validation: steps 1..3 on batches 0..2, exactly the training prompts.
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["staleness/max"] == 0 for r in steps)
    assert [r["prompt_ids"] for r in steps] == [list(range(8 * k, 8 * k + 8)) for k in range(3)]

    # The evaluator's rollouts: every prompt's greedy response and its 3 samples, per round.
    val_rollouts = [r for r in rollouts if r["kind"] == "val"]
    for step in (0, 2):
        shown = [r for r in val_rollouts if r["step"] == step]
        assert [r["id"] for r in shown] == [f"val/{i}" for i in range(len(rows))]
        assert all(len(r["samples"]) == 3 for r in shown)
        assert shown[0]["prompt"] == shown[-1]["prompt"] == rows[0]["prompt"]
        assert shown[0]["response"] == shown[-1]["response"]          # greedy: the same answer twice
        greedy_mean = sum(r["reward"] for r in shown) / len(shown)
        assert greedy_mean == pytest.approx(next(r for r in val if r["val/step"] == step)["val/mean@1"])
    # the samples are sampled (at the training temperature), not copies of the greedy answer
    assert any(s["response"] != r["response"] for r in val_rollouts for s in r["samples"])
    train_rollouts = [r for r in rollouts if r["kind"] == "train"]
    assert sorted({r["step"] for r in train_rollouts}) == [1, 2, 3]
    assert all(not str(r["id"]).startswith("val/") for r in train_rollouts)

    # Console: the table of the first and last round.
    assert "validation" in summary.report and "step 0" in summary.report and "step 2" in summary.report

    # The trace shows validation generation as its own span.
    doc = json.loads(trace.read_text())
    pid_name = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    slices = {(pid_name[e["pid"]], e["name"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    assert ("generator", "generate val") in slices and ("generator", "generate") in slices
    assert ("evaluator", "evaluate") in slices

    # TensorBoard: scalars at their steps, the rollout tables as text.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("val/mean@1")] == [0, 2]
    assert [e.value for e in acc.Scalars("val/copy_b/pass@3")] == pytest.approx([r["val/copy_b/pass@3"] for r in val])
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2, 3]
    texts = {tag: [t.tensor_proto.string_val[0].decode() for t in acc.Tensors(tag)]
             for tag in acc.Tags()["tensors"]}
    val_tables = texts["rollouts/val/text_summary"]
    assert len(val_tables) == 2 and rows[1]["prompt"] in val_tables[0]
    assert any("| step | version | reward | prompt | response |" in t for t in texts["rollouts/train/text_summary"])


def test_asynchronous_run_hf_loop_and_wandb_offline(tmp_path, monkeypatch):
    """max_staleness=1, the HF sampling loop (validation prompts in calls of their own), a round
    after every step, TensorBoard and (when installed) wandb in offline mode."""
    val_path = tmp_path / "val.jsonl"
    write_val_file(val_path)
    use_wandb = importlib.util.find_spec("wandb") is not None
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    loggers = "tensorboard,wandb" if use_wandb else "tensorboard"
    summary, records, rollouts = run(
        tmp_path, f"val.path={val_path}", "val.every=1", "val.n=2", "val.max_prompts=4", "val.rollouts=1",
        "generator.backend=hf", "max_steps=3", "max_staleness=1", "learner.record_prompt_ids=true",
        "learner.minibatch_size=32", f"loggers={loggers}", NO_REFERENCE)
    val = [r for r in records if "val/step" in r]
    rounds = [r["val/step"] for r in val]
    # rounds 0 and 1 gate batches 0 and 2, which steps 1 and 3 train on; round 2 may be cut by the end
    assert rounds[:2] == [0, 1] and set(rounds) <= {0, 1, 2}, rounds
    assert all(r["val/prompts"] == 4 and "val/mean@2" in r and "val/pass@2" in r for r in val)
    assert val[0]["val/version_min"] == 0                     # before training: the starting weights
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["staleness/max"] <= 1 for r in steps)
    assert [r["prompt_ids"] for r in steps] == [list(range(8 * k, 8 * k + 8)) for k in range(3)]
    assert [r["id"] for r in rollouts if r["kind"] == "val" and r["step"] == 0] == ["val/0"]
    if use_wandb:
        runs = list((tmp_path / "wandb").glob("offline-run-*"))
        assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir()), runs
