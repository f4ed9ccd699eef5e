"""Start real ``p2psync node`` processes on the testbed's machines, wired as a given tree.

Every machine runs one node listening on its own address (``--listen.host``,
a fixed port: each machine has its own IP), with the parents a plan gives it
(and its fallbacks after them); the trainer publishes artifact files dropped
into ``publish_dir``. Every link is mutually authenticated TLS: the cluster CA
lives beside the trainer key (made there if missing), each node's certificate
(its id and region) is issued into ``<workdir>/<name>/tls`` and the observer
presents the CA's client certificate. The processes run inside the testbed's namespaces, so
``Testbed.down`` ends them even if the caller dies; normally
:meth:`NodeSet.stop` ends them by pid.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from p2psync.testbed.errors import TestbedError
from p2psync.testbed.runner import Testbed

PORT = 7070
CLI = [sys.executable, "-c", "import sys; from p2psync.cli import main; sys.exit(main())"]


@dataclass
class NodeSet:
    tb: Testbed
    token: str
    tls_dir: Path | None = None
    """The client certificate the observer presents (None: the nodes serve plain HTTP)."""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        Testbed.stop(list(self.procs.values()))

    def _observer(self, *opts: str) -> subprocess.Popen:
        """:mod:`p2psync.testbed.observe` on every node, from the core namespace, with the operator's
        client certificate where the nodes serve TLS."""
        args = [sys.executable, "-m", "p2psync.testbed.observe", "--token", self.token, *opts,
                *([f"--tls-dir={self.tls_dir}"] if self.tls_dir else []),
                *(f"{n}={u}" for n, u in self.urls.items())]
        return self.tb.spawn("core", args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def watch(self, version: int, timeout: float, interval: float = 0.01, then=None) -> dict:
        """Run the observer in the core namespace until every node applied ``version``; ``then()`` runs once
        the observer is polling every node (publish there, so nothing happens before it looks)."""
        p = self._observer("--version", str(version), "--timeout", str(timeout), "--interval", str(interval))
        try:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise TestbedError(f"observer failed to start: {line!r} {p.stderr.read()[-2000:] if p.stderr else ''}")
            if then is not None:
                then()
            out, err = p.communicate(timeout=timeout + 60)
        finally:
            if p.poll() is None:
                Testbed.stop([p])
        if p.returncode != 0 or not out.strip():
            raise TestbedError(f"observer failed: {err[-2000:]}")
        return json.loads(out.strip().splitlines()[-1])


    def wait_warm(self, timeout: float) -> None:
        """Return once every node's codec is warm (it applies at full speed); TestbedError after ``timeout``."""
        p = self._observer("--warm", "--timeout", str(timeout))
        try:
            out, err = p.communicate(timeout=timeout + 60)
        finally:
            if p.poll() is None:
                Testbed.stop([p])
        cold = json.loads(out.strip().splitlines()[-1])["cold"] if p.returncode == 0 and out.strip() else None
        if cold is None or cold:
            raise TestbedError(f"codec not warm after {timeout:.0f} s on {cold}: {err[-2000:]}")


def order(parents: Mapping[str, Sequence[str]], root: str) -> list[str]:
    """Parents before children (breadth first from ``root``); unreachable nodes last."""
    kids: dict[str, list[str]] = {}
    for c, ps in parents.items():
        kids.setdefault(ps[0], []).append(c)
    out, todo = [root], [root]
    while todo:
        n = todo.pop(0)
        for c in kids.get(n, []):
            out.append(c)
            todo.append(c)
    return out + [n for n in parents if n not in out]


def start(tb: Testbed, parents: Mapping[str, Sequence[str]], workdir: Path, keydir: Path, token: str,
          publish_dir: Path, extra: Sequence[str] = (), log_level: str = "WARNING", tls: bool = True) -> NodeSet:
    """One node per machine of ``parents`` (child -> candidate parents, best first) plus the trainer.
    ``tls=False``: plain HTTP (``tls.enabled = false``), to measure what TLS costs."""
    from p2psync.certs import Authority

    ca = Authority(keydir)
    ns = NodeSet(tb, token, ca.client() if tls else None)
    root = tb.trainer.id
    scheme = "https" if tls else "http"
    try:
        for name in order(parents, root):
            m = tb.machines[name]
            url = f"{scheme}://{m.ip}:{PORT}"
            if tls:
                ca.node(name, m.region, workdir / name / "tls", hosts=[m.ip])  # its address, for curl
            args = [*CLI, "--log-level", log_level, "node", "--role", "trainer" if name == root else "rollout",
                    "--id", name, f"--region={m.region}", f"--listen.host={m.ip}", f"--listen.port={PORT}",
                    f"--data_dir={workdir / name}", f"--cluster_token={token}",
                    f"--trainer_public_key={keydir / 'trainer.pub'}", f"--tls.enabled={'true' if tls else 'false'}",
                    *extra]
            if name == root:
                args += [f"--trainer_private_key={keydir / 'trainer.key'}", f"--publish-dir={publish_dir}"]
            else:
                cands = [f"{scheme}://{tb.machines[p].ip}:{PORT}" for p in parents[name]]
                args.append("--parents=" + ",".join(cands))
            with open(workdir / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
                p = tb.spawn(name, args, stdout=subprocess.PIPE, stderr=log, text=True)
            ns.procs[name] = p
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if not line.startswith("http"):
                raise TestbedError(f"node {name} did not start: {line!r}; see {workdir / f'{name}.log'}")
            ns.urls[name] = url
    except BaseException:
        ns.stop()
        raise
    return ns
