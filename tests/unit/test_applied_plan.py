"""rl/model/applied_plan.py: the memory plan applied to graphs/grpo.py on one assumed 140 GiB GPU
for Qwen2.5's published shapes (W1's workload: 32 prompts x 8, 128-token prompts, 256-token
responses), checked against the plan's own arithmetic (rl/model/memory_plan.py), not against
numbers; a user's explicit share and budget are kept; placement=cpu changes nothing; an
out-of-memory error in a node is one line naming the plan and the setting. No GPU here: these
are the computed plans; what a GPU measures is bench/gpu_step.py's (docs/gpus.md)."""

from __future__ import annotations

import json

import pytest
import torch

from dataflow.actor.host import HostSpec, NodeHost
from dataflow.config import flatten
from dataflow.driver.failures import raise_if_failed
from dataflow.driver.loading import describe, load_graph
from dataflow.errors import UserError
from graphs.grpo import GRPOGraphConfig
from rl.model.applied_plan import ALLOCATOR_SLACK, KV_HEADROOM, MULTIPLE, TARGET_TOKENS, WORKSPACE_BYTES, lent_bytes
from rl.model.memory_plan import RESERVE, GiB, ModelShape, generator_need, learner_need, reference_need

# Qwen2.5's published config.json values (huggingface.co/Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}).
QWEN = {"0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
        "1.5b": dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True),
        "3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                   num_key_value_heads=2, intermediate_size=11008, tie_word_embeddings=True),
        "7b": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False)}
W1 = ["placement=colocated", "gpu_memory_gib=140", "max_new_tokens=256", "prompts.max_prompt_tokens=128",
      "prompts_per_step=32", "group_size=8", "learner.minibatch_size=256", "learner.kl.coef=0.01",
      "generator.prompts_per_call=32"]
MAX_LEN = 128 + 256


def policy_dir(tmp_path, size: str) -> str:
    d = tmp_path / size
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 32768, **QWEN[size]}))
    return str(d)


def static_bytes(shape: ModelShape, lora: int) -> dict[str, float]:
    """Each node's bytes that no budget shrinks, with its workspace and allocator slack, written out here
    (weight_transport=auto is cuda_ipc on one colocated GPU: the learner's two push buffers of the bf16
    weights or the float32 adapter, a generator's staging copy)."""
    push = shape.push_bytes(4 if lora else 2, lora)
    learner = learner_need(shape, on_cuda=True, micro_batch_tokens=0, lora_rank=lora).total + 2 * push
    gen = generator_need(shape, dtype_bytes=2, slots=256, max_len=MAX_LEN, lora_rank=lora)
    out = {"learner": learner, "generator": gen.total + gen.parts["kv cache"] * (KV_HEADROOM - 1) + push}
    if not lora:   # LoRA: the learner is its own reference (the base with the adapter off)
        out["reference"] = shape.params() * 2
    return {k: (v + WORKSPACE_BYTES) * (1 + ALLOCATOR_SLACK) for k, v in out.items()}


@pytest.mark.parametrize("size", list(QWEN))
@pytest.mark.parametrize("lora", [0, 32])
def test_the_plan_for_qwen25_shapes_on_one_140_gib_gpu_is_its_arithmetic(tmp_path, size, lora):
    path = policy_dir(tmp_path, size)
    graph, config = load_graph("graphs/grpo.py", W1 + [f"policy.path={path}", f"learner.lora.rank={lora}"])
    plan = graph.memory_plan
    shape = ModelShape.from_dir(path)
    usable = 140 * GiB * (1 - RESERVE)
    fixed = static_bytes(shape, lora)
    if sum(fixed.values()) > usable:     # the static bytes alone overflow: refused, one line, what to do
        assert plan.problem and "\n" not in plan.problem and " needs " in plan.problem
        assert "learner.lora.rank" in plan.problem or "generator" in plan.problem
        assert config.learner.max_tokens_per_micro_batch == 0 and graph.nodes["learner"].gpus == pytest.approx(1 / len(fixed))
        return
    assert plan.problem is None, plan.problem
    budget = config.learner.max_tokens_per_micro_batch
    assert budget % MULTIPLE == 0 and max(2048, MAX_LEN) <= budget <= TARGET_TOKENS
    if not lora:
        assert config.reference.max_tokens_per_micro_batch == budget
    # Applied: the graph's shares are the plan's, each node's need fits its share, and the shares
    # fill the GPU but its reserve.
    for need in plan.needs:
        share = graph.nodes[need.node].gpus
        assert share == plan.shares[need.node] and need.total <= share * plan.gpu_bytes * (1 + 1e-9), need.text()
        assert need.parts["allocator slack"] == pytest.approx(ALLOCATOR_SLACK * (need.total - need.parts["allocator slack"]), abs=1)
    assert sum(plan.shares.values()) == pytest.approx(1 - RESERVE)
    learner = next(n for n in plan.needs if n.node == "learner")
    assert learner.parts["activations"] == shape.activation_bytes(budget, budget, 2, config.learner.gradient_checkpointing)
    # AdamW's step (a float32 temporary per trained parameter) comes after the pass: the larger counts.
    pass_bytes = learner.parts["activations"] + learner.parts["logits gradient"]
    assert learner.parts["optimizer step"] == max(0, learner.parts["grads"] - pass_bytes)
    # Checkpointing is on only when the smallest budget (2048 tokens here) would not fit without it:
    # the learner's need there (and its logits' gradient) beside the generator's and the reference's.
    floor = 2048
    room = usable - fixed["generator"]
    if not lora:
        room -= (reference_need(shape, dtype_bytes=2, micro_batch_tokens=floor).total + WORKSPACE_BYTES) * (1 + ALLOCATOR_SLACK)
    plain = learner_need(shape, on_cuda=True, micro_batch_tokens=floor, logit_rows=floor, lora_rank=lora).total
    plain += floor * shape.vocab * 2 + WORKSPACE_BYTES + 2 * shape.push_bytes(4 if lora else 2, lora)
    assert config.learner.gradient_checkpointing == (plain * (1 + ALLOCATOR_SLACK) > room)


def test_issue_37s_goals_follow_from_the_arithmetic(tmp_path):
    """3B full fine-tuning and 7B with LoRA fit one 140 GiB GPU; 7B full does not (its fp32
    weights, gradients and AdamW state beside the generator's and the reference's weights exceed
    the GPU): refused naming learner.lora.rank."""
    plans = {}
    for size, lora in (("3b", 0), ("7b", 32), ("7b", 0)):
        graph, _ = load_graph("graphs/grpo.py", W1 + [f"policy.path={policy_dir(tmp_path, size)}", f"learner.lora.rank={lora}"])
        plans[size, lora] = graph.memory_plan
    assert plans["3b", 0].problem is None and plans["7b", 32].problem is None
    refusal = plans["7b", 0].problem
    assert refusal.startswith("learner needs") and "learner.lora.rank" in refusal
    assert "optimizer state and weight push buffers alone take" in refusal   # weight_transport=auto: cuda_ipc here
    shape = ModelShape.from_dir(str(tmp_path / "7b"))
    assert sum(static_bytes(shape, 0).values()) > 140 * GiB * (1 - RESERVE)
    assert sum(static_bytes(shape, 32).values()) < 140 * GiB * (1 - RESERVE)


def test_with_auto_decoder_slots_the_budget_leaves_the_generator_half_of_the_room(tmp_path):
    """generator.prompts_per_call=0: the trainers' per-token bytes at the budget take at most half
    of what is left once every node has its static bytes and the generator one group's slots; the
    generator's share holds the slots its decoder then takes (up to 256, the cache within half of
    its room, rl/generation/decoder_slots.py's rule)."""
    path = policy_dir(tmp_path, "1.5b")
    sets = [s for s in W1 if not s.startswith("generator.prompts_per_call")] + [f"policy.path={path}"]
    graph, config = load_graph("graphs/grpo.py", sets)
    plan, shape = graph.memory_plan, ModelShape.from_dir(path)
    assert plan.problem is None, plan.problem
    budget, slack = config.learner.max_tokens_per_micro_batch, 1 + ALLOCATOR_SLACK
    assert budget % MULTIPLE == 0 and budget >= 2048 and not config.learner.gradient_checkpointing
    gen = generator_need(shape, dtype_bytes=2, slots=8, max_len=MAX_LEN)
    room = 140 * GiB * (1 - RESERVE) - slack * (
        gen.total + gen.parts["kv cache"] * (KV_HEADROOM - 1) + shape.params() * 2
        + learner_need(shape, on_cuda=True, micro_batch_tokens=0).total + 3 * WORKSPACE_BYTES
        + 3 * shape.push_bytes(2))   # cuda_ipc: the learner's two push buffers, the generator's staging

    def per_pass(tokens: int) -> float:
        learner = learner_need(shape, on_cuda=True, micro_batch_tokens=tokens, logit_rows=tokens).parts["activations"]
        reference = reference_need(shape, dtype_bytes=2, micro_batch_tokens=tokens).parts["activations"]
        return slack * (learner + tokens * shape.vocab * 2 + reference)

    assert per_pass(budget) <= room / 2 < per_pass(budget + MULTIPLE) or budget == TARGET_TOKENS
    generator = next(n for n in plan.needs if n.node == "generator")
    slots = generator.parts["kv cache"] // (MAX_LEN * shape.kv_bytes_per_token(2))
    assert 8 < slots <= 256 and generator.total <= plan.shares["generator"] * plan.gpu_bytes


def test_a_users_share_and_budget_are_kept_and_named_as_theirs(tmp_path):
    path = policy_dir(tmp_path, "1.5b")
    graph, config = load_graph("graphs/grpo.py", W1 + [f"policy.path={path}", 'gpu_shares={"learner":0.6}',
                                                        "reference.max_tokens_per_micro_batch=4096"])
    plan = graph.memory_plan
    assert plan.problem is None, plan.problem
    assert graph.nodes["learner"].gpus == 0.6 and config.reference.max_tokens_per_micro_batch == 4096
    who = {key: who for key, _, who in plan.settings}
    assert who["gpu_shares.learner"] == "you" and who["reference.max_tokens_per_micro_batch"] == "you"
    assert who["gpu_shares.generator"] == who["learner.max_tokens_per_micro_batch"] == "plan"
    learner = next(n for n in plan.needs if n.node == "learner")
    assert learner.total <= 0.6 * plan.gpu_bytes     # the plan's budget fits the user's share
    text = describe(graph, config)
    assert "gpu_shares.learner = 0.6  (you)" in text and "learner.max_tokens_per_micro_batch = " in text
    summary = plan.summary()      # the line a run prints as it starts
    assert "\n" not in summary and "gpu_shares.learner=0.6 (yours)" in summary
    assert f"learner.max_tokens_per_micro_batch={config.learner.max_tokens_per_micro_batch}," in summary

    # A user's share too small for the learner's state: refused in one line naming the share.
    graph, config = load_graph("graphs/grpo.py", W1 + [f"policy.path={policy_dir(tmp_path, '3b')}",
                                                        'gpu_shares={"learner":0.3}'])
    line = graph.memory_plan.problem
    assert line.startswith("learner needs") and "raise gpu_shares.learner (yours: 0.3)" in line and "\n" not in line
    assert graph.nodes["learner"].gpus == 0.3 and config.learner.max_tokens_per_micro_batch == 0   # not applied


def test_cpu_placement_and_an_unknown_gpu_size_leave_every_setting_as_it_was(tmp_path, monkeypatch):
    path = policy_dir(tmp_path, "0.5b")
    sets = W1 + [f"policy.path={path}"]
    cpu_sets = [s for s in sets if not s.startswith("placement=")]
    graph, config = load_graph("graphs/grpo.py", cpu_sets)
    assert graph.memory_plan is None and config.learner.max_tokens_per_micro_batch == 0
    monkeypatch.setattr(GRPOGraphConfig, "memory_plan", lambda self, g: None)   # the same run without a plan
    _, untouched = load_graph("graphs/grpo.py", cpu_sets)
    assert flatten(config) == flatten(untouched)

    # A GPU placement whose GPU size is only assumed (no GPU on this machine, gpu_memory_gib=0):
    # printed, not applied.
    monkeypatch.undo()
    monkeypatch.setattr("graphs.rlhf.gpu_total_bytes", lambda: 0)
    graph, config = load_graph("graphs/grpo.py", [s for s in sets if not s.startswith("gpu_memory_gib")])
    assert not graph.memory_plan.enforced and graph.nodes["learner"].gpus == pytest.approx(1 / 3)
    assert config.learner.max_tokens_per_micro_batch == 0 and "assumed: set gpu_memory_gib" in describe(graph, config)


def test_an_out_of_memory_error_is_one_line_with_what_the_plan_gave_the_node(tmp_path):
    graph, _ = load_graph("graphs/grpo.py", W1 + [f"policy.path={policy_dir(tmp_path, '3b')}"])
    note = graph.nodes["learner"].memory_note
    assert note.startswith("the memory plan gave it") and "GiB" in note
    host = NodeHost.__new__(NodeHost)     # the host's failure report alone, without an actor
    host.spec = HostSpec(node="learner", replica=0, num_replicas=1, kind=object, config=None, cpus=1, gpus=0.54,
                         max_steps=None, trace=False, run_dir=str(tmp_path), memory_note=note)
    host._last_item = {}
    torch_text = ("CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 139.72 GiB of which "
                  "60.12 GiB is free. Of the allocated memory 70.1 GiB is allocated by PyTorch, and 2.1 GiB is reserved "
                  "by PyTorch but unallocated. 75.45 GiB allowed; see PYTORCH_CUDA_ALLOC_CONF\n\n...")
    try:
        raise torch.OutOfMemoryError(torch_text)
    except torch.OutOfMemoryError as e:
        result = host._failure(e, phase="run")
    with pytest.raises(UserError) as caught:
        raise_if_failed("learner", result)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("node 'learner' (run): out of GPU memory (Tried to allocate 2.32 GiB; "
                                                "75.45 GiB allowed; it held 70.1 GiB (+2.1 GiB reserved, unused))")
    assert note in line and "lower learner.max_tokens_per_micro_batch (now " in line

    host.spec.memory_note = ""            # no plan (a hand-built graph): its share and what to set
    try:
        raise torch.OutOfMemoryError(torch_text)
    except torch.OutOfMemoryError as e:
        result = host._failure(e, phase="setup")
    assert result["user_error"] and result["message"] == (
        "out of GPU memory (Tried to allocate 2.32 GiB; 75.45 GiB allowed; it held 70.1 GiB (+2.1 GiB reserved, unused)); "
        "no memory plan for it (share 0.54 of a "
        "GPU): lower its max_tokens_per_micro_batch (or micro_batch_size) or give it a larger gpu_shares entry")


@pytest.mark.parametrize("size,lora", [("0.5b", 0), ("1.5b", 0), ("3b", 32)])
def test_the_phase_switch_lends_the_learners_step_room_to_the_kv_cache_and_each_phase_fits(tmp_path, size, lora):
    """max_staleness=0 on one 80 GiB GPU: the learner's gradients, activations and step temporaries
    (lent_bytes) are the generator's between steps. Each phase fits the GPU but its reserve: the
    generation phase (the generator up to its cap, every other node without what it lends) and the
    training phase (every node at its share); the budget is at least the fixed shares' and the
    generator may hold more than its share; the two nodes share one lock file, the others none."""
    sync = W1[1:] + ["placement=colocated", "gpu_memory_gib=80", "max_staleness=0", "generator.prompts_per_call=0",
                     f"policy.path={policy_dir(tmp_path, size)}", f"learner.lora.rank={lora}"]
    fixed, _ = load_graph("graphs/grpo.py", sync + ["phase_switch=off"])
    graph, config = load_graph("graphs/grpo.py", sync + ["phase_switch=on"])
    plan = graph.memory_plan
    assert plan.problem is None and ("phase_switch", "on", "plan") in plan.settings and not fixed.memory_plan.caps
    need = {n.node: n for n in plan.needs}
    lent = lent_bytes(need["learner"])
    assert 0 < lent < need["learner"].total
    cap = graph.nodes["generator"].memory_cap
    assert cap == plan.caps["generator"] == pytest.approx(plan.shares["generator"] + lent / plan.gpu_bytes)
    usable = plan.gpu_bytes * (1 - RESERVE)
    training = sum(plan.shares.values()) * plan.gpu_bytes
    generation = cap * plan.gpu_bytes + sum(s for n, s in plan.shares.items() if n != "generator") * plan.gpu_bytes - lent
    assert training <= usable * (1 + 1e-9) and generation <= usable * (1 + 1e-9)
    assert need["generator"].total <= cap * plan.gpu_bytes * (1 + 1e-9)
    budget, fixed_budget = config.learner.max_tokens_per_micro_batch, fixed.nodes["learner"].config.max_tokens_per_micro_batch
    assert budget >= fixed_budget and cap > fixed.nodes["generator"].gpus
    assert graph.nodes["generator"].gpu_turn and graph.nodes["generator"].gpu_turn == graph.nodes["learner"].gpu_turn
    assert not any(s.gpu_turn for n, s in graph.nodes.items() if n not in ("generator", "learner"))
    assert "phase switch:" in plan.text() and "phase_switch=on" in plan.summary()


@pytest.mark.parametrize("staleness", ["max_staleness=1", "max_staleness=0"])
def test_auto_decoder_slots_are_the_ones_the_generators_share_holds_and_the_plan_sets_them(tmp_path, staleness):
    """generator.prompts_per_call=0 with the generator's default prompt room (1024 tokens): at 1.5B
    on 80 GiB the share the plan left the generator held fewer than 256 slots once each slot's
    allocator slack and sampling row count, and the decoder's own rule (the KV cache within half of
    its room) took 256 anyway: out of memory in the generator on an H100 (phase_switch=off,
    bench/results/phase_switch_h100_2026-12-06.md). The plan now sets prompts_per_call to the
    slots its share holds, and the generator's need at them fits the share."""
    sets = [s for s in W1 if not s.startswith(("gpu_memory_gib", "generator.prompts_per_call", "prompts.max_prompt"))]
    graph, config = load_graph("graphs/grpo.py", sets + ["gpu_memory_gib=80", "generator.prompts_per_call=0",
                                                         f"policy.path={policy_dir(tmp_path, '1.5b')}", staleness,
                                                         "phase_switch=off"])
    plan = graph.memory_plan
    assert plan.problem is None, plan.problem
    need = next(n for n in plan.needs if n.node == "generator")
    per_slot = ModelShape.from_dir(policy_dir(tmp_path, "1.5b")).kv_bytes_per_token(2) * (1024 + 256)
    assert ("generator.prompts_per_call", need.parts["kv cache"] // per_slot // 8, "plan") in plan.settings
    assert graph.nodes["generator"].config.prompts_per_call == need.parts["kv cache"] // per_slot // 8 < 32
    assert need.total <= plan.shares["generator"] * plan.gpu_bytes


def test_the_phase_switch_is_off_where_generation_overlaps_training_and_on_where_asked_says_why_not(tmp_path):
    """auto: only synchronous, and only where the fixed shares would not fit without gradient
    checkpointing (the switch costs time where they do: bench/results/phase_switch_h100_2026-12-06.md);
    on: wherever the two share a GPU the plan divides, or a one-line refusal saying why not."""
    base = W1[1:] + ["placement=colocated", "gpu_memory_gib=80", f"policy.path={policy_dir(tmp_path, '0.5b')}"]
    fits, _ = load_graph("graphs/grpo.py", base + ["max_staleness=0"])
    off, _ = load_graph("graphs/grpo.py", base + ["max_staleness=0", "phase_switch=off"])
    assert not fits.memory_plan.caps and fits.memory_plan.settings == off.memory_plan.settings
    big = W1[1:] + ["placement=colocated", "gpu_memory_gib=80", f"policy.path={policy_dir(tmp_path, '7b')}",
                    "learner.lora.rank=32", "max_staleness=0"]
    switched, _ = load_graph("graphs/grpo.py", big)
    fixed = load_graph("graphs/grpo.py", big + ["phase_switch=off"])[0].memory_plan
    assert ("learner.gradient_checkpointing", True, "plan") in fixed.settings or fixed.problem
    assert switched.memory_plan.caps and ("phase_switch", "on", "plan") in switched.memory_plan.settings
    asynchronous, _ = load_graph("graphs/grpo.py", base + ["max_staleness=1"])
    assert not asynchronous.memory_plan.caps and not asynchronous.nodes["generator"].gpu_turn
    forced, _ = load_graph("graphs/grpo.py", base + ["max_staleness=1", "phase_switch=on"])
    assert forced.memory_plan.caps and forced.nodes["learner"].gpu_turn     # on: generation waits for each step
    refused = load_graph("graphs/grpo.py", base + ["phase_switch=on", "generator.backend=hf"])[0].memory_plan
    assert refused.problem.startswith("phase_switch=on needs the static decoder (generator.backend=hf")
    assert "\n" not in refused.problem
    theirs = load_graph("graphs/grpo.py", base + ["max_staleness=0", "phase_switch=on", 'gpu_shares={"learner": 0.5}'])[0]
    assert "needs the generator and the learner on one GPU whose shares the plan sets" in theirs.memory_plan.problem


def test_an_agent_graphs_slots_hold_whole_episodes(tmp_path):
    """graphs/agent.py: a decoder slot holds the prompt and every turn (env.max_episode_tokens), as
    nodes/impl/generator.py sizes it, so the plan's KV cache and the slots it sets count episodes."""
    sets = ["placement=colocated", "gpu_memory_gib=80", "max_new_tokens=64", "prompts_per_step=32", "group_size=8",
            "learner.minibatch_size=256", f"policy.path={policy_dir(tmp_path, '0.5b')}",
            "env.path=tests/agent_toy_env.py", "env.max_episode_tokens=2048"]
    graph, config = load_graph("graphs/agent.py", sets)
    plan = graph.memory_plan
    assert plan.problem is None, plan.problem
    generator = next(n for n in plan.needs if n.node == "generator")
    per_slot = ModelShape.from_dir(policy_dir(tmp_path, "0.5b")).kv_bytes_per_token(2) * (1024 + 2048)
    assert generator.parts["kv cache"] == config.generator.prompts_per_call * 8 * per_slot


def test_the_decoder_slots_fit_the_datas_longest_prompt_training_and_validation(tmp_path):
    """generator.max_prompt_tokens=0 and no environment: the plan sizes a slot for the longest prompt
    the source will send (the training and the validation rows, as the prompt source tokenizes them),
    to a multiple of 64, not the generator's default room (max_position_embeddings less the response,
    within [256, 1024]); the generator gets that value. A user's value is kept."""
    from rl.data.tasks import build_fast_tokenizer
    from rl.model.memory_plan import policy_shape

    train = ["1+2=", "12+34+56=", "7*8="]
    val = ["+".join(str(i) for i in range(1, 40)) + "="]
    for name, texts in (("train", train), ("val", val)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": t, "answer": "3"}) + "\n" for t in texts))
    lengths = [len(ids) for ids in build_fast_tokenizer()(train + val)["input_ids"]]
    assert max(lengths[:3]) <= 64 < lengths[3] <= 128       # the validation row decides: 128, not 64
    base = ["placement=colocated", "gpu_memory_gib=80", "max_new_tokens=256", "policy.model.max_position_embeddings=4096",
            f"prompts.path={tmp_path / 'train.jsonl'}", "generator.prompts_per_call=32"]

    graph, config = load_graph("graphs/grpo.py", base + [f"val.path={tmp_path / 'val.jsonl'}"])
    plan = graph.memory_plan
    assert plan.problem is None and ("generator.max_prompt_tokens", 128, "plan") in plan.settings
    assert config.generator.max_prompt_tokens == 128 and any("longest prompt is" in n for n in plan.notes)
    shape, _ = policy_shape(config)
    kv = next(n for n in plan.needs if n.node == "generator").parts["kv cache"]
    assert kv == generator_need(shape, dtype_bytes=2, slots=256, max_len=128 + 256).parts["kv cache"]
    assert "generator.max_prompt_tokens = 128  (plan)" in describe(graph, config)

    _, config = load_graph("graphs/grpo.py", base)                  # no validation file: the training rows'
    assert config.generator.max_prompt_tokens == 64
    graph, config = load_graph("graphs/grpo.py", base + ["generator.max_prompt_tokens=512"])
    assert config.generator.max_prompt_tokens == 512
    assert not any(k == "generator.max_prompt_tokens" for k, _, who in graph.memory_plan.settings if who == "plan")
    _, config = load_graph("graphs/grpo.py", [s for s in base if not s.startswith(("placement", "gpu_memory"))])
    assert config.generator.max_prompt_tokens == 0                   # on CPU no plan: the generator's own default


def test_a_refusal_with_the_users_fixed_slots_says_how_many_fit_and_those_fit(tmp_path):
    """generator.prompts_per_call set by the user, too many slots for the GPU: the refusal names the
    most prompts per call with which the plan fits, and it does; one more does not (1.5B full
    fine-tuning on 80 GiB with 256 slots of 1280 tokens)."""
    path = policy_dir(tmp_path, "1.5b")
    sets = [s for s in W1 if not s.startswith(("gpu_memory_gib", "prompts.max_prompt_tokens"))] + [
        "gpu_memory_gib=80", "generator.max_prompt_tokens=1024", f"policy.path={path}"]
    problem = load_graph("graphs/grpo.py", sets)[0].memory_plan.problem
    assert problem and "fits (yours: 32), or 0 for the plan's choice" in problem
    fits = int(problem.split("generator.prompts_per_call=")[-1].split(" ")[0])
    assert 0 < fits < 32
    graph, config = load_graph("graphs/grpo.py", [*sets, f"generator.prompts_per_call={fits}"])
    assert graph.memory_plan.problem is None and config.generator.prompts_per_call == fits
    assert load_graph("graphs/grpo.py", [*sets, f"generator.prompts_per_call={fits + 1}"])[0].memory_plan.problem
