"""LoRA on vLLM, two ways (issue 37 item 3): the adapter merged into the engine's weights, which is
what generator.backend=vllm does with learner.lora.rank > 0 (dataflow/weights/lora.py merges each
pushed adapter into a base copy and the engine loads the merged weights), against vLLM's own LoRA
path (enable_lora: the base stays, each request names a LoRARequest, punica kernels add the
adapter's product). W1's shape (random init), a rank-32 adapter on every linear layer.

    PYTHONPATH=/tmp/site:$PWD python3 bench/vllm_lora.py --out $OUT/vllm_lora [--rank 32] [--prompts 256] [--new 256]

Each engine runs in a process of its own (`--part merged`, `--part lora`; the default `--part all`
builds the workload, starts both one after the other and writes results.json and table.md). Per
engine: decode throughput (llm.generate on token-id prompts, T=1, eos suppressed: every response
`--new` tokens; median of 3 after a warm-up) and 64 greedy responses of 64 tokens. The LoRA engine
also times the first generate after a new adapter version (a LoRARequest of a new id: vLLM loads
it from its directory), the cost a push would have on that path; the merged engine times
load_weights of a merged state, the cost of ours. Greedy agreement between the two engines says
whether they decode the same model (bf16: a few responses may part late). No CPU mode: vLLM needs
CUDA. Not run yet (written 2026-12-06 without a GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]   # every linear layer
WORK = Path(os.environ.get("VLLM_LORA_DIR", "/tmp/vllm_lora"))   # model dirs (GBs) stay outside --out


def log(text: str) -> None:
    print(f"[vllm_lora] {text}", flush=True)


def build(rank: int) -> dict:
    """W1's base model dir, two adapter versions (peft directories) and the merged model of v1."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import gpu_step

    paths = {"base": gpu_step.build_workload(WORK / "w1", gpu_step.SHAPES["w1"], num_prompts=64)["model"],
             "v1": str(WORK / "adapter_v1"), "v2": str(WORK / "adapter_v2"), "merged": str(WORK / "merged_v1")}
    if (WORK / "READY").exists() and json.loads((WORK / "READY").read_text()) == {"rank": rank}:
        return paths
    for version, seed in (("v1", 1), ("v2", 2)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(paths["base"], torch_dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=LINEARS,
                                                      init_lora_weights=False))
        with torch.no_grad():       # a trained-looking delta: small, not peft's random-init scale
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.01)
        peft_model.save_pretrained(paths[version])
        if version == "v1":
            peft_model.merge_and_unload().to(torch.bfloat16).save_pretrained(paths["merged"])
        del peft_model, model
    (WORK / "READY").write_text(json.dumps({"rank": rank}))
    return paths


def engine_part(kind: str, args, paths: dict) -> dict:
    """One engine (`kind`: merged | lora): throughput, greedy responses, the version switch's cost."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"       # as the generator runs it (vllm_engine.py)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import torch
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    import gpu_step
    from rl.generation.vllm_engine import _worker_load
    from rl.generation.vllm_sampling import sampling_params

    shape = gpu_step.SHAPES["w1"]
    rng = random.Random(0)
    prompts = [[rng.randrange(4, shape["vocab"]) for _ in range(shape["prompt_len"])] for _ in range(args.prompts)]
    lora = kind == "lora"
    t = time.perf_counter()
    llm = LLM(model=paths["base"] if lora else paths["merged"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              gpu_memory_utilization=0.5, max_model_len=shape["prompt_len"] + args.new, max_num_seqs=args.prompts,
              enable_prefix_caching=False, **({"enable_lora": True, "max_lora_rank": args.rank, "max_loras": 1}
                                              if lora else {}))
    row: dict = {"engine": kind, "engine_build_s": time.perf_counter() - t}
    request = LoRARequest("v1", 1, paths["v1"]) if lora else None

    def generate(batch, temperature: float, new: int, req=request):
        params = [sampling_params(temperature=temperature, top_k=0, max_new_tokens=new, min_new_tokens=new,
                                  stop_ids=[], seed=i, logprobs=False) for i in range(len(batch))]
        out = llm.generate([{"prompt_token_ids": p} for p in batch], params, lora_request=req, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]

    generate(prompts, 1.0, args.new)            # warm-up (and, for LoRA, v1's load)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        responses = generate(prompts, 1.0, args.new)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    s = statistics.median(times)
    row.update(decode_s=s, tok_per_s=sum(map(len, responses)) / s, decode_runs_s=times)
    row["greedy"] = generate(prompts[:64], 0.0, 64)
    small = prompts[:8]
    generate(small, 1.0, 8)
    torch.cuda.synchronize()
    t = time.perf_counter()
    generate(small, 1.0, 8)
    base_s = time.perf_counter() - t
    if lora:                                     # a new version: a LoRARequest vLLM has not seen
        t = time.perf_counter()
        generate(small, 1.0, 8, LoRARequest("v2", 2, paths["v2"]))
        row["switch_s"] = time.perf_counter() - t - base_s
        row["switch_how"] = "first generate with a new LoRARequest (load from disk), less the same generate on v1"
    else:                                        # ours: the merged state into the engine's weights
        from safetensors.torch import load_file
        state = []
        for f in sorted(Path(paths["merged"]).glob("*.safetensors")):
            state += list(load_file(str(f), device="cuda").items())
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.collective_rpc(_worker_load, args=(state,))     # VllmDecoder.load_weights' call
        llm.reset_prefix_cache()
        row["switch_s"] = time.perf_counter() - t
        row["switch_how"] = ("the merged state (GPU tensors, HF names) through the worker's load_weights, as "
                             "VllmDecoder.load_weights does; the merge itself (dataflow/weights/lora.py) not included")
    row["small_generate_s"] = base_s
    return row


def table(rows: list[dict], agree: dict) -> str:
    out = ["| engine | decode s (median of 3) | response tok/s | version switch s | engine build s |",
           "|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['engine']} | {r['decode_s']:.2f} | {r['tok_per_s']:,.0f} | {r['switch_s']:.3f} | "
                   f"{r['engine_build_s']:.1f} |")
    out.append("")
    out.append(f"merged / LoRA tok/s: {rows[0]['tok_per_s'] / rows[1]['tok_per_s']:.2f}x; greedy responses "
               f"identical: {agree['identical']} of {agree['n']}, mean agreeing prefix {agree['prefix']:.1f} of 64 tokens")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--part", choices=["all", "merged", "lora"], default="all")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--new", type=int, default=256)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = build(args.rank)
    if args.part != "all":
        (out / f"{args.part}.json").write_text(json.dumps(engine_part(args.part, args, paths)))
        return 0
    rows = []
    for kind in ("merged", "lora"):      # a process each: an engine's GPU memory goes with its process
        cmd = [sys.executable, __file__, "--out", str(out), "--part", kind, "--rank", str(args.rank),
               "--prompts", str(args.prompts), "--new", str(args.new)]
        rc = subprocess.run(cmd).returncode
        if rc != 0 or not (out / f"{kind}.json").exists():
            log(f"{kind} engine failed (rc {rc})")
            return 1
        rows.append(json.loads((out / f"{kind}.json").read_text()))
        log(f"{kind}: {rows[-1]['tok_per_s']:,.0f} tok/s, switch {rows[-1]['switch_s']:.3f} s")
    a, b = rows[0].pop("greedy"), rows[1].pop("greedy")
    prefix = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), min(len(u), len(v))) for u, v in zip(a, b)]
    agree = {"n": len(a), "identical": sum(u == v for u, v in zip(a, b)), "prefix": statistics.mean(prefix)}
    (out / "results.json").write_text(json.dumps({"rows": rows, "greedy_agreement": agree, "rank": args.rank}, indent=1))
    text = table(rows, agree)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
