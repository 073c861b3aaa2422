"""The stall diagnosis on hand-written wait states (no Ray): the wait graph's roots (a version wait
closing a cycle, a busy node everyone waits for, a blocked output, a silent host), a thread's short
stack, and when the early look comes (dataflow/driver/stall.py). Real graphs made to stall on
purpose: tests/integration/test_stall.py."""

from __future__ import annotations

from dataflow import Graph
from dataflow.driver import stall
from nodes.prompts import PromptConfig, PromptSource
from tests.graphs.stalls import BatchTrainer, TrainerConfig
from tests.graphs.toy import Square


def ppo_like() -> Graph:
    """prompts -> square (x2) -> trainer, trainer publishes `policy` to prompts (the PPO shape)."""
    g = Graph("ppo_like")
    g.node("prompts", PromptSource, PromptConfig())
    g.node("square", Square, replicas=2)
    g.node("trainer", BatchTrainer, TrainerConfig(), ends_run=True)
    g.channel("prompts.prompts", "square.numbers", capacity=4, name="prompts")
    g.channel("square.squares", "trainer.prompts", capacity=4, name="squares")
    g.versioned("policy", src="trainer", dst=["prompts"])
    return g


def state(*spans, versions=(), publishing=None, channels=None, phase="running"):
    return {"phase": phase, "now_us": 100_000_000, "spans": list(spans), "versions": list(versions),
            "publishing": publishing, "channels": channels or {}, "latest": {}}


def test_a_version_wait_that_closes_a_cycle_is_the_root_of_a_deadlock():
    """max_staleness=-1: the source waits for a version the trainer publishes only after a batch
    that the source holds back. Every node waits; the root is the wait that closes the cycle."""
    states = {
        "prompts": state(versions=[("policy", 1, 0, "staleness admission of batch 0 (max_staleness=-1)", 0)]),
        "square[0]": state(("wait_input", "wait prompts", "prompts", 0),
                           channels={"prompts": {"end": "in", "depth": 0, "producers_open": 1}}),
        "square[1]": state(("wait_input", "wait prompts", "prompts", 0)),
        "trainer": state(("wait_input", "wait squares", "squares", 0)),
    }
    waits = stall.wait_graph(ppo_like(), states)
    assert all(w.waiting for w in waits.values())
    roots, cycle = stall.roots_of(waits)
    assert roots == ["prompts"]
    assert cycle == ["prompts", "trainer", "square[0]", "prompts"]  # who waits for whom, back to the root
    text = stall.report(waits, roots, cycle, "headline")
    assert "waits for 'policy' version >= 1 (has 0) from trainer: staleness admission of batch 0 " \
           "(max_staleness=-1) for 100 s   <- root" in text, text
    assert "waits for input on 'prompts' (0 buffered; producer: prompts)" in text, text


def test_a_busy_node_that_everyone_ends_up_waiting_for_is_the_root():
    """square[0] is stuck in its work; square[1] and the source wait in the cycle through the
    trainer, which waits on both squares: the cycle is not a sink (square[0] could unblock it)."""
    states = {
        "prompts": state(versions=[("policy", 2, 1, "", 0)]),
        "square[0]": state(("busy", "square", None, 40_000_000)),
        "square[1]": state(("wait_input", "wait prompts", "prompts", 0)),
        "trainer": state(("wait_input", "wait squares", "squares", 0)),
    }
    waits = stall.wait_graph(ppo_like(), states)
    assert stall.roots_of(waits) == (["square[0]"], [])
    assert waits["square[0]"].what == ["busy in 'square' for 60 s"]


def test_a_blocked_output_points_at_its_consumer_and_a_silent_host_is_a_root():
    states = {
        "prompts": state(("blocked_output", "blocked prompts", "prompts", 0),
                         channels={"prompts": {"end": "out", "depth": 4, "capacity": 4}}),
        "square[0]": None,  # did not answer: its event loop is blocked
        "square[1]": state(("blocked_output", "blocked squares", "squares", 0)),
        "trainer": state(publishing=("policy", 3, "prompts", 0)),
    }
    waits = stall.wait_graph(ppo_like(), states)
    assert "blocked sending on 'prompts' (full: 4 of 4; consumers: square[0], square[1])" in waits["prompts"].what[0]
    assert waits["trainer"].what == ["pushing 'policy' v3 to prompts: no ack for 100 s"]
    roots, _ = stall.roots_of(waits)
    assert roots == ["square[0]"] and "does not answer the driver" in waits["square[0]"].what[0]


def test_a_threads_short_stack_names_the_project_frames_and_the_ends_of_a_library_run():
    """torch.compile's stacks are 50+ frames deep: the short form keeps where the thread is, the
    project's frames, and each run of one package's frames by its ends; no stdlib or Ray frames."""
    from dataflow.actor.stacks import frame_of, short_lines

    site = "/venv/lib/python3.11/site-packages/"
    torch = [frame_of(f"{site}torch/_inductor/f{i}.py", i, f"f{i}") for i in range(30)]
    frames = (torch + [frame_of(f"{site}torch/_dynamo/eval_frame.py", 600, "_fn"),
                       frame_of(f"{stall.__file__[:-len('dataflow/driver/stall.py')]}rl/update/packing.py", 240, "packed_logprobs"),
                       frame_of(f"{site}ray/util/tracing/tracing_helper.py", 520, "_resume_span")])
    assert short_lines({"frames": frames}) == [
        "torch/_inductor/f0.py:0 f0", "torch/_inductor/f1.py:1 f1", "... 28 frames in torch",
        "torch/_dynamo/eval_frame.py:600 _fn", "rl/update/packing.py:240 packed_logprobs"]
    # Past SHORT_LINES the project's frames stay and a library's go first.
    project = stall.__file__[:-len("dataflow/driver/stall.py")]
    mixed = [frame_of(f"{site}lib{i}/x.py" if i % 2 else f"{project}nodes/n{i}.py", i, f"f{i}") for i in range(1, 16)]
    lines = short_lines({"frames": mixed})
    assert [f"nodes/n{i}.py:{i} f{i}" for i in range(2, 16, 2)][:5] == [x for x in lines if x.startswith("nodes/")][:5]
    assert lines[0] == "lib1/x.py:1 f1" and lines[-1] == "... (the file has the rest)", lines


def test_the_early_look_comes_before_the_stall_timeout_only():
    watch = stall.StallWatch(Graph("g"))  # stall_warn_s 120 s, timeout max(300 s, 5 x slowest step)
    assert watch.early_look_s() == 120.0
    watch.slowest_step_s = 100.0          # a slow first step: not before twice that
    assert watch.early_look_s() == 200.0
    assert stall.StallWatch(Graph("g", stall_timeout_s=2.0)).early_look_s() is None  # the tests' stalls
    assert stall.StallWatch(Graph("g", stall_warn_s=None)).early_look_s() is None
