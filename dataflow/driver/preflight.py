"""Inputs checked in the driver before Ray starts: model directories, datasets, reward files.

A config class (a node's Config, a part of one, or the graph's config) may define

    def preflight(self) -> list[str]:
        '''One line per problem with what this config points at; [] when all is well.'''

`input_problems(graph, config)` calls it on every config object of the graph (the graph's config
tree and every node's config and their nested configs), each object once, children before their
parent (a policy directory's problems come before the checks that need that policy), and puts the
setting's dotted key in front of each line (a PolicySpec's "path=/m: ..." under `policy` reads
"policy.path=/m: ..."). Equal configs in several places (the policy every node loads) are checked
once, under the first key: the message is the same whichever node would have read the input.
`dataflow.run` prints the lines and exits 2, in seconds, before Ray starts; without these checks the
same mistakes would surface in whichever node read the input first, after start-up.

A node kind may also define `check_settings(config, max_steps)` (a staticmethod raising UserError):
its cross-setting check, which `input_problems` runs on each node's config too, so a setting that
does not fit another is one line before Ray starts, not a node's failed setup after it.

The built-in nodes' checks are rl/preflight.py (PolicySpec.preflight; RLHFConfig.preflight for the
prompts -> generator -> reward pipeline of graphs/ppo.py, grpo.py, dapo.py). A user node kind
gets its own by defining `preflight` on its Config.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from dataflow.errors import UserError


def input_problems(graph, config: Any = None, max_steps: int | None = None,
                   seconds: dict[str, float] | None = None) -> list[str]:
    """The problems, one line each ([] = none); `seconds`, when given, gets each check's time by
    the setting it checks (the graph config's own check: `<its class>.preflight`) and the memory plan's."""
    lines: list[str] = _node_setting_problems(graph, max_steps)
    for key, part in _parts(graph, config):
        t0 = time.perf_counter()
        try:
            found = part.preflight()
        except UserError as e:   # a check that raises instead of returning lines
            found = [str(e)]
        except Exception as e:   # a broken check must not stop a run that may be fine: say so, go on
            print(f"[dataflow] warning: the input check of {key or type(part).__name__} raised "
                  f"{type(e).__name__}: {e}; going on without it", file=sys.stderr)
            continue
        finally:
            if seconds is not None:
                name = key or f"{type(part).__name__}.preflight"
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
        for line in found or ():
            text = f"{key}.{line}" if key and _names_a_field(line, part) else line
            if text not in lines:
                lines.append(text)
    memory = getattr(config, "memory_plan", None)    # a node that does not fit its GPU share
    if callable(memory) and not lines:                # (it reads the model dir checked above)
        t0 = time.perf_counter()
        try:
            plan = memory(graph)
        except Exception as e:   # as a broken check above: say so, go on
            print(f"[dataflow] warning: the memory plan raised {type(e).__name__}: {e}; going on without it",
                  file=sys.stderr)
            plan = None
        if seconds is not None:
            seconds["memory plan"] = time.perf_counter() - t0
        if plan is not None and plan.problem and plan.enforced:
            lines.append(f"memory plan: {plan.problem}")
    return lines


def _node_setting_problems(graph, max_steps: int | None) -> list[str]:
    """Each node kind's check_settings(config, max_steps) on its config (a replicated node once)."""
    lines: list[str] = []
    for spec in graph.nodes.values():
        check = getattr(spec.kind, "check_settings", None)
        if check is None:
            continue
        try:
            check(spec.config, max_steps if max_steps is not None else graph.max_steps)
        except UserError as e:
            if str(e) not in lines:
                lines.append(str(e))
    return lines


def _names_a_field(line: str, part: Any) -> bool:
    """Whether `line` starts with one of `part`'s own settings ("path=..."), to be prefixed."""
    head = line.split("=", 1)[0].split(":", 1)[0]
    return any(f.name == head for f in dataclasses.fields(part))


def _parts(graph, config: Any) -> list[tuple[str, Any]]:
    """(dotted key, config object) with a `preflight` method, children first, each object once and
    each value once (the first key of equal configs)."""
    out: list[tuple[str, Any]] = []
    seen_ids: set[int] = set()

    def walk(obj: Any, key: str) -> None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type) or id(obj) in seen_ids:
            return
        seen_ids.add(id(obj))
        for f in dataclasses.fields(obj):
            walk(getattr(obj, f.name), f"{key}.{f.name}" if key else f.name)
        if callable(getattr(type(obj), "preflight", None)) and not any(
                type(other) is type(obj) and other == obj for _, other in out):
            out.append((key, obj))

    walk(config, "")
    for node in graph.nodes.values():
        walk(node.config, node.name)
    return out
