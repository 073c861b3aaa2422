"""A real model learns to use a tool / environment feedback (issue 36, item 6): GRPO over episodes
(graphs/agent.py) on SmolLM2-135M-Instruct, beside the same model trained single-turn without the
tool / feedback (graphs/grpo.py), both judged on held-out episodes by examples/agents/judge.py.

    python bench/real_agent.py --task calculator --out runs/agent_calc     # one H200
    python bench/real_agent.py --task guess --out runs/agent_guess
    python bench/real_agent.py --task guess --tiny --out /tmp/agent_tiny   # CPU smoke (minutes)

Tasks (examples/agents/README.md): calculator = 3-digit x 2-digit products with the calculator
tool as a typed function (env.tools=[calculator], env.reward=function: examples/agents/rewards.py
calculator_reward on the final answer); its baseline trains on the same products
asked without a tool, rewarded by calculator_reward. guess = the higher/lower game
(examples/agents/guess_env.py, env.reward=env: 1 for a win, + --guess-bonus for each wrong guess the
answers still allowed); its baseline trains on one guess
(rewards.py one_guess_reward). --variants agent,single picks the runs.

Each run saves a checkpoint every --eval-every steps; after the run, the base model (step 0) and
every checkpoint's learner weights are judged greedily on --val-n held-out rows: the agent run by
its episodes (judge.py), the baseline single-turn on its own rows. wall_s counts from the run's
start (start-up included) to the end of the step (its record in metrics.jsonl, as TRL's
on_step_end in real_trl_agent.py); saved_s to its checkpoint's commit, a background write that
can come many seconds later. Writes OUT/results.json, OUT/table.md,
OUT/curve.png and OUT/<variant>/ (run log, metrics). Model and data: --model / --work as
bench/real_rl.py (the data is written by examples/agents/tasks.py into WORK/agent_data).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples" / "agents"))

import judge as J  # noqa: E402
from gpu_step import log, run_logged  # noqa: E402
from real_common import plot_curves  # noqa: E402
from real_rl import CheckpointClock  # noqa: E402

REWARDS = str(ROOT / "examples" / "agents" / "rewards.py")
BASELINE = {"calculator": ("calculator_no_tool", "calculator_reward"), "guess": ("guess_one_shot", "one_guess_reward")}
TINY = {"steps": 2, "eval_every": 1, "val_n": 4, "prompts_per_step": 2, "group": 2, "max_turn_tokens": 12}


def agent_title(task: str) -> str:
    """The curve plots' title (the y axis says "accuracy": here it is held-out success)."""
    return f"SmolLM2-135M-Instruct, the {task} task, held-out success (greedy, judge.py)"


def prepare(args) -> tuple[str, Path]:
    """(model dir, data dir): SmolLM2 converted and the tasks written under --work when missing."""
    work = Path(args.work)
    model = args.model or str(work / "smollm2")
    if not (Path(model) / "model.safetensors").is_file():
        from examples.smollm2_arithmetic import smollm2
        log(f"converting SmolLM2-135M-Instruct into {model}")
        smollm2.convert(model, check=True, log=log)
    data = work / "agent_data"
    if not (data / "READY").is_file():
        import tasks
        tasks.write_all(str(data), seed=0, num_val=500, num_train=20000)
        (data / "READY").write_text("seed 0\n")
        log(f"wrote the agent tasks to {data}")
    return model, data


def graph_sets(args, variant: str, model: str, data: Path, on_gpu: bool) -> tuple[str, list[str]]:
    """(graph file, --set list) of one run."""
    task = J.TASKS[args.task]
    turn_tokens = args.max_turn_tokens or task["max_turn_tokens"]
    samples = args.prompts_per_step * args.group
    sets = [f"policy.path={model}", f"prompts_per_step={args.prompts_per_step}", f"group_size={args.group}",
            f"learner.lr={args.lr}", f"learner.kl.coef={args.kl}", f"generator.temperature={args.temperature}",
            f"learner.minibatch_size={samples}", "learner.whiten_advantages=false", f"max_staleness={args.staleness}",
            f"save_interval={args.eval_every}", "keep_checkpoints=0", f"max_steps={args.steps}",
            f"max_new_tokens={turn_tokens}"]
    if variant == "agent":
        graph = "agent.py"
        sets += [f"prompts.path={data / args.task / 'train.jsonl'}", f"env.path={task['path']}",
                 f"env.max_turns={task['max_turns']}", f"env.max_turn_tokens={turn_tokens}",
                 f"env.max_episode_tokens={task['max_episode_tokens']}"]
        if args.task == "calculator":   # the typed-function form; the answer's reward on the final message
            sets += ["env.tools=[calculator]", "env.reward=function", f"reward.path={REWARDS}",
                     "reward.function=calculator_reward"]
        else:   # the game's reward: 1 for a win + the bonus per wrong guess the answers still allowed
            sets += [f"env.name={task['name']}", "env.reward=env",
                     f'env.kwargs={{"consistent_bonus": {args.guess_bonus}}}']
    else:
        graph = "grpo.py"
        rows, function = BASELINE[args.task]
        sets += [f"prompts.path={data / rows / 'train.jsonl'}", f"reward.path={REWARDS}", f"reward.function={function}"]
    sets += ["placement=colocated", "num_gpus=1"] if on_gpu else \
        [f"generator.prompts_per_call={args.prompts_per_step}", "generator.max_prompt_tokens=512",
         "stall_action=warn"]   # a busy CPU can take minutes per step: report a stall, do not stop
    return str(ROOT / "graphs" / graph), sets + args.set


def run_variant(args, variant: str, model: str, data: Path, on_gpu: bool, out: Path) -> dict:
    vdir = out / variant
    vdir.mkdir(parents=True, exist_ok=True)
    graph, sets = graph_sets(args, variant, model, data, on_gpu)
    cmd = [sys.executable, "-m", "dataflow.run", graph, "--max-steps", str(args.steps), "--out", str(vdir / "run")]
    if args.trace:
        cmd += ["--trace", str(vdir / "trace.json.gz")]
    for s in sets:
        cmd += ["--set", s]
    clock = CheckpointClock(vdir / "run")
    log(f"{variant}: {' '.join(sets)}")
    t0 = time.time()
    rc = run_logged(cmd, vdir / "run.log", args.timeout, variant)
    clock.stop()
    log(f"{variant}: rc {rc} in {time.time() - t0:.0f} s")
    return {"variant": variant, "rc": rc, "run_s": time.time() - t0, "t0": t0, "saved": dict(clock.saved),
            "stepped": dict(clock.stepped), "run_dir": str(vdir / "run")}


def judge_run(args, run: dict, model: str, data: Path, device: str) -> list[dict]:
    """Held-out success of the base model and of every checkpoint of `run`."""
    from dataflow.actor import checkpoint
    single = run["variant"] == "single"
    rows_dir = BASELINE[args.task][0] if single else args.task
    rows = J.read_rows(str(data / rows_dir / "val.jsonl"), args.val_n)
    net, tokenizer = J.load_model(model, device)
    base = {k: v.clone() for k, v in net.state_dict().items()}
    points = []
    for step in [0] + sorted(run["saved"]):
        if step:
            ckpt = checkpoint.step_dir(run["run_dir"], step)
            state = checkpoint.read_state(checkpoint.replica_state_dir(ckpt, "learner"))["node"]["model"]
            state = {k.replace("_orig_mod.", ""): v for k, v in state.items()}
        else:
            state = base
        missing, unexpected = net.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"checkpoint {step} does not fit the model: {missing[:3]} {unexpected[:3]}")
        if net.config.tie_word_embeddings:
            net.tie_weights()
        result = J.judge(net, tokenizer, rows, args.task, single=single, batch=args.eval_batch)
        # when the step ended (its metrics record), as TRL's on_step_end; not when its checkpoint committed
        wall = run["stepped"].get(step, run["saved"][step]) - run["t0"] if step else 0.0
        saved = run["saved"][step] - run["t0"] if step else 0.0
        points.append({"step": step, "wall_s": wall, "saved_s": saved, "accuracy": result["success"], "success": result["success"],
                       "mean_turns": result["mean_turns"], "counters": result["counters"],
                       "example": result["examples"][0]})
        log(f"{run['variant']} step {step}: held-out success {result['success']:.3f} ({result['wins']}/{result['n']}) "
            f"at {wall:.0f} s")
    return points


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(J.TASKS), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="agent,single", help="agent (graphs/agent.py), single (the baseline)")
    p.add_argument("--model", default="", help="converted SmolLM2 dir (default: convert into --work)")
    p.add_argument("--work", default="/tmp/real")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--val-n", type=int, default=200, help="held-out rows judged per checkpoint")
    p.add_argument("--eval-batch", type=int, default=256)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-turn-tokens", type=int, default=0, help="0 = the task's (judge.TASKS)")
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--kl", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--staleness", type=int, default=1, help="max_staleness")
    p.add_argument("--guess-bonus", type=float, default=0.1,
                   help="guess: reward per wrong guess inside the range the answers leave (guess_env.py)")
    p.add_argument("--timeout", type=float, default=1200, help="per run, s")
    p.add_argument("--trace", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU smoke: " + ", ".join(f"{k}={v}" for k, v in TINY.items()))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more graph settings (both runs)")
    args = p.parse_args()
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    import torch
    on_gpu = torch.cuda.is_available() and not args.tiny
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, data = prepare(args)
    runs = [run_variant(args, v, model, data, on_gpu, out) for v in args.variants.split(",")]
    results = {"task": args.task, "settings": {k: v for k, v in vars(args).items() if k != "set"}, "sets": args.set,
               "runs": []}
    for run in runs:
        points = judge_run(args, run, model, data, "cuda" if on_gpu else "cpu") if run["saved"] or run["rc"] == 0 else []
        results["runs"].append({**{k: v for k, v in run.items() if k not in ("saved", "stepped")}, "points": points})
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    lines = [f"# {args.task}: held-out success (examples/agents/judge.py, greedy, {args.val_n} rows)", "",
             "| run | step | wall s | held-out success | mean turns |", "|---|---:|---:|---:|---:|"]
    for r in results["runs"]:
        for pt in r["points"]:
            lines.append(f"| {r['variant']} | {pt['step']} | {pt['wall_s']:.0f} | {pt['success']:.3f} | {pt['mean_turns']:.2f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    if any(r["points"] for r in results["runs"]):
        plot_curves(out / "curve.png", {r["variant"]: r["points"] for r in results["runs"] if r["points"]},
                    title=agent_title(args.task))
    print("\n".join(lines))
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
