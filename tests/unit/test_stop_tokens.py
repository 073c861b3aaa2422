"""Stop and pad tokens (rl/data/policy.py, both decoders, stop strings, the reward model's pooling) on a
model dir built here: a chat tokenizer without a pad token whose eos (<|endoftext|>) is not the
<|im_end|> that generation_config.json adds (tests/chat_model.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from nodes.impl.reference import add_logprobs
from nodes.impl.reward_model import score_items
from rl.data import policy
from rl.generation.decoding import decode_responses
from rl.generation.hf_sampling import cut_at_stop_strings, sample_responses
from rl.model.padded_batch import pad_batch, sequence_logprobs
from rl.data.tasks import build_tokenizer
from tests.chat_model import EOT, IM_END, make_chat_model_dir


def load(tmp_path, always_emit=IM_END):
    make_chat_model_dir(tmp_path, always_emit=always_emit)
    return policy.load(policy.PolicySpec(path=str(tmp_path)))


def prompt_ids(tok) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": "add 1 + 2 ="}], tokenize=True,
                                   add_generation_prompt=True)["input_ids"]


def test_pad_token_given_and_stop_ids_collected(tmp_path):
    model, tok = load(tmp_path)
    eot, im_end = tok.convert_tokens_to_ids(EOT), tok.convert_tokens_to_ids(IM_END)
    assert (tok.pad_token, tok.pad_token_id) == (EOT, eot)          # no pad token: eos pads
    assert policy.stop_token_ids(model, tok) == [eot, im_end]        # tokenizer's eos, then generation_config's
    assert policy.stop_token_ids(model, tok, [5, im_end]) == [eot, im_end, 5]
    with pytest.raises(policy.UserError, match=r"stop token ids \[999\] are outside the model's vocabulary"):
        policy.stop_token_ids(model, tok, [999])
    builtin = build_tokenizer()
    assert policy.ensure_pad_token(builtin) is None and builtin.pad_token == "<pad>"   # a pad token is kept


@pytest.mark.parametrize("decode", ["hf", "static"])
def test_both_decoders_stop_at_every_stop_id(tmp_path, decode):
    """The model samples <|im_end|> with probability ~1 at every position."""
    model, tok = load(tmp_path)
    stops = policy.stop_token_ids(model, tok)
    im_end = tok.convert_tokens_to_ids(IM_END)
    prompts = [prompt_ids(tok), prompt_ids(tok)[:3]]

    def run(**kw):
        if decode == "hf":
            return sample_responses(model, tok, prompts, 8, seed=0, **kw)
        return decode_responses(model, tok, prompts, 8, seed=0, **kw)

    for s in run(stop_ids=stops):
        assert s["response_ids"] == [im_end] and s["finished"] and len(s["logprobs"]) == 1
    for s in run():   # the tokenizer's eos alone (the old behaviour): never stops
        assert s["response_ids"] == [im_end] * 8 and not s["finished"]
    for s in run(stop_ids=stops, min_new_tokens=2):   # every stop id is masked before min_new_tokens
        assert len(s["response_ids"]) == 3 and s["response_ids"][-1] == im_end and s["finished"]
        assert not set(s["response_ids"][:2]) & set(stops)


def test_padding_with_eos_never_masks_a_real_eos(tmp_path):
    """pad == eos: responses that end in eos keep it as a trained token (masks come from lengths)."""
    model, tok = load(tmp_path, always_emit=None)
    eot = tok.convert_tokens_to_ids(EOT)
    assert tok.pad_token_id == eot
    p = prompt_ids(tok)
    samples = [{"prompt_ids": p, "response_ids": [10, 11, eot]}, {"prompt_ids": p[:4], "response_ids": [eot]}]
    batch = pad_batch(samples, tok.pad_token_id, token_keys=())
    P = batch["prompt_len"]
    assert batch["response_mask"][0, P:P + 3].tolist() == [1, 1, 1]
    assert batch["response_mask"][1].tolist() == [0] * P + [1, 0, 0]
    assert (batch["input_ids"][1, P:] == eot).all()      # the real eos and the pads after it look alike
    model.double()
    items = [{"samples": [dict(s) for s in samples]}]
    add_logprobs(model, tok.pad_token_id, items, "ref")
    for s in items[0]["samples"]:
        alone = pad_batch([s], tok.pad_token_id, token_keys=())
        lp, _ = sequence_logprobs(model, alone["input_ids"], alone["attention_mask"], alone["response_mask"],
                                  with_entropy=False)
        expected = lp[0, alone["prompt_len"]:].tolist()
        assert len(s["ref"]) == len(s["response_ids"]) and s["ref"][-1] < -0.5   # eos scored, not masked
        assert s["ref"] == pytest.approx(expected, abs=1e-6)   # unpad_tokens rounds to float32
    # the HF loop feeds finished rows pads (== eos here): a response still ends at its first eos
    eos_model, eos_tok = load(tmp_path / "eos", always_emit=EOT)
    for s in sample_responses(eos_model, eos_tok, [p, p[:3]], 6, seed=0, min_new_tokens=0):
        assert s["response_ids"] == [eot] and s["finished"]


def test_stop_strings_cut_after_the_token_that_completes_them(tmp_path):
    _, tok = load(tmp_path)
    ids = tok("1 2 = 3 : 4 5", add_special_tokens=False)["input_ids"]
    sample = {"prompt_ids": [1], "response_ids": ids, "logprobs": [-0.1 * (i + 1) for i in range(len(ids))],
              "finished": False}
    cut = cut_at_stop_strings(sample, tok, ["3 :"])
    assert cut["response_ids"] == ids[:5] and cut["logprobs"] == sample["logprobs"][:5] and cut["finished"]
    assert cut_at_stop_strings(sample, tok, ["=", "9"])["response_ids"] == ids[:3]
    assert cut_at_stop_strings(sample, tok, ["9"]) is sample and cut_at_stop_strings(sample, tok, []) is sample


def test_reward_model_scores_the_last_real_token_when_pad_is_eos(tmp_path):
    _, tok = load(tmp_path, always_emit=None)
    eot = tok.pad_token_id
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        num_labels=1, pad_token_id=eot)).double().eval()
    p = prompt_ids(tok)
    samples = [{"prompt_ids": p, "response_ids": [10, 11, eot]}, {"prompt_ids": p[:4], "response_ids": [12]}]
    items = [{"samples": [dict(s) for s in samples]}]
    score_items(rm, eot, items, 1.0, 0.0)
    for s in items[0]["samples"]:
        with torch.no_grad():   # the sequence alone, unpadded: the logit at its final token (the eos)
            ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
            hidden = rm.model(input_ids=ids).last_hidden_state
            expected = rm.score(hidden[:, -1])[0, 0].item()
        assert s["score"] == pytest.approx(expected, abs=1e-6) and not s["failed"]   # float32 out
