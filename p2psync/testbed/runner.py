"""Run commands inside the testbed's machines (any command: nodes, file servers, benchmark clients)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import p2psync.testbed.netns as netns
from p2psync.testbed.config import Machine, TestbedConfig
from p2psync.testbed.delay import LinkFaults
from p2psync.testbed.errors import TestbedError

REPO = Path(__file__).resolve().parents[2]


def expand(argv: Sequence[str], m: Machine, cfg: TestbedConfig) -> list[str]:
    """Fill ``{node}``, ``{ip}``, ``{region}``, ``{role}``, ``{namespace}``, ``{trainer_ip}`` in each argument."""
    trainer = next(x for x in cfg.machines() if x.role == "trainer")
    values = {"node": m.id, "ip": m.ip, "region": m.region, "role": m.role, "namespace": m.namespace,
              "trainer_ip": trainer.ip}
    out = []
    for a in argv:
        for k, v in values.items():
            a = a.replace("{" + k + "}", v)
        out.append(a)
    return out


class Testbed:
    """A built testbed. Contract: every process :meth:`spawn` starts runs inside one of the testbed's
    namespaces, so :meth:`down` (or ``p2psync testbed down`` after a crash) ends it."""

    __test__ = False  # not a pytest class

    def __init__(self, cfg: TestbedConfig, state: dict, state_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.state = state
        self.state_dir = state_dir
        self.machines = {m.id: m for m in cfg.machines()}

    @classmethod
    def up(cls, cfg: TestbedConfig, state_dir: Path | None = None) -> Testbed:
        return cls(cfg, netns.up(cfg, state_dir), state_dir)

    @classmethod
    def attach(cls, name: str, state_dir: Path | None = None) -> Testbed:
        st = netns.read_state(name, state_dir)
        if st is None or not st.get("complete"):
            raise TestbedError(f"no testbed {name!r} is up (state file {netns.state_path(name, state_dir)}); "
                               f"run `p2psync testbed up` first")
        return cls(netns.config_of(st), st, state_dir)

    def down(self) -> list[str]:
        return netns.down(self.cfg.name, self.state_dir)

    def set_link_faults(self, faults: Mapping[tuple[str, str], LinkFaults], seed: int | None = None) -> dict:
        """Put ``faults`` on the WAN (keyed by (source region, destination region), one direction each),
        replacing all others; ``{}`` heals every link. Returns the delay line's counters once in force."""
        return netns.set_link_faults(self.cfg.name, dict(faults), self.state_dir, seed=seed)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def trainer(self) -> Machine:
        return next(m for m in self.machines.values() if m.role == "trainer")

    def rollout_machines(self) -> list[Machine]:
        return [m for m in self.machines.values() if m.role != "trainer"]

    def namespace_of(self, target: str) -> str:
        """A machine id, or ``core`` / ``router:<region>``."""
        if target in self.machines:
            return self.machines[target].namespace
        if target == "core":
            return self.cfg.core_namespace
        if target.startswith("router:"):
            region = target.split(":", 1)[1]
            self.cfg.region_index(region)
            return self.cfg.router_namespace(region)
        raise TestbedError(f"{target!r} is neither a machine of testbed {self.cfg.name!r} "
                           f"({', '.join(self.machines)}) nor core / router:<region>")

    def argv(self, target: str, argv: Sequence[str]) -> list[str]:
        m = self.machines.get(target)
        cmd = expand(argv, m, self.cfg) if m else list(argv)
        return ["ip", "netns", "exec", self.namespace_of(target), *cmd]

    @staticmethod
    def env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The caller's environment with the repository importable (commands run with any cwd)."""
        pp = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        return {**os.environ, "PYTHONPATH": pp, "PYTHONUNBUFFERED": "1", **(extra or {})}

    def spawn(self, target: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **popen: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``target``'s namespace; the returned pid is the command's own
        (``ip netns exec`` execs it), so it can be ended by pid."""
        popen.setdefault("cwd", str(REPO))
        return subprocess.Popen(self.argv(target, argv), env=self.env(env), **popen)

    def run(self, target: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float | None = None, **kw: Any) -> subprocess.CompletedProcess:
        kw.setdefault("cwd", str(REPO))
        kw.setdefault("check", False)
        return subprocess.run(self.argv(target, argv), env=self.env(env), timeout=timeout, **kw)

    @staticmethod
    def stop(procs: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
        """SIGTERM each (by pid), wait, SIGKILL what lingers."""
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                try:
                    p.wait(30)  # a loaded host can take a while to reap a large process
                except subprocess.TimeoutExpired:
                    pass  # the kernel still owes us its exit; the namespace teardown does not need it
