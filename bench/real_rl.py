"""GRPO (graphs/grpo.py) or PPO (graphs/ppo.py) on SmolLM2-135M-Instruct and the arithmetic task,
with a held-out accuracy curve (issue 18, items 3 and 5).

    python bench/real_rl.py --out runs/real_grpo                      # one H200: GRPO, 120 steps
    python bench/real_rl.py --algo ppo --out runs/real_ppo            # PPO, same samples per step
    python bench/real_rl.py --tiny --out /tmp/real_tiny               # CPU smoke (minutes)
    ... --set learner.lr=5e-6 --set max_staleness=1                   # any graph setting

Model and data: --model / --data, or converted and written under --work (examples/smollm2_arithmetic/smollm2.py,
examples/smollm2_arithmetic/make_arithmetic.py). The graph runs with the --reward file (default
examples/smollm2_arithmetic/last_number_reward.py; `--reward math` = rl/reward/reward_fn.py's math_reward) and saves a
checkpoint every --eval-every steps (save_interval, every checkpoint kept). After the run every
checkpoint's learner weights, and the base model (step 0), are evaluated greedily on the held-out
split by examples/smollm2_arithmetic/heldout.py (the same judge bench/real_trl.py uses): evaluating after the run keeps
the training clock clean of evaluation. Saving the checkpoints is in the clock (their saves are
timed from the checkpoint directories appearing and reported apart: train_s = wall_s minus saves
so far).

Writes --out/curve.json, curve.md, curve.png, the run directory (metrics.jsonl, config.json)
and, with --trace, a Chrome trace plus its idle report (item 7: GPU idle per step).

Settings matched to bench/real_trl.py (TRL's GRPOTrainer): group --group, --prompts-per-step,
lr, KL coef --kl (k3, in the loss), clip 0.2, temperature 1, --max-new-tokens, one optimizer step per
training step (learner.minibatch_size = samples per step), max_staleness 0 (on-policy, as TRL).
PPO: group 1 and prompts_per_step = GRPO's prompts x group (the same samples per step); the
critic starts from the same checkpoint (graphs/ppo.py wires one policy to every node).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_common import (REWARDS, ROOT, Evaluator, GpuMemory, add_common_args, apply_tiny,  # noqa: E402
                         eval_fields, log, prepare, write_curve)

TINY = {"steps": 2, "eval_every": 1, "val_n": 8, "eval_batch": 8, "prompts_per_step": 2, "group": 2,
        "max_new_tokens": 16}


def graph_overrides(args, model: str, train: str, on_gpu: bool) -> list[str]:
    ppo = args.algo == "ppo"
    prompts = args.prompts_per_step * (args.group if ppo else 1)
    samples = prompts * (1 if ppo else args.group)
    reward_path, reward_function = REWARDS[args.reward]
    sets = [f"policy.path={model}", f"prompts.path={train}", f"reward.path={reward_path}",
            f"reward.function={reward_function}", f"prompts_per_step={prompts}", f"max_new_tokens={args.max_new_tokens}",
            f"learner.lr={args.lr}", f"learner.kl.coef={args.kl}", f"generator.temperature={args.temperature}",
            f"learner.minibatch_size={samples}", "max_staleness=0", f"save_interval={args.eval_every}",
            "keep_checkpoints=0", f"max_steps={args.steps}"]
    if ppo:
        # Micro-batches of 64 (gradient accumulation: the same update): colocated on one H200,
        # PPO's four model nodes get a quarter each, and the learner's forward over all 256
        # samples at once ran out of it (bench/results/smollm2_grpo_ppo_h200_2026-12-01.md).
        sets += [f"critic.minibatch_size={samples}", "learner.micro_batch_size=64", "critic.micro_batch_size=64"]
    else:
        # Group-normalised scores only, as TRL's scale_rewards="group" (the learner whitens them
        # again over tokens by default: issue 17, bug 1).
        sets += [f"group_size={args.group}", "learner.whiten_advantages=false"]
    if on_gpu:
        sets += ["placement=colocated", "num_gpus=1"]
    else:  # the decoder's CPU default is 32 prompts' slots of 1024 + new tokens: 3 GB of fp32 KV cache here
        sets += [f"generator.prompts_per_call={prompts}", "generator.max_prompt_tokens=128"]
    return sets + args.set


class CheckpointClock:
    """Watches <run>/checkpoints: how long each save took (step_k.tmp seen -> step_k committed); and
    <run>/metrics.jsonl: when each learner step's record appeared (`stepped`), the moment that step's
    weights existed, as a TrainerCallback's on_step_end stamps TRL's (a background save commits
    later)."""

    def __init__(self, run_dir: Path):
        # A run into the same --out as an earlier one: the driver truncates metrics.jsonl when it
        # starts, after this thread may have read the old file's length, so the offset would land
        # mid-line in the new one; and old step_k directories would read as this run's saves.
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        self.dir, self.began, self.saved, self.stepped = run_dir / "checkpoints", {}, {}, {}
        self.metrics, self._read = run_dir / "metrics.jsonl", 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _steps(self, now: float) -> None:
        try:
            with open(self.metrics, "rb") as f:
                f.seek(self._read)
                chunk = f.read()
        except OSError:
            return
        whole = chunk[:chunk.rfind(b"\n") + 1]      # a line being written waits for the next poll
        self._read += len(whole)
        for line in whole.splitlines():
            record = json.loads(line)
            if "step" in record and "timing/step_s" in record:
                self.stepped.setdefault(record["step"], now)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = time.time()
            self._steps(now)
            if not self.dir.is_dir():
                continue
            for p in self.dir.iterdir():
                name, _, suffix = p.name.partition(".")
                if not name.startswith("step_"):
                    continue
                step = int(name[5:])
                if suffix == "tmp":
                    self.began.setdefault(step, now)
                elif suffix == "" and (p / "manifest.json").is_file():
                    self.saved.setdefault(step, now)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def save_s(self, step: int) -> float:
        return self.saved[step] - self.began.get(step, self.saved[step])


def keep_actor_logs(dst: Path, session: Path = Path("/tmp/ray/session_latest/logs")) -> None:
    """The actors' stderr (Ray's worker-*.err, non-empty ones) into one small archive: what the
    nodes print there (TORCH_LOGS=recompiles, warnings) is not in the driver's log, and the device
    machine returns a handful of files per call."""
    import tarfile

    files = sorted(f for f in session.glob("worker-*.err") if f.stat().st_size > 0) if session.is_dir() else []
    if files:
        with tarfile.open(dst, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=f.name)


def render_prompts(model_dir: str, src: str, dst: Path) -> str:
    """A copy of the JSONL `src` whose chat prompts are rendered with the model's template."""
    from transformers import AutoTokenizer
    from examples.smollm2_arithmetic import heldout
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    with open(src) as f, open(dst, "w") as out:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out.write(json.dumps({**row, "prompt": heldout.render(tokenizer, row["prompt"])}) + "\n")
    return str(dst)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algo", choices=("grpo", "ppo"), default="grpo")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more graph settings")
    p.add_argument("--trace", action="store_true", help="write trace.json and the idle report (item 7)")
    p.add_argument("--no-eval", action="store_true",
                   help="stop after the run's report, without the held-out judging (start-up measurements)")
    p.add_argument("--render-prompts", action="store_true",
                   help="train on a copy of the data with the chat template rendered into string prompts "
                        "(for an engine without chat-prompt support, before issue 17's prompts land)")
    add_common_args(p, TINY)
    args = p.parse_args()
    apply_tiny(args)
    import torch
    from dataflow.actor import checkpoint
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph

    on_gpu = torch.cuda.is_available() and not args.tiny
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    model, train, val = prepare(args, args.algo)
    if args.render_prompts:
        train = render_prompts(model, train, out / "train_rendered.jsonl")
    t_ready = time.time()   # model and data exist: the clock of the run starts here
    sets = graph_overrides(args, model, train, on_gpu)
    log(args.algo, "graph settings: " + " ".join(sets))
    t_load = time.time()
    graph, config = load_graph(str(ROOT / "graphs" / f"{args.algo}.py"), sets)
    log(args.algo, f"graph loaded in {time.time() - t_load:.1f} s")
    run_dir = out / "run"
    clock = CheckpointClock(run_dir)
    options = RunOptions(max_steps=args.steps, out_dir=str(run_dir), quiet=False,
                         trace_path=str(out / "trace.json") if args.trace else None)
    t_run = time.time()
    with GpuMemory() as memory:
        summary = asyncio.run(run_graph(graph, options, config))
    t_end = time.time()
    clock.stop()
    log(args.algo, f"run {summary.status}: {summary.steps} steps in {summary.seconds:.1f} s")
    keep_actor_logs(out / "actor_logs.tgz")
    records = [json.loads(line) for line in Path(summary.metrics_path).read_text().splitlines()]
    steps = {r["step"]: r for r in records if "step" in r}
    # The step records' time_s counts from the graph running (after start-up); start-up = the
    # rest of the run's seconds, plus Ray's start (before the run's own clock) and the graph's
    # loading: the wall clock starts when the model and data exist, as bench/real_trl.py's does.
    last = max(steps)
    startup_s = (t_run - t_ready) + (summary.startup or {}).get("ray", 0.0) + summary.seconds - steps[last]["time_s"]
    log(args.algo, f"start-up {startup_s:.1f} s (graph load, Ray, actors, models), then {steps[last]['time_s']:.1f} s of steps")
    log(args.algo, f"start-up parts, s: {summary.startup}")
    if args.no_eval:
        print(summary.report)
        return 0

    evaluate = Evaluator(model, val, args.val_n, args.eval_batch, args.max_new_tokens,
                         "cuda" if on_gpu else "cpu")
    lora = config.learner.lora
    lora_scaling = lora.alpha / lora.rank if lora.rank else 0.0
    points = [{"step": 0, "wall_s": 0.0, "train_s": 0.0, **eval_fields(evaluate())}]
    log(args.algo, f"step 0 (base model): accuracy {points[0]['accuracy']:.3f}")
    saves_so_far = 0.0
    for step in sorted(clock.saved):
        ckpt = checkpoint.step_dir(run_dir, step)
        state = checkpoint.read_state(checkpoint.replica_state_dir(ckpt, "learner"))["node"]["model"]
        saves_so_far += clock.save_s(step)
        wall = startup_s + steps[step]["time_s"] if step in steps else float("nan")
        points.append({"step": step, "wall_s": wall, "train_s": wall - saves_so_far, "save_s": clock.save_s(step),
                       **eval_fields(evaluate(state, lora_scaling))})
        log(args.algo, f"step {step}: accuracy {points[-1]['accuracy']:.3f} at {wall:.1f} s")
    samples = [r["perf/samples_per_s"] * r["timing/step_s"] for r in steps.values()]
    tokens = sum(r["response_length/mean"] * n for r, n in zip(steps.values(), samples))
    extra = {"engine": "dataflow", "algo": args.algo, "steps": last, "status": summary.status,
             "startup_s": startup_s, "startup": summary.startup, "run_s": summary.seconds, "prepare_s": t_ready - t_start,
             "checkpoint_save_s": sum(clock.save_s(s) for s in clock.saved),
             "response_tokens_per_s": tokens / max(steps[last]["time_s"], 1e-9),
             "peak_gpu_mem_mib": memory.peak_mib, "settings": sets, "script_s": t_end - t_start,
             "reward_by_step": {s: r["reward/mean"] for s, r in steps.items()},
             "length_by_step": {s: r["response_length/mean"] for s, r in steps.items()},
             "idle_report": summary.report}
    write_curve(out, f"dataflow {args.algo}", points, extra)
    log(args.algo, f"wrote {out}/curve.json, curve.md, curve.png")
    print(summary.report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
