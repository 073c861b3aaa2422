"""Between our sampling settings and vLLM's request objects: the SamplingParams a sample is asked
with, and the sample dict (tokens, behaviour log-probs, finished) made from what vLLM returns.
Used by both vLLM decoders (rl/generation/vllm_engine.py, vllm_episodes.py). Importing this module
never imports vllm (its imports are inside the functions).
"""

from __future__ import annotations


def sampling_params(*, temperature: float, top_k: int, max_new_tokens: int, min_new_tokens: int,
                    stop_ids: list[int], stop_strings: list[str] | tuple = (), seed: int | None = None,
                    n: int = 1, logprobs: bool = True):
    """vllm.SamplingParams for our sampling settings. Stop ids end a response and stay in it (as in
    the static decoder); min_new_tokens masks them before then. Stop strings are checked by vLLM
    on text with special tokens kept (our cut_at_stop_strings convention, which then cuts the
    response after the stop string's token); without stop strings nothing is detokenised: vLLM
    would turn every new token into text, a cost on each decode step that nothing here reads."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n, temperature=float(temperature), top_k=int(top_k or 0), top_p=1.0,
        max_tokens=int(max_new_tokens), min_tokens=min(int(min_new_tokens), int(max_new_tokens)),
        stop_token_ids=[int(i) for i in stop_ids], stop=list(stop_strings) or None,
        include_stop_str_in_output=True, skip_special_tokens=False, detokenize=bool(stop_strings),
        seed=seed, logprobs=0 if logprobs else None, flat_logprobs=True,
        output_kind=RequestOutputKind.FINAL_ONLY)


def token_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """The sampled tokens' log-probs from a CompletionOutput's `logprobs` (FlatLogprobs, or a list
    of {token id: Logprob} per position)."""
    if logprobs is None:
        raise ValueError("vLLM returned no log-probs (SamplingParams(logprobs=0) is needed)")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned log-probs for {len(logprobs)} positions, {len(token_ids)} tokens")
    flat = getattr(logprobs, "start_indices", None)
    if flat is not None and len(logprobs.logprobs) == len(token_ids) and list(logprobs.token_ids) == list(token_ids):
        return [float(x) for x in logprobs.logprobs]    # one entry per position: the sampled token
    out = []
    for i, (position, token) in enumerate(zip(logprobs, token_ids)):
        if token not in position:
            raise ValueError(f"vLLM's log-probs at position {i} do not include the sampled token {token}")
        out.append(float(position[token].logprob))
    return out


def to_sample(prompt_ids: list[int], completion, stop_ids) -> dict:
    """Our sample dict from a vllm CompletionOutput ("finished": it ends at a stop id, as in the
    static decoder; a stop string is marked by cut_at_stop_strings after)."""
    tokens = [int(t) for t in completion.token_ids]
    return {"prompt_ids": list(prompt_ids), "response_ids": tokens,
            "logprobs": token_logprobs(tokens, completion.logprobs),
            "finished": bool(tokens) and tokens[-1] in set(stop_ids)}
