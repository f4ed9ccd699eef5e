"""LoRA adapters as p2psync model states: the format the trainer publishes and the rollout side loads.

An adapter version is an ordinary model state, so it travels as any other stream does (signed
snapshot, then signed deltas; relays carry it unchanged): its tensors under PEFT's names
(``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, bf16 as vLLM serves them) plus
one ``U8`` tensor, :data:`CONFIG_TENSOR`, holding the adapter's config as canonical JSON. The
config is therefore covered by the signed target fingerprint like every weight word, and costs
nothing in a delta while it does not change. It names what a receiver checks before it serves
the adapter: the LoRA rank and alpha, the target modules, and the fingerprint of the base
model's weights it was trained on.

The stream's ``model_id`` names the adapter (:func:`stream_id`), so one trainer can publish
several adapters, each on its own node, beside or without a full-weight stream.

Also here: PEFT's on-disk folder (``adapter_config.json`` + ``adapter_model.safetensors``), read and
written without the ``peft`` package, which is what vLLM loads from a path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from p2psync.errors import CodecError, ConfigError

if TYPE_CHECKING:
    import torch

    from p2psync.state import ModelState

CONFIG_TENSOR = "p2psync.adapter_config"
"""Name of the ``U8`` tensor that holds an adapter state's config (canonical JSON)."""
FORMAT = "p2psync-lora/1"
_PEFT_NAME = re.compile(r"^base_model\.model\.(.+)\.(lora_A|lora_B)\.weight$")
_LIVE_NAME = re.compile(r"^(.*\.(?:lora_A|lora_B))\.[^.]+(\.weight)$")


def stream_id(name: str) -> str:
    """The ``model_id`` of adapter ``name``'s stream."""
    return f"lora:{name}"


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter promises about itself; signed with its weights."""

    name: str
    """The adapter's name (its stream is :func:`stream_id` of it)."""
    r: int
    """LoRA rank."""
    lora_alpha: float
    """LoRA scaling numerator (the update is ``alpha / r * B A``)."""
    target_modules: tuple[str, ...]
    """Module names the adapter adapts (``q_proj``, ``v_proj``, ...), sorted."""
    base_fingerprint: str
    """p2psync fingerprint of the base model's weights the adapter was trained on."""
    base_model: str = ""
    """The base model's name or path (informational; the fingerprint is what is checked)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("name", "must not be empty")
        if self.r < 1:
            raise ConfigError("r", f"must be at least 1, got {self.r}")
        if not self.target_modules:
            raise ConfigError("target_modules", "must name at least one module")
        object.__setattr__(self, "target_modules", tuple(sorted(set(self.target_modules))))

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "name": self.name, "r": self.r, "lora_alpha": self.lora_alpha,
                "target_modules": list(self.target_modules), "base_fingerprint": self.base_fingerprint,
                "base_model": self.base_model}

    @classmethod
    def from_json(cls, body: Any) -> AdapterConfig:
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise CodecError(f"adapter config: not a {FORMAT} config")
        try:
            return cls(name=str(body["name"]), r=int(body["r"]), lora_alpha=float(body["lora_alpha"]),
                       target_modules=tuple(str(m) for m in body["target_modules"]),
                       base_fingerprint=str(body["base_fingerprint"]), base_model=str(body.get("base_model", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise CodecError(f"adapter config: bad field ({exc})") from None

    def peft_json(self) -> dict[str, Any]:
        """``adapter_config.json`` of a PEFT LoRA folder with this config."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r, "lora_alpha": self.lora_alpha,
                "target_modules": list(self.target_modules), "lora_dropout": 0.0, "bias": "none",
                "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
                "base_model_name_or_path": self.base_model}

    def encoded(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()


def peft_names(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA tensors of ``named`` (a PEFT model's ``named_parameters()``, or its saved state
    dict) under the names PEFT saves them with: the adapter's own name dropped
    (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``). Other tensors are left out."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        m = _LIVE_NAME.match(name)
        key = m.group(1) + m.group(2) if m else name
        if _PEFT_NAME.match(key):
            out[key] = t
    if not out:
        raise ConfigError("adapter", "no LoRA tensors (named base_model.model.<module>.lora_A/B.weight) found")
    return out


def check_tensors(tensors: Mapping[str, Any], config: AdapterConfig) -> None:
    """Raise :class:`ConfigError` unless ``tensors`` are LoRA pairs of rank ``config.r`` on
    ``config.target_modules``."""
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, t in tensors.items():
        m = _PEFT_NAME.match(name)
        if m is None:
            raise ConfigError("adapter", f"{name} is not a LoRA tensor name (base_model.model.<module>.lora_A.weight)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tuple(t.shape)
    for module, ab in pairs.items():
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None or len(a) != 2 or len(b) != 2 or a[0] != config.r or b[1] != config.r:
            raise ConfigError("adapter", f"{module}: lora_A {a} and lora_B {b} are not a rank-{config.r} pair")
        if module.rsplit(".", 1)[-1] not in config.target_modules:
            raise ConfigError("adapter", f"{module} is not among the target modules {list(config.target_modules)}")


def adapter_state(tensors: Mapping[str, torch.Tensor], config: AdapterConfig) -> ModelState:
    """The model state of one adapter version: ``tensors`` (PEFT names, bf16) and the config tensor."""
    import torch

    from p2psync.state import ModelState

    check_tensors(tensors, config)
    items: list[tuple[str, torch.Tensor]] = [(n, tensors[n].detach().to(torch.bfloat16).contiguous())
                                             for n in sorted(tensors)]
    items.append((CONFIG_TENSOR, config_tensor(config)))
    return ModelState(items)


def config_tensor(config: AdapterConfig) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(config.encoded()), dtype=torch.uint8)


def split_state(state: ModelState) -> tuple[AdapterConfig, dict[str, np.ndarray]]:
    """``(config, {PEFT name: raw words})`` of an adapter state (a :class:`CodecError` if it is not one)."""
    if CONFIG_TENSOR not in state.index:
        raise CodecError(f"not an adapter state (no {CONFIG_TENSOR} tensor)")
    try:
        body = json.loads(state.words(CONFIG_TENSOR).tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodecError(f"adapter config: not JSON ({exc})") from None
    config = AdapterConfig.from_json(body)
    words = {s.name: state.words(s.name) for s in state.specs if s.name != CONFIG_TENSOR}
    shapes = {s.name: s for s in state.specs if s.name != CONFIG_TENSOR}
    try:
        check_tensors({n: np.empty(shapes[n].shape, dtype=np.uint8) for n in words}, config)
    except ConfigError as exc:
        raise CodecError(f"adapter state: {exc}") from None
    return config, words


def write_peft_folder(path: str | Path, tensors: Mapping[str, torch.Tensor], config: AdapterConfig) -> Path:
    """Write a PEFT LoRA folder (what ``PeftModel.save_pretrained`` writes, and vLLM loads)."""
    from safetensors.torch import save_file

    check_tensors(tensors, config)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous() for n, t in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config.peft_json(), indent=2))
    return path


def read_peft_folder(path: str | Path, *, name: str, base_fingerprint: str) -> tuple[dict[str, torch.Tensor],
                                                                                     AdapterConfig]:
    """The tensors and config of a PEFT LoRA folder, as :func:`adapter_state` takes them."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        peft = json.loads((path / "adapter_config.json").read_text())
        tensors = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("adapter", f"{path} is not a PEFT LoRA folder ({exc})") from None
    if peft.get("peft_type", "LORA") != "LORA":
        raise ConfigError("adapter", f"{path}: peft_type {peft.get('peft_type')!r}, only LORA is supported")
    targets = peft.get("target_modules")
    if isinstance(targets, str):
        raise ConfigError("adapter", f"{path}: target_modules as a pattern ({targets!r}) is not supported")
    config = AdapterConfig(name=name, r=int(peft["r"]), lora_alpha=float(peft["lora_alpha"]),
                           target_modules=tuple(targets or ()), base_fingerprint=base_fingerprint,
                           base_model=str(peft.get("base_model_name_or_path") or ""))
    return peft_names(tensors), config
