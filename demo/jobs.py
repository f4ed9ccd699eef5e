"""Job wrappers the demo runs inside its node processes (``p2psync node --job demo.jobs:trainer``).

The training job ends after its last step; the trainer *node* must keep
serving until every follower holds the last version, so the wrapper keeps the
process up after the job returns and until the demo sends SIGTERM. The job's
outcome goes to ``done_path`` (a JSON file the demo waits for).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any


async def trainer(node: Any, options: dict[str, Any]) -> int:
    from trainer.grpo import run

    done_path = Path(options.pop("done_path"))
    t0 = time.time()
    try:
        rc = await run(node, options)
        outcome: dict[str, Any] = {"rc": int(rc or 0), "seconds": time.time() - t0}
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the demo, which exits non-zero
        outcome = {"rc": 1, "error": repr(exc), "seconds": time.time() - t0}
        node.log.exception("training job failed")
    # Written whole, then renamed: the demo polls for the file and must never read it half written.
    tmp = done_path.with_name(done_path.name + ".tmp")
    tmp.write_text(json.dumps(outcome))
    os.replace(tmp, done_path)
    await asyncio.Event().wait()  # keep serving until SIGTERM
    return int(outcome["rc"])


async def rollout(node: Any, options: dict[str, Any]) -> int:
    from rollout.worker import run

    return await run(node, options)
