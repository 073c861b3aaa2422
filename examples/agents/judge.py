"""The held-out judge of the two agent tasks: episodes played with the HF model, success by its own rule.

    python examples/agents/judge.py MODEL_DIR DATA/calculator/val.jsonl --task calculator [--limit 200]
    python examples/agents/judge.py MODEL_DIR DATA/guess/val.jsonl --task guess
    python examples/agents/judge.py MODEL_DIR DATA/calculator_no_tool/val.jsonl --task calculator --single-turn
    ... --samples 2 --temperature 0.8     # sampled episodes instead of greedy (the base rates)

Greedy by default (as examples/smollm2_arithmetic/heldout.py), on CPU or GPU. Episodes are rl/agent's Episode runner
with the settings of TASKS (the same file, chat, tool listing and observation tokens the engine
trains on); the judge only decodes: every live episode's ids (prompt, then sampled and
environment ids) as one left-padded batch per turn, each turn stopping at the end-of-turn token or
its token limit. Single-turn (--single-turn, the baselines' rows) decodes the prompt once.

Success, judged from the chat, not from any reward:
  calculator: the last assistant message has no tool call and its last number is the product
    (a tool result alone earns nothing: an episode cut off after a call fails);
  guess: some guess (the first whole number of an assistant message) is the secret.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from guess_env import first_integer  # noqa: E402

# env.* settings of each task: what graphs/agent.py is run with (README.md) and what the judge plays.
TASKS = {
    "calculator": dict(path=str(HERE / "calculator.py"), tools=["calculator"], reward="function", max_turns=3,
                       max_turn_tokens=64, max_episode_tokens=512),
    "guess": dict(path=str(HERE / "guess_env.py"), name="GuessingGame", reward="env", max_turns=7,
                  max_turn_tokens=16, max_episode_tokens=512),
}
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def success(task: str, messages: list[dict], row: dict) -> bool:
    said = [m["content"] for m in messages if m["role"] == "assistant"]
    if task == "guess":
        return any(first_integer(text) == int(row["secret"]) for text in said)
    if not said or messages[-1]["role"] != "assistant" or "<tool_call>" in said[-1]:
        return False
    pred = last_number(said[-1])
    return pred is not None and float(pred) == float(row["answer"])


def decode_batch(model, tokenizer, sequences: list[list[int]], limits: list[int], stop_ids, temperature: float):
    """One turn for each sequence: (sampled ids up to and with the first stop id, stopped) pairs."""
    import torch
    device = next(model.parameters()).device
    width = max(map(len, sequences))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences], device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
        else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(limits),
                             eos_token_id=sorted(stop_ids), pad_token_id=pad, **sampling)
    turns = []
    for row, limit in zip(out[:, width:].tolist(), limits):
        row = row[:limit]
        stop = next((i for i, t in enumerate(row) if t in stop_ids), None)
        turns.append((row[:stop + 1], True) if stop is not None else (row, False))
    return turns


async def play(model, tokenizer, rows: list[dict], task: str, samples: int, temperature: float, batch: int,
               settings: dict) -> list[dict]:
    """Every row's episodes to the end through rl/agent: [{"messages", "turns", "counters", ...}]."""
    from rl.agent.config import EnvConfig
    from rl.agent.loading import load_environment
    factory = load_environment(EnvConfig(**settings), tokenizer)
    try:
        episodes = [(factory.episode(dict(r)), r) for r in rows for _ in range(samples)]
        await asyncio.gather(*(ep.start() for ep, _ in episodes))
        while live := [(ep, r) for ep, r in episodes if not ep.done]:
            for start in range(0, len(live), batch):
                chunk = live[start:start + batch]
                seqs = [ep.prompt_ids + ep.response_ids for ep, _ in chunk]
                limits = [ep.turn_token_limit(settings["max_turn_tokens"]) for ep, _ in chunk]
                t = time.perf_counter()
                turns = decode_batch(model, tokenizer, seqs, limits, factory.stop_ids, temperature)
                print(f"judge: {len(chunk)} of {len(live)} live episodes decoded a turn in "
                      f"{time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
                await asyncio.gather(*(ep.step(ids, stopped) for (ep, _), (ids, stopped) in zip(chunk, turns)))
        return [{"row": r, **vars(ep.result())} for ep, r in episodes]
    finally:
        factory.close()


def single_turn(model, tokenizer, rows: list[dict], samples: int, temperature: float, batch: int,
                max_new_tokens: int) -> list[dict]:
    """One response per episode from the rendered prompt: the baselines without tool or feedback."""
    stop = {tokenizer.eos_token_id}
    out = []
    jobs = [r for r in rows for _ in range(samples)]
    for start in range(0, len(jobs), batch):
        chunk = jobs[start:start + batch]
        seqs = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                              return_dict=False) for r in chunk]
        for r, (ids, _) in zip(chunk, decode_batch(model, tokenizer, seqs, [max_new_tokens] * len(chunk), stop,
                                                   temperature)):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            out.append({"row": r, "messages": list(r["prompt"]) + [{"role": "assistant", "content": text}],
                        "turns": 1, "counters": {}, "failed": None, "response_ids": ids})
    return out


def judge(model, tokenizer, rows: list[dict], task: str, *, single: bool = False, samples: int = 1,
          temperature: float = 0.0, batch: int = 64, seed: int = 0, **overrides) -> dict:
    """Success rate of `model` on `rows`, each played `samples` times: {"success", "wins", "n", ...}."""
    import torch
    if task not in TASKS:
        raise ValueError(f"task {task!r}: one of {sorted(TASKS)}")
    torch.manual_seed(seed)
    settings = {**TASKS[task], **{k: v for k, v in overrides.items() if v}}
    t0 = time.perf_counter()
    if single:
        played = single_turn(model, tokenizer, rows, samples, temperature, batch, settings["max_turn_tokens"])
    else:
        played = asyncio.run(play(model, tokenizer, rows, task, samples, temperature, batch, settings))
    wins = [success(task, p["messages"], p["row"]) for p in played]
    counters: dict[str, int] = {}
    for p in played:
        for k, v in p["counters"].items():
            counters[k] = counters.get(k, 0) + v
    return {"task": task, "single_turn": single, "success": sum(wins) / len(wins), "wins": sum(wins),
            "n": len(played), "temperature": temperature, "settings": settings,
            "mean_turns": sum(p["turns"] for p in played) / len(played),
            "sampled_and_env_tokens": sum(len(p["response_ids"]) for p in played),
            "failed": sum(p["failed"] is not None for p in played), "counters": counters,
            "judge_s": time.perf_counter() - t0,
            "examples": [{"messages": p["messages"][-6:], "success": w} for p, w in list(zip(played, wins))[:8]]}


def read_rows(path: str, limit: int = 0) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


def load_model(path: str, device: str, dtype_name: str = ""):
    """bf16 on a GPU, fp32 on CPU unless dtype_name says ("bf16" on CPU shows what a GPU run sees:
    a weight change below bf16's resolution vanishes there)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        dtype_name, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(device).eval(), tokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("data")
    p.add_argument("--task", choices=sorted(TASKS), required=True)
    p.add_argument("--single-turn", action="store_true", help="the baselines' rows: one response, no env")
    p.add_argument("--limit", type=int, default=0, help="first N rows (0 = all)")
    p.add_argument("--samples", type=int, default=1, help="episodes per row")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the held-out judge)")
    p.add_argument("--max-turns", type=int, default=0, help="0 = the task's (TASKS)")
    p.add_argument("--max-turn-tokens", type=int, default=0, help="0 = the task's (TASKS)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="")
    p.add_argument("--dtype", choices=["", "bf16", "fp32"], default="", help="default: bf16 on a GPU, fp32 on CPU")
    p.add_argument("--out", default="", help="write the result (with example episodes) as JSON here")
    args = p.parse_args()
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, device, args.dtype)
    result = judge(model, tokenizer, read_rows(args.data, args.limit), args.task, single=args.single_turn,
                   samples=args.samples, temperature=args.temperature, batch=args.batch, seed=args.seed,
                   max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens)
    for ex in result["examples"][:4]:
        print(("WIN  " if ex["success"] else "LOSS ") + " | ".join(
            f"{m['role']}: {m['content'][-80:]!r}" for m in ex["messages"][-5:]))
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
