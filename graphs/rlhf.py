"""The settings the RLHF graphs here share (graphs/ppo.py, grpo.py, dapo.py): subclass RLHFConfig.

Not a graph itself: RLHFConfig is the public base of their configs. It holds every node's config and
the settings several nodes share, declared once in `rules` (dataflow/config.py): Graph(config=cfg)
copies them into the nodes (share), fills node defaults from them (fill) and checks them (check)
before the graph's nodes are declared, so --describe and config.json show what ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from dataflow import Graph, check, fill, share
from dataflow.config import rule_problems
from dataflow.errors import ConfigError
from dataflow.checks import AtLeast, Each, Finite, Fraction, NonNegative, Range
from dataflow.presets import auto_weight_transport
from nodes.critic import CriticConfig
from nodes.generator import GeneratorConfig
from nodes.learner import LearnerConfig
from nodes.prompts import PromptConfig
from nodes.reference import Reference, ReferenceConfig
from nodes.evaluator import VALIDATED, Evaluator, ValidationConfig
from nodes.reward import Reward, RewardConfig, RewardWithValidation
from nodes.reward_model import RewardModel, RewardModelConfig
from rl.data.policy import PolicySpec
from rl.data.tasks import make_task

PROGRESS = ["reward/mean±reward/std", "kl", "entropy", "staleness/mean", "perf/samples_per_s"]
"""The metrics on each step's progress line."""


def _max_new_tokens(cfg: RLHFConfig) -> int:
    """max_new_tokens, or the built-in task's when 0."""
    if cfg.max_new_tokens:
        return cfg.max_new_tokens
    if cfg.prompts.path:
        raise ValueError("set max_new_tokens=N when prompts.path points at your own data")
    return make_task(cfg.prompts.task, cfg.prompts.num_digits).max_new_tokens


def _travel_dtype(cfg: RLHFConfig) -> str:
    """The weights travel in the generators' dtype (auto: fp32 on CPU, bf16 on GPUs)."""
    gen = cfg.generator.dtype
    return gen if gen != "auto" else "float32" if cfg.placement == "cpu" else "bfloat16"


def _learner_reference(cfg: RLHFConfig) -> bool:
    """With LoRA the reference is the learner's base, its adapter disabled: no reference node."""
    return cfg.learner.lora.rank > 0 and cfg.needs_reference()


def _validation_problem(cfg: RLHFConfig) -> str | None:
    if cfg.val.path and cfg.reward_kind != "function":
        return ("val.path needs reward_kind=function: validation scores with the training's reward "
                "function (a reward model is not wired for it)")
    return None


def _reward_model_share_problem(cfg: RLHFConfig) -> str | None:
    share_, kind = cfg.reward_model_gpu_share, cfg.reward_kind
    if share_ and kind != "model":
        return ("reward_model_gpu_share is set, but reward_kind is 'function' (a program on CPU); "
                "set reward_kind=model or leave the share at 0")
    if share_ and cfg.placement == "cpu":
        return "reward_model_gpu_share needs placement=colocated or split (placement=cpu uses no GPU)"
    return None


def runs(algorithm: str, graph_file: str, instead: str):
    """A check rule: the graph's nodes are wired for one algorithm (a critic and GAE for ppo, group
    advantages for grpo), so `--set learner.algorithm=` another is a one-line error, not silently
    replaced by build(). The graph's config gives learner.algorithm that default."""
    def problem(cfg) -> str | None:
        if cfg.learner.algorithm == algorithm:
            return None
        return (f"learner.algorithm={cfg.learner.algorithm}: {graph_file} is wired for {algorithm} (its nodes), "
                f"which this setting cannot change; {instead}")
    return check(problem)


@dataclass(kw_only=True)
class RLHFConfig:
    policy: PolicySpec = field(default_factory=PolicySpec)
    """The policy every node starts from (a local HF dir, or the built-in tiny model)."""
    prompts: PromptConfig = field(default_factory=PromptConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reward_kind: Literal["function", "model"] = "function"
    """function: a program scores responses (`reward`). model: a sequence classifier (`reward_model`)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    max_new_tokens: Annotated[int, NonNegative] = 0
    """Longest response (0 = what the built-in task needs; set it for your own data)."""
    max_staleness: Annotated[int, NonNegative] = 1
    """Policy versions the generators may run ahead of the learner (0 = synchronous)."""
    weight_transport: Literal["auto", "object_store", "collective", "cuda_ipc"] = "auto"
    """How the learner's weights reach the generators. auto: cuda_ipc for placement=colocated with
    num_gpus=1 (a device-to-device copy, no CPU round trip), else object_store (dataflow/presets.py).
    object_store: a state dict through Ray's object store. collective: the HybridEngine push (gloo;
    NCCL when each end has a GPU of its own; llama/qwen2 policies), the `policy` edge then carries
    only the version. cuda_ipc: learner and every generator on ONE physical GPU (placement=colocated,
    num_gpus=1): the learner writes its weights, cast to the generators' dtype
    (learner.weight_sync.dtype), into GPU buffers it shares by CUDA IPC and each generator copies
    them on the GPU; no CPU round trip, costs two model-sized buffers on the learner and one per
    generator. Fails on CPU or across GPUs."""
    weight_checksums: bool = False
    """Log a checksum of the weights per version, learner and generators (metrics.jsonl)."""
    prompts_per_step: Annotated[int, AtLeast(1)] = 256
    generator_replicas: Annotated[int, NonNegative] = 0
    """Generator actors (0 = one per generator GPU, or 1 on CPU)."""
    channel_capacity: Annotated[int, AtLeast(1)] = 64
    placement: Literal["cpu", "colocated", "split"] = "cpu"
    """Where the model nodes run (dataflow/presets.py). cpu: no GPU. colocated: one pool of num_gpus
    GPUs that the generators (one per GPU), reference, critic and learner share, in equal shares, as
    evenly as they go. split: the generators get GPUs 0..num_gpus-2 (one whole GPU each), the learner
    side (reference, critic, learner) the last GPU. Each share caps that node's GPU memory. On a GPU
    that all of its pool's nodes share, the memory plan sets the shares from what each node needs
    (docs/gpus.md); elsewhere they are equal; gpu_shares sets them per node."""
    num_gpus: Annotated[int, AtLeast(1)] = 1
    """GPUs for placement=colocated or split (the cluster must have them; checked at start)."""
    reward_model_gpu_share: Annotated[float, Range(0, 1, high_open=True)] = 0.0
    """With reward_kind=model and a GPU placement: the reward model's share of one GPU of the
    learner's pool (the other shares there shrink to make room). 0 = the reward model on CPU."""
    gpu_shares: Annotated[dict[str, float], Each(Fraction)] = field(default_factory=dict)
    """A fraction of one GPU for named model nodes (generator, reference, critic, learner), each
    replica, e.g. '{"learner": 0.5}'; kept as given. Where all of a pool's nodes share one GPU
    (colocated with num_gpus=1, split's learner GPU), the memory plan gives the nodes not named
    what they need and the generator the rest (without a known GPU size: equal parts of what is
    left); on several colocated GPUs they keep their equal shares and the plan checks that
    everything fits. A share caps the node's GPU memory too."""
    phase_switch: Literal["auto", "on", "off"] = "auto"
    """Where the generator and the learner share one GPU (placement=colocated, num_gpus=1) and the
    static decoder generates: the decoder frees its KV cache whenever its slots run empty and the
    learner its activations and gradients after each step, and the two take turns on the GPU
    (rl/model/gpu_turns.py), so the memory plan lends the learner's step room to the KV cache:
    more decoder slots and a larger token budget on the same GPU (docs/gpus.md). The switch costs
    time: the decoder's CUDA graphs are captured again at each turn. auto: on with max_staleness=0
    (generation waits for each step anyway) where the fixed shares would not fit without gradient
    checkpointing; on: wherever possible, also with max_staleness > 0 (generation then waits for
    every learner step); off: fixed shares. vLLM: generator.vllm.sleep_level."""
    gpu_memory_gib: Annotated[float, NonNegative] = 0.0
    """GPU size for the memory plan (rl/model/applied_plan.py; --describe prints it on a GPU placement):
    it sets the shares, token budgets and checkpointing left at their defaults, and refuses before
    start a node that does not fit. As CUDA counts it (torch.cuda.mem_get_info()[1], a little under
    nvidia-smi's total): each node's cap is a fraction of that. 0 = the driver's GPU 0 if it has one,
    else the plan assumes an H200 (141 GiB), only prints and applies nothing."""
    val: ValidationConfig = field(default_factory=ValidationConfig)
    """Validation rounds on a held-out file (nodes/evaluator.py): val.path, val.every, val.n, val.k."""
    loggers: str = ""
    """Metric sinks besides metrics.jsonl: tensorboard, wandb, or both (dataflow/driver/loggers.py)."""
    max_steps: Annotated[int, AtLeast(1)] = 200
    """Stop after this many learner steps (--max-steps overrides)."""
    target_reward: Annotated[float, Finite] = 0.0
    """Stop as soon as the mean reward reaches this (0 = off)."""
    save_interval: Annotated[int, NonNegative] = 0
    """Checkpoint every this many steps and on Ctrl-C (0 = off); continue with --resume DIR."""
    keep_checkpoints: Annotated[int, AtLeast(0, note="0 keeps every checkpoint")] = 3
    """Checkpoints kept under <run>/checkpoints: older ones are deleted once a newer one is saved
    (0 = keep all)."""
    async_checkpoint: bool = True
    """Write checkpoints in the background: training waits only while the state is copied to CPU
    memory (host memory for it doubles until the files are written); False waits for the commit
    (dataflow/driver/checkpointer.py)."""
    drop_bad_items: bool = False
    """Drop (and count) channel items that fail to decode, instead of failing the node reading them."""
    stall_timeout_s: float | None = None
    """Seconds without a learner step after which the driver prints what every node waits for and
    the root of the wait (dataflow/driver/stall.py); None = max(300 s, 5 x the slowest step), < 0 = off."""
    stall_action: Literal["stop", "warn"] = "stop"
    """On a stall: stop the run (exit 1) naming the root, or warn and keep waiting."""
    stall_warn_s: float | None = 120.0
    """Seconds without a learner step after which the driver prints where every node is (their
    Python stacks too) once and the run goes on: an early look before the stall timeout; None = off."""
    use_reference: Literal["auto", "always"] = "auto"
    """The reference node (the frozen starting policy's log-probs) feeds only the KL term. auto: run
    it when learner.kl.coef > 0; with 0 nothing reads it, and the graph leaves out its model, its
    GPU share and its forward pass per step (as TRL does with beta=0, and verl without
    use_kl_loss / use_kl_in_reward). always: run it anyway, for the KL-to-reference metric."""
    max_restarts: Annotated[int, NonNegative] = 3
    """Times a generator, reward, reference, critic or prompt source replica is restarted after its
    process dies (its prompts are re-issued); the learner's death stops the run."""

    def __init_subclass__(cls, **kwargs):
        """A graph's config subclass: its rules must name real settings, checked at import time."""
        super().__init_subclass__(**kwargs)
        _check_rules(cls)

    rules: ClassVar[tuple] = (
        check(_reward_model_share_problem),
        check(_validation_problem),
        share("val", "prompts.val"),  # the source sends the validation rounds
        share("policy", "prompts.policy", "generator.policy", "reference.policy", "critic.policy", "learner.policy"),
        share("prompts_per_step", "prompts.prompts_per_step", "learner.prompts_per_step"),
        share("max_staleness", "prompts.max_staleness", "learner.max_staleness"),
        share("generator.temperature", "learner.temperature", "reference.temperature"),  # log-probs at the sampling temperature
        share("target_reward", "learner.target_reward"),
        share("max_new_tokens", "generator.max_new_tokens", value=_max_new_tokens),
        fill("learner.max_new_tokens", "generator.max_new_tokens"),  # overlong shaping's cap
        fill("generator.max_prompt_tokens", "prompts.max_prompt_tokens"),  # the source's bound holds in the decoder
        fill("weight_transport", lambda cfg: auto_weight_transport(cfg.placement, cfg.num_gpus)),
        share("weight_transport", "learner.weight_sync.transport", "generator.weight_sync.transport"),
        fill("learner.weight_sync.checksums", "weight_checksums"),
        fill("generator.weight_sync.checksums", "weight_checksums"),
        fill("learner.weight_sync.dtype", _travel_dtype),
        fill("learner.own_reference", _learner_reference),
        fill("reward.tokenizer_path", "policy.path"),  # responses decoded with the policy's tokenizer
    )

    def preflight(self) -> list[str]:
        """The data, the prompt lengths and the reward, checked before start (rl/preflight.py)."""
        from rl.preflight import pipeline_problems

        by_function = self.reward_kind == "function"
        return pipeline_problems(self.prompts, self.generator, self.reward if by_function else None,
                                 None if by_function else self.reward_model, max_new_tokens_key="max_new_tokens")

    def memory_plan(self, graph):
        """The memory plan of `graph` on its GPUs (rl/model/applied_plan.py), applied to it once: the
        shares, token budgets and checkpointing the user left at their defaults; None on CPU.
        dataflow's load_graph applies it, --describe prints it, its preflight refuses one that does
        not fit. Applied only when the GPU's size is known (gpu_memory_gib, or the driver's GPU 0)."""
        if getattr(graph, "memory_plan", None) is not None or graph.placement in (None, "cpu"):
            return graph.memory_plan
        from rl.model.applied_plan import apply, rlhf_plan
        from rl.model.memory_plan import GiB

        size, known = self.gpu_memory_gib * GiB, self.gpu_memory_gib > 0
        if not known:
            size = gpu_total_bytes()
            known = size > 0
        longest = None
        if not self.generator.max_prompt_tokens and not self.generator.env.path:
            from rl.preflight import longest_prompt   # the data's rows, which the checks then reuse
            longest = longest_prompt(self.prompts)
        plan = rlhf_plan(self, graph, int(size or 141 * GiB), known, longest)
        if plan is not None and plan.enforced and not plan.problem:
            apply(plan, self, graph)
        graph.memory_plan = plan
        return plan

    def reward_node(self) -> dict:
        """g.node() arguments of the reward node reward_kind asks for: a program, or a sequence
        classifier (on CPU, or on its reward_model_gpu_share of a GPU of the learner's side)."""
        if self.reward_kind == "model":
            on_gpu = {"side": "train", "gpus": self.reward_model_gpu_share} if self.reward_model_gpu_share else {}
            return {"kind": RewardModel, "config": self.reward_model, "cpus": 0.2, **on_gpu}
        kind = RewardWithValidation if self.val.path else Reward   # + a `validation` port
        return {"kind": kind, "config": self.reward, "cpus": 0.1}

    def needs_reference(self) -> bool:
        """Whether the learner reads reference log-probs (use_reference)."""
        return not (self.use_reference == "auto" and self.learner.kl.coef == 0)

    def add_reference(self, g: Graph, src: str, name: str = "scored") -> str:
        """src -> reference (a channel called `name`), returning the port that carries the samples
        on: "reference.with_ref", or `src` itself when the graph needs no reference (use_reference)
        or the learner computes the log-probs itself (learner.own_reference: LoRA)."""
        if not self.needs_reference() or self.learner.own_reference:
            return src
        g.node("reference", Reference, self.reference, cpus=0.2, side="train")
        g.channel(src, "reference.scored", capacity=self.channel_capacity, name=name)
        return "reference.with_ref"

    def add_validation(self, g: Graph) -> None:
        """With val.path: the validation branch, reward.validation -> evaluator, and the evaluator's
        `validated` edge back to the prompt source (which holds the next batch until a round is in)."""
        if self.val.path:
            g.node("evaluator", Evaluator, self.val, cpus=0.1)
            g.channel("reward.validation", "evaluator.validation", capacity=self.channel_capacity, name="validation")
            g.versioned(VALIDATED, src="evaluator", dst=["prompts"])


def gpu_total_bytes() -> int:
    """GPU 0's memory as CUDA counts it, the total that each node's allocator cap is a fraction of
    (set_per_process_memory_fraction), from nvidia-smi (no CUDA context in the driver): its total
    less what the driver and firmware reserve. Planned against the total alone, every node's cap
    fell short of the bytes the plan gave it. Torch's count without nvidia-smi; 0 without a GPU."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        # memory.reserved is not known to every driver: then the total alone
        for fields in ("memory.total,memory.reserved", "memory.total"):
            try:
                out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True, timeout=20)
                mib = [float(x) for x in out.stdout.strip().split(",")] if out.returncode == 0 else []
            except (OSError, ValueError, subprocess.SubprocessError):
                mib = []
            if mib and mib[0] > 0:
                return int((mib[0] - sum(mib[1:])) * (1 << 20))
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


def _check_rules(cls: type) -> None:
    """ConfigError (at import) when a share/fill rule of `cls` names a setting that does not exist."""
    if found := rule_problems(cls):
        raise ConfigError("; ".join(found))


_check_rules(RLHFConfig)
