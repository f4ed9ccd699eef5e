#!/usr/bin/env bash
# The test suite: set up .venv (first run only), make sure Debian's chromium is there for the /ui browser
# test (installed with apt-get when root), check the types, and run pytest. Extra arguments go to pytest.
set -euo pipefail
# Compile the codec kernels once, into the numba cache the test session uses (tests/conftest.py sets
# the same NUMBA_CACHE_DIR; tools/bootstrap.sh runs `p2psync warm` with it), so that the node processes
# the integration tests start load them instead of all compiling them at once (7 node processes
# compiling on 2 cores outlasted the first test's 150 s wait for version 0).
cd "$(dirname "$0")/.."
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$PWD/.numba_cache}"
bash tools/bootstrap.sh test
bash tools/ensure_chromium.sh || echo "tools/test.sh: could not install chromium; the /ui browser test will skip" >&2
# Types of p2psync, topology, trainer and rollout ([tool.mypy] in pyproject.toml; strict on the pure
# cores): any error fails the run before a test starts.
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest -q "$@"
