"""Dataset files: which format a path holds (by extension and content) and the rows of a JSONL,
JSON or parquet file, each with its position (JSONL: line[:column], others: row) and, for a row
that cannot be parsed, what is wrong. rl/data/prompts.py turns rows into prompts (docs/data.md has the
formats).
"""

from __future__ import annotations

import itertools
import json
import os

from dataflow.errors import UserError


class DatasetError(UserError, ValueError):
    """A malformed prompt dataset; the message starts with where: "path:line:" or "path row N:"."""


def _jsonl_lines(path: str):
    """(line number, parsed object or None, problem) per non-blank line, with the json module
    ("line:column" in place of the number for malformed JSON)."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, None, f"not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)"
                continue
            try:
                yield line_no, json.loads(text), None
            except json.JSONDecodeError as e:
                yield f"{line_no}:{e.colno}", None, f"invalid JSON ({e.msg}); write one JSON object per line"


def read_rows(path: str, fmt: str):
    """(position, parsed row, problem) for every row of a file (positions as in rl/data/prompts.Prompts)."""
    import pyarrow as pa

    if fmt == "parquet":
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
        return ((i, row, None) for i, row in enumerate(rows))
    if fmt == "json":
        try:
            with open(path, encoding="utf-8") as f:
                rows = json.load(f)
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg}); a .json file is an "
                               "array of objects or one object per line") from None
        if not isinstance(rows, list):
            raise DatasetError(f"{path}: a .json file must hold an array of row objects (or one object per "
                               f"line), not a {type(rows).__name__}")
        return ((i, row, None) for i, row in enumerate(rows))
    import pyarrow.json as pj
    try:   # fast path: pyarrow (lines of the whole file must parse and agree on types)
        rows = pj.read_json(path, read_options=pj.ReadOptions(block_size=1 << 24)).to_pylist()
    except (pa.ArrowException, UnicodeDecodeError, OSError):
        return _jsonl_lines(path)
    with open(path, "rb") as f:   # pyarrow skips blank lines: number the others
        lines = [n for n, raw in enumerate(f, start=1) if raw.strip()]
    if len(lines) != len(rows):   # a line pyarrow and Python disagree is blank: the exact path
        return _jsonl_lines(path)
    return zip(lines, rows, itertools.repeat(None))


def file_format(path: str) -> str:
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "meta.json")):
            return "tokens"
        raise DatasetError(f"{path}: a directory without meta.json; give a .jsonl, .json or .parquet file, or a "
                           "token file directory written by `python -m rl.data convert`")
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: no such file; give the path of a .jsonl, .json or .parquet prompt dataset")
    ext = os.path.splitext(path)[1].lower()
    if ext in (".parquet", ".pq"):
        return "parquet"
    if ext in (".jsonl", ".ndjson"):
        return "jsonl"
    if ext == ".json":
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
        return "json" if head.startswith(b"[") else "jsonl"
    raise DatasetError(f"{path}: unknown dataset format {ext or '(no extension)'!r}; use .jsonl, .json or .parquet")
