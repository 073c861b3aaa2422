"""Where a step's generation time goes on a real model: the long tail of response lengths
(issue 18, item 7; the baseline for the issue on variable-length work).

    python bench/real_tail.py --out runs/real_tail [--prompts 64 --group 8 --max-new-tokens 512]
    python bench/real_tail.py --tiny --out /tmp/real_tail_tiny       # CPU smoke
    python bench/real_tail.py --trace runs/real_grpo/trace.json --out runs/real_tail   # + a run's trace

Part 1, the decoder alone: one GRPO step's generation (--prompts held-out prompts x --group, T=1,
stop at <|im_end|>) through rl/decoding.StaticDecoder, the generator node's decoder, with all
sequences admitted at once (a synchronous step). Every decode step is timed (synchronised) with
the number of sequences still running, which gives: the time until half / 90% / all responses
ended, the time spent with fewer than 10% of the slots busy ("waiting on the longest
responses"), and the slot occupancy (busy slot-steps / slots x steps): 1 - occupancy is the
decode work spent on finished rows.

Part 2, with --trace (a Chrome trace of a graph run, bench/real_rl.py --trace): per training
step, the generator's busy time, the learner's train time and wait, and the run's GPU idle %
(dataflow/trace/report.summarize, the numbers of the end-of-run report).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_common import log, prepare  # noqa: E402
from tools import heldout  # noqa: E402

TINY = {"prompts": 2, "group": 2, "max_new_tokens": 16}


def decode_tail(model, tokenizer, prompts: list, group: int, max_new_tokens: int, seed: int = 0) -> dict:
    import torch
    from rl.decoding import StaticDecoder, sample_key
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
    """Per training step (between the ends of the learner's 'train step' slices): the generators'
    'generate' time in that window, the learner's train time and its wait before it; and the
    run's idle summary (dataflow/trace/report.summarize)."""
    from dataflow.trace.report import load_trace, summarize
    doc = json.loads(Path(trace_path).read_text())
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    slices = [(names.get(e["pid"], ""), e["name"], e["ts"], e["ts"] + e["dur"])
              for e in doc["traceEvents"] if e["ph"] == "X"]
    train = sorted((s for s in slices if s[0].startswith("learner") and s[1] == "train step"), key=lambda s: s[2])
    gen = [s for s in slices if s[0].startswith("generator") and s[1] == "generate"]
    steps, window_start = [], min((g[2] for g in gen), default=train[0][2] if train else 0)
    for k, (_, _, t0, t1) in enumerate(train, 1):
        busy = sum(max(0, min(g3, t1) - max(g2, window_start)) for _, _, g2, g3 in gen)
        steps.append({"step": k, "window_s": (t1 - window_start) / 1e6, "generate_s": busy / 1e6,
                      "train_s": (t1 - t0) / 1e6, "learner_wait_s": (t0 - window_start) / 1e6})
        window_start = t1
    summary = summarize(load_trace(trace_path)[0])
    return {"steps": steps, "devices": summary.get("devices", {}), "idle_causes": summary.get("idle_causes", [])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="")
    p.add_argument("--data", default="")
    p.add_argument("--work", default="/tmp/real")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--trace", default="", help="a graph run's trace.json to break down per step")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    import torch
    model_dir, _, val = prepare(args, "tail")
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    model, tokenizer = heldout.load_model(model_dir, device)
    rows = heldout.read_rows(val, args.prompts)
    result = {"decoder": decode_tail(model, tokenizer, [r["prompt"] for r in rows], args.group, args.max_new_tokens),
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "settings": {"prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens}}
    log("tail", json.dumps(result["decoder"]))
    if args.trace:
        result["trace"] = trace_steps(args.trace)
        for s in result["trace"]["steps"]:
            log("tail", json.dumps(s))
        log("tail", json.dumps({k: {"idle": v.get("idle")} for k, v in result["trace"]["devices"].items()}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tail.json").write_text(json.dumps(result, indent=1))
    log("tail", f"wrote {out / 'tail.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
