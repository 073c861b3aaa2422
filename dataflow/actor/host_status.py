"""NodeHost's status calls (dataflow/actor/host.py; the actor is one class, these are its part that
reports on the replica): poll() hands the driver the events, trace data and channel depths (and the
peak GPU memory as a metrics record), wait_state() what the replica waits for right now (the
driver's stall diagnosis, dataflow/driver/stall.py), and _thread_stacks where its threads are (for
the host's StackServer, dataflow/actor/stacks.py).
"""

from __future__ import annotations

import os

from dataflow import channel as channels
from dataflow.actor import stacks


class StatusCalls:
    """Mixed into NodeHost, whose __init__ sets the attributes used here: ctx, tracer, device,
    events, emit(), latest_version(), _phase, _versions, _version_waits, _publishing, _loop_thread
    (and run() sets _node_run)."""

    async def poll(self, ack: tuple[int, int] | None = None) -> dict:
        """Events since the last acknowledged one, trace data, channel depths. `ack` = (pid, seq)
        of the last event the driver handled: events stay here until acknowledged, so a reply
        lost to a cancelled poll (Ctrl-C) is sent again by the next one."""
        if ack is not None and ack[0] == os.getpid():
            self.events = [e for e in self.events if e["seq"] > ack[1]]
        self._report_peak_memory()
        events = list(self.events)
        stats = {}
        if self.ctx is not None:
            for end in list(self.ctx.outputs.values()) + list(self.ctx.inputs.values()):
                s = end.statistics()
                stats[f"{'out' if isinstance(end, channels.SendEnd) else 'in'}:{end.channel}"] = s.current_buffer_used
        return {"events": events, "trace": self.tracer.drain(), "depths": stats, "pid": os.getpid()}

    async def wait_state(self) -> dict:
        """What this replica is doing at this instant (dataflow/driver/stall.py builds the wait graph):
        {"phase", "now_us", "spans": [(kind, name, channel, since_us)] open now (busy work, waits
        for input, blocked outputs), "versions": [(edge, min_version, latest, why, since_us)],
        "publishing": (edge, version, subscriber, since_us) | None, "channels": {channel: stats},
        "latest": {edge: newest version held}}."""
        channel_stats = {}
        if self.ctx is not None:
            for end in list(self.ctx.outputs.values()) + list(self.ctx.inputs.values()):
                st = end.statistics()
                if isinstance(end, channels.SendEnd):
                    channel_stats[end.channel] = {"end": "out", "depth": st.current_buffer_used,
                                                  "capacity": st.capacity, "consumers_open": st.consumers_open,
                                                  "total": st.sent_total}
                else:
                    channel_stats[end.channel] = {"end": "in", "depth": st.current_buffer_used,
                                                  "producers_open": st.producers_open, "total": st.received_total}
        return {"phase": self._phase, "now_us": self.tracer.now_us(), "spans": self.tracer.open_spans(),
                "versions": [(edge, v, self.latest_version(edge), why, t0)
                             for edge, v, why, t0 in self._version_waits.values()],
                "publishing": self._publishing, "channels": channel_stats,
                "latest": {edge: version for edge, (version, _) in self._versions.items()}}

    def _thread_stacks(self, skip_ident: int) -> list[dict]:
        """Where this process's threads are in the code (dataflow/actor/stacks.py), but the stack
        server's own (`skip_ident`), which calls this: it answers while the node blocks the loop."""
        return stacks.capture(skip_ident=skip_ident, loop_ident=self._loop_thread,
                              coro=getattr(self, "_node_run", None))

    def _report_peak_memory(self) -> None:
        """Emit `gpu/peak_mem_gb` (peak of torch's allocated bytes in this process) and
        `gpu/peak_reserved_gb` as a metrics record whenever the peak grew by >= 1%: a few records
        per node per run, so metrics.jsonl tells how much of its GPU each node needed."""
        if self.device != "cuda":
            return
        import torch

        peak = torch.cuda.max_memory_allocated() / 2**30
        if peak > 1.01 * getattr(self, "_peak_reported", 0.0) and peak > 0:
            self._peak_reported = peak
            self.emit({"kind": "metrics", "values": {
                "gpu/peak_mem_gb": round(peak, 3),
                "gpu/peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 3)}})
