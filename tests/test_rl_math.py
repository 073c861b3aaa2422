"""rl/ (masked, advantages, losses, kl, logprobs) against plain float64 Python loops, on seeded random batches with padding."""

import math
import random

import pytest
import torch

from rl.advantages import gae_advantages, grpo_advantages
from rl.kl import AdaptiveKLController, FixedKLController, kl_penalty, per_token_rewards
from rl.logprobs import _compiled_fns, logprobs_from_logits, token_logprobs
from rl.losses import ppo_policy_loss, value_loss
from rl.masked import masked_mean, masked_whiten


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
    for kind, f in {"k1": lambda d: d, "k2": lambda d: 0.5 * d * d,
                    "k3": lambda d: math.exp(-d) - 1 + d}.items():
        out = kl_penalty(lp, ref, kind)
        for b in range(4):
            for t in range(6):
                assert out[b, t].item() == pytest.approx(f(lp[b, t].item() - ref[b, t].item()),
                                                         abs=1e-12)
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
    restored = AdaptiveKLController(1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.update(20.0, 100) == ctl.update(20.0, 100)

    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 1000) == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05


def test_token_logprobs_compiled_kernel_matches_the_eager_chunks():
    # The CUDA default (torch.compile, one kernel over all rows) runs on CPU too: the same numbers.
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 40, 500, generator=gen) * 2).requires_grad_()
    tokens = torch.randint(0, 500, (3, 40), generator=gen)
    w = torch.randn(3, 40, generator=gen)
    results = []
    for compile in (False, True):
        logits.grad = None
        lp, ent = token_logprobs(logits, tokens, 0.8, chunk_elems=7 * 500, compile=compile)
        ((lp * w).sum() + (ent * w).sum()).backward()
        results.append((lp.detach(), ent.detach(), logits.grad.clone()))
    assert all(_compiled_fns.get(name) is not None for name in ("stats1", "grad1"))  # really compiled
    for eager, compiled in zip(*results):
        assert torch.allclose(eager, compiled, rtol=0, atol=1e-5)
