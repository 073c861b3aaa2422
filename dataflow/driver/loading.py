"""Graph files: import one and build its Graph (load_graph), and print what it declares (describe).

    load_graph(path, overrides) -> (graph, config)   user mistakes raise UserError, nothing started
    import_graph_file(path) -> module                the file imported, nothing built (its defaults)
    describe(graph, config) -> str                   --describe: nodes, channels, placement, settings

Every setting's declared range (dataflow/checks.py) is checked after --set and before build(), so
--describe and a run refuse the same values, all of them at once (SettingProblems: one line each).
After build() they are checked again: the shared settings were resolved by then (a value shared
from another setting is named by that one), and a node's config outside the graph's `config`
tree (a graph file that builds its configs in build()) is named by the node.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

from dataflow import placement
from dataflow.checks import SettingProblems, problems
from dataflow.config import apply_overrides, flatten, resolve
from dataflow.errors import ConfigError, UserError
from dataflow.graph import Graph

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def load_graph(path: str, overrides: list[str] = ()) -> tuple[Graph, Any]:
    """Import a graph file and build its Graph with --set overrides applied. Returns (graph, config)."""
    file = Path(path)
    module = import_graph_file(path)
    config = getattr(module, "config", None)
    if overrides:
        if config is None or not dataclasses.is_dataclass(config):
            raise ConfigError(f"{path}: --set given, but the graph file defines no `config` dataclass to set")
        config = apply_overrides(config, list(overrides))
    if found := _merge(problems(config), _resolved_problems(config)):   # before build(), all at once
        raise SettingProblems(found)
    if hasattr(module, "build"):
        try:
            graph = module.build(config) if config is not None else module.build()
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{_user_frame(e, file)}: build() raised {type(e).__name__}: {e}") from None
    elif isinstance(getattr(module, "graph", None), Graph):
        graph = module.graph
    else:
        raise UserError(f"{path}: defines neither `build(config) -> Graph` nor `graph = Graph(...)`; add one")
    if not isinstance(graph, Graph):
        raise UserError(f"{path}: build() returned {type(graph).__name__}, expected a dataflow Graph")
    if found := built_problems(graph, config):
        raise SettingProblems(found)
    graph.validate(source=path)
    apply_memory_plan(graph, config)
    return graph, config


def import_graph_file(path: str):
    """The graph file imported (as dataflow_graph_<stem>), nothing built: its `config` holds its
    defaults, whether or not they build a graph (graphs/agent.py refuses to without env.path)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{path}: no such graph file")
    for p in (str(PROJECT_ROOT), str(file.resolve().parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    module_name = f"dataflow_graph_{file.stem}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise UserError(f"{path}:{e.lineno}: syntax error: {e.msg}\n    {(e.text or '').strip()}") from None
    except Exception as e:
        raise UserError(f"{_user_frame(e, file)}: {type(e).__name__}: {e}") from None
    # Node classes defined in the graph file itself travel to the actors by value.
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)

    return module


def apply_memory_plan(graph: Graph, config: Any) -> None:
    """A graph config's memory plan (graphs/rlhf.py: memory_plan(graph) sets the GPU shares and
    micro-batch budgets the user left at their defaults). One that raises (a policy directory that
    is not there) is left to the input check and --describe, which name the cause."""
    memory = getattr(config, "memory_plan", None)
    if callable(memory):
        try:
            memory(graph)
        except Exception:
            pass


def _user_frame(e: BaseException, file: Path) -> str:
    """file:line of the deepest traceback frame inside the graph file (else the file)."""
    where = str(file)
    for frame in traceback.extract_tb(e.__traceback__):
        if Path(frame.filename).resolve() == file.resolve():
            where = f"{file}:{frame.lineno}"
    return where


def built_problems(graph: Graph, config: Any) -> list[str]:
    """Declared ranges broken after build(): in the config (build() may set values; a shared value is
    named by its source setting) and in node configs that are not part of it (named by the node)."""
    seen: set[int] = set()
    found = _merge([], [_by_source(line, config) for line in problems(config, seen=seen)]) if config is not None else []
    for node in graph.nodes.values():
        found += [f"node '{node.name}': {line}" for line in problems(node.config, seen=seen)]
    return found


def _resolved_problems(config: Any) -> list[str]:
    """Ranges broken once the config's rules have run (a value shared or filled from another), on a
    copy: reported with the user's own values, in the same breath. A rule that fails is build()'s to
    report."""
    if config is None or not dataclasses.is_dataclass(config) or not getattr(type(config), "rules", ()):
        return []
    try:
        resolved = resolve(copy.deepcopy(config))
    except Exception:
        return []
    return [_by_source(line, config) for line in problems(resolved)]


def _merge(found: list[str], more: list[str]) -> list[str]:
    """`found` and the lines of `more` about settings it does not name yet (one line per setting)."""
    out = list(found)
    for line in more:
        if line.split("=", 1)[0] not in (f.split("=", 1)[0] for f in out):
            out.append(line)
    return out


def _by_source(line: str, config: Any) -> str:
    """`learner.temperature=0.0: why` -> `generator.temperature=0.0: why (the graph shares it with
    learner.temperature, ...)` for a target of a config's share rule, or of a fill rule from another
    setting (a filled value the user did not set): the user sets the source, not the copy."""
    for rule in getattr(type(config), "rules", ()):
        if rule.kind not in ("share", "fill") or not rule.source:
            continue
        for target in rule.targets:
            if line.startswith(f"{target}=") and (rule.kind == "share" or _left_at_default(config, target)):
                value, why = line[len(target) + 1:].split(": ", 1)
                verb = "shares it with" if rule.kind == "share" else "fills in from it"
                return f"{rule.source}={value}: {why} (the graph {verb} {', '.join(rule.targets)})"
            if rule.kind == "share" and line.startswith(f"{target}."):   # inside a shared sub-config
                shared = f"(the graph shares {rule.source} with {', '.join(rule.targets)})"
                return f"{rule.source}{line[len(target):]} {shared}"
    return line


def _left_at_default(config: Any, key: str) -> bool:
    *path, name = key.split(".")
    for part in path:
        config = getattr(config, part)
    f = next(f for f in dataclasses.fields(config) if f.name == name)
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
    return getattr(config, name) == default


def describe(graph: Graph, config: Any = None) -> str:
    memory = getattr(config, "memory_plan", None)    # a graph config may plan its GPU memory (graphs/rlhf.py)
    try:   # first: an applied plan sets the shares the node lines show
        plan, failed = (memory(graph) if callable(memory) else None), None
    except Exception as e:      # e.g. a policy dir without config.json: the input checks name it
        plan, failed = None, f"memory plan: not computed ({type(e).__name__}: {e})"
    lines = [f"graph '{graph.name}'", "nodes:"]
    for n in graph.nodes.values():
        res = f"cpus={n.cpus:g} gpus={n.gpus:g}" + (f" pool={n.pool}" if n.pool else "")
        lines.append(f"  {n.name:<12} {n.kind.__name__:<16} replicas={n.replicas} {res}"
                     f"{'  (ends the run)' if n.ends_run else ''}")
    lines.append("channels:")
    for c in graph.channels.values():
        src = ", ".join(f"{a}.{b}" for a, b in c.src)
        dst = ", ".join(f"{a}.{b}" for a, b in c.dst)
        lines.append(f"  {c.name:<12} {src} -> {dst}  capacity={c.capacity}{'  feedback' if c.feedback else ''}")
    if graph.versioned_edges:
        lines.append("versioned edges (latest wins):")
        for e in graph.versioned_edges.values():
            lines.append(f"  {e.name:<12} {e.src} -> {', '.join(e.dst)}")
    lines.append("placement: " + placement.plan(graph).text())
    if failed:
        lines.append(failed)
    if plan is not None:
        lines.append(plan.text())
    if config is not None and dataclasses.is_dataclass(config):
        lines.append("settings (--set key=value):")
        lines += [f"  {k} = {v!r}" for k, v in flatten(config)]
    return "\n".join(lines)
