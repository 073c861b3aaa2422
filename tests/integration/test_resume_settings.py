"""--resume (dataflow/driver/resume.py): a damaged or half-written checkpoint is refused in one line naming
the newest intact one; a resumed run starts from the run's recorded settings, each --set changing
only what it names; a --set that changes what the run is, is refused unless --allow-changed-settings.

Checkpoints for the refusals are written with dataflow/actor/checkpoint.py's own functions (no Ray); the
settings tests run tests/graphs/checkpointed.py through the CLI in this process on the module's Ray."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dataflow.actor import checkpoint  # noqa: E402
from dataflow import run as cli  # noqa: E402
from dataflow.errors import UserError  # noqa: E402
from dataflow.driver.resume import DEFINES_THE_RUN, _matches, checkpoint_to_resume  # noqa: E402

GRAPH = "tests/graphs/checkpointed.py"


def committed(run_dir: Path, step: int) -> Path:
    tmp = checkpoint.begin(run_dir, step)
    checkpoint.write_state(tmp / "learner", {"node": {"step": step, "w": torch.arange(1000.0)}, "steps": step})
    return checkpoint.commit(tmp, {"graph": "g", "reason": "interval", "step": step, "replicas": ["learner"],
                                   "stale": {}})


def test_a_truncated_checkpoint_is_named_with_the_newest_intact_one(tmp_path):
    committed(tmp_path, 2)
    four = committed(tmp_path, 4)
    tensors = four / "learner" / checkpoint.TENSORS
    size = tensors.stat().st_size
    tensors.write_bytes(tensors.read_bytes()[: size // 2])
    with pytest.raises(UserError) as e:
        checkpoint_to_resume(four)
    assert str(e.value) == (f"--resume {four}: checkpoint is damaged (learner/tensors.safetensors is truncated "
                            f"({size // 2} of {size} bytes)); resume from the newest intact one instead: "
                            f"--resume {tmp_path / 'checkpoints' / 'step_2'}")
    with pytest.raises(UserError, match="its latest checkpoint step_4 is damaged .* --resume .*step_2$"):
        checkpoint_to_resume(tmp_path)  # the run directory: its latest is the broken one
    (four / "learner" / checkpoint.STATE_JSON).write_text('{"node": ')
    with pytest.raises(UserError, match=r"learner/state.json unreadable: JSONDecodeError"):
        checkpoint_to_resume(four)


def test_a_half_written_checkpoint_is_named_as_such(tmp_path):
    two = committed(tmp_path, 2)
    partial = checkpoint.begin(tmp_path, 6)  # a save killed before its commit
    checkpoint.write_state(partial / "learner", {"node": {"step": 6}})
    with pytest.raises(UserError) as e:
        checkpoint_to_resume(partial)
    assert str(e.value) == (f"--resume {partial}: a half-written checkpoint (its save never committed: no "
                            f"manifest.json); resume from the newest intact one instead: --resume {two}")
    assert checkpoint_to_resume(tmp_path) == two  # the run directory: its latest committed one
    (two / "learner" / checkpoint.TENSORS).unlink()
    with pytest.raises(UserError, match="has no intact checkpoint to resume from; start the run again"):
        checkpoint_to_resume(partial)


def test_the_settings_that_define_a_run():
    ppo_keys = ["prompts_per_step", "prompts.prompts_per_step", "generator.group_size", "group_size",
                "policy.path", "policy.model.n_layer", "prompts.path", "prompts.task", "reward.path"]
    assert all(_matches(k, DEFINES_THE_RUN) for k in ppo_keys)
    free = ["learner.lr", "prompts.epochs", "max_staleness", "save_interval", "reward.timeout_s", "max_steps"]
    assert not any(_matches(k, DEFINES_THE_RUN) for k in free)


# ---- through the CLI ------------------------------------------------------------------------------
def main(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_resume_keeps_the_recorded_settings_and_refuses_changing_what_the_run_is(capsys, ray_instance, tmp_path):
    run = tmp_path / "run"
    rc, out, err = main(capsys, GRAPH, "--set", "counter.delay_s=0.01", "--set", "save_interval=2",
                        "--max-steps", "4", "--out", run)
    assert rc == 0, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4"]
    assert checkpoint.read_manifest(run / "checkpoints" / "step_4")["settings"]["counter.delay_s"] == 0.01
    # A new run into it (no --resume) is refused before anything starts: it would truncate the
    # metrics, and --resume on the directory would then pick whichever run's checkpoint is higher.
    metrics = (run / "metrics.jsonl").read_bytes()
    rc, out, err = main(capsys, GRAPH, "--max-steps", "2", "--out", run)
    assert rc == 2 and err.strip().splitlines() == [
        f"error: --out {run} holds an earlier run (metrics.jsonl and checkpoints up to step_4): continue it with "
        f"--resume {run}, or give a new --out"], err
    assert (run / "metrics.jsonl").read_bytes() == metrics

    # No --set: the run's own settings (the defaults are delay_s=0.2, save_interval=1000).
    rc, out, err = main(capsys, GRAPH, "--resume", run, "--max-steps", "6")
    assert rc == 0, err
    assert "resumed from" in out and "step_4" in out
    settings = json.loads((run / "config.json").read_text())
    assert settings["counter.delay_s"] == 0.01 and settings["save_interval"] == 2
    assert (run / "checkpoints" / "step_6").is_dir()  # save_interval=2 carried over

    # A --set changes what it names only; one that defines the run is refused naming it.
    rc, out, err = main(capsys, GRAPH, "--resume", run, "--max-steps", "8", "--set", "counter.count=50")
    assert rc == 2
    assert err.strip().splitlines() == [
        f"error: --resume {run / 'checkpoints' / 'step_6'}: --set counter.count=50 changes a setting that defines "
        "the run (it was 1000); drop it to continue the same run, start a new run without --resume, or pass "
        "--allow-changed-settings to change it anyway"], err
    rc, out, err = main(capsys, GRAPH, "--resume", run, "--max-steps", "8", "--set", "counter.count=50",
                        "--set", "counter.delay_s=0", "--allow-changed-settings")
    assert rc == 0, err
    settings = json.loads((run / "config.json").read_text())
    assert (settings["counter.count"], settings["counter.delay_s"], settings["save_interval"]) == (50, 0.0, 2)

    # A damaged latest checkpoint: one line, exit 2, the intact one to use; nothing started.
    tensors = run / "checkpoints" / "step_8" / "tally" / checkpoint.TENSORS
    tensors.write_bytes(tensors.read_bytes()[:5])
    rc, out, err = main(capsys, GRAPH, "--resume", run, "--max-steps", "10")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "its latest checkpoint step_8 is damaged (tally/tensors.safetensors is truncated (5 bytes: not even " \
           f"its header)); resume from the newest intact one instead: --resume {run / 'checkpoints' / 'step_6'}" in err


def test_resume_with_kl_switched_on_then_off_trains_with_the_coefficient_it_names(capsys, ray_instance, tmp_path):
    """GRPO without KL has no reference node. Resumed with --set learner.kl.coef=0.05 it gains one,
    and its steps train with 0.05 (a fixed KL coefficient is a setting: the checkpoint's 0 must not
    come back with the learner's state); resumed again with 0, the reference goes and so does KL."""
    run = tmp_path / "run"
    tiny = ["--set", "prompts_per_step=4", "--set", "group_size=4", "--set", "learner.minibatch_size=8",
            "--set", "max_staleness=0", "--set", "save_interval=2"]
    for coef, steps in (("0", 2), ("0.05", 4), ("0", 6)):
        resume = ["--resume", run] if steps > 2 else [*tiny, "--out", run]
        rc, out, err = main(capsys, "graphs/grpo.py", *resume, "--set", f"learner.kl.coef={coef}",
                            "--max-steps", steps)
        assert rc == 0, err
        assert ("reference" in json.loads((run / "processes.json").read_text())) == (coef != "0")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"]: r for r in records if "kl_coef" in r}
    assert sorted(trained) == [1, 2, 3, 4, 5, 6]
    assert [trained[s]["kl_coef"] for s in range(1, 7)] == [0.0, 0.0, 0.05, 0.05, 0.0, 0.0]
    assert [("kl" in trained[s]) for s in range(1, 7)] == [False, False, True, True, False, False]
