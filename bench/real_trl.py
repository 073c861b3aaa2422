"""TRL 1.16's GRPOTrainer on the same model dir, data, reward and settings as bench/real_rl.py
(issue 18, item 4), with the same held-out curve.

    python bench/real_trl.py --out runs/real_trl                 # one H200 (bf16 autocast)
    python bench/real_trl.py --tiny --out /tmp/real_trl_tiny     # CPU smoke

Matched to bench/real_rl.py: --group generations per prompt, --prompts-per-step prompts (one
generation round and one optimizer step per step: per_device_train_batch_size x
gradient_accumulation_steps = the step's completions), --lr constant, AdamW weight decay 0.01
(torch's default, our learner's), clip 0.2, beta = --kl (k3, in the loss, as ours), loss_type
"dapo" (token mean over the step, ours), group-normalised advantages, grad clip 1.0, temperature
--temperature with top_k 0 / top_p 1, --max-new-tokens as max_completion_length with EOS
allowed (responses stop at <|im_end|>), fp32 master weights under bf16 autocast (as our
learner), no gradient checkpointing (ours has none). Plain transformers generation (no vLLM).
The reward is the --reward function (default examples/smollm2_arithmetic/last_number_reward.py, as real_rl.py), called
on each completion's text with the row's "answer"; prompts are the rows' chat messages, which TRL renders with the model's template.

Held-out accuracy: every --eval-every steps a callback copies the weights to CPU (the copy is
timed and left out of train_s); after training each copy is evaluated by examples/smollm2_arithmetic/heldout.py, the
judge real_rl.py uses. Writes --out/curve.json, curve.md, curve.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_common import (Evaluator, GpuMemory, add_common_args, apply_tiny, eval_fields, log,  # noqa: E402
                         prepare, reward_function, write_curve)

TINY = {"steps": 2, "eval_every": 1, "val_n": 8, "eval_batch": 8, "prompts_per_step": 2, "group": 2,
        "max_new_tokens": 16}


def reward_for_trl(name: str):
    """The --reward function (the same file and function our reward node loads) in TRL's batched
    form: f(prompts, completions, answer, **kw) -> list of floats."""
    score = reward_function(name)

    def reward_trl(prompts, completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(score("", t, answer=str(a))) for t, a in zip(texts, answer)]

    reward_trl.__name__ = name     # TRL logs rewards/<name>/mean
    return reward_trl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro-batch", type=int, default=0, help="per_device_train_batch_size (0 = whole step)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--max-wall", type=float, default=0,
                   help="stop training after this many seconds from the model and data existing (0 = no limit); "
                        "the step reached is snapshotted and evaluated")
    add_common_args(p, TINY)
    args = p.parse_args()
    apply_tiny(args)
    import pyarrow as pa
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    on_gpu = torch.cuda.is_available() and not args.tiny
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    model_dir, train_path, val_path = prepare(args, "trl")
    t_ready = time.time()
    log("trl", f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
        f"cuda {on_gpu}")
    completions = args.prompts_per_step * args.group
    micro = args.micro_batch or completions
    if completions % micro:
        raise SystemExit(f"--micro-batch {micro} must divide {completions} completions per step")
    rows = [json.loads(line) for line in open(train_path) if line.strip()]
    need = args.steps * args.prompts_per_step
    rows = (rows * (need // len(rows) + 1))[:need]
    # An explicit fingerprint: datasets otherwise hashes the table with dill (bench/trl_w1.py says why).
    dataset = Dataset(pa.Table.from_pylist([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]),
                      fingerprint="real-arithmetic")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0, beta=args.kl, epsilon=0.2, num_iterations=1,
        loss_type="dapo", scale_rewards="group", num_generations=args.group,
        per_device_train_batch_size=micro, gradient_accumulation_steps=completions // micro,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        bf16=on_gpu, use_cpu=not on_gpu, gradient_checkpointing=args.gradient_checkpointing,
        logging_steps=1, save_strategy="no", report_to="none", log_completions=False, disable_dropout=True,
        dataloader_num_workers=0, shuffle_dataset=False, seed=0)

    stamps: dict[int, float] = {}
    snapshots: dict[int, tuple[dict, float]] = {}
    logs: list[dict] = []
    snapshot_s = [0.0]

    class Snapshots(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            stamps[0] = time.time()

        def on_step_end(self, a, state, control, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            stamps[state.global_step] = time.time()
            out_of_time = args.max_wall and time.time() - t_ready > args.max_wall
            if out_of_time:
                control.should_training_stop = True
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps or out_of_time:
                t = time.time()
                weights = {k: v.detach().to("cpu", copy=True) for k, v in kw["model"].state_dict().items()}
                snapshot_s[0] += time.time() - t
                snapshots[state.global_step] = (weights, snapshot_s[0])
            log("trl", f"step {state.global_step} at {stamps[state.global_step] - t_ready:.1f} s")

        def on_log(self, a, state, control, logs_=None, **kw):
            entry = kw.get("logs") or logs_
            if entry:
                logs.append({"step": state.global_step, **entry})

    trainer = GRPOTrainer(model=model, reward_funcs=reward_for_trl(args.reward), args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Snapshots()])
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    log("trl", f"training {args.steps} steps of {completions} completions, max {args.max_new_tokens} tokens")
    with GpuMemory() as memory:
        trainer.train()
    peak_alloc = torch.cuda.max_memory_allocated() / 2**20 if on_gpu else None
    t_end = time.time()
    del trainer
    model.to("cpu")
    if on_gpu:
        torch.cuda.empty_cache()

    evaluate = Evaluator(model_dir, val_path, args.val_n, args.eval_batch, args.max_new_tokens,
                         "cuda" if on_gpu else "cpu")
    points = [{"step": 0, "wall_s": 0.0, "train_s": 0.0, **eval_fields(evaluate())}]
    log("trl", f"step 0 (base model): accuracy {points[0]['accuracy']:.3f}")
    for step in sorted(snapshots):
        weights, saved_s = snapshots.pop(step)
        wall = stamps[step] - t_ready
        points.append({"step": step, "wall_s": wall, "train_s": wall - saved_s, **eval_fields(evaluate(weights))})
        log("trl", f"step {step}: accuracy {points[-1]['accuracy']:.3f} at {wall:.1f} s")
    step_s = [stamps[s] - stamps[s - 1] for s in sorted(stamps) if s > 0]
    lengths = [entry["completions/mean_length"] for entry in logs if "completions/mean_length" in entry]
    tokens = sum(lengths) * completions
    extra = {"engine": "trl", "algo": "grpo", "steps": max(stamps), "startup_s": stamps[0] - t_ready,
             "prepare_s": t_ready - t_start, "snapshot_s": snapshot_s[0],
             "s_per_step_median": statistics.median(step_s) if step_s else None,
             "response_tokens_per_s": tokens / max(stamps[max(stamps)] - stamps[0], 1e-9),
             "peak_gpu_mem_mib": memory.peak_mib, "peak_torch_alloc_mib": peak_alloc,
             "reward_by_step": {e["step"]: e["reward"] for e in logs if "reward" in e},
             "length_by_step": {e["step"]: e["completions/mean_length"] for e in logs if "completions/mean_length" in e},
             "script_s": t_end - t_start, "trl_version": trl.__version__,
             "settings": {k: getattr(args, k) for k in ("steps", "prompts_per_step", "group", "max_new_tokens",
                                                        "lr", "kl", "temperature", "micro_batch")}}
    write_curve(out, "TRL GRPOTrainer", points, extra)
    log("trl", f"wrote {out}/curve.json, curve.md, curve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
