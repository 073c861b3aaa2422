"""docs/settings.md, generated: every setting of every graph in graphs/, from its config dataclasses.

    python -m graphs.settings_reference            # print the page
    python -m graphs.settings_reference --write    # write docs/settings.md
    python -m graphs.settings_reference --check    # exit 1 when docs/settings.md is stale

Not a graph file: it reads them. A graph file here is one that defines `build(`.

Each graph file is loaded as `--describe` loads it (dataflow.driver.loading.load_graph: the graph's
`config` after build(), so a value is what runs when nothing is set) and its config tree walked
as `--describe` walks it (dataflow.config.flatten). A setting's constraint is read as the
pre-start checks read it (dataflow.checks.constraints_of), and a setting another one feeds is
named by the graph's rules (share / fill). The description is the attribute docstring under the
field, read from the class's source (the string literal right after the field, PEP 257's
"attribute docstring"); a subclass that redeclares a field without one keeps the base's.
tests/unit/test_settings_reference.py fails when the page differs from this script's output.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from dataflow.checks import Each, ExistingPath, OneOf, Range, constraints_of
from dataflow.config import flatten
from dataflow.driver.loading import load_graph

ROOT = Path(__file__).resolve().parent.parent
GRAPHS = tuple(f"graphs/{p.name}" for p in sorted((ROOT / "graphs").glob("*.py")) if "\ndef build(" in p.read_text())
PAGE = ROOT / "docs" / "settings.md"


@lru_cache(maxsize=None)
def _own_docs(cls: type) -> dict[str, str]:
    """{field: attribute docstring} declared in `cls`'s own body."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def field_doc(cls: type, name: str) -> str:
    """The attribute docstring of `name`, from `cls` or the nearest base class that has one."""
    for klass in cls.__mro__:
        if doc := _own_docs(klass).get(name):
            return doc
    return ""


def type_text(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_text(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def constraint_text(rule: Any) -> str:
    if isinstance(rule, Range):
        return rule.text() or "finite"
    if isinstance(rule, OneOf):
        return "one of " + ", ".join(map(repr, rule.choices))
    if isinstance(rule, Each):
        inner = constraint_text(rule.rule)
        return (f"{rule.count} values, each " if rule.count else "each ") + inner
    if isinstance(rule, ExistingPath):
        return f"an existing {rule.kind if rule.kind != 'any' else 'path'}" + (" or empty" if rule.optional else "")
    return type(rule).__name__


def _fields(config: Any) -> tuple[dict[str, Any], dict[str, list], type]:
    cls = type(config)
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
    return hints, constraints_of(cls), cls


def _rule_notes(config: Any) -> dict[str, str]:
    """{dotted target: how the graph's rules set it}."""
    notes = {}
    for rule in getattr(type(config), "rules", ()):
        if rule.kind == "check":
            continue
        name = getattr(rule.compute, "__name__", "<lambda>")
        source = (f"`{rule.source}`" if rule.source
                  else f"`{name}()`" if name != "<lambda>" else "the graph's rules")
        for target in rule.targets:
            notes[target] = (f"shared: takes {source}" if rule.kind == "share"
                             else f"while left at its default, filled from {source}")
    return notes


def settings(config: Any, prefix: str = "") -> list[dict]:
    """One row per leaf setting of the config tree, in declaration order."""
    rows = []
    hints, rules, cls = _fields(config)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        key = prefix + f.name
        if dataclasses.is_dataclass(value):
            rows.append({"key": key, "group": type(value).__name__, "doc": field_doc(cls, f.name)})
            rows += settings(value, key + ".")
            continue
        tp = hints.get(f.name, f.type)
        shown = [r for r in rules.get(f.name, ()) if not (isinstance(r, OneOf) and get_origin(tp) is Literal)]
        declared = (f.default if f.default is not dataclasses.MISSING
                    else f.default_factory() if f.default_factory is not dataclasses.MISSING else value)
        rows.append({"key": key, "type": type_text(tp), "default": value, "declared": declared,
                     "allowed": "; ".join(constraint_text(r) for r in shown), "doc": field_doc(cls, f.name)})
    return rows


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _value(value: Any) -> str:
    text = repr(str(value)) if isinstance(value, Path) else repr(value)
    return f"`{text}`" if len(text) < 60 else f"`{text[:57]}...`"


def _first(per_graph: dict, key: str) -> dict:
    return next(rows[key] for rows, _, _ in per_graph.values() if key in rows)


def _per_graph(texts: dict[str, str], names: dict) -> str:
    """"grpo, dapo: `8`; ppo: `1`": the graphs that agree named together."""
    by_text: dict[str, list[str]] = {}
    for p, text in texts.items():
        by_text.setdefault(text, []).append(names[p])
    return "; ".join(f"{', '.join(graphs)}: {text}" for text, graphs in by_text.items())


def _row(key: str, per_graph: dict, names: dict) -> str:
    found = {p: rows[key] for p, (rows, _, _) in per_graph.items() if key in rows}
    row = next(iter(found.values()))
    ruled = {per_graph[p][1].get(key) for p in found} - {None}
    # a filled setting's value depends on the others (e.g. weight_transport on placement): show its own default
    defaults = {p: r["declared"] if per_graph[p][1].get(key, "").startswith("while left") else r["default"]
                for p, r in found.items()}
    if len({repr(v) for v in defaults.values()}) == 1:
        default = _value(next(iter(defaults.values())))
    else:
        default = _per_graph({p: _value(v) for p, v in defaults.items()}, names)
    if len(found) < len(per_graph):
        default += " (only " + ", ".join(names[p] for p in found) + ")"
    doc = row["doc"]
    if len(ruled) == 1:
        note = next(iter(ruled))
        doc = (doc + " " if doc else "") + note[0].upper() + note[1:] + "."
    elif ruled:    # the graphs fill it from different settings: name each ("agent: ...; ppo, grpo: ...")
        doc = (doc + " " if doc else "") + _per_graph(
            {p: per_graph[p][1].get(key) or "set by hand" for p in found}, names) + "."
    allowed = {p: r["allowed"] for p, r in found.items()}
    if len(set(allowed.values())) == 1:
        allowed_text = next(iter(allowed.values()))
    else:
        allowed_text = _per_graph({p: a or "any" for p, a in allowed.items()}, names)
    return f"| `{key}` | {_cell(row['type'])} | {_cell(default)} | {_cell(allowed_text)} | {_cell(doc)} |"


# A graph that refuses to build without a setting is built with a stand-in value for it, and the
# page shows that setting's own default.
STAND_INS = {"graphs/agent.py": {"env.path": "examples/agents/guess_env.py"}}


def _load_for_page(path: str):
    stand_ins = STAND_INS.get(path, {})
    graph, config = load_graph(str(ROOT / path), [f"{k}={v}" for k, v in stand_ins.items()])
    for key in stand_ins:
        *parents, name = key.split(".")
        owner = config
        for part in parents:
            owner = getattr(owner, part)
        setattr(owner, name, getattr(type(owner)(), name))
    return graph, config


def render() -> str:
    per_graph = {}
    for path in GRAPHS:
        graph, config = _load_for_page(path)
        notes = _rule_notes(config)
        assert len(flatten(config)) == sum("type" in r for r in settings(config))
        per_graph[path] = ({r["key"]: r for r in settings(config)}, notes, type(config).__name__)
    keys: list[str] = []
    for rows, _, _ in per_graph.values():
        keys += [k for k in rows if k not in keys]
    names = {p: Path(p).stem for p in GRAPHS}
    out = [
        "# Settings reference",
        "",
        "<!-- Generated by `python -m graphs.settings_reference --write` from the config dataclasses;",
        "     do not edit by hand: tests/unit/test_settings_reference.py fails when this page is stale. -->",
        "",
        "Every setting of the graphs in graphs/ (" + ", ".join(
            f"`{p}` ({per_graph[p][2]})" for p in GRAPHS) + "), set with `--set key=value`",
        "(`--describe` prints the values a run would use). *Default* is the value a run uses when the",
        "setting is not set (the graph's config after build()); where graphs differ, each is named.",
        "*Allowed* is the constraint checked before anything starts (dataflow/checks.py); a setting",
        "the graph fills from another says so (its rules: dataflow/config.py share / fill).",
        "",
    ]
    header = ["| setting | type | default | allowed | description |", "|---|---|---|---|---|"]
    groups = [""] + [k for k in keys if "group" in _first(per_graph, k)]
    # A group the graph shares from another setting (prompts.policy <- policy) is one setting, set
    # there: its header says so and its fields are not repeated.
    shared = {k: n for _, notes, _ in per_graph.values() for k, n in notes.items() if k in groups}
    for group in groups:
        if any(group.startswith(s + ".") for s in shared):
            continue
        if group:
            row = _first(per_graph, group)
            out += ["", f"{'##' if '.' not in group else '###'} `{group}` ({row['group']})", ""]
            out += [_cell(row["doc"]), ""] if row["doc"] else []
            if group in shared:
                out += [shared[group].replace("shared: takes ", "The graph copies ") + " here: set that instead."]
                continue
        else:
            out += ["", "## Run and shared settings", ""]
        out += header
        for key in keys:
            if key.rpartition(".")[0] == group and "group" not in _first(per_graph, key):
                out.append(_row(key, per_graph, names))
    return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--write" in argv:
        PAGE.write_text(text)
    elif "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python -m graphs.settings_reference --write")
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
