"""The two agent tasks' data: prompts, answers and their train / held-out splits.

    python examples/agents/tasks.py OUT_DIR [--seed 0] [--num-val 500]

Writes OUT_DIR/calculator/{train,val}.jsonl and OUT_DIR/guess/{train,val}.jsonl; deterministic
(the same seed gives the same bytes); the two splits of a task never share a problem.

calculator: "What is 347 * 68?" (a 3-digit times a 2-digit number, 100..999 x 10..99). The rows'
  prompt is a chat that already holds one solved question: [system, user "What is 123 * 45?",
  assistant (the calculator call), user (the tool's result), assistant (the answer), user (the
  question)]. The engine appends the tool's listing to the system message (SmolLM2's chat template
  has no tools section, so the tool reaches the model in the system prompt, as issue 36 asks).
  Why a solved turn in the chat: a 135M model never copied a call shown only in the system prompt
  (README.md, base rates), and copies what it sees itself do in the conversation.
  The single-turn baseline's rows (calculator_no_tool) say nothing of a tool.
guess: a secret number in 1..100 and the game's opening message (guess_env.GuessingGame.reset
  writes the same text); `--no-feedback` baseline rows allow one guess.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from guess_env import GuessingGame  # noqa: E402

# The rows' system message: a worked call in the exact format. The engine appends the tool listing
# (rl/agent/tools.py: schema from calculator()'s type hints and docstring, in the words Qwen2.5's
# template uses) since SmolLM2's template has no tools section. A 135M model copies a shown call far
# more often than it follows a described format (README.md: the measured base rates).
EXAMPLE_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 45"}}\n</tool_call>'
TOOL_SYSTEM = ("You are a helpful assistant with a calculator. To multiply, call the calculator first, "
               f"for example:\n{EXAMPLE_CALL}\nThe result comes back to you. Then answer with the number.")
CALC_QUESTION = "What is {a} * {b}?"
# The solved question every calculator row's chat starts with; the tool's result is written as the
# engine writes it for a template without tools (rl/agent/tools.result_messages).
SOLVED = [{"role": "user", "content": CALC_QUESTION.format(a=123, b=45)},
          {"role": "assistant", "content": EXAMPLE_CALL},
          {"role": "user", "content": "<tool_response>\n5535\n</tool_response>"},
          {"role": "assistant", "content": "123 * 45 = 5535"}]
NO_TOOL_SUFFIX = " Answer with only the number."


def calculator_row(a: int, b: int, tools: bool = True) -> dict:
    question = CALC_QUESTION.format(a=a, b=b)
    prompt = ([{"role": "system", "content": TOOL_SYSTEM}, *SOLVED, {"role": "user", "content": question}] if tools
              else [{"role": "user", "content": question + NO_TOOL_SUFFIX}])
    return {"prompt": prompt, "answer": str(a * b), "data_source": "calculator" if tools else "calculator_no_tool"}


def guess_row(secret: int, feedback: bool = True) -> dict:
    game = GuessingGame(max_guesses=7 if feedback else 1)
    text = game.reset(secret=secret)
    return {"prompt": [{"role": "user", "content": text}], "secret": secret, "answer": str(secret),
            "data_source": "guess" if feedback else "guess_one_shot"}


def calculator_splits(seed: int, num_val: int, num_train: int, tools: bool = True) -> tuple[list, list]:
    rng = random.Random(seed)
    pairs = rng.sample([(a, b) for a in range(100, 1000) for b in range(10, 100) if (a, b) != (123, 45)],
                       num_val + num_train)   # the solved question is never asked
    return ([calculator_row(a, b, tools) for a, b in pairs[num_val:]],
            [calculator_row(a, b, tools) for a, b in pairs[:num_val]])


def guess_splits(seed: int, num_val: int, num_train: int, feedback: bool = True) -> tuple[list, list]:
    """Secrets are drawn with replacement (only 100 exist): train and held-out differ by seed, not by
    number; what is held out is the episode, which the policy meets fresh."""
    rng = random.Random(seed + 1)
    secrets = [rng.randint(1, 100) for _ in range(num_val + num_train)]
    return ([guess_row(s, feedback) for s in secrets[num_val:]], [guess_row(s, feedback) for s in secrets[:num_val]])


def write_jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def write_all(out_dir: str, seed: int = 0, num_val: int = 500, num_train: int = 20000) -> dict[str, tuple[str, str]]:
    """Both tasks and both baselines under out_dir; returns {name: (train path, val path)}."""
    made = {}
    for name, (train, val) in {
            "calculator": calculator_splits(seed, num_val, num_train),
            "calculator_no_tool": calculator_splits(seed, num_val, num_train, tools=False),
            "guess": guess_splits(seed, num_val, num_train),
            "guess_one_shot": guess_splits(seed, num_val, num_train, feedback=False)}.items():
        paths = (os.path.join(out_dir, name, "train.jsonl"), os.path.join(out_dir, name, "val.jsonl"))
        write_jsonl(paths[0], train)
        write_jsonl(paths[1], val)
        made[name] = paths
    return made


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-val", type=int, default=500)
    p.add_argument("--num-train", type=int, default=20000)
    args = p.parse_args()
    for name, (train, val) in write_all(args.out_dir, args.seed, args.num_val, args.num_train).items():
        print(f"{name}: {train}, {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
