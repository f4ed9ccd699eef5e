"""The vLLM rollout engine: in-place sparse updates through vLLM's public weight-update path.

UNTESTED HERE: vLLM cannot be installed or run on the development machine (no
GPU). The vLLM-independent parts (the CPU mirror, which tensors a delta
touched, name handling, batching) are pure code with unit tests
(``tests/unit/rollout/test_vllm_adapter.py``); the tests that drive a real
``vllm.LLM`` skip unless ``import vllm`` works and a CUDA device is present.

How an update reaches vLLM (written against vLLM's source, v0.10-v0.11 era
``main``; file paths in ``vllm-project/vllm``):

- ``vllm.LLM(..., worker_extension_cls="rollout.vllm.P2PSyncWorkerExtension")``
  (``vllm/config/parallel.py``: ``worker_extension_cls``) mixes
  :class:`P2PSyncWorkerExtension` into every GPU worker; ``LLM.collective_rpc``
  (``vllm/entrypoints/llm.py``) calls its methods on all workers (every
  tensor-parallel rank gets the full checkpoint tensor and its weight loader
  takes its own shard).
- The extension calls ``self.model_runner.model.load_weights(weights=[(name,
  tensor), ...])`` with *checkpoint* names, as vLLM's own RLHF example does
  (``examples/offline_inference/rlhf_utils.py``, ``WorkerExtension.update_weight``
  and ``ColocateWorkerExtension.update_weights_from_ipc``). The model's loader
  maps q/k/v onto the fused ``qkv_proj`` and gate/up onto ``gate_up_proj``
  (``stacked_params_mapping`` in ``vllm/model_executor/models/qwen2.py`` /
  ``qwen3.py`` / ``llama.py``) and skips ``lm_head`` when embeddings are tied
  (``AutoWeightsLoader(skip_prefixes=["lm_head."])``). Copies are
  ``param.data.copy_`` / ``narrow().copy_`` of bf16 into bf16: bit-preserving.
  Quantized models (which need ``process_weights_after_loading``) are refused.
- After an update ``LLM.reset_prefix_cache()`` drops KV blocks computed with the
  old weights (``vllm/v1/core/sched/scheduler.py``: it refuses while requests
  hold blocks, so updates happen between batches: ``switch_mid_generation`` is
  False and the worker switches between batches).
- Log-probabilities: ``logprobs_mode="processed_logprobs"``
  (``vllm/config/model.py``; ``vllm/v1/sample/ops/topk_topp_sampler.py``
  ``forward_native`` returns ``log_softmax`` of the temperature-scaled logits
  *after* top-k/top-p masking). That equals :mod:`rollout.engine`'s rule
  (tempered, untruncated) when ``top_p == 1``; with ``top_p < 1`` vLLM
  renormalises over the nucleus (the difference is ``-log(nucleus mass)``),
  which the trainer must know about. Greedy requests use temperature 1 in
  vLLM's sampler, as ours do.
- Sampling: per-request ``seed`` gives vLLM a private generator, so a batch is
  reproducible, but vLLM draws its noise per request and step, not per
  absolute position: a response resumed from a prefix does not repeat the
  uninterrupted continuation (it is still a correct sample).

Weights and fingerprint. The driver keeps a CPU mirror of the checkpoint-format
weights (a :class:`~p2psync.state.ModelState` in the trainer's table). An
artifact is applied to the mirror all-or-nothing (fingerprint-checked); then
only the tensors the delta touched (the manifest's signed ``changed`` counts)
are sent whole to ``load_weights``. The engine's fingerprint is the mirror's:
the GPU holds what vLLM's own checkpoint loader made of exactly those bits. If
sending fails halfway the engine marks itself unusable (``version = None``)
and raises: the GPU may hold a mix, and only a full :meth:`VLLMEngine.load`
repairs it. Cost per step: the changed tensors cross host->GPU densely (with
1-3 % of elements changed almost every matrix is touched), bounded per RPC by
``max_rpc_bytes``.
"""

from __future__ import annotations

import logging
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from p2psync.artifact import applier_for
from p2psync.errors import FingerprintMismatch, P2PSyncError
from p2psync.state import ModelState
from rollout.engine import EngineConfig, Generation, Prepared, RolloutEngine, SeqRequest, SeqState, TokenEvent

if TYPE_CHECKING:
    import torch

    from p2psync.artifact import Manifest

logger = logging.getLogger(__name__)

EXTENSION = "rollout.vllm.P2PSyncWorkerExtension"
DEFAULT_RPC_BYTES = 256 << 20


# --- pure parts (no vLLM needed) ---------------------------------------------------------------
def changed_tensors(manifest: Manifest) -> list[str]:
    """Names of the tensors an artifact writes: every tensor of a snapshot; for a delta those whose
    signed ``changed`` count is non-zero (all of them if the manifest carries no counts)."""
    names = [t.name for t in manifest.tensors]
    if manifest.kind == "snapshot" or not manifest.changed:
        return names
    return [n for n, c in zip(names, manifest.changed) if c > 0]


@dataclass(frozen=True)
class NameMap:
    """Trainer table names -> the checkpoint names vLLM's ``load_weights`` expects.

    HF state-dict names already are checkpoint names for the architectures vLLM loads from HF
    folders (Llama, Qwen2/3, Mistral); ``rename`` covers the rest, ``skip`` drops tensors vLLM
    does not hold (e.g. a tied ``lm_head.weight`` listed separately).
    """

    rename: Mapping[str, str] = field(default_factory=dict)
    skip: frozenset[str] = frozenset()

    def __call__(self, name: str) -> str | None:
        if name in self.skip:
            return None
        return self.rename.get(name, name)


def batches(weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split ``(name, tensor)`` pairs, in order, into lists of at most ``max_bytes`` (a larger tensor goes alone)."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in weights:
        n = t.numel() * t.element_size()
        if cur and size + n > max_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


class CheckpointMirror:
    """A CPU copy of the checkpoint-format weights that artifacts apply to, all-or-nothing."""

    def __init__(self, state: ModelState, version: int) -> None:
        self.state = state
        self.version = version

    @classmethod
    def copy_of(cls, source: ModelState, version: int, expected_fingerprint: str | None = None) -> CheckpointMirror:
        state = source.clone()
        state.invalidate()
        fp = state.fingerprint  # recomputed from the copied words
        want = expected_fingerprint if expected_fingerprint is not None else source.fingerprint
        if fp != want:
            raise FingerprintMismatch(want, fp)
        return cls(state, version)

    def prepare(self, manifest: Manifest, chunks: Sequence[bytes], threads: int = 2) -> Prepared:
        """Check the base and decode against the mirror, writing nothing."""
        ap = applier_for(self.state, manifest)
        ap.add_chunks(enumerate(chunks), threads)
        return Prepared(manifest, ap, self.version)

    def commit(self, prepared: Prepared) -> tuple[str, list[str]]:
        """Write a prepared artifact (nothing on any error); returns (fingerprint, tensors written)."""
        if prepared.base_version != self.version:
            raise P2PSyncError(f"prepared against version {prepared.base_version}, mirror is at {self.version}")
        fp = prepared.applier.commit()
        self.version = prepared.manifest.target_version
        return fp, changed_tensors(prepared.manifest)

    def apply(self, manifest: Manifest, chunks: Sequence[bytes], threads: int = 2) -> tuple[str, list[str]]:
        """Apply an artifact (nothing changes on any error); returns (fingerprint, tensors written)."""
        return self.commit(self.prepare(manifest, chunks, threads))

    def weights(self, names: Iterable[str], name_map: NameMap) -> list[tuple[str, torch.Tensor]]:
        """``(checkpoint name, CPU tensor)`` for ``names`` (the mirror's own tensors: do not modify)."""
        out = []
        for n in names:
            ck = name_map(n)
            if ck is not None:
                out.append((ck, self.state.tensor(n)))
        return out


# --- inside vLLM's worker processes ------------------------------------------------------------
class P2PSyncWorkerExtension:
    """Mixed into vLLM's GPU worker via ``worker_extension_cls`` (see module doc); called by ``collective_rpc``."""

    def p2psync_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Hand checkpoint-named tensors to the model's own loader (fused layouts handled by vLLM)."""
        import torch

        model = self.model_runner.model  # type: ignore[attr-defined]
        device = getattr(self, "device", None) or next(model.parameters()).device
        model.load_weights(weights=[(n, t.to(device, non_blocking=True)) for n, t in weights])
        if torch.cuda.is_available() and torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        return len(weights)

    def p2psync_model_dtype(self) -> str:
        return str(next(self.model_runner.model.parameters()).dtype)  # type: ignore[attr-defined]


# --- the engine ---------------------------------------------------------------------------------
class VLLMEngine(RolloutEngine):
    """A ``vllm.LLM`` with a CPU checkpoint mirror (see module doc). Untested here."""

    name = "vllm"
    switch_mid_generation = False

    def __init__(self, llm: Any, name_map: NameMap | None = None, max_rpc_bytes: int = DEFAULT_RPC_BYTES) -> None:
        self.llm = llm
        self.name_map = name_map or NameMap()
        self.max_rpc_bytes = max_rpc_bytes
        self.mirror: CheckpointMirror | None = None
        self.version = None

    @classmethod
    def build(cls, config: EngineConfig) -> VLLMEngine:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise P2PSyncError(f"engine 'vllm' needs vLLM installed (pip install 'p2psync[vllm]'): {exc}") from exc
        extra = dict(config.vllm)
        name_map = NameMap(extra.pop("rename", {}), frozenset(extra.pop("skip", ())))
        max_rpc = int(extra.pop("max_rpc_bytes", DEFAULT_RPC_BYTES))
        if config.model_path:
            model = config.model_path
        else:
            # vLLM builds from a folder: write the config there and start from dummy weights
            # (the node's weights replace them before anything is generated).
            model = tempfile.mkdtemp(prefix="p2psync-vllm-")
            config.hf_config().save_pretrained(model)
            extra.setdefault("load_format", "dummy")
        if extra.get("quantization"):
            raise P2PSyncError("engine 'vllm': quantized models cannot hold the trainer's exact bits")
        llm = LLM(model=model, dtype=config.dtype, skip_tokenizer_init=True, worker_extension_cls=EXTENSION,
                  logprobs_mode="processed_logprobs", enable_prefix_caching=True, **extra)
        dtypes = set(llm.collective_rpc("p2psync_model_dtype"))
        if dtypes != {f"torch.{config.dtype}"}:
            raise P2PSyncError(f"engine 'vllm': model dtype {dtypes} is not the published {config.dtype}")
        return cls(llm, name_map, max_rpc)

    @property
    def state(self) -> ModelState:
        if self.mirror is None:
            raise RuntimeError("the engine holds no weights yet (call load() first)")
        return self.mirror.state

    def _send(self, names: Sequence[str]) -> None:
        assert self.mirror is not None
        try:
            for part in batches(self.mirror.weights(names, self.name_map), self.max_rpc_bytes):
                self.llm.collective_rpc("p2psync_load_weights", args=(part,))
            if not self.llm.reset_prefix_cache():
                raise P2PSyncError("vLLM refused to reset its prefix cache (requests still running)")
        except BaseException:
            self.version = None  # the GPU may hold a mix of versions: unusable until a full load()
            raise

    def load(self, source: ModelState, version: int, expected_fingerprint: str | None = None) -> str:
        self.version = None
        self.mirror = CheckpointMirror.copy_of(source, version, expected_fingerprint)
        self._send([s.name for s in self.mirror.state.specs])
        self.version = version
        return self.mirror.state.fingerprint

    def prepare(self, manifest: Manifest, chunks: Sequence[bytes], threads: int = 2) -> Prepared:
        if self.mirror is None or self.version is None:
            raise RuntimeError("the engine holds no usable weights (call load() first)")
        return self.mirror.prepare(manifest, chunks, threads)

    def commit(self, prepared: Prepared) -> str:
        if self.mirror is None or self.version is None:
            raise RuntimeError("the engine holds no usable weights (call load() first)")
        fp, names = self.mirror.commit(prepared)
        self._send(names)
        self.version = prepared.manifest.target_version
        return fp

    def start(self, requests: Sequence[SeqRequest]) -> VLLMGeneration:
        if self.version is None:
            raise RuntimeError("the engine holds no usable weights (call load() first)")
        return VLLMGeneration(self, list(requests))

    def close(self) -> None:
        shutdown = getattr(getattr(self.llm, "llm_engine", None), "shutdown", None)
        if callable(shutdown):
            shutdown()


def sampling_params(req: SeqRequest) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for one response (pure; see module doc)."""
    return dict(n=1, temperature=max(0.0, req.temperature), top_p=req.top_p,
                max_tokens=req.max_new_tokens - len(req.prefix), seed=req.seed,
                stop_token_ids=list(req.stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False)


class VLLMGeneration(Generation):
    """A batch driven through ``LLMEngine.add_request`` / ``step`` (one scheduler step per :meth:`step`)."""

    def __init__(self, engine: VLLMEngine, requests: list[SeqRequest]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.engine = engine
        self.seqs = [SeqState(r) for r in requests]
        self._ids: dict[str, int] = {}
        core = engine.llm.llm_engine
        for i, (s, r) in enumerate(zip(self.seqs, requests)):
            if s.length >= r.max_new_tokens:
                s.finish_reason = "length"
                continue
            rid = f"p2psync-{uuid.uuid4().hex}"
            self._ids[rid] = i
            core.add_request(rid, TokensPrompt(prompt_token_ids=list(r.prompt_ids) + list(r.prefix)),
                             SamplingParams(**sampling_params(r)))

    def step(self) -> list[TokenEvent]:
        version = self.engine.version
        assert version is not None
        events = []
        for out in self.engine.llm.llm_engine.step():
            i = self._ids.get(out.request_id)
            if i is None:
                continue
            s = self.seqs[i]
            comp = out.outputs[0]
            for k in range(len(s.tokens), len(comp.token_ids)):
                tok = int(comp.token_ids[k])
                lp = float(comp.logprobs[k][tok].logprob)
                s.tokens.append(tok)
                s.logprobs.append(lp)
                s.versions.append(version)
                last = k == len(comp.token_ids) - 1
                if last and out.finished:
                    s.finish_reason = "stop" if comp.finish_reason == "stop" else "length"
                events.append(TokenEvent(i, tok, lp, version, s.finish_reason if last else None))
        return events

    def cancel(self, indices: Iterable[int]) -> None:
        idx = set(indices)
        rids = [rid for rid, i in self._ids.items() if i in idx and not self.seqs[i].done]
        if rids:
            self.engine.llm.llm_engine.abort_request(rids)
        super().cancel(idx)
