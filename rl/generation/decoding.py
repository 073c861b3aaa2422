"""Fast sampling for Llama / Qwen2 policies: a static KV cache with slots, CUDA-graph decode steps,
counter-based sampling noise.

Why not the HF loop (rl/generation/hf_sampling.py:sample_responses): eager HF launches ~400 kernels per token and
syncs to move probs to the CPU every token; on a GPU the decode step of a 0.5B model at batch 256 is
~1 ms of work, so launch and sync overhead dominated. Here one decode step (model + sampling + state
update) is a fixed sequence of tensor ops on preallocated buffers, so on CUDA it is captured once per
slot-count bucket in a CUDA graph and replayed (one launch per token); the host syncs only every
`sync_every` steps to collect finished sequences.

Layout. `num_slots` slots, each holding one sequence of up to `max_len` tokens; per layer a K and a V
cache [num_slots, max_len, n_kv_head, head_dim] in the model dtype (this is flash-attn's layout, so
its kernel can read it directly). Per-slot lengths: slots hold sequences of different lengths, no
left padding. Prefill (eager, right-padded, causal) writes a set of slots; a decode step advances the
first B slots (B = a power-of-two bucket covering every active slot) with torch sdpa and a mask
built from the lengths; rows that are free or finished compute but change nothing.

Weights are read from the HF model's own modules at every call (no copies), so in-place updates
(load_state_dict, the collective receiver) are seen at once. CUDA graphs, however, bake in tensor
addresses: `refresh()` (called before each serving period) re-captures when a parameter's storage
was replaced (e.g. rehome() in dataflow/weights/adapters.py sets `p.data`).

Sampling noise is counter-based: token t of sample j of prompt id p under seed s uses Gumbel noise
hashed from (s, p, j, t, vocab index) (Gumbel-max == sampling from the softmax), so a response does
not depend on which batch, slot, replica or restart produced it. The behaviour log-probs are those of
the distribution actually sampled (temperature, top_k, <eos> masked before min_new_tokens).

Stop tokens: `eos_id` is one id or several (a Llama 3 / Qwen2.5-Instruct generation_config.json
lists a few); a sequence ends at the first of any of them, and "<eos>" in this file means any.
"""

from __future__ import annotations

import torch
from torch import nn

from rl.generation.decoder_forward import (attention_input, attention_output, compile_layer_halves, decode_logits,
                                           extend_prefill, flash_with_kvcache, prefill, teacher_forced_logits,
                                           unsupported_reason)
from rl.generation.decoder_steps import capture, collect_finished, decode_step, record, run_sampler, run_step
from rl.generation.sampling import M32, _fmix32, gumbel_noise, sample_key, sample_tokens  # noqa: F401 (decoding.sample_key)


class StaticDecoder:
    """Slots of a static KV cache, continuously refilled. Not thread-safe: one caller at a time.

        dec = StaticDecoder(model, num_slots=256, max_len=384, eos_id=[2, 7], max_new_tokens=256)
        dec.add([(prompt_ids, tag, key), ...])   # prefill into free slots (key: sample_key(...))
        while dec.active: done = dec.step(8)     # [(tag, sample dict)] of the finished sequences

    A sample dict is {"prompt_ids", "response_ids", "logprobs", "finished"} as sample_responses',
    plus "token_versions" with `token_versions=True`: per response token, the weight version that
    sampled it (set_version; partial rollouts, below).

    Multi-turn episodes (nodes/generator.py with env.path): add(..., keep=True) keeps a slot when its
    sequence finishes a turn: step() returns its sample with "slot", the slot is parked (its KV
    cache kept, skipped by the decode steps' bookkeeping) until extend() appends the environment's
    tokens to it (only those are prefilled, after the turn's last sampled token, which was never
    fed) and decoding resumes, or release() frees it. A turn's noise counter is the token's index
    in the episode (extend's `noise_start`), so no turn replays another's noise.
    `eos_id`: the stop token id, or a list of them (every one ends a sequence).
    `attention`: "auto" (flash-attn when importable on CUDA, else sdpa), "sdpa" or "flash".
    `cuda_graphs`: None = on CUDA. `compile_sampler`: torch.compile the sampling ops (CUDA; falls
    back to eager if compiling fails): unfused, the per-vocab noise costs ~15 passes over [B, V].
    `compile_layers`: torch.compile each layer's parts before and after attention (None = on CUDA),
    here, on a dummy step; if that fails, the layers run eagerly and one line is printed.

    Partial rollouts (nodes/generator.py, generator.partial_rollout): the weights may change
    between two step() calls while sequences are live; set_version(v) then tags the tokens sampled
    from there on with v. The live slots keep their KV cache: the keys and values of their earlier
    tokens were computed by the old weights and are not recomputed (AReaL's interruptible
    generation and slime's partial rollout keep them too), so a token sampled after the switch sees
    the old weights' cache of its prefix. Its behaviour log-prob is that of the distribution that
    sampled it, so the learner's per-token importance weight (rl/algorithm/losses.behaviour_weights) corrects
    for both.
    """

    def __init__(self, model: nn.Module, num_slots: int, max_len: int, *, eos_id: int | list[int],
                 max_new_tokens: int, min_new_tokens: int = 0, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0, cuda_graphs: bool | None = None,
                 attention: str = "auto", compile_sampler: bool | None = None,
                 compile_layers: bool | None = None, sync_every: int | None = None,
                 token_versions: bool = False, cache: bool = True):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"StaticDecoder: unsupported model: {reason}")
        self.model = model
        self.num_slots, self.max_len = num_slots, max_len
        self.stop_ids = [int(eos_id)] if isinstance(eos_id, int) else [int(i) for i in eos_id]
        if not self.stop_ids:
            raise ValueError("StaticDecoder: eos_id is an empty list; give at least one stop id")
        self.eos_id, self.max_new_tokens = self.stop_ids[0], max_new_tokens
        self.min_new_tokens = min(min_new_tokens, max_new_tokens)
        self.temperature, self.top_k, self.seed = temperature, top_k or 0, seed
        self._cuda_graphs, self._compile, self._sync_every = cuda_graphs, compile_sampler, sync_every
        self._attention, self._compile_layers = attention, compile_layers
        self._device = self._dtype = None
        self.token_versions, self.version = token_versions, 0
        self.k_cache = self.v_cache = None
        self._cache_later = not cache     # the phase switch: the first refresh() in a turn allocates it
        self.refresh()
        self._cache_later = False

    # ----- buffers, weights -------------------------------------------------------------------
    def refresh(self) -> None:
        """Call after the weights may have changed storage, device or dtype (cheap otherwise):
        reallocates the cache on a device/dtype change, drops captured graphs on a storage change."""
        p = next(self.model.parameters())
        if (p.device, p.dtype) != (self._device, self._dtype):
            self._allocate(p.device, p.dtype)
        elif self.k_cache is None:                  # released (free_cache()): allocate it again
            self._allocate_cache()
        ptrs = tuple(t.data_ptr() for t in self.model.parameters())
        if ptrs != getattr(self, "_ptrs", None):
            self._graphs = {}
            self._ptrs = ptrs

    def _allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        cfg, S, L = self.model.config, self.num_slots, self.max_len
        self._device, self._dtype = device, dtype
        cuda = device.type == "cuda"
        attn = self.model.model.layers[0].self_attn
        self.n_head = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_head
        self.head_dim = attn.head_dim
        flash = flash_with_kvcache() if cuda and dtype in (torch.float16, torch.bfloat16) else None
        if self._attention == "flash" and flash is None:
            raise ValueError("StaticDecoder(attention='flash'): flash_attn is not importable here "
                             "(or the device/dtype is not CUDA fp16/bf16)")
        self._flash = flash if self._attention in ("auto", "flash") else None
        if not self._cache_later:
            self._allocate_cache()
        z = dict(device=device, dtype=torch.long)
        self.lengths = torch.zeros(S, **z)          # tokens in the cache (= next write position)
        self.last = torch.zeros(S, **z)             # token to feed at the next step
        self.n_gen = torch.zeros(S, **z)            # tokens generated so far (this turn)
        self.noise_base = torch.zeros(S, **z)       # noise counter of the turn's first token (episodes)
        self.keys = torch.zeros(S, **z)
        self.temps = torch.full((S,), float(self.temperature), device=device, dtype=torch.float32)
        self.alive = torch.zeros(S, device=device, dtype=torch.bool)
        self.caps = torch.full((S,), self.max_new_tokens, **z)   # per-slot response cap (add())
        self.out_tokens = torch.zeros(S, self.max_new_tokens, **z)
        self.out_logp = torch.zeros(S, self.max_new_tokens, device=device, dtype=torch.float32)
        self.slot_ids = torch.arange(S, **z)
        self.positions = torch.arange(L, **z)
        vocab = self.model.lm_head.weight.shape[0]     # the logits' width (config.vocab_size may differ)
        self.vocab_hash = _fmix32(_fmix32(torch.arange(vocab, **z) ^ 0x9E3779B9))
        if max(self.stop_ids) >= vocab or min(self.stop_ids) < 0:
            raise ValueError(f"StaticDecoder: stop ids {self.stop_ids} outside the vocabulary of {vocab}")
        self.stop_tensor = torch.tensor(self.stop_ids, **z)
        self.is_stop = torch.zeros(vocab, device=device, dtype=torch.bool)   # a lookup: capturable
        self.is_stop[self.stop_tensor] = True
        self.slots: list = [None] * S              # (tag, prompt_ids) per busy slot
        self.keep = [False] * S                     # park the slot when its turn ends (episodes)
        self.parked: set[int] = set()               # slots between two turns of an episode
        self._versions: list = [None] * S          # per busy slot [(first token index, version)]
        # Slots whose request asked for another temperature than the decoder's (0 = greedy). While
        # there are any, steps sample with the per-slot tensor `temps` (one more graph per bucket);
        # else with the decoder's one temperature, as before (no per-row work).
        self._odd_temps = set()
        # host-side upper bound of each slot's length, without reading the device: prompt length
        # at admission + decode steps since (slots that finished early only stay below it)
        self._prompt_len, self._added_at, self._steps = [0] * S, [0] * S, 0
        self.cuda_graphs = cuda if self._cuda_graphs is None else (self._cuda_graphs and cuda)
        self.sync_every = self._sync_every or (8 if cuda else 1)
        self.exact_lengths = not cuda
        self._compiled = None
        if cuda if self._compile is None else self._compile:
            # default dynamic=None: a second batch size recompiles once with a dynamic batch
            # dimension, not once per bucket
            self._compiled = torch.compile(sample_tokens)
        self._graphs = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self._attention_input, self._attention_output = attention_input, attention_output
        self.layers_compiled = False
        if cuda if self._compile_layers is None else self._compile_layers:
            compile_layer_halves(self)

    def _allocate_cache(self) -> None:
        S, L, n_layer = self.num_slots, self.max_len, len(self.model.model.layers)
        # sdpa reads [S, kv, L, d] (each head's keys contiguous; a transposed view is much slower
        # on CPU); flash_attn_with_kvcache wants [S, L, kv, d].
        shape = (S, L, self.n_kv, self.head_dim) if self._flash else (S, self.n_kv, L, self.head_dim)
        kw = dict(device=self._device, dtype=self._dtype)
        self.k_cache = [torch.zeros(shape, **kw) for _ in range(n_layer)]
        self.v_cache = [torch.zeros(shape, **kw) for _ in range(n_layer)]

    def free_cache(self) -> int:
        """Free the KV cache and the captured graphs (their private pool) while no slot is busy,
        so that another process on this GPU may use the memory meanwhile (the phase switch of a
        synchronous colocated run: docs/gpus.md). The next refresh() allocates the cache again and
        the decode steps capture their graphs again. Returns the bytes given back to the GPU."""
        if self.active:
            raise RuntimeError(f"StaticDecoder.free_cache: {self.active} slots are busy")
        if self.k_cache is None:
            return 0
        cuda = self._device is not None and self._device.type == "cuda"
        held = torch.cuda.memory_reserved(self._device) if cuda else 0
        self.k_cache = self.v_cache = None
        self._graphs = {}
        if self.cuda_graphs:
            self._pool = torch.cuda.graph_pool_handle()
        if not cuda:
            return 0
        torch.cuda.empty_cache()
        return held - torch.cuda.memory_reserved(self._device)

    @property
    def cache_freed(self) -> bool:
        return self.k_cache is None

    @property
    def active(self) -> int:
        """Busy slots, parked ones included."""
        return sum(s is not None for s in self.slots)

    @property
    def decoding(self) -> int:
        """Busy slots that are not parked (a decode step has work)."""
        return self.active - len(self.parked)

    def free_slots(self) -> int:
        return self.slots.count(None)

    # ----- model pieces (rl/generation/decoder_forward.py) ---------------------------------------------------
    _prefill, _decode_logits, _extend_prefill = prefill, decode_logits, extend_prefill
    teacher_forced_logits = teacher_forced_logits   # dec.teacher_forced_logits(prompts, continuations)

    # ----- decode steps (rl/generation/decoder_steps.py) ---------------------------------------
    _sampler, _record, _step, _run_step = run_sampler, record, decode_step, run_step
    _capture, _collect = capture, collect_finished

    # ----- public API -------------------------------------------------------------------------
    @torch.no_grad()
    def add(self, requests: list[tuple], keep: bool = False) -> None:
        """Prefill requests (prompt_ids, tag, key[, temperature[, max_new_tokens]]) into free slots
        (lowest first, so the decode bucket stays small); a request's own temperature (0 = greedy)
        overrides the decoder's for that sequence, its own max_new_tokens (None = the decoder's)
        caps its response below the decoder's. Raises ValueError if they do not fit.
        keep: park each slot at the end of its turn instead of freeing it (episodes; extend())."""
        if not requests:
            return
        temps = [float(r[3]) if len(r) > 3 and r[3] is not None else float(self.temperature) for r in requests]
        caps = [max(1, min(int(r[4]), self.max_new_tokens)) if len(r) > 4 and r[4] is not None
                else self.max_new_tokens for r in requests]
        requests = [r[:3] for r in requests]
        free = [i for i, s in enumerate(self.slots) if s is None]
        if len(requests) > len(free):
            raise ValueError(f"StaticDecoder.add: {len(requests)} requests, {len(free)} free slots")
        longest = max(len(p) for p, _, _ in requests)
        if longest + self.max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {longest} tokens + max_new_tokens={self.max_new_tokens} "
                             f"exceeds the decoder's max_len={self.max_len}")
        was_training = self.model.training
        self.model.eval()
        dev = self._device
        slots = free[:len(requests)]
        ids = torch.zeros(len(requests), longest, dtype=torch.long)
        for r, (p, _, _) in enumerate(requests):
            ids[r, :len(p)] = torch.tensor(p, dtype=torch.long)
        lens = torch.tensor([len(p) for p, _, _ in requests], dtype=torch.long)
        keys = torch.tensor([k for _, _, k in requests], dtype=torch.long)
        rows = torch.tensor(slots, dtype=torch.long).to(dev)
        ids, lens, keys = ids.to(dev), lens.to(dev), keys.to(dev)
        logits = self._prefill(ids, lens, rows)
        self.lengths[rows], self.keys[rows], self.n_gen[rows], self.noise_base[rows] = lens, keys, 0, 0
        self.temps[rows] = torch.tensor(temps, dtype=torch.float32).to(dev)
        self.caps[rows] = torch.tensor(caps, dtype=torch.long).to(dev)
        self._odd_temps.update(s for s, t in zip(slots, temps) if t != self.temperature)
        # eager sampler: prefill sizes vary, and each new shape would recompile a compiled one
        self._record(rows, logits, torch.ones(len(slots), dtype=torch.bool, device=dev), sample_tokens)
        for s, (p, tag, _) in zip(slots, requests):
            self.slots[s] = (tag, list(p))
            self.keep[s] = keep
            self._versions[s] = [(0, self.version)]
            self._prompt_len[s], self._added_at[s] = len(p), self._steps
        self.model.train(was_training)

    @torch.no_grad()
    def extend(self, requests: list[tuple[int, list[int], int, int | None]]) -> None:
        """Resume parked slots: requests (slot, appended ids, noise_start, max_new_tokens or None).
        The turn's last sampled token and the appended ids are prefilled after the slot's cache
        (rl/generation/decoder_forward.extend_prefill), then the next turn is sampled; its token t uses noise
        counter noise_start + t (the token's index in the episode's response). Raises ValueError
        for a slot that is not parked or a sequence that would outgrow max_len."""
        if not requests:
            return
        slots = [r[0] for r in requests]
        if any(s not in self.parked for s in slots):
            raise ValueError(f"StaticDecoder.extend: slots {slots} are not all parked ({sorted(self.parked)})")
        starts = self.lengths[torch.tensor(slots, device=self._device)].tolist()
        last = self.last[torch.tensor(slots, device=self._device)].tolist()
        new = [[t] + list(ids) for t, (_, ids, _, _) in zip(last, requests)]
        caps = [max(1, min(int(r[3]), self.max_new_tokens)) if r[3] is not None else self.max_new_tokens
                for r in requests]
        for s, start, ids, cap in zip(slots, starts, new, caps):
            if start + len(ids) + cap > self.max_len:
                raise ValueError(f"StaticDecoder.extend: slot {s} holds {start} tokens; {len(ids)} more and "
                                 f"{cap} new ones exceed max_len={self.max_len}")
        was_training = self.model.training
        self.model.eval()
        dev = self._device
        ids = torch.zeros(len(new), max(map(len, new)), dtype=torch.long)
        for r, t in enumerate(new):
            ids[r, :len(t)] = torch.tensor(t, dtype=torch.long)
        lens = torch.tensor([len(t) for t in new], dtype=torch.long, device=dev)
        rows = torch.tensor(slots, dtype=torch.long, device=dev)
        logits = self._extend_prefill(ids.to(dev), lens, torch.tensor(starts, device=dev), rows)
        self.lengths[rows] = torch.tensor(starts, device=dev) + lens
        self.n_gen[rows] = 0
        self.noise_base[rows] = torch.tensor([r[2] for r in requests], dtype=torch.long, device=dev)
        self.caps[rows] = torch.tensor(caps, dtype=torch.long, device=dev)
        self._record(rows, logits, torch.ones(len(slots), dtype=torch.bool, device=dev), sample_tokens)
        for s, start, t in zip(slots, starts, new):
            self.parked.discard(s)
            self._versions[s] = [(0, self.version)]
            self._prompt_len[s], self._added_at[s] = start + len(t), self._steps
        self.model.train(was_training)

    def release(self, slot: int) -> None:
        """Free a parked slot (its episode ended)."""
        self.parked.discard(slot)
        self._free(slot)

    def _free(self, s: int) -> None:
        self.slots[s], self.keep[s] = None, False
        if s in self._odd_temps:
            self._odd_temps.discard(s)
            self.temps[s] = float(self.temperature)
        self.lengths[s] = 0      # a free slot decodes harmlessly at position 0 until refilled

    def set_version(self, version: int) -> None:
        """The weights are now `version` (call between step() calls): the live sequences' next
        tokens are tagged with it; their cache is kept (class docstring, partial rollouts)."""
        if version == self.version:
            return
        busy = [i for i, s in enumerate(self.slots) if s is not None]
        n_gen = self.n_gen.tolist() if busy else []     # one read per weight switch
        for s in busy:
            spans = self._versions[s]
            if spans[-1][0] == n_gen[s]:   # no token under the previous version yet
                spans.pop()
            spans.append((n_gen[s], version))
        self.version = version

    @torch.no_grad()
    def step(self, num_steps: int | None = None) -> list[tuple[object, dict]]:
        """Up to `num_steps` (default sync_every) decode steps, then [(tag, sample)] for the
        sequences that finished (their slots are free again)."""
        busy = [i for i, s in enumerate(self.slots) if s is not None and i not in self.parked]
        if not busy:
            return []
        # power-of-two bucket covering the busy slots; at least 8 so there are few graphs to capture
        B = min(self.num_slots, max(8, 1 << busy[-1].bit_length()))
        was_training = self.model.training
        self.model.eval()
        # on CPU checking costs nothing and saves whole steps; on CUDA it would sync every token
        alive = self.alive[:B].any() if self._device.type != "cuda" else None
        num_steps = num_steps or self.sync_every
        # Attend over a 64-aligned bound of the longest sequence over these steps (a graph per
        # (B, L) pair): with 128-token prompts and 256 new tokens, ~1/3 less KV read than max_len.
        bound = max(self._prompt_len[s] + self._steps - self._added_at[s] for s in busy) + num_steps
        L = min(self.max_len, -(-bound // 64) * 64)
        for _ in range(num_steps):
            if alive is not None and not bool(alive):
                break
            self._run_step(B, L)
            self._steps += 1
            if alive is not None:
                alive = self.alive[:B].any()
        self.model.train(was_training)
        return self._collect(busy)


@torch.no_grad()
def decode_responses(model: nn.Module, tokenizer, prompt_ids_list: list[list[int]],
                     max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                     seed: int = 0, keys: list[tuple[int, int]] | None = None,
                     min_new_tokens: int = 0, num_slots: int | None = None,
                     decoder: StaticDecoder | None = None, stop_ids: list[int] | None = None,
                     **decoder_kwargs) -> list[dict]:
    """sample_responses' result with a StaticDecoder: one sample per prompt, in order.
    stop_ids: every id that ends a response (default the tokenizer's eos).
    keys[i] = (prompt id, sample index) names prompt i's noise (default (i, 0)); with fewer
    slots than prompts, slots are refilled as sequences finish. `decoder`: reuse one (its
    sampling settings win; it must be idle)."""
    keys = keys or [(i, 0) for i in range(len(prompt_ids_list))]
    if decoder is None:
        decoder = StaticDecoder(
            model, num_slots or len(prompt_ids_list),
            max(len(p) for p in prompt_ids_list) + max_new_tokens, eos_id=stop_ids or tokenizer.eos_token_id,
            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
            temperature=temperature, top_k=top_k or 0, seed=seed, **decoder_kwargs)
    decoder.refresh()
    queue = [(p, i, sample_key(decoder.seed, *keys[i])) for i, p in enumerate(prompt_ids_list)]
    queue.reverse()
    out: list[dict | None] = [None] * len(queue)
    while queue or decoder.active:
        take = min(decoder.free_slots(), len(queue))
        decoder.add([queue.pop() for _ in range(take)])
        for i, sample in decoder.step():
            out[i] = sample
    return out
