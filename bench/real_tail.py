"""Where a step's generation time goes on a real model: the long tail of response lengths
(issue 18, item 7; the baseline for the issue on variable-length work).

    python bench/real_tail.py --out runs/real_tail [--prompts 64 --group 8 --max-new-tokens 512]
    python bench/real_tail.py --tiny --out /tmp/real_tail_tiny       # CPU smoke
    python bench/real_tail.py --trace runs/real_grpo/trace.json --out runs/real_tail   # + a run's trace
    python bench/real_tail.py --prompts 0 --trace trace.json.gz --out /tmp/tail       # the trace only (CPU)

Part 1, the decoder alone: one GRPO step's generation (--prompts held-out prompts x --group, T=1,
stop at <|im_end|>) through rl/generation/decoding.StaticDecoder, the generator node's decoder, with all
sequences admitted at once (a synchronous step). Every decode step is timed (synchronised) with
the number of sequences still running, which gives: the time until half / 90% / all responses
ended, the time spent with fewer than 10% of the slots busy ("waiting on the longest
responses"), and the slot occupancy (busy slot-steps / slots x steps): 1 - occupancy is the
decode work spent on finished rows.

Part 2, with --trace (a Chrome trace of a graph run, bench/real_rl.py --trace): per training
step, the generator's generate span, when 50% / 90% of its groups reached the reward node, the
tail (the span's end minus the 90% time: decoding only the longest responses), the learner's
train time, the GPU idle share of the step (NVML samples, as the end-of-run report); medians
over the steps after the first.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_common import log, prepare  # noqa: E402
from examples.smollm2_arithmetic import heldout  # noqa: E402

TINY = {"prompts": 2, "group": 2, "max_new_tokens": 16}


def decode_tail(model, tokenizer, prompts: list, group: int, max_new_tokens: int, seed: int = 0) -> dict:
    import torch
    from rl.generation.decoding import StaticDecoder, sample_key
    ids = [tokenizer(heldout.render(tokenizer, p), add_special_tokens=False)["input_ids"] for p in prompts]
    slots = len(ids) * group
    dec = StaticDecoder(model, slots, max(len(i) for i in ids) + max_new_tokens, eos_id=tokenizer.eos_token_id,
                        max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    cuda = next(model.parameters()).is_cuda

    def sync():
        if cuda:
            torch.cuda.synchronize()

    requests = [(p, (i, j), sample_key(seed, i, j)) for i, p in enumerate(ids) for j in range(group)]
    # One warm-up round (CUDA graph capture, compilation) before the timed one.
    for timed in (False, True):
        sync()
        t0 = time.perf_counter()
        dec.add(requests)
        sync()
        prefill_s = time.perf_counter() - t0
        timeline, lengths = [], []
        while dec.active:
            running = dec.active
            finished = dec.step(1)
            sync()
            timeline.append((time.perf_counter() - t0, running))
            lengths += [len(s["response_ids"]) for _, s in finished]
        if not timed:
            continue
        total = timeline[-1][0]
        ends = sorted(lengths)

        def time_until(fraction: float) -> float:
            k = ends[max(0, int(fraction * len(ends)) - 1)]          # that response's length in steps
            return timeline[min(k, len(timeline)) - 1][0]

        step_s = [b[0] - a[0] for a, b in zip([(prefill_s, 0)] + timeline, timeline)]
        tail = sum(dt for dt, (_, running) in zip(step_s, timeline) if running < 0.1 * slots)
        busy = sum(running for _, running in timeline)
        return {"slots": slots, "prefill_s": prefill_s, "total_s": total, "decode_steps": len(timeline),
                "mean_length": statistics.mean(lengths), "p50_length": ends[len(ends) // 2],
                "p90_length": ends[int(0.9 * len(ends)) - 1], "max_length": ends[-1],
                "hit_cap": sum(n >= max_new_tokens for n in lengths) / len(lengths),
                "t_half_done_s": time_until(0.5), "t_90pct_done_s": time_until(0.9),
                "tail_under_10pct_busy_s": tail, "occupancy": busy / (slots * len(timeline)),
                "tokens_per_s": sum(lengths) / total}


def trace_steps(trace_path: str) -> dict:
    """Per training step, from a graph run's trace: the window (end of the previous 'train step'
    to the end of this one), the generator's 'generate' span, when its groups reached the reward
    node (the start of each 'score' slice, weighted by its items: groups stream downstream as they
    finish), the tail = the generate span's end minus the time 90% of the step's groups had
    arrived (the generator decoding only the longest responses), the learner's train time, and
    the GPU idle share of the window (the GPU track's 'busy' spans, from NVML samples); plus
    the run's idle summary (dataflow/trace/report.summarize, the end-of-run report's numbers)."""
    from dataflow.trace.chrome import rows_from_doc
    from dataflow.trace.intervals import sampled_idle
    from dataflow.trace.report import summarize
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    slices = [(names.get(e["pid"], ""), e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e.get("args", {}))
              for e in events if e["ph"] == "X"]

    def spans(node: str, name: str) -> list:
        return sorted((s for s in slices if s[0].startswith(node) and s[1] == name), key=lambda s: s[2])

    train, gen, scores = spans("learner", "train step"), spans("generator", "generate"), spans("reward", "score")
    # The GPU track's NVML samples (what the end-of-run report uses without --trace-kernels; its
    # 'busy' slices are span events, which count launch gaps as busy): [t0, t1, percent].
    points = sorted((e["ts"] / 1e6, e["args"]["busy"]) for e in events
                    if e["ph"] == "C" and names.get(e["pid"], "").startswith("GPU") and "busy" in e.get("args", {}))
    nvml = [[a, b, pct] for (a, pct), (b, _) in zip(points, points[1:])]
    steps, prev_end = [], None
    for k, (g, t) in enumerate(zip(gen, train), 1):
        window_start = prev_end if prev_end is not None else g[2]
        prev_end = t[3]
        arrivals = sorted((s[2], s[4].get("items", 1)) for s in scores if g[2] <= s[2] <= g[3] + 0.05)
        total = sum(n for _, n in arrivals)

        def time_until(frac: float) -> float:
            done = 0
            for at, n in arrivals:
                done += n
                if done >= frac * total:
                    return at - g[2]
            return float("nan")

        window = t[3] - window_start
        t90 = time_until(0.9) if total else float("nan")
        steps.append({"step": k, "window_s": window, "generate_s": g[3] - g[2], "groups": total,
                      "t_half_groups_s": time_until(0.5) if total else float("nan"), "t_90pct_groups_s": t90,
                      "tail_s": (g[3] - g[2]) - t90, "train_s": t[3] - t[2],
                      "gpu_idle_frac": sampled_idle(nvml, (window_start, t[3])) if nvml and window > 0 else float("nan")})
    summary = summarize(rows_from_doc(doc)[0])     # the file read once: the report's aggregates
    later = steps[1:] or steps     # step 1 carries the first compile and CUDA-graph capture

    def median(key: str) -> float:
        values = [s[key] for s in later if s[key] == s[key]]
        return statistics.median(values) if values else float("nan")

    medians = {key: median(key) for key in ("window_s", "generate_s", "t_90pct_groups_s", "tail_s", "train_s",
                                            "gpu_idle_frac")}
    medians["tail_share_of_step"] = median_ratio(later, "tail_s", "window_s")
    return {"steps": steps, "median_after_step_1": medians, "devices": summary.get("devices", {}),
            "idle_causes": summary.get("idle_causes", [])}


def median_ratio(steps: list, num: str, den: str) -> float:
    values = [s[num] / s[den] for s in steps if s[num] == s[num] and s[den] > 0]
    return statistics.median(values) if values else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="")
    p.add_argument("--data", default="")
    p.add_argument("--work", default="/tmp/real")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=64, help="part 1's prompts (0: only part 2, the --trace)")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--trace", default="", help="a graph run's trace.json to break down per step")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    result = {"settings": {"prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens}}
    if args.prompts:
        import torch
        model_dir, _, val = prepare(args, "tail")
        device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
        model, tokenizer = heldout.load_model(model_dir, device)
        rows = heldout.read_rows(val, args.prompts)
        result["decoder"] = decode_tail(model, tokenizer, [r["prompt"] for r in rows], args.group, args.max_new_tokens)
        result["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        log("tail", json.dumps(result["decoder"]))
    if args.trace:
        result["trace"] = trace_steps(args.trace)
        for s in result["trace"]["steps"]:
            log("tail", json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}))
        log("tail", "median after step 1: " + json.dumps(result["trace"]["median_after_step_1"]))
        log("tail", json.dumps({k: {"idle": v.get("idle")} for k, v in result["trace"]["devices"].items()}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tail.json").write_text(json.dumps(result, indent=1))
    log("tail", f"wrote {out / 'tail.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
