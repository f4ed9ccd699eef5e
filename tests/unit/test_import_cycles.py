"""No import circle in the packages, and every import points down the layers.

The layers, lowest first: ``topology`` (pure planning), ``p2psync`` (the core), ``trainer`` and
``rollout`` (the two sides, peers: neither imports the other), ``demo`` (an application on all
of them). Inside the vLLM backend (``rollout.engines.vllm``) the same holds for its parts:
``placement`` < ``apply`` < ``worker`` < ``plugin`` < ``engine``.

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
GRAPHED = ("p2psync", "topology", "trainer", "rollout", "demo")
"""Packages whose modules make up the graph."""
CHECKED = ("p2psync", "topology", "trainer", "rollout", "demo")
"""Packages in which a circle fails the test."""
LAYERS: dict[str, int] = {"topology": 0, "p2psync": 1, "trainer": 2, "rollout": 2, "demo": 3}
"""Top-level package -> layer. A module may import its own package and lower layers only (so
two packages of one layer are peers that never import each other)."""
VLLM = "rollout.engines.vllm"
VLLM_LAYERS: dict[str, int] = {"placement": 0, "apply": 1, "worker": 2, "plugin": 3, "engine": 4}
"""Parts of the vLLM backend -> layer, by the same rule (the package's ``__init__`` is no part)."""


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


def _unit(mod: str) -> tuple[str, int] | None:
    """The package (or vLLM backend part) a module belongs to and that unit's layer."""
    top = mod.split(".")[0]
    if top not in LAYERS:
        return None
    return top, LAYERS[top]


def _vllm_part(mod: str) -> tuple[str, int] | None:
    if not mod.startswith(VLLM + "."):
        return None
    part = mod[len(VLLM) + 1:].split(".")[0]
    return (part, VLLM_LAYERS[part]) if part in VLLM_LAYERS else None


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that does not point down: ``a -> b`` where ``b``'s package is of a higher
    layer, or of the same layer but another package; the same inside the vLLM backend."""
    bad = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            for unit in (_unit, _vllm_part):
                ua, ub = unit(a), unit(b)
                if ua and ub and ua[0] != ub[0] and ub[1] >= ua[1]:
                    bad.append(f"{a} -> {b} ({ua[0]} may not import {ub[0]})")
    return bad


def test_imports_point_down_the_layers():
    bad = upward(import_graph(modules()))
    assert not bad, "imports up (or across) the layers:\n" + "\n".join(bad)


def test_the_layer_check_finds_an_import_up(tmp_path: Path):
    """An import from a lower layer to a higher one, and between the two peers, is found; one
    down the layers is not."""
    for pkg, body in {"topology": "import p2psync.x\n", "p2psync": "", "trainer": "", "rollout": "",
                      "demo": "import trainer\nimport rollout\nimport p2psync\n"}.items():
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(body)
    (tmp_path / "p2psync" / "x.py").write_text("import topology\n")
    (tmp_path / "rollout" / "y.py").write_text("def f():\n    from trainer import z\n")
    (tmp_path / "trainer" / "z.py").write_text("from p2psync import x\n")
    bad = upward(import_graph(modules(tmp_path, tuple(LAYERS))))
    assert bad == ["rollout.y -> trainer (rollout may not import trainer)",
                   "rollout.y -> trainer.z (rollout may not import trainer)",
                   "topology -> p2psync.x (topology may not import p2psync)"]


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
