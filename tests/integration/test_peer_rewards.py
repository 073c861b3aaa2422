"""Peer parity: reward files written the way TRL's and verl's documentation tells their users to,
run unchanged through the CLI (dataflow.run.main, what `python -m dataflow.run graphs/grpo.py`
runs, on this module's Ray instance) on the tiny chat model (tests/chat_model.py), checking the
rewards the learner received (metrics.jsonl), not only that the run ended. docs/rewards.md lists
the conventions; the README claims TRL's and verl's (OpenRLHF's reward_func is not claimed).

The model always answers <|im_end|> at once, so each response is "" (special tokens are not
decoded): the functions below score from the row and the shape of what they are given, which
makes every step's mean reward known in advance. That model dir has no pad token and names
<|im_end|> as an eos only in generation_config.json (the tokenizer's eos is <|endoftext|>): every
run also checks that each response ends at that first token (length 1, not max_new_tokens=8)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataflow.run import main
from tests.chat_model import IM_END, make_chat_model_dir

pytestmark = pytest.mark.usefixtures("ray_instance")  # one Ray for the module (tests/conftest.py)

STEPS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_model")
    make_chat_model_dir(path)
    return str(path)


def chat(text: str) -> list[dict]:
    return [{"role": "system", "content": "you are terse"}, {"role": "user", "content": text}]


def run_grpo(tmp_path: Path, model_dir: str, rows: list[dict], *overrides: str, parquet: bool = False) -> list[dict]:
    """GRPO for STEPS steps over `rows` (4 prompts a step, 2 responses each), written as a jsonl
    file or a parquet one (verl's); metrics.jsonl records."""
    if parquet:
        data = tmp_path / "train.parquet"
        pq.write_table(pa.Table.from_pylist(rows), data)
    else:
        data = tmp_path / "train.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    rc = main(["graphs/grpo.py", "--set", f"policy.path={model_dir}", "--set", f"prompts.policy.path={model_dir}",
               "--set", f"prompts.path={data}", "--set", "max_new_tokens=8", "--set", "prompts_per_step=4",
               "--set", "group_size=2", "--set", "learner.minibatch_size=8", "--set", "channel_capacity=8",
               "--set", "learner.kl.coef=0", "--set", "learner.record_prompt_ids=true",
               *[a for o in overrides for a in ("--set", o)], "--max-steps", str(STEPS), "--out", str(out)])
    assert rc == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_learner_received(records: list[dict], expected: list[float]) -> None:
    """Every step's reward/mean is the mean of `expected[id % len(expected)]` over the prompts it
    trained on (file order, no shuffle), no response failed, and every response ended at the
    generation_config.json eos <|im_end|> (length 1)."""
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), steps
    for r in steps:
        want = sum(expected[i % len(expected)] for i in r["prompt_ids"]) / len(r["prompt_ids"])
        assert r["reward/mean"] == pytest.approx(want, abs=1e-9), (r["prompt_ids"], r["reward/mean"], want)
        assert r["samples/failed"] == 0
        assert r["response_length/mean"] == 1.0, r


def reward_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("node") == "reward" and "step" not in r]


def test_a_trl_users_weighted_chat_rewards_run_unchanged(tmp_path, model_dir):
    """TRL's GRPOTrainer convention: trl.rewards' own accuracy_reward and think_format_reward,
    plus two functions in TRL's documented form (conversational completions, a column as a list,
    None to skip), with reward.function=[...] and reward.weights=[...], each logged on its own."""
    reward = tmp_path / "trl_rewards.py"
    reward.write_text(textwrap.dedent('''
        from trl.rewards import accuracy_reward, think_format_reward


        def format_reward(completions, **kwargs):
            """1 for TRL's conversational completion: one assistant message."""
            return [float(len(c) == 1 and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str))
                    for c in completions]


        def level_reward(prompts, completions, level, completion_ids, **kwargs):
            """The row's `level`, +0.5 if its prompt came as chat messages; None (skip) without a level."""
            assert len(prompts) == len(completions) == len(level) == len(completion_ids)
            return [None if lv is None else lv + 0.5 * (p[-1]["role"] == "user") for p, lv in zip(prompts, level)]
    '''))
    rows = [{"prompt": chat(f"add {i} + 1 ="), "solution": str(i + 1), "level": level}
            for i, level in enumerate([1, 2, None, 3])]
    records = run_grpo(tmp_path, model_dir, rows, f"reward.path={reward}",
                       "reward.function=[accuracy_reward, think_format_reward, level_reward, format_reward]",
                       "reward.weights=[1.0, 0.2, 1.0, 0.5]")
    # "" is neither right (accuracy 0) nor <think>-formatted (0); level + 0.5 (skipped without one); format 1 x 0.5
    check_learner_received(records, [1 + 0.5 + 0.5, 2 + 0.5 + 0.5, 0.5, 3 + 0.5 + 0.5])
    logged = reward_records(records)
    assert logged and all(r["reward/accuracy_reward"] == 0.0 and r["reward/think_format_reward"] == 0.0
                          and r["reward/format_reward"] == 1.0 for r in logged), logged
    assert all(1.5 <= r["reward/level_reward"] <= 3.5 for r in logged), logged   # a batch's mean of 1.5 / 2.5 / 3.5


VERL_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0, **kwargs):
    """verl's custom reward function: ground truth / 10, + format_score (custom_reward_function.reward_kwargs)."""
    assert data_source == "toy/add" and extra_info["split"] == "train"
    return {"score": float(ground_truth) / 10 + format_score, "acc": float(extra_info["index"] % 2)}
'''


def verl_rows() -> list[dict]:
    return [{"data_source": "toy/add", "prompt": chat(f"add {i} + 1 ="), "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 3)}, "extra_info": {"index": i, "split": "train"}}
            for i in range(4)]


def test_a_verl_users_compute_score_runs_unchanged(tmp_path, model_dir):
    """verl's layout in verl's parquet file and compute_score(data_source, solution_str,
    ground_truth, extra_info, **kwargs) with no reward.function setting; reward.kwargs as verl's
    reward_kwargs; the dict's "score" is the reward and its other numeric key is logged. The chat
    rows render with the model dir's template (no pad token: no pad crash anywhere), and every
    response ends at the eos only generation_config.json names (check_learner_received)."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_dir)   # the premise: <|im_end|> is an eos only by generation_config
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert tok.pad_token is None and tok.eos_token_id != im_end
    assert im_end in GenerationConfig.from_pretrained(model_dir).eos_token_id
    reward = tmp_path / "verl_reward.py"
    reward.write_text(VERL_FILE)
    records = run_grpo(tmp_path, model_dir, verl_rows(), f"reward.path={reward}", 'reward.kwargs={"format_score": 0.5}',
                       parquet=True)
    check_learner_received(records, [0.8, 0.9, 1.0, 1.1])
    logged = reward_records(records)
    assert logged and all(0.0 <= r["reward/acc"] <= 1.0 and 0.8 <= r["reward/compute_score"] <= 1.1 for r in logged)
    assert {r["reward/acc"] for r in logged} != {0.0}   # odd rows' 1.0 reached the log


def test_verls_batched_compute_score_runs_unchanged(tmp_path, model_dir):
    """verl's BatchRewardManager form: compute_score(data_sources, solution_strs, ground_truths,
    extra_infos, **reward_kwargs) -> a list, lists in."""
    reward = tmp_path / "verl_batch_reward.py"
    reward.write_text(textwrap.dedent('''
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
            assert len(data_sources) == len(solution_strs) == len(ground_truths) == len(extra_infos)
            return [float(g) / 10 + kwargs["bonus"] for g in ground_truths]
    '''))
    records = run_grpo(tmp_path, model_dir, verl_rows(), f"reward.path={reward}", 'reward.kwargs={"bonus": 1.0}')
    check_learner_received(records, [1.3, 1.4, 1.5, 1.6])
