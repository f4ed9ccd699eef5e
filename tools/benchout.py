"""What the benchmarks in tools/ do with a result: print it as one JSON line, append it to a file."""

from __future__ import annotations

import json
import os


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded (every benchmark records the load it ran under)."""
    return [round(x, 2) for x in os.getloadavg()]


def emit(res: dict, path: str | None) -> dict:
    """Print ``res`` as one JSON line and, with ``path``, append that line to the file; returns ``res``."""
    line = json.dumps(res)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    return res
