#!/usr/bin/env bash
# The test suite: set up .venv (first run only), make sure Debian's chromium is there for the /ui browser
# test (installed with apt-get when root), check the types, and run pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Caches kept by the machine, outside the clone, so that a run on a machine that ran the suite before
# (a fresh CI clone included) reuses them; a brand-new machine fills them. pip keeps its own (~/.cache/pip).
cache="${XDG_CACHE_HOME:-$HOME/.cache}/p2psync"
mkdir -p "$cache"
# numba's cache is keyed by each kernel's source file path, modification time and size, and a fresh
# clone stamps every file with the checkout time: under CI, tracked Python files without local changes
# get the time of the last commit that changed them instead (the same in every clone of a commit), so
# the kernels compiled by an earlier run at the same path load instead of compiling again.
if [ "${CI:-}" = true ] && git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  python3 - <<'PY'
import os
import subprocess

run = lambda *a: subprocess.run(["git", *a], check=True, capture_output=True, text=True).stdout  # noqa: E731
changed = {line[3:] for line in run("status", "--porcelain", "--untracked-files=no").splitlines()}
tracked = set(run("ls-files", "*.py").splitlines()) - changed
when: dict[str, int] = {}
t = 0
for line in run("log", "--format=%x00%ct", "--name-only", "--no-renames", "--", "*.py").splitlines():
    if line.startswith("\0"):
        t = int(line[1:])
    elif line in tracked and line not in when:
        when[line] = t
for path, t in when.items():
    os.utime(path, (t, t))
PY
fi
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$cache/numba}"
bash tools/bootstrap.sh test
bash tools/ensure_chromium.sh ||
  echo "tools/test.sh: could not install chromium; the /ui browser tests will skip (fail under CI=true)" >&2
# Types of p2psync, topology, trainer and rollout ([tool.mypy] in pyproject.toml; strict on the pure
# cores): any error fails the run before a test starts. mypy checks its cache against the sources.
.venv/bin/python -m mypy --cache-dir "${MYPY_CACHE_DIR:-$cache/mypy}"
# The codec kernels, compiled once into the numba cache the test session uses (tests/conftest.py takes
# the NUMBA_CACHE_DIR exported above; tools/bootstrap.sh compiled them at install), so that the node
# processes the integration tests start load them instead of all compiling them at once (7 node
# processes compiling on 2 cores outlasted the first test's 150 s wait for version 0).
.venv/bin/python -m p2psync.cli warm
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
# verl pins a transformers older than vLLM 0.32's: its tests (marked verl) run in a venv of their own
# that reuses .venv's packages (tools/verl_venv.sh), first. Then the unit tests of the pure cores (no vLLM,
# no node processes) in two pytest-xdist workers, one per core: on this 2-core machine they take about
# half the time. Then everything else one test at a time: vLLM engines, node processes and network
# namespaces each want the machine to themselves.
rc=0
bash tools/verl_venv.sh
PYTHONPATH="$PWD" .venv-verl/bin/python -m pytest -q -m verl || rc=$?
cores=(tests/unit/p2psync tests/unit/topology tests/unit/demo)
.venv/bin/python -m pytest -q -m "not verl" -n 2 "${cores[@]}" || rc=$?
.venv/bin/python -m pytest -q -m "not verl" "${cores[@]/#/--ignore=}" || rc=$?
exit "$rc"
