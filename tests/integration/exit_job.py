"""A ``--job`` for ``test_nodes.py``: leaves output in the process's buffers, then ends with a code.

Run as ``p2psync node ... --job tests.integration.exit_job:run --job-config F.json`` (importable
from the repository root, where node processes start).
"""

from __future__ import annotations

import logging
from typing import Any


async def run(node, options: dict[str, Any]) -> int:
    await node.wait_version(0)  # the snapshot in --publish-dir applied
    for i in range(int(options.get("lines", 1000))):
        print(f"job line {i}")  # block-buffered when stdout is a pipe: only the exit flushes it
    logging.getLogger("tests.exit_job").info("job done")
    return int(options.get("code", 3))
