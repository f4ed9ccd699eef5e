"""The testbed's error (kept here so the rest of p2psync does not depend on the testbed)."""

from __future__ import annotations

from p2psync.errors import P2PSyncError


class TestbedError(P2PSyncError):
    """The emulated WAN cannot be built, used or removed; the message says why and what to do."""

    __test__ = False  # not a pytest class
