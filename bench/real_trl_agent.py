"""TRL 1.16's GRPOTrainer on the two agent tasks, beside bench/real_agent.py (issue 36, item 6):
same model dir, data, environment files, reward and held-out judge.

    python bench/real_trl_agent.py --out runs/trl_agent_calc                  # one H200 (bf16 autocast)
    python bench/real_trl_agent.py --task guess --out runs/trl_agent_guess
    python bench/real_trl_agent.py --tiny --out /tmp/trl_agent_tiny           # CPU smoke

calculator: TRL's `tools=[examples/agents/calculator.calculator]` (ours: env.tools=[calculator]),
reward_funcs = examples/agents/rewards.calculator_reward on the last assistant message (0 when the
episode ends on a tool result), the data rows of examples/agents/tasks.py, the held-out judge
examples/agents/judge.py (greedy; after training, on weight snapshots taken every --eval-every
steps, the copy left out of train time).

guess: TRL's `rollout_func` (its hook for environments that are not tool calls: a gym-style game
answers plain text) plays each episode of examples/agents/guess_env.GuessingGame through rl/agent's
Episode runner, as judge.py does, sampling with TRL's own model at --temperature; it returns the
episode's ids with `env_mask` (0 on the game's tokens, as our loss mask) and the episode's reward
(a win, plus --guess-bonus per wrong guess the answers still allowed, as ours). TRL hands
rollout_func only the prompts, so each row's secret rides in its first message (key "secret",
which the chat template ignores).

What TRL needs for SmolLM2 on the calculator (whose template has no tools section and which TRL's
add_response_schema does not know): the tool listing is put into the rows' system message by
rl/agent/tools.system_message (the exact first prompt our engine renders); the tokenizer gets
TRL's Qwen3 response template (Hermes <tool_call>{json}</tool_call>, the same ChatML markers);
and a chat template that writes a tool result as ours does (a user turn of <tool_response> blocks,
rl/agent/tools.py), so both engines train on the same tokens. Left different: TRL caps the whole
completion (sampled + tool tokens) at max_completion_length = --max-turns x --max-turn-tokens + 64
and each generation at the same, where ours caps each turn at --max-turn-tokens (module
real_agent.py); TRL answers several calls of one turn in several user turns, ours in one.
Settings as bench/real_trl.py: --group generations per prompt, --prompts-per-step prompts, one
optimizer step per step, lr constant, beta --kl, loss "dapo", group-normalised advantages,
temperature --temperature (top_k 0, top_p 1), fp32 master weights under bf16 autocast.
Writes OUT/results.json, OUT/table.md, OUT/curve.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples" / "agents"))

import judge as J  # noqa: E402
from gpu_step import log  # noqa: E402
from real_agent import agent_title, prepare  # noqa: E402
from real_common import GpuMemory, plot_curves  # noqa: E402

TINY = {"steps": 2, "eval_every": 1, "val_n": 4, "prompts_per_step": 2, "group": 2, "max_turn_tokens": 12}

# SmolLM2's ChatML template, with tool messages written as rl/agent/tools.result_messages writes
# them for a template without tools (a user turn, the result inside <tool_response>), and an
# assistant message's parsed tool_calls written back in Hermes form (TRL refuses a template that
# drops them: trl.chat_template_utils.supports_tool_calling; the trained ids are the sampled ones).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant "
    "named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{% elif message['role'] == 'assistant' and message.tool_calls is defined and message.tool_calls %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}{% for call in message.tool_calls %}"
    "{{ '<tool_call>\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + call.function.arguments | tojson "
    "+ '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tool_rows(path: str) -> list[dict]:
    """The calculator rows with the tool listed in the system message, as our engine renders them."""
    from calculator import calculator
    from rl.agent import tools as T
    schemas = [T.tool_schema(calculator, "calculator.py")]
    rows = J.read_rows(path)
    return [{"prompt": T.system_message(schemas, r["prompt"]), "answer": r["answer"]} for r in rows]


def reward_for_trl(completions, answer, **kwargs):
    """rewards.calculator_reward on each episode's last assistant message, in TRL's batched form."""
    from rewards import calculator_reward
    scores = []
    for messages, a in zip(completions, answer):
        last = messages[-1] if isinstance(messages, list) else {"role": "assistant", "content": messages}
        ok = last.get("role") == "assistant" and not last.get("tool_calls")
        scores.append(calculator_reward("", last.get("content") or "", str(a)) if ok else 0.0)
    return scores


reward_for_trl.__name__ = "calculator_reward"


def guess_rows(path: str) -> list[dict]:
    """The guess rows, the secret in the first message (rollout_func sees only the prompts)."""
    return [{"prompt": [{**r["prompt"][0], "secret": int(r["secret"])}, *r["prompt"][1:]]} for r in J.read_rows(path)]


def guess_rollout(args, tokenizer, on_gpu: bool):
    """TRL's rollout_func for the guessing game: one episode per prompt (TRL repeats each prompt
    num_generations times), played with the trainer's model through rl/agent (judge.play)."""
    import torch
    settings = {**J.TASKS["guess"], "kwargs": {"consistent_bonus": args.guess_bonus}}

    def rollout(prompts, trainer):
        rows = [{"prompt": [{k: v for k, v in m.items() if k != "secret"} for m in p], "secret": p[0]["secret"]}
                for p in prompts]
        model = trainer.model
        training = model.training
        model.eval()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu):
            played = asyncio.run(J.play(model, tokenizer, rows, "guess", 1, args.temperature, len(rows), settings))
        model.train(training)
        return {"prompt_ids": [p["prompt_ids"] for p in played], "completion_ids": [p["response_ids"] for p in played],
                "logprobs": None, "env_mask": [p["loss_mask"] for p in played],
                "env_reward": [float(p["reward"] or 0.0) for p in played]}
    return rollout


def guess_reward(completions, env_reward, **kwargs):
    """The episode's own reward (rollout_func's env_reward): a win + the consistent-guess bonus."""
    return [float(r) for r in env_reward]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--task", choices=["calculator", "guess"], default="calculator")
    p.add_argument("--guess-bonus", type=float, default=0.1, help="guess: as bench/real_agent.py's")
    p.add_argument("--model", default="")
    p.add_argument("--work", default="/tmp/real")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--val-n", type=int, default=200)
    p.add_argument("--eval-batch", type=int, default=256)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=0, help="0 = the task's (judge.TASKS)")
    p.add_argument("--max-turn-tokens", type=int, default=0, help="0 = the task's (judge.TASKS)")
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--kl", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-wall", type=float, default=0, help="stop after this many seconds of training (0 = none)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke: " + ", ".join(f"{k}={v}" for k, v in TINY.items()))
    args = p.parse_args()
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    args.max_turns = args.max_turns or J.TASKS[args.task]["max_turns"]
    args.max_turn_tokens = args.max_turn_tokens or J.TASKS[args.task]["max_turn_tokens"]
    import pyarrow as pa
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl import chat_template_utils as ctu

    from calculator import calculator as calculator_tool

    on_gpu = torch.cuda.is_available() and not args.tiny
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    model_dir, data = prepare(args)
    t_ready = time.time()
    log(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, cuda {on_gpu}")
    completions = args.prompts_per_step * args.group
    calculator = args.task == "calculator"
    train = str(data / args.task / "train.jsonl")
    rows = tool_rows(train) if calculator else guess_rows(train)
    rows = (rows * (args.steps * args.prompts_per_step // len(rows) + 1))[:args.steps * args.prompts_per_step]
    dataset = Dataset(pa.Table.from_pylist(rows), fingerprint=f"agent-{args.task}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.padding_side = "left"
    if calculator:
        tokenizer.chat_template = CHAT_TEMPLATE
        if ctu._SUPPORTS_RESPONSE_TEMPLATE:
            tokenizer.response_template = ctu.qwen3_template
        else:
            tokenizer.response_schema = ctu.qwen3_schema
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0, beta=args.kl, epsilon=0.2, num_iterations=1,
        loss_type="dapo", scale_rewards="group", num_generations=args.group,
        per_device_train_batch_size=completions, gradient_accumulation_steps=1,
        max_completion_length=(args.max_turns * args.max_turn_tokens + 64 if calculator
                               else J.TASKS["guess"]["max_episode_tokens"]),
        max_tool_calling_iterations=args.max_turns - 1 if calculator else None,
        temperature=args.temperature, top_p=1.0, top_k=0, bf16=on_gpu, use_cpu=not on_gpu,
        logging_steps=1, save_strategy="no", report_to="none", log_completions=False, disable_dropout=True,
        dataloader_num_workers=0, shuffle_dataset=False, seed=0)

    stamps: dict[int, float] = {}
    snapshots: dict[int, dict] = {}
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
                snapshots[state.global_step] = {k: v.detach().to("cpu", copy=True) for k, v in kw["model"].state_dict().items()}
                snapshot_s[0] += time.time() - t
            log(f"trl step {state.global_step} at {stamps[state.global_step] - t_ready:.1f} s")

        def on_log(self, a, state, control, logs_=None, **kw):
            entry = kw.get("logs") or logs_
            if entry:
                logs.append({"step": state.global_step, **entry})

    engine = {"tools": [calculator_tool]} if calculator else {"rollout_func": guess_rollout(args, tokenizer, on_gpu)}
    trainer = GRPOTrainer(model=model, reward_funcs=reward_for_trl if calculator else guess_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[Snapshots()], **engine)
    with GpuMemory() as memory:
        trainer.train()
    t_end = time.time()
    del trainer
    model.to("cpu")

    device = "cuda" if on_gpu else "cpu"
    net, judge_tok = J.load_model(model_dir, device)
    val = J.read_rows(str(data / args.task / "val.jsonl"), args.val_n)
    points = []
    for step in [0] + sorted(snapshots):
        if step:
            net.load_state_dict(snapshots.pop(step), strict=False)
            if net.config.tie_word_embeddings:
                net.tie_weights()
        result = J.judge(net, judge_tok, val, args.task, batch=args.eval_batch)
        wall = stamps[step] - t_ready if step else 0.0
        points.append({"step": step, "wall_s": wall, "accuracy": result["success"], "success": result["success"],
                       "mean_turns": result["mean_turns"], "counters": result["counters"],
                       "example": result["examples"][0]})
        log(f"trl step {step}: held-out success {result['success']:.3f} at {wall:.0f} s")
    step_s = [stamps[s] - stamps[s - 1] for s in sorted(stamps) if s > 0 and s - 1 in stamps]
    results = {"engine": "trl", "trl_version": trl.__version__, "task": args.task, "points": points,
               "startup_s": stamps.get(0, t_ready) - t_ready, "prepare_s": t_ready - t_start, "script_s": t_end - t_start,
               "s_per_step_median": statistics.median(step_s) if step_s else None, "snapshot_s": snapshot_s[0],
               "peak_gpu_mem_mib": memory.peak_mib, "logs": logs,
               "settings": {k: getattr(args, k) for k in ("steps", "prompts_per_step", "group", "max_turns",
                                                          "max_turn_tokens", "lr", "kl", "temperature")}}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    form = "tools=" if calculator else "rollout_func"
    lines = [f"# TRL GRPOTrainer ({form}), {args.task}: held-out success ({args.val_n} rows)", "",
             "| step | wall s | held-out success | mean turns |", "|---:|---:|---:|---:|"]
    lines += [f"| {pt['step']} | {pt['wall_s']:.0f} | {pt['success']:.3f} | {pt['mean_turns']:.2f} |" for pt in points]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot_curves(out / "curve.png", {"TRL": points}, title=agent_title(args.task))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
