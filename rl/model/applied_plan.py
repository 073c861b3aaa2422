"""The memory plan of an RLHF graph (graphs/rlhf.py) on GPUs, applied: the GPU shares, the token
budget per micro-batch and gradient checkpointing follow from the model's shape, so a user on one
GPU sets none of them. The bytes are rl/model/memory_plan.py's arithmetic; this file decides.

    plan = rlhf_plan(cfg, graph, gpu_bytes, enforced)    # None on placement=cpu
    apply(plan, cfg, graph)                              # the graph's shares, the nodes' configs

What it decides for the model nodes (generator, reference, critic, learner):
- a token budget B for the passes of learner, critic and reference whose user left both
  max_tokens_per_micro_batch and micro_batch_size at 0: at most TARGET_TOKENS (and a minibatch),
  at least the floor (MIN_TOKENS, and the longest sample: a pass holds at least one);
- on a GPU that all of its pool's nodes share (colocated with num_gpus=1, split's learner GPU), the
  shares the user did not set in gpu_shares: each trainer its need at B, the generator the rest (its
  KV cache gets the slack). With auto decoder slots (generator.prompts_per_call=0) B takes at most
  half of the room left once every node has its static bytes and the generator its smallest KV
  cache, so generation keeps room to batch; where half does not reach the floor, or the slots are
  fixed, B takes what it needs up to TARGET_TOKENS;
- gradient checkpointing (learner, critic) when even the floor does not fit without it;
- on pools of several GPUs (colocated num_gpus > 1, split's generator GPUs) the shares stay the
  preset's, and B follows from each trainer's share.
A user's gpu_shares entry, budget, micro_batch_size or gradient_checkpointing=true is kept and
checked. A plan that cannot fit is a one-line problem (node, need, room, what to change) that
dataflow/driver/preflight.py refuses before Ray starts. With a GPU size that is only assumed (no
GPU on the driver, gpu_memory_gib=0) the plan is printed, not applied.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import uuid

from rl.model.memory_plan import (DTYPE_BYTES, PROMPT_ROOM_MULTIPLE, RESERVE, GiB, ModelShape, NodeNeed, Plan, _refusal,
                                  generator_need, learner_need, policy_shape, prompt_room, reference_need, tokens_within)

TARGET_TOKENS = 16384
"""The largest budget the plan picks: a pass of this many tokens keeps the matmuls of a GPU busy
([tokens, hidden] x [hidden, ...]); larger passes cost memory and buy little speed."""
MIN_TOKENS = 2048
"""The smallest budget the plan picks before it turns gradient checkpointing on: smaller passes leave
the matmuls short of rows, so recomputing each layer costs less than running them."""
KV_HEADROOM = 2
"""Generator bytes per byte of KV cache: the decoder keeps its cache within half of its room
(rl/generation/decoder_slots.prompts_per_call); prefill, sampling and CUDA graphs use the rest."""
AUTO_SLOTS = 256     # rl/generation/decoder_slots.AUTO_SLOTS (imported there with torch; the plan stays pure)
ALLOCATOR_SLACK = 0.10
"""Each node's share holds its need plus this fraction: its share caps its allocator
(set_per_process_memory_fraction), so the fragmentation of torch's caching allocator and the
kernels' workspaces must fit inside it; the unassigned RESERVE holds the CUDA contexts."""
WORKSPACE_BYTES = 1 << 30
"""Per node, what the byte model leaves out: cuBLAS and attention kernels' workspaces, CUDA graphs'
pools, masks and indices, small tensors; a guess, to be replaced by what GPU runs measure."""
MULTIPLE = 256
TRAINERS = ("learner", "critic", "reference")


def _at_default(c, name: str) -> bool:
    f = next(f for f in dataclasses.fields(c) if f.name == name)
    return getattr(c, name) == (f.default if f.default is not dataclasses.MISSING else f.default_factory())


@dataclasses.dataclass
class _Inputs:
    """What the plan reads from the config and the graph, once."""
    shape: ModelShape
    max_len: int
    gpu: int
    configs: dict
    nodes: list[str]
    per_gpu: dict[str, int]              # replicas of a node on one GPU
    pool_of: dict[str, str]
    pool_gpus: dict[str, int]
    user_shares: dict[str, float]
    user_budget: dict[str, int]          # trainer -> tokens per pass it set (rows x the longest sample)
    floor: int
    cap: int
    may_checkpoint: list[str]            # the trainers whose checkpointing the plan may turn on
    switching: bool = False              # the phase switch: the learner's step lends its room to the KV cache
    lent: int = 0                        # _decide's: the bytes the learner lends the generator between steps
    slots: int = 0                       # _decide's: the generator's decoder slots (the most its share holds)
    push: int = 0                        # weight_transport=cuda_ipc: the bytes of one flat push buffer


def _need(ctx: _Inputs, cfg, node: str, tokens: int, ckpt: bool, slots: int = 0, step: bool = True) -> NodeNeed:
    """A node's bytes at `tokens` per pass (trainers) or `slots` decoder slots (generator). The
    learner's backward also holds the gradient of a pass's logits, [tokens, vocab] in their bf16
    (rl/model/logprobs.token_logprobs keeps no float32 copy: it upcasts a few rows at a time).
    AdamW's foreach step (learner, critic) makes a float32 temporary per trained parameter once
    the passes' activations are freed: the need is the larger of the two phases (step=False: the
    pass alone, linear in tokens, for the budget's arithmetic)."""
    s, lc, g = ctx.shape, cfg.learner, cfg.generator
    if node == "generator":
        n = generator_need(s, dtype_bytes=DTYPE_BYTES.get(g.dtype, 2), slots=slots, max_len=ctx.max_len,
                           lora_rank=lc.lora.rank, lora_targets=tuple(lc.lora.target_modules))
        n.parts["decoder room"] = n.parts["kv cache"] * (KV_HEADROOM - 1)
    elif node == "learner":
        n = learner_need(s, on_cuda=True, micro_batch_tokens=tokens, logit_rows=tokens, lora_rank=lc.lora.rank,
                         lora_targets=tuple(lc.lora.target_modules), checkpointing=ckpt)
        n.parts["logits gradient"] = tokens * s.vocab * 2
    elif node == "critic":
        n = learner_need(s, on_cuda=True, micro_batch_tokens=tokens, logit_rows=0, checkpointing=ckpt, node="critic")
    else:
        n = reference_need(s, dtype_bytes=2, micro_batch_tokens=tokens)
    if ctx.push and node in ("learner", "generator"):   # cuda_ipc: the learner's two buffers, a generator's staging
        n.parts["push buffers"] = ctx.push * (2 if node == "learner" else 1)
    if node in ("learner", "critic") and step:
        n.parts["optimizer step"] = max(0, n.parts["grads"] - n.parts["activations"] - n.parts.get("logits gradient", 0))
    n.parts["workspace"] = WORKSPACE_BYTES
    if node in ctx.user_budget and not ctx.configs[node].max_tokens_per_micro_batch:
        n.setting = f"{node}.micro_batch_size (yours: {ctx.configs[node].micro_batch_size}; or 0, for the plan's budget)"
    elif node in TRAINERS and node not in ctx.user_budget:   # the plan chose the budget: what shrinks the need is the longest sample
        n.setting = (f"generator.max_prompt_tokens / max_new_tokens (the longest sample, {ctx.max_len} tokens, "
                     f"bounds the smallest pass){'' if lc.lora.rank else ', or learner.lora.rank (e.g. 32)'}")
    n.parts["allocator slack"] = int(ALLOCATOR_SLACK * n.total)
    if node in ctx.user_shares:
        n.setting += f", or raise gpu_shares.{node} (yours: {ctx.user_shares[node]:g})"
    return n


def _slots(ctx: _Inputs, cfg, room: float) -> tuple[int, int]:
    """(fewest, most) decoder slots of a generator replica: its prompts_per_call x group_size, or
    for auto one group up to AUTO_SLOTS (as many as `room` bytes hold, the decoder's own rule)."""
    g = cfg.generator
    if g.prompts_per_call:
        return (g.prompts_per_call * g.group_size,) * 2
    # a slot's bytes as _need counts them (KV cache, decoder room, sampling row, their allocator
    # slack), so that the need at `most` slots stays within `room`
    per_slot = _need(ctx, cfg, "generator", 0, False, 1).total - _need(ctx, cfg, "generator", 0, False, 0).total + 1
    most = max(g.group_size, min(AUTO_SLOTS, int(room // per_slot)) // g.group_size * g.group_size)
    return g.group_size, most


def _decide(ctx: _Inputs, cfg, graph, ckpt: bool) -> tuple[dict, dict, dict, str | None]:
    """(tokens per trainer, shares, needs, problem) with the plan's checkpointing `ckpt`."""

    def checkpointing(n: str) -> bool:
        return n in ("learner", "critic") and (ctx.configs[n].gradient_checkpointing or (ckpt and n in ctx.may_checkpoint))

    planned = [n for n in TRAINERS if n in ctx.nodes and n not in ctx.user_budget]
    static = {n: _need(ctx, cfg, n, 0, checkpointing(n), step=False).total for n in planned}
    per_token = {n: _need(ctx, cfg, n, 1, checkpointing(n), step=False).total - static[n] for n in planned}
    # A trainer's optimizer step (AdamW's temporaries, once the passes' activations are freed) may
    # need more than its pass: its need at a budget is the larger of the two (_need).
    step = {n: _need(ctx, cfg, n, 0, checkpointing(n)).total - static[n] for n in planned}
    kept = {n: graph.nodes[n].gpus for n in graph.nodes if graph.nodes[n].pool and not _plannable(ctx, n)}
    fits: list[float] = [ctx.cap]
    rooms: dict[str, float] = {}       # per planned trainer: the bytes it may take at most (for the refusal)
    for pool in sorted({ctx.pool_of[n] for n in ctx.nodes if _plannable(ctx, n)}):
        members = [n for n in ctx.nodes if ctx.pool_of[n] == pool and _plannable(ctx, n)]
        taken = sum(share * math.ceil(graph.nodes[n].replicas / ctx.pool_gpus[pool])
                    for n, share in kept.items() if graph.nodes[n].pool == pool)
        least = {n: _need(ctx, cfg, n, 0, False, _slots(ctx, cfg, 0)[0]) if n == "generator" else
                 _need(ctx, cfg, n, ctx.user_budget.get(n, ctx.floor), checkpointing(n)) for n in members}
        room = (1 - RESERVE - taken) * ctx.gpu - sum(ctx.per_gpu[n] * (least[n].total if n == "generator" or
                                                                      n in ctx.user_budget else static[n])
                                                     for n in members)
        if room < 0:   # the static bytes (and the budgets a user set) alone overflow: name the largest
            worst = max([n for n in members if n in ctx.user_budget] or members, key=lambda n: least[n].total)
            return {}, {}, {}, _refusal(least[worst], room + least[worst].total)
        per = sum(ctx.per_gpu[n] * per_token[n] for n in members if n in planned)
        if per:
            # The generator's auto slots grow into the slack; with a fixed prompts_per_call it would sit idle.
            # (Phase switch: the KV cache takes the trainers' room while they wait, so the budget
            # may take all of it.)
            half = room / 2 if "generator" in members and not cfg.generator.prompts_per_call \
                and not ctx.switching else room
            trainers = {n: (ctx.per_gpu[n], per_token[n], step[n]) for n in members if n in planned}
            at_half = tokens_within(half, trainers, ctx.cap)
            fits.append(at_half if at_half >= ctx.floor else tokens_within(room, trainers, ctx.cap))
            rooms.update({n: room - (per - per_token[n]) * ctx.floor + static[n] for n in members if n in planned})
    for n in planned:                     # a trainer whose share is kept: the budget its share holds
        if not _plannable(ctx, n):
            fits.append((graph.nodes[n].gpus * ctx.gpu - static[n]) // per_token[n])
            rooms[n] = graph.nodes[n].gpus * ctx.gpu
    tokens = {n: ctx.user_budget[n] for n in ctx.user_budget if n in ctx.nodes}
    budget = int(min(fits)) // MULTIPLE * MULTIPLE
    if planned and budget < ctx.floor:
        worst = max(planned, key=lambda n: static[n])
        return {}, {}, {}, _refusal(_need(ctx, cfg, worst, ctx.floor, checkpointing(worst)), rooms[worst])
    tokens.update({n: budget for n in planned})
    needs = {n: _need(ctx, cfg, n, tokens[n], checkpointing(n)) for n in tokens}
    shares = {n: kept[n] for n in ctx.nodes if n in kept}
    for pool in {ctx.pool_of[n] for n in ctx.nodes if _plannable(ctx, n)}:
        members = [n for n in ctx.nodes if ctx.pool_of[n] == pool and _plannable(ctx, n)]
        taken = sum(s * math.ceil(graph.nodes[n].replicas / ctx.pool_gpus[pool])
                    for n, s in kept.items() if graph.nodes[n].pool == pool)
        left = 1 - RESERVE - taken - sum(ctx.per_gpu[n] * needs[n].total / ctx.gpu for n in members if n in needs)
        for n in members:
            if n in needs and "generator" in members:
                shares[n] = needs[n].total / ctx.gpu
            elif n in needs:              # no generator here (split's learner GPU): the slack by need
                total = sum(ctx.per_gpu[m] * needs[m].total for m in members)
                shares[n] = needs[n].total / ctx.gpu * (1 + left * ctx.gpu / total)
            else:                         # the generator: the rest, its KV cache the slack
                shares[n] = left / ctx.per_gpu[n]
    ctx.lent = lent_bytes(needs["learner"]) if ctx.switching and "learner" in needs else 0
    if "generator" in ctx.nodes:
        room = shares["generator"] * ctx.gpu + ctx.lent - _need(ctx, cfg, "generator", 0, False, 0).total
        fewest, most = _slots(ctx, cfg, room)
        ctx.slots = most
        needs["generator"] = _need(ctx, cfg, "generator", 0, False, most)
        smallest = _need(ctx, cfg, "generator", 0, False, fewest)
        if smallest.total > shares["generator"] * ctx.gpu + ctx.lent + 1:
            return tokens, shares, needs, _refusal(smallest, shares["generator"] * ctx.gpu + ctx.lent)
    for n in tokens:                      # a trainer whose share is kept: its need must fit it
        if needs[n].total > shares[n] * ctx.gpu * (1 + 1e-9):
            return tokens, shares, needs, _refusal(needs[n], shares[n] * ctx.gpu)
    return tokens, shares, needs, None


LENT_PARTS = ("grads", "autocast cache", "activations", "logits gradient", "optimizer step")


def lent_bytes(need: NodeNeed) -> int:
    """What the learner holds only during its step (gradients, activations, the step's temporaries,
    and their allocator slack), freed after it (rl/update/compile_warm_up.free_step_memory): the
    room the phase switch lends the generator's KV cache between steps."""
    step = sum(need.parts.get(k, 0) for k in LENT_PARTS)
    return int(step * (1 + ALLOCATOR_SLACK))


def phase_switch(cfg, graph, nodes: list[str], pool_gpus: dict, pool_of: dict, user_shares: dict) -> tuple[bool, str]:
    """(possible, why not) for cfg.phase_switch: the generator and the learner share one GPU the plan
    divides, and the static decoder generates; auto also asks for max_staleness=0 (and rlhf_plan
    then turns it on only where the fixed shares do not fit without checkpointing)."""
    mode = getattr(cfg, "phase_switch", "off")
    if mode == "off":
        return False, "phase_switch=off"
    shared = ("generator" in nodes and "learner" in nodes and pool_of["generator"] == pool_of["learner"]
              and pool_gpus[pool_of["generator"]] == 1 and graph.nodes["generator"].replicas == 1
              and not {"generator", "learner"} & set(user_shares) and cfg.learner.num_ranks == 1)
    if not shared:
        why = ("needs the generator and the learner on one GPU whose shares the plan sets (placement=colocated, "
               "num_gpus=1, one generator, no gpu_shares for either, learner.dp x tp = 1)")
    elif cfg.generator.backend not in ("auto", "static"):
        why = f"needs the static decoder (generator.backend={cfg.generator.backend}; vLLM: generator.vllm.sleep_level)"
    elif mode == "auto" and cfg.max_staleness:
        why = f"auto: off with max_staleness={cfg.max_staleness} (generation overlaps the learner's step)"
    else:
        return True, ""
    return False, why


def _plannable(ctx: _Inputs, n: str) -> bool:
    """A model node whose share the plan sets: on a pool of one GPU, not named in gpu_shares."""
    return n in ctx.nodes and ctx.pool_gpus.get(ctx.pool_of.get(n), 0) == 1 and n not in ctx.user_shares


def rlhf_plan(cfg, graph, gpu_bytes: int, enforced: bool, longest_prompt: int | None = None,
              hint: bool = True) -> Plan | None:
    """The plan of a graph of graphs/rlhf.py's kind (`cfg`: its RLHFConfig) on its GPU placement;
    None on placement=cpu. Its `settings` say what apply() sets and what the user set.
    `longest_prompt`: the data's longest prompt in tokens (rl/preflight.longest_prompt), which with
    generator.max_prompt_tokens=0 and no environment sizes the decoder's slots (prompt_room).
    A refusal where the user fixed the generator's slots names the prompts_per_call that fits (`hint`)."""
    if getattr(graph, "placement", "cpu") in (None, "cpu"):
        return None
    shape, max_pos = policy_shape(cfg)
    g = cfg.generator
    # The generator's rule for a slot (nodes/impl/generator.py): its longest prompt, then the longest
    # response, or with an environment the whole episode (every turn's sampled and environment tokens).
    response = g.env.max_episode_tokens if g.env.path else g.max_new_tokens
    room, sized_by_data = prompt_room(g, max_pos, response, longest_prompt)
    max_len = room + response
    configs = {"learner": cfg.learner, "critic": getattr(cfg, "critic", None), "reference": cfg.reference,
               "generator": g}
    nodes = [n for n in ("generator", *TRAINERS) if n in graph.nodes and graph.nodes[n].pool]
    user_budget = {n: configs[n].max_tokens_per_micro_batch or configs[n].micro_batch_size * max_len
                   for n in nodes if n in TRAINERS
                   and not (_at_default(configs[n], "max_tokens_per_micro_batch")
                            and _at_default(configs[n], "micro_batch_size"))}
    minibatch = cfg.learner.minibatch_size * max_len
    floor = min(minibatch, math.ceil(max(MIN_TOKENS, max_len) / MULTIPLE) * MULTIPLE)
    may_checkpoint = [n for n in ("learner", "critic") if n in nodes and n not in user_budget
                      and not configs[n].gradient_checkpointing]
    ctx = _Inputs(shape, max_len, gpu_bytes, configs, nodes,
                  {n: math.ceil(graph.nodes[n].replicas / graph.pools[graph.nodes[n].pool].gpus) for n in nodes},
                  {n: s.pool for n, s in graph.nodes.items() if s.pool}, {p: s.gpus for p, s in graph.pools.items()},
                  {n: v for n, v in (getattr(cfg, "gpu_shares", None) or {}).items() if n in nodes}, user_budget,
                  floor, max(floor, min(TARGET_TOKENS, minibatch)), may_checkpoint)
    sync = cfg.learner.weight_sync
    if sync.transport == "cuda_ipc":   # what travels (dataflow/weights/sync.py): the float32 adapter, or the weights in bf16
        lora = cfg.learner.lora
        ctx.push = shape.push_bytes(4 if lora.rank else DTYPE_BYTES[sync.dtype if sync.dtype != "auto" else "bfloat16"],
                                    lora.rank, tuple(lora.target_modules))
    possible, why_not = phase_switch(cfg, graph, nodes, ctx.pool_gpus, ctx.pool_of, ctx.user_shares)
    ctx.switching = possible and getattr(cfg, "phase_switch", "off") == "on"
    tokens, shares, needs, problem, ckpt = _fit(ctx, cfg, graph, may_checkpoint)
    if possible and not ctx.switching and (problem or ckpt):
        # auto: the switch only where fixed shares do not fit without checkpointing; where they do
        # it costs time (the decoder's CUDA graphs are captured again each turn)
        fixed, fixed_slots = (tokens, shares, needs, problem, ckpt), ctx.slots
        ctx.switching = True
        tokens, shares, needs, problem, ckpt = _fit(ctx, cfg, graph, may_checkpoint)
        if problem:            # it does not fit either way: say so as the fixed shares see it
            ctx.switching, ctx.lent, ctx.slots = False, 0, fixed_slots
            tokens, shares, needs, problem, ckpt = fixed
    settings = []
    for n in nodes:
        if n in shares:
            settings.append((f"gpu_shares.{n}", shares[n], "you" if n in ctx.user_shares else
                             "plan" if _plannable(ctx, n) else "placement"))
    for n in TRAINERS:
        if n in user_budget:
            key = "max_tokens_per_micro_batch" if configs[n].max_tokens_per_micro_batch else "micro_batch_size"
            settings.append((f"{n}.{key}", getattr(configs[n], key), "you"))
        elif n in tokens:
            settings.append((f"{n}.max_tokens_per_micro_batch", tokens[n], "plan"))
        if n in nodes and n != "reference" and (configs[n].gradient_checkpointing or (ckpt and n in may_checkpoint)):
            settings.append((f"{n}.gradient_checkpointing", True,
                             "you" if configs[n].gradient_checkpointing else "plan"))
    if "generator" in needs and not g.prompts_per_call and g.backend in ("auto", "static"):
        # auto slots: the count the generator's share holds, set so that the static decoder takes
        # exactly that (its own rule, rl/generation/decoder_slots.py, sees only the KV cache and could
        # take more); vLLM sizes its own cache within the share
        settings.append(("generator.prompts_per_call", ctx.slots // g.group_size, "plan"))
    if sized_by_data:
        settings.append(("generator.max_prompt_tokens", room, "plan"))
    if problem:   # refused: nothing is applied, so only what the user set is listed
        settings = [s for s in settings if s[2] == "you"]
        if hint and g.prompts_per_call:    # the slots the user fixed may be what leaves the others short
            problem += _fitting_slots(cfg, graph, gpu_bytes, longest_prompt)
    notes = []
    if sized_by_data and not problem:
        notes.append(f"decoder slots of {max_len} tokens: the data's longest prompt is {longest_prompt} tokens "
                     f"(generator.max_prompt_tokens = {room}, to a multiple of {PROMPT_ROOM_MULTIPLE}), then "
                     f"{response} for the response")
    if ctx.switching and not problem:
        settings.append(("phase_switch", "on", "plan"))
        notes.append(f"phase switch: the generator's KV cache and the learner's step take turns on the GPU "
                     f"(rl/model/gpu_turns.py); between steps the generator may use {ctx.lent / GiB:.2f} GiB "
                     f"of the learner's (gradients, activations), up to {generator_cap(ctx, shares):.2f} of the GPU")
    elif getattr(cfg, "phase_switch", "off") == "on" and not problem:
        problem = f"phase_switch=on {why_not}; or set phase_switch=auto"
    ordered = [needs[n] for n in nodes if n in needs]
    plan = Plan(gpu_bytes, ordered, shares, problem, enforced=enforced, settings=settings, notes=notes)
    plan.caps = {"generator": generator_cap(ctx, shares)} if ctx.switching and not problem else {}
    return plan


def _fitting_slots(cfg, graph, gpu_bytes: int, longest_prompt: int | None) -> str:
    """For a refusal of the user's generator.prompts_per_call: the most prompts per call below it
    with which the whole plan fits (fewer slots also give the trainers' budgets more room, so the
    plan is made again for each count, not read off the generator's share)."""
    g = cfg.generator
    for count in range(g.prompts_per_call - 1, 0, -1):
        trial = dataclasses.replace(cfg, generator=dataclasses.replace(g, prompts_per_call=count))
        if rlhf_plan(trial, graph, gpu_bytes, False, longest_prompt, hint=False).problem is None:
            return f"; generator.prompts_per_call={count} fits (yours: {g.prompts_per_call}), or 0 for the plan's choice"
    return ""


def _fit(ctx: _Inputs, cfg, graph, may_checkpoint: list[str]) -> tuple[dict, dict, dict, str | None, bool]:
    """_decide without gradient checkpointing, then with it where that alone does not fit:
    (tokens, shares, needs, problem, checkpointing on)."""
    tokens, shares, needs, problem = _decide(ctx, cfg, graph, False)
    if problem and may_checkpoint:
        return (*_decide(ctx, cfg, graph, True), True)
    return tokens, shares, needs, problem, False


def generator_cap(ctx: _Inputs, shares: dict) -> float:
    """The fraction of the GPU the generator's allocator may use: its share, plus what the learner
    lends it between steps under the phase switch."""
    return min(1.0, shares["generator"] + ctx.lent / ctx.gpu)


def apply(plan: Plan, cfg, graph) -> None:
    """Set what the plan chose ("plan" settings) on the graph's nodes and their configs, and give
    each model node its line for an out-of-memory error (NodeSpec.memory_note)."""
    for key, value, who in plan.settings:
        if who != "plan" or "." not in key:
            continue
        node, name = key.split(".", 1)
        if node == "gpu_shares":
            graph.nodes[name].gpus = value
        else:
            setattr(graph.nodes[node].config, name, value)
    for need in plan.needs:
        c = graph.nodes[need.node].config
        advice = f"lower {need.setting}"
        if need.node in TRAINERS:
            key = "max_tokens_per_micro_batch" if c.max_tokens_per_micro_batch else "micro_batch_size"
            advice = f"lower {need.node}.{key} (now {getattr(c, key)})" + (
                "" if getattr(c, "gradient_checkpointing", True) else f" or set {need.node}.gradient_checkpointing=true")
        graph.nodes[need.node].memory_note = (f"the memory plan gave it {plan.shares[need.node]:.2f} of a "
                                              f"{plan.gpu_bytes / GiB:.0f} GiB GPU for {need.text()}; {advice}")
    if plan.caps:   # the phase switch: a lock file per run that the generator and the learner share
        turn = os.path.join(tempfile.gettempdir(), f"dataflow-gpu-turn-{os.getpid()}-{uuid.uuid4().hex[:8]}.lock")
        graph.nodes["generator"].gpu_turn = graph.nodes["learner"].gpu_turn = turn
        graph.nodes["generator"].memory_cap = plan.caps["generator"]
