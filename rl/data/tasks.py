"""Built-in synthetic tasks and their tokenizer. No network. (Prompt datasets: rl/data/prompts.py.)

A task turns a seed into an endless, deterministic stream of prompt records
`{"prompt": "copy 3 1 4 :", "answer": "3 1 4", "task": "copy"}` and scores a response text by a
program. Prompts and answers are space-separated tokens of a tiny word-level vocabulary, so one
token is one digit and per-position credit is well defined.

Tasks (k = num_digits, digits uniform in 0-9):
  first_digit  "first d1 .. dk :"   -> "d1"              exact match
  copy         "copy d1 .. dk :"    -> "d1 .. dk"        per-position credit
  reverse      "reverse d1 .. dk :" -> "dk .. d1"        per-position credit
  sort         "sort d1 .. dk :"    -> digits ascending  per-position credit

DEFAULT: copy, k=2: it needs the prompt (no constant answer scores well) and a plain PPO loop
learns it well inside the demo's few minutes on a CPU.
Harder: copy, k=3, where per-token credit matters: with the score only on the last token PPO
plateaus; with per-position token_rewards it learns.
Stretch: reverse, k=3 stalls even with token rewards (each answer position needs a different
attention offset). The runs behind this choice: bench/results/task_choice_cpu_2026-11-29.md.

Per-position credit: score = #(i < k with response[i] == answer[i]) / k. Tokens after the k-th
are ignored: an earlier version divided by max(k, len(response)) to teach stopping, and the
reference loop then plateaued at 0.7 because the policy first learns never to emit <eos> (an
early <eos> loses credit) and never explores it at position k + 1 again.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator


if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
DIGITS = tuple(str(d) for d in range(10))
WORDS = ("first", "copy", "reverse", "sort", "sum", ":", "=", "+")
TASK_NAMES = ("first_digit", "copy", "reverse", "sort")
DEFAULT_TASK = "copy"
DEFAULT_NUM_DIGITS = 2


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def _builtin_backend():
    """The built-in word-level tokenizer (tokenizers' Tokenizer; build_tokenizer documents it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + DIGITS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return backend


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over specials, digits and task words; prepends <bos> when encoding.

    Ids are fixed: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then "0".."9", then WORDS. Text is split on
    whitespace and every digit is its own token ("314:" == "3 1 4 :"). Decoding joins tokens with
    spaces. `tokenizer.save_pretrained(dir)` / `load_tokenizer(dir)` round-trip it.
    """
    # Imported here, not at the top: the driver imports this module (graph files -> node configs)
    # and never builds a tokenizer. The model nodes use this one; the prompt source and the
    # reward node use build_fast_tokenizer (no transformers import, seconds less start-up).
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_builtin_backend(), bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=UNK)


def build_fast_tokenizer():
    """build_tokenizer()'s tokenizer without transformers (rl/data/fast_tokenizer.py): the same ids."""
    from rl.data.fast_tokenizer import FastTokenizer

    return FastTokenizer(_builtin_backend(), {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK},
                         name_or_path="(built-in)")


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved with save_pretrained from a local directory (never a hub)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"{path}: no tokenizer.json; save one with "
                                "tokenizer.save_pretrained(path)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------

def _target(task: str, digits: list[str]) -> list[str]:
    if task == "first_digit":
        return digits[:1]
    if task == "copy":
        return list(digits)
    if task == "reverse":
        return digits[::-1]
    if task == "sort":
        return sorted(digits)
    raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASK_NAMES)}")


_PROMPT_WORD = {"first_digit": "first", "copy": "copy", "reverse": "reverse", "sort": "sort"}


def _position_credits(answer: list[str], response: list[str]) -> list[float]:
    """Credit of each response token: 1/k where it matches the answer, else 0."""
    return [1.0 / len(answer) if i < len(answer) and tok == answer[i] else 0.0
            for i, tok in enumerate(response)]


@dataclass(frozen=True)
class Task:
    """One synthetic task. Build with make_task(); all methods are pure."""

    name: str
    num_digits: int
    seed: int

    @property
    def max_new_tokens(self) -> int:
        """Answer tokens + 1 for <eos>: the generation budget that allows a perfect score."""
        return len(_target(self.name, ["0"] * self.num_digits)) + 1

    def make_prompt(self, rng: random.Random) -> dict:
        digits = [str(rng.randrange(10)) for _ in range(self.num_digits)]
        return {"prompt": " ".join([_PROMPT_WORD[self.name], *digits, ":"]),
                "answer": " ".join(_target(self.name, digits)), "task": self.name}

    def prompts(self) -> Iterator[dict]:
        """Endless prompt records, the same sequence for the same seed (each call restarts)."""
        rng = random.Random(f"{self.name}/{self.num_digits}/{self.seed}")
        while True:
            yield self.make_prompt(rng)

    def take(self, n: int) -> list[dict]:
        """The first n records of prompts()."""
        it = self.prompts()
        return [next(it) for _ in range(n)]

    def score(self, fields: dict, response_text: str) -> float:
        return score(fields, response_text)

    def token_rewards(self, fields: dict, response_tokens: list[str]) -> list[float]:
        return token_rewards(fields, response_tokens)


def make_task(name: str = DEFAULT_TASK, num_digits: int = DEFAULT_NUM_DIGITS,
              seed: int = 0) -> Task:
    """A Task by name (first_digit, copy, reverse, sort) and number of prompt digits."""
    _target(name, [])  # validates the name
    if num_digits < 1:
        raise ValueError(f"make_task: num_digits={num_digits} must be >= 1")
    return Task(name=name, num_digits=int(num_digits), seed=int(seed))


def score(fields: dict, response_text: str) -> float:
    """Score in [0, 1] of a response to a task prompt record (uses fields["answer"], ["task"]).

    first_digit: 1.0 iff the response is exactly the answer digit. Others: per-position credit
    (module docstring). The response is split on whitespace; special tokens must already be
    stripped (decode with skip_special_tokens=True).
    """
    answer, response = fields["answer"].split(), response_text.split()
    if fields.get("task") == "first_digit":
        return 1.0 if response == answer else 0.0
    return sum(_position_credits(answer, response))


def token_rewards(fields: dict, response_tokens: list[str]) -> list[float]:
    """Per-token partial credit aligned with `response_tokens` (token strings, specials included).

    Special tokens (e.g. the final <eos>) get 0; the other tokens get their per-position credit,
    so sum(token_rewards(f, toks)) == score(f, text without specials). first_digit puts its
    exact-match score on the last token.
    """
    content = [i for i, tok in enumerate(response_tokens) if tok not in SPECIAL_TOKENS]
    rewards = [0.0] * len(response_tokens)
    words = [response_tokens[i] for i in content]
    if fields.get("task") == "first_digit":
        if response_tokens:
            rewards[-1] = score(fields, " ".join(words))
        return rewards
    for i, credit in zip(content, _position_credits(fields["answer"].split(), words)):
        rewards[i] = credit
    return rewards
