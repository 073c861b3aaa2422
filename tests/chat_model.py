"""A small chat model directory built in the test, as a user's instruct model looks (no hub):
a ChatML chat template, NO pad token, and a generation_config.json listing two eos ids of which
the tokenizer names only one (SmolLM2-Instruct's situation). Used by tests/unit/test_data.py."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

IM_START, IM_END, EOT, UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<unk>"
WORDS = ("system", "user", "assistant", "you", "are", "terse", "add", "copy", "+", "=", ":") + tuple("0123456789")
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """Word-level: specials, then WORDS. eos = <|endoftext|>; no pad, no bos."""
    vocab = {tok: i for i, tok in enumerate((UNK, IM_START, IM_END, EOT) + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOT, unk_token=UNK,
                                  additional_special_tokens=[IM_START, IM_END])
    if chat_template:
        tok.chat_template = CHATML
    return tok


def make_chat_model_dir(path, always_emit: str | None = IM_END, chat_template: bool = True) -> dict:
    """Save a random-init 2-layer Llama + chat_tokenizer() at `path`; returns the token ids.

    always_emit: a token the model then samples with probability ~1 at every position (its
    attention and MLP outputs are zeroed, so the residual stream is the token embedding, whose
    dimension 0 is large; that token's lm_head row reads dimension 0). None: a plain random model.
    """
    tok = chat_tokenizer(chat_template)
    ids = {name: tok.convert_tokens_to_ids(name) for name in (IM_START, IM_END, EOT, UNK)}
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=None, pad_token_id=None,
                         eos_token_id=ids[EOT])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if always_emit is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.model.embed_tokens.weight[:, 0] = 100.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[tok.convert_tokens_to_ids(always_emit), 0] = 10.0
    model.generation_config = GenerationConfig(eos_token_id=[ids[IM_END], ids[EOT]])
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return ids
