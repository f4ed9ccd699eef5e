"""Watch p2psync nodes from inside the testbed until each holds and has applied a version.

Runs in the core namespace (``ip netns exec <name>-core``), which reaches every
machine without crossing the delay line or a region's uplink, so what it sees
is not delayed by the emulated WAN. One thread per node polls ``/v1/status``
every ``--interval`` seconds; times are ``time.monotonic()`` (system-wide, so
comparable with the caller's clock).

    python -m p2psync.testbed.observe --token T --version 3 --timeout 60 NAME=URL ...

Prints "ready" once every node answered a first poll (act then: publish), then one JSON object: per node ``received`` (first poll that listed a complete
artifact targeting the version), ``applied`` (first poll at that version or
later), ``version`` and ``fingerprint`` as last seen; ``timed_out`` lists the
nodes that did not get there.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request


def _status(url: str, token: str) -> dict:
    req = urllib.request.Request(url + "/v1/status", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def watch(urls: dict[str, str], token: str, version: int, timeout: float, interval: float = 0.01,
          on_ready=None) -> dict:
    """Poll until every node applied ``version``; ``on_ready()`` runs once every node answered a first poll."""
    first = threading.Barrier(len(urls), action=on_ready) if on_ready else None
    out: dict[str, dict] = {n: {"received": None, "applied": None, "version": None, "fingerprint": None}
                            for n in urls}
    deadline = time.monotonic() + timeout

    def follow(name: str, url: str) -> None:
        rec = out[name]
        waiting = first
        while time.monotonic() < deadline:
            try:
                s = _status(url, token)
            except OSError:
                time.sleep(interval)
                continue
            now = time.monotonic()
            if waiting is not None:
                waiting.wait(max(1.0, deadline - now))
                waiting = None
                continue  # the caller acts on "ready": start timing from the next poll
            if rec["received"] is None and any(a.get("target") == version and a.get("complete")
                                               for a in s.get("versions", [])):
                rec["received"] = now
            v = s.get("version")
            rec["version"], rec["fingerprint"] = v, s.get("fingerprint")
            if v is not None and v >= version:
                rec["applied"] = now
                if rec["received"] is None:
                    rec["received"] = now
                return
            time.sleep(interval)

    threads = [threading.Thread(target=follow, args=(n, u), name=f"watch-{n}", daemon=True) for n, u in urls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 15)
    return {"nodes": out, "timed_out": sorted(n for n, r in out.items() if r["applied"] is None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--token", required=True)
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--interval", type=float, default=0.01)
    ap.add_argument("nodes", nargs="+", metavar="NAME=URL")
    a = ap.parse_args(argv)
    urls = dict(n.split("=", 1) for n in a.nodes)
    result = watch(urls, a.token, a.version, a.timeout, a.interval, on_ready=lambda: print("ready", flush=True))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
