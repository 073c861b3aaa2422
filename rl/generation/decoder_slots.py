"""How many decoder slots a generator replica takes (generator.prompts_per_call = 0, auto): a
slot holds one response's KV cache over every layer, so a real model's slot is large, and auto
takes fewer where they do not fit the room the replica has (its GPU share, or on a CPU half of
the machine's available memory). With vLLM (generator.backend=vllm), the engine's memory in auto mode."""

from __future__ import annotations

import os

import torch

from dataflow.errors import UserError

AUTO_SLOTS = 256


def prompts_per_call(c, device, slot_bytes: int = 0, room_bytes: int = 0) -> int:
    """c.prompts_per_call (c: nodes.generator.GeneratorConfig), or for 0 (auto) AUTO_SLOTS decoder
    slots' worth on CUDA, 32 prompts elsewhere. Given a slot's KV-cache bytes and the bytes this replica may still allocate, auto
    also keeps the cache within half of that room (activations, the sampler and CUDA graphs need
    the rest), down to one prompt's group."""
    if c.prompts_per_call:
        return c.prompts_per_call
    slots = AUTO_SLOTS if torch.device(device).type == "cuda" else 32 * c.group_size
    if slot_bytes and room_bytes:
        slots = min(slots, room_bytes // 2 // slot_bytes)
    return max(1, slots // c.group_size)


def room_bytes(device, gpu_share: float) -> int:
    """What this replica may still allocate: its share of the GPU less what it holds, or on a CPU
    half of the machine's available memory (the other nodes' models live there too)."""
    if torch.device(device).type == "cuda":
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return max(1, int(gpu_share * total - torch.cuda.memory_allocated()))
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, available // 2)


def kv_bytes_per_token(config, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """Bytes of one token's K and V over every layer, per GPU (the KV heads split over tensor
    parallel); a multimodal config's text model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * max(1, kv_heads // tensor_parallel) * head_dim * dtype_bytes


def kv_bytes_per_slot(model, max_len: int) -> int:
    """Bytes of one decoder slot's K and V cache over every layer (rl/generation/decoding.StaticDecoder)."""
    return kv_bytes_per_token(model.config, next(model.parameters()).element_size()) * max_len


def fitted_prompts_per_call(c, device, model, max_len: int, gpu_share: float, log) -> int:
    """prompts_per_call = 0 (auto) for a static decoder of `max_len`-token slots on `model`: fewer
    prompts than auto's count where their KV cache would not fit this replica's room (logged, with
    the settings to choose)."""
    # A real model's slot is large (SmolLM2: 30 layers x 1,152 positions, 53 MiB in fp32 on a
    # CPU; 32 prompts x 8 would be 13 GiB): auto takes fewer slots where they do not fit.
    slot = kv_bytes_per_slot(model, max_len)
    room = room_bytes(device, gpu_share)
    wanted = prompts_per_call(c, device)     # auto without the memory rule
    fitted = prompts_per_call(c, device, slot, room)
    if fitted < wanted:
        log(f"generator: {fitted * c.group_size} decoder slots (auto), not "
            f"{wanted * c.group_size}: a slot's KV cache is {slot / 2**20:.0f} MiB and this "
            f"replica has {room / 2**30:.1f} GiB to use; set generator.prompts_per_call "
            "(and generator.max_prompt_tokens) to choose")
    return fitted


def auto_memory_utilization(gpu_share: float, held_bytes: int, total_bytes: int) -> float:
    """vLLM's gpu_memory_utilization for a replica with `gpu_share` of a GPU that already holds
    `held_bytes` (its receiving copy of the weights): 0.9 of the share (CUDA context, NCCL and
    other non-torch memory take the rest), less what is held, at least 0.05."""
    return max(0.05, round(0.9 * gpu_share - held_bytes / total_bytes, 4))


KV_BLOCK = 16    # vLLM's default KV block (tokens): a sequence holds whole blocks


def auto_kv_cache_bytes(config, *, num_slots: int, max_len: int, dtype_bytes: int, room_bytes: int,
                        tensor_parallel: int = 1) -> int:
    """vLLM's KV cache per GPU with gpu_memory_utilization auto: twice every slot's `max_len` tokens
    in whole blocks (the prefix cache keeps earlier turns' and prompts' blocks for the next request),
    within half of `room_bytes` (the share left after the weights; the other half is for vLLM's
    activations and CUDA graphs). Below the slots' need vLLM runs fewer sequences at once and queues
    the rest; below one sequence it could run none: a UserError naming what to change."""
    sequence = -(-max_len // KV_BLOCK) * KV_BLOCK * kv_bytes_per_token(config, dtype_bytes, tensor_parallel)
    cap = room_bytes // 2
    if cap < sequence:
        raise UserError(f"generator: vLLM's KV cache would get {max(cap, 0) / 2**20:.0f} MiB of this replica's GPU "
                        f"share, less than one {max_len}-token sequence ({sequence / 2**20:.0f} MiB); give the "
                        "generator a larger share (gpu_shares), set generator.vllm.gpu_memory_utilization, or "
                        "lower generator.max_prompt_tokens / max_new_tokens")
    return int(min(2 * num_slots * sequence, cap))
