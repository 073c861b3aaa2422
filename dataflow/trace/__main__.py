"""`python -m dataflow.trace out.json [--plot out.png] [--spans]`: the idle table of a saved trace."""

from __future__ import annotations

import argparse
import sys

from dataflow.trace.chrome import load_trace
from dataflow.trace.plot import plot
from dataflow.trace.report import format_report, format_spans, summarize


def main(argv=None) -> int:
    """`python -m dataflow.trace out.json [--plot out.png]`: the idle table of a saved trace."""
    p = argparse.ArgumentParser(prog="python -m dataflow.trace", description=main.__doc__)
    p.add_argument("trace", help="trace written with --trace (.json or .json.gz)")
    p.add_argument("--plot", metavar="OUT.png", help="also draw the timeline and utilization chart")
    p.add_argument("--spans", action="store_true", help="also list each node's busy spans by total time")
    args = p.parse_args(argv)
    try:
        aggs, rows = load_trace(args.trace)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(aggs)
    print(format_report(summary))
    if args.spans:
        print(format_spans(summary))
    if args.plot:
        plot(args.plot, rows, summary, t0_us=0)
        print(f"plot -> {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
