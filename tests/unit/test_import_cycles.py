"""No import circle in the packages: the import graph of their source files has no cycle.

Built with :mod:`ast` from the source (nothing is imported). An edge ``a -> b`` is any import
of ``b`` in ``a``, at module level or inside a function, including imports under
``if TYPE_CHECKING:`` (a type-only circle is still two modules that need each other to be
read). ``from pkg import name`` counts as an import of ``pkg`` itself (its ``__init__`` runs
and is read) and of ``pkg.name`` when that is a module; ``import pkg.mod`` and
``from pkg.mod import x`` count as imports of ``pkg.mod`` only (a package ``__init__`` that
re-exports its own modules is not a circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRAPHED = ("p2psync", "topology", "trainer", "rollout")
"""Packages whose modules make up the graph."""
CHECKED = ("p2psync", "topology", "trainer", "rollout")
"""Packages in which a circle fails the test."""


def modules(root: Path = ROOT, packages: tuple[str, ...] = GRAPHED) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The module that an import of ``name`` reads (the longest known prefix)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = [src] + [f"{src}.{a.name}" for a in node.names if f"{src}.{a.name}" in mods]
            for t in targets:
                owner = _owner(t, mods)
                if owner is not None and owner != mod:
                    graph[mod].add(owner)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one
    circle through its modules (sorted by name, starting from the smallest)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # recursion depth: the longest import chain
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(c, graph) for c in sorted(found)]


def _circle(comp: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A path ``a -> ... -> a`` inside one component, through as many of its modules as a
    depth-first walk finds (enough to name the loop)."""
    members = set(comp)
    start = comp[0]
    path = [start]
    seen = {start}
    while True:
        nxt = sorted(graph[path[-1]] & members)
        fresh = [n for n in nxt if n not in seen]
        if fresh:
            path.append(fresh[0])
            seen.add(fresh[0])
            continue
        back = [n for n in nxt if n in path]
        return path[path.index(back[0]):] + [back[0]] if back else path


def test_no_import_circle():
    graph = import_graph(modules())
    bad = [c for c in cycles(graph) if any(m.split(".")[0] in CHECKED for m in c)]
    assert not bad, "import circles:\n" + "\n".join(" -> ".join(c) for c in bad)


def test_the_check_finds_a_circle(tmp_path: Path):
    """The graph builder sees module-level, function-level and TYPE_CHECKING imports."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import B\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("import pkg.sub.b\n")
    graph = import_graph(modules(tmp_path, ("pkg",)))
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg", "pkg.c"}
    assert graph["pkg.d"] == {"pkg.sub.b"}  # not pkg.sub: a re-exporting __init__ is no circle
    assert cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.c", "pkg.a"]]
