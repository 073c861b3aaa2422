"""The loss mask of multi-turn samples (rl/generation/episodes.py: "loss_mask" 1 on sampled
tokens, 0 on the environment's) through the learner, in float64: an environment token gets exactly
zero gradient, is not counted in the token mean, KL or entropy, and the update equals one computed
by hand from a plain forward of each sequence. The critic's GAE skips environment tokens as verl's
multi-turn GAE does."""

from __future__ import annotations

import random

import torch

from nodes.impl.learner import LearnerConfig, ppo_update
from rl.algorithm.advantages import gae_advantages
from rl.model.causal_lm import ModelConfig, build_policy
from rl.data.tasks import build_tokenizer

ENT, KL = 0.01, 0.1


def _model(tok):
    torch.manual_seed(0)
    return build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, intermediate_size=64), tok).double()


def _episodes(tok, model):
    """Two groups of two episodes, hand-built: prompt, then turns of sampled tokens and environment
    tokens; behaviour log-probs 0 and (deliberately) garbage reference log-probs on the environment
    tokens, which must change nothing."""
    g = torch.Generator().manual_seed(3)
    samples = []
    layouts = [[1, 1, 0, 0, 1], [1, 0, 1, 1], [1, 1, 1, 0, 0, 0, 1, 1], [1, 0, 1]]
    for i, mask in enumerate(layouts):
        prompt = torch.randint(4, len(tok), (3 + i % 2,), generator=g).tolist()
        response = torch.randint(4, len(tok), (len(mask),), generator=g).tolist()
        with torch.no_grad():
            lp = _plain_logprobs(model, prompt, response).tolist()
        samples.append({"prompt_ids": prompt, "response_ids": response, "loss_mask": mask,
                        "logprobs": [x if m else 0.0 for x, m in zip(lp, mask)],
                        "ref_logprobs": [x - 0.3 * (k % 3) if m else 1e3 for k, (x, m) in enumerate(zip(lp, mask))],
                        "score": [1.0, 0.0, 0.25, 1.0][i], "failed": False, "finished": True})
    return samples


def _plain_logprobs(model, prompt, response, entropy=False):
    """log pi(response_t | ...) from one unpadded forward of prompt + response (float64)."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(1, torch.tensor(response)[:, None])[:, 0]
    return (lp, -(logp.exp() * logp).sum(-1)) if entropy else lp


def _hand_loss(model, samples):
    """The GRPO loss by hand: advantages (score - group mean) / (unbiased group std + 1e-6), one
    epoch at the current weights (ratio 1, old = current), token mean over the SAMPLED tokens only,
    + KL x k3(pi, ref) and - ENT x entropy, each a token mean over the sampled tokens. Policy: PPO's
    clipped surrogate (rl/algorithm/losses.policy_loss: Schulman et al. 2017); k3 as verl's low_var_kl
    (rl/algorithm/kl.kl_penalty); advantages as verl's compute_grpo_outcome_advantage (unbiased std)."""
    terms, n = [], 0
    for g in range(0, len(samples), 2):
        scores = [samples[g]["score"], samples[g + 1]["score"]]
        mean = sum(scores) / 2
        std = (sum((x - mean) ** 2 for x in scores) / 1) ** 0.5
        for s, score in zip(samples[g:g + 2], scores):
            adv = (score - mean) / (std + 1e-6)
            lp, ent = _plain_logprobs(model, s["prompt_ids"], s["response_ids"], entropy=True)
            for t, m in enumerate(s["loss_mask"]):
                if not m:
                    continue
                n += 1
                # the learner keeps per-token inputs (old, reference log-probs) as float32 tensors
                ratio = torch.exp(lp[t] - lp[t].detach().float().double())
                policy = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
                log_r = lp[t] - torch.tensor(s["ref_logprobs"][t]).float().double()
                terms.append((policy, KL * (torch.expm1(-log_r) + log_r), -ENT * ent[t]))
    return [sum(t[k] for t in terms) / n for k in range(3)]


def _update(model, samples):
    m = build_policy(ModelConfig(n_layer=1, n_embd=32, n_head=2, intermediate_size=64), build_tokenizer()).double()
    m.load_state_dict(model.state_dict())
    cfg = LearnerConfig(algorithm="grpo", group_size=2, minibatch_size=len(samples), ppo_epochs=1,
                        entropy_coef=ENT, max_grad_norm=1e9)
    cfg.kl.coef = KL
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    grads = []
    def keep_grad(module, inputs, logits):
        if logits.requires_grad:         # the update's pass (the proximal pass runs without grad)
            logits.register_hook(grads.append)
    handle = m.lm_head.register_forward_hook(keep_grad)
    stats = ppo_update(m, opt, [dict(s) for s in samples], KL, tok_pad(), cfg, random.Random(0), stale=False)
    handle.remove()
    return m, stats, grads


def tok_pad():
    return build_tokenizer().pad_token_id


def test_environment_tokens_get_zero_gradient_and_the_update_is_the_hand_computed_one():
    tok = build_tokenizer()
    model = _model(tok)
    samples = _episodes(tok, model)
    updated, stats, grads = _update(model, samples)
    # 1. the learner's gradient w.r.t. the logits that predict an environment token: exactly 0
    (grad,) = grads                     # one pass: the whole minibatch, padded, rows in the epoch's order
    order = list(range(len(samples)))
    random.Random(0).shuffle(order)     # ppo_update's draw for its one epoch
    # the logits kept start at the first response column (every episode starts with a sampled
    # token): logits column t predicts response token t
    for r, i in enumerate(order):
        for t, m in enumerate(samples[i]["loss_mask"]):
            row = grad[r, t]
            if m:
                assert row.abs().max() > 0
            else:
                assert torch.equal(row, torch.zeros_like(row)), (i, t)
    # 2. the update (SGD, lr 1: the weight change is minus the gradient) and the stats equal the hand loss's
    hand = _model(tok)
    hand.load_state_dict(model.state_dict())
    policy_h, kl_h, ent_h = _hand_loss(hand, samples)
    (policy_h + kl_h + ent_h).backward()
    for (name, p0), p1, ph in zip(model.named_parameters(), updated.parameters(), hand.parameters()):
        expected = -(ph.grad if ph.grad is not None else torch.zeros_like(p0))
        assert torch.allclose(p1.detach() - p0.detach(), expected, atol=1e-14, rtol=0), name
    assert abs(stats["losses/policy"] - policy_h.item()) < 1e-14
    assert abs(stats["losses/kl"] * KL - kl_h.item()) < 1e-14
    assert abs(-stats["entropy"] * ENT - ent_h.item()) < 1e-14


def test_environment_tokens_are_not_in_the_token_counts():
    """Dropping an episode's environment tokens from the counts: the same samples with every token
    trained (no loss_mask) give another policy loss; the masked loss's token mean divides by the
    sampled tokens only (checked above by hand); here: the mask changes the result."""
    tok = build_tokenizer()
    model = _model(tok)
    samples = _episodes(tok, model)
    _, masked, _ = _update(model, samples)
    unmasked = [{**s, "loss_mask": None, "ref_logprobs": [x if x < 100 else 0.0 for x in s["ref_logprobs"]]}
                for s in samples]
    _, plain, _ = _update(model, unmasked)
    assert masked["losses/kl"] != plain["losses/kl"] and masked["entropy"] != plain["entropy"]


def _verl_gae(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return (verl/trainer/ppo/core_algos.py, verl-project/verl at
    1dda039b9), transcribed: observation tokens (response_mask 0) neither take a TD step nor reset
    the recursion; then whitening is the caller's. Advantages read on the masked positions."""
    nextvalues, lastgaelam, out = 0.0, 0.0, []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def test_critic_gae_skips_environment_tokens_as_verl_does():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 1, 1, 0]], dtype=torch.float64)
    rewards = torch.randn(2, 8, generator=g, dtype=torch.float64) * mask
    values = torch.randn(2, 8, generator=g, dtype=torch.float64) * mask
    ours, returns = gae_advantages(rewards, values, mask, 0.9, 0.8)
    ref, ref_returns = _verl_gae(rewards, values, mask, 0.9, 0.8)
    assert torch.allclose(ours, ref * mask, atol=1e-14)
    assert torch.allclose(returns, ref_returns * mask, atol=1e-14)
    assert torch.equal(ours * (1 - mask), torch.zeros_like(ours))


def test_critic_values_and_advantages_of_an_episode_skip_its_environment_tokens():
    """nodes/impl/critic.advantages_for on episode samples: per-token lists as long as the response,
    0 on the environment tokens, and the advantages of the sampled tokens those of GAE over the
    sampled tokens alone (the environment tokens cut out of the sequence)."""
    from nodes.impl.critic import CriticConfig, advantages_for
    from rl.model.causal_lm import ValueModel

    tok = build_tokenizer()
    base = _model(tok)
    samples = _episodes(tok, base)
    for s in samples:
        last = max(i for i, m in enumerate(s["loss_mask"]) if m)
        s["token_rewards"] = [s["score"] if i == last else 0.0 for i in range(len(s["response_ids"]))]
    critic = ValueModel.from_policy(base).double().eval()
    c = CriticConfig(gamma=0.9, lam=0.8)
    advantages_for(critic, [{"samples": samples}], tok.pad_token_id, c, "cpu")
    for s in samples:
        n, mask = len(s["response_ids"]), s["loss_mask"]
        assert len(s["values"]) == len(s["advantages"]) == len(s["returns"]) == n
        assert all(a == 0.0 and v == 0.0 for a, v, m in zip(s["advantages"], s["values"], mask) if not m)
        kept = [i for i in range(n) if mask[i]]
        v = torch.tensor([[s["values"][i] for i in kept]], dtype=torch.float64)
        r = torch.tensor([[s["token_rewards"][i] for i in kept]], dtype=torch.float64)
        ref, _ = gae_advantages(r, v, torch.ones_like(v), 0.9, 0.8)
        got = torch.tensor([s["advantages"][i] for i in kept], dtype=torch.float64)
        assert torch.allclose(got, ref[0].to(got.dtype), atol=1e-6)


def test_agent_graph_gives_the_learner_the_episode_length_cap_not_one_turns():
    """graphs/agent.py: an episode's response runs to env.max_episode_tokens; the learner's
    max_new_tokens (overlong shaping's cap, seq-mean-token-sum-norm's divisor, the compile warm-up's
    lengths) is filled from it, where graphs/grpo.py fills it from max_new_tokens. A user's value stays."""
    from dataflow.driver.loading import load_graph

    base = ["env.path=examples/agents/guess_env.py", "env.max_episode_tokens=300", "max_new_tokens=16"]
    _, cfg = load_graph("graphs/agent.py", base)
    assert (cfg.learner.max_new_tokens, cfg.generator.max_new_tokens) == (300, 16)
    _, cfg = load_graph("graphs/agent.py", base + ["learner.max_new_tokens=40"])
    assert cfg.learner.max_new_tokens == 40
    _, cfg = load_graph("graphs/grpo.py", ["max_new_tokens=16"])
    assert cfg.learner.max_new_tokens == 16
