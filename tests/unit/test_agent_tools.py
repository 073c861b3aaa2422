"""rl/agent tools: Hermes call parsing, the built-in tool-calling environment and TRL's
environment_factory form, with a byte-level BPE tokenizer and a Qwen2.5-like template that has a
tools section (tests/agent_tokenizers.py); the SmolLM2 fallback (no tools section) is in
tests/test_agent_smollm2.py.

Parsing follows verl's HermesToolParser (verl-project/verl 1dda039,
verl/experimental/agent_loop/tool_parser.py: `<tool_call>(.*?)</tool_call>`, DOTALL) and TRL 1.16
(trl/chat_template_utils.py `_validate_tool_calls`: missing/null arguments = {}); unlike both, a
malformed call is answered with an error instead of being dropped (rl/agent/tools.py says why).
"""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from rl.agent import EnvConfig, EnvLoadError, load_environment
from rl.agent.tools import ToolCall, parse_tool_calls, system_message, template_has_tools
from tests.agent_tokenizers import bpe_tokenizer
from tests.chat_model import chat_tokenizer

TOOLS = '''
import asyncio, time

def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b

async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    await asyncio.sleep(0)
    return a + b

def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b

def slow(s: float) -> str:
    """Sleep.

    Args:
        s: seconds
    """
    time.sleep(s)
    return "woke"
'''


def call_text(name, arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.mark.parametrize("text, want", [
    ("The answer is 408.", []),
    (call_text("multiply", {"a": 12, "b": 34}), [ToolCall("multiply", {"a": 12, "b": 34})]),
    ("Let me compute." + call_text("multiply", {"a": 1, "b": 2}) + "\n" + call_text("add", {"a": 3, "b": 4}),
     [ToolCall("multiply", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]),
    ('<tool_call>{"name": "now"}</tool_call>', [ToolCall("now", {})]),
    ('<tool_call>{"name": "now", "arguments": null}</tool_call>', [ToolCall("now", {})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', [ToolCall("add", {"a": 1})]),
    ("<tool_call>{'name': 'add'}</tool_call>",
     [ToolCall(error="the tool call is not valid JSON (Expecting property name enclosed in double quotes at character 1)")]),
    ('<tool_call>{"arguments": {}}</tool_call>',
     [ToolCall(error='a tool call is a JSON object {"name": ..., "arguments": {...}}')]),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
     [ToolCall(error="the arguments of add are not a JSON object")]),
    (call_text("add", {"a": 1}) + '<tool_call>{"name": "add", "argu',
     [ToolCall("add", {"a": 1}), ToolCall(error="a <tool_call> has no closing </tool_call>")]),
])
def test_hermes_parsing(text, want):
    assert parse_tool_calls(text) == want


def test_which_templates_have_a_tools_section():
    assert template_has_tools(bpe_tokenizer()) and not template_has_tools(chat_tokenizer())


def write(tmp_path, source: str) -> str:
    path = tmp_path / "tools.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


async def play(factory, row, replies, tok):
    ep = factory.episode(row)
    assert await ep.start(), ep.failed
    turns = []
    for reply in replies:
        turn = await ep.step(tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id], True)
        turns.append(turn)
        if turn.done:
            break
    return ep, turns


def render_ids(tok, messages, **kwargs) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs),
                      add_special_tokens=False)


def test_tool_episode_tokens_equal_a_full_render_with_tools(tmp_path):
    tok = bpe_tokenizer()
    factory = load_environment(EnvConfig(path=write(tmp_path, TOOLS), tools=["multiply", "add"], reward="function"), tok)
    schemas = factory.renderer.tools
    assert schemas == factory.tool_schemas
    assert [s["function"]["name"] for s in schemas] == ["multiply", "add"]
    first = call_text("multiply", {"a": 12, "b": 34}) + "\n" + call_text("add", {"a": 408, "b": 1})
    ep, turns = asyncio.run(play(factory, {"prompt": "What is 12 times 34?", "answer": "408"},
                                 [first, "The answer is 408."], tok))
    r = ep.result()
    assert (r.ended_by, r.turns, r.failed, r.reward) == ("no_tool_call", 2, None, None)
    assert r.counters["tool_calls"] == 2 and r.counters["tool_errors"] == 0
    assert r.messages[2:4] == [{"role": "tool", "name": "multiply", "content": "408"},
                               {"role": "tool", "name": "add", "content": "409"}]
    assert r.prompt_ids == render_ids(tok, r.messages[:1], tools=schemas)
    t1 = tok.encode(first, add_special_tokens=False) + [tok.eos_token_id]
    # Prompt + first turn + the environment's ids = the template's render of the chat so far.
    assert r.prompt_ids + r.response_ids[:len(t1) + len(turns[0].append_ids)] == render_ids(tok, r.messages[:4], tools=schemas)
    assert tok.decode(turns[0].append_ids) == ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n"
                                               "<tool_response>\n409\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    env = turns[0].append_ids
    assert r.loss_mask == [1] * len(t1) + [0] * len(env) + [1] * (len(r.response_ids) - len(t1) - len(env))
    assert r.final_text == "The answer is 408." and r.completion_messages == r.messages[1:]


@pytest.mark.parametrize("reply, kind, error", [
    (call_text("sqrt", {"x": 2}), "unknown_tool_calls",
     "unknown tool 'sqrt'; the tools are ['add', 'divide', 'multiply', 'slow']"),
    (call_text("multiply", {"a": 1}), "bad_tool_arguments", "bad arguments for multiply: missing a required argument: 'b'"),
    (call_text("multiply", {"a": 1, "b": 2, "c": 3}), "bad_tool_arguments",
     "bad arguments for multiply: got an unexpected keyword argument 'c'"),
    ("<tool_call>{not json}</tool_call>", "malformed_tool_calls", "the tool call is not valid JSON"),
    (call_text("divide", {"a": 1, "b": 0}), "tool_exceptions", "divide raised ZeroDivisionError: division by zero"),
    (call_text("slow", {"s": 3.0}), "tool_timeouts", "tool slow timed out after 0.2 s"),
])
def test_tool_errors_are_answered_and_counted(tmp_path, reply, kind, error):
    tok = bpe_tokenizer()
    factory = load_environment(EnvConfig(path=write(tmp_path, TOOLS), tools=["multiply", "add", "divide", "slow"],
                                         reward="function", step_timeout_s=0.2), tok)
    ep, turns = asyncio.run(play(factory, {"prompt": "x"}, [reply, "done"], tok))
    r = ep.result()
    assert r.failed is None and r.ended_by == "no_tool_call" and len(turns) == 2
    assert r.counters["tool_errors"] == 1 and r.counters[kind] == 1 and r.counters["tool_calls"] == 1
    answer = json.loads(r.messages[2]["content"])
    assert r.messages[2]["role"] == "tool" and answer["error"].startswith(error)


def test_max_turns_ends_a_model_that_keeps_calling(tmp_path):
    tok = bpe_tokenizer()
    factory = load_environment(EnvConfig(path=write(tmp_path, TOOLS), tools=["add"], reward="function", max_turns=2), tok)
    ep, turns = asyncio.run(play(factory, {"prompt": "x"}, [call_text("add", {"a": 1, "b": 1})] * 5, tok))
    assert ep.result().ended_by == "max_turns" and ep.result().counters["tool_calls"] == 2 and len(turns) == 2


TRL_ENV = '''
class Counter:
    """TRL's environment_factory contract: reset(**row) starts an episode, public methods are tools."""
    def __init__(self, start=0):
        self.value = start
    def reset(self, **kwargs):
        self.value = int(kwargs.get("start", self.value))
        return f" Start at {self.value}."
    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: how much to add
        """
        self.value += step
        return self.value
    def get_reward(self) -> float:
        return float(self.value == 3)
    def _helper(self):
        return None
'''


def test_trl_environment_factory_class(tmp_path):
    tok = bpe_tokenizer()
    factory = load_environment(EnvConfig(path=write(tmp_path, TRL_ENV)), tok)
    assert factory.form == "trl" and [s["function"]["name"] for s in factory.tool_schemas] == ["increment"]
    assert "self" not in json.dumps(factory.tool_schemas) and factory.renderer.tools == factory.tool_schemas
    ep, _ = asyncio.run(play(factory, {"prompt": "Count to 3.", "start": 1},
                             [call_text("increment", {"step": 2}), "It is 3."], tok))
    r = ep.result()
    # reset's text is appended to the last user message, as TRL does.
    assert r.messages[0] == {"role": "user", "content": "Count to 3. Start at 1."}
    assert r.messages[2] == {"role": "tool", "name": "increment", "content": "3"}
    assert (r.reward, r.final_reward, r.step_rewards, r.ended_by) == (1.0, 1.0, [None, None], "no_tool_call")
    ep, _ = asyncio.run(play(factory, {"prompt": "Count to 3."}, ["It is 0."], tok))
    assert ep.result().reward == 0.0


def test_trl_class_without_get_reward_needs_the_reward_function(tmp_path):
    source = TRL_ENV.replace("def get_reward", "def _no_reward")
    with pytest.raises(EnvLoadError, match=r"tools.py: env.reward=env, but class Counter has no get_reward\(\) "
                                           r"and gives no reward; set env.reward=function"):
        load_environment(EnvConfig(path=write(tmp_path, source)), bpe_tokenizer())
    assert load_environment(EnvConfig(path=write(tmp_path, source), reward="function"), bpe_tokenizer()).form == "trl"


def test_trl_tool_without_docstring_is_refused(tmp_path):
    source = TRL_ENV.replace('"""Add to the counter.\n\n        Args:\n            step: how much to add\n        """', "")
    with pytest.raises(EnvLoadError, match=r"tools.py: tool Counter.increment: Cannot generate JSON schema"):
        load_environment(EnvConfig(path=write(tmp_path, source)), bpe_tokenizer())


def test_a_tool_past_the_episode_timeout_fails_the_episode(tmp_path):
    tok = bpe_tokenizer()
    factory = load_environment(EnvConfig(path=write(tmp_path, TOOLS), tools=["slow"], reward="function",
                                         step_timeout_s=5.0, episode_timeout_s=0.2), tok)
    ep, turns = asyncio.run(play(factory, {"prompt": "x"}, [call_text("slow", {"s": 1.0})], tok))
    assert turns[0].done and ep.result().failed == "episode timed out: the environment took over 0.2 s (in tool slow)"


def test_the_tools_system_message_joins_the_users_own():
    schema = {"type": "function", "function": {"name": "f"}}
    merged = system_message([schema], [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert json.dumps(schema) in merged[0]["content"] and merged[1] == {"role": "user", "content": "hi"}
    added = system_message([schema], [{"role": "user", "content": "hi"}])
    assert [m["role"] for m in added] == ["system", "user"] and added[0]["content"].startswith("# Tools\n")


def test_a_chat_row_from_the_prompt_source_starts_its_episode_rendered_once(tmp_path):
    """The prompt source renders a chat row to text (rl/data/prompts.py); an episode must start
    from the row's messages, rendered once by the environment with the tools section, not from
    that text wrapped as one user message (the calculator's 0-call runs, issue 36). A system
    prompt set on the data reaches the episode too."""
    import types
    from rl.data import prompts as data
    from rl.generation.episodes import Episodes
    tok = bpe_tokenizer()
    factory = load_environment(EnvConfig(path=write(tmp_path, TOOLS), tools=["multiply"], reward="function"), tok)
    chat = [{"role": "user", "content": "What is 12 times 34?"}]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": chat, "answer": "408"}) + "\n")

    async def first_prompt(cfg):
        enc = data.encode_prompts(data.load_prompts(str(path)), tok, cfg=cfg)
        msg = types.SimpleNamespace(data={"id": 0, **enc.message(0)})
        episodes = Episodes(types.SimpleNamespace(tracer=None), factory, None, 16)
        runs = await episodes.start(msg, [(1, None)], None)
        return runs[0].prompt_ids
    schemas = factory.renderer.tools
    assert asyncio.run(first_prompt(data.DataConfig())) == render_ids(tok, chat, tools=schemas)
    system = [{"role": "system", "content": "Use the tools."}] + chat
    assert asyncio.run(first_prompt(data.DataConfig(system_prompt="Use the tools."))) == \
        render_ids(tok, system, tools=schemas)
