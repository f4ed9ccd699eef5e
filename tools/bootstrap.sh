#!/usr/bin/env bash
# Creates .venv (once) and installs p2psync with the given extras.
# torch is pinned to the CPU build so that a fresh machine does not pull CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=".venv/.p2psync-installed-$(sha1sum pyproject.toml | cut -c1-12)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[${extras}]"
  touch "$stamp"
fi
