"""Fixtures for integration tests (helpers live in :mod:`nodeproc`)."""

from __future__ import annotations

import pytest
from nodeproc import Cluster


@pytest.fixture
def cluster(tmp_path):
    """Keys, a publish folder, and every node process the test starts (stopped afterwards, by pid)."""
    c = Cluster(tmp_path)
    yield c
    c.stop_all()
