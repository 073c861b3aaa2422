"""Memory-mapped token files: a prompt dataset rendered and tokenized once (rl/data/prompts.py reads the
files these come from; `python -m rl.data convert` writes these).

`python -m rl.data convert data.parquet out_dir --tokenizer DIR` writes the prompts,
rendered and tokenized once, as tokens.npy (int32, every prompt's ids back to back), offsets.npy
(int64, prompt i is tokens[offsets[i]:offsets[i + 1]]), records.bin + record_offsets.npy (each
prompt's text and fields as JSON) and meta.json (the tokenizer's path and the hashes of its
tokenizer.json and chat template, the rendering settings, counts). Opening one maps the arrays
(numpy mmap): nothing is parsed or tokenized until a prompt is sent. bench/data_load.py measures it.

open_prompts(path, ...) opens any dataset setting's file: a token file is mapped, any other file is
read, rendered and tokenized (rl/data/prompts.py) once and kept as a token file in the prompt cache
(encode_cached, below), which later reads map. It lives here, above both, so that the prompt reader
needs no import of the token files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Sequence

import numpy as np

from dataflow.errors import UserError
from rl.data.files import file_format
from rl.data.prompts import (RENDER_KEYS, DataConfig, DatasetError, EncodedPrompts, Prompts, encode_prompts,
                             load_prompts)

TOKEN_FILE_FORMAT = "dataflow-prompt-tokens/1"


def tokenizer_fingerprint(tokenizer, tokenizer_dir: str) -> dict:
    """What a token file was made with: the tokenizer dir, hashes of its tokenizer.json and chat template."""
    def sha(data: bytes | None):
        return hashlib.sha256(data).hexdigest() if data is not None else None

    tokenizer_json = os.path.join(tokenizer_dir, "tokenizer.json")
    with open(tokenizer_json, "rb") as f:
        data = f.read()
    template = getattr(tokenizer, "chat_template", None)
    return {"path": os.path.abspath(tokenizer_dir), "tokenizer_json_sha256": sha(data),
            "chat_template_sha256": sha(template.encode()) if isinstance(template, str) else None,
            "vocab_size": len(tokenizer)}


def save_token_file(encoded: EncodedPrompts, out_dir: str, meta: dict) -> None:
    """Write `encoded` as a token file directory (module docstring)."""
    os.makedirs(out_dir, exist_ok=True)
    np.save(os.path.join(out_dir, "tokens.npy"), encoded.tokens)
    np.save(os.path.join(out_dir, "offsets.npy"), encoded.offsets)
    blobs = [json.dumps(record, ensure_ascii=False).encode() for record in encoded.records]
    record_offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=record_offsets[1:])
    with open(os.path.join(out_dir, "records.bin"), "wb") as f:
        f.write(b"".join(blobs))
    np.save(os.path.join(out_dir, "record_offsets.npy"), record_offsets)
    meta = {"format": TOKEN_FILE_FORMAT, "num_prompts": len(encoded), "num_tokens": int(len(encoded.tokens)),
            "skipped": encoded.skipped, "truncated": encoded.truncated, **meta}
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


class _Records(Sequence):
    """records[i] = (text, fields), parsed from a memory-mapped JSON blob only when asked for."""

    def __init__(self, blob, offsets):
        self.blob, self.offsets = blob, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int):
        text, fields = json.loads(self.blob[self.offsets[i]:self.offsets[i + 1]].tobytes())
        return text, fields


def open_token_file(path: str, tokenizer=None, tokenizer_dir: str = "", cfg=None,
                    setting: str = "prompts") -> EncodedPrompts:
    """Map a token file. Given the policy's tokenizer, checks it is the one the file was made with;
    rendering settings in `cfg` that differ from the file's are an error (they were applied then)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("format") != TOKEN_FILE_FORMAT:
        raise DatasetError(f"{path}/meta.json: not a token file of this version ({meta.get('format')!r}); "
                           "convert the dataset again with python -m rl.data convert")
    redo = f"convert again: python -m rl.data convert {meta.get('source', 'DATA')} {path} --tokenizer DIR"
    if tokenizer is not None and tokenizer_dir:
        now, then = tokenizer_fingerprint(tokenizer, tokenizer_dir), meta["tokenizer"]
        for key in ("tokenizer_json_sha256", "chat_template_sha256", "vocab_size"):
            if now[key] != then[key]:
                raise DatasetError(f"{path}: made with the tokenizer at {then['path']}, whose {key} differs from "
                                   f"the policy's ({tokenizer_dir}); {redo}")
    defaults = DataConfig()
    for key in RENDER_KEYS if cfg is not None else ():
        value = getattr(cfg, key, getattr(defaults, key))
        if value != getattr(defaults, key) and value != meta["settings"][key]:
            raise DatasetError(f"{path}: {key}={value!r} is set, but the token file was made with "
                               f"{meta['settings'][key]!r}; {redo} (with that setting)")
    load = lambda name: np.load(os.path.join(path, name), mmap_mode="r")  # noqa: E731
    blob = np.memmap(os.path.join(path, "records.bin"), dtype=np.uint8, mode="r") \
        if os.path.getsize(os.path.join(path, "records.bin")) else np.zeros(0, np.uint8)
    return EncodedPrompts(load("tokens.npy"), load("offsets.npy"), _Records(blob, load("record_offsets.npy")),
                          skipped=meta["skipped"], truncated=meta["truncated"], source=path)


def _made_from(source: str, tokenizer, tokenizer_dir: str, cfg) -> dict:
    """A token file's meta besides its counts: the source, the tokenizer's fingerprint, the rendering settings."""
    return {"source": os.path.abspath(source), "tokenizer": tokenizer_fingerprint(tokenizer, tokenizer_dir),
            "settings": _settings(cfg, RENDER_KEYS), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _settings(cfg, keys) -> dict:
    """cfg's values of `keys` (DataConfig's default where cfg lacks one)."""
    defaults = DataConfig()
    return {k: getattr(cfg, k, getattr(defaults, k)) for k in keys}


def convert(source: str, out_dir: str, tokenizer_dir: str, cfg: DataConfig) -> dict:
    """Read, render and tokenize `source` once into the token file `out_dir`; returns its meta."""
    from rl.data.policy import PolicySpec, load_tokenizer

    tokenizer = load_tokenizer(PolicySpec(path=tokenizer_dir))
    encoded = encode_prompts(load_prompts(source, cfg, "convert"), tokenizer, tokenizer_dir, cfg, "convert")
    meta = _made_from(source, tokenizer, tokenizer_dir, cfg)
    save_token_file(encoded, out_dir, meta)
    return {**meta, "num_prompts": len(encoded), "skipped": encoded.skipped, "truncated": encoded.truncated}


# ---------------------------------------------------------------------------------------------
# Opening any dataset; the converter's command line
# ---------------------------------------------------------------------------------------------

def open_prompts(path: str, cfg=None, tokenizer=None, tokenizer_dir: str = "",
                 setting: str = "prompts") -> EncodedPrompts:
    """A dataset ready to send, from a file (read, rendered, tokenized now, or found in the prompt
    cache) or a token file (mapped). The entry point for every dataset setting (training prompts,
    validation files)."""
    cfg = cfg or DataConfig()
    if file_format(path) == "tokens":
        return open_token_file(path, tokenizer, tokenizer_dir, cfg, setting)
    return encode_cached(path, cfg, tokenizer, tokenizer_dir, setting)[0]


# ---------------------------------------------------------------------------------------------
# The prompt cache: a JSONL/JSON/parquet dataset's token file, made on first use
# ---------------------------------------------------------------------------------------------
# A dataset is read, rendered and tokenized in the driver's input checks (rl/preflight.py), then
# again in the prompt source's set-up, and again in the next run: seconds per 20,000 chat rows,
# minutes for millions. The first read writes the result as a token file under the cache, keyed by
# the file's bytes (sha256), the tokenizer's fingerprint and the rendering settings (as Hugging Face
# datasets keys its map() results by a fingerprint); the later reads map it.

CACHE_VERSION = 1
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
CACHE_MAX_BYTES = int(float(os.environ.get("DATAFLOW_PROMPT_CACHE_GB", "20")) * 2**30)
"""Entries beyond this ($DATAFLOW_PROMPT_CACHE_GB, 20 by default) go, least recently used first."""


def cache_root() -> str:
    """$DATAFLOW_PROMPT_CACHE, else ~/.cache/dataflow/prompts (under $XDG_CACHE_HOME); "" turns the cache off."""
    root = os.environ.get("DATAFLOW_PROMPT_CACHE")
    if root is not None:
        return root
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dataflow", "prompts")


def _cache_entry(path: str, cfg, tokenizer, tokenizer_dir: str) -> str | None:
    """The cache directory of this file read with these settings and tokenizer; None: not cached
    (cache off, no tokenizer: nothing to tokenize, or no tokenizer.json to fingerprint)."""
    root = cache_root()
    if not root or tokenizer is None or not tokenizer_dir:
        return None
    try:
        content = hashlib.sha256()
        with open(path, "rb") as f:   # the bytes, not the mtime: a file rewritten within the clock's tick is seen
            while chunk := f.read(1 << 24):
                content.update(chunk)
        fingerprint = tokenizer_fingerprint(tokenizer, tokenizer_dir)
        # and the files that change how it tokenizes besides tokenizer.json (add_bos_token, added tokens)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer_dir, name)):
                with open(os.path.join(tokenizer_dir, name), "rb") as f:
                    fingerprint[name] = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None
    key = {"format": TOKEN_FILE_FORMAT, "cache": CACHE_VERSION, "content_sha256": content.hexdigest(),
           "tokenizer": fingerprint, "settings": _settings(cfg, (*RENDER_KEYS, "skip_bad_lines"))}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()[:32]
    return os.path.join(root, digest)


def encode_cached(path: str, cfg, tokenizer, tokenizer_dir: str = "", setting: str = "prompts"):
    """(encoded prompts, where(i)) of a JSONL/JSON/parquet file: from the cache, or read, rendered and
    tokenized (encode_prompts(load_prompts(...)): a bad row raises as there) and then cached.
    where(i) names record i's row as load_prompts' messages do ("usable row i" where rendering
    dropped rows)."""
    entry = _cache_entry(path, cfg, tokenizer, tokenizer_dir)
    if entry is not None and os.path.isfile(os.path.join(entry, "meta.json")):
        try:   # no tokenizer or settings check in opening it: the entry's key holds both
            encoded = open_token_file(entry)
            with open(os.path.join(entry, "meta.json")) as f:
                by_line = json.load(f)["by_line"]
            positions = np.load(os.path.join(entry, "positions.npy"), mmap_mode="r")
            with contextlib.suppress(OSError):   # used now: the last to go when pruned (a read-only cache still serves)
                os.utime(entry)
            return encoded, _where_fn(path, by_line, positions)
        except (OSError, ValueError, KeyError, DatasetError):
            pass    # a damaged entry: read the file again and replace it
    rows = load_prompts(path, cfg, setting)
    encoded = encode_prompts(rows, tokenizer, tokenizer_dir, cfg, setting)
    positions = rows.positions if len(encoded) == len(rows) else None   # else rendering dropped rows: positions shift
    if entry is not None:
        _save_entry(entry, encoded, rows.by_line, positions, cfg, tokenizer, tokenizer_dir, path)
    return encoded, _where_fn(path, rows.by_line, positions)


def _prune(root: str, keep: str) -> None:
    """Remove the least recently used entries while the cache holds more than CACHE_MAX_BYTES."""
    import shutil

    entries = []
    for name in os.listdir(root):
        where = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(where):
            continue
        size = sum(e.stat().st_size for e in os.scandir(where) if e.is_file())
        entries.append((os.stat(where).st_mtime, size, where))
    total = sum(size for _, size, _ in entries)
    for _, size, where in sorted(entries):
        if total <= CACHE_MAX_BYTES:
            break
        if where != keep:
            shutil.rmtree(where, ignore_errors=True)
            total -= size


def _where_fn(path: str, by_line: bool, positions):
    if positions is None or len(positions) == 0:
        return lambda i: f"{path} usable row {i}"
    return Prompts(path, by_line, positions=positions).where


def _save_entry(entry: str, encoded: EncodedPrompts, by_line: bool, positions, cfg, tokenizer,
                tokenizer_dir: str, source: str) -> None:
    """Write the entry beside it and rename it into place (a concurrent run's equal entry wins);
    a cache that cannot be written (read-only, full, fields JSON cannot hold) is skipped."""
    import shutil
    import tempfile

    tmp = None
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".writing-", dir=os.path.dirname(entry))
        save_token_file(encoded, tmp, {**_made_from(source, tokenizer, tokenizer_dir, cfg), "by_line": by_line})
        np.save(os.path.join(tmp, "positions.npy"), np.asarray(positions if positions is not None else [], np.int64))
        os.rename(tmp, entry)
        tmp = None
        _prune(os.path.dirname(entry), keep=entry)
    except (OSError, TypeError, ValueError):
        pass
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert", help="render and tokenize a dataset once into a memory-mapped token file")
    p.add_argument("source", help=".jsonl, .json or .parquet file")
    p.add_argument("out_dir")
    p.add_argument("--tokenizer", required=True, help="the policy's model directory (its tokenizer.json)")
    for f in dataclasses.fields(DataConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=int if f.type in ("int", int) else str, default=f.default)
    args = parser.parse_args(argv)
    cfg = DataConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DataConfig)})
    if cfg.truncation not in ("error", "left", "right"):
        parser.error(f"--truncation {cfg.truncation!r}: use error, left or right")
    try:
        meta = convert(args.source, args.out_dir, args.tokenizer, cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out_dir}: {meta['num_prompts']} prompts ({meta['skipped']} skipped, {meta['truncated']} "
          f"truncated) from {args.source}")
    return 0


if __name__ == "__main__":   # python -m rl.data.token_file; rl/data/__main__.py runs it as python -m rl.data
    sys.exit(main())
