"""`python -m dataflow.run GRAPH.py [--set k=v]... [--address A] [--max-steps N] [--describe]`.

Exit status: 0 done, 1 a node failed or the run stalled, 2 a user mistake (graph file, --set,
inputs), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from dataflow import startup_gc
from dataflow.errors import NodeFailed, UserError
from dataflow.driver.stall import RunStalled


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dataflow.run",
        description="Run a dataflow graph (an RLHF pipeline declared in a Python file) on Ray.",
        epilog="Examples:\n"
               "  python -m dataflow.run graphs/ppo.py\n"
               "  python -m dataflow.run graphs/grpo.py --set task.name=reverse --max-steps 50\n"
               "  python -m dataflow.run graphs/ppo.py --describe\n"
               "Exit status: 0 done, 1 a node failed or the run stalled, 2 bad input, 130 interrupted.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graph", help="graph file: defines build(config) -> Graph (and a `config` dataclass), or `graph`")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of the graph's config, e.g. --set learner.lr=1e-4 (repeatable; "
                        "--describe lists the settings)")
    p.add_argument("--address", default=None,
                   help="join an existing Ray cluster (default: $RAY_ADDRESS, else start a local instance)")
    p.add_argument("--keep-processes", action="store_true",
                   help="with --address: when the run ends cleanly, keep its node processes in the cluster for "
                        "the next run of the same placement, which then skips their start and imports (the "
                        "project's files unchanged); a run without this flag, or `ray stop`, ends them")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N training steps")
    p.add_argument("--describe", action="store_true",
                   help="print nodes, channels with capacities, resources, placement and settings; run nothing")
    p.add_argument("--trace", default=None, metavar="OUT.json",
                   help="write a Chrome/Perfetto trace of every node's busy and wait spans")
    p.add_argument("--trace-kernels", action="store_true",
                   help="on CUDA, also record kernels with torch.profiler and print their GPU idle %% next "
                        "to the CUDA-event idle %% (a check of the trace; costs profiler overhead)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="run directory for metrics.jsonl and weights (default runs/<graph>-<time>); not one an earlier "
                        "run wrote to (continue that one with --resume)")
    p.add_argument("--verbose", action="store_true", help="also show the node actors' own logs")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="where compiled artefacts (torch.compile, triton, vLLM's engine) persist across runs of "
                        "the same model and shapes (default ~/.cache/dataflow/compile; '' = the libraries' own)"),
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint (DIR = <run>/checkpoints/step_<k>, or a run directory: "
                        "its latest checkpoint) with the run's recorded settings, each --set changing only what "
                        "it names; --max-steps counts from the start of the original run")
    p.add_argument("--allow-changed-settings", action="store_true",
                   help="with --resume: accept a --set that changes what the run is (batch, group size, model, "
                        "task or data, reward), which is refused otherwise")
    return p.parse_args(argv)


SLOW_CHECKS_S = 2.0
"""Input checks that take longer than this print where their time went (before Ray starts)."""


def main(argv: list[str] | None = None) -> int:
    if argv is None:   # this process is the command, not a caller's: no collection while it starts (dataflow/startup_gc.py)
        startup_gc.pause()
    try:
        return _main(argv)
    finally:
        startup_gc.resume()


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    from dataflow.driver.options import DriverClock
    from dataflow.driver.resume import load_for_resume
    from dataflow.driver.runtime import RunOptions, describe, load_graph, run_graph

    # The command's own wait before Ray starts, by part, for the running line (argv None: this
    # process is the command; a caller's process started long before its call).
    clock = DriverClock(since_process_start=argv is None)
    try:
        with clock.part("graph"):   # the graph file, its node kinds' declarations (no torch), the settings
            if args.resume:  # the run's own settings, and a checkpoint that is intact
                graph, config, checkpoint = load_for_resume(args.graph, args.overrides, args.resume,
                                                            args.allow_changed_settings)
                args.resume = str(checkpoint)
            else:
                graph, config = load_graph(args.graph, args.overrides)
    except UserError as e:
        for line in getattr(e, "lines", None) or [str(e)]:   # SettingProblems: one line per setting
            print(f"error: {line}", file=sys.stderr)
        return 2
    if args.describe:
        print(describe(graph, config))
        return 0
    if args.keep_processes and not (args.address or os.environ.get("RAY_ADDRESS")):
        print("error: --keep-processes: the Ray this command starts ends with it; start one that outlives it "
              "(`ray start --head`) and pass --address auto", file=sys.stderr)
        return 2
    if args.max_steps is not None and args.max_steps < 1:
        print("error: --max-steps must be >= 1", file=sys.stderr)
        return 2
    for flag, where in (("--out", args.out), ("--compile-cache", args.compile_cache),
                        ("--trace", os.path.dirname(os.path.abspath(args.trace)) if args.trace else None)):
        if where and (problem := out_dir_problem(where)):
            shown = f"{args.trace}: its directory {where}" if flag == "--trace" else where
            print(f"error: {flag} {shown}: {problem}", file=sys.stderr)
            return 2
    if args.out and not args.resume and (earlier := earlier_run(args.out)):
        # a new run there would truncate its metrics.jsonl, and `--resume DIR` would then pick the
        # earlier run's highest checkpoint over this one's
        held, last_checkpoint = earlier
        what = (f"continue it with --resume {args.out}, or give a new --out" if last_checkpoint
                else f"give a new --out, or delete {args.out} first")
        print(f"error: --out {args.out} holds an earlier run ({held}): {what}", file=sys.stderr)
        return 2
    from dataflow.driver.preflight import input_problems

    try:
        # model dirs, data, rewards, the nodes' cross-setting checks: in seconds, before Ray starts
        checks: dict[str, float] = {}
        with clock.part("checks"):
            found = input_problems(graph, config, args.max_steps, seconds=checks)
    except KeyboardInterrupt:
        print("\n[dataflow] interrupted while checking the inputs; nothing was started.", file=sys.stderr)
        return 130
    if found:
        for line in found:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if clock.parts["checks"] >= SLOW_CHECKS_S:   # say which input took the time (a large prompt file: a token file helps)
        slowest = sorted(checks.items(), key=lambda kv: -kv[1])[:3]
        print(f"[dataflow] input checks took {clock.parts['checks']:.1f} s: "
              + ", ".join(f"{name} {s:.1f} s" for name, s in slowest))
    plan = getattr(graph, "memory_plan", None)    # what the graph config's memory plan set (graphs/rlhf.py)
    if plan is not None and getattr(plan, "settings", None):
        print(f"[dataflow] {plan.summary()}")
    options = RunOptions(address=args.address, max_steps=args.max_steps, trace_path=args.trace,
                         trace_kernels=args.trace_kernels,
                         out_dir=args.out, verbose=args.verbose, resume=args.resume, driver_parts=clock.parts,
                         **({"keep_processes": True} if args.keep_processes else {}),
                         **({} if args.compile_cache is None else {"compile_cache": args.compile_cache}))
    startup_gc.resume()
    return _run_with_signals(lambda: run_graph(graph, options, config), args.graph)


def out_dir_problem(path: str) -> str | None:
    """Why the run directory cannot be made at `path` (a file there or above it, no write access),
    or None; checked before Ray starts instead of failing at the first metrics write."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "a file is there; give a directory (it is made if missing)"
        return None if os.access(path, os.W_OK | os.X_OK) else "not writable; give a directory you can write"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a directory; give a path under a directory"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{parent} is not writable; give a directory you can write"


def earlier_run(path: str) -> tuple[str, object] | None:
    """(what of an earlier run the directory holds, its latest checkpoint or None), or None if it
    holds neither metrics nor a checkpoint."""
    from dataflow.actor import checkpoint

    metrics = os.path.join(path, "metrics.jsonl")
    held = ["metrics.jsonl"] if os.path.isfile(metrics) and os.path.getsize(metrics) > 0 else []
    last = checkpoint.latest(path) if os.path.isdir(path) else None
    if last is not None:
        held.append(f"checkpoints up to {last.name}")
    return (" and ".join(held), last) if held else None


def _run_with_signals(make_coro, graph_file: str = "GRAPH.py") -> int:
    """Run the driver on uvloop; Ctrl-C / SIGTERM cancel it, which stops every actor and Ray."""
    interrupted = []

    async def main_task():
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda s=sig: (interrupted.append(s), task.cancel()))
        return await make_coro()

    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        summary = run(main_task())
    except asyncio.CancelledError:
        if interrupted:
            print("\n[dataflow] interrupted: stopped every node and Ray.", file=sys.stderr)
            return 130
        raise
    except NodeFailed as e:
        print(f"\n[dataflow] node '{e.node}' failed: {e.summary}", file=sys.stderr)
        if e.item:
            print(f"  while processing: {e.item}", file=sys.stderr)
        if e.traceback_text:
            print("  original traceback (in the node's actor):", file=sys.stderr)
            print("    " + e.traceback_text.rstrip().replace("\n", "\n    "), file=sys.stderr)
        last = getattr(e, "last_checkpoint", None)
        if last:
            print(f"  last checkpoint: {last}\n  continue with: python -m dataflow.run {graph_file} --resume {last} "
                  "(it keeps the run's settings)", file=sys.stderr)
        return 1
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunStalled as e:
        print(f"\n{e.report}", file=sys.stderr)
        print(f"[dataflow] stopped: the run stalled; root of the wait: {', '.join(e.roots)} (Graph(stall_timeout_s=..., "
              "stall_action='warn') in the graph file: when a stall stops the run, or that it only warns)",
              file=sys.stderr)
        return 1
    print(summary.report)
    print(f"[dataflow] {summary.status}: {summary.steps} steps in {summary.seconds:.1f} s")
    for note in getattr(summary, "notes", ()):
        print(f"  {note}")
    restarts = getattr(summary, "restarts", None)
    if restarts:
        print("  restarted after their process died: " + ", ".join(f"{n} x{k}" for n, k in restarts.items()))
    if getattr(summary, "alerts", None):
        print("  went wrong along the way (see metrics.jsonl): "
              + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.alerts.items()))
    print(f"  metrics: {summary.metrics_path}")
    for name, path in summary.artifacts.items():
        print(f"  {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
