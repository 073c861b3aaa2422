"""A short supervised warm start for the calculator task: demonstration episodes played through
rl/agent, the model trained on their sampled positions only, saved as a model directory.

    python examples/agents/warm_start.py MODEL DATA/calculator/train.jsonl OUT_DIR [--examples 64]
        [--epochs 1] [--lr 1e-5] [--batch 8] [--device cuda]

Why: SmolLM2-135M-Instruct never wrote a calculator call in 256 sampled episodes, even with a solved
question in the chat (README.md), so GRPO had nothing to reinforce; issue 36 allows a short
supervised warm start on demonstrations. Kept short on purpose (few examples, one epoch): the RL run
should start from a model that calls the tool sometimes, not one that already solves the task.
Size it in bf16, the precision a GPU run decodes in (judge.py --dtype bf16): a change below bf16's
resolution vanishes there (bench/results/agent_warm_start_cpu_2026-12-04b.md).

Each demonstration is an episode of the engine's own tool environment (env.tools=[calculator],
judge.TASKS) with the model's turns written, not sampled: the right call, then the answer with the
tool's result. So the ids are exactly those an RL episode has (the first render with the tool
listing, the observation tokens of the template's delta) and the loss covers exactly the tokens an
RL episode would train (its loss mask). Rows are taken from the end of the file, which the RL runs
(a few thousand prompts) do not reach.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import judge as J  # noqa: E402
from tasks import EXAMPLE_CALL  # noqa: E402

_QUESTION = re.compile(r"What is (\d+) \* (\d+)\?")


def demonstration_turns(row: dict) -> tuple[str, str]:
    """(the call, the answer) a perfect player writes for a calculator row."""
    a, b = _QUESTION.search(row["prompt"][-1]["content"]).groups()
    return EXAMPLE_CALL.replace("123 * 45", f"{a} * {b}"), f"{a} * {b} = {int(a) * int(b)}"


async def demonstrations(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) of each row's demonstration episode: prompt (mask 0), then the written turns
    (mask 1, each ending with the stop token) and the tool's reply (mask 0)."""
    from rl.agent.config import EnvConfig
    from rl.agent.loading import load_environment

    factory = load_environment(EnvConfig(**J.TASKS["calculator"]), tokenizer)
    stop = min(factory.stop_ids)
    out = []
    try:
        for row in rows:
            ep = factory.episode(dict(row))
            if not await ep.start():
                raise RuntimeError(f"the environment refused a demonstration row: {ep.result().failed}")
            for text in demonstration_turns(row):
                await ep.step(tokenizer.encode(text, add_special_tokens=False) + [stop], True)
            result = ep.result()
            if result.failed or not J.success("calculator", result.messages, row):
                raise RuntimeError(f"a demonstration did not succeed: {result.failed or result.messages[-1]}")
            out.append((result.prompt_ids + result.response_ids, [0] * len(result.prompt_ids) + result.loss_mask))
    finally:
        factory.close()
    return out


def masked_loss(model, batch: list[tuple[list[int], list[int]]], pad_id: int):
    """Mean cross-entropy over the positions whose mask is 1 (right-padded batch)."""
    import torch
    import torch.nn.functional as F
    device = next(model.parameters()).device
    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([i + [pad_id] * (width - len(i)) for i, _ in batch], device=device)
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], device=device)
    attention = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch], device=device)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    weights = mask[:, 1:].reshape(-1).float()
    return (loss * weights).sum() / weights.sum()


def bf16_visible_change(before: dict, model) -> float:
    """The fraction of the model's weights whose bf16 value differs from `before`'s (a state dict).

    The engine decodes in bf16 on a GPU: a change smaller than bf16's resolution (about 0.4% of a
    weight) rounds back to the old value there. Two Adam steps at lr 1e-5 move a weight by about
    2e-5, far below that for most weights, so a warm start that works in fp32 can vanish in bf16."""
    import torch
    changed = total = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            old = before[name].to(p.device)
            changed += int((p.to(torch.bfloat16) != old.to(torch.bfloat16)).sum())
            total += p.numel()
    return changed / max(total, 1)


def warm_start(model_dir: str, rows: list[dict], out_dir: str, *, epochs: int = 1, lr: float = 1e-5, batch: int = 8,
               device: str = "cpu", seed: int = 0, log=print) -> tuple[list[float], float]:
    """Train model_dir on the rows' demonstrations; write out_dir (model, tokenizer files); the losses
    and the fraction of weights whose change survives a bf16 cast (bf16_visible_change)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).to(device)
    model.train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    data = asyncio.run(demonstrations(tokenizer, rows))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rng, losses = random.Random(seed), []
    for epoch in range(epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        for start in range(0, len(order), batch):
            with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
                loss = masked_loss(model, [data[i] for i in order[start:start + batch]], pad)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
        log(f"warm start: epoch {epoch + 1}, {len(data)} demonstrations, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    visible = bf16_visible_change(before, model)
    log(f"warm start: {visible:.1%} of the weights differ from the base's in bf16 (what a GPU run decodes with)")
    model.save_pretrained(out_dir)
    for name in os.listdir(model_dir):   # tokenizer, chat template, generation config, licence
        if not name.endswith(".safetensors") and name != "config.json" and os.path.isfile(os.path.join(model_dir, name)):
            shutil.copy(os.path.join(model_dir, name), os.path.join(out_dir, name))
    return losses, visible


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("train", help="calculator train.jsonl (examples/agents/tasks.py)")
    p.add_argument("out")
    p.add_argument("--examples", type=int, default=64, help="demonstrations, from the end of the file")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="")
    args = p.parse_args()
    rows = J.read_rows(args.train)[-args.examples:]
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    losses, visible = warm_start(args.model, rows, args.out, epochs=args.epochs, lr=args.lr, batch=args.batch,
                                 device=device)
    print(json.dumps({"out": args.out, "examples": len(rows), "steps": len(losses), "loss_first": losses[0],
                      "loss_last": losses[-1], "bf16_visible_change": visible}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
