"""GRPO, Dr.GRPO, DAPO, RLOO and PPO on SmolLM2-135M-Instruct and the arithmetic task on one GPU,
with held-out accuracy every --val-every steps (issue 20, item 8). One run at a time by
default (--max-concurrent): split the variants over calls, e.g. --variants grpo,dr_grpo,rloo then
--variants dapo,ppo, each within a 600 s call.

    python3 bench/real_variants.py --model-dir /tmp/real/smollm2 --data /tmp/real/arithmetic \
        --variants grpo,dr_grpo,rloo --out OUT/variants    # one H200, one run after another
    ... --seeds 1 --out OUT/variants_s1                                     # the second seed, another call
    python3 bench/real_variants.py --table OUT/variants OUT/variants_s1    # one table of both
    python3 bench/real_variants.py --tiny --out /tmp/variants_tiny         # CPU smoke, one run at a time

Each (variant, seed) is its own `python -m dataflow.run` process with its own local Ray instance
(ray.init without an address starts a new one; only `ray start` records a cluster for others to
join), all started together and sharing the one GPU through gpu_shares: --gpu-fraction of the GPU
(default 0.9; the rest is the processes' CUDA contexts) is split evenly over the concurrent runs and,
inside a run, over its model nodes by SHARES. The settings are bench/real_rl.py's (graph_overrides:
32 prompts x 8 responses = 256 samples per step, PPO 256 prompts x 1; max_new_tokens 128, lr 5e-6,
temperature 1, KL 0, one optimizer step per step, max_staleness 0, colocated on GPU 0), with
micro-batches sized to the smaller shares, no checkpoints and no final weights. Held-out accuracy
is the built-in validation (val.path = the 500 val problems, greedy, val.n=0), scored by --reward
(examples/smollm2_arithmetic/last_number_reward.py: the last number of the response, examples/smollm2_arithmetic/heldout.py's judge), before
the first step and every --val-every steps; max_steps is --steps + 1 so that the weights after
step --steps are validated too (the run ends at its last step without publishing them).

Variants (VARIANTS; docs/algorithms.md): grpo (group mean / std), dr_grpo (group mean only, loss
over a constant: seq-mean-token-sum-norm), dapo (graphs/dapo.py's dynamic sampling + clip-higher
0.2 / 0.28 + overlong shaping over the last --overlong-buffer tokens + truncated responses masked),
rloo (leave-one-out baseline), ppo (graphs/ppo.py, the critic from the same checkpoint, GAE).
LoRA against full fine-tuning (issue 37 item 5; not in the default list): lora32 and lora1 are grpo
with `learner.lora.rank` 32 / 1 (alpha 32, every linear layer) at --lora-lr, by default 10x --lr:
LoRA's best learning rate is about ten times full fine-tuning's ("LoRA Without Regret", TRL docs).

--budget-s: when it runs out, every run still going gets SIGTERM (it stops like Ctrl-C: its
metrics so far are kept) and the table shows the rounds it reported. Writes OUT/<variant>-s<seed>/
(log.txt, run/metrics.jsonl, run/config.json), OUT/results.json and OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_common import ROOT, GpuMemory, add_common_args, apply_tiny, log, prepare  # noqa: E402
from real_rl import TINY, graph_overrides  # noqa: E402

# name -> (graph file, its algo in real_rl.graph_overrides, extra settings)
VARIANTS: dict[str, tuple[str, str, list[str]]] = {
    "grpo": ("grpo", "grpo", []),
    "dr_grpo": ("grpo", "grpo", ["learner.advantage=dr_grpo"]),
    "dapo": ("dapo", "grpo", ["learner.clip_eps_low=0.2", "learner.clip_eps_high=0.28", "learner.mask_truncated=true"]),
    "rloo": ("grpo", "grpo", ["learner.advantage=rloo"]),
    "ppo": ("ppo", "ppo", []),
    "lora32": ("grpo", "grpo", ["learner.lora.rank=32"]),
    "lora1": ("grpo", "grpo", ["learner.lora.rank=1"]),
}
ALGORITHM_VARIANTS = ["grpo", "dr_grpo", "dapo", "rloo", "ppo"]   # the default --variants
# A run's share of the GPU, split over its model nodes (the learner holds fp32 weights, AdamW and
# the activations of a micro-batch; the generator bf16 weights and the KV cache of 256 slots).
SHARES = {"grpo": {"learner": 0.5, "generator": 0.3, "reference": 0.2},
          "ppo": {"learner": 0.35, "critic": 0.3, "generator": 0.2, "reference": 0.15}}
MICRO_BATCH = {"grpo": 32, "ppo": 16}   # learner (and critic) rows per forward/backward pass


def run_settings(args, name: str, seed: int, model: str, train: str, val: str, on_gpu: bool,
                 share: float, shared: bool = True) -> tuple[str, list[str]]:
    """(graph file, --set list) of one run. `shared`: other runs share the GPU at the same time,
    so micro-batches are sized down to this run's share (MICRO_BATCH); alone, a run keeps the
    nodes' own micro-batch sizing, as bench/real_rl.py: the shared sizes made a lone GRPO run much
    slower per step (bench/results/variants_smollm2_h200_2026-12-02a.md)."""
    graph, algo, extra = VARIANTS[name]
    base = SimpleNamespace(algo=algo, prompts_per_step=args.prompts_per_step, group=args.group,
                           max_new_tokens=args.max_new_tokens, lr=args.lr, kl=args.kl,
                           temperature=args.temperature, eval_every=args.val_every, steps=args.steps + 1, set=[],
                           reward=args.reward)
    sets = graph_overrides(base, model, train, on_gpu)
    kind = "ppo" if algo == "ppo" else "grpo"
    mb = MICRO_BATCH[kind] if on_gpu and shared else 0
    sets += ["save_interval=0", "learner.save_final=false",
             f"val.path={val}", f"val.every={args.val_every}", "val.n=0",
             *seed_settings(seed)]
    if args.val_n:
        sets.append(f"val.max_prompts={args.val_n}")
    if mb:
        sets += [f"learner.micro_batch_size={mb}", f"reference.micro_batch_size={2 * mb}"]
        if kind == "ppo":
            sets.append(f"critic.micro_batch_size={mb}")
    if on_gpu:
        # With --kl 0 the graph runs no reference (graphs/rlhf.py use_reference): its part goes to the others.
        fracs = {node: f for node, f in SHARES[kind].items() if node != "reference" or args.kl > 0}
        shares = {node: round(share * f / sum(fracs.values()), 4) for node, f in fracs.items()}
        sets += ["prompts.max_prompt_tokens=128", "gpu_shares=" + json.dumps(shares, separators=(",", ":"))]
    if name == "dapo":
        sets.append(f"learner.overlong_buffer={max(1, min(args.overlong_buffer, args.max_new_tokens // 4))}")
        if args.tiny:   # groups of 2 of 16 tokens from the base model are nearly all wrong: refill until 2 differ
            sets.append("filter.max_num_gen_batches=0")
    if name.startswith("lora"):
        extra = extra + [f"learner.lr={args.lora_lr or 10 * args.lr}"]
    sets += extra + args.set
    return str(ROOT / "graphs" / f"{graph}.py"), sets


def seed_settings(seed: int) -> list[str]:
    """The seed of the sampling noise, the prompt order and the learner's / critic's RNG."""
    return ["prompts.shuffle=true", f"prompts.seed={seed}", f"generator.seed={seed}",
            f"learner.seed={seed}", f"critic.seed={seed}"]


def read_run(run_dir: Path) -> dict:
    """What one run reported: validation rounds, steps, start-up, status (from its log)."""
    metrics = run_dir / "run" / "metrics.jsonl"
    records = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()] if metrics.is_file() else []
    val = {int(r["val/step"]): r["val/mean@1"] for r in records if "val/step" in r and "val/mean@1" in r}
    steps = [r for r in records if "step" in r]
    text = (run_dir / "log.txt").read_text(errors="replace") if (run_dir / "log.txt").is_file() else ""
    startup = re.search(r"start-up ([\d.]+) s", text)
    step_s = [r["timing/step_s"] for r in steps[1:]]
    info = json.loads((run_dir / "info.json").read_text()) if (run_dir / "info.json").is_file() else {}
    return {**info, "val": val, "steps": len(steps), "startup_s": float(startup.group(1)) if startup else None,
            "median_step_s": statistics.median(step_s) if step_s else None,
            "train_reward_last": steps[-1]["reward/mean"] if steps else None,
            "response_length_last": steps[-1]["response_length/mean"] if steps else None,
            "filter_prompts": sum(r["filter/prompts_per_step"] for r in records if "filter/batch" in r) or None}


def table(results: list[dict]) -> str:
    val_steps = sorted({s for r in results for s in r["val"]})
    head = ["variant", "seed", *[f"step {s}" for s in val_steps], "final", "steps", "wall s", "start-up s",
            "median s/step", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(results, key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"])):
        final = r["val"][max(r["val"])] if r["val"] else None
        cells = [r["variant"], str(r["seed"]), *[f"{r['val'][s]:.3f}" if s in r["val"] else "-" for s in val_steps],
                 f"{final:.3f}" if final is not None else "-", str(r["steps"]),
                 f"{r['wall_s']:.0f}" if r.get("wall_s") else "-",
                 f"{r['startup_s']:.0f}" if r.get("startup_s") else "-",
                 f"{r['median_step_s']:.2f}" if r.get("median_step_s") else "-", r.get("status", "?")]
        lines.append("| " + " | ".join(cells) + " |")
    by_variant = {}
    for r in results:
        if r["val"]:
            by_variant.setdefault(r["variant"], []).append(r["val"][max(r["val"])])
    if any(len(v) > 1 for v in by_variant.values()):
        lines += ["", "| variant | final held-out, mean ± sd over its runs (each) |", "|---|---|"]
        for name, v in by_variant.items():
            sd = f" ± {statistics.stdev(v):.3f}" if len(v) > 1 else ""
            lines.append(f"| {name} | {statistics.mean(v):.3f}{sd} ({', '.join(f'{x:.3f}' for x in v)}) |")
    return "\n".join(lines)


def warming_ready(run_dir: Path) -> bool:
    """The run printed its start-up line (its nodes are set up, graphs compiled), or it ended."""
    text = (run_dir / "log.txt").read_text(errors="replace") if (run_dir / "log.txt").is_file() else ""
    return "start-up" in text or "[dataflow] node" in text or (run_dir / "info.json").is_file()


def launch(args, runs: list[tuple[str, int]], model: str, train: str, val: str, on_gpu: bool, out: Path) -> list[dict]:
    concurrent = args.max_concurrent or len(runs)
    share = args.gpu_fraction / concurrent
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH", ""), str(ROOT)] if p)
    env.pop("RAY_ADDRESS", None)   # each run starts a Ray instance of its own
    # Several runs on one machine: each Ray instance's object store would claim 30% of the RAM (the
    # weights travel by CUDA IPC on one GPU: it holds little here), and each process compiling its
    # layers would start a pool of cpu_count inductor workers.
    env.setdefault("RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION", str(round(0.25 / concurrent, 3)))
    # one run at a time: each finds the earlier runs' graphs in the shared cache anyway, and PPO (the
    # slowest per step) first would take most of a call's budget
    # (bench/results/variants_smollm2_h200_2026-12-02a.md)
    warm = args.warm_first if args.warm_first is not None else on_gpu and concurrent > 1
    pending, active, done = list(runs), {}, []
    if warm:   # PPO first: its start-up compiles the most graphs (generator, reference, learner, critic)
        pending.sort(key=lambda r: r[0] != "ppo")
    first_env = dict(env)
    if concurrent > 1:   # several processes compiling at once: one inductor worker each, not cpu_count
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    deadline = time.time() + args.budget_s
    last_report = 0.0
    warming, warm_until = None, 0.0   # the run dir whose start-up the others wait for (its compiles fill the cache)
    while pending or active:
        if warming is not None and (warming_ready(warming) or time.time() > warm_until):
            log("variants", f"{warming.name} is running (or {args.warm_timeout_s:.0f} s passed): starting the others")
            warming = None
        while pending and len(active) < concurrent and time.time() < deadline and warming is None:
            name, seed = pending.pop(0)
            run_dir = out / f"{name}-s{seed}"
            run_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(run_dir / "run", ignore_errors=True)   # a rerun: the CLI refuses an earlier run's directory
            graph, sets = run_settings(args, name, seed, model, train, val, on_gpu, share, concurrent > 1)
            cmd = [sys.executable, "-m", "dataflow.run", graph, "--out", str(run_dir / "run"),
                   "--max-steps", str(args.steps + 1), *[x for s in sets for x in ("--set", s)]]
            (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
            logf = open(run_dir / "log.txt", "w")
            first = warm and not active and not done and len(pending) + 1 == len(runs)
            proc = subprocess.Popen(cmd, cwd=str(ROOT), env=first_env if first else env, stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True)   # a SIGTERM for it alone
            active[proc.pid] = (proc, name, seed, run_dir, time.time(), logf, False)
            log("variants", f"started {name} seed {seed} (pid {proc.pid}): {graph} " + " ".join(sets))
            if first and pending:
                warming, warm_until = run_dir, time.time() + args.warm_timeout_s
                log("variants", f"waiting for {name} seed {seed} to finish its start-up (compiles) before the others")
            elif pending and len(active) < concurrent:
                time.sleep(args.stagger_s)
        for pid, (proc, name, seed, run_dir, t0, logf, stopped) in list(active.items()):
            rc = proc.poll()
            if rc is None:
                if time.time() > deadline and not stopped:
                    log("variants", f"budget ({args.budget_s:.0f} s) spent: stopping {name} seed {seed}")
                    proc.send_signal(signal.SIGTERM)
                    active[pid] = (proc, name, seed, run_dir, t0, logf, True)
                elif stopped and time.time() > deadline + args.stop_grace_s:
                    proc.kill()
                continue
            logf.close()
            del active[pid]
            status = {0: "done", 130: "stopped (budget)"}.get(rc, f"exit {rc}")
            info = {"variant": name, "seed": seed, "rc": rc, "status": status, "wall_s": time.time() - t0}
            (run_dir / "info.json").write_text(json.dumps(info))
            done.append(read_run(run_dir))
            log("variants", f"{name} seed {seed}: {status} after {info['wall_s']:.0f} s, held-out {done[-1]['val']}")
        if pending and time.time() >= deadline and not active:
            log("variants", f"budget spent: not started: {pending}")
            break
        if time.time() - last_report > args.report_every_s:
            last_report = time.time()
            for proc, name, seed, run_dir, t0, _, _ in active.values():
                r = read_run(run_dir)
                log("variants", f"  {name} s{seed}: {r['steps']} steps, held-out {r['val']}, {time.time() - t0:.0f} s")
        time.sleep(1.0)
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="", help="the converted model dir (as --model)")
    p.add_argument("--variants", default=",".join(ALGORITHM_VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--lora-lr", type=float, default=0.0, help="the lora variants' learning rate (0 = 10x --lr)")
    p.add_argument("--seeds", default="0", help="comma-separated; every (variant, seed) runs at once")
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--overlong-buffer", type=int, default=32, help="dapo: tokens before the cap where the penalty grows")
    p.add_argument("--gpu-fraction", type=float, default=0.9, help="of the GPU, split over the concurrent runs")
    p.add_argument("--max-concurrent", type=int, default=1,
                   help="runs at once (0 = all). 1: five at once on one H200 ran several times slower per "
                        "step than one alone, too slow to learn in one call's budget "
                        "(bench/results/variants_smollm2_h200_2026-12-01.md)")
    p.add_argument("--budget-s", type=float, default=500.0,
                   help="seconds from the first start; then SIGTERM to the runs still going")
    p.add_argument("--stagger-s", type=float, default=2.0, help="between two starts")
    p.add_argument("--warm-first", action=argparse.BooleanOptionalAction, default=None,
                   help="start one run (PPO) alone and the others once it has started up, so that they "
                        "find its compiled graphs in the inductor cache instead of compiling them all at "
                        "once (default: on a GPU, with more than one run at a time)")
    p.add_argument("--warm-timeout-s", type=float, default=240.0, help="the longest the others wait for it")
    p.add_argument("--stop-grace-s", type=float, default=45.0)
    p.add_argument("--report-every-s", type=float, default=30.0)
    p.add_argument("--table", nargs="+", metavar="OUT", help="print one table of these output dirs, run nothing")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more settings, every run")
    add_common_args(p, {**TINY, "val_n": 4, "val_every": 1})
    p.set_defaults(steps=80, lr=5e-6, out="")
    if "--table" in sys.argv:   # --out is not needed then
        for a in p._actions:
            if a.dest == "out":
                a.required = False
    args = p.parse_args()
    if args.table:
        results = [read_run(d) for o in args.table for d in sorted(Path(o).iterdir()) if (d / "info.json").is_file()]
        print(table(results))
        return 0
    apply_tiny(args)
    if args.tiny and args.budget_s == p.get_default("budget_s"):   # CPU start-ups take minutes
        args.budget_s = 1800.0
    args.model = args.model or args.model_dir
    import torch
    on_gpu = torch.cuda.is_available() and not args.tiny
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.variants.split(",") if n]
    if set(names) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(set(names) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    runs = [(n, int(s)) for s in args.seeds.split(",") for n in names]
    model, train, val = prepare(args, "variants")
    t0 = time.time()
    with GpuMemory() as memory:
        results = launch(args, runs, model, train, val, on_gpu, out)
    summary = {"runs": results, "wall_s": time.time() - t0, "peak_gpu_mem_mib": memory.peak_mib,
               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "args": {k: v for k, v in vars(args).items() if k != "_tiny"}}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    print(f"\nheld-out greedy accuracy (val/mean@1, {args.val_n or 'all'} problems) by step; "
          f"{len(runs)} runs, {args.max_concurrent or len(runs)} at once, {summary['wall_s']:.0f} s in all, "
          f"peak GPU memory {memory.peak_mib} MiB (all processes)")
    print(text)
    return 0 if all(r.get("rc") == 0 for r in results) and len(results) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
