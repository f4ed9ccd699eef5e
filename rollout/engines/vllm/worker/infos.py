"""What a client sends the ``p2psync`` vLLM backend, checked field by field.

``init_weight_transfer_engine`` carries ``{"init_info": {...}}`` and
``update_weights`` ``{"update_info": {...}}``; vLLM hands those dicts to the
backend as they came over HTTP (or from ``LLM``). :func:`init_info` and
:func:`update_info` turn them into typed values or raise
:class:`TransferInfoError` naming the field (``init_info.url``,
``update_info.version``, ...): wrong types, missing or unknown keys, negative
versions, a ``stage`` that is not ``true`` or ``false``. JSON has no integer type of its own, so a version must be a JSON
integer (``5``), not ``"5"`` or ``5.0``.

The schema is two ``msgspec`` structs checked by :func:`p2psync.validate.convert` (the token is never
echoed in a refusal). No vLLM import here: the rules are plain Python, testable without an engine. The parent's
fields become one :class:`~p2psync.transport.leaf.Parent`, built here once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from p2psync.errors import ConfigError, P2PSyncError
from p2psync.transport.leaf import Parent, public_key_from
from p2psync.validate import NON_BLANK, convert


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
    adapters: dict[str, Parent] | None = None
    """Where each LoRA adapter's stream (``lora:<name>``) is pulled from, by adapter name: the node
    given in ``init_info.adapters``, presenting the parent's token, key and certificate; an adapter
    not named there is pulled from :attr:`parent` (:mod:`rollout.engines.vllm.worker.adapter_source`)."""

    def adapter_parent(self, name: str) -> Parent:
        """The node adapter ``name``'s stream is pulled from."""
        return (self.adapters or {}).get(name, self.parent)


@dataclass
class UpdateFields:
    """The fields of ``update_info``."""

    version: int
    stage: bool = False
    """Fetch (and decode) ``version`` in the background and return at once; a later update to it
    commits what was staged (:mod:`rollout.engines.vllm.worker.stage`)."""


Text = Annotated[str, Meta(pattern=NON_BLANK)]
Count = Annotated[int, Meta(ge=0)]


class _InitInfo(msgspec.Struct, forbid_unknown_fields=True):
    """``init_info`` as it comes (:class:`InitFields` says what each field means)."""

    url: Text
    token: Text
    public_key: Text
    version: Count | None = None
    node_id: Text = "vllm"
    threads: Count = 0
    timeout: Annotated[float, Meta(gt=0)] = 30.0
    tls_dir: Text = ""
    adapters: dict[Text, Text] = {}


INIT_KEYS: tuple[str, ...] = _InitInfo.__struct_fields__
"""The keys ``init_info`` may carry (the trainer-side engine's list is checked against it)."""


class _UpdateInfo(msgspec.Struct, forbid_unknown_fields=True):
    """``update_info`` as it comes."""

    version: Count
    stage: bool = False


def init_info(value: Any) -> InitFields:
    """The ``init_info`` a client sent, checked (see module doc)."""
    where = "init_info"
    d = convert(value, _InitInfo, error=TransferInfoError, where=where, secrets=("token",))
    try:
        parent = Parent.create(d.url, d.token, d.public_key, d.node_id, d.tls_dir, d.timeout,
                               prefix=f"{where}.")
    except ConfigError as exc:
        raise TransferInfoError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
    adapters: dict[str, Parent] = {}
    for name, url in d.adapters.items():
        if not url.startswith(("http://", "https://")):
            raise TransferInfoError(f"{where}.adapters.{name}", f"must be an http:// or https:// address, got {url!r}")
        if url.startswith("https://") and parent.tls is None:
            raise TransferInfoError(f"{where}.tls_dir", "missing: an https:// adapter node takes only mutual TLS")
        adapters[name] = dataclasses.replace(parent, url=url.rstrip("/"))
    return InitFields(parent, d.version, d.threads, adapters)


def update_info(value: Any) -> UpdateFields:
    """The ``update_info`` a client sent (for this worker's rank), checked (see module doc)."""
    d = convert(value, _UpdateInfo, error=TransferInfoError, where="update_info")
    return UpdateFields(version=d.version, stage=d.stage)


def load_public_key(text: str, field: str = "init_info.public_key") -> Any:
    """The trainer's Ed25519 public key from PEM text or the path of a PEM file; :class:`TransferInfoError`
    naming ``field`` if it cannot be read or is not an Ed25519 key."""
    try:
        return public_key_from(text, field)
    except ConfigError as exc:
        raise TransferInfoError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
