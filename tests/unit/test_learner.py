"""The learner's update on a real tiny model (no Ray): clipping once per optimizer step, failed
samples masked out, the loss going down on a fixed batch, GRPO/PPO advantages wired right."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nodes.impl.learner import LearnerConfig, ppo_update, step_advantages
from rl.model.causal_lm import ModelConfig, build_policy
from rl.generation.hf_sampling import sample_responses
from nodes.impl.reference import add_logprobs
from rl.data.tasks import build_tokenizer, make_task, score


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
    from rl.model.padded_batch import pad_batch, sequence_logprobs

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
    ppo = step_advantages(samples, LearnerConfig(algorithm="ppo", whiten_advantages=False))
    assert ppo == [pytest.approx(s["advantages"], abs=1e-7) for s in samples]
    # gae: whitened over the batch's tokens (verl's GAE); the group estimators never are
    whitened = [a for row in step_advantages(samples, LearnerConfig(algorithm="ppo")) for a in row]
    mean = sum(whitened) / len(whitened)
    assert mean == pytest.approx(0.0, abs=1e-9)
    assert sum((a - mean) ** 2 for a in whitened) / (len(whitened) - 1) == pytest.approx(1.0, rel=1e-4)  # var + 1e-8


def _float64_update(model, samples, tok, micro_batch_size, stale, **settings):
    """One ppo_update in float64 (SGD lr=1, so the weight change is exactly the clipped gradient);
    returns (weights, stats)."""
    m = fresh(model).double()
    cfg = LearnerConfig(minibatch_size=len(samples), ppo_epochs=2, micro_batch_size=micro_batch_size,
                        entropy_coef=0.01, max_grad_norm=1e9, **settings)
    cfg.kl.coef = 0.1
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    stats = ppo_update(m, opt, with_advantages([dict(s) for s in samples], cfg), 0.1, tok.pad_token_id, cfg,
                       random.Random(0), stale=stale)
    return {k: v.clone() for k, v in m.state_dict().items()}, stats


GRPO2 = dict(algorithm="grpo", group_size=2)


@pytest.mark.parametrize("stale,settings", [
    (False, {}), (True, {}),
    (False, dict(loss_agg_mode="seq-mean-token-mean", policy_loss="dual_clip", **GRPO2)),
    (True, dict(loss_agg_mode="seq-mean-token-sum", policy_loss="gspo", advantage="rloo", **GRPO2)),
    (False, dict(advantage="dr_grpo", max_new_tokens=8, policy_loss="reinforce", **GRPO2)),
    (False, dict(advantage="reinforce_pp", clip_eps_high=0.28, mask_truncated=True, overlong_buffer=2,
                 max_new_tokens=4, **GRPO2)),
])
def test_micro_batches_equal_the_whole_minibatch_in_float64(setup, stale, settings):
    # Responses of different lengths and two failed samples: slices hold different numbers of
    # valid tokens, which is what the whole minibatch's normaliser has to get right, for every
    # aggregation mode, policy loss and advantage estimator.
    tok, model, samples = setup
    samples = [dict(s, failed=i in (1, 6), token_rewards=[0.1 * i] * len(s["response_ids"]))
               for i, s in enumerate(samples)]
    whole, whole_stats = _float64_update(model, samples, tok, 0, stale, **settings)
    split, split_stats = _float64_update(model, samples, tok, 3, stale, **settings)  # 16 samples: 3+3+3+3+3+1
    for k in whole:
        assert torch.allclose(whole[k], split[k], rtol=0, atol=1e-12), k
    for k in ("losses/policy", "losses/kl", "entropy", "losses/approx_kl", "losses/clipfrac", "grad_norm"):
        assert split_stats[k] == pytest.approx(whole_stats[k], rel=1e-10, abs=1e-12), k
    assert any(not torch.equal(whole[k], fresh(model).double().state_dict()[k]) for k in whole)


def test_reference_and_old_logprobs_micro_batched_match(setup):
    tok, model, samples = setup
    m = fresh(model).double()
    items = [{"samples": [dict(s) for s in samples[i:i + 2]]} for i in range(0, len(samples), 2)]
    add_logprobs(m, tok.pad_token_id, items, "a")
    add_logprobs(m, tok.pad_token_id, items, "b", micro_batch_size=5)
    for item in items:
        for s in item["samples"]:
            assert s["a"] == pytest.approx(s["b"], abs=1e-12)


def test_critic_micro_batches_equal_the_whole_minibatch(setup):
    from nodes.impl.critic import CriticConfig, critic_update
    from rl.model.causal_lm import ValueModel

    tok, model, samples = setup
    samples = [dict(s, values=[0.1] * len(s["response_ids"]), returns=[s["score"]] * len(s["response_ids"]))
               for s in samples]
    results = []
    for mbs in (0, 3):
        vm = ValueModel.from_policy(fresh(model)).double()
        opt = torch.optim.SGD(vm.parameters(), lr=1.0)
        cfg = CriticConfig(epochs=1, minibatch_size=len(samples), micro_batch_size=mbs, max_grad_norm=1e9)
        stats = critic_update(vm, opt, samples, tok.pad_token_id, cfg, random.Random(0))
        results.append(({k: v.clone() for k, v in vm.state_dict().items()}, stats))
    # ValueModel.forward returns float32 values whatever the trunk's dtype, so this equality holds
    # to float32 rounding, not float64's.
    (w0, s0), (w1, s1) = results
    for k in w0:
        assert torch.allclose(w0[k], w1[k], rtol=1e-5, atol=1e-8), k
    assert s1["critic/value_loss"] == pytest.approx(s0["critic/value_loss"], rel=1e-5)


def test_precision_settings():
    from rl.model.precision import compile_setting, compute_dtype, micro_slices

    # compile's default stays eager with packed passes or gradient checkpointing; explicit wins
    assert compile_setting(None, packing=False) is None
    assert compile_setting(None, packing=True) is False
    assert compile_setting(None, packing=False, gradient_checkpointing=True) is False
    assert compile_setting(True, packing=True, gradient_checkpointing=True) is True
    assert compile_setting(False, packing=False) is False
    assert compute_dtype("auto", "cpu") == torch.float32
    assert compute_dtype("auto", "cuda") == torch.bfloat16
    assert compute_dtype("fp32", "cuda") == torch.float32
    assert compute_dtype("bf16", "cpu") == torch.bfloat16
    assert micro_slices(7, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    assert micro_slices(7, 0) == [slice(0, 7)]


def test_sequence_logprobs_match_a_plain_log_softmax_of_the_whole_forward(setup):
    # logits_to_keep, the chunked kernel and a detached entropy give the textbook numbers:
    # log_softmax(logits[t - 1] / T)[token t] on response tokens, 0 elsewhere.
    from rl.model.padded_batch import mask_position_ids as _position_ids, pad_batch, sequence_logprobs

    tok, model, samples = setup
    m = fresh(model).double()
    b = pad_batch(samples, tok.pad_token_id)
    args = (m, b["input_ids"], b["attention_mask"], b["response_mask"])
    lp, ent = sequence_logprobs(*args, temperature=0.7)
    with torch.no_grad():
        lp_n, ent_n = sequence_logprobs(*args, temperature=0.7)
    lp_d, ent_d = sequence_logprobs(*args, temperature=0.7, entropy_grad=False)
    assert lp.dtype == torch.float64 and lp.requires_grad and ent.requires_grad
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
               position_ids=_position_ids(b["attention_mask"])).logits.detach()
    logp_all = torch.log_softmax(logits[:, :-1] / 0.7, dim=-1)
    mask = b["response_mask"][:, 1:].double()
    expect_lp = logp_all.gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1) * mask
    expect_ent = -(logp_all.exp() * logp_all).sum(-1) * mask
    assert torch.allclose(lp[:, 1:], expect_lp, rtol=0, atol=1e-10) and not lp[:, 0].any()
    assert torch.allclose(ent[:, 1:], expect_ent, rtol=0, atol=1e-10)
    assert torch.equal(lp, lp_n) and torch.equal(ent, ent_n)
    assert torch.equal(lp, lp_d) and torch.equal(ent, ent_d) and not ent_d.requires_grad


@pytest.mark.parametrize("minibatch_size", [16, 6])
def test_stale_update_takes_the_first_minibatchs_proximal_logprobs_from_its_own_forward(setup, minibatch_size):
    # Decoupled PPO: the proximal ("old") log-probs are the weights' before the update. The first
    # minibatch's forward pass runs on exactly those weights, so only the other rows get an extra
    # no-grad pass. Behaviour log-probs 0.1 below the model's make every token's importance weight
    # exp(old - behaviour) = exp(0.1) -- for the rows of both kinds, if their old log-probs are right.
    tok, model, samples = setup
    m = fresh(model).double()
    samples = with_advantages([dict(s) for s in samples], LearnerConfig())
    items = [{"samples": samples}]
    add_logprobs(m, tok.pad_token_id, items, "logprobs")          # the model's own, float64
    for s in samples:
        s["logprobs"] = [v - 0.1 for v in s["logprobs"]]
    no_grad_rows = []
    m.register_forward_hook(lambda mod, args, kwargs, out: None if torch.is_grad_enabled()
                            else no_grad_rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    cfg = LearnerConfig(minibatch_size=minibatch_size, ppo_epochs=1, micro_batch_size=4, is_truncation=2.0)
    stats = ppo_update(m, torch.optim.SGD(m.parameters(), lr=0.1), samples, 0.0, tok.pad_token_id, cfg,
                       random.Random(0), stale=True)
    assert sum(no_grad_rows) == len(samples) - minibatch_size
    assert stats["losses/is_weight"] == pytest.approx(math.exp(0.1), rel=1e-6)   # float32 log-probs


# --- issue 17's four bugs: each test fails on the learner before the fix -------------------------

def _crafted(tok, model, lengths, scores, failed=()):
    """Samples of one prompt with responses of the given lengths and scores; behaviour and
    reference log-probs are the model's own (full softmax, T=1), so with identical weights every
    importance ratio is 1 and the policy loss is -sum(A) / tokens."""
    prompt = tok("1 2 3")["input_ids"]
    digits = tok.convert_tokens_to_ids(["4", "5", "6", "7"])
    samples = [{"prompt_ids": prompt, "response_ids": [digits[j % 4] for j in range(n)], "score": float(score),
                "failed": i in failed, "finished": True, "advantages": [0.0] * n, "token_rewards": [0.0] * n}
               for i, (n, score) in enumerate(zip(lengths, scores))]
    add_logprobs(model, tok.pad_token_id, [{"samples": samples}], "logprobs")
    add_logprobs(model, tok.pad_token_id, [{"samples": samples}], "ref_logprobs")
    return samples


def _policy_loss_at_identical_weights(model, tok, samples, cfg):
    m = fresh(model)
    stats = ppo_update(m, torch.optim.SGD(m.parameters(), lr=0.0), with_advantages(samples, cfg), 0.0,
                       tok.pad_token_id, cfg, random.Random(0), stale=False)
    return stats


def test_grpo_advantages_are_not_whitened_again_over_tokens(setup):
    # Groups of 2, scores [1, 0 | 1, 1], lengths [1, 3 | 2, 2]: advantages [[0.707], [-0.707 x3],
    # [0, 0], [0, 0]], so the token-mean policy loss is -(0.707 - 3 x 0.707) / 8 = 0.177. Whitened
    # again over the tokens ([[1.768], [-1.061 x3], [0.354 x2] x2]) it was 0, and the group with
    # no signal was pushed up, by length.
    tok, model, _ = setup
    samples = _crafted(tok, model, [1, 3, 2, 2], [1, 0, 1, 1])
    cfg = LearnerConfig(algorithm="grpo", group_size=2, minibatch_size=4)
    cfg.kl.coef = 0.0
    advs = step_advantages(samples, cfg)
    assert advs[0] == pytest.approx([0.5 ** 0.5], abs=1e-5) and advs[1] == pytest.approx([-0.5 ** 0.5] * 3, abs=1e-5)
    assert advs[2] == advs[3] == [0.0, 0.0]
    stats = _policy_loss_at_identical_weights(model, tok, samples, cfg)
    assert stats["losses/policy"] == pytest.approx(2 * 0.5 ** 0.5 / 8, abs=1e-5)


def test_a_failed_sample_is_not_part_of_its_groups_baseline(setup):
    # Group [1, 1, failed, 1]: the valid members all scored 1, so their advantage is 0 (it was 0.5:
    # the failed sample's 0 score pulled the group mean down).
    tok, model, _ = setup
    samples = _crafted(tok, model, [2, 3, 2, 1], [1, 1, 0, 1], failed=(2,))
    cfg = LearnerConfig(algorithm="grpo", group_size=4, whiten_advantages=False)
    assert all(a == 0.0 for row in step_advantages(samples, cfg) for a in row)
    for advantage in ("dr_grpo", "rloo"):
        cfg.advantage = advantage
        assert all(a == 0.0 for row in step_advantages(samples, cfg) for a in row), advantage


@pytest.mark.parametrize("sampling", [{"min_new_tokens": 2}, {"top_k": 4}])
def test_old_logprobs_are_the_learners_own_so_the_ratio_is_one_at_identical_weights(setup, sampling):
    # The generator's behaviour log-probs come from the distribution it sampled: <eos> masked
    # before min_new_tokens, or renormalised over the top_k tokens. Used as the old log-probs they
    # gave a ratio of 0.169 / 0.603 with identical weights; recomputed by the learner it is 1.
    tok, model, _ = setup
    task = make_task("copy", 3)
    ids = [tok(p["prompt"])["input_ids"] for p in task.take(8)]
    samples = sample_responses(model, tok, ids, task.max_new_tokens, seed=1, **sampling)
    items = [{"samples": samples}]
    add_logprobs(model, tok.pad_token_id, items, "ref_logprobs")
    behaviour = [v for s in samples for v in s["logprobs"]]
    add_logprobs(model, tok.pad_token_id, items, "full")
    assert max(abs(a - b) for a, b in zip(behaviour, [v for s in samples for v in s["full"]])) > 0.01
    for s in samples:
        s.update(score=1.0, failed=False, advantages=[1.0] * len(s["response_ids"]))
    cfg = LearnerConfig(minibatch_size=4, ppo_epochs=1, whiten_advantages=False)  # 2 minibatches
    stats = _policy_loss_at_identical_weights(model, tok, samples, cfg)
    assert stats["losses/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats["losses/clipfrac"] == 0.0


def test_reference_logprobs_are_at_the_sampling_temperature(setup):
    # The learner's log-probs are at the sampling temperature; the reference's were at T=1, so with
    # policy = reference the KL at T=0.7 was 0.079 instead of 0.
    tok, model, samples = setup
    samples = [dict(s) for s in samples]
    add_logprobs(model, tok.pad_token_id, [{"samples": samples}], "ref_logprobs", temperature=0.7)
    add_logprobs(model, tok.pad_token_id, [{"samples": samples}], "logprobs", temperature=0.7)
    cfg = LearnerConfig(minibatch_size=len(samples), ppo_epochs=1, temperature=0.7)
    stats = _policy_loss_at_identical_weights(model, tok, samples, cfg)
    assert stats["losses/kl"] == pytest.approx(0.0, abs=1e-6)


def test_an_overflowing_log_ratio_is_clamped_not_a_skipped_minibatch(setup):
    # Tokens whose policy log-prob lies 100 below the reference's: k3's exp(ref - logp) overflows
    # float32 to inf and the minibatch was skipped; with the log ratio clamped at 20 and the
    # estimate at 10 (verl's bounds) the update goes through.
    tok, model, samples = setup
    samples = with_advantages([dict(s) for s in samples], LearnerConfig())
    samples[0]["ref_logprobs"] = [v + 100.0 for v in samples[0]["ref_logprobs"]]
    cfg = LearnerConfig(minibatch_size=len(samples), ppo_epochs=2, kl=LearnerConfig().kl)
    cfg.kl.coef, cfg.kl.estimator, cfg.kl.clamp = 0.1, "k3", 10.0
    m = fresh(model)
    stats = ppo_update(m, torch.optim.SGD(m.parameters(), lr=1e-3), samples, 0.1, tok.pad_token_id, cfg,
                       random.Random(0), stale=False)
    assert stats["updates/skipped"] == 0 and math.isfinite(stats["losses/kl"])
    assert stats["losses/kl"] == pytest.approx(10.0 * len(samples[0]["response_ids"]) /
                                               sum(len(s["response_ids"]) for s in samples), rel=0.05)
    # The default leaves the estimate unclamped (see KLConfig.clamp); the log ratio's clamp alone
    # keeps it finite, so the update still goes through.
    cfg.kl.clamp = LearnerConfig().kl.clamp
    m = fresh(model)
    stats = ppo_update(m, torch.optim.SGD(m.parameters(), lr=1e-3), samples, 0.1, tok.pad_token_id, cfg,
                       random.Random(0), stale=False)
    assert stats["updates/skipped"] == 0 and math.isfinite(stats["losses/kl"]) and stats["losses/kl"] > 1e3


def test_settings_that_do_not_fit_together_are_clear_errors():
    from dataflow.checks import problems
    from dataflow.errors import UserError
    from nodes.learner import check_config

    def error(max_steps=None, **settings):
        cfg = LearnerConfig(**{k: v for k, v in settings.items() if "." not in k})
        for key, value in settings.items():
            if "." in key:
                sub, name = key.split(".")
                setattr(getattr(cfg, sub), name, value)
        with pytest.raises(UserError) as e:
            check_config(cfg, max_steps)
        return str(e.value)

    assert "graphs/ppo.py" in error(algorithm="grpo", advantage="gae")
    assert "learner-side advantage" in error(**{"kl.placement": "reward"})       # gae: the critic's GAE
    assert "learner-side advantage" in error(overlong_buffer=2, max_new_tokens=8)
    assert "max_new_tokens" in error(algorithm="grpo", advantage="dr_grpo")  # no constant to divide by
    assert "max_new_tokens" in error(algorithm="grpo", overlong_buffer=4)
    # ranges of one setting are declared beside it (dataflow/checks.py), checked before start
    assert problems(LearnerConfig(policy_loss="dual_clip", dual_clip_c=1.0)) == ["dual_clip_c=1.0: must be > 1"]
    assert problems(LearnerConfig(betas=[0.9])) == ["betas=[0.9]: give 2 values"]
    assert "--max-steps" in error(**{"schedule.decay": "cosine"})
    check_config(LearnerConfig(algorithm="grpo", advantage="dr_grpo", max_new_tokens=8), None)   # fits
    cfg = LearnerConfig()
    cfg.schedule.decay = "cosine"
    check_config(cfg, 100)                              # decays over the run's max_steps


def test_stale_steps_weight_each_token_by_its_own_version(setup):
    """ppo_update with the step's version and per-token "token_versions" (partial rollouts): tokens
    sampled by the step's own weights get importance weight 1, so all-fresh tokens in a stale step
    update exactly as a fresh step, all-old ones as today's per-sample stale path, and a mix lies
    between (rl/algorithm/losses.behaviour_weights, tested against a float64 loop in test_rl_math.py)."""
    tok, model, samples = setup
    # behaviour log-probs that differ from the learner's, so the importance weights are not ~1
    samples = [dict(s, logprobs=[lp + 0.3 * ((i + t) % 3 - 1) for t, lp in enumerate(s["logprobs"])])
               for i, s in enumerate(samples)]

    def update(stale, version=None, versions=None):
        m = fresh(model).double()
        cfg = LearnerConfig(minibatch_size=len(samples), max_grad_norm=1e9, is_truncation=1.5)
        batch = [dict(s, **({"token_versions": versions(s)} if versions else {})) for s in samples]
        stats = ppo_update(m, torch.optim.SGD(m.parameters(), lr=1.0), with_advantages(batch, cfg), 0.0,
                           tok.pad_token_id, cfg, random.Random(0), stale=stale, version=version)
        return torch.cat([p.detach().flatten() for p in m.parameters()]), stats

    on_policy, _ = update(False)
    per_sample, per_sample_stats = update(True)
    fresh_tokens, _ = update(True, 5, lambda s: [5] * len(s["response_ids"]))
    old_tokens, old_stats = update(True, 5, lambda s: [4] * len(s["response_ids"]))
    mixed, mixed_stats = update(True, 5, lambda s: [4] + [5] * (len(s["response_ids"]) - 1))
    assert (on_policy - per_sample).abs().max() > 1e-6              # the weights matter here
    torch.testing.assert_close(fresh_tokens, on_policy, rtol=0, atol=1e-12)
    torch.testing.assert_close(old_tokens, per_sample, rtol=0, atol=1e-12)
    assert old_stats["losses/is_weight"] == pytest.approx(per_sample_stats["losses/is_weight"], abs=1e-12)
    assert min((mixed - on_policy).abs().max(), (mixed - per_sample).abs().max()) > 1e-9
    assert mixed_stats["losses/is_weight"] != pytest.approx(old_stats["losses/is_weight"], abs=1e-9)


@pytest.mark.parametrize("micro", [0, 5])
def test_model_passes_run_at_aligned_widths(setup, micro):
    # Inductor specializes a compiled layer on whether the width is a multiple of 8: the first
    # aligned width after unaligned ones recompiles the learner's layers mid-run. The learner,
    # reference and critic pad every pass to rl/model/padded_batch.COLUMN_MULTIPLE columns.
    from nodes.impl.critic import CriticConfig, advantages_for, critic_update
    from rl.model.causal_lm import ValueModel
    from rl.model.padded_batch import COLUMN_MULTIPLE

    tok, model, samples = setup
    assert any((len(s["prompt_ids"]) + len(s["response_ids"])) % COLUMN_MULTIPLE for s in samples)
    widths = []

    def record(m):
        return m.get_input_embeddings().register_forward_hook(lambda mod, inp, out: widths.append(inp[0].shape[-1]))

    m = fresh(model)
    record(m)
    cfg = LearnerConfig(minibatch_size=len(samples), micro_batch_size=micro)
    ppo_update(m, torch.optim.SGD(m.parameters(), lr=0.0), with_advantages([dict(s) for s in samples], cfg), 0.0,
               tok.pad_token_id, cfg, random.Random(0), stale=True)
    add_logprobs(m, tok.pad_token_id, [{"samples": [dict(s) for s in samples]}], "ref", micro_batch_size=micro)
    vm = ValueModel.from_policy(fresh(model))
    record(vm.backbone)
    ccfg = CriticConfig(epochs=1, minibatch_size=len(samples), micro_batch_size=micro)
    items = [{"samples": [dict(s, token_rewards=[0.0] * len(s["response_ids"])) for s in samples]}]
    advantages_for(vm, items, tok.pad_token_id, ccfg, "cpu")
    critic_update(vm, torch.optim.SGD(vm.parameters(), lr=0.0), items[0]["samples"], tok.pad_token_id, ccfg,
                  random.Random(0))
    assert len(widths) >= 4 and all(w % COLUMN_MULTIPLE == 0 for w in widths), widths


@pytest.mark.parametrize("placement", ["loss", "reward"])
def test_without_reference_logprobs_the_update_is_the_one_at_kl_coefficient_zero(setup, placement):
    """With learner.kl.coef=0 the graph leaves the reference out (graphs/rlhf.use_reference) and the
    samples carry no "ref_logprobs": the update must be exactly the one the KL-free loss gives with
    them, only without a KL stat; with a coefficient > 0 their absence is a clear error."""
    tok, model, samples = setup
    results = []
    for keep_ref in (True, False):
        cfg = LearnerConfig(algorithm="grpo", group_size=2, minibatch_size=8, ppo_epochs=2, micro_batch_size=4,
                            entropy_coef=0.01, max_grad_norm=1e9)
        cfg.kl.coef, cfg.kl.placement = 0.0, placement
        m = fresh(model).double()
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        batch = [{k: v for k, v in s.items() if keep_ref or k != "ref_logprobs"} for s in samples]
        stats = ppo_update(m, opt, batch, 0.0, tok.pad_token_id, cfg, random.Random(0), stale=False)
        results.append(({k: v.clone() for k, v in m.state_dict().items()}, stats))
    (w_ref, s_ref), (w_none, s_none) = results
    for k in w_ref:
        torch.testing.assert_close(w_none[k], w_ref[k], rtol=0, atol=0)
    kl_keys = {"losses/kl", "kl/rollout"}
    assert not kl_keys & set(s_none)
    assert ("losses/kl" if placement == "loss" else "kl/rollout") in s_ref
    assert {k: v for k, v in s_none.items()} == {k: v for k, v in s_ref.items() if k not in kl_keys}

    cfg.kl.coef = 0.1
    with pytest.raises(ValueError, match=r"KL coefficient is 0.1 .*set learner.kl.coef=0"):
        ppo_update(fresh(model), torch.optim.SGD(model.parameters(), lr=0.0), batch, 0.1, tok.pad_token_id, cfg,
                   random.Random(0), stale=False)


def test_the_warm_ups_longest_sample_has_none_of_the_models_sizes():
    # rl/update/compile_warm_up: a padded width equal to a size the layer's inputs carry (here the
    # hidden size, 64 + 8) would make the first compiled graph static in the length.
    from rl.model.padded_batch import COLUMN_MULTIPLE, aligned
    from rl.update.compile_warm_up import made_up_samples, model_sizes

    model = build_policy(ModelConfig(n_layer=1, n_embd=72, n_head=2, intermediate_size=64), build_tokenizer())
    sizes = model_sizes(model)
    assert {72, 64, 36, 2, 22} <= sizes and 0 not in sizes   # hidden, MLP, head dim, heads, vocabulary
    cfg = LearnerConfig(algorithm="grpo", group_size=2, prompts_per_step=4, minibatch_size=8, max_new_tokens=8)
    def widths(samples):   # the first's, and the widest a micro-batch of them can have
        return (aligned(len(samples[0]["prompt_ids"]) + len(samples[0]["response_ids"]), COLUMN_MULTIPLE),
                aligned(max(len(s["prompt_ids"]) for s in samples) + max(len(s["response_ids"]) for s in samples),
                        COLUMN_MULTIPLE))

    assert widths(made_up_samples(cfg, 22)) == (72, 72)     # without `avoid`: the tie
    # 72 (hidden) and 64 (MLP) avoided: prompts of at most 48 tokens, widths 56
    assert widths(made_up_samples(cfg, 22, avoid=sizes)) == (56, 56)


def test_the_warm_up_runs_the_learners_own_reference_pass_on_a_step_sized_batch(setup):
    # LoRA's learner computes the reference log-probs itself, the adapter off and no grad: graphs
    # other than the update's (a compiled run's first step compiled them: one more graph on CPU).
    # rl/update/compile_warm_up.warm_up_update runs that pass first, on a step's made-up samples.
    from rl.update.compile_warm_up import warm_up_update

    tok, model, _ = setup
    cfg = LearnerConfig(algorithm="grpo", group_size=2, prompts_per_step=4, minibatch_size=8, max_new_tokens=8)
    cfg.kl.coef = 0.1
    m = fresh(model).eval()
    seen = []

    def reference(samples):
        seen.append((len(samples), torch.is_grad_enabled(), m.training))
        add_logprobs(m, tok.pad_token_id, [{"samples": samples}], "ref_logprobs")

    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert warm_up_update(m, cfg, tok.pad_token_id, reference) > 0
    assert seen == [(8, True, False)]          # one step-sized batch, the model as a step finds it
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert all(p.grad is None for p in m.parameters()) and not m.training
