"""The learner's update on one step's samples: advantages, then PPO-style epochs over minibatches.

`c` is a nodes.learner.LearnerConfig (read by attribute; no import, so rl/ stays free of nodes/).
The phases, in order:
  1. old ("proximal") log-probs: always the learner's own forward at the current weights, at the
     sampling temperature, over the full softmax (as verl's old_log_prob pass). The generator's
     behaviour log-probs come from the distribution it sampled (top_k-truncated, <eos> masked
     before min_new_tokens) and are used only for the decoupled-PPO importance weight of stale
     samples. The first minibatch of the first epoch takes them from its own forward (nothing has
     changed the weights before it), so with one minibatch and one epoch no extra pass runs;
     KL in the reward needs them for every row before the advantages, so then all rows get a
     no-grad pass first, as do dp x tp ranks (a rank's forward covers only its share).
  2. advantages (compute_advantages): the critic's GAE (whitened over the batch's tokens, verl's
     GAE) or a learner-side estimator from the scores (grpo, dr_grpo, rloo, reinforce_pp), after
     DAPO's overlong shaping and, with KL in the reward, the per-token KL penalty.
  3. epochs over minibatches, each in micro-batches whose gradients accumulate into one
     optimizer step; the loss aggregation's normaliser is the whole minibatch's
     (rl/algorithm/losses.agg_row_weights), so micro-batches and dp shares add up to the unsplit loss.
Micro-batches (phases 1 and 3): c.micro_batch_size rows, or with c.max_tokens_per_micro_batch a
token budget per pass, rows balanced over the dp ranks by tokens (rl/update/microbatch.py); each pass
packed (c.packing: no padding, rl/update/packing.py) or padded to its own rows' columns. The loss math
runs on each pass's rows in the padded [b, t] layout (PackedBatch.to_rows), so per-sequence terms
(GSPO, the seq-mean aggregations) are the same in both layouts. "learner/padding_frac": padding
as a fraction of the tokens all of the step's passes processed.
"""

from __future__ import annotations

import math
import random

import torch

from dataflow.errors import SettingError
from rl.algorithm.advantages import grpo_advantages, reinforce_pp_advantages, rloo_advantages
from rl.algorithm.kl import kl_penalty, kl_shaped_rewards, sequence_kl
from rl.algorithm.losses import agg_row_weights, policy_loss, weighted_token_sum
from rl.algorithm.masked import masked_mean, masked_whiten
from rl.update.microbatch import padding_metrics, rank_micro_batches, sample_lengths
from rl.model.padded_batch import COLUMN_MULTIPLE, pad_batch
from rl.update.packing import micro_batch, micro_batch_logprobs
from rl.model.precision import autocast, compute_dtype
from rl.algorithm.shaping import overlong_penalty
from rl.update.settings import check_config, resolved_advantage, resolved_loss_agg_mode  # noqa: F401 (check_config)


def loss_scale_factor(c) -> float:
    """Dr. GRPO's constant normaliser: learner.loss_scale_factor, else the longest response."""
    return float(c.loss_scale_factor or c.max_new_tokens)


def _last_token_index(batch: dict, lengths: torch.Tensor) -> torch.Tensor:
    """Column of each response's last token in pad_batch's layout (responses start at prompt_len)."""
    return batch["prompt_len"] + (lengths - 1).clamp(min=0)



def compute_advantages(samples: list[dict], batch: dict, c, kl_coef: float = 0.0,
                       old_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Per-token advantages [B, T] (float64, 0 off the responses) of `samples` laid out as `batch`
    (pad_batch of them with "ref_logprobs", plus "advantages" for gae and "token_rewards" for
    reinforce_pp), and stats. Failed samples are left out of every baseline and get 0.

    Scores: each sample's "score", plus DAPO's overlong penalty (c.overlong_buffer > 0) and, with
    KL in the reward (c.kl.placement == "reward"), minus kl_coef * sum_t KL_t of the rollout
    (old_logprobs vs the reference; verl's apply_kl_penalty, then the estimator sums the
    token-level rewards). reinforce_pp works on the token rewards themselves: the per-token KL
    penalty on each token, the overlong penalty on the last.
    """
    kind = resolved_advantage(c)
    # the trained tokens: an episode's environment tokens are 0 here (pad_batch's loss_mask)
    response_mask = batch["loss_mask"].to(torch.float64)
    if kind == "gae":
        advantages = batch["advantages"].to(torch.float64)
        failed = torch.tensor([s["failed"] for s in samples], device=response_mask.device)
        mask = response_mask * (~failed).to(torch.float64)[:, None]
        return (masked_whiten(advantages, mask) if c.whiten_advantages else advantages * mask), {}
    device = response_mask.device
    valid = torch.tensor([not s["failed"] for s in samples], device=device)
    mask = response_mask * valid.to(torch.float64)[:, None]
    rows = torch.arange(len(samples), device=device)
    lengths = torch.tensor([len(s["response_ids"]) for s in samples], device=device)
    scores = torch.tensor([float(s["score"]) for s in samples], dtype=torch.float64, device=device)
    token_rewards = batch["token_rewards"].to(torch.float64) * mask if kind == "reinforce_pp" else None
    stats: dict[str, float] = {}
    if c.overlong_buffer:
        penalty = overlong_penalty(lengths, c.max_new_tokens, c.overlong_buffer, c.overlong_penalty)
        penalty = penalty.to(device) * valid
        scores = scores + penalty
        if token_rewards is not None:
            token_rewards[rows, _last_token_index(batch, lengths)] += penalty * (lengths > 0)
        stats["reward/overlong_penalty"] = float(penalty.sum() / valid.sum().clamp(min=1))
    if c.kl.placement == "reward" and "ref_logprobs" in batch:
        kl = kl_penalty(old_logprobs.to(torch.float64), batch["ref_logprobs"].to(torch.float64),
                        c.kl.estimator, c.kl.clamp or None) * mask
        per_seq = sequence_kl(kl, mask)
        stats["kl/rollout"] = float(per_seq.sum() / valid.sum().clamp(min=1))
        if token_rewards is not None:
            token_rewards = kl_shaped_rewards(token_rewards, kl, kl_coef, mask)
        else:
            scores = scores - kl_coef * kl.sum(1)
    if kind == "reinforce_pp":
        advantages, _ = reinforce_pp_advantages(token_rewards, mask, c.gamma)
        return advantages, stats
    if kind in ("grpo", "dr_grpo"):
        per_seq = grpo_advantages(scores, group_size=c.group_size, valid=valid,
                                  normalize_std=kind == "grpo" and c.grpo_std_scaling)
    elif kind == "rloo":
        per_seq = rloo_advantages(scores, group_size=c.group_size, valid=valid)
    else:
        raise ValueError(f"learner.advantage={kind!r}: use gae, grpo, dr_grpo, rloo or reinforce_pp")
    return per_seq[:, None] * mask, stats


def with_reference(samples: list[dict], kl_coef: float) -> bool:
    """Whether the samples carry the reference's log-probs. Without them there is no KL term (and
    no "losses/kl" or "kl/rollout" stat): the graph leaves the reference node out when the KL
    coefficient is 0 (graphs/rlhf.RLHFConfig.use_reference); a coefficient > 0 needs them."""
    have = ["ref_logprobs" in s for s in samples]
    if any(have) != all(have):
        raise ValueError("some samples of the step carry reference log-probs ('ref_logprobs') and some do not")
    if not all(have) and kl_coef > 0:
        raise SettingError(f"the KL coefficient is {kl_coef:g} but the samples carry no reference log-probs: "
                         "the graph has no reference node before the learner; add one, or set learner.kl.coef=0")
    return all(have)


def _token_keys(c, with_ref: bool = True) -> tuple[str, ...]:
    kind = resolved_advantage(c)
    return ("logprobs", *(("ref_logprobs",) if with_ref else ()), *(("advantages",) if kind == "gae" else ()),
            *(("token_rewards",) if kind == "reinforce_pp" else ()))


def step_advantages(samples: list[dict], c) -> list[list[float]]:
    """Each sample's per-token advantages as lists (KL in the reward left out: that needs the
    learner's log-probs, see ppo_update). For inspection and tests."""
    batch = pad_batch(samples, 0, token_keys=_token_keys(c, with_reference(samples, 0.0)))
    advantages, _ = compute_advantages(samples, batch, c)
    p = batch["prompt_len"]
    return [advantages[i, p:p + len(s["response_ids"])].tolist() for i, s in enumerate(samples)]


def ppo_update(model, optimizer, samples: list[dict], kl_coef: float, pad_id: int, c,
               rng: random.Random, stale: bool, ranks=None, version: int | None = None) -> dict:
    """Advantages of `samples`, then c.ppo_epochs epochs over minibatches; one gradient clip per
    optimizer step. Returns the mean stats of the optimizer steps (and the advantages' stats).

    Each sample needs "prompt_ids", "response_ids", "logprobs" (behaviour), "ref_logprobs" (with
    a KL coefficient > 0; see with_reference), "score", "failed", "finished", and "advantages"
    (gae) or "token_rewards" (reinforce_pp).
    Failed samples are masked out of every loss term; with c.mask_truncated, so are responses
    that hit the length cap ("finished" False; DAPO's overlong filtering); they stay in the
    group baselines. An optimizer step whose loss or gradient norm is not finite is skipped (the
    weights and the optimizer state stay as they were); "updates/skipped" counts them,
    "updates/skipped_last" is the run of skipped steps at the end, "updates/skip_reason" says why.

    The loss of a minibatch is  policy + kl_coef * KL (KL in the loss) - entropy_coef * entropy,
    each aggregated by c.loss_agg_mode with the whole minibatch's normaliser; a micro-batch (or a
    dp rank's share) contributes its rows' part of those sums, so the summed gradient and every
    reported stat equal the unsplit minibatch's. Forward/backward run under c.precision's autocast.

    Stale samples (`stale`: some token was sampled by weights older than the step's) get decoupled
    PPO's importance weight per token (rl/algorithm/losses.behaviour_weights); given `version`, the weights
    the step trains from, and every sample's "token_versions" (the version that sampled each token;
    the learner fills them in), a token with version_t == version gets weight 1, so a partial
    rollout's fresh tail and a fresh sample in a stale step are not reweighted.

    `ranks` (dataflow/weights/multirank.TrainRanks; every rank calls with the same samples and rng state):
    each dp rank runs its share of every minibatch (FSDP sums the gradients over dp), so the
    update equals one rank's.
    """
    device = next(model.parameters()).device
    amp = compute_dtype(c.precision, device)
    agg_mode, scale = resolved_loss_agg_mode(c), loss_scale_factor(c)
    kl_in_loss = c.kl.placement == "loss"
    with_ref = with_reference(samples, kl_coef)
    per_token = stale and version is not None and all("token_versions" in s for s in samples)
    full = pad_batch(samples, pad_id, token_keys=_token_keys(c, with_ref) + (("token_versions",) if per_token else ()),
                     device=device, multiple_of=COLUMN_MULTIPLE)
    num = len(samples)
    # Micro-batches: rows (micro_batch_size) or a token budget (max_tokens_per_micro_batch), each
    # run packed or padded to its own rows' columns (rl/update/microbatch.py, rl/update/packing.py).
    lengths = sample_lengths(samples)
    lengths.append(lengths[0])                                  # the dp pad row (row `num`, below)
    layout = "packed" if c.packing else "padded"

    def passes(rows, ranks=None):
        return rank_micro_batches(rows, lengths, c.max_tokens_per_micro_batch, c.micro_batch_size, layout, ranks,
                                  pad_index=num, setting="learner.max_tokens_per_micro_batch")

    def real_tokens(rows) -> int:
        return sum(sum(lengths[i]) for i in rows if i != num)

    keep = torch.tensor([not s["failed"] and (s.get("finished", True) or not c.mask_truncated) for s in samples],
                        device=device)
    mask = full["loss_mask"] * keep[:, None]     # environment tokens (episodes) and failed samples: 0
    # Every epoch's sample order, drawn up front (the same rng draws as shuffling per epoch).
    orders = []
    for _ in range(c.ppo_epochs):
        orders.append(list(range(num)))
        rng.shuffle(orders[-1])
    # 1. Old log-probs (module docstring). dp x tp: every rank runs every row (not a dp share).
    reuse_first = ranks is None and kl_in_loss
    first_rows = set(orders[0][:c.minibatch_size]) if reuse_first else set()
    old_logprobs = torch.zeros_like(full["logprobs"])
    proximal_tokens = [0, 0]       # processed, real: the same on every rank
    with torch.no_grad(), autocast(amp, device):
        for rows in passes([i for i in range(num) if i not in first_rows]):
            mb = micro_batch(full, rows, c.packing)
            logprobs, _ = micro_batch_logprobs(model, mb, temperature=c.temperature, with_entropy=False)
            mb.put(old_logprobs, logprobs)
            proximal_tokens[0] += mb.num_tokens
            proximal_tokens[1] += real_tokens(rows)
    # 2. Advantages (with KL in the reward: from the old log-probs just computed).
    advantages, adv_stats = compute_advantages(samples, full, c, kl_coef, old_logprobs)
    if ranks is not None:  # row `num`: a mask-0 copy of row 0 that pads short dp shares
        full = {k: torch.cat([v, v[:1]]) if torch.is_tensor(v) else v for k, v in full.items()}
        mask = torch.cat([mask, torch.zeros_like(mask[:1])])
        old_logprobs, advantages = torch.cat([old_logprobs, old_logprobs[:1]]), torch.cat([advantages, advantages[:1]])
    # Valid tokens per row, read once: the stat weights below are Python floats from these, and
    # the per-slice stats stay on the device until the minibatch ends, so the GPU is waited for
    # once per optimizer step, not once per micro-batch (the CPU keeps queueing kernels ahead).
    row_tokens = mask.sum(1).tolist()
    stat_keys = ("loss", "policy", "kl", "entropy", "approx_kl", "clipfrac", "clipfrac_lower", "ratio", "is_weight")
    stats: dict[str, list[float]] = {}
    skipped, skipped_last, total, reason = 0, 0, 0, ""
    update_tokens = [0, 0]         # processed, real: the minibatches' passes, summed over dp
    behaviour = full["logprobs"] if stale else None
    stale_tokens = full["token_versions"] < version if per_token else None   # exact: versions < 2^24
    model.train()
    for epoch, order in enumerate(orders):
        for start in range(0, len(order), c.minibatch_size):
            mb_list = order[start:start + c.minibatch_size]
            mb_rows = torch.tensor(mb_list, device=device)
            mb_tokens = max(sum(row_tokens[i] for i in mb_list), 1.0)
            # The aggregation's per-row weights, from the whole minibatch (every dp share's rows):
            # a micro-batch's loss is its rows' part of the minibatch's, whatever the split.
            row_weights = torch.zeros(len(row_tokens), dtype=torch.float64, device=device)
            row_weights[mb_rows] = agg_row_weights(mask[mb_rows].double(), agg_mode, scale)
            # This dp rank's passes (the tp ranks of a dp group: the same); tokens balanced over dp
            # with a token budget, a contiguous dp share otherwise.
            parts = passes(mb_list, ranks)
            optimizer.zero_grad(set_to_none=True)
            total += 1
            acc = torch.zeros(len(stat_keys), dtype=torch.float64, device=device)
            mb_processed, mb_real = 0, 0
            # One autocast context per minibatch, not per micro-batch: autocast caches the bf16 copy
            # of each fp32 weight until the context ends, so the weights are cast once per optimizer
            # step (on W1, 16 micro-batches recast them 16 times). It ends before optimizer.step,
            # which changes the weights. The loss math stays fp32/float64 under it (autocast lowers
            # only matmul-like ops), and backward runs on autograd's own thread. Sharded (ranks):
            # no cache, see rl/model/precision.autocast.
            with autocast(amp, device, cache_weights=ranks is None):
                for rows in parts:
                    # This pass's share of the minibatch's valid tokens, for the token-mean stats;
                    # a Python float (double), so the weighting adds no float32 rounding.
                    share = sum(row_tokens[i] for i in rows) / mb_tokens
                    mb = micro_batch(full, rows, c.packing, response_mask=mask)
                    mb_processed += mb.num_tokens
                    mb_real += real_tokens(rows)
                    packed_lp, packed_ent = micro_batch_logprobs(model, mb, temperature=c.temperature,
                                                                 entropy_grad=c.entropy_coef != 0)
                    if reuse_first and epoch == 0 and start == 0:   # see first_rows above
                        mb.put(old_logprobs, packed_lp.detach())
                    # The loss math runs on the rows' [b, t] layout (one row per sequence) in both layouts.
                    logprobs, entropy = mb.to_rows(packed_lp), mb.to_rows(packed_ent)
                    del packed_lp, packed_ent
                    take, idx = mb.take_rows, torch.as_tensor(rows, device=device)
                    m = take(mask)
                    pg_loss, pg_stats = policy_loss(
                        logprobs, take(old_logprobs), take(advantages), m, row_weights[idx], c.policy_loss,
                        c.clip_eps if c.clip_eps_low is None else c.clip_eps_low,
                        c.clip_eps if c.clip_eps_high is None else c.clip_eps_high, c.dual_clip_c,
                        c.log_ratio_clamp or None,
                        behaviour_logprobs=take(behaviour) if stale else None,
                        is_truncation=c.is_truncation if stale else None,
                        stale_tokens=take(stale_tokens) if per_token else None)
                    kl_tokens = (kl_penalty(logprobs, take(full["ref_logprobs"]), c.kl.estimator, c.kl.clamp or None)
                                 if with_ref else torch.zeros_like(logprobs))
                    loss = pg_loss
                    if kl_in_loss and with_ref:
                        loss = loss + kl_coef * weighted_token_sum(kl_tokens, m, row_weights[idx])
                    if c.entropy_coef:
                        loss = loss - c.entropy_coef * weighted_token_sum(entropy, m, row_weights[idx])
                    token_means = (masked_mean(kl_tokens, m), masked_mean(entropy, m),
                                   *(pg_stats[k] for k in ("approx_kl", "clipfrac", "clipfrac_lower", "ratio_mean",
                                                           "is_weight_mean")))
                    acc[:2] += torch.stack([loss.detach().double(), pg_loss.detach().double()])
                    acc[2:] += torch.stack([t.detach().double() for t in token_means]) * share
                    # Always backward (on every rank alike: a collective under FSDP); a non-finite
                    # loss makes the gradient non-finite, and the step is skipped below.
                    loss.backward()
                    del logprobs, entropy, loss
            sums = dict(zip(stat_keys, acc.tolist()))   # the one wait for the GPU of this minibatch
            sums.update(tokens_processed=mb_processed, tokens_real=mb_real)
            if ranks is not None:  # the minibatch's stats: the dp shares' parts add up
                sums = ranks.sum_over_dp(sums)
            update_tokens[0] += int(sums["tokens_processed"])
            update_tokens[1] += int(sums["tokens_real"])
            finite = math.isfinite(sums["loss"])          # equal on every rank
            grad_norm = torch.tensor(float("nan"))
            if finite:
                clip = torch.nn.utils.clip_grad_norm_ if ranks is None else ranks.clip_grad_norm_
                grad_norm = clip(model.parameters(), c.max_grad_norm)  # ranks: the global norm
            if finite and torch.isfinite(grad_norm):
                optimizer.step()
                skipped_last = 0
            else:  # skip this optimizer step
                optimizer.zero_grad(set_to_none=True)
                skipped, skipped_last = skipped + 1, skipped_last + 1
                reason = reason or (f"non-finite loss {sums['loss']} (policy {sums['policy']}, kl {sums['kl']})"
                                    if not finite else f"non-finite gradient norm {grad_norm.item()}")
            for k in ("policy", *(("kl",) if with_ref else ()), "approx_kl", "clipfrac", "clipfrac_lower", "ratio", "is_weight"):
                stats.setdefault(f"losses/{k}", []).append(sums[k])
            stats.setdefault("entropy", []).append(sums["entropy"])
            stats.setdefault("grad_norm", []).append(grad_norm.item())
    model.eval()
    return {**{k: sum(v) / len(v) for k, v in stats.items()}, **adv_stats, "updates/total": total,
            "updates/skipped": skipped, "updates/skipped_last": skipped_last, "updates/skip_reason": reason,
            "samples/masked_truncated": int(sum(1 for s in samples if not s["failed"] and not s.get("finished", True)))
            if c.mask_truncated else 0,
            **padding_metrics(proximal_tokens[0] + update_tokens[0], proximal_tokens[1] + update_tokens[1], "learner")}
