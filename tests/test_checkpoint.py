"""Checkpoints (dataflow/checkpoint.py): exact round trips without pickle, atomic commits, and
on a real Ray instance: 3 steps + resume + 3 steps == 6 steps bit for bit, the metrics file
continuing with no gap or repeat, and a checkpoint on interrupt. One Ray instance for the module."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from dataflow import checkpoint  # noqa: E402
from dataflow.runtime import RunOptions, load_graph, run_graph  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# ---- state files, no Ray ----------------------------------------------------------------------------
def _trained_model_and_optimizer():
    from nodes.models import ModelConfig, build_policy
    from nodes.tasks import build_tokenizer

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


def test_metrics_continue_from_the_checkpoint_step(tmp_path):
    lines = [{"step": 1}, {"node": "critic", "x": 1}, {"step": 2}, {"node": "critic", "x": 2}, {"step": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "cut')
    checkpoint.continue_metrics(tmp_path / "metrics.jsonl", tmp_path / "out.jsonl", 2)
    assert [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()] == lines[:3]


# ---- real runs ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_instance():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}})
    yield
    ray.shutdown()


# Synchronous PPO, small; one item per batched call, so every number is reproducible (checkpoint.py).
SYNC = ("max_staleness=0", "prompts_per_step=16", "channel_capacity=16", "learner.minibatch_size=8",
        "critic.minibatch_size=8", "generator.prompts_per_call=1", "reference.items_per_call=1",
        "critic.items_per_call=1", "policy.model.n_layer=1", "policy.model.n_embd=64",
        "policy.model.intermediate_size=128", "learner.kl.kind=adaptive", "save_interval=3")


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


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_continues_bit_for_bit_and_metrics_have_no_gap(ray_instance, tmp_path):
    """6 steps straight (checkpoints at 3 and 6); then from its step-3 checkpoint, 3 more steps
    in another directory: the same metrics, weights, optimizer and critic state, bit for bit."""
    straight = tmp_path / "straight"
    run(straight, *SYNC, max_steps=6)
    ckpt = straight / "checkpoints" / "step_3"
    manifest = checkpoint.read_manifest(ckpt)
    assert manifest["step"] == 3 and manifest["graph"] == "ppo" and manifest["reason"] == "interval"
    assert {p.name for p in ckpt.iterdir()} == {"manifest.json", "prompts", "generator", "reward", "reference",
                                                 "critic", "learner"}
    assert all(p.suffix in (".json", ".safetensors") for p in ckpt.rglob("*") if p.is_file())

    resumed = tmp_path / "resumed"
    summary = run(resumed, *SYNC, max_steps=6, resume=ckpt)
    assert summary.steps == 6 and summary.artifacts["last checkpoint"] == str(resumed / "checkpoints" / "step_6")
    resumed_steps, straight_steps = steps_of(resumed), steps_of(straight)
    assert [r["step"] for r in resumed_steps] == [1, 2, 3, 4, 5, 6]  # no gap, no repeat
    assert resumed_steps[:3] == straight_steps[:3]  # carried over from the checkpoint's run
    for a, b in zip(resumed_steps[3:], straight_steps[3:]):
        for key in ("reward/mean", "kl", "entropy", "kl_coef", "losses/policy", "grad_norm", "version"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    # the same weights, optimizer state and critic, bit for bit
    assert_same_tensors(load_file(str(resumed / "final" / "model.safetensors")),
                        load_file(str(straight / "final" / "model.safetensors")))
    for node in ("learner", "critic"):
        assert_same_tensors(node_tensors(resumed / "checkpoints" / "step_6" / node),
                            node_tensors(straight / "checkpoints" / "step_6" / node))
    assert checkpoint.read_state(resumed / "checkpoints" / "step_6" / "prompts")["node"] == {"position": 96}

    # Ctrl-C / SIGTERM (the CLI cancels the driver task): a checkpoint of the learner's last step.
    async def interrupted():
        graph, config = load_graph(str(ROOT / "graphs/ppo.py"), list(SYNC))
        task = asyncio.ensure_future(run_graph(graph, RunOptions(max_steps=100, out_dir=str(resumed), quiet=True,
                                                                 resume=str(resumed)), config))
        while not task.done() and len(steps_of(resumed)) < 8:
            await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    last = checkpoint.latest(resumed)
    manifest = checkpoint.read_manifest(last)
    assert manifest["reason"] == "interrupt" and manifest["step"] >= 8, manifest
    assert [r["step"] for r in steps_of(resumed)][:manifest["step"]] == list(range(1, manifest["step"] + 1))
    learner = checkpoint.read_state(last / "learner")
    assert learner["node"]["step"] == manifest["step"] == learner["steps"]
