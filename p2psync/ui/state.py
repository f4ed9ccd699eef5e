"""What the live page shows, as one JSON document: pure functions (no sockets, no clocks).

:func:`build_state` merges the cluster view (who exists, from ``node.cluster()``
or the trainer's own view) with each node's ``GET /v1/status`` answer, and
:func:`layout` places the tree: one column band per region (the trainer's
first, then by name), one row per depth, each parent above its children.
The page's script only draws what this says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

STATE_FORMAT = 1


def _transfers(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    for aid, t in sorted((status.get("transfers") or {}).items()):
        if not isinstance(t, Mapping):
            continue
        held, total = int(t.get("chunks_held", 0) or 0), int(t.get("chunks", 0) or 0)
        out.append({"id": aid, "chunks_held": held, "chunks": total,
                    "fraction": held / total if total else 0.0,
                    "bytes_held": t.get("bytes_held"), "bytes": t.get("bytes")})
    return out


def build_state(self_id: str, members: Sequence[Mapping[str, Any]], statuses: Mapping[str, Mapping[str, Any]],
                errors: Mapping[str, str], now: float, source: str) -> dict[str, Any]:
    """The ``/ui/state`` document.

    ``members``: dicts with ``id`` and, where known, ``role``, ``region``,
    ``address``, ``version``, ``status``, ``parent`` (the control plane's
    ``Node.cluster()`` entries). ``statuses``: node id -> its ``/v1/status``
    answer; ``errors``: node id -> why there is none. A node's live status wins
    over the cluster entry; its parent is the parent it actually pulls from
    (its status names that parent's URL, mapped back to an id) when known,
    else the planned one.
    """
    by_url = {str(m["address"]).rstrip("/"): str(m["id"]) for m in members if m.get("address")}
    nodes: list[dict[str, Any]] = []
    for m in members:
        nid = str(m["id"])
        st = statuses.get(nid) or {}
        parent_url = st.get("parent")
        parent = by_url.get(str(parent_url).rstrip("/")) if parent_url else None
        transfers = _transfers(st)
        nodes.append({
            "id": nid,
            "role": st.get("role") or m.get("role") or "?",
            "region": st.get("region") or m.get("region") or "?",
            "address": m.get("address"),
            "parent": parent or m.get("parent"),
            "planned_parent": m.get("parent"),
            "version": st["version"] if "version" in st else m.get("version"),
            "head": st.get("head"),
            "loaded": st.get("loaded"),
            "transfers": transfers,
            "progress": max((t["fraction"] for t in transfers), default=None),
            "bytes_in": st.get("bytes_in"),
            "bytes_out": st.get("bytes_out"),
            "bad_chunks": st.get("bad_chunks"),
            "status": "unreachable" if nid in errors else str(m.get("status") or ("alive" if st else "unknown")),
            "error": errors.get(nid),
            "seen_s": m.get("seen"),
        })
    ids = {n["id"] for n in nodes}
    for n in nodes:  # an edge only between nodes that are drawn, and never a self-loop
        if n["parent"] not in ids or n["parent"] == n["id"]:
            n["parent"] = None
    pos, bands = layout(nodes, self_id)
    depth = _depths(nodes, self_id)
    for n in nodes:
        n["x"], n["y"] = pos[n["id"]]
        n["depth"] = depth[n["id"]]
    me = next((n for n in nodes if n["id"] == self_id), None)
    versions = [n["version"] for n in nodes if isinstance(n["version"], int)]
    return {
        "format": STATE_FORMAT, "now": now, "self": self_id, "source": source,
        "head": me["version"] if me else None,
        "in_sync": sum(1 for n in nodes if me and n["version"] == me["version"]),
        "oldest": min(versions, default=None),
        "rows": max(depth.values(), default=0) + 1, "regions": bands, "nodes": nodes,
    }


def _depths(nodes: Sequence[Mapping[str, Any]], root: str) -> dict[str, int]:
    """Depth below ``root``; a chain that does not reach it (parent unknown, or a cycle while nodes
    re-parent) hangs at depth 1 from its top."""
    parent = {n["id"]: n["parent"] for n in nodes}
    depth: dict[str, int] = {root: 0} if root in parent else {}
    for nid in parent:
        chain: list[str] = []
        cur = nid
        while cur is not None and cur != root and cur not in depth and cur not in chain:
            chain.append(cur)
            cur = parent.get(cur)
        base = depth.get(cur, 0) if cur is not None and cur not in chain else 0
        for k, c in enumerate(reversed(chain)):
            depth[c] = base + 1 + k
    return depth


def layout(nodes: Sequence[Mapping[str, Any]], root: str) -> tuple[dict[str, tuple[float, float]], list[dict[str, Any]]]:
    """Positions in [0, 1] x [0, 1] (x across, y down) and the region bands ``{name, x0, x1}``.

    Bands are as wide as their widest row; inside a band, rows are ordered so
    that siblings sit together (children in their parents' order).
    """
    if not nodes:
        return {}, []
    depth = _depths(nodes, root)
    region = {n["id"]: str(n["region"]) for n in nodes}
    root_region = region.get(root)
    names = sorted(set(region.values()), key=lambda r: (r != root_region, r))
    rows: dict[str, dict[int, list[str]]] = {r: {} for r in names}
    order = {n["id"]: i for i, n in enumerate(sorted(nodes, key=lambda n: str(n["id"])))}
    parent = {n["id"]: n["parent"] for n in nodes}
    rank: dict[str, tuple[int, ...]] = {}
    for nid in sorted(depth, key=lambda i: (depth[i], order[i])):
        p = parent.get(nid)
        rank[nid] = (*(rank.get(p, ()) if p else ()), order[nid])
    for nid in depth:
        rows[region[nid]].setdefault(depth[nid], []).append(nid)
    width = {r: max((len(v) for v in rows[r].values()), default=1) for r in names}
    total = sum(width.values())
    max_depth = max(depth.values(), default=0)
    pos: dict[str, tuple[float, float]] = {}
    bands = []
    x0 = 0.0
    for r in names:
        w = width[r] / total
        bands.append({"name": r, "x0": x0, "x1": x0 + w, "nodes": sum(len(v) for v in rows[r].values())})
        for d, ids in rows[r].items():
            ids.sort(key=lambda i: rank[i])
            for k, nid in enumerate(ids):
                pos[nid] = (x0 + w * (k + 0.5) / len(ids), (d + 0.5) / (max_depth + 1))
        x0 += w
    return pos, bands
