"""Benchmark: how long a dataset of N chat prompts takes to be ready to send, from JSONL vs from a
memory-mapped token file (rl/data/prompts.py).

    .venv/bin/python bench/data_load.py [--num 1000000] [--dir /tmp/data_load]

Data: N verl-layout rows ({"data_source", "prompt": [one user message], "reward_model":
{"ground_truth"}, "extra_info"}), prompts like "what is 123 + 456 ?", written once as JSONL and
parquet. Tokenizer: a byte-level BPE (vocab 4096) trained here on the first 20k prompts, with a
ChatML template (no hub). Measured, each once, in this process:
  parse JSONL          rl.data.prompts.load_prompts (pyarrow), rows only
  parse parquet        the same from parquet
  ready from JSONL     rl.data.token_file.open_prompts: parse + render the chat template + tokenize (what
                       the prompt source does at setup without a token file)
  convert              python -m rl.data convert's work, once: parquet -> token file
  ready from tokens    open_prompts on the token file (maps arrays; nothing parsed)
  then 10k random prompt messages from each (what the source does per prompt it sends).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from rl.data import prompts as data  # noqa: E402
from rl.data.token_file import convert, open_prompts  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_rows(n: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, b = rng.randrange(1000), rng.randrange(1000)
        rows.append({"data_source": "bench/add", "prompt": [{"role": "user", "content": f"what is {a} + {b} ? "
                                                                                        "answer in \\boxed{}."}],
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"index": i, "split": "train"}})
    return rows


def make_tokenizer(rows: list[dict], out_dir: str) -> None:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator((r["prompt"][0]["content"] for r in rows[:20000]), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    tok.chat_template = CHATML
    tok.save_pretrained(out_dir)


def timed(label: str, fn, results: dict):
    t = time.perf_counter()
    out = fn()
    results[label] = time.perf_counter() - t
    print(f"{label:24s} {results[label]:8.2f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num", type=int, default=1_000_000)
    ap.add_argument("--dir", default="/tmp/data_load")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    jsonl, parquet = os.path.join(args.dir, "d.jsonl"), os.path.join(args.dir, "d.parquet")
    tok_dir, token_file = os.path.join(args.dir, "tokenizer"), os.path.join(args.dir, "tokens")
    rows = make_rows(args.num)
    with open(jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    make_tokenizer(rows, tok_dir)
    del rows
    from rl.data.policy import PolicySpec, load_tokenizer
    tokenizer = load_tokenizer(PolicySpec(path=tok_dir))
    print(f"{args.num} prompts: JSONL {os.path.getsize(jsonl) / 2**20:.0f} MiB, "
          f"parquet {os.path.getsize(parquet) / 2**20:.0f} MiB", flush=True)

    r: dict = {}
    timed("parse JSONL", lambda: data.load_prompts(jsonl), r)
    timed("parse parquet", lambda: data.load_prompts(parquet), r)
    ready = timed("ready from JSONL", lambda: open_prompts(jsonl, None, tokenizer, tok_dir), r)
    timed("convert (once)", lambda: convert(parquet, token_file, tok_dir, data.DataConfig()), r)
    mapped = timed("ready from tokens", lambda: token_file.open_prompts(token_file, None, tokenizer, tok_dir), r)
    picks = random.Random(1).sample(range(args.num), 10_000)
    for name, ds in (("JSONL", ready), ("tokens", mapped)):
        t = time.perf_counter()
        messages = [ds.message(i) for i in picks]
        print(f"10k messages ({name:6s})  {(time.perf_counter() - t) / len(picks) * 1e6:8.1f} us each", flush=True)
    assert messages == [ready.message(i) for i in picks]     # the same prompts either way
    size = sum(os.path.getsize(os.path.join(token_file, f)) for f in os.listdir(token_file))
    print(f"token file {size / 2**20:.0f} MiB, {int(mapped.offsets[-1]) / args.num:.1f} tokens per prompt; "
          f"ready from tokens {r['ready from JSONL'] / r['ready from tokens']:.0f}x faster than from JSONL")


if __name__ == "__main__":
    main()
