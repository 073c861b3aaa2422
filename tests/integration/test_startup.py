"""Start-up (issue 38): start-up as its own state in the trace, the table and the picture, with
utilization over the training window only; the reward node starting without transformers; the
compile cache setting reaching the node processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dataflow.driver.runtime import RunOptions, load_graph, run_graph
from dataflow.trace.collector import TraceCollector
from dataflow.trace.report import flat_metrics, format_report, summarize
from dataflow.trace.tracer import WAITING_PROCESSES, WAITING_SETUP, Tracer
from tests.chat_model import make_chat_model_dir

ROOT = Path(__file__).resolve().parents[2]
S = 1_000_000  # us per second


class FakeClock:
    def __init__(self, t: int = 0):
        self.t = t

    def __call__(self) -> int:
        return self.t


def starting_tracer(name: str, clock: FakeClock) -> Tracer:
    tracer = Tracer(name, enabled=True, starting=True)
    tracer.now_us = clock
    tracer._state_t = tracer._window_start = clock()
    return tracer


def critic_run(clock: FakeClock) -> dict:
    """A critic as an 8-step CPU PPO run shows it: 60 s of set-up (50 s of it loading its model),
    4 s waiting for the others' set-up, then 20 s busy and 16 s waiting for input."""
    t = starting_tracer("critic", clock)
    with t.span("setup"):
        with t.span("load model"):
            clock.t = 50 * S
        clock.t = 60 * S
    clock.t = 64 * S
    t.started()
    for _ in range(4):
        with t.span("update"):
            clock.t += 5 * S
        with t.wait_input("with_ref"):
            clock.t += 4 * S
    return t.drain()


def test_tracer_counts_startup_apart():
    drained = critic_run(FakeClock())
    assert drained["state_us"] == {"busy": 20 * S, "wait_input": 16 * S, "blocked_output": 0, "other": 0,
                                   "startup": 64 * S}
    assert drained["startup_parts"] == {"load model": 50 * S, "setup": 10 * S, WAITING_SETUP: 4 * S}
    assert drained["spans"] == {"update": [4, 20 * S]}
    assert drained["run_start"] == 64 * S
    kinds = {(e[1], e[5]) for e in drained["events"] if e[0] == "X"}
    assert ("setup", "startup") in kinds and ("load model", "startup") in kinds and ("update", "busy") in kinds


def test_report_over_the_training_window_hand_built():
    """A hand-built trace: 100 s window, 64 s of start-up. Busy is 20 of the 36 s of training (not
    84 of 100, as when set-up counted as busy), idle causes are shares of the 36 s, and the
    start-up stands beside them, per part."""
    aggs = {"processes": {
        "critic": {"device": "cpu", "gpu": None, "window": [0, 100 * S], "run_start": 64 * S,
                   "state_us": {"busy": 20 * S, "wait_input": 16 * S, "blocked_output": 0, "other": 0, "startup": 64 * S},
                   "wait_us": {"with_ref": 16 * S}, "blocked_us": {}, "spans": {"update": [4, 20 * S]},
                   "startup_parts": {"load model": 50 * S, "setup": 10 * S, WAITING_SETUP: 4 * S}, "dropped": 0},
        "prompts": {"device": "cpu", "gpu": None, "window": [1 * S, 100 * S], "run_start": 64 * S,
                    "state_us": {"busy": 0, "wait_input": 0, "blocked_output": 18 * S, "other": 18 * S, "startup": 63 * S},
                    "wait_us": {}, "blocked_us": {"prompts": 18 * S}, "spans": {},
                    "startup_parts": {"imports": 1 * S, WAITING_PROCESSES: 20 * S, "setup": 2 * S,
                                      WAITING_SETUP: 40 * S}, "dropped": 0}},
        "gpus": {}}
    s = summarize(aggs)
    critic = s["nodes"]["critic"]
    assert critic["busy"] == pytest.approx(20 / 36) and critic["wait_input"] == pytest.approx(16 / 36)
    assert critic["other"] == pytest.approx(0.0, abs=1e-9)
    assert critic["startup_s"] == 64 and critic["window_s"] == 36
    assert critic["startup_parts"] == {"load model": 50, "setup": 10, WAITING_SETUP: 4}
    assert s["nodes"]["prompts"]["blocked_output"] == pytest.approx(0.5)
    assert s["window_s"] == 36 and s["startup_s"] == 64 and s["train_window"] == [64 * S, 100 * S]
    assert s["devices"]["cpu critic"]["idle"] == pytest.approx(16 / 36)
    assert s["idle_causes"][0] == {"who": "prompts", "kind": "blocked_output", "channel": "prompts",
                                   "seconds": 18.0, "fraction": pytest.approx(0.5)}
    assert flat_metrics(s)["util/critic/startup_s"] == 64
    table = format_report(s)
    assert "64.0 s of start-up (launch -> every node running), then the training window, 36.0 s" in table
    assert "55.6%" in table                                    # the critic's busy share, not 84%
    assert re.search(r"critic +64\.0 +0\.0 +0\.0 +60\.0 +4\.0  load model 50\.0, setup 10\.0\n", table), table
    assert re.search(r"prompts +63\.0 +0\.0 +1\.0 +2\.0 +60\.0  setup 2\.0\n", table), table


def test_gpu_idle_over_the_training_window():
    """Busy GPU intervals only during set-up (loading weights) do not make the GPU look busy."""
    c = TraceCollector(enabled=True)
    d = {"device": "cuda", "gpu": "gpu0", "window": [0, 10 * S], "run_start": 6 * S,
         "state_us": {"busy": 1 * S, "wait_input": 3 * S, "blocked_output": 0, "other": 0, "startup": 6 * S},
         "wait_us": {"samples": 3 * S}, "blocked_us": {}, "spans": {"update": [1, 1 * S]},
         "startup_parts": {"setup": 6 * S}, "events": [], "dropped": 0,
         "gpu_intervals": [[0, 5 * S], [6 * S, 7 * S]]}
    c.add("learner", d)
    s = c.summary()
    assert s["devices"]["gpu0"]["idle"] == pytest.approx(0.75)   # 1 s busy of the 4 s of training
    assert s["devices"]["gpu0"]["startup_s"] == 6
    assert s["nodes"]["learner"]["busy"] == pytest.approx(0.25)


def test_trace_file_cli_and_plot_show_startup(tmp_path):
    """Through the trace file: the CLI's table and the picture come from the same training-window
    figures (a start-up band: the plot draws 'startup' slices)."""
    clock = FakeClock()
    c = TraceCollector(enabled=True)
    c.add("critic", critic_run(clock))
    path, png = tmp_path / "t.json", tmp_path / "t.png"
    c.write(str(path))
    doc = json.loads(path.read_text())
    assert {e["cat"] for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] in ("setup", "load model")} == {"startup"}
    out = subprocess.run([sys.executable, "-m", "dataflow.trace", str(path), "--plot", str(png)],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "64.0 s of start-up (launch -> every node running), then the training window, 36.0 s" in out
    assert "55.6%" in out and png.stat().st_size > 10_000


@pytest.mark.usefixtures("ray_instance")
# The CPU demo's own table (graphs/ppo.py, traced), start-up apart from the training window:
# tests/integration/test_ppo_graph.py checks it on its learning run's trace.


@pytest.mark.usefixtures("ray_instance")
@pytest.mark.parametrize("tokenizer_dir", [False, True])
def test_reward_node_with_a_reward_file_imports_no_transformers(tmp_path, tokenizer_dir):
    """The reward node (a real one on Ray: tests/graphs/reward_probe.py) with a plain reward
    file: its process never imports transformers or torch, the built-in tokenizer or a model
    directory's alike. The reward function runs in that process and looks (and at the compile
    cache setting, which every node process gets in its environment, and at the garbage collector,
    paused while the process started and on again once its node was set up: dataflow/startup_gc.py)."""
    reward = tmp_path / "r.py"
    cache = str(tmp_path / "compile cache")
    reward.write_text(textwrap.dedent(f'''
        import gc
        import os
        import sys

        CACHE = {cache!r}

        def reward(prompt, response, **fields):
            loaded = [m for m in ("transformers", "torch") if m in sys.modules]
            assert not loaded, f"the reward node imported {{loaded}}"
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(CACHE, "inductor"), os.environ
            assert gc.isenabled(), "the node's process still collects no garbage"
            return 1.0
    '''))
    sets = [f"reward.path={reward}"]
    if tokenizer_dir:
        make_chat_model_dir(tmp_path / "model")
        sets.append(f"reward.tokenizer_path={tmp_path / 'model'}")
    graph, config = load_graph(str(ROOT / "tests" / "graphs" / "reward_probe.py"), sets)
    summary = asyncio.run(run_graph(graph, RunOptions(out_dir=str(tmp_path / "run"), compile_cache=cache), config))
    assert summary.status == "done", summary.status
    scored = json.loads((tmp_path / "run" / "scored.json").read_text())
    assert scored and all(not s["failed"] and s["score"] == 1.0 for group in scored for s in group), scored


def test_a_process_without_torch_checkpoints_and_restores_without_importing_it(tmp_path):
    """A prompt source or a reward file's node never imports torch; its checkpoint must not either
    (the first checkpoint of every run waited for that import in those nodes: seconds on a GPU
    machine). Its state and Python's RNG round-trip; torch's RNG is saved where torch is loaded."""
    script = textwrap.dedent(f'''
        import random, sys
        from dataflow.actor import checkpoint
        random.seed(5)
        checkpoint.write_state({str(tmp_path / "a")!r}, {{"node": {{"position": 96, "pair": (1, 2)}},
                                                           "rng": checkpoint.rng_state(), "steps": 3}})
        first = random.random()
        state = checkpoint.read_state({str(tmp_path / "a")!r})
        checkpoint.set_rng_state(state["rng"])
        print(state["node"], state["steps"], sorted(state["rng"]), random.random() == first, "torch" in sys.modules)
    ''')
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "{'position': 96, 'pair': (1, 2)} 3 ['python'] True False", out.stdout


def test_the_drivers_input_checks_import_no_transformers(tmp_path):
    """The command's own start-up: the graph file and the input checks on a chat model directory
    and a JSONL dataset (the policy's model type, its tokenizer, every row rendered with the
    chat template) run without importing transformers (its import is a second or more before Ray
    starts; the nodes that build models import it in their own processes)."""
    make_chat_model_dir(tmp_path / "model")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"copy {i} :"}], "answer": str(i)}) + "\n"
                            for i in range(20)))
    script = textwrap.dedent(f'''
        import sys
        from dataflow.driver.preflight import input_problems
        from dataflow.driver.runtime import load_graph
        graph, config = load_graph("graphs/grpo.py", ["policy.path={tmp_path / 'model'}", "prompts.path={data}",
                                                     "max_new_tokens=8"])
        print(input_problems(graph, config, 2), "transformers" in sys.modules)
    ''')
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DATAFLOW_PROMPT_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[] False", out.stdout


@pytest.mark.parametrize("graph_file,sets", [("graphs/grpo.py", []), ("graphs/ppo.py", []), ("graphs/dapo.py", []),
                                             ("graphs/agent.py", ["env.path=examples/agents/guess_env.py"])])
def test_the_driver_imports_no_torch_before_ray_starts(graph_file, sets):
    """Everything the command does before Ray starts (the graph file, --describe, a bad setting's
    error, the input checks and the memory plan) reads only the node kinds' declarations
    (nodes/learner.py, ...), never their implementations (nodes/impl/): torch's import, and
    transformers', would be most of the command's start-up, and every error's wait. Each graph in
    a fresh interpreter, on its defaults (CPU placement, the built-in task)."""
    script = textwrap.dedent(f'''
        import sys
        from dataflow.driver.loading import describe, load_graph
        from dataflow.driver.preflight import input_problems
        from dataflow.checks import SettingProblems
        try:
            load_graph({graph_file!r}, {sets + ["learner.lr=-1"]!r})
        except SettingProblems as e:
            print(e)
        graph, config = load_graph({graph_file!r}, {sets!r})
        describe(graph, config)
        print(input_problems(graph, config), config.memory_plan(graph))
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
    ''')
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-3:] == ["learner.lr=-1.0: must be > 0", "[] None", "[]"], out.stdout
