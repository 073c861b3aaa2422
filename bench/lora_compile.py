"""The learner's compile warm-up, LoRA against full fine-tuning, cold and warm inductor cache.

    python3 bench/lora_compile.py --shape w1 --rank 32 --out OUT      # on a GPU (CUDA); CPU: --shape tiny

Issue 37 asks why a LoRA run's first learner step is slow (W1 on an H100: about 77-87 s, against
about 23 s for full fine-tuning at 1.5B). This times the pieces of that first step in isolation,
on the learner's own code path: a W1-shaped Qwen2 from its config (random init), fp32 master
weights (precision.prepare_trained), LoRA through rl/model/lora.wrap, compiled layers
(precision.compile_layers), then rl/update/compile_warm_up.warm_up_update on W1's step shape
(32 prompts x 8, 256-token responses, KL 0.01, 16384-token passes), then, with LoRA, the
learner's own reference pass (the adapter disabled, no grad: nodes/impl/learner._reference_logprobs).
Each variant runs twice in its own process on one fresh TORCHINDUCTOR_CACHE_DIR: cold, then warm.
Prints seconds per piece and torch._dynamo's compile-time table (where the compile went), and
writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"w1": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
          "tiny": dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=True)}


def one(shape: str, rank: int) -> dict:
    """In this process: build, wrap, compile, warm up; the seconds of each piece."""
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers
    from torch._dynamo.utils import compile_times

    from nodes.learner import LearnerConfig
    from nodes.impl.reference import add_logprobs
    from rl.model import lora
    from rl.model.lora import LoraConfig
    from rl.model.precision import compile_layers, prepare_trained
    from rl.update.compile_warm_up import made_up_samples, warm_up_update

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out, t = {"shape": shape, "rank": rank, "device": device}, time.perf_counter()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen2Config(max_position_embeddings=4096, **SHAPES[shape]))
    prepare_trained(model, device, "auto").eval()
    c = LearnerConfig(prompts_per_step=32 if shape == "w1" else 4, group_size=8 if shape == "w1" else 4,
                      max_new_tokens=256 if shape == "w1" else 32, max_tokens_per_micro_batch=16384)
    c.kl.coef = 0.01
    peft = lora.wrap(model, LoraConfig(rank=rank), device, "auto") if rank else None
    out["build_s"] = time.perf_counter() - t
    assert compile_layers(model, True, device)
    out["warm_up_s"] = warm_up_update(model, c, 0)
    if peft is not None:    # the step's reference pass: the adapter off, no grad (its own graphs)
        samples = made_up_samples(c, SHAPES[shape]["vocab_size"], seed=3)
        t = time.perf_counter()
        with peft.disable_adapter(), torch.no_grad():
            add_logprobs(model, 0, [{"samples": samples}], "ref_logprobs", 0, 1.0, c.max_tokens_per_micro_batch)
        out["reference_pass_s"] = time.perf_counter() - t
    t = time.perf_counter()
    warm_up_update(model, c, 0)
    out["compiled_update_s"] = time.perf_counter() - t
    out["compile_times"] = compile_times(repr="str", aggregate=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="w1", choices=sorted(SHAPES))
    p.add_argument("--rank", type=int, default=32, help="LoRA rank of the LoRA variant")
    p.add_argument("--only-lora", action="store_true", help="the LoRA variant alone (no full fine-tuning)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--one", nargs=2, metavar=("SHAPE", "RANK"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], int(args.one[1]))), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for rank in (args.rank,) if args.only_lora else (0, args.rank):
        cache = tempfile.mkdtemp(prefix=f"inductor_r{rank}_")
        for temperature in ("cold", "warm"):
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            t = time.perf_counter()
            run = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--one", args.shape, str(rank)],
                                 env=env, capture_output=True, text=True)
            line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                print(f"rank {rank} {temperature}: failed rc={run.returncode}\n{run.stderr[-2000:]}", flush=True)
                continue
            r = dict(json.loads(line[7:]), cache=temperature, process_s=time.perf_counter() - t)
            results.append(r)
            print(f"rank {rank:3d} {temperature}: process {r['process_s']:.1f} s, build {r['build_s']:.1f} s, "
                  f"warm-up {r['warm_up_s']:.1f} s, reference pass {r.get('reference_pass_s', 0):.1f} s, "
                  f"compiled update {r['compiled_update_s']:.2f} s", flush=True)
            print(r["compile_times"], flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
