"""Reading the checkpoint vLLM loaded, for the tensors it rounds at load.

The words of a tensor vLLM rounds at load (a ``float32`` checkpoint served in
``bfloat16``) are kept by the engine beside the live ones
(:mod:`rollout.engines.vllm.apply.kept`); at binding they come from the
checkpoint vLLM loaded: the model's local folder (``model_config.model``), only
the tensors asked for, and of each only the box this rank holds (a
tensor-parallel rank's rows or columns, read alone from a safetensors file).
Safetensors files are opened lazily (the folder's ``*.safetensors.index.json``
names the file of each tensor; without one every file's header is read); a folder of ``*.bin`` / ``*.pt`` files is read through
vLLM's own iterator of that format (which loads each file whole). A model that is
not a local folder (a Hub id whose files vLLM fetched into its cache, a remote
loader) is refused with :class:`~rollout.engines.vllm.apply.kept.CheckpointUnreadable`
naming why.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from p2psync import dtypes
from p2psync.state import TensorSpec
from rollout.engines.vllm.apply.kept import Box, CheckpointUnreadable, Reader, whole_box


def reader(vllm_config: Any) -> Reader:
    """The reader of the checkpoint ``vllm_config``'s model was loaded from (module doc)."""
    model = str(getattr(vllm_config.model_config, "model", ""))
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto"))

    def read(specs: Sequence[TensorSpec], boxes: Sequence[Box]) -> dict[str, np.ndarray]:
        return read_folder(model, specs, load_format, boxes)

    return read


def read_folder(model: str, specs: Sequence[TensorSpec], load_format: str = "auto",
                boxes: Sequence[Box] | None = None) -> dict[str, np.ndarray]:
    """The flat unsigned words of ``specs`` as stored in the checkpoint folder ``model`` (module doc),
    of the box ``boxes[k]`` of each (C order; None: whole tensors); raises :class:`CheckpointUnreadable`
    naming the first tensor it cannot give."""
    if not specs:
        return {}
    first = specs[0].name
    if load_format not in ("auto", "hf", "safetensors", "pt"):
        raise CheckpointUnreadable(first, f"vLLM loaded it with load_format={load_format!r}; p2psync reads "
                                   "safetensors, .bin and .pt folders only")
    folder = Path(model)
    if not folder.is_dir():
        raise CheckpointUnreadable(first, f"the model vLLM loaded ({model!r}) is not a local folder; serve a "
                                   "local checkpoint folder (e.g. a snapshot downloaded with huggingface-cli)")
    want = {s.name: (s, whole_box(s.shape) if boxes is None else boxes[k]) for k, s in enumerate(specs)}
    safetensors = sorted(folder.glob("*.safetensors"))
    got = (_from_safetensors(folder, safetensors, want) if safetensors and load_format != "pt"
           else _from_pt(folder, want, load_format))
    out: dict[str, np.ndarray] = {}
    for s in specs:
        found = got.get(s.name)
        if found is None:
            raise CheckpointUnreadable(s.name, f"no tensor of that name in {folder}")
        shape, t = found
        code = dtypes.from_torch(t.dtype).code
        if code != s.dtype or math.prod(shape) != s.numel:
            raise CheckpointUnreadable(s.name, f"{folder} holds it as {code} {list(shape)}, the trainer's table "
                                       f"as {s.dtype} {list(s.shape)}")
        out[s.name] = dtypes.words_of(t.contiguous())
    return out


def _cut(t: Any, spec: TensorSpec, box: Box) -> Any:
    """Box ``box`` of tensor ``t`` (read whole), laid out as the table's ``spec``."""
    if box == whole_box(spec.shape) or t.numel() != spec.numel:
        return t
    return t.reshape(spec.shape)[tuple(slice(lo, hi) for lo, hi in box)]


def _from_safetensors(folder: Path, files: list[Path], want: dict[str, tuple[TensorSpec, Box]]
                      ) -> dict[str, tuple[tuple[int, ...], Any]]:
    """``name -> (shape in the file, the box's elements)``: a box of a tensor stored in the table's
    shape is read alone (``get_slice``), not the whole tensor."""
    from safetensors import safe_open

    index = next(iter(sorted(folder.glob("*.safetensors.index.json"))), None)
    where: dict[str, str] = {}
    if index is not None:
        where = {k: str(folder / v) for k, v in json.loads(index.read_text()).get("weight_map", {}).items()}
    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for f in ([Path(p) for p in sorted(set(where[n] for n in want if n in where))] if where else files):
        if not os.path.exists(f):
            continue
        with safe_open(str(f), framework="pt") as st:
            for k in set(st.keys()) & (set(want) - set(out)):
                spec, box = want[k]
                part = st.get_slice(k)
                shape = tuple(int(n) for n in part.get_shape())
                if box != whole_box(spec.shape) and shape == tuple(spec.shape):
                    out[k] = (shape, part[tuple(slice(lo, hi) for lo, hi in box)])
                else:
                    out[k] = (shape, _cut(st.get_tensor(k), spec, box))
    return out


def _from_pt(folder: Path, want: dict[str, tuple[TensorSpec, Box]], load_format: str
             ) -> dict[str, tuple[tuple[int, ...], Any]]:
    from vllm.model_executor.model_loader.weight_utils import pt_weights_iterator

    files = sorted(str(p) for p in folder.glob("*.pt" if load_format == "pt" else "*.bin"))
    if not files and load_format == "auto":
        files = sorted(str(p) for p in folder.glob("*.pt"))
    return {k: (tuple(t.shape), _cut(t, *want[k])) for k, t in pt_weights_iterator(files, False) if k in want}
