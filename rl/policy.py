"""Where a policy comes from: a local HF model directory, or a random-init model for the built-in
tasks. Generator, reference, learner and critic all load the same PolicySpec, so they start equal.

Pad token. Many Llama-family tokenizers ship without one, and every node that batches sequences
(generator's HF loop, reference, critic, learner) pads. A tokenizer without a pad token gets its
eos token as pad (what verl's `set_pad_token_id` and TRL's examples do), else its unk token. This
is safe here because no mask is ever taken from `ids == pad_id`: rl/padded_batch.pad_batch builds the
attention and response masks from the sequence lengths, so a real eos at the end of a response
stays a trained token even where it equals the pad id (tests/test_data.py checks it).

Stop tokens. Generation stops at every id of `stop_token_ids`: the tokenizer's eos, every eos id
of the model's generation_config.json (Llama 3 and Qwen2.5-Instruct list several; a converted
tokenizer may name a different eos than the model was tuned to emit), and the ids a user adds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated


from dataflow.checks import ExistingPath
from dataflow.errors import UserError
from rl import tasks
from rl.model_config import ModelConfig


@dataclass(kw_only=True)
class PolicySpec:
    path: Annotated[str, ExistingPath(kind="dir")] = ""
    """Local HF model directory (config.json, safetensors, tokenizer.json). Empty: build `model`."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Shape of the random-init model used when `path` is empty (built-in tasks)."""

    def preflight(self) -> list[str]:
        """What is wrong with the model directory, before anything starts (dataflow/preflight.py)."""
        if not self.path:
            return []
        from rl.preflight import model_dir_problems

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
    and the chat template without transformers (rl/fast_tokenizer.py; the same ids as AutoTokenizer),
    for the processes that only encode, decode and render chats (the prompt source, the driver's
    checks, the token-file converter). The model nodes load theirs with the model (`load`)."""
    from rl import fast_tokenizer

    if not spec.path:
        return tasks.build_fast_tokenizer()
    try:
        tokenizer = fast_tokenizer.load(spec.path)
    except (FileNotFoundError, OSError, ValueError) as e:
        raise UserError(f"policy.path={spec.path}: {e}") from None
    ensure_pad_token(tokenizer)
    return tokenizer


def load(spec: PolicySpec):
    """(model, tokenizer), the tokenizer with a pad token. Never downloads; a missing or
    incomplete directory is a UserError."""
    from rl.models import build_policy, load_policy  # torch: the prompts node imports this module without it

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
