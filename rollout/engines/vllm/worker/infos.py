"""What a client sends the ``p2psync`` vLLM backend, checked field by field.

``init_weight_transfer_engine`` carries ``{"init_info": {...}}`` and
``update_weights`` ``{"update_info": {...}}``; vLLM hands those dicts to the
backend as they came over HTTP (or from ``LLM``). :func:`init_info` and
:func:`update_info` turn them into typed values or raise
:class:`TransferInfoError` naming the field (``init_info.url``,
``update_info.version``, ...): wrong types, missing or unknown keys, negative
versions, a ``stage`` that is not ``true`` or ``false``. JSON has no integer type of its own, so a version must be a JSON
integer (``5``), not ``"5"`` or ``5.0``.

No vLLM import here: the rules are plain Python, testable without an engine. The parent's
fields become one :class:`~p2psync.transport.leaf.Parent`, built here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2psync.errors import ConfigError, P2PSyncError
from p2psync.transport.leaf import Parent, public_key_from


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
    """The fields of ``init_info`` (the backend's :class:`rollout.engines.vllm.worker.backend.P2PSyncInitInfo`).

    The parent's own fields (``url``, ``token``, ``public_key``, ``node_id``, ``timeout``,
    ``tls_dir``: see :class:`~p2psync.transport.leaf.Parent`) build :attr:`parent` once, its
    certificate folder loaded and its key read; ``node_id`` defaults to ``"vllm"``."""

    parent: Parent
    """The p2psync node to pull from (e.g. the rollout node's own server)."""
    version: int | None = None
    """Version of the weights the model holds now (None: unknown, the first update loads a snapshot)."""
    threads: int = 0
    """Decode, write and hash threads; 0: one per CPU the update may use, the worker's own cores and
    those vLLM's thread binding leaves free (:mod:`rollout.engines.vllm.worker.cpus`)."""


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
    token = _text(d["token"], f"{where}.token")
    key = _text(d["public_key"], f"{where}.public_key")
    node_id = _text(d["node_id"], f"{where}.node_id") if "node_id" in d else "vllm"
    version = None if d.get("version") is None else _integer(d["version"], f"{where}.version", 0)
    threads = _integer(d["threads"], f"{where}.threads", 0) if "threads" in d else 0
    tls_dir = _text(d["tls_dir"], f"{where}.tls_dir") if "tls_dir" in d else ""
    timeout = d.get("timeout", 30.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TransferInfoError(f"{where}.timeout", f"must be a number of seconds > 0, got {_shown(timeout)}")
    try:
        parent = Parent.create(url, token, key, node_id, tls_dir, float(timeout), prefix=f"{where}.")
    except ConfigError as exc:
        raise TransferInfoError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
    return InitFields(parent, version, threads)


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
    try:
        return public_key_from(text, field)
    except ConfigError as exc:
        raise TransferInfoError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
