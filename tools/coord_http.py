"""The coordinator's HTTP cost per gossip message, on a real trainer node process.

``tools/gossip_scale.py`` and ``tools/coord_scale.py`` count what the coordinator's gossip code
costs (:class:`~p2psync.gossip.protocol.GossipNode` and the live plan); every message also arrives
as an HTTP POST on the node's aiohttp server (``POST /v1/gossip``), over mutual TLS in production.
This tool measures that part: it starts ``p2psync node --role trainer`` (gossip on, the trainer key,
its certificate), lets it settle, then posts ``Report`` messages (what every member sends the
coordinator at least every ``gossip.report_interval``, 10 s: ``n / 10`` a second at ``n`` members)
at a fixed rate from ``--senders`` members, each presenting its own certificate, and reads the node
process's CPU time from ``/proc`` over the window. Per message it writes the CPU beyond the node's
idle rate, in three modes:

- ``tls_keepalive``: mutual TLS, each sender on one kept connection (a member's gossip session keeps
  its connection between reports: aiohttp's client keeps an idle connection 15 s);
- ``tls_connect``: mutual TLS, a new connection and handshake per message (members whose
  connection lapsed: reports further apart than the keep-alive, or a restarted coordinator);
- ``plain``: HTTP without TLS (``tls.enabled = false``), the floor.

From those it derives the share of one core that reports at ``n / 10`` a second would take at
10,000 and 100,000 members (what members' report spacing, ``gossip.report_budget``, now bounds),
and it records this machine's open-files limit (a kept connection per member is a descriptor).

    PYTHONPATH=$PWD .venv/bin/python tools/coord_http.py --rate 400 --seconds 15 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from p2psync import certs, keys
from p2psync.control.gossip_service import FROM_HEADER
from p2psync.gossip.messages import Report, dumps
from p2psync.transport.tls import Tls, connector

TOKEN = "coord-http-bench-token-0123456789"
CLI = [sys.executable, "-c", "import sys; from p2psync.cli import main; sys.exit(main())"]
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def settle(pid: int, quiet: float = 0.05, limit: float = 60.0) -> None:
    """Wait until the node's start-up work (imports, the codec's compiled kernels, the first plan) is
    done: two one-second windows in a row under ``quiet`` of a core."""
    deadline, calm = time.monotonic() + limit, 0
    while calm < 2 and time.monotonic() < deadline:
        c = cpu_s(pid)
        time.sleep(1.0)
        calm = calm + 1 if cpu_s(pid) - c < quiet else 0


def start_trainer(root: Path, tls: bool) -> tuple[subprocess.Popen, str]:
    keydir = root / "keys"
    if not (keydir / "trainer.key").exists():
        keys.write_pair(keys.generate(), keydir)
        certs.create_ca(keydir)
    data = root / ("trainer-tls" if tls else "trainer-plain")
    certs.issue(keydir, "trainer", "default", data / "tls")
    args = ["node", "--role", "trainer", "--id", "trainer", "--listen.port=0", f"--data_dir={data}",
            f"--cluster_token={TOKEN}", f"--trainer_public_key={keydir / 'trainer.pub'}",
            f"--trainer_private_key={keydir / 'trainer.key'}", f"--tls.enabled={'true' if tls else 'false'}"]
    log = open(root / f"{data.name}.log", "ab")  # noqa: SIM115  (the child keeps its own descriptor)
    p = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=log, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    assert p.stdout is not None
    url = p.stdout.readline().strip()
    if not url.startswith("http"):
        p.kill()
        raise SystemExit(f"trainer did not start: {url!r}; see {root / (data.name + '.log')}")
    return p, url


def sender_tls(root: Path, i: int) -> Tls:
    folder = root / "senders" / f"m{i:05d}"
    if not (folder / certs.NODE_CERT).exists():
        certs.issue(root / "keys", f"m{i:05d}", "default", folder)
    return Tls.for_client(folder)


async def post_reports(url: str, root: Path, mode: str, senders: int, rate: float, seconds: float) -> dict[str, Any]:
    """Post ``rate`` reports a second for ``seconds`` from ``senders`` members; answers and latencies."""
    sessions = []
    for i in range(senders):
        tls = sender_tls(root, i) if mode != "plain" else None
        headers = {"Authorization": f"Bearer {TOKEN}", FROM_HEADER: f"https://m{i:05d}.invalid:7070",
                   "Content-Type": "application/json"}
        sessions.append(aiohttp.ClientSession(connector=connector(tls, limit=1, force_close=(mode == "tls_connect")),
                                              headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=10)))
    codes: dict[int, int] = {}
    lat: list[float] = []
    seq = 0

    async def one(i: int) -> None:
        nonlocal seq
        seq += 1
        body = dumps(Report(f"m{i:05d}", 1, versions=(seq,), throughput=100.0 + seq % 7, bandwidth=1e8))
        t = time.perf_counter()
        try:
            async with sessions[i].post(url + "/v1/gossip", data=body) as r:
                await r.read()
                codes[r.status] = codes.get(r.status, 0) + 1
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            codes[-1] = codes.get(-1, 0) + 1
            if codes[-1] == 1:
                print(f"  first send error: {exc!r}", flush=True)
        lat.append(time.perf_counter() - t)

    try:
        warm = [asyncio.create_task(one(i)) for i in range(senders)]  # connections (and handshakes) made
        await asyncio.gather(*warm)
        codes.clear()
        lat.clear()
        tasks: list[asyncio.Task] = []
        t0 = time.perf_counter()
        n = int(rate * seconds)
        for k in range(n):
            delay = t0 + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(k % senders)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    finally:
        for s in sessions:
            await s.close()
    lat.sort()
    return {"sent": n, "wall_s": wall, "codes": codes, "latency_p50_ms": round(1e3 * lat[len(lat) // 2], 2),
            "latency_p99_ms": round(1e3 * lat[int(len(lat) * 0.99)], 2)}


def measure(root: Path, mode: str, senders: int, rate: float, seconds: float, idle_s: float) -> dict[str, Any]:
    proc, url = start_trainer(root, tls=(mode != "plain"))
    try:
        settle(proc.pid)
        c0, t0 = cpu_s(proc.pid), time.monotonic()
        time.sleep(idle_s)
        idle_rate = (cpu_s(proc.pid) - c0) / (time.monotonic() - t0)
        c1, t1 = cpu_s(proc.pid), time.monotonic()
        sent = asyncio.run(post_reports(url, root, mode, senders, rate, seconds))
        busy, span = cpu_s(proc.pid) - c1, time.monotonic() - t1
        # The warm-up sends (one per sender, with its handshake) fall in the window too: counted in
        # the messages, so a handshake shows in the per-message cost of tls_keepalive only 1/n of the time.
        msgs = sent["sent"] + senders
        per_msg = max(0.0, busy - idle_rate * span) / msgs
        return {"mode": mode, "cpu_per_message_us": round(1e6 * per_msg, 1), "idle_cpu_share": round(idle_rate, 4),
                "busy_cpu_s": round(busy, 3), "messages": msgs, **sent}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=400.0, help="reports a second (default 400)")
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds of sending per mode (default 15)")
    ap.add_argument("--senders", type=int, default=64, help="members sending, each with its own certificate")
    ap.add_argument("--idle-seconds", type=float, default=5.0, help="seconds the node's idle CPU is measured")
    ap.add_argument("--modes", default="tls_keepalive,tls_connect,plain")
    ap.add_argument("--report-interval", type=float, default=10.0, help="gossip.report_interval the figures assume")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
                           "load_average_start": os.getloadavg()[0], "command": " ".join(["python", *sys.argv]),
                           "rate": args.rate, "senders": args.senders,
                           "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)}
    with tempfile.TemporaryDirectory(prefix="coord-http-") as tmp:
        for mode in args.modes.split(","):
            r = measure(Path(tmp), mode, args.senders, args.rate, args.seconds, args.idle_seconds)
            for n in (10_000, 100_000):
                r[f"core_share_reports_{n}"] = round(r["cpu_per_message_us"] * 1e-6 * n / args.report_interval, 3)
            out[mode] = r
            print(json.dumps(r), flush=True)
    out["load_average_end"] = os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
