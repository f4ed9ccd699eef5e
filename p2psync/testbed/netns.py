"""Build and tear down the emulated WAN out of network namespaces, veth pairs, ``tbf`` and the delay line.

Layout (see :mod:`p2psync.testbed.config` for the address plan)::

    machine ns  <name>-n-<id>   eth0 ----veth---- n<j>  router ns <name>-rt-<region>
    router ns                   wan  ----veth---- r<i>  core ns   <name>-core   (+ dly0, the delay line)

Caps (``tc tbf`` on the sending side of each veth): a machine's uplink on its
``eth0``, its downlink on the router's ``n<j>``, a region's WAN uplink on the
router's ``wan`` and its WAN downlink on the core's ``r<i>``. Every packet
between two regions crosses the core, where policy routing sends it through
the delay line (``dly0``); with the delay line gone, table 100 falls back to a
blackhole, so a crashed delay line stops inter-region traffic instead of
silently removing the latency.

Contract: everything the testbed creates lives inside namespaces whose names
start with ``<name>-`` (the prefix is the testbed's; nothing is created in the
host's namespace, and no namespace has a route out of the testbed subnet), and
the state file is written before the first namespace is created, so
:func:`down` can remove exactly those namespaces and the processes inside
them, also after a crash; :func:`up` first removes leftovers of its prefix.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from p2psync.testbed.config import TestbedConfig, from_dict
from p2psync.testbed.delay import LinkFaults
from p2psync.testbed.errors import TestbedError

logger = logging.getLogger(__name__)

STATE_DIR = Path(os.environ.get("P2PSYNC_TESTBED_STATE_DIR", "/run/p2psync-testbed"))
DELAY_TABLE = "100"
DELAY_PREF = "100"


@dataclass(frozen=True)
class Cmd:
    """One command of the build, with a short reason shown when it fails."""

    argv: tuple[str, ...]
    why: str


def tbf_args(mbit: float, mtu: int) -> list[str]:
    """``tbf`` parameters for a cap of ``mbit``: a burst of >= 2 packets or 2 ms, a queue of >= 100 ms."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(2 * mtu + 1600, int(rate_bytes * 0.002))
    limit = max(burst + 4 * mtu, int(rate_bytes * 0.1))
    return ["tbf", "rate", f"{round(mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit)]


def plan_commands(cfg: TestbedConfig) -> list[Cmd]:
    """Every command that builds ``cfg``'s testbed except starting the delay line (pure)."""
    out: list[Cmd] = []

    def add(why: str, *argv: str) -> None:
        out.append(Cmd(tuple(argv), why))

    net16 = f"{cfg.net.network_address}/16"
    core = cfg.core_namespace
    for ns in cfg.namespaces():
        add(f"namespace {ns}", "ip", "netns", "add", ns)
        add("no IPv6 (nothing to emulate, no stray traffic)", "ip", "netns", "exec", ns, "sysctl", "-qw",
            "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
        add("loopback", "ip", "-n", ns, "link", "set", "lo", "up")
    for ns in [core, *(cfg.router_namespace(r.name) for r in cfg.regions)]:
        # rp_filter off: packets re-enter the core from the delay line, not from their region's link.
        add(f"forwarding in {ns}", "ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0")
    buf = cfg.tcp_buffer_mb << 20
    for m in cfg.machines():
        # Long-lived streams keep their congestion window across idle gaps between steps
        # (Linux otherwise restarts slow start after an RTO of silence), as a WAN deployment of
        # p2psync should configure its machines (docs/benchmarks/wan.md).
        add(f"TCP buffers of {m.id}", "ip", "netns", "exec", m.namespace, "sysctl", "-qw",
            f"net.ipv4.tcp_rmem=4096 131072 {buf}", f"net.ipv4.tcp_wmem=4096 16384 {buf}",
            "net.ipv4.tcp_slow_start_after_idle=0")
    mtu = str(cfg.mtu)
    for i, r in enumerate(cfg.regions):
        rt, dev, wan_ip = cfg.router_namespace(r.name), f"r{i}", cfg.router_wan_ip(r.name)
        add(f"WAN link of {r.name}", "ip", "link", "add", dev, "netns", core, "type", "veth",
            "peer", "name", "wan", "netns", rt)
        add("core side up", "ip", "-n", core, "link", "set", dev, "mtu", mtu, "up")
        add("router side up", "ip", "-n", rt, "link", "set", "wan", "mtu", mtu, "up")
        add("core address", "ip", "-n", core, "addr", "add", f"{cfg.core_ip}/32", "dev", dev)
        add("core -> router", "ip", "-n", core, "route", "add", f"{wan_ip}/32", "dev", dev)
        add(f"core -> {r.name} machines", "ip", "-n", core, "route", "add", cfg.region_subnet(r.name),
            "via", wan_ip, "dev", dev)
        add("router WAN address", "ip", "-n", rt, "addr", "add", f"{wan_ip}/32", "dev", "wan")
        add("router -> core", "ip", "-n", rt, "route", "add", f"{cfg.core_ip}/32", "dev", "wan")
        add("router -> other regions", "ip", "-n", rt, "route", "add", net16, "via", cfg.core_ip, "dev", "wan")
        if r.wan_mbit > 0:
            add(f"{r.name} WAN uplink cap", "tc", "-n", rt, "qdisc", "add", "dev", "wan", "root",
                *tbf_args(r.wan_mbit, cfg.mtu))
            add(f"{r.name} WAN downlink cap", "tc", "-n", core, "qdisc", "add", "dev", dev, "root",
                *tbf_args(r.wan_mbit, cfg.mtu))
    for m in cfg.machines():
        rt, dev = cfg.router_namespace(m.region), f"n{m.index}"
        add(f"link of {m.id}", "ip", "link", "add", "eth0", "netns", m.namespace, "type", "veth",
            "peer", "name", dev, "netns", rt)
        add("machine side up", "ip", "-n", m.namespace, "link", "set", "eth0", "mtu", mtu, "up")
        add("router side up", "ip", "-n", rt, "link", "set", dev, "mtu", mtu, "up")
        add("machine address", "ip", "-n", m.namespace, "addr", "add", f"{m.ip}/32", "dev", "eth0")
        add("machine -> router", "ip", "-n", m.namespace, "route", "add", f"{m.router_ip}/32", "dev", "eth0")
        # The testbed subnet only: no default route, so nothing can leave the testbed.
        add("machine -> testbed", "ip", "-n", m.namespace, "route", "add", net16, "via", m.router_ip, "dev", "eth0")
        add("router address", "ip", "-n", rt, "addr", "add", f"{m.router_ip}/32", "dev", dev)
        add("router -> machine", "ip", "-n", rt, "route", "add", f"{m.ip}/32", "dev", dev)
        if m.uplink_mbit > 0:
            add(f"{m.id} uplink cap", "tc", "-n", m.namespace, "qdisc", "add", "dev", "eth0", "root",
                *tbf_args(m.uplink_mbit, cfg.mtu))
        if m.downlink_mbit > 0:
            add(f"{m.id} downlink cap", "tc", "-n", rt, "qdisc", "add", "dev", dev, "root",
                *tbf_args(m.downlink_mbit, cfg.mtu))
    return out


def delay_spec(cfg: TestbedConfig) -> dict | None:
    """What the delay line needs, or None when no pair of regions has a delay."""
    delays = []
    for i, a in enumerate(cfg.regions):
        for j, b in enumerate(cfg.regions):
            ms = cfg.one_way_ms(a.name, b.name)
            if i != j and ms > 0:
                delays.append([i + 1, j + 1, ms / 1000.0])
    if not delays:
        return None
    return {"base": int(cfg.net.network_address), "mtu": cfg.mtu, "delays": delays}


def delay_routing(cfg: TestbedConfig) -> list[Cmd]:
    """Policy routing that sends inter-region packets through the delay line (after it created ``dly0``)."""
    core = cfg.core_namespace
    out = [Cmd(("ip", "-n", core, "route", "add", "blackhole", f"{cfg.net.network_address}/16", "table",
                DELAY_TABLE), "no delay line, no inter-region traffic")]
    for i, r in enumerate(cfg.regions):
        out.append(Cmd(("ip", "-n", core, "route", "add", cfg.region_subnet(r.name), "dev", "dly0", "table",
                        DELAY_TABLE), f"to {r.name} through the delay line"))
    for i in range(len(cfg.regions)):
        out.append(Cmd(("ip", "-n", core, "rule", "add", "iif", f"r{i}", "lookup", DELAY_TABLE, "pref",
                        DELAY_PREF), f"from region {i} into the delay line"))
    return out


# ---- privileges and tools ------------------------------------------------------------------

def check_host() -> None:
    """Raise :class:`TestbedError` unless this process is root and ``ip`` and ``tc`` exist."""
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (it creates network namespaces, veth pairs and tc qdiscs): "
                           "run it as root, e.g. `sudo p2psync testbed up`")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise TestbedError(f"the testbed needs {' and '.join(missing)} from iproute2 (apt-get install iproute2)")


def _run(cmd: Cmd | list[str], check: bool = True) -> subprocess.CompletedProcess:
    argv = list(cmd.argv if isinstance(cmd, Cmd) else cmd)
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        why = cmd.why if isinstance(cmd, Cmd) else "command"
        raise TestbedError(f"{why}: `{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def existing_namespaces() -> list[str]:
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    r = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


# ---- state ---------------------------------------------------------------------------------

def state_path(name: str, state_dir: Path | None = None) -> Path:
    return (state_dir or STATE_DIR) / f"{name}.json"


def write_state(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_state(name: str, state_dir: Path | None = None) -> dict | None:
    p = state_path(name, state_dir)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise TestbedError(f"state file {p} is unreadable ({exc}); remove it and run `down` again") from exc


@contextlib.contextmanager
def locked(name: str, state_dir: Path | None = None) -> Iterator[None]:
    """Serialise up/down of one testbed name across processes."""
    d = state_dir or STATE_DIR
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---- up / down -----------------------------------------------------------------------------

def _stop_pids(pids: list[int], grace: float = 3.0) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _remove(namespaces: list[str]) -> list[str]:
    """Stop every process inside ``namespaces`` (by pid), then delete them; returns those deleted."""
    present = set(existing_namespaces())
    targets = [ns for ns in namespaces if ns in present]
    pids = sorted({p for ns in targets for p in namespace_pids(ns)} - {os.getpid()})
    if pids:
        _stop_pids(pids)
    for ns in targets:
        _run(["ip", "netns", "del", ns], check=False)
    return targets


def leftovers(name: str) -> list[str]:
    return [ns for ns in existing_namespaces() if ns.startswith(f"{name}-")]


def down(name: str, state_dir: Path | None = None) -> list[str]:
    """Remove the testbed ``name``: processes inside its namespaces, the namespaces, the state file.

    Works from the state file alone (after a crash) and also removes namespaces of the
    ``<name>-`` prefix that the state file does not list (a crash before it was updated).
    """
    check_host()
    with locked(name, state_dir):
        st = read_state(name, state_dir) or {}
        listed = list(st.get("namespaces", []))
        delay_pid = st.get("delay_pid")
        if delay_pid and _alive(delay_pid) and _is_delay_line(delay_pid, name):
            _stop_pids([delay_pid])
        gone = _remove(listed + [ns for ns in leftovers(name) if ns not in listed])
        left = leftovers(name)
        if left:
            raise TestbedError(f"could not remove namespaces {left}; see `ip netns pids` for what holds them")
        state_path(name, state_dir).unlink(missing_ok=True)
        control = control_path(name, state_dir)
        control.unlink(missing_ok=True)
        control.with_name(control.name + ".stats").unlink(missing_ok=True)
        return gone


def _is_delay_line(pid: int, name: str) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"p2psync.testbed.delay" in cmd and any(name.encode() in c for c in cmd)


def up(cfg: TestbedConfig, state_dir: Path | None = None, log_dir: Path | None = None) -> dict:
    """Build ``cfg``'s testbed (removing leftovers of its prefix first); returns the state written.

    On any failure everything built so far is removed again before the error propagates.
    """
    check_host()
    name = cfg.name
    with locked(name, state_dir):
        stale = leftovers(name)
        if stale:
            logger.warning("removing leftovers of testbed %s: %s", name, ", ".join(stale))
            _remove(stale)
        path = state_path(name, state_dir)
        state = {"name": name, "config": cfg.to_dict(), "namespaces": cfg.namespaces(), "delay_pid": None,
                 "created_at": time.time(), "complete": False}
        write_state(path, state)  # before anything exists: a crash from here on is recoverable by `down`
        try:
            for cmd in plan_commands(cfg):
                _run(cmd)
            spec = delay_spec(cfg)
            if spec is not None:
                if not os.path.exists("/dev/net/tun"):
                    raise TestbedError("the inter-region delays need /dev/net/tun (`modprobe tun`), "
                                       "or set every latency to 0")
                state["delay_pid"] = _start_delay_line(cfg, spec, log_dir or path.parent,
                                                       control_path(name, state_dir))
                write_state(path, state)
                for cmd in delay_routing(cfg):
                    _run(cmd)
        except BaseException:
            _remove(cfg.namespaces() + leftovers(name))
            path.unlink(missing_ok=True)
            raise
        state["complete"] = True
        write_state(path, state)
        return state


def control_path(name: str, state_dir: Path | None = None) -> Path:
    """The delay line's fault control file (re-read on SIGHUP; its counters in ``<path>.stats``)."""
    return (state_dir or STATE_DIR) / f"{name}-faults.json"


def set_link_faults(name: str, faults: dict[tuple[str, str], LinkFaults], state_dir: Path | None = None,
                    seed: int | None = None, timeout: float = 5.0) -> dict:
    """Put ``faults`` (keyed by (source region, destination region); one direction each) in force on testbed
    ``name``'s delay line, replacing all others (``{}`` heals every link); returns the line's counters once
    it confirmed the change. TestbedError when there is no delay line or it did not confirm in ``timeout``."""
    st = read_state(name, state_dir)
    if st is None or not st.get("delay_pid"):
        raise TestbedError(f"testbed {name!r} has no delay line (no latency between its regions)")
    cfg, pid = config_of(st), int(st["delay_pid"])
    if not (_alive(pid) and _is_delay_line(pid, name)):
        raise TestbedError(f"the delay line of testbed {name!r} (pid {pid}) is gone")
    path = control_path(name, state_dir)
    stats = path.with_name(path.name + ".stats")
    try:
        serial = int(json.loads(stats.read_text()).get("serial", 0)) + 1
    except (OSError, ValueError):
        serial = 1
    data: dict = {"serial": serial, "faults": [[cfg.region_index(a) + 1, cfg.region_index(b) + 1, f.to_json()]
                                               for (a, b), f in faults.items()]}
    if seed is not None:
        data["seed"] = seed
    write_state(path, data)
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = json.loads(stats.read_text())
            if got.get("serial") == serial:
                return got
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise TestbedError(f"the delay line of testbed {name!r} did not confirm the faults within {timeout:.0f} s")


def _start_delay_line(cfg: TestbedConfig, spec: dict, log_dir: Path, control: Path) -> int:
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])}
    log_dir.mkdir(parents=True, exist_ok=True)
    control.unlink(missing_ok=True)  # a new line starts with no faults
    control.with_name(control.name + ".stats").unlink(missing_ok=True)
    argv = ["ip", "netns", "exec", cfg.core_namespace, sys.executable, "-m", "p2psync.testbed.delay",
            "--spec", json.dumps(spec), "--testbed", cfg.name, "--control", str(control)]
    with open(log_dir / f"{cfg.name}-delay.log", "ab") as log:  # the child keeps its own descriptor
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
    assert p.stdout is not None
    line = p.stdout.readline().decode().strip()
    if line != "ready":
        p.kill()
        p.wait()
        raise TestbedError(f"the delay line did not start (said {line!r}); see {log_dir / f'{cfg.name}-delay.log'}")
    p.stdout.close()
    return p.pid


def config_of(state: dict) -> TestbedConfig:
    return from_dict(state["config"])


def status(name: str, state_dir: Path | None = None) -> dict:
    """What exists of testbed ``name``: namespaces present or missing, delay line alive, caps installed."""
    st = read_state(name, state_dir)
    present = set(existing_namespaces())
    out: dict = {"name": name, "state_file": str(state_path(name, state_dir)), "exists": st is not None,
                 "leftovers": [ns for ns in leftovers(name) if st is None or ns not in st.get("namespaces", [])]}
    if st is None:
        return out
    cfg = config_of(st)
    pid = st.get("delay_pid")
    out.update(
        complete=st.get("complete", False),
        missing=[ns for ns in st["namespaces"] if ns not in present],
        delay_line={"pid": pid, "alive": bool(pid and _alive(pid))} if pid else None,
        machines=[{"id": m.id, "region": m.region, "ip": m.ip, "namespace": m.namespace, "role": m.role,
                   "class": m.node_class, "processes": len(namespace_pids(m.namespace)) if m.namespace in present else 0}
                  for m in cfg.machines()],
        regions=[{"name": r.name, "wan_mbit": r.wan_mbit, "subnet": cfg.region_subnet(r.name)} for r in cfg.regions],
    )
    return out
