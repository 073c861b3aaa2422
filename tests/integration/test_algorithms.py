"""Every algorithm setting of the learner (docs/algorithms.md) run end to end: the real GRPO
graph on a real Ray instance, a few steps of the built-in task, each run checking what its
settings must show in metrics.jsonl. Tiny batches: each run takes seconds. Every run is synchronous
(max_staleness=0) and traced, so each also checks that mode's versions and the trace's contents."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from dataflow.driver.runtime import RunOptions, load_graph, run_graph
from rl.data.tasks import make_task

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("ray_instance")  # one Ray for the module (tests/conftest.py)

MAX_TOKENS = make_task().max_new_tokens    # the built-in task's response cap (graphs' default)
TINY = ["prompts_per_step=4", "group_size=4", "channel_capacity=16", "learner.minibatch_size=8",
        "max_staleness=0", f"learner.max_new_tokens={MAX_TOKENS}"]


def run(graph_file: str, tmp_path: Path, overrides: list[str], max_steps: int, turns: bool = False) -> list[dict]:
    """`turns`: the generator and the learner take turns on the device as the memory plan's phase
    switch makes them (the plan sets it only on GPU placements; here the lock file is given by hand)."""
    trace = tmp_path / "trace.json"
    graph, config = load_graph(str(ROOT / graph_file), overrides)
    if turns:
        graph.nodes["generator"].gpu_turn = graph.nodes["learner"].gpu_turn = str(tmp_path / "gpu.lock")
    summary = asyncio.run(run_graph(graph, RunOptions(max_steps=max_steps, out_dir=str(tmp_path), quiet=True,
                                                      trace_path=str(trace)), config))
    assert summary.status in ("done", "max steps reached"), summary.status
    # Where each node's setup went: the spans its setup opened, as start-up parts.
    parts = {"setup/learner/import transformers", "setup/learner/load model", "setup/learner/weight sync setup",
             "setup/generator/import transformers", "setup/generator/load model",
             "setup/prompts/load tokenizer", "setup/reward/load tokenizer"}
    assert parts <= summary.startup.keys() and all(summary.startup[p] >= 0 for p in parts), summary.startup
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert len(steps) == max_steps
    reference = "learner.kl.coef=0" not in overrides   # KL coefficient 0: no reference node, no KL stat
    for r in steps:   # every optimizer step ran, with finite losses
        assert r["updates/skipped"] == 0, r
        assert all(math.isfinite(r[k]) for k in ("losses/policy", "entropy", "lr", "grad_norm")), r
        assert math.isfinite(r["kl"]) if reference else "kl" not in r and "losses/kl" not in r, r
    # Synchronous mode (max_staleness=0): step k trains only on samples of version k - 1.
    assert [r["step"] for r in steps] == list(range(1, max_steps + 1))
    assert all(r["staleness/max"] == 0 for r in steps)
    assert [r["version"] for r in steps] == list(range(1, max_steps + 1))
    doc = json.loads(trace.read_text())
    check_trace(doc, reference)
    if turns:
        check_turns(records, doc, max_steps)
    return steps


def check_trace(doc: dict, reference: bool) -> None:
    """The trace of a GRPO run holds every node, with its unit-of-work slices and the run's counters."""
    events = doc["traceEvents"]
    pid_name = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    slices = {(pid_name[e["pid"]], e["name"]) for e in events if e["ph"] == "X"}
    for node, work in [("generator", "generate"), ("reward", "score"), ("learner", "train step"),
                       ("learner", "weight push send")] + [("reference", "reference forward")] * reference:
        assert (node, work) in slices, (node, work)
    assert {"prompts", "generator", "reward", "learner"} <= set(pid_name.values())
    assert ("reference" in pid_name.values()) == reference
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"queue depth", "staleness", "samples in flight"} <= counters


def spans(doc: dict, node: str, name: str) -> list[tuple[float, float]]:
    events = doc["traceEvents"]
    pid = next(e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name" and e["args"]["name"] == node)
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["pid"] == pid and e["name"] == name)


def check_turns(records: list[dict], doc: dict, max_steps: int) -> None:
    """The phase switch (rl/model/gpu_turns.py): the static decoder frees its KV cache each time its
    slots run empty, the learner waits for it and frees its step's memory after, and no decode step
    runs while the learner's update holds the device."""
    trained = [r for r in records if "step" in r]
    assert all(r["learner/gpu_turn_wait_s"] >= 0 and r["learner/free_s"] >= 0 for r in trained)
    frees = [r for r in records if "generator/kv_free_s" in r]
    allocs = [r for r in records if "generator/kv_alloc_s" in r]
    assert len(frees) >= max_steps and len(allocs) >= max_steps   # the cache went and came back every step
    waits, freed = spans(doc, "learner", "wait for the GPU"), spans(doc, "learner", "free activations")
    assert len(waits) == len(freed) == max_steps
    updates = [(w[1], f[1]) for w, f in zip(waits, freed)]       # the learner holds its turn in between
    decoding = spans(doc, "generator", "decode steps") + spans(doc, "generator", "prefill")
    assert decoding and len(spans(doc, "generator", "free KV cache")) >= max_steps
    for start, end in updates:
        assert not [d for d in decoding if d[0] < end and d[1] > start], (start, end)


def check_dapo(steps):
    # warmup then cosine over the run's 3 steps: lr 0, then 1e-3 x cos schedule
    assert [round(r["lr"] / 1e-3, 6) for r in steps] == [0.0, 1.0, 0.5]
    assert all(r["reward/overlong_penalty"] <= 0 for r in steps)
    assert all("samples/masked_truncated" in r for r in steps)


def check_dr_grpo(steps):
    assert [round(r["lr"] / 1e-3, 6) for r in steps] == [1.0, 0.75]     # linear over 4 steps
    assert all("losses/clipfrac_lower" in r for r in steps)


def check_kl_in_reward(steps):
    # the adaptive controller is fed the rollout's KL, so the coefficient moves from step to step
    assert all("kl/rollout" in r and r["kl"] == r["kl/rollout"] for r in steps)
    assert steps[1]["kl_coef"] != steps[0]["kl_coef"]


CASES = {
    "dapo: clip-higher + overlong shaping + truncation mask; grpo without std; no KL, so no reference node; "
    "warmup + cosine; micro-batches": (
        ["learner.kl.coef=0", "learner.clip_eps_low=0.2", "learner.clip_eps_high=0.28", "learner.overlong_buffer=1",
         "learner.mask_truncated=true", "learner.grpo_std_scaling=false", "learner.schedule.warmup_steps=1",
         "learner.schedule.decay=cosine", "learner.micro_batch_size=3"], 3, check_dapo),
    "dr_grpo (seq-mean-token-sum-norm) + dual_clip + k1, linear decay": (
        ["learner.advantage=dr_grpo", "learner.policy_loss=dual_clip", "learner.kl.estimator=k1",
         "learner.schedule.decay=linear", "learner.schedule.total_steps=4"], 2, check_dr_grpo),
    "rloo + reinforce + seq-mean-token-sum + adaptive KL in the reward (k2), AdamW settings": (
        ["learner.advantage=rloo", "learner.policy_loss=reinforce", "learner.loss_agg_mode=seq-mean-token-sum",
         "learner.kl.placement=reward", "learner.kl.kind=adaptive", "learner.kl.estimator=k2",
         "learner.kl.horizon=10", "learner.weight_decay=0.0", "learner.betas=0.9,0.95"], 2, check_kl_in_reward),
    "reinforce_pp + gspo (seq-mean-token-mean) + KL in the reward; the static decoder and the learner "
    "taking turns on the device (the phase switch)": (
        ["learner.advantage=reinforce_pp", "learner.policy_loss=gspo", "learner.kl.placement=reward",
         "learner.kl.kind=adaptive", "learner.kl.horizon=10", "learner.gamma=0.99", "generator.backend=static"],
        2, check_kl_in_reward),
}
TURNS = {name for name in CASES if "phase switch" in name}


@pytest.mark.parametrize("name", list(CASES))
def test_grpo_graph_runs_each_algorithm_setting(tmp_path, name):
    overrides, max_steps, check = CASES[name]
    check(run("graphs/grpo.py", tmp_path, [*TINY, *overrides], max_steps, turns=name in TURNS))


# The PPO graph's KL at the start at a sampling temperature (policy = reference, T=0.7): checked on
# the user-model run of tests/integration/test_ppo_graph.py, which runs the PPO graph synchronously anyway.
