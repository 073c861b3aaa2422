"""examples/agents/warm_start.py: demonstration episodes are the engine's own episodes with written
turns (ids and loss mask exact), and a few steps on them lower the loss of exactly those tokens. The
tokenizer is tests/agent_tokenizers.py's BPE with a ChatML template without tools section (SmolLM2's
case); the model a tiny random Llama built here."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "agents"))

import tasks as T  # noqa: E402
import warm_start as W  # noqa: E402
from tests.agent_tokenizers import bpe_tokenizer  # noqa: E402
from tests.chat_model import CHATML  # noqa: E402


def _rows():
    return [T.calculator_row(a, b) for a, b in [(347, 68), (512, 19), (100, 99)]]


def test_demonstrations_train_only_the_written_turns_and_see_the_tools_result():
    tok = bpe_tokenizer(CHATML)
    rows = _rows()
    demos = asyncio.run(W.demonstrations(tok, rows))
    assert len(demos) == len(rows)
    for (ids, mask), row in zip(demos, rows):
        assert len(ids) == len(mask) and mask[0] == 0
        trained = [t for t, m in zip(ids, mask) if m]
        call, answer = W.demonstration_turns(row)
        end = tok.convert_tokens_to_ids("<|im_end|>")
        # the two written turns, each with its stop token, and nothing else
        assert trained == (tok.encode(call, add_special_tokens=False) + [end]
                           + tok.encode(answer, add_special_tokens=False) + [end])
        assert answer.endswith(row["answer"])
        # the untrained part after the prompt holds the tool's reply with the product
        first_trained = mask.index(1)
        reply = [t for i, t in enumerate(ids) if i > first_trained and not mask[i]]
        assert f"<tool_response>\n{row['answer']}\n</tool_response>" in tok.decode(reply)
        # the prompt is the episode's first render: the tool listing in the system message
        assert '"name": "calculator"' in tok.decode(ids[:first_trained])


def test_a_short_warm_start_lowers_the_loss_on_the_demonstrations(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = bpe_tokenizer(CHATML)
    model_dir, out_dir = tmp_path / "model", tmp_path / "warm"
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = _rows()[:2]
    losses, visible = W.warm_start(str(model_dir), rows, str(out_dir), epochs=10, lr=2e-2, batch=2,
                                   log=lambda *_: None)
    assert len(losses) == 10 and losses[-1] < 0.7 * losses[0], losses
    assert visible > 0.5, visible   # lr 2e-2 moves nearly every weight by more than bf16's resolution
    # the saved directory is a model and tokenizer the engine can load, with the trained weights
    warm = LlamaForCausalLM.from_pretrained(out_dir)
    demos = asyncio.run(W.demonstrations(tok, rows))
    with torch.no_grad():
        assert W.masked_loss(warm, demos, tok.pad_token_id).item() < 0.7 * losses[0]   # not the initial weights
    assert (out_dir / "tokenizer_config.json").is_file()


def test_bf16_visible_change_counts_only_changes_a_bf16_copy_keeps():
    """A change far below bf16's resolution (what two small Adam steps make) rounds away in the bf16
    copy a GPU decodes with; a change of a few percent of each weight does not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert W.bf16_visible_change(before, model) == 0.0
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-5)              # 0.001% of each weight: bf16 keeps 8 bits of mantissa
    assert W.bf16_visible_change(before, model) < 0.02
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)                  # 5% of each weight
    assert W.bf16_visible_change(before, model) > 0.95
