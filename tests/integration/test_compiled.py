"""The compiled paths (torch.compile: decoder layers, learner and critic layers, flex attention over
packs, the fused log-prob kernel, the compile warm-up) against their eager forms. They start
inductor's compile worker processes and take minutes on 2 cores, so they live in the integration
tier; their fixtures and helpers are the unit tests' (tests/unit/)."""

from __future__ import annotations

import random

import pytest
import torch

from rl.model.logprobs import _compiled_fns, token_logprobs
from tests.unit.test_decoding import decoding, policy, prompts, tok  # noqa: F401 (fixtures)
from tests.unit.test_learner import LearnerConfig, fresh, ppo_update, setup, with_advantages  # noqa: F401 (fixtures)
from tests.unit.test_packing import pack_rows, packed_sequence_logprobs, pad_batch, random_samples, tiny_model


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


def test_compiled_layers_with_flex_attention_compile_once_for_many_pack_lengths():
    """compile_layers on a flex_attention model (packed passes on CUDA without flash_attn), on CPU:
    the layers compile with automatic dynamic shapes (rl/model/precision.compile_layers says why not
    dynamic=True: its flex kernel does not build on CPU), so the first pack length compiles static,
    the second recompiles with the lengths dynamic, and packs of three more lengths run that graph
    with no new one. (A pack of one flex block, N <= 128, compiles one more variant once, the block
    counts' size 1 being specialized; not run here, to save a compile.) Log-probs equal eager
    sdpa's (the block-diagonal mask). No gradients: CPU flex has no backward ("FlexAttention does
    not support backward on CPU")."""
    import copy

    from torch._dynamo.utils import counters

    from rl.update.packing import use_varlen_attention
    from rl.model.precision import compile_layers

    eager = tiny_model("llama").float().eval()
    model = copy.deepcopy(eager)
    assert use_varlen_attention(model, "cpu", "flex_attention") == "flex_attention"
    torch._dynamo.reset()        # graphs another test compiled for the same layer class would be reused
    assert compile_layers(model, True, "cpu")
    g = torch.Generator().manual_seed(5)
    lengths = [(int(p), int(r)) for p, r in torch.randint(1, 12, (60, 2), generator=g)]
    samples = random_samples(lengths, seed=6)
    batch = pad_batch(samples, 0, token_keys=())
    graphs, start = [], 0
    for rows in (14, 20, 17, 26, 15):                   # packs of N = 187, 226, 208, 338, 163: 2-3 blocks of 128
        packed = pack_rows(batch["input_ids"], batch["attention_mask"], batch["response_mask"],
                           list(range(start, start + rows)))
        start = (start + rows) % 30
        with torch.no_grad():
            lp, ent = packed_sequence_logprobs(model, packed)
            want_lp, want_ent = packed_sequence_logprobs(eager, packed)
        assert lp.abs().sum() > 1.0
        assert (lp - want_lp).abs().max() < 1e-4 and (ent - want_ent).abs().max() < 1e-4
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] < graphs[1] == graphs[2] == graphs[3] == graphs[4], graphs


def test_compiled_critic_layers_make_the_same_update_as_eager(setup, capsys):
    # critic.compile (the CUDA default for a one-process critic) on CPU: the trunk's layers compiled
    # through the value head's forward; the value pass and one critic update give the eager values,
    # weights and stats. Micro-batches of 4 rows, as in the policy test below: the same layer
    # shapes, so that test reuses these kernels from inductor's cache (a cold compile is ~40 s on
    # 2 cores), and no 1-row remainder, whose specialized graphs cost ~10 s more to compile.
    from torch._dynamo.utils import counters
    from nodes.impl.critic import CriticConfig, advantages_for, critic_update
    from rl.model.causal_lm import ValueModel
    from rl.model.precision import compile_layers

    tok, model, samples = setup
    samples = [dict(s, values=[0.1] * len(s["response_ids"]), returns=[s["score"]] * len(s["response_ids"]))
               for s in samples]
    cfg = CriticConfig(epochs=1, minibatch_size=len(samples), micro_batch_size=4, max_grad_norm=1e9)
    results, values = [], []
    for compile in (False, True):
        vm = ValueModel.from_policy(fresh(model))
        torch._dynamo.reset()   # graphs another test compiled for the same layer class would be reused
        assert compile_layers(vm, compile, "cpu") == compile
        graphs_at_setup = counters["stats"]["unique_graphs"]
        assert all((layer._compiled_call_impl is not None) == compile for layer in vm.backbone.layers)
        items = [{"samples": [dict(s, token_rewards=[0.0] * len(s["response_ids"])) for s in samples]}]
        advantages_for(vm, items, tok.pad_token_id, cfg, "cpu")          # the value pass: no grad
        values.append([v for s in items[0]["samples"] for v in s["values"]])
        stats = critic_update(vm, torch.optim.SGD(vm.parameters(), lr=1.0), samples, tok.pad_token_id, cfg,
                              random.Random(0))
        results.append(({k: v.clone() for k, v in vm.state_dict().items()}, stats))
        # the layers compile on first use, in the value pass and the update; a second update of
        # the same batch runs the graphs already compiled
        graphs_after = counters["stats"]["unique_graphs"]
        assert (graphs_after > graphs_at_setup) == compile
        critic_update(vm, torch.optim.SGD(vm.parameters(), lr=0.0), samples, tok.pad_token_id, cfg, random.Random(0))
        assert counters["stats"]["unique_graphs"] == graphs_after
    assert "torch.compile does not work" not in capsys.readouterr().out
    assert values[1] == pytest.approx(values[0], abs=1e-6)
    (eager, eager_stats), (compiled, compiled_stats) = results
    assert any((eager[k] - dict(ValueModel.from_policy(fresh(model)).state_dict())[k]).abs().max() > 1e-4
               for k in eager)                            # the update moved the weights
    for k in eager:
        assert torch.allclose(eager[k], compiled[k], rtol=0, atol=1e-5), k
    assert compiled_stats["critic/value_loss"] == pytest.approx(eager_stats["critic/value_loss"], rel=1e-5)


def test_compiled_layers_make_the_same_update_as_eager(setup, capsys):
    # rl/model/precision.compile_layers (the CUDA default for the learner and reference) on CPU:
    # every decoder layer compiled, and one update gives the eager update's weights and stats.
    from torch._dynamo.utils import counters
    from rl.model.precision import compile_layers

    tok, model, samples = setup
    cfg = LearnerConfig(minibatch_size=8, ppo_epochs=1, micro_batch_size=4, lr=1e-2)
    samples = with_advantages([dict(s) for s in samples], cfg)
    results = []
    for compile in (False, True):
        m = fresh(model).eval()   # as the learner holds it between updates (prepare_trained)
        torch._dynamo.reset()   # graphs another test compiled for the same layer class would be reused
        assert compile_layers(m, compile, "cpu") == compile
        graphs_at_setup = counters["stats"]["unique_graphs"]
        assert all((layer._compiled_call_impl is not None) == compile for layer in m.model.layers)
        # SGD: the weight change is the gradient (Adam's would turn float noise near 0 into +-lr)
        stats = ppo_update(m, torch.optim.SGD(m.parameters(), lr=1.0), samples, 0.1, tok.pad_token_id, cfg,
                           random.Random(0), stale=True)
        results.append(({k: v.clone() for k, v in m.state_dict().items()}, stats))
        # the layers compile on first use, inside the update (its padded and unpadded
        # micro-batches, with grad and without: proximal log-probs); a second update of the same
        # batch runs the graphs already compiled
        graphs_after = counters["stats"]["unique_graphs"]
        assert (graphs_after > graphs_at_setup) == compile
        ppo_update(m, torch.optim.SGD(m.parameters(), lr=0.0), samples, 0.1, tok.pad_token_id, cfg,
                   random.Random(0), stale=True)
        assert counters["stats"]["unique_graphs"] == graphs_after
    assert "torch.compile does not work" not in capsys.readouterr().out
    (eager, eager_stats), (compiled, compiled_stats) = results
    for k in eager:
        assert torch.allclose(eager[k], compiled[k], rtol=0, atol=1e-5), k
    for k in ("losses/policy", "losses/kl", "entropy", "grad_norm"):
        assert compiled_stats[k] == pytest.approx(eager_stats[k], rel=1e-4, abs=1e-6), k


def test_lora_layers_compile_one_graph_for_every_layer():
    # With LoRA the embeddings are frozen: the first layer's input had no grad and the layers
    # compiled a second graph for it (a recompile on requires_grad) in every shape a run met.
    # rl/model/lora.wrap makes that input require grad in grad mode, so no layer recompiles.
    from rl.model import lora
    from rl.model.precision import compile_layers

    model = tiny_model("llama").float()
    lora.wrap(model, lora.LoraConfig(rank=4), "cpu", "fp32")
    torch._dynamo.reset()
    assert compile_layers(model, True, "cpu")
    ids = torch.randint(1, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(error_on_recompile=True):
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)   # the base stays frozen


def test_the_compile_warm_up_compiles_what_the_first_update_runs_and_changes_nothing(setup, capsys):
    # rl/compile_warm_up: the learner's update on made-up samples, with an optimizer that never
    # steps, compiles the layers' graphs a real update then reuses; weights, optimizer state and
    # gradients are as before it.
    from torch._dynamo.utils import counters
    from rl.update.compile_warm_up import made_up_samples, warm_up_update
    from rl.model.precision import compile_layers

    tok, model, samples = setup
    cfg = LearnerConfig(algorithm="grpo", group_size=2, prompts_per_step=len(samples) // 2, minibatch_size=8,
                        ppo_epochs=1, micro_batch_size=4, max_new_tokens=8)
    cfg.kl.coef = 0.0                     # no reference: the samples carry no ref_logprobs
    samples = [{k: v for k, v in s.items() if k != "ref_logprobs"} for s in samples]
    made_up = made_up_samples(cfg, model.config.vocab_size)
    assert len(made_up) == len(samples) and max(len(s["response_ids"]) for s in made_up) <= 8
    assert "ref_logprobs" not in made_up[0]
    m = fresh(model).eval()
    torch._dynamo.reset()
    assert compile_layers(m, True, "cpu")
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    graphs_at_setup = counters["stats"]["unique_graphs"]
    assert warm_up_update(m, cfg, tok.pad_token_id) > 0
    graphs_warm = counters["stats"]["unique_graphs"]
    assert graphs_warm > graphs_at_setup
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert all(p.grad is None for p in m.parameters()) and not optimizer.state and not m.training
    ppo_update(m, optimizer, samples, 0.0, tok.pad_token_id, cfg, random.Random(0), stale=True)
    assert counters["stats"]["unique_graphs"] == graphs_warm
    assert "torch.compile does not work" not in capsys.readouterr().out
    # a step's short last micro-batch: one group of short samples, as the warm-up's second batch
    short = made_up_samples(cfg, model.config.vocab_size, seed=5, count=cfg.group_size, cap=3)
    assert len(short) == cfg.group_size and max(len(s["response_ids"]) for s in short) <= 3
    ppo_update(m, optimizer, short, 0.0, tok.pad_token_id, cfg, random.Random(0), stale=True)
    assert counters["stats"]["unique_graphs"] == graphs_warm
    # the fields each advantage and a KL coefficient > 0 need
    cfg.kl.coef, cfg.advantage = 0.1, "gae"
    assert {"ref_logprobs", "advantages"} <= set(made_up_samples(cfg, 50)[0])


def test_the_warm_up_task_holds_the_state_lock_and_logs_a_failure(setup):
    # rl/update/compile_warm_up.start_warm_up runs under the node's state lock (a resumed run's weights
    # load after it; the first step waits for it); a failing warm-up is logged and the run goes on.
    import asyncio
    import contextlib
    from types import SimpleNamespace
    from rl.update.compile_warm_up import start_warm_up

    tok, model, _ = setup
    cfg = LearnerConfig(algorithm="grpo", group_size=2, prompts_per_step=2, minibatch_size=4, max_new_tokens=4)
    lines = []

    async def main(pad_id):
        ctx = SimpleNamespace(state_lock=asyncio.Lock(), log=lines.append, span=lambda name: contextlib.nullcontext())
        task = start_warm_up(ctx, fresh(model), cfg, pad_id)
        await asyncio.sleep(0)                    # the task takes the lock first, as in setup
        async with ctx.state_lock:
            assert task.done()                    # load_state / the first step came after it
        await task

    asyncio.run(main(tok.pad_token_id))
    assert len(lines) == 1 and lines[0].startswith("compile warm-up: ")
    asyncio.run(main(10**9))                      # a pad id outside the vocabulary: the passes fail
    assert lines[1].startswith("compile warm-up failed (") and lines[1].endswith("the layers compile in the first step")


def test_compiled_decoder_layers_equal_eager_with_one_graph_for_all_shapes(tok, policy, capsys):
    """compile_layers (the CUDA default) on CPU: teacher-forced logits still equal the HF forward,
    sampled responses equal the eager decoder's, and every layer, batch bucket (6 and 16 rows),
    attention length (64 and 96), prefill and an episode's extend prefill run the graphs compiled
    at setup (the two halves of a layer, for one token and for several): no recompiles."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    dec = decoding.StaticDecoder(policy, 16, 96, eos_id=tok.eos_token_id, max_new_tokens=10,
                                 seed=2, compile_layers=True)
    assert dec.layers_compiled and "failed" not in capsys.readouterr().out
    at_setup = counters["stats"]["unique_graphs"]
    ps = prompts(tok, 6)
    conts = [[(7 * i + j) % len(tok) for j in range(3 + i)] for i in range(len(ps))]
    got = dec.teacher_forced_logits(ps, conts)                   # B = 6, L = 96
    with torch.no_grad():
        for p, c, g in zip(ps, conts, got):
            ref = policy(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:len(p) + len(c) - 1]
            assert (g - ref).abs().max() < 1e-5
    ps = prompts(tok)
    compiled = decoding.decode_responses(policy, tok, ps, 10, decoder=dec)   # B = 16, L = 64
    eager = decoding.decode_responses(policy, tok, ps, 10, seed=2, num_slots=16, compile_layers=False)
    assert [s["response_ids"] for s in compiled] == [s["response_ids"] for s in eager]
    for a, b in zip(compiled, eager):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    # an episode's turns: parked slots extended with environment tokens, compiled as eager; one
    # prompt and one episode's turn alone (a one-row batch runs as two: no graph of its own)
    ps = prompts(tok, 3)
    turns = {}
    for d in (dec, decoding.StaticDecoder(policy, 16, 96, eos_id=tok.eos_token_id, max_new_tokens=10, seed=2,
                                          compile_layers=False)):
        d.add([(p, i, i) for i, p in enumerate(ps[:2])], keep=True)
        d.add([(ps[2], 2, 2)], keep=True)
        ended = []
        while len(ended) < len(ps):
            ended += d.step()
        requests = [(s["slot"], [5 + i, 6, 7], 20, None) for i, (_, s) in enumerate(sorted(ended, key=lambda e: e[0]))]
        d.extend(requests[:2])
        d.extend(requests[2:])
        second = []
        while len(second) < len(ps):
            second += d.step()
        turns[d is dec] = sorted(second, key=lambda e: e[0])
    for (_, a), (_, b) in zip(turns[True], turns[False]):
        assert a["response_ids"] == b["response_ids"] and a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    assert counters["stats"]["unique_graphs"] == at_setup >= 4   # one per half and length kind, no recompile


def test_a_padded_width_equal_to_the_hidden_size_makes_the_compiled_layers_static_in_length(tok):
    # Why the compile warm-up's batches avoid the model's sizes (rl/update/compile_warm_up.model_sizes):
    # under dynamic=True a first length equal to the hidden size is tied to it (duck sizing), the
    # graph is static in the length and the next length compiles again; another first length
    # gives a graph every later length runs.
    from torch._dynamo.utils import counters

    from rl.model.causal_lm import ModelConfig, build_policy
    from rl.model.precision import compile_layers

    def graphs_after(lengths):
        model = build_policy(ModelConfig(n_layer=1, n_embd=72, n_head=2, intermediate_size=64), tok).eval()
        torch._dynamo.reset()
        assert compile_layers(model, True, "cpu")
        counts = []
        for T in lengths:
            with torch.no_grad():
                model(input_ids=torch.ones(3, T, dtype=torch.long), attention_mask=torch.ones(3, T, dtype=torch.long))
            counts.append(counters["stats"]["unique_graphs"])
        return [c - counts[0] for c in counts]

    assert graphs_after([72, 56]) == [0, 1]
    assert graphs_after([56, 48, 72]) == [0, 0, 0]
