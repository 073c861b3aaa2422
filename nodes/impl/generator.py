"""The generator's implementation: the policy loaded, the static decoder, vLLM or the HF loop built,
and the continuous-batching loop. Its settings, ports and flow (weight switches, partial rollouts,
episodes, validation prompts, determinism): nodes/generator.py.
"""

from __future__ import annotations

import asyncio
import time

import torch

from dataflow.errors import UserError
from dataflow.weights.sync import GeneratorWeightSync
from nodes import generator as declared
from nodes.generator import GeneratorConfig  # noqa: F401 (tests)
from rl.generation.episodes import Episodes
from rl.generation.hf_loop import HFLoop
from rl.generation.reports import Drain, ValidationSpan
from rl.data import policy
from rl.model.gpu_turns import GpuTurn
from rl.model.memory_plan import default_prompt_room
from rl.model.precision import cast_model
from rl.agent import load_environment
from rl.generation.decoder_slots import fitted_prompts_per_call, prompts_per_call
from rl.generation.decoding import StaticDecoder, unsupported_reason
from rl.generation.groups import PromptGroups, response_cap, sample_plan
from rl.generation.hf_sampling import cut_at_stop_strings
from rl.generation.vllm_engine import choose_backend


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)


class Generator(HFLoop, declared.Generator):
    """The model and its decoder, set up and run (the flow: nodes/generator.py)."""

    async def setup(self):
        c = self.config
        self.prompts_per_call = prompts_per_call(c, self.ctx.device)  # the HF loop's; the decoder's below
        with self.ctx.span("import transformers"):   # spans in setup: the run's start-up parts (setup/generator/...)
            policy.import_model_code()
        with self.ctx.span("load model"):
            self.model, self.tokenizer = policy.load(c.policy)
        self.stop_ids = policy.stop_token_ids(self.model, self.tokenizer, c.stop_token_ids)
        if self.stop_ids != [self.tokenizer.eos_token_id] or c.stop_strings:
            self.ctx.log(f"generator: responses stop at ids {self.stop_ids} "
                         f"{self.tokenizer.convert_ids_to_tokens(self.stop_ids)}"
                         + (f" and strings {c.stop_strings}" if c.stop_strings else ""))
        backend, why = choose_backend(c.backend, unsupported_reason(self.model), self.ctx.device)
        self.ctx.log(f"generator: backend {backend} ({why})")
        self.env = None
        if c.env.path:
            with self.ctx.span("load environment"):
                self.env = load_environment(c.env, self.tokenizer, self.stop_ids)
        if backend != "static" and (c.partial_rollout or c.max_new_tokens_key):
            self.ctx.log(f"generator: partial_rollout and max_new_tokens_key are the static decoder's: the {backend} "
                         "backend drains its requests before each weight switch and ignores per-row caps")
        # Cast before the weight sync's setup: it tells the learner the dtype to push in. With vLLM
        # this copy only receives the pushes (vLLM holds its own): on the CPU where it can be.
        held = "cpu" if backend == "vllm" and c.weight_sync.transport == "object_store" else self.ctx.device
        # never trained here: no forward in any thread builds a graph (a worker thread runs with grad on)
        cast_model(self.model, held, resolve_dtype(c.dtype, self.ctx.device)).eval().requires_grad_(False)
        self.version = 0
        self.weight_sync = GeneratorWeightSync(self.ctx, c.weight_sync)
        with self.ctx.span("weight sync setup"):
            await self.weight_sync.setup(self.model)
        self.decoder, self.turn = None, None
        if backend == "hf":
            return
        max_pos = self.model.config.max_position_embeddings
        # an episode's slot holds its prompt and every turn's sampled and environment tokens
        self.max_response = c.env.max_episode_tokens if self.env else c.max_new_tokens
        turn_tokens = max(c.max_new_tokens, c.env.max_turn_tokens) if self.env else c.max_new_tokens
        self.max_prompt = default_prompt_room(c.max_prompt_tokens, max_pos, self.max_response)
        if backend == "vllm":
            from rl.generation.vllm_engine import build_decoder
            from rl.generation.vllm_episodes import VllmEpisodeDecoder
            # a minute or so: in a thread, so the actor keeps answering (weight sync, channels)
            with self.ctx.span("build decoder"):
                self.decoder = await asyncio.to_thread(
                    build_decoder, c, self.model, self.stop_ids, self.prompts_per_call * c.group_size,
                    self.max_prompt + self.max_response, self.ctx.gpu_share, lambda: self.weight_sync.version,
                    self.ctx.log, decoder=VllmEpisodeDecoder if self.env else None, max_new_tokens=turn_tokens)
            return
        if c.prompts_per_call == 0:     # auto: fewer prompts where their KV cache does not fit
            slot_len = self.max_prompt + self.max_response
            self.prompts_per_call = fitted_prompts_per_call(c, self.ctx.device, self.model, slot_len,
                                                            self.ctx.gpu_share, self.ctx.log)
        self.turn = GpuTurn(self.ctx.gpu_turn) if self.ctx.gpu_turn else None
        with self.ctx.span("build decoder"):   # phase switch: no cache until its first turn
            self.decoder = StaticDecoder(
                self.model, self.prompts_per_call * c.group_size, self.max_prompt + self.max_response,
                eos_id=self.stop_ids, max_new_tokens=turn_tokens,
                min_new_tokens=c.min_new_tokens, temperature=c.temperature, top_k=c.top_k,
                seed=c.seed, cuda_graphs=c.cuda_graphs, compile_layers=c.compile, cache=self.turn is None)

    def _give_turn(self) -> None:
        """Phase switch: the KV cache and graphs back to the GPU, the turn to the learner."""
        t = time.perf_counter()
        freed = self.decoder.free_cache()
        self.turn.give()
        self.ctx.metrics({"generator/kv_free_s": time.perf_counter() - t, "generator/kv_freed_gib": freed / 2**30})

    async def _take_turn(self) -> None:
        """Phase switch: wait for the learner's step to end; the cache is allocated in refresh()."""
        with self.ctx.span("wait for the GPU"):
            waited = await asyncio.to_thread(self.turn.take)
        self.ctx.metrics({"generator/gpu_turn_wait_s": waited})

    async def run(self):
        if self.decoder is None:
            await self._run_batched()      # the HF loop (rl/generation/hf_loop.py)
        else:
            await self._run_continuous()

    def _tokenize(self, msg) -> list[int]:
        # The prompt source sends the ids when it has the policy's tokenizer (chat template
        # rendered, truncated: nodes/prompts.py); else the text is tokenized here.
        ids = msg.data.get("prompt_ids") or self.tokenizer(msg.data["prompt"])["input_ids"]
        if self.decoder is not None and len(ids) > self.max_prompt:
            raise UserError(f"generator: prompt {msg.data['id']} has {len(ids)} tokens, more than "
                            f"generator.max_prompt_tokens={self.max_prompt}; raise it")
        return ids

    def _stop_strings(self, sample: dict) -> dict:
        return cut_at_stop_strings(sample, self.tokenizer, self.config.stop_strings)

    def _plan(self, msg) -> list[tuple[int, float | None]]:
        """msg's samples: (noise key, temperature or None) each (rl/generation/groups.sample_plan)."""
        c = self.config
        return sample_plan(msg, c.seed, c.group_size, None if self.decoder is None else self.decoder.num_slots)

    async def _run_continuous(self):
        c, dec = self.config, self.decoder
        prompts, out = self.ctx.inputs["prompts"], self.ctx.outputs["samples"]
        val_span, drain = ValidationSpan(self.ctx), Drain(self.ctx, dec.num_slots)
        partial = c.partial_rollout and isinstance(dec, StaticDecoder)   # vLLM's requests drain (logged)
        # Episodes: a group is admitted once its starts are done; each turn's end goes to the
        # environment; a group's counter falls as its episodes end (rl/generation/episodes.py).
        episodes = Episodes(self.ctx, self.env, dec, c.max_new_tokens) if self.env else None
        if partial or episodes:
            dec.token_versions = True

        def take(msg):
            if episodes is None:
                return msg, self._tokenize(msg)
            return msg, episodes.start(msg, self._plan(msg), None)

        # taken prompts, open groups, finished items waiting for room (rl/generation/groups.py)
        groups = PromptGroups(prompts, out, take, val_span)
        waiting, ready = groups.waiting, groups.ready

        def finish(n: int, j: int, sample: dict) -> None:
            groups.finish(n, j, sample if episodes else self._stop_strings(sample))

        try:
            while True:
                # Wait for work outside serving(): an idle generator must not hold the weights (the
                # collective push waits for them, and the prompt source for that push).
                await groups.send_ready()
                if not waiting and not groups.ended and not dec.active:   # live slots (partial rollout): no wait
                    await groups.take_batch(self.prompts_per_call)
                if not waiting and not dec.active:
                    if groups.ended:
                        return
                    continue
                if episodes and not dec.decoding:
                    # every live episode waits on its environment (or its start): wait here, out of
                    # serving(), so the weights may switch meanwhile (module docstring); meanwhile
                    # free slots take new prompts
                    if not waiting and not groups.ended and dec.free_slots() >= c.group_size:
                        groups.take_one()

                    def admissible() -> bool:
                        return bool(waiting) and waiting[0][1].done() and \
                            dec.free_slots() >= len(self._plan(waiting[0][0]))
                    if not episodes.stepped and not admissible():
                        await episodes.wait([waiting[0][1]] if waiting else [], 0.05 if dec.free_slots() else 1.0)
                        if not episodes.stepped and not admissible():
                            continue
                if self.turn is not None and dec.cache_freed:
                    await self._take_turn()
                async with self.weight_sync.serving() as self.version:
                    t = time.perf_counter()
                    freed = dec.cache_freed
                    await asyncio.to_thread(dec.refresh)   # re-captures graphs if weights moved
                    if freed:
                        self.ctx.metrics({"generator/kv_alloc_s": time.perf_counter() - t})
                    if partial or episodes:
                        dec.set_version(self.version)      # live slots' next tokens are this version's
                    with self.ctx.span("generate", version=self.version):
                        while True:
                            # Admit whole groups, only while these weights are the newest announced
                            # and the output has room (backpressure). Partial rollout: newer weights
                            # are switched to now, between decode steps, the slots kept.
                            # Finished groups the outbox had no room for go first, as soon as it
                            # has room: held to the end of the serving block, one full moment of
                            # the channel turned streaming into a batch at the end.
                            groups.send_ready_now()
                            if episodes:   # environment steps that ended: extend their slots or finish
                                extend, final = episodes.harvest()
                                for (n, j), sample in final:
                                    finish(n, j, sample)
                                if extend:
                                    with self.ctx.span("extend prefill", track="decoder", n=len(extend)):
                                        await asyncio.to_thread(dec.extend, extend)
                            admit = []
                            newer = self.ctx.latest_version(self.weight_sync.edge) > self.version
                            drain.newer(newer)
                            if newer and partial:
                                break
                            while not newer and not ready and dec.free_slots() - len(admit) >= c.group_size:
                                if not waiting and not groups.ended and not groups.take_one():
                                    break
                                if not waiting or (episodes and not waiting[0][1].done()):
                                    break
                                plan = self._plan(waiting[0][0])
                                if dec.free_slots() - len(admit) < len(plan):   # a larger validation group
                                    break
                                msg, ids = waiting.popleft()
                                number = groups.admit(msg, len(plan), self.version)
                                if episodes:
                                    requests, failed = episodes.admit(self._episode_prompts(msg, ids.result()), number)
                                    admit += requests
                                    for (n, j), sample in failed:
                                        finish(n, j, sample)
                                else:
                                    cap = response_cap(msg, c.max_new_tokens_key)
                                    admit += [(ids, (number, j), key, temp, cap) for j, (key, temp) in enumerate(plan)]
                            if admit:
                                with self.ctx.span("prefill", track="decoder", n=len(admit)):
                                    await asyncio.to_thread(dec.add, admit, episodes is not None)
                            if not dec.decoding:   # idle, or (episodes) every slot waits on its environment
                                break
                            drain.stepping(dec.free_slots())
                            with self.ctx.span("decode steps", track="decoder"):
                                ended = await asyncio.to_thread(dec.step)
                            for tag, sample in ended:
                                if episodes:
                                    episodes.turn_ended(tag, sample)     # tag: the episode
                                else:
                                    finish(*tag, sample)
                            if self.turn is not None and not dec.active and not waiting and not groups.take_one():
                                with self.ctx.span("free KV cache", track="decoder"):
                                    self._give_turn()   # milliseconds: the tensors and the pool freed
                                break
                        drain.ended()     # the slots are empty, or (partial rollout) newer weights are due
        finally:
            val_span.close()
            if episodes:
                episodes.close()

    def _episode_prompts(self, msg, runs: list) -> list:
        """The started episodes of msg's group, their first renders checked against the slots."""
        for r in runs:
            if len(r.prompt_ids) > self.max_prompt:
                raise UserError(f"generator: prompt {msg.data['id']} renders to {len(r.prompt_ids)} tokens in its "
                                f"episode's first turn, more than generator.max_prompt_tokens={self.max_prompt}; "
                                "raise it")
        return runs
