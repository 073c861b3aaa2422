"""generator.backend and the vLLM backend's CPU-testable parts (rl/generation/vllm_engine.py).

Always run: the backend choice (real code, this machine's real vllm status), the one-line error for
backend=vllm where vllm is not installed (preflight, before Ray), and the weight names handed to
vLLM's load_weights (against the checkpoint names save_pretrained writes, which is what vLLM loads
from disk). Run only where vllm imports (CI does not install it; the GPU machine runs the engine
itself in bench/vllm_check.py): the SamplingParams mapping, and log-probs taken from vLLM's own
output classes, made by vLLM's own OutputProcessor from the sampler's per-step output. On a CPU
machine, vllm 0.26.0 installs beside torch 2.13 for these with no dependencies resolved:

    pip download vllm==0.26.0 --no-deps -d /tmp/w && pip install --no-deps --target /tmp/vllm_site \\
      /tmp/w/vllm-0.26.0-*.whl msgspec cbor2 pyzmq aiohttp multidict yarl propcache aiohappyeyeballs \\
      aiosignal frozenlist openai openai_harmony cloudpickle pybase64 cachetools py-cpuinfo \\
      prometheus_client einops
    PYTHONPATH=/tmp/vllm_site:$PWD python -m pytest tests/integration/test_vllm_backend.py
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time

import pytest
import torch

from dataflow.errors import UserError
from rl.generation.decoding import unsupported_reason
from rl.generation.decoder_slots import auto_kv_cache_bytes, auto_memory_utilization
from rl.generation.vllm_engine import INSTALL, choose_backend, engine_weights, missing_vllm, vllm_installed


def _vllm_importable() -> str | None:
    """Why vLLM's output-side classes do not import here (None: they do)."""
    if not vllm_installed():
        return f"vllm is not installed ({INSTALL}; CI does not install it)"
    try:
        for name in ("vllm.sampling_params", "vllm.outputs", "vllm.logprobs", "vllm.v1.engine.output_processor"):
            importlib.import_module(name)
    except Exception as e:   # installed but broken here (e.g. a missing dependency)
        return f"vllm is installed but does not import here: {type(e).__name__}: {e}"
    return None


_WHY_NOT = _vllm_importable()
needs_vllm = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def tiny(family: str):
    """A real, tiny random-init transformers model of `family` (tied embeddings)."""
    import transformers

    names = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
             "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    config = getattr(transformers, names[0])(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    return getattr(transformers, names[1])(config)


# ---- the backend choice ----------------------------------------------------------------------------
def test_auto_picks_static_for_the_models_it_covers_on_any_device():
    for device in ("cpu", "cuda"):
        assert choose_backend("auto", unsupported_reason(tiny("qwen2")), device)[0] == "static"


def test_auto_for_other_models_vllm_on_cuda_when_installed_else_hf():
    reason = unsupported_reason(tiny("mistral"))
    assert reason and "mistral" in reason
    backend, why = choose_backend("auto", reason, "cpu")
    assert backend == "hf" and "needs CUDA" in why
    backend, why = choose_backend("auto", reason, "cuda")       # this machine's real vllm status
    if vllm_installed():
        assert backend == "vllm"
    else:
        assert backend == "hf" and "not installed" in why and "pip install -e '.[vllm]'" in why


def test_explicit_backends():
    assert choose_backend("hf", None, "cpu")[0] == "hf"
    assert choose_backend("static", None, "cpu")[0] == "static"
    with pytest.raises(UserError, match="static decoder cannot run this model.*model_type 'mistral'"):
        choose_backend("static", unsupported_reason(tiny("mistral")), "cuda")
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        choose_backend("vllm", None, "cpu", vllm_ok=True)


@pytest.mark.skipif(vllm_installed(), reason="vllm is installed here: the missing-vllm error cannot occur")
def test_vllm_backend_without_vllm_is_one_line_naming_the_install():
    with pytest.raises(UserError) as e:
        choose_backend("vllm", None, "cuda")
    assert str(e.value) == missing_vllm()
    assert "\n" not in str(e.value) and "pip install -e '.[vllm]'" in str(e.value) and "vllm==0.26.0" in str(e.value)


@pytest.mark.skipif(vllm_installed(), reason="vllm is installed here: the missing-vllm error cannot occur")
def test_cli_refuses_backend_vllm_before_ray_starts():
    proc = subprocess.run([sys.executable, "-m", "dataflow.run", "graphs/grpo.py", "--set", "generator.backend=vllm",
                           "--max-steps", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = proc.stderr.splitlines() + proc.stdout.splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert [line for line in lines if line.startswith("error:")] == [f"error: generator.{missing_vllm('backend=vllm')}"]
    assert not any("running:" in line for line in lines), "the graph started"


def test_importing_the_project_never_imports_vllm():
    code = ("import sys, nodes.generator, graphs.grpo, rl.generation.vllm_engine, rl.preflight; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_auto_memory_utilization_leaves_room_for_the_received_copy():
    gib = 2**30
    assert auto_memory_utilization(1.0, 0, 100 * gib) == 0.9
    assert auto_memory_utilization(0.25, 1 * gib, 100 * gib) == pytest.approx(0.215)
    assert auto_memory_utilization(0.05, 10 * gib, 100 * gib) == 0.05        # never below 5%


def test_auto_kv_cache_is_twice_the_slots_in_whole_blocks_within_half_the_room():
    """gpu_memory_utilization auto sizes vLLM's KV cache from the slots (no free-memory profile,
    which fails while colocated nodes allocate): 2 x layers x kv_heads x head_dim x bytes per token."""
    import transformers

    cfg = transformers.Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, intermediate_size=4864)
    per_token = 2 * 24 * 2 * 64 * 2                       # bf16, head_dim 896 / 14
    sequence = 400 * per_token                            # 390 tokens: 25 blocks of 16
    need = 256 * sequence
    kv = lambda room, tp=1: auto_kv_cache_bytes(cfg, num_slots=256, max_len=390, dtype_bytes=2,  # noqa: E731
                                                room_bytes=room, tensor_parallel=tp)
    assert kv(100 * 2**30) == 2 * need                    # room: twice the need, for the prefix cache
    assert kv(3 * need) == 3 * need // 2                  # else half of the room
    assert kv(need) == need // 2                          # below the need: vLLM queues what does not fit
    assert kv(100 * 2**30, tp=2) == need                  # per GPU: the KV heads split over tensor parallel
    with pytest.raises(UserError, match="less than one 390-token sequence.*gpu_shares"):
        kv(sequence)                                      # half a sequence: no request could run


# ---- the weights handed to vLLM's load_weights ---------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral"])
def test_engine_weights_are_the_checkpoint_names_and_tensors(family, tmp_path):
    """vLLM's load_weights reads HF checkpoint names (it fuses q/k/v, gate/up itself and skips a
    tied lm_head): what we hand it must be exactly what save_pretrained writes to disk."""
    from safetensors.torch import load_file

    model = tiny(family)
    model.save_pretrained(str(tmp_path))
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    ours = dict(engine_weights(model))
    assert sorted(ours) == sorted(on_disk) and "lm_head.weight" not in ours
    for name, tensor in ours.items():
        assert torch.equal(tensor, on_disk[name]), name


# ---- vLLM's own classes (where vllm imports) ----------------------------------------------------------
@needs_vllm
def test_sampling_params_mapping():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from rl.generation.vllm_sampling import sampling_params

    p = sampling_params(temperature=0.7, top_k=5, max_new_tokens=32, min_new_tokens=4, stop_ids=[2, 7], seed=123)
    assert isinstance(p, SamplingParams)
    assert (p.n, p.temperature, p.top_k, p.top_p, p.max_tokens, p.min_tokens) == (1, 0.7, 5, 1.0, 32, 4)
    assert p.stop_token_ids == [2, 7] and p.stop == [] and not p.ignore_eos and p.seed == 123
    assert p.logprobs == 0 and p.flat_logprobs and p.output_kind == RequestOutputKind.FINAL_ONLY
    assert not p.detokenize and not p.skip_special_tokens      # no text needed without stop strings
    assert sampling_params(temperature=1.0, top_k=0, max_new_tokens=8, min_new_tokens=99,
                           stop_ids=[2]).min_tokens == 8          # clipped to max, as the static decoder
    s = sampling_params(temperature=1.0, top_k=0, max_new_tokens=8, min_new_tokens=0, stop_ids=[2],
                        stop_strings=["</answer>"], n=8, logprobs=False)
    assert s.stop == ["</answer>"] and s.detokenize and s.include_stop_str_in_output and s.n == 8
    assert s.logprobs is None and s.top_k == 0                     # 0 = the whole vocabulary in both
    greedy = sampling_params(temperature=0.0, top_k=5, max_new_tokens=8, min_new_tokens=0, stop_ids=[2])
    assert greedy.temperature == 0.0 and greedy.top_k == 0          # vLLM's greedy normalisation


def _engine_outputs(params, prompt, tokens, logprobs, finish_at):
    """Feed vLLM's OutputProcessor (what LLMEngine.step runs) the per-step outputs its engine core
    sends for one request (a sampled token, its log-prob and rank from the sampler): the
    RequestOutputs it returns after each step."""
    import numpy as np
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.outputs import LogprobsLists

    processor = OutputProcessor(None, log_stats=False)
    processor.add_request(EngineCoreRequest(
        request_id="r0", prompt_token_ids=list(prompt), mm_features=None, sampling_params=params,
        pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
        data_parallel_rank=None, external_req_id="r0"), None)
    steps = []
    for i, (token, lp) in enumerate(zip(tokens, logprobs)):
        out = EngineCoreOutput(
            request_id="r0", new_token_ids=[token],
            new_logprobs=LogprobsLists(np.array([[token]]), np.array([[lp]], dtype=np.float32), np.array([1])),
            finish_reason=(FinishReason.STOP if finish_at == "stop" else FinishReason.LENGTH)
            if i == len(tokens) - 1 else None)
        steps.append(processor.process_outputs([out]).request_outputs)
    return steps


@needs_vllm
@pytest.mark.parametrize("flat", [True, False])
def test_logprobs_from_vllms_output_classes(flat):
    from vllm.logprobs import FlatLogprobs
    from vllm.outputs import CompletionOutput, RequestOutput

    from rl.generation.vllm_sampling import sampling_params, to_sample

    params = sampling_params(temperature=0.7, top_k=0, max_new_tokens=3, min_new_tokens=0, stop_ids=[2], seed=5)
    params.flat_logprobs = flat
    tokens, lps = [9, 11, 2], [-0.25, -1.5, -0.125]
    steps = _engine_outputs(params, [5, 6, 7], tokens, lps, "stop")
    assert steps[0] == [] and steps[1] == []             # FINAL_ONLY: one output, when it finished
    (ro,) = steps[2]
    assert isinstance(ro, RequestOutput) and ro.finished and isinstance(ro.outputs[0], CompletionOutput)
    assert isinstance(ro.outputs[0].logprobs, FlatLogprobs) == flat
    sample = to_sample(ro.prompt_token_ids, ro.outputs[0], stop_ids=[2, 4])
    assert sample == {"prompt_ids": [5, 6, 7], "response_ids": tokens, "logprobs": lps, "finished": True}

    steps = _engine_outputs(params, [5], [9, 11, 3], lps, "length")     # cut at max tokens
    assert to_sample([5], steps[-1][0].outputs[0], stop_ids=[2])["finished"] is False


@needs_vllm
def test_logprobs_missing_or_misaligned_are_errors():
    from vllm.logprobs import create_sample_logprobs, append_logprobs_for_next_position

    from rl.generation.vllm_sampling import token_logprobs

    with pytest.raises(ValueError, match="no log-probs"):
        token_logprobs([1, 2], None)
    lp = create_sample_logprobs(False)
    append_logprobs_for_next_position(lp, [7], [-0.5], [None], 1, 0)
    with pytest.raises(ValueError, match="1 positions, 2 tokens"):
        token_logprobs([7, 8], lp)
    with pytest.raises(ValueError, match="do not include the sampled token 8"):
        token_logprobs([8], lp)


# ---- multi-turn episodes on a real engine (GPU only) -------------------------------------------------
needs_vllm_gpu = pytest.mark.skipif(_WHY_NOT is not None or not torch.cuda.is_available(),
                                    reason=str(_WHY_NOT or "vLLM's engine needs CUDA (none here)"))


@needs_vllm_gpu
def test_vllm_episode_turns_resend_the_history_hit_the_prefix_cache_and_match_the_model(tmp_path):
    """rl/generation/vllm_episodes.VllmEpisodeDecoder on a real engine: a 3-turn episode with 5
    environment tokens between turns. Each turn's request is the whole history (prompt, earlier
    turns, appended ids); the later turns find the history's blocks in vLLM's prefix cache; each
    turn's behaviour log-probs match the model's on that history (bf16 engine); the slot is parked
    between turns and free after release(); the same key samples the same turns again."""
    import transformers

    from rl.generation.vllm_episodes import VllmEpisodeDecoder

    config = transformers.Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path)
    model = model.cuda().eval()
    dec = VllmEpisodeDecoder(str(tmp_path), model, num_slots=4, max_len=256, stop_ids=[63], max_new_tokens=8,
                             min_new_tokens=8, temperature=1.0, seed=0, gpu_memory_utilization=0.2,
                             version=lambda: 0, loaded=0, log=lambda text: None)

    def episode(key: int) -> list[dict]:
        prompt = list(range(1, 40))          # over two of vLLM's 16-token blocks
        history, turns = list(prompt), []
        dec.refresh()
        dec.set_version(0)
        dec.add([(prompt, "episode", key, None, 8)], keep=True)
        for turn in range(3):
            out = []
            while not out:
                out = dec.step()
            [(tag, sample)] = out
            assert tag == "episode" and sample["prompt_ids"] == history and len(sample["response_ids"]) == 8
            assert sample["slot"] in dec.parked and sample["token_versions"] == [0] * 8 and dec.decoding == 0
            history += sample["response_ids"]
            turns.append(sample)
            if turn < 2:
                dec.extend([(sample["slot"], [5, 6, 7, 8, 9], len(history) + 5 - len(prompt), 8)])
                history += [5, 6, 7, 8, 9]
        dec.release(turns[-1]["slot"])
        assert dec.active == 0 and not dec.parked
        return turns

    turns = episode(key=7)
    assert dec.cached_tokens >= 32, (dec.cached_tokens, dec.prompt_tokens)   # turns 2-3 reused the history
    with torch.no_grad():
        for s in turns:
            ids = torch.tensor([s["prompt_ids"] + s["response_ids"]], device="cuda")
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            P = len(s["prompt_ids"])
            want = logp[P - 1:, :].gather(1, ids[0, P:, None])[:, 0]
            got = torch.tensor(s["logprobs"], device="cuda")
            assert (got - want).abs().max() < 0.1 and (got - want).abs().mean() < 0.02, (got, want)
    again = episode(key=7)
    assert [s["response_ids"] for s in again] == [s["response_ids"] for s in turns]
    dec.close()


def _members(cls) -> set[str]:
    """cls's attributes: its class members and every `self.X = ...` in its and its bases' methods."""
    import ast
    import inspect

    names = set(dir(cls))
    for klass in cls.__mro__[:-1]:
        for node in ast.walk(ast.parse(inspect.getsource(klass))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def test_the_vllm_decoders_have_every_decoder_member_the_generator_uses():
    """The generator drives a StaticDecoder, a VllmDecoder or a VllmEpisodeDecoder through the same
    names (nodes/impl/generator.py's `dec.`, rl/generation/episodes.py's `self.dec.`); only the GPU runs the
    vLLM ones, so a name the static decoder gained and the vLLM ones lack (cache_freed, decoding, add's
    keep) stopped every vLLM graph run there. Checked here, on CPU, from the source."""
    import inspect
    import re

    from rl.generation.decoding import StaticDecoder
    from rl.generation.vllm_engine import VllmDecoder
    from rl.generation.vllm_episodes import VllmEpisodeDecoder

    used = set()
    for path, pattern in (("nodes/impl/generator.py", r"\bdec\.(\w+)"),
                          ("rl/generation/episodes.py", r"self\.dec\.(\w+)")):
        used |= set(re.findall(pattern, (ROOT / path).read_text()))
    assert {"add", "step", "decoding", "cache_freed", "extend", "version"} <= used, used
    episodes_only = {"extend", "release", "set_version", "version", "token_versions"}   # episodes or partial rollout
    for cls, needed in ((StaticDecoder, used), (VllmEpisodeDecoder, used), (VllmDecoder, used - episodes_only)):
        assert not needed - _members(cls), (cls.__name__, sorted(needed - _members(cls)))
    for cls in (StaticDecoder, VllmDecoder, VllmEpisodeDecoder):
        inspect.signature(cls.add).bind(None, [], False)   # add(requests, keep), as the generator calls it
    assert VllmDecoder.cache_freed is False and VllmEpisodeDecoder.cache_freed is False
