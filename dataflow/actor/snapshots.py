"""Snapshots: a replica's latest state between checkpoints, for its restart.

A replica restarted after its process died (dataflow/driver/restarts.py) loads its snapshot if it has a
newer one than its state in the last checkpoint (restore_dir), else that state. A node may write
its state between checkpoints with write_snapshot() to <run>/snapshots/<replica>/ (replaced
atomically each time; cleared when a run starts, so a resumed run never loads its predecessor's).
The critic does after every critic.snapshot_interval training passes, so a restarted critic keeps
its training since the last checkpoint; "progress" (training passes) in its state says which of
snapshot and checkpoint is newer. It comes back without the samples it had received but not
trained on: those of batches not yet trained are re-issued and reach it again; those of batches
the learner has trained already are lost to the critic's training (not to the learner's). The
files are a checkpoint replica's (dataflow/actor/checkpoint.py: state.json + tensors.safetensors).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dataflow.actor import checkpoint


def snapshot_dir(run_dir: str | Path, replica: str) -> Path:
    return Path(run_dir) / "snapshots" / replica


def write_snapshot(run_dir: str | Path, replica: str, node_state: dict) -> None:
    """Replace `replica`'s snapshot with `node_state` (and the process RNG states), atomically:
    written to <replica>.tmp, then swapped in. `node_state` must hold a "progress" counter that
    grows with every change worth keeping (restore_dir compares it with the last checkpoint's)."""
    final = snapshot_dir(run_dir, replica)
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    # Not fsynced: a snapshot has to outlive its process, not the machine (the page cache does),
    # and the fsyncs would cost more than the write (about 100 ms of a ~5 ms write here).
    checkpoint.write_state(tmp, {"node": node_state, "rng": checkpoint.rng_state(), "steps": 0}, durable=False)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def clear_snapshots(run_dir: str | Path) -> None:
    """At a run's start: snapshots of an earlier run in the same directory (a resumed one's
    future) must never be loaded."""
    shutil.rmtree(Path(run_dir) / "snapshots", ignore_errors=True)


def restore_dir(run_dir: str | Path, last: Path | None, replica: str) -> Path | None:
    """Where a restarted `replica` loads its state from: its snapshot if that is newer (a higher
    "progress") than its state in the last checkpoint `last`, else that state (None: neither)."""
    saved = checkpoint.replica_state_dir(last, replica) if last is not None else None
    snap = snapshot_dir(run_dir, replica)
    if not (snap / checkpoint.STATE_JSON).is_file():
        snap = snap.with_name(snap.name + ".old")  # a crash between the two renames
        if not (snap / checkpoint.STATE_JSON).is_file():
            return saved

    def progress(d: Path) -> int:
        node = json.loads((d / checkpoint.STATE_JSON).read_text()).get("node")
        return node.get("progress", -1) if isinstance(node, dict) else -1

    return snap if saved is None or progress(snap) > progress(saved) else saved
