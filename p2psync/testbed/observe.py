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
    python -m p2psync.testbed.observe --token T --poll 1 --timeout 900 [--leases NAME] NAME=URL ...

Prints "ready" once every node delivered its first catalogue (act then:
publish), then one JSON object: per node ``announced`` (first catalogue that
listed an artifact targeting the version, complete or still in flight: for the
trainer, the moment it made the artifact available), ``received`` (first
catalogue listing it complete), ``applied`` (first catalogue at that version or
later), ``version`` and ``fingerprint`` as last seen; ``timed_out`` lists the
nodes that did not get there. ``--warm`` instead waits until every node's codec
is warm (its ``/metrics`` list ``p2psync_codec_warm_seconds``) and prints the nodes
that are not. ``--poll S`` instead asks every node's ``GET /v1/status`` every S
seconds (one kept connection per node, all at once) and prints one JSON line per
round, ``{"t": ..., "nodes": {name: status or {"error": why}}, "leases": ...}``
(``leases``: the ``--leases`` node's ``GET /v1/control/status``, the
coordinator's lease table), until ``--timeout`` or its stdin closes.
``--head-as DIR --as-id ID`` asks every node's ``GET /v1/head`` once with the
node certificate in DIR (node ID's) and prints what each answered: an HTTP
status, or ``"cut"`` when the node closed the connection (how a revoked node is
refused).
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


def _get(conns: dict, name: str, url: str, path: str, token: str, context: ssl.SSLContext | None,
         timeout: float) -> dict:
    """``GET url+path`` as JSON over the connection kept for ``name`` (opened again after any error)."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = conns.get(name)
    if conn is None:
        conn = (http.client.HTTPSConnection(u.hostname or "", u.port, timeout=timeout, context=context)
                if u.scheme == "https" else http.client.HTTPConnection(u.hostname or "", u.port, timeout=timeout))
        conns[name] = conn
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise OSError(f"HTTP {r.status}: {body[:100]!r}")
        return json.loads(body)
    except BaseException:
        conns.pop(name, None)
        conn.close()
        raise


def poll(urls: dict[str, str], token: str, interval: float, timeout: float, leases: str | None = None,
         context: ssl.SSLContext | None = None, out=sys.stdout, stop: threading.Event | None = None) -> None:
    """Every ``interval`` s until ``timeout`` (or ``stop``): one line of every node's status (see the module doc)."""
    from concurrent.futures import ThreadPoolExecutor

    conns: dict[str, object] = {}
    ask = max(0.5, min(5.0, 2 * interval))
    jobs = [(n, u, "/v1/status") for n, u in urls.items()]
    if leases:
        jobs.append(("leases", urls[leases], "/v1/control/status"))

    def one(job: tuple[str, str, str]) -> tuple[str, dict]:
        name, url, path = job
        try:
            return name, _get(conns, name, url, path, token, context, ask)
        except (OSError, ValueError) as exc:
            return name, {"error": f"{type(exc).__name__}: {exc}"[:200]}

    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(len(jobs), thread_name_prefix="poll") as pool:
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            t0 = time.monotonic()
            got = dict(pool.map(one, jobs))
            line = {"t": t0, "nodes": {n: got[n] for n in urls}, "leases": got.get("leases")}
            try:
                out.write(json.dumps(line) + "\n")
                out.flush()
            except (BrokenPipeError, ValueError):  # the reader went away
                return
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))


def head_as(urls: dict[str, str], token: str, tls_dir: str, node_id: str, timeout: float = 10.0) -> dict[str, object]:
    """What each node answers ``GET /v1/head`` presenting node ``node_id``'s certificate (see the module doc)."""
    import urllib.error

    from p2psync.transport.tls import Tls

    ctx = Tls.for_client(tls_dir).client_context
    out: dict[str, object] = {}

    def one(name: str, url: str) -> None:
        req = urllib.request.Request(url + "/v1/head", headers={"Authorization": f"Bearer {token}",
                                                                "X-P2PSync-Node": node_id})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
                out[name] = r.status
        except urllib.error.HTTPError as exc:
            out[name] = exc.code
        except (ssl.SSLError, ConnectionError):
            out[name] = "cut"
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            out[name] = "cut" if isinstance(reason, (ssl.SSLError, ConnectionError)) else f"error: {reason}"

    threads = [threading.Thread(target=one, args=(n, u), daemon=True) for n, u in urls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--token", required=True)
    ap.add_argument("--version", type=int, default=None)
    ap.add_argument("--warm", action="store_true", help="wait until every node's codec is warm instead")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--interval", type=float, default=0.01, help="ignored (the observer follows event streams)")
    ap.add_argument("--tls-dir", default="", help="client certificate folder for https nodes")
    ap.add_argument("--poll", type=float, default=0.0, help="print every node's status every POLL seconds")
    ap.add_argument("--leases", default="", help="with --poll: the node whose lease table to print too")
    ap.add_argument("--head-as", default="", metavar="DIR", help="ask every node's /v1/head once as node --as-id")
    ap.add_argument("--as-id", default="", help="with --head-as: the node id the certificate in DIR names")
    ap.add_argument("nodes", nargs="+", metavar="NAME=URL")
    a = ap.parse_args(argv)
    urls = dict(n.split("=", 1) for n in a.nodes)
    from p2psync.transport.tls import Tls

    ctx = Tls.for_client(a.tls_dir or None).client_context
    if a.head_as:
        print(json.dumps(head_as(urls, a.token, a.head_as, a.as_id, a.timeout)), flush=True)
        return 0
    if a.poll:
        stop = threading.Event()

        def eof() -> None:  # the caller closed our stdin (or died): stop
            sys.stdin.read()
            stop.set()

        threading.Thread(target=eof, name="stdin-eof", daemon=True).start()
        poll(urls, a.token, a.poll, a.timeout, a.leases or None, context=ctx, stop=stop)
        return 0
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
