"""Counters and gauges of one node, exposed in Prometheus' text format (``GET /metrics``).

The node's event loop counts into plain dictionaries (no lock, no per-label objects); at a scrape
:class:`Metrics` hands them to ``prometheus_client`` as metric families, which writes the
exposition (escaping, ``# HELP`` / ``# TYPE``, the format Prometheus negotiates). A counter's
families are named without the ``_total`` suffix, as the format asks; its samples keep it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

HELP = {
    "p2psync_bytes_in_total": ("counter", "Verified payload bytes received from parents."),
    "p2psync_bytes_out_total": ("counter", "Payload bytes served to children."),
    "p2psync_chunks_in_total": ("counter", "Verified chunks received."),
    "p2psync_chunks_out_total": ("counter", "Chunks served."),
    "p2psync_bad_chunks_total": ("counter", "Chunks that failed verification, by the peer that served them."),
    "p2psync_parent_failures_total": ("counter", "Parent requests that failed or stalled, by parent."),
    "p2psync_parent_switches_total": ("counter", "Times the active parent changed."),
    "p2psync_slow_clients_cut_total": ("counter", "Connections dropped because the client stopped reading."),
    "p2psync_requests_total": ("counter", "HTTP requests answered, by status code."),
    "p2psync_versions_applied_total": ("counter", "Artifacts applied to the local weights."),
    "p2psync_snapshots_materialised_total": ("counter", "Signed snapshots rebuilt from local weights."),
    "p2psync_version": ("gauge", "Version of the applied weights (-1: none)."),
    "p2psync_codec_warm_seconds": ("gauge", "Seconds the codec warm-up after start took (absent: still warming)."),
    "p2psync_head": ("gauge", "Newest version known from the parent (-1: none)."),
    "p2psync_transfer_chunks_held": ("gauge", "Chunks held of the artifact being fetched."),
    "p2psync_transfer_chunks_total": ("gauge", "Chunks of the artifact being fetched."),
}


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""What ``GET /metrics`` answers with: the classic text format every Prometheus version reads."""


class Metrics:
    """Plain in-process counters; the event loop is the only writer."""

    def __init__(self) -> None:
        self._values: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)

    def inc(self, name: str, amount: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        series = self._values[name]
        series[key] = series.get(key, 0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        self._values[name][tuple(sorted(labels.items()))] = value

    def get(self, name: str, **labels: str) -> float:
        return self._values.get(name, {}).get(tuple(sorted(labels.items())), 0)

    def total(self, name: str) -> float:
        return sum(self._values.get(name, {}).values())

    def families(self, **const: str) -> Iterator[Any]:
        """The values as ``prometheus_client`` metric families, ``const`` labels on every sample."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, UnknownMetricFamily

        for name in sorted(self._values):
            kind, text = HELP.get(name, ("untyped", name))
            series = sorted(self._values[name].items())
            labels = sorted({k for key, _ in series for k, _ in key} | set(const))
            cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}.get(kind, UnknownMetricFamily)
            fam = cls(name, text, labels=labels)
            for key, value in series:
                got = {**const, **dict(key)}
                fam.add_metric([got.get(k, "") for k in labels], value)
            yield fam

    def render(self, **const: str) -> str:
        """The exposition text of every value, ``const`` labels (node, region, role) on each sample."""
        from prometheus_client import CollectorRegistry, generate_latest

        metrics = self

        class _Snapshot:
            def collect(self) -> Iterator[Any]:
                return metrics.families(**const)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot())
        return generate_latest(registry).decode()
