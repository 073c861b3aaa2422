"""Arithmetic word-free problems with a held-out split, for a real small instruct model to learn.

    python examples/smollm2_arithmetic/make_arithmetic.py OUT_DIR [--seed 0] [--num-val 500] [--num-train 0] [--parquet]

Writes OUT_DIR/train.jsonl and OUT_DIR/val.jsonl (and .parquet beside them with --parquet), one
row per problem: {"prompt": [{"role": "user", "content": "What is 47 + 38? ..."}],
"answer": "85", "data_source": "arithmetic"}: a chat prompt the policy's template renders, the
answer rl/reward/reward_fn.py's math_reward checks. Deterministic: the same seed gives the same files,
byte for byte. The two splits never share a problem (the pair of operands and the operator).

Why this task: a verifiable task needs a base accuracy that is low but not zero, so GRPO's groups
see some correct answers to learn from, and room to at least double. 2-digit addition and
subtraction (a, b in 10..99, a >= b for subtraction so answers are never negative) is within
reach of a 135M model: it gets some right and misses carries and borrows. Measured here
(SmolLM2-135M-Instruct, greedy, its chat template, the first 200 held-out problems of seed 0, at
most 32 new tokens, CPU): 8.0% correct (the same under math_reward); 60% of the responses hit the
32-token cap: despite "Answer with only the number." the model often explains ("To solve this,
we need to combine ..."), so with a larger cap it scores somewhat more (the shared notes give
~15% without the instruction and a larger cap). What GRPO can gain is then both arithmetic and
answering briefly; the held-out judge (examples/smollm2_arithmetic/heldout.py) scores only the last number of the
response, whatever its format, so a format alone earns nothing. \\boxed{} is not asked for: the
base model never writes it (0% in it), and a reward that needs a box trains the format first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

INSTRUCTION = "Answer with only the number."
DATA_SOURCE = "arithmetic"


def all_problems(low: int = 10, high: int = 99) -> list[tuple[int, str, int]]:
    """Every (a, op, b): a + b for all a, b in [low, high]; a - b for a >= b."""
    problems = [(a, "+", b) for a in range(low, high + 1) for b in range(low, high + 1)]
    problems += [(a, "-", b) for a in range(low, high + 1) for b in range(low, a + 1)]
    return problems


def row(a: int, op: str, b: int) -> dict:
    value = a + b if op == "+" else a - b
    content = f"What is {a} {op} {b}? {INSTRUCTION}"
    return {"prompt": [{"role": "user", "content": content}], "answer": str(value), "data_source": DATA_SOURCE}


def make_splits(seed: int, num_val: int, num_train: int = 0) -> tuple[list[dict], list[dict]]:
    """(train rows, val rows): the problems shuffled by `seed`, the first num_val held out; train
    is the rest (num_train > 0: its first num_train)."""
    problems = all_problems()
    if num_val >= len(problems):
        raise ValueError(f"--num-val {num_val}: there are only {len(problems)} problems")
    random.Random(seed).shuffle(problems)
    val, train = problems[:num_val], problems[num_val:]
    if num_train:
        if num_train > len(train):
            raise ValueError(f"--num-train {num_train}: only {len(train)} problems are left after the held-out split")
        train = train[:num_train]
    return [row(*p) for p in train], [row(*p) for p in val]


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def write_parquet(path: str, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-val", type=int, default=500, help="held-out problems")
    p.add_argument("--num-train", type=int, default=0, help="training problems (0 = all the others)")
    p.add_argument("--parquet", action="store_true", help="also write train.parquet and val.parquet (pyarrow)")
    args = p.parse_args()
    try:
        train, val = make_splits(args.seed, args.num_val, args.num_train)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    for name, rows in (("train", train), ("val", val)):
        write_jsonl(os.path.join(args.out_dir, f"{name}.jsonl"), rows)
        if args.parquet:
            write_parquet(os.path.join(args.out_dir, f"{name}.parquet"), rows)
    print(f"wrote {len(train)} training and {len(val)} held-out problems to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
