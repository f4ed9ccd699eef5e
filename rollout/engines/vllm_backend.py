"""The ``p2psync`` vLLM weight-transfer backend: pull verified artifacts from a p2psync node, apply in place.

Registered under the name ``p2psync`` by this package's ``vllm.general_plugins``
entry point (:mod:`rollout.engines.vllm_plugin`); vLLM builds it in every worker
process with the loaded model. Turned on with ``weight_transfer_config=
{"backend": "p2psync"}`` (offline ``LLM``) or ``--weight-transfer-config
'{"backend": "p2psync"}'`` (``vllm serve``), then:

- ``init_weight_transfer_engine({"init_info": {"url": ..., "token": ...,
  "public_key": ..., "version": ..., "tls_dir": ...}})``: the p2psync parent to pull
  from (any node's address, its cluster token, and the certificate folder to present
  to it over mutual TLS: the node's own), the trainer's Ed25519 public key (PEM
  text or a file path), and optionally the version of the weights vLLM loaded
  (e.g. from the trainer's checkpoint), checked at once: every live word is
  hashed and must give that version's signed fingerprint. Without it the first
  update starts from a snapshot.
- ``update_weights({"update_info": {"version": v}})``: reach version ``v``. The
  backend asks the parent for its catalogue, plans the cheapest chain of
  artifacts (:func:`p2psync.store.plan_catchup`), and for each: fetches the
  manifest and checks its signature against the trainer's key, fetches every
  chunk and checks it against the signed hash (a chunk whose connection is cut
  mid-body is ``PeerUnreachable``; a complete answer shorter than the signed
  chunk is ``TruncatedError``), then applies it to the live
  parameters all-or-nothing (:class:`~rollout.engines.vllm_weights.LiveWeights`).
  Each artifact is one transaction: on any error the model keeps the last
  version it fully reached (and keeps serving) and the error is raised with its
  p2psync class name at the front of its message (``WrongBase: ...``), which is
  what reaches an HTTP or ``collective_rpc`` caller.

``start_weight_update`` / ``finish_weight_update`` have nothing to do (the apply
is in place); callers should reset vLLM's prefix cache after an update, since
cached KV blocks were computed with the old weights.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from p2psync.errors import P2PSyncError, TruncatedError, WrongBase, WrongSize
from rollout.engines.vllm_tp import RankGroup, RankRefused, Solo, together, vllm_group
from rollout.engines.vllm_weights import LiveWeights

logger = logging.getLogger(__name__)

BACKEND = "p2psync"


@dataclass
class P2PSyncInitInfo(WeightTransferInitInfo):
    url: str
    """HTTP address of the p2psync node to pull from (e.g. the rollout node's own server)."""
    token: str
    """The cluster token (``Authorization: Bearer``)."""
    public_key: str
    """The trainer's Ed25519 public key: PEM text, or the path of a PEM file."""
    version: int | None = None
    """Version of the weights the model holds now (None: unknown, the first update loads a snapshot)."""
    node_id: str = "vllm"
    threads: int = 2
    """Decode and hash threads."""
    timeout: float = 30.0
    """Seconds a parent may stall before the fetch fails."""
    tls_dir: str = ""
    """Certificate folder presented to an ``https://`` parent (the node's own ``tls.dir``; mutual TLS)."""


@dataclass
class P2PSyncUpdateInfo(WeightTransferUpdateInfo):
    version: int
    """The version to reach."""


def load_public_key(text: str) -> Any:
    from cryptography.hazmat.primitives import serialization

    from p2psync import keys

    if "BEGIN PUBLIC KEY" not in text:
        return keys.load_public(text)
    return serialization.load_pem_public_key(text.encode())


def _tls(tls_dir: str) -> Any:
    from p2psync.transport.tls import Tls

    return Tls.for_client(tls_dir) if tls_dir else None


async def fetch_artifact(url: str, token: str, node_id: str, aid: str, public_key: Any, timeout: float,
                         parallel: int = 4, tls_dir: str = "") -> tuple[Any, list[memoryview]]:
    """The manifest (signature checked) and every chunk (hash checked) of artifact ``aid`` at ``url``."""
    from p2psync.artifact import verify_chunk
    from p2psync.transport.client import ChunkBuffer, PeerClient

    client = await PeerClient.create(token, node_id, stall_timeout=timeout, sse_keepalive=1.0,
                                     parallel_streams=parallel, tls=_tls(tls_dir))
    async with client:
        manifest = await client.call_manifest(url, aid)
        manifest.verify(public_key)
        if manifest.artifact_id != aid:
            raise P2PSyncError(f"{url} served the manifest of {manifest.artifact_id} for {aid}")
        sem = asyncio.Semaphore(parallel)

        async def one(i: int) -> memoryview:
            async with sem:
                buf = ChunkBuffer(manifest.chunks[i].size)
                try:
                    await client.call_chunk(url, aid, i, buf)
                except WrongSize as exc:
                    raise short_answer(exc, f"chunk {i} of {aid} from {url}") or exc
                data = buf.take()
                verify_chunk(manifest, i, data)
                return data

        chunks = await asyncio.gather(*(one(i) for i in range(len(manifest.chunks))))
    return manifest, list(chunks)


def short_answer(exc: WrongSize, what: str) -> TruncatedError | None:
    """A :class:`TruncatedError` if the peer answered completely, but with fewer bytes than the signed size.

    A connection cut mid-body stays :class:`PeerUnreachable` (the answer never completed: trying
    again may work); a complete, well-formed answer that is shorter than the chunk the manifest
    signs is truncated content, and asking that peer again gives the same."""
    if exc.got >= exc.expected:
        return None
    return TruncatedError(f"{what}: the peer's answer has {exc.got} of the {exc.expected} bytes the signed "
                          "manifest gives it")


async def fetch_version_manifest(url: str, token: str, node_id: str, version: int, public_key: Any,
                                 timeout: float, tls_dir: str = "") -> Any:
    """The signed manifest of an artifact reaching ``version`` (a delta, else a snapshot), signature checked."""
    from p2psync.transport.client import NotHeld, PeerClient

    client = await PeerClient.create(token, node_id, stall_timeout=timeout, sse_keepalive=1.0, parallel_streams=1,
                                     tls=_tls(tls_dir))
    async with client:
        try:
            m = await client.call_version_manifest(url, version, "delta")
        except NotHeld:
            m = await client.call_version_manifest(url, version, "snapshot")
    m.verify(public_key)
    return m


async def fetch_plan(url: str, token: str, node_id: str, current: int | None, target: int, timeout: float,
                     tls_dir: str = "") -> list[Any]:
    """The artifacts to apply, in order, to go from ``current`` to ``target`` with what ``url`` holds."""
    from p2psync.store import plan_catchup
    from p2psync.transport.client import PeerClient

    client = await PeerClient.create(token, node_id, stall_timeout=timeout, sse_keepalive=1.0, parallel_streams=1,
                                     tls=_tls(tls_dir))
    async with client:
        cat = await client.call_head(url)
    return plan_catchup(current, target, [a for a in cat.artifacts if a.complete])


def _run(coro: Any) -> Any:
    """Run ``coro`` on a loop of its own (the caller's thread may already run one)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2psync-fetch") as pool:
        return pool.submit(asyncio.run, coro).result()


def tagged(exc: BaseException) -> str:
    """The message a p2psync error carries across vLLM's process boundary: ``ClassName: message``."""
    return f"{type(exc).__name__}: {exc}"


class P2PSyncWeightTransfer(WeightTransferEngine[P2PSyncInitInfo, P2PSyncUpdateInfo]):
    """vLLM weight-transfer backend ``p2psync`` (see module doc)."""

    init_info_cls = P2PSyncInitInfo
    update_info_cls = P2PSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.info: P2PSyncInitInfo | None = None
        self.public_key: Any = None
        self.version: int | None = None
        self.live: LiveWeights | None = None
        self.timing: dict[str, float] = {}
        """The last artifact's fetch, decode and commit seconds (see :meth:`status`)."""
        tp = int(getattr(self.parallel_config, "tensor_parallel_size", 1) or 1)
        pp = int(getattr(self.parallel_config, "pipeline_parallel_size", 1) or 1)
        if pp != 1:
            # A pipeline stage holds some layers only; the fingerprint covers the whole model.
            raise P2PSyncError(f"the p2psync backend needs pipeline_parallel_size=1 (got {pp})")
        self.group: RankGroup = vllm_group() if tp > 1 else Solo()

    # --- vLLM's contract ---------------------------------------------------------------------
    def init_transfer_engine(self, init_info: P2PSyncInitInfo) -> None:
        """Remember the parent; with a ``version``, check now that the loaded weights are that version.

        The check binds the trainer's tensor table to the model and hashes every live word (the
        one full pass; later updates change the fingerprint from the changed words alone)."""
        public_key = load_public_key(init_info.public_key)
        if init_info.version is not None:
            try:
                manifest = self._together(lambda: _run(fetch_version_manifest(
                    init_info.url, init_info.token, init_info.node_id, init_info.version, public_key,
                    init_info.timeout, init_info.tls_dir)))
                live = self.bind(manifest, init_info.threads)
                if live.audit() != manifest.target_fingerprint:
                    raise WrongBase(manifest.target_fingerprint, live.fingerprint, init_info.version)
            except P2PSyncError as exc:
                self._refuse(exc, f"p2psync init at version {init_info.version}")
                return
            self.version = init_info.version
        self.public_key = public_key
        self.info = init_info

    def start_weight_update(self) -> None:
        """Nothing to prepare: artifacts are applied in place, each all-or-nothing."""

    def finish_weight_update(self) -> None:
        """Nothing to finish (see :meth:`start_weight_update`)."""

    def shutdown(self) -> None:
        self.info = None

    def receive_weights(self, update_info: P2PSyncUpdateInfo) -> None:
        try:
            self.reach(int(update_info.version))
        except P2PSyncError as exc:
            self._refuse(exc, f"p2psync update to version {update_info.version}")

    def _refuse(self, exc: P2PSyncError, what: str) -> None:
        """Raise ``exc`` (tagged) to vLLM's caller: from the last tensor-parallel rank only.

        The ranks fail together (every step is voted). vLLM 0.32's ``collective_rpc`` reads the
        workers' answers in rank order and raises at the first failure without reading the rest,
        which would leave those answers queued as the replies to its next call; a failure from
        the last rank alone is read after every other answer. The ranks agree on the message: the
        first rank's own error, not another rank's ``RankRefused``."""
        texts = self.group.texts(tagged(exc))
        text = next((t for t in texts if not t.startswith(RankRefused.__name__)), texts[0])
        logger.error("%s refused: %s", what, text)
        if self.group.rank == self.group.size - 1:
            raise _Tagged(exc, text) from exc

    # --- p2psync ---------------------------------------------------------------------------------
    def reach(self, target: int) -> None:
        """Apply the artifacts from the current version to ``target`` (see module doc)."""
        info = self.info
        if info is None:
            raise P2PSyncError("init_weight_transfer_engine was not called (no p2psync parent)")
        # Tensor-parallel ranks apply rank 0's plan together; each fetches and checks it itself.
        plan = self._together(lambda: [a.id for a in _run(fetch_plan(info.url, info.token, info.node_id,
                                                                     self.version, target, info.timeout,
                                                                     info.tls_dir))],
                              share=True)
        for aid in plan:
            t = time.perf_counter()
            manifest, chunks = self._together(lambda: _run(fetch_artifact(
                info.url, info.token, info.node_id, aid, self.public_key, info.timeout, tls_dir=info.tls_dir)))
            fetched = time.perf_counter() - t
            self.apply(manifest, chunks)
            self.timing = {"fetch_s": round(fetched, 4), **(self.live.timing if self.live else {}),
                           "bytes": sum(len(c) for c in chunks)}

    def _together(self, fn: Any, share: bool = False) -> Any:
        """``fn()`` on every rank, then a vote: if it failed anywhere it fails everywhere. With
        ``share``, every rank gets rank 0's result."""
        got = together(self.group, fn, "another tensor-parallel rank could not fetch the update")
        return self.group.first(got) if share else got

    def bind(self, manifest: Any, threads: int | None = None) -> LiveWeights:
        specs = list(manifest.tensors)
        if self.live is None or self.live.specs != specs:
            self.live = LiveWeights(self.model, specs, threads or (self.info.threads if self.info else 2),
                                    group=self.group)
        return self.live

    def apply(self, manifest: Any, chunks: list[Any]) -> str:
        """Apply one verified artifact to the live weights (all-or-nothing); returns the fingerprint."""
        live = self.bind(manifest)
        if manifest.kind == "snapshot":
            before = live.fingerprint
            try:
                fp = live.load_snapshot(manifest, chunks)
            except BaseException:
                if live.audit() != before:  # it failed after it began writing: no version holds now
                    self.version = None
                raise
        else:
            fp = live.apply_delta(manifest, chunks)
        self.version = manifest.target_version
        logger.info("p2psync: weights at version %d (%s, fingerprint %s)", self.version, manifest.kind, fp)
        return fp

    def status(self) -> dict[str, Any]:
        live = self.live
        return {"version": self.version, "fingerprint": live.fingerprint if live else None,
                "timing": dict(self.timing)}

    def audit(self) -> str | None:
        return self.live.audit() if self.live else None


class _Tagged(P2PSyncError):
    """A p2psync error re-raised with its class name in the message (it crosses process boundaries as text)."""

    def __init__(self, exc: P2PSyncError, text: str | None = None) -> None:
        super().__init__(text or tagged(exc))
        self.original = exc


# --- collective_rpc helpers (module-level: vLLM's workers import them by reference) ----------
def _backend(worker: Any) -> P2PSyncWeightTransfer:
    eng = getattr(worker, "weight_transfer_engine", None)
    if eng is None:
        eng = getattr(getattr(worker, "worker", None), "weight_transfer_engine", None)
    if not isinstance(eng, P2PSyncWeightTransfer):
        raise P2PSyncError(f"vLLM's weight-transfer backend is {type(eng).__name__}, not p2psync "
                           "(build the LLM with weight_transfer_config={'backend': 'p2psync'})")
    return eng


def rpc_status(worker: Any) -> dict[str, Any]:
    """``{"version", "fingerprint"}`` of the backend in this worker."""
    return _backend(worker).status()


def rpc_audit(worker: Any) -> str | None:
    """The fingerprint recomputed from every live parameter word (None before the first update)."""
    return _backend(worker).audit()


def rpc_read(worker: Any, names: list[str]) -> dict[str, bytes]:
    """Raw bytes of the live words of checkpoint tensors ``names`` (tests and audits)."""
    live = _backend(worker).live
    if live is None:
        raise P2PSyncError("no weights bound yet (no update applied)")
    return {n: live.read(n).tobytes() for n in names}
