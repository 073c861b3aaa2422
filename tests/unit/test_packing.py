"""Packed forward/backward (rl/update/packing.py) against the padded path (rl/model/padded_batch.sequence_logprobs on
pad_batch), on real small Llama / Qwen2 models in float64 on CPU (sdpa attention, the
block-diagonal mask transformers builds from restarting position ids).

Tolerance: 1e-10 absolute on log-probs, entropies and values, 1e-9 relative on gradients (float64;
the two layouts run the same per-row arithmetic in different matmul shapes, so they agree to a
few ulps: measured differences are 0 to ~1e-15). bf16 on GPU is not checked here (no GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rl.update.microbatch import enable_gradient_checkpointing
from rl.model.causal_lm import ValueModel
from rl.model.padded_batch import COLUMN_MULTIPLE, aligned, pad_batch, sequence_logprobs, unpad_tokens
from rl.update.packing import (
           micro_batch,
           micro_batch_logprobs,
           pack_rows,
           pack_samples,
           packed_sequence_logprobs,
           packed_values,
           padded_columns,
       )

VOCAB = 61
LENGTHS = [(3, 5), (7, 1), (1, 9), (4, 4), (2, 12), (6, 3)]   # (prompt, response): uneven, both sides


def tiny_model(family: str, seed: int = 0):
    cls_cfg, cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = cls_cfg(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                  tie_word_embeddings=True, pad_token_id=0)
    torch.manual_seed(seed)
    return cls(cfg).double()


def random_samples(lengths=LENGTHS, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(1, VOCAB, (p,), generator=g).tolist(),
             "response_ids": torch.randint(1, VOCAB, (r,), generator=g).tolist()} for p, r in lengths]


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(a: dict, b: dict, rtol=1e-9):
    assert a.keys() == b.keys() and a
    for name in a:
        scale = max(a[name].abs().max().item(), 1e-12)
        assert (a[name] - b[name]).abs().max().item() <= rtol * scale, name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_logprobs_and_gradients_equal_padded(family):
    model = tiny_model(family)
    samples = random_samples()
    batch = pad_batch(samples, 0, token_keys=())
    mask = batch["response_mask"].double()
    g = torch.Generator().manual_seed(2)
    w_lp, w_ent = torch.randn(mask.shape, generator=g, dtype=torch.float64), torch.randn(mask.shape, generator=g,
                                                                                      dtype=torch.float64)
    temperature = 0.7

    lp, ent = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], mask, temperature)
    ((lp * w_lp).sum() + 0.3 * (ent * w_ent).sum()).backward()
    padded_grads = grads(model)
    model.zero_grad(set_to_none=True)

    packed = pack_rows(batch["input_ids"], batch["attention_mask"], mask)
    assert packed.num_tokens == sum(p + r for p, r in LENGTHS)      # no padding in the pack
    plp, pent = packed_sequence_logprobs(model, packed, temperature)
    ((plp * packed.take(w_lp)).sum() + 0.3 * (pent * packed.take(w_ent)).sum()).backward()

    assert lp.abs().sum() > 1.0                                       # real numbers were compared
    assert (packed.to_padded(plp.detach()) - lp.detach()).abs().max() < 1e-10
    assert (packed.to_padded(pent.detach()) - ent.detach()).abs().max() < 1e-10
    assert_grads_close(grads(model), padded_grads)


def test_subset_of_rows_in_any_order_and_take_put_round_trip():
    model = tiny_model("llama")
    packed, batch = pack_samples(random_samples(), 0)
    rows = [4, 0, 2]
    sub = pack_rows(batch["input_ids"], batch["attention_mask"], batch["response_mask"], rows)
    assert sub.rows == rows and sub.seq_lens == [sum(LENGTHS[i]) for i in rows]
    with torch.no_grad():
        lp_all, _ = packed_sequence_logprobs(model, packed, with_entropy=False)
        lp_sub, _ = packed_sequence_logprobs(model, sub, with_entropy=False)
    full = packed.to_padded(lp_all)
    assert (sub.to_padded(lp_sub)[rows] - full[rows]).abs().max() < 1e-10
    # put writes only the packed rows' places; unpad_tokens then gives each response's values
    dst = torch.full(full.shape, 7.0, dtype=torch.float64)
    sub.put(dst, lp_sub)
    assert (dst[[1, 3, 5]] == 7.0).all()
    per_row = unpad_tokens(sub.to_padded(lp_sub), batch["response_mask"])
    assert [len(per_row[i]) for i in rows] == [LENGTHS[i][1] for i in rows]


def test_restarting_position_ids_are_what_confines_attention():
    """Negative control: the same pack with positions 0..N-1 (one long sequence) is not the padded
    result, so the equality above comes from transformers' packed-sequence masking."""
    model = tiny_model("llama")
    packed, batch = pack_samples(random_samples(), 0)
    one_sequence = dataclasses.replace(packed, position_ids=torch.arange(packed.num_tokens)[None])
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
        wrong, _ = packed_sequence_logprobs(model, one_sequence, with_entropy=False)
    assert (one_sequence.to_padded(wrong) - lp).abs().max() > 1e-3


def test_packed_values_and_gradients_equal_padded():
    backbone = tiny_model("qwen2").model
    value_model = ValueModel(backbone, 32, seed=3).double()
    batch = pad_batch(random_samples(), 0, token_keys=())
    mask = batch["response_mask"].double()
    target = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    values = value_model(batch["input_ids"], batch["attention_mask"])
    (((values - target) ** 2) * mask).sum().backward()
    padded_grads = grads(value_model)
    value_model.zero_grad(set_to_none=True)

    packed = pack_rows(batch["input_ids"], batch["attention_mask"], mask)
    pvalues = packed_values(value_model, packed)
    (((pvalues - packed.take(target)) ** 2) * packed.response_mask).sum().backward()

    # compared on the response tokens (elsewhere the padded layout's values see padding states)
    assert (packed.to_padded(pvalues.detach()) * mask - values.detach() * mask).abs().max() < 1e-10
    assert_grads_close(grads(value_model), padded_grads)


def test_gradient_checkpointing_leaves_gradients_unchanged():
    batch = pad_batch(random_samples(), 0, token_keys=())
    packed = pack_rows(batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    results = []
    for checkpointing in (False, True):
        model = tiny_model("llama").train()
        if checkpointing:
            enable_gradient_checkpointing(model)
        calls = []   # layer 0 MLP calls (pre-hook: recomputation stops early, after its last saved input)
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        for run in (lambda: sequence_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                              batch["response_mask"].double())[0].sum(),
                    lambda: packed_sequence_logprobs(model, packed)[0].sum()):
            calls.clear()
            run().backward()
            assert len(calls) == (2 if checkpointing else 1)
            results.append(grads(model))
            model.zero_grad(set_to_none=True)
    padded_plain, packed_plain, padded_ckpt, packed_ckpt = results
    assert_grads_close(padded_ckpt, padded_plain, rtol=1e-12)
    assert_grads_close(packed_ckpt, packed_plain, rtol=1e-12)

    value_model = ValueModel(tiny_model("llama").model, 32).double().train()
    enable_gradient_checkpointing(value_model)
    assert value_model.backbone.gradient_checkpointing


def test_empty_prompt_is_an_error():
    batch = pad_batch(random_samples([(0, 3), (2, 2)]), 0, token_keys=())
    with pytest.raises(ValueError, match=r"rows \[0\] have an empty prompt"):
        pack_rows(batch["input_ids"], batch["attention_mask"], batch["response_mask"])


def test_padded_columns_trim_a_micro_batch_to_its_own_rows():
    model = tiny_model("llama")
    batch = pad_batch(random_samples(), 0, token_keys=(), multiple_of=COLUMN_MULTIPLE)   # as the nodes' batches
    rows = [1, 3, 5]                                    # prompts 7, 4, 6; responses 1, 4, 3
    cols = padded_columns(batch["attention_mask"], rows)
    # their 7 + 4 columns, widened with padding columns to an aligned width (one compiled graph)
    assert batch["input_ids"].shape[1] % COLUMN_MULTIPLE == 0
    assert cols.stop - cols.start == aligned(7 + 4) == 16
    used = torch.nonzero(batch["attention_mask"][rows].sum(0)).squeeze(1)
    assert cols.start <= used.min() and used.max() < cols.stop
    with torch.no_grad():
        full, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
        trimmed, _ = sequence_logprobs(model, *(batch[k][rows][:, cols] for k in
                                                ("input_ids", "attention_mask", "response_mask")))
    assert (trimmed - full[rows][:, cols]).abs().max() < 1e-10
    assert full[rows][:, :cols.start].abs().sum() == 0 and full[rows][:, cols.stop:].abs().sum() == 0
    mb = micro_batch(batch, rows, packing=False)                  # the same, as the nodes' micro-batch
    with torch.no_grad():
        lp, _ = micro_batch_logprobs(model, mb)
    assert mb.input_ids.shape == (3, 16) and (mb.take(full) - lp).abs().max() < 1e-10
    back = mb.to_padded(lp)
    assert (back[rows] - full[rows]).abs().max() < 1e-10 and back[[0, 2, 4]].abs().sum() == 0


def test_use_varlen_attention_switches_the_trunk():
    from rl.update.packing import use_varlen_attention, varlen_attention_available

    assert varlen_attention_available("cpu") == "sdpa"
    value_model = ValueModel(tiny_model("llama").model, 32).double()
    assert use_varlen_attention(value_model, "cpu") == "sdpa"
    assert use_varlen_attention(value_model, "cpu", "eager") == "eager"
    assert value_model.backbone.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_torch_varlen_attention_equals_padded_sdpa(family):
    """torch_varlen (rl/update/varlen_attention.py; on CPU its per-sequence path: the glue around the CUDA
    kernel, i.e. the rows' boundaries from PackedBatch.attention_kwargs, grouped-query heads, the
    layout transformers hands over): packed log-probs, values and gradients equal the padded sdpa
    computation in float64; a padded batch (2-D mask) run under it equals sdpa too; and the
    boundaries are what confines attention (one boundary for the whole pack gives other numbers)."""
    import copy

    from rl.update.packing import use_varlen_attention

    reference = tiny_model(family)                              # sdpa, padded: the reference
    model = copy.deepcopy(reference)
    assert use_varlen_attention(model, "cpu", "torch_varlen") == "torch_varlen"
    samples = random_samples()
    batch = pad_batch(samples, 0, token_keys=())
    mask = batch["response_mask"].double()
    w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    lp, ent = sequence_logprobs(reference, batch["input_ids"], batch["attention_mask"], mask, 0.7)
    ((lp * w).sum() + 0.3 * ent.sum()).backward()
    packed = pack_rows(batch["input_ids"], batch["attention_mask"], mask)
    kwargs = packed.attention_kwargs(model)
    assert kwargs["cu_seq_lens_q"].tolist()[-1] == packed.num_tokens and kwargs["max_length_q"] == 14
    plp, pent = packed_sequence_logprobs(model, packed, 0.7)
    ((plp * packed.take(w)).sum() + 0.3 * pent.sum()).backward()
    assert lp.abs().sum() > 1.0
    assert (packed.to_padded(plp.detach()) - lp.detach()).abs().max() < 1e-10
    assert (packed.to_padded(pent.detach()) - ent.detach()).abs().max() < 1e-10
    assert_grads_close(grads(model), grads(reference))

    with torch.no_grad():                                       # padded rows under torch_varlen
        padded_lp, _ = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], mask)
        want, _ = sequence_logprobs(reference, batch["input_ids"], batch["attention_mask"], mask)
        assert (padded_lp - want).abs().max() < 1e-10
        one = {"cu_seq_lens_q": torch.tensor([0, packed.num_tokens], dtype=torch.int32),
               "max_length_q": packed.num_tokens}
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, **one).logits
        right = model(input_ids=packed.input_ids, position_ids=packed.position_ids, **kwargs).logits
        assert (out - right).abs().max() > 1e-3

    value_model = ValueModel(copy.deepcopy(reference.model), 32, seed=3).double()
    value_ref = copy.deepcopy(value_model)
    use_varlen_attention(value_model, "cpu", "torch_varlen")
    with torch.no_grad():
        v = packed_values(value_model, packed)
        want_v = value_ref(batch["input_ids"], batch["attention_mask"])
    assert (packed.to_padded(v) * mask - want_v * mask).abs().max() < 1e-10 and v.abs().sum() > 0.1
