"""dataflow/driver/loggers.py without Ray: TensorBoard event files read back with tensorboard's own
EventAccumulator, rollouts.jsonl, the validation console lines, and the setting's errors."""

from __future__ import annotations

import importlib.util
import json

import pytest

from dataflow import Graph
from dataflow.errors import GraphError, UserError
from dataflow.driver.loggers import RunLoggers, parse, problems, progress_line, rollout_table, summary

VAL0 = {"time_s": 1.0, "node": "evaluator", "val/step": 0, "val/prompts": 6, "val/mean@1": 0.25,
        "val/mean@4": 0.125, "val/pass@4": 0.5, "val/gsm8k/mean@1": 0.5, "val/version_min": 0, "val/version_max": 0}
VAL2 = {**VAL0, "time_s": 9.0, "val/step": 2, "val/mean@1": 0.5, "val/gsm8k/mean@1": 0.75, "val/version_max": 3}


def test_tensorboard_scalars_text_and_rollouts_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = RunLoggers(tmp_path, "tensorboard")
    assert sinks.record(VAL0, step=0) == progress_line(VAL0)
    for step in (1, 2):
        assert sinks.record({"time_s": step, "node": "learner", "step": step, "reward/mean": 0.1 * step,
                             "note": "text is not a scalar", "ok": True}, step=step) is None
    rows = [{"kind": "train", "step": 2, "version": 1, "id": 3, "prompt": "copy 1 2 :", "response": "1 | 2\nend",
             "reward": 1.0}]
    sinks.record({"time_s": 3, "node": "reward"}, step=2, rollouts=rows)   # a record of rollouts only
    sinks.record(VAL2, step=2, rollouts=[{"kind": "val", "step": 2, "prompt": "p", "response": "r", "reward": 0.0}])
    table = sinks.close()

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert [(e.step, e.value) for e in acc.Scalars("val/mean@1")] == [(0, 0.25), (2, 0.5)]   # at val/step
    assert "note" not in acc.Tags()["scalars"] and "ok" not in acc.Tags()["scalars"]
    assert "time_s" not in acc.Tags()["scalars"]
    [train] = acc.Tensors("rollouts/train/text_summary")
    text = train.tensor_proto.string_val[0].decode()
    assert train.step == 2 and "copy 1 2 :" in text and "1 \\| 2<br>end" in text   # one table row per rollout
    assert acc.Tensors("rollouts/val/text_summary")[0].step == 2

    lines = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["train", "val"] and lines[0]["response"] == "1 | 2\nend"
    # the end-of-run table: first and last round side by side
    assert table.splitlines()[0].split()[1:] == ["step", "0", "step", "2"]
    assert "  mean@1" in table and "0.250" in table and "0.500" in table and "gsm8k/mean@1" in table


def test_console_lines_and_summary():
    assert progress_line(VAL0) == "val step  0 | mean@1 0.250 | mean@4 0.125 | pass@4 0.500 | 6 prompts"
    assert "policy versions 0..3" in progress_line(VAL2)            # a round answered by two versions
    assert summary([]) == ""
    only = summary([VAL0])
    assert "step 0" in only and "step 2" not in only
    assert rollout_table([]).count("\n") == 1


def test_loggers_setting_errors(tmp_path):
    assert parse("tensorboard, wandb") == ["tensorboard", "wandb"] and parse("") == [] and parse(None) == []
    with pytest.raises(UserError, match="unknown 'tensorbord'; choose from tensorboard, wandb"):
        parse("tensorbord")
    g = Graph("g", loggers="tensorbord")
    with pytest.raises(GraphError, match="loggers: unknown 'tensorbord'"):
        g.validate()
    if importlib.util.find_spec("wandb") is None:
        assert problems("wandb") == ["loggers=wandb needs the wandb package: pip install wandb"]
    assert problems(["tensorboard"]) == ([] if importlib.util.find_spec("tensorboard") else
                                          ["loggers=tensorboard needs the tensorboard package: pip install tensorboard"])
    sinks = RunLoggers(tmp_path, "")          # no sinks: rollouts.jsonl still written
    sinks.record({"time_s": 0}, step=1, rollouts=[{"kind": "train", "step": 1}])
    assert sinks.close() == "" and (tmp_path / "rollouts.jsonl").read_text().count("\n") == 1


def test_wandb_offline(tmp_path, monkeypatch):
    """wandb (when installed) with no network: WANDB_MODE=offline writes the run under <run>/wandb."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = RunLoggers(tmp_path, ["wandb"], {"lr": 0.001}, name="unit")
    sinks.record(VAL0, step=0)
    sinks.record({"time_s": 1, "node": "learner", "step": 1, "reward/mean": 0.5}, step=1,
                 rollouts=[{"kind": "train", "step": 1, "version": 0, "prompt": "p", "response": "r", "reward": 0.5}])
    sinks.close()
    [run_dir] = list((tmp_path / "wandb").glob("offline-run-*"))
    assert any(p.suffix == ".wandb" and p.stat().st_size > 0 for p in run_dir.iterdir())
