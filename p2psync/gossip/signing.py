"""Trainer-key signatures on coordinator entries (plan, head, leases).

Relays may be untrusted machines: they forward gossip but must not be able to
forge or alter what the coordinator wrote. The trainer signs
:meth:`~p2psync.gossip.items.CoordEntry.signed_bytes` with the same Ed25519
key that signs manifests; every node checks with the trainer's public key it
already holds. Hooks for :class:`~p2psync.gossip.coordinator_state.CoordinatorState`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Callable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2psync.gossip.items import CoordEntry


def signer(private_key: Ed25519PrivateKey) -> Callable[[CoordEntry], CoordEntry]:
    """``sign`` hook: the entry with its signature."""

    def sign(e: CoordEntry) -> CoordEntry:
        sig = private_key.sign(e.signed_bytes())
        return dataclasses.replace(e, signature=base64.b64encode(sig).decode())

    return sign


def verifier(public_key: Ed25519PublicKey) -> Callable[[CoordEntry], bool]:
    """``verify`` hook: True only for an entry signed by the trainer's key (unsigned: False)."""

    def verify(e: CoordEntry) -> bool:
        if not e.signature:
            return False
        try:
            public_key.verify(base64.b64decode(e.signature, validate=True), e.signed_bytes())
        except (InvalidSignature, binascii.Error, ValueError):
            return False
        return True

    return verify
