"""What `--resume` continues from: an intact checkpoint, and the run's own settings.

    load_for_resume(graph_file, overrides, resume, allow_changed) -> (graph, config, checkpoint)

The checkpoint. `--resume` takes a checkpoint directory or a run directory (its latest
checkpoint). One that is half-written (step_<k>.tmp, or no manifest: its save never committed)
or damaged (a state.json that does not parse, a tensors.safetensors shorter than its header says:
a disk that filled up, a copy cut short) is refused in one line that names the file and the
newest intact checkpoint of the same run to resume instead, never the broken one. The check reads
headers and sizes only (no tensor is loaded), so it takes milliseconds before anything starts.

The settings. A run's settings are recorded when it starts (<run>/config.json) and in each
checkpoint's manifest ("settings"). Resuming starts from them, not from the graph file's defaults;
each `--set` changes only the setting it names. A `--set` that changes what the run is (the
batch, the group size, the model, the task or data, the reward: DEFINES_THE_RUN, or the graph
file's own `defines_the_run`) is refused naming the setting, unless `--allow-changed-settings`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any

from dataflow.actor import checkpoint
from dataflow.config import flatten
from dataflow.errors import UserError
from dataflow.driver.loading import import_graph_file, load_graph

# Settings whose change makes a resumed run another experiment (a key, a prefix ending in ".",
# or a leaf name matched at any depth). A graph file may declare its own `defines_the_run`.
DEFINES_THE_RUN = ("prompts_per_step", "group_size", "policy.", "prompts.path", "prompts.task",
                   "prompts.num_digits", "prompts.seed", "reward_kind", "reward.path", "reward.function",
                   "reward_model.path", "algorithm")
ALLOW_FLAG = "--allow-changed-settings"


def load_for_resume(graph_file: str, overrides: list[str], resume: str, allow_changed: bool = False):
    """(graph, config, checkpoint dir): the graph built from the run's recorded settings with
    `overrides` applied on top. UserError for a broken checkpoint or a refused change."""
    ckpt = checkpoint_to_resume(resume)
    recorded = recorded_settings(ckpt)
    if recorded is None:  # a checkpoint from before settings were recorded: the defaults, as then
        return (*load_graph(graph_file, overrides), ckpt)
    named = {item.split("=", 1)[0].strip(): item.split("=", 1)[1] for item in overrides if "=" in item}
    # The file's settings, learnt without building its graph: a graph whose defaults do not build
    # (graphs/agent.py wants env.path) resumes from the recorded settings as any other does.
    defaults = getattr(import_graph_file(graph_file), "config", None)
    known = dict(flatten(defaults)) if dataclasses.is_dataclass(defaults) else {}
    replay = [f"{k}={_as_text(v)}" for k, v in recorded.items() if k in known and k not in named]
    graph, config = load_graph(graph_file, replay + list(overrides))
    if not allow_changed and config is not None:
        now = {k: _jsonable(v) for k, v in flatten(config)}
        defining = _defining(graph_file)
        for key in named:
            if key in recorded and now.get(key) != recorded[key] and _matches(key, defining):
                raise UserError(f"--resume {ckpt}: --set {key}={named[key]} changes a setting that defines the run "
                                f"(it was {recorded[key]!r}); drop it to continue the same run, start a new run "
                                f"without --resume, or pass {ALLOW_FLAG} to change it anyway")
    return graph, config, ckpt


def checkpoint_to_resume(arg: str | Path) -> Path:
    """The checkpoint `--resume arg` names, intact; else UserError naming the one to use instead."""
    path = Path(arg)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path
    if path.name.startswith("step_") and not checkpoint.is_checkpoint(path):
        why = "a half-written checkpoint (its save never committed: no manifest.json)"
        if not path.exists():
            why = "no such checkpoint"
        raise UserError(f"--resume {path}: {why}; {_instead(run_dir, path)}")
    ckpt = checkpoint.resolve(path)
    problem = damage(ckpt)
    if problem:
        which = f"its latest checkpoint {ckpt.name}" if ckpt != path else "checkpoint"
        raise UserError(f"--resume {path}: {which} is damaged ({problem}); {_instead(run_dir, ckpt)}")
    return ckpt


def _instead(run_dir: Path, broken: Path) -> str:
    intact = newest_intact(run_dir, exclude=broken)
    if intact is None:
        return f"{run_dir} has no intact checkpoint to resume from; start the run again without --resume"
    return f"resume from the newest intact one instead: --resume {intact}"


def newest_intact(run_dir: Path, exclude: Path | None = None) -> Path | None:
    found = [p for p in checkpoint.checkpoints_dir(run_dir).glob("step_*")
             if checkpoint.is_checkpoint(p) and p != exclude]
    for p in sorted(found, key=lambda p: int(p.name.split("_", 1)[1]), reverse=True):
        if damage(p) is None:
            return p
    return None


def damage(ckpt: Path) -> str | None:
    """What is wrong with committed checkpoint `ckpt` (None: intact, as far as headers and sizes tell)."""
    try:
        manifest = checkpoint.read_manifest(ckpt)
    except (OSError, ValueError) as e:
        return f"{checkpoint.MANIFEST} unreadable: {e}"
    for replica in manifest.get("replicas", []):
        state_dir = ckpt / replica
        if not state_dir.is_dir():
            if replica in manifest.get("stale", {}) and manifest["stale"][replica] is None:
                continue  # died before its first save: nothing was kept for it
            return f"{replica}/ is missing"
        try:
            json.loads((state_dir / checkpoint.STATE_JSON).read_text())
        except (OSError, ValueError) as e:
            return f"{replica}/{checkpoint.STATE_JSON} unreadable: {type(e).__name__}: {e}"
        problem = safetensors_damage(state_dir / checkpoint.TENSORS)
        if problem:
            return f"{replica}/{checkpoint.TENSORS} {problem}"
    return None


def safetensors_extent(path) -> tuple[int, int | None, int | None]:
    """(the file's size, the bytes its header ends at, the bytes its data ends at) of a safetensors
    file: an 8-byte header length, a JSON header giving each tensor's byte range, then the data.
    None where the file is too short to say (no 8-byte length; a header cut off). Reads the header
    only. OSError: unreadable; ValueError: a corrupt header."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return size, None, None
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return size, 8 + n, None
        header = json.loads(f.read(n))
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    return size, 8 + n, 8 + n + max(ends, default=0)


def safetensors_damage(path: Path) -> str | None:
    """Why a checkpoint's safetensors file is not complete (None: it is as long as its header says)."""
    try:
        size, header_end, data_end = safetensors_extent(path)
    except OSError as e:
        return f"unreadable: {e.strerror or e}"
    except ValueError:
        return "has a corrupt header"
    if header_end is None:
        return f"is truncated ({size} bytes: not even its header)"
    if data_end is None:
        return f"is truncated ({size} bytes; its header alone needs {header_end})"
    if size < data_end:
        return f"is truncated ({size} of {data_end} bytes)"
    return None


def recorded_settings(ckpt: Path) -> dict | None:
    """The settings the checkpoint's run ran with: its manifest's, else <run>/config.json."""
    settings = checkpoint.read_manifest(ckpt).get("settings")
    if settings is None:
        config_json = ckpt.parent.parent / "config.json"
        try:
            settings = json.loads(config_json.read_text()) if config_json.is_file() else None
        except ValueError:
            raise UserError(f"--resume {ckpt}: {config_json} (the run's settings) is not valid JSON") from None
    return settings


def _defining(graph_file: str) -> tuple[str, ...]:
    import sys

    module = sys.modules.get(f"dataflow_graph_{Path(graph_file).stem}")
    return tuple(getattr(module, "defines_the_run", DEFINES_THE_RUN))


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) or key.endswith("." + p) for p in patterns)


def _as_text(value: Any) -> str:
    """A recorded (JSON) value as --set text that converts back to it (dataflow/config.py)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _jsonable(v: Any) -> Any:
    from dataflow.driver.monitor import _jsonable as jsonable

    return jsonable(v)
