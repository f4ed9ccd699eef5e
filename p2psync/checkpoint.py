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


def _rewrite_like(src: Path, dst: Path, state: ModelState) -> bool:
    """``dst`` = the safetensors file ``src`` byte for byte (its header: ``__metadata__``, tensor
    order, offsets, padding), each tensor's data replaced by ``state``'s bits. Returns False (and
    writes nothing) when ``src``'s tensors are not exactly ``state``'s names, dtypes and sizes."""
    with open(src, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            return False
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return False
    start = 8 + n
    spans: list[tuple[str, int, int]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if name not in state.index:
            return False
        t = state.tensor(name)
        begin, end = info["data_offsets"]
        if end - begin != t.numel() * t.element_size() or list(info["shape"]) != list(t.shape):
            return False
        spans.append((name, begin, end))
    if len(spans) != len(state):
        return False
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    try:
        with open(tmp, "r+b") as f:
            for name, begin, _ in spans:
                f.seek(start + begin)
                f.write(state.tensor(name).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        tmp.replace(dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


def save(state: ModelState, out: str | Path, like: Checkpoint | None = None) -> None:
    """Write ``state`` as one ``.safetensors`` file (``out`` ends in .safetensors) or as a folder
    with the shard layout of ``like`` (plus its non-weight files, e.g. config.json).

    With ``like`` of the same kind (a file for a file, a folder for a folder) and the same tensor
    table, every file is ``like``'s byte for byte except the tensors' data: the safetensors header
    (``__metadata__``, tensor order, padding), the index and the other files are copied, so the
    output is byte-identical to any checkpoint with those bits whose files have ``like``'s headers
    (e.g. NEW of a delta when BASE and NEW were written the same way)."""
    out = Path(out)
    if out.suffix == ".safetensors":
        if like is not None and not like.source.is_dir() and _rewrite_like(like.source, out, state):
            return
        meta = next(iter(like.metadata.values()), {}) if like else {"format": "pt"}
        save_file(state.tensors(), str(out), metadata=meta or None)
        return
    out.mkdir(parents=True, exist_ok=True)
    if like is None or not like.source.is_dir():
        save_file(state.tensors(), str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    known = set(state)
    for shard, names in like.shards.items():
        part = ModelState((n, state.tensor(n)) for n in names if n in known)
        if not _rewrite_like(like.source / shard, out / shard, part):
            save_file(part.tensors(), str(out / shard), metadata=like.metadata.get(shard) or None)
    if (like.source / INDEX).exists():
        shutil.copyfile(like.source / INDEX, out / INDEX)  # a delta keeps every tensor's size
    for p in like.source.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != INDEX:
            shutil.copy2(p, out / p.name)
