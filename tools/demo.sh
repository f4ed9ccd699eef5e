#!/usr/bin/env bash
# The main job: set up .venv (first run only) and run the p2psync demo. Extra arguments go to `p2psync demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh test
exec .venv/bin/p2psync demo "$@"
