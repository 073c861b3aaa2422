"""rl/model/memory_plan.py against torch's own accounting on CPU: parameter counts and the learner's
weights, gradients and AdamW state exactly (full and LoRA); the KV cache as the decoder counts it;
activations within ACTIVATION_TOLERANCE of the tensors autograd saves in a real log-prob pass (fp32,
and bf16 autocast on CPU; CUDA's autocast and kernels are not checked here); the shares and the
one-line refusal."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rl.generation.decoder_slots import kv_bytes_per_slot
from rl.model.memory_plan import (ACTIVATION_TOLERANCE, IPC_ALIGN, GiB, ModelShape, NodeNeed, default_micro_batch_tokens,
                                  generator_need, learner_need, plan_shares)
from rl.model.padded_batch import sequence_logprobs

SHAPES = [dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
          dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1),
          dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8)]


def build(family: str, tied: bool = False, **shape):
    cls, cfg = (LlamaForCausalLM, LlamaConfig) if family == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    torch.manual_seed(0)
    return cls(cfg(vocab_size=100, max_position_embeddings=256, tie_word_embeddings=tied, **shape))


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("qwen2", False)])
def test_parameters_and_kv_cache_are_what_torch_and_the_decoder_count(family, tied):
    model = build(family, tied, **SHAPES[0])
    shape = ModelShape.from_hf_config(model.config.to_dict())
    assert shape.params() == sum(p.numel() for p in model.parameters())
    assert shape.kv_bytes_per_token(4) * 48 == kv_bytes_per_slot(model, 48)


@pytest.mark.parametrize("family,tied,lora_rank", [("llama", True, 0), ("qwen2", False, 0), ("qwen2", False, 4)])
def test_the_push_buffer_is_the_flat_layout_cuda_ipc_allocates(family, tied, lora_rank):
    """ModelShape.push_bytes against dataflow/weights/ipc's own layout of what the learner sends: the
    unique state dict (a tied embedding once) in bf16, or the LoRA adapter's tensors in float32."""
    from dataflow.weights import ipc
    from dataflow.weights.state import unique_state
    from rl.model import lora

    assert IPC_ALIGN == ipc.IPC_ALIGN
    model = build(family, tied, **SHAPES[1])
    shape = ModelShape.from_hf_config(model.config.to_dict())
    targets = ("q_proj", "down_proj")
    if lora_rank:
        lora.wrap(model, lora.LoraConfig(rank=lora_rank, target_modules=list(targets)), "cpu", "fp32")
        sent, dtype_bytes = lora.LoraWeights(model).tensors(), 4
    else:
        sent, dtype_bytes = unique_state(model.state_dict(keep_vars=True))[0], 2
    shapes, _ = ipc.ipc_state_split(sent)
    assert shape.push_bytes(dtype_bytes, lora_rank, targets) == ipc.flat_layout(shapes)[1] * dtype_bytes


def adamw_step_bytes(model) -> dict[str, int]:
    """Bytes torch holds after one AdamW step over the trainable parameters."""
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3)
    ids = torch.randint(0, 100, (2, 8))
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {"weights": nbytes(model.parameters()), "grads": nbytes(p.grad for p in trained),
            "optimizer": nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))}


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_learners_weights_grads_and_adamw_state_are_torchs_exactly(lora_rank):
    from rl.model import lora

    model = build("qwen2", **SHAPES[0])
    shape = ModelShape.from_hf_config(model.config.to_dict())
    if lora_rank:
        lora.wrap(model, lora.LoraConfig(rank=lora_rank, target_modules=["q_proj", "v_proj", "down_proj"]), "cpu", "fp32")
    need = learner_need(shape, on_cuda=False, micro_batch_tokens=16, lora_rank=lora_rank,
                        lora_targets=("q_proj", "v_proj", "down_proj"))
    got = adamw_step_bytes(model)
    assert {k: need.parts[k] for k in got} == got
    assert need.parts["autocast cache"] == 0


def saved_bytes(model, batch: int, length: int, autocast: bool) -> tuple[int, int]:
    """(bytes of the tensors autograd saves in a learner log-prob pass (not the parameters, nor,
    under autocast, their bf16 copies: the plan counts those as the autocast cache), logit rows)."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(0))
    attention, response = torch.ones(batch, length, dtype=torch.long), torch.zeros(batch, length)
    response[:, length // 2:] = 1
    model.train()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        sequence_logprobs(model, ids, attention, response, with_entropy=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_copies = sum(p.numel() * 2 for n, p in model.named_parameters() if n.endswith("proj.weight")) if autocast else 0
    keep = length - length // 2 + 1
    return sum(v for k, v in seen.items() if k not in params) - weight_copies, batch * keep


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("shape_kw", SHAPES)
def test_activations_are_within_tolerance_of_what_autograd_saves(shape_kw, autocast):
    model = build("llama", **shape_kw)
    shape = ModelShape.from_hf_config(model.config.to_dict())
    for batch, length in ((2, 32), (4, 64)):
        measured, rows = saved_bytes(model, batch, length, autocast)
        planned = shape.activation_bytes(batch * length, rows, 2 if autocast else 4)
        assert abs(planned - measured) <= ACTIVATION_TOLERANCE * measured, (planned, measured)


def test_shares_follow_the_needs_and_a_node_that_does_not_fit_is_refused_in_one_line():
    # Qwen2.5-7B's published shape: full fine-tuning cannot share one 141 GiB GPU with a generator;
    # LoRA can, and the plan derives a token budget for the learner's micro-batches from its share.
    qwen7b = ModelShape(vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128,
                        intermediate=18944, qkv_bias=True)
    assert abs(qwen7b.params() - 7.6e9) < 0.1e9
    gpu = 141 * GiB
    gen = generator_need(qwen7b, dtype_bytes=2, slots=256, max_len=384)
    full = learner_need(qwen7b, on_cuda=True, micro_batch_tokens=4096, checkpointing=True)
    plan = plan_shares([gen, full], gpu)
    assert plan.problem is not None and "\n" not in plan.problem
    assert plan.problem.startswith("learner needs") and "optimizer state alone take" in plan.problem
    assert "learner.lora.rank" in plan.problem
    huge = learner_need(qwen7b, on_cuda=True, micro_batch_tokens=4 * 65536, lora_rank=32)
    plan = plan_shares([gen, huge], gpu)    # activations dominate: the token budget is what to lower
    assert plan.problem is not None and "lower learner.max_tokens_per_micro_batch" in plan.problem, plan.problem

    gen = generator_need(qwen7b, dtype_bytes=2, slots=256, max_len=384, lora_rank=32)
    lora = learner_need(qwen7b, on_cuda=True, micro_batch_tokens=4096, lora_rank=32, checkpointing=True)
    plan = plan_shares([gen, lora], gpu)
    assert plan.problem is None, plan.problem
    assert sum(plan.shares.values()) == pytest.approx(0.9)
    assert plan.shares["learner"] / plan.shares["generator"] == pytest.approx(lora.total / gen.total)
    static = lora.total - lora.parts["activations"]
    tokens = default_micro_batch_tokens(qwen7b, plan.shares["learner"] * gpu, static, on_cuda=True, checkpointing=True)
    assert tokens >= 4096 and tokens % 256 == 0
    assert learner_need(qwen7b, on_cuda=True, micro_batch_tokens=tokens, lora_rank=32,
                        checkpointing=True).total <= plan.shares["learner"] * gpu
    assert "memory plan" in plan.text() and "learner" in plan.text()

    pinned = plan_shares([NodeNeed("generator", {"weights": 50 * GiB}), NodeNeed("learner", {"weights": 10 * GiB})],
                         100 * GiB, fixed={"generator": 0.5})
    assert pinned.problem is not None and pinned.problem.startswith("generator needs 50.0 GiB but has 45.0 GiB")


def test_describe_prints_the_plan_and_a_node_over_its_share_is_refused_before_start():
    """graphs/grpo.py on one colocated GPU: --describe shows each node's need and the share the plan
    applied (rl/model/applied_plan.py), the user's micro-batch kept; with a GPU too small for the
    learner's state the input check (run before Ray starts) refuses in one line naming the node
    and what to change; placement=cpu has no plan."""
    from dataflow.driver.loading import describe, load_graph
    from dataflow.driver.preflight import input_problems

    big = ["policy.model.n_layer=8", "policy.model.n_embd=1024", "policy.model.n_head=8",
           "policy.model.intermediate_size=4096", "placement=colocated", "learner.micro_batch_size=8"]
    graph, config = load_graph("graphs/grpo.py", big + ["gpu_memory_gib=80"])
    text = describe(graph, config)
    assert "memory plan (one GPU of 80 GiB" in text and "learner.micro_batch_size = 8  (you)" in text, text
    share = graph.nodes["learner"].gpus
    assert f"learner    share {share:.2f}" in text and "gpu_shares.learner = " in text and share != pytest.approx(1 / 3)
    assert not [line for line in input_problems(graph, config) if line.startswith("memory plan")]

    graph, config = load_graph("graphs/grpo.py", big + ["gpu_memory_gib=3"])
    problems = [line for line in input_problems(graph, config) if line.startswith("memory plan")]
    assert len(problems) == 1 and problems[0].startswith("memory plan: learner needs"), problems
    assert "learner.lora.rank" in problems[0]

    graph, config = load_graph("graphs/grpo.py", ["gpu_memory_gib=1"])
    assert "memory plan" not in describe(graph, config)


def test_tokens_within_is_the_largest_budget_whose_passes_and_optimizer_steps_fit():
    # Each trainer needs the larger of its pass (bytes per token x budget) and its optimizer step:
    # up to the step's bytes a larger pass costs nothing. Checked against a scan of every budget.
    from rl.model.memory_plan import tokens_within

    cases = [({"learner": (1, 3.0, 5000.0), "reference": (1, 1.0, 0.0)}, 9000.0),    # the step holds below 1666 tokens
             ({"learner": (1, 3.0, 0.0), "critic": (2, 2.0, 900.0)}, 4000.0),
             ({"learner": (1, 3.0, 5000.0)}, 4000.0)]                                 # the step alone does not fit

    def scan(trainers, room, cap):
        fits = [b for b in range(cap + 1) if sum(k * max(p * b, s) for k, p, s in trainers.values()) <= room]
        return max(fits) if fits else -1

    for trainers, room in cases:
        assert tokens_within(room, trainers, 5000) == scan(trainers, room, 5000)
    assert tokens_within(9000.0, cases[0][0], 5000) == 2250          # max(3b, 5000) + b <= 9000: 4b above 1666
    assert tokens_within(1e9, cases[1][0], 700) == 700                # at most the cap
