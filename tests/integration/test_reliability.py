"""Failures the run survives or reports well: non-finite losses (skipped, then a stop after
learner.max_bad_updates in a row), channel items that fail to decode (counted and named; dropped
only with drop_bad_items), the learner's process killed (the run stops naming the checkpoint to
resume from), and a generator's process killed (restarted; every prompt trained exactly once).

The in-process tests host a node in this process (NodeHost without an actor) fed by a fake
producer; the kill tests run graphs/ppo.py (a critic to kill) or graphs/grpo.py through
runtime.run_graph on the module's Ray instance and kill a node's process by PID. Neither reads a
KL term (learner.kl.coef=0): no reference node, a model process less to start per run."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


from dataflow import Node  # noqa: E402
from dataflow.actor import checkpoint  # noqa: E402
from dataflow.channel.codec import Message, encode  # noqa: E402
from dataflow.actor.host import HostSpec, NodeHost  # noqa: E402
from dataflow.driver.runtime import RunOptions, load_graph  # noqa: E402
from nodes.impl.learner import ppo_update, step_advantages  # noqa: E402
from nodes.learner import Learner, LearnerConfig  # noqa: E402 (hosted as a graph does: the declaration)
from rl.model.causal_lm import ModelConfig, build_policy  # noqa: E402
from rl.generation.hf_sampling import sample_responses  # noqa: E402
from rl.data.policy import PolicySpec  # noqa: E402
from nodes.impl.reference import add_logprobs  # noqa: E402
from rl.data.tasks import build_tokenizer, make_task  # noqa: E402
from tests.conftest import kill_stops_the_run, run_in_thread, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelConfig(n_layer=1, n_embd=32, n_head=2, intermediate_size=64)


# ---- a node hosted in this process, fed by a fake producer -------------------------------------------
class _Remote:
    def __init__(self, fn):
        self.remote = lambda *args: asyncio.ensure_future(fn(*args))


class FakeProducer:
    """Stands in for a producer's actor handle: serves (header, buffers) pairs, then end of stream."""

    def __init__(self, items: list):
        self.items = list(items)
        self.channel_take = _Remote(self._take)
        self.channel_receiver_closed = _Remote(self._closed)

    async def _take(self, channel, consumer_key, max_items):
        batch, self.items = self.items[:max_items], self.items[max_items:]
        return not self.items, batch

    async def _closed(self, channel, consumer_key):
        pass


def hosted(kind, config, port: str, channel: str, items: list, tmp_path: Path, **spec) -> NodeHost:
    """A NodeHost (no actor) whose input `port` reads `items` from a fake producer 'upstream'."""
    host = NodeHost(HostSpec(node=kind.__name__.lower(), replica=0, num_replicas=1, kind=kind, config=config,
                             cpus=1, gpus=0, max_steps=None, trace=False, run_dir=str(tmp_path), **spec))
    wiring = {"outputs": {}, "publishes": {e: [] for e in kind.publishes},
              "publish_timeout": {e: 5.0 for e in kind.publishes},
              "inputs": {port: {"channel": channel, "producers": [("upstream", FakeProducer(items))], "prefetch": 4}}}
    return host, wiring


# ---- 1. non-finite losses -------------------------------------------------------------------------------
def _samples(n: int, advantage: float = 0.5) -> tuple:
    tok = build_tokenizer()
    model = build_policy(TINY, tok)
    task = make_task("copy", 2)
    prompts = task.take(n)
    samples = sample_responses(model, tok, [tok(p["prompt"])["input_ids"] for p in prompts], task.max_new_tokens, seed=0)
    items = [{"id": i, "version": 0, "samples": [s], "fields": p} for i, (s, p) in enumerate(zip(samples, prompts))]
    add_logprobs(model, tok.pad_token_id, items, "ref_logprobs")
    for s in samples:
        s.update(score=0.5, failed=False, advantages=[advantage] * len(s["response_ids"]))
    return tok, model, items


def test_a_non_finite_loss_skips_that_update_only():
    tok, model, items = _samples(4)
    samples = [s for item in items for s in item["samples"]]
    samples[2]["advantages"] = [float("nan")] * len(samples[2]["response_ids"])
    cfg = LearnerConfig(minibatch_size=1, whiten_advantages=False)
    for s, adv in zip(samples, step_advantages(samples, cfg)):
        s["advantage_tokens"] = adv
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = ppo_update(model, opt, samples, 0.01, tok.pad_token_id, cfg, random.Random(0), stale=False)
    assert (stats["updates/total"], stats["updates/skipped"]) == (4, 1)
    assert stats["updates/skip_reason"].startswith("non-finite loss nan")
    assert all(torch.isfinite(p).all() for p in model.parameters())

    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = {k: v["step"].item() for k, v in opt.state_dict()["state"].items()}
    for s in samples:  # every loss NaN: nothing changes (ppo_update reads the critic's "advantages")
        s["advantages"] = [float("inf")] * len(s["response_ids"])
    stats = ppo_update(model, opt, samples, 0.01, tok.pad_token_id, cfg, random.Random(0), stale=False)
    assert (stats["updates/skipped"], stats["updates/skipped_last"]) == (4, 4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert {k: v["step"].item() for k, v in opt.state_dict()["state"].items()} == state_before


def test_the_learner_stops_after_max_bad_updates_in_a_row(ray_instance, tmp_path):
    """Non-finite losses: each step's update is skipped and logged, the step still reports, and the
    second bad update in a row (max_bad_updates=2) fails the learner saying why."""
    _, _, items = _samples(6, advantage=float("nan"))
    messages = []
    for i, item in enumerate(items):
        item["version"] = i // 2
        messages.append(encode(Message(item, {"batch": i // 2, "seq": i, "producer": "upstream"})))
    config = LearnerConfig(policy=PolicySpec(model=TINY), prompts_per_step=2, minibatch_size=2,
                           max_bad_updates=2, save_final=False)
    host, wiring = hosted(Learner, config, "rollouts", "rollouts", messages, tmp_path)

    async def scenario():
        assert (await host.connect(wiring))["status"] == "ready"
        before = {k: v.clone() for k, v in host.node.model.state_dict().items()}
        result = await host.run()
        same = all(torch.equal(before[k], v) for k, v in host.node.model.state_dict().items())
        return result, same, (await host.poll())["events"]

    result, unchanged, events = asyncio.run(scenario())
    assert result["status"] == "failed" and result["user_error"] and result["error"].startswith(
        "BadUpdates: 2 updates in a row were skipped (learner.max_bad_updates=2); the last reason: "
        "non-finite loss nan"), result
    assert unchanged
    logs = [e["text"] for e in events if e["kind"] == "log"]
    assert logs[:2] == ["step 1: skipped 1 of 1 updates: non-finite loss nan (policy nan, kl " + logs[0].split("kl ")[1],
                        "step 2: skipped 1 of 1 updates: non-finite loss nan (policy nan, kl " + logs[1].split("kl ")[1]]
    steps = [e for e in events if e["kind"] == "step"]
    assert [(e["step"], e["values"]["updates/skipped"]) for e in steps] == [(1, 1)]


# ---- 2. channel items that fail to decode ----------------------------------------------------------------
class Sink(Node):
    inputs = ("numbers",)

    async def run(self):
        self.seen = [msg.data async for msg in self.ctx.inputs["numbers"]]


@pytest.mark.parametrize("drop", [False, True])
def test_an_item_that_fails_to_decode_is_counted_and_named(tmp_path, drop):
    good = [encode(Message({"value": i}, {"seq": i})) for i in range(3)]
    items = [good[0], (b"\x00garbage", []), good[1], good[2]]
    host, wiring = hosted(Sink, None, "numbers", "numbers", items, tmp_path, drop_bad_items=drop)

    async def scenario():
        assert (await host.connect(wiring))["status"] == "ready"
        return await host.run(), (await host.poll())["events"]

    result, events = asyncio.run(scenario())
    what = "channel 'numbers': an item from producer 'upstream' failed to decode: header too short"
    if not drop:  # the consumer fails, naming the channel and the producer (the driver adds the node)
        assert result["status"] == "failed" and result["error"] == f"BadItem: {what}", result
        assert not result["echo"]  # its own failure, not an echo of a dead producer
        return
    assert result["status"] == "done" and host.node.seen == [{"value": i} for i in range(3)]
    assert [e["text"] for e in events if e["kind"] == "log"] == [
        f"dropped: {what} (drop_bad_items; later ones are only counted)"]
    assert [e["values"] for e in events if e["kind"] == "metrics"] == [{"channel/bad_items/numbers": 1}]


# ---- 3. processes killed mid-run -------------------------------------------------------------------------
def test_a_take_left_by_a_dead_consumer_hands_nothing_to_it():
    """A consumer's process died with a take waiting at its producer: once the restart resets that
    consumer, the waiting take returns empty instead of swallowing the next item."""
    from dataflow.channel import SendEnd

    async def scenario():
        out = SendEnd("samples", capacity=4, consumer_keys=["reward"], producer="generator")
        zombie = asyncio.ensure_future(out._take("reward", 4))
        await asyncio.sleep(0.01)
        out.reset_consumer("reward")
        assert await zombie == (False, [])
        await out.send({"id": 1})
        closed, items = await out._take("reward", 4)  # the restarted consumer's take
        return closed, len(items)

    assert asyncio.run(scenario()) == (False, 1)


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's complete lines (the driver may be writing the last one as we read)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def _progress(state_dir: Path) -> int:
    """A critic state's training passes ("progress"), from its state.json (-1: none yet)."""
    try:
        return json.loads((state_dir / "state.json").read_text())["node"]["progress"]
    except (OSError, ValueError, KeyError):
        return -1


def test_a_dead_replica_that_is_not_restarted_says_why():
    """The report of a death that ends the run says why it was not restarted: restarts used up, or
    the node kind refused (a generator under the collective push). Ray's own death error."""
    from ray.exceptions import RayActorError

    from dataflow.errors import NodeFailed
    from dataflow.driver.failures import raise_first_failure
    from dataflow.driver.restarts import refusals

    died = RayActorError()
    graph, _ = load_graph(str(ROOT / "graphs/ppo.py"), ["max_restarts=2"])
    why = refusals(graph, {"generator": died, "critic": {"status": "done"}}, {"generator": 2})
    assert why == {"generator": "it was restarted 2 time(s) already (max_restarts=2)"}
    with pytest.raises(NodeFailed) as failed:
        raise_first_failure({"generator": died}, why)
    assert failed.value.node == "generator"
    assert failed.value.summary.endswith("; not restarted: it was restarted 2 time(s) already (max_restarts=2)")
    assert refusals(graph, {"generator": died}, {"generator": 1}) == {}     # it is restarted
    assert refusals(graph, {"learner": died}, {}) == {}      # ends the run: its report names the checkpoint
    graph, _ = load_graph(str(ROOT / "graphs/ppo.py"), ["max_restarts=2", "weight_transport=collective"])
    assert refusals(graph, {"generator": died}, {})["generator"].startswith("weight_transport=collective: ")
    graph, _ = load_graph(str(ROOT / "graphs/ppo.py"), ["max_restarts=0", "weight_transport=collective"])
    assert refusals(graph, {"generator": died}, {}) == {}      # restarts are off: nothing to explain


def test_a_killed_generator_is_restarted_and_a_killed_learner_stops_the_run(ray_instance, tmp_path):
    """kill -9 of the generator's process: it is restarted (counted in metrics, an instant event in
    the trace) and every prompt is still trained on exactly once. Then kill -9 of the learner's:
    the run stops within 10 s naming the learner and the last checkpoint to resume from."""
    graph, config = load_graph(str(ROOT / "graphs/ppo.py"), [
        "prompts_per_step=16", "channel_capacity=16", "max_staleness=1", "learner.minibatch_size=16",
        "critic.minibatch_size=16", "generator.prompts_per_call=4", "policy.model.n_layer=1",
        "policy.model.n_embd=64", "policy.model.intermediate_size=128", "save_interval=2",
        "learner.record_prompt_ids=true", "learner.kl.coef=0"])
    run_dir, trace = tmp_path / "run", tmp_path / "trace.json"
    thread, outcome = run_in_thread(graph, config, RunOptions(max_steps=1000, out_dir=str(run_dir), quiet=True,
                                                              trace_path=str(trace)))
    steps = lambda: [r for r in _records(run_dir) if "step" in r]  # noqa: E731
    wait_until(lambda: len(steps()) >= 2, 300, "step 2", thread, outcome)
    pids = json.loads((run_dir / "processes.json").read_text())
    # Steps go on for a while after a kill on what was already downstream: count from the restart's
    # record (the driver cancels a restart in progress when the learner dies, as it should).
    back = lambda node: any(r.get("restarted") == node for r in _records(run_dir))  # noqa: E731
    os.kill(pids["generator"], signal.SIGKILL)
    wait_until(lambda: back("generator"), 300, "the generator's restart", thread, outcome)
    killed_at = len(steps())
    wait_until(lambda: len(steps()) >= killed_at + 4, 300, "4 steps after the restart", thread, outcome)
    assert json.loads((run_dir / "processes.json").read_text())["generator"] != pids["generator"]

    # kill -9 of the critic once it has trained since the last checkpoint: it comes back with that
    # training (its snapshot, critic.snapshot_interval=1), not as of the checkpoint.
    snapshot = run_dir / "snapshots" / "critic"
    wait_until(lambda: _progress(snapshot) > _progress(checkpoint.latest(run_dir) / "critic"), 120,
                "a critic snapshot newer than the last checkpoint", thread, outcome)
    step_checkpointed = int(checkpoint.latest(run_dir).name.split("_")[1])
    os.kill(pids["critic"], signal.SIGKILL)
    wait_until(lambda: back("critic"), 300, "the critic's restart", thread, outcome)
    killed_at = len(steps())
    wait_until(lambda: len(steps()) >= killed_at + 2, 300, "2 steps after the critic's restart", thread, outcome)

    error = kill_stops_the_run(pids["learner"], "learner", thread, outcome, within_s=10)
    # the newest committed checkpoint: of the last even step, or the one before when the kill hit
    # the learner while it was saving (the step's metrics are out before its checkpoint commits)
    last_saved = int(error.last_checkpoint.rsplit("_", 1)[1])
    assert error.last_checkpoint == str(checkpoint.latest(run_dir)) and last_saved in (
        len(steps()) // 2 * 2, len(steps()) // 2 * 2 - 2), (error.last_checkpoint, len(steps()))

    trained = [i for r in steps() for i in r["prompt_ids"]]
    assert trained == list(range(16 * len(steps())))  # every prompt once, none lost, none twice
    restarts = [r for r in _records(run_dir) if r.get("restarted")]
    assert [(r["restarted"], r["restarts/total"]) for r in restarts] == [("generator", 1), ("critic", 2)]
    # its snapshot; or, when a checkpoint committed between that check and the kill, that newer
    # checkpoint, which holds the same training (an equal one wins the tie): never an older one
    state_from = Path(restarts[1]["state_from"]).resolve()
    assert state_from == snapshot.resolve() or (
        state_from.parent.parent == (run_dir / "checkpoints").resolve()
        and int(state_from.parent.name.split("_")[1]) > step_checkpointed), (state_from, step_checkpointed)
    assert restarts[1]["restarts/critic"] == 1
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["args"]["node"] for e in events if e.get("ph") == "i" and e.get("name") == "restart"} == {
        "generator", "critic"}
    # keep_checkpoints (default 3): only the newest three are left
    kept = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*") if checkpoint.is_checkpoint(p))
    assert kept == [last_saved - 4, last_saved - 2, last_saved]


def test_prompts_are_reissued_after_a_jsonl_dataset_is_exhausted(ray_instance, tmp_path):
    """A JSONL dataset of 3 batches read once (prompts.epochs=1), all admitted at once
    (max_staleness=2) into channels that hold them all: the source has sent its last prompt within
    a second, and the generator (one prompt per call) still holds most of them when it is killed
    after step 1. The source is still up to re-issue them, so all 3 batches train, each prompt once
    (before the fix: the source had returned, and the run ended after step 1). The model and the
    response cap make a prompt cost the generator ~75 ms here, so batches 2 and 3 need ~2.4 s, past
    the ~1 s the kill takes to follow step 1: with a 1-layer model and 12 tokens the generator
    once finished all three before it (CI, 2026-12-02), and the run ended with nothing to restart.
    GRPO with groups of one response: the generator's work per prompt is PPO's, and no critic
    (not what this tests) to start."""
    rows = [{"prompt": f"copy {i // 10} {i % 10} :", "answer": f"{i // 10} {i % 10}"} for i in range(48)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text("def reward(prompt, response, answer):\n"
                                        "    return float(response.split() == answer.split())\n")
    graph, config = load_graph(str(ROOT / "graphs/grpo.py"), [
        f"prompts.path={tmp_path / 'data.jsonl'}", "prompts.epochs=1", f"reward.path={tmp_path / 'reward.py'}",
        "max_new_tokens=48", "prompts_per_step=16", "group_size=1", "channel_capacity=64", "max_staleness=2",
        "learner.minibatch_size=16", "generator.prompts_per_call=1", "learner.kl.coef=0",
        "policy.model.n_layer=2", "policy.model.n_embd=128", "policy.model.intermediate_size=256",
        "learner.record_prompt_ids=true"])
    run_dir = tmp_path / "run"
    thread, outcome = run_in_thread(graph, config, RunOptions(out_dir=str(run_dir), quiet=True))
    steps = lambda: [r for r in _records(run_dir) if "step" in r]  # noqa: E731
    wait_until(lambda: len(steps()) >= 1, 300, "step 1", thread, outcome)
    os.kill(json.loads((run_dir / "processes.json").read_text())["generator"], signal.SIGKILL)
    thread.join(300)
    assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
    assert outcome["summary"].status == "done" and outcome["summary"].restarts == {"generator": 1}
    assert [i for r in steps() for i in r["prompt_ids"]] == list(range(48))  # every prompt once
