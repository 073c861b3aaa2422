"""The phase switch (rl/model/applied_plan.py, rl/model/gpu_turns.py) end to end on CPU: the memory
plan sets it only on GPU placements, so here the graph's generator and learner are given the lock
file by hand, as the plan does, and a synchronous GRPO run on a real Ray instance shows the turns:
the static decoder frees its KV cache each time its slots run empty, the learner waits for it, and
no decode step runs while the learner's update holds the GPU."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from dataflow.driver.runtime import RunOptions, load_graph, run_graph
from tests.integration.test_algorithms import TINY

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("ray_instance")


def spans(doc: dict, node: str, name: str) -> list[tuple[float, float]]:
    events = doc["traceEvents"]
    pid = next(e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name" and e["args"]["name"] == node)
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["pid"] == pid and e["name"] == name)


def test_generator_and_learner_take_turns_and_no_decode_step_overlaps_an_update(tmp_path):
    graph, config = load_graph(str(ROOT / "graphs/grpo.py"), TINY + ["generator.backend=static"])
    turn = str(tmp_path / "gpu.lock")
    graph.nodes["generator"].gpu_turn = graph.nodes["learner"].gpu_turn = turn
    steps = 3
    summary = asyncio.run(run_graph(graph, RunOptions(max_steps=steps, out_dir=str(tmp_path), quiet=True,
                                                      trace_path=str(tmp_path / "trace.json")), config))
    assert summary.status in ("done", "max steps reached"), summary.status
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    trained = [r for r in records if "step" in r]
    assert len(trained) == steps and all(math.isfinite(r["losses/policy"]) and r["updates/skipped"] == 0 for r in trained)
    assert all(r["learner/gpu_turn_wait_s"] >= 0 and r["learner/free_s"] >= 0 for r in trained)
    frees = [r for r in records if "generator/kv_free_s" in r]
    allocs = [r for r in records if "generator/kv_alloc_s" in r]
    assert len(frees) >= steps and len(allocs) >= steps      # the cache went and came back every step

    doc = json.loads((tmp_path / "trace.json").read_text())
    waits, frees_l = spans(doc, "learner", "wait for the GPU"), spans(doc, "learner", "free activations")
    assert len(waits) == len(frees_l) == steps
    updates = [(w[1], f[1]) for w, f in zip(waits, frees_l)]      # the learner holds its turn in between
    decoding = spans(doc, "generator", "decode steps") + spans(doc, "generator", "prefill")
    assert decoding and len(spans(doc, "generator", "free KV cache")) >= steps
    for start, end in updates:
        assert not [d for d in decoding if d[0] < end and d[1] > start], (start, end)
