"""Kernels built ahead of use: after the warm-up a fresh process's first apply loads or compiles none."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from p2psync.workers import run_ordered

ROOT = Path(__file__).resolve().parents[3]


def _loaded(path: str, warm: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("precompile_paths.py")), path, warm],
                         env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("path", ["node", "vllm"])
def test_a_fresh_processs_first_apply_loads_no_kernel_after_the_warm_up(path):
    cold = _loaded(path, "cold")
    assert "p2psync.codec.segdecode.decode_body" in cold  # what the warm-up takes off the path...
    assert _loaded(path, "warm") == []  # ...all of it


def test_helpers_run_on_the_cpus_given_and_the_caller_keeps_its_own():
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    mine = os.sched_getaffinity(0)
    one = {min(mine)}
    got, _, err = run_ordered(8, range(8), lambda i: os.sched_getaffinity(0), 3, cpus=one)
    assert err is None
    assert os.sched_getaffinity(0) == mine
    assert {frozenset(a) for a in got} <= {frozenset(mine), frozenset(one)}  # caller's or ``one``


@pytest.mark.slow
def test_a_read_only_install_caches_its_kernels_in_the_users_folder(tmp_path):
    pkg = tmp_path / "site" / "p2psync"
    shutil.copytree(ROOT / "p2psync", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # A file where numba would make the package's __pycache__: the package folder cannot take
    # the cache, as for an install into a folder the user cannot write (root ignores modes).
    (pkg / "codec" / "__pycache__").write_text("")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(HOME=str(home), PYTHONPATH=str(tmp_path / "site"), PYTHONDONTWRITEBYTECODE="1")
    code = ("from p2psync.codec import context, precompile\n"
            "context._group_cost(10, 3.0)\n"
            "s = context._group_cost.stats\n"
            "print(sum(s.cache_hits.values()), sum(s.cache_misses.values()), precompile.cache_location())\n")
    runs = [subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, check=True).stdout.split() for _ in range(2)]
    assert runs[0][:2] == ["0", "1"]  # compiled once...
    assert runs[1][:2] == ["1", "0"]  # ...and the next process loads it
    assert runs[1][2].startswith(str(home / ".cache" / "numba"))
