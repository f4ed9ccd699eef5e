"""The testbed's observer against real event streams on a loopback socket."""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from p2psync.testbed.observe import warm, watch


class Streams:
    """A loopback HTTP server: ``/v1/events`` sends each catalogue of ``catalogues`` then stays open
    and silent, as a node does between changes; ``/metrics`` lists a warm codec when ``warm_codec``."""

    def __init__(self, catalogues: list[dict], warm_codec: bool = True) -> None:
        self.catalogues, self.warm_codec = catalogues, warm_codec
        self.loop = asyncio.new_event_loop()
        self.url = ""
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        assert started.wait(10)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for cat in self.catalogues:
            await resp.write(f"data: {json.dumps(cat)}\n\n".encode())
        await asyncio.sleep(3600)
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="p2psync_codec_warm_seconds 0.5\n" if self.warm_codec else "p2psync_up 1\n")

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/events", self._events)
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        started.set()
        self.loop.run_forever()


def test_a_version_held_before_ready_ends_the_wait():
    # Nodes that loaded version 0 before the observer connected send one catalogue, then nothing.
    node = Streams([{"version": 0, "fingerprint": "f0", "artifacts": []}])
    ready: list[bool] = []
    out = watch({"n": node.url}, "t", 0, timeout=4, on_ready=lambda: ready.append(True))
    assert ready == [True]
    assert out["timed_out"] == [] and out["nodes"]["n"]["version"] == 0


def test_a_version_not_yet_held_is_waited_for_and_what_came_before_ready_does_not_count():
    node = Streams([{"version": 0, "fingerprint": "f0", "artifacts": []},
                    {"version": 0, "fingerprint": "f0", "artifacts": [{"target": 1, "complete": True}]},
                    {"version": 1, "fingerprint": "f1", "artifacts": []}])
    out = watch({"n": node.url}, "t", 1, timeout=4, on_ready=lambda: None)
    rec = out["nodes"]["n"]
    assert out["timed_out"] == [] and rec["fingerprint"] == "f1"
    assert rec["announced"] <= rec["received"] <= rec["applied"]
    stuck = Streams([{"version": 0, "fingerprint": "f0", "artifacts": []}])
    assert watch({"s": stuck.url}, "t", 1, timeout=1.5, on_ready=lambda: None)["timed_out"] == ["s"]


def test_warm_lists_the_nodes_whose_codec_is_cold():
    hot, cold = Streams([], warm_codec=True), Streams([], warm_codec=False)
    assert warm({"hot": hot.url, "cold": cold.url}, "t", timeout=1.0, interval=0.1) == ["cold"]


def test_the_node_sets_observers_present_the_operators_certificate(tmp_path):
    # Nodes serve mutual TLS: an observer without the client certificate is refused at every poll.
    import subprocess
    import sys

    from p2psync.testbed.nodes import NodeSet

    class Spawner:
        args: list[list[str]] = []

        def spawn(self, ns, args, **kw):
            self.args.append(list(args))
            # The observer prints "ready", then its result once the nodes got there.
            script = ('print(\'{"cold": []}\')' if "--warm" in args else
                      'import time; print("ready", flush=True); time.sleep(0.3); '
                      'print(\'{"nodes": {}, "timed_out": []}\')')
            return subprocess.Popen([sys.executable, "-c", script], **kw)

    tb = Spawner()
    nodes = NodeSet(tb=tb, token="t", tls_dir=tmp_path, urls={"n": "https://10.0.0.2:7070"})  # type: ignore[arg-type]
    nodes.wait_warm(5)
    nodes.watch(0, 5)
    assert [a.count(f"--tls-dir={tmp_path}") for a in tb.args] == [1, 1]
