#!/usr/bin/env bash
# docs/benchmarks/ui.png: the trainer's live page /ui while version 1 flows through a real cluster. The
# browser test (tests/integration/test_ui_live.py) takes that screenshot under its own tmp dir; this runs
# it in a folder of its own and copies the picture into the docs. Tests never write into the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/ensure_chromium.sh
base=$(mktemp -d)
trap 'rm -rf "$base"' EXIT
.venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$base" tests/integration/test_ui_live.py
shot=$(find "$base" -name ui.png -print -quit)
[ -n "$shot" ] || { echo "ui_screenshot: the test left no ui.png under $base" >&2; exit 1; }
cp "$shot" docs/benchmarks/ui.png
echo "docs/benchmarks/ui.png <- $shot"
