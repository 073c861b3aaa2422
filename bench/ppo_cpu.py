"""Side-by-side runs of the built-in task in one invocation on one Ray instance (CPU).

    python bench/ppo_cpu.py [--graph graphs/ppo.py] [--target 0.8] [--max-steps 300] [--set k=v ...]
    python bench/ppo_cpu.py --compare algorithms --set prompts.num_digits=3   # PPO vs GRPO
    python bench/ppo_cpu.py --compare variants --set prompts.num_digits=3 --max-steps 200 \
        --seeds 0,1 --out bench/results/variants_cpu.jsonl                   # every algorithm, 2 seeds

--compare modes (default): the same graph with max_staleness=0 (synchronous on-policy, the
baseline) and max_staleness=N (asynchronous). --compare algorithms: graphs/ppo.py vs
graphs/grpo.py with the same settings and samples per step. Prints, for each run, the wall time
until the step mean reward first reaches --target, steps, samples/s, and the ratio of the two.

--compare variants: each named variant of VARIANTS (a graph file + settings; docs/algorithms.md)
for every seed of --seeds (policy init, prompt stream, sampling noise and learner/critic RNG all
from the seed), always --max-steps steps (--target only measures, it does not stop the run).
Every variant sees 256 samples per training step. Per run: the first step whose policy reward
reaches --target and its time (from the graph running; start-up excluded), the samples generated
until then, and the final reward (mean of the last 10 steps). The policy reward is the learner's
step mean reward, except under dynamic sampling (graphs/dapo.py), where the learner only sees the
groups the filter kept (biased low once many groups are all right): there it is the mean score of
one response of every prompt generated for the step, kept or dropped (the reward node's rollout
records, reward.rollouts_every=1). Each run appends a JSON line to --out as it ends, so a long
sweep can be split (--variants, --seeds) and resumed; the table is printed from everything in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

GRPO, DAPO, PPO = "graphs/grpo.py", "graphs/dapo.py", "graphs/ppo.py"
GROUPS = ["prompts_per_step=32", "group_size=8"]   # 256 samples per step
# name -> (graph, settings). The learner's defaults otherwise (lr 1e-3, clip 0.2, KL k3 0.01 in the
# loss, token-mean, minibatches of 128, max_staleness 1).
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "grpo": (GRPO, GROUPS),
    "dr_grpo": (GRPO, GROUPS + ["learner.advantage=dr_grpo"]),   # auto loss_agg seq-mean-token-sum-norm
    # clip-higher + dynamic sampling (the filter graph) + overlong shaping and filtering. The task's
    # cap is exactly answer + <eos> (4 tokens), where any buffer would penalise a right answer:
    # DAPO gets 2 more tokens of room, penalised linearly (5 tokens -0.5, 6 -1, and cut ones masked).
    "dapo": (DAPO, GROUPS + ["learner.clip_eps_low=0.2", "learner.clip_eps_high=0.28", "max_new_tokens=6",
                             "learner.overlong_buffer=2", "learner.mask_truncated=true"]),
    "dapo_no_overlong": (DAPO, GROUPS + ["learner.clip_eps_low=0.2", "learner.clip_eps_high=0.28"]),
    "rloo": (GRPO, GROUPS + ["learner.advantage=rloo"]),
    # REINFORCE++ on the task's per-position token rewards, KL per token in the reward
    "reinforce_pp": (GRPO, GROUPS + ["learner.advantage=reinforce_pp", "learner.kl.placement=reward"]),
    # ... and with the score on the last token only (an outcome reward, as a user's reward function
    # gives): whitening returns over the batch's tokens ranks late positions low under per-position credit
    "reinforce_pp_outcome": (GRPO, GROUPS + ["learner.advantage=reinforce_pp", "learner.kl.placement=reward",
                                             "reward.per_token=false"]),
    # GSPO with the paper's clip range (auto loss_agg seq-mean-token-mean)
    "gspo": (GRPO, GROUPS + ["learner.policy_loss=gspo", "learner.clip_eps_low=0.0003", "learner.clip_eps_high=0.0004"]),
    "gspo_clip0.2": (GRPO, GROUPS + ["learner.policy_loss=gspo"]),
    "ppo": (PPO, ["prompts_per_step=256", "generator.prompts_per_call=256"]),   # 256 decoder slots, as GRPO's 32 x 8
}
DEFAULT_VARIANTS = "grpo,dr_grpo,dapo,rloo,reinforce_pp,gspo,ppo"


def seed_settings(seed: int) -> list[str]:
    return [f"{k}={seed}" for k in ("policy.model.seed", "prompts.seed", "generator.seed", "learner.seed", "critic.seed")]


def run_once(graph_file: str, overrides: list[str], max_steps: int, out_dir: str, keep_going: bool = False) -> dict:
    """One run's step records (and all records, rollouts). keep_going: a run that fails part way
    (e.g. a group filter that cannot fill a batch once nearly every group is all right) returns
    the steps it made, its status naming the error."""
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph

    graph, config = load_graph(graph_file, overrides)
    t0 = time.time()
    try:
        summary = asyncio.run(run_graph(graph, RunOptions(max_steps=max_steps, out_dir=out_dir, quiet=True), config))
        metrics_path, status = Path(summary.metrics_path), summary.status
    except Exception as e:
        found = sorted(Path(out_dir).glob("**/metrics.jsonl"))
        if not keep_going or not found:
            raise
        metrics_path, status = found[0], f"stopped: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    records = [json.loads(l) for l in metrics_path.read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    rollouts_file = metrics_path.parent / "rollouts.jsonl"
    rollouts = [json.loads(l) for l in rollouts_file.read_text().splitlines()] if rollouts_file.is_file() else []
    return {"wall_s": time.time() - t0, "steps": steps, "records": records, "rollouts": rollouts,
            "status": status}


def summarize(name: str, result: dict, target: float) -> dict:
    steps = result["steps"]
    reached = next((r for r in steps if r["reward/mean"] >= target), None)
    samples = sum(r["perf/samples_per_s"] * r["timing/step_s"] for r in steps)
    train_s = steps[-1]["time_s"] - steps[0]["time_s"] + steps[0]["timing/step_s"] if steps else float("nan")
    return {"mode": name, "steps": len(steps), "final_reward": steps[-1]["reward/mean"] if steps else float("nan"),
            "time_to_target_s": reached["time_s"] if reached else float("nan"),
            "step_to_target": reached["step"] if reached else None,
            "samples_per_s": samples / train_s if steps else float("nan"), "wall_s": result["wall_s"]}


def policy_rewards(result: dict) -> dict[int, float]:
    """step -> the policy's mean reward on the step's samples. With a group filter, the learner's
    reward/mean covers the kept groups only: use the reward node's rollout rows (one response of
    every prompt it scored for the step, kept or dropped; reward.rollouts_every=1)."""
    steps = {r["step"]: r["reward/mean"] for r in result["steps"]}
    if not any("filter/batch" in r for r in result["records"]):
        return steps
    by_step: dict[int, list[float]] = {}
    for row in result["rollouts"]:
        if row.get("kind") == "train":
            by_step.setdefault(row["step"], []).append(row["reward"])
    return {s: sum(v) / len(v) for s, v in by_step.items() if s in steps}


def summarize_variant(name: str, seed: int, result: dict, target: float, overrides: list[str]) -> dict:
    steps = result["steps"]
    reward = policy_rewards(result)
    order = sorted(reward)
    reached = next((s for s in order if reward[s] >= target), None)
    by_step = {r["step"]: r for r in steps}
    filtered = [r for r in result["records"] if "filter/batch" in r]
    group = next((int(o.split("=")[1]) for o in overrides if o.startswith("group_size=")), 1)
    generated = {}   # step -> samples generated for steps 1..step
    total = 0.0
    for s in sorted(by_step):
        r = by_step[s]
        f = next((x for x in filtered if x["filter/batch"] == s - 1), None)
        total += f["filter/prompts_per_step"] * group if f else r["perf/samples_per_s"] * r["timing/step_s"]
        generated[s] = total
    last = order[-10:]
    return {"variant": name, "seed": seed, "status": result["status"], "steps": len(steps),
            "step_to_target": reached, "time_to_target_s": by_step[reached]["time_s"] if reached else None,
            "samples_to_target": generated.get(reached) if reached else None,
            "final_reward": sum(reward[s] for s in last) / len(last) if last else None,
            "learner_final_reward": (sum(r["reward/mean"] for r in steps[-10:]) / len(steps[-10:])) if steps else None,
            "train_s": steps[-1]["time_s"] if steps else None, "wall_s": result["wall_s"],
            "samples_generated": total, "reward_by_step": reward, "settings": overrides,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def _fmt(values: list, spec: str, none: str = "-") -> str:
    """mean ± sd (n) of the values that exist, and how many runs did not reach it."""
    got = [v for v in values if v is not None]
    if not got:
        return f"not reached ({len(values)} runs)"
    text = format(statistics.mean(got), spec)
    if len(got) > 1:
        text += " ± " + format(statistics.stdev(got), spec)
    text += " (" + ", ".join(format(v, spec) if v is not None else none for v in values) + ")"
    return text


def print_variant_table(rows: list[dict], target: float, max_steps: int) -> None:
    names = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"\n| variant | runs | first step >= {target} | time to {target} (s) | samples to {target} (k) | "
          f"final reward (last 10 of {max_steps} steps) | train s |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        rs = sorted((r for r in rows if r["variant"] == name), key=lambda r: r["seed"])
        samples = [r["samples_to_target"] / 1000 if r["samples_to_target"] else None for r in rs]
        print(f"| {name} | {len(rs)} (seeds {','.join(str(r['seed']) for r in rs)}) | "
              f"{_fmt([r['step_to_target'] for r in rs], '.0f')} | {_fmt([r['time_to_target_s'] for r in rs], '.1f')} | "
              f"{_fmt(samples, '.1f')} | {_fmt([r['final_reward'] for r in rs], '.3f')} | "
              f"{_fmt([r['train_s'] for r in rs], '.0f')} |")
    print("(mean ± sd over seeds, then each seed's value; '-' = that seed did not reach the target)")


def compare_variants(args) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s != ""]
    done = set()
    if out.is_file():
        done = {(r["variant"], r["seed"]) for r in map(json.loads, out.read_text().splitlines())
                if r.get("target") == args.target and r.get("steps")}   # a failed run is run again
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:        # seeds outer: a sweep cut short still has every variant once
            for name in names:
                if (name, seed) in done:
                    print(f"{name} seed {seed}: in {out} already, skipped", flush=True)
                    continue
                graph_file, extra = VARIANTS[name]
                overrides = args.overrides + extra + seed_settings(seed)
                if graph_file == DAPO:
                    overrides += ["reward.rollouts_every=1", "reward.rollouts_per_step=100000"]
                t = time.time()
                try:
                    result = run_once(str(ROOT / graph_file), overrides, args.max_steps, f"{tmp}/{name}-{seed}",
                                      keep_going=True)
                except Exception as e:   # one failed run does not end the sweep: it is reported
                    print(f"{name} seed {seed}: FAILED after {time.time() - t:.0f} s: {type(e).__name__}: {e}", flush=True)
                    row = {"variant": name, "seed": seed, "status": f"error: {e}", "steps": 0}
                else:
                    row = summarize_variant(name, seed, result, args.target, overrides)
                row["target"] = args.target
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{name} seed {seed}: " + json.dumps({k: v for k, v in row.items() if k not in ("reward_by_step", "settings")}), flush=True)
    rows = [r for r in map(json.loads, out.read_text().splitlines())
            if r.get("target") == args.target and r.get("steps") and r["variant"] in names]
    print(f"\nsettings: {args.overrides}; {args.max_steps} steps; results in {out}")
    print_variant_table(rows, args.target, args.max_steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", default=str(ROOT / "graphs/ppo.py"))
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--async-staleness", type=int, default=1)
    p.add_argument("--compare", choices=("modes", "algorithms", "variants"), default="modes")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"--compare variants: of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="0,1", help="--compare variants: comma-separated seeds")
    p.add_argument("--out", default="variants_cpu.jsonl", help="--compare variants: one JSON line per run (appended)")
    p.add_argument("--table-only", action="store_true", help="--compare variants: print the table of --out, run nothing")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()

    if args.compare == "variants" and args.table_only:
        rows = [r for r in map(json.loads, Path(args.out).read_text().splitlines()) if r.get("target") == args.target and r.get("steps")]
        print_variant_table(rows, args.target, args.max_steps)
        return
    import ray

    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(4, os.cpu_count() or 1),
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    if args.compare == "variants":
        compare_variants(args)
        ray.shutdown()
        return
    if args.compare == "modes":
        runs = [("sync (max_staleness=0)", args.graph, ["max_staleness=0"]),
                (f"async (max_staleness={args.async_staleness})", args.graph, [f"max_staleness={args.async_staleness}"])]
    else:  # the same samples per step: 256 PPO samples = 32 prompts x 8 GRPO responses
        runs = [("ppo", str(ROOT / "graphs/ppo.py"), ["prompts_per_step=256"]),
                ("grpo (8 per prompt)", str(ROOT / "graphs/grpo.py"), ["prompts_per_step=32", "group_size=8"])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, graph_file, extra) in enumerate(runs):
            overrides = args.overrides + extra + [f"target_reward={args.target}"]
            result = run_once(graph_file, overrides, args.max_steps, f"{tmp}/{i}")
            rows.append(summarize(name, result, args.target))
            print(f"{name}: {rows[-1]}", flush=True)
    ray.shutdown()
    print(f"\nto reward {args.target} (time from the graph running; start-up excluded); settings: {args.overrides}")
    print(f"| mode | steps | final reward | time to {args.target} (s) | samples/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['steps']} | {r['final_reward']:.3f} | {r['time_to_target_s']:.1f} | {r['samples_per_s']:.0f} |")
    s, a = rows
    print(f"\n{a['mode']} / {s['mode']}: samples/s x{a['samples_per_s'] / s['samples_per_s']:.2f}, "
          f"time to target x{a['time_to_target_s'] / s['time_to_target_s']:.2f} (lower is better)")


if __name__ == "__main__":
    main()
