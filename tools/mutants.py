"""The mutants of tools/mutation_check.py: where a module can be broken, and the broken module.

:func:`sites` lists every rewrite the unit-test check makes on the given lines (a comparison turned
around, ``and``/``or`` swapped, ``+``/``-`` swapped, a condition negated, an integer moved by one,
``True``/``False`` swapped, ``return None``); :func:`meaningful_sites` the few a reviewer would call a
bug, for integration files (a check dropped where the test reached its ``raise``, a comparison turned
around or moved across its boundary, ``x + 1`` made ``x``, a condition negated, ``return None``).
Neither touches a compiled (numba) kernel, a log or an error message, or a setting (a module-level
constant, a default, a class option, ``if TYPE_CHECKING``). :func:`mutate` returns the source with one
site rewritten. Pure functions of the source text: nothing here runs a test or writes a file.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

_FLIP = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_QUIET_CALLS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


def _jitted(fn: ast.AST) -> bool:
    decos = getattr(fn, "decorator_list", [])
    return any("jit" in ast.unparse(d) or "vectorize" in ast.unparse(d) for d in decos)


def _excluded_lines(tree: ast.Module) -> set[int]:
    """Lines not to mutate: compiled kernels, decorators, raise statements and log calls."""
    out: set[int] = set()
    for node in ast.walk(tree):
        span: ast.stmt | ast.expr | None = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for d in node.decorator_list:  # compile options, caching flags
                out.update(range(d.lineno, (d.end_lineno or d.lineno) + 1))
            if not isinstance(node, ast.ClassDef) and _jitted(node):
                span = node
        elif isinstance(node, (ast.Raise, ast.Assert)):
            span = node
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _QUIET_CALLS):
            span = node
        if span is not None:
            out.update(range(span.lineno, (span.end_lineno or span.lineno) + 1))
    return out


def _settings(tree: ast.Module) -> set[int]:
    """ids of the nodes under module-level assignments, argument and field defaults, class options
    and ``if TYPE_CHECKING``: settings (a chunk size, a default timeout) whose change a correct
    program survives."""
    roots: list[ast.AST] = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))]
    for node in ast.walk(tree):
        if isinstance(node, ast.arguments):
            roots += [d for d in (*node.defaults, *node.kw_defaults) if d is not None]
        elif isinstance(node, ast.ClassDef):  # field defaults and class options (msgspec's forbid_unknown_fields)
            roots += [n for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))] + list(node.keywords)
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            roots.append(node)  # imports for the type checker only
    return {id(n) for r in roots for n in ast.walk(r)}


def _candidates(source: str, lines: set[int]) -> Iterator[tuple[int, int, ast.AST]]:
    """``(index in ast.walk order, line, node)`` of the nodes on ``lines`` that a mutant may touch:
    not on an excluded line (:func:`_excluded_lines`), not part of a setting (:func:`_settings`)."""
    tree = ast.parse(source)
    skip = _excluded_lines(tree)
    settings = _settings(tree)
    for k, node in enumerate(ast.walk(tree)):
        line = getattr(node, "lineno", None)
        if line is not None and line in lines and line not in skip and id(node) not in settings:
            yield k, line, node


def sites(source: str, lines: set[int]) -> list[tuple[int, int, str]]:
    """``(node index in ast.walk order, line, description)`` of every mutation site on ``lines``."""
    out = []
    for k, line, node in _candidates(source, lines):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in _FLIP:
            out.append((k, line, f"{type(node.ops[0]).__name__} -> {_FLIP[type(node.ops[0])].__name__}"))
        elif isinstance(node, ast.BoolOp):
            out.append((k, line, f"{type(node.op).__name__} swapped"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            out.append((k, line, f"{type(node.op).__name__} swapped"))
        elif isinstance(node, (ast.If, ast.While)):
            out.append((k, line, f"{type(node).__name__} condition negated"))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            out.append((k, line, f"constant {node.value} -> {node.value + 1}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            out.append((k, line, f"{node.value} -> {not node.value}"))
        elif isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            out.append((k, line, "return None"))
    return out


_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}


def _raises(node: ast.If) -> bool:
    return any(isinstance(s, ast.Raise) for s in node.body)


def _one(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value == 1


def meaningful_sites(source: str, lines: set[int], ran: set[int] | None = None) -> list[tuple[int, int, str]]:
    """The sites a reviewer would call a real bug on ``lines``: a check dropped (``if bad: raise``
    made ``if False``), a comparison turned around or moved across its boundary (``<`` to ``<=``), an
    ``x + 1`` made ``x`` (off by one), a condition negated, ``and``/``or`` swapped, a ``return x`` made
    ``return None``. No constant moved: a buffer size or a flag a correct program tolerates. ``ran``: every
    line the test ran; a check whose ``raise`` it never reached is no site (valid input passes it)."""
    out = []
    for k, line, node in _candidates(source, lines):
        if isinstance(node, ast.If) and _raises(node):
            if ran is None or any(r.lineno in ran for r in node.body if isinstance(r, ast.Raise)):
                out.append((k, line, "check dropped"))
        elif isinstance(node, (ast.If, ast.While)):
            out.append((k, line, f"{type(node).__name__} condition negated"))
        elif isinstance(node, ast.Compare) and type(node.ops[0]) in _FLIP:
            out.append((k, line, f"{type(node.ops[0]).__name__} -> {_FLIP[type(node.ops[0])].__name__}"))
            if type(node.ops[0]) in _BOUNDARY:
                out.append((k, line, f"boundary {type(node.ops[0]).__name__} -> "
                                     f"{_BOUNDARY[type(node.ops[0])].__name__}"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and _one(node.right):
            out.append((k, line, f"off by one ({type(node.op).__name__} 1 dropped)"))
        elif isinstance(node, ast.BoolOp):
            out.append((k, line, f"{type(node.op).__name__} swapped"))
        elif isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value in (None, 0)):
            out.append((k, line, "return None"))  # not ``return 0``: a command's status, sys.exit(None) is 0 too
    return out


def mutate(source: str, index: int, op: str = "") -> str:
    """``source`` with the site at ``ast.walk`` position ``index`` changed as ``op`` says (see
    :func:`sites` and :func:`meaningful_sites`)."""
    tree = ast.parse(source)
    walk = list(ast.walk(tree))
    node = walk[index]
    if op == "check dropped" and isinstance(node, ast.If):
        node.test = ast.Constant(value=False)
    elif op.startswith("boundary") and isinstance(node, ast.Compare):
        node.ops[0] = _BOUNDARY[type(node.ops[0])]()
    elif op.startswith("off by one") and isinstance(node, ast.BinOp):
        parent = next(p for p in walk for f, v in ast.iter_fields(p)
                      if v is node or (isinstance(v, list) and any(x is node for x in v)))
        for f, v in ast.iter_fields(parent):
            if v is node:
                setattr(parent, f, node.left)
            elif isinstance(v, list):
                v[:] = [node.left if x is node else x for x in v]
    elif isinstance(node, ast.Compare):
        node.ops[0] = _FLIP[type(node.ops[0])]()
    elif isinstance(node, ast.BoolOp):
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif isinstance(node, ast.BinOp):
        node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
    elif isinstance(node, (ast.If, ast.While)):
        node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        node.value = not node.value
    elif isinstance(node, ast.Constant) and isinstance(node.value, int):
        node.value = node.value + 1
    elif isinstance(node, ast.Return):
        node.value = ast.Constant(value=None)
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"
