"""The owner watch of the vLLM plugin: a process started with the owner's name in its environment ends
when the owner dies, even by SIGKILL; a process without it starts no watch. Real processes, no vLLM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rollout.engines.vllm import plugin
from rollout.engines.vllm.plugin import OWNER_ENV, owned_processes, start_time, watch_owner

pytestmark = pytest.mark.timeout(60)

# The owner starts the child inside owned_processes(), prints its pid, and waits to be killed.
OWNER = """
import subprocess, sys, time
from rollout.engines.vllm.plugin import owned_processes
with owned_processes():
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""
CHILD = """
import os, signal, sys, time
from rollout.engines.vllm import plugin
if "ignore-term" in sys.argv[1:]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "no-pidfd" in sys.argv[1:]:
    del os.pidfd_open
assert plugin.watch_owner() is not None
time.sleep(120)
"""


def _running(pid: int, start: int | None) -> bool:
    return start is not None and plugin._running(pid, start)


@pytest.mark.parametrize("mode", ["", "ignore-term", "no-pidfd"])
def test_a_child_ends_when_its_owner_is_killed(mode):
    code = CHILD.replace('sys.argv[1:]', repr([mode]))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    child, start = 0, None
    try:
        child = int(owner.stdout.readline())
        start = start_time(child)
        time.sleep(1.5)  # let the child arm its watch
        assert _running(child, start)
        owner.kill()
        owner.wait(10)
        t = time.monotonic()
        while _running(child, start) and time.monotonic() - t < 10:
            time.sleep(0.05)
        took = time.monotonic() - t
        assert not _running(child, start), f"child {child} outlived its owner by 10 s ({mode or 'plain'})"
        if mode == "ignore-term":
            assert took >= plugin.GRACE_S - 0.5  # SIGTERM ignored: the hard exit ends it
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        if _running(child, start):
            os.kill(child, signal.SIGKILL)


def test_no_watch_without_the_owner_name_or_in_the_owner_itself(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "_watching", None)
    monkeypatch.delenv(OWNER_ENV, raising=False)
    assert watch_owner() is None  # a plain `vllm serve`
    with owned_processes():
        assert os.environ[OWNER_ENV] == f"{os.getpid()}:{start_time(os.getpid())}"
        assert watch_owner() is None  # the process that builds the LLM watches nobody
    assert OWNER_ENV not in os.environ  # only vLLM processes started inside the block carry it
    monkeypatch.setenv(OWNER_ENV, "not-a-pid")
    assert watch_owner() is None
    assert "ignoring" in caplog.text
