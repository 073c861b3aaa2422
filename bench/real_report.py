"""Side by side: curves written by bench/real_rl.py and bench/real_trl.py -> one PNG and a table.

    python bench/real_report.py runs/real_grpo runs/real_trl runs/real_ppo --out runs/real_report
    python bench/real_report.py runs/agent_guess runs/trl_agent_guess --out runs/guess_report   # agents

An agent run's directory (bench/real_agent.py, bench/real_trl_agent.py: results.json) gives one
curve per run it holds (ours: the agent run, then its single-turn baseline), accuracy = held-out
success.

The first curve is ours (the one compared), the TRL curve is found by its engine ("trl"). The
table gives each run's start and end accuracy, steps, wall time, tokens/s and peak GPU memory,
then ours vs TRL: accuracy after equal steps (TRL's last evaluated step, or the nearest
evaluated one below it), accuracy after equal wall time (TRL's whole run: our best point reached
by then), and the time each needs to reach TRL's final accuracy, with the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_common import ARITHMETIC_TITLE, plot_curves  # noqa: E402


def at_step(points: list[dict], step: int) -> dict:
    return max((p for p in points if p["step"] <= step), key=lambda p: p["step"])


def by_time(points: list[dict], seconds: float) -> dict:
    """The last point evaluated at or before `seconds` of wall time."""
    return max((p for p in points if p["wall_s"] <= seconds), key=lambda p: p["wall_s"])


def time_to(points: list[dict], accuracy: float) -> float | None:
    hit = [p["wall_s"] for p in points if p["accuracy"] >= accuracy and p["step"] > 0]
    return min(hit) if hit else None


def load_curves(run_dir: str) -> list[dict]:
    """The curves of one output directory: curve.json (bench/real_rl.py, real_trl.py), or an agent
    bench's results.json (real_agent.py: one curve per run in it; real_trl_agent.py: one)."""
    path = Path(run_dir)
    if (path / "curve.json").is_file():
        return [json.loads((path / "curve.json").read_text())]
    results = json.loads((path / "results.json").read_text())
    if "runs" in results:   # real_agent.py
        return [{"name": f"{path.name}/{r['variant']}", "engine": "dataflow", "points": r["points"]}
                for r in results["runs"] if r.get("points")]
    return [{"name": path.name, "engine": results.get("engine", "trl"), "points": results["points"],
             "startup_s": results.get("startup_s", float("nan")), "peak_gpu_mem_mib": results.get("peak_gpu_mem_mib")}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="output dirs holding curve.json (or an agent bench's results.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default=ARITHMETIC_TITLE, help="the plot's title")
    args = p.parse_args()
    curves = [c for r in args.runs for c in load_curves(r)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_curves(out / "curves.png", {c["name"]: c["points"] for c in curves}, title=args.title)
    lines = ["| run | start acc | end acc | steps | wall s | start-up s | tokens/s | peak GPU MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in curves:
        first, last = c["points"][0], c["points"][-1]
        lines.append(f"| {c['name']} | {first['accuracy']:.3f} | {last['accuracy']:.3f} | {last['step']} | "
                     f"{last['wall_s']:.1f} | {c.get('startup_s', float('nan')):.1f} | "
                     f"{c.get('response_tokens_per_s') or float('nan'):.0f} | {c.get('peak_gpu_mem_mib')} |")
    ours = curves[0]
    trl = next((c for c in curves if c.get("engine") == "trl"), None)
    if trl is not None and trl is not ours:
        o, t = ours["points"], trl["points"]
        t_last = t[-1]
        lines += ["", f"ours = {ours['name']}, TRL = {trl['name']}", "",
                  "| comparison | ours | TRL | ratio |", "|---|---:|---:|---:|"]
        step = t_last["step"]
        lines.append(f"| accuracy after {step} steps | {at_step(o, step)['accuracy']:.3f} | "
                     f"{t_last['accuracy']:.3f} | |")
        same_time = by_time(o, t_last["wall_s"])
        lines.append(f"| accuracy after {t_last['wall_s']:.0f} s (TRL's whole run) | {same_time['accuracy']:.3f} "
                     f"(step {same_time['step']}) | {t_last['accuracy']:.3f} | |")
        ours_t, trl_t = time_to(o, t_last["accuracy"]), time_to(t, t_last["accuracy"])
        ratio = f"{trl_t / ours_t:.2f}x" if ours_t and trl_t else "n/a"
        lines.append(f"| wall s to TRL's final accuracy {t_last['accuracy']:.3f} | "
                     f"{ours_t if ours_t is None else round(ours_t, 1)} | "
                     f"{trl_t if trl_t is None else round(trl_t, 1)} | {ratio} |")
        for key in ("response_tokens_per_s", "peak_gpu_mem_mib"):
            a, b = ours.get(key), trl.get(key)
            ratio = f"{a / b:.2f}x" if a and b else "n/a"
            lines.append(f"| {key} | {a if a is None else round(a)} | {b if b is None else round(b)} | {ratio} |")
    table = "\n".join(lines) + "\n"
    (out / "report.md").write_text(table)
    print(table)
    print(f"wrote {out / 'curves.png'} and {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
