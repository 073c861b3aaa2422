"""Generator: samples responses with a transformers causal LM, tagged with the policy version.

Consumes: `prompts` {"id", "prompt", "fields"}.
Produces: `samples`, one item per prompt: {"id", "prompt", "fields", "version",
          "samples": [{"prompt_ids", "response_ids", "logprobs", "finished"[, "token_versions"]} x group_size]}.
Waits for: prompts (admitted by the prompt source under the staleness bound).
Unblocked by: the prompt source; new weights arrive on the versioned edge `policy` at any time
(weight_sync.transport=collective: by the learner's HybridEngine push; dataflow/weights/sync.py).

Llama / Qwen2 policies decode with rl/generation/decoding.py (static KV cache, CUDA graphs on a GPU) by
continuous batching: prompts_per_call x group_size slots are refilled from the `prompts` channel as
prompts arrive and sequences finish, and each prompt's item goes downstream as soon as its whole
group finished, not after a batch (rl/generation/groups.py). A prompt's group is admitted at once,
and only while no newer weight version is announced: then admission stops, the slots drain, the
weights switch (between serving() blocks), and admission resumes, so no response or group mixes versions. Prompts already
taken are generated, never lost. generator.backend=vllm runs a vLLM engine in the same loop
(rl/generation/vllm_engine.VllmDecoder has the decoder's interface; the weight sync writes into this replica's
HF copy, which is loaded into vLLM at each switch). The HF loop (rl/generation/hf_loop.py) runs in
batches of up to prompts_per_call prompts, switching weights between batches.
Generation runs in a worker thread so the actor keeps answering channel pulls and weight pushes.

Partial rollouts (generator.partial_rollout; slime's and verl's name, AReaL's interruptible
generation): on a newer version the live sequences are not drained: the loop leaves serving()
between two decode steps, the weights switch, the sequences go on under them with their KV cache
kept (rl/generation/decoding.py), and admission resumes at once. Each sample carries "token_versions" (per
response token, the version that sampled it; AReaL's per-token versions). The item's "version" is
its oldest token's, the one its group was admitted under, so the prompt source's staleness bound
holds for every token; the learner weights each token by its own (rl/algorithm/losses.behaviour_weights). A
response then depends on when the weights switched. Every switch reports generator/drain_s (from
seeing a newer version to leaving the old weights, admission stopped) and drain_free_slots.

Validation prompts (data "val", nodes/evaluator.py) get 1 + val.n responses instead of a group:
the first greedy (temperature 0, a per-slot setting of the decoder; rl/generation/decoding.py), the others at
the training temperature. In the continuous decoder they share decode steps with training prompts
(the span "generate val" on the track "val" marks them); the HF loop decodes them in calls of their
own (span "generate val").

Multi-turn episodes (env.path set; graphs/agent.py): each sample of a group is an episode of the
user's environment, which runs here, inside the generator (rl/generation/episodes.py): a slot
whose turn ends waits (parked, its KV cache kept) while its environment step runs on this actor's
event loop and the other slots keep decoding; the environment's tokens are then prefilled after the
slot's cache (no re-prefill of the history) and the next turn decodes. A group goes downstream
once all its episodes ended. The HF loop runs episodes too, simpler: each turn re-prefills the
whole history, a batch's episodes turn in lockstep (rl/generation/episodes.hf_episodes). vLLM
runs episodes through rl/generation/vllm_episodes.py (each turn a new request, the history served
by vLLM's prefix cache). stop_strings do not apply to episodes.

Determinism: the static decoder's noise is a function of (seed, prompt id, sample index, token
index) only, so a prompt samples the same responses on any replica, in any batch or slot, after a
restart or a resume (up to float differences between batch shapes). The HF loop seeds a
torch.Generator per call from (seed, id of the call's first prompt).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch

from dataflow import Node
from dataflow.checks import AtLeast, Each, NonNegative
from dataflow.errors import UserError
from rl.generation.episodes import Episodes
from rl.generation.hf_loop import HFLoop
from rl.generation.reports import Drain, ValidationSpan
from rl.data import policy
from rl.model.gpu_turns import GpuTurn
from rl.model.memory_plan import default_prompt_room
from rl.model.precision import cast_model
from rl.agent import EnvConfig, environment_problems, load_environment
from rl.generation.decoder_slots import fitted_prompts_per_call, prompts_per_call
from rl.generation.decoding import StaticDecoder, unsupported_reason
from rl.generation.groups import PromptGroups, response_cap, sample_plan
from rl.generation.hf_sampling import cut_at_stop_strings
from rl.generation.vllm_engine import VllmConfig, choose_backend, missing_vllm, vllm_installed
from dataflow.weights.sync import SYNC_EDGE, GeneratorWeightSync, WeightSyncConfig


@dataclass(kw_only=True)
class GeneratorConfig:
    policy: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    """The model to sample from (the learner pushes its weights here)."""
    group_size: Annotated[int, AtLeast(1)] = 1
    """Responses per prompt (GRPO groups; 1 for PPO)."""
    max_new_tokens: Annotated[int, AtLeast(1)] = 8
    """Longest response in tokens."""
    min_new_tokens: Annotated[int, NonNegative] = 0
    """Every stop token is masked out (of the sampled distribution and its log-probs) before this
    many tokens."""
    stop_token_ids: Annotated[list[int], Each(NonNegative)] = field(default_factory=list)
    """Ids that end a response, besides the tokenizer's eos and every eos id of the model's
    generation_config.json (always on; rl/data/policy.stop_token_ids). The stop token stays in the
    trained response."""
    stop_strings: list[str] = field(default_factory=list)
    """Texts that end a response: after generation, a response is cut after the token that
    completes the first one (rl/generation/hf_sampling.cut_at_stop_strings; the tokens past it were generated and
    are dropped). Prefer stop_token_ids where the stop is one token: it saves that compute."""
    temperature: Annotated[float, NonNegative] = 1.0
    top_k: Annotated[int, NonNegative] = 0
    """Sample from the k most likely tokens (0 = all)."""
    prompts_per_call: Annotated[int, NonNegative] = 0
    """Prompts decoded at once: the static decoder has prompts_per_call x group_size slots,
    refilled as prompts arrive; the HF loop takes up to this many per call. 0 = auto: 256 slots'
    worth on CUDA (256 // group_size prompts: 32 for GRPO's groups of 8, 256 for PPO), 32 prompts
    on CPU. On a GPU a decode step costs little more for 256 slots than for 32, so more slots are
    nearly free throughput (bench/results/w1_step_h200_2026-11-30a.md). Auto takes fewer slots
    when their KV cache would fill more than half of the GPU memory this replica has left, or on a
    CPU a quarter of the machine's available memory (logged; rl/generation/decoder_slots.py)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and KV cache dtype (auto: bfloat16 on CUDA, float32 on CPU). The learner's weights
    are cast into it as they arrive."""
    backend: Literal["auto", "static", "hf", "vllm"] = "auto"
    """static: our decoder (rl/generation/decoding.py; llama / qwen2); hf: the plain transformers loop; vllm: a
    vLLM engine per replica (rl/generation/vllm_engine.py; CUDA, `pip install -e '.[vllm]'`). auto: static for
    the models it covers, else vllm on CUDA when installed, else hf. The choice and why: logged."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """backend=vllm: the engine's memory share and sleep mode (rl/generation/vllm_engine.VllmConfig)."""
    max_prompt_tokens: Annotated[int, NonNegative] = 0
    """Static decoder: longest prompt (sizes the KV cache with max_new_tokens). 0 = the model's
    max_position_embeddings - max_new_tokens, within [256, 1024]; on a GPU the memory plan sets it to
    the data's longest prompt, training and validation (episodes excepted). A longer prompt fails the node."""
    cuda_graphs: bool = True
    """Static decoder on CUDA: replay each decode step as a CUDA graph (False: eager, to compare)."""
    compile: bool | None = None
    """Static decoder: torch.compile each layer's parts around attention (None = on CUDA;
    rl/generation/decoder_forward.attention_input / attention_output).
    Compiled at setup; a machine without a working compiler decodes with eager layers (logged)."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How the learner's weights arrive (must match the learner's; dataflow/weights/sync.py)."""
    partial_rollout: bool = False
    """Static decoder: a response still decoding when new weights arrive continues under them (its
    KV cache kept) instead of the slots draining first; each token is tagged with its version and
    the learner weights it per token (module docstring). The HF loop ignores it (logged)."""
    max_new_tokens_key: str = ""
    """Static decoder: the prompt row's field (in its "fields") that caps that prompt's responses,
    at most max_new_tokens (empty = off): a per-row length, e.g. a long-tailed benchmark's
    (bench/partial_rollout.py)."""
    seed: int = 0
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes: the user's environment or tools (rl/agent/config.py; graphs/agent.py
    sets it from its env.* settings). env.path "" = single-turn responses."""

    def preflight(self) -> list[str]:
        """backend=vllm where vllm is not installed, and the env file's mistakes (a syntax error, no
        such class or tool, a signature that cannot be called, a tool without type hints): one line
        each, before anything starts (rl/agent/loading.environment_problems)."""
        vllm = [missing_vllm("backend=vllm")] if self.backend == "vllm" and not vllm_installed() else []
        return vllm + environment_problems(self.env)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)


class Generator(HFLoop, Node):
    Config = GeneratorConfig
    inputs = ("prompts",)
    outputs = ("samples",)
    subscribes = ("policy", SYNC_EDGE)

    @classmethod
    def restart_refusal(cls, config: GeneratorConfig) -> str:
        if config.weight_sync.transport == "collective":
            return ("weight_transport=collective: a new process cannot join the learner's running push "
                    "group (weight_transport=object_store or cuda_ipc restart generators)")
        return ""

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
