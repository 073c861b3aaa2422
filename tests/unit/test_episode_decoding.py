"""The static decoder's multi-turn parts (rl/generation/decoding.StaticDecoder keep / extend / release) on CPU
in float32: a slot's KV cache extended by an episode's appended tokens gives the logits of a full
re-prefill of the history, decoding continues from it as from a fresh prompt, and the sampling
noise of a later turn never repeats an earlier turn's."""

import copy

import pytest
import torch

from rl.generation import decoding
from rl.model import causal_lm as models
from rl.data import tasks
from rl.generation.decoder_forward import extend_prefill


@pytest.fixture(scope="module")
def tok():
    return tasks.build_tokenizer()


SHAPES = {"llama": dict(family="llama", n_layer=2, n_embd=64, n_head=4),
          "qwen2-gqa": dict(family="qwen2", n_layer=2, n_embd=64, n_head=4, n_kv_head=2)}


@pytest.fixture(scope="module", params=list(SHAPES))
def policy(request, tok):
    torch.manual_seed(0)
    model = models.build_policy(models.ModelConfig(**SHAPES[request.param]), tok).eval()
    if request.param.startswith("qwen2"):
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return model


def _turn(dec, requests, keep=True):
    dec.add(requests, keep=keep)
    out = {}
    while dec.decoding:
        for tag, sample in dec.step():
            out[tag] = sample
    return out


def test_extended_slot_logits_equal_a_full_prefill(tok, policy):
    """Two episodes of different lengths: after a turn, extend_prefill's logits at the appended
    tokens' end equal the model's on the whole history, and every position's K/V equals a fresh
    prefill's."""
    prompts = [[5, 9, 11, 4, 7], [6, 8]]
    dec = decoding.StaticDecoder(policy, 4, 64, eos_id=tok.eos_token_id, max_new_tokens=6, temperature=1.0)
    samples = _turn(dec, [(p, i, decoding.sample_key(0, i, 0)) for i, p in enumerate(prompts)])
    appended = [[12, 13, 14], [15]]
    slots = [samples[i]["slot"] for i in range(2)]
    starts = dec.lengths[torch.tensor(slots)]
    history = [p + samples[i]["response_ids"] + appended[i] for i, p in enumerate(prompts)]
    new = [[samples[i]["response_ids"][-1]] + appended[i] for i in range(2)]
    ids = torch.zeros(2, max(map(len, new)), dtype=torch.long)
    for r, t in enumerate(new):
        ids[r, :len(t)] = torch.tensor(t)
    with torch.no_grad():
        got = extend_prefill(dec, ids, torch.tensor([len(t) for t in new]), starts, torch.tensor(slots))
        for i, h in enumerate(history):
            assert int(starts[i]) + len(new[i]) == len(h)
            ref = policy(input_ids=torch.tensor([h])).logits[0, -1]
            assert (got[i] - ref).abs().max() < 1e-5
    # the whole cache of each slot equals a fresh decoder's prefill of the history
    fresh = decoding.StaticDecoder(policy, 4, 64, eos_id=tok.eos_token_id, max_new_tokens=6)
    with torch.no_grad():
        for i, h in enumerate(history):
            fresh._prefill(torch.tensor([h]), torch.tensor([len(h)]), torch.tensor([0]))
            for layer in range(len(policy.model.layers)):
                a = dec.k_cache[layer][slots[i], :, :len(h)]
                b = fresh.k_cache[layer][0, :, :len(h)]
                assert (a - b).abs().max() < 1e-5


def test_greedy_turn_after_extend_equals_decoding_the_full_history(tok, policy):
    """Greedy: the second turn of an episode (cache extended) samples the tokens and log-probs a
    fresh decoder samples from the whole history as its prompt."""
    prompt, appended = [5, 9, 11, 4, 7], [12, 13, 14]
    dec = decoding.StaticDecoder(policy, 2, 64, eos_id=tok.eos_token_id, max_new_tokens=6, temperature=0.0)
    first = _turn(dec, [(prompt, "e", 1)])["e"]
    dec.extend([(first["slot"], appended, len(first["response_ids"]) + len(appended), None)])
    second = {}
    while dec.decoding:
        second.update(dec.step())
    second = second["e"]
    assert second["slot"] == first["slot"] and dec.active == 1
    dec.release(first["slot"])
    assert dec.active == 0 and dec.free_slots() == 2
    history = prompt + first["response_ids"] + appended
    ref = decoding.decode_responses(policy, tok, [history], 6, temperature=0.0)[0]
    assert second["response_ids"] == ref["response_ids"]
    assert max(abs(a - b) for a, b in zip(second["logprobs"], ref["logprobs"])) < 1e-5


def test_noise_differs_across_turns_and_follows_the_episode_index(tok, policy):
    """A model with uniform logits samples argmax of the noise alone, so each token shows which
    noise counter drew it: turn 1's tokens are those of counters 0, 1, 2, turn 2's (extended after
    2 environment tokens) those of counters 5, 6, 7 (its index in the episode's response), not a
    replay of turn 1's (the counter restarting at 0)."""
    uniform = copy.deepcopy(policy)
    with torch.no_grad():
        uniform.lm_head.weight.zero_()
    dec = decoding.StaticDecoder(uniform, 2, 64, eos_id=tok.eos_token_id, max_new_tokens=3, min_new_tokens=3)
    key = decoding.sample_key(0, 3, 0)

    def drawn(step):    # the token uniform logits give at noise counter `step` (<eos> masked)
        noise = decoding.gumbel_noise(torch.tensor([key]), torch.tensor([step]), dec.vocab_hash)[0]
        noise[tok.eos_token_id] = float("-inf")
        return int(noise.argmax())
    first = _turn(dec, [([5, 9, 11], "e", key)])["e"]
    assert first["response_ids"] == [drawn(t) for t in range(3)]
    dec.extend([(first["slot"], [12, 13], 5, None)])
    second = {}
    while dec.decoding:
        second.update(dec.step())
    assert second["e"]["response_ids"] == [drawn(t) for t in (5, 6, 7)]
    assert second["e"]["response_ids"] != first["response_ids"]


def test_an_environment_step_that_just_ended_is_seen_before_the_event_loop_turns():
    """The generator checks for finished steps right after its own await; a step that ended in that
    same loop turn must count (a done-callback would run only after the check, and the generator,
    seeing nothing to wait on, would spin holding the event loop)."""
    import asyncio
    from rl.generation.episodes import Episodes

    async def main():
        episodes = Episodes(None, None, None, max_new_tokens=8)

        async def step():
            return "turn"
        task = asyncio.ensure_future(step())
        episodes.steps[task] = "run"
        await asyncio.sleep(0)    # the step runs and ends; callbacks it schedules run after us
        assert task.done() and episodes.stepped and episodes.waiting == 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await episodes.wait([], 5.0)          # returns at once: there is a step to harvest
        assert loop.time() - t0 < 1.0
        episodes.steps.clear()
        await episodes.wait([], 0.05)         # nothing to wait on: sleeps, never spins
        assert loop.time() - t0 >= 0.05
    asyncio.run(main())


def test_episode_metrics_average_tool_calls_and_errors_per_episode():
    """The learner's env/* line (rl/generation/episodes.episode_metrics): per-episode means of the
    episodes' tool counters, so a tool-using run whose model stopped calling shows 0 calls."""
    from rl.generation.episodes import episode_metrics

    def episode(turns, calls, errors, failed=None):
        return {"turns": turns, "loss_mask": [1, 1, 0, 1], "env": {
            "failed": failed, "env_s": 0.5, "counters": {"tool_calls": calls, "tool_errors": errors},
            "prefilled_tokens": 10, "history_tokens": 20}}
    m = episode_metrics([episode(3, 2, 1), episode(1, 0, 0), episode(2, 1, 0, failed="timeout"),
                         {"turns": 1, "loss_mask": [1]}])          # a single-turn sample: not an episode
    assert m["env/tool_calls"] == 1.0 and m["env/tool_errors"] == pytest.approx(1 / 3)
    assert m["env/turns"] == 2.0 and m["env/failed"] == 1 and m["env/trained_tokens"] == 3.0
    assert episode_metrics([{"turns": 1, "loss_mask": [1]}]) == {}
