"""The JSON file format of the network model (``p2psync plan --from FILE``).

A file is one object: ``format_version`` (:data:`FORMAT_VERSION`), optional ``defaults``
(the :class:`~topology.model_types.Defaults` fields), ``nodes`` (required), and optional
``regions``, ``region_links`` and ``links``, each a list of objects with the fields of
:class:`~topology.model_types.NodeSpec`, :class:`~topology.model_types.Region`,
:class:`~topology.model_types.RegionLink` and :class:`~topology.model_types.Measurement`.
A file that does not follow it raises :class:`topology.errors.ModelError` whose message
starts with the field, e.g. ``nodes[3].uplink_bps: must be a non-negative finite number``.

This module reads and writes the parts (:class:`ModelParts`); the model itself checks
them when it is built, so :meth:`topology.model.NetworkModel.from_json` and ``load`` are
``NetworkModel(*parse(...))``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from topology.errors import ModelError
from topology.model_types import ROLES, Defaults, Measurement, NodeSpec, Region, RegionLink

FORMAT_VERSION = 1


class ModelParts(NamedTuple):
    """What a model file holds, in the order :class:`~topology.model.NetworkModel` takes it."""

    nodes: list[NodeSpec]
    links: list[Measurement]
    regions: list[Region]
    region_links: list[RegionLink]
    defaults: Defaults


def parts_to_json(nodes: Iterable[NodeSpec], links: Iterable[Measurement], regions: Iterable[Region],
                  region_links: Iterable[RegionLink], defaults: Defaults) -> dict[str, Any]:
    """The JSON object of a model's parts (what :func:`parse` reads back)."""
    return {
        "format_version": FORMAT_VERSION,
        "defaults": vars(defaults).copy(),
        "nodes": [{k: v for k, v in vars(n).items() if not (k == "node_class" and v is None)} for n in nodes],
        "regions": [vars(r).copy() for r in regions],
        "region_links": [
            {k: v for k, v in vars(rl).items() if not (k == "capacity_bps" and v is None)}
            for rl in region_links
        ],
        "links": [vars(m).copy() for m in links],
    }


def parse(data: Any) -> ModelParts:
    """Parse the dict :func:`parts_to_json` writes; ``ValueError`` names the first bad field."""
    if not isinstance(data, dict):
        raise ModelError("<root>", "a network model must be a JSON object")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ModelError("format_version", f"unsupported model format version {version!r} (this build reads {FORMAT_VERSION})")
    d = data.get("defaults", {})
    if not isinstance(d, dict):
        raise ModelError("defaults", "must be an object")
    defaults = Defaults(**{
        k: _num(d, k, "defaults", default=getattr(Defaults, k)) for k in Defaults.__dataclass_fields__
    })
    nodes = []
    for i, o in enumerate(_list(data, "nodes", required=True)):
        where = f"nodes[{i}]"
        _obj(o, where)
        role = _str(o, "role", where)
        if role not in ROLES:
            raise ModelError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        cls_ = o.get("node_class")
        if cls_ is not None and not isinstance(cls_, str):
            raise ModelError(f"{where}.node_class", "must be a string or absent")
        nodes.append(NodeSpec(
            _str(o, "id", where), _str(o, "region", where), role,
            _num(o, "uplink_bps", where), _num(o, "downlink_bps", where), cls_,
        ))
    regions = []
    for i, o in enumerate(_list(data, "regions")):
        where = f"regions[{i}]"
        _obj(o, where)
        regions.append(Region(_str(o, "name", where), _num(o, "intra_bandwidth_bps", where), _num(o, "intra_rtt_s", where)))
    region_links = []
    for i, o in enumerate(_list(data, "region_links")):
        where = f"region_links[{i}]"
        _obj(o, where)
        cap = o.get("capacity_bps")
        region_links.append(RegionLink(
            _str(o, "src", where), _str(o, "dst", where), _num(o, "bandwidth_bps", where),
            _num(o, "rtt_s", where), None if cap is None else _num(o, "capacity_bps", where),
        ))
    links = []
    for i, o in enumerate(_list(data, "links")):
        where = f"links[{i}]"
        _obj(o, where)
        links.append(Measurement(_str(o, "src", where), _str(o, "dst", where), _num(o, "bandwidth_bps", where), _num(o, "rtt_s", where)))
    return ModelParts(nodes, links, regions, region_links, defaults)


def read_file(path: str | Path) -> ModelParts:
    """The parts of the model file at ``path``."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(str(path), f"not valid JSON ({exc})") from exc
    return parse(data)


def write_file(path: str | Path, data: Mapping[str, Any]) -> None:
    """Write a model's JSON object (:func:`parts_to_json`) to ``path``."""
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


# ---- typed field readers -----------------------------------------------------------------


def _obj(o: Any, where: str) -> None:
    if not isinstance(o, dict):
        raise ModelError(where, "must be an object")


def _list(data: Mapping[str, Any], key: str, required: bool = False) -> list[Any]:
    if key not in data:
        if required:
            raise ModelError(key, "missing")
        return []
    v = data[key]
    if not isinstance(v, list):
        raise ModelError(key, "must be a list")
    return v


def _str(o: Mapping[str, Any], key: str, where: str) -> str:
    v = o.get(key)
    if not isinstance(v, str) or not v:
        raise ModelError(f"{where}.{key}", "missing" if v is None else f"must be a non-empty string, got {v!r}")
    return v


def _num(o: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    v = o.get(key, default)
    if v is None:
        raise ModelError(f"{where}.{key}", "missing")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ModelError(f"{where}.{key}", f"must be a non-negative finite number, got {v!r}")
    return float(v)


__all__ = ["FORMAT_VERSION", "ModelParts", "parse", "parts_to_json", "read_file", "write_file"]
