"""Tracing on vs off on the CPU PPO demo, side by side in one invocation.

    python bench/trace_overhead.py [--steps 40] [--rounds 2] [--set k=v ...]

Runs graphs/ppo.py `rounds` times each with --trace off and on, alternating (off, on, off, on, ...)
so drift on the machine hits both alike, on one Ray instance. Reports the median samples/s of the
learner steps (first 5 steps of each run skipped as warm-up), the on/off ratio, and the trace size
per minute of run (the 5-minute budget is 50 MB).

Also the machine's CPU time per trained sample over the same steps (from /proc/stat: user, nice,
system, irq, softirq of every process, so run it on an otherwise idle machine). On 2 cores the
demo's 6 actors keep both cores busy, so wall-clock samples/s moves by +-20% from run to run with
the order in which the actors get the cores; the CPU seconds a sample costs do not depend on that
order, and what tracing adds is CPU work: that ratio is the cost measure that can resolve 2%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


WARMUP_STEPS = 5


def cpu_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores; steal time excluded)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def steps_done(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"step"' in line)
    except FileNotFoundError:
        return 0


def one_run(overrides: list[str], steps: int, out_dir: str, trace: bool) -> dict:
    from dataflow.driver.runtime import RunOptions, load_graph, run_graph

    graph, config = load_graph(str(ROOT / "graphs/ppo.py"), overrides)
    trace_path = f"{out_dir}/trace.json" if trace else None
    options = RunOptions(max_steps=steps, out_dir=out_dir, quiet=True, trace_path=trace_path)
    # Sample (machine CPU seconds, steps done) while it runs: the CPU the steps after warm-up cost.
    samples, done = [], threading.Event()

    def sampler():
        while not done.wait(0.2):
            samples.append((cpu_busy_s(), steps_done(Path(out_dir) / "metrics.jsonl")))

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        summary = asyncio.run(run_graph(graph, options, config))
    finally:
        done.set()
        thread.join()
    records = [json.loads(l) for l in Path(summary.metrics_path).read_text().splitlines()]
    step_records = [r for r in records if "step" in r]
    rates = [r["perf/samples_per_s"] for r in step_records][WARMUP_STEPS:]
    run_s = step_records[-1]["time_s"]
    per_step = round(step_records[-1]["perf/samples_per_s"] * step_records[-1]["timing/step_s"])
    # From the first moment past warm-up to the first moment the last step was seen (not the shutdown).
    first = next(s for s in samples if s[1] >= WARMUP_STEPS)
    last = next((s for s in samples if s[1] >= len(step_records)), samples[-1])
    cpu_per_sample = (last[0] - first[0]) / max((last[1] - first[1]) * per_step, 1)
    size = os.path.getsize(trace_path) if trace else 0
    return {"rate": statistics.median(rates), "run_s": run_s, "trace_bytes": size,
            "cpu_ms_per_sample": 1000 * cpu_per_sample, "cpu_steps": last[1] - first[1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    import ray

    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(4, os.cpu_count() or 1),
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    results = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for trace in (False, True):
                r = one_run(args.overrides, args.steps, f"{tmp}/{i}-{trace}", trace)
                results[trace].append(r)
                print(f"round {i} trace={'on ' if trace else 'off'}: {r['rate']:.1f} samples/s, "
                      f"{r['cpu_ms_per_sample']:.3f} CPU ms per sample (over {r['cpu_steps']} steps), "
                      f"{r['trace_bytes'] / 1e6:.2f} MB in {r['run_s']:.0f} s", flush=True)
    ray.shutdown()
    off = statistics.median(r["rate"] for r in results[False])
    on = statistics.median(r["rate"] for r in results[True])
    mb_per_min = statistics.median(r["trace_bytes"] / 1e6 / (r["run_s"] / 60) for r in results[True])
    # Each round's on/off pair ran back to back: their ratio cancels the machine's slow drift.
    ratios = sorted(b["rate"] / a["rate"] for a, b in zip(results[False], results[True]))
    cpu_ratios = sorted(b["cpu_ms_per_sample"] / a["cpu_ms_per_sample"]
                        for a, b in zip(results[False], results[True]))
    print("\n| tracing | samples/s (median) |\n|---|---|")
    print(f"| off | {off:.1f} |\n| on | {on:.1f} |")
    print(f"\non / off = {on / off:.3f} (goal >= 0.98); per round: {', '.join(f'{r:.3f}' for r in ratios)}, "
          f"median {statistics.median(ratios):.3f}; trace size {mb_per_min:.2f} MB per minute "
          f"(-> {5 * mb_per_min:.1f} MB for a 5-minute run; budget 50 MB)")
    cpu_off = statistics.median(r["cpu_ms_per_sample"] for r in results[False])
    cpu_on = statistics.median(r["cpu_ms_per_sample"] for r in results[True])
    print(f"CPU per sample: off {cpu_off:.3f} ms, on {cpu_on:.3f} ms, on / off = {cpu_on / cpu_off:.3f} "
          f"(goal <= 1.02); per round: {', '.join(f'{r:.3f}' for r in cpu_ratios)}, "
          f"median {statistics.median(cpu_ratios):.3f}")


if __name__ == "__main__":
    main()
