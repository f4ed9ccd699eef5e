#!/usr/bin/env bash
# The test suite: set up .venv (first run only) and run pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh test
exec .venv/bin/python -m pytest -q "$@"
