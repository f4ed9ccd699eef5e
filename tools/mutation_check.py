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

Integration files (``--integration``) start node processes and vLLM engines: minutes per run. There
the coverage run includes the processes the test starts (coverage's ``.pth`` and
``$COVERAGE_PROCESS_START``), the lines recorded by ``--record-coverage`` over ``tests/unit`` are left
alone (``--exclude-covered-by``: a file is judged on what only it reaches), and the mutants are the
bugs a reviewer would name, spread over the modules it runs: a check dropped, a comparison turned
around or moved across its boundary, an ``x + 1`` made ``x``, a condition negated, ``return None``.
``--python`` runs the tests in another interpreter (``.venv-verl`` for the ``verl`` tests, with
``-m verl``); ``--resume`` goes on from the files already in ``--json``.
Needs the ``coverage`` package (``.venv/bin/python -m pip install coverage``). Run it on a clean
checkout: files are rewritten in place while it runs (and restored on exit, Ctrl-C included).

    .venv/bin/python tools/mutation_check.py --per-file 3 --json docs/benchmarks/mutation.json
    .venv/bin/python tools/mutation_check.py tests/unit/topology/test_planner.py --per-file 8
    .venv/bin/python tools/mutation_check.py --record-coverage /tmp/unit.cov -m "not verl"
    .venv/bin/python tools/mutation_check.py --integration --exclude-covered-by /tmp/unit.cov -m "not verl" \
        --per-file 2 --file-budget 60 --json docs/internals/mutation_integration.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mutants import meaningful_sites, mutate, sites

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("p2psync", "topology", "trainer", "rollout", "demo")
SOURCES = (*PACKAGES, "tools")
"""Where mutants are drawn from: the packages, and the tools some tests import (``soak.ledger``)."""
@dataclass
class Mutant:
    module: str
    line: int
    op: str
    killed: bool | None = None
    how: str = ""
    seconds: float = 0.0
    by: str = ""


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


@dataclass
class Runner:
    """How a test file runs: the interpreter (``.venv-verl/bin/python`` for the verl tests), a marker
    expression, the per-run timeout, and a ``-k`` expression (a file whose cases each load a model
    runs a few of them: ``-k "llama or qwen3_moe"``)."""
    python: str
    marker: str | None
    timeout: float
    keyword: str | None = None


def _pytest(run: Runner, files: list[str], timeout: float, extra: list[str] | None = None,
            env: dict[str, str] | None = None) -> tuple[str, float, str]:
    """Run test files; ``("passed" | "failed" | "timeout" | "no tests" | "skipped", seconds, output tail)``.
    A run whose every test skipped (no vLLM, no root) is ``"skipped"``: its mutants would prove nothing."""
    cmd = [run.python, *(extra or ["-m", "pytest"]), "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly",
           *(["-m", run.marker] if run.marker else []),
           *(["-k", run.keyword] if run.keyword else []), *files]
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}  # node processes the tests start import this tree too
    # Its own session: on a timeout or when this tool is stopped, the whole group goes (pytest and the
    # node and engine processes it started), not only pytest.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:  # a process that left the group (its own session) may still hold the pipe
            stdout, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stdout = ""
        return "timeout", time.monotonic() - t0, stdout[-2000:]
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:  # whatever pytest left running in its group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    how = {0: "passed", 5: "no tests"}.get(proc.returncode, "failed")
    # What failed, kept ahead of the tail: node processes write their logs into the same pipes, and a
    # long log pushes pytest's report out of the last 2000 characters.
    tail = "\n".join(_said(stdout)) + "\n" + (stdout + stderr)[-2000:]
    if how == "passed" and not re.search(r"\b[1-9]\d* passed", stdout):
        how = "skipped"
    return how, time.monotonic() - t0, tail


_COVERED = """
import os, sys
import coverage, pytest
cov = coverage.Coverage.current()  # started by coverage's .pth from $COVERAGE_PROCESS_START
if cov is None:  # an interpreter without that .pth (.venv-verl reuses .venv's packages): start it here
    cov = coverage.Coverage(config_file=os.environ["COVERAGE_PROCESS_START"])
    cov.start()
real_exit = os._exit
def _exit(code):  # tests/conftest.py ends a session that loaded vLLM with os._exit: save first
    cov.stop()
    cov.save()
    real_exit(code)
os._exit = _exit
rc = pytest.main(sys.argv[1:])
cov.stop()
cov.save()
sys.exit(int(rc))
"""


def covered_data(run: Runner, files: list[str], timeout: float) -> tuple[str, float, str, object | None]:
    """Run ``files`` in one pytest session under coverage, the processes it starts included (node
    processes, vLLM's engine core: coverage's ``.pth`` starts it in every interpreter that sees
    ``$COVERAGE_PROCESS_START``; a process ended by SIGTERM saves first). Returns the outcome and the
    combined ``CoverageData`` (``None`` when nothing was recorded)."""
    import coverage

    with tempfile.TemporaryDirectory() as d:
        rc = Path(d) / "coveragerc"
        rc.write_text(f"[run]\nparallel = true\nsigterm = true\ndata_file = {d}/.coverage\nsource =\n"
                      + "".join(f"    {REPO / s}\n" for s in SOURCES))
        env = {"COVERAGE_PROCESS_START": str(rc)}
        how, seconds, tail = _pytest(run, files, timeout, ["-c", _COVERED], env)
        if not any(Path(d).glob(".coverage.*")):
            return how, seconds, tail, None
        cov = coverage.Coverage(data_file=str(Path(d) / ".coverage"), config_file=False)
        cov.combine([d])
        data = coverage.CoverageData(no_disk=True)  # in memory: no .coverage left in the checkout
        data.update(cov.get_data())
        return how, seconds, tail, data


def _project_lines(data: object | None) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    if data is None:
        return out
    for f in data.measured_files():  # type: ignore[attr-defined]
        rel = os.path.relpath(f, REPO)
        if rel.split(os.sep)[0] in SOURCES:
            out[rel] = set(data.lines(f) or ())  # type: ignore[attr-defined]
    return out


def load_lines(path: str) -> dict[str, set[int]]:
    """The project lines recorded in a coverage data file (``--record-coverage``)."""
    import coverage

    data = coverage.CoverageData(basename=path)
    data.read()
    return _project_lines(data)


def _said(output: str) -> list[str]:
    """The lines of a pytest report that say what failed: the first ``FAILED``/``ERROR`` summary line
    (the test), the source line pytest marks with ``>`` above the first error (the failing statement)
    and the first ``E   assert`` line, else the first ``E`` line (the values or the error)."""
    lines = output.splitlines()
    summary = [ln.strip() for ln in lines if ln.startswith(("FAILED", "ERROR"))][:1]
    first = next((i for i, ln in enumerate(lines) if ln.startswith("E ")), None)
    if first is None:
        return summary
    where = [ln.strip()[:200] for ln in lines[:first] if ln.startswith(">")][-1:]
    errors = [ln for ln in lines[first:] if ln.startswith("E ")]
    value = next((ln for ln in errors if ln[1:].lstrip().startswith("assert ")), errors[0])
    return summary + where + [value.strip()[:200]]


def _first_error(output: str, default: str) -> str:
    """What failed in a pytest run (:func:`_said`, joined), else ``default``."""
    said = _said(output)
    return " | ".join(said)[:600] if said else default


def _functions(source: str) -> dict[int, str]:
    """Line -> name of the innermost function or class around it."""
    out: dict[int, str] = {}
    for node in ast.walk(ast.parse(source)):  # outer before inner: inner names win
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                out[line] = node.name
    return out


def aimed(pool: list[tuple[str, int, int, str]], test_text: str, n: int,
          rng: random.Random) -> list[tuple[str, int, int, str]]:
    """``n`` sites in the code the test is about, one module each first: a site scores by the words of
    the test file (its names, strings and comments) that name its module (``probe``, ``tls``) or the
    function around it, and a dropped check scores more where the test expects errors. Ties are drawn."""
    words = {w.lower() for w in re.findall(r"[A-Za-z][A-Za-z0-9]{2,}", test_text)}
    words |= {w.lower() for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]{3,}", test_text)}
    errors = bool(re.search(r"pytest\.raises|[Ee]rror|refus", test_text))
    funcs = {mod: _functions((REPO / mod).read_text()) for mod in {m for m, *_ in pool}}

    def score(site: tuple[str, int, int, str]) -> float:
        mod, _, line, op = site
        parts = [x.lower() for x in Path(mod).with_suffix("").parts[1:] if x != "__init__"]
        fn = funcs[mod].get(line, "").lower()
        name_hit = fn in words or any(w in words for w in fn.strip("_").split("_") if len(w) > 3)
        return (2 * sum(x in words for x in parts) + 2 * name_hit + (errors and op == "check dropped")
                + rng.random())

    ranked = sorted(pool, key=score, reverse=True)
    out: list[tuple[str, int, int, str]] = []
    for site in ranked:  # the best site of each module, best modules first
        if len(out) < n and site[0] not in {m for m, *_ in out}:
            out.append(site)
    out += [s for s in ranked if s not in out][: n - len(out)]
    return out


def check_file(test_file: str, per_file: int, rng: random.Random, run: Runner, *,
               exclude: dict[str, set[int]] | None = None, any_module: bool = False,
               meaningful: bool = False, budget: float | None = None) -> dict:
    """Mutants of the code ``test_file`` runs, each run against ``test_file`` alone.

    ``any_module``: draw from every project module the run executed (an integration file starts
    processes and imports little), not only those it imports; ``exclude``: lines to leave alone (those
    the unit tests already run), so that an integration file is judged on what only it reaches;
    ``meaningful``: :func:`meaningful_sites` rather than :func:`sites`, spread over modules; ``budget``:
    no further mutant once this file's mutants have taken that many seconds."""
    how, base_s, tail, data = covered_data(run, [test_file], run.timeout)
    lines = ran = _project_lines(data)
    res: dict = {"file": test_file, "baseline": how, "baseline_seconds": round(base_s, 1), "mutants": []}
    if run.python != sys.executable or run.marker:
        res["python"], res["marker"] = run.python, run.marker
    if run.keyword:
        res["keyword"] = run.keyword
    if how != "passed":
        res["why"] = f"baseline {how}: {_first_error(tail, how)}"
        return res
    if exclude:
        lines = {m: ls - exclude.get(m, set()) for m, ls in lines.items()}
        lines = {m: ls for m, ls in lines.items() if ls}
    wanted = set(lines) if any_module else imported_modules(REPO / test_file) & set(lines)
    if not wanted:  # it checks files it reads or programs it runs: no module of its own to break here
        res["why"] = ("runs no project line the unit tests do not" if any_module
                      else "runs no code it imports (it reads files or runs programs)")
        return res
    pool = []
    for mod in sorted(wanted):
        src = (REPO / mod).read_text()
        found = meaningful_sites(src, lines[mod], ran[mod]) if meaningful else sites(src, lines[mod])
        pool += [(mod, k, line, op) for k, line, op in found]
    res["targets"] = sorted(wanted)
    res["sites"] = len(pool)
    picked = (aimed(pool, (REPO / test_file).read_text(), per_file, rng) if meaningful
              else rng.sample(pool, min(per_file, len(pool))))
    # A mutant that hangs is killed by the file's own per-test timeouts; this bound only stops a run
    # that outlasts the baseline (which ran under coverage, slower) by far.
    timeout = min(run.timeout, 2 * base_s + 120)
    spent = 0.0
    for mod, k, line, op in picked:
        if budget is not None and spent >= budget:
            break
        m = Mutant(mod, line, op)
        path = REPO / mod
        src, st = path.read_text(), path.stat()
        try:
            path.write_text(mutate(src, k, op))
            m.how, m.seconds, tail = _pytest(run, [test_file], timeout)
        finally:
            path.write_text(src)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        spent += m.seconds
        m.killed = m.how in ("failed", "timeout")
        if m.killed:  # which assertion or error noticed it
            m.by = _first_error(tail, m.how)
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
            "integration": a.integration, "exclude_covered_by": a.exclude_covered_by,  # interpreter, marker: per file
            "file_budget": a.file_budget, "date": time.strftime("%Y-%m-%d"), "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="test files (default: tests/unit/**/test_*.py, or "
                                             "tests/integration/test_*.py with --integration)")
    ap.add_argument("--per-file", type=int, default=3, help="mutants per test file (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run of a test file")
    ap.add_argument("--json", help="write the results here (after every file)")
    ap.add_argument("--resume", action="store_true", help="keep the files already in --json and go on")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter the tests run in (.venv-verl/bin/python for the verl tests)")
    ap.add_argument("-m", "--marker", help="pytest marker expression (-m verl, -m 'not verl')")
    ap.add_argument("-k", "--keyword", help="pytest -k expression: run only these cases of each file")
    ap.add_argument("--record-coverage", metavar="DATA",
                    help="run the files once, in one session, under coverage (the processes they start "
                         "included) and write the lines they ran to the coverage data file DATA; no mutant")
    ap.add_argument("--exclude-covered-by", metavar="DATA",
                    help="leave alone the lines recorded in DATA (e.g. what tests/unit runs)")
    ap.add_argument("--integration", action="store_true",
                    help="integration mode: mutants from any module the run executed, meaningful "
                         "kinds only, spread over modules")
    ap.add_argument("--file-budget", type=float,
                    help="no further mutant of a file once its mutants have taken this many seconds")
    a = ap.parse_args(argv)
    run = Runner(a.python, a.marker, a.timeout, a.keyword)
    default = ("tests/integration", "test_*.py") if a.integration else ("tests/unit", "**/test_*.py")
    files = a.files or sorted(str(p.relative_to(REPO)) for p in (REPO / default[0]).glob(default[1]))
    if a.record_coverage:
        how, seconds, tail, data = covered_data(run, files, a.timeout)
        if data is None:
            print(f"mutation_check: nothing recorded ({how})\n{tail}", file=sys.stderr)
            return 1
        out_data = __import__("coverage").CoverageData(basename=a.record_coverage)
        out_data.update(data)
        out_data.write()
        n = sum(len(v) for v in _project_lines(data).values())
        print(f"{how} in {seconds:.0f} s; {n} project lines in {a.record_coverage}")
        return 0 if how == "passed" else 1
    exclude = load_lines(a.exclude_covered_by) if a.exclude_covered_by else None
    if exclude is not None and not exclude:  # coverage keeps absolute paths: another checkout's match none
        print(f"mutation_check: {a.exclude_covered_by} holds no line of this checkout's packages (recorded "
              f"in another checkout? its paths are absolute); record it here", file=sys.stderr)
        return 2
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", *SOURCES], cwd=REPO,
                           capture_output=True, text=True, check=False).stdout.strip()
    if dirty:
        print(f"mutation_check: the code has local changes; run it on a clean checkout:\n{dirty}",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # restore the module being mutated
    rng = random.Random(a.seed)
    results: list[dict] = []
    if a.resume and a.json and Path(a.json).exists():
        results = json.loads(Path(a.json).read_text())["results"]
    done = {r["file"] for r in results}
    t0 = time.monotonic() - (json.loads(Path(a.json).read_text())["seconds"] if results else 0.0)
    out = summary(results, 0.0, a)
    for f in files:
        if f in done:
            continue
        print(f"{f}", flush=True)
        results.append(check_file(f, a.per_file, rng, run, exclude=exclude, any_module=a.integration,
                                  meaningful=a.integration, budget=a.file_budget))
        out = summary(results, time.monotonic() - t0, a)
        if a.json:  # after every file: a run stopped part-way keeps what it found
            Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "results"}, indent=1))
    return 1 if out["files_no_mutant_killed"] else 0


if __name__ == "__main__":
    sys.exit(main())
