"""A GRPO run on a verl-layout chat parquet file with a model dir built here (tests/chat_model.py: a
chat template, no pad token, two eos ids): the prompts render, and every response ends at the eos
only generation_config.json names. The dataset rules themselves: tests/unit/test_data.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.chat_model import EOT, IM_END, chat_tokenizer
from tests.unit.test_data import VERL_ROWS, model_dir  # noqa: F401 - model_dir: the fixture

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("ray_instance")
def test_grpo_on_a_chat_parquet_file_stops_at_generation_config_eos(tmp_path, model_dir):
    """The model always samples <|im_end|>, which only generation_config.json names as an eos (the
    tokenizer's eos is <|endoftext|>, and there is no pad token). A run of 2 GRPO steps on a
    verl-layout chat parquet file must start (no pad crash anywhere), render the chats, and end
    every response at that first token (response length 1, not max_new_tokens=8)."""
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph

    src = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS * 4), src)
    overrides = [f"policy.path={model_dir}", f"prompts.policy.path={model_dir}", f"prompts.path={src}",
                 "max_new_tokens=8", "prompts_per_step=4", "group_size=2", "channel_capacity=8",
                 "learner.minibatch_size=8", "prompts.shuffle=true"]
    graph, config = load_graph(str(ROOT / "graphs/grpo.py"), overrides)
    summary = asyncio.run(run_graph(graph, RunOptions(max_steps=2, out_dir=str(tmp_path / "run"), quiet=True), config))
    assert summary.status == "max steps reached" and summary.steps == 2
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert len(steps) == 2 and all(r["response_length/mean"] == 1.0 for r in steps), steps
    assert all(r["samples/failed"] == 0 for r in steps)
    tok = chat_tokenizer()
    assert tok.convert_tokens_to_ids(IM_END) != tok.convert_tokens_to_ids(EOT)
