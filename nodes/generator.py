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

This file declares the kind (its settings and ports: what the driver reads before Ray starts, no
torch); nodes/impl/generator.py runs it (Node.implementation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from dataflow import Node
from dataflow.checks import AtLeast, Each, NonNegative
from dataflow.weights.edges import SYNC_EDGE, WeightSyncConfig
from rl.agent import EnvConfig, environment_problems
from rl.data import policy
from rl.generation.vllm_engine import VllmConfig, missing_vllm, vllm_installed


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


class Generator(Node):
    Config = GeneratorConfig
    inputs = ("prompts",)
    outputs = ("samples",)
    subscribes = ("policy", SYNC_EDGE)
    implementation = "nodes.impl.generator:Generator"

    @classmethod
    def restart_refusal(cls, config: GeneratorConfig) -> str:
        if config.weight_sync.transport == "collective":
            return ("weight_transport=collective: a new process cannot join the learner's running push "
                    "group (weight_transport=object_store or cuda_ipc restart generators)")
        return ""
