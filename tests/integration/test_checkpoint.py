"""Checkpoints (dataflow/actor/checkpoint.py): exact round trips without pickle, atomic commits, and
on a real Ray instance: 3 steps + resume + 3 steps == 6 steps bit for bit, the metrics file
continuing with no gap or repeat, and a checkpoint on interrupt. One Ray instance for the module."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


from dataflow.actor import checkpoint, snapshots  # noqa: E402
from dataflow.driver import checkpointer  # noqa: E402
from dataflow.driver.runtime import RunOptions, load_graph, run_graph  # noqa: E402
from tests.conftest import run_then_interrupt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# ---- state files, no Ray ----------------------------------------------------------------------------
def _trained_model_and_optimizer():
    from rl.model.causal_lm import ModelConfig, build_policy
    from rl.data.tasks import build_tokenizer

    model = build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, intermediate_size=64), build_tokenizer())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    return model, opt


def test_state_round_trips_exactly_and_is_json_plus_safetensors(tmp_path):
    model, opt = _trained_model_and_optimizer()
    rng = random.Random(7)
    rng.random()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng.getstate(),
             "int_keys": {3: "a", 10: [1.5, float("inf")]}, "tuple": (1, (2, "x")), "nan": float("nan"),
             "array": np.arange(6, dtype=np.float32).reshape(2, 3), "bf16": torch.ones(3, dtype=torch.bfloat16),
             "__tensor__": "a key that looks like a tag", "pending": [(4, {"ids": [1, 2]})]}
    checkpoint.write_state(tmp_path / "node", {"node": state, "rng": checkpoint.rng_state()})
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == ["state.json", "tensors.safetensors"]
    back = checkpoint.read_state(tmp_path / "node")["node"]

    # tensors sharing storage (tied embedding and LM head) are stored once
    shared = torch.arange(4.0)
    tree, stored = checkpoint.pack({"a": shared, "b": shared, "view": shared[1:]})
    assert len(stored) == 2 and tree["a"] == tree["b"] != tree["view"]
    for k, v in model.state_dict().items():
        assert torch.equal(back["model"][k], v) and back["model"][k].dtype == v.dtype, k
    clone, clone_opt = _trained_model_and_optimizer()
    clone_opt.load_state_dict(back["optimizer"])
    for (k, a), b in zip(opt.state_dict()["state"].items(), clone_opt.state_dict()["state"].values()):
        assert all(torch.equal(a[name], b[name]) for name in a), k
    assert back["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]
    restored = random.Random()
    restored.setstate(back["rng"])
    assert restored.random() == rng.random()
    assert back["int_keys"] == {3: "a", 10: [1.5, float("inf")]} and back["tuple"] == (1, (2, "x"))
    assert math.isnan(back["nan"]) and back["__tensor__"] == "a key that looks like a tag"
    assert np.array_equal(back["array"], state["array"]) and back["bf16"].dtype == torch.bfloat16
    assert back["pending"] == [(4, {"ids": [1, 2]})]
    with pytest.raises(TypeError, match="cannot save a object"):
        checkpoint.pack({"x": object()})


def test_a_captured_state_is_a_copy_that_training_does_not_change(tmp_path):
    """async_checkpoint writes from pack(copy=True) after training has gone on: the files hold the
    state as it was when captured. Without the copy a CPU tensor is the live one."""
    model, opt = _trained_model_and_optimizer()
    before = {"model": {k: v.clone() for k, v in model.state_dict().items()},
              "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()]}
    captured = checkpoint.pack({"model": model.state_dict(), "optimizer": opt.state_dict()}, copy=True)
    aliased = checkpoint.pack({"model": model.state_dict()})
    model(torch.tensor([[3, 2, 1]])).logits.sum().backward()
    opt.step()  # in place: what the learner's next step does while the write runs
    checkpoint.write_packed(tmp_path / "node", *captured)
    back = checkpoint.read_state(tmp_path / "node")
    assert all(torch.equal(back["model"][k], v) for k, v in before["model"].items())
    assert all(torch.equal(a, back["optimizer"]["state"][i]["exp_avg"]) for i, a in enumerate(before["exp_avg"]))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before["model"][k])]
    assert changed and not torch.equal(aliased[1][aliased[0]["model"][changed[0]]["__tensor__"]], before["model"][changed[0]])


def test_captures_with_staging_reuse_their_buffers_and_hold_each_state(tmp_path):
    """async_checkpoint captures copy into the buffers of the previous capture (pack's staging):
    the second capture of the same layout allocates nothing, holds the state as it was at the
    second capture, and a tensor whose shape changed gets a buffer of its own."""
    model, opt = _trained_model_and_optimizer()
    staging: dict = {}
    first_tree, first = checkpoint.pack({"model": model.state_dict(), "optimizer": opt.state_dict()}, True, staging)
    buffers = {name: t.data_ptr() for name, t in first.items()}
    assert len(staging) == len(first) and all(staging[n] is t for n, t in first.items())
    model(torch.tensor([[3, 2, 1]])).logits.sum().backward()
    opt.step()
    now = {"model": {k: v.clone() for k, v in model.state_dict().items()},
           "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()]}
    tree, second = checkpoint.pack({"model": model.state_dict(), "optimizer": opt.state_dict()}, True, staging)
    assert tree == first_tree and {n: t.data_ptr() for n, t in second.items()} == buffers
    opt.step()  # training goes on while the write runs
    checkpoint.write_packed(tmp_path / "node", tree, second)
    back = checkpoint.read_state(tmp_path / "node")
    assert all(torch.equal(back["model"][k], v) for k, v in now["model"].items())
    assert all(torch.equal(a, back["optimizer"]["state"][i]["exp_avg"]) for i, a in enumerate(now["exp_avg"]))
    grown = checkpoint.pack({"w": torch.ones(5)}, True, staging)[1]["t0"]
    assert torch.equal(grown, torch.ones(5)) and grown.data_ptr() != buffers["t0"] and staging["t0"] is grown


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    tmp = checkpoint.begin(run, 2)
    checkpoint.write_state(tmp / "learner", {"w": torch.ones(2)})
    done = checkpoint.commit(tmp, {"graph": "g", "step": 2})
    assert done == run / "checkpoints" / "step_2" and not tmp.exists()

    tmp = checkpoint.begin(run, 4)  # the save of step 4 "crashes" after one replica wrote
    checkpoint.write_state(tmp / "learner", {"w": torch.zeros(2)})
    assert checkpoint.latest(run) == done
    assert checkpoint.resolve(run) == done and checkpoint.resolve(done) == done
    with pytest.raises(Exception, match="neither a checkpoint"):
        checkpoint.resolve(tmp)

    tmp = checkpoint.begin(run, 4)  # the next save of step 4 starts clean and commits
    assert not (tmp / "learner").exists()
    checkpoint.write_state(tmp / "learner", {"w": torch.full((2,), 4.0)})
    committed = checkpoint.commit(tmp, {"graph": "g", "step": 4})
    assert checkpoint.latest(run) == committed == run / "checkpoints" / "step_4"
    # saving a step again (a resumed run) replaces the old directory as a whole
    tmp = checkpoint.begin(run, 2)
    checkpoint.write_state(tmp / "learner", {"w": torch.full((2,), 2.0)})
    checkpoint.commit(tmp, {"graph": "g", "step": 2})
    assert torch.equal(checkpoint.read_state(run / "checkpoints" / "step_2" / "learner")["w"], torch.full((2,), 2.0))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_4"]


class _Remote:
    """Stands in for an actor method handle: .remote() returns an awaitable, as Ray's does."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args[:2])  # (directory, step); a synchronous save
        return call()


class _Host:
    def __init__(self, save_state):
        self.save_state = _Remote(save_state)


def test_a_replica_killed_mid_save_keeps_its_previous_state_not_its_half_written_one(tmp_path):
    """The critic dies while writing its part of step 4 (CI caught this: the copy of its step-2
    state then hit the half-written directory). Its part of step 4 is step 2's, whole."""
    from ray.exceptions import RayActorError

    run = tmp_path / "run"

    def saver(value):
        def save_state(directory, step):
            checkpoint.write_state(directory, {"w": torch.full((2,), value), "step": step})
            return {"saved": True, "step": step}
        return save_state

    def dies_mid_write(directory, step):
        Path(directory).mkdir(parents=True)
        (Path(directory) / "tensors.safetensors").write_bytes(b"half")
        raise RayActorError()

    step_2 = asyncio.run(checkpointer.save({"learner": _Host(saver(2.0)), "critic": _Host(saver(2.0))}, ["learner"],
                                         run, 2, {"graph": "g"}))
    step_4 = asyncio.run(checkpointer.save({"learner": _Host(saver(4.0)), "critic": _Host(dies_mid_write)},
                                         ["learner"], run, 4, {"graph": "g"}, previous=step_2))
    assert checkpoint.read_manifest(step_4)["stale"] == {"critic": 2}
    assert torch.equal(checkpoint.read_state(step_4 / "critic")["w"], torch.full((2,), 2.0))
    assert torch.equal(checkpoint.read_state(step_4 / "learner")["w"], torch.full((2,), 4.0))
    # no earlier checkpoint to take it from: the replica has no state in step 4 (it starts fresh)
    step_4 = asyncio.run(checkpointer.save({"learner": _Host(saver(4.0)), "critic": _Host(dies_mid_write)},
                                         ["learner"], tmp_path / "other", 4, {"graph": "g"}))
    assert checkpoint.replica_state_dir(step_4, "critic") is None and not (step_4 / "critic").exists()


def test_keep_checkpoints_deletes_older_ones_after_a_newer_commits(tmp_path):
    run = tmp_path / "run"

    def save(step):
        tmp = checkpoint.begin(run, step)
        checkpoint.write_state(tmp / "learner", {"step": step})
        path = checkpoint.commit(tmp, {"graph": "g", "step": step})
        return path, checkpoint.prune(run, 2, path)

    names = lambda: sorted(p.name for p in (run / "checkpoints").iterdir())  # noqa: E731
    for step in (2, 4):
        assert save(step)[1] == []
    assert save(6)[1] == [run / "checkpoints" / "step_2"] and names() == ["step_4", "step_6"]
    # A run resumed from step_4 of a longer one: its own step_6 replaces the old one and step_4,
    # the one it resumed from, stays until a newer one (step_8) exists; a crashed save's .tmp is left.
    checkpoint.begin(run, 10)
    assert save(6)[1] == [] and names() == ["step_10.tmp", "step_4", "step_6"]
    assert save(8)[1] == [run / "checkpoints" / "step_4"] and names() == ["step_10.tmp", "step_6", "step_8"]
    assert checkpoint.prune(run, 0, run / "checkpoints" / "step_8") == []  # 0 keeps all
    with pytest.raises(Exception, match=r"keep_checkpoints=-1: must be >= 0 \(0 keeps every checkpoint\)"):
        load_graph(str(ROOT / "graphs/ppo.py"), ["keep_checkpoints=-1"])


def test_a_restarted_replica_loads_the_newer_of_its_snapshot_and_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    tmp = checkpoint.begin(run, 4)
    checkpoint.write_state(tmp / "critic", {"node": {"progress": 4, "w": torch.zeros(2)}})
    last = checkpoint.commit(tmp, {"graph": "g", "step": 4})
    assert snapshots.restore_dir(run, last, "critic") == last / "critic"  # no snapshot yet
    snapshots.write_snapshot(run, "critic", {"progress": 6, "w": torch.ones(2)})
    snapshots.write_snapshot(run, "critic", {"progress": 7, "w": torch.full((2,), 7.0)})  # replaces it
    assert snapshots.restore_dir(run, last, "critic") == run / "snapshots" / "critic"
    assert snapshots.restore_dir(run, None, "critic") == run / "snapshots" / "critic"
    assert torch.equal(checkpoint.read_state(run / "snapshots" / "critic")["node"]["w"], torch.full((2,), 7.0))
    assert sorted(p.name for p in (run / "snapshots").iterdir()) == ["critic"]
    snapshots.write_snapshot(run, "critic", {"progress": 4, "w": torch.ones(2)})  # not newer: the checkpoint
    assert snapshots.restore_dir(run, last, "critic") == last / "critic"
    snapshots.clear_snapshots(run)  # a new (or resumed) run never loads an earlier run's snapshot
    assert snapshots.restore_dir(run, last, "critic") == last / "critic"
    assert snapshots.restore_dir(run, last, "generator") is None


def test_metrics_continue_from_the_checkpoint_step(tmp_path):
    lines = [{"step": 1}, {"node": "critic", "x": 1}, {"step": 2}, {"node": "critic", "x": 2}, {"step": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "cut')
    checkpoint.continue_metrics(tmp_path / "metrics.jsonl", tmp_path / "out.jsonl", 2)
    assert [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()] == lines[:3]


# ---- real runs ----------------------------------------------------------------------------------------


# Synchronous PPO, small, with the default batched calls (batches form by arrival: the resumed run
# matches within RESUME_TOL; dataflow/actor/checkpoint.py says why). The generator's static decoder
# draws its noise per prompt, so a prompt samples the same tokens whatever shares its batch.
SYNC = ("max_staleness=0", "prompts_per_step=16", "channel_capacity=16", "learner.minibatch_size=8",
        "critic.minibatch_size=8", "policy.model.n_layer=1",
        "policy.model.n_embd=64", "policy.model.intermediate_size=128", "learner.kl.kind=adaptive",
        "save_interval=3")
RESUME_TOL = 1e-5  # largest |difference| of a weight after 3 resumed steps; measured: see the test


def run(out: Path, *overrides: str, max_steps: int, resume: Path | None = None):
    graph, config = load_graph(str(ROOT / "graphs/ppo.py"), list(overrides))
    options = RunOptions(max_steps=max_steps, out_dir=str(out), quiet=True,
                         resume=str(resume) if resume else None)
    return asyncio.run(run_graph(graph, options, config))


def steps_of(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "step" in r]


def node_tensors(directory: Path) -> dict:
    """The tensors of a replica's saved node state (not its process RNG states), by key path."""
    found = {}

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            found[path] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")

    walk(checkpoint.read_state(directory)["node"], "")
    return found


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())


def test_resume_continues_the_run_and_metrics_have_no_gap(ray_instance, tmp_path):
    """6 steps straight (checkpoints at 3 and 6); then from its step-3 checkpoint, in another
    directory, a resumed run that goes on until Ctrl-C after step 8: its steps 4-6 have the same
    samples and rewards, and its step-6 checkpoint the same weights, optimizer and critic state
    within rounding (RESUME_TOL), far below what 3 steps of training change; the interrupt saves a
    checkpoint of the learner's last step. (One resumed run serves both: a graph start-up less.)"""
    straight = tmp_path / "straight"
    run(straight, *SYNC, "async_checkpoint=true", max_steps=6)  # resumed from a checkpoint written in the background
    ckpt = straight / "checkpoints" / "step_3"
    manifest = checkpoint.read_manifest(ckpt)
    assert manifest["step"] == 3 and manifest["graph"] == "ppo" and manifest["reason"] == "interval"
    assert {p.name for p in ckpt.iterdir()} == {"manifest.json", "prompts", "generator", "reward", "reference",
                                                 "critic", "learner"}
    assert all(p.suffix in (".json", ".safetensors") for p in ckpt.rglob("*") if p.is_file())
    assert (straight / "final" / "model.safetensors").is_file()

    # Ctrl-C / SIGTERM (the CLI cancels the driver task) after step 8 of the resumed run. Nothing
    # of steps 1-6 depends on max_steps (run_then_interrupt's is 100): the lr schedule is constant,
    # and in synchronous mode the step-6 checkpoint is taken before batch 6 is admitted.
    resumed = tmp_path / "resumed"
    run_then_interrupt("graphs/ppo.py", list(SYNC), resumed, after_steps=8, resume=str(ckpt))
    resumed_steps, straight_steps = steps_of(resumed), steps_of(straight)
    assert [r["step"] for r in resumed_steps][:6] == [1, 2, 3, 4, 5, 6]  # no gap, no repeat
    assert resumed_steps[:3] == straight_steps[:3]  # carried over from the checkpoint's run
    for a, b in zip(resumed_steps[3:6], straight_steps[3:6], strict=True):
        assert (a["reward/mean"], a["version"]) == (b["reward/mean"], b["version"])  # the same samples
        for key in ("kl", "entropy", "kl_coef", "losses/policy", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-7), (a["step"], key, a[key], b[key])
    # The same state at step 6 within RESUME_TOL (the learner's holds the policy weights); 3 steps
    # of training move the weights by far more than that, so a resume that lost the optimizer, the
    # KL controller, an RNG or the data position would fail.
    assert checkpoint.read_manifest(resumed / "checkpoints" / "step_6")["reason"] == "interval"
    learner_diff = max_difference(node_tensors(resumed / "checkpoints" / "step_6" / "learner"),
                                  node_tensors(straight / "checkpoints" / "step_6" / "learner"))
    critic_diff = max_difference(node_tensors(resumed / "checkpoints" / "step_6" / "critic"),
                                 node_tensors(straight / "checkpoints" / "step_6" / "critic"))
    trained = max_difference({k: v for k, v in node_tensors(ckpt / "learner").items() if "/model/" in k},
                             {k: v for k, v in node_tensors(straight / "checkpoints" / "step_6" / "learner").items()
                              if "/model/" in k})
    print(f"resume vs straight: learner state {learner_diff:.3g}, critic state {critic_diff:.3g}; "
          f"steps 4-6 moved the weights by {trained:.3g}")
    assert max(learner_diff, critic_diff) <= RESUME_TOL and trained > 100 * RESUME_TOL
    assert checkpoint.read_state(resumed / "checkpoints" / "step_6" / "prompts")["node"] == {"position": 96}

    last = checkpoint.latest(resumed)
    manifest = checkpoint.read_manifest(last)
    assert manifest["reason"] == "interrupt" and manifest["step"] >= 8, manifest
    assert [r["step"] for r in steps_of(resumed)][:manifest["step"]] == list(range(1, manifest["step"] + 1))
    learner = checkpoint.read_state(last / "learner")
    assert learner["node"]["step"] == manifest["step"] == learner["steps"]


# ---- async_checkpoint on tests/graphs/checkpoint_probe.py: a checkpoint every step ------------------------
def run_probe(out: Path, *overrides: str):
    graph, config = load_graph(str(ROOT / "tests/graphs/checkpoint_probe.py"), list(overrides))
    return asyncio.run(run_graph(graph, RunOptions(out_dir=str(out), quiet=True), config))


def test_every_checkpoint_holds_its_step_both_modes_write_the_same_files_and_a_request_is_served_at_once(
        ray_instance, tmp_path, monkeypatch):
    """6 steps, a checkpoint after each, keep_checkpoints=2. With async_checkpoint the probe's next
    in-place update runs while the last checkpoint is written, one save waits for the previous
    commit, and the run ends only after the last commit: step_5 and step_6 hold exactly w after
    5 and 6 steps, nothing half-written is left, and the files are the synchronous run's.
    The async run also shows that the driver's loop wakes when a node asks for a checkpoint
    (Checkpointer.watch_requests), not only every POLL_INTERVAL_S: with the interval at 60 s, its
    six checkpoints, one per step, each wait far less than it (before, each waited for the next poll)."""
    from dataflow.driver import runtime

    for mode in ("async", "sync"):
        if mode == "async":
            monkeypatch.setattr(runtime, "POLL_INTERVAL_S", 60.0)
        t = time.perf_counter()
        summary = run_probe(tmp_path / mode, f"async_checkpoint={mode == 'async'}")
        seconds = time.perf_counter() - t
        monkeypatch.undo()
        assert summary.steps == 6
        if mode == "async":
            assert (tmp_path / mode / "checkpoints" / "step_6").is_dir()
            assert seconds < 60, seconds
        names = sorted(p.name for p in (tmp_path / mode / "checkpoints").iterdir())
        assert names == ["step_5", "step_6"], names  # pruned as they committed, no .tmp left
        for step in (5, 6):
            state = checkpoint.read_state(tmp_path / mode / "checkpoints" / f"step_{step}" / "probe")
            assert state["node"]["step"] == state["steps"] == step
            assert torch.equal(state["node"]["w"], torch.full((1 << 22,), float(sum(range(step)))))
        records = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        blocked = [r["timing/checkpoint_blocked_s"] for r in records if "timing/checkpoint_blocked_s" in r]
        print(f"{mode}: probe blocked per checkpoint: {', '.join(f'{b * 1e3:.0f}' for b in blocked)} ms")
        assert len(blocked) == 6
        if mode == "async":   # far below the 60 s poll, with room for a loaded machine's first save
            assert max(blocked) < 30, blocked
    # The same deterministic graph: the same node state in both modes (the processes' RNG states,
    # saved beside it, are unseeded here and differ between any two runs).
    for step in (5, 6):
        for part in ("probe", "counter"):
            a, b = (tmp_path / m / "checkpoints" / f"step_{step}" / part for m in ("sync", "async"))
            ta, tb = node_tensors(a), node_tensors(b)
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
            ja, jb = (json.loads((d / checkpoint.STATE_JSON).read_text()) for d in (a, b))
            assert (ja["node"], ja["steps"], ja["rng"].keys()) == (jb["node"], jb["steps"], jb["rng"].keys())


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_failed_write_stops_the_run_and_leaves_the_previous_checkpoint(ray_instance, tmp_path, mode):
    """The probe's state at step 3 cannot be written (a complex tensor): in both modes the run
    stops naming the probe and the failed checkpoint, step_2 stays the latest and step_3.tmp is
    left unread."""
    from dataflow.errors import NodeFailed

    with pytest.raises(NodeFailed) as e:
        run_probe(tmp_path, f"async_checkpoint={mode == 'async'}", "probe.unsaveable_at=3")
    assert e.value.node == "probe" and "checkpoint of step 3 failed: " in str(e.value), str(e.value)
    assert checkpoint.latest(tmp_path) == tmp_path / "checkpoints" / "step_2"
    assert (tmp_path / "checkpoints" / "step_3.tmp").is_dir()
    assert e.value.last_checkpoint == str(tmp_path / "checkpoints" / "step_2")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_node_killed_during_a_save_stops_the_run_at_once_and_the_save_is_not_committed(
        ray_instance, tmp_path, mode):
    """kill -9 of the probe (the run-ending node) while the checkpoint of step 2 is being taken
    (its state is, the counter's capture takes 30 s): the driver reports the probe's dead process
    at once, not once the save is over, and abandons the save: step_2.tmp is left unread and
    step_1 is the checkpoint to resume from."""
    from tests.conftest import kill_stops_the_run, run_in_thread, wait_until

    graph, config = load_graph(str(ROOT / "tests/graphs/checkpoint_probe.py"), [
        f"async_checkpoint={mode == 'async'}", "counter.slow_save_at=2"])
    thread, outcome = run_in_thread(graph, config, RunOptions(out_dir=str(tmp_path), quiet=True))
    wait_until(lambda: (tmp_path / "counter_saving").exists(), 120, "the save of step 2", thread, outcome)
    pid = json.loads((tmp_path / "processes.json").read_text())["probe"]
    error = kill_stops_the_run(pid, "probe", thread, outcome, within_s=10)
    assert not (tmp_path / "checkpoints" / "step_2").exists()
    assert (tmp_path / "checkpoints" / "step_2.tmp").is_dir()
    assert error.last_checkpoint == str(tmp_path / "checkpoints" / "step_1") == str(checkpoint.latest(tmp_path))
