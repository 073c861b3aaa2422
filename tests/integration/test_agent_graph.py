"""Multi-turn episodes through the graph on a real Ray, with the tiny chat model (tests/chat_model.py)
and the toy environments of tests/agent_toy_env.py: the generator's samples exact against the
episodes and the model, failures counted and stopping the run, a generator killed mid-episode (restarted)
and then the learner (the run resumed with --resume): every prompt trained once, the environment in
the trace."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.chat_model import make_chat_model_dir
from tests.conftest import run_in_thread, wait_until

ROOT = Path(__file__).resolve().parents[2]
ENV = str(ROOT / "tests/agent_toy_env.py")
RAY_NUM_CPUS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_model")
    make_chat_model_dir(path, always_emit=None)
    return path


def _data(path: Path, n: int, **extra) -> Path:
    rows = [{"prompt": f"copy {i % 10}", "target": f"{i % 10}{(i + 3) % 10}{(i + 7) % 10}",
             **{k: v(i) if callable(v) else v for k, v in extra.items()}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's complete lines: the driver may be writing the last one as a test polls it (a
    line cut short there failed json.loads in the kill test's waits now and then)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def _run(graph_file: str, overrides: list[str], run_dir: Path, max_steps: int, trace: Path | None = None):
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph

    graph, config = load_graph(str(ROOT / graph_file), overrides)
    return asyncio.run(run_graph(graph, RunOptions(max_steps=max_steps, out_dir=str(run_dir), quiet=True,
                                                   trace_path=str(trace) if trace else None), config))


@pytest.mark.usefixtures("ray_instance")
@pytest.mark.parametrize("backend", ["static", "hf"])
def test_three_turn_samples_are_exact_against_the_episode_and_the_model(tmp_path, model_dir, backend):
    """CopyDigits (3 turns) through prompts -> generator -> recorder (tests/graphs/agent_probe.py):
    every sample is prompt + 3 sampled turns with the environment's tokens between them; the mask,
    log-probs and versions line up with the ids; each sampled turn decodes to the chat's assistant
    message and each environment part to the next "copy <digit>"; and every behaviour log-prob is
    the model's own on the whole sequence (one unpadded forward): the turns decoded from the slot's
    extended KV cache (static; the HF loop re-prefills the history) are the model's distribution on
    the full history. Prefilled tokens: prompt + environment parts (static) or the whole history at
every turn (HF). The environment's steps are "env step" slices in the trace."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, trace = tmp_path / "run", tmp_path / "trace.json"
    summary = _run("tests/graphs/agent_probe.py", [
        f"policy.path={model_dir}", f"prompts.path={_data(tmp_path / 'd.jsonl', 4)}", f"env.path={ENV}",
        "env.name=CopyDigits", "generator.group_size=2", "generator.max_new_tokens=4", "generator.seed=5",
        f"generator.backend={backend}"],
        run_dir, max_steps=4, trace=trace)
    assert summary.steps == 4
    items = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for item in items:
        target = item["fields"]["target"]
        for s in item["samples"]:
            n = len(s["response_ids"])
            assert len(s["loss_mask"]) == len(s["logprobs"]) == len(s["token_versions"]) == n
            assert s["turns"] == 3 and s["env"]["failed"] is None and s["env"]["ended_by"] == "done"
            assert s["token_versions"] == [0] * n
            # segments: sampled, environment, sampled, environment, sampled
            segments, start = [], 0
            for t in range(1, n + 1):
                if t == n or s["loss_mask"][t] != s["loss_mask"][start]:
                    segments.append((s["loss_mask"][start], s["response_ids"][start:t]))
                    start = t
            assert [m for m, _ in segments] == [1, 0, 1, 0, 1]
            assistant = [m["content"] for m in s["env"]["messages"] if m["role"] == "assistant"]
            for (_, ids), text in zip(segments[::2], assistant):
                stop = ids[-1] if ids[-1] in (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id) else None
                assert tok.decode(ids[:-1] if stop is not None else ids, skip_special_tokens=True) == text
            for (_, ids), digit in zip(segments[1::2], target[1:]):
                assert f"copy {digit}" in tok.decode(ids)
            assert all(lp == 0.0 for lp, m in zip(s["logprobs"], s["loss_mask"]) if not m)
            # prefill: the prompt, then only each environment part (static: the slot keeps its cache),
            # against the whole history before each of the 3 turns (what the HF loop prefills)
            p, (a, b, c, d, _) = len(s["prompt_ids"]), [len(ids) for _, ids in segments]
            history = p + (p + a + b) + (p + a + b + c + d)
            assert s["env"]["history_tokens"] == history
            assert s["env"]["prefilled_tokens"] == (p + b + d if backend == "static" else history)
            with torch.no_grad():
                ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
                logp = torch.log_softmax(model(input_ids=ids).logits[0, len(s["prompt_ids"]) - 1:-1].float(), -1)
                ref = logp.gather(1, ids[0, len(s["prompt_ids"]):, None])[:, 0]
            got = torch.tensor(s["logprobs"])
            sampled = torch.tensor(s["loss_mask"]).bool()
            assert (got[sampled] - ref[sampled]).abs().max() < 1e-4
    # two samples of a prompt are two episodes: different noise, not one response twice
    assert any(item["samples"][0]["response_ids"] != item["samples"][1]["response_ids"] for item in items)
    events = json.loads(trace.read_text())["traceEvents"]
    env_steps = [e for e in events if e.get("name") == "env step"]
    assert env_steps, "no env step slices in the trace"


AGENT = ["max_new_tokens=4", "group_size=2", "prompts_per_step=4", "learner.minibatch_size=8",
         "learner.kl.coef=0", "channel_capacity=16", "reward.items_per_call=2"]


@pytest.mark.usefixtures("ray_instance")
def test_failed_episodes_counted_a_generator_and_a_learner_killed_mid_episode_and_resume_train_every_prompt_once(
        tmp_path, model_dir, capsys):
    """graphs/agent.py on 24 prompts read once (6 steps), the first of every 4 failing in its second
    turn (both its episodes), checkpointed every 2 steps; environment steps sleep 0.1 s and later
    batches are admitted (max_staleness=2), so the generator holds episodes mid-way whenever a kill
    comes. The generator is killed after step 1: restarted, its prompts re-issued. The learner is
    killed after step 3, while the last batch's episodes wait on a file (their rows' `hold`), so the
    first run cannot have trained step 6 and saved step_6 by then, however late the kill comes on a
    loaded machine: the run stops naming it and its last checkpoint; `--resume` through the CLI,
    with no --set (the environment comes from the recorded settings), trains the rest. Over both
    runs every prompt is trained exactly once, and every step counts its 2 failed episodes
    (samples/failed, env/failed) and still trains. (One scenario for both kills: a graph run less.)"""
    from dataflow import run as cli
    from dataflow.driver.runtime import RunOptions, load_graph
    from dataflow.errors import NodeFailed

    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    hold.touch()   # batch 6 (prompts 20-23) waits until the learner is killed
    data = _data(tmp_path / "d.jsonl", 24, fail=lambda i: int(i % 4 == 0), hold=lambda i: str(hold) if i >= 20 else "")
    graph, config = load_graph(str(ROOT / "graphs/agent.py"), AGENT + [
        f"policy.path={model_dir}", f"prompts.path={data}",
        "prompts.epochs=1", f"env.path={ENV}", "env.name=FailsOnSecondTurn", 'env.kwargs={"delay_s": 0.1}',
        "max_staleness=2", "learner.record_prompt_ids=true", "save_interval=2"])
    thread, outcome = run_in_thread(graph, config, RunOptions(out_dir=str(run_dir), quiet=True))
    steps = lambda: [r for r in _records(run_dir) if "step" in r and "prompt_ids" in r]  # noqa: E731
    pid = lambda node: json.loads((run_dir / "processes.json").read_text())[node]  # noqa: E731
    wait_until(lambda: len(steps()) >= 1, 600, "step 1", thread, outcome)
    generator_pid = pid("generator")
    os.kill(generator_pid, signal.SIGKILL)
    step_2 = run_dir / "checkpoints" / "step_2"
    restarted = lambda: [r["restarted"] for r in _records(run_dir) if "restarted" in r]  # noqa: E731
    wait_until(lambda: len(steps()) >= 3 and (step_2 / "manifest.json").is_file() and restarted(), 600,
               "step 3 and the generator's restart", thread, outcome)
    assert pid("generator") != generator_pid    # a new process took the killed one's place
    os.kill(pid("learner"), signal.SIGKILL)
    thread.join(120)
    assert not thread.is_alive()
    error = outcome.get("error")
    assert isinstance(error, NodeFailed) and error.node == "learner", repr(error)
    assert error.last_checkpoint is not None and Path(error.last_checkpoint).name in ("step_2", "step_4")
    assert restarted() == ["generator"]
    assert len(steps()) < 6
    hold.unlink()

    rc = cli.main(["graphs/agent.py", "--resume", str(run_dir)])
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    assert "resumed from" in out
    done = steps()
    assert [r["step"] for r in done] == [1, 2, 3, 4, 5, 6]
    assert sorted(i for r in done for i in r["prompt_ids"]) == list(range(24))   # every prompt once
    assert all(r["samples/failed"] == 2 and r["env/failed"] == 2 for r in done), done
    assert all(r["env/turns"] == (2 * 2 + 6 * 3) / 8 for r in done), [r["env/turns"] for r in done]  # failed: in turn 2
    # the shown rollouts of an episode: its chat turn by turn, not the prompt source's text alone
    shown = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert shown and all(r["kind"] == "train" for r in shown)
    for r in shown:
        assert r["prompt"].startswith("[user] copy ") and r["turns"] in (2, 3), r
        assert r["response"].count("[assistant] ") == r["turns"] and "[user] copy " in r["response"], r
        assert r["ended_by"] == ("done" if r["turns"] == 3 else "failed"), r


@pytest.mark.usefixtures("ray_instance")
def test_every_episode_failing_stops_the_run_in_one_line(tmp_path, model_dir):
    """Every episode fails (its environment raises in the second turn): after
    reward.max_failed_batches=2 batches of reward.items_per_call=2 prompts the run stops with one
    line naming the episodes and the environment's error."""
    from dataflow.errors import UserError

    with pytest.raises(UserError) as info:
        _run("graphs/agent.py", AGENT + [
            f"policy.path={model_dir}", f"prompts.path={_data(tmp_path / 'd.jsonl', 16, fail=1)}",
            f"env.path={ENV}", "env.name=FailsOnSecondTurn", "reward.max_failed_batches=2"], tmp_path / "run", 20)
    message = str(info.value)
    assert "\n" not in message
    # the streak counts prompts as batches arrive (a batch is what has arrived: 1 or 2 prompts), so it
    # stops at the first batch that brings it to 2 x 2: at 4 prompts, or 5 after batches of 1, 2, 2
    found = re.search(r"the episodes failed for every response of (\d+) consecutive prompts "
                      r"\(reward.max_failed_batches=2 batches of reward.items_per_call=2\)", message)
    assert found and 4 <= int(found.group(1)) <= 5, message
    assert "episode failed:" in message and "the toy environment broke" in message and "Fix the environment" in message
