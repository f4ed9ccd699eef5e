"""The lease workload of the chaos soak: jobs run inside real ``p2psync node`` processes
(``--job tools.soak.jobs:trainer`` / ``tools.soak.jobs:rollout``, options from ``--job-config``).

The trainer keeps ``backlog`` prompt groups queued at its coordinator (work ids carry the
trainer's start time, so a restarted trainer's work is new work) and appends every accepted
result to ``out`` (JSON lines: work id, node, migrated). Rollout nodes lease one group at a time
and "generate" fake tokens slowly, reporting progress, so that leases are held across faults,
expire, move and complete. No engine: the soak is about the control plane and the weights.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

logger = logging.getLogger("tools.soak.jobs")


async def trainer(node: Any, options: dict[str, Any]) -> int:
    from p2psync.control.api import RolloutRequest

    coord = node.coordinator
    backlog, responses = int(options.get("backlog", 8)), int(options.get("responses", 2))
    req = RolloutRequest(prompt_ids=[1, 2, 3], max_new_tokens=int(options.get("max_new_tokens", 24))).to_json()
    run = f"{int(time.time() * 1000):x}"
    submitted = 0

    def top_up() -> None:
        nonlocal submitted
        while coord.pending() < backlog:
            coord.submit(f"{run}-{submitted}", req, prompt_key=f"p{submitted % 5}", responses=responses)
            submitted += 1

    top_up()
    async for r in coord.results():
        with open(options["out"], "a") as f:
            f.write(json.dumps({"work_id": r.work_id, "node": r.node, "migrated": r.migrated,
                                "t": time.time()}) + "\n")
        top_up()
    return 0


async def rollout(node: Any, options: dict[str, Any]) -> int:
    from p2psync.control.api import ResponseResult, RolloutRequest
    from p2psync.errors import LeaseExpired, P2PSyncError

    work = node.work
    delay, every = float(options.get("token_delay", 0.1)), int(options.get("report_every", 8))
    try:
        while True:
            try:
                grants = await work.request(1, wait=5.0, version=node.version)
            except P2PSyncError as exc:  # coordinator unreachable (partition, restart): ask again
                logger.info("no lease: %s", exc)
                await asyncio.sleep(1.0)
                continue
            for g in grants:
                req = RolloutRequest.from_json(g.payload)
                done = {r: ResponseResult.from_json(d) for r, d in g.done.items()}
                try:
                    for r in range(g.responses):
                        if r in done:
                            continue
                        toks, lps, vers = (list(x) for x in g.resume.get(r, ([], [], [])))
                        sent = len(toks)
                        while len(toks) < req.max_new_tokens:
                            await asyncio.sleep(delay)
                            toks.append(len(toks))
                            lps.append(-0.5)
                            vers.append(node.version or 0)
                            if len(toks) - sent >= every and len(toks) < req.max_new_tokens:
                                await work.progress(g, r, sent, toks[sent:], lps[sent:], vers[sent:])
                                sent = len(toks)
                        await work.progress(g, r, sent, toks[sent:], lps[sent:], vers[sent:], finish_reason="length")
                        done[r] = ResponseResult(toks, lps, vers, "length")
                    await work.complete(g, done)
                except LeaseExpired:
                    logger.info("lease on %s lost", g.work_id)
                except P2PSyncError as exc:  # the lease will expire and the work move
                    logger.info("dropping %s: %s", g.work_id, exc)
    except asyncio.CancelledError:
        await work.release_all()
        raise
