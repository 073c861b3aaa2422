"""TRL's GRPOTrainer on workload W1 (run by bench/gpu_step.py --trl; standalone works too).

    python3 bench/trl_w1.py --model DIR --prompts P.jsonl --reward reward.py --steps 6 --warmup 2 --out result.json

The peer baseline for bench/gpu_step.py: trl==1.16.0, transformers generation (no vLLM), the same
model directory, prompts and reward program, and as close a learning set-up as TRL allows:
num_generations 8, 32 prompts (256 completions) per optimizer step (per_device_train_batch_size
x gradient_accumulation_steps = 256, so one generation round and one optimizer step per step,
on-policy like our max_staleness=0), max_completion_length 256 with EOS suppressed
(generation_kwargs min_new_tokens = 256), bf16 autocast over fp32 master weights (the model is
loaded in fp32, as our learner holds it), AdamW lr 1e-6 constant, weight decay 0.01 (torch's
AdamW default, which our learner uses), clip eps 0.2, KL beta = our kl coef, loss_type "dapo"
(token mean over the whole step's tokens, our loss), group-std scaled advantages, grad clip 1.0,
no gradient checkpointing (ours has none; TRL's default is on: --gradient-checkpointing).
--lora-rank R: LoRA through TRL's peft_config (all linear layers, alpha --lora-alpha, no dropout:
X
Imports nothing from this project, so it runs in a separate venv.

Timing: a callback synchronizes CUDA and stamps every optimizer step's end; s/step is the mean
step time after the first --warmup steps; response tokens/s uses TRL's logged mean completion
length x completions per step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

T0 = time.time()


def log(text: str) -> None:
    print(f"[trl_w1 {time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {text}", flush=True)


def load_reward(path: str):
    spec = importlib.util.spec_from_file_location("w1_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = module.reward

    def w1_reward(prompts, completions, **kwargs):
        return [float(fn(p, c)) for p, c in zip(prompts, completions)]

    return w1_reward


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--reward", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=16, help="per_device_train_batch_size (completions)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.01)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA through peft (TRL's peft_config), 0 = full")
    p.add_argument("--lora-alpha", type=float, default=32.0, help="as learner.lora.alpha")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import pyarrow as pa
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    log(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
        f"cuda {torch.cuda.is_available()}")
    completions = args.prompts_per_step * args.group
    if completions % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide {completions} completions per step")
    rows = [json.loads(l) for l in open(args.prompts) if l.strip()]
    need = (args.steps + 1) * args.prompts_per_step
    rows = (rows * (need // len(rows) + 1))[:need]
    # An explicit fingerprint: datasets otherwise hashes the table with dill, which cannot pickle
    # pyarrow's types when pyarrow lies outside a "site-packages" directory (pip --target /tmp/site).
    dataset = Dataset(pa.Table.from_pylist([{"prompt": r["prompt"]} for r in rows]), fingerprint="w1-prompts")
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    tokenizer.padding_side = "left"
    # fp32 master weights (the directory holds bf16): TRL's bf16=True then autocasts, as our learner does.
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=torch.float32)
    on_gpu = torch.cuda.is_available() and not args.cpu
    config = GRPOConfig(
        output_dir=args.out + ".trainer", max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0, beta=args.beta, epsilon=0.2, num_iterations=1,
        loss_type="dapo", scale_rewards="group", num_generations=args.group,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=completions // args.micro_batch,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": args.max_new_tokens},
        bf16=on_gpu, use_cpu=not on_gpu, gradient_checkpointing=args.gradient_checkpointing,
        logging_steps=1, save_strategy="no", report_to="none", log_completions=False, disable_dropout=True,
        dataloader_num_workers=0, seed=0)

    stamps: list[float] = []
    logs: list[dict] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            log(f"step {state.global_step} done in {stamps[-1] - stamps[-2]:.2f} s")

        def on_log(self, a, state, control, logs_=None, **kw):
            entry = kw.get("logs") or logs_
            if entry:
                logs.append(dict(entry))

    peft_config = None
    if args.lora_rank:   # as our learner.lora: every linear layer but the head, no dropout
        from peft import LoraConfig
        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=load_reward(args.reward), args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()], peft_config=peft_config)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    log(f"training {args.steps} steps of {completions} completions x {args.max_new_tokens} tokens")
    trainer.train()
    step_s = [b - a for a, b in zip(stamps, stamps[1:])]
    steady = step_s[args.warmup:]
    lengths = [l["completions/mean_length"] for l in logs if "completions/mean_length" in l]
    length = statistics.mean(lengths[args.warmup:] or lengths) if lengths else float("nan")
    result = {"steps_done": len(step_s), "step_s": step_s, "lora_rank": args.lora_rank,
              "s_per_step": statistics.mean(steady) if steady else None,
              "s_per_step_median": statistics.median(steady) if steady else None,
              "response_length": length,
              "response_tokens_per_s": completions * length / statistics.mean(steady) if steady else None,
              "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
              "reward": next((l["reward"] for l in reversed(logs) if "reward" in l), None),
              "kl": next((l["kl"] for l in reversed(logs) if "kl" in l), None),
              "trl_version": trl.__version__, "transformers_version": transformers.__version__,
              "torch_version": torch.__version__}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"result: {json.dumps({k: v for k, v in result.items() if k != 'step_s'})}")
    if length == length and int(round(length)) != args.max_new_tokens:  # EOS must be suppressed
        log(f"WARNING: mean completion length {length} != {args.max_new_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
