"""The vLLM generator backend (generator.backend=vllm): one offline vLLM engine per generator replica,
driven like rl/generation/decoding.StaticDecoder, so nodes/impl/generator.py's continuous loop runs it unchanged.

Importing this module never imports vllm: every vllm import is inside a function, so the project
imports (and CI runs) without it. Verified against vllm 0.26.0's source (the wheel's own files):
  - engine: `vllm.LLM(...)`, then its `llm_engine` (v1/engine/llm_engine.py): `add_request(id,
    prompt, params)`, `step()` -> the RequestOutputs that finished (FINAL_ONLY), `abort_request`.
    A step loop, not `llm.generate`: generate() returns when its whole batch is done, while the
    loop admits a group whenever slots free up and hands back each sample as it finishes, so a
    group goes downstream as soon as its last sample does (the static decoder's streaming).
  - one request per sample (n=1, seed = the sample's noise key): vLLM's LLMEngine.add_request fans
    `n > 1` out into n child requests anyway (ParentRequest), so this costs nothing more, keeps
    each sample reproducible from its key, and lets a validation group mix a greedy sample with
    sampled ones. Prefix caching (on) shares the prompt's KV blocks between a group's requests.
  - log-probs: `logprobs_mode="processed_logprobs"` (config/model.py LogprobsMode): the sampler
    (v1/worker/gpu/sample/sampler.py, and v1/sample/sampler.py) then reports log_softmax of the
    logits after min_tokens masking, penalties, temperature and top-k/top-p: the distribution it
    samples from, the learner's convention (log-probs at the sampling temperature) and what the
    static decoder records. `SamplingParams(logprobs=0)` asks for the sampled token's only;
    `flat_logprobs=True` returns them as one `vllm.logprobs.FlatLogprobs` (no dict per token).
  - weights: `llm.collective_rpc(fn, args=...)` (v1/serial_utils.run_method: fn(worker, *args) on
    every worker), fn calling `worker.get_model().load_weights(iterable of (HF name, tensor))`, which
    fuses q/k/v and gate/up itself; then `llm.reset_prefix_cache()`, or cached prompt blocks would
    mix versions.
  - sleep mode: `enable_sleep_mode=True`, `llm.sleep(level)` (1: weights to CPU, KV cache freed;
    2: both freed), `llm.wake_up()`.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): collective_rpc then hands
the weight tensors over by reference, with nothing serialised; tensor_parallel_size > 1 uses
vLLM's multiprocessing executor, whose workers receive CUDA IPC handles of the tensors instead.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Literal

from dataflow.checks import NonNegative, Range
from dataflow.errors import UserError
from rl.generation.vllm_sampling import sampling_params, to_sample

VLLM_VERSION = "0.26.0"
INSTALL = f"pip install -e '.[vllm]' (vllm=={VLLM_VERSION}, which needs torch 2.11)"
BACKENDS = ("auto", "static", "hf", "vllm")


@dataclass(kw_only=True)
class VllmConfig:
    gpu_memory_utilization: Annotated[float, Range(0, 1, high_open=True)] = 0.0
    """vLLM's share of the GPU's memory (weights, activations, KV cache); vLLM then sizes its KV cache
    by profiling the GPU's free memory, which fails when nodes on the same GPU allocate or free
    meanwhile. 0 = auto: the KV cache is sized without that profile, from the slots
    (auto_kv_cache_bytes, vLLM's kv_cache_memory_bytes), within 0.9 x this replica's GPU share less
    what the replica already holds there (the weights it receives)."""
    sleep_level: Literal[0, 1, 2] = 0
    """Sleep mode while the replica is idle (training shares the GPU): 1 frees the KV cache and
    moves the weights to CPU, 2 frees both (the weights are reloaded from the replica's copy on
    waking). 0 = off."""
    sleep_idle_s: Annotated[float, NonNegative] = 0.5
    """Idle time (no request in flight) before the engine sleeps, when sleep_level > 0."""
    enforce_eager: bool = False
    """No CUDA graphs in vLLM (faster start, slower decoding)."""
    seeded: bool = True
    """Seed each request with its sample's noise key: a prompt's responses do not depend on the
    batch or replica (as the static decoder). False: vLLM's own random seeds."""


def vllm_installed() -> bool:
    """Whether vllm is installed, without importing it."""
    return importlib.util.find_spec("vllm") is not None


def missing_vllm(who: str = "generator.backend=vllm") -> str:
    return f"{who}: vllm is not installed here; {INSTALL}"


def choose_backend(requested: str, static_reason: str | None, device: str,
                   vllm_ok: bool | None = None) -> tuple[str, str]:
    """(backend, why) for generator.backend=`requested`. `static_reason`: why the static decoder
    cannot run the model (rl/generation/decoding.unsupported_reason; None: it can). auto: static where it
    can run, else vLLM on CUDA where installed, else the HF loop. vllm without vllm installed is a
    UserError naming what to install."""
    if requested not in BACKENDS:
        raise UserError(f"generator.backend={requested!r}: use one of {', '.join(BACKENDS)}")
    cuda = str(device).startswith("cuda")
    if requested == "vllm":
        if not (vllm_installed() if vllm_ok is None else vllm_ok):
            raise UserError(missing_vllm())
        if not cuda:
            raise UserError(f"generator.backend=vllm needs a CUDA GPU; this generator runs on {device} "
                            "(placement=cpu?): use generator.backend=static or hf")
        return "vllm", "generator.backend=vllm"
    if requested == "hf":
        return "hf", "generator.backend=hf"
    if requested == "static":
        if static_reason:
            raise UserError(f"generator.backend=static: the static decoder cannot run this model: "
                            f"{static_reason}; use generator.backend=auto, vllm or hf")
        return "static", "generator.backend=static"
    if static_reason is None:
        return "static", "auto: the static decoder supports this model"
    if not cuda:
        return "hf", f"auto: {static_reason}, and vLLM needs CUDA"
    if vllm_installed() if vllm_ok is None else vllm_ok:
        return "vllm", f"auto: {static_reason}; vLLM is installed"
    return "hf", f"auto: {static_reason}, and vLLM is not installed ({INSTALL} for it)"


def engine_weights(model) -> list[tuple[str, object]]:
    """(name, tensor) pairs for vLLM's load_weights: HF checkpoint names (vLLM fuses q/k/v and
    gate/up itself), a tied lm_head left out: dataflow/weights/adapters.py's "hf" form, which is
    every family's own names."""
    from dataflow.weights.adapters import WeightAdapter

    params = {n: p.detach() for n, p in model.named_parameters()}
    return list(WeightAdapter(None, "hf").to_engine(params).items())


def _worker_load(worker, weights) -> int:
    """Runs on every vLLM worker (collective_rpc; `worker` is vLLM's GPU worker): load (name,
    tensor) pairs, or CUDA IPC handles of them, with the model's own load_weights. A module-level
    function: vLLM's multiprocessing executor sends it by name (cloudpickle) and its arguments
    with pickle, which a lambda would not survive."""
    import torch
    from dataflow.weights.ipc import open_handle

    if weights and isinstance(weights[0][1], tuple):        # tensor parallel: open the handles
        weights = [(n, open_handle(h, 0)) for n, h in weights]
    with torch.no_grad():
        worker.get_model().load_weights(weights)
    torch.cuda.synchronize()
    return len(weights)


def engine_dir(model, path: str) -> tuple[str, bool]:
    """(directory vLLM loads, dummy weights?): the policy's directory, or for a built-in random-init
    policy (no path) its config saved to a temporary directory, weights loaded from the replica's
    copy at the first refresh()."""
    if path:
        return path, False
    import tempfile

    out = tempfile.mkdtemp(prefix="vllm-policy-")
    config = model.config
    if not config.architectures:      # a config built in code names none; vLLM picks its model by it
        config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    return out, True


def build_decoder(c, model, stop_ids: list[int], num_slots: int, max_len: int, gpu_share: float,
                  version, log=print, decoder: type | None = None, max_new_tokens: int = 0) -> "VllmDecoder":
    """The generator's VllmDecoder from its GeneratorConfig `c` (nodes/generator.py): sized to this
    replica's GPU share, tensor parallel over the replica's GPUs. decoder: the class to build (VllmDecoder unless the
    caller passes the multi-turn VllmEpisodeDecoder), a turn capped at max_new_tokens (0: c.max_new_tokens)."""
    import torch

    from rl.generation.decoder_slots import auto_kv_cache_bytes, auto_memory_utilization

    if not vllm_installed():
        raise UserError(missing_vllm())
    tp = max(1, torch.cuda.device_count())
    util, kv_bytes = c.vllm.gpu_memory_utilization, None
    dtype = "bfloat16" if c.dtype == "auto" else c.dtype     # generator.dtype on CUDA
    if not util:
        held = torch.cuda.memory_allocated()
        if c.weight_sync.transport == "cuda_ipc":   # its staging buffer comes with the first push
            held += sum(p.numel() * p.element_size() for p in model.parameters())
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        util = auto_memory_utilization(gpu_share or 1.0, held, total)
        dtype_bytes = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        weights = sum(p.numel() for p in model.parameters()) * dtype_bytes // tp      # the engine's own copy
        kv_bytes = auto_kv_cache_bytes(model.config, num_slots=num_slots, max_len=max_len, dtype_bytes=dtype_bytes,
                                       room_bytes=int(util * total) - weights, tensor_parallel=tp)
    directory, dummy = engine_dir(model, c.policy.path)
    memory = f"KV cache {kv_bytes / 2**30:.2f} GiB (auto)" if kv_bytes else f"gpu_memory_utilization {util:g}"
    log(f"generator: vLLM engine on {tp} GPU(s), {memory}, {num_slots} sequences "
        f"of up to {max_len} tokens, {dtype}" + (f", sleep level {c.vllm.sleep_level}" if c.vllm.sleep_level else ""))
    return (decoder or VllmDecoder)(
        directory, model, num_slots=num_slots, max_len=max_len, stop_ids=stop_ids,
        max_new_tokens=max_new_tokens or c.max_new_tokens, min_new_tokens=c.min_new_tokens, temperature=c.temperature,
        top_k=c.top_k, seed=c.seed, stop_strings=c.stop_strings, dtype=dtype,
        gpu_memory_utilization=util, kv_cache_bytes=kv_bytes, tensor_parallel_size=tp, config=c.vllm, version=version,
        loaded=None if dummy else 0, dummy_weights=dummy, log=log)


class VllmDecoder:
    """StaticDecoder's interface (add, step, active, free_slots, refresh, num_slots) over a vLLM
    engine. `model` is the replica's HF copy of the weights, which the weight sync writes into;
    refresh() loads them into vLLM whenever `version()` (the version the sync switched to) moved
    since the last load. Not thread-safe beyond the idle sleep timer: one caller at a time."""

    def __init__(self, model_dir: str, model, *, num_slots: int, max_len: int, stop_ids: list[int],
                 max_new_tokens: int, min_new_tokens: int = 0, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop_strings: list[str] | tuple = (),
                 dtype: str = "bfloat16", gpu_memory_utilization: float = 0.5, kv_cache_bytes: int | None = None,
                 tensor_parallel_size: int = 1, config: VllmConfig | None = None,
                 version=lambda: 0, loaded: int | None = 0, dummy_weights: bool = False,
                 executor: str | None = None, log=print):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine core in this process
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # not in the GPU machine's kit
        from vllm import LLM

        self.config = config or VllmConfig()
        self.model, self.synced_version, self.loaded, self.log = model, version, loaded, log
        self.num_slots, self.max_len, self.max_new_tokens = num_slots, max_len, max_new_tokens
        self.stop_ids = [int(i) for i in stop_ids]
        self.temperature, self.seed = temperature, seed
        # vLLM's workers: in this process for one GPU; in processes of their own ("mp") for tensor
        # parallel, or when asked (bench/vllm_check.py's sleep part runs that path on one GPU)
        executor = executor or ("mp" if tensor_parallel_size > 1 else None)
        self.remote_workers = executor == "mp"
        self._params = dict(top_k=top_k, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                            stop_ids=self.stop_ids, stop_strings=list(stop_strings))
        self.llm = LLM(
            model=model_dir, skip_tokenizer_init=not stop_strings, dtype=dtype, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_bytes,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=executor,
            max_model_len=max_len, max_num_seqs=num_slots, enable_prefix_caching=True,
            logprobs_mode="processed_logprobs", enable_sleep_mode=self.config.sleep_level > 0,
            enforce_eager=self.config.enforce_eager, load_format="dummy" if dummy_weights else "auto")
        self.engine = self.llm.llm_engine
        self.requests: dict[str, tuple] = {}       # request id -> (tag, prompt ids)
        self._count = 0
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self.asleep = False
        self.sleeps = 0
        self.weight_loads = 0

    # ----- the StaticDecoder interface --------------------------------------------------------
    @property
    def active(self) -> int:
        return len(self.requests)

    @property
    def decoding(self) -> int:
        """Requests in the engine (no slot is ever parked here)."""
        return len(self.requests)

    cache_freed = False
    """The generator never frees this engine's KV cache: vLLM's sleep mode does, on its own timer."""

    def free_slots(self) -> int:
        return self.num_slots - len(self.requests)

    def _cap(self, cap: int | None) -> int:
        """A request's own max_new_tokens (None = the decoder's), within 1..the decoder's."""
        return self.max_new_tokens if cap is None else max(1, min(int(cap), self.max_new_tokens))

    def refresh(self) -> None:
        """Called before each serving period (nothing in flight): wake the engine, load the
        replica's weights if their version moved."""
        with self._lock:
            self._ready()

    def add(self, requests: list[tuple], keep: bool = False) -> None:
        """Requests (prompt_ids, tag, key[, temperature[, max_new_tokens]]), as StaticDecoder.add;
        keep (park a slot for the next turn) is VllmEpisodeDecoder's."""
        if keep:
            raise ValueError("VllmDecoder.add: keep is for episodes (VllmEpisodeDecoder)")
        if not requests:
            return
        if len(requests) > self.free_slots():
            raise ValueError(f"VllmDecoder.add: {len(requests)} requests, {self.free_slots()} free slots")
        longest = max(len(r[0]) for r in requests)
        if longest + self.max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {longest} tokens + max_new_tokens={self.max_new_tokens} "
                             f"exceeds the engine's max_model_len={self.max_len}")
        with self._lock:
            self._ready()
            for r in requests:
                ids, tag, key = r[0], r[1], r[2]
                temp = r[3] if len(r) > 3 and r[3] is not None else self.temperature
                params = sampling_params(temperature=temp, seed=int(key) if self.config.seeded else None,
                                         **{**self._params, "max_new_tokens": self._cap(r[4] if len(r) > 4 else None)})
                rid = str(self._count)
                self._count += 1
                self.requests[rid] = (tag, list(ids))
                self.engine.add_request(rid, {"prompt_token_ids": list(ids)}, params)

    def step(self, num_steps: int = 8) -> list[tuple[object, dict]]:
        """Up to `num_steps` engine steps, returning early once a sample finished:
        [(tag, sample)] of the finished ones."""
        out = []
        with self._lock:
            for _ in range(num_steps):
                if not self.requests:
                    break
                for ro in self.engine.step():
                    if not ro.finished:
                        continue
                    tag, prompt = self.requests.pop(ro.request_id)
                    out.append((tag, to_sample(prompt, ro.outputs[0], self.stop_ids)))
                if out:
                    break
            if not self.requests:
                self._arm_sleep()
        return out

    def abort(self) -> None:
        """Drop every request in flight (their samples are lost)."""
        with self._lock:
            self.engine.abort_request(list(self.requests))
            self.requests.clear()

    # ----- weights and sleep ------------------------------------------------------------------
    def _ready(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.asleep:
            t = time.perf_counter()
            self.llm.wake_up()
            self.asleep = False
            self._note(f"awake in {time.perf_counter() - t:.2f} s")
        version = self.synced_version()
        if version != self.loaded:
            self.load_weights()
            self.loaded = version

    def load_weights(self) -> None:
        """The replica's HF weights into vLLM (between serving periods), then forget cached prompt
        blocks: they hold K/V of the old weights."""
        weights = engine_weights(self.model)
        tensors = weights          # referenced until every worker loaded them (the handles point here)
        if self.remote_workers and weights and weights[0][1].is_cuda:   # workers in other processes: CUDA IPC
            from dataflow.weights.ipc import share
            weights = [(n, share(t)) for n, t in weights]      # (CPU tensors travel pickled)
        self.llm.collective_rpc(_worker_load, args=(weights,))
        del tensors
        self.llm.reset_prefix_cache()
        self.weight_loads += 1

    def _arm_sleep(self) -> None:
        c = self.config
        if c.sleep_level and not self.asleep and self._timer is None:
            self._timer = threading.Timer(c.sleep_idle_s, self._sleep)
            self._timer.daemon = True
            self._timer.start()

    def _sleep(self) -> None:
        with self._lock:
            self._timer = None
            if self.requests or self.asleep:
                return
            import torch

            free, t = torch.cuda.mem_get_info()[0], time.perf_counter()
            self.llm.sleep(level=self.config.sleep_level)
            self.asleep = True
            self.sleeps += 1
            self._note(f"asleep (level {self.config.sleep_level}) in {time.perf_counter() - t:.2f} s, "
                       f"{(torch.cuda.mem_get_info()[0] - free) / 2**30:.1f} GiB of the GPU freed")
            if self.config.sleep_level == 2:
                self.loaded = None          # weights freed: reload on waking

    def _note(self, text: str) -> None:
        # the first sleeps and wake-ups, with their cost: what sleep mode buys and takes per step
        if self.sleeps <= 3:
            self.log(f"generator: vLLM {text}")

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
