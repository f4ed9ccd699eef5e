"""Shardcast (PyPI ``shardcast``) deployed as its README describes: an origin at the trainer, one middle
node per region, clients that download from their region's middle node.

    python tools/wan/shardcast_node.py origin --dir D --port 8000          # stdin: one file path per line
    python tools/wan/shardcast_node.py middle --dir D --port 8000 --upstream http://IP:8000
    python tools/wan/shardcast_node.py client --dir D --server http://IP:8000 --versions v1,v2

The origin prints "ready", then for each path read on stdin shards it
(``OriginServer.broadcast``) and prints ``{"version", "published"}`` once the
version is listed. A middle node runs ``MiddleNode`` (checking upstream every
second, the smallest interval it accepts) and prints ``{"version", "end"}``
when it has finished downloading each version's shards. A client polls the
version list of its server every 0.1 s, downloads and reassembles each version
(``ClientNode.download_version``, which verifies the blake3 checksum) and
prints ``{"version", "end"}``. Times are ``time.monotonic()``.

Shardcast wants a ``data1.bin`` on every server it talks to (its downloader
fetches it to test the server); origin and middle nodes write a 1-byte one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _private_paths(d: Path) -> None:
    """Shardcast's downloader keeps two scratch files at fixed paths (``/tmp/dummy.bin`` and
    ``temp_distribution.txt`` beside its package), fine with one client per machine but racy with
    every emulated machine on one filesystem. Same logic, with the paths moved into this node's folder."""
    import os

    import shardcast.client as sc
    import shardcast.client_node as scn
    import shardcast.middle_node as scm

    scratch = d / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)

    class Downloader(sc.ShardDownloader):
        def _init_server_metrics(self):  # type: ignore[override]
            for server in self.servers:
                tmp_path = scratch / "dummy.bin"
                if self._download_file(server, "data1.bin", tmp_path):
                    tmp_path.unlink()
                else:
                    raise Exception(f"Failed to download dummy file from {server}")

        def download_distribution_file(self):  # type: ignore[override]
            temp_path = str(scratch / "temp_distribution.txt")
            if self.download_file(sc.SHARDCAST_DISTRIBUTION_FILE, temp_path, update_metrics=False,
                                  log_error_on_failure=False):
                with open(temp_path) as f:
                    content = f.read()
                os.unlink(temp_path)
                return content
            return None

    scn.ShardDownloader = Downloader
    scm.ShardDownloader = Downloader


def _dummy(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "data1.bin").write_bytes(b"\0")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["origin", "middle", "client"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--upstream")
    ap.add_argument("--server")
    ap.add_argument("--versions", default="v1")
    a = ap.parse_args()
    d = Path(a.dir)
    import logging

    from shardcast.utils import logger

    logger.setLevel(logging.WARNING)
    _private_paths(d)
    if a.mode == "origin":
        from shardcast import OriginServer

        _dummy(d)
        origin = OriginServer(str(d), a.port)
        print("ready", flush=True)
        for line in sys.stdin:
            path = line.strip()
            if path:
                v = origin.broadcast(path)
                print(json.dumps({"version": v, "published": time.monotonic()}), flush=True)
        return 0
    if a.mode == "middle":
        from shardcast import MiddleNode

        _dummy(d)
        node = MiddleNode([a.upstream], str(d), a.port, check_interval=1)
        print("ready", flush=True)
        reported: set[str] = set()
        while True:
            for v in sorted(node.processed_versions - reported):
                reported.add(v)
                print(json.dumps({"version": v, "end": time.monotonic()}), flush=True)
            time.sleep(0.01)
    from shardcast import ClientNode

    while True:  # the middle node may still be starting
        try:
            client = ClientNode([a.server], str(d))
            break
        except Exception:  # noqa: BLE001 - shardcast raises a bare Exception for an unreachable server
            time.sleep(0.2)
    print("ready", flush=True)
    for v in a.versions.split(","):
        while v not in client.list_available_versions():
            time.sleep(0.1)
        if client.download_version(v, str(d / f"{v}.bin")) is None:
            print(json.dumps({"version": v, "error": "download failed"}), flush=True)
            return 1
        print(json.dumps({"version": v, "end": time.monotonic()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
