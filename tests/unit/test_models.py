"""rl/model/causal_lm.py: build/load, sampling log-probs vs a fresh forward, batching, the value model."""

import os

import pytest
import torch

from rl.model import causal_lm as models, padded_batch
from rl.generation import hf_sampling
from rl.data import tasks


@pytest.fixture(scope="module")
def tok():
    return tasks.build_tokenizer()


@pytest.fixture(scope="module")
def policy(tok):
    return models.build_policy(models.ModelConfig(n_layer=2, n_embd=64, n_head=4), tok)


def varied_prompts(tok, n=24):
    """Prompts of three different lengths (so the batch needs left padding)."""
    out = []
    for i, r in enumerate(tasks.make_task("copy", 3, seed=0).take(n)):
        ids = tok(r["prompt"])["input_ids"]
        out.append(ids if i % 3 == 0 else ids[:-1] if i % 3 == 1 else ids[:3] + ids[-1:])
    return out


def test_build_policy_is_seeded_and_sized(tok, policy):
    again = models.build_policy({"n_layer": 2, "n_embd": 64, "n_head": 4}, tok)
    for a, b in zip(policy.parameters(), again.parameters()):
        assert torch.equal(a, b)
    other = models.build_policy(models.ModelConfig(n_layer=2, n_embd=64, n_head=4, seed=1), tok)
    assert not torch.equal(next(policy.parameters()), next(other.parameters()))
    assert policy.config.vocab_size == len(tok)
    assert policy.get_input_embeddings().weight is policy.get_output_embeddings().weight
    with pytest.raises(ValueError, match="unknown keys"):
        models.build_policy({"n_layers": 2}, tok)
    with pytest.raises(ValueError, match="divisible"):
        models.ModelConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="n_kv_head=3 must divide n_head=4"):
        models.ModelConfig(n_head=4, n_kv_head=3)
    gqa = models.build_policy(models.ModelConfig(family="qwen2", n_layer=1, n_embd=64, n_head=4,
                                                 n_kv_head=2), tok)
    assert gqa.config.num_key_value_heads == 2
    assert gqa.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_fresh_forward(tok, policy, temperature):
    prompts = varied_prompts(tok)
    samples = hf_sampling.sample_responses(policy, tok, prompts, max_new_tokens=6,
                                      temperature=temperature, seed=0)
    batch = padded_batch.pad_batch(samples, tok.pad_token_id)
    with torch.no_grad():
        logprobs, entropy = padded_batch.sequence_logprobs(policy, batch["input_ids"],
                                                     batch["attention_mask"],
                                                     batch["response_mask"], temperature)
    mask = batch["response_mask"]
    assert ((logprobs - batch["logprobs"]).abs() * mask).max() < 1e-5
    assert (logprobs * (1 - mask)).abs().max() == 0
    assert (entropy * mask > 0).sum() == mask.sum()
    # each sample alone (no padding at all) gives the same log-probs
    for i in (0, 1, 2):
        alone = padded_batch.pad_batch([samples[i]], tok.pad_token_id)
        with torch.no_grad():
            lp, _ = padded_batch.sequence_logprobs(policy, alone["input_ids"], alone["attention_mask"],
                                             alone["response_mask"], temperature)
        got = padded_batch.unpad_tokens(lp, alone["response_mask"])[0]
        assert got == pytest.approx(samples[i]["logprobs"], abs=1e-5)


def test_sampling_is_seeded_and_stops_at_eos(tok, policy):
    prompts = varied_prompts(tok, 64)
    a = hf_sampling.sample_responses(policy, tok, prompts, 5, seed=3)
    b = hf_sampling.sample_responses(policy, tok, prompts, 5, generator=torch.Generator().manual_seed(3))
    assert a == b
    assert a != hf_sampling.sample_responses(policy, tok, prompts, 5, seed=4)
    for s, p in zip(a, prompts):
        assert s["prompt_ids"] == p
        assert 1 <= len(s["response_ids"]) <= 5 and len(s["logprobs"]) == len(s["response_ids"])
        assert s["finished"] == (s["response_ids"][-1] == tok.eos_token_id)
        assert tok.eos_token_id not in s["response_ids"][:-1]
    assert any(s["finished"] for s in a) and not all(s["finished"] for s in a)
    greedy = hf_sampling.sample_responses(policy, tok, prompts[:4], 5, temperature=0)
    assert greedy == hf_sampling.sample_responses(policy, tok, prompts[:4], 5, temperature=0)
    top1 = hf_sampling.sample_responses(policy, tok, prompts[:4], 5, top_k=1, seed=9)
    assert [s["response_ids"] for s in top1] == [s["response_ids"] for s in greedy]
    assert all(abs(x) < 1e-6 for s in top1 for x in s["logprobs"])


def test_untrained_policy_scores_like_chance(tok):
    policy = models.build_policy(None, tok)
    task = tasks.make_task()
    records = task.take(256)
    samples = hf_sampling.sample_responses(policy, tok, [tok(r["prompt"])["input_ids"] for r in records],
                                      task.max_new_tokens, seed=0)
    scores = [task.score(r, tok.decode(s["response_ids"], skip_special_tokens=True))
              for r, s in zip(records, samples)]
    assert sum(scores) / len(scores) < 0.2


def test_pad_batch_layout(tok):
    samples = [{"prompt_ids": [1, 5, 6], "response_ids": [7, 2], "logprobs": [-0.5, -0.25]},
               {"prompt_ids": [1, 5], "response_ids": [8, 9, 2], "logprobs": [-1.0, -2.0, -3.0]}]
    b = padded_batch.pad_batch(samples, pad_id=0)
    assert b["prompt_len"] == 3
    assert b["input_ids"].tolist() == [[1, 5, 6, 7, 2, 0], [0, 1, 5, 8, 9, 2]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]
    assert b["response_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert b["logprobs"].tolist() == [[0, 0, 0, -0.5, -0.25, 0], [0, 0, 0, -1.0, -2.0, -3.0]]
    assert padded_batch.unpad_tokens(b["logprobs"], b["response_mask"]) == [[-0.5, -0.25],
                                                                      [-1.0, -2.0, -3.0]]
    samples[0]["logprobs"] = [-0.5]
    with pytest.raises(ValueError, match="sample 0 has 1 'logprobs' values for 2"):
        padded_batch.pad_batch(samples, pad_id=0)


def test_value_model_alignment_and_checkpointing(tok, policy):
    critic = models.ValueModel.from_policy(policy, gradient_checkpointing=True)
    samples = hf_sampling.sample_responses(policy, tok, varied_prompts(tok, 6), 4, seed=0)
    b = padded_batch.pad_batch(samples, tok.pad_token_id)
    values = critic(b["input_ids"], b["attention_mask"])
    assert values.shape == b["input_ids"].shape and torch.all(values[:, 0] == 0)
    # values[:, t] sees tokens < t only: changing the last token changes no value of a full row
    full = b["attention_mask"].bool().all(1).nonzero()[0, 0]
    ids = b["input_ids"].clone()
    ids[full, -1] = (ids[full, -1] + 1) % len(tok)
    with torch.no_grad():
        assert torch.allclose(critic(ids, b["attention_mask"])[full], values[full].detach(), atol=1e-6)
    critic.train()
    (values * b["response_mask"]).sum().backward()
    assert critic.value_head.weight.grad is not None
    assert next(critic.backbone.parameters()).grad is not None
    fresh = models.ValueModel.from_config(None, tok)
    assert fresh(b["input_ids"], b["attention_mask"]).shape == values.shape


def test_save_and_load_policy(tmp_path, tok, policy):
    path = str(tmp_path / "run")
    models.save_policy(policy, tok, path)
    loaded, loaded_tok = models.load_policy(path)
    ids = torch.tensor([tok("copy 1 2 3 :")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, policy(input_ids=ids).logits)
    assert loaded_tok("copy 4 :")["input_ids"] == tok("copy 4 :")["input_ids"]

    with pytest.raises(FileNotFoundError, match="does not exist"):
        models.load_policy(str(tmp_path / "nope"))
    os.remove(os.path.join(path, "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match=f"{path}: no tokenizer.json"):
        models.load_policy(path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=f"{path}: missing weights"):
        models.load_policy(path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(FileNotFoundError, match=f"{path}: missing config.json"):
        models.load_policy(path)


def test_sample_responses_per_row_temperature(tok, policy):
    """Rows at temperature 0 are the greedy responses (the same twice) beside sampled rows."""
    prompts = varied_prompts(tok, 6)
    temps = [0.0, 1.0] * 3
    a = hf_sampling.sample_responses(policy, tok, prompts, 5, temperature=temps, seed=1)
    b = hf_sampling.sample_responses(policy, tok, prompts, 5, temperature=temps, seed=2)
    greedy = hf_sampling.sample_responses(policy, tok, prompts, 5, temperature=0)
    for i in range(0, 6, 2):
        assert a[i]["response_ids"] == b[i]["response_ids"] == greedy[i]["response_ids"]
        assert a[i]["logprobs"] == pytest.approx(greedy[i]["logprobs"], abs=1e-5)
    assert [a[i]["response_ids"] for i in (1, 3, 5)] != [b[i]["response_ids"] for i in (1, 3, 5)]
    same = hf_sampling.sample_responses(policy, tok, prompts, 5, temperature=[1.0] * 6, seed=1)
    assert same == hf_sampling.sample_responses(policy, tok, prompts, 5, temperature=1.0, seed=1)
    with pytest.raises(ValueError, match="temperatures for 6 prompts"):
        hf_sampling.sample_responses(policy, tok, prompts, 5, temperature=[0.0, 1.0])


def test_sample_responses_builds_no_autograd_graph_in_a_worker_thread(tok, policy):
    """The HF loop samples in asyncio.to_thread, where grad mode is on, with a model whose weights
    require grad: every forward must still run without a graph (one kept over a batch of episodes
    held every layer's activations of every decode step and ran a GPU out of memory)."""
    import asyncio

    grad_modes = []
    hook = policy.register_forward_hook(lambda module, args, out: grad_modes.append(torch.is_grad_enabled()))
    try:
        assert any(p.requires_grad for p in policy.parameters())
        asyncio.run(asyncio.to_thread(hf_sampling.sample_responses, policy, tok, varied_prompts(tok, 3), 4, seed=0))
    finally:
        hook.remove()
    assert grad_modes and not any(grad_modes)


def test_cast_model_keeps_rotary_in_float32(tok, policy):
    """rl/model/precision.cast_model (the generator's and the frozen reference's cast): bf16 weights,
    rotary inverse frequencies still float32, so a long context's logits stay those of the fp32
    model within bf16's rounding; a plain .to(bfloat16) rounds the frequencies and drifts."""
    import copy
    from rl.model.precision import cast_model
    fp32 = copy.deepcopy(policy).eval()
    ours = cast_model(copy.deepcopy(policy), "cpu", torch.bfloat16).eval()
    plain = copy.deepcopy(policy).to(dtype=torch.bfloat16).eval()
    assert next(ours.parameters()).dtype == torch.bfloat16
    rotary = ours.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, fp32.model.rotary_emb.inv_freq)
    assert plain.model.rotary_emb.inv_freq.dtype == torch.bfloat16   # what the helper guards against

    # positions far into a context: cos/sin of the fp32 model, rounded to bf16 once
    x = torch.zeros(1, 1, policy.config.hidden_size, dtype=torch.bfloat16)
    pos = torch.tensor([[700, 1500]])
    want = [t.to(torch.bfloat16) for t in fp32.model.rotary_emb(x.float(), pos)]
    assert all(torch.equal(a, b) for a, b in zip(rotary(x, pos), want))
    assert not all(torch.equal(a, b) for a, b in zip(plain.model.rotary_emb(x, pos), want))
