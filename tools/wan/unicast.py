"""Full-weight HTTP unicast baseline: one aiohttp file server at the trainer, every machine downloads.

    python tools/wan/unicast.py serve --host IP --port 8080 --dir DIR        # prints "ready"
    python tools/wan/unicast.py fetch --url URL --out FILE       # "ready", then reads the start time on stdin

``fetch`` imports everything, prints "ready", reads a ``time.monotonic()``
value on stdin (the driver sends one to every client once all are ready),
waits until then, streams the file to disk in 4 MiB reads and prints one JSON line with
its start and end times (``time.monotonic()``, system-wide) and the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


async def serve(host: str, port: int, directory: str) -> None:
    from aiohttp import web

    app = web.Application()
    app.router.add_static("/", directory)  # FileResponse: sendfile, no copy through Python
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=1024).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def fetch(url: str, out: str) -> dict:
    import aiohttp

    print("ready", flush=True)
    go = float(await asyncio.to_thread(sys.stdin.readline))
    await asyncio.sleep(max(0.0, go - time.monotonic()))
    t0 = time.monotonic()
    n = 0
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url) as r:
        r.raise_for_status()
        with open(out, "wb") as f:  # noqa: ASYNC230 - local disk, 4 MiB writes; the network is the subject
            async for block in r.content.iter_chunked(4 << 20):
                f.write(block)
                n += len(block)
    return {"start": t0, "end": time.monotonic(), "bytes": n}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["serve", "fetch"])
    ap.add_argument("--host")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--dir")
    ap.add_argument("--url")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.mode == "serve":
        asyncio.run(serve(a.host, a.port, a.dir))
    else:
        print(json.dumps(asyncio.run(fetch(a.url, a.out))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
