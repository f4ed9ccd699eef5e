"""Derived placements kept on disk, so that a restarted engine of the same model shape reuses them.

A placement depends on the model's structure and vLLM's loader code, not on the
weights: the key (:func:`cache_key`) hashes vLLM's version, the model class,
every parameter's name, shape, dtype, class and weight loader, the experts'
kernel and expert maps, the model's config, the trainer's tensor table and the
rank within its group. A file holds the placements as arrays and one JSON
header (``numpy.savez``, read without pickle), written whole or not at all.

Where: ``$P2PSYNC_PLACEMENT_CACHE`` (``off`` or empty: no cache), else
``$XDG_CACHE_HOME/p2psync/placements`` or ``~/.cache/p2psync/placements``. A file
that cannot be read or does not match is ignored (the placement is derived
again and the file replaced); the caller still checks what it loads for
transformed copies, and the binding audits every live word against the
version's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rollout.engines.vllm.placement.boxes import Family, Placement

logger = logging.getLogger(__name__)

FORMAT = 2
"""Bumped whenever what a placement means, or how it is derived, changes."""


def cache_dir() -> Path | None:
    env = os.environ.get("P2PSYNC_PLACEMENT_CACHE")
    if env is not None:
        return None if env.strip() in ("", "off") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "p2psync" / "placements"


def _loader_id(p: Any) -> str:
    fn = getattr(p, "weight_loader", None)
    fn = getattr(fn, "__func__", fn)
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def cache_key(model: Any, table: str, params: dict[str, Any], rank: int, size: int) -> str:
    """The hex key of ``model``'s placements for tensor table ``table`` on rank ``rank`` of ``size``."""
    import vllm

    from rollout.engines.vllm.placement.repack import moe_experts

    h = hashlib.sha256()

    def put(*parts: Any) -> None:
        h.update(repr(parts).encode())
        h.update(b"\0")

    put(FORMAT, getattr(vllm, "__version__", "?"), type(model).__module__, type(model).__qualname__, table,
        rank, size)
    cfg = getattr(model, "config", None)
    to_json = getattr(cfg, "to_json_string", None)
    put(to_json(use_diff=False) if callable(to_json) else repr(cfg))
    for n, p in params.items():
        put(n, tuple(p.shape), str(p.dtype), type(p).__name__, _loader_id(p))
    for n, m in model.named_modules():
        emap = getattr(m, "expert_map", None)
        fe = moe_experts(m)
        if emap is not None or fe is not None:
            put(n, type(m).__name__, None if emap is None else emap.reshape(-1).tolist(),
                type(fe).__name__, getattr(fe, "isa", None), getattr(fe, "_use_zentorch", None))
    return h.hexdigest()[:40]


def load(key: str, specs: Sequence[Any]) -> dict[str, Placement] | None:
    """The placements stored under ``key`` (None: none, or unreadable, or not for ``specs``)."""
    d = cache_dir()
    if d is None:
        return None
    path = d / f"{key}.npz"
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            head = json.loads(bytes(z["head"]).decode())
            if head.get("format") != FORMAT or head.get("key") != key:
                return None
            shapes = {s.name: tuple(s.shape) for s in specs}
            out: dict[str, Placement] = {}
            for i, pl in enumerate(head["placements"]):
                fams = [Family(tuple((int(a), int(b), int(c)) for a, b, c in dims), z[f"c{i}_{j}"].astype(np.int64),
                               z[f"d{i}_{j}"].astype(np.int64)) for j, dims in enumerate(pl["families"])]
                if shapes.get(pl["name"]) != tuple(pl["shape"]):
                    return None
                out[pl["name"]] = Placement(pl["name"], pl["param"], tuple(pl["shape"]), fams, cast=pl.get("cast"))
            return out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("p2psync: placement cache %s unreadable (%s): derived again", path, exc)
        return None


def save(key: str, places: dict[str, Placement]) -> None:
    """Store ``places`` under ``key`` (atomically; a failure to write is logged, not raised)."""
    d = cache_dir()
    if d is None:
        return
    arrays: dict[str, np.ndarray] = {}
    head: dict[str, Any] = {"format": FORMAT, "key": key, "placements": []}
    for i, pl in enumerate(places.values()):
        head["placements"].append({"name": pl.name, "param": pl.param, "shape": list(pl.shape),
                                   "families": [[list(x) for x in f.dims] for f in pl.families],
                                   "cast": pl.cast})
        for j, fam in enumerate(pl.families):
            arrays[f"c{i}_{j}"] = fam.ck
            arrays[f"d{i}_{j}"] = fam.dst
    arrays["head"] = np.frombuffer(json.dumps(head).encode(), dtype=np.uint8)
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                np.savez(out, **arrays)  # type: ignore[arg-type]
            os.replace(tmp, d / f"{key}.npz")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        logger.warning("p2psync: placement cache not written to %s: %s", d, exc)
