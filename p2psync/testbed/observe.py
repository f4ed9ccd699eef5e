"""Watch p2psync nodes from inside the testbed until each holds and has applied a version.

Runs in the core namespace (``ip netns exec <name>-core``), which reaches every
machine without crossing the delay line or a region's uplink, so what it sees
is not delayed by the emulated WAN. One thread per node follows the node's
event stream (``GET /v1/events``: one catalogue per change, pushed by the node,
so watching costs the nodes nothing between changes, unlike polling their
status); times are ``time.monotonic()`` (system-wide, so comparable with the
caller's clock).

    python -m p2psync.testbed.observe --token T --version 3 --timeout 60 NAME=URL ...
    python -m p2psync.testbed.observe --token T --warm --timeout 60 NAME=URL ...

Prints "ready" once every node delivered its first catalogue (act then:
publish), then one JSON object: per node ``announced`` (first catalogue that
listed an artifact targeting the version, complete or still in flight: for the
trainer, the moment it made the artifact available), ``received`` (first
catalogue listing it complete), ``applied`` (first catalogue at that version or
later), ``version`` and ``fingerprint`` as last seen; ``timed_out`` lists the
nodes that did not get there. ``--warm`` instead waits until every node's codec
is warm (its ``/metrics`` list ``p2psync_codec_warm_seconds``) and prints the nodes
that are not.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import threading
import time
import urllib.request


def _events(url: str, token: str, timeout: float, context: ssl.SSLContext | None = None):
    """Catalogues from a node's server-sent event stream, as they arrive."""
    req = urllib.request.Request(url + "/v1/events", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
        data: list[str] = []
        for raw in r:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif not line and data:
                yield json.loads("\n".join(data))
                data = []


def watch(urls: dict[str, str], token: str, version: int, timeout: float, on_ready=None,
          context: ssl.SSLContext | None = None) -> dict:
    """Follow every node until it applied ``version``; ``on_ready()`` runs once every node sent a first catalogue.
    ``context``: the TLS client context (a client certificate of the cluster CA) for https nodes."""
    first = threading.Barrier(len(urls), action=on_ready) if on_ready else None
    out: dict[str, dict] = {n: {"announced": None, "received": None, "applied": None, "version": None,
                                "fingerprint": None} for n in urls}
    deadline = time.monotonic() + timeout

    def follow(name: str, url: str) -> None:
        rec = out[name]
        waiting = first
        while time.monotonic() < deadline:
            try:
                for cat in _events(url, token, max(1.0, deadline - time.monotonic()), context):
                    now = time.monotonic()
                    if waiting is not None:
                        waiting.wait(max(1.0, deadline - now))
                        waiting = None
                        v = cat.get("version")
                        if v is None or v < version:
                            continue  # what it held before "ready" does not count
                        # It held the version before "ready" (a wait for what nodes load at start):
                        # no later catalogue may come, so this one ends the wait.
                    for a in cat.get("artifacts", []):
                        if a.get("target") == version:
                            rec["announced"] = rec["announced"] or now
                            if a.get("complete") and rec["received"] is None:
                                rec["received"] = now
                    v = cat.get("version")
                    rec["version"], rec["fingerprint"] = v, cat.get("fingerprint")
                    if v is not None and v >= version:
                        rec["applied"] = now
                        rec["received"] = rec["received"] or now
                        rec["announced"] = rec["announced"] or now
                        return
                    if now > deadline:
                        return
            except (OSError, ValueError):
                time.sleep(0.05)

    threads = [threading.Thread(target=follow, args=(n, u), name=f"watch-{n}", daemon=True) for n, u in urls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 15)
    return {"nodes": out, "timed_out": sorted(n for n, r in out.items() if r["applied"] is None)}


def warm(urls: dict[str, str], token: str, timeout: float, interval: float = 0.2,
         context: ssl.SSLContext | None = None) -> list[str]:
    """Poll every node's metrics until its codec is warm; the nodes still cold at ``timeout``.
    ``context``: the TLS client context for https nodes."""
    cold = dict(urls)
    deadline = time.monotonic() + timeout
    while cold and time.monotonic() < deadline:
        for name, url in list(cold.items()):
            req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(req, timeout=5, context=context) as r:
                    if b"\np2psync_codec_warm_seconds" in b"\n" + r.read():
                        del cold[name]
            except OSError:
                pass
        if cold:
            time.sleep(interval)
    return sorted(cold)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--token", required=True)
    ap.add_argument("--version", type=int, default=None)
    ap.add_argument("--warm", action="store_true", help="wait until every node's codec is warm instead")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--interval", type=float, default=0.01, help="ignored (the observer follows event streams)")
    ap.add_argument("--tls-dir", default="", help="client certificate folder for https nodes")
    ap.add_argument("nodes", nargs="+", metavar="NAME=URL")
    a = ap.parse_args(argv)
    urls = dict(n.split("=", 1) for n in a.nodes)
    from p2psync.transport.tls import Tls

    ctx = Tls.for_client(a.tls_dir or None).client_context
    if a.warm:
        print(json.dumps({"cold": warm(urls, a.token, a.timeout, context=ctx)}), flush=True)
        return 0
    if a.version is None:
        ap.error("--version or --warm is required")
    result = watch(urls, a.token, a.version, a.timeout, on_ready=lambda: print("ready", flush=True), context=ctx)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
