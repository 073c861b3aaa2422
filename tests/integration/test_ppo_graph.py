"""graphs/ppo.py on a real Ray instance: learning and the staleness bound, the end-of-run table's
start-up (on the same traced run), reward failures and every model node packed (one run), a user's model, data and reward (and the KL at
the start). One Ray instance for the module; runs go through
runtime.run_graph in-process. (graphs/grpo.py's synchronous mode and trace: tests/integration/test_algorithms.py.)"""

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

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


from dataflow.driver.runtime import RunOptions, load_graph, run_graph  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("ray_instance")  # one Ray for the module (tests/conftest.py)


def run(graph_file: str, tmp_path: Path, *overrides: str, max_steps: int | None = None) -> list[dict]:
    graph, config = load_graph(str(ROOT / graph_file), list(overrides))
    options = RunOptions(max_steps=max_steps, out_dir=str(tmp_path), quiet=True)
    summary = asyncio.run(run_graph(graph, options, config))
    assert summary.status in ("done", "max steps reached"), summary.status
    return [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]


def steps(records: list[dict]) -> list[dict]:
    return [r for r in records if "step" in r]


SMALL = ("prompts_per_step=32", "channel_capacity=16", "critic.minibatch_size=32", "learner.minibatch_size=32")


@pytest.fixture(scope="module")
def learning_run(ray_instance, tmp_path_factory):
    """One traced PPO run on the default task (asynchronous: max_staleness=1, the default, spelled
    out), read by the two tests below: (summary, its directory, its trace file)."""
    out = tmp_path_factory.mktemp("ppo_learns")
    graph, config = load_graph(str(ROOT / "graphs" / "ppo.py"), ["target_reward=0.6", "max_staleness=1"])
    options = RunOptions(max_steps=150, out_dir=str(out / "run"), quiet=True, trace_path=str(out / "trace.json"))
    summary = asyncio.run(run_graph(graph, options, config))
    assert summary.status in ("done", "max steps reached"), summary.status
    return summary, out / "run", out / "trace.json"


def test_ppo_reward_rises_on_the_default_task_within_the_staleness_bound(learning_run):
    """A short PPO run on the default task (copy 2 digits) must clearly learn: from under 0.3
    (a random policy scores ~0.05) to a mean reward of at least 0.6. The same run checks the
    staleness bound: no step trains on samples more than 1 version old, and generators really ran
    ahead of the learner at some point."""
    summary, run_dir, _ = learning_run
    records = steps([json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()])
    first, last = records[0]["reward/mean"], records[-1]["reward/mean"]
    assert first < 0.3, first
    assert last >= 0.6, [round(r["reward/mean"], 2) for r in records]
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert (run_dir / "final" / "tokenizer.json").is_file()
    assert all(r["staleness/max"] <= 1 for r in records), [r["staleness/max"] for r in records]
    assert any(r["staleness/max"] > 0 for r in records)


def test_the_end_of_run_table_shows_startup_apart(learning_run):
    """The same run's trace: the end-of-run table and `python -m dataflow.trace` on its file print
    the same table, in which every node's start-up stands apart, counted from the launch (no
    shorter than the driver's own start-up), split into parts that add up to it (the critic's
    'load model' among them, no busy time), and every node's states add up to its training window."""
    summary, _, trace_path = learning_run
    S = 1_000_000  # us per second
    aggs = json.loads(trace_path.read_text())["otherData"]["dataflow"]["aggregates"]
    nodes = {"prompts", "generator", "reward", "reference", "critic", "learner"}
    assert nodes <= aggs["processes"].keys()
    for name in nodes:
        a = aggs["processes"][name]
        assert sum(a["startup_parts"].values()) == a["state_us"]["startup"] > 0, (name, a)
        assert sum(a["state_us"].values()) == a["window"][1] - a["window"][0], (name, a)
        assert a["startup_parts"]["imports"] > 0 and a["run_start"] - a["window"][0] == a["state_us"]["startup"]
        # from the launch: at least the driver's start-up (Ray up -> every node set up), give or take the clock offset
        assert a["state_us"]["startup"] / S >= summary.startup["total"] - 0.5, (name, a, summary.startup)
    assert aggs["processes"]["critic"]["startup_parts"]["load model"] > 0
    # transformers' model code imported apart from the weights, in every model node
    assert all(aggs["processes"][n]["startup_parts"]["import transformers"] > 0
               for n in ("generator", "reference", "critic", "learner"))
    assert "load model" not in aggs["processes"]["critic"]["spans"]   # set-up is not busy time
    table = summary.report[summary.report.index("[dataflow] where time went"):summary.report.index("  padding")]
    assert "s of start-up (launch -> every node running), then the training window" in table
    assert re.search(r"\n  start-up \(s\) +total +process +imports +set-up +waiting", table), table
    assert re.search(r"\n  critic +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+  [^\n]*\bload model [\d.]+", table), table
    assert re.search(r"\n  critic +[^\n]*\bimport transformers [\d.]+", table), table
    out = subprocess.run([sys.executable, "-m", "dataflow.trace", str(trace_path)], capture_output=True,
                         text=True, cwd=ROOT, check=True, timeout=120).stdout
    assert table in out   # the same figures, the same training window


# Synchronous GRPO (max_staleness=0: every step on the current version) and the run's trace: checked
# on each of tests/integration/test_algorithms.py's GRPO runs, which are synchronous and traced.


# Token budgets for every model node, packed passes and the learner's gradient checkpointing (issue 21).
PACKED = ("learner.max_tokens_per_micro_batch=256", "reference.max_tokens_per_micro_batch=256",
          "critic.max_tokens_per_micro_batch=256", "learner.packing=true", "reference.packing=true",
          "critic.packing=true", "learner.gradient_checkpointing=true")


@pytest.fixture(scope="module")
def flaky_packed_run(ray_instance, tmp_path_factory):
    """One PPO run (3 steps) read by the two tests below: a reward that fails in four ways for some
    prompts, and every model node packed. (It was two runs, the reward one without a reference node:
    one graph start-up less.) (summary, records)."""
    tmp_path = tmp_path_factory.mktemp("ppo_flaky_packed")
    reward_file = tmp_path / "flaky_reward.py"
    reward_file.write_text(textwrap.dedent('''
        import time
        def reward(prompt, response, answer, **fields):
            d = int(prompt.split()[1])
            if d == 1:
                raise RuntimeError("bad luck")
            if d == 2:
                time.sleep(5)           # longer than the timeout
            if d == 3:
                return float("nan")
            if d == 4:
                return "high"
            return 1.0 if response.split()[:1] == answer.split()[:1] else 0.0
    '''))
    graph, config = load_graph(str(ROOT / "graphs/ppo.py"), [*SMALL, *PACKED, f"reward.path={reward_file}",
                                                              "reward.timeout_s=0.3", "prompts.task=first_digit"])
    summary = asyncio.run(run_graph(graph, RunOptions(max_steps=3, out_dir=str(tmp_path / "run"), quiet=True), config))
    assert summary.status in ("done", "max steps reached"), summary.status
    return summary, [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]


def test_reward_failures_are_counted_and_the_run_goes_on(flaky_packed_run):
    _, records = flaky_packed_run
    step_records = steps(records)
    assert len(step_records) == 3
    assert sum(r["samples/failed"] for r in step_records) > 0
    failed_totals = [r["reward/failed_total"] for r in records if "reward/failed_total" in r]
    assert failed_totals and failed_totals[-1] >= sum(r["samples/failed"] for r in step_records)


def test_ppo_graph_packed_everywhere_reports_no_padding(flaky_packed_run):
    """Every model node packed (a token budget each, the learner with gradient checkpointing): no
    padding in any pass, per node, and in the end-of-run table. (tests/integration/test_varlen_nodes.py:
    the packed computations equal the padded ones.)"""
    summary, records = flaky_packed_run
    assert [r["step"] for r in steps(records)] == [1, 2, 3]
    for node in ("learner", "reference", "critic"):
        reports = [r for r in records if f"{node}/padding_frac" in r]
        assert reports, node
        assert all(r[f"{node}/padding_frac"] == 0.0 and r[f"{node}/tokens_processed"] == r[f"{node}/tokens_real"] > 0
                   for r in reports), node
    assert all(r["learner/tokens_real"] > 0 for r in steps(records))
    # the end-of-run table: every node's padding over the run
    assert "padding (of the tokens processed): " in summary.report
    assert all(f"{node} 0.0%" in summary.report for node in ("learner", "reference", "critic")), summary.report


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_user_model_dir_jsonl_and_reward_file_and_kl_zero_at_the_start(tmp_path, lora):
    """The quickstart's "your model, data and reward" path (docs/quickstart.md): a saved HF model directory, a JSONL
    dataset with extra fields, and a reward file; two steps run and the metrics say so.
    The same run, synchronous at a sampling temperature: policy = reference at step 1, and one
    minibatch (learner.minibatch_size = prompts_per_step) of one epoch trains at exactly those
    weights, so the KL must be 0 at T=0.7 too (the reference's log-probs were at T=1 before: > 0).
    With LoRA (PPO: the critic beside it keeps full weights) the reference is the learner's base
    with its adapter disabled, no reference node: the adapter starts at zero, so the KL is 0 there too,
    and the learner pushes only the adapter."""
    from rl.model.causal_lm import ModelConfig, build_policy, save_policy
    from rl.data.tasks import build_tokenizer

    tok = build_tokenizer()
    save_policy(build_policy(ModelConfig(), tok), tok, str(tmp_path / "model"))
    rows = [{"prompt": f"copy {a} {b} :", "answer": f"{a} {b}", "tag": "x"} for a in range(10) for b in range(10)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "my_reward.py").write_text(textwrap.dedent('''
        def reward(prompt, response, answer, tag):
            assert tag == "x"
            return {"exact": float(response.split() == answer.split()), "length": -0.01 * len(response.split())}
    '''))
    records = run("graphs/ppo.py", tmp_path / "run", *SMALL, f"policy.path={tmp_path / 'model'}",
                  f"prompts.path={tmp_path / 'data.jsonl'}", f"reward.path={tmp_path / 'my_reward.py'}",
                  'reward.weights={"exact": 1.0, "length": 1.0}', "max_new_tokens=4", "max_staleness=0",
                  "generator.temperature=0.7", *["learner.lora.rank=4"] * lora, max_steps=2)
    step_records = steps(records)
    pushes = [r["weights/push_adapter"] for r in records if "weights/push_adapter" in r]
    assert pushes and all(p == lora for p in pushes)
    assert [r["step"] for r in step_records] == [1, 2]
    assert all(r["samples/failed"] == 0 for r in step_records)
    assert all(-0.05 <= r["reward/mean"] <= 1.0 for r in step_records)
    assert step_records[0]["kl"] == pytest.approx(0.0, abs=1e-5)
    assert step_records[0]["losses/approx_kl"] == pytest.approx(0.0, abs=1e-6)
