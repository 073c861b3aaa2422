"""rl/data/prompts.py and the prompt source: JSONL / JSON / parquet files, verl's layout, bad rows, chat
templates, truncation, token files, shuffled epochs, with a model dir built here (tests/chat_model.py:
chat template, no pad token, two eos ids). A GRPO run on such a file:
tests/integration/test_peer_rewards.py::test_a_verl_users_compute_score_runs_unchanged."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl.data import prompts as data, policy, token_file
from tests.chat_model import make_chat_model_dir

ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "add 1 + 2 ="}]
VERL_ROWS = [
    {"data_source": "toy/add", "prompt": CHAT, "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"index": 0, "split": "train"}},
    {"data_source": "toy/add", "prompt": [{"role": "user", "content": "add 2 + 2 ="}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"index": 1, "split": "train"}},
]


def write_jsonl(path: Path, rows: list, raw_lines: dict[int, bytes] | None = None) -> Path:
    lines = [json.dumps(r).encode() for r in rows]
    for i, raw in (raw_lines or {}).items():
        lines.insert(i, raw)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_model")
    make_chat_model_dir(path)
    return str(path)


def test_verl_layout_reads_the_same_from_jsonl_json_and_parquet(tmp_path):
    paths = [write_jsonl(tmp_path / "d.jsonl", VERL_ROWS), tmp_path / "d.json", tmp_path / "d.parquet"]
    paths[1].write_text(json.dumps(VERL_ROWS, indent=2))
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), paths[2])
    for path in paths:
        got = data.load_prompts(str(path))
        assert got.prompts == [r["prompt"] for r in VERL_ROWS], path
        assert [f["answer"] for f in got.fields] == ["3", "4"]                # ground_truth as the answer
        assert got.fields[1]["data_source"] == "toy/add" and got.fields[1]["extra_info"]["index"] == 1
        assert got.fields[0]["reward_model"] == VERL_ROWS[0]["reward_model"]  # the original kept too
        assert "prompt" not in got.fields[0]
    assert data.load_prompts(str(paths[2])).where(1) == f"{paths[2]} row 1"
    assert data.load_prompts(str(paths[0])).where(1) == f"{paths[0]}:2"


def test_field_names_and_answer_key(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "copy 1 2 :", "sol": {"final": "1 2"}, "answer": "x"}])
    cfg = data.DataConfig(prompt_key="question", answer_key="sol.final")
    got = data.load_prompts(str(path), cfg)
    assert got.prompts == ["copy 1 2 :"] and got.fields[0]["answer"] == "1 2" and "question" not in got.fields[0]
    with pytest.raises(data.DatasetError, match=rf'^{path}:1: missing answer field "sol.other"'):
        data.load_prompts(str(path), data.DataConfig(prompt_key="question", answer_key="sol.other"))
    with pytest.raises(data.DatasetError, match=r'missing "prompt" field'):
        data.load_prompts(str(path))


def test_bad_rows_name_file_line_column_and_the_setting_that_skips(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl",
                       [{"prompt": "copy 1 2 :", "answer": "1 2"}, ["a list"], {"question": "no prompt"},
                        {"prompt": ""}, {"prompt": "ok", "extra": 1}],
                       raw_lines={1: b"", 2: b'{"prompt": "a" "b"}', 3: b'{"prompt": "caf\xe9"}'})
    # line 3 is malformed at column 16 (the second string); line 4 is Latin-1, not UTF-8
    with pytest.raises(data.DatasetError) as e:
        data.load_prompts(str(path))
    assert str(e.value).startswith(f"{path}:3:16: invalid JSON (Expecting ',' delimiter)")
    assert "--set prompts.skip_bad_lines=true" in str(e.value)
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(lines[:2] + lines[3:]))        # without the malformed line
    with pytest.raises(data.DatasetError, match=rf"^{path}:3: not UTF-8 \(byte 0xe9"):
        data.load_prompts(str(path))
    path.write_bytes(b"\n".join(lines[:2] + lines[4:]))
    with pytest.raises(data.DatasetError, match=rf"^{path}:3: expected an object, got list.*--set val.skip_bad_lines"):
        data.load_prompts(str(path), setting="val")
    path.write_bytes(b"\n".join(lines))
    got = data.load_prompts(str(path), data.DataConfig(skip_bad_lines=True))
    assert got.skipped == 5 and got.prompts == ["copy 1 2 :", "ok"]
    assert [got.where(i) for i in range(2)] == [f"{path}:1", f"{path}:8"]
    with pytest.raises(data.DatasetError, match="no such file"):
        data.load_prompts(str(tmp_path / "absent.jsonl"))
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(data.DatasetError, match="unknown dataset format '.csv'"):
        data.load_prompts(str(tmp_path / "d.csv"))


def test_mixed_types_fall_back_and_arrays_report_rows(tmp_path):
    # a string prompt then a chat: pyarrow refuses a column that changes type; the json module reads it
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "copy 1 :"}, {"prompt": CHAT, "n": 1}])
    got = data.load_prompts(str(path))
    assert got.prompts == ["copy 1 :", CHAT] and got.fields == [{}, {"n": 1}]
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"prompt": "x"}, {"prompt": 3}]))
    with pytest.raises(data.DatasetError, match=rf"^{array} row 1: \"prompt\" must be"):
        data.load_prompts(str(array))
    array.write_text('[{"prompt": "x"},\n {"prompt": }]')
    with pytest.raises(data.DatasetError, match=rf"^{array}:2:13: invalid JSON"):
        data.load_prompts(str(array))


def test_chat_prompts_render_with_the_template_and_system_prompt(tmp_path, model_dir):
    tok = policy.load_tokenizer(policy.PolicySpec(path=model_dir))
    rows = [{"prompt": CHAT}, {"prompt": [{"role": "system", "content": "you are"}] + CHAT}, {"prompt": "copy 1 2 :"}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    enc = token_file.open_prompts(str(path), data.DataConfig(), tok, model_dir)
    first = enc.message(0)
    assert first["prompt"] == "<|im_start|>user\nadd 1 + 2 =<|im_end|>\n<|im_start|>assistant\n"
    assert first["prompt_ids"] == tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert first["fields"]["raw_prompt"] == CHAT
    assert enc.message(2) == {"prompt": "copy 1 2 :", "prompt_ids": tok("copy 1 2 :")["input_ids"], "fields": {}}

    with pytest.raises(data.DatasetError, match=rf"^{path}:3: a system prompt is set but this prompt is a string"):
        token_file.open_prompts(str(path), data.DataConfig(system_prompt="you are terse"), tok, model_dir)
    cfg = data.DataConfig(system_prompt="you are terse", apply_chat_template=True)
    enc = token_file.open_prompts(str(path), cfg, tok, model_dir)
    assert enc.message(0)["prompt"].startswith("<|im_start|>system\nyou are terse<|im_end|>\n<|im_start|>user")
    assert enc.message(1)["prompt"].count("system") == 1          # the row's own system message wins
    # the messages as rendered: an agent's episode starts from them (rl/generation/episodes.py)
    assert enc.message(0)["fields"]["raw_prompt"] == [{"role": "system", "content": "you are terse"}] + CHAT
    assert enc.message(2)["prompt"] == "<|im_start|>system\nyou are terse<|im_end|>\n<|im_start|>user\ncopy 1 2 :" \
                                       "<|im_end|>\n<|im_start|>assistant\n"

    # a template's own check (e.g. "roles must alternate") rejects a row: a bad row like any other
    tok.chat_template = "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    with pytest.raises(data.DatasetError, match=rf"^{path}:2: the chat template rejects this prompt \(no system role\)"):
        token_file.open_prompts(str(path), data.DataConfig(), tok, model_dir)
    assert len(token_file.open_prompts(str(path), data.DataConfig(skip_bad_lines=True), tok, model_dir)) == 2


def test_chat_prompts_need_a_template_and_a_tokenizer(tmp_path):
    bare = tmp_path / "bare"
    make_chat_model_dir(bare, always_emit=None, chat_template=False)
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "copy 1 :"}, {"prompt": CHAT}])
    tok = policy.load_tokenizer(policy.PolicySpec(path=str(bare)))
    with pytest.raises(data.UserError, match=rf"^{path}:2: a chat prompt, but the tokenizer at {bare} has no chat template"):
        token_file.open_prompts(str(path), data.DataConfig(), tok, str(bare))
    with pytest.raises(data.DatasetError, match=rf"^{path}:2: a chat prompt needs the policy's tokenizer.*prompts.policy.path"):
        token_file.open_prompts(str(path), data.DataConfig(), None)
    enc = token_file.open_prompts(str(write_jsonl(tmp_path / "s.jsonl", [{"prompt": "copy 1 :"}])))
    assert enc.message(0) == {"prompt": "copy 1 :", "fields": {}}   # no tokenizer: the generator tokenizes


def test_long_prompts_error_truncate_or_skip(tmp_path, model_dir):
    tok = policy.load_tokenizer(policy.PolicySpec(path=model_dir))
    path = write_jsonl(tmp_path / "l.jsonl", [{"prompt": "copy 1 2 :"}, {"prompt": "copy 1 2 3 4 5 6 7 :"}])
    full = tok("copy 1 2 3 4 5 6 7 :")["input_ids"]
    with pytest.raises(data.DatasetError) as e:
        token_file.open_prompts(str(path), data.DataConfig(max_prompt_tokens=5), tok, model_dir)
    assert str(e.value).startswith(f"{path}:2: the prompt has 9 tokens, more than max_prompt_tokens=5")
    assert "--set prompts.truncation=left" in str(e.value) and "--set prompts.skip_bad_lines=true" in str(e.value)
    left = token_file.open_prompts(str(path), data.DataConfig(max_prompt_tokens=5, truncation="left"), tok, model_dir)
    right = token_file.open_prompts(str(path), data.DataConfig(max_prompt_tokens=5, truncation="right"), tok, model_dir)
    assert left.message(1)["prompt_ids"] == full[-5:] and right.message(1)["prompt_ids"] == full[:5]
    assert left.message(1)["prompt"] == "4 5 6 7 :" and left.truncated == right.truncated == 1
    assert left.message(0)["prompt_ids"] == tok("copy 1 2 :")["input_ids"]
    skipped = token_file.open_prompts(str(path), data.DataConfig(max_prompt_tokens=5, skip_bad_lines=True), tok, model_dir)
    assert len(skipped) == 1 and skipped.skipped == 1


def test_token_file_matches_the_file_it_was_made_from(tmp_path, model_dir, capsys):
    src = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS * 3), src)
    out = tmp_path / "tokens"
    assert token_file.main(["convert", str(src), str(out), "--tokenizer", model_dir, "--system-prompt", "you are terse"]) == 0
    assert "6 prompts (0 skipped, 0 truncated)" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["path"] == model_dir and meta["tokenizer"]["chat_template_sha256"]
    assert meta["settings"]["system_prompt"] == "you are terse" and meta["num_prompts"] == 6
    tok = policy.load_tokenizer(policy.PolicySpec(path=model_dir))
    cfg = data.DataConfig(system_prompt="you are terse")
    mapped = token_file.open_prompts(str(out), cfg, tok, model_dir)
    direct = token_file.open_prompts(str(src), cfg, tok, model_dir)
    assert len(mapped) == 6 and [mapped.message(i) for i in range(6)] == [direct.message(i) for i in range(6)]
    assert isinstance(mapped.tokens, __import__("numpy").memmap)        # mapped, not read
    with pytest.raises(data.DatasetError, match="system_prompt='other' is set, but the token file was made with"):
        token_file.open_prompts(str(out), data.DataConfig(system_prompt="other"), tok, model_dir)
    other = tmp_path / "other"
    make_chat_model_dir(other, chat_template=False)
    with pytest.raises(data.DatasetError, match="chat_template_sha256 differs.*python -m rl.data convert"):
        token_file.open_prompts(str(out), cfg, policy.load_tokenizer(policy.PolicySpec(path=str(other))), str(other))
    # the converter's own errors name its flags
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}], raw_lines={1: b"{"})
    assert token_file.main(["convert", str(bad), str(tmp_path / "t2"), "--tokenizer", model_dir]) == 2
    assert "skip such rows with --skip-bad-lines" in capsys.readouterr().err


def test_stream_shuffles_each_epoch_from_the_seed():
    from nodes.prompts import PromptConfig, PromptSource

    def order(**kw):
        src = types.SimpleNamespace(config=PromptConfig(path="x", **kw), data=list(range(6)))
        return list(PromptSource._stream(src))

    assert order(epochs=2) == list(range(6)) * 2
    shuffled = order(epochs=2, shuffle=True, seed=3)
    assert sorted(shuffled[:6]) == sorted(shuffled[6:]) == list(range(6))
    assert shuffled[:6] != shuffled[6:] and shuffled == order(epochs=2, shuffle=True, seed=3)
    assert shuffled != order(epochs=2, shuffle=True, seed=4)


def test_the_prompt_cache_reads_a_file_once_and_knows_when_it_changed(tmp_path, model_dir, monkeypatch):
    """The driver's checks and the prompt source read a dataset through rl/data/token_file.encode_cached:
    the first read renders and tokenizes it and writes a token file under the cache; the next one
    maps it (the same messages, each row's position in the file, the skipped count). Other bytes,
    other rendering settings or the cache set to "" read the file again; a bad row still raises."""
    monkeypatch.setenv("DATAFLOW_PROMPT_CACHE", str(tmp_path / "cache"))
    tok = policy.load_tokenizer(policy.PolicySpec(path=model_dir))
    path = write_jsonl(tmp_path / "d.jsonl", VERL_ROWS, raw_lines={1: b"{not json"})
    cfg = data.DataConfig(skip_bad_lines=True)
    first, where = token_file.encode_cached(str(path), cfg, tok, model_dir)
    assert len(first) == 2 and first.skipped == 1 and [where(0), where(1)] == [f"{path}:1", f"{path}:3"]
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and (entries[0] / "positions.npy").is_file()

    reads = []
    encode = data.encode_prompts
    monkeypatch.setattr(token_file, "encode_prompts", lambda *a, **k: reads.append(1) or encode(*a, **k))
    again, where = token_file.encode_cached(str(path), cfg, tok, model_dir)
    assert reads == [] and isinstance(again.tokens, __import__("numpy").memmap)      # mapped, not tokenized
    assert [again.message(i) for i in range(2)] == [first.message(i) for i in range(2)]
    assert again.skipped == 1 and [where(0), where(1)] == [f"{path}:1", f"{path}:3"]
    assert token_file.open_prompts(str(path), cfg, tok, model_dir).message(1) == first.message(1) and reads == []

    token_file.encode_cached(str(path), data.DataConfig(skip_bad_lines=True, system_prompt="be terse"), tok, model_dir)
    assert len(reads) == 1                                        # another rendering: read again
    write_jsonl(path, VERL_ROWS[::-1], raw_lines={1: b"{not json"})   # same size, other bytes
    swapped, _ = token_file.encode_cached(str(path), cfg, tok, model_dir)
    assert len(reads) == 2 and swapped.message(0)["fields"]["answer"] == "4"
    config = Path(model_dir) / "tokenizer_config.json"     # a tokenizer setting outside tokenizer.json
    saved = config.read_bytes()
    config.write_text(json.dumps({**json.loads(saved), "model_max_length": 77}))
    try:
        token_file.encode_cached(str(path), cfg, policy.load_tokenizer(policy.PolicySpec(path=model_dir)), model_dir)
    finally:
        config.write_bytes(saved)
    assert len(reads) == 3
    with pytest.raises(data.DatasetError, match=rf"^{path}:2:.*invalid JSON"):   # not skipping: the bad row fails
        token_file.encode_cached(str(path), data.DataConfig(), tok, model_dir)
    monkeypatch.setenv("DATAFLOW_PROMPT_CACHE", "")
    token_file.encode_cached(str(path), cfg, tok, model_dir)
    assert len(reads) == 4 and len(list((tmp_path / "cache").iterdir())) == 4   # nothing written with it off


def test_a_damaged_cache_entry_is_read_again_and_the_cache_keeps_its_size(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("DATAFLOW_PROMPT_CACHE", str(tmp_path / "cache"))
    tok = policy.load_tokenizer(policy.PolicySpec(path=model_dir))
    path = write_jsonl(tmp_path / "d.jsonl", VERL_ROWS)
    want = token_file.encode_cached(str(path), data.DataConfig(), tok, model_dir)[0].message(1)
    (entry,) = (tmp_path / "cache").iterdir()
    (entry / "tokens.npy").write_bytes(b"damaged")
    assert token_file.encode_cached(str(path), data.DataConfig(), tok, model_dir)[0].message(1) == want
    assert token_file.encode_cached(str(path), data.DataConfig(), tok, model_dir)[0].message(1) == want
    # Over the size limit, the least recently used entries go; the one just written stays.
    monkeypatch.setattr(token_file, "CACHE_MAX_BYTES", 1)
    token_file.encode_cached(str(path), data.DataConfig(system_prompt="be terse"), tok, model_dir)
    (kept,) = (tmp_path / "cache").iterdir()
    assert kept != entry and json.loads((kept / "meta.json").read_text())["settings"]["system_prompt"] == "be terse"


def test_a_read_only_prompt_cache_still_serves_its_entries(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("DATAFLOW_PROMPT_CACHE", str(tmp_path / "cache"))
    tok = policy.load_tokenizer(policy.PolicySpec(path=model_dir))
    path = write_jsonl(tmp_path / "d.jsonl", VERL_ROWS)
    want = token_file.encode_cached(str(path), data.DataConfig(), tok, model_dir)[0].message(0)
    monkeypatch.setattr(token_file.os, "utime", lambda *a, **k: (_ for _ in ()).throw(PermissionError("read-only")))
    monkeypatch.setattr(token_file, "encode_prompts", lambda *a, **k: pytest.fail("read the file again"))
    assert token_file.encode_cached(str(path), data.DataConfig(), tok, model_dir)[0].message(0) == want
