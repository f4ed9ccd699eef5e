"""One error hierarchy for everything p2psync raises on purpose.

Every error carries a one-line message a user understands plus structured
fields, so that callers that recover deliberately (re-fetch, re-parent, skip a
peer) can act on the fields instead of parsing text.
"""

from __future__ import annotations


class P2PSyncError(Exception):
    """Base of every error p2psync raises on purpose."""


class ConfigError(P2PSyncError, ValueError):
    """A configuration value is invalid; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class CodecError(P2PSyncError):
    """Bytes that do not decode: malformed, truncated or out-of-range content."""


class TruncatedError(CodecError):
    """The input ended before the structure it announced was complete."""


class SegmentIndexError(CodecError):
    """A manifest's segment index (``field``) is malformed or does not match the chunks it signs."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"manifest: {field}: {message}")
        self.field = field


class FormatVersionError(CodecError):
    """The artifact was written by a format version this build cannot read."""

    def __init__(self, found: int, supported: int) -> None:
        super().__init__(f"unsupported format version {found} (this build reads version {supported})")
        self.found = found
        self.supported = supported


class IntegrityError(P2PSyncError):
    """Content does not match what the signed manifest promises."""


class ChunkHashMismatch(IntegrityError):
    """A chunk's xxh3-128 differs from the manifest; ``index`` says which chunk."""

    def __init__(self, index: int, expected: str, actual: str) -> None:
        super().__init__(f"chunk {index} is corrupt: hash {actual} != manifest {expected}")
        self.index = index
        self.expected = expected
        self.actual = actual


class FingerprintMismatch(IntegrityError):
    """The state a delta produces is not the state the manifest names."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"result fingerprint {actual} != manifest target {expected}; nothing was applied")
        self.expected = expected
        self.actual = actual


class SignatureError(IntegrityError):
    """The manifest is unsigned, signed by another key, or its signature is forged."""


class WrongBase(P2PSyncError):
    """A delta was offered to a state other than its base."""

    def __init__(self, expected: str, actual: str, base_version: int | None = None) -> None:
        where = f" (version {base_version})" if base_version is not None else ""
        super().__init__(
            f"wrong base: delta needs base fingerprint {expected}{where}, state has {actual}; nothing was applied"
        )
        self.expected = expected
        self.actual = actual
        self.base_version = base_version


class TensorTableMismatch(P2PSyncError):
    """The tensor table of an artifact and of a state differ (names, dtypes or shapes)."""

    def __init__(
        self,
        unknown: list[str] | None = None,
        missing: list[str] | None = None,
        reshaped: list[str] | None = None,
        retyped: list[str] | None = None,
    ) -> None:
        self.unknown = sorted(unknown or [])
        self.missing = sorted(missing or [])
        self.reshaped = sorted(reshaped or [])
        self.retyped = sorted(retyped or [])
        parts = []
        for label, names in (
            ("unknown", self.unknown),
            ("missing", self.missing),
            ("reshaped", self.reshaped),
            ("retyped", self.retyped),
        ):
            if names:
                shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                parts.append(f"{label}: {shown}")
        super().__init__("tensor table mismatch (" + "; ".join(parts or ["order differs"]) + ")")


class PeerUnreachable(P2PSyncError):
    """A peer did not answer or answered with an error."""

    def __init__(self, peer: str, reason: str, message: str | None = None) -> None:
        super().__init__(message or f"peer {peer} unreachable: {reason}")
        self.peer = peer
        self.reason = reason


class PeerRefused(PeerUnreachable):
    """A peer refused this node, or this node refused the peer, for a reason retrying does not fix:
    an operator must change ``setting`` (here or on the peer). Callers retry, backed off, in case
    it is fixed meanwhile."""

    def __init__(self, peer: str, cause: str, setting: str, hint: str) -> None:
        super().__init__(peer, cause, f"peer {peer}: {cause}; {hint} ({setting})")
        self.cause = cause
        self.setting = setting


class WrongClusterToken(PeerRefused):
    """The peer answered 401: this node's cluster token is not the one the peer holds."""

    def __init__(self, peer: str, what: str) -> None:
        super().__init__(peer, f"wrong cluster token (HTTP 401 on {what})", "cluster_token / cluster_token_file",
                         "give this node the cluster's token")


class ForeignCertificate(PeerRefused):
    """The peer's TLS certificate does not verify against this node's ``ca.crt``."""

    def __init__(self, peer: str, detail: str) -> None:
        super().__init__(peer, f"certificate not issued by this cluster's CA ({detail})", "tls.dir",
                         "issue the peer's certificate with this cluster's CA (`p2psync cert issue`), "
                         "or check that the URL names a node of this cluster")


class NodeRevoked(PeerRefused):
    """The peer answered 403 because this node's id is on the cluster's revocation list."""

    def __init__(self, peer: str, node: str) -> None:
        super().__init__(peer, f"this node is revoked ({node} is on the cluster's revocation list)",
                         "tls.revoked on the trainer",
                         "no node serves it any more; retrying rarely until an operator takes it off the list")


class WrongSize(PeerUnreachable):
    """A peer's answer was complete but of the wrong size (announced or delivered)."""

    def __init__(self, peer: str, what: str, got: int, expected: int, announced: bool = False) -> None:
        super().__init__(peer, f"{what}: {got} bytes{' announced' if announced else ''}, expected {expected}")
        self.got = got
        self.expected = expected


class LeaseExpired(P2PSyncError):
    """A lease was used after it expired or was taken by another holder."""

    def __init__(self, work_id: str) -> None:
        super().__init__(f"lease on work {work_id} expired")
        self.work_id = work_id


class NotCoordinator(IntegrityError):
    """A coordinator entry was written, or claims to be written, by a node that is not the coordinator
    (or its trainer-key signature does not verify)."""

    def __init__(self, writer: str, coordinator: str | None, name: str, reason: str = "") -> None:
        why = reason or f"but the coordinator is {coordinator!r}"
        super().__init__(f"coordinator entry {name!r} written by {writer!r}, {why}")
        self.writer = writer
        self.coordinator = coordinator
        self.name = name


class UnknownWork(P2PSyncError):
    """A work id the coordinator's lease table never saw (or that is not queued when a grant needs it)."""

    def __init__(self, work_id: str) -> None:
        super().__init__(f"unknown work {work_id}")
        self.work_id = work_id


class ProgressGap(P2PSyncError):
    """A progress report starts past the tokens already recorded; ``have`` is where it must start."""

    def __init__(self, work_id: str, response: int, offset: int, have: int) -> None:
        super().__init__(f"work {work_id} response {response}: report starts at token {offset}, only {have} recorded")
        self.work_id = work_id
        self.response = response
        self.offset = offset
        self.have = have


class CheckpointLayoutError(P2PSyncError):
    """A checkpoint tensor cannot be mapped onto the model's memory; ``name`` is the checkpoint tensor."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


class AdapterMismatch(P2PSyncError):
    """A LoRA adapter does not fit the engine it is offered to: another base model, a rank above
    the engine's ``max_lora_rank``, or target modules the engine does not serve LoRA on. Nothing
    was loaded."""

    def __init__(self, adapter: str, reason: str) -> None:
        super().__init__(f"adapter {adapter}: {reason}; nothing was loaded")
        self.adapter = adapter
        self.reason = reason


class MissingVersion(P2PSyncError):
    """A request named an adapter version that is not loaded (never received, or evicted by the
    staleness window)."""

    def __init__(self, adapter: str, version: int, loaded: list[int]) -> None:
        super().__init__(f"adapter {adapter}: version {version} is not loaded (loaded: {loaded or 'none'})")
        self.adapter = adapter
        self.version = version
        self.loaded = loaded
