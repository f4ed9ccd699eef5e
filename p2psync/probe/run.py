"""A probe run against live nodes: learn who they are, have them measure each other, build the model.

The one module of :mod:`topology` that does I/O. Steps:

1. ``GET /v1/status`` of every address given, concurrently: node id, region, role.
2. Pairs and rounds from :mod:`topology.probeplan` (samples inside regions,
   representatives across them; pairs of one round share no node and no
   region pipe).
3. Per round, every pair at once: ``POST dst/v1/probe/measure {targets: [src]}``
   (see :mod:`p2psync.probe.service`); the next round starts when this one is done.
4. :func:`topology.model.model_from_measurements` over the figures.

Contract: a node that does not answer step 1 is left out (and listed in
:attr:`ProbeRun.unreachable`); a run without exactly one trainer among the
nodes that answered raises :class:`~p2psync.errors.ConfigError`. A pair that
fails is listed in :attr:`ProbeRun.failed` and left to the model's estimate;
a reply that names another node than the one asked for is a failure, never
a figure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2psync.config import ProbeSettings
from p2psync.errors import ConfigError, PeerUnreachable
from p2psync.probe.service import MeasureRequest, ProbeClient, TargetResult
from p2psync.transport.tls import Tls
from topology.model import Defaults, Measurement, NetworkModel, model_from_measurements
from topology.probeplan import Member, Pair, choose_pairs, node_specs, schedule_rounds

logger = logging.getLogger(__name__)

PROBE_RUN_FORMAT = 1


_SETTINGS = ProbeSettings()


@dataclass(frozen=True)
class ProbeOptions:
    """How a run probes. Defaults are those of the node config's ``[probe]`` section
    (:class:`p2psync.config.ProbeSettings`); :meth:`from_settings` takes a node's section."""

    bytes: int = _SETTINGS.bytes
    """Bytes each measurement downloads."""
    rtt_samples: int = _SETTINGS.rtt_samples
    intra_peers: int = _SETTINGS.intra_peers
    """Peers each node pulls from inside its region."""
    representatives: int = _SETTINGS.representatives
    """Nodes per region that measure across regions."""
    parallel: int = _SETTINGS.parallel
    """Measurements in flight at once inside one round (a round larger than this runs in waves)."""
    seed: int = 0
    status_timeout: float = 10.0
    """Seconds to wait for each node's ``GET /v1/status``."""
    connect_timeout: float = _SETTINGS.connect_timeout
    stall_timeout: float = _SETTINGS.stall_timeout
    min_rate_bps: float = _SETTINGS.min_rate_bps
    """The prober's own timeouts (its calls to the nodes); see :class:`~p2psync.config.ProbeSettings`."""

    @classmethod
    def from_settings(cls, settings: ProbeSettings, **overrides: Any) -> ProbeOptions:
        """Options from a node config's ``[probe]`` section (validated), with ``overrides`` on top."""
        settings.validate()
        base = {k: getattr(settings, k) for k in ("bytes", "rtt_samples", "intra_peers", "representatives",
                                                  "parallel", "connect_timeout", "stall_timeout", "min_rate_bps")}
        return cls(**{**base, **overrides})

    def client_settings(self) -> ProbeSettings:
        """The settings the prober's :class:`~p2psync.probe.service.ProbeClient` runs with."""
        return ProbeSettings(connect_timeout=self.connect_timeout, stall_timeout=self.stall_timeout,
                             min_rate_bps=self.min_rate_bps, bytes=self.bytes, rtt_samples=self.rtt_samples)


@dataclass
class ProbeRun:
    """What one run learned. ``model`` plans directly; :meth:`to_json` is a model file plus the raw figures."""

    members: list[Member]
    addresses: dict[str, str]
    measurements: list[Measurement]
    model: NetworkModel
    rounds: int
    seconds: float
    failed: list[tuple[str, str, str]] = field(default_factory=list)
    """(src, dst, reason) of each pair that gave no figure."""
    unreachable: list[tuple[str, str]] = field(default_factory=list)
    """(address, reason) of each address that did not answer ``GET /v1/status``."""
    raw: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The model (readable by ``NetworkModel.from_json``, i.e. ``p2psync plan --from``) plus a ``probe`` section."""
        data = self.model.to_json()
        data["probe"] = {
            "format": PROBE_RUN_FORMAT, "at": time.time(), "seconds": round(self.seconds, 3),
            "rounds": self.rounds, "addresses": self.addresses, "results": self.raw,
            "failed": [{"src": s, "dst": d, "error": e} for s, d, e in self.failed],
            "unreachable": [{"address": a, "error": e} for a, e in self.unreachable],
        }
        return data


async def discover(client: ProbeClient, urls: Sequence[str], timeout: float = 5.0
                   ) -> tuple[list[Member], dict[str, str], list[tuple[str, str]]]:
    """Identity of each node at ``urls`` from ``GET /v1/status``: (members, id -> url, unreachable)."""
    urls = list(dict.fromkeys(u.rstrip("/") for u in urls))

    async def one(url: str) -> dict[str, Any]:
        return await client.call_json(url, "/v1/status", timeout=timeout)

    answers = await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)
    members: list[Member] = []
    addresses: dict[str, str] = {}
    unreachable: list[tuple[str, str]] = []
    for url, a in zip(urls, answers):
        if isinstance(a, BaseException):
            if not isinstance(a, PeerUnreachable):
                raise a
            unreachable.append((url, str(a)))
            continue
        nid, region, role = a.get("node"), a.get("region"), a.get("role")
        if not (isinstance(nid, str) and nid and isinstance(region, str) and region and isinstance(role, str)
                and role):
            unreachable.append((url, "status lacks node/region/role"))
            continue
        if nid in addresses:
            raise ConfigError("nodes", f"{url} and {addresses[nid]} both answer as node {nid!r}")
        addresses[nid] = url
        members.append(Member(nid, region, role))
    trainers = [m.id for m in members if m.role == "trainer"]
    if len(trainers) != 1:
        raise ConfigError("nodes", f"the nodes that answered must include exactly one trainer, found {len(trainers)}"
                          + (f" (unreachable: {'; '.join(e for _, e in unreachable[:3])})" if unreachable else ""))
    return members, addresses, unreachable


async def measure_pair(client: ProbeClient, addresses: dict[str, str], pair: Pair, options: ProbeOptions
                       ) -> TargetResult:
    """``dst`` measures pulling from ``src``; raises :class:`PeerUnreachable` when no figure came back."""
    src, dst = pair
    req = MeasureRequest((addresses[src],), options.bytes, options.rtt_samples)
    reply = await client.call_measure(addresses[dst], req)
    if reply.node != dst:
        raise PeerUnreachable(addresses[dst], f"answered as node {reply.node!r}, expected {dst!r}")
    (r,) = reply.results
    if r.error:
        raise PeerUnreachable(addresses[src], r.error)
    if r.node != src:
        raise PeerUnreachable(addresses[src], f"answered as node {r.node!r}, expected {src!r}")
    if r.rtt_s is None or (options.bytes and not r.bandwidth_bps):
        raise PeerUnreachable(addresses[src], "measurement came back without figures")
    return r


async def probe(urls: Sequence[str], token: str, options: ProbeOptions | None = None, *,
                defaults: Defaults | None = None,
                on_round: Callable[[int, int, int, float], None] | None = None, tls: Tls | None = None) -> ProbeRun:
    """Run the whole probe (see the module doc). ``on_round(index, rounds, pairs, seconds)`` reports progress;
    ``tls``: the client certificate presented to the nodes (None: plain HTTP)."""
    options = options or ProbeOptions()
    defaults = defaults or Defaults()
    if options.bytes <= 0:
        raise ConfigError("bytes", "a probe run needs bytes > 0 to measure throughput")
    t0 = time.perf_counter()
    async with await ProbeClient.create(token, connections=max(8, 2 * options.parallel),
                                        settings=options.client_settings(), tls=tls) as client:
        members, addresses, unreachable = await discover(client, urls, options.status_timeout)
        region_of = {m.id: m.region for m in members}
        pairs = choose_pairs(members, intra_peers=options.intra_peers,
                             representatives_per_region=options.representatives, seed=options.seed)
        rounds = schedule_rounds(pairs, region_of)
        measurements: list[Measurement] = []
        failed: list[tuple[str, str, str]] = []
        raw: list[dict[str, Any]] = []
        gate = asyncio.Semaphore(max(1, options.parallel))

        async def run_pair(p: Pair) -> None:
            async with gate:
                try:
                    r = await measure_pair(client, addresses, p, options)
                except PeerUnreachable as exc:
                    logger.warning("probe %s -> %s failed: %s", p[0], p[1], exc)
                    failed.append((p[0], p[1], str(exc)))
                    return
            assert r.bandwidth_bps is not None and r.rtt_s is not None
            measurements.append(Measurement(p[0], p[1], r.bandwidth_bps, r.rtt_s))
            raw.append({"src": p[0], "dst": p[1], "bandwidth_bps": r.bandwidth_bps, "rtt_s": r.rtt_s,
                        "rtt_min_s": r.rtt_min_s, "bytes": r.bytes, "seconds": r.seconds})

        for i, batch in enumerate(rounds):
            t = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for p in batch:
                    tg.create_task(run_pair(p), name=f"probe:{p[0]}->{p[1]}")
            if on_round is not None:
                on_round(i, len(rounds), len(batch), time.perf_counter() - t)
    measurements.sort(key=lambda m: (m.src, m.dst))
    raw.sort(key=lambda r: (r["src"], r["dst"]))
    specs = node_specs(members, measurements, fallback_bps=defaults.intra_bandwidth_bps)
    model = model_from_measurements(specs, measurements, defaults)
    return ProbeRun(members, addresses, measurements, model, len(rounds), time.perf_counter() - t0,
                    failed, unreachable, raw)


def read_cluster_file(path: str) -> list[str]:
    """Node addresses from a cluster file: one URL per line (``#`` comments), or JSON.

    JSON: a list of URLs, or of objects with ``address`` (or ``url``), or ``{"nodes": [...]}`` of either.
    """
    import json
    from pathlib import Path

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError("cluster", f"cannot read {path}: {exc.strerror}") from None
    urls: list[str] = []
    if text.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError("cluster", f"{path} is not valid JSON: {exc}") from None
        items = data.get("nodes") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise ConfigError("cluster", f"{path}: expected a list of node addresses")
        for i, it in enumerate(items):
            u = it if isinstance(it, str) else (it.get("address") or it.get("url")) if isinstance(it, dict) else None
            if not isinstance(u, str):
                raise ConfigError(f"cluster[{i}]", "must be a URL or an object with 'address'")
            urls.append(u)
    else:
        urls = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        urls = [u for u in urls if u]
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ConfigError("cluster", f"{u!r} is not an http(s) URL")
    if not urls:
        raise ConfigError("cluster", f"{path} lists no node")
    return urls


__all__ = ["ProbeOptions", "ProbeRun", "discover", "measure_pair", "probe", "read_cluster_file"]
