"""What the RLHF nodes will read, checked in the driver before Ray starts (dataflow/driver/preflight.py).

Each check returns one line per problem, naming the setting, the file and what to do; the CLI
prints them and exits 2. The nodes would find the same mistakes after start-up (26-45 s in, and
the message would depend on which node reads the input first); here they come in seconds.

    model_dir_problems(path)          a policy / reward model directory: config.json readable, its
                                      weights complete (a truncated safetensors file is named), the
                                      tokenizer loads and can pad (not for a reward model); it is
                                      rl/data/policy.py's, which PolicySpec.preflight calls
    pipeline_problems(...)            the prompts as the prompt source reads them (the same loader,
                                      rl/data/prompts.py: the same messages), at least one usable row, prompt
                                      length + max_new_tokens within the model's positions, and the
                                      reward (built-in scorer, or a reward file) against the rows' fields

The dataset is read whole, as the prompt source reads it at its setup: a check of the first rows
could not say how many rows are usable nor how long the longest prompt is, and the cost is that of
the source's own setup once more (a token file, `python -m rl.data convert`, is mapped: its
lengths come from its offsets, at once). The fields a reward needs are looked at in the first
FIELD_ROWS rows.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re

from dataflow.errors import UserError
from rl.data.policy import model_dir_problems
from rl.model.memory_plan import default_prompt_room

FIELD_ROWS = 100_000
"""Rows whose fields are checked against the reward's signature (a token file decodes each)."""


def model_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def context_of(policy) -> tuple[int | None, str]:
    """(positions of the policy's model, where that number is set), from config.json or the
    random-init model's settings; (None, "") when the directory does not tell."""
    if not policy.path:
        return policy.model.max_position_embeddings, "policy.model.max_position_embeddings"
    value = model_config(policy.path).get("max_position_embeddings")
    return (int(value), f"{policy.path}/config.json max_position_embeddings") if value else (None, "")


# ---- prompts, lengths and the reward --------------------------------------------------------------

@dataclasses.dataclass
class _Rows:
    """The dataset as the prompt source would send it: prompt lengths in tokens, the fields the
    reward gets, and where each row is (file:line, when it can be told)."""
    lengths: list[int]
    fields: list[dict]
    where: list[str]


_ROWS: dict[tuple, _Rows] = {}
"""The training rows the memory plan read (by path, file state, render settings and tokenizer),
until the checks take them: the plan reads the prompt lengths first, the checks reuse its read."""


def _open_rows(prompts, tokenizer, keep: bool = False) -> _Rows:
    """`prompts.path` read with the prompt source's loader; raises its DatasetError/UserError.
    keep: leave the rows in _ROWS for the next reader; else a read kept there is taken out (a large
    dataset's fields are not held for the whole run)."""
    stat = os.stat(prompts.path)
    key = (prompts.path, stat.st_mtime_ns, stat.st_size, prompts.policy.path if tokenizer is not None else "",
           *(repr(getattr(prompts, k, None)) for k in ("prompt_key", "answer_key", "system_prompt",
                                                          "apply_chat_template", "max_prompt_tokens", "truncation",
                                                          "skip_bad_lines")))
    rows = _ROWS.pop(key, None) or _read_rows(prompts, tokenizer)
    if keep:
        _ROWS.clear()
        _ROWS[key] = rows
    return rows


def longest_prompt(prompts) -> int | None:
    """Tokens of the longest prompt the prompt source will send: prompts.path's rows (or the
    built-in task's) and the validation file's, as the policy's tokenizer renders them; None where
    that cannot be told here (an unreadable file or tokenizer: the checks name those)."""
    from rl.data import policy as policy_lib

    try:
        tokenizer = policy_lib.load_tokenizer(prompts.policy) if prompts.policy.path else None
        rows = _open_rows(prompts, tokenizer, keep=True) if prompts.path else _builtin_rows(prompts, tokenizer)
        lengths = list(rows.lengths)
        if prompts.val.path:
            val = _open_rows(dataclasses.replace(prompts, path=prompts.val.path), tokenizer)
            lengths += val.lengths[:prompts.val.max_prompts or None]
    except Exception:   # the checks say what is wrong with the data or the tokenizer, in their words
        return None
    return max(lengths) if lengths else None


def _read_rows(prompts, tokenizer) -> _Rows:
    from rl.data import files as dataset_files, tasks, token_file

    fmt = dataset_files.file_format(prompts.path)
    if fmt == "tokens":
        encoded = token_file.open_prompts(prompts.path, prompts, tokenizer, prompts.policy.path, setting="prompts")
        n = len(encoded)
        lengths = (encoded.offsets[1:] - encoded.offsets[:-1]).tolist()
        fields = [encoded.records[i][1] for i in range(min(n, FIELD_ROWS))]
        return _Rows(lengths, fields, [f"{prompts.path} row {i}" for i in range(n)])
    # read, rendered and tokenized as the prompt source will, which then finds the result in the
    # prompt cache (rl/data/token_file.encode_cached)
    encoded, where = token_file.encode_cached(prompts.path, prompts, tokenizer, prompts.policy.path, setting="prompts")
    if encoded.tokens is not None:
        lengths = (encoded.offsets[1:] - encoded.offsets[:-1]).tolist()
    else:   # no policy tokenizer: the generator tokenizes the text with the built-in one
        builtin = tasks.build_fast_tokenizer()
        lengths = [len(ids) for ids in builtin([text for text, _ in encoded.records])["input_ids"]]
    return _Rows(lengths, [fields for _, fields in encoded.records], [where(i) for i in range(len(encoded))])


def _builtin_rows(prompts, tokenizer) -> _Rows:
    """A few of the built-in task's prompts (all of one task and size have the same length)."""
    from rl.data import tasks

    records = tasks.make_task(prompts.task, prompts.num_digits, seed=prompts.seed).take(4)
    tok = tokenizer or tasks.build_fast_tokenizer()
    lengths = [len(ids) for ids in tok([r["prompt"] for r in records])["input_ids"]]
    where = f"prompts.task={prompts.task} with prompts.num_digits={prompts.num_digits}"
    return _Rows(lengths, [{k: v for k, v in r.items() if k != "prompt"} for r in records], [where] * len(records))


def _no_usable_rows(prompts, tokenizer, error: UserError) -> str:
    """The line for a dataset with no usable row: how many were skipped, and why the first was."""
    from rl.data import token_file

    skipped = re.search(r"\((\d+) skipped\)", str(error))
    if not skipped or skipped.group(1) == "0":
        return f"prompts.path={prompts.path}: no rows at all (an empty file?); give a dataset with prompts"
    try:   # read again without skipping: the first bad row's own message says why
        strict = dataclasses.replace(prompts, skip_bad_lines=False)
        token_file.open_prompts(prompts.path, strict, tokenizer, prompts.policy.path, setting="prompts")
        why = ""
    except UserError as first:
        why = f"; the first: {str(first).split('; fix it')[0]}"
    return (f"prompts.path={prompts.path}: no usable rows: all {skipped.group(1)} were skipped "
            f"(prompts.skip_bad_lines=true){why}")


def _field_params(fn, form: str) -> list[str]:
    """Parameters of a reward function that only the rows' fields can fill (no default, not given
    by the engine): SAMPLE's first two positional ones take (prompt, response)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    P = inspect.Parameter
    if form == "sample":
        params = [p for p in params if p not in [q for q in params if q.kind in (P.POSITIONAL_ONLY,
                                                                                 P.POSITIONAL_OR_KEYWORD)][:2]]
    given = {"prompts", "completions", "completion_ids"}
    return [p.name for p in params if p.default is P.empty and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
            and p.name not in given]


def _missing(rows: _Rows, has) -> tuple[int, int, str]:
    """(rows lacking it, rows looked at, where the first is). A null counts as lacking: Arrow fills
    a field that a row of a JSONL file lacks with null."""
    bad = [i for i, f in enumerate(rows.fields) if not has(f)]
    return len(bad), len(rows.fields), rows.where[bad[0]] if bad else ""


def _of(k: int, n: int) -> str:
    """How many rows: "the one row", "all 3 rows", "2 of 5 rows (of the first 100000)"."""
    if k == n:
        return "the one row" if n == 1 else f"all {n} rows"
    return f"{k} of {n} rows" + (f" (of the first {FIELD_ROWS})" if n == FIELD_ROWS else "")


def _reward_problems(reward, rows: _Rows, data_path: str) -> list[str]:
    """The reward (built-in scorer, or reward.path's function) against the fields of the rows."""
    from rl.reward.reward_fn import load_rewards

    source = f"prompts.path={data_path}" if data_path else "the built-in task"
    if not reward.path and (reward.function or reward.kwargs):
        fn = reward.function
        given = (f"reward.function={fn if isinstance(fn, str) else '[' + ', '.join(fn) + ']'}" if fn
                 else f"reward.kwargs={reward.kwargs}")
        return [f"{given}: is for the functions of reward.path, which is empty (the built-in scorer runs and "
                "would ignore it); set reward.path=FILE too, or drop it"]
    if not reward.path:
        if not data_path:
            return []
        k, n, first = _missing(rows, lambda f: isinstance(f.get("answer"), str))
        return [f"{source}: {_of(k, n)} have no `answer` field (a string; the first: {first}); the built-in "
                "scorer (reward.path empty) needs one: set reward.path to your reward file, or "
                "prompts.answer_key to the field that holds the answer"] if k else []
    try:
        rewards = load_rewards(reward.path, reward.function, reward.weights, reward.kwargs)
    except UserError as e:
        return [f"reward.path: {e}"]
    found = []
    for fn in rewards.fns:
        found += _reward_fn_problems(fn, reward, rows, source)
    return found


def _reward_fn_problems(fn, reward, rows: _Rows, source: str) -> list[str]:
    from rl.reward.reward_fn import BATCH_FORMS, SAMPLE, VERL_FORMS

    if fn.form in VERL_FORMS:
        k, n, first = _missing(rows, lambda f: f.get("answer") is not None or (
            isinstance(f.get("reward_model"), dict) and f["reward_model"].get("ground_truth") is not None))
        return [f"{source}: {_of(k, n)} have neither reward_model.ground_truth nor an `answer` field (the first: "
                f"{first}), which {fn.where}, verl's compute_score, needs as its ground_truth; set "
                "prompts.answer_key to the field that holds it"] if k else []
    found = []
    for name in _field_params(fn.fn, "sample" if fn.form == SAMPLE else "batched"):
        if name in fn.kwargs:
            continue
        if fn.form in BATCH_FORMS:   # a batch gets every field any row has (None where one lacks it)
            k = 0 if any(f.get(name) is not None for f in rows.fields) else len(rows.fields)
            n, first = len(rows.fields), rows.where[0] if rows.where else ""
        else:
            k, n, first = _missing(rows, lambda f, name=name: f.get(name) is not None)
        if k:
            found.append(f"reward.path={reward.path}: {fn.where} takes `{name}`, which {_of(k, n)} of {source} lack "
                         f"(the first: {first}); give the parameter a default or add the field to the data")
    return found


def pipeline_problems(prompts, generator, reward=None, reward_model=None,
                      max_new_tokens_key: str = "generator.max_new_tokens") -> list[str]:
    """The inputs of a prompts -> generator -> reward pipeline (PromptConfig, GeneratorConfig,
    RewardConfig or None, RewardModelConfig or None), one line per problem. Policy directory
    problems are PolicySpec.preflight's: with a broken policy the checks needing it are skipped."""
    from rl.data import policy as policy_lib

    found = []
    if reward_model is not None:
        if not reward_model.path:
            found.append("reward_model.path is empty: set --set reward_model.path=/dir/of/a/sequence/classifier")
        else:
            found += [f"reward_model.path={reward_model.path}: {why}"
                      for why in model_dir_problems(reward_model.path, tokenizer=False)]
            if not found:
                labels = model_config(reward_model.path)
                num = labels.get("num_labels") or len(labels.get("id2label") or {}) or 2
                if num != 1:
                    found.append(f"reward_model.path={reward_model.path}: num_labels={num}, a reward model has 1 "
                                 "(a sequence classifier with one output)")
    spec = prompts.policy if prompts.policy.path else generator.policy
    if any(s.path and model_dir_problems(s.path) for s in (prompts.policy, generator.policy)):
        return found   # PolicySpec.preflight names the directory's problems
    positions, where = context_of(spec)
    new = generator.max_new_tokens
    if positions is not None and new >= positions:
        found.append(f"{max_new_tokens_key}={new}: the model has {positions} positions ({where}) for prompt and "
                     f"response together; set it below {positions}")
    tokenizer = policy_lib.load_tokenizer(prompts.policy) if prompts.policy.path else None
    try:
        rows = _open_rows(prompts, tokenizer) if prompts.path else _builtin_rows(prompts, tokenizer)
    except UserError as e:
        return found + [_no_usable_rows(prompts, tokenizer, e) if "no usable rows" in str(e) else str(e)]
    if positions is not None and new < positions and rows.lengths:
        longest = max(range(len(rows.lengths)), key=rows.lengths.__getitem__)
        top = rows.lengths[longest]
        if top + new > positions:
            cut = (f"cut the prompts with prompts.max_prompt_tokens={positions - new} and prompts.truncation=left, "
                   "or " if prompts.path else "")
            found.append(f"prompts up to {top} tokens (the longest: {rows.where[longest]}) + {max_new_tokens_key} "
                         f"{new} > the model's {positions} positions ({where}); {cut}lower {max_new_tokens_key}")
        else:
            found += _decoder_room(generator, spec, top, rows.where[longest], positions, new)
    if reward is not None:
        found += _reward_problems(reward, rows, prompts.path)
    return found


def _decoder_room(generator, spec, longest: int, where: str, positions: int, new: int) -> list[str]:
    """The static decoder (llama / qwen2 policies) and the vLLM engine are sized for
    generator.max_prompt_tokens (0: default_prompt_room) and refuse a longer prompt."""
    family = model_config(spec.path).get("model_type") if spec.path else spec.model.family
    if generator.backend == "hf" or (generator.backend != "vllm" and family not in ("llama", "qwen2")):
        return []
    room = default_prompt_room(generator.max_prompt_tokens, positions, new)
    if longest <= room:
        return []
    setting = f"generator.max_prompt_tokens={generator.max_prompt_tokens}" if generator.max_prompt_tokens else \
        f"generator.max_prompt_tokens=0 (auto: {room})"
    return [f"prompts up to {longest} tokens (the longest: {where}) > {setting}, the decoder's room for a "
            f"prompt; set generator.max_prompt_tokens={min(longest, positions - new)}"]
