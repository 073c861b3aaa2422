"""Compile the learner's layers while the rest of the graph starts, not in its first step.

Compiled layers (rl/model/precision.compile_layers) build their graphs on first use. Without a warm-up
that first use is the first training step, which then waits for the compile after the generator's
own set-up and first batch, on the critical path of a short run
(bench/results/trl_smollm2_h200_2026-12-03a.md).
The warm-up runs the learner's real update (rl/update/ppo_update.ppo_update: the same passes, grad modes,
masks, column alignment and micro-batch split as a training step) on made-up samples shaped like
a step's, with an optimizer that never steps, on a thread started in the learner's set-up; the
first real step waits for it. The weights, the optimizer state and the learner's rng are
untouched; the gradients are dropped.

Why this and not a made-up forward: an earlier warm-up (removed in af94277) ran hand-built passes
and compiled four graphs the real batches never used: its batch was under inductor's fusion-size
guard (576*B*T < 5242880), and it ran without an attention mask and in the other grad mode. The
real update on a step-sized batch takes the real batches' guards.
"""

from __future__ import annotations

import asyncio
import random
import time

import torch


class _NoStep:
    """An optimizer for ppo_update that clears gradients and never changes a weight."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self) -> None:
        pass


def made_up_samples(c, vocab_size: int, prompt_tokens: tuple[int, int] = (16, 64), seed: int = 0,
                    count: int | None = None, cap: int | None = None, avoid: frozenset = frozenset()) -> list[dict]:
    """A step's samples as the learner receives them (c: LearnerConfig): `count` of them
    (prompts_per_step x group_size by default), prompt lengths in `prompt_tokens`, response lengths
    spread from 1 to `cap` (the generators' cap by default: learner.max_new_tokens; 64 when unset),
    the first sample the longest (both maxima: a batch's padded length is fixed by its arguments),
    random tokens and scores, with the per-token fields the configured advantage and KL need. Prompts are short (chat-templated
    arithmetic questions for SmolLM2 are ~50 tokens): the warm-up should be no bigger than a real
    step, whose memory its passes reserve: prompts wider than the real ones raised the learner's
    peak GPU memory for the whole run (bench/results/trl_smollm2_h200_2026-12-03a.md).
    `avoid`: widths the longest padded batch (the longest prompt and response, to COLUMN_MULTIPLE)
    must not have; the prompts' upper bound is lowered until it has none (model_sizes says why)."""
    from rl.model.padded_batch import COLUMN_MULTIPLE, aligned
    from rl.update.ppo_update import resolved_advantage

    rng = random.Random(seed)
    cap = cap or c.max_new_tokens or 64
    low, longest = prompt_tokens
    while aligned(longest + cap, COLUMN_MULTIPLE) in avoid and longest > 1:
        longest -= 1
    low = min(low, longest)
    kind = resolved_advantage(c)
    samples = []
    for i in range(count or c.prompts_per_step * c.group_size):
        prompt = [rng.randrange(vocab_size) for _ in range(longest if i == 0 else rng.randint(low, longest))]
        n = cap if i == 0 else rng.randint(1, cap)
        sample = {"prompt_ids": prompt, "response_ids": [rng.randrange(vocab_size) for _ in range(n)],
                  "logprobs": [-rng.random() for _ in range(n)], "score": float(rng.random() < 0.5),
                  "failed": False, "finished": n < cap}
        if c.kl.coef > 0:
            sample["ref_logprobs"] = [-rng.random() for _ in range(n)]
        if kind == "gae":
            sample["advantages"] = [rng.gauss(0, 1) for _ in range(n)]
        if kind == "reinforce_pp":
            sample["token_rewards"] = [0.0] * (n - 1) + [sample["score"]]
        samples.append(sample)
    return samples


def model_sizes(model: torch.nn.Module) -> frozenset:
    """The sizes a layer's inputs carry besides batch and length (hidden, head and MLP widths, head
    counts, the vocabulary). Under dynamic=True dynamo gives equal sizes one symbol (duck sizing): a
    padded length equal to one of them is tied to the weights' static size, so its first graph is
    static in the length and the next length compiles again."""
    cfg = getattr(getattr(model, "backbone", model), "config", None)
    heads, kv = getattr(cfg, "num_attention_heads", 0), getattr(cfg, "num_key_value_heads", 0)
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else 0)
    return frozenset({getattr(cfg, "hidden_size", 0), getattr(cfg, "intermediate_size", 0), heads, kv,
                      head_dim, heads * head_dim, kv * head_dim, getattr(cfg, "vocab_size", 0)}) - {0}


def warm_up_update(model: torch.nn.Module, c, pad_id: int, reference=None) -> float:
    """ppo_update on made_up_samples, with an optimizer that never steps: a step-sized batch, one
    group of short samples, and a step-sized batch again with other lengths; returns the seconds.
    `reference(samples)`, the learner's own reference pass (LoRA: the base with the adapter off,
    nodes/impl/learner._reference_logprobs), runs on a step-sized batch first: without grad and autocast
    it has graphs of its own, which the first step would otherwise compile.
    Three because one left the first real step two recompiles (TORCH_LOGS=recompiles, SmolLM2 on
    an H200, bench/results/agents_speed_h200_2026-12-05.md): the warm-up's padded length, 64 + 512
    tokens, equalled the hidden size, so dynamo tied it to it and the graph was static at 576; the
    step's lengths recompiled it with dynamic lengths, guarded by inductor's fusion-size check
    (hidden x tokens of a micro-batch >= 5242880) on the side its sizes fell; the step's short last
    micro-batch, on the other side, recompiled again. Now the longest sample avoids the model's
    sizes (model_sizes), so the first batch compiles with dynamic lengths on the large side, the
    short group the small side, and the third batch (another padded length) finds both and compiles
    nothing unless something else made the first graph static. The model is left in eval mode
    with no gradients, as ppo_update leaves it."""
    from rl.update.ppo_update import ppo_update

    t = time.perf_counter()
    vocab = model.get_input_embeddings().weight.shape[0]
    avoid = model_sizes(model)
    batches = [made_up_samples(c, vocab, avoid=avoid),
               made_up_samples(c, vocab, seed=1, count=c.group_size, cap=16, avoid=avoid),
               made_up_samples(c, vocab, prompt_tokens=(16, 48), seed=2, avoid=avoid)]
    try:
        if reference is not None:
            reference(made_up_samples(c, vocab, seed=3, avoid=avoid))
        for samples in batches:
            ppo_update(model, _NoStep(model), samples, c.kl.coef, pad_id, c, random.Random(0), stale=False)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()   # give the made-up step's blocks back to the GPU's other processes
    return time.perf_counter() - t


def free_step_memory(model: torch.nn.Module) -> float:
    """The gradients a step leaves (ppo_update sets them to None before each minibatch, not after
    the last) and the allocator's free blocks back to the GPU, for the phase switch's other side;
    returns the seconds it took."""
    t = time.perf_counter()
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return time.perf_counter() - t


def start_warm_up(ctx, model: torch.nn.Module, c, pad_id: int, turn=None, reference=None) -> asyncio.Task:
    """warm_up_update on a thread, as a task of the learner's event loop (call it in setup), under
    the node's state lock: a resumed run's weights load after it, and the first training step,
    which takes the lock too, waits for it. A failure is logged, not raised: the first step then
    compiles the layers, or fails with its own error. With the phase switch's `turn`
    (rl/model/gpu_turns.GpuTurn) it holds the GPU's turn meanwhile, as a step does."""
    async def run():
        async with ctx.state_lock:
            with ctx.span("compile warm-up"):
                try:
                    if turn is not None:
                        await asyncio.to_thread(turn.take)
                    seconds = await asyncio.to_thread(warm_up_update, model, c, pad_id, reference)
                    ctx.log(f"compile warm-up: {seconds:.1f} s (rl/update/compile_warm_up.py)")
                except Exception as e:
                    ctx.log(f"compile warm-up failed ({type(e).__name__}: {str(e)[:200]}); "
                            "the layers compile in the first step")
                finally:
                    if turn is not None:
                        turn.give()
    return asyncio.create_task(run())
