"""No silent stall (dataflow/driver/stall.py): a run that makes no progress says what every node waits for
and which node is at the root, then stops (exit 1) or keeps waiting; a source whose data runs out
ends the run with a line saying so; counters of trouble are on screen (Graph.alerts).

Real graphs made to stall on purpose (tests/graphs/stalls.py) run through the CLI in this process
(same code path and exit status as `python -m dataflow.run`) on the module's Ray instance. The wait
graph's roots on hand-written wait states (no Ray): tests/unit/test_stall_diagnosis.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dataflow import Graph, Node  # noqa: E402
from dataflow.driver import stall  # noqa: E402
from dataflow import run as cli  # noqa: E402
from dataflow.driver.runtime import RunOptions, run_graph  # noqa: E402
from tests.graphs.alerts import TroubledSink  # noqa: E402
from tests.graphs.stalls import Silent, Sink  # noqa: E402
from tests.graphs.toy import Counter, CounterConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STALLS = "tests/graphs/stalls.py"


def main(capsys, *argv) -> tuple[int, str, str, float]:
    """`python -m dataflow.run ARGV` in this process: (exit status, stdout, stderr, seconds)."""
    capsys.readouterr()
    t0 = time.monotonic()
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err, time.monotonic() - t0


# ---- real graphs that stall ---------------------------------------------------------------------------
def test_a_node_that_never_sends_stops_the_run_naming_it(capsys, ray_instance, tmp_path):
    rc, out, err, seconds = main(capsys, STALLS, "--set", "case=never_sends", "--set", "stall_timeout_s=2",
                                 "--out", tmp_path)
    assert rc == 1, err
    assert "[dataflow] stalled: no step for" in err
    assert "source  running its own code (in no channel, version or push wait)   <- root" in err, err
    assert "sink    waits for input on 'numbers' (0 buffered; producer: source)" in err, err
    assert "root of the wait: source running its own code" in err, err
    assert "[dataflow] stopped: the run stalled; root of the wait: source (Graph(stall_timeout_s=" in err, err
    assert "Traceback" not in err
    assert seconds < 60, seconds


def test_a_node_blocking_its_event_loop_is_named_and_does_not_freeze_the_driver(capsys, ray_instance, tmp_path,
                                                                                monkeypatch):
    # The blocked host never answers wait_state: the snapshot waits out ANSWER_TIMEOUT_S (5 s) for nothing,
    # and the stop waits out STOP_GRACE_S (5 s) before killing it. 2 s and 1 s still leave the
    # sink, which does answer and stop, ample time on a loaded machine. Its stacks come from its
    # stack server, outside Ray (the next test says why), within STACKS_TIMEOUT_S (10 s).
    from dataflow.driver import launch

    monkeypatch.setattr(stall, "ANSWER_TIMEOUT_S", 2.0)
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    rc, out, err, seconds = main(capsys, STALLS, "--set", "case=blocks_loop", "--set", "stall_timeout_s=2",
                                 "--out", tmp_path)
    assert rc == 1, err
    assert "root of the wait: source does not answer the driver" in err, err
    assert "[dataflow] stopped: the run stalled; root of the wait: source (" in err, err
    assert re.search(r"thread AsyncIO Thread: default, innermost first:\n +tests/graphs/stalls.py:\d+ run\n", err), err
    assert seconds < 60, seconds


def test_stacks_answer_while_ray_cannot_deliver_any_call_to_the_blocked_actor(ray_instance):
    # Ray's race: a call's coroutine returns, Ray's fiber wakes and waits for the future the event
    # loop sets next; the loop blocks first (call_soon below). That fiber now holds Ray's dispatch
    # thread for the default group, and the next call (a wait_state) holds the actor's one task
    # dispatch thread: no call reaches the actor, a concurrency group's neither (the stacks went
    # through one before: 'no stacks' in a third of loaded runs of the test above). The stack
    # server answers regardless, and says where the loop is; a token it did not issue gets nothing.
    import ray

    from dataflow.actor import stacks

    @ray.remote
    class Blocker:
        def __init__(self):
            self.server = stacks.StackServer(ray.util.get_node_ip_address(),
                                             lambda skip: stacks.capture(skip_ident=skip))

        async def address(self):
            return self.server.address

        async def block_as_this_call_returns(self, seconds: float):
            def hold_the_loop():
                time.sleep(seconds)

            asyncio.get_running_loop().call_soon(hold_the_loop)
            return "returned"

        async def wait_state(self):
            return {}

    async def scenario():
        actor = Blocker.remote()
        host, port, token = await actor.address.remote()
        returned = actor.block_as_this_call_returns.remote(20.0)
        await asyncio.sleep(1.0)
        queued = actor.wait_state.remote()
        done, _ = await asyncio.wait([asyncio.ensure_future(queued), asyncio.ensure_future(returned)], timeout=2.0)
        threads = await asyncio.wait_for(stacks.ask((host, port, token)), 10.0)
        with pytest.raises(ValueError):  # nothing back: json.loads(b"")
            await asyncio.wait_for(stacks.ask((host, port, "not-" + token)), 10.0)
        ray.kill(actor)
        return done, threads

    done, threads = asyncio.run(scenario())
    assert not done, ("Ray delivered a call to the blocked actor: this Ray version has not the race this test "
                      "stands for (the stacks would then also come through Ray; drop this assert)")
    loop = [t for t in threads if t["thread"] == "AsyncIO Thread: default"]
    assert loop and loop[0]["node_code"] and loop[0]["frames"][0][3] == "hold_the_loop", threads
    assert not any(t["thread"] == "dataflow stack server" for t in threads)  # the answering thread is left out


def spin_in_place(seconds: float) -> None:
    """Burns CPU here: the frame the stall report must name."""
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        sum(range(1000))


class Spinning(Node):
    """Produces `numbers`; its work, in an asyncio.to_thread worker as nodes/impl/reference.py's is,
    never ends (60 s: the actor is killed sooner)."""

    outputs = ("numbers",)

    async def run(self):
        with self.ctx.span("train"):
            await asyncio.to_thread(spin_in_place, 60)


def test_the_report_names_where_the_busy_root_is_in_its_code(ray_instance, tmp_path):
    graph = Graph("spins", stall_timeout_s=2.0)
    graph.node("source", Spinning, cpus=0.1)
    graph.node("sink", Sink, cpus=0.1, ends_run=True)
    graph.channel("source.numbers", "sink.numbers", capacity=4, name="numbers")
    with pytest.raises(stall.RunStalled) as stalled:
        asyncio.run(run_graph(graph, RunOptions(out_dir=str(tmp_path), quiet=True)))
    text = stalled.value.report
    assert re.search(r"source  busy in 'train' for \d+ s   <- root\n", text), text
    assert re.search(r"thread \S+, innermost first:\n +tests/integration/test_stall.py:\d+ spin_in_place\n", text), text
    assert "sink  " not in text.split("root of the wait")[1]  # only the root's stacks are on screen
    stacks_file = tmp_path / "stall-1.txt"
    assert f"every replica's threads, in full: {stacks_file}" in text, text
    full = stacks_file.read_text()
    assert "==== sink ====" in full and re.search(r'test_stall.py", line \d+, in spin_in_place', full), full


def test_an_admission_deadlock_is_named_at_the_admission(capsys, ray_instance, tmp_path, monkeypatch):
    """Every node waits and nothing moves: reported after DEADLOCK_S (2 s here), long before the
    stall timeout (600 s here). (The trainer wants 8 prompts a step, the source admits 4 per
    version: max_staleness=-1 did it once, and is refused before start now.)"""
    monkeypatch.setattr(stall, "DEADLOCK_S", 2.0)
    monkeypatch.setattr(stall, "SNAPSHOT_EVERY_S", 0.5)
    rc, out, err, seconds = main(capsys, STALLS, "--set", "case=admission", "--set", "stall_timeout_s=600",
                                 "--set", "prompts.max_staleness=0", "--set", "trainer_prompts_per_step=8", "--out", tmp_path)
    assert rc == 1, err
    assert "[dataflow] stalled: every node waits and nothing has moved for" in err, err
    assert ("waits for 'policy' version >= 1 (has 0) from trainer: staleness admission of batch 1 "
            "(max_staleness=0)") in err, err
    assert "root of the wait: prompts waits for" in err, err
    assert "a cycle of waits no node can break: prompts -> trainer -> prompts" in err, err
    assert seconds < 60, seconds


def test_warn_prints_the_wait_graph_and_keeps_waiting(capsys, ray_instance, tmp_path):
    graph = Graph("warned", stall_timeout_s=1.0, stall_action="warn")
    graph.node("source", Silent, cpus=0.1)
    graph.node("sink", Sink, cpus=0.1, ends_run=True)
    graph.channel("source.numbers", "sink.numbers", capacity=4, name="numbers")

    async def scenario():
        task = asyncio.ensure_future(run_graph(graph, RunOptions(out_dir=str(tmp_path), quiet=True)))
        seen = ""
        deadline = time.monotonic() + 60
        while seen.count("still waiting") < 2 and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.2)
            seen += capsys.readouterr().out
        assert not task.done(), task.exception() if task.done() else None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    seen = asyncio.run(scenario())
    assert seen.count("(stall_action='warn': still waiting)") >= 2, seen
    assert "source  running its own code" in seen


# ---- the source runs out ----------------------------------------------------------------------------
def test_data_that_runs_out_before_max_steps_ends_the_run_saying_so(capsys, ray_instance, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(10)))
    rc, out, err, _ = main(capsys, STALLS, "--set", "case=admission", "--set", f"prompts.path={data}",
                           "--set", "prompts.epochs=1", "--set", "max_steps=5", "--out", tmp_path / "run")
    assert rc == 0, err
    assert "[dataflow] done: 2 steps" in out, out
    assert (f"the run ended after 2 of 5 steps: prompts: the data ran out: {data} has 10 usable prompts, read once "
            "(prompts.epochs=1): 2 batches of prompts_per_step=4; --set prompts.epochs=0 repeats the data "
            "until max steps") in out, out


def test_an_empty_dataset_ends_the_run_at_once_instead_of_spinning(capsys, ray_instance, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    rc, out, err, seconds = main(capsys, STALLS, "--set", "case=admission", "--set", f"prompts.path={data}",
                                 "--out", tmp_path / "run")
    # An empty dataset is a user mistake the data loader names at setup (exit 2), at once; the
    # graphs/ RLHF graphs refuse it even before Ray starts (tests/unit/test_preflight.py).
    assert rc == 2, (out, err)
    assert str(data) in err and "no usable" in err, err
    assert seconds < 60


# ---- trouble counters on screen -------------------------------------------------------------------------
def test_non_zero_trouble_counters_are_on_the_progress_line_and_in_the_summary(capsys, ray_instance, tmp_path):
    graph = Graph("troubled", max_steps=3)
    graph.node("counter", Counter, CounterConfig(count=10), cpus=0.1)
    graph.node("sink", TroubledSink, cpus=0.1, ends_run=True)
    graph.channel("counter.numbers", "sink.numbers", capacity=4, name="numbers")
    capsys.readouterr()
    summary = asyncio.run(run_graph(graph, RunOptions(out_dir=str(tmp_path))))
    out = capsys.readouterr().out
    assert summary.alerts == {"reward/failed_total": 6}  # a running total: the latest, not the sum
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 3 and all("! reward/failed_total" in line for line in step_lines), out
    assert "prompts/duplicates_dropped" not in out  # zero: not shown
    assert step_lines[-1].endswith("! reward/failed_total 6"), step_lines
