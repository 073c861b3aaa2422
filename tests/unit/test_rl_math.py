"""rl/ (masked, advantages, losses, kl, logprobs) against plain float64 Python loops, on seeded random batches with padding."""

import math
import random

import pytest
import torch

from rl.algorithm.advantages import gae_advantages, grpo_advantages
from rl.algorithm.kl import AdaptiveKLController, FixedKLController, kl_penalty, per_token_rewards
from rl.model.logprobs import logprobs_from_logits, token_logprobs
from rl.algorithm.losses import ppo_policy_loss, value_loss
from rl.algorithm.masked import masked_mean, masked_whiten


def random_batch(seed, batch=6, num_tokens=9, left_pad=True):
    """Random [B, T] float64 values and a mask of prompt/padding (0) and response tokens (1).

    Rows have varying response lengths, start offsets (a left-padded prompt), and one row is
    all padding; one row has a hole in the middle (a masked token inside the response).
    """
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, num_tokens, dtype=torch.float64)
    rng = random.Random(seed)
    for b in range(batch - 1):
        start = rng.randrange(0, 4) if left_pad else 0
        length = rng.randrange(1, num_tokens - start + 1)
        mask[b, start:start + length] = 1.0
    mask[1, :] = 0.0
    mask[1, 2:7] = 1.0
    mask[1, 4] = 0.0                                   # hole
    mask[batch - 1, :] = 0.0                           # all padding
    x = torch.randn(batch, num_tokens, generator=gen, dtype=torch.float64)
    return x, mask, gen


def ref_masked_mean(x, mask):
    vals = [x[i][j] for i in range(len(x)) for j in range(len(x[0])) if mask[i][j] > 0]
    return sum(vals) / len(vals) if vals else 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_mean_and_whiten(seed):
    x, mask, _ = random_batch(seed)
    xl, ml = x.tolist(), mask.tolist()
    assert masked_mean(x, mask).item() == pytest.approx(ref_masked_mean(xl, ml), abs=1e-12)
    rows = masked_mean(x, mask, dim=1)
    for b in range(x.shape[0]):
        assert rows[b].item() == pytest.approx(ref_masked_mean([xl[b]], [ml[b]]), abs=1e-12)
    assert rows[-1].item() == 0.0                      # all-padding row: 0, not NaN

    vals = [v for r, m in zip(xl, ml) for v, k in zip(r, m) if k > 0]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    white = masked_whiten(x, mask)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            expect = (xl[b][t] - mean) / math.sqrt(var + 1e-8) if ml[b][t] > 0 else 0.0
            assert white[b, t].item() == pytest.approx(expect, abs=1e-10)


def ref_gae(rewards, values, mask, gamma, lam):
    """Per row: collect the valid tokens in order, run the textbook GAE on that list."""
    adv = [[0.0] * len(r) for r in rewards]
    ret = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        idx = [t for t in range(len(rewards[b])) if mask[b][t] > 0]
        last_gae = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_value = values[b][idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            last_gae = delta + gamma * lam * last_gae
            adv[b][t] = last_gae
            ret[b][t] = last_gae + values[b][t]
    return adv, ret


@pytest.mark.parametrize("seed,gamma,lam", [(0, 1.0, 0.95), (1, 0.99, 1.0), (2, 0.9, 0.0)])
def test_gae_matches_loop(seed, gamma, lam):
    rewards, mask, gen = random_batch(seed)
    values = torch.randn(rewards.shape, generator=gen, dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=0, atol=1e-12)


def test_gae_ignores_padding_values():
    """Garbage in rewards/values at padded positions must not change anything."""
    rewards, mask, gen = random_batch(3)
    values = torch.randn(rewards.shape, generator=gen, dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, mask, 1.0, 0.95)
    noise = torch.randn(rewards.shape, generator=gen, dtype=torch.float64) * 100 * (1 - mask)
    adv2, ret2 = gae_advantages(rewards + noise, values + noise, mask, 1.0, 0.95)
    torch.testing.assert_close(adv, adv2, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, ret2, rtol=0, atol=1e-12)


def ref_grpo(scores, groups, eps, normalize_std):
    out = []
    for s, g in zip(scores, groups):
        members = [x for x, h in zip(scores, groups) if h == g]
        mean = sum(members) / len(members)
        if not normalize_std:
            out.append(s - mean)
            continue
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / max(len(members) - 1, 1))
        out.append((s - mean) / (std + eps))
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_advantages(normalize_std):
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(16, generator=gen, dtype=torch.float64)
    scores[4:8] = 0.7                                   # zero-variance group
    groups = [i // 4 for i in range(16)]
    adv = grpo_advantages(scores, group_size=4, eps=1e-6, normalize_std=normalize_std)
    ref = ref_grpo(scores.tolist(), groups, 1e-6, normalize_std)
    torch.testing.assert_close(adv, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.all(adv[4:8] == 0)
    assert torch.isfinite(adv).all()

    # The same groups given as shuffled ids (plus a singleton group) give the same answer.
    perm = torch.randperm(16, generator=gen)
    ids = torch.tensor(groups)[perm] * 7 + 3
    ids_list, scores_p = ids.tolist() + [99], scores[perm].tolist() + [0.3]
    adv_p = grpo_advantages(torch.tensor(scores_p, dtype=torch.float64),
                                    group_ids=torch.tensor(ids_list), normalize_std=normalize_std)
    ref_p = ref_grpo(scores_p, ids_list, 1e-6, normalize_std)
    torch.testing.assert_close(adv_p, torch.tensor(ref_p, dtype=torch.float64), rtol=0, atol=1e-12)
    assert adv_p[-1] == 0

    with pytest.raises(ValueError, match="multiple"):
        grpo_advantages(scores[:15], group_size=4)


def ref_ppo(logp, old, behaviour, adv, mask, eps, trunc):
    num, den, kl, clipped, ratios, weights = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if mask[b][t] == 0:
                continue
            r = math.exp(logp[b][t] - old[b][t])
            w = 1.0
            if behaviour is not None:
                w = math.exp(old[b][t] - behaviour[b][t])
                w = min(w, trunc) if trunc is not None else w
            a = adv[b][t]
            num += w * max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
            den += 1
            kl += (r - 1) - math.log(r)
            clipped += abs(r - 1) > eps
            ratios += r
            weights += w
    return num / den, {"approx_kl": kl / den, "clipfrac": clipped / den,
                       "ratio_mean": ratios / den, "is_weight_mean": weights / den}


@pytest.mark.parametrize("seed,use_behaviour,trunc", [(0, False, None), (1, True, None),
                                                      (2, True, 1.5)])
def test_ppo_policy_loss_matches_loop(seed, use_behaviour, trunc):
    adv, mask, gen = random_batch(seed)
    old = -torch.rand(adv.shape, generator=gen, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(adv.shape, generator=gen, dtype=torch.float64)
    behaviour = old + 0.5 * torch.randn(adv.shape, generator=gen, dtype=torch.float64)
    behaviour = behaviour if use_behaviour else None
    loss, stats = ppo_policy_loss(logp, old, adv, mask, 0.2, behaviour, trunc)
    ref_loss, ref_stats = ref_ppo(logp.tolist(), old.tolist(),
                                  behaviour.tolist() if use_behaviour else None,
                                  adv.tolist(), mask.tolist(), 0.2, trunc)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    for key, value in ref_stats.items():
        assert stats[key] == pytest.approx(value, abs=1e-12), key
    if trunc is not None:
        assert stats["is_weight_mean"] <= trunc


def test_ppo_clip_zeroes_gradient_outside_range():
    """Positive advantage and ratio > 1 + eps (or negative and < 1 - eps): no gradient."""
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.tensor([[0.5, -0.5, 0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, stats = ppo_policy_loss(logp, old, adv, mask, clip_eps=0.2)
    loss.backward()
    # tokens 0, 1: ratio left the trust region in the advantage's direction -> clipped, grad 0.
    # tokens 2, 3: moving against the advantage is never clipped -> grad = -A * ratio / 4.
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == 0
    assert logp.grad[0, 2].item() == pytest.approx(math.exp(0.5) / 4)
    assert logp.grad[0, 3].item() == pytest.approx(-math.exp(-0.5) / 4)
    assert stats["clipfrac"] == 1.0


def test_ppo_is_weight_is_detached_and_truncated():
    old = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([[-2.0, 0.0, 0.5]], dtype=torch.float64, requires_grad=True)
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.ones(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, stats = ppo_policy_loss(logp, old, adv, mask, 0.2, behaviour, is_truncation=2.0)
    loss.backward()
    weights = [min(math.exp(2.0), 2.0), 1.0, math.exp(-0.5)]
    assert stats["is_weight_mean"] == pytest.approx(sum(weights) / 3)
    for t, w in enumerate(weights):
        assert logp.grad[0, t].item() == pytest.approx(-w / 3)
    assert old.grad is None and behaviour.grad is None


def test_value_loss_matches_loop():
    returns, mask, gen = random_batch(5)
    old = torch.randn(returns.shape, generator=gen, dtype=torch.float64)
    values = old + 0.4 * torch.randn(returns.shape, generator=gen, dtype=torch.float64)
    loss, stats = value_loss(values, old, returns, mask, clip_eps=0.2)
    num, den, clipped = 0.0, 0, 0
    for b in range(returns.shape[0]):
        for t in range(returns.shape[1]):
            if mask[b, t] == 0:
                continue
            v, o, r = values[b, t].item(), old[b, t].item(), returns[b, t].item()
            vc = o + min(max(v - o, -0.2), 0.2)
            num += max((v - r) ** 2, (vc - r) ** 2)
            clipped += abs(v - o) > 0.2 and (vc - r) ** 2 > (v - r) ** 2
            den += 1
    assert loss.item() == pytest.approx(0.5 * num / den, abs=1e-12)
    assert stats["clipfrac"] == pytest.approx(clipped / den)


def reference_logprobs_entropy(logits, tokens, temperature):
    """float64 autograd through the textbook formulas: log_softmax, gather, -sum p log p."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elems", [1 << 20, 3 * 11])    # one chunk; 3 rows per chunk (15 rows: 5)
def test_token_logprobs_values_and_gradients_match_float64_autograd(temperature, chunk_elems):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    w_lp, w_ent = torch.randn(3, 5, generator=gen, dtype=torch.float64), torch.randn(3, 5, generator=gen,
                                                                                      dtype=torch.float64)
    logp, ent = token_logprobs(logits, tokens, temperature, chunk_elems=chunk_elems)
    ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref_logp, ref_ent = reference_logprobs_entropy(logits, tokens, temperature)
    ((ref_logp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    assert torch.allclose(logp, ref_logp, rtol=0, atol=1e-12)
    assert torch.allclose(ent, ref_ent, rtol=0, atol=1e-12)
    assert torch.allclose(grad, logits.grad, rtol=0, atol=1e-12)


def test_token_logprobs_entropy_as_a_metric_and_bf16_logits():
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 6, 50, generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 50, (4, 6), generator=gen)
    # entropy_grad=False: the entropy carries no gradient, the log-probs' gradient is unchanged
    logp, ent = token_logprobs(logits, tokens, entropy_grad=False, chunk_elems=100)
    assert logp.dtype == ent.dtype == torch.float32 and not ent.requires_grad
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref_logits = logits.detach().double().requires_grad_()
    ref_logp, ref_ent = reference_logprobs_entropy(ref_logits, tokens, 1.0)
    ref_logp.sum().backward()
    # float32 math on the bf16 values: equal to float64 up to float32 rounding; the gradient is
    # rounded to bf16 (8 bits of mantissa) on the way out
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)
    assert torch.allclose(logits.grad.double(), ref_logits.grad, atol=1e-2, rtol=1e-2)
    lp_only, none = token_logprobs(logits.detach(), tokens, with_entropy=False)
    assert none is None and torch.equal(lp_only, logp.detach())


def test_kl_penalty_entropy_logprobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64) * 4
    logits[0, 0, 0] = 1000.0                          # stability: no inf/NaN
    tokens = torch.randint(0, 7, (3, 5), generator=gen)
    logp = logprobs_from_logits(logits, tokens)
    fused_logp, ent = token_logprobs(logits, tokens, chunk_elems=14)   # 2 rows per chunk
    assert torch.allclose(fused_logp, logp, rtol=0, atol=1e-12)
    for b in range(3):
        for t in range(5):
            row = logits[b, t].tolist()
            m = max(row)
            z = sum(math.exp(v - m) for v in row)
            probs = [math.exp(v - m) / z for v in row]
            assert logp[b, t].item() == pytest.approx(row[tokens[b, t]] - m - math.log(z), abs=1e-10)
            expect = -sum(p * math.log(p) for p in probs if p > 0)
            assert ent[b, t].item() == pytest.approx(expect, abs=1e-10)

    lp = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    ref = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    lp[0, 0], ref[0, 1] = -150.0, -150.0               # |log ratio| ~ 150: exp overflows float32
    ref[0, 2] = 0.6                                      # k3's exp(-d) ~ 30: over the 10 clamp
    for kind, f in {"k1": lambda d: d, "k2": lambda d: 0.5 * d * d,
                    "k3": lambda d: math.exp(-min(max(d, -20), 20)) - 1 + min(max(d, -20), 20)}.items():
        out = kl_penalty(lp, ref, kind)                  # verl's clamps: 20 inside k3, 10 outside
        unclamped = kl_penalty(lp, ref, kind, clamp=None, log_ratio_clamp=None)
        for b in range(4):
            for t in range(6):
                d = lp[b, t].item() - ref[b, t].item()
                assert out[b, t].item() == pytest.approx(min(max(f(d), -10.0), 10.0), abs=1e-12)
                if kind != "k3" or abs(d) < 20:
                    expect = f(d) if kind != "k3" else math.exp(-d) - 1 + d
                    assert unclamped[b, t].item() == pytest.approx(expect, rel=1e-12, abs=1e-12)
        assert torch.isfinite(kl_penalty(lp.float(), ref.float(), kind)).all()
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(lp, ref, "k4")


def test_per_token_rewards():
    kl, mask, gen = random_batch(7)
    score = torch.rand(kl.shape[0], generator=gen, dtype=torch.float64)
    rewards = per_token_rewards(score, kl, 0.1, mask)
    for b in range(kl.shape[0]):
        valid = [t for t in range(kl.shape[1]) if mask[b, t] > 0]
        for t in range(kl.shape[1]):
            expect = -0.1 * kl[b, t].item() if mask[b, t] > 0 else 0.0
            if valid and t == valid[-1]:
                expect += score[b].item()
            assert rewards[b, t].item() == pytest.approx(expect, abs=1e-12)
    assert torch.all(rewards[-1] == 0)                 # all-padding row gets nothing


def test_kl_controllers():
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    value, expected = 0.2, []
    for kl in [12.0, 6.6, 3.0, 0.0, float("nan"), 7.0]:
        ctl.update(kl, n_steps=256)
        if not math.isnan(kl):
            value *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * 256 / 10000
        expected.append(value)
        assert ctl.value == pytest.approx(value, rel=1e-12)
    # Resuming: the coefficient an adaptive controller steered to is state; target, horizon and a
    # fixed coefficient are settings, which the resumed run's configuration gives.
    restored = AdaptiveKLController(1.0, target=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value and restored.update(20.0, 100) == ctl.update(20.0, 100)
    retargeted = AdaptiveKLController(1.0, target=3.0, horizon=500)
    retargeted.load_state_dict(ctl.state_dict())
    assert (retargeted.value, retargeted.target, retargeted.horizon) == (ctl.value, 3.0, 500)

    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 1000) == 0.05
    changed = FixedKLController(0.0)  # resumed with --set learner.kl.coef=0 (or any other value)
    changed.load_state_dict(fixed.state_dict())
    assert changed.value == 0.0
    now_adaptive = AdaptiveKLController(0.3, target=6.0, horizon=10000)  # resumed with kl.kind=adaptive
    now_adaptive.load_state_dict(fixed.state_dict())
    assert now_adaptive.value == 0.3


# --- issue 20: loss aggregation, policy-loss variants, advantage estimators, shaping, schedule ----

from rl.algorithm.advantages import reinforce_pp_advantages, rloo_advantages  # noqa: E402
from rl.algorithm.kl import kl_shaped_rewards, sequence_kl  # noqa: E402
from rl.algorithm.losses import agg_loss, agg_row_weights, policy_loss  # noqa: E402
from rl.algorithm.schedule import lr_multiplier  # noqa: E402
from rl.algorithm.shaping import overlong_penalty  # noqa: E402

AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def ref_agg(loss, mask, mode, scale=None):
    """verl's agg_loss, as loops over the valid tokens (fully masked rows not counted).

    seq-mean-token-sum-norm (Dr. GRPO) is seq-mean-token-sum divided by the constant C:
    sum_i sum_t l_it / (S * C), S = rows with a valid token. verl: verl/trainer/ppo/core_algos.py
    `agg_loss`, the branch `elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]`
    (`loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size`, then
    `loss /= loss_scale_factor`), since verl PR #5417 (2026-02; read at commit 018f23b5f83a).
    TRL: trl/trainer/grpo_trainer.py `_compute_loss`, loss_type == "dr_grpo" (line 3135 at commit
    f2cd57710ae3): `(per_token_loss * mask).sum() / (per_token_loss.size(0) * self.max_completion_length)`.
    """
    rows = [[v for v, m in zip(lr, mr) if m > 0] for lr, mr in zip(loss, mask)]
    rows = [r for r in rows if r]
    if not rows:
        return 0.0
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * scale)


def test_dr_grpo_normaliser_is_the_peers():
    """The issue's case: per-token loss 1, mask [[1,1,0,0],[1,0,0,0]], C=4: (2 + 1) / (2 * 4),
    the peers' 0.375 (see ref_agg), not sum / C = 0.75; a fully masked row does not count in S
    (verl's seq_mask)."""
    loss = torch.ones(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", 4.0).item() == pytest.approx(0.375, abs=1e-15)
    assert ref_agg(loss.tolist(), mask.tolist(), "seq-mean-token-sum-norm", 4.0) == 0.375


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_agg_loss_matches_loop_and_splits_add_up_to_the_whole(mode, seed):
    loss, mask, gen = random_batch(seed, batch=7, left_pad=seed == 0)
    scale = 9.0 if mode == "seq-mean-token-sum-norm" else None
    whole = agg_loss(loss, mask, mode, scale)
    assert whole.item() == pytest.approx(ref_agg(loss.tolist(), mask.tolist(), mode, scale), abs=1e-12)
    # Micro-batches / dp shares: each part sums its rows with the WHOLE batch's row weights; any
    # partition of the rows adds up to the unsplit loss (a per-part mean would not).
    weights = agg_row_weights(mask, mode, scale)
    perm = torch.randperm(7, generator=gen)
    parts = [perm[:3], perm[3:4], perm[4:]]
    from rl.algorithm.losses import weighted_token_sum
    split = sum(weighted_token_sum(loss[p], mask[p], weights[p]) for p in parts)
    assert split.item() == pytest.approx(whole.item(), abs=1e-12)
    if mode != "token-mean":   # a per-part token mean differs: what the normaliser must avoid
        assert agg_loss(loss, mask, "token-mean").item() != pytest.approx(whole.item(), abs=1e-6)
    assert agg_loss(loss, torch.zeros_like(mask), mode, scale).item() == 0.0


def test_agg_row_weights_need_a_constant_for_sum_norm():
    with pytest.raises(ValueError, match="scale_factor"):
        agg_row_weights(torch.ones(2, 3), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-mean"):
        agg_row_weights(torch.ones(2, 3), "seq-sum")


def ref_token_loss(kind, r, a, lo, hi, c):
    clipped = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    if kind == "reinforce":
        return -a * r
    if kind == "dual_clip" and a < 0:
        return min(clipped, -a * c)
    return clipped


def ref_policy_loss(kind, logp, old, adv, mask, mode, lo, hi, c):
    """Per-token losses from plain floats (gspo: the paper's sequence ratio s_i on every token)."""
    losses = []
    for b in range(len(logp)):
        valid = [t for t in range(len(logp[b])) if mask[b][t] > 0]
        seq_r = math.exp(sum(logp[b][t] - old[b][t] for t in valid) / len(valid)) if valid else 1.0
        row = []
        for t in range(len(logp[b])):
            r = seq_r if kind == "gspo" else math.exp(logp[b][t] - old[b][t])
            row.append(ref_token_loss("ppo" if kind == "gspo" else kind, r, adv[b][t], lo, hi, c))
        losses.append(row)
    return ref_agg(losses, mask, mode, 9.0)


@pytest.mark.parametrize("kind", ["ppo", "dual_clip", "gspo", "reinforce"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_variants_match_loop(kind, mode):
    adv, mask, gen = random_batch(4, batch=7)
    adv = adv * 2
    old = -torch.rand(adv.shape, generator=gen, dtype=torch.float64) * 3
    logp = (old + 0.4 * torch.randn(adv.shape, generator=gen, dtype=torch.float64)).requires_grad_()
    if kind == "gspo":     # one advantage per sequence, as GSPO assumes
        adv = adv[:, :1].expand_as(adv).contiguous()
    if kind == "dual_clip":  # row 2: ratios e^1.5 = 4.5 > c = 3 with negative advantages
        logp = (logp.detach() + 1.5 * torch.nn.functional.one_hot(torch.tensor(2), 7)[:, None]).requires_grad_()
        adv[2] = -adv[2].abs()
    lo, hi = 0.2, 0.28     # DAPO's clip-higher
    weights = agg_row_weights(mask, mode, 9.0)
    loss, stats = policy_loss(logp, old, adv, mask, weights, kind, lo, hi, dual_clip_c=3.0)
    ref = ref_policy_loss(kind, logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), mode, lo, hi, 3.0)
    assert loss.item() == pytest.approx(ref, abs=1e-12)
    ratios = [math.exp(a - b) for lr, orow, mr in zip(logp.tolist(), old.tolist(), mask.tolist())
              for a, b, m in zip(lr, orow, mr) if m > 0]
    assert stats["approx_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / len(ratios), abs=1e-12)
    if kind == "ppo":
        outside = sum(r < 1 - lo or r > 1 + hi for r in ratios) / len(ratios)
        assert stats["clipfrac"].item() == pytest.approx(outside, abs=1e-12) and outside > 0
    if kind == "dual_clip":
        assert stats["clipfrac_lower"].item() > 0
    if kind == "gspo":
        # The gradient is the paper's: d/d logp_it of -A_i clip(s_i) with s_i = exp(mean_t log r_it),
        # computed by autograd on the sequence form in float64.
        loss.backward()
        x = logp.detach().clone().requires_grad_()
        n = mask.sum(1).clamp(min=1)
        s = torch.exp(((x - old) * mask).sum(1) / n)
        a = adv[:, 0]
        seq_loss = torch.max(-a * s, -a * s.clamp(1 - lo, 1 + hi))
        # each sequence's loss sits on each of its n_i tokens: its weight is the row's w_i * n_i
        (seq_loss * weights * mask.sum(1)).sum().backward()
        torch.testing.assert_close(logp.grad, x.grad * mask, rtol=0, atol=1e-12)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[2.0, 2.0, -2.0]], dtype=torch.float64, requires_grad=True)   # ratio e^2 = 7.4
    adv = torch.tensor([[-1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, stats = policy_loss(logp, old, adv, mask, agg_row_weights(mask, "token-mean"), "dual_clip")
    loss.backward()
    # token 0: -A r = 7.4 > c |A| = 3 -> the bound, no gradient; token 1: clipped at 1.2 (A > 0)
    assert loss.item() == pytest.approx((3.0 - 1.2 + 0.8) / 3)
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == 0
    assert stats["clipfrac_lower"].item() == pytest.approx(1 / 3)


def test_log_ratio_clamp_keeps_an_overflow_finite():
    old = torch.zeros(2, 2)
    logp = torch.tensor([[150.0, 0.0], [0.0, 0.0]], requires_grad=True)   # exp(150) overflows float32
    adv, mask = -torch.ones(2, 2), torch.ones(2, 2)
    weights = agg_row_weights(mask, "token-mean")
    for kind in ("reinforce", "dual_clip"):
        loss, _ = policy_loss(logp, old, adv, mask, weights, kind)
        assert torch.isfinite(loss)
        loss, _ = policy_loss(logp, old, adv, mask, weights, kind, log_ratio_clamp=None)
        assert kind == "dual_clip" or not torch.isfinite(loss)


def ref_rloo(scores, groups, valid):
    out = []
    for i, (s, g) in enumerate(zip(scores, groups)):
        others = [x for j, (x, h) in enumerate(zip(scores, groups)) if h == g and j != i and valid[j]]
        out.append(s - sum(others) / len(others) if valid[i] and others else 0.0)
    return out


def test_rloo_and_grpo_leave_invalid_members_out():
    gen = torch.Generator().manual_seed(5)
    scores = torch.rand(12, generator=gen, dtype=torch.float64)
    valid = torch.ones(12, dtype=torch.bool)
    valid[[1, 6, 7, 8]] = False                        # group 2 keeps a single valid member (9..11: 9)
    valid[10], valid[11] = False, False
    groups = [i // 4 for i in range(12)]
    rloo = rloo_advantages(scores, group_size=4, valid=valid)
    torch.testing.assert_close(rloo, torch.tensor(ref_rloo(scores.tolist(), groups, valid.tolist()),
                                                  dtype=torch.float64), rtol=0, atol=1e-12)
    assert rloo[8:].abs().sum() == 0
    kept = [i for i in range(12) if valid[i]]
    grpo = grpo_advantages(scores, group_size=4, valid=valid)
    ref = ref_grpo([scores[i].item() for i in kept], [groups[i] for i in kept], 1e-6, True)
    torch.testing.assert_close(grpo[kept], torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-12)
    assert grpo[~valid].abs().sum() == 0
    # all valid: RLOO = k/(k-1) x (r - group mean), verl's form
    full = rloo_advantages(scores, group_size=4)
    centered = grpo_advantages(scores, group_size=4, normalize_std=False)
    torch.testing.assert_close(full, centered * 4 / 3, rtol=0, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop(gamma):
    rewards, mask, _ = random_batch(6)
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma)
    rl, ml = rewards.tolist(), mask.tolist()
    ref_ret = [[0.0] * len(r) for r in rl]
    for b in range(len(rl)):
        running = 0.0
        for t in reversed([t for t in range(len(rl[b])) if ml[b][t] > 0]):
            running = rl[b][t] + gamma * running
            ref_ret[b][t] = running
    vals = [ref_ret[b][t] for b in range(len(rl)) for t in range(len(rl[b])) if ml[b][t] > 0]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) + 1e-8)
    ref_adv = [[(ref_ret[b][t] - mean) / std if ml[b][t] > 0 else 0.0 for t in range(len(rl[b]))]
               for b in range(len(rl))]
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=0, atol=1e-10)


def test_kl_in_the_reward_and_sequence_kl():
    kl, mask, gen = random_batch(8)
    rewards = torch.randn(kl.shape, generator=gen, dtype=torch.float64)
    shaped = kl_shaped_rewards(rewards, kl, 0.05, mask)
    per_seq = sequence_kl(kl, mask)
    for b in range(kl.shape[0]):
        valid = [t for t in range(kl.shape[1]) if mask[b, t] > 0]
        for t in range(kl.shape[1]):
            expect = rewards[b, t].item() - 0.05 * kl[b, t].item() if t in valid else 0.0
            assert shaped[b, t].item() == pytest.approx(expect, abs=1e-12)
        expect = sum(kl[b, t].item() for t in valid) / len(valid) if valid else 0.0
        assert per_seq[b].item() == pytest.approx(expect, abs=1e-12)


def test_overlong_penalty_matches_dapo():
    lengths = torch.tensor([0, 10, 12, 13, 15, 16, 20])
    pen = overlong_penalty(lengths, max_len=16, buffer_len=4, penalty_factor=0.5)
    # L_exp = 12: 0 up to 12 tokens, then -(L - 12) / 4 x 0.5
    expect = [0.0, 0.0, 0.0, -0.125, -0.375, -0.5, -1.0]
    assert pen.tolist() == pytest.approx(expect, abs=1e-12)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_len=16, buffer_len=17)


@pytest.mark.parametrize("decay", ["constant", "linear", "cosine"])
def test_lr_multiplier_matches_transformers_schedules(decay):
    transformers = pytest.importorskip("transformers")
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    make = {"constant": lambda: transformers.get_constant_schedule_with_warmup(opt, 5),
            "linear": lambda: transformers.get_linear_schedule_with_warmup(opt, 5, 30),
            "cosine": lambda: transformers.get_cosine_schedule_with_warmup(opt, 5, 30)}[decay]
    peer = make().lr_lambdas[0]
    for step in range(31):
        assert lr_multiplier(step, 5, 30, decay) == pytest.approx(peer(step), abs=1e-12), step
    # past total_steps the factor stays at its end value (transformers' cosine would rise again)
    assert lr_multiplier(34, 5, 30, decay) == (1.0 if decay == "constant" else 0.0)
    # with a floor: m + (1 - m) x shape
    p = (20 - 5) / 25
    shape = {"constant": 1.0, "linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p))}[decay]
    assert lr_multiplier(20, 5, 30, decay, min_lr_ratio=0.1) == pytest.approx(0.1 + 0.9 * shape, abs=1e-12)


def test_behaviour_weights_are_taken_per_token_by_the_version_that_sampled_it():
    """Partial rollouts: a response's tokens come from several weight versions. Decoupled PPO's
    weight min(exp(old - behaviour), trunc) applies to each token sampled before the step's
    weights (version < 4 here), 1 to those sampled by them; policy_loss uses it per token."""
    from rl.algorithm.losses import behaviour_weights

    adv, mask, gen = random_batch(7, batch=6, num_tokens=10)
    old = -torch.rand(adv.shape, generator=gen, dtype=torch.float64) * 3
    logp = (old + 0.3 * torch.randn(adv.shape, generator=gen, dtype=torch.float64)).requires_grad_()
    behaviour = old + 0.6 * torch.randn(adv.shape, generator=gen, dtype=torch.float64)
    # per token: version 2, 3 or 4 (each row switching versions part-way, as a partial rollout does)
    versions = torch.tensor([[2 + min(2, (t * (b + 1)) // 6) for t in range(10)] for b in range(6)])
    assert any(len(set(row)) > 1 for row in versions.tolist())
    trunc, current = 1.7, 4
    stale = versions < current
    ref = [[(min(math.exp(o - be), trunc) if v < current else 1.0) for o, be, v in zip(orow, brow, vrow)]
           for orow, brow, vrow in zip(old.tolist(), behaviour.tolist(), versions.tolist())]
    got = behaviour_weights(old, behaviour, stale, trunc)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-12)
    every = [[min(math.exp(o - be), trunc) for o, be in zip(orow, brow)] for orow, brow in zip(old.tolist(), behaviour.tolist())]
    torch.testing.assert_close(behaviour_weights(old, behaviour, None, trunc), torch.tensor(every, dtype=torch.float64),
                               rtol=0, atol=1e-12)                 # None: every token stale (one version per sample)
    # the loss: token-mean of w_t * max(-A r, -A clip(r)), float64 loop
    eps, num, den = 0.2, 0.0, 0.0
    for b, row in enumerate(logp.tolist()):
        for t, lp in enumerate(row):
            if mask[b, t] > 0:
                r, a = math.exp(lp - old[b, t].item()), adv[b, t].item()
                num += ref[b][t] * max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
                den += 1
    loss, stats = policy_loss(logp, old, adv, mask, agg_row_weights(mask, "token-mean"), "ppo", eps, eps,
                              behaviour_logprobs=behaviour, is_truncation=trunc, stale_tokens=stale)
    assert loss.item() == pytest.approx(num / den, abs=1e-12)
    w_mean = sum(ref[b][t] for b in range(6) for t in range(10) if mask[b, t] > 0) / den
    assert stats["is_weight_mean"].item() == pytest.approx(w_mean, abs=1e-12)
    loss.backward()                         # the weights carry no gradient: only logp has one
    assert logp.grad is not None and logp.grad[~stale & (mask > 0)].abs().sum() > 0
