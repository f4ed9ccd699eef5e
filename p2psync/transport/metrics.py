"""Counters and gauges of one node, rendered as Prometheus text (``GET /metrics``)."""

from __future__ import annotations

from collections import defaultdict

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


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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

    def render(self, **const: str) -> str:
        lines = []
        for name in sorted(self._values):
            kind, text = HELP.get(name, ("untyped", name))
            lines.append(f"# HELP {name} {text}")
            lines.append(f"# TYPE {name} {kind}")
            for key, value in sorted(self._values[name].items()):
                labels = {**const, **dict(key)}
                lab = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
                num = int(value) if float(value).is_integer() else value
                lines.append(f"{name}{{{lab}}} {num}" if lab else f"{name} {num}")
        return "\n".join(lines) + "\n"
