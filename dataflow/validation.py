"""The rules a graph must satisfy before any actor starts (Graph.validate): node kinds, configs
and resources, ports and channels, versioned edges, placement, cycles. Every problem names the
file:line of its declaration and what to change."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dataflow.node import Node


def graph_problems(graph, source: str) -> list[str]:
    """Every problem of `graph` (a dataflow.graph.Graph), each a line of the GraphError."""
    problems = list(graph._problems)
    if graph.stall_action not in ("stop", "warn"):
        problems.append(f"{source}: stall_action must be 'stop' or 'warn' (got {graph.stall_action!r})")
    if not isinstance(graph.keep_checkpoints, int) or graph.keep_checkpoints < 0:
        problems.append(f"{source}: keep_checkpoints must be an integer >= 0 (got {graph.keep_checkpoints!r}); "
                        "0 keeps every checkpoint")
    from dataflow.driver import loggers

    problems += [f"{source}: {p}" for p in loggers.problems(graph.loggers)]
    for spec in graph.nodes.values():
        problems += _node_problems(spec)
        if spec.side is not None and spec.side not in ("rollout", "train"):
            problems.append(f"{spec.where}: node '{spec.name}': side must be 'rollout' or 'train' (got {spec.side!r})")
        elif spec.side is not None and graph.placement is None:
            problems.append(f"{spec.where}: node '{spec.name}' has side='{spec.side}', but no GPU preset places it; "
                            "call g.place('cpu' | 'colocated' | 'split', num_gpus=N) after declaring the nodes")
    if not problems:  # pools, and which GPU each replica gets (needs sound node resources)
        from dataflow import placement

        problems += placement.problems(graph)
    bound: dict[tuple[str, str, str], str] = {}  # (node, direction, port) -> channel
    for ch in graph.channels.values():
        at = f"{ch.where}: channel '{ch.name}'"
        if not isinstance(ch.capacity, int) or isinstance(ch.capacity, bool) or ch.capacity < 1:
            problems.append(f"{at}: capacity must be an integer >= 1 (got {ch.capacity!r})")
        if not ch.src:
            problems.append(f"{at} has no producer: give src='node.port'")
        if not ch.dst:
            problems.append(f"{at} has no consumer: give dst='node.port'")
        for direction, ports in (("output", ch.src), ("input", ch.dst)):
            for node, port in ports:
                spec = graph.nodes.get(node)
                if spec is None:
                    problems.append(f"{at}: unknown node '{node}' (nodes: {', '.join(graph.nodes) or 'none'})")
                    continue
                declared = getattr(spec.kind, "outputs" if direction == "output" else "inputs", ())
                if port not in declared:
                    problems.append(f"{at}: node '{node}' ({spec.kind.__name__}) has no {direction} port '{port}'"
                                    f" ({direction} ports: {', '.join(declared) or 'none'})")
                    continue
                key = (node, direction, port)
                if key in bound:
                    problems.append(f"{at}: {direction} port '{node}.{port}' is already connected to channel '{bound[key]}'")
                bound[key] = ch.name
    for spec in graph.nodes.values():
        if not is_node_class(spec.kind):
            continue
        for direction, ports in (("input", spec.kind.inputs), ("output", spec.kind.outputs)):
            for port in ports:
                if (spec.name, direction, port) not in bound:
                    problems.append(f"{spec.where}: node '{spec.name}': {direction} port '{port}' is not connected;"
                                    f" add g.channel(...) with {'dst' if direction == 'input' else 'src'}='{spec.name}.{port}'")
    for edge in graph.versioned_edges.values():
        at = f"{edge.where}: versioned edge '{edge.name}'"
        for node, attr in [(edge.src, "publishes")] + [(d, "subscribes") for d in edge.dst]:
            spec = graph.nodes.get(node)
            if spec is None:
                problems.append(f"{at}: unknown node '{node}'")
            elif is_node_class(spec.kind) and edge.name not in getattr(spec.kind, attr):
                problems.append(f"{at}: node '{node}' ({spec.kind.__name__}) does not list '{edge.name}' in {attr}")
    if not problems:
        cycle = find_cycle(graph)
        if cycle:
            problems.append(f"{graph.channels[cycle[0]].where}: channels {' -> '.join(cycle)} form a cycle;"
                            " pass feedback=True to the channel that closes it if the loop is intended")
    if not graph.nodes and not problems:
        problems.append(f"{source}: the graph has no nodes")
    return problems


def find_cycle(graph) -> list[str] | None:
    """A list of channel names forming a cycle over non-feedback channels, or None."""
    out_edges: dict[str, list[tuple[str, str]]] = {n: [] for n in graph.nodes}
    for ch in graph.channels.values():
        if ch.feedback:
            continue
        for a, _ in ch.src:
            for b, _ in ch.dst:
                out_edges[a].append((b, ch.name))
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        for nxt, ch_name in out_edges[node]:
            stack.append(ch_name)
            if state.get(nxt) == 1:
                return list(stack)
            if nxt not in state and (found := visit(nxt)):
                return found
            stack.pop()
        state[node] = 2
        return None

    for n in graph.nodes:
        if n not in state and (found := visit(n)):
            return found
    return None


def is_node_class(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, Node)


def _node_problems(spec) -> list[str]:
    at = f"{spec.where}: node '{spec.name}'"
    if not is_node_class(spec.kind):
        return [f"{at}: {spec.kind!r} is not a Node subclass (from dataflow import Node)"]
    problems = []
    want = spec.kind.Config
    if want is not None and not isinstance(spec.config, want):
        problems.append(f"{at}: config must be a {want.__name__} (got {type(spec.config).__name__})")
    elif want is not None and dataclasses.is_dataclass(want):
        problems += [f"{at}: {p}" for p in _field_type_problems(spec.config)]
    if not isinstance(spec.replicas, int) or spec.replicas < 1:
        problems.append(f"{at}: replicas must be an integer >= 1 (got {spec.replicas!r})")
    if not isinstance(spec.cpus, (int, float)) or spec.cpus < 0:
        problems.append(f"{at}: cpus must be >= 0 (got {spec.cpus!r})")
    if not isinstance(spec.gpus, (int, float)) or spec.gpus < 0 or (spec.gpus > 1 and not float(spec.gpus).is_integer()):
        problems.append(f"{at}: gpus must be a fraction <= 1 or a whole number (got {spec.gpus!r})")
    return problems


def _field_type_problems(config: Any, prefix: str = "") -> list[str]:
    """Scalar fields whose value does not match the declared type (a wrong type in a graph file)."""
    from dataflow.config import _resolved_hints

    problems = []
    hints = _resolved_hints(type(config))
    for f in dataclasses.fields(config):
        value, tp = getattr(config, f.name), hints.get(f.name)
        if dataclasses.is_dataclass(value):
            problems += _field_type_problems(value, f"{prefix}{f.name}.")
        elif tp in (int, float, str, bool):
            ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
            if tp is float and isinstance(value, int) and not isinstance(value, bool):
                ok = math.isfinite(value)
            if not ok:
                problems.append(f"setting {prefix}{f.name} must be {tp.__name__} (got {value!r})")
    return problems
