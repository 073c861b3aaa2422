"""rl/generation/decoding.py on CPU (fp32): the static-cache decoder against the HF model, its sampling
noise, and slot refilling. (CUDA graphs: bench/gpu_decode.py on a GPU.)"""

import math

import pytest
import torch

from rl.generation import decoder_steps, decoding
from rl.model import causal_lm as models, padded_batch
from rl.generation import hf_sampling
from rl.data import tasks


@pytest.fixture(scope="module")
def tok():
    return tasks.build_tokenizer()


SHAPES = {"llama": dict(family="llama", n_layer=2, n_embd=64, n_head=4),
          "qwen2-gqa": dict(family="qwen2", n_layer=2, n_embd=64, n_head=4, n_kv_head=2)}


@pytest.fixture(scope="module", params=list(SHAPES))
def policy(request, tok):
    model = models.build_policy(models.ModelConfig(**SHAPES[request.param]), tok).eval()
    if request.param.startswith("qwen2"):   # random init leaves the qkv biases at 0: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return model


def prompts(tok, n=12):
    """Prompts of three different lengths."""
    out = []
    for i, r in enumerate(tasks.make_task("copy", 3, seed=0).take(n)):
        ids = tok(r["prompt"])["input_ids"]
        out.append(ids if i % 3 == 0 else ids[:-1] if i % 3 == 1 else ids[:3] + ids[-1:])
    return out


def test_decoder_logits_equal_hf_forward(tok, policy):
    ps = prompts(tok, 6)
    conts = [[(7 * i + j) % len(tok) for j in range(3 + i)] for i in range(len(ps))]
    dec = decoding.StaticDecoder(policy, 8, 32, eos_id=tok.eos_token_id, max_new_tokens=16)
    got = dec.teacher_forced_logits(ps, conts)
    with torch.no_grad():
        for p, c, g in zip(ps, conts, got):
            ref = policy(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:len(p) + len(c) - 1]
            assert g.shape == ref.shape
            assert (g - ref).abs().max() < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_sequence_logprobs(tok, policy, temperature):
    samples = decoding.decode_responses(policy, tok, prompts(tok), 8, temperature=temperature, seed=0)
    assert any(s["finished"] for s in samples) and not all(s["finished"] for s in samples)
    for s in samples:
        assert 1 <= len(s["response_ids"]) == len(s["logprobs"]) <= 8
        assert s["finished"] == (s["response_ids"][-1] == tok.eos_token_id)
        assert tok.eos_token_id not in s["response_ids"][:-1]
    b = padded_batch.pad_batch(samples, tok.pad_token_id)
    with torch.no_grad():
        lp, _ = padded_batch.sequence_logprobs(policy, b["input_ids"], b["attention_mask"],
                                         b["response_mask"], temperature, with_entropy=False)
    assert ((lp - b["logprobs"]).abs() * b["response_mask"]).max() < 1e-5


def test_greedy_equals_hf_loop(tok, policy):
    ps = prompts(tok)
    ours = decoding.decode_responses(policy, tok, ps, 6, temperature=0)
    ref = hf_sampling.sample_responses(policy, tok, ps, 6, temperature=0)
    assert [s["response_ids"] for s in ours] == [s["response_ids"] for s in ref]
    for a, b in zip(ours, ref):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    top1 = decoding.decode_responses(policy, tok, ps, 6, top_k=1, seed=5)
    assert [s["response_ids"] for s in top1] == [s["response_ids"] for s in ours]
    assert all(abs(x) < 1e-6 for s in top1 for x in s["logprobs"])


def test_responses_do_not_depend_on_batch_or_slot(tok, policy):
    """The noise is keyed by (seed, prompt id, sample index, token index): the same key gives the
    same response alone, in a full batch, in a different order, or through 3 refilled slots."""
    ps = prompts(tok)
    keys = [(100 + i // 2, i % 2) for i in range(len(ps))]
    full = decoding.decode_responses(policy, tok, ps, 8, seed=3, keys=keys, top_k=10)
    order = list(reversed(range(len(ps))))
    shuffled = decoding.decode_responses(policy, tok, [ps[i] for i in order], 8, seed=3,
                                         keys=[keys[i] for i in order], top_k=10, num_slots=3)
    alone = decoding.decode_responses(policy, tok, ps[4:5], 8, seed=3, keys=keys[4:5], top_k=10)
    for got, i in zip(shuffled, order):
        assert got["response_ids"] == full[i]["response_ids"]
        assert got["logprobs"] == pytest.approx(full[i]["logprobs"], abs=1e-5)
    assert alone[0]["response_ids"] == full[4]["response_ids"]
    other = decoding.decode_responses(policy, tok, ps, 8, seed=4, keys=keys, top_k=10)
    assert [s["response_ids"] for s in other] != [s["response_ids"] for s in full]


def test_slots_refill_and_finished_sequences_come_out_early(tok, policy):
    # 50-61 token prompts: sequences cross the 64-token attention bound while decoding
    ps = [(p * 20)[:50 + i] for i, p in enumerate(prompts(tok))]
    keys = [decoding.sample_key(0, i, 0) for i in range(len(ps))]
    reference = decoding.decode_responses(policy, tok, ps, 10, keys=[(i, 0) for i in range(len(ps))])
    lengths = [len(s["response_ids"]) for s in reference]
    assert min(lengths) < max(lengths) == 10
    dec = decoding.StaticDecoder(policy, 4, 100, eos_id=tok.eos_token_id, max_new_tokens=10,
                                 sync_every=3)
    dec.exact_lengths = False    # as on CUDA: attend over the host-side bound (64-aligned), no sync
    queue = list(range(len(ps)))
    got, steps, early = {}, 0, False
    while queue or dec.active:
        while queue and dec.free_slots():
            i = queue.pop(0)
            dec.add([(ps[i], i, keys[i])])
        for i, sample in dec.step():
            early |= dec.active > 0          # came out while other sequences kept decoding
            got[i] = sample
        steps += 1
    assert early
    for i, ref in enumerate(reference):   # batch shapes differ, so logits only to float noise
        assert got[i]["response_ids"] == ref["response_ids"]
        assert got[i]["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-5)
    # refilling freed slots takes fewer steps than decoding in fixed batches of 4
    assert steps < sum(max(lengths[k:k + 4]) for k in range(0, len(ps), 4))


def test_min_new_tokens_masks_eos(tok, policy):
    ps = prompts(tok)
    samples = decoding.decode_responses(policy, tok, ps, 8, seed=1, min_new_tokens=8)
    assert all(len(s["response_ids"]) == 8 and not s["finished"] for s in samples)
    # the behaviour log-probs are of the distribution without <eos>: log p - log(1 - p_eos)
    b = padded_batch.pad_batch(samples, tok.pad_token_id)
    with torch.no_grad():
        logits = policy(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                        position_ids=padded_batch.mask_position_ids(b["attention_mask"])).logits.float()
    logits[..., tok.eos_token_id] = float("-inf")
    lp = torch.log_softmax(logits[:, :-1], -1).gather(2, b["input_ids"][:, 1:, None]).squeeze(2)
    mask = b["response_mask"][:, 1:]
    assert ((lp - b["logprobs"][:, 1:]).abs() * mask).max() < 1e-5
    hf = hf_sampling.sample_responses(policy, tok, ps, 8, seed=1, min_new_tokens=8)
    assert all(len(s["response_ids"]) == 8 for s in hf)


def test_counter_noise_samples_the_softmax():
    """Gumbel-max with the hashed noise draws from softmax(logits): frequencies over 20k keys
    match the probabilities (a broken hash, e.g. correlated across the vocab, fails this)."""
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    n = 20000
    logits = probs.log().expand(n, -1).contiguous()
    keys = torch.tensor([decoding.sample_key(7, i, 0) for i in range(n)])
    vocab_hash = decoding._fmix32(decoding._fmix32(torch.arange(5) ^ 0x9E3779B9))
    tokens, lp = decoding.sample_tokens(logits, keys, torch.zeros(n, dtype=torch.long), vocab_hash,
                                        1.0, 0, eos_id=4, min_new_tokens=0)
    freq = torch.bincount(tokens, minlength=5).float() / n
    assert (freq - probs).abs().max() < 4 * math.sqrt(0.25 / n)
    assert torch.allclose(lp, probs.log()[tokens])
    # the next token index draws independently of this one
    again, _ = decoding.sample_tokens(logits, keys, torch.ones(n, dtype=torch.long), vocab_hash,
                                      1.0, 0, eos_id=4, min_new_tokens=0)
    same = (again == tokens).float().mean()
    assert abs(same - (probs ** 2).sum()) < 0.02


def test_weights_updated_in_place_or_replaced_are_used(tok, policy):
    ps = prompts(tok, 3)
    dec = decoding.StaticDecoder(policy, 4, 32, eos_id=tok.eos_token_id, max_new_tokens=4)
    conts = [[5, 6, 7]] * 3
    before = dec.teacher_forced_logits(ps, conts)
    saved = {k: v.clone() for k, v in policy.state_dict().items()}
    try:
        with torch.no_grad():
            w = policy.model.layers[0].mlp.down_proj.weight
            w.mul_(3.0)                                  # in place (load_state_dict, receiver)
            dec.refresh()
            inplace = dec.teacher_forced_logits(ps, conts)
            w.data = w.data.clone() * 2.0                # replaced storage (rehome)
            dec.refresh()
            replaced = dec.teacher_forced_logits(ps, conts)
            ref = policy(input_ids=torch.tensor([ps[0] + conts[0]])).logits[0, len(ps[0]) - 1:-1]
    finally:
        policy.load_state_dict(saved)
    assert (before[0] - inplace[0]).abs().max() > 1e-3
    assert (replaced[0] - ref).abs().max() < 1e-5


def test_unsupported_models_are_named(tok):
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok)))
    assert "gpt2" in decoding.unsupported_reason(gpt2)
    with pytest.raises(ValueError, match="unsupported model"):
        decoding.StaticDecoder(gpt2, 2, 16, eos_id=0, max_new_tokens=4)


def test_prompts_per_call_auto_fills_256_slots_on_cuda_and_32_prompts_on_cpu():
    from nodes.impl.generator import GeneratorConfig, prompts_per_call

    assert prompts_per_call(GeneratorConfig(group_size=8), "cuda") == 32      # GRPO: 32 x 8 slots
    assert prompts_per_call(GeneratorConfig(group_size=1), "cuda:0") == 256   # PPO: 256 x 1
    assert prompts_per_call(GeneratorConfig(group_size=512), "cuda") == 1
    assert prompts_per_call(GeneratorConfig(group_size=1), "cpu") == 32
    assert prompts_per_call(GeneratorConfig(group_size=8, prompts_per_call=5), "cuda") == 5
    # With the KV cache's size known: half the room left, in whole groups, at least one group.
    grpo = GeneratorConfig(group_size=8)
    assert prompts_per_call(grpo, "cuda", slot_bytes=2**20, room_bytes=2**30) == 32     # 512 slots fit: 256
    assert prompts_per_call(grpo, "cuda", slot_bytes=2**20, room_bytes=200 * 2**20) == 12  # 100 slots
    assert prompts_per_call(grpo, "cuda", slot_bytes=2**30, room_bytes=2**30) == 1
    assert prompts_per_call(GeneratorConfig(group_size=8, prompts_per_call=64), "cuda", 2**30, 2**30) == 64
    # On a CPU too: a SmolLM2-sized slot (53 MiB in fp32) in 8 GiB of room gives 77 slots, 9 prompts
    # of 8 (32 x 8 slots would be 13 GiB), while a tiny model's slots keep the 32 prompts.
    assert prompts_per_call(grpo, "cpu", slot_bytes=53 * 2**20, room_bytes=8 * 2**30) == 9
    assert prompts_per_call(grpo, "cpu", slot_bytes=2**16, room_bytes=8 * 2**30) == 32


def test_room_bytes_on_cpu_is_half_the_available_memory():
    from rl.generation.decoder_slots import room_bytes

    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(room_bytes("cpu", 1.0) - available // 2) < 2**30    # memory moves a little meanwhile


def test_kv_bytes_per_slot_is_what_the_static_decoder_allocates(tok, policy):
    from rl.generation.decoder_slots import kv_bytes_per_slot

    dec = decoding.StaticDecoder(policy, num_slots=3, max_len=40, eos_id=tok.eos_token_id, max_new_tokens=8)
    dec.refresh()
    cache = sum(t.numel() * t.element_size() for t in dec.k_cache + dec.v_cache)
    assert kv_bytes_per_slot(policy, 40) * 3 == cache


def test_per_request_temperature_mixes_greedy_and_sampled_rows(tok, policy):
    """A request's own temperature (validation: 0 = greedy beside samples at the training
    temperature, nodes/generator.py): its rows equal a decoder run at that one temperature, in the
    same batch as rows at another one, through refilled slots; the per-slot mode ends with them."""
    ps = prompts(tok)
    keys = [(i, 0) for i in range(len(ps))]
    sampled = decoding.decode_responses(policy, tok, ps, 8, temperature=0.7, seed=2, keys=keys, top_k=10)
    greedy = decoding.decode_responses(policy, tok, ps, 8, temperature=0, seed=2, keys=keys, top_k=10)
    dec = decoding.StaticDecoder(policy, 5, 32, eos_id=tok.eos_token_id, max_new_tokens=8,
                                 temperature=0.7, top_k=10, seed=2)
    queue = [(p, i, decoding.sample_key(2, i, 0), 0.0 if i % 2 else None) for i, p in enumerate(ps)]
    out, saw_mixed = {}, False
    while queue or dec.active:
        take = min(dec.free_slots(), len(queue))
        dec.add([queue.pop(0) for _ in range(take)])
        saw_mixed |= bool(dec._odd_temps) and any(
            s is not None and s[0] % 2 == 0 for s in dec.slots)
        out.update(dec.step())
    assert saw_mixed
    for i in range(len(ps)):
        ref = greedy[i] if i % 2 else sampled[i]
        assert out[i]["response_ids"] == ref["response_ids"], i
        assert out[i]["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-5)
    assert not dec._odd_temps and bool((dec.temps == 0.7).all())
    assert {mode for _, _, mode in dec._graphs} <= {False, True}   # (CUDA only; empty on CPU)


def test_sample_tokens_per_row_temperature_matches_one_temperature():
    """The tensor form (per-row temperatures, 0 = greedy) gives each row what the float form gives."""
    g = torch.Generator().manual_seed(0)
    n, vocab = 6, 50
    logits = torch.randn(n, vocab, generator=g) * 3
    keys = torch.arange(n, dtype=torch.long) * 7919
    steps = torch.zeros(n, dtype=torch.long)
    vocab_hash = decoding._fmix32(decoding._fmix32(torch.arange(vocab) ^ 0x9E3779B9))
    temps = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3, 0.7])
    got_t, got_lp = decoding.sample_tokens(logits, keys, steps, vocab_hash, temps, 5, 0, 0)
    for i, t in enumerate(temps.tolist()):
        ref_t, ref_lp = decoding.sample_tokens(logits, keys, steps, vocab_hash, t, 5, 0, 0)
        assert got_t[i] == ref_t[i] and got_lp[i] == pytest.approx(ref_lp[i].item(), abs=1e-6)
    assert got_t[0] == logits[0].argmax() and got_t[3] == logits[3].argmax()


def test_weight_switch_mid_decode_keeps_the_cache_and_tags_each_token(tok, policy):
    """Partial rollouts (set_version): weights change between two step() calls while sequences are
    live. Every token is tagged with the version that sampled it, no token is lost or repeated, each
    response stops at its own cap (the 5th request field), and a token sampled after the switch has
    the log-prob of the new weights over the KV cache the old weights wrote for its prefix: equal
    to HF's forward that continues the old model's past_key_values with the new model."""
    import copy

    ps = prompts(tok, 3)
    caps = [9, 4, 7]
    keys = [decoding.sample_key(0, i, 0) for i in range(3)]
    dec = decoding.StaticDecoder(policy, 4, 48, eos_id=tok.eos_token_id, max_new_tokens=9, min_new_tokens=9,
                                 token_versions=True)
    dec.add([(p, i, k, None, cap) for i, (p, k, cap) in enumerate(zip(ps, keys, caps))])
    got = dict(dec.step(4))                          # 1 + 4 tokens under version 0: slot 1 (cap 4) ends
    assert list(got) == [1]
    old = copy.deepcopy(policy)
    saved = {k: v.clone() for k, v in policy.state_dict().items()}
    try:
        with torch.no_grad():
            policy.model.layers[0].mlp.down_proj.weight.mul_(3.0)
            policy.lm_head.weight.mul_(1.5)
        dec.refresh()
        dec.set_version(1)
        while dec.active:
            got.update(dec.step(2))
        for i, (p, cap) in enumerate(zip(ps, caps)):
            s = got[i]
            k = min(5, cap)                          # tokens sampled before the switch
            assert len(s["response_ids"]) == len(s["logprobs"]) == cap and not s["finished"]
            assert s["token_versions"] == [0] * k + [1] * (cap - k)
            r = s["response_ids"]
            with torch.no_grad():                   # HF: the old model's cache of the prefix, continued by the new one
                first = old(input_ids=torch.tensor([p + r[:k - 1]]), use_cache=True)
                logits = [first.logits[0, len(p) - 1:]]
                if cap > k:
                    logits.append(policy(input_ids=torch.tensor([r[k - 1:cap - 1]]), cache=first.cache).logits[0])
            logits = torch.cat(logits)
            logits[:, tok.eos_token_id] = -math.inf          # min_new_tokens: <eos> masked out of what was sampled
            want = torch.log_softmax(logits, -1)[torch.arange(cap), torch.tensor(r)]
            assert s["logprobs"] == pytest.approx(want.tolist(), abs=1e-4)
            if cap > k:                              # not a recompute of the prefix with the new weights
                with torch.no_grad():
                    fresh = policy(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]
                    fresh[:, tok.eos_token_id] = -math.inf
                    fresh = torch.log_softmax(fresh, -1)
                assert (fresh[torch.arange(cap), torch.tensor(r)][k:] - want[k:]).abs().max() > 1e-3
    finally:
        policy.load_state_dict(saved)


def test_expand_versions():
    assert decoder_steps.expand_versions([(0, 3)], 4) == [3, 3, 3, 3]
    assert decoder_steps.expand_versions([(0, 3), (5, 4)], 7) == [3, 3, 3, 3, 3, 4, 4]
    assert decoder_steps.expand_versions([(0, 3), (2, 4), (3, 6)], 5) == [3, 3, 4, 6, 6]


def test_a_released_cache_is_allocated_again_and_the_responses_do_not_change(tok, policy):
    """The phase switch (nodes/generator.py): a decoder built with cache=False has none until its
    first refresh(), free_cache() frees the KV cache of an idle decoder, the next refresh() allocates it again, and the same keys sample the same responses as a decoder
    that never let go of it; a decoder with busy slots refuses to release."""
    ps = prompts(tok, 6)
    keys = [(200 + i, 0) for i in range(len(ps))]
    kept = decoding.decode_responses(policy, tok, ps, 6, seed=5, keys=keys, top_k=10, num_slots=4)
    dec = decoding.StaticDecoder(policy, 4, max(map(len, ps)) + 6, eos_id=tok.eos_token_id, max_new_tokens=6,
                                 seed=5, top_k=10, cache=False)     # built without one: the first turn allocates it
    assert dec.cache_freed
    first = decoding.decode_responses(policy, tok, ps[:3], 6, keys=keys[:3], decoder=dec)
    assert dec.free_cache() == 0 and dec.cache_freed and dec.k_cache is None   # on CPU: freed, no GPU bytes to count
    again = decoding.decode_responses(policy, tok, ps[3:], 6, keys=keys[3:], decoder=dec)
    assert not dec.cache_freed and len(dec.k_cache) == len(policy.model.layers)
    for got, want in zip(first + again, kept):
        assert got["response_ids"] == want["response_ids"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
    dec.add([(ps[0], 0, decoding.sample_key(5, 0, 0))])
    with pytest.raises(RuntimeError, match="slots are busy"):
        dec.free_cache()
