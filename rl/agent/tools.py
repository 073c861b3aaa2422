"""Tools: typed Python functions the model calls in Hermes format, and their results as messages.

Schemas: transformers.utils.get_json_schema (type hints on every argument and a Google docstring
describing each; the same contract as TRL's `tools=` and verl's `@function_tool`).
Rendering: passed as `apply_chat_template(tools=...)` where the chat template has a tools section
(Qwen2.5-style templates); otherwise (SmolLM2's template has none) a system message lists them and
the call format, in the words Qwen2.5's template uses, and results come back as user messages
wrapped in <tool_response> (as Qwen2.5's template writes tool messages).

Calls: Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several per turn, found
with verl's pattern (`<tool_call>(.*?)</tool_call>`, DOTALL: verl-project/verl 1dda039,
verl/experimental/agent_loop/tool_parser.py HermesToolParser). Missing or null "arguments" mean no
arguments (TRL 1.16 chat_template_utils._validate_tool_calls); an "arguments" JSON string is
parsed (OpenAI's wire form). Where the peers differ from us: verl logs and skips a call whose JSON
does not parse, and TRL then reads the whole turn as plain text (no call, the episode ends); here
every `<tool_call>` gets an answer: a malformed one, an unclosed one, an unknown tool name, arguments
that do not fit the function, or a tool that raises or times out each return an error result to
the model (`{"error": "..."}`, as TRL answers an unknown name or a raising tool) and are counted.
"""

from __future__ import annotations

import inspect
import json
import re
import types
from dataclasses import dataclass
from typing import Any, Callable

from rl.agent.config import EnvLoadError

CALL_PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"

SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def tool_schema(fn: Callable, where: str) -> dict:
    """The OpenAI function schema of a typed, documented function; EnvLoadError naming `where`."""
    from transformers.utils import get_json_schema
    try:
        return get_json_schema(fn)
    except Exception as e:   # TypeHintParsingException, DocstringParsingException
        raise EnvLoadError(f"{where}: {e}; a tool needs a type hint on every argument and a docstring "
                        "describing it and each argument (Google style: Args:)") from None


def method_tools(cls: type) -> dict[str, Callable]:
    """TRL's environment_factory tools: the class's public functions other than reset/get_reward
    (inspect.getmembers(cls, isfunction), as trl/trainer/grpo_trainer.py v1.16 lists them)."""
    return {name: fn for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward", "close")}


def method_schema(cls: type, name: str, fn: Callable, where: str) -> dict:
    """Schema of a method as the model sees it (without self), without building an instance."""
    bound = fn if isinstance(inspect.getattr_static(cls, name), staticmethod) else types.MethodType(fn, object())
    return tool_schema(bound, f"{where}: tool {cls.__name__}.{name}")


def template_has_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes the `tools=` schemas (a tools section) into the prompt."""
    probe = {"type": "function", "function": {"name": "probe_tool_9f3", "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[probe],
                                             tokenize=False, add_generation_prompt=True)
    except Exception:
        return False
    return "probe_tool_9f3" in text


def system_message(schemas: list[dict], messages: list[dict]) -> list[dict]:
    """`messages` with the tools listed in the system message (added first, or appended to the
    existing one), for templates without a tools section."""
    text = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(s) for s in schemas))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


@dataclass
class ToolCall:
    name: str = ""
    arguments: dict | None = None
    error: str = ""
    """Why the call cannot be made (malformed JSON, unclosed tag); then name/arguments are unset."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every Hermes call in a turn's text, in order; malformed ones carry `error`."""
    calls = []
    for body in CALL_PATTERN.findall(text):
        calls.append(_parse_one(body.strip()))
    rest = CALL_PATTERN.sub("", text)
    if OPEN_TAG in rest:
        calls.append(ToolCall(error="a <tool_call> has no closing </tool_call>"))
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(error=f"the arguments of {call['name']} are not a JSON object")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(error=f"the arguments of {call['name']} are not a JSON object")
    return ToolCall(name=call["name"], arguments=arguments)


def error_result(text: str) -> str:
    return json.dumps({"error": text})


def result_text(value: Any) -> str:
    """A tool's return value as the tool message's content (TRL: str(result))."""
    return value if isinstance(value, str) else str(value)


def argument_problem(fn: Callable, name: str, arguments: dict) -> str | None:
    """Why `fn(**arguments)` cannot be called (missing or unknown arguments), or None."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return f"bad arguments for {name}: {e}"
    except ValueError:
        return None
    return None


def result_messages(results: list[tuple[str, str]], in_template: bool) -> list[dict]:
    """The messages answering one turn's calls: `tool` messages where the template renders them,
    else one user message of <tool_response> blocks."""
    if in_template:
        return [{"role": "tool", "name": name, "content": content} for name, content in results]
    blocks = "\n".join(f"<tool_response>\n{content}\n</tool_response>" for _, content in results)
    return [{"role": "user", "content": blocks}]
