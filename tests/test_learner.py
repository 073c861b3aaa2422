"""The learner's update on a real tiny model (no Ray): clipping once per optimizer step, failed
samples masked out, the loss going down on a fixed batch, GRPO/PPO advantages wired right."""

from __future__ import annotations

import random

import pytest
import torch

from nodes.learner import LearnerConfig, ppo_update, step_advantages
from nodes.models import ModelConfig, build_policy, sample_responses
from nodes.reference import add_logprobs
from nodes.tasks import build_tokenizer, make_task, score


@pytest.fixture(scope="module")
def setup():
    tok = build_tokenizer()
    model = build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, intermediate_size=64), tok)
    task = make_task("copy", 3)
    prompts = task.take(8)
    ids = [tok(p["prompt"])["input_ids"] for p in prompts for _ in range(2)]
    samples = sample_responses(model, tok, ids, task.max_new_tokens, seed=0)
    items = [{"samples": samples[2 * i:2 * i + 2], "fields": p} for i, p in enumerate(prompts)]
    add_logprobs(model, tok.pad_token_id, items, "ref_logprobs")
    for item in items:
        for s in item["samples"]:
            text = tok.decode(s["response_ids"], skip_special_tokens=True)
            s["score"] = score(item["fields"], text)
            s["failed"] = False
            s["advantages"] = [s["score"] - 0.1] * len(s["response_ids"])
    return tok, model, [s for item in items for s in item["samples"]]


def fresh(model):
    clone = build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, intermediate_size=64), build_tokenizer())
    clone.load_state_dict(model.state_dict())
    return clone


def with_advantages(samples, cfg):
    for s, adv in zip(samples, step_advantages(samples, cfg)):
        s["advantage_tokens"] = adv
    return samples


def test_gradient_clipping_happens_once_per_optimizer_step(setup, monkeypatch):
    tok, model, samples = setup
    cfg = LearnerConfig(ppo_epochs=2, minibatch_size=4)  # 16 samples -> 4 minibatches x 2 epochs
    calls, steps = [], []
    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: calls.append(1) or real_clip(*a, **k))
    m = fresh(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    real_step = opt.step
    opt.step = lambda *a, **k: steps.append(1) or real_step(*a, **k)
    ppo_update(m, opt, with_advantages(samples, cfg), 0.0, tok.pad_token_id, cfg, random.Random(0), stale=False)
    assert len(steps) == 8
    assert len(calls) == len(steps)


def test_failed_samples_do_not_move_the_policy(setup):
    tok, model, samples = setup
    cfg = LearnerConfig(minibatch_size=64, whiten_advantages=False, kl=LearnerConfig().kl)
    cfg.kl.coef = 0.0
    failed = [dict(s, failed=True) for s in samples]
    m = fresh(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    # All failed: the masked loss has no gradient, so SGD leaves every weight as it was.
    ppo_update(m, opt, with_advantages(failed, cfg), 0.0, tok.pad_token_id, cfg, random.Random(0), stale=False)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_update_raises_logprob_of_positive_advantage_tokens(setup):
    tok, model, samples = setup
    cfg = LearnerConfig(minibatch_size=64, ppo_epochs=4, whiten_advantages=False, lr=1e-2)
    samples = with_advantages([dict(s) for s in samples], cfg)
    m = fresh(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    from nodes.models import pad_batch, sequence_logprobs

    batch = pad_batch(samples, tok.pad_token_id, token_keys=("advantage_tokens",))
    def objective():
        with torch.no_grad():
            lp, _ = sequence_logprobs(m, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
        return (lp * batch["advantage_tokens"]).sum().item()
    before = objective()
    ppo_update(m, opt, samples, 0.0, tok.pad_token_id, cfg, random.Random(0), stale=True)
    assert objective() > before


def test_grpo_advantages_are_group_normalised_per_token(setup):
    _, _, samples = setup
    cfg = LearnerConfig(algorithm="grpo", group_size=2)
    advs = step_advantages(samples, cfg)
    for i in range(0, len(samples), 2):
        a, b = samples[i]["score"], samples[i + 1]["score"]
        if a == b:
            assert advs[i] == [0.0] * len(samples[i]["response_ids"])
        else:
            assert advs[i][0] == pytest.approx(-advs[i + 1][0]) and (advs[i][0] > 0) == (a > b)
        assert len(advs[i]) == len(samples[i]["response_ids"])
    ppo = step_advantages(samples, LearnerConfig(algorithm="ppo"))
    assert ppo == [s["advantages"] for s in samples]
