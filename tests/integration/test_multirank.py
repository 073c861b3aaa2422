"""The learner and critic as dp x tp ranks (dataflow/weights/multirank.py): one PPO update and one critic
value pass + update in 2 and 4 gloo processes equal the one-rank ones; graph runs with learner
dp=2 / tp=2 deliver the learner's full weights to the generators (object store and HybridEngine
push), and multi-rank learner and critic checkpoint on Ctrl-C in the one-rank format.

Function level: processes are forked (the parent already imported torch and transformers) and
train in float64, so the only differences from one rank are summation orders.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dataflow.weights.layout import ParallelLayout, build_mesh
from dataflow.weights.multirank import TrainRanks
from nodes.impl.learner import LearnerConfig, ppo_update, step_advantages
from rl.model.causal_lm import ModelConfig, build_policy
from rl.generation.hf_sampling import sample_responses
from nodes.impl.reference import add_logprobs
from rl.data.tasks import build_tokenizer, make_task, score
from tests.gloo import join_world

MODEL = ModelConfig(n_layer=2, n_embd=32, n_head=4, intermediate_size=64)   # every TP dim divides by 2


def _samples():
    tok = build_tokenizer()
    model = build_policy(MODEL, tok)
    task = make_task("copy", 3)
    prompts = task.take(7)
    ids = [tok(p["prompt"])["input_ids"] for p in prompts for _ in range(2)]
    samples = sample_responses(model, tok, ids, task.max_new_tokens, seed=0)
    items = [{"samples": samples[2 * i:2 * i + 2], "fields": p} for i, p in enumerate(prompts)]
    add_logprobs(model, tok.pad_token_id, items, "ref_logprobs")
    out = []
    for item in items:
        for s in item["samples"]:
            s["score"] = score(item["fields"], tok.decode(s["response_ids"], skip_special_tokens=True))
            s["failed"] = len(out) in (3, 8)       # failed samples: shares hold unequal token counts
            s["advantages"] = [s["score"] - 0.1] * len(s["response_ids"])
            out.append(s)
    return tok, out


# 14 samples in minibatches of 6: 6, 6, 2 -> dp shares of 3 and 1 (the short one is padded), and
# micro-batches of 2 inside each share; 2 epochs; stale=True also runs the proximal forward.
CFG = dict(minibatch_size=6, micro_batch_size=2, ppo_epochs=2, entropy_coef=0.01, max_grad_norm=0.5, lr=1e-2)


def _update(model, samples, pad_id, ranks=None):
    cfg = LearnerConfig(**CFG)
    cfg.kl.coef = 0.1
    samples = [dict(s) for s in samples]
    for s, adv in zip(samples, step_advantages(samples, cfg)):
        s["advantage_tokens"] = adv
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    stats = ppo_update(model, opt, samples, 0.1, pad_id, cfg, random.Random(0), stale=True, ranks=ranks)
    return opt, stats


@pytest.fixture(scope="module")
def reference():
    tok, samples = _samples()
    model = build_policy(MODEL, tok).double()
    _, stats = _update(model, samples, tok.pad_token_id)
    return tok, samples, {k: v.clone() for k, v in model.state_dict().items()}, stats


def _join_gloo(rank, layout, tmp) -> TrainRanks:
    """This forked process as rank `rank` of a gloo group and the training mesh."""
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    join_world(tmp, "world", rank, layout.world_size)
    ranks = TrainRanks(layout, build_mesh(layout), rank, "gloo", "cpu")
    return ranks


def _worker(rank, layout, tmp, tok, samples):
    ranks = _join_gloo(rank, layout, tmp)
    model = ranks.shard(build_policy(MODEL, tok).double())
    opt, stats = _update(model, samples, tok.pad_token_id, ranks)
    weights, optim = ranks.full_state(model, opt)
    # Loading distributes rank 0's full state into a fresh sharded model (a resume): gathering
    # it again gives the same tensors.
    fresh = ranks.shard(build_policy(MODEL, tok).double())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ranks.load_full_state(fresh, fresh_opt, weights if rank == 0 else None, optim if rank == 0 else None)
    again, again_optim = ranks.full_state(fresh, fresh_opt)
    record = {"stats": stats, "weights": weights, "reloaded": again,
              "optim_equal": rank != 0 or _nested_equal(optim, again_optim)}
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(record, f)
    dist.destroy_process_group()


def _nested_equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_nested_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_nested_equal(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2), (2, 2)])
def test_multirank_update_equals_one_rank(reference, tmp_path, dp, tp):
    tok, samples, want, want_stats = reference
    layout = ParallelLayout(dp=dp, tp=tp)
    mp.start_processes(_worker, args=(layout, str(tmp_path), tok, samples),
                       nprocs=layout.world_size, start_method="fork")
    records = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(layout.world_size)]
    got = records[0]["weights"]
    assert set(got) == set(want)
    # float64: the ranks only reorder sums (dp shares, TP partial sums, the norm's all-reduce).
    moved = 0.0
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-10), (k, (got[k] - want[k]).abs().max())
        moved = max(moved, (want[k] - build_policy(MODEL, tok).double().state_dict()[k]).abs().max().item())
    assert moved > 1e-3          # the update did move the weights
    for r in records:             # every rank reports the global minibatch statistics
        for k in ("losses/policy", "losses/kl", "entropy", "grad_norm", "updates/total"):
            assert r["stats"][k] == pytest.approx(want_stats[k], rel=1e-9, abs=1e-12), k
    assert records[0]["stats"]["grad_norm"] > CFG["max_grad_norm"]      # clipping was active
    for k in want:
        assert torch.equal(records[0]["reloaded"][k], got[k]), k
    assert all(r["optim_equal"] for r in records)


# ---- the critic: value pass and training on the same mesh -------------------------------------
def _critic_samples(samples):
    out = []
    for i, s in enumerate(samples):
        n = len(s["response_ids"])
        out.append(dict(s, token_rewards=[0.0] * (n - 1) + [s["score"]], values=[0.05 * i] * n,
                        returns=[s["score"] - 0.01 * t for t in range(n)]))
    return out


def _fresh_critic(tok):
    from rl.model.causal_lm import ValueModel

    return ValueModel.from_policy(build_policy(MODEL, tok)).double()


def _critic_run(tok, samples, ranks=None):
    """A value pass over every sample (2 per item), then one critic_update; float64 trunk."""
    from nodes.impl.critic import CriticConfig, advantages_for, critic_update

    model = _fresh_critic(tok)
    if ranks is not None:
        ranks.shard(model)
    cfg = CriticConfig(epochs=2, minibatch_size=6, micro_batch_size=2, max_grad_norm=0.05, lr=1e-2)
    samples = _critic_samples(samples)
    items = [{"samples": [dict(s) for s in samples[i:i + 2]]} for i in range(0, len(samples), 2)]
    advantages_for(model, items, tok.pad_token_id, cfg, "cpu", ranks)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    stats = critic_update(model, opt, samples, tok.pad_token_id, cfg, random.Random(0), ranks)
    return model, opt, [s["advantages"] for item in items for s in item["samples"]], stats


def _critic_worker(rank, layout, tmp, tok, samples):
    ranks = _join_gloo(rank, layout, tmp)
    model, opt, advantages, stats = _critic_run(tok, samples, ranks)
    weights, _ = ranks.full_state(model, opt)
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({"weights": weights, "advantages": advantages, "stats": stats}, f)
    dist.destroy_process_group()


def test_critic_as_2x2_ranks_equals_one_rank(reference, tmp_path):
    """Values computed in dp shares and gathered, and two epochs of clipped value regression with
    short padded dp shares, micro-batches and an active global clip: the same as one rank."""
    tok, samples, _, _ = reference
    want_model, _, want_adv, want_stats = _critic_run(tok, samples)
    layout = ParallelLayout(dp=2, tp=2)
    mp.start_processes(_critic_worker, args=(layout, str(tmp_path), tok, samples),
                       nprocs=layout.world_size, start_method="fork")
    records = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(layout.world_size)]
    want = want_model.state_dict()
    got = records[0]["weights"]
    assert set(got) == set(want)
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-10), (k, (got[k] - want[k]).abs().max())
    initial = _fresh_critic(tok).state_dict()
    assert max((want[k] - initial[k]).abs().max().item() for k in want) > 1e-3   # training moved it
    for r in records:
        # values go through float32 (the value pass's output buffer), on one rank as on four
        assert all(a == pytest.approx(b, abs=1e-6) for x, y in zip(r["advantages"], want_adv) for a, b in zip(x, y))
        for k in ("critic/value_loss", "critic/clipfrac"):
            assert r["stats"][k] == pytest.approx(want_stats[k], rel=1e-9, abs=1e-12), k


# ---- graph runs: the learner as 2 and 4 Ray actors ----------------------------------------------
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[2]
SMALL = ("prompts_per_step=4", "group_size=4", "channel_capacity=16", "learner.minibatch_size=8",
         "max_staleness=0", "weight_checksums=true")


# Logical CPUs: up to 4 learner ranks (1 CPU each) next to the rollout nodes (tests/conftest.py).
RAY_NUM_CPUS = 8


def check_generators_hold_learner_weights(records, versions=None):
    """Every version a generator switched to has the checksum of the whole weights the learner
    (rank 0, after gathering them) logged for it; only rank 0 reports steps. `versions`: the
    ones the learner pushed (None: 0, 1, ... without a gap)."""
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    assert {r["node"] for r in steps} == {"learner[0]"}
    sums: dict[str, dict[int, float]] = {}
    for r in records:
        if "weights/checksum" in r:
            sums.setdefault(r["node"], {})[r["weights/version"]] = r["weights/checksum"]
    learner = sums.pop("learner[0]")
    versions = versions or list(range(len(learner)))
    assert sorted(learner) == versions
    assert len(set(learner.values())) == len(versions), "the weights should change at every version"
    assert sums, "the generator should have switched weights"
    for gen, got in sums.items():
        assert got, gen
        for version, checksum in got.items():
            assert checksum == pytest.approx(learner[version], rel=1e-12, abs=0), (gen, version)


def test_grpo_graph_learner_tp2_collective_push_checkpoint_killed_generator_then_resume_as_2x2(ray_instance, tmp_path):
    """tp=2 with the HybridEngine push (every rank all-gathers, rank 0 broadcasts to the
    generator): the generator holds the learner's weights at every version. Once the checkpoint of
    step 2 is committed, kill -9 of the generator: a new process cannot join the learner's push
    group, so the run stops within seconds naming the generator (not the learner's push that failed
    on the closed connection, its echo) and why it was not restarted. The checkpoint of step 2
    holds the whole state (one-rank format); a 2 x 2 learner resumes from it and goes on. (The
    generator's kill was a one-rank GRPO run of its own in test_weight_sync: a graph start-up less.)"""
    from dataflow.driver.runtime import RunOptions, load_graph
    from tests.conftest import kill_stops_the_run, run_in_thread, wait_until

    # learner.kl.coef=0 in both runs: no reference node, two processes less to start (the KL term
    # on TP ranks: test_multirank_update_equals_one_rank).
    graph, config = load_graph(str(ROOT / "graphs/grpo.py"), [*SMALL, "learner.tp=2", "weight_transport=collective",
                                                              "save_interval=2", "learner.kl.coef=0", "max_restarts=3"])
    assert not graph.nodes["generator"].restartable and graph.nodes["reward"].restartable
    run_dir = tmp_path / "a"
    ckpt = run_dir / "checkpoints" / "step_2"
    thread, outcome = run_in_thread(graph, config, RunOptions(max_steps=1000, out_dir=str(run_dir), quiet=True))
    wait_until(lambda: (ckpt / "manifest.json").is_file(), 300, "the checkpoint of step 2", thread, outcome)
    pid = json.loads((run_dir / "processes.json").read_text())["generator"]
    error = kill_stops_the_run(pid, "generator", thread, outcome, within_s=15)
    assert "not restarted: weight_transport=collective" in error.summary, error.summary
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert '"restarted"' not in metrics
    check_generators_hold_learner_weights([json.loads(line) for line in metrics.splitlines()])
    assert (ckpt / "learner[0]").is_dir() and (ckpt / "learner[1]").is_dir()
    # The whole step-2 weights, as a plain model loads them (a one-rank learner could resume too).
    from dataflow.actor.checkpoint import read_state
    from dataflow.weights.sync import weights_checksum

    state = read_state(ckpt / "learner[0]")["node"]
    assert state["step"] == 2 and state["optimizer"]["state"]
    plain = build_policy(ModelConfig(), build_tokenizer())
    plain.load_state_dict(state["model"])
    step2 = weights_checksum(plain)
    import asyncio
    import shutil

    from dataflow.driver.runtime import run_graph

    graph, config = load_graph(str(ROOT / "graphs/grpo.py"),
                               [*SMALL, "learner.dp=2", "learner.tp=2", "learner.kl.coef=0"])
    summary = asyncio.run(run_graph(graph, RunOptions(max_steps=3, out_dir=str(tmp_path / "a"), quiet=True,
                                                      resume=str(ckpt)), config))
    assert summary.status == "max steps reached", summary.status
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "step" in r]
    assert steps == [1, 2, 3], steps
    sums = [r for r in records if r.get("node") == "learner[0]" and r.get("weights/version") == 2]
    gens = [r for r in records if r.get("node") == "generator" and r.get("weights/version") == 2]
    assert sums and gens and gens[-1]["weights/checksum"] == pytest.approx(sums[-1]["weights/checksum"], rel=1e-12)
    # The resumed ranks pushed exactly the checkpointed weights (loading spread them over 2 x 2).
    assert sums[-1]["weights/checksum"] == pytest.approx(step2, rel=1e-12)
    assert (tmp_path / "a" / "final" / "config.json").exists()      # gathered, saved by rank 0
    shutil.rmtree(tmp_path / "a", ignore_errors=True)


def test_only_rank_0_reads_the_rollouts():
    """A channel with several consumer replicas hands each item to one of them: the learner's
    other ranks get no input port, and the producer counts rank 0 as its only consumer."""
    from dataflow.driver.launch import wiring as _wiring
    from dataflow.driver.runtime import load_graph

    graph, _ = load_graph(str(ROOT / "graphs/grpo.py"), ["learner.dp=2", "learner.tp=2"])
    graph.validate()
    assert graph.nodes["learner"].replicas == 4 and "ranks" in graph.versioned_edges
    hosts = {name: name for spec in graph.nodes.values() for name in spec.replica_names()}
    # rank 0 is the only consumer: it may prefetch the whole channel capacity
    assert _wiring(graph, "learner[0]", hosts)["inputs"]["rollouts"]["prefetch"] == graph.channels["rollouts"].capacity
    for follower in ("learner[1]", "learner[2]", "learner[3]"):
        assert _wiring(graph, follower, hosts)["inputs"] == {}
    assert _wiring(graph, "reference", hosts)["outputs"]["with_ref"]["consumers"] == ["learner[0]"]
    assert [r for r, _ in _wiring(graph, "learner[0]", hosts)["publishes"]["ranks"]] == \
        ["learner[0]", "learner[1]", "learner[2]", "learner[3]"]


def test_ppo_graph_with_2_rank_learner_and_critic_checkpoints_on_ctrl_c_in_the_one_rank_format(
        ray_instance, tmp_path):
    """learner.dp=2 and critic.dp=2 in the PPO graph: the generator holds the learner's gathered
    weights at every version (object store); on Ctrl-C each node gathers its whole state onto
    rank 0 (Node.prepare_checkpoint, dataflow/weights/multirank.RankCommands; the save_interval
    checkpoints take the same path) in the one-rank format: a plain model loads it, as a one-rank
    critic does when it resumes (a one-rank learner resuming as 2 x 2: the tp2 test above)."""
    from dataflow.actor import checkpoint
    from dataflow.driver.runtime import load_graph
    from rl.model.causal_lm import ValueModel
    from tests.conftest import run_then_interrupt

    settings = ["prompts_per_step=4", "channel_capacity=8", "learner.minibatch_size=4", "critic.minibatch_size=4",
                "max_staleness=0", "save_interval=1000", "weight_checksums=true",
                "learner.kl.coef=0"]   # no reference node: a process less to start, and it holds no state
    run_dir = tmp_path / "run"
    assert not load_graph(str(ROOT / "graphs/ppo.py"), ["critic.dp=2"])[0].nodes["critic"].restartable
    run_then_interrupt("graphs/ppo.py", [*settings, "learner.dp=2", "critic.dp=2"], run_dir, after_steps=2)
    last = checkpoint.latest(run_dir)
    manifest = checkpoint.read_manifest(last)
    assert manifest["reason"] == "interrupt" and manifest["step"] >= 2 and manifest["stale"] == {}, manifest
    assert (last / "critic[1]").is_dir() and (last / "learner[1]").is_dir()
    critic = checkpoint.read_state(last / "critic[0]")["node"]
    assert critic["progress"] >= 2 and critic["optimizer"]["state"]
    plain = ValueModel.from_policy(build_policy(ModelConfig(), build_tokenizer()))
    plain.load_state_dict(critic["model"])                                  # whole tensors, plain names
    assert critic["optimizer"]["state"][0]["exp_avg"].shape == next(plain.parameters()).shape
    assert checkpoint.read_state(last / "learner[0]")["node"]["step"] == manifest["step"]
    check_generators_hold_learner_weights([json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()])


def test_a_killed_critic_rank_stops_the_run_instead_of_restarting_alone(ray_instance, tmp_path):
    """kill -9 of critic[1] (of critic.dp=2): a new process could not rejoin the running process
    group, so it is not restarted; the run stops naming that rank, within seconds."""
    from dataflow.driver.runtime import RunOptions, load_graph
    from tests.conftest import kill_stops_the_run, run_in_thread, wait_until

    graph, config = load_graph(str(ROOT / "graphs/ppo.py"), [   # kl.coef=0: no reference node to start
        "prompts_per_step=4", "channel_capacity=8", "learner.minibatch_size=4", "critic.minibatch_size=4",
        "critic.dp=2", "max_restarts=5", "learner.kl.coef=0"])
    run_dir = tmp_path / "run"
    thread, outcome = run_in_thread(graph, config, RunOptions(max_steps=1000, out_dir=str(run_dir), quiet=True))
    metrics = run_dir / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and '"step"' in metrics.read_text(), 300, "step 1", thread, outcome)
    pids = json.loads((run_dir / "processes.json").read_text())
    kill_stops_the_run(pids["critic[1]"], "critic[1]", thread, outcome, within_s=20)
    assert not [line for line in metrics.read_text().splitlines() if '"restarted"' in line]
