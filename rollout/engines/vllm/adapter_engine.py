"""The ``vllm-lora`` rollout engine: a frozen base served by vLLM, the node's stream an adapter's versions.

For RL on a LoRA adapter: the rollout node follows the adapter's stream ``lora:<name>`` (the
trainer's :class:`~trainer.adapter.AdapterPublisher`), and this engine serves every batch with the
adapter version the node holds. The base weights are the checkpoint ``model_path`` (required) and
never change; each version the node verified is loaded into vLLM's live LoRA slots from memory by
:class:`~rollout.engines.vllm.lora.AdapterSlots` (one ``lora_int_id`` per version, the last
``P2PSYNC_LORA_WINDOW`` kept, default 2), and a batch's requests all name the version the engine
held when the batch started, and that version stays loaded until the batch is done (pinned,
:meth:`~rollout.engines.vllm.lora.AdapterSlots.pin`). Every token records that version (``SeqState.versions``, the
coordinator's ``versions``): the rollout's adapter version.

Versions switch between batches (``switch_mid_generation = False``): a new version gets its own id,
so nothing of a running batch changes, and vLLM's prefix cache keys blocks by adapter id (no reset).
The engine's :attr:`state` is the adapter state it loaded (the node's verified words), its
fingerprint and :meth:`audit` that state's; an adapter that does not fit the engine (another base,
a rank above ``max_lora_rank``, targets without LoRA in vLLM) is refused as
:class:`~p2psync.errors.AdapterMismatch` at commit and the engine keeps its version.

Job config: ``{"engine": "vllm-lora", "model_path": BASE, "vllm": {"max_lora_rank": 8}}``
(``enable_lora`` is on by default; ``vllm`` holds any other ``vllm.LLM`` keyword).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from p2psync.errors import ConfigError, FingerprintMismatch, P2PSyncError
from rollout.engines.base import EngineConfig, Prepared, SeqRequest
from rollout.engines.vllm.engine import VLLMEngine, VLLMGeneration
from rollout.engines.vllm.launch import llm_kwargs, require_vllm, start_llm

if TYPE_CHECKING:
    from p2psync.artifact import Manifest
    from p2psync.state import ModelState
    from rollout.engines.vllm.lora import AdapterSlots


class VLLMAdapterEngine(VLLMEngine):
    """A vLLM engine serving a frozen base with the node's adapter versions (see module doc)."""

    name = "vllm-lora"
    switch_mid_generation = False
    pulls_artifacts = False

    def __init__(self, llm: Any, slots: AdapterSlots) -> None:
        super().__init__(llm)
        self.slots = slots
        self._state: ModelState | None = None
        self._adapter: str | None = None

    @classmethod
    def build(cls, config: EngineConfig) -> VLLMAdapterEngine:
        require_vllm(cls.name)
        if not config.model_path:
            raise ConfigError("model_path", "engine 'vllm-lora' serves a frozen base: give its checkpoint folder "
                              "(the node's stream carries the adapter only)")
        from p2psync import checkpoint
        from rollout.engines.vllm.lora import AdapterSlots
        from rollout.engines.vllm.worker.adapter_source import window

        kw = llm_kwargs(config, config.model_path)
        kw.setdefault("enable_lora", True)
        base_fp = checkpoint.load(config.model_path).state.fingerprint
        llm = start_llm(kw)
        try:
            slots = AdapterSlots(llm, base_fingerprint=base_fp, window=window())
        except BaseException:
            llm.llm_engine.engine_core.shutdown()
            raise
        return cls(llm, slots)

    # --- the rollout contract --------------------------------------------------------------
    @property
    def state(self) -> ModelState:
        if self._state is None:
            raise RuntimeError("the engine holds no adapter version yet (call load() first)")
        return self._state

    @property
    def fingerprint(self) -> str:
        return self.state.fingerprint

    def audit(self, threads: int = 2) -> str:
        return self.state.audit(threads)

    def lora_request(self) -> Any:
        """The ``LoRARequest`` of the version held: what every request of a new batch names."""
        if self._adapter is None or self.version is None:
            raise RuntimeError("the engine holds no adapter version yet (call load() first)")
        return self.slots.request(self._adapter, self.version)

    def start(self, requests: Sequence[SeqRequest]) -> VLLMGeneration:
        """A batch on the version held, pinned in the slots until every sequence of it is done (a
        version loaded meanwhile never removes the one the batch runs on)."""
        if self._adapter is None or self.version is None:
            raise RuntimeError("the engine holds no adapter version yet (call load() first)")
        release = self.slots.pin(self._adapter, self.version)
        try:
            gen = super().start(requests)
        except BaseException:
            release()
            raise
        gen.on_done(release)
        return gen

    def _take(self, state: ModelState, version: int) -> None:
        """Load ``state`` (verified) into vLLM as ``version`` and adopt it (nothing changes if refused)."""
        from p2psync.adapter import split_state

        config, _ = split_state(state)
        with self.calling():
            self.slots.load(config.name, state, version)
        self._state, self._adapter, self.version = state, config.name, version

    def load(self, source: ModelState | None, version: int, expected_fingerprint: str | None = None) -> str:
        """Load the node's adapter state ``source`` as ``version`` (a copy: the node keeps its own)."""
        if source is None:
            raise P2PSyncError("engine 'vllm-lora': load needs the node's adapter state")
        state = source.clone()
        fp = state.fingerprint
        if expected_fingerprint is not None and fp != expected_fingerprint:
            raise FingerprintMismatch(expected_fingerprint, fp)
        self._take(state, version)
        return fp

    def prepare(self, manifest: Manifest, chunks: Sequence[bytes], threads: int = 2) -> Prepared:
        from p2psync.codec.decode import Applier

        ap = Applier.onto(self.state.clone(), manifest)
        ap.add_chunks(enumerate(chunks), threads)
        return Prepared(manifest, ap, self.version)

    def prepare_decoded(self, manifest: Manifest, changes: dict, sums: list[tuple[int, int]]) -> Prepared:
        from p2psync.codec.decode import Applier

        return Prepared(manifest, Applier.adopting(self.state.clone(), manifest, changes, sums), self.version)

    def commit(self, prepared: Prepared) -> str:
        m = prepared.manifest
        if prepared.base_version != self.version:
            raise P2PSyncError(f"prepared against version {prepared.base_version}, engine is at {self.version}")
        fp = prepared.applier.commit()  # the target fingerprint checked
        self._take(prepared.applier.state, m.target_version)
        return str(fp)
