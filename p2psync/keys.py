"""Ed25519 keys: only the trainer's private key can publish; everyone verifies with its public key."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2psync.errors import ConfigError, SignatureError


def generate() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def write_pair(private: Ed25519PrivateKey, directory: Path, name: str = "trainer") -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    priv_path, pub_path = directory / f"{name}.key", directory / f"{name}.pub"
    if priv_path.exists() or pub_path.exists():
        raise ConfigError("output", f"{priv_path} or {pub_path} already exists; refusing to overwrite a key")
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub_path.write_bytes(
        private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return priv_path, pub_path


def load_private(path: str | Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError("key", f"cannot read private key {path}: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError("key", f"{path} is not an Ed25519 private key")
    return key


def load_public(path: str | Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError("pubkey", f"cannot read public key {path}: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError("pubkey", f"{path} is not an Ed25519 public key")
    return key


def verify(public: Ed25519PublicKey, signature: bytes, message: bytes) -> None:
    try:
        public.verify(signature, message)
    except InvalidSignature:
        raise SignatureError("manifest signature does not verify: forged, altered or signed by another key") from None
