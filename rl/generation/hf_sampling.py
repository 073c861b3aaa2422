"""The plain transformers sampling loop (generator.backend=hf, and any model the static decoder
does not cover): KV-cached sampling with per-row temperatures and stop tokens, and the cut at stop
strings. Token layout and position ids as rl/model/causal_lm.py's (rl/model/padded_batch.py).
"""

from __future__ import annotations

import torch
from torch import nn

from rl.model.logprobs import logprobs_from_logits
from rl.model.padded_batch import mask_position_ids


def _cache_kwarg(model: nn.Module, out) -> dict:
    """The KV cache of `out`, under the keyword this transformers version takes: 5.24 renamed
    `past_key_values` to `cache` (keeping a deprecated alias); 5.17 (the GPU image) has only the old."""
    if hasattr(out, "cache"):
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def _row_temperatures(temperature, num: int, device) -> torch.Tensor | None:
    """[num, 1] per-row temperatures, or None when one temperature serves every row (the old path,
    bit for bit the same random stream)."""
    if not isinstance(temperature, (list, tuple)):
        return None
    if len(temperature) != num:
        raise ValueError(f"sample_responses: {len(temperature)} temperatures for {num} prompts")
    if len(set(temperature)) == 1:
        return None
    return torch.tensor(temperature, dtype=torch.float32, device=device)[:, None]


def _sample_per_row(logits: torch.Tensor, temps: torch.Tensor, top_k: int | None,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits the log-probs are taken from, tokens): rows with temperature 0 take the
    argmax (log-probs at temperature 1, no top_k), the others sample as the one-temperature path."""
    greedy = temps <= 0
    logits = logits / torch.where(greedy, 1.0, temps)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill((logits < kth) & ~greedy, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    sampled = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits.device)
    return logits, torch.where(greedy[:, 0], logits.argmax(-1), sampled)


@torch.no_grad()   # grad mode is per thread and on in asyncio.to_thread's: no graph over every decode step
def sample_responses(model: nn.Module, tokenizer, prompt_ids_list: list[list[int]],
                     max_new_tokens: int, temperature: float | list[float] = 1.0, top_k: int | None = None,
                     generator: torch.Generator | None = None,
                     seed: int | None = None, min_new_tokens: int = 0,
                     stop_ids: list[int] | None = None) -> list[dict]:
    """Sample one response per prompt with a KV cache, in a hand loop.

    Why not model.generate: on CPU both take the same time within noise
    (bench/results/task_choice_cpu_2026-11-29.md), and the loop gives exact
    behaviour log-probs of the distribution actually sampled, a seedable torch.Generator, and
    stops as soon as every row has emitted <eos>.

    Returns, per prompt, {"prompt_ids", "response_ids", "logprobs", "finished"}: response_ids end
    with <eos> when finished (else they stop at max_new_tokens); logprobs are the behaviour
    log-probs of each response token under the sampling distribution (softmax(logits /
    temperature), renormalised over the top_k tokens if top_k). temperature 0 means greedy, with
    the log-probs of the temperature-1 distribution (sequence_logprobs has no top_k, so with
    top_k recompute old log-probs or pass these as behaviour_logprobs to ppo_policy_loss).
    Randomness comes from `generator`, else from
    a torch.Generator seeded with `seed`, else from the global RNG. Before `min_new_tokens`
    tokens <eos> is masked out of the sampled distribution (and so of the behaviour log-probs).
    The fast path for Llama/Qwen2 (static KV cache, CUDA graphs) is rl/generation/decoding.py.
    Sampling is over the whole vocab, so a response may contain any id, <pad>'s included: take
    masks from pad_batch, never from `ids != pad_id`.
    `stop_ids`: every id that ends a response (default: the tokenizer's eos; rl/data/policy.py
    stop_token_ids collects them); "<eos>" above means any of them.
    `temperature` may be a list, one per prompt (0 = greedy for that row, without top_k):
    validation's greedy responses beside sampled ones in one call (nodes/generator.py).
    """
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    stop_ids = list(stop_ids) if stop_ids else [tokenizer.eos_token_id]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    num = len(prompt_ids_list)
    prompt_len = max(len(p) for p in prompt_ids_list)
    input_ids = torch.full((num, prompt_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((num, prompt_len), dtype=torch.long)
    for i, p in enumerate(prompt_ids_list):          # left padding: the last column is the "now"
        input_ids[i, prompt_len - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, prompt_len - len(p):] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

    was_training = model.training
    model.eval()
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=mask_position_ids(attention_mask), use_cache=True, logits_to_keep=1)
    next_pos = attention_mask.sum(1, keepdim=True)
    tokens, logprobs = [], []
    alive = torch.ones(num, dtype=torch.bool, device=device)
    per_row = _row_temperatures(temperature, num, device)
    if per_row is None and isinstance(temperature, (list, tuple)):
        temperature = temperature[0]
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        if step < min_new_tokens:
            logits[:, stops] = float("-inf")
        if per_row is not None:
            logits, token = _sample_per_row(logits, per_row, top_k, generator)
        elif temperature > 0:
            logits = logits / temperature
            if top_k is not None and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            # torch.Generator objects are per device; a CPU one keeps seeds portable.
            token = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(device)
        else:
            token = logits.argmax(-1)
        logprob = logprobs_from_logits(logits, token)
        token = torch.where(alive, token, torch.full_like(token, pad_id))
        tokens.append(token)
        logprobs.append(logprob)
        step_mask = alive.long()[:, None]              # finished rows feed pads, masked out
        alive = alive & ~torch.isin(token, stops)
        if step == max_new_tokens - 1 or not alive.any():
            break
        attention_mask = torch.cat([attention_mask, step_mask], dim=1)
        out = model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=next_pos,
                    use_cache=True, **_cache_kwarg(model, out))
        next_pos = next_pos + step_mask
    model.train(was_training)

    tokens = torch.stack(tokens, 1).tolist()
    logprobs = torch.stack(logprobs, 1).tolist()
    samples = []
    for i, prompt in enumerate(prompt_ids_list):
        response = tokens[i]
        # the first stop token ends it: finished rows were fed pads after it (maybe a stop id too)
        ends = [t for t, tok in enumerate(response) if tok in stop_ids]
        length = ends[0] + 1 if ends else len(response)
        samples.append({"prompt_ids": list(prompt), "response_ids": response[:length],
                        "logprobs": logprobs[i][:length], "finished": bool(ends)})
    return samples


def cut_at_stop_strings(sample: dict, tokenizer, stop_strings: list[str]) -> dict:
    """`sample` ended at its first stop string: the shortest prefix of response_ids whose decoded
    text contains one of `stop_strings` (the token completing it stays, as a stop token does), with
    its logprobs, finished=True. Unchanged when no stop string occurs.

    Checked on the decoded text after generation (the decoders stop only at token ids), so tokens
    past the stop string were generated and are dropped here; a prefix search takes O(log n)
    decodes. Special tokens are decoded too, so a stop string may name one."""
    response = sample["response_ids"]

    def stops_within(k: int) -> bool:
        text = tokenizer.decode(response[:k], skip_special_tokens=False)
        return any(s in text for s in stop_strings)

    if not stop_strings or not response or not stops_within(len(response)):
        return sample
    lo, hi = 1, len(response)            # the shortest k with stops_within(k): it holds at hi
    while lo < hi:
        mid = (lo + hi) // 2
        if stops_within(mid):
            hi = mid
        else:
            lo = mid + 1
    return {**sample, "response_ids": response[:lo], "logprobs": sample["logprobs"][:lo], "finished": True}
