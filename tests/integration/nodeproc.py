"""Helpers for integration tests that start real ``p2psync node`` processes on loopback.

Every process is started from the CLI with ``--listen.port=0`` and serves mutual TLS
with a certificate of the tests' CA (:mod:`tlsutil`, issued into ``<data_dir>/tls``;
the tests' own requests present a client certificate); its address is read back
from its first stdout line; it is ended by its pid (SIGTERM, then
SIGKILL if it lingers) and only if this test started it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import tlsutil

TOKEN = "test-cluster-token-0123456789"
CHUNK = 64 << 10
CLI = [sys.executable, "-c", "import sys; from p2psync.cli import main; sys.exit(main())"]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    url: str
    log: Path
    data_dir: Path
    args: list[str] = field(default_factory=list)

    def status(self, timeout: float = 5.0) -> dict:
        return get_json(self.url + "/v1/status", timeout)

    def metrics(self) -> str:
        return request(self.url + "/metrics")[1].decode()

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def stop(self) -> int:
        self.kill(signal.SIGTERM)
        try:
            return self.popen.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.popen.pid, signal.SIGKILL)
            return self.popen.wait(5)


def request(url: str, token: str | None = TOKEN, headers: dict | None = None, timeout: float = 5.0,
            method: str = "GET", data: bytes | None = None) -> tuple[int, bytes]:
    h = dict(headers or {})
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, headers=h, method=method, data=data)
    ctx = tlsutil.client_context() if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get_json(url: str, timeout: float = 5.0) -> dict:
    code, body = request(url, timeout=timeout)
    assert code == 200, (url, code, body[:200])
    return json.loads(body)


@dataclass
class Cluster:
    """Keys, artifacts and the processes of one test; stops what it started."""

    root: Path
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        from p2psync import keys

        self.keydir = self.root / "keys"
        self.priv = keys.generate()
        keys.write_pair(self.priv, self.keydir)
        self.publish_dir = self.root / "publish"
        self.publish_dir.mkdir()

    def start(self, name: str, role: str, parents: list[str] = (), extra: list[str] = (),
              publish: bool = False, data_dir: Path | None = None) -> Proc:
        data_dir = data_dir or self.root / name
        region = next((a.split("=", 1)[1] for a in extra if a.startswith("--region=")), "default")
        if not (data_dir / "tls" / "node.crt").exists():
            tlsutil.certify(data_dir, name, region)
        args = ["node", "--role", role, "--id", name, "--listen.port=0", f"--data_dir={data_dir}",
                f"--cluster_token={TOKEN}", f"--trainer_public_key={self.keydir / 'trainer.pub'}",
                "--limits.stall_timeout=3", "--limits.chunk_wait_timeout=2", "--limits.retry_after=0.3",
                "--limits.sse_keepalive=1", "--limits.poll_interval=1", "--store.snapshot_chunk_size=65536",
                "--store.snapshot_interval=5", *extra]
        if parents:
            args.append("--parents=" + ",".join(parents))
        if role == "trainer":
            args.append(f"--trainer_private_key={self.keydir / 'trainer.key'}")
        if publish:
            args.append(f"--publish-dir={self.publish_dir}")
        return self._spawn(name, args, data_dir)

    def _spawn(self, name: str, args: list[str], data_dir: Path) -> Proc:
        log = self.root / f"{name}.log"
        with open(log, "ab") as err:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=err, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = popen.stdout.readline().strip()
        if not line.startswith("http"):
            popen.kill()
            raise AssertionError(f"{name} did not print its address: {line!r}\n{log.read_text()[-3000:]}")
        p = Proc(name, popen, line, log, data_dir, args)
        self.procs.append(p)
        return p

    def restart(self, p: Proc, same_port: bool = False, stop: bool = True) -> Proc:
        """Stop ``p`` (SIGTERM; ``stop=False``: it was stopped already) and start it again with the same
        arguments and data dir; ``same_port``: on the port it had (else a fresh one, so its address changes)."""
        if stop:
            p.stop()
        self.procs.remove(p)
        args = list(p.args)
        if same_port:
            port = p.url.rsplit(":", 1)[1].rstrip("/")
            args = [f"--listen.port={port}" if a == "--listen.port=0" else a for a in args]
        return self._spawn(p.name, args, p.data_dir)

    def stop_all(self) -> None:
        for p in self.procs:
            p.kill(signal.SIGTERM)
        for p in self.procs:
            p.stop()


class Workload:
    """A few random bf16 tensors; each version changes a random sparse subset (raw bit flips)."""

    def __init__(self, priv, numel: int = 400_000, fraction: float = 0.05, seed: int = 0) -> None:
        import torch

        from p2psync.state import ModelState

        self.priv = priv
        self.fraction = fraction
        self.gen = torch.Generator().manual_seed(seed)
        sizes = {"embed.weight": numel // 2, "layer.0.w": numel // 4, "layer.0.b": numel // 4}
        self.state = ModelState({n: torch.randn(s, generator=self.gen).to(torch.bfloat16) for n, s in sizes.items()})
        self.version = 0
        self.fingerprints = {0: self.state.fingerprint}

    def snapshot(self, directory: Path) -> Path:
        from p2psync.artifact import build_manifest, write_file
        from p2psync.codec.encode import CodecOptions, encode_snapshot

        enc = encode_snapshot(self.state, CodecOptions(chunk_size=CHUNK))
        m = build_manifest(enc, model_id="test", target_version=self.version, chunk_size=CHUNK,
                           private_key=self.priv)
        path = directory / f"{self.version:06d}-snapshot.p2sa"
        write_file(path, m, enc.chunks)
        return path

    def step(self, directory: Path) -> Path:
        import torch

        from p2psync.artifact import build_manifest, write_file
        from p2psync.codec.encode import CodecOptions, encode_delta

        new = self.state.clone()
        for name in new:
            t = new.tensor(name).view(torch.int16).reshape(-1)
            mask = torch.rand(t.shape[0], generator=self.gen) < self.fraction
            t[mask] = t[mask] ^ torch.randint(1, 64, (int(mask.sum()),), generator=self.gen, dtype=torch.int16)
        new.invalidate()
        enc = encode_delta(self.state, new, CodecOptions(chunk_size=CHUNK))
        m = build_manifest(enc, model_id="test", base_version=self.version, target_version=self.version + 1,
                           chunk_size=CHUNK, private_key=self.priv)
        self.state = new
        self.version += 1
        self.fingerprints[self.version] = new.fingerprint
        path = directory / f"{self.version:06d}-delta.p2sa"
        write_file(path, m, enc.chunks)
        return path


def wait_for(pred, timeout: float, what: str, interval: float = 0.1):
    """Poll ``pred`` until it returns a truthy value (no timing assertion: the test timeout bounds it)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except (OSError, AssertionError, ValueError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"gave up waiting for {what}: last={last!r}")


def at_version(p: Proc, version: int):
    s = p.status()
    return s if s["version"] is not None and s["version"] >= version else None
