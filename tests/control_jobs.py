"""Deterministic jobs for the control-plane integration tests (run inside real ``p2psync node``
processes with ``--job tests.control_jobs:trainer`` or ``--job tests.control_jobs:rollout``).

Fake tokens say who made them: token ``i`` of a response made by node ``n`` is
``tag(n) * 10_000 + i``. A response is intact when ``token % 10_000 == i`` for
every position (no gap, no repeat), and a migrated one shows the tag changing
at the position where the next holder continued.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("tests.control_jobs")


def tag(node_id: str) -> int:
    return 1 + int.from_bytes(hashlib.blake2b(node_id.encode(), digest_size=2).digest(), "little") % 99


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


async def trainer(node, options: dict[str, Any]) -> int:
    """Submit ``work`` prompt groups (once ``start_file`` exists, if given) and write each accepted
    result to ``out`` (JSON lines).

    Stays running after the last result (the node keeps publishing and serving).
    """
    from p2psync.control.api import RolloutRequest

    coord = node.coordinator
    n, responses = int(options["work"]), int(options.get("responses", 2))
    if options.get("start_file"):  # the test says when every node is up
        while not Path(options["start_file"]).exists():
            await asyncio.sleep(0.1)
    req = RolloutRequest(prompt_ids=[1, 2, 3], max_new_tokens=int(options.get("max_new_tokens", 24)))
    for i in range(n):
        coord.submit(f"w{i:03d}", req.to_json(), prompt_key=f"p{i % 3}", responses=responses)
    seen = 0
    async for r in coord.results():
        _append(options["out"], {"work_id": r.work_id, "node": r.node, "migrated": r.migrated,
                                 "responses": [x.to_json() for x in r.responses]})
        seen += 1
        if seen == n:
            _append(options["out"], {"done": True, "pending": coord.pending()})
    await asyncio.Event().wait()
    return 0


async def rollout(node, options: dict[str, Any]) -> int:
    """Take grants one at a time and "generate" slowly, reporting progress every few tokens."""
    from p2psync.control.api import ResponseResult, RolloutRequest
    from p2psync.errors import LeaseExpired, PeerUnreachable

    work = node.work
    delay = float(options.get("token_delay", 0.05))
    every = int(options.get("report_every", 4))
    me = tag(node.config.id)
    log = Path(options["log_dir"]) / f"{node.config.id}.jsonl" if options.get("log_dir") else None
    try:
        while True:
            grants = await work.request(1, wait=2.0)
            for g in grants:
                req = RolloutRequest.from_json(g.payload)
                if log is not None:
                    _append(str(log), {"work_id": g.work_id, "lease_id": g.lease_id,
                                       "resume": {r: len(v[0]) for r, v in g.resume.items()}})
                done: dict[int, ResponseResult] = {r: ResponseResult.from_json(d) for r, d in g.done.items()}
                try:
                    for r in range(g.responses):
                        if r in done:
                            continue
                        toks, lps, vers = (list(x) for x in g.resume.get(r, ([], [], [])))
                        sent = len(toks)
                        while len(toks) < req.max_new_tokens:
                            await asyncio.sleep(delay)
                            i = len(toks)
                            toks.append(me * 10_000 + i)
                            lps.append(-0.5 - (i % 7) / 10)
                            vers.append(node.version or 0)
                            if len(toks) - sent >= every:
                                await work.progress(g, r, sent, toks[sent:], lps[sent:], vers[sent:])
                                sent = len(toks)
                                if log is not None and sent < req.max_new_tokens:  # the coordinator holds these
                                    _append(str(log), {"work_id": g.work_id, "response": r, "reported": sent})
                        await work.progress(g, r, sent, toks[sent:], lps[sent:], vers[sent:], finish_reason="length")
                        done[r] = ResponseResult(toks, lps, vers, "length")
                    accepted = await work.complete(g, done)
                    logger.info("work %s completed (accepted: %s)", g.work_id, accepted)
                except LeaseExpired:
                    logger.info("lease on %s lost; dropping it", g.work_id)
                except PeerUnreachable as exc:
                    # The coordinator did not answer for a while: the lease will expire and the work move.
                    logger.warning("coordinator unreachable, dropping %s: %s", g.work_id, exc)
    except asyncio.CancelledError:
        # Preemption notice (SIGTERM): hand everything back at once, with the tokens reported.
        await work.release_all()
        raise
