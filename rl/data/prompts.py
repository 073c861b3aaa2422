"""Prompt datasets: JSONL, JSON and parquet files, chat prompts rendered with the policy's chat
template, and memory-mapped token files for large datasets. No network.

Files (`prompts.path`, and any other dataset setting such as a validation file; read by rl/data/files.py):
  .jsonl / .ndjson  one JSON object per line, read by pyarrow; if pyarrow cannot (a malformed or
                    non-UTF-8 line, a field whose type changes between rows), line by line with
                    the json module, which names the bad line and column or skips it
  .json             a JSON array of objects (the json module), or one object per line as .jsonl
  .parquet / .pq    read by pyarrow (verl's and HF datasets' format)
  a directory       a token file written by `python -m rl.data convert` (below)

A row's prompt (field `prompt_key`, default "prompt") is a string, or a chat: a list of
{"role", "content"} messages, rendered with the tokenizer's chat template with the generation
prompt added (an optional system prompt goes first unless the chat has one). Every other field
goes to the reward function. The answer (field `answer_key`; default "answer", else verl's
`reward_model.ground_truth`) is passed as fields["answer"], so verl's parquet layout
(`data_source`, `prompt` as messages, `reward_model.ground_truth`, `extra_info`) works unchanged.
A chat row's messages, as rendered (with the system prompt), are kept as fields["raw_prompt"]
(verl's name): TRL's conversational reward functions get them, and an agent's episodes start from
them (rl/generation/episodes.py; the text would be rendered twice). Arrow fills a field a
row lacks with null: such keys are dropped from messages (a template testing `message.name is
defined` must not see them) but kept in the other fields, as HF datasets and verl do.

A bad row (not an object, no prompt, not UTF-8, malformed JSON, a template that rejects it, a
prompt over max_prompt_tokens with truncation=error) raises DatasetError naming the file and line
(JSONL: path:line[:column]) or row (JSON arrays and parquet: "path row N", 0-based), or with
skip_bad_lines is skipped and counted.

Token files (`python -m rl.data convert data.parquet out_dir --tokenizer DIR`, rl/data/token_file.py):
the prompts rendered and tokenized once, memory-mapped when opened, so a large dataset is ready
at once; bench/data_load.py measures it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from dataflow.errors import UserError
from rl.data.files import DatasetError, file_format, read_rows


@dataclass(kw_only=True)
class DataConfig:
    """How rows are read and rendered. PromptConfig (nodes/prompts.py) has these fields too; any
    object with them can be passed where a DataConfig is taken."""
    prompt_key: str = "prompt"
    answer_key: str = ""
    """Field of the answer, dotted for nested ("reward_model.ground_truth"); empty = "answer",
    else reward_model.ground_truth, else none."""
    skip_bad_lines: bool = False
    """Skip (and count) bad rows instead of stopping with where they are."""
    system_prompt: str = ""
    """Put first in every chat that has no system message of its own."""
    apply_chat_template: bool = False
    """Render string prompts too, as one user message (chat prompts always are)."""
    max_prompt_tokens: int = 0
    """Longest prompt in tokens (0 = no limit here)."""
    truncation: Literal["error", "left", "right"] = "error"
    """A longer prompt: a bad row (error), or cut keeping its end (left) or its start (right)."""


RENDER_KEYS = ("prompt_key", "answer_key", "system_prompt", "apply_chat_template", "max_prompt_tokens",
               "truncation")


# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------

@dataclass
class Prompts:
    """A file's usable rows: prompts[i] (a string or a list of messages) and fields[i] (a dict)."""
    path: str
    by_line: bool
    """JSONL: positions are line numbers (1-based); else row indices (0-based)."""
    prompts: list = field(default_factory=list)
    fields: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def where(self, i: int) -> str:
        """Where row i came from, as DatasetError messages start."""
        return _where(self.path, self.by_line, self.positions[i])


def _where(path: str, by_line: bool, position) -> str:
    return f"{path}:{position}" if by_line else f"{path} row {position}"


def _flag(setting: str, key: str, value: str) -> str:
    """How a user sets `key`: a --set of the graph, or the converter's own flag."""
    if setting == "convert":
        flag = "--tokenizer" if key == "policy.path" else f"--{key.replace('_', '-')}"
        return flag + ("" if value == "true" else f" {value}")
    return f"--set {setting}.{key}={value}"


def _skip_hint(setting: str) -> str:
    return f"fix it, or skip such rows with {_flag(setting, 'skip_bad_lines', 'true')}"


def _get(row: dict, dotted: str):
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def _check_row(raw, cfg, setting: str) -> tuple[object, dict] | str:
    """(prompt, fields) of a parsed row, or what is wrong with it."""
    key = cfg.prompt_key
    if not isinstance(raw, dict):
        return f'expected an object, got {type(raw).__name__}; write {{"{key}": "..."}}'
    if key not in raw:
        return f'missing "{key}" field; add "{key}": "<text>" (or set prompt_key to the field that holds it)'
    prompt = raw[key]
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            return f'"{key}" is an empty list of messages'
        messages = []
        for m in prompt:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return f'"{key}" must be a string or a list of {{"role": str, "content": str}} messages'
            messages.append({k: v for k, v in m.items() if v is not None})
        prompt = messages
    elif not isinstance(prompt, str) or not prompt.strip():
        return f'"{key}" must be a non-empty string or a list of {{"role", "content"}} messages'
    fields = {k: v for k, v in raw.items() if k != key}
    try:
        if cfg.answer_key:
            fields["answer"] = _get(raw, cfg.answer_key)
        elif "answer" not in raw and isinstance(raw.get("reward_model"), dict) \
                and "ground_truth" in raw["reward_model"]:
            fields["answer"] = raw["reward_model"]["ground_truth"]   # verl's layout
    except KeyError:
        return f'missing answer field "{cfg.answer_key}" ({setting}.answer_key)'
    return prompt, fields


def load_prompts(path: str, cfg=None, setting: str = "prompts") -> Prompts:
    """The usable rows of a JSONL, JSON or parquet file. `cfg`: a DataConfig or any object with its
    fields (prompt_key, answer_key, skip_bad_lines); `setting` names it in error messages
    (e.g. "prompts", "val"). A bad row raises DatasetError, or is skipped and counted."""
    cfg = cfg or DataConfig()
    fmt = file_format(path)
    if fmt == "tokens":
        raise DatasetError(f"{path}: a token file holds tokenized prompts; open it with open_prompts")
    out = Prompts(path, by_line=fmt == "jsonl")
    for position, raw, problem in read_rows(path, fmt):
        checked = _check_row(raw, cfg, setting) if problem is None else problem
        if isinstance(checked, str):
            if not cfg.skip_bad_lines:
                raise DatasetError(f"{_where(path, out.by_line, position)}: {checked}; {_skip_hint(setting)}")
            out.skipped += 1
            continue
        out.prompts.append(checked[0])
        out.fields.append(checked[1])
        out.positions.append(position)
    if not out.prompts:
        raise DatasetError(f"{path}: no usable rows ({out.skipped} skipped)")
    return out


# ---------------------------------------------------------------------------------------------
# Rendering and tokenizing
# ---------------------------------------------------------------------------------------------

class EncodedPrompts:
    """Prompts ready to send: message(i) = {"prompt": text, "prompt_ids": ids, "fields": dict}
    (no "prompt_ids" when tokens is None: the generator then tokenizes the text)."""

    def __init__(self, tokens, offsets, records: Sequence, *, skipped: int = 0, truncated: int = 0,
                 source: str = ""):
        self.tokens, self.offsets, self.records = tokens, offsets, records
        self.skipped, self.truncated, self.source = skipped, truncated, source

    def __len__(self) -> int:
        return len(self.records)

    def ids(self, i: int) -> list[int]:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]].tolist()

    def message(self, i: int) -> dict:
        text, fields = self.records[i]
        msg = {"prompt": text, "fields": fields}
        if self.tokens is not None:
            msg["prompt_ids"] = self.ids(i)
        return msg


def _render(prompt, cfg, tokenizer, tokenizer_dir: str, where: str, setting: str) -> tuple[str, bool, list | None]:
    """(text, whether tokenizing adds special tokens, the messages rendered or None): a chat
    template's text carries its own special tokens."""
    if isinstance(prompt, str) and not cfg.apply_chat_template:
        if cfg.system_prompt:
            raise DatasetError(f"{where}: a system prompt is set but this prompt is a string; render strings "
                               f"as chats with {_flag(setting, 'apply_chat_template', 'true')}, or write chat rows "
                               "(a list of messages)")
        return prompt, True, None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if cfg.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    if tokenizer is None:
        raise DatasetError(f"{where}: a chat prompt needs the policy's tokenizer to render it; "
                           f"{_flag(setting, 'policy.path', 'DIR')} (the policy's model directory)")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{where}: a chat prompt, but the tokenizer at {tokenizer_dir or '(built-in)'} has no "
                        "chat template; add \"chat_template\" to its tokenizer_config.json or give string prompts")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False, messages


def encode_prompts(prompts: Prompts, tokenizer, tokenizer_dir: str = "", cfg=None, setting: str = "prompts",
                   chunk: int = 8192) -> EncodedPrompts:
    """Render every prompt and tokenize it (a fast tokenizer, a chunk of texts at a time), applying
    max_prompt_tokens / truncation; tokenizer None: the texts only (string prompts, no limit)."""
    cfg = cfg or DataConfig()
    limit = cfg.max_prompt_tokens
    if tokenizer is None and limit:
        raise DatasetError(f"{prompts.path}: max_prompt_tokens needs the policy's tokenizer; "
                           f"{_flag(setting, 'policy.path', 'DIR')} (the policy's model directory)")
    pieces, lengths, records = [], [], []
    skipped, truncated = prompts.skipped, 0
    for start in range(0, len(prompts), chunk):
        batch = []
        for i in range(start, min(start + chunk, len(prompts))):
            try:
                text, special, messages = _render(prompts.prompts[i], cfg, tokenizer, tokenizer_dir,
                                                  prompts.where(i), setting)
            except UserError:
                raise
            except Exception as e:   # a template's own check (e.g. roles must alternate)
                if not cfg.skip_bad_lines:
                    raise DatasetError(f"{prompts.where(i)}: the chat template rejects this prompt ({e}); "
                                       f"{_skip_hint(setting)}") from None
                skipped += 1
                continue
            batch.append((i, text, special, messages))
        if tokenizer is None:
            records += [(text, prompts.fields[i]) for i, text, _, _ in batch]
            continue
        ids = [None] * len(batch)
        for special in (True, False):
            group = [j for j, b in enumerate(batch) if b[2] == special]
            if group:
                encoded = tokenizer([batch[j][1] for j in group], add_special_tokens=special,
                                    return_attention_mask=False)["input_ids"]
                for j, e in zip(group, encoded):
                    ids[j] = e
        for (i, text, _, messages), row_ids in zip(batch, ids):
            fields = prompts.fields[i]
            if not isinstance(prompts.prompts[i], str):    # a chat row: its messages as rendered
                fields = {**fields, "raw_prompt": messages}
            if limit and len(row_ids) > limit:
                if cfg.truncation == "error":
                    if not cfg.skip_bad_lines:
                        raise DatasetError(
                            f"{prompts.where(i)}: the prompt has {len(row_ids)} tokens, more "
                            f"than max_prompt_tokens={limit}; raise it, cut prompts with "
                            f"{_flag(setting, 'truncation', 'left')} (keep the end) or right, or skip them "
                            f"with {_flag(setting, 'skip_bad_lines', 'true')}")
                    skipped += 1
                    continue
                row_ids = row_ids[-limit:] if cfg.truncation == "left" else row_ids[:limit]
                text = tokenizer.decode(row_ids)
                truncated += 1
            pieces.append(np.asarray(row_ids, dtype=np.int32))
            lengths.append(len(row_ids))
            records.append((text, fields))
    if not records:
        raise DatasetError(f"{prompts.path}: no usable rows ({skipped} skipped)")
    tokens = offsets = None
    if tokenizer is not None:
        tokens = np.concatenate(pieces)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
    return EncodedPrompts(tokens, offsets, records, skipped=skipped, truncated=truncated, source=prompts.path)
