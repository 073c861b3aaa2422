"""LoRA (rl/model/lora.py, dataflow/weights/lora.py) on CPU: the LoRA model against the dense model with
W0 + (alpha/r) B A merged (float64), the reference as the base with the adapter disabled, the
adapter-only push on each transport leaving the generator with the learner's merged weights at every
version, then GRPO runs through the CLI and the runtime: final dirs that load with peft and
transformers, an exact resume from a LoRA checkpoint."""

from __future__ import annotations

import asyncio
import copy
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from dataflow.weights import ipc as weight_ipc  # noqa: E402
from dataflow.weights.lora import merged_weight  # noqa: E402
from dataflow.weights.sync import GeneratorWeightSync, LearnerWeightSync, WeightSyncConfig, weights_checksum  # noqa: E402
from nodes.impl.reference import add_logprobs  # noqa: E402
from rl.model import lora  # noqa: E402
from rl.model.lora import LoraConfig  # noqa: E402
from rl.generation.hf_sampling import sample_responses  # noqa: E402
from rl.data.tasks import build_tokenizer, make_task  # noqa: E402
from tests.integration.test_weight_sync import Edges, StandInContext, tiny_policy  # noqa: E402

peft = pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[test]' installs it)")

ROOT = Path(__file__).resolve().parents[2]


def lora_policy(seed: int = 0, rank: int = 4, alpha: float = 8.0, dtype=torch.float32, random_b: bool = True):
    """(peft model, plain HF model with LoRA layers inside, a deep copy of the base before wrapping),
    with B drawn at random if `random_b` (peft starts B at 0, where the adapter changes nothing)."""
    model = tiny_policy(seed).to(dtype)
    base = copy.deepcopy(model)
    wrapped = lora.wrap(model, LoraConfig(rank=rank, alpha=alpha), "cpu", "fp32")
    torch.manual_seed(seed + 100)
    with torch.no_grad():
        if not random_b:
            return wrapped, model, base
        for layer in lora.adapted_layers(model).values():
            layer.lora_B["default"].weight.normal_(0, 0.1)
    return wrapped, model, base


def test_lora_forward_and_backward_equal_the_dense_model_with_the_adapter_merged_in_float64():
    """Logits and the gradients of A and B through peft's LoRA layers equal those of the plain model
    whose weights are W0 + (alpha / r) B A (the LoRA paper's definition, Hu et al. 2021, eq. 3; peft's
    LoraLayer.get_delta_weight, scaling = lora_alpha / r), in float64."""
    wrapped, model, base = lora_policy(dtype=torch.float64)
    ids = torch.randint(0, base.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    layers = lora.adapted_layers(model)
    assert {n.split(".")[-1] for n in layers} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}      # all-linear: lm_head left out
    assert [n for n, p in model.named_parameters() if p.requires_grad] and all(
        ".lora_" in n for n, p in model.named_parameters() if p.requires_grad)

    logits = model(input_ids=ids).logits
    logits.pow(2).mean().backward()

    # The dense reference: the same weights, W0 + s B A for each adapted layer, A and B leaves.
    leaves = {n: (l.lora_A["default"].weight.detach().clone().requires_grad_(),
                  l.lora_B["default"].weight.detach().clone().requires_grad_(), l.scaling["default"])
              for n, l in layers.items()}
    assert all(s == 8.0 / 4 for _, _, s in leaves.values())
    weights = {n: p.detach() for n, p in base.named_parameters()}
    for n, (a, b, s) in leaves.items():
        weights[f"{n}.weight"] = weights[f"{n}.weight"] + s * (b @ a)
    dense = torch.func.functional_call(base, weights, args=(), kwargs={"input_ids": ids}).logits
    dense.pow(2).mean().backward()

    assert torch.allclose(logits, dense, rtol=0, atol=1e-12), (logits - dense).abs().max()
    for n, (a, b, _) in leaves.items():
        assert torch.allclose(layers[n].lora_A["default"].weight.grad, a.grad, rtol=0, atol=1e-12), n
        assert torch.allclose(layers[n].lora_B["default"].weight.grad, b.grad, rtol=0, atol=1e-12), n
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)   # the base is frozen


def test_the_reference_is_the_base_with_the_adapter_disabled():
    """The learner's own reference log-probs (disable_adapter) are exactly the base model's, and differ
    from the adapted policy's."""
    wrapped, model, base = lora_policy()
    tok, task = build_tokenizer(), make_task("copy", 3)
    ids = [tok(p["prompt"])["input_ids"] for p in task.take(4)]
    samples = sample_responses(base, tok, ids, task.max_new_tokens, seed=0)
    items = [{"samples": [dict(s) for s in samples]}]
    add_logprobs(base, tok.pad_token_id, items, "base")
    with wrapped.disable_adapter():
        add_logprobs(model, tok.pad_token_id, items, "ref")
    add_logprobs(model, tok.pad_token_id, items, "policy")
    for s in items[0]["samples"]:
        assert s["ref"] == s["base"]
    assert any(s["policy"] != s["base"] for s in items[0]["samples"])


# ---- the adapter-only push, each transport -----------------------------------------------------
def stand_in_cuda_ipc(monkeypatch):
    """cuda_ipc's CUDA parts on CPU, as tests/integration/test_weight_sync.py's cuda_ipc test stands them in."""
    shared: dict[int, torch.Tensor] = {}

    def rebuild(storage_handle, storage_offset_bytes, tensor_offset, tensor_size, storage_device):
        return shared[storage_handle]

    def share(t):
        shared[id(t)] = t
        return rebuild, (id(t), 0, 0, tuple(t.shape), "learner's device")

    for name, value in (("require_cuda", lambda device, who: None), ("device_index", lambda: 0),
                        ("ipc_device", lambda index: torch.device("cpu")), ("share", share),
                        ("gpu_uuid", lambda index: "GPU-0")):
        monkeypatch.setattr(weight_ipc, name, value)


@pytest.mark.parametrize("transport", ["object_store", "collective", "cuda_ipc"])
def test_an_adapter_only_push_leaves_the_generator_with_the_learners_merged_weights(monkeypatch, transport):
    """Versions 0-3, the adapter changed between them: after each switch the generator's weights are
    the learner's merged ones (the checksums both log are equal, and every tensor is), only adapter
    tensors travel, and setting the adapter to zero gives back the pristine base exactly (each version
    is merged into the kept base copy, not into the previous version)."""
    if transport == "cuda_ipc":
        stand_in_cuda_ipc(monkeypatch)

    async def scenario():
        edges = Edges()
        cfg = WeightSyncConfig(transport=transport, dtype="float32", checksums=True, timeout_s=5,
                               rendezvous_timeout_s=30)
        lctx = StandInContext(edges, "learner", subscribers=("generator",))
        gctx = StandInContext(edges, "generator")
        learner, gen = LearnerWeightSync(lctx, cfg), GeneratorWeightSync(gctx, cfg)
        wrapped, model, base = lora_policy(random_b=False)    # v0: B = 0, the shared seed's weights
        generator_model = tiny_policy(0)
        weights = lora.LoraWeights(model)
        await asyncio.gather(learner.setup(model, adapter=weights), gen.setup(generator_model))
        if transport == "object_store":
            learner.dtype = torch.float32      # the graph fills it in (learner.weight_sync.dtype)

        async def serve():
            async with gen.serving() as version:
                return version, weights_checksum(gen.model)

        sent = []
        for version in range(4):
            if version:
                with torch.no_grad():
                    for p in model.parameters():
                        if p.requires_grad:
                            p.add_(torch.randn_like(p) * 0.05)
            await learner.publish(model, version)
            if transport == "object_store":
                _, payload = await lctx.latest("policy")
                sent.append(payload)
            got = await serve()
            assert got == (version, lctx.logged[-1]["weights/checksum"]), (version, got, lctx.logged[-1])
            merged = weights.merged(torch.float32)
            for name, p in generator_model.named_parameters():
                assert torch.equal(p, merged[name]), (version, name)
        assert [e["weights/version"] for e in lctx.logged] == [0, 1, 2, 3]
        assert len({e["weights/checksum"] for e in lctx.logged}) == 4
        if transport == "object_store":     # only the adapter travels
            from dataflow.weights.sync import decode_state
            state = decode_state(sent[-1])
            assert set(state) == set(weights.tensors()) and all(k.endswith((".lora_A", ".lora_B")) for k in state)
            adapter_bytes = sum(t.numel() * t.element_size() for t in state.values())
            model_bytes = sum(t.numel() * t.element_size() for t in generator_model.state_dict().values())
            assert adapter_bytes < model_bytes / 2

        with torch.no_grad():              # a zero adapter: the base again, bit for bit
            for layer in lora.adapted_layers(model).values():
                layer.lora_B["default"].weight.zero_()
        await learner.publish(model, 4)
        await serve()
        for (name, p), (name0, p0) in zip(generator_model.named_parameters(), base.named_parameters()):
            assert name == name0 and torch.equal(p, p0), name

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_merged_weight_is_float32_math_cast_to_the_base_dtype():
    """A bfloat16 generator's merge: W0 (bf16) + B_s A in float32, rounded once."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 5, generator=g).to(torch.bfloat16)
    a, b = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    want = (w0.double() + b.double() @ a.double()).to(torch.bfloat16)
    got = merged_weight(w0, a, b)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


# ---- GRPO with LoRA through the CLI: checksums, final dirs, the checkpoint, an exact resume ----
def cli(*args: str) -> int:
    """`python -m dataflow.run graphs/grpo.py ARGS` through dataflow.run.main in this process (the
    same code and exit status, without the interpreter's start and imports; tests/unit/test_graph.py).
    With the module's Ray up (the ray_instance fixture) it runs there, as with --address: the CLI's
    own Ray start is tests/integration/test_runtime.py's."""
    from dataflow import run

    return run.main([str(ROOT / "graphs/grpo.py"), *args])


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def learner_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from dataflow.actor import checkpoint
    from tests.integration.test_checkpoint import node_tensors

    assert checkpoint.read_manifest(ckpt)["step"] == int(ckpt.name.removeprefix("step_"))
    return node_tensors(ckpt / "learner")


def test_grpo_with_lora_through_the_cli_trains_pushes_adapters_saves_both_dirs_and_resumes_exactly(ray_instance, tmp_path):
    """4 synchronous GRPO steps with learner.lora.rank=8 and a KL term on the tiny chat model: no
    reference node runs (the learner's base is the reference), every version the generator switched
    to has the learner's checksum of the merged weights, the checkpoints hold only the adapter (and
    its optimizer state), <run>/final loads with transformers and equals the base with
    <run>/final_adapter loaded by peft; a run resumed from the step-2 checkpoint reaches the same
    step-4 state (within rounding) as the straight run."""
    from transformers import AutoModelForCausalLM

    from tests.chat_model import make_chat_model_dir
    from tests.integration.test_checkpoint import RESUME_TOL, max_difference

    model_dir = tmp_path / "model"
    make_chat_model_dir(model_dir, always_emit=None)
    settings = [f"policy.path={model_dir}", "max_new_tokens=4", "prompts_per_step=4", "group_size=2",
                "channel_capacity=8", "learner.minibatch_size=4", "learner.lr=0.02", "learner.lora.rank=8",
                "learner.kl.coef=0.05", "max_staleness=0", "weight_checksums=true", "save_interval=2"]
    args = [a for s in settings for a in ("--set", s)]
    straight = tmp_path / "straight"
    assert cli(*args, "--max-steps", "4", "--out", str(straight)) == 0
    config = json.loads((straight / "config.json").read_text())
    assert config["learner.own_reference"] is True and config["learner.lora.rank"] == 8
    ckpt = straight / "checkpoints" / "step_2"
    assert {p.name for p in ckpt.iterdir()} == {"manifest.json", "prompts", "generator", "reward", "learner"}
    steps = [x for x in records(straight) if "step" in x]
    assert [x["step"] for x in steps] == [1, 2, 3, 4] and all(x["kl"] >= 0 for x in steps)
    assert any(x["kl"] > 0 for x in steps), "the adapter should move the policy away from the reference"
    sums: dict[str, dict[int, float]] = {}
    for x in records(straight):
        if "weights/checksum" in x:
            sums.setdefault(x["node"], {})[x["weights/version"]] = x["weights/checksum"]
    learner = sums.pop("learner")
    assert sorted(learner) == [0, 1, 2, 3] and len(set(learner.values())) == 4
    assert sums and all(got and all(learner[v] == c for v, c in got.items()) for got in sums.values()), sums

    state = learner_tensors(straight / "checkpoints" / "step_4")
    model_keys = [k for k in state if k.startswith("/model/")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys
    assert len([k for k in state if k.startswith("/optimizer/")]) == 2 * len(model_keys) + len(model_keys)
    # every push (version 0 at the start, then after steps 1-3) carried the fp32 adapter alone
    pushes = [x for x in records(straight) if "weights/push_s" in x]
    assert [x["weights/pushed_version"] for x in pushes] == [0, 1, 2, 3]
    adapter_bytes = sum(state[k].numel() * 4 for k in model_keys)
    assert all(x["weights/push_adapter"] and x["weights/push_mib"] * 2**20 == adapter_bytes for x in pushes), pushes

    merged = AutoModelForCausalLM.from_pretrained(straight / "final").eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), straight / "final_adapter")
    ids = torch.tensor([[1, 5, 8, 12, 20, 3]])
    with torch.no_grad():
        want, got, before = adapted.eval()(ids).logits, merged(ids).logits, base(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert (got - before).abs().max() > 1e-3, "the merged model should differ from the base"

    resumed = tmp_path / "resumed"
    assert cli(*args, "--max-steps", "4", "--out", str(resumed), "--resume", str(ckpt)) == 0
    again = [x for x in records(resumed) if "step" in x]
    assert [x["step"] for x in again] == [1, 2, 3, 4]
    for a, b in zip(again[2:], steps[2:], strict=True):
        assert (a["reward/mean"], a["version"]) == (b["reward/mean"], b["version"])
    diff = max_difference(learner_tensors(resumed / "checkpoints" / "step_4"), state)
    trained = max_difference({k: v for k, v in learner_tensors(ckpt).items() if k.startswith("/model/")},
                             {k: v for k, v in state.items() if k.startswith("/model/")})
    print(f"resume vs straight: learner state {diff:.3g}; steps 3-4 moved the adapter by {trained:.3g}")
    assert diff <= RESUME_TOL and trained > 100 * RESUME_TOL
