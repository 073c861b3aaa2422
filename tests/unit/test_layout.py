"""The house's layout: no import loop between the engine's modules, and docs/architecture.md's file
map names exactly the engine's files, each on a line of its own.

Imports are read from the syntax tree (every `import` and `from ... import`, at module level, in
functions and under `if TYPE_CHECKING:`), so a loop hidden in a function body counts too: it still
ties the two files together, and it breaks as soon as one of them imports the other at the top.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ("dataflow", "rl", "nodes", "graphs", "examples")
MAP = ROOT / "docs" / "architecture.md"
MAP_HEADING = "## Map of the engine's files"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_files() -> list[Path]:
    return sorted(p for top in ENGINE for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The engine modules `path` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from package, one dot per level
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:   # import a.b.c where only a.b is ours: a.b
                name = name.rpartition(".")[0]
            if name and name != this:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = engine_files()
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_loop_and_passes_a_tree():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_imports_are_read_in_functions_and_resolved_to_modules(tmp_path):
    file = ROOT / "rl" / "preflight.py"
    modules = {module_name(p) for p in engine_files()}
    found = imports_of(file, modules)
    assert "rl.data.policy" in found            # module level
    assert "rl.reward.reward_fn" in found       # inside a function
    assert "rl.data.tasks" in found             # `from rl.data import tasks`: the module, not the package


def test_no_import_loop_in_the_engine():
    loops = cycles(import_graph())
    graph = import_graph()
    lines = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a] & set(c)))
             for c in loops]
    assert not loops, "import loops (break each by moving the shared part to a module both may import):\n" + \
        "\n".join(lines)


def map_section() -> list[str]:
    text = MAP.read_text()
    assert MAP_HEADING in text, f"{MAP} has no section {MAP_HEADING!r}"
    section = text.split(MAP_HEADING, 1)[1]
    return section.split("\n## ", 1)[0].splitlines()


def mapped_files() -> list[str]:
    return [m for line in map_section() for m in re.findall(r"`([\w./-]+\.py)`", line)]


def listed_files() -> set[str]:
    """Every engine file but a package's __init__.py that holds nothing but its docstring."""
    out = set()
    for p in engine_files():
        if p.name == "__init__.py":
            body = ast.parse(p.read_text()).body
            if all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body):
                continue
        out.add(p.relative_to(ROOT).as_posix())
    return out


def test_the_file_map_names_every_engine_file_once_and_no_other():
    mapped = mapped_files()
    missing = sorted(listed_files() - set(mapped))
    unknown = sorted(f for f in set(mapped) if not (ROOT / f).is_file())
    twice = sorted({f for f in mapped if mapped.count(f) > 1})
    assert not missing, f"{MAP.name}'s file map lacks (add a line saying each one's role): {missing}"
    assert not unknown, f"{MAP.name}'s file map names files that do not exist: {unknown}"
    assert not twice, f"{MAP.name}'s file map names these more than once: {twice}"


def test_each_file_of_the_map_has_a_line_saying_its_role():
    for line in map_section():
        files = re.findall(r"`([\w./-]+\.py)`", line)
        if files:
            assert len(files) == 1, f"one file per line in the map: {line!r}"
            role = line.split(f"`{files[0]}`", 1)[1].strip(" -:")
            assert len(role) >= 10, f"say what {files[0]} is for: {line!r}"
