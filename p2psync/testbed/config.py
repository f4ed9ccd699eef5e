"""Typed description of an emulated multi-region WAN, and its address plan (pure: no I/O but reading the file).

Layout of the file (TOML or JSON; every key optional, the defaults are the issue's testbed)::

    name = "p2tb"                  # prefix of every namespace the testbed creates
    subnet = "10.99.0.0/16"        # addresses inside the testbed (never routed to the host)
    mtu = 65000                    # of every emulated link (see docs/benchmarks/wan.md: why so large)
    tcp_buffer_mb = 64             # largest TCP send/receive buffer of each machine (a WAN host's tuning)
    trainer_region = "us-east"
    trainer_uplink_mbit = 1000     # the trainer machine's uplink cap
    trainer_class = "reserved"
    nodes_per_region = 4           # for regions that do not say
    node_class = "on-demand"
    node_uplink_mbit = 0           # 0: uncapped (a veth pair, many Gbit/s)
    node_downlink_mbit = 0
    default_latency_ms = 40        # one-way delay between two regions not listed under [[latency]]

    [[regions]]
    name = "us-east"
    wan_mbit = 1000                # the region's link to the WAN core, each direction; 0: uncapped
    nodes = 4
    node_class = "reserved"        # optional, else node_class

    [[latency]]                    # one-way delay, both directions
    a = "us-east"
    b = "eu-west"
    ms = 40

    [prices]                       # dollars per node-hour, per node class (cost figures)
    reserved = 2.3
    [tokens_per_s]                 # rollout tokens per second a node of the class generates
    reserved = 2500

Address plan (``subnet`` must be a /16 or larger): the core router is ``.0.1``;
region *i* (0-based, in file order) has its router's WAN side at ``.0.(i+2)``,
its router at ``.(i+1).1`` and its machines at ``.(i+1).(j+2)``, the trainer
first in its region. Validation raises :class:`~p2psync.errors.ConfigError`
naming the field.
"""

from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2psync.errors import ConfigError

_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")
_REGION = re.compile(r"^[a-z][a-z0-9-]{0,15}$")
TRAINER = "trainer"

DEFAULT_REGIONS: list[dict[str, Any]] = [
    {"name": "us-east", "wan_mbit": 1000, "node_class": "reserved"},
    {"name": "us-west", "wan_mbit": 1000},
    {"name": "eu-west", "wan_mbit": 200},
    {"name": "ap-south", "wan_mbit": 200, "node_class": "preemptible"},
]
DEFAULT_LATENCY: list[dict[str, Any]] = [
    {"a": "us-east", "b": "us-west", "ms": 30},
    {"a": "us-east", "b": "eu-west", "ms": 40},
    {"a": "us-east", "b": "ap-south", "ms": 100},
    {"a": "us-west", "b": "eu-west", "ms": 70},
    {"a": "us-west", "b": "ap-south", "ms": 80},
    {"a": "eu-west", "b": "ap-south", "ms": 60},
]
# Rough public list prices for one 8-GPU-class rollout machine, dollars per hour, by purchase type.
DEFAULT_PRICES = {"reserved": 14.0, "on-demand": 24.0, "preemptible": 9.0}
# Rollout tokens per second per machine (same hardware whatever the purchase type).
DEFAULT_TOKENS_PER_S = {"reserved": 20000.0, "on-demand": 20000.0, "preemptible": 20000.0}


@dataclass(frozen=True)
class RegionSpec:
    name: str
    """Region label (the nodes' ``region``)."""
    wan_mbit: float
    """Cap of the region's link to the WAN core in Mbit/s, each direction; 0: uncapped."""
    nodes: int
    """Machines in the region besides the trainer."""
    node_class: str
    """Purchase class of the region's machines (a key of ``prices``)."""


@dataclass(frozen=True)
class Machine:
    """One emulated machine: its own network namespace, one veth to its region's router."""

    id: str
    region: str
    index: int
    """Position in its region (0: the trainer in the trainer's region)."""
    ip: str
    router_ip: str
    namespace: str
    uplink_mbit: float
    downlink_mbit: float
    node_class: str
    role: str
    """``trainer`` or ``rollout``."""


@dataclass
class TestbedConfig:
    """The emulated WAN; build with :func:`load` or :func:`from_dict` (validated)."""

    __test__ = False  # not a pytest class
    name: str = "p2tb"
    """Prefix of every namespace (``<name>-core``, ``<name>-rt-<region>``, ``<name>-n-<node>``)."""
    subnet: str = "10.99.0.0/16"
    """Addresses inside the testbed; must be a /16 or larger (the first /16 is used)."""
    mtu: int = 65000
    """MTU of every emulated link; large so the user-space delay line handles few packets per second."""
    tcp_buffer_mb: int = 64
    """Largest TCP send and receive buffer of each machine, MB (Linux's default 4 MB send buffer caps one
    flow at ~300 Mbit/s over a 60 ms RTT; WAN hosts raise it)."""
    trainer_region: str = "us-east"
    trainer_uplink_mbit: float = 1000.0
    """Cap of the trainer machine's uplink, Mbit/s; 0: uncapped."""
    trainer_class: str = "reserved"
    nodes_per_region: int = 4
    node_class: str = "on-demand"
    node_uplink_mbit: float = 0.0
    node_downlink_mbit: float = 0.0
    default_latency_ms: float = 40.0
    """One-way delay between two regions that ``latency`` does not list."""
    regions: list[RegionSpec] = field(default_factory=list)
    latency: dict[tuple[str, str], float] = field(default_factory=dict)
    """One-way delay in ms, keyed by (src region, dst region)."""
    prices: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_PRICES))
    """Dollars per node-hour per node class."""
    tokens_per_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TOKENS_PER_S))
    """Rollout tokens per second per node class."""

    # ---- derived -------------------------------------------------------------------------

    @property
    def net(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.subnet, strict=False)

    def _addr(self, third: int, fourth: int) -> str:
        base = int(self.net.network_address)
        return str(ipaddress.IPv4Address(base + (third << 8) + fourth))

    @property
    def core_namespace(self) -> str:
        return f"{self.name}-core"

    @property
    def core_ip(self) -> str:
        return self._addr(0, 1)

    def router_namespace(self, region: str) -> str:
        return f"{self.name}-rt-{region}"

    def region_index(self, region: str) -> int:
        for i, r in enumerate(self.regions):
            if r.name == region:
                return i
        raise KeyError(region)

    def region_subnet(self, region: str) -> str:
        return f"{self._addr(self.region_index(region) + 1, 0)}/24"

    def router_ip(self, region: str) -> str:
        return self._addr(self.region_index(region) + 1, 1)

    def router_wan_ip(self, region: str) -> str:
        return self._addr(0, self.region_index(region) + 2)

    def machines(self) -> list[Machine]:
        """Every machine, the trainer first, then region by region in file order."""
        out: list[Machine] = []
        for ri, r in enumerate(self.regions):
            members: list[tuple[str, str, float, str]] = []
            if r.name == self.trainer_region:
                members.append((TRAINER, "trainer", self.trainer_uplink_mbit, self.trainer_class))
            members += [(f"{r.name}-{k}", "rollout", self.node_uplink_mbit, r.node_class) for k in range(r.nodes)]
            for j, (mid, role, up, cls) in enumerate(members):
                out.append(Machine(mid, r.name, j, self._addr(ri + 1, j + 2), self._addr(ri + 1, 1),
                                   f"{self.name}-n-{mid}", up, self.node_downlink_mbit, cls, role))
        out.sort(key=lambda m: m.role != "trainer")
        return out

    def machine(self, node_id: str) -> Machine:
        for m in self.machines():
            if m.id == node_id:
                return m
        raise ConfigError("node", f"no machine {node_id!r} in testbed {self.name!r}")

    def namespaces(self) -> list[str]:
        """Every namespace the testbed creates, in creation order."""
        return [self.core_namespace, *(self.router_namespace(r.name) for r in self.regions),
                *(m.namespace for m in self.machines())]

    def one_way_ms(self, src_region: str, dst_region: str) -> float:
        if src_region == dst_region:
            return 0.0
        return self.latency.get((src_region, dst_region), self.default_latency_ms)

    def wan_mbit(self, region: str) -> float:
        return self.regions[self.region_index(region)].wan_mbit

    def path_mbit(self, src: Machine, dst: Machine) -> float:
        """Capacity of the path ``src -> dst`` alone (0 in the result never happens: uncapped is inf)."""
        caps = [src.uplink_mbit, dst.downlink_mbit]
        if src.region != dst.region:
            caps += [self.wan_mbit(src.region), self.wan_mbit(dst.region)]
        real = [c for c in caps if c > 0]
        return min(real) if real else float("inf")

    def concurrent_seconds(self, streams: list[tuple[str, str]], bytes_each: float) -> float:
        """Seconds until ``bytes_each`` crossed every ``(source id, destination id)`` stream when
        all of them send at once: each capped link (a machine's uplink or downlink, a region's
        link to the WAN core in either direction) carries the streams routed over it, so the
        most loaded link sets the time (latency left out)."""
        load: dict[tuple[str, str], float] = {}
        rate: dict[tuple[str, str], float] = {}

        def cross(key: tuple[str, str], mbit: float) -> None:
            if mbit > 0:
                load[key] = load.get(key, 0.0) + bytes_each
                rate[key] = mbit

        for src_id, dst_id in streams:
            src, dst = self.machine(src_id), self.machine(dst_id)
            cross(("up", src.id), src.uplink_mbit)
            cross(("down", dst.id), dst.downlink_mbit)
            if src.region != dst.region:
                cross(("wan-out", src.region), self.wan_mbit(src.region))
                cross(("wan-in", dst.region), self.wan_mbit(dst.region))
        return max((8 * b / (rate[k] * 1e6) for k, b in load.items()), default=0.0)

    def validate(self) -> TestbedConfig:
        if not _NAME.match(self.name):
            raise ConfigError("name", f"must match {_NAME.pattern} (it prefixes namespace names), got {self.name!r}")
        try:
            net = ipaddress.IPv4Network(self.subnet, strict=False)
        except ValueError as exc:
            raise ConfigError("subnet", str(exc)) from None
        if net.prefixlen > 16:
            raise ConfigError("subnet", f"must be a /16 or larger, got /{net.prefixlen}")
        if not net.is_private:
            raise ConfigError("subnet", f"must be a private range (the testbed never routes to the host), got {net}")
        if not 1280 <= self.mtu <= 65535:
            raise ConfigError("mtu", f"must be 1280..65535, got {self.mtu}")
        if not 1 <= self.tcp_buffer_mb <= 1024:
            raise ConfigError("tcp_buffer_mb", f"must be 1..1024, got {self.tcp_buffer_mb}")
        if not self.regions:
            raise ConfigError("regions", "at least one region is needed")
        if len(self.regions) > 250:
            raise ConfigError("regions", "at most 250 regions")
        seen: set[str] = set()
        for i, r in enumerate(self.regions):
            if not _REGION.match(r.name):
                raise ConfigError(f"regions[{i}].name", f"must match {_REGION.pattern}, got {r.name!r}")
            if r.name in seen:
                raise ConfigError(f"regions[{i}].name", f"duplicate region {r.name!r}")
            seen.add(r.name)
            if r.wan_mbit < 0:
                raise ConfigError(f"regions[{i}].wan_mbit", "must be >= 0 (0: uncapped)")
            if not 0 <= r.nodes <= 250:
                raise ConfigError(f"regions[{i}].nodes", f"must be 0..250, got {r.nodes}")
            if r.node_class not in self.prices:
                raise ConfigError(f"regions[{i}].node_class", f"{r.node_class!r} has no entry in prices")
        if self.trainer_region not in seen:
            raise ConfigError("trainer_region", f"{self.trainer_region!r} is not one of the regions")
        for name in ("trainer_uplink_mbit", "node_uplink_mbit", "node_downlink_mbit", "default_latency_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must be >= 0")
        if self.trainer_class not in self.prices:
            raise ConfigError("trainer_class", f"{self.trainer_class!r} has no entry in prices")
        for (a, b), ms in self.latency.items():
            if a not in seen or b not in seen:
                raise ConfigError("latency", f"unknown region in pair {a!r}/{b!r}")
            if not 0 <= ms <= 10_000:
                raise ConfigError("latency", f"{a}/{b}: must be 0..10000 ms, got {ms}")
        for table in ("prices", "tokens_per_s"):
            for k, v in getattr(self, table).items():
                if not v >= 0:
                    raise ConfigError(f"{table}.{k}", "must be >= 0")
        return self

    # ---- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "subnet": self.subnet, "mtu": self.mtu, "tcp_buffer_mb": self.tcp_buffer_mb,
            "trainer_region": self.trainer_region,
            "trainer_uplink_mbit": self.trainer_uplink_mbit, "trainer_class": self.trainer_class,
            "nodes_per_region": self.nodes_per_region, "node_class": self.node_class,
            "node_uplink_mbit": self.node_uplink_mbit, "node_downlink_mbit": self.node_downlink_mbit,
            "default_latency_ms": self.default_latency_ms,
            "regions": [{"name": r.name, "wan_mbit": r.wan_mbit, "nodes": r.nodes, "node_class": r.node_class}
                        for r in self.regions],
            "latency": [{"a": a, "b": b, "ms": ms} for (a, b), ms in self.latency.items()],
            "prices": dict(self.prices), "tokens_per_s": dict(self.tokens_per_s),
        }


_SCALARS: dict[str, type] = {
    "name": str, "subnet": str, "mtu": int, "tcp_buffer_mb": int, "trainer_region": str, "trainer_uplink_mbit": float,
    "trainer_class": str, "nodes_per_region": int, "node_class": str, "node_uplink_mbit": float,
    "node_downlink_mbit": float, "default_latency_ms": float,
}


def _typed(where: str, tp: type, v: Any) -> Any:
    if tp is str:
        if not isinstance(v, str):
            raise ConfigError(where, f"must be a string, got {v!r}")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (tp is int and not isinstance(v, int)):
        raise ConfigError(where, f"must be {'an integer' if tp is int else 'a number'}, got {v!r}")
    return tp(v)


def from_dict(data: dict[str, Any]) -> TestbedConfig:
    """Build and validate from the file's structure; missing keys take the defaults above."""
    if not isinstance(data, dict):
        raise ConfigError("<root>", "a testbed description must be a table/object")
    known = {*_SCALARS, "regions", "latency", "prices", "tokens_per_s"}
    for k in data:
        if k not in known:
            raise ConfigError(k, "unknown setting")
    cfg = TestbedConfig()
    kw = {k: _typed(k, tp, data[k]) for k, tp in _SCALARS.items() if k in data}
    for k, v in kw.items():
        setattr(cfg, k, v)
    for table in ("prices", "tokens_per_s"):
        if table in data:
            raw = data[table]
            if not isinstance(raw, dict):
                raise ConfigError(table, "must be a table of class = number")
            merged = dict(getattr(cfg, table))
            merged.update({str(k): _typed(f"{table}.{k}", float, v) for k, v in raw.items()})
            setattr(cfg, table, merged)
    raw_regions = data.get("regions", DEFAULT_REGIONS)
    if not isinstance(raw_regions, list):
        raise ConfigError("regions", "must be a list of tables")
    regions = []
    for i, r in enumerate(raw_regions):
        where = f"regions[{i}]"
        if not isinstance(r, dict):
            raise ConfigError(where, "must be a table")
        for k in r:
            if k not in ("name", "wan_mbit", "nodes", "node_class"):
                raise ConfigError(f"{where}.{k}", "unknown setting")
        if "name" not in r:
            raise ConfigError(f"{where}.name", "is required")
        regions.append(RegionSpec(
            _typed(f"{where}.name", str, r["name"]),
            _typed(f"{where}.wan_mbit", float, r.get("wan_mbit", 0.0)),
            _typed(f"{where}.nodes", int, r.get("nodes", cfg.nodes_per_region)),
            _typed(f"{where}.node_class", str, r.get("node_class", cfg.node_class)),
        ))
    cfg.regions = regions
    raw_lat = data.get("latency", DEFAULT_LATENCY if "regions" not in data else [])
    if not isinstance(raw_lat, list):
        raise ConfigError("latency", "must be a list of {a, b, ms} tables")
    latency: dict[tuple[str, str], float] = {}
    for i, e in enumerate(raw_lat):
        where = f"latency[{i}]"
        if not isinstance(e, dict) or set(e) - {"a", "b", "ms"} or not {"a", "b", "ms"} <= set(e):
            raise ConfigError(where, "must be a table with exactly a, b and ms")
        a, b = _typed(f"{where}.a", str, e["a"]), _typed(f"{where}.b", str, e["b"])
        if a == b:
            raise ConfigError(f"{where}.b", "must differ from a (inside a region there is no added delay)")
        ms = _typed(f"{where}.ms", float, e["ms"])
        latency[(a, b)] = ms
        latency[(b, a)] = ms
    cfg.latency = latency
    return cfg.validate()


def load(path: str | Path | None = None, **overrides: Any) -> TestbedConfig:
    """The file (TOML, or JSON when it ends in ``.json``), then ``overrides`` of top-level keys; validated."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError("config", f"cannot read {p}: {exc.strerror}") from None
        try:
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError("config", f"{p} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    return from_dict(data)


def scaled(regions: int, per_region: int, base: TestbedConfig | None = None, name: str | None = None) -> TestbedConfig:
    """The default testbed (or ``base``) cut to its first ``regions`` regions with ``per_region`` machines each."""
    base = base or from_dict({})
    if not 1 <= regions <= len(base.regions):
        raise ConfigError("regions", f"must be 1..{len(base.regions)}, got {regions}")
    d = base.to_dict()
    d["regions"] = [{**r, "nodes": per_region} for r in d["regions"][:regions]]
    keep = {r["name"] for r in d["regions"]}
    d["latency"] = [e for e in d["latency"] if e["a"] in keep and e["b"] in keep]
    if d["trainer_region"] not in keep:
        d["trainer_region"] = d["regions"][0]["name"]
    if name:
        d["name"] = name
    return from_dict(d)
