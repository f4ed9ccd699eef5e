"""Mutation check: does each test file fail when the code it tests is broken?

For every test file given (default: every ``tests/unit/**/test_*.py``) this tool

1. runs the file once under coverage, to learn which lines of the project's packages it executes;
2. picks mutation sites among those lines, in the modules the file imports (none when it imports
   no project module: it reads files or runs programs, and is listed as not mutated): a comparison turned around (``<`` to ``>=``, ``==`` to ``!=``,
   ``in`` to ``not in``), ``and``/``or`` swapped, ``+``/``-`` swapped, an ``if``/``while`` condition
   negated, an integer constant moved by one, ``True``/``False`` swapped, a ``return`` of a value
   made ``return None``; never inside a compiled (numba) kernel, a log or an error message, and no
   constant of a module-level setting, an argument's or a field's default, a class option or an
   ``if TYPE_CHECKING`` (a correct program survives those);
3. runs the file against each mutant (the module rewritten in place, restored after; its
   modification time too, so numba's cache of the other kernels stays valid) and counts the
   mutant killed when the run fails or times out.

A test file whose every mutant survives is listed: its assertions do not notice a broken
implementation of what it runs. The sites are drawn from ``--seed``; ``--per-file`` sets how many.
Needs the ``coverage`` package (``.venv/bin/python -m pip install coverage``). Run it on a clean
checkout: files are rewritten in place while it runs (and restored on exit, Ctrl-C included).

    .venv/bin/python tools/mutation_check.py --per-file 3 --json docs/benchmarks/mutation.json
    .venv/bin/python tools/mutation_check.py tests/unit/topology/test_planner.py --per-file 8
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("p2psync", "topology", "trainer", "rollout", "demo")
SOURCES = (*PACKAGES, "tools")
"""Where mutants are drawn from: the packages, and the tools some tests import (``soak.ledger``)."""
_FLIP = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_QUIET_CALLS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


@dataclass
class Mutant:
    module: str
    line: int
    op: str
    killed: bool | None = None
    how: str = ""
    seconds: float = 0.0


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


def sites(source: str, lines: set[int]) -> list[tuple[int, int, str]]:
    """``(node index in ast.walk order, line, description)`` of every mutation site on ``lines``."""
    tree = ast.parse(source)
    skip = _excluded_lines(tree)
    settings = _settings(tree)
    out = []
    for k, node in enumerate(ast.walk(tree)):
        line = getattr(node, "lineno", None)
        if line is None or line not in lines or line in skip:
            continue
        if isinstance(node, ast.Compare) and type(node.ops[0]) in _FLIP:
            out.append((k, line, f"{type(node.ops[0]).__name__} -> {_FLIP[type(node.ops[0])].__name__}"))
        elif isinstance(node, ast.BoolOp):
            out.append((k, line, f"{type(node.op).__name__} swapped"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            out.append((k, line, f"{type(node.op).__name__} swapped"))
        elif isinstance(node, (ast.If, ast.While)) and id(node) not in settings:
            out.append((k, line, f"{type(node).__name__} condition negated"))
        elif isinstance(node, ast.Constant) and id(node) in settings:
            continue
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            out.append((k, line, f"constant {node.value} -> {node.value + 1}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            out.append((k, line, f"{node.value} -> {not node.value}"))
        elif isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            out.append((k, line, "return None"))
    return out


def mutate(source: str, index: int) -> str:
    """``source`` with the site at ``ast.walk`` position ``index`` changed (see :func:`sites`)."""
    tree = ast.parse(source)
    node = list(ast.walk(tree))[index]
    if isinstance(node, ast.Compare):
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


def imported_modules(test_file: Path) -> set[str]:
    """Project files (relative paths) that ``test_file`` imports directly."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(test_file.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            for root in (REPO, REPO / "tools"):  # tests import tools' modules with tools/ on sys.path
                base = root / Path(*name.split("."))
                for cand in (base.with_suffix(".py"), base / "__init__.py"):
                    if cand.is_file() and cand.relative_to(REPO).parts[0] in SOURCES:
                        out.add(str(cand.relative_to(REPO)))
    return out


def _pytest(test_file: str, timeout: float, extra: list[str] | None = None) -> tuple[str, float]:
    """Run one test file; ``("passed" | "failed" | "timeout" | "no tests", seconds)``."""
    cmd = [sys.executable, *(extra or ["-m", "pytest"]), "-q", "-x", "-p", "no:cacheprovider",
           "-p", "no:randomly", test_file]
    t0 = time.monotonic()
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO)}  # node processes the tests start import this tree too
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False,
                           start_new_session=True)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0
    how = {0: "passed", 5: "no tests"}.get(r.returncode, "failed")
    return how, time.monotonic() - t0


_COVERED = """
import os, sys
import coverage, pytest
cov = coverage.Coverage(data_file=sys.argv[1], source=sys.argv[2].split(","))
real_exit = os._exit
def _exit(code):  # tests/conftest.py ends a session that loaded vLLM with os._exit: save first
    cov.stop()
    cov.save()
    real_exit(code)
os._exit = _exit
cov.start()
rc = pytest.main(sys.argv[3:])
cov.stop()
cov.save()
sys.exit(int(rc))
"""


def covered(test_file: str, timeout: float) -> tuple[str, dict[str, set[int]]]:
    """Run ``test_file`` under coverage: its outcome and the project lines it executed, by file."""
    import coverage

    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / ".coverage"
        how, _ = _pytest(test_file, timeout, ["-c", _COVERED, str(data), ",".join(SOURCES)])
        if not data.exists():
            return how, {}
        cov = coverage.Coverage(data_file=str(data))
        cov.load()
        got = cov.get_data()
        out = {}
        for f in got.measured_files():
            rel = os.path.relpath(f, REPO)
            if rel.split(os.sep)[0] in SOURCES:
                out[rel] = set(got.lines(f) or ())
        return how, out


def check_file(test_file: str, per_file: int, rng: random.Random, timeout: float) -> dict:
    how, lines = covered(test_file, timeout)
    res: dict = {"file": test_file, "baseline": how, "mutants": []}
    if how != "passed":
        return res
    wanted = imported_modules(REPO / test_file) & set(lines)
    if not wanted:  # it checks files it reads or programs it runs: no module of its own to break here
        res["why"] = "runs no code it imports (it reads files or runs programs)"
        return res
    pool = []
    for mod in sorted(wanted):
        src = (REPO / mod).read_text()
        pool += [(mod, k, line, op) for k, line, op in sites(src, lines[mod])]
    res["targets"] = sorted(wanted)
    res["sites"] = len(pool)
    for mod, k, line, op in rng.sample(pool, min(per_file, len(pool))):
        m = Mutant(mod, line, op)
        path = REPO / mod
        src, st = path.read_text(), path.stat()
        try:
            path.write_text(mutate(src, k))
            m.how, m.seconds = _pytest(test_file, timeout)
        finally:
            path.write_text(src)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        m.killed = m.how in ("failed", "timeout")
        res["mutants"].append(asdict(m))
        print(f"  {'killed ' if m.killed else 'SURVIVED'} {mod}:{line} {op} ({m.how}, {m.seconds:.0f} s)", flush=True)
    return res


def summary(results: list[dict], seconds: float, a: argparse.Namespace) -> dict:
    tried = [r for r in results if r["mutants"]]
    return {"files": len(results), "files_mutated": len(tried),
            "mutants": sum(len(r["mutants"]) for r in tried),
            "killed": sum(m["killed"] for r in tried for m in r["mutants"]),
            "files_no_mutant_killed": [r["file"] for r in tried if not any(m["killed"] for m in r["mutants"])],
            "files_not_mutated": [{"file": r["file"], "baseline": r["baseline"], "sites": r.get("sites", 0),
                                   "why": r.get("why", "")} for r in results if not r["mutants"]],
            "seconds": round(seconds, 1), "seed": a.seed, "per_file": a.per_file,
            "date": time.strftime("%Y-%m-%d"), "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="test files (default: tests/unit/**/test_*.py)")
    ap.add_argument("--per-file", type=int, default=3, help="mutants per test file (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run of a test file")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", *SOURCES], cwd=REPO,
                           capture_output=True, text=True, check=False).stdout.strip()
    if dirty:
        print(f"mutation_check: the code has local changes; run it on a clean checkout:\n{dirty}",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # restore the module being mutated
    files = a.files or sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "unit").rglob("test_*.py"))
    rng = random.Random(a.seed)
    results: list[dict] = []
    t0 = time.monotonic()
    out = summary(results, 0.0, a)
    for f in files:
        print(f"{f}", flush=True)
        results.append(check_file(f, a.per_file, rng, a.timeout))
        out = summary(results, time.monotonic() - t0, a)
        if a.json:  # after every file: a run stopped part-way keeps what it found
            Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "results"}, indent=1))
    return 1 if out["files_no_mutant_killed"] else 0


if __name__ == "__main__":
    sys.exit(main())
