"""``p2psync node`` start-up: the open-files limit a large cluster's coordinator needs."""

from __future__ import annotations

import resource
import subprocess
import sys

_SHOW = ("import resource; from p2psync.cli.node import _raise_open_files; _raise_open_files(); "
         "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")


def _limit_after_start(soft: int) -> tuple[int, int]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def lowered() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    out = subprocess.run([sys.executable, "-c", _SHOW], preexec_fn=lowered, capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]), int(out[1])


def test_a_node_lifts_its_open_files_limit_to_the_hard_limit():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert hard == resource.RLIM_INFINITY or hard > 256
    soft, kept = _limit_after_start(256)
    assert kept == hard  # the hard limit is the system's, left alone
    assert soft == (1 << 20 if hard == resource.RLIM_INFINITY else hard)
