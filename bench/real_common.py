"""What bench/real_rl.py and bench/real_trl.py share: the task files, the held-out evaluation of
weight snapshots, GPU memory sampling, and the curve (a JSON, a markdown table, a PNG).

A curve is a list of points {"step", "wall_s", "train_s", "accuracy", "math_reward", ...}:
wall_s counts from the script's start (start-up included), train_s leaves out time spent saving
snapshots for evaluation (checkpoints), which a run without evaluation would not spend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from examples.smollm2_arithmetic import heldout  # noqa: E402

T0 = time.time()


def log(tag: str, text: str) -> None:
    print(f"[{tag} {time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {text}", flush=True)


def prepare(args, tag: str) -> tuple[str, str, str]:
    """(model dir, train file, val file): converted / written under --work when not given."""
    work = Path(args.work)
    model = args.model or str(work / "smollm2")
    if not os.path.isfile(os.path.join(model, "model.safetensors")):
        from examples.smollm2_arithmetic import smollm2
        log(tag, f"converting SmolLM2-135M-Instruct into {model}")
        smollm2.convert(model, check=True, log=lambda s: log(tag, s))
    data = Path(args.data or work / "arithmetic")
    if not (data / "train.jsonl").is_file():
        from examples.smollm2_arithmetic import make_arithmetic
        train, val = make_arithmetic.make_splits(seed=0, num_val=500)
        data.mkdir(parents=True, exist_ok=True)
        make_arithmetic.write_jsonl(str(data / "train.jsonl"), train)
        make_arithmetic.write_jsonl(str(data / "val.jsonl"), val)
        log(tag, f"wrote {len(train)} + {len(val)} problems to {data}")
    return model, str(data / "train.jsonl"), str(data / "val.jsonl")


# --reward: (file, function); both engines load the same function from the same file.
REWARDS = {"last_number": (ROOT / "examples" / "smollm2_arithmetic" / "last_number_reward.py", "last_number_reward"),
           "math": (ROOT / "rl" / "reward" / "reward_fn.py", "math_reward")}


def reward_function(name: str):
    """The --reward function itself, loaded from its file as the reward node loads it."""
    import importlib.util
    path, function = REWARDS[name]
    spec = importlib.util.spec_from_file_location(f"bench_reward_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, function)


def add_common_args(p, tiny_defaults: dict) -> None:
    """Arguments every real_* script takes; --tiny swaps in `tiny_defaults` (a CPU smoke run)."""
    p.add_argument("--model", default="", help="converted model dir (default: convert into --work)")
    p.add_argument("--data", default="", help="dir with train.jsonl / val.jsonl (default: write into --work)")
    p.add_argument("--work", default="/tmp/real", help="where the model and data are made when not given")
    p.add_argument("--out", required=True, help="output dir (curve.json, curve.md, curve.png, logs)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every N steps")
    p.add_argument("--val-n", type=int, default=500, help="held-out problems evaluated")
    p.add_argument("--eval-batch", type=int, default=512)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group", type=int, default=8, help="responses per prompt (GRPO; PPO uses 1)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--kl", type=float, default=0.0, help="KL coefficient (beta)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reward", choices=tuple(REWARDS), default="last_number",
                   help="last_number: examples/smollm2_arithmetic/last_number_reward.py (the held-out judge's rule); math: rl/reward/reward_fn.py's "
                        "math_reward, which this task games (math-verify evaluates a restated '47 + 38')")
    p.add_argument("--tiny", action="store_true", help="CPU smoke: " + ", ".join(f"{k}={v}" for k, v in tiny_defaults.items()))
    p.set_defaults(_tiny=tiny_defaults)


def apply_tiny(args) -> None:
    if args.tiny:
        for k, v in args._tiny.items():
            setattr(args, k, v)


class GpuMemory:
    """Peak GPU memory in use (MiB, all processes: our nodes are separate Ray actors), sampled
    every `interval_s` with nvidia-smi; None where there is no nvidia-smi."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self.peak_mib, self._stop = interval_s, None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5).stdout
            return max(int(x) for x in out.split())
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self._sample()
            if used is not None:
                self.peak_mib = max(self.peak_mib or 0, used)
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


LORA_A, LORA_B = ".lora_A.default.weight", ".lora_B.default.weight"   # peft's names in a LoRA checkpoint


class Evaluator:
    """Greedy held-out accuracy (examples/smollm2_arithmetic/heldout.evaluate) of weight snapshots, in one model kept
    on the evaluation device, so every engine is judged by the same code on the same problems."""

    def __init__(self, model_dir: str, val_path: str, n: int, batch: int, max_new_tokens: int, device: str):
        self.model, self.tokenizer = heldout.load_model(model_dir, device)
        self.rows = heldout.read_rows(val_path, n)
        self.batch, self.max_new_tokens = batch, max_new_tokens
        self._base: dict | None = None

    def __call__(self, state_dict: dict | None = None, lora_scaling: float = 0.0) -> dict:
        """state_dict: a learner checkpoint's model state, full weights or (learner.lora) the
        adapter alone, merged here into the base as the generators merge it, at lora_scaling =
        learner.lora.alpha / rank."""
        if state_dict is not None:
            # torch.compile'd layers name their weights "..._orig_mod...": strip it.
            clean = {k.replace("_orig_mod.", ""): v for k, v in state_dict.items()}
            if any(k.endswith(LORA_A) for k in clean):
                clean = self._merged(clean, lora_scaling)
            missing, unexpected = self.model.load_state_dict(clean, strict=False)
            if unexpected or set(missing) - {"lm_head.weight"}:
                raise RuntimeError(f"snapshot does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
            if self.model.config.tie_word_embeddings:
                self.model.tie_weights()
        return heldout.evaluate(self.model, self.tokenizer, self.rows, self.max_new_tokens, self.batch)

    def _merged(self, adapter: dict, scaling: float) -> dict:
        """The base weights with W0 + scaling B A in every adapted layer (peft's own names)."""
        from dataflow.weights.lora import merged_weight

        if not scaling:
            raise ValueError("a LoRA snapshot needs lora_scaling (learner.lora.alpha / rank)")
        if self._base is None:   # the model still holds the base: keep a pristine copy
            self._base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        state = dict(self._base)
        for key in [k for k in adapter if k.endswith(LORA_A)]:
            target = key[:-len(LORA_A)]
            a, b = adapter[key], adapter[target + LORA_B]
            state[target + ".weight"] = merged_weight(self._base[target + ".weight"], a, b.float() * scaling)
        return state


def eval_fields(result: dict) -> dict:
    """The held-out evaluation's numbers a curve point keeps (examples/smollm2_arithmetic/heldout.evaluate's result)."""
    return {k: result[k] for k in ("accuracy", "math_reward", "mean_length", "hit_cap", "eval_s")}


def write_curve(out: Path, name: str, points: list[dict], extra: dict) -> None:
    """curve.json (points + extra), curve.md (a table) and curve.png (accuracy vs steps and wall time)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps({"name": name, "points": points, **extra}, indent=1))
    lines = [f"# {name}", "", "| step | wall s | train s | held-out accuracy | math_reward | mean length | hit cap |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p['step']} | {p['wall_s']:.1f} | {p['train_s']:.1f} | {p['accuracy']:.3f} | "
                     f"{'-' if p['math_reward'] is None else format(p['math_reward'], '.3f')} | {p['mean_length']:.1f} | {p['hit_cap']:.2f} |")
    lines += ["", "```", json.dumps(extra, indent=1), "```"]
    (out / "curve.md").write_text("\n".join(lines) + "\n")
    plot_curves(out / "curve.png", {name: points})


ARITHMETIC_TITLE = "SmolLM2-135M-Instruct, 2-digit arithmetic, held-out greedy accuracy"


def plot_curves(path: Path, curves: dict[str, list[dict]], title: str = ARITHMETIC_TITLE) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in curves.items():
        by_step.plot([p["step"] for p in points], [p["accuracy"] for p in points], marker="o", label=name)
        by_time.plot([p["wall_s"] for p in points], [p["accuracy"] for p in points], marker="o", label=name)
    by_step.set_xlabel("training steps")
    by_time.set_xlabel("wall time since start, s (start-up included)")
    for ax in (by_step, by_time):
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
