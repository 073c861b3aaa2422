"""Packed (padding-free) forward passes: a micro-batch's rows end to end in one [1, N] sequence.

Layout. pack_rows takes rows of a pad_batch layout ([left-padded prompt | right-padded response],
rl/model/padded_batch.py) and lays their real tokens end to end: input_ids [1, N] (N = the rows' prompt +
response tokens, no padding), position_ids restarting at 0 for every row, and `index` [N], the flat
position in the padded [B, T] batch each packed token came from. Any padded per-token tensor packs
with `take` (behaviour / ref log-probs, advantages, loss masks) and packed results go back with
`put`, so the loss math of rl/losses and rl/masked runs unchanged on [1, N] tensors: a token mean
over a mask is the same number whatever the layout. Per-sequence terms (GSPO's ratio, the
seq-mean loss aggregations) need one row per sequence: to_rows lays packed results out as the
rows' [b, t] block of the padded batch (differentiably) and take_rows cuts the same block from
padded tensors; PaddedRows has both too (identity / take), so the learner's loss runs unchanged. Token alignment is models.py's: a value at
packed column t concerns input_ids[0, t] (a log-prob from the logits at t - 1 of the same row; a
value from the hidden state at t - 1); a row's first token is a prompt token and never gets one.

Attention confined to each row. The model is called with position_ids and attention_mask=None:
transformers (5.x; masking_utils.find_packed_sequence_indices) reads position ids that restart as
packed sequences, and every attention implementation then keeps each token to its own row:
  flash_attention_2/3  flash_attn_varlen_func with cu_seqlens from the position ids: no wasted work;
  torch_varlen         torch's own FlashAttention varlen kernel (rl/update/varlen_attention.py), from the
                       rows' cumulative lengths (PackedBatch.attention_kwargs): no wasted work;
  flex_attention       a BlockMask of the block-diagonal causal mask: blocks across rows skipped;
  sdpa / eager         a dense [N, N] block-diagonal causal mask: exact, but O(N^2) attention work
                       and mask memory over the whole pack: for CPU tests and small packs only.
use_varlen_attention picks the first one available on the device (flash needs the flash_attn
package; torch_varlen CUDA and torch >= 2.10; flex CUDA and torch.compile). Position ids restart per row, so RoPE sees each row
as pad_batch + sequence_logprobs do (cumsum(mask) - 1): the same numbers, up to float rounding.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from rl.model.logprobs import token_logprobs
from rl.model.padded_batch import aligned, pad_batch, sequence_logprobs
from rl.update import varlen_attention

VARLEN_KWARG_READERS = ("flash_attention_2", "flash_attention_3", varlen_attention.NAME)


@dataclass
class PackedBatch:
    """Rows of a padded [B, T] batch, packed. input_ids, position_ids, response_mask: [1, N]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    """1 on response tokens (the structure, as pad_batch's; loss masks are taken separately)."""
    index: torch.Tensor
    """[N] long: flat index into the padded [B, T] batch of each packed token."""
    rows: list[int]
    """The padded batch's rows, in packing order."""
    seq_lens: list[int]
    """Tokens of each row (prompt + response), in packing order."""
    padded_shape: tuple[int, int]
    row_of: torch.Tensor
    """[N] long: each packed token's row, as a position in `rows`."""
    columns: slice
    """The padded batch's columns the rows use (padded_columns): the width of take_rows / to_rows."""

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass processes: N, all of them real."""
        return self.input_ids.shape[1]

    def attention_kwargs(self, model: nn.Module) -> dict:
        """The rows' boundaries as the keywords transformers forwards to each attention call
        (cumulative lengths, longest row), for the implementations that read them (flash
        attention, torch_varlen): without them each layer would derive them from the position ids,
        a host sync per layer. Empty for the others (sdpa, flex build their mask from the ids)."""
        config = getattr(getattr(model, "backbone", model), "config", None)
        name = getattr(config, "_attn_implementation", None)
        if name not in VARLEN_KWARG_READERS:
            return {}
        cu = torch.tensor([0, *itertools.accumulate(self.seq_lens)], dtype=torch.int32,
                          device=self.input_ids.device)
        longest = max(self.seq_lens, default=0)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

    def take_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows' [b, t] part of a padded [B, T] tensor (rows in packing order, t = columns):
        the per-row layout the loss math runs in, so per-sequence terms (GSPO's ratio, the
        seq-mean aggregations' row weights) see one row per sequence, not one pack."""
        return x[torch.as_tensor(self.rows, device=x.device)][:, self.columns]

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Packed [1, N] values in take_rows' [b, t] layout, 0 elsewhere (differentiable: an
        out-of-place scatter, so the loss's gradient flows back into the packed forward)."""
        dst = values.new_zeros((len(self.rows), self.columns.stop - self.columns.start))
        return dst.index_put((self.row_of, self.index % self.padded_shape[1] - self.columns.start), values[0])

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The packed [1, N] view of a padded [B, T] per-token tensor (a gather: a new tensor)."""
        if tuple(x.shape[:2]) != self.padded_shape:
            raise ValueError(f"PackedBatch.take: tensor of shape {tuple(x.shape)}; the packed rows come "
                             f"from a padded batch of shape {self.padded_shape}")
        return x.reshape(-1, *x.shape[2:])[self.index][None]

    def put(self, dst: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write packed [1, N] `values` into their places of the padded [B, T] `dst` (in place);
        returns dst. Positions of other rows and padding are left as they were."""
        dst.view(-1)[self.index] = values[0].to(dst.dtype)
        return dst

    def to_padded(self, values: torch.Tensor) -> torch.Tensor:
        """Packed [1, N] values as a [B, T] tensor of zeros elsewhere (the padded layout's convention)."""
        dst = torch.zeros(self.padded_shape, dtype=values.dtype, device=values.device)
        return self.put(dst, values)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
              rows: list[int] | torch.Tensor | None = None) -> PackedBatch:
    """Pack `rows` (default: all) of a pad_batch layout into one [1, N] sequence, rows in the order given.

    Raises ValueError when a row starts with a response token (an empty prompt): its first action
    would have no context to be predicted from, in this layout as in the padded one."""
    num_rows, num_cols = input_ids.shape
    rows_t = torch.arange(num_rows) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    rows_t = rows_t.to(input_ids.device)
    mask = attention_mask[rows_t] > 0                      # [b, T]: contiguous runs (left pad | real | right pad)
    r, c = mask.nonzero(as_tuple=True)                     # row-major: row by row, left to right
    flat = rows_t[r] * num_cols + c
    positions = (mask.long().cumsum(1) - 1)[r, c]
    resp = response_mask.reshape(-1)[flat]
    first = positions == 0
    if bool((resp[first] > 0).any()):
        bad = rows_t[r[first][resp[first] > 0]].tolist()
        raise ValueError(f"pack_rows: rows {bad[:8]} have an empty prompt (the response starts at the row's "
                         "first token); every sample needs at least one prompt token (e.g. <bos>)")
    columns = slice(int(c.min()), int(c.max()) + 1) if len(c) else slice(0, num_cols)
    return PackedBatch(input_ids=input_ids.reshape(-1)[flat][None], position_ids=positions[None],
                       response_mask=resp[None], index=flat, rows=rows_t.tolist(),
                       seq_lens=mask.sum(1).tolist(), padded_shape=(num_rows, num_cols), row_of=r,
                       columns=columns)


def pack_samples(samples: list[dict], pad_id: int, token_keys: tuple[str, ...] = (),
                 device: str | torch.device = "cpu") -> tuple[PackedBatch, dict]:
    """(packed batch of all samples, their padded batch): pad_batch then pack_rows, so the packed
    layout and the padded one agree token for token; per-token keys pack with packed.take(batch[k])."""
    batch = pad_batch(samples, pad_id, token_keys=token_keys, device=device)
    return pack_rows(batch["input_ids"], batch["attention_mask"], batch["response_mask"]), batch


def padded_columns(attention_mask: torch.Tensor, rows: list[int] | torch.Tensor) -> slice:
    """The columns of a pad_batch layout that `rows` use: from their longest prompt's first token
    to their longest response's last. pad_batch puts every response at the same column P, so the
    rows' own padded batch is this column slice of the whole one (x[rows][:, cols]): a padded
    token-budget micro-batch costs rows x (its longest prompt + longest response), not the
    minibatch's T. Its width is a multiple of COLUMN_MULTIPLE where the batch's is (pad_batch's is).
    One read of the mask (a host sync)."""
    used = torch.nonzero(attention_mask[torch.as_tensor(rows, device=attention_mask.device)].sum(0) > 0)
    total = attention_mask.shape[1]
    if len(used) == 0:
        return slice(0, total)
    start, stop = int(used[0]), int(used[-1]) + 1
    # widened with padding columns to an aligned width (rl/model/padded_batch.COLUMN_MULTIPLE): right first, then left
    extra = aligned(stop - start) - (stop - start)
    right = min(extra, total - stop)
    return slice(max(0, start - (extra - right)), stop + right)


@dataclass
class PaddedRows:
    """Rows of a padded [B, T] batch as their own padded micro-batch, trimmed to their columns
    (padded_columns): the padded twin of PackedBatch, with the same take / put / to_padded, so a
    node's micro-batch loop is one code path for both layouts (micro_batch / micro_batch_logprobs)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    """[b, t] of the rows (b rows, t of their columns)."""
    index: torch.Tensor
    """[b] long: the rows in the padded batch."""
    columns: slice
    rows: list[int]
    padded_shape: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass processes: b x t, padding included."""
        return self.input_ids.numel()

    def take(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[:2]) != self.padded_shape:
            raise ValueError(f"PaddedRows.take: tensor of shape {tuple(x.shape)}; the rows come from a "
                             f"padded batch of shape {self.padded_shape}")
        return x[self.index][:, self.columns]

    def take_rows(self, x: torch.Tensor) -> torch.Tensor:
        """PackedBatch.take_rows: here the micro-batch's own layout already (= take)."""
        return self.take(x)

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """PackedBatch.to_rows: the values are in that layout already."""
        return values

    def put(self, dst: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        cols = torch.arange(self.columns.start, self.columns.stop, device=dst.device)
        dst[self.index[:, None], cols[None, :]] = values.to(dst.dtype)
        return dst

    def to_padded(self, values: torch.Tensor) -> torch.Tensor:
        return self.put(torch.zeros(self.padded_shape, dtype=values.dtype, device=values.device), values)


def micro_batch(batch: dict, rows: list[int], packing: bool, response_mask: torch.Tensor | None = None
                ) -> PackedBatch | PaddedRows:
    """`rows` of a pad_batch dict as one micro-batch: packed (pack_rows) or padded to their own
    columns (PaddedRows). response_mask: the tokens to compute (default the batch's; a loss mask
    with failed rows zeroed spares their logits when packed)."""
    response_mask = batch["response_mask"] if response_mask is None else response_mask
    if packing:
        return pack_rows(batch["input_ids"], batch["attention_mask"], response_mask, rows)
    index = torch.as_tensor(rows, dtype=torch.long, device=batch["input_ids"].device)
    cols = padded_columns(batch["attention_mask"], index)
    return PaddedRows(input_ids=batch["input_ids"][index][:, cols],
                      attention_mask=batch["attention_mask"][index][:, cols],
                      response_mask=response_mask[index][:, cols], index=index, columns=cols, rows=list(rows),
                      padded_shape=tuple(batch["input_ids"].shape))


def micro_batch_logprobs(model: nn.Module, mb: PackedBatch | PaddedRows, temperature: float = 1.0,
                         with_entropy: bool = True, entropy_grad: bool = True):
    """(logprobs, entropy or None) of a micro_batch, in its own layout ([1, N] or [b, t]):
    packed_sequence_logprobs or rl/model/padded_batch.sequence_logprobs."""
    if isinstance(mb, PackedBatch):
        return packed_sequence_logprobs(model, mb, temperature, with_entropy, entropy_grad)
    return sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.response_mask, temperature,
                             with_entropy=with_entropy, entropy_grad=entropy_grad)


def micro_batch_values(value_model: nn.Module, mb: PackedBatch | PaddedRows) -> torch.Tensor:
    """ValueModel values of a micro_batch, in its own layout: packed_values or ValueModel.forward."""
    if isinstance(mb, PackedBatch):
        return packed_values(value_model, mb)
    return value_model(mb.input_ids, mb.attention_mask)


def _predicting_columns(packed: PackedBatch) -> torch.Tensor:
    """Packed columns t whose next token (t + 1) is a response token: those whose logits are
    needed. Never the last token of a row predicting the next row's first (a prompt token)."""
    cols = torch.nonzero(packed.response_mask[0, 1:] > 0).squeeze(1)
    if len(cols) == 0:  # no response token at all: one column keeps the autograd graph (and FSDP's hooks) whole
        cols = torch.zeros(1, dtype=torch.long, device=packed.input_ids.device)
    return cols


def packed_sequence_logprobs(model: nn.Module, packed: PackedBatch, temperature: float = 1.0,
                             with_entropy: bool = True, entropy_grad: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs [1, N], entropy [1, N] or None) of the packed tokens: rl/model/padded_batch.sequence_logprobs
    for a packed batch, 0 off the response tokens.

    logprobs[0, t] = log softmax(logits[0, t - 1] / temperature)[input_ids[0, t]] on response
    tokens, the logits from that row alone (module docstring). Only the logits of the columns that
    predict a response token are computed (a 1-D logits_to_keep), so prompts cost no [., V] logits:
    fewer than the padded path, which keeps every column from the first response column on.
    Keeps the autograd graph (wrap in torch.no_grad() for old/ref log-probs)."""
    cols = _predicting_columns(packed)
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                use_cache=False, logits_to_keep=cols, **packed.attention_kwargs(model))
    logits = out.logits                                    # [1, K, V]: column k predicts cols[k] + 1
    del out
    targets = packed.input_ids[:, cols + 1]
    token_lp, token_ent = token_logprobs(logits, targets, temperature, with_entropy=with_entropy,
                                         entropy_grad=entropy_grad)
    mask = packed.response_mask[:, cols + 1].to(token_lp.dtype)
    shape = (1, packed.num_tokens)
    logprobs = torch.zeros(shape, dtype=token_lp.dtype, device=token_lp.device)
    logprobs = logprobs.index_put((torch.zeros_like(cols), cols + 1), (token_lp * mask)[0])
    entropy = None
    if with_entropy:
        entropy = torch.zeros(shape, dtype=token_ent.dtype, device=token_ent.device)
        entropy = entropy.index_put((torch.zeros_like(cols), cols + 1), (token_ent * mask)[0])
    return logprobs, entropy


def packed_values(value_model: nn.Module, packed: PackedBatch) -> torch.Tensor:
    """values [1, N] of rl/model/causal_lm.ValueModel on a packed batch: values[0, t] = the value head on the
    hidden state at t - 1 of the same row, 0 at each row's first token (ValueModel.forward, packed).
    The dtype is ValueModel's: float32 out of bf16 autocast, float64 for a float64 model."""
    return value_model(packed.input_ids, None, position_ids=packed.position_ids,
                       **packed.attention_kwargs(value_model))


def varlen_attention_available(device) -> str:
    """The attention implementation that confines a pack's rows without wasted work on `device`:
    "flash_attention_2" (CUDA with the flash_attn package), "torch_varlen" (CUDA: torch's own
    FlashAttention varlen kernel, rl/update/varlen_attention.py), "flex_attention" (CUDA, a torch without
    that kernel: compiled per pack length), else "sdpa" (exact, with a dense block-diagonal mask: CPU
    and tests)."""
    if torch.device(device).type == "cuda":
        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        if varlen_attention.kernel_available():
            return varlen_attention.NAME
        return "flex_attention"
    return "sdpa"


def use_varlen_attention(model: nn.Module, device, implementation: str = "auto") -> str:
    """Switch `model`'s attention (a transformers model, or a ValueModel's backbone) to the
    implementation packed batches should run with; returns its name. "auto":
    varlen_attention_available(device). transformers also runs padded batches (a 2-D mask) under
    each of them, so a node may switch once at setup; checked here on CPU: sdpa and torch_varlen's
    per-sequence path (tests) and, once by hand, flex_attention (packed fp32 log-probs within 1e-6
    of padded sdpa after a ~60 s compile). flash_attention_2 is unchecked (no flash_attn wheel on
    the GPU machine); torch_varlen's kernel and flex on CUDA: bench/varlen.py."""
    name = varlen_attention_available(device) if implementation == "auto" else implementation
    if name == varlen_attention.NAME:
        varlen_attention.register()
    target = getattr(model, "backbone", model)             # ValueModel keeps its trunk there
    if getattr(target.config, "_attn_implementation", None) != name:
        target.set_attn_implementation(name)
    return name
