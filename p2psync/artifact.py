"""Artifacts: a signed manifest plus chunks, for deltas and snapshots alike.

Manifest bytes::

    b"P2SM"  u16 format_version  u32 body_len  body  u8 sig_len  signature

``body`` is canonical JSON (sorted keys, no spaces). The Ed25519 signature
covers magic, format version and body, so every field, chunk hash included, is
authenticated by the trainer's key. A relay can delay an artifact but cannot
change one bit of it without being caught by :func:`verify_chunk`.

Artifact file (what ``p2psync delta encode`` writes)::

    b"P2SA"  u16 format_version  u64 manifest_len  manifest  chunk 0  chunk 1 ...
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import xxhash
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2psync import keys
from p2psync.codec.decode import Applier
from p2psync.codec.encode import CodecOptions, EncodedArtifact
from p2psync.codec.segindex import index_of, parse_index
from p2psync.dtypes import BY_CODE
from p2psync.errors import ChunkHashMismatch, CodecError, FormatVersionError, SignatureError, TruncatedError
from p2psync.state import ModelState, TensorSpec, table_hash

FORMAT_VERSION = 2
MANIFEST_MAGIC = b"P2SM"
FILE_MAGIC = b"P2SA"
MAX_MANIFEST_BYTES = 64 << 20
MAX_CHUNK_BYTES = 256 << 20
MAX_TENSOR_ELEMENTS = 1 << 40
_HEX32 = set("0123456789abcdef")


def chunk_hash(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class ChunkRef:
    size: int
    hash: str


@dataclass(frozen=True)
class Manifest:
    """What an artifact promises. Immutable; ``signature`` is empty when unsigned."""

    kind: str
    model_id: str
    base_version: int | None
    target_version: int
    base_fingerprint: str | None
    target_fingerprint: str
    tensors: tuple[TensorSpec, ...]
    chunk_size: int
    chunks: tuple[ChunkRef, ...]
    created: float
    changed: tuple[int, ...] = ()
    stats: tuple[tuple[str, int], ...] = ()
    key_id: str = ""
    signature: bytes = b""
    format_version: int = FORMAT_VERSION
    segments: tuple[tuple[int, ...], ...] = ()
    """Per chunk, ``tensor, start, stop`` of each of its segments (:mod:`p2psync.codec.slices`), so
    that a tensor-parallel rank fetches only the chunks it needs. Empty in snapshots and in
    manifests written before the index existed (then a rank fetches every chunk)."""

    # --- derived ----------------------------------------------------------------------
    @cached_property
    def tensor_table_hash(self) -> str:
        return table_hash(self.tensors)

    @property
    def payload_bytes(self) -> int:
        return sum(c.size for c in self.chunks)

    @property
    def model_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def signed(self) -> bool:
        return bool(self.signature)

    @property
    def artifact_id(self) -> str:
        """Stable name of this artifact: kind, versions and the target fingerprint."""
        base = "none" if self.base_version is None else str(self.base_version)
        return f"{self.kind}-{base}-{self.target_version}-{self.target_fingerprint[:16]}"

    # --- serialisation ----------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model_id": self.model_id,
            "base_version": self.base_version,
            "target_version": self.target_version,
            "base_fingerprint": self.base_fingerprint,
            "target_fingerprint": self.target_fingerprint,
            "tensor_table_hash": self.tensor_table_hash,
            "tensors": [t.to_json() for t in self.tensors],
            "chunk_size": self.chunk_size,
            "chunks": [[c.size, c.hash] for c in self.chunks],
            "created": self.created,
            "changed": list(self.changed),
            "stats": dict(self.stats),
            "key_id": self.key_id,
            **({"segments": [list(e) for e in self.segments]} if self.segments else {}),
        }

    def signed_bytes(self) -> bytes:
        # Computed once per instance (the fields are immutable): a relay verifies, stores, serves
        # and pushes the same manifest several times per version.
        cached = self.__dict__.get("_signed_bytes")
        if cached is None:
            body = json.dumps(self.body(), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
            cached = MANIFEST_MAGIC + struct.pack("<HI", self.format_version, len(body)) + body
            self.__dict__["_signed_bytes"] = cached
        return cached

    def to_bytes(self) -> bytes:
        return self.signed_bytes() + struct.pack("<B", len(self.signature)) + self.signature

    def sign(self, private: Ed25519PrivateKey) -> "Manifest":
        from dataclasses import replace

        unsigned = replace(self, key_id=keys.key_id(private.public_key()), signature=b"")
        return replace(unsigned, signature=private.sign(unsigned.signed_bytes()))

    def verify(self, public: Ed25519PublicKey | None, *, allow_unsigned: bool = False) -> None:
        """Raise :class:`SignatureError` unless signed by ``public`` (or unsigned and allowed)."""
        if public is None:
            if allow_unsigned:
                return
            raise SignatureError("no public key given to verify the manifest (pass one, or opt out explicitly)")
        if not self.signature:
            if allow_unsigned:
                return
            raise SignatureError("manifest is unsigned; refusing it (opt out explicitly to accept unsigned artifacts)")
        if self.key_id != keys.key_id(public):
            raise SignatureError(f"manifest signed by another key ({self.key_id or '?'}, expected {keys.key_id(public)})")
        keys.verify(public, self.signature, self.signed_bytes())

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> "Manifest":
        """Parse and validate structure (not the signature: see :meth:`verify`)."""
        data = bytes(data)
        if len(data) < 10:
            raise TruncatedError("manifest: truncated header")
        if data[:4] != MANIFEST_MAGIC:
            raise CodecError("manifest: bad magic (not a p2psync manifest)")
        version, body_len = struct.unpack_from("<HI", data, 4)
        if version != FORMAT_VERSION:
            raise FormatVersionError(version, FORMAT_VERSION)
        if body_len > MAX_MANIFEST_BYTES:
            raise CodecError(f"manifest: body of {body_len} bytes exceeds the {MAX_MANIFEST_BYTES} limit")
        end = 10 + body_len
        if len(data) < end + 1:
            raise TruncatedError("manifest: truncated body")
        sig_len = data[end]
        if len(data) != end + 1 + sig_len:
            raise TruncatedError("manifest: truncated signature") if len(data) < end + 1 + sig_len else CodecError(
                "manifest: trailing bytes")
        try:
            body = json.loads(data[10:end].decode("ascii"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CodecError(f"manifest: body is not valid JSON ({exc})") from None
        m = _from_body(body, data[end + 1 :], version)
        if m.signed_bytes() != data[:end]:
            raise CodecError("manifest: body is not in canonical form")
        return m


def _field(body: dict, name: str, types: type | tuple, optional: bool = False) -> Any:
    if name not in body:
        raise CodecError(f"manifest: missing field {name!r}")
    v = body[name]
    if v is None and optional:
        return None
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise CodecError(f"manifest: field {name!r} has the wrong type")
    if not isinstance(v, types):
        raise CodecError(f"manifest: field {name!r} has the wrong type")
    return v


def _hex(v: str | None, name: str) -> None:
    if v is not None and (len(v) != 32 or not set(v) <= _HEX32):
        raise CodecError(f"manifest: field {name!r} is not a 128-bit hex digest")


def _from_body(body: Any, signature: bytes, version: int) -> Manifest:
    if not isinstance(body, dict):
        raise CodecError("manifest: body is not an object")
    kind = _field(body, "kind", str)
    if kind not in ("delta", "snapshot"):
        raise CodecError(f"manifest: unknown kind {kind!r}")
    tensors = []
    for t in _field(body, "tensors", list):
        if not (isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and t[1] in BY_CODE
                and isinstance(t[2], list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                   for s in t[2])):
            raise CodecError(f"manifest: bad tensor entry {str(t)[:80]}")
        spec = TensorSpec(t[0], t[1], tuple(t[2]))
        if spec.numel > MAX_TENSOR_ELEMENTS or len(spec.shape) > 16:
            raise CodecError(f"manifest: tensor {spec.name[:40]!r} is implausibly large")
        tensors.append(spec)
    if len({t.name for t in tensors}) != len(tensors):
        raise CodecError("manifest: duplicate tensor names")
    chunks = []
    for c in _field(body, "chunks", list):
        if not (isinstance(c, list) and len(c) == 2 and isinstance(c[0], int) and not isinstance(c[0], bool)
                and 0 < c[0] <= MAX_CHUNK_BYTES and isinstance(c[1], str)):
            raise CodecError(f"manifest: bad chunk entry {str(c)[:80]}")
        _hex(c[1], "chunks")
        chunks.append(ChunkRef(c[0], c[1]))
    changed = _field(body, "changed", list)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in changed):
        raise CodecError("manifest: bad changed counts")
    stats = _field(body, "stats", dict)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in stats.values()):
        raise CodecError("manifest: bad stats")
    m = Manifest(
        kind=kind,
        model_id=_field(body, "model_id", str),
        base_version=_field(body, "base_version", int, optional=True),
        target_version=_field(body, "target_version", int),
        base_fingerprint=_field(body, "base_fingerprint", str, optional=True),
        target_fingerprint=_field(body, "target_fingerprint", str),
        tensors=tuple(tensors),
        chunk_size=_field(body, "chunk_size", int),
        chunks=tuple(chunks),
        created=float(_field(body, "created", (int, float))),
        changed=tuple(changed),
        stats=tuple(sorted(stats.items())),
        key_id=_field(body, "key_id", str),
        signature=bytes(signature),
        format_version=version,
        segments=parse_index(body["segments"], tensors, len(chunks)) if "segments" in body else (),
    )
    _hex(m.base_fingerprint, "base_fingerprint")
    _hex(m.target_fingerprint, "target_fingerprint")
    if _field(body, "tensor_table_hash", str) != m.tensor_table_hash:
        raise CodecError("manifest: tensor_table_hash does not match its tensor table")
    if m.target_version < 0 or (m.base_version is not None and m.base_version < 0) or m.chunk_size <= 0:
        raise CodecError("manifest: versions must be >= 0 and chunk_size > 0")
    if kind == "delta" and (m.base_version is None or m.base_fingerprint is None):
        raise CodecError("manifest: a delta must name its base version and fingerprint")
    if m.changed and len(m.changed) != len(m.tensors):
        raise CodecError("manifest: changed counts do not match the tensor table")
    return m


def build_manifest(
    enc: EncodedArtifact,
    *,
    model_id: str,
    target_version: int,
    base_version: int | None = None,
    chunk_size: int,
    private_key: Ed25519PrivateKey | None = None,
    created: float | None = None,
    refs: Sequence[ChunkRef] | None = None,
) -> Manifest:
    """The manifest of ``enc`` (signed if ``private_key`` is given). ``refs``: the chunks' sizes
    and hashes when ``enc`` holds no chunks (see :func:`snapshot_manifest`)."""
    index = index_of(enc.chunks) if enc.kind == "delta" and refs is None else ()
    m = Manifest(
        kind=enc.kind,
        model_id=model_id,
        base_version=base_version if enc.kind == "delta" else None,
        target_version=target_version,
        base_fingerprint=enc.base_fingerprint if enc.kind == "delta" else None,
        target_fingerprint=enc.target_fingerprint,
        tensors=tuple(enc.specs),
        chunk_size=chunk_size,
        chunks=tuple(refs) if refs is not None else tuple(ChunkRef(len(c), chunk_hash(c)) for c in enc.chunks),
        created=time.time() if created is None else created,
        changed=tuple(enc.changed) if enc.kind == "delta" else (),
        stats=tuple(sorted({"header": enc.stats.header, "positions": enc.stats.positions,
                            "residuals": enc.stats.residuals, "raw": enc.stats.raw}.items())),
        segments=index,
    )
    return m.sign(private_key) if private_key is not None else m


def snapshot_manifest(state: ModelState, opts: CodecOptions, *, model_id: str, target_version: int,
                      private_key: Ed25519PrivateKey | None = None) -> Manifest:
    """The manifest of ``encode_snapshot(state, opts)``, made without holding its chunks: each is
    hashed as it is packed and dropped, so a snapshot of any size takes a few chunks of memory
    (a raw snapshot's encode is a copy: cheap next to an encoded copy of the whole model). Write
    the chunks afterwards with :func:`snapshot_chunks_to`, while ``state`` is unchanged."""
    from p2psync.codec.encode import encode_snapshot

    refs: list[ChunkRef] = []
    enc = encode_snapshot(state, opts, sink=lambda i, c: refs.append(ChunkRef(len(c), chunk_hash(c))))
    return build_manifest(enc, model_id=model_id, target_version=target_version, chunk_size=opts.chunk_size,
                          private_key=private_key, refs=refs)


def snapshot_chunks_to(state: ModelState, manifest: Manifest, opts: CodecOptions,
                       put: Callable[[int, bytes], None], *, verify: bool = True) -> None:
    """Encode the snapshot of ``state`` again and hand each chunk, in order, to ``put``.

    Checked against ``manifest`` as it goes (each chunk's size and hash unless ``verify`` is
    false because ``put`` checks it, the chunk count, the fingerprint): raises
    :class:`ChunkHashMismatch` or :class:`CodecError` at the first difference, after handing
    over only chunks that matched. Used to rebuild a trainer-signed snapshot from weights held,
    and for the second pass after :func:`snapshot_manifest`."""
    from p2psync.codec.encode import encode_snapshot

    n = 0

    def sink(i: int, chunk: bytes) -> None:
        nonlocal n
        if verify:
            verify_chunk(manifest, i, chunk)
        elif i >= len(manifest.chunks):
            raise CodecError(f"chunk index {i} out of range (artifact has {len(manifest.chunks)})")
        put(i, chunk)
        n = i + 1

    enc = encode_snapshot(state, opts, sink=sink)
    if n != len(manifest.chunks):
        raise CodecError(f"the weights make {n} snapshot chunks, the manifest lists {len(manifest.chunks)}")
    if enc.target_fingerprint != manifest.target_fingerprint:
        raise CodecError(f"the weights' fingerprint {enc.target_fingerprint} is not the manifest's "
                         f"{manifest.target_fingerprint}")


def verify_chunk(manifest: Manifest, index: int, data: bytes | memoryview) -> None:
    """Raise unless ``data`` is exactly chunk ``index`` of ``manifest``."""
    if not 0 <= index < len(manifest.chunks):
        raise CodecError(f"chunk index {index} out of range (artifact has {len(manifest.chunks)})")
    ref = manifest.chunks[index]
    if len(data) != ref.size:
        raise ChunkHashMismatch(index, ref.hash, f"<{len(data)} bytes, expected {ref.size}>")
    h = chunk_hash(data)
    if h != ref.hash:
        raise ChunkHashMismatch(index, ref.hash, h)


# --- artifact files ----------------------------------------------------------------------
def write_file(path: str | Path, manifest: Manifest, chunks: Iterable[bytes]) -> None:
    """Write atomically (temp file, then rename)."""
    with FileWriter(path, manifest) as w:
        for i, c in enumerate(chunks):
            w.put(i, c)


class FileWriter:
    """Writes an artifact file chunk by chunk, atomically: into a temporary file renamed into
    place when the ``with`` block ends without an error and every chunk was written in order;
    otherwise the temporary file is removed and nothing at ``path`` changes."""

    def __init__(self, path: str | Path, manifest: Manifest, *, fsync: bool = False):
        self.path, self.manifest, self.fsync = Path(path), manifest, fsync
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._next = 0
        self._f: Any = None

    def __enter__(self) -> FileWriter:
        mbytes = self.manifest.to_bytes()
        self._f = open(self._tmp, "wb")
        self._f.write(FILE_MAGIC + struct.pack("<HQ", FORMAT_VERSION, len(mbytes)))
        self._f.write(mbytes)
        return self

    def put(self, index: int, data: bytes | memoryview) -> None:
        if index != self._next:
            raise CodecError(f"chunk {index} written out of order (expected {self._next})")
        self._f.write(data)
        self._next += 1

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        done = False
        try:
            if exc_type is None and self._next != len(self.manifest.chunks):
                raise CodecError(f"{self._next} of {len(self.manifest.chunks)} chunks written")
            if exc_type is None and self.fsync:
                self._f.flush()
                os.fsync(self._f.fileno())
            self._f.close()
            if exc_type is None:
                os.replace(self._tmp, self.path)
                done = True
        finally:
            if not done:  # whatever failed (a full disk fails the close's flush too), no temporary stays
                with contextlib.suppress(OSError):
                    self._f.close()
                self._tmp.unlink(missing_ok=True)


class ArtifactFile:
    """An artifact file opened for reading: manifest parsed (and verified), chunks read on demand."""

    def __init__(self, path: str | Path, public: Ed25519PublicKey | None, *, allow_unsigned: bool = False):
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb")
        except OSError as exc:
            raise CodecError(f"cannot open artifact {path}: {exc.strerror}") from None
        head = self._f.read(14)
        if len(head) < 14:
            self._f.close()
            raise TruncatedError(f"{path}: truncated artifact header") if head[:4] == FILE_MAGIC[: len(head)] \
                else CodecError(f"{path}: not a p2psync artifact")
        if head[:4] != FILE_MAGIC:
            self._f.close()
            raise CodecError(f"{path}: not a p2psync artifact (bad magic)")
        version, mlen = struct.unpack_from("<HQ", head, 4)
        if version != FORMAT_VERSION:
            self._f.close()
            raise FormatVersionError(version, FORMAT_VERSION)
        if mlen > MAX_MANIFEST_BYTES + 1024:
            self._f.close()
            raise CodecError(f"{path}: manifest length {mlen} exceeds the limit")
        mbytes = self._f.read(mlen)
        if len(mbytes) != mlen:
            self._f.close()
            raise TruncatedError(f"{path}: truncated manifest")
        try:
            self.manifest = Manifest.from_bytes(mbytes)
            self.manifest.verify(public, allow_unsigned=allow_unsigned)
        except Exception:
            self._f.close()
            raise
        self._offsets = []
        off = 14 + mlen
        for c in self.manifest.chunks:
            self._offsets.append(off)
            off += c.size
        size = os.fstat(self._f.fileno()).st_size
        if size < off:
            self._f.close()
            raise TruncatedError(f"{path}: truncated: {size} bytes, manifest promises {off}")
        if size > off:
            self._f.close()
            raise CodecError(f"{path}: {size - off} bytes after the last chunk")

    def chunk(self, index: int) -> bytes:
        """Chunk ``index``, verified against the manifest."""
        self._f.seek(self._offsets[index])
        data = self._f.read(self.manifest.chunks[index].size)
        verify_chunk(self.manifest, index, data)
        return data

    def chunks(self) -> Iterator[tuple[int, bytes]]:
        for i in range(len(self.manifest.chunks)):
            yield i, self.chunk(i)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "ArtifactFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def applier_for(state: ModelState, manifest: Manifest) -> Applier:
    """An :class:`Applier` for ``manifest`` (checks tensor table and base first)."""
    return Applier.for_manifest(state, manifest)


def apply_file(state: ModelState, art: ArtifactFile, threads: int = 2) -> str:
    """Verify every chunk, decode, and apply all-or-nothing. Returns the new fingerprint."""
    ap = applier_for(state, art.manifest)
    ap.add_chunks(art.chunks(), threads)
    return ap.commit()
