"""The static decoder's decode steps (rl/generation/decoding.StaticDecoder): sampling a token
and advancing a slot's state, one decode step over the first B slots, run eagerly or replayed as a
captured CUDA graph, and reading the finished sequences back after the steps.

The functions taking `dec` read and write the decoder's buffers and are its methods (`_sampler`,
`_record`, `_step`, `_run_step`, `_capture`, `_collect`), as rl/generation/decoder_forward.py's are;
they live here so that rl/generation/decoding.py keeps to the slots, their buffers and the public API.
"""

from __future__ import annotations

import torch

from rl.generation.sampling import sample_tokens


def run_sampler(dec, *args):
    if dec._compiled is not None:
        try:
            return dec._compiled(*args)
        except Exception as e:    # e.g. no compiler toolchain: eager is correct, just slower
            if torch.cuda.is_current_stream_capturing():
                raise
            print(f"StaticDecoder: torch.compile of the sampler failed ({type(e).__name__}: "
                  f"{str(e)[:200]}); sampling eagerly", flush=True)
            dec._compiled = None
    return sample_tokens(*args)


def record(dec, rows: torch.Tensor, logits: torch.Tensor, live: torch.Tensor, sampler=None) -> None:
    """Sample for `rows` and advance their state where `live` (all tensor ops)."""
    steps = dec.n_gen[rows]
    temperature = dec.temps[rows] if dec._odd_temps else dec.temperature
    tok, lp = (sampler or dec._sampler)(logits, dec.keys[rows], steps, dec.vocab_hash,
                                        temperature, dec.top_k, dec.stop_tensor,
                                        dec.min_new_tokens, steps + dec.noise_base[rows])
    col = steps.clamp(max=dec.max_new_tokens - 1)
    dec.out_tokens[rows, col] = torch.where(live, tok, dec.out_tokens[rows, col])
    dec.out_logp[rows, col] = torch.where(live, lp, dec.out_logp[rows, col])
    dec.last[rows] = torch.where(live, tok, dec.last[rows])
    n_gen = steps + live.long()
    dec.n_gen[rows] = n_gen
    dec.alive[rows] = live & ~dec.is_stop[tok] & (n_gen < dec.caps[rows])


def decode_step(dec, B: int, L: int | None = None) -> None:
    rows, live = dec.slot_ids[:B], dec.alive[:B].clone()
    logits = dec._decode_logits(B, L)
    # the token fed this step is now in the cache (capped: a full slot stops being alive anyway)
    dec.lengths[:B] = torch.where(live, (dec.lengths[:B] + 1).clamp(max=dec.max_len - 1),
                                  dec.lengths[:B])
    dec._record(rows, logits, live)


def run_step(dec, B: int, L: int) -> None:
    if not dec.cuda_graphs:
        # CPU: reading the lengths costs nothing; attend only over the filled positions
        dec._step(B, int(dec.lengths[:B].max()) + 1 if dec.exact_lengths else L)
        return
    graph = dec._graphs.get((B, L, bool(dec._odd_temps)))
    if graph is None:
        graph = dec._capture(B, L)
    graph.replay()


def capture(dec, B: int, L: int):
    """Capture _step(B, L). The warm-up steps capture needs (on a side stream: cuBLAS
    workspaces, the compiled sampler) really run, so the state they advance is saved before
    and restored after: the live sequences must not move or see extra K/V."""
    state = [dec.lengths, dec.last, dec.n_gen, dec.alive, dec.out_tokens, dec.out_logp]
    saved = [t.clone() for t in state] + [[c.clone() for c in cs] for cs in (dec.k_cache, dec.v_cache)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            dec._step(B, L)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the weight receiver's thread may use CUDA (NCCL) while this one captures
    with torch.cuda.graph(graph, pool=dec._pool, capture_error_mode="thread_local"):
        dec._step(B, L)
    for t, s in zip(state, saved):   # capture ran nothing, but the warm-ups did
        t.copy_(s)
    for cs, ss in zip((dec.k_cache, dec.v_cache), saved[len(state):]):
        for c, s in zip(cs, ss):
            c.copy_(s)
    dec._graphs[B, L, bool(dec._odd_temps)] = graph
    return graph


def collect_finished(dec, busy: list[int]) -> list[tuple[object, dict]]:
    """[(tag, sample)] of the sequences in `busy` that finished; their slots are freed, or parked
    at the end of an episode's turn."""
    alive = dec.alive.tolist()
    done = [i for i in busy if not alive[i]]
    if not done:
        return []
    idx = torch.tensor(done, device=dec._device)
    n_gen = dec.n_gen[idx].tolist()
    tokens, logp = dec.out_tokens[idx].tolist(), dec.out_logp[idx].tolist()
    out = []
    for i, s in enumerate(done):
        tag, prompt = dec.slots[s]
        response = tokens[i][:n_gen[i]]
        sample = {"prompt_ids": prompt, "response_ids": response, "logprobs": logp[i][:n_gen[i]],
                  "finished": bool(response) and response[-1] in dec.stop_ids}
        if dec.token_versions:
            sample["token_versions"] = expand_versions(dec._versions[s], n_gen[i])
        if dec.keep[s]:       # an episode's turn: the slot waits, cache kept, for extend()
            sample["slot"] = s
            dec.parked.add(s)
        else:
            dec._free(s)
        out.append((tag, sample))
    return out


def expand_versions(spans: list[tuple[int, int]], length: int) -> list[int]:
    """Per token, the version of the last span [(first token index, version), ...] starting at or
    before it: ([(0, 3), (5, 4)], 7) -> [3, 3, 3, 3, 3, 4, 4]."""
    bounds = [start for start, _ in spans[1:]] + [length]
    return [v for (start, v), end in zip(spans, bounds) for _ in range(max(0, min(end, length) - start))]
