"""Reading the checkpoint vLLM loaded, for the tensors it rounds at load.

The words of a tensor vLLM rounds at load (a ``float32`` checkpoint served in
``bfloat16``) are kept by the engine beside the live ones
(:mod:`rollout.engines.vllm.apply.kept`); at binding they come from the
checkpoint vLLM loaded: the model's local folder (``model_config.model``), only
the tensors asked for. Safetensors files are opened lazily (the folder's
``*.safetensors.index.json`` names the file of each tensor; without one every
file's header is read); a folder of ``*.bin`` / ``*.pt`` files is read through
vLLM's own iterator of that format (which loads each file whole). A model that is
not a local folder (a Hub id whose files vLLM fetched into its cache, a remote
loader) is refused with :class:`~rollout.engines.vllm.apply.kept.CheckpointUnreadable`
naming why.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from p2psync import dtypes
from p2psync.state import TensorSpec
from rollout.engines.vllm.apply.kept import CheckpointUnreadable, Reader


def reader(vllm_config: Any) -> Reader:
    """The reader of the checkpoint ``vllm_config``'s model was loaded from (module doc)."""
    model = str(getattr(vllm_config.model_config, "model", ""))
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto"))

    def read(specs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
        return read_folder(model, specs, load_format)

    return read


def read_folder(model: str, specs: Sequence[TensorSpec], load_format: str = "auto") -> dict[str, np.ndarray]:
    """The flat unsigned words of ``specs`` as stored in the checkpoint folder ``model`` (module doc);
    raises :class:`CheckpointUnreadable` naming the first tensor it cannot give."""
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
    safetensors = sorted(folder.glob("*.safetensors"))
    got = (_from_safetensors(folder, safetensors, specs) if safetensors and load_format != "pt"
           else _from_pt(folder, specs, load_format))
    out: dict[str, np.ndarray] = {}
    for s in specs:
        t = got.get(s.name)
        if t is None:
            raise CheckpointUnreadable(s.name, f"no tensor of that name in {folder}")
        code = dtypes.from_torch(t.dtype).code
        if code != s.dtype or t.numel() != s.numel:
            raise CheckpointUnreadable(s.name, f"{folder} holds it as {code} {list(t.shape)}, the trainer's table "
                                       f"as {s.dtype} {list(s.shape)}")
        out[s.name] = dtypes.words_of(t.contiguous())
    return out


def _from_safetensors(folder: Path, files: list[Path], specs: Sequence[TensorSpec]) -> dict[str, Any]:
    from safetensors import safe_open

    index = next(iter(sorted(folder.glob("*.safetensors.index.json"))), None)
    where: dict[str, str] = {}
    if index is not None:
        where = {k: str(folder / v) for k, v in json.loads(index.read_text()).get("weight_map", {}).items()}
    want = {s.name for s in specs}
    out: dict[str, Any] = {}
    for f in ([Path(p) for p in sorted(set(where[n] for n in want if n in where))] if where else files):
        if not os.path.exists(f):
            continue
        with safe_open(str(f), framework="pt") as st:
            for k in set(st.keys()) & (want - set(out)):
                out[k] = st.get_tensor(k)
    return out


def _from_pt(folder: Path, specs: Sequence[TensorSpec], load_format: str) -> dict[str, Any]:
    from vllm.model_executor.model_loader.weight_utils import pt_weights_iterator

    files = sorted(str(p) for p in folder.glob("*.pt" if load_format == "pt" else "*.bin"))
    if not files and load_format == "auto":
        files = sorted(str(p) for p in folder.glob("*.pt"))
    want = {s.name for s in specs}
    return {k: t for k, t in pt_weights_iterator(files, False) if k in want}
