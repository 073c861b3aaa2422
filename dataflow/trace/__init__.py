"""Tracing: where each node's time goes (busy, waiting for input, blocked on output) and what keeps
each GPU idle, in every run; with --trace also a Chrome/Perfetto timeline.

    tracer.py     Tracer: one per node replica process; spans, counters, the exact state accounting
    gpu.py        GPU busy sources of a Tracer on CUDA: CUDA events around spans, NVML samples
    kernels.py    --trace-kernels: every kernel's CUPTI record (torch.profiler), the exact source
    collector.py  TraceCollector: the driver merges every process's drains on one clock
    intervals.py  interval math (unions, idle fractions, utilization samples)
    chrome.py     the trace file: Chrome Trace Event JSON with the aggregates, and reading it back
    report.py     the idle summary, its metrics and the end-of-run table
    plot.py       the PNG timeline and utilization chart (matplotlib)
    __main__.py   `python -m dataflow.trace out.json [--plot out.png]`: the table of a saved trace

How the engine uses it:
  host      tracer = Tracer(name, enabled=trace, device=device, starting=True), started() when its
            run() begins (start-up apart: report.py); clock() returns tracer.now_us();
            poll() returns tracer.drain(); nodes call ctx.span(name, **args).
  channels  `with tracer.wait_input(ch): await <item>` in recv, `with tracer.blocked_output(ch):
            await <room>` in send, `tracer.counter(f"channel/{ch}/depth", depth=n)`.
  driver    collector = TraceCollector(enabled); launched(t_us) when Ray is up (where every node's
            start-up begins); set_clock_offset(name, measure_clock_offset(
            [(t_send, remote_now, t_recv), ...])); add(name, drained) per poll; at the end
            report() (always), write(path) (--trace), plot(png), flat_metrics(summary()) for JSONL.
`python -m dataflow.trace out.json [--plot out.png]` prints the same table from a saved file; the
Chrome JSON opens in the Perfetto UI or chrome://tracing.
"""
