"""Reading and writing standard checkpoints: ``.safetensors`` files and Hugging Face folders
(one ``model.safetensors`` or shards plus ``model.safetensors.index.json``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from p2psync.errors import ConfigError, TensorTableMismatch
from p2psync.state import ModelState, TensorSpec, check_table

INDEX = "model.safetensors.index.json"


@dataclass
class Checkpoint:
    state: ModelState
    source: Path
    shards: dict[str, list[str]] = field(default_factory=dict)
    """shard file name -> tensor names (a single file checkpoint has one entry)."""
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    """shard file name -> safetensors ``__metadata__``."""


def _read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except FileNotFoundError:
        raise ConfigError("checkpoint", f"{path} does not exist") from None
    except Exception as exc:  # safetensors raises its own SafetensorError / OSError types
        raise ConfigError("checkpoint", f"{path} is not a readable safetensors file: {exc}") from None


def load(path: str | Path) -> Checkpoint:
    """Load every tensor of a checkpoint to CPU memory, ordered by name."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    shards: dict[str, list[str]] = {}
    metadata: dict[str, dict[str, str]] = {}
    if path.is_dir():
        index = path / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise ConfigError("checkpoint", f"{index} is not a valid index: {exc}") from None
            files = sorted(set(weight_map.values()))
        elif (path / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise ConfigError("checkpoint", f"{path} holds no .safetensors files")
        for name in files:
            t, meta = _read_file(path / name)
            dup = set(t) & set(tensors)
            if dup:
                raise ConfigError("checkpoint", f"tensor {sorted(dup)[0]} appears in more than one shard")
            tensors.update(t)
            shards[name] = sorted(t)
            metadata[name] = meta
    else:
        tensors, meta = _read_file(path)
        shards[path.name] = sorted(tensors)
        metadata[path.name] = meta
    state = ModelState((k, tensors[k]) for k in sorted(tensors))
    return Checkpoint(state, path, shards, metadata)


def in_table(state: ModelState, specs: Sequence[TensorSpec]) -> ModelState:
    """``state`` (a loaded checkpoint, ordered by name) in the order of a published tensor table,
    sharing its memory: its fingerprint is then the one the trainer publishes for the same bits.
    A checkpoint a trainer saved with ``save_pretrained`` (in the rollout dtype) is a valid
    version 0 when the two fingerprints are equal. Raises :class:`TensorTableMismatch` naming
    every tensor the two tables do not share."""
    names = {s.name for s in specs}
    unknown = [s.name for s in specs if s.name not in state.index]
    missing = [n for n in state if n not in names]
    if unknown or missing:
        raise TensorTableMismatch(unknown=unknown, missing=missing)
    ordered = ModelState((s.name, state.tensor(s.name)) for s in specs)
    check_table(list(specs), ordered.specs)
    return ordered


def save(state: ModelState, out: str | Path, like: Checkpoint | None = None) -> None:
    """Write ``state`` as one ``.safetensors`` file (``out`` ends in .safetensors) or as a folder
    with the shard layout of ``like`` (plus its non-weight files, e.g. config.json)."""
    out = Path(out)
    if out.suffix == ".safetensors":
        meta = next(iter(like.metadata.values()), {}) if like else {}
        save_file(state.tensors(), str(out), metadata=meta or {"format": "pt"})
        return
    out.mkdir(parents=True, exist_ok=True)
    if like is None or not like.source.is_dir():
        save_file(state.tensors(), str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    known = set(state)
    for shard, names in like.shards.items():
        save_file({n: state.tensor(n) for n in names if n in known}, str(out / shard),
                  metadata=like.metadata.get(shard) or {"format": "pt"})
    if (like.source / INDEX).exists():
        index = json.loads((like.source / INDEX).read_text())
        index.setdefault("metadata", {})["total_size"] = state.nbytes
        (out / INDEX).write_text(json.dumps(index, indent=2))
    for p in like.source.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != INDEX:
            shutil.copy2(p, out / p.name)
