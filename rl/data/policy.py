"""Where a policy comes from: a local HF model directory, or a random-init model for the built-in
tasks. Generator, reference, learner and critic all load the same PolicySpec, so they start equal.

Pad token. Many Llama-family tokenizers ship without one, and every node that batches sequences
(generator's HF loop, reference, critic, learner) pads. A tokenizer without a pad token gets its
eos token as pad (what verl's `set_pad_token_id` and TRL's examples do), else its unk token. This
is safe here because no mask is ever taken from `ids == pad_id`: rl/model/padded_batch.pad_batch builds the
attention and response masks from the sequence lengths, so a real eos at the end of a response
stays a trained token even where it equals the pad id (tests/unit/test_data.py checks it).

Stop tokens. Generation stops at every id of `stop_token_ids`: the tokenizer's eos, every eos id
of the model's generation_config.json (Llama 3 and Qwen2.5-Instruct list several; a converted
tokenizer may name a different eos than the model was tuned to emit), and the ids a user adds.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Annotated

from dataflow.checks import ExistingPath
from dataflow.errors import UserError
from rl.data import tasks
from rl.model.model_config import ModelConfig


@dataclass(kw_only=True)
class PolicySpec:
    path: Annotated[str, ExistingPath(kind="dir")] = ""
    """Local HF model directory (config.json, safetensors, tokenizer.json). Empty: build `model`."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Shape of the random-init model used when `path` is empty (built-in tasks)."""

    def preflight(self) -> list[str]:
        """What is wrong with the model directory, before anything starts (dataflow/driver/preflight.py)."""
        if not self.path:
            return []
        return [f"path={self.path}: {why}" for why in model_dir_problems(self.path)]


def ensure_pad_token(tokenizer) -> str | None:
    """Give `tokenizer` a pad token if it has none (eos, else unk; module docstring); returns the
    token chosen, None if it had one. Raises UserError if it has neither eos nor unk."""
    if tokenizer.pad_token_id is not None:
        return None
    for name in ("eos_token", "unk_token"):
        token = getattr(tokenizer, name)
        if token is not None:
            tokenizer.pad_token = token
            return token
    raise UserError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no pad, eos or unk token to pad "
                    "with; add \"pad_token\" to its tokenizer_config.json")


def load_tokenizer(spec: PolicySpec):
    """The policy's tokenizer (the built-in one for an empty path), with a pad token: tokenizer.json
    and the chat template without transformers (rl/data/fast_tokenizer.py; the same ids as AutoTokenizer),
    for the processes that only encode, decode and render chats (the prompt source, the driver's
    checks, the token-file converter). The model nodes load theirs with the model (`load`)."""
    from rl.data import fast_tokenizer

    if not spec.path:
        return tasks.build_fast_tokenizer()
    try:
        tokenizer = fast_tokenizer.load(spec.path)
    except (FileNotFoundError, OSError, ValueError) as e:
        raise UserError(f"policy.path={spec.path}: {e}") from None
    ensure_pad_token(tokenizer)
    return tokenizer


def import_model_code() -> None:
    """Import transformers' model code (modeling_utils, which pulls in torch._dynamo,
    torch.distributed.tensor and sympy): most of a model node's "load model" time, and the same for
    every model. The model nodes call it in a start-up part of its own ("import transformers"), so
    the run's start-up table tells that import from reading the weights."""
    import transformers.modeling_utils  # noqa: F401


def load(spec: PolicySpec):
    """(model, tokenizer), the tokenizer with a pad token. Never downloads; a missing or
    incomplete directory is a UserError."""
    from rl.model.causal_lm import build_policy, load_policy  # torch: the prompts node imports this module without it

    if spec.path:
        try:
            model, tokenizer = load_policy(spec.path)
        except (FileNotFoundError, OSError, ValueError) as e:
            raise UserError(f"policy.path={spec.path}: {e}") from None
        ensure_pad_token(tokenizer)
        return model, tokenizer
    tokenizer = tasks.build_tokenizer()
    return build_policy(spec.model, tokenizer), tokenizer


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def stop_token_ids(model, tokenizer, extra: list[int] | tuple[int, ...] = ()) -> list[int]:
    """Every id generation stops at, in order, without repeats: the tokenizer's eos, the eos ids of
    the model's generation config (generation_config.json when the directory has one, else
    config.json's eos_token_id) and `extra`. Ids outside the model's vocabulary are a UserError."""
    generation_config = getattr(model, "generation_config", None)
    ids = _as_ids(tokenizer.eos_token_id) + _as_ids(getattr(generation_config, "eos_token_id", None)) \
        + _as_ids(list(extra))
    ids = list(dict.fromkeys(ids))
    vocab = model.get_output_embeddings().weight.shape[0]
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UserError(f"stop token ids {bad} are outside the model's vocabulary of {vocab} "
                        "(generation_config.json eos_token_id or generator.stop_token_ids)")
    if not ids:
        raise UserError("no stop token: the tokenizer has no eos token and the model's generation config "
                        "names none; set generator.stop_token_ids=[ID]")
    return ids


# ---- what is wrong with a model directory (PolicySpec.preflight; rl/preflight.py for a reward model's) -----
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def safetensors_problem(file: str) -> str | None:
    """Why a .safetensors file cannot be read whole (None: its header parses and the file is as
    long as the header says). Reads the header only, not the tensors."""
    from dataflow.driver.resume import safetensors_extent   # the checkpoint reader's; not at import: nodes import this

    name = os.path.basename(file)
    try:
        size, header_end, data_end = safetensors_extent(file)
    except (OSError, ValueError) as e:
        return f"{name} is not a readable safetensors file ({e})"
    if header_end is None:
        return f"{name} is truncated ({size} bytes, not even a header)"
    if data_end is None:
        return f"{name} is truncated ({size} bytes; its header alone is {header_end})"
    if size < data_end:
        return (f"{name} is truncated: {size} bytes, its header describes {data_end} "
                "(an interrupted download or save: copy or save it again)")
    return None


def _weights_problems(path: str) -> list[str]:
    present = [w for w in WEIGHT_FILES if os.path.isfile(os.path.join(path, w))]
    if not present:
        return ["missing weights (model.safetensors, its .index.json, or pytorch_model.bin); the save was "
                "incomplete: save it again with save_pretrained"]
    first = present[0]
    if first == "model.safetensors":
        why = safetensors_problem(os.path.join(path, first))
        return [why] if why else []
    if first == "model.safetensors.index.json":
        try:
            with open(os.path.join(path, first)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            return [f"{first} is not a readable index ({e})"]
        found = []
        for shard in shards:
            file = os.path.join(path, shard)
            why = f"{shard} (listed in {first}) is missing" if not os.path.isfile(file) else safetensors_problem(file)
            if why:
                found.append(why)
        return found
    import zipfile   # pytorch_model.bin: torch.save's zip; a truncated one has no central directory

    file = os.path.join(path, first)
    if not zipfile.is_zipfile(file):
        return [f"{first} is truncated or not a torch.save file ({os.path.getsize(file)} bytes)"]
    return []


@functools.lru_cache(maxsize=16)
def _model_dir_problems(path: str, mtime: float, tokenizer: bool) -> tuple[str, ...]:
    if not os.path.isdir(path):
        return (f"{path} is not a directory" if os.path.exists(path) else "the model directory does not exist",)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return ("no config.json there: not a saved HF model directory (save it with save_pretrained)",)
    try:
        with open(config_file) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as e:   # unreadable, not JSON, not an object
        return (f"config.json cannot be read: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",)
    if not known_model_type(model_type):
        return (f"config.json cannot be read: its model_type {model_type!r} is not one this transformers knows "
                "(a newer model family: upgrade transformers)",)
    found = _weights_problems(path)
    if tokenizer:
        try:
            load_tokenizer(PolicySpec(path=path))   # tokenizer.json, and a pad token (eos/unk)
        except UserError as e:
            found.append(str(e).removeprefix(f"policy.path={path}: ").removeprefix(f"{path}: "))
        except Exception as e:
            found.append(f"its tokenizer does not load: {type(e).__name__}: {e}")
    return tuple(found)


def known_model_type(model_type) -> bool:
    """Whether transformers knows this config.json model_type: its own table (CONFIG_MAPPING_NAMES),
    not AutoConfig, whose config class imports the model family's code. The table is read from
    transformers' source first: importing transformers is a second or more of the driver's
    start-up, where nothing else needs it. Only a type missing there imports it to be sure, so a
    source that reads differently can cost time but never refuses a model."""
    if model_type in _model_types_in_source():
        return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


@functools.lru_cache(maxsize=1)
def _model_types_in_source() -> frozenset:
    """The keys of transformers' CONFIG_MAPPING_NAMES by the syntax tree of the modules that build it
    (models/auto/auto_mappings.py and configuration_auto.py: an OrderedDict of (type, class) pairs
    and .update({...}) calls); empty where the source reads otherwise."""
    found: set[str] = set()
    try:
        auto = os.path.join(os.path.dirname(importlib.util.find_spec("transformers").origin), "models", "auto")
        for name in ("auto_mappings.py", "configuration_auto.py"):
            if not os.path.isfile(os.path.join(auto, name)):
                continue
            with open(os.path.join(auto, name)) as f:
                tree = ast.parse(f.read())
            for stmt in tree.body:
                if not _builds_config_mapping(stmt):
                    continue
                for node in ast.walk(stmt):
                    if isinstance(node, ast.Tuple) and len(node.elts) == 2 and _is_str(node.elts[0]):
                        found.add(node.elts[0].value)
                    elif isinstance(node, ast.Dict):
                        found.update(k.value for k in node.keys if _is_str(k))
    except Exception:   # noqa: BLE001 - another layout: the import decides
        return frozenset()
    return frozenset(found)


def _builds_config_mapping(stmt) -> bool:
    """`CONFIG_MAPPING_NAMES = ...` or `CONFIG_MAPPING_NAMES.update(...)`."""
    if isinstance(stmt, ast.Assign):
        return [getattr(t, "id", None) for t in stmt.targets] == ["CONFIG_MAPPING_NAMES"]
    call = getattr(stmt, "value", None) if isinstance(stmt, ast.Expr) else None
    func = getattr(call, "func", None)
    return (isinstance(func, ast.Attribute) and func.attr == "update"
            and getattr(func.value, "id", None) == "CONFIG_MAPPING_NAMES")


def _is_str(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def model_dir_problems(path: str, tokenizer: bool = True) -> list[str]:
    """What is wrong with a local HF model directory (reasons, without the path; [] = fine)."""
    mtime = os.path.getmtime(path) if os.path.exists(path) else 0.0
    return list(_model_dir_problems(str(path), mtime, tokenizer))
