"""Memory-mapped token files: a prompt dataset rendered and tokenized once (rl/data/prompts.py reads the
files these come from; `python -m rl.data convert` writes these).

`python -m rl.data convert data.parquet out_dir --tokenizer DIR` writes the prompts,
rendered and tokenized once, as tokens.npy (int32, every prompt's ids back to back), offsets.npy
(int64, prompt i is tokens[offsets[i]:offsets[i + 1]]), records.bin + record_offsets.npy (each
prompt's text and fields as JSON) and meta.json (the tokenizer's path and the hashes of its
tokenizer.json and chat template, the rendering settings, counts). Opening one maps the arrays
(numpy mmap): nothing is parsed or tokenized until a prompt is sent. bench/data_load.py measures it.

open_prompts(path, ...) opens any dataset setting's file: a token file is mapped, any other file is
read, rendered and tokenized now (rl/data/prompts.py). It lives here, above both, so that the
prompt reader needs no import of the token files.
"""

from __future__ import annotations

import argparse
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
from rl.data.prompts import RENDER_KEYS, DataConfig, DatasetError, EncodedPrompts, encode_prompts, load_prompts

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


def convert(source: str, out_dir: str, tokenizer_dir: str, cfg: DataConfig) -> dict:
    """Read, render and tokenize `source` once into the token file `out_dir`; returns its meta."""
    from rl.data.policy import PolicySpec, load_tokenizer

    tokenizer = load_tokenizer(PolicySpec(path=tokenizer_dir))
    encoded = encode_prompts(load_prompts(source, cfg, "convert"), tokenizer, tokenizer_dir, cfg, "convert")
    meta = {"source": os.path.abspath(source), "tokenizer": tokenizer_fingerprint(tokenizer, tokenizer_dir),
            "settings": {k: getattr(cfg, k) for k in RENDER_KEYS},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    save_token_file(encoded, out_dir, meta)
    return {**meta, "num_prompts": len(encoded), "skipped": encoded.skipped, "truncated": encoded.truncated}


# ---------------------------------------------------------------------------------------------
# Opening any dataset; the converter's command line
# ---------------------------------------------------------------------------------------------

def open_prompts(path: str, cfg=None, tokenizer=None, tokenizer_dir: str = "",
                 setting: str = "prompts") -> EncodedPrompts:
    """A dataset ready to send, from a file (read, rendered, tokenized now) or a token file
    (mapped). The entry point for every dataset setting (training prompts, validation files)."""
    cfg = cfg or DataConfig()
    if file_format(path) == "tokens":
        return open_token_file(path, tokenizer, tokenizer_dir, cfg, setting)
    return encode_prompts(load_prompts(path, cfg, setting), tokenizer, tokenizer_dir, cfg, setting)


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
