"""Start a local p2psync cluster as real processes, and stop exactly what was started.

Layout (``regions`` regions, region 0 also holds the trainer)::

    trainer (region r0) --+--> relay r0-relay --> rollout r0-1, r0-2, ...
                          +--> relay r1-relay --> rollout r1-1, ...

Each process is a ``p2psync node`` on ``127.0.0.1`` port 0; its address is
read from its first stdout line. Nodes log JSON lines (``--log-json``) to
``logs/<name>.log``: the demo reads its timings from them. Configured parents are the static fallback
(rollouts: their region's relay, then the trainer; relays: the trainer); when
the control plane is live the coordinator's plan takes over. The trainer runs
the training job (``--job``), every rollout node the rollout worker.

Every link is mutually authenticated TLS, as in production: the cluster CA is made
under ``keys/`` beside the trainer key, each node's certificate (its id and region)
is issued into ``nodes/<name>/tls`` before it starts, and the demo's own requests
present the client certificate ``keys/clients/operator``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-c", "import sys; from p2psync.cli import main; sys.exit(main())"]


@dataclass
class Proc:
    """One node process started by :class:`LocalCluster`."""

    name: str
    role: str
    region: str
    popen: subprocess.Popen
    url: str
    log: Path
    data_dir: Path
    parents: list[str] = field(default_factory=list)
    """Configured parents (URLs), in order: the first is the node's parent until a plan or a failure moves it."""

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.popen.pid, sig)


@dataclass
class ClusterSpec:
    regions: int = 2
    rollouts_per_region: int = 2
    relays_per_region: int = 1
    chunk_size: int = 256 << 10
    """Chunk size of trainer-signed snapshots (the publisher picks its delta chunk size)."""
    extra_args: list[str] = field(default_factory=list)
    """Extra ``--section.field=value`` overrides for every node."""
    host: str = "127.0.0.1"
    """Loopback address every node listens on."""
    capture: str = ""
    """Folder: put a recording relay in front of every node (:mod:`demo.capture`)."""
    log_json: bool = True
    """Nodes log JSON lines with their own timestamps (:mod:`demo.timeline` reads them)."""

    def region_name(self, r: int) -> str:
        return f"r{r}"


class LocalCluster:
    """Keys, token, configs and processes under ``root``; :meth:`stop` ends what it started."""

    def __init__(self, root: Path, spec: ClusterSpec) -> None:
        from p2psync import keys

        self.root = root
        self.spec = spec
        self.root.mkdir(parents=True, exist_ok=True)
        from p2psync.certs import Authority
        from p2psync.transport.tls import Tls

        self.keydir = root / "keys"
        keys.write_pair(keys.generate(), self.keydir)
        self.authority = Authority(self.keydir)
        self.tls = Tls.for_client(self.authority.client())
        self.token = secrets.token_hex(16)
        (root / "cluster.token").write_text(self.token)
        os.chmod(root / "cluster.token", 0o600)
        self.procs: list[Proc] = []
        self.recorder = None
        if spec.capture:
            from demo.capture import Recorder

            self.recorder = Recorder(Path(spec.capture))

    # ------------------------------------------------------------------ processes
    def _args(self, name: str, role: str, region: str, parents: list[str], seeds: list[str]) -> list[str]:
        data_dir = self.root / "nodes" / name
        args = ["--log-json"] if self.spec.log_json else []
        args += ["node", "--role", role, "--id", name, f"--region={region}", f"--listen.host={self.spec.host}",
                "--listen.port=0", f"--data_dir={data_dir}",
                f"--cluster_token_file={self.root / 'cluster.token'}",
                f"--trainer_public_key={self.keydir / 'trainer.pub'}",
                f"--store.snapshot_chunk_size={self.spec.chunk_size}",
                "--limits.stall_timeout=5", "--limits.retry_after=0.5", "--limits.sse_keepalive=2",
                "--limits.poll_interval=2", *self.spec.extra_args]
        if role == "trainer":
            args.append(f"--trainer_private_key={self.keydir / 'trainer.key'}")
        if parents:
            args.append("--parents=" + ",".join(parents))
        if seeds and self._has_gossip():
            args.append("--gossip.seeds=" + ",".join(seeds))
        return args

    @staticmethod
    def _has_gossip() -> bool:
        from dataclasses import fields

        from p2psync.config import NodeConfig

        return "gossip" in {f.name for f in fields(NodeConfig)}

    def start(self, name: str, role: str, region: str, parents: Sequence[str] = (), seeds: Sequence[str] = (),
              job: str | None = None, job_config: dict[str, Any] | None = None,
              env: dict[str, str] | None = None, timeout: float = 120.0) -> Proc:
        args = self._args(name, role, region, list(parents), list(seeds))
        self.authority.node(name, region, self.root / "nodes" / name / "tls")
        if self.recorder is not None:
            from demo.capture import free_port

            port = free_port(self.spec.host)
            front = self.recorder.front(name, self.spec.host, port)
            args += [f"--listen.port={port}", f"--listen.advertise=https://{self.spec.host}:{front}"]
        if job:
            cfg_path = self.root / "jobs" / f"{name}.json"
            cfg_path.parent.mkdir(parents=True, exist_ok=True)
            cfg_path.write_text(json.dumps(job_config or {}, indent=1))
            args += ["--job", job, "--job-config", str(cfg_path)]
        log = self.root / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        # The node stops if this process dies without stopping it (SIGKILL, a crash).
        penv = {**os.environ, "PYTHONUNBUFFERED": "1", "P2PSYNC_EXIT_WITH_PARENT": str(os.getpid()), **(env or {})}
        with open(log, "ab") as err:  # the child keeps its own copy of the descriptor
            popen = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=err, text=True, env=penv,
                                     start_new_session=True)
        line = _readline(popen, timeout)
        if not line.startswith("http"):
            popen.kill()
            popen.wait()
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"node {name} did not start (first line {line!r}); log tail:\n{tail}")
        proc = Proc(name, role, region, popen, line, log, self.root / "nodes" / name, list(parents))
        self.procs.append(proc)
        return proc

    def by_role(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, all threads) each live node process used so far, from ``/proc``."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for p in self.procs:
            try:
                fields = Path(f"/proc/{p.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone already (or not Linux)
                continue
            out[p.name] = round((int(fields[11]) + int(fields[12])) / tick, 2)
        return out

    def stop(self, grace: float = 15.0) -> dict[str, int | None]:
        """SIGTERM rollouts first (they hand back work), then the rest; SIGKILL what lingers."""
        order = self.by_role("rollout") + self.by_role("relay") + self.by_role("trainer")
        codes: dict[str, int | None] = {}
        for group in (order[: len(self.by_role("rollout"))], order[len(self.by_role("rollout")):]):
            for p in group:
                p.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in group:
                try:
                    codes[p.name] = p.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.signal(signal.SIGKILL)
                    codes[p.name] = p.popen.wait(5)
        for p in self.procs:
            if p.popen.stdout:
                p.popen.stdout.close()
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
        return codes

    def wait_planned(self, names: list[str], timeout: float = 30.0) -> bool:
        """Wait until the coordinator's plan (the trainer's ``/v1/cluster``) gives every node in ``names``
        a parent; False if it did not within ``timeout``."""
        trainer = next((p for p in self.procs if p.role == "trainer"), None)
        if trainer is None or not names:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                nodes = self.get_json(trainer.url + "/v1/cluster").get("nodes", [])
            except (OSError, urllib.error.URLError, ValueError):
                nodes = []
            planned = {n.get("id") for n in nodes if isinstance(n, dict) and n.get("parent")}
            if set(names) <= planned:
                return True
            time.sleep(0.2)
        return False

    # ------------------------------------------------------------------ HTTP
    def get_json(self, url: str, timeout: float = 2.0) -> dict:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"})
        with self.tls.urlopen(req, timeout) as resp:
            return json.loads(resp.read())

    def status(self, proc: Proc, timeout: float = 2.0) -> dict | None:
        """The node's /v1/status, or None if it does not answer."""
        try:
            return self.get_json(proc.url + "/v1/status", timeout)
        except (OSError, urllib.error.URLError, ValueError):
            return None


def _readline(popen: subprocess.Popen, timeout: float) -> str:
    """First stdout line of ``popen`` within ``timeout`` seconds ('' if none)."""
    import selectors

    assert popen.stdout is not None  # started with stdout=PIPE
    sel = selectors.DefaultSelector()
    sel.register(popen.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            return ""
        return popen.stdout.readline().strip()
    finally:
        sel.close()
