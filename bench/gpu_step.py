"""W1 step benchmark: GRPO / PPO through the normal runtime, sync vs async, optionally vs TRL.

    python3 bench/gpu_step.py --gpus 1 --algos grpo,ppo --modes sync,async --steps 6 --out OUT [--trl]
    python3 bench/gpu_step.py --tiny --out /tmp/w1tiny --trl --trl-python /tmp/trlvenv/bin/python   # CPU check

Builds workload W1 (../shared/device/README.md) on disk the way a user would: a local HF model
directory (Qwen2.5-0.5B shape, random init, bf16 safetensors, a 151936-token tokenizer whose
specials are <pad>/<eos>/<bos>/<unk>), a JSONL of prompts that tokenize to exactly 128 ids, and a
reward file (a cheap program). The tokenizer is byte-level BPE with no merges (every byte one
token, then filler tokens up to the vocab size), not WordLevel: transformers 5's AutoTokenizer
loads any qwen2 model directory's tokenizer as Qwen2Tokenizer, which rebuilds a byte-level BPE
from tokenizer.json's vocab and merges, so a WordLevel vocab encodes to nothing there. A prompt
of 128 ASCII letters is then exactly 128 ids, in our nodes and in TRL alike (checked at build).
Then runs `python -m dataflow.run graphs/{grpo,ppo}.py` once per variant in a subprocess (one
variant failing or timing out does not stop the others), with --set overrides only, each with
--trace, and reads back metrics.jsonl and the trace.

Workload per step: 256 responses of exactly 256 tokens (EOS suppressed with
generator.min_new_tokens=256) to 128-token prompts. GRPO: 32 prompts x group 8. PPO: 256 prompts
x 1 (the PPO graph has no groups; same samples and tokens per step), critic 1 epoch.
Both: one optimizer step per batch (minibatch = 256), lr 1e-6, KL coef 0.01 (TRL's beta = the same).
Modes: sync = max_staleness 0 (on-policy, generation and training alternate); async =
max_staleness 1 (generation of batch k+1 overlaps training on batch k).
--gpus 1: placement=colocated (every node shares the one GPU); --gpus 2: placement=split
(generator on GPU 0, reference/critic/learner on GPU 1). TRL always runs on one GPU.
Micro-batches (and the learner's GPU share) per variant unless --micro-batch: batch_sizes(); with
--plan none are set and the memory plan (rl/model/applied_plan.py) chooses shares, token budgets and
checkpointing, as for a user who sets nothing (issue 37's ladder: --shape 1.5b/3b/7b, and
--set learner.lora.rank=32 for LoRA).

Reported per variant (the first --warmup steps excluded):
  s/step       wall time between the learner's step records (steady state)
  tok/s        response tokens trained on per second (256 x 256 per step at W1)
  idle%        per GPU, from the trace report over the whole run (dataflow.trace.report.summarize);
               idle_steady%: the same GPU intervals over the steady window only (after the
               warm-up steps' train spans), when the trace has them
  peak GB      the largest `gpu/peak_mem_gb` any node reported (torch max_memory_allocated), per node in JSON
  MFU          model FLOP per step / (s/step x 989e12 x GPUs), 989 TFLOP/s = H200 dense bf16 peak.
               FLOP per step = 2·N·T_gen + 2·N·T_ref + 6·N·T_train (+ PPO: 2·Nc·T + 6·Nc·T per
               critic epoch), N = matmul parameters of the policy incl. the (tied) LM head, Nc = the
               critic's (no LM head), T = tokens per step = 256 x (128 + 256); plus causal attention
               4·layers·d·S²/2 per sequence forward (x3 for training). Recomputation (old
               log-probs of stale samples, padding) is not counted: MFU is of useful work. With
               --set learner.lora.rank=R > 0 training is 4·N·T_train (+ attention x2): the frozen
               base gets no weight gradients (the adapter's own FLOP are left out).
--learner-bench (first, in this process, no Ray): the token log-prob kernel (plain float32 vs
rl_math.token_logprobs eager and compiled), then ppo_update alone (one optimizer step over 256
synthetic W1-length samples) and the reference pass, per micro-batch size
(--learner-micro-batches 8,16,32), with eager and with compiled decoder layers
(precision.compile_layers): s, tokens/s, MFU, peak GB, so the learner side's own speed and memory
show apart from generation; --algos "" skips the graphs.
Writes OUT/results.json (rewritten after every variant, so a cut-off call keeps what finished),
OUT/<variant>/{run.log, metrics.jsonl, trace.json.gz}, OUT/trl/{run.log, result.json}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

H200_BF16_PEAK = 989e12
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
# W1 and a CPU-sized stand-in with the same structure (GQA, tied embeddings, Qwen2).
SHAPES = {
    "w1": dict(vocab=151936, hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
               prompt_len=128, response_len=256, prompts_per_step=32, group=8),
    "tiny": dict(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                 prompt_len=16, response_len=16, prompts_per_step=4, group=8),
}
# Issue 37's ladder: W1's workload on Qwen2.5's published 1.5B, 3B and 7B shapes (--shape).
SHAPES["1.5b"] = dict(SHAPES["w1"], hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960)
SHAPES["3b"] = dict(SHAPES["w1"], hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008)
SHAPES["7b"] = dict(SHAPES["w1"], vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944,
                    tied=False)
REWARD_SOURCE = '''"""W1 benchmark reward: cheap and varied (so group advantages are not all 0): the fraction of
the response's characters with an odd code point. Works for dataflow (reward(prompt, response))
and TRL (wrapped by bench/trl_w1.py)."""


def reward(prompt, response, **fields):
    return sum(ord(c) & 1 for c in response) / max(len(response), 1)
'''
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
T0 = time.time()


def log(text: str) -> None:
    print(f"[gpu_step {time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {text}", flush=True)


# ---- the workload on disk ------------------------------------------------------------------------
def build_workload(work: Path, shape: dict, num_prompts: int, seed: int = 0) -> dict:
    """Model dir, prompts JSONL and reward file under `work` (reused when already complete)."""
    model_dir, prompts, reward = work / "model", work / "prompts.jsonl", work / "reward.py"
    done = work / "READY"
    paths = {"model": str(model_dir), "prompts": str(prompts), "reward": str(reward)}
    made = json.loads(done.read_text()) if done.exists() else {}
    if made.get("num_prompts", 0) >= num_prompts and made == {**shape, "num_prompts": made["num_prompts"]}:
        log(f"workload reused from {work}")
        return paths
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    work.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):  # the 256 byte symbols: every text encodes
        vocab[ch] = len(vocab)
    filler = 0
    while len(vocab) < shape["vocab"]:  # never produced by encoding, but the model can sample them
        vocab[f"x{filler}"] = len(vocab)
        filler += 1
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                  bos_token="<bos>", unk_token="<unk>")
    config = Qwen2Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["intermediate"], max_position_embeddings=32768, rope_theta=1e6,
        tie_word_embeddings=shape.get("tied", True), use_sliding_window=False, rms_norm_eps=1e-6,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    t = time.time()
    torch.manual_seed(seed)
    # Initialise on the GPU when there is one: a 0.5B random init on CPU takes tens of seconds.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    n_params = sum(p.numel() for p in model.parameters())
    del model
    log(f"model {n_params / 1e6:.0f}M params saved (bf16) to {model_dir} in {time.time() - t:.1f} s")
    rng = random.Random(seed)
    with open(prompts, "w") as f:
        for i in range(num_prompts):
            f.write(json.dumps({"prompt": "".join(rng.choice(LETTERS) for _ in range(shape["prompt_len"])),
                                "answer": ""}) + "\n")
    reward.write_text(REWARD_SOURCE)
    # Check what a user would, loading it the way the nodes (rl/data/tasks.load_tokenizer) and TRL do:
    # exactly prompt_len ids per prompt, the specials where the model config says.
    check = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    for line in prompts.read_text().splitlines()[:8]:
        ids = check(json.loads(line)["prompt"])["input_ids"]
        assert len(ids) == shape["prompt_len"] and min(ids) >= len(SPECIALS), \
            f"{type(check).__name__}: {len(ids)} ids, want {shape['prompt_len']}: {ids[:8]}"
    assert check.pad_token_id == 0 and check.eos_token_id == 1 and len(check) == shape["vocab"]
    done.write_text(json.dumps({**shape, "num_prompts": num_prompts}))
    return paths


# ---- FLOP and metrics ----------------------------------------------------------------------------
def matmul_params(shape: dict, lm_head: bool = True) -> int:
    d, kv = shape["hidden"], shape["hidden"] // shape["heads"] * shape["kv_heads"]
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * shape["intermediate"]  # q, o; k, v; gate, up, down
    return shape["layers"] * per_layer + (shape["vocab"] * d if lm_head else 0)


def flop_per_step(shape: dict, algo: str, critic_epochs: int = 1, lora: bool = False) -> float:
    """Useful model FLOP of one step (module docstring): forward = 2 FLOP per parameter per token
    plus causal attention; backward = 2 x forward, or 1 x with LoRA (the input gradients only)."""
    samples = shape["prompts_per_step"] * shape["group"]
    seq = shape["prompt_len"] + shape["response_len"]
    tokens = samples * seq
    attn_fwd = samples * 4 * shape["layers"] * shape["hidden"] * seq * seq / 2

    def fwd(n):
        return 2 * n * tokens + attn_fwd

    n = matmul_params(shape)
    total = fwd(n) + fwd(n) + (2 if lora else 3) * fwd(n)  # generation (prefill + decode), reference, training
    if algo == "ppo":
        nc = matmul_params(shape, lm_head=False)
        total += fwd(nc) + critic_epochs * 3 * fwd(nc)  # value pass + critic training
    return total


def uses_lora(sets: list[str]) -> bool:
    """Whether --set trains a LoRA adapter (learner.lora.rank > 0)."""
    return any(x.startswith("learner.lora.rank=") and x.split("=", 1)[1].strip() not in ("0", "") for x in sets)


def steady_stats(records: list[dict], warmup: int, samples_per_step: int) -> dict:
    """s/step and response tokens/s over the steps after the first `warmup` ones."""
    steps = [r for r in records if "step" in r and str(r.get("node", "")).startswith("learner")]
    if len(steps) <= warmup:
        return {"steps_done": len(steps)}
    steady = steps[warmup:]
    t_start = steps[warmup - 1]["time_s"] if warmup else steady[0]["time_s"] - steady[0]["timing/step_s"]
    span = steady[-1]["time_s"] - t_start
    tokens = sum(r["response_length/mean"] * samples_per_step for r in steady)
    return {"steps_done": len(steps), "steady_steps": len(steady), "s_per_step": span / len(steady),
            "s_per_step_median": statistics.median(r["timing/step_s"] for r in steady),
            "response_tokens_per_s": tokens / span, "response_length": steady[-1]["response_length/mean"],
            "reward": steady[-1].get("reward/mean"), "kl": steady[-1].get("kl"),
            "window_s": [t_start, steady[-1]["time_s"]]}


def peak_memory(records: list[dict]) -> dict:
    out: dict[str, float] = {}
    for r in records:
        if "gpu/peak_mem_gb" in r:
            out[r["node"]] = max(out.get(r["node"], 0.0), r["gpu/peak_mem_gb"])
    return out


def trace_idle(trace_path: Path, warmup: int) -> dict:
    """Per-GPU idle fraction from the trace report (whole run), and over the steady window: from
    the end of the learner's warm-up train spans to the end of its last one."""
    import gzip

    from dataflow.trace.chrome import load_trace
    from dataflow.trace.intervals import idle_fraction
    from dataflow.trace.report import summarize

    aggregates, rows = load_trace(str(trace_path))
    summary = summarize(aggregates)
    out = {"idle": {label: d["idle"] for label, d in summary["devices"].items()}}
    try:
        with gzip.open(trace_path, "rt") if str(trace_path).endswith(".gz") else open(trace_path) as f:
            doc = json.load(f)
        names = {ev["pid"]: ev["args"]["name"] for ev in doc["traceEvents"]
                 if ev["ph"] == "M" and ev["name"] == "process_name"}
        spans = sorted(ev["ts"] + ev["dur"] for ev in doc["traceEvents"] if ev["ph"] == "X"
                       and ev.get("name") == "train step" and names.get(ev["pid"]) == "learner")
        if len(spans) > warmup:
            window = [spans[warmup - 1] if warmup else spans[0], spans[-1]]
            out["idle_steady"] = {label: idle_fraction(kinds.get("gpu", []), window)
                                  for label, kinds in rows if label in aggregates["gpus"]}
            out["steady_window_s"] = (window[1] - window[0]) / 1e6
    except Exception as e:  # the steady idle is a bonus; the report's own figure stands
        out["idle_steady_error"] = f"{type(e).__name__}: {e}"
    return out


# ---- running a variant ---------------------------------------------------------------------------
def run_logged(cmd: list[str], log_path: Path, timeout_s: float, prefix: str, env: dict | None = None) -> int:
    """Run `cmd` in its own process group, its output to `log_path` and (prefixed) to stdout;
    kill the group after `timeout_s`. Returns the exit status (124 on timeout)."""
    with open(log_path, "w") as logf:
        logf.write(" ".join(cmd) + "\n")
        logf.flush()
        proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, env=env)
        timed_out = threading.Event()

        def kill():
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                time.sleep(10)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            for line in proc.stdout:
                logf.write(line)
                logf.flush()
                if line.startswith(("step", "[dataflow]", "error", "Traceback", "[trl_w1", "  ")) or "Error" in line:
                    print(f"  {prefix}| {line.rstrip()}"[:300], flush=True)
            proc.wait()
        finally:
            timer.cancel()
    return 124 if timed_out.is_set() else proc.returncode


def batch_sizes(args, algo: str) -> tuple[int, int, list[str]]:
    """(learner/critic micro-batch, reference micro-batch, extra --set) of a variant: --micro-batch
    and --ref-micro-batch when given, else the fastest measured that fit
    (bench/results/w1_step_h200_2026-11-30b.md): GRPO on one H200 64 and 64 with half the GPU for
    the learner; PPO on one H200 16 (four model nodes share it); two H200s 32 and 32."""
    if args.plan:   # the memory plan chooses the budgets and shares (rl/model/applied_plan.py)
        return 0, 0, []
    if args.micro_batch:
        return args.micro_batch, args.ref_micro_batch or 32, []
    if args.gpus == 1 and algo == "grpo" and not args.tiny:
        shares = [] if any(x.startswith("gpu_shares=") for x in args.set) else ['gpu_shares={"learner":0.5}']
        return 64, args.ref_micro_batch or 64, shares
    return (16 if args.gpus == 1 else 32), args.ref_micro_batch or 32, []


def memory_plan_lines(algo: str, sets: list[str], vdir: Path) -> list[str]:
    """--plan: the variant's --describe (same --set) saved as vdir/describe.txt; its memory plan
    lines (each node's share and need, the budgets and who chose them) for the results row."""
    cmd = [sys.executable, "-m", "dataflow.run", str(ROOT / f"graphs/{algo}.py"), "--describe"]
    out = subprocess.run(cmd + [x for s in sets for x in ("--set", s)], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    (vdir / "describe.txt").write_text(text)
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith(("memory plan", "error"))), len(lines))
    end = next((i for i, l in enumerate(lines) if l.startswith("settings (--set")), len(lines))
    log("memory plan:\n" + "\n".join(lines[start:end]))
    return lines[start:end]


def dataflow_variant(args, shape: dict, paths: dict, algo: str, mode: str, out: Path, timeout_s: float) -> dict:
    name = f"{algo}-{mode}-{args.gpus}gpu"
    vdir = out / name
    vdir.mkdir(parents=True, exist_ok=True)
    samples = shape["prompts_per_step"] * shape["group"]
    micro, ref_micro, shares = batch_sizes(args, algo)
    sets = [f"policy.path={paths['model']}", f"prompts.path={paths['prompts']}", f"reward.path={paths['reward']}",
            f"max_new_tokens={shape['response_len']}", f"generator.min_new_tokens={shape['response_len']}",
            f"max_staleness={0 if mode == 'sync' else 1}",
            f"learner.minibatch_size={samples}", "learner.ppo_epochs=1", "learner.lr=1e-6", "learner.kl.coef=0.01", "learner.save_final=false",
            *([f"learner.micro_batch_size={micro}"] if micro else []),
            *([f"reference.micro_batch_size={ref_micro}"] if ref_micro else []),
            # a step's prompts decoded at once: 256 decoder slots for GRPO (32 x 8) and PPO (256 x 1)
            f"generator.prompts_per_call={shape['prompts_per_step'] if algo == 'grpo' else samples}"]
    if args.tiny:
        sets += ["placement=cpu"]
    else:
        sets += [f"placement={'colocated' if args.gpus == 1 else 'split'}", f"num_gpus={args.gpus}"]
    if algo == "grpo":
        sets += [f"prompts_per_step={shape['prompts_per_step']}", f"group_size={shape['group']}"]
    else:
        sets += [f"prompts_per_step={samples}", "critic.epochs=1", f"critic.minibatch_size={samples}",
                 *([f"critic.micro_batch_size={micro}"] if micro else []), "critic.lr=1e-6"]
    sets += shares + args.set
    trace = vdir / "trace.json.gz"
    shutil.rmtree(vdir / "run", ignore_errors=True)   # a rerun: the CLI refuses an earlier run's directory
    cmd = [sys.executable, "-m", "dataflow.run", str(ROOT / f"graphs/{algo}.py"), "--max-steps", str(args.steps),
           "--trace", str(trace), "--out", str(vdir / "run")]
    for s in sets:
        cmd += ["--set", s]
    if name in args.trace_kernels:  # exact kernel records: the trace's idle comes from them
        cmd.append("--trace-kernels")
    plan = memory_plan_lines(algo, sets, vdir) if args.plan else []
    log(f"{name}: start (timeout {timeout_s:.0f} s)")
    t = time.time()
    rc = run_logged(cmd, vdir / "run.log", timeout_s, name)
    row = {"variant": name, "algo": algo, "mode": mode, "gpus": args.gpus, "micro_batch": micro,
           "ref_micro_batch": ref_micro, "extra_sets": shares + args.set, "rc": rc, "wall_s": time.time() - t,
           **({"memory_plan": plan} if args.plan else {}),
           "status": "ok" if rc == 0 else ("timeout" if rc == 124 else f"failed rc={rc}")}
    metrics = vdir / "run" / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
        row.update(steady_stats(records, args.warmup, samples))
        row["peak_mem_gb"] = peak_memory(records)
    if trace.exists():
        try:
            row.update(trace_idle(trace, args.warmup))
        except Exception as e:
            row["trace_error"] = f"{type(e).__name__}: {e}"
    if name in args.trace_kernels:  # the runtime's line: kernel records vs NVML vs span events
        row["idle_sources"] = [l.strip() for l in (vdir / "run.log").read_text().splitlines()
                               if "from kernel records" in l]
    if row.get("s_per_step"):
        flop = flop_per_step(shape, algo, lora=uses_lora(args.set))
        row["mfu"] = flop / row["s_per_step"] / (H200_BF16_PEAK * args.gpus)
    if row["status"] == "ok" and "s_per_step" not in row:
        row["status"] = f"ok but only {row.get('steps_done', 0)} steps (<= warm-up {args.warmup})"
    if rc != 0:
        row["log_tail"] = (vdir / "run.log").read_text()[-1500:]
    log(f"{name}: {row['status']} in {row['wall_s']:.0f} s; s/step {row.get('s_per_step', float('nan')):.2f}")
    return row


def trl_variant(args, shape: dict, paths: dict, out: Path, timeout_s: float) -> dict:
    vdir = out / "trl"
    vdir.mkdir(parents=True, exist_ok=True)
    cmd = [args.trl_python, str(ROOT / "bench/trl_w1.py"), "--model", paths["model"], "--prompts", paths["prompts"],
           "--reward", paths["reward"], "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--prompts-per-step", str(shape["prompts_per_step"]), "--group", str(shape["group"]),
           "--max-new-tokens", str(shape["response_len"]), "--micro-batch", str(args.trl_micro_batch),
           "--lr", "1e-6", "--beta", "0.01", "--out", str(vdir / "result.json")]
    if args.tiny:
        cmd.append("--cpu")
    if args.trl_grad_ckpt:
        cmd.append("--gradient-checkpointing")
    if args.trl_lora_rank:
        cmd += ["--lora-rank", str(args.trl_lora_rank)]
    log(f"trl: start (timeout {timeout_s:.0f} s)")
    t = time.time()
    env = dict(os.environ)
    if args.trl_python != sys.executable:  # a separate venv: don't leak this interpreter's site dirs
        env.pop("PYTHONPATH", None)
    rc = run_logged(cmd, vdir / "run.log", timeout_s, "trl", env=env)
    row = {"variant": "trl-grpo-sync-1gpu" + (f"-lora{args.trl_lora_rank}" if args.trl_lora_rank else ""), "algo": "grpo", "mode": "trl", "gpus": 1, "rc": rc,
           "wall_s": time.time() - t, "status": "ok" if rc == 0 else ("timeout" if rc == 124 else f"failed rc={rc}")}
    result = vdir / "result.json"
    if result.exists():
        row.update(json.loads(result.read_text()))
    if row.get("s_per_step"):
        row["mfu"] = flop_per_step(shape, "grpo", lora=bool(args.trl_lora_rank)) / row["s_per_step"] / H200_BF16_PEAK
    if rc != 0:
        row["log_tail"] = (vdir / "run.log").read_text()[-1500:]
    log(f"trl: {row['status']} in {row['wall_s']:.0f} s; s/step {row.get('s_per_step', float('nan')):.2f}")
    return row


def logprob_kernel_bench(micro_batches: list[int], cols: int, vocab: int) -> list[dict]:
    """Side by side, per learner micro-batch of W1's logits ([mb, 257, vocab] bf16): token log-probs
    with a detached entropy metric, forward + backward, as the learner runs them. plain: the float32
    upcast of the whole logits, logsumexp-gather and softmax-entropy (what nodes/models ran before
    rl_math.token_logprobs); fused eager; fused compiled (the CUDA default). Median ms of 5, peak GB."""
    import torch

    from rl.model.logprobs import token_logprobs

    def plain(logits, tokens):
        z = logits.float()
        lse = torch.logsumexp(z, -1)
        lp = z.gather(-1, tokens[..., None]).squeeze(-1) - lse
        with torch.no_grad():
            ent = lse - (torch.softmax(z, -1) * z).sum(-1)
        return lp, ent

    variants = {"plain fp32": plain,
                "fused eager": lambda l, t: token_logprobs(l, t, entropy_grad=False, compile=False),
                "fused compiled": lambda l, t: token_logprobs(l, t, entropy_grad=False, compile=True)}
    rows = []
    for mbs in micro_batches:
        g = torch.Generator(device="cuda").manual_seed(0)
        base = torch.randn(mbs, cols, vocab, device="cuda", generator=g).to(torch.bfloat16)
        tokens = torch.randint(0, vocab, (mbs, cols), device="cuda", generator=g)
        weights = torch.randn(mbs, cols, device="cuda", generator=g)
        results = {}
        for name, fn in variants.items():
            row = {"variant": f"logprob kernel mb={mbs} {name}", "status": "ok"}
            try:
                times = []
                for i in range(6):
                    logits = base.clone().requires_grad_()
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start = torch.cuda.memory_allocated()
                    t = time.perf_counter()
                    lp, ent = fn(logits, tokens)
                    (lp * weights).sum().backward()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                results[name] = (lp.detach(), ent, logits.grad)
                row.update(s_per_step=statistics.median(times[1:]),
                           peak_mem_gb=(torch.cuda.max_memory_allocated() - start) / 2**30)
                del logits, lp, ent
            except Exception as e:
                row["status"] = f"error {type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            log(f"{row['variant']}: {row['status']} {1e3 * row.get('s_per_step', float('nan')):.1f} ms")
        if "plain fp32" in results:  # the fused kernels' numbers against the plain ones
            ref = results.pop("plain fp32")
            for name, got in results.items():
                diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)]
                log(f"logprob kernel mb={mbs} {name} vs plain: max abs diff logprob {diffs[0]:.2e} "
                    f"entropy {diffs[1]:.2e} grad {diffs[2]:.2e}")
        del base, results
        torch.cuda.empty_cache()
    return rows


def learner_bench(args, shape: dict, paths: dict, out: Path) -> list[dict]:
    """The learner side alone, in this process, on the W1 model: one ppo_update (one optimizer
    step over all 256 samples) and one reference pass per micro-batch size, on synthetic samples
    of W1 length; seconds (median of 3 after 1 warm-up), MFU of the update (6·N·T + attention)
    and peak memory. Tells whether the learner fits and how fast it can go without generation."""
    import torch

    from rl.data import policy
    from nodes.impl.learner import LearnerConfig, ppo_update
    from rl.model.precision import compile_layers, prepare_frozen, prepare_trained
    from nodes.impl.reference import add_logprobs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = policy.PolicySpec(path=paths["model"])
    model, tok = policy.load(spec)
    prepare_trained(model, device, "auto")
    ref, _ = policy.load(spec)
    prepare_frozen(ref, device, "auto")
    g = torch.Generator().manual_seed(0)
    n, P, R = shape["prompts_per_step"] * shape["group"], shape["prompt_len"], shape["response_len"]
    ids = torch.randint(len(SPECIALS), shape["vocab"], (n, P + R), generator=g).tolist()
    samples = [{"prompt_ids": row[:P], "response_ids": row[P:], "logprobs": [-11.0] * R, "ref_logprobs": [-11.0] * R,
                "advantages": [float(i % 2) - 0.5] * R, "score": 0.0, "failed": False, "finished": True}
               for i, row in enumerate(ids)]
    seq = P + R
    attn = n * 4 * shape["layers"] * shape["hidden"] * seq * seq / 2
    train_flop = 3 * (2 * matmul_params(shape) * n * seq + attn)
    rows = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def timed(fn, reps=3):
        times = []
        for i in range(reps + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    if device == "cuda":
        rows += logprob_kernel_bench(args.learner_micro_batches, R + 1, shape["vocab"])
    # stale=False: W1's one minibatch takes its proximal log-probs from its own forward either way
    for mbs, compiled in [(m, c) for c in (False, True) for m in args.learner_micro_batches]:
        if compiled and mbs == args.learner_micro_batches[0]:  # once, before the first compiled row
            compile_layers(model, True, device)  # the graph's CUDA default
        row = {"variant": f"learner mb={mbs}{' compiled' if compiled else ''}", "status": "ok"}
        try:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            cfg = LearnerConfig(minibatch_size=n, micro_batch_size=mbs, lr=1e-6)
            s = timed(lambda: ppo_update(model, opt, samples, 0.01, tok.pad_token_id, cfg, random.Random(0), False))
            row.update(s_per_step=s, response_tokens_per_s=n * R / s, mfu=train_flop / s / H200_BF16_PEAK)
            if device == "cuda":
                row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as e:  # e.g. out of memory at a large micro-batch: report, go on
            row["status"] = f"error {type(e).__name__}: {str(e)[:200]}"
            opt.zero_grad(set_to_none=True)
        rows.append(row)
        log(f"{row['variant']}: {row['status']} {row.get('s_per_step', float('nan')):.3f} s")
    if device == "cuda":  # where one update's GPU time goes, by op (written next to results.json)
        from torch.profiler import ProfilerActivity, profile

        mbs = args.learner_micro_batches[0]
        cfg = LearnerConfig(minibatch_size=n, micro_batch_size=mbs, lr=1e-6)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ppo_update(model, opt, samples, 0.01, tok.pad_token_id, cfg, random.Random(0), False)
            torch.cuda.synchronize()
        text = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
        (out / "learner_profile.txt").write_text(f"ppo_update, micro-batch {mbs}, {n} samples\n{text}\n")
        log(f"learner profile (micro-batch {mbs}):\n{text[:6000]}")
    for mbs, compiled in [(m, c) for c in (False, True) for m in args.learner_micro_batches]:
        if compiled and mbs == args.learner_micro_batches[0]:
            compile_layers(ref, True, device)
        row = {"variant": f"reference mb={mbs}{' compiled' if compiled else ''}", "status": "ok"}
        try:
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            items = [{"samples": [dict(x) for x in samples[i:i + shape["group"]]]} for i in range(0, n, shape["group"])]
            s = timed(lambda: add_logprobs(ref, tok.pad_token_id, items, "ref_logprobs", mbs))
            row.update(s_per_step=s, response_tokens_per_s=n * R / s, mfu=train_flop / 3 / s / H200_BF16_PEAK)
            if device == "cuda":
                row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as e:
            row["status"] = f"error {type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        log(f"{row['variant']}: {row['status']} {row.get('s_per_step', float('nan')):.3f} s")
    return rows


def table(rows: list[dict]) -> str:
    def pct(d):
        return (" ".join(f"{label.split()[-1]}:{100 * v:.0f}" for label, v in sorted(d.items()))
                if isinstance(d, dict) and d else "-")

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    lines = ["| variant | status | steps | s/step | s/step med | resp tok/s | GPU idle % run | idle % steady "
             "| peak GB (max node) | MFU % |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = r.get("peak_mem_gb") or {}
        peak_s = (f"{max(peak.values()):.1f} ({max(peak, key=peak.get)})" if isinstance(peak, dict) and peak
                  else f(r.get("peak_mem_gb"), ".1f"))
        lines.append(f"| {r['variant']} | {r['status']} | {r.get('steps_done', '-')} | {f(r.get('s_per_step'), '.2f')} "
                     f"| {f(r.get('s_per_step_median'), '.2f')} | {f(r.get('response_tokens_per_s'), '.0f')} "
                     f"| {pct(r.get('idle'))} | {pct(r.get('idle_steady'))} | {peak_s} "
                     f"| {f(100 * r['mfu'] if r.get('mfu') else None, '.1f')} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, choices=(1, 2), default=1)
    p.add_argument("--algos", default="grpo,ppo")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer (bench/trl_w1.py)")
    p.add_argument("--trl-only", action="store_true", help="run only TRL")
    p.add_argument("--trl-python", default=sys.executable, help="interpreter with trl installed")
    p.add_argument("--trl-micro-batch", type=int, default=16, help="TRL per_device_train_batch_size")
    p.add_argument("--trl-grad-ckpt", action="store_true", help="TRL with gradient checkpointing (its default)")
    p.add_argument("--trl-lora-rank", type=int, default=0, help="TRL with LoRA of this rank (peft; the anchor "
                   "for --set learner.lora.rank=R)")
    p.add_argument("--tiny", action="store_true", help="a small shape on CPU: checks the whole script end to end")
    p.add_argument("--shape", default="w1", choices=sorted(SHAPES), help="model shape (w1: Qwen2.5-0.5B's)")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="learner/critic micro_batch_size; 0 = per variant, see batch_sizes()")
    p.add_argument("--ref-micro-batch", type=int, default=0, help="reference micro_batch_size; 0 = per variant")
    p.add_argument("--plan", action="store_true",
                   help="no micro-batches or gpu_shares set: the memory plan chooses them (issue 37; its "
                        "--describe is saved per variant and its plan lines go into the results)")
    p.add_argument("--set", action="append", default=[], help="extra --set for every dataflow variant")
    p.add_argument("--learner-bench", action="store_true",
                   help="first time ppo_update and the reference pass alone (no Ray), per micro-batch size")
    p.add_argument("--learner-micro-batches", type=lambda v: [int(x) for x in v.split(",")], default=[8, 16, 32])
    p.add_argument("--trace-kernels", default="", type=lambda v: [x for x in v.split(",") if x],
                   help="variants (e.g. ppo-async) run with --trace-kernels: GPU idle from kernel records")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/w1_workload", help="where the model dir and data go (not under --out)")
    p.add_argument("--budget-s", type=float, default=570.0,
                   help="stop starting variants past this many seconds (the GPU machine's call limit is 600)")
    args = p.parse_args()

    name = "tiny" if args.tiny else args.shape
    shape = SHAPES[name]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work + ("" if name == "w1" else f"_{name}"))
    log(f"args: {vars(args)}")
    # Enough for PPO's 256 prompts per step (the source stops when they run out); at least 12 steps'
    # worth, so a later call with a few more steps reuses the same files.
    num_prompts = max(args.steps + 4, 12) * shape["prompts_per_step"] * shape["group"]
    try:
        paths = build_workload(work, shape, num_prompts)
    except Exception as e:
        log(f"workload build failed: {type(e).__name__}: {e}")
        raise
    variants = [] if args.trl_only else [(a, m) for a in args.algos.split(",") if a for m in args.modes.split(",") if m]
    rows: list[dict] = []
    if args.learner_bench:
        try:
            rows += learner_bench(args, shape, paths, out)
        except Exception as e:
            rows.append({"variant": "learner bench", "status": f"error {type(e).__name__}: {e}"})
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():  # hand the cached blocks back before the graphs' processes start
            torch.cuda.empty_cache()
        (out / "results.json").write_text(json.dumps({"shape": shape, "args": vars(args), "rows": rows}, indent=1))
    todo = [("df", a, m) for a, m in variants] + ([("trl", "grpo", "sync")] if args.trl or args.trl_only else [])
    for kind, algo, mode in todo:
        left = args.budget_s - (time.time() - T0)
        if left < 60:
            rows.append({"variant": f"{kind}:{algo}-{mode}", "status": "skipped (time budget)"})
            continue
        try:
            row = (trl_variant(args, shape, paths, out, left - 5) if kind == "trl"
                   else dataflow_variant(args, shape, paths, algo, mode, out, left - 5))
        except Exception as e:  # a bug in reading one variant's results must not lose the others
            row = {"variant": f"{kind}:{algo}-{mode}", "status": f"error {type(e).__name__}: {e}"}
        rows.append(row)
        (out / "results.json").write_text(json.dumps({"shape": shape, "args": vars(args), "rows": rows}, indent=1))
    text = table(rows)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"shape": shape, "args": vars(args), "rows": rows,
                                                  "flop_per_step": {a: flop_per_step(shape, a) for a in ("grpo", "ppo")}},
                                                 indent=1))
    print(f"\nW1{' (tiny, CPU)' if args.tiny else ''}: {shape['prompts_per_step'] * shape['group']} responses x "
          f"{shape['response_len']} tokens per step, prompts {shape['prompt_len']}; steps {args.steps}, "
          f"first {args.warmup} excluded; FLOP/step grpo {flop_per_step(shape, 'grpo'):.3g}, "
          f"ppo {flop_per_step(shape, 'ppo'):.3g}; MFU vs 989 TFLOP/s per GPU", flush=True)
    print(text, flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
