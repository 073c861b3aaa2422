"""Token-budget micro-batches, packed passes and learner gradient checkpointing as the nodes run
them (issue 21): one learner update (ppo_update), the reference's log-probs (add_logprobs) and the
critic's value pass and update (advantages_for, critic_update), each equal in float64 to the
unsplit padded computation on real tiny models; the learner as 2 gloo dp ranks with a token budget
equal to one rank. (A PPO graph run on Ray with every node packed reports zero padding per node:
tests/integration/test_ppo_graph.py, on its reward-failures run. The library pieces: tests/unit/test_packing.py, tests/unit/test_microbatch.py.)"""

from __future__ import annotations

import os
import pickle
import random

import pytest
import torch
import torch.multiprocessing as mp

from nodes.impl.learner import LearnerConfig, ppo_update
from nodes.impl.reference import add_logprobs
from rl.update.microbatch import enable_gradient_checkpointing, sample_lengths
from tests.unit.test_learner import GRPO2, _float64_update, fresh, setup, with_advantages  # noqa: F401 (fixture)


def _uneven(samples):
    """The fixture's samples (prompts of 6 tokens, responses of 2 or 4) cut to uneven prompt and
    response lengths, two of them failed, some truncated, with per-token rewards (reinforce_pp)."""
    out = []
    for i, s in enumerate(samples):
        p, r = len(s["prompt_ids"]) - (7 * i) % 5, min(len(s["response_ids"]), 1 + i % 4)
        cut = {k: s[k][:r] for k in ("response_ids", "logprobs", "ref_logprobs", "advantages")}
        out.append(dict(s, **cut, prompt_ids=s["prompt_ids"][-p:], failed=i in (1, 6), finished=i % 5 != 0,
                        token_rewards=[0.1 * i] * r))
    return out


def _budget(samples, rows_per_pass: int = 3) -> int:
    """A token budget that needs several passes: about rows_per_pass of the longest rows."""
    return rows_per_pass * max(p + r for p, r in sample_lengths(samples))


@pytest.mark.parametrize("packing,stale,settings", [
    (True, False, {}),
    (False, False, {}),
    (True, True, dict(loss_agg_mode="seq-mean-token-mean", policy_loss="gspo", advantage="rloo", **GRPO2)),
    (True, False, dict(advantage="dr_grpo", max_new_tokens=8, policy_loss="dual_clip", **GRPO2)),
    (False, False, dict(loss_agg_mode="seq-mean-token-sum", mask_truncated=True, advantage="reinforce_pp", **GRPO2)),
])
def test_learner_token_budget_step_equals_the_unsplit_step(setup, packing, stale, settings):
    # Uneven lengths and two failed samples: passes hold different numbers of rows and valid
    # tokens; the whole minibatch's normaliser must still hold for every aggregation mode, and GSPO's
    # per-sequence ratio must see one row per sequence in a pack.
    tok, model, samples = setup
    samples = _uneven(samples)
    lengths = sample_lengths(samples)
    assert len(set(lengths)) > 6                                       # uneven, really
    budget = _budget(samples)
    whole, whole_stats = _float64_update(model, samples, tok, 0, stale, **settings)
    split, split_stats = _float64_update(model, samples, tok, 0, stale, max_tokens_per_micro_batch=budget,
                                         packing=packing, **settings)
    for k in whole:
        assert torch.allclose(whole[k], split[k], rtol=0, atol=1e-12), k
    for k in ("losses/policy", "losses/kl", "entropy", "losses/approx_kl", "losses/clipfrac", "grad_norm"):
        assert split_stats[k] == pytest.approx(whole_stats[k], rel=1e-10, abs=1e-12), k
    assert any(not torch.equal(whole[k], fresh(model).double().state_dict()[k]) for k in whole)
    # every pass's real tokens counted: 2 epochs of the one minibatch (its first pass gives the
    # proximal log-probs, so no extra pass)
    assert split_stats["learner/tokens_real"] == whole_stats["learner/tokens_real"] == 2 * sum(map(sum, lengths))
    if packing:
        assert split_stats["learner/padding_frac"] == 0.0
        assert split_stats["learner/tokens_processed"] == split_stats["learner/tokens_real"]
    else:  # padded to each pass's own rows: less padding than the whole minibatch's width
        assert 0.0 < split_stats["learner/padding_frac"] < whole_stats["learner/padding_frac"]


def test_a_row_longer_than_the_budget_is_an_error_naming_the_setting(setup):
    tok, model, samples = setup
    samples = _uneven(samples)
    longest = max(p + r for p, r in sample_lengths(samples))
    with pytest.raises(ValueError, match=rf"learner.max_tokens_per_micro_batch={longest - 1} is smaller than row"):
        _float64_update(model, samples, tok, 0, False, max_tokens_per_micro_batch=longest - 1)


def test_micro_batch_settings_are_one_or_the_other():
    from dataflow.errors import UserError
    from nodes.learner import check_config

    with pytest.raises(UserError, match=r"learner.micro_batch_size=4 and learner.max_tokens_per_micro_batch=512"):
        check_config(LearnerConfig(micro_batch_size=4, max_tokens_per_micro_batch=512), None)
    check_config(LearnerConfig(max_tokens_per_micro_batch=512, packing=True), None)


def test_learner_gradient_checkpointing_gives_the_same_update(setup):
    # SGD lr=1 in float64: the weight change is the (clipped) gradient; recomputation must really
    # run (layer 0's MLP is called once more per backward) and change nothing.
    tok, model, samples = setup
    samples = _uneven(samples)
    cfg = LearnerConfig(minibatch_size=len(samples), ppo_epochs=1, max_tokens_per_micro_batch=_budget(samples),
                        packing=True, entropy_coef=0.01, max_grad_norm=1e9)
    samples = with_advantages([dict(s) for s in samples], cfg)
    results = []
    for checkpointing in (False, True):
        m = fresh(model).double()
        if checkpointing:
            enable_gradient_checkpointing(m)
        calls = []
        m.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
        ppo_update(m, torch.optim.SGD(m.parameters(), lr=1.0), samples, 0.1, tok.pad_token_id, cfg,
                   random.Random(0), stale=False)
        results.append(({k: v.clone() for k, v in m.state_dict().items()}, len(calls)))
    (plain, plain_calls), (ckpt, ckpt_calls) = results
    assert ckpt_calls > plain_calls                                   # the layers were recomputed
    for k in plain:
        assert torch.allclose(plain[k], ckpt[k], rtol=0, atol=1e-12), k


@pytest.mark.parametrize("packing", [True, False])
def test_reference_logprobs_with_a_token_budget_equal_unsplit(setup, packing):
    tok, model, samples = setup
    samples = _uneven(samples)
    m = fresh(model).double()
    items = [{"samples": [dict(s) for s in samples[i:i + 2]]} for i in range(0, len(samples), 2)]
    plain = add_logprobs(m, tok.pad_token_id, items, "a", temperature=0.7)
    split = add_logprobs(m, tok.pad_token_id, items, "b", temperature=0.7, max_tokens=_budget(samples, 2),
                         packing=packing)
    for item in items:
        for s in item["samples"]:
            assert len(s["a"]) == len(s["response_ids"]) and s["a"] == pytest.approx(s["b"], abs=1e-12)
    assert plain["reference/tokens_real"] == split["reference/tokens_real"] == sum(map(sum, sample_lengths(samples)))
    assert plain["reference/padding_frac"] > 0
    assert (split["reference/padding_frac"] == 0) if packing else (split["reference/padding_frac"] > 0)


@pytest.mark.parametrize("packing", [True, False])
def test_critic_value_pass_and_update_with_a_token_budget_equal_unsplit(setup, packing):
    from nodes.impl.critic import CriticConfig, advantages_for, critic_update
    from rl.model.causal_lm import ValueModel

    tok, model, samples = setup
    samples = [dict(s, values=[0.1] * len(s["response_ids"]), returns=[s["score"]] * len(s["response_ids"]),
                    token_rewards=[s["score"]] * len(s["response_ids"])) for s in _uneven(samples)]
    results = []
    for split in (False, True):
        vm = ValueModel.from_policy(fresh(model)).double()
        cfg = CriticConfig(epochs=1, minibatch_size=len(samples) // 2, max_grad_norm=1e9,
                           max_tokens_per_micro_batch=_budget(samples, 2) if split else 0, packing=packing and split)
        items = [{"samples": [dict(s) for s in samples]}]
        value_stats = advantages_for(vm, items, tok.pad_token_id, cfg, "cpu")
        stats = critic_update(vm, torch.optim.SGD(vm.parameters(), lr=1.0), samples, tok.pad_token_id, cfg,
                              random.Random(0))
        results.append((items[0]["samples"], {k: v.clone() for k, v in vm.state_dict().items()}, stats, value_stats))
    (s0, w0, st0, v0), (s1, w1, st1, v1) = results
    for a, b in zip(s0, s1):   # the value pass keeps float32 values
        for key in ("values", "advantages", "returns"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    for k in w0:
        assert torch.allclose(w0[k], w1[k], rtol=0, atol=1e-10), k
    assert any((w0[k] - ValueModel.from_policy(fresh(model)).double().state_dict()[k]).abs().max() > 1e-4 for k in w0)
    assert st1["critic/value_loss"] == pytest.approx(st0["critic/value_loss"], rel=1e-10)
    assert st1["critic/tokens_real"] == st0["critic/tokens_real"] and v1["critic/tokens_real"] == v0["critic/tokens_real"]
    if packing:
        assert st1["critic/tokens_processed"] == st1["critic/tokens_real"]
        assert v1["critic/tokens_processed"] == v1["critic/tokens_real"]
    assert st1["critic/tokens_processed"] < st0["critic/tokens_processed"]


# ---- 2 gloo dp ranks: the budget's plan balances rows over ranks, the update equals one rank's ----

def _dp_update(model, samples, pad_id, ranks=None, **settings):
    from tests.integration.test_multirank import CFG

    cfg = LearnerConfig(**{**CFG, "micro_batch_size": 0, **settings})
    cfg.kl.coef = 0.1
    samples = [dict(s) for s in samples]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return ppo_update(model, opt, samples, 0.1, pad_id, cfg, random.Random(0), stale=True, ranks=ranks)


def _dp_worker(rank, layout, tmp, tok, samples, settings):
    import torch.distributed as dist

    from tests.integration.test_multirank import MODEL, _join_gloo
    from rl.model.causal_lm import build_policy

    ranks = _join_gloo(rank, layout, tmp)
    model = ranks.shard(build_policy(MODEL, tok).double())
    stats = _dp_update(model, samples, tok.pad_token_id, ranks, **settings)
    weights, _ = ranks.full_state(model)
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({"stats": stats, "weights": weights}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("packing", [True, False])
def test_two_dp_ranks_with_a_token_budget_equal_one_rank(tmp_path, packing):
    from dataflow.weights.layout import ParallelLayout
    from rl.model.causal_lm import build_policy
    from tests.integration.test_multirank import MODEL, _samples

    tok, samples = _samples()           # 14 samples of uneven lengths, two failed; minibatches 6, 6, 2
    budget = 2 * max(p + r for p, r in sample_lengths(samples))
    want_model = build_policy(MODEL, tok).double()
    want = _dp_update(want_model, samples, tok.pad_token_id)
    settings = dict(max_tokens_per_micro_batch=budget, packing=packing)
    mp.start_processes(_dp_worker, args=(ParallelLayout(dp=2), str(tmp_path), tok, samples, settings),
                       nprocs=2, start_method="fork")
    records = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    for k, v in want_model.state_dict().items():
        assert torch.allclose(records[0]["weights"][k], v, rtol=0, atol=1e-10), k
    for r in records:
        for k in ("losses/policy", "losses/kl", "entropy", "grad_norm"):
            assert r["stats"][k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
        # the proximal pass (on every rank: all rows, counted once) and 2 epochs (summed over the ranks)
        assert r["stats"]["learner/tokens_real"] == 3 * sum(map(sum, sample_lengths(samples)))
        # a rank with fewer rows than passes runs the pad row: the only padding when packed
        assert 0.0 <= r["stats"]["learner/padding_frac"] < (0.2 if packing else 0.5)


def _dp_critic(tok, samples, ranks=None, **settings):
    """A value pass (2 samples per item), then one critic_update, in float64 (tests/integration/test_multirank)."""
    from nodes.impl.critic import CriticConfig, advantages_for, critic_update
    from tests.integration.test_multirank import _critic_samples, _fresh_critic

    model = _fresh_critic(tok)
    if ranks is not None:
        ranks.shard(model)
    cfg = CriticConfig(epochs=2, minibatch_size=6, max_grad_norm=0.05, lr=1e-2, **settings)
    samples = _critic_samples(samples)
    items = [{"samples": [dict(s) for s in samples[i:i + 2]]} for i in range(0, len(samples), 2)]
    value_stats = advantages_for(model, items, tok.pad_token_id, cfg, "cpu", ranks)
    stats = critic_update(model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), samples, tok.pad_token_id, cfg,
                          random.Random(0), ranks)
    return model, [s["values"] for item in items for s in item["samples"]], {**value_stats, **stats}


def _dp_critic_worker(rank, layout, tmp, tok, samples, settings):
    import torch.distributed as dist

    from tests.integration.test_multirank import _join_gloo

    ranks = _join_gloo(rank, layout, tmp)
    model, values, stats = _dp_critic(tok, samples, ranks, **settings)
    weights, _ = ranks.full_state(model)
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({"weights": weights, "values": values, "stats": stats}, f)
    dist.destroy_process_group()


def test_critic_as_two_dp_ranks_with_a_token_budget_and_packing_equals_one_rank(tmp_path):
    # The value pass's rows balanced over the ranks by tokens (each rank runs as many passes, a
    # rank short of rows runs the pad row), summed over dp; training as the learner's.
    from dataflow.weights.layout import ParallelLayout
    from tests.integration.test_multirank import _samples

    tok, samples = _samples()
    want_model, want_values, want_stats = _dp_critic(tok, samples)
    budget = 2 * max(p + r for p, r in sample_lengths(samples))
    settings = dict(max_tokens_per_micro_batch=budget, packing=True)
    mp.start_processes(_dp_critic_worker, args=(ParallelLayout(dp=2), str(tmp_path), tok, samples,
                                                settings), nprocs=2, start_method="fork")
    records = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    for k, v in want_model.state_dict().items():
        assert torch.allclose(records[0]["weights"][k], v, rtol=0, atol=1e-10), k
    for r in records:
        assert all(a == pytest.approx(b, abs=1e-6) for x, y in zip(r["values"], want_values) for a, b in zip(x, y))
        assert r["stats"]["critic/value_loss"] == pytest.approx(want_stats["critic/value_loss"], rel=1e-9)
        assert r["stats"]["critic/tokens_real"] == want_stats["critic/tokens_real"]


@pytest.mark.usefixtures("ray_instance")
def test_grpo_with_partial_rollouts_continues_responses_under_new_weights(tmp_path):
    """generator.partial_rollout on graphs/grpo.py (async, max_staleness 1): the generator is the
    bottleneck (one prompt's group at a time, 24 tokens each, <eos> masked), so weights arrive while
    responses decode; those go on under the new weights: some responses carry two versions, each
    token's staleness is below its sample's (the oldest token's, the one the bound holds for), and
    every prompt is trained on once with all 24 of its tokens. No KL term, so no reference node (a
    model process less to start; what this tests is the generator's)."""
    import asyncio
    import json

    from dataflow.driver.runtime import RunOptions, load_graph, run_graph
    from tests.integration.test_ppo_graph import ROOT

    graph, config = load_graph(str(ROOT / "graphs/grpo.py"), [
        "prompts_per_step=4", "group_size=4", "learner.minibatch_size=16", "learner.record_prompt_ids=true",
        "max_staleness=1", "max_new_tokens=24", "generator.min_new_tokens=24", "generator.prompts_per_call=1",
        "generator.partial_rollout=true", "learner.kl.coef=0"])
    summary = asyncio.run(run_graph(graph, RunOptions(max_steps=4, out_dir=str(tmp_path), quiet=True), config))
    assert summary.status in ("done", "max steps reached"), summary.status
    records = [json.loads(line) for line in open(summary.metrics_path)]
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["response_length/mean"] == 24 and r["staleness/max"] <= 1 for r in steps)
    mixed = [r for r in steps if r["samples/mixed_versions"] > 0]
    assert mixed, [(r["step"], r["staleness/mean"], r["staleness/token_mean"]) for r in steps]
    assert all(r["staleness/token_mean"] < r["staleness/mean"] for r in mixed)
    trained = [i for r in steps for i in r["prompt_ids"]]
    assert len(trained) == len(set(trained)) == 4 * 4 and all(r["prompts/duplicates_dropped"] == 0 for r in steps)
    switches = [r for r in records if "generator/drain_s" in r]
    assert switches and all(r["generator/drain_free_slots"] == 0.0 for r in switches)   # no slot waits for a drain
