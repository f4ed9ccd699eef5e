"""What a client sends the ``p2psync`` vLLM backend, checked field by field.

``init_weight_transfer_engine`` carries ``{"init_info": {...}}`` and
``update_weights`` ``{"update_info": {...}}``; vLLM hands those dicts to the
backend as they came over HTTP (or from ``LLM``). :func:`init_info` and
:func:`update_info` turn them into typed values or raise
:class:`TransferInfoError` naming the field (``init_info.url``,
``update_info.version``, ...): wrong types, missing or unknown keys, negative
versions, a ``stage`` that is not ``true`` or ``false``. JSON has no integer type of its own, so a version must be a JSON
integer (``5``), not ``"5"`` or ``5.0``.

No vLLM import here: the rules are plain Python, testable without an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2psync.errors import ConfigError, P2PSyncError


class TransferInfoError(ConfigError):
    """A field of ``init_info`` / ``update_info`` is missing, unknown, mistyped or out of range, or what it
    names (the parent's URL, its token, the key file) cannot be used; ``field`` names it (``init_info.url``)."""


class NotInitialized(P2PSyncError):
    """An update before any ``init_weight_transfer_engine`` was accepted (none was sent, or every one
    was refused): the engine has no p2psync parent to pull from, and keeps serving the weights it
    loaded."""

    def __init__(self) -> None:
        super().__init__("no init_weight_transfer_engine has succeeded yet (none was sent, or each was "
                         "refused): the engine has no p2psync parent; send an init that is accepted, then update")


@dataclass
class InitFields:
    """The fields of ``init_info`` (the backend's :class:`rollout.engines.vllm.worker.backend.P2PSyncInitInfo`)."""

    url: str
    """Address of the p2psync node to pull from (e.g. the rollout node's own server)."""
    token: str
    """The cluster token (``Authorization: Bearer``)."""
    public_key: str
    """The trainer's Ed25519 public key: PEM text, or the path of a PEM file."""
    version: int | None = None
    """Version of the weights the model holds now (None: unknown, the first update loads a snapshot)."""
    node_id: str = "vllm"
    threads: int = 0
    """Decode, write and hash threads; 0: one per CPU the update may use, the worker's own cores and
    those vLLM's thread binding leaves free (:mod:`rollout.engines.vllm.worker.cpus`)."""
    timeout: float = 30.0
    """Seconds a parent may stall before the fetch fails."""
    tls_dir: str = ""
    """Certificate folder presented to an ``https://`` parent (the node's own ``tls.dir``; mutual TLS)."""


@dataclass
class UpdateFields:
    """The fields of ``update_info``."""

    version: int
    stage: bool = False
    """Fetch (and decode) ``version`` in the background and return at once; a later update to it
    commits what was staged (:mod:`rollout.engines.vllm.worker.stage`)."""


_INIT_REQUIRED = ("url", "token", "public_key")
_INIT_OPTIONAL = ("version", "node_id", "threads", "timeout", "tls_dir")


def _table(value: Any, where: str, known: tuple[str, ...], required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TransferInfoError(where, f"must be a JSON object, got {_shown(value)}")
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise TransferInfoError(f"{where}.{unknown[0]}", f"unknown key (known: {', '.join(known)})")
    for k in required:
        if k not in value:
            raise TransferInfoError(f"{where}.{k}", "missing (required)")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise TransferInfoError(field, f"must be a string, got {_shown(value)}")
    if not value.strip():
        raise TransferInfoError(field, "must not be empty")
    return value


def _integer(value: Any, field: str, least: int) -> int:
    # bool is an int in Python; true/false in JSON is not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TransferInfoError(field, f"must be an integer >= {least}, got {_shown(value)}")
    if value < least:
        raise TransferInfoError(field, f"must be an integer >= {least}, got {value}")
    return value


def init_info(value: Any) -> InitFields:
    """The ``init_info`` a client sent, checked (see module doc)."""
    where = "init_info"
    d = _table(value, where, _INIT_REQUIRED + _INIT_OPTIONAL, _INIT_REQUIRED)
    url = _text(d["url"], f"{where}.url")
    if not url.startswith(("http://", "https://")):
        raise TransferInfoError(f"{where}.url", f"must be an http:// or https:// address, got {url!r}")
    out = InitFields(url=url.rstrip("/"), token=_text(d["token"], f"{where}.token"),
                     public_key=_text(d["public_key"], f"{where}.public_key"))
    if d.get("version") is not None:
        out.version = _integer(d["version"], f"{where}.version", 0)
    if "node_id" in d:
        out.node_id = _text(d["node_id"], f"{where}.node_id")
    if "threads" in d:
        out.threads = _integer(d["threads"], f"{where}.threads", 0)
    if "timeout" in d:
        t = d["timeout"]
        if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0:
            raise TransferInfoError(f"{where}.timeout", f"must be a number of seconds > 0, got {_shown(t)}")
        out.timeout = float(t)
    if "tls_dir" in d:
        out.tls_dir = _text(d["tls_dir"], f"{where}.tls_dir")
        if not Path(out.tls_dir).is_dir():
            raise TransferInfoError(f"{where}.tls_dir", f"no such folder: {out.tls_dir!r} (the certificate folder "
                                    "of the node, e.g. its data_dir/tls)")
    if url.startswith("https://") and not out.tls_dir:
        raise TransferInfoError(f"{where}.tls_dir", "missing: an https:// parent takes only mutual TLS; give the "
                                "folder with a certificate of the cluster CA (the node's data_dir/tls)")
    return out


def update_info(value: Any) -> UpdateFields:
    """The ``update_info`` a client sent (for this worker's rank), checked (see module doc)."""
    d = _table(value, "update_info", ("version", "stage"), ("version",))
    stage = d.get("stage", False)
    if not isinstance(stage, bool):
        raise TransferInfoError("update_info.stage", f"must be true or false, got {_shown(stage)}")
    return UpdateFields(version=_integer(d["version"], "update_info.version", 0), stage=stage)


def load_public_key(text: str, field: str = "init_info.public_key") -> Any:
    """The trainer's Ed25519 public key from PEM text or the path of a PEM file; :class:`TransferInfoError`
    naming ``field`` if it cannot be read or is not an Ed25519 key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from p2psync import keys

    if "BEGIN PUBLIC KEY" not in text:
        try:
            return keys.load_public(text)
        except ConfigError as exc:
            raise TransferInfoError(field, str(exc).removeprefix(f"{exc.field}: ")) from None
    try:
        key = serialization.load_pem_public_key(text.encode())
    except (ValueError, TypeError) as exc:
        raise TransferInfoError(field, f"PEM text that is not a public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise TransferInfoError(field, f"not an Ed25519 public key ({type(key).__name__})")
    return key
