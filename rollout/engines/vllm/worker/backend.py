"""The ``p2psync`` vLLM weight-transfer backend: pull verified artifacts from a p2psync node, apply in place.

Registered under the name ``p2psync`` by this package's ``vllm.general_plugins``
entry point (:mod:`rollout.engines.vllm.plugin`); vLLM builds it in every worker
process with the loaded model. Turned on with ``weight_transfer_config=
{"backend": "p2psync"}`` (offline ``LLM``) or ``--weight-transfer-config
'{"backend": "p2psync"}'`` (``vllm serve``), then:

- ``init_weight_transfer_engine({"init_info": {"url": ..., "token": ...,
  "public_key": ..., "version": ..., "tls_dir": ...}})``: the p2psync parent to pull
  from (any node's address, its cluster token, and the certificate folder to present
  to it over mutual TLS: the node's own), the trainer's Ed25519 public key (PEM
  text or a file path), and optionally the version of the weights vLLM loaded
  (e.g. from the trainer's checkpoint). Everything is checked before the init is
  accepted: the fields (:mod:`rollout.engines.vllm.worker.infos`), that the parent
  answers with this token, and that the key verifies the parent's signed
  manifests (with ``version``: that version's manifest, and every live word is
  hashed and must give its signed fingerprint; without: the manifest of the
  newest complete artifact the parent lists, so a parent that lists none yet is
  refused). Where vLLM rounds tensors at load (a ``float32`` checkpoint served in
  ``bfloat16``), binding reads their checkpoint words from the model's local folder
  and keeps them (:mod:`rollout.engines.vllm.apply.kept`). A refused init changes nothing: the previous accepted init (parent,
  key, version) stays in effect, or none if there was none. An init without
  ``version`` keeps the version the backend holds (re-pointing at another
  parent); with none held, the first update starts from a snapshot.
- ``update_weights({"update_info": {"version": v}})``: reach version ``v``. The
  backend asks the parent for its catalogue, plans the cheapest chain of
  artifacts (:func:`p2psync.store.plan_catchup`), and for each: fetches the
  manifest and checks its signature against the trainer's key, fetches the
  chunks this rank needs (every chunk, but with tensor parallelism only those
  holding its slice of a delta, from the manifest's signed segment index:
  :mod:`rollout.engines.vllm.apply.slices`) and checks each against the signed hash (a chunk whose connection is cut
  mid-body is ``PeerUnreachable``; a complete answer shorter than the signed
  chunk is ``TruncatedError``), then applies it to the live
  parameters all-or-nothing (:class:`~rollout.engines.vllm.apply.weights.LiveWeights`).
  A delta's chunks are decoded as they arrive, while later ones are still
  being fetched (:mod:`rollout.engines.vllm.apply.stream`; with tensor parallelism
  the ranges ranks rebuild together after the fetch), and committed once all
  are decoded and the target fingerprint checked.
  Each artifact is one transaction: on any error the model keeps the last
  version it fully reached (and keeps serving).
- ``update_weights({"update_info": {"version": v, "stage": true}})``: stage
  ``v`` and return at once: the first artifact of the way to it fetched (at
  tensor parallel 1 also decoded) in a thread beside generation; the next update
  that needs it commits it (:mod:`rollout.engines.vllm.worker.stage`).

Every refusal is a :class:`~p2psync.errors.P2PSyncError` raised with its class
name at the front of its message (``TransferInfoError: update_info.version:
...``, ``WrongBase: ...``): that text is what reaches an HTTP or
``collective_rpc`` caller, inside vLLM's own wrapper (``Call to collective_rpc
method failed: Worker failed with error '<class>: <message>', ...``).

Sessions. vLLM's worker ends the update session when ``update_weights`` raises:
after a refusal the next call is ``start_weight_update`` (a ``finish`` answers
vLLM's "without a matching start_weight_update"). ``start_weight_update`` /
``finish_weight_update`` have nothing to do here (the apply is in place);
callers should reset vLLM's prefix cache after an update, since cached KV blocks
were computed with the old weights.

Status. Calling the backend object returns :meth:`P2PSyncWeightTransfer.status`
(version, fingerprint, rank, and the rank's bytes fetched and seconds): vLLM's development route ``POST /collective_rpc
{"method": "weight_transfer_engine"}`` does exactly that on every worker.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from p2psync.errors import P2PSyncError, PeerUnreachable, SignatureError, TruncatedError, WrongBase, WrongSize
from rollout.engines.vllm.worker import checkpoint, infos
from rollout.engines.vllm.worker import warm
from rollout.engines.vllm.worker.cpus import own_cpus, update_cpus
from p2psync.transport.leaf import Fetcher, Parent, fetch_manifest, fetch_version_manifest
from rollout.engines.vllm.worker.fetch import decoding, fetch_decoding, key_checked, plan_to
from rollout.engines.vllm.worker.infos import NotInitialized, TransferInfoError
from rollout.engines.vllm.worker.stage import Staged, Stager, replay, stage
from rollout.engines.vllm.apply.stream import Streamed, streams
from rollout.engines.vllm.apply.ranks import RankGroup, RankRefused, Solo, together, vllm_group
from rollout.engines.vllm.apply.weights import LiveWeights

logger = logging.getLogger(__name__)

BACKEND = "p2psync"


@dataclass
class P2PSyncInitInfo(WeightTransferInitInfo):
    """The checked ``init_info`` (fields: :class:`rollout.engines.vllm.worker.infos.InitFields`), or
    the refusal of one."""

    fields: infos.InitFields | None = None
    refusal: P2PSyncError | None = field(default=None, repr=False)
    """Set by :meth:`P2PSyncWeightTransfer.parse_init_info` instead of raising (not a client field)."""


@dataclass
class P2PSyncUpdateInfo(WeightTransferUpdateInfo):
    version: int
    """The version to reach."""
    stage: bool = False
    """Only stage it: fetch (and decode) in the background, return at once (:mod:`rollout.engines.vllm.worker.stage`)."""


def _init_error(exc: P2PSyncError, url: str, version: int | None) -> P2PSyncError:
    """An init's fetch error, named by the ``init_info`` field that caused it where one did."""
    from p2psync.transport.client import NotHeld

    if isinstance(exc, NotHeld) and version is not None:
        return TransferInfoError("init_info.version", f"{url} holds no signed manifest of version {version}: {exc}")
    if isinstance(exc, PeerUnreachable) and not isinstance(exc, WrongSize):
        if "HTTP 401" in exc.reason:
            return TransferInfoError("init_info.token", f"{url} refused the cluster token: {exc}")
        if "HTTP 403" in exc.reason:  # mutual TLS: a revoked id, a client-only one, or not init_info.node_id's
            return TransferInfoError("init_info.tls_dir", f"{url} refused the certificate in it for node_id: {exc}")
        return TransferInfoError("init_info.url", f"{exc}")
    if isinstance(exc, SignatureError) and "init_info.public_key" not in str(exc):
        return SignatureError(f"init_info.public_key does not verify {url}'s manifest: {exc}")
    return exc


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
        self.info: infos.InitFields | None = None
        self.version: int | None = None
        from rollout.engines.vllm.worker.adapter_source import SOURCE

        SOURCE.backend = self  # `vllm serve`'s p2psync: adapter paths pull through this init
        self.live: LiveWeights | None = None
        self.timing: dict[str, Any] = {}
        """The last artifact's bytes fetched, and fetch, decode and commit seconds (see :meth:`status`)."""
        self.fetcher = Fetcher()
        """The client an update fetches through, kept between updates (its connections reused)."""
        self.stager = Stager()
        """The update staged ahead of its commit, if any (:mod:`rollout.engines.vllm.worker.stage`)."""
        self.overlap = True
        """Decode a delta's chunks as they arrive (:mod:`rollout.engines.vllm.apply.stream`). Off: fetch every
        chunk, then decode."""
        tp = int(getattr(self.parallel_config, "tensor_parallel_size", 1) or 1)
        pp = int(getattr(self.parallel_config, "pipeline_parallel_size", 1) or 1)
        if pp != 1:
            # A pipeline stage holds some layers only; the fingerprint covers the whole model.
            raise P2PSyncError(f"the p2psync backend needs pipeline_parallel_size=1 (got {pp})")
        self.group: RankGroup = vllm_group() if tp > 1 else Solo()
        self.cpus = update_cpus(vllm_config)
        """CPUs the update's threads run on."""
        # The codec's kernels and the apply path load now, beside the engine's start, not in the
        # first update (rollout.engines.vllm.worker.warm), on the update's cores other than this thread's
        # where there are any.
        warm.start(model, (self.cpus - own_cpus()) or None)
        logger.info("p2psync: updates run on CPUs %s", sorted(self.cpus))

    # --- vLLM's contract ---------------------------------------------------------------------
    def parse_init_info(self, init_dict: Any) -> P2PSyncInitInfo:
        """The client's ``init_info``, checked (:func:`rollout.engines.vllm.worker.infos.init_info`).

        Never raises: a refusal travels in ``refusal`` to :meth:`init_transfer_engine`, which raises
        it from the last tensor-parallel rank only (see :meth:`_refuse`)."""
        try:
            return P2PSyncInitInfo(fields=infos.init_info(init_dict))
        except P2PSyncError as exc:
            return P2PSyncInitInfo(refusal=exc)

    def parse_update_info(self, update_dict: Any) -> P2PSyncUpdateInfo:
        """The client's ``update_info``, checked; raises :class:`TransferInfoError` naming the field."""
        got = infos.update_info(update_dict)
        return P2PSyncUpdateInfo(got.version, got.stage)

    def update_weights(self, update_info: Any) -> None:
        """vLLM's entry for one ``update_info``: checked, then :meth:`receive_weights` (refusals tagged)."""
        try:
            info = self.parse_update_info(update_info)
        except P2PSyncError as exc:
            self._refuse(exc, "p2psync update")
            return
        self.receive_weights(info)
        import torch

        torch.accelerator.synchronize()

    def init_transfer_engine(self, init_info: P2PSyncInitInfo) -> None:
        """Check the parent, the key and (with ``version``) the loaded weights, then adopt them (see module doc).

        The check with ``version`` binds the trainer's tensor table to the model and hashes every
        live word (the one full pass; later updates change the fingerprint from the changed words
        alone). Nothing is adopted unless every check passed."""
        if init_info.refusal is not None or init_info.fields is None:
            self._refuse(init_info.refusal or P2PSyncError("empty init_info"), "p2psync init")
            return
        self.stager.take()  # staged from the previous parent: dropped
        info = init_info.fields
        parent = info.parent
        version, live = self.version, self.live
        try:
            if info.version is not None:
                at = info.version
                manifest = self._together(lambda: self._at_init(lambda c: fetch_version_manifest(parent, at, c), info))
                live = self.bound(manifest, info.threads)
                if live.audit() != manifest.target_fingerprint:
                    raise WrongBase(manifest.target_fingerprint, live.fingerprint, info.version)
                version = info.version
            else:
                self._together(lambda: self._at_init(lambda c: key_checked(parent, c), info))
        except P2PSyncError as exc:
            self._refuse(exc, f"p2psync init{'' if info.version is None else f' at version {info.version}'}")
            return
        self.info, self.version, self.live = info, version, live
        self.fetcher.connect(parent)

    def _at_init(self, call: Any, info: infos.InitFields) -> Any:
        """``call(client)`` through the fetcher (its connections then serve the first update), with
        a refusal named by the field of ``init_info`` it comes from."""
        try:
            return self.fetcher.run(info.parent, call, retry=True)
        except P2PSyncError as exc:
            raise _init_error(exc, info.parent.url, info.version) from None

    def start_weight_update(self) -> None:
        """Nothing to prepare: artifacts are applied in place, each all-or-nothing."""

    def finish_weight_update(self) -> None:
        """Nothing to finish (see :meth:`start_weight_update`)."""

    def shutdown(self) -> None:
        self.info = None
        self.stager.take()
        self.fetcher.close()

    def receive_weights(self, update_info: P2PSyncUpdateInfo) -> None:
        from p2psync.codec import precompile

        what = "stage of version" if update_info.stage else "update to version"
        try:
            if update_info.stage:
                self.stage(int(update_info.version))
                return
            warming = warm.pending()
            with precompile.first_use() as loaded:
                self.reach(int(update_info.version))
            self.timing.update(kernels_loaded=len(loaded), warming=warming)
        except P2PSyncError as exc:
            self._refuse(exc, f"p2psync {what} {update_info.version}")

    def __call__(self) -> dict[str, Any]:
        """:meth:`status` (what ``POST /collective_rpc {"method": "weight_transfer_engine"}`` returns)."""
        return self.status()

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
    def _checked(self, target: int) -> infos.InitFields:
        info = self.info
        if info is None:
            raise NotInitialized()
        if self.version is not None and target < self.version:
            raise TransferInfoError("update_info.version", f"{target} is below the version held ({self.version}): "
                                    "updates only move forward")
        return info

    def _fetching(self, parent: Parent) -> Any:
        def fetching(call: Any, retry: bool = False) -> Any:  # through the client kept between updates
            return self.fetcher.run(parent, call, retry=retry)
        return fetching

    def stage(self, target: int) -> None:
        """Start staging ``target`` in the background (:mod:`rollout.engines.vllm.worker.stage`); returns at once."""
        info = self._checked(target)
        if target == self.version:
            return
        base, live, overlap, parent = self.version, self.live, self.overlap, info.parent
        self.stager.start(target, lambda: stage(self._fetching(parent), parent, live, base, target, overlap))

    def _staged(self, target: int) -> tuple[Staged | None, list[str] | None]:
        """What was staged (after waiting for a stage in progress), and its plan if that alone reaches
        ``target`` from the version held on every rank (the commit then asks the parent nothing)."""
        staged = self.stager.take()
        if staged is not None and staged.error is not None:
            logger.warning("p2psync: staging version %d failed (%s); the update fetches it", staged.target,
                           tagged(staged.error))
        alone = staged.plan if staged is not None and staged.target == target and len(staged.plan) == 1 \
            and staged.usable(staged.plan[0], self.version) else None
        lead = self.group.first(alone)
        return staged, lead if self.group.all_true(alone is not None and alone == lead) else None

    def reach(self, target: int) -> None:
        """Apply the artifacts from the current version to ``target`` (see module doc)."""
        parent = self._checked(target).parent
        fetching = self._fetching(parent)
        staged, plan = self._staged(target)
        # Tensor-parallel ranks apply rank 0's plan together; each fetches and checks it itself.
        if plan is None:
            # the chunk streams' connections open while the plan and the manifest are fetched
            self.fetcher.connect(parent)
            plan = self._together(lambda: [a.id for a in fetching(lambda c: plan_to(parent, self.version, target, c),
                                                                  retry=True)], share=True)
        for aid in plan:
            if self.group.all_true(staged is not None and staged.usable(aid, self.version)):
                assert staged is not None
                self._commit_staged(staged)
                staged = None
                continue
            t = time.perf_counter()
            manifest = self._together(lambda: fetching(lambda c: fetch_manifest(parent, aid, c), retry=True))
            t_bind = time.perf_counter()
            need = self.needed(manifest)  # binds the table first (its collectives are not fetch time)
            t_need = time.perf_counter()
            stream = self._together(lambda: self._stream(manifest))  # voted: a WrongBase refuses on every rank
            if stream is not None:
                stream.agree()

            # with a stream, each chunk decoded as it arrives (rollout.engines.vllm.apply.stream)
            chunks = self._together(lambda: fetch_decoding(fetching, parent, aid, manifest, need, stream))
            fetched = (t_bind - t) + (time.perf_counter() - t_need)
            self.apply(manifest, chunks, stream)
            self.timing = {"fetch_s": round(fetched, 4), **(self.live.timing if self.live else {}),
                           **_transfer(manifest, chunks)}

    def _commit_staged(self, staged: Staged) -> None:
        """Apply a staged artifact: decode its chunks here if the stage did not, check, commit."""
        manifest, chunks, stream = staged.manifest, staged.chunks, staged.stream
        assert chunks is not None
        t = time.perf_counter()
        if stream is None:
            stream = self._together(lambda: self._stream(manifest))  # voted: a WrongBase refuses on every rank
            if stream is not None:
                stream.agree()
                assert self.live is not None
                threads, cpus = self.live.threads, self.live.cpus
                self._together(lambda: self.fetcher.call(lambda: decoding(stream, replay(chunks), threads, cpus)))
        decoded = time.perf_counter() - t
        self.apply(manifest, chunks, stream)
        timing = dict(self.live.timing) if self.live else {}
        if staged.stream is None:
            timing["decode_s"] = round(timing.get("decode_s", 0.0) + decoded, 4)
        self.timing = {"fetch_s": 0.0, **timing, "staged": True, "staged_s": round(staged.seconds, 4),
                       **_transfer(manifest, chunks)}

    def _stream(self, manifest: Any) -> Streamed | None:
        """A decoder of ``manifest``'s chunks as they arrive, where it applies (a delta with a segment
        index, :attr:`overlap` on; :mod:`rollout.engines.vllm.apply.stream`); checks the base first."""
        if not self.overlap or self.live is None or not streams(self.live, manifest):
            return None
        return Streamed(self.live, manifest)

    def needed(self, manifest: Any) -> list[int] | None:
        """The chunks of ``manifest`` this rank fetches: for a delta with a segment index, those
        holding segments it holds elements of (:mod:`rollout.engines.vllm.apply.slices`); else all (None)."""
        if manifest.kind != "delta" or not manifest.segments:
            return None
        from rollout.engines.vllm.apply.slices import chunks_needed

        return chunks_needed(self.bind(manifest), manifest)

    def _together(self, fn: Any, share: bool = False) -> Any:
        """``fn()`` on every rank, then a vote: if it failed anywhere it fails everywhere. With
        ``share``, every rank gets rank 0's result."""
        got = together(self.group, fn, "another tensor-parallel rank could not fetch the update")
        return self.group.first(got) if share else got

    def bound(self, manifest: Any, threads: int | None = None) -> LiveWeights:
        """The live weights bound to ``manifest``'s tensor table (the current binding if it is that table)."""
        specs = list(manifest.tensors)
        if self.live is not None and self.live.specs == specs:
            return self.live
        live = LiveWeights(self.model, specs, threads or (self.info.threads if self.info else 0) or len(self.cpus),
                           group=self.group, checkpoint=checkpoint.reader(self.vllm_config))
        live.cpus = self.cpus
        return live

    def bind(self, manifest: Any, threads: int | None = None) -> LiveWeights:
        self.live = self.bound(manifest, threads)
        return self.live

    def apply(self, manifest: Any, chunks: list[Any], streamed: Streamed | None = None) -> str:
        """Apply one verified artifact to the live weights (all-or-nothing); returns the fingerprint.
        ``streamed``: its chunks already decoded as they arrived."""
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
            fp = live.apply_delta(manifest, chunks, streamed)
        self.version = manifest.target_version
        logger.info("p2psync: weights at version %d (%s, fingerprint %s)", self.version, manifest.kind, fp)
        return fp

    def status(self) -> dict[str, Any]:
        """This rank's state and its figures for the last artifact applied (one dict per worker
        through ``collective_rpc``):

        - ``version``, ``fingerprint``: the weights held (the whole model's fingerprint, equal on
          every rank);
        - ``rank``, ``ranks``: this worker's tensor-parallel rank and the group's size;
        - ``timing``: ``fetch_s`` (seconds fetching the manifest and this rank's chunks, each
          verified; with chunks decoded as they arrive, ``overlapped``, most of the decode runs
          inside it), ``decode_s`` (decoding this rank's slice, or what was left of it after the
          fetch, and checking the target fingerprint), ``decode_busy_s`` (with ``overlapped``:
          thread-seconds of the decode during the fetch), ``commit_s`` (writing and checking again), ``changes`` (changed words
          written here), ``segments_decoded``, ``fetched_bytes`` (bytes of chunks this rank
          fetched; ``bytes`` is the same figure), ``artifact_bytes`` (all the artifact's chunks),
          ``fetched_chunks``, ``artifact_chunks``, and ``fetched_runs`` (the chunks fetched, as
          ``[first, end)`` runs of indices). A rank's share of the transfer is
          ``fetched_bytes / artifact_bytes`` (1.0 at one rank, and for a snapshot or a manifest
          without a segment index); its apply time is ``fetch_s + decode_s + commit_s``.
          ``kernels_loaded``: compiled kernels the update had to load (0 once the warm-up of
          :mod:`rollout.engines.vllm.worker.warm` ran); ``warming``: whether that warm-up was still running
          when the update began. An artifact
          committed from a stage has ``staged`` true, ``staged_s`` (the stage's seconds, beside
          generation) and ``fetch_s`` 0;
        - ``staging``: ``{"version", "done"}`` of a stage in progress or kept for its commit, or None;
        - ``converted``: checkpoint tensors vLLM keeps in another dtype here, with that dtype
          (``{"model.layers.1.mlp.gate.weight": "float32"}`` for a float32 router of a bf16
          checkpoint, ``"bfloat16"`` for every tensor of a float32 checkpoint served in bf16;
          :mod:`rollout.engines.vllm.placement.casts`)."""
        live = self.live
        converted = {pl.name: pl.cast for pl in live.places if pl is not None and pl.cast} if live else {}
        return {"version": self.version, "fingerprint": live.fingerprint if live else None,
                "rank": self.group.rank, "ranks": self.group.size, "timing": dict(self.timing),
                "staging": self.stager.state(), "converted": converted}

    def audit(self) -> str | None:
        return self.live.audit() if self.live else None


def _transfer(manifest: Any, chunks: list[Any]) -> dict[str, Any]:
    """The status's figures of what this rank fetched of ``manifest`` (``chunks``: None where not fetched)."""
    got = [i for i, c in enumerate(chunks) if c is not None]
    size = sum(len(chunks[i]) for i in got)
    return {"bytes": size, "fetched_bytes": size, "artifact_bytes": manifest.payload_bytes,
            "fetched_chunks": len(got), "artifact_chunks": len(manifest.chunks), "fetched_runs": _runs(got)}


def _runs(ids: list[int]) -> list[list[int]]:
    """Sorted distinct ``ids`` as ``[first, end)`` runs."""
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


class _Tagged(P2PSyncError):
    """A p2psync error re-raised with its class name in the message (it crosses process boundaries as text)."""

    def __init__(self, exc: P2PSyncError, text: str | None = None) -> None:
        super().__init__(text or tagged(exc))
        self.original = exc
