#!/usr/bin/env bash
# The test suite: set up .venv (first run only), make sure Debian's chromium is there for the /ui browser
# test (installed with apt-get when root), and run pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh test
bash tools/ensure_chromium.sh || echo "tools/test.sh: could not install chromium; the /ui browser test will skip" >&2
# Compile the codec kernels once (numba caches them beside the source), not in many test node processes at once.
.venv/bin/python -c "from p2psync.codec.decode import warm_up; warm_up()"
exec .venv/bin/python -m pytest -q "$@"
