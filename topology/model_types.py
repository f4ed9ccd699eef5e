"""The value types of the network model and the checks every model applies to them.

:class:`NodeSpec`, :class:`Region`, :class:`RegionLink`, :class:`Measurement` and
:class:`Defaults` are what a :class:`topology.model.NetworkModel` is built from, whether
in code, from a probe run or from a file (:mod:`topology.model_json`). A bad figure raises
:class:`topology.errors.ModelError` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from topology.errors import ModelError

ROLES = ("trainer", "relay", "rollout")


@dataclass(frozen=True)
class NodeSpec:
    """One machine that holds (or relays) artifacts."""

    id: str
    region: str
    role: str
    """``trainer`` (the root, exactly one), ``relay`` (serves, runs no engine) or ``rollout``."""
    uplink_bps: float
    """What the node can send in total, over all its children, in bits/s."""
    downlink_bps: float
    """What the node can receive in total, in bits/s."""
    node_class: str | None = None
    """Free-form machine class (``dc``, ``edge``...); informative only."""


@dataclass(frozen=True)
class Region:
    """Figures for pairs of nodes inside one region that were not measured."""

    name: str
    intra_bandwidth_bps: float
    """What one flow between two nodes of the region gets."""
    intra_rtt_s: float


@dataclass(frozen=True)
class RegionLink:
    """Figures for flows from region ``src`` to region ``dst`` (directed)."""

    src: str
    dst: str
    bandwidth_bps: float
    """What one flow from a node in ``src`` to a node in ``dst`` gets (typical, per flow)."""
    rtt_s: float
    capacity_bps: float | None = None
    """Aggregate capacity of the ``src -> dst`` pipe, shared by all its flows; None: not a shared bottleneck."""


@dataclass(frozen=True)
class Measurement:
    """One measured directed pair: ``dst`` pulling from ``src``."""

    src: str
    dst: str
    bandwidth_bps: float
    rtt_s: float


@dataclass(frozen=True)
class Defaults:
    """Figures used where neither a measurement nor a region-level figure exists."""

    intra_bandwidth_bps: float = 10e9
    intra_rtt_s: float = 0.0005
    inter_bandwidth_bps: float = 0.5e9
    inter_rtt_s: float = 0.05


def check_node(n: NodeSpec, where: str) -> None:
    if not isinstance(n.id, str) or not n.id:
        raise ModelError(f"{where}.id", "must be a non-empty string")
    if n.role not in ROLES:
        raise ModelError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {n.role!r}")
    check_positive(n.uplink_bps, f"{where}.uplink_bps")
    check_positive(n.downlink_bps, f"{where}.downlink_bps")


def check_positive(x: Any, where: str) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise ModelError(where, f"must be a positive finite number, got {x!r}")


def check_non_negative(x: Any, where: str) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        raise ModelError(where, f"must be a non-negative finite number, got {x!r}")


__all__ = [
    "ROLES", "Defaults", "Measurement", "NodeSpec", "Region", "RegionLink",
    "check_node", "check_non_negative", "check_positive",
]
