"""Token-budget micro-batches, dp balancing, loss weights and padding (rl/update/microbatch.py).

The loss-normalisation tests run the real PPO policy loss and the critic's value loss on real
small models in float64: the gradient accumulated over every simulated dp rank's micro-batches
(packed, or padded to their own columns; weights from micro_batch_weights) equals the unsplit
padded minibatch's to 1e-9 relative."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from rl.algorithm.losses import ppo_policy_loss, value_loss
from rl.update.microbatch import (
           karmarkar_karp,
           micro_batch_cost,
           micro_batch_weights,
           padding_stats,
           plan_micro_batches,
           sample_lengths,
           token_budget_micro_batches,
       )
from rl.model.causal_lm import ValueModel
from rl.model.padded_batch import pad_batch, sequence_logprobs
from rl.update.packing import micro_batch, micro_batch_logprobs, micro_batch_values
from tests.unit.test_packing import assert_grads_close, grads, random_samples, tiny_model


def long_tailed_lengths(n: int, seed: int = 0, cap: int = 96) -> list[tuple[int, int]]:
    """Prompts 4..20 tokens; responses mostly short, some at the cap (the shape of real RL rollouts)."""
    rng = random.Random(seed)
    return [(rng.randint(4, 20), min(cap, max(1, int(rng.lognormvariate(2.5, 1.0))))) for _ in range(n)]


def is_partition(parts, n):
    flat = [i for p in parts for i in p]
    return sorted(flat) == list(range(n))


def test_karmarkar_karp_textbook_example_and_validity():
    # LDM on {8,7,6,5,4}: 8-7 -> 1, 6-5 -> 1, 4-1 -> 3, 3-1 -> 2: sums 16 and 14 (optimum is 15/15)
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert is_partition(parts, 5)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [14, 16]
    parts = karmarkar_karp(list(range(1, 13)), 4, equal_size=True)
    assert is_partition(parts, 12) and all(len(p) == 3 for p in parts)
    # by hand: states {4,3,2,1} {8,7,6,5} {12,11,10,9} (spread 3 each); the first two merge to
    # {9,9,9,9} (spread 0), then {12,11,10,9} + {9,9,9,9} -> 21, 20, 19, 18
    assert sorted(sum(i + 1 for i in p) for p in parts) == [18, 19, 20, 21]
    assert karmarkar_karp([5, 3], 4) == [[0], [1], [], []]
    with pytest.raises(ValueError, match="equal parts"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)


def test_karmarkar_karp_within_its_bound_of_the_optimum():
    """k-way LDM's worst case is 4/3 - 1/(3k) of the optimal largest part (Michiels et al. 2007);
    the optimum by brute force over every assignment."""
    rng = random.Random(1)
    for _ in range(20):
        weights = [rng.randint(1, 100) for _ in range(8)]
        k = 3
        best = min(max(sum(w for w, a in zip(weights, assign) if a == j) for j in range(k))
                   for assign in itertools.product(range(k), repeat=len(weights)))
        got = max(sum(weights[i] for i in p) for p in karmarkar_karp(weights, k))
        assert best <= got <= (4 / 3 - 1 / (3 * k)) * best + 1e-9


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_token_budget_micro_batches_fit_and_cover(layout):
    lengths = long_tailed_lengths(200)
    budget = 512
    parts = token_budget_micro_batches(lengths, budget, layout)
    assert is_partition(parts, len(lengths))
    assert all(micro_batch_cost(lengths, p, layout) <= budget for p in parts)
    lower = -(-sum(p + r for p, r in lengths) // budget)       # no plan can use fewer passes
    assert lower <= len(parts) <= (lower + 2 if layout == "packed" else 3 * lower)


def test_row_longer_than_budget_is_an_error():
    """A verdict about the settings and the data, met while training: a UserError (one line, exit 2)."""
    from dataflow.errors import UserError

    with pytest.raises(UserError, match=r"learner.max_tokens_per_micro_batch=50 is smaller than row 1 "
                                         r"\(10 prompt \+ 41 response = 51 tokens\)"):
        plan_micro_batches([(5, 5), (10, 41)], 50, setting="learner.max_tokens_per_micro_batch")


def test_plan_balances_ranks_with_equal_micro_batch_counts():
    lengths = long_tailed_lengths(131, seed=3)
    budget, num_ranks = 400, 4
    plan = plan_micro_batches(lengths, budget, num_ranks)
    assert len(plan) == num_ranks
    assert len({len(parts) for parts in plan}) == 1                 # every rank runs as many passes
    assert is_partition([p for parts in plan for p in parts], len(lengths))
    assert all(micro_batch_cost(lengths, p) <= budget for parts in plan for p in parts)
    per_rank = [sum(sum(lengths[i]) for p in parts for i in p) for parts in plan]
    assert max(per_rank) - min(per_rank) <= max(p + r for p, r in lengths)
    # a contiguous split (what dp_share does) is far less even on a long tail
    chunk = -(-len(lengths) // num_ranks)
    contiguous = [sum(sum(x) for x in lengths[i:i + chunk]) for i in range(0, len(lengths), chunk)]
    assert max(per_rank) - min(per_rank) < max(contiguous) - min(contiguous)
    # more ranks than rows: the extra ranks get only empty micro-batches (their pad row)
    small = plan_micro_batches([(3, 4), (2, 2)], 100, num_ranks=3)
    assert sorted(len(p) for parts in small for p in parts) == [0, 1, 1]


def test_weights_keep_the_minibatch_token_mean():
    lengths = long_tailed_lengths(57, seed=5)
    rng = random.Random(6)
    valid = [0.0 if rng.random() < 0.1 else float(r) for _, r in lengths]    # failed samples: no tokens
    per_token = [[rng.gauss(0, 1) for _ in range(r)] for _, r in lengths]
    plan = plan_micro_batches(lengths, 300, num_ranks=3)
    weights = micro_batch_weights(plan, valid)
    reference = sum(sum(x) for x, v in zip(per_token, valid) if v) / sum(valid)
    accumulated = 0.0
    for parts, rank_weights in zip(plan, weights):
        for part, w in zip(parts, rank_weights):
            tokens = [x for i in part if valid[i] for x in per_token[i]]
            accumulated += w * (sum(tokens) / len(tokens) if tokens else 0.0)
    assert abs(accumulated - reference) < 1e-12
    assert abs(sum(map(sum, weights)) - 1.0) < 1e-12
    assert micro_batch_weights([[[0, 1]]], [0.0, 0.0]) == [[0.0]]


LENGTHS = [(3, 5), (7, 1), (1, 9), (4, 4), (2, 12), (6, 3), (5, 7), (2, 2), (3, 11)]


@pytest.mark.parametrize("packing", [True, False])
def test_ranks_times_micro_batches_give_the_minibatch_policy_gradient(packing):
    """ppo_policy_loss (a token mean) over one padded minibatch vs the same rows spread over 3
    simulated dp ranks x token-budget micro-batches (packed, or padded to their own columns),
    losses weighted by micro_batch_weights and gradients summed (what FSDP's reduction over dp does)."""
    samples = random_samples(LENGTHS, seed=7)
    model = tiny_model("qwen2", seed=2)
    batch = pad_batch(samples, 0, token_keys=())
    g = torch.Generator().manual_seed(8)
    mask = batch["response_mask"].double()
    mask[4] = 0.0                                                      # a failed sample
    advantages = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    with torch.no_grad():
        old, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], mask, with_entropy=False)
    old = old + 0.05 * torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask  # ratios != 1

    lp, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], mask, with_entropy=False)
    full_loss, _ = ppo_policy_loss(lp, old, advantages, mask, clip_eps=0.2)
    full_loss.backward()
    reference = grads(model)
    model.zero_grad(set_to_none=True)

    plan = plan_micro_batches(sample_lengths(samples), 24, num_ranks=3, layout="packed" if packing else "padded")
    assert sum(len(parts) for parts in plan) > 3                       # the split is real
    weights = micro_batch_weights(plan, mask.sum(1).tolist())
    accumulated = 0.0
    for parts, rank_weights in zip(plan, weights):
        for rows, w in zip(parts, rank_weights):
            if not rows:
                continue
            mb = micro_batch(batch, rows, packing, response_mask=mask)
            mlp, _ = micro_batch_logprobs(model, mb, with_entropy=False)
            loss, _ = ppo_policy_loss(mlp, mb.take(old), mb.take(advantages), mb.take(mask), clip_eps=0.2)
            (loss * w).backward()
            accumulated += loss.item() * w
    assert abs(accumulated - full_loss.item()) < 1e-12
    assert_grads_close(grads(model), reference)


@pytest.mark.parametrize("packing", [True, False])
def test_ranks_times_micro_batches_give_the_minibatch_value_gradient(packing):
    """The critic's clipped value loss, the same way."""
    samples = random_samples(LENGTHS, seed=9)
    value_model = ValueModel(tiny_model("llama", seed=4).model, 32, seed=5).double()
    batch = pad_batch(samples, 0, token_keys=())
    mask = batch["response_mask"].double()
    g = torch.Generator().manual_seed(10)
    returns = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    with torch.no_grad():
        old_values = value_model(batch["input_ids"], batch["attention_mask"]) * mask
    old_values = old_values + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask  # some clipped

    full_loss, _ = value_loss(value_model(batch["input_ids"], batch["attention_mask"]), old_values, returns, mask, 0.2)
    full_loss.backward()
    reference = grads(value_model)
    value_model.zero_grad(set_to_none=True)

    plan = plan_micro_batches(sample_lengths(samples), 30, num_ranks=2, layout="packed" if packing else "padded")
    for parts, rank_weights in zip(plan, micro_batch_weights(plan, mask.sum(1).tolist())):
        for rows, w in zip(parts, rank_weights):
            if rows:
                mb = micro_batch(batch, rows, packing)
                loss, _ = value_loss(micro_batch_values(value_model, mb), mb.take(old_values), mb.take(returns),
                                     mb.take(mask), 0.2)
                (loss * w).backward()
    assert_grads_close(grads(value_model), reference)


def test_padding_stats():
    mbs = [[(2, 3), (4, 1)], [(1, 1)]]
    # padded: 2 x (4 + 3) + 1 x 2 = 16 processed, 12 real; packed: 12 processed
    assert padding_stats(mbs, "padded") == {"perf/padding_frac": 4 / 16, "perf/tokens_processed": 16,
                                            "perf/tokens_real": 12}
    assert padding_stats(mbs, "packed")["perf/padding_frac"] == 0.0
    assert padding_stats(mbs, "packed", filler_tokens=4)["perf/padding_frac"] == 4 / 16
    assert padding_stats([], "packed")["perf/padding_frac"] == 0.0
    # micro-batches sliced out of one [B, T = 9] minibatch batch: 3 rows x 9 columns processed
    assert padding_stats(mbs, "padded", width=9)["perf/padding_frac"] == 1 - 12 / 27


def test_padded_budget_counts_the_aligned_width():
    # the nodes' padded passes run at widths rounded up to COLUMN_MULTIPLE (rl/update/packing.padded_columns):
    # two rows of 5 tokens fit a budget of 10 unaligned, but run as 2 x 8 = 16 tokens
    from rl.model.padded_batch import COLUMN_MULTIPLE
    from rl.update.microbatch import token_budget_micro_batches

    lengths = [(3, 2), (3, 2)]
    assert micro_batch_cost(lengths, [0, 1], "padded") == 10
    assert micro_batch_cost(lengths, [0, 1], "padded", COLUMN_MULTIPLE) == 16
    assert token_budget_micro_batches(lengths, 10, "padded") == [[0], [1]]
    assert token_budget_micro_batches(lengths, 16, "padded") == [[0, 1]]
