"""Where a run's metrics go besides metrics.jsonl: TensorBoard, wandb, rollouts.jsonl; and the
validation lines of the console (a progress line per round, a before/after table at the end).

The graph's `loggers` setting picks the sinks (Graph.loggers: "tensorboard", "wandb", or both,
e.g. `loggers=tensorboard,wandb`); each needs its package (pip install tensorboard / wandb) and
says so if it is missing. The driver's Monitor (dataflow/driver/monitor.py) hands every record it writes
to metrics.jsonl to `RunLoggers.record`, with the rollouts a node sent along (the reward node's
training rollouts, the evaluator's validation ones), which always go to <run>/rollouts.jsonl.

  TensorBoard  <run>/tensorboard/: every number of every record as a scalar (same names as in
               metrics.jsonl), at the learner step it was logged at (a validation record at its
               val/step); rollouts as a text table per kind ("rollouts/train", "rollouts/val").
  wandb        one run in <run>/wandb (project: $WANDB_PROJECT or the graph's name); offline with
               WANDB_MODE=offline (no network; `wandb sync` uploads later). The same scalars (x
               axis "step", validation ones "val/step"), rollouts as a wandb.Table, the config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dataflow.errors import UserError

KNOWN = ("tensorboard", "wandb")
HIDDEN = ("time_s", "node")   # not metrics
VAL_INFO = ("val/step", "val/prompts", "val/samples_failed", "val/version_min", "val/version_max",
            "val/response_length/mean", "val/duplicates_dropped")


def parse(loggers) -> list[str]:
    """["tensorboard", "wandb"] from a list or "tensorboard,wandb"; an unknown name is a UserError."""
    names = [n.strip() for n in (loggers.split(",") if isinstance(loggers, str) else loggers or []) if n.strip()]
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise UserError(f"loggers: unknown '{unknown[0]}'; choose from {', '.join(KNOWN)} (comma-separated)")
    return names


def problems(loggers) -> list[str]:
    """What is wrong with a `loggers` setting (unknown names, packages not installed), checked
    with the graph before anything starts."""
    import importlib.util

    try:
        names = parse(loggers)
    except UserError as e:
        return [str(e)]
    package = {"tensorboard": "tensorboard", "wandb": "wandb"}
    return [f"loggers={name} needs the {package[name]} package: pip install {package[name]}"
            for name in names if importlib.util.find_spec(package[name]) is None]


class RunLoggers:
    """The sinks of one run, opened by the Monitor; `record` per metrics record, `close` at the end."""

    def __init__(self, run_dir: Path, loggers, config: dict | None = None, name: str = "run",
                 resume: bool = False):
        names = parse(loggers)
        self.run_dir = Path(run_dir)
        self.tb = self.wandb = None
        self.val_records: list[dict] = []
        self.rollouts_path = self.run_dir / "rollouts.jsonl"
        self._rollouts_file = None
        self._rollouts_mode = "a" if resume else "w"
        if "tensorboard" in names:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("loggers=tensorboard needs the tensorboard package: pip install tensorboard") from None
            self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in names:
            try:
                import wandb
            except ImportError:
                raise UserError("loggers=wandb needs the wandb package: pip install wandb "
                                "(WANDB_MODE=offline runs with no network)") from None
            self._wandb = wandb
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", name), dir=str(self.run_dir),
                                    name=self.run_dir.name, config=config or {}, reinit=True)
            self.wandb.define_metric("step")
            self.wandb.define_metric("val/step")
            self.wandb.define_metric("val/*", step_metric="val/step")
            self.wandb.define_metric("*", step_metric="step")

    def record(self, record: dict, step: int, rollouts: list[dict] | None = None) -> str | None:
        """Send one record's numbers (at the learner step `step` it was logged at, or its val/step)
        and its rollouts to the sinks. Returns the console line for a validation record, else None."""
        scalars = {k: v for k, v in record.items()
                   if k not in HIDDEN and k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        at = int(record.get("val/step", record.get("step", step)))
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, at)
        if self.wandb is not None and scalars:
            self.wandb.log({**scalars, "step": int(record.get("step", step))})
        if rollouts:
            self._rollouts(rollouts, at)
        if self.tb is not None:
            self.tb.flush()   # a crashed run keeps what it logged
        if "val/step" in record:
            self.val_records.append(record)
            return progress_line(record)
        return None

    def _rollouts(self, rows: list[dict], at: int) -> None:
        if self._rollouts_file is None:
            self._rollouts_file = open(self.rollouts_path, self._rollouts_mode)
        for row in rows:
            self._rollouts_file.write(json.dumps(row, default=str) + "\n")
        self._rollouts_file.flush()
        kinds: dict[str, list[dict]] = {}
        for row in rows:
            kinds.setdefault(row.get("kind", "train"), []).append(row)
        for kind, group in kinds.items():
            if self.tb is not None:
                self.tb.add_text(f"rollouts/{kind}", rollout_table(group), at)
            if self.wandb is not None:
                table = self._wandb.Table(columns=["step", "version", "reward", "prompt", "response"],
                                          data=[[r.get("step"), r.get("version"), r.get("reward"),
                                                 str(r.get("prompt")), str(r.get("response"))] for r in group])
                self.wandb.log({f"rollouts/{kind}": table, "step": at})

    def close(self) -> str:
        """Flush and close every sink; returns the end-of-run validation table ("" if none)."""
        if self._rollouts_file is not None:
            self._rollouts_file.close()
            self._rollouts_file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        return summary(self.val_records)


def rollout_table(rows: list[dict]) -> str:
    """A markdown table (TensorBoard renders it): step, version, reward, prompt, response."""
    def cell(v: Any) -> str:
        text = f"{v:.3f}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "<br>")
    lines = ["| step | version | reward | prompt | response |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in ("step", "version", "reward", "prompt", "response")) + " |"
              for r in rows]
    return "\n".join(lines)


def _score_keys(record: dict) -> list[str]:
    return [k for k in record if k.startswith("val/") and k not in VAL_INFO and ("mean@" in k or "pass@" in k)]


def progress_line(record: dict) -> str:
    """`val step  2 | mean@1 0.250 | mean@4 0.188 | pass@4 0.500 | 16 prompts` (overall scores)."""
    parts = [f"val step {record['val/step']:>2}"]
    parts += [f"{k[4:]} {record[k]:.3f}" for k in _score_keys(record) if k.count("/") == 1]
    parts.append(f"{record.get('val/prompts', '?')} prompts")
    versions = (record.get("val/version_min"), record.get("val/version_max"))
    if versions[0] is not None and versions[0] != versions[1]:
        parts.append(f"policy versions {versions[0]}..{versions[1]}")
    return " | ".join(parts)


def summary(records: list[dict]) -> str:
    """The first (before training, with val.before_train) and the last validation round, side by side."""
    if not records:
        return ""
    first, last = records[0], records[-1]
    shown = [first] if first is last else [first, last]
    keys = _score_keys(last)
    width = max(len(k) for k in keys) if keys else 8
    head = "validation".ljust(width + 2) + "".join(f"{'step ' + str(r['val/step']):>10}" for r in shown)
    lines = [head] + ["  " + k[4:].ljust(width) + "".join(
        f"{r[k]:>10.3f}" if isinstance(r.get(k), (int, float)) else f"{'-':>10}" for r in shown) for k in keys]
    return "\n".join(lines)
