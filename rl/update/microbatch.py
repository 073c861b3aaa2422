"""Memory-bounded passes over a minibatch: token-budget micro-batches balanced over dp ranks, their
loss weights, the padding they cost, and gradient checkpointing. Pure Python except the last and
rank_micro_batches (which the nodes call: a dp rank's share of the plan).

A row's length is its (prompt, response) token counts. A micro-batch's cost in tokens depends on
the layout it runs in:
  "packed"  sum of its rows' prompt + response (rl/update/packing.py: no padding at all);
  "padded"  rows x (longest prompt + longest response), pad_batch's [B, T] (rl/model/padded_batch.py).
`max_tokens_per_micro_batch` bounds that cost per forward/backward pass on each GPU (verl's
`ppo_max_token_len_per_gpu`, slime's `max_tokens_per_gpu`). A row whose own length exceeds the budget
is an error, as in verl (rearrange_micro_batches asserts it): the budget is the memory bound the
user set, and running such a row alone would break it without telling; the error names the row,
its length and the setting to raise (a node can check the generator's caps at setup instead).

Rows are spread over micro-batches and dp ranks by the Karmarkar-Karp largest differencing method
(verl's seqlen_balancing.karmarkar_karp, the same idea; the number of parts as verl's
rearrange_micro_batches: ceil(total tokens / budget), grown until every part fits, which verl does
not check). Every dp rank gets the same number of micro-batches, since each forward/backward is an
FSDP collective (verl all-reduces the count and splits the largest; here every rank plans all ranks
from the same rows, so no collective is needed); an empty micro-batch means "run the rank's mask-0
pad row", as ppo_update's dp shares already do.

Loss normalisation: every loss term is a token mean over the valid tokens of the whole minibatch,
so micro-batch j of any rank is weighted by n_j / n (its share of those tokens): the gradients
summed over micro-batches and ranks equal the unsplit minibatch's (micro_batch_weights).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from dataflow.errors import SettingError
from rl.model.padded_batch import COLUMN_MULTIPLE, aligned
from rl.model.precision import micro_slices

Layout = Literal["packed", "padded"]


def sample_lengths(samples: list[dict]) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) of each sample."""
    return [(len(s["prompt_ids"]), len(s["response_ids"])) for s in samples]


def karmarkar_karp(weights: Sequence[float], num_parts: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `weights` in `num_parts` parts of near-equal sums (largest differencing method).

    Each item starts as a partial solution of num_parts subsets (itself in one, the rest empty);
    the two partial solutions with the largest spread (largest minus smallest subset sum) are
    merged, largest subset with smallest, until one remains (Karmarkar & Karp 1982; k-way form:
    Michiels et al. 2007; https://en.wikipedia.org/wiki/Largest_differencing_method).
    equal_size: every part gets len(weights) / num_parts items (the items, sorted, enter num_parts
    at a time, one per subset); len(weights) must divide by num_parts. Otherwise parts may be empty
    (num_parts > len(weights)). Deterministic: ties break on insertion order."""
    if num_parts < 1:
        raise ValueError(f"karmarkar_karp: num_parts={num_parts}; must be >= 1")
    if equal_size and len(weights) % num_parts:
        raise ValueError(f"karmarkar_karp: {len(weights)} items do not split into {num_parts} equal parts")
    order = sorted(range(len(weights)), key=lambda i: weights[i])
    groups = ([order[i:i + num_parts] for i in range(0, len(order), num_parts)] if equal_size
              else [[i] for i in order])
    tie = itertools.count()
    heap = []
    for group in groups:
        # a partial solution: subsets as (sum, items), kept sorted by sum, largest first
        subsets = sorted(([weights[i], [i]] for i in group), key=lambda s: -s[0])
        subsets += [[0, []] for _ in range(num_parts - len(subsets))]
        heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), next(tie), subsets))
    if not heap:
        return [[] for _ in range(num_parts)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(([sa + sb, ia + ib] for (sa, ia), (sb, ib) in zip(a, reversed(b))), key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    return [sorted(items) for _, items in heap[0][2]]


def micro_batch_cost(lengths: Sequence[tuple[int, int]], rows: Sequence[int], layout: Layout = "packed",
                     multiple: int = 1) -> int:
    """Tokens a forward pass over `rows` processes in `layout` (module docstring); padded, at a width
    rounded up to `multiple` (the nodes' passes: rl/model/padded_batch.COLUMN_MULTIPLE)."""
    if not rows:
        return 0
    if layout == "packed":
        return sum(lengths[i][0] + lengths[i][1] for i in rows)
    if layout == "padded":
        return len(rows) * aligned(max(lengths[i][0] for i in rows) + max(lengths[i][1] for i in rows), multiple)
    raise ValueError(f"layout={layout!r}; use 'packed' or 'padded'")


def _check_fits(lengths, max_tokens: int, setting: str) -> None:
    if max_tokens < 1:
        raise SettingError(f"{setting}={max_tokens}; must be >= 1 (or 0 to split by row count)")
    for i, (p, r) in enumerate(lengths):
        if p + r > max_tokens:
            raise SettingError(f"{setting}={max_tokens} is smaller than row {i} ({p} prompt + {r} response "
                             f"= {p + r} tokens): raise {setting} to at least the longest prompt + response")


def token_budget_micro_batches(lengths: Sequence[tuple[int, int]], max_tokens: int, layout: Layout = "packed",
                               setting: str = "max_tokens_per_micro_batch") -> list[list[int]]:
    """Micro-batches (lists of indices into `lengths`) each costing at most `max_tokens` in `layout`.

    packed: Karmarkar-Karp into ceil(total / max_tokens) parts of near-equal tokens, one part more
    until every part fits (at worst one row each: each row fits, see below).
    padded: longest first, a row joins the current micro-batch while rows x (longest prompt +
    longest response), widened to an aligned width, fits (verl's get_truncate_padding_micro_batches),
    so rows of similar length share a micro-batch and padding stays small. A row alone may exceed the
    budget by its alignment (fewer than COLUMN_MULTIPLE tokens).
    Raises ValueError naming `setting` when a row alone exceeds max_tokens (module docstring)."""
    _check_fits(lengths, max_tokens, setting)
    if not lengths:
        return []
    if layout == "packed":
        total = micro_batch_cost(lengths, range(len(lengths)), "packed")
        num_parts = min(len(lengths), math.ceil(total / max_tokens))
        while True:
            parts = [p for p in karmarkar_karp([p + r for p, r in lengths], num_parts) if p]
            if all(micro_batch_cost(lengths, part) <= max_tokens for part in parts):
                return parts
            num_parts += 1
    if layout != "padded":
        raise ValueError(f"layout={layout!r}; use 'packed' or 'padded'")
    parts, current = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-sum(lengths[i]), i)):
        if current and micro_batch_cost(lengths, current + [i], "padded", COLUMN_MULTIPLE) > max_tokens:
            parts.append(sorted(current))
            current = []
        current.append(i)
    return parts + [sorted(current)]


def _split_to(parts: list[list[int]], count: int, lengths, layout: Layout) -> list[list[int]]:
    """`parts` split until there are `count` of them: the costliest splittable part into two
    balanced halves (each fits when the whole did); empty parts once no part has two rows."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        splittable = [j for j, p in enumerate(parts) if len(p) > 1]
        if not splittable:
            parts.append([])
            continue
        j = max(splittable, key=lambda j: micro_batch_cost(lengths, parts[j], layout))
        a, b = karmarkar_karp([sum(lengths[i]) for i in parts[j]], 2)
        parts[j:j + 1] = [[parts[j][k] for k in a], [parts[j][k] for k in b]]
    return parts


def plan_micro_batches(lengths: Sequence[tuple[int, int]], max_tokens: int, num_ranks: int = 1,
                       layout: Layout = "packed", setting: str = "max_tokens_per_micro_batch"
                       ) -> list[list[list[int]]]:
    """plan[rank][j]: the indices into `lengths` (one minibatch's rows) that dp rank `rank` runs in
    its micro-batch j. Rows go to ranks by Karmarkar-Karp on tokens (near-equal tokens per rank,
    row counts may differ), each rank's share into token_budget_micro_batches, then every rank is
    split to the same number of micro-batches (the largest count; an empty one: the pad row).
    Every rank computes the same plan from the same rows (no collective needed)."""
    if num_ranks < 1:
        raise ValueError(f"plan_micro_batches: num_ranks={num_ranks}; must be >= 1")
    _check_fits(lengths, max_tokens, setting)
    shares = karmarkar_karp([p + r for p, r in lengths], num_ranks) if num_ranks > 1 else [list(range(len(lengths)))]
    per_rank = []
    for share in shares:
        local = token_budget_micro_batches([lengths[i] for i in share], max_tokens, layout, setting)
        per_rank.append([[share[k] for k in part] for part in local])
    count = max(1, max(len(parts) for parts in per_rank))
    return [_split_to(parts, count, lengths, layout) for parts in per_rank]


def rank_micro_batches(rows: Sequence[int], lengths: Sequence[tuple[int, int]], max_tokens: int,
                       micro_batch_size: int, layout: Layout, ranks=None, pad_index: int | None = None,
                       setting: str = "max_tokens_per_micro_batch") -> list[list[int]]:
    """The micro-batches this dp rank runs for the minibatch `rows` (indices into the step's batch,
    lengths[i] = row i's (prompt, response) tokens), as lists of those indices.

    max_tokens > 0: plan_micro_batches over every dp rank (tokens balanced over ranks, each pass
    within the budget in `layout`), this rank's part of it; an empty micro-batch (a rank with fewer
    rows than passes) is [pad_index]: a mask-0 row, so every rank issues the same number of
    forward/backward passes (FSDP collectives). max_tokens = 0: the older split, a contiguous dp
    share (ranks.dp_share, padded with pad_index) cut into micro_batch_size rows (0 = all).
    `ranks`: a dataflow.weights.multirank.TrainRanks (dp_rank, dp_size, dp_share), or None."""
    rows = list(rows)
    if not rows:
        return []
    if max_tokens:
        plan = plan_micro_batches([lengths[i] for i in rows], max_tokens, ranks.dp_size if ranks else 1,
                                  layout, setting)
        mine = plan[ranks.dp_rank if ranks else 0]
        assert pad_index is not None or all(mine), "an empty micro-batch (dp) needs a pad row"
        return [[rows[k] for k in part] if part else [pad_index] for part in mine]
    if ranks is not None:
        rows = ranks.dp_share(torch.tensor(rows, dtype=torch.long), pad_index=pad_index).tolist()
    return [rows[sl] for sl in micro_slices(len(rows), micro_batch_size)]


def padding_metrics(tokens_processed: int, tokens_real: int, prefix: str) -> dict:
    """{prefix/padding_frac, prefix/tokens_processed, prefix/tokens_real}: padding as a fraction of
    the tokens a node's forward passes processed (0 when none ran)."""
    return {f"{prefix}/padding_frac": (tokens_processed - tokens_real) / tokens_processed if tokens_processed else 0.0,
            f"{prefix}/tokens_processed": tokens_processed, f"{prefix}/tokens_real": tokens_real}


def micro_batch_weights(plan: list[list[list[int]]], valid_tokens: Sequence[float]) -> list[list[float]]:
    """weights[rank][j] = valid tokens of micro-batch j of `rank` / valid tokens of the minibatch
    (all ranks' rows; a denominator of at least 1, so all-invalid gives weights 0, as ppo_update).
    valid_tokens[i]: row i's tokens in the loss (its loss mask summed: 0 for a failed sample).
    Sum over ranks and micro-batches of weight x (the micro-batch's token-mean loss) = the
    minibatch's token-mean loss, and so for the gradients."""
    total = max(sum(valid_tokens[i] for parts in plan for part in parts for i in part), 1.0)
    return [[sum(valid_tokens[i] for i in part) / total for part in parts] for parts in plan]


def padding_stats(micro_batches: Sequence[Sequence[tuple[int, int]]], layout: Layout,
                  filler_tokens: int = 0, width: int | None = None) -> dict:
    """Padding as a fraction of the tokens a node's forward passes processed in one step.

    micro_batches: each pass's rows as (prompt, response) lengths (every rank's passes, for dp);
    layout: what the passes ran in (module docstring); filler_tokens: tokens run only to keep ranks
    in step (a dp pad row standing in for an empty micro-batch), counted as padding; width
    ("padded" only): the passes ran at this many columns whatever their rows (micro-batches sliced
    out of a whole minibatch's [B, T], as ppo_update did before micro_batch trimmed them: width = T).
    Returns {"perf/padding_frac", "perf/tokens_processed", "perf/tokens_real"} (padding_metrics).
    The nodes count what their passes ran instead (PackedBatch / PaddedRows.num_tokens)."""
    real = sum(p + r for mb in micro_batches for p, r in mb)
    if width is not None and layout != "padded":
        raise ValueError(f"padding_stats: width={width} is for the padded layout, not {layout!r}")
    processed = filler_tokens + sum(len(mb) * width if width is not None else
                                    micro_batch_cost(list(mb), range(len(mb)), layout) for mb in micro_batches)
    return padding_metrics(processed, real, "perf")


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them (the
    critic's `gradient_checkpointing`, for any node): a transformers causal LM, or a ValueModel
    (its backbone). Non-reentrant torch.utils.checkpoint (transformers' default; it supports
    autocast and inputs without grad). Active only in train mode, as transformers does it:
    the learner's ppo_update calls model.train(). Gradients are unchanged (recomputation replays
    the same ops; dropout is 0 in these models)."""
    target = getattr(model, "backbone", model)
    if hasattr(target, "activation_checkpointing_enable"):      # transformers >= 5.24
        target.activation_checkpointing_enable()
    else:                                                        # 5.17 (the GPU image): the old name
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
