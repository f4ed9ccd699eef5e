"""The transformers rollout engine: a causal LM in the rollout dtype (bf16), CPU by default.

Weights. The model is built from a transformers config (random init, then
overwritten) and its parameters *are* the engine's :class:`ModelState`: the
state is a view over the parameter tensors (same memory), in the trainer's
tensor-table order, so applying an artifact writes straight into the weights
the next forward pass reads and :meth:`HFEngine.audit` hashes exactly those
weights. The table's names are the checkpoint's (:mod:`p2psync.checkpoint_names`):
where transformers holds a MoE block's experts fused, each expert's
``gate_proj``/``up_proj``/``down_proj`` is a view into the fused parameter. Tied weights (``lm_head.weight`` = ``model.embed_tokens.weight``) are
one tensor in the model and one entry in the trainer's table (the first name
in state-dict order); if the trainer's table names both, both entries view the
same memory and a delta writes the same words twice.

Generation. Left-padded batch, one prefill, then one token per
:meth:`HFGeneration.step` with a KV cache; finished rows leave the cache. If
the weights changed since the cache was built (the worker switched version
between two steps), the next step rebuilds the cache by prefilling every
context (prompt, prefix and tokens so far) under the new weights, so every
token's logits come from a single weight version: the one recorded for it.
Sampling and log-probabilities follow :mod:`rollout.engines.base`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from p2psync.artifact import applier_for
from p2psync.checkpoint_names import checkpoint_tensors
from p2psync.errors import FingerprintMismatch, P2PSyncError, TensorTableMismatch
from p2psync.state import ModelState, TensorSpec, check_table
from rollout.engines.base import (
    EngineConfig,
    Generation,
    Prepared,
    RolloutEngine,
    SeqRequest,
    SeqState,
    TokenEvent,
    finish_reason,
    sample_rows,
)

if TYPE_CHECKING:
    from p2psync.artifact import Manifest

logger = logging.getLogger(__name__)


class HFEngine(RolloutEngine):
    """A transformers causal LM whose parameters are a :class:`ModelState` (see module doc)."""

    name = "hf"
    switch_mid_generation = True

    def __init__(self, model: torch.nn.Module, device: str = "cpu") -> None:
        self.model = model.eval().requires_grad_(False)
        self.device = torch.device(device)
        # Every checkpoint name the model answers to (tied aliases included), sharing the parameters'
        # memory: an expert of a fused MoE parameter is a view into it.
        self._named: dict[str, torch.Tensor] = checkpoint_tensors(self.model)
        self._state: ModelState | None = None
        self._epoch = 0
        """Bumped whenever the weights change; a generation whose cache is older rebuilds it."""
        self.version = None
        cfg = self.model.config
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    @classmethod
    def build(cls, config: EngineConfig) -> HFEngine:
        from transformers import AutoModelForCausalLM

        if config.threads:
            torch.set_num_threads(config.threads)
        if config.device != "cpu" and config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device: {config.device!r} requested but CUDA is not available")
        if config.device != "cpu":
            # The state must view the weights, and ModelState holds CPU tensors: a GPU copy would
            # need its own apply path (the vLLM engine has one). Say so rather than desync silently.
            raise ValueError("device: the transformers engine applies deltas to its CPU weights; use 'cpu' "
                             "(or the vllm engine on a GPU)")
        model = AutoModelForCausalLM.from_config(config.hf_config(), dtype=getattr(torch, config.dtype))
        return cls(model, config.device)

    # --- weights ----------------------------------------------------------------------------
    @property
    def state(self) -> ModelState:
        if self._state is None:
            raise RuntimeError("the engine holds no weights yet (call load() first)")
        return self._state

    @property
    def has_weights(self) -> bool:
        return self._state is not None and self.version is not None

    def bind(self, specs: Sequence[TensorSpec]) -> ModelState:
        """A state over the model's own tensors, in the order (and with the names) of ``specs``."""
        unknown = [s.name for s in specs if s.name not in self._named]
        covered = {self._named[s.name].data_ptr() for s in specs if s.name in self._named}
        missing = [n for n, t in self._named.items() if t.data_ptr() not in covered]
        if unknown or missing:
            raise TensorTableMismatch(unknown=unknown, missing=missing)
        state = ModelState([(s.name, self._named[s.name]) for s in specs])
        check_table(list(specs), state.specs)
        for s in specs:
            if state.tensor(s.name).data_ptr() != self._named[s.name].data_ptr():
                raise RuntimeError(f"{s.name}: the state would copy the weight instead of viewing it")
        return state

    def load(self, source: ModelState | None, version: int, expected_fingerprint: str | None = None) -> str:
        if source is None:
            raise P2PSyncError("engine 'hf' copies weights from a state; none given")
        if self._state is None or self._state.specs != source.specs:
            self._state = self.bind(source.specs)
        state = self._state
        self.version = None  # weights are in flux until the audit below passes
        self._epoch += 1
        with torch.no_grad():
            for spec in source.specs:
                state.words(spec.name)[:] = source.words(spec.name)
        state.invalidate()
        fp = state.fingerprint  # recomputed from every word just copied, and cached for the next apply
        want = expected_fingerprint if expected_fingerprint is not None else source.fingerprint
        if fp != want:
            raise FingerprintMismatch(want, fp)
        self.version = version
        return fp

    def prepare(self, manifest: Manifest, chunks: Sequence[bytes], threads: int = 2) -> Prepared:
        applier = applier_for(self.state, manifest)  # checks table and base before decoding anything
        applier.add_chunks(enumerate(chunks), threads)
        return Prepared(manifest, applier, self.version)

    def commit(self, prepared: Prepared) -> str:
        if prepared.base_version != self.version:
            raise P2PSyncError(f"prepared against version {prepared.base_version}, engine is at {self.version}")
        fp = prepared.applier.commit()  # writes only if the result hashes to the manifest's target
        self.version = prepared.manifest.target_version
        self._epoch += 1
        return fp

    # --- generation -------------------------------------------------------------------------
    def start(self, requests: Sequence[SeqRequest]) -> HFGeneration:
        if not self.has_weights:
            raise RuntimeError("the engine holds no weights yet (call load() first)")
        return HFGeneration(self, list(requests))

    def logprobs_of(self, prompt_ids: Sequence[int], tokens: Sequence[int], temperature: float = 1.0
                    ) -> list[float]:
        """Log-probabilities of ``tokens`` after ``prompt_ids`` in one forward pass (the trainer's view)."""
        ids = torch.tensor([list(prompt_ids) + list(tokens)], device=self.device)
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0].float()
        t = temperature if temperature > 0 else 1.0
        lp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1] / t, dim=-1)
        return lp.gather(1, torch.tensor(list(tokens)).unsqueeze(1)).squeeze(1).tolist()


class HFGeneration(Generation):
    """One batch on an :class:`HFEngine` (see module doc for the cache rules)."""

    def __init__(self, engine: HFEngine, requests: list[SeqRequest]) -> None:
        self.engine = engine
        self.seqs = [SeqState(r) for r in requests]
        self._rows: list[int] = []
        """Sequence index of each cache row."""
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._next_pos: torch.Tensor | None = None
        self._epoch = -1
        for s in self.seqs:
            if s.length >= s.request.max_new_tokens:
                s.finish_reason = "length"
            elif s.request.prefix and s.request.prefix[-1] in s.request.stop_token_ids:
                s.finish_reason = "stop"

    def _context(self, s: SeqState) -> list[int]:
        return list(s.request.prompt_ids) + list(s.request.prefix) + s.tokens

    def _prefill(self, rows: list[int]) -> torch.Tensor:
        eng = self.engine
        ctx = [self._context(self.seqs[i]) for i in rows]
        width = max(len(c) for c in ctx)
        ids = torch.full((len(rows), width), eng.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, c in enumerate(ctx):
            ids[r, width - len(c):] = torch.tensor(c)
            mask[r, width - len(c):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache(config=eng.model.config)  # type: ignore[arg-type]  # a transformers model's config
        out = eng.model(input_ids=ids.to(eng.device), attention_mask=mask.to(eng.device),
                        position_ids=pos.to(eng.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._cache, self._mask, self._rows = out.past_key_values, mask, list(rows)
        self._next_pos = pos[:, -1] + 1
        self._epoch = eng._epoch
        return out.logits[:, -1, :]

    def _decode(self) -> torch.Tensor:
        eng = self.engine
        assert self._mask is not None and self._next_pos is not None
        last = torch.tensor([[self.seqs[i].tokens[-1] if self.seqs[i].tokens else self.seqs[i].request.prefix[-1]]
                             for i in self._rows], dtype=torch.long)
        self._mask = torch.cat([self._mask, torch.ones((len(self._rows), 1), dtype=torch.long)], dim=1)
        pos = self._next_pos.unsqueeze(1)
        out = eng.model(input_ids=last.to(eng.device), attention_mask=self._mask.to(eng.device),
                        position_ids=pos.to(eng.device), past_key_values=self._cache, use_cache=True,
                        logits_to_keep=1)
        self._cache = out.past_key_values
        self._next_pos = self._next_pos + 1
        return out.logits[:, -1, :]

    def _drop_finished(self) -> None:
        keep = [r for r, i in enumerate(self._rows) if not self.seqs[i].done]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._cache = self._mask = self._next_pos = None
            self._rows = []
            return
        idx = torch.tensor(keep, dtype=torch.long)
        self._cache.batch_select_indices(idx.to(self.engine.device))
        assert self._mask is not None and self._next_pos is not None
        self._mask, self._next_pos = self._mask[idx], self._next_pos[idx]
        self._rows = [self._rows[r] for r in keep]

    def step(self) -> list[TokenEvent]:
        eng = self.engine
        active = [i for i, s in enumerate(self.seqs) if not s.done]
        if not active:
            return []
        # Context limit: a row that cannot take one more position ends as "length".
        for i in active:
            s = self.seqs[i]
            if len(s.request.prompt_ids) + s.length >= eng.max_positions:
                s.finish_reason = "length"
        self._drop_finished()
        active = [i for i, s in enumerate(self.seqs) if not s.done]
        if not active:
            return []
        version = eng.version
        assert version is not None
        with torch.no_grad():
            if self._cache is None or self._epoch != eng._epoch or set(self._rows) != set(active):
                logits = self._prefill(active)
            else:
                logits = self._decode()
        rows = [self.seqs[i] for i in self._rows]
        tokens, lps = sample_rows(logits, [s.request for s in rows], [s.length for s in rows])
        events = []
        for i, s, tok, lp in zip(self._rows, rows, tokens, lps):
            s.tokens.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            s.finish_reason = finish_reason(s.request, tok, s.length)
            events.append(TokenEvent(i, tok, lp, version, s.finish_reason))
        self._drop_finished()
        return events

    def cancel(self, indices: Any) -> None:
        super().cancel(indices)
        self._drop_finished()
