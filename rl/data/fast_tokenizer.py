"""A policy's tokenizer without transformers: `tokenizers.Tokenizer.from_file(tokenizer.json)` plus
the chat template, rendered with jinja2 the way transformers' `apply_chat_template` renders it.

Why: the prompt source and the reward node only encode, decode and render chats, and importing
transformers' AutoTokenizer costs seconds per process (it pulls in torch and the auto-model
factory; issue 38 measured 13.5 s on the GPU image, against 0.2 s for tokenizer.json alone).
The model nodes keep AutoTokenizer (rl/model/causal_lm.py): they import torch and transformers anyway.

What transformers (5.x, tokenization_utils_tokenizers.TokenizersBackend and
utils/chat_template_utils) does, and what is mirrored here so the ids are the same
(tests/integration/test_fast_tokenizer.py compares them with AutoTokenizer's):
  - special tokens: bos/eos/unk/sep/pad/cls/mask from tokenizer_config.json (a string or an
    AddedToken dict), then special_tokens_map.json; one the vocabulary lacks is added as special;
  - the post-processor of tokenizer.json as it is (none: `$A`, no special tokens added);
    tokenizer_config.json's add_bos_token / add_eos_token do not change it (transformers 5.24
    loads such a file as TokenizersBackend and does not either; the test pins it);
  - encoding: no truncation or padding (what a call without them sets on the backend);
  - decoding: the backend's decode, and clean_up_tokenization_spaces when the config asks for
    it (never for a BPE model, as transformers);
  - the chat template: chat_template.jinja, else tokenizer_config.json's "chat_template" (a
    string or a list of named ones: "default"), rendered in an immutable sandbox with
    trim_blocks and lstrip_blocks, loop controls, a `{% generation %}` block that renders its
    body, transformers' tojson filter, raise_exception, strftime_now, dict and namespace, with
    `messages` (keys whose value is None dropped, reasoning fields aliased), tools=None,
    documents=None, add_generation_prompt and the named special tokens as strings.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from tokenizers import AddedToken, Tokenizer, processors

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' _REASONING_FIELDS


def _content(value) -> str | None:
    """A special token as written in a config: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _chat_template(path: str, config: dict) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class FastTokenizer:
    """The part of a transformers tokenizer the prompt source and the reward node use: call it on a
    list of texts, decode, convert_ids_to_tokens, apply_chat_template(tokenize=False), the named
    special tokens and their ids. Build with `load(path)` or `FastTokenizer(backend, ...)`."""

    def __init__(self, backend: Tokenizer, specials: dict[str, str | None] | None = None,
                 chat_template: str | None = None, name_or_path: str = "", clean_up_spaces: bool = False,
                 extra_special: tuple[str, ...] = ()):
        self.backend = backend
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self._specials = {name: (specials or {}).get(name) for name in SPECIAL_NAMES}
        missing = [t for t in list(self._specials.values()) + list(extra_special)
                   if t is not None and backend.token_to_id(t) is None]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(missing)])
        self._clean_up = clean_up_spaces and type(backend.model).__name__ != "BPE"
        backend.no_truncation()
        backend.no_padding()
        self._template = None

    # ---- special tokens ---------------------------------------------------------------------------
    def __getattr__(self, name: str):
        # bos_token, eos_token, ... and their *_id, like a transformers tokenizer
        specials = self.__dict__.get("_specials", {})
        if name in specials:
            return specials[name]
        if name.endswith("_id") and name[:-3] in specials:
            token = specials[name[:-3]]
            return None if token is None else self.backend.token_to_id(token)
        raise AttributeError(name)

    @property
    def pad_token(self) -> str | None:
        return self._specials["pad_token"]

    @pad_token.setter
    def pad_token(self, token: str) -> None:
        self._specials["pad_token"] = token

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (what a chat template sees)."""
        return {name: token for name, token in self._specials.items() if token is not None}

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # ---- encoding and decoding --------------------------------------------------------------------
    def __call__(self, texts, add_special_tokens: bool = True, return_attention_mask: bool = False) -> dict:
        """{"input_ids": ids of each text} (one text: its ids). return_attention_mask is ignored
        (accepted for transformers' signature; no padding, so the mask would be all ones)."""
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts, add_special_tokens=add_special_tokens)}
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---- chat template ----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False):
        """The chat rendered as transformers renders it (module docstring); tokenize=True:
        {"input_ids": its ids} (transformers 5's return_dict default), no special tokens added (the
        template writes its own, as in transformers)."""
        if not self.chat_template:
            raise ValueError(f"the tokenizer at {self.name_or_path or '(built-in)'} has no chat template")
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if self._template is None or self._template[0] != self.chat_template:
            self._template = (self.chat_template, compile_template(self.chat_template))
        chat = []
        for m in messages:
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        text = self._template[1].render(messages=chat, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        return {"input_ids": self.encode(text, add_special_tokens=False)} if tokenize else text


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization (spaces before punctuation and contractions)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def compile_template(source: str):
    """A jinja2 template compiled in the environment transformers renders chat templates in."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def load(path: str) -> FastTokenizer:
    """The tokenizer of a local model directory (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json, chat_template.jinja). FileNotFoundError without tokenizer.json."""
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        raise FileNotFoundError(f"{path}: no tokenizer.json; save one with tokenizer.save_pretrained(path)")
    backend = Tokenizer.from_file(tokenizer_json)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    token_map = _read_json(os.path.join(path, "special_tokens_map.json"))
    specials = {name: _content(config.get(name)) or _content(token_map.get(name)) for name in SPECIAL_NAMES}
    extra = []
    for key in ("extra_special_tokens", "additional_special_tokens"):
        listed = config.get(key) or token_map.get(key)
        extra += [_content(t) for t in listed] if isinstance(listed, list) else []
    tokenizer = FastTokenizer(backend, specials, _chat_template(path, config), name_or_path=path,
                              clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
                              extra_special=tuple(t for t in extra if t))
    if backend.post_processor is None:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return tokenizer
