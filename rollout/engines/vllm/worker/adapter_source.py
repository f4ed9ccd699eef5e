"""LoRA adapter versions for a running ``vllm serve``, pulled by the worker from a p2psync node, never from disk.

vLLM's server loads an adapter through ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``:
the API server gives it a ``lora_int_id`` of its own and every worker's LoRA manager loads
``lora_path`` (a folder) the first time, and again whenever its LRU cache evicted the adapter and a
request names it. vLLM 0.32 has no hook for *where* an adapter's weights come from (a resolver
plugin only turns a name into a path), so :func:`install` wraps the worker manager's
``_load_adapter``: a path of the form ``p2psync:<adapter>@<version>`` (:func:`parse_path`) is
served by :data:`SOURCE`, every other path by vLLM's own loader, unchanged.

:class:`AdapterSource` (one per worker process) keeps, per adapter, the newest decoded stream state
(the base of the next delta) and vLLM's in-memory ``LoRAModel`` of its last ``window`` versions
(:data:`WINDOW_ENV`, default 2), or, once the API server has said which versions it keeps
(:meth:`AdapterSource.keep`, the ``collective_rpc`` :data:`KEEP_RPC`: the window plus the versions
requests still run on, :mod:`rollout.engines.vllm.pins`), exactly those. Asked for a version it does not hold yet, it plans the chain of
artifacts from the version it holds on the adapter's node (``init_info.adapters[<adapter>]``, else
``init_info.url``; the p2psync backend's init gives the token, key and certificate), fetches each
signed manifest and its verified chunks, decodes them, checks the adapter against the engine
(base fingerprint, rank, target modules) and builds the ``LoRAModel`` from memory; asked again for
a version in its window (vLLM's LRU evicted it), it gives the same tensors under the id asked for.
A version is adopted only after every check passed, so a refusal changes neither this cache nor
vLLM's registered adapters (vLLM loads before it evicts or registers anything).

Refusals are :class:`~p2psync.errors.P2PSyncError` s whose message starts with the class name:
``SignatureError`` (a manifest the trainer's key does not verify), ``WrongBase`` /
``TransferInfoError`` (no chain of artifacts from the version held to the one asked for),
``AdapterMismatch`` (another base, a rank above ``max_lora_rank``, targets the engine serves no
LoRA on, a version not newer than the newest held), ``MissingVersion`` (a version that left the
window), ``NotInitialized`` (no ``init_weight_transfer_engine`` accepted yet).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from p2psync.errors import AdapterMismatch, ConfigError, MissingVersion, P2PSyncError

if TYPE_CHECKING:
    from p2psync.adapter import AdapterConfig
    from p2psync.state import ModelState

logger = logging.getLogger(__name__)

PREFIX = "p2psync:"
_PATH = re.compile(r"^p2psync:([^@\s]+)@(0|[1-9][0-9]*)$")
KEEP_RPC = "p2psync_keep_adapters"
"""The worker method (``collective_rpc``) by which the API server says which versions to keep."""
WINDOW_ENV = "P2PSYNC_LORA_WINDOW"
"""Versions of each adapter a server keeps loaded (read by the API server and the workers alike)."""


def parse_path(path: str) -> tuple[str, int] | None:
    """``(adapter, version)`` of a ``p2psync:<adapter>@<version>`` path; None for any other path
    (:class:`~p2psync.errors.ConfigError` for a ``p2psync:`` path that does not parse)."""
    if not path.startswith(PREFIX):
        return None
    m = _PATH.match(path)
    if m is None:
        raise ConfigError("lora_path", f"{path!r} is not p2psync:<adapter>@<version> (e.g. p2psync:policy@3)")
    return m.group(1), int(m.group(2))


def served_name(adapter: str, version: int) -> str:
    """The model name a server serves version ``version`` of ``adapter`` under: ``<adapter>@v<version>``."""
    return f"{adapter}@v{version}"


def window() -> int:
    """:data:`WINDOW_ENV` (default 2; a :class:`~p2psync.errors.ConfigError` unless an integer >= 1)."""
    text = os.environ.get(WINDOW_ENV, "2")
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise ConfigError(WINDOW_ENV, f"must be an integer >= 1, got {text!r}")
    return k


@dataclass
class _Held:
    state: ModelState
    version: int
    config: AdapterConfig
    models: dict[int, Any] = field(default_factory=dict)
    """version -> vLLM ``LoRAModel`` (CPU tensors), oldest first."""


class AdapterSource:
    """The adapter versions one vLLM worker process serves from memory (module docstring).

    Contract: :meth:`load` returns a ``LoRAModel`` built from verified, signed artifacts whose
    adapter fits the engine, or raises with nothing changed."""

    def __init__(self) -> None:
        self.backend: Any = None
        """The worker's p2psync backend (set when vLLM builds it): the parent, key and base weights."""
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._fetcher: Any = None
        self._base_fp: str | None = None
        self._told: dict[str, int] = {}
        """adapter -> number of the last keep message applied (its versions are the API server's to drop)."""

    def keep(self, adapter: str, versions: list[int], seq: int) -> list[int]:
        """Keep, of ``adapter``'s versions older than the newest in ``versions``, exactly those in
        ``versions`` (message ``seq`` of the API server; an older message than one applied is
        ignored). Returns the versions held."""
        with self._lock:
            if seq <= self._told.get(adapter, 0):
                return self.versions(adapter)
            self._told[adapter] = seq
            h = self._held.get(adapter)
            if h is not None and versions:
                top = max(versions)
                for v in [v for v in h.models if v < top and v not in versions]:
                    del h.models[v]
            held = self.versions(adapter)
        logger.info("p2psync: adapter %s versions held in memory %s (kept by the API server: %s)",
                    adapter, held, versions)
        return held

    def versions(self, adapter: str) -> list[int]:
        """Versions of ``adapter`` this worker holds in memory, oldest first."""
        h = self._held.get(adapter)
        return list(h.models) if h is not None else []

    def load(self, mgr: Any, adapter: str, version: int, lora_int_id: int) -> Any:
        """vLLM's ``LoRAModel`` of ``adapter`` at ``version`` under ``lora_int_id`` (``mgr``: the
        worker's ``WorkerLoRAManager``), pulled and checked if not held (module docstring)."""
        keep = window()  # a bad setting is refused before anything changes
        with self._lock:
            h = self._held.get(adapter)
            if h is not None and version in h.models:
                return h.models[version].clone(lora_int_id)
            if h is not None and version <= h.version:
                raise MissingVersion(adapter, version, list(h.models))
            state = self._pull(adapter, version, h)
            lora = self._model(mgr, adapter, state, lora_int_id)
            from p2psync.adapter import split_state

            config, _ = split_state(state)
            if h is None:
                h = self._held[adapter] = _Held(state, version, config)
            h.state, h.version, h.config = state, version, config
            h.models[version] = lora
            if adapter not in self._told:  # else the API server says what leaves (it knows the pins)
                for old in list(h.models)[:-keep]:
                    del h.models[old]
            logger.info("p2psync: adapter %s version %d loaded from memory (lora_int_id %d; held %s)",
                        adapter, version, lora_int_id, list(h.models))
            return lora

    # --- pulling -------------------------------------------------------------------------------------
    def _pull(self, adapter: str, version: int, held: _Held | None) -> ModelState:
        """The adapter state at ``version``: the chain of artifacts from the version held, each
        verified (signature, chunk hashes, base and target fingerprints) and decoded."""
        from p2psync.adapter import stream_id
        from p2psync.codec.decode import Applier
        from p2psync.transport.leaf import Fetcher, fetch_artifact
        from p2psync.transport.leaf import NoCatchup, fetch_plan
        from rollout.engines.vllm.worker.infos import NotInitialized

        info = getattr(self.backend, "info", None)
        if info is None:
            raise NotInitialized()
        parent = info.adapter_parent(adapter)
        if self._fetcher is None:
            self._fetcher = Fetcher()
        try:
            steps = self._fetcher.run(parent, lambda c: fetch_plan(parent, held.version if held else None, version, c),
                                      retry=True)
        except NoCatchup as exc:
            raise MissingVersion(adapter, version, self.versions(adapter)) from exc
        state = held.state if held is not None else None
        for step in steps:
            manifest, chunks = self._fetcher.run(parent, lambda c, aid=step.id: fetch_artifact(parent, aid, client=c))
            if manifest.model_id != stream_id(adapter):
                raise AdapterMismatch(adapter, f"{parent.url} serves stream {manifest.model_id!r}, not "
                                               f"{stream_id(adapter)!r} (init_info.adapters names each adapter's node)")
            ap = Applier.onto(state.clone() if state is not None else None, manifest)
            ap.add_chunks(enumerate(chunks), 2)
            ap.commit()
            state = ap.state
        if state is None:
            raise MissingVersion(adapter, version, [])
        return state

    # --- checking and building -----------------------------------------------------------------------
    def base_fingerprint(self) -> str:
        """The fingerprint of the base weights the engine serves: the backend's, where an init at a
        version or an update bound them, else that of the checkpoint vLLM loaded (read once)."""
        live = getattr(self.backend, "live", None)
        if live is not None:
            return str(live.fingerprint)
        if self._base_fp is None:
            from p2psync import checkpoint

            self._base_fp = checkpoint.load(self.backend.vllm_config.model_config.model).state.fingerprint
        return self._base_fp

    def _model(self, mgr: Any, adapter: str, state: ModelState, lora_int_id: int) -> Any:
        from p2psync.adapter import split_state
        from rollout.engines.vllm.worker.lora import lora_model

        config, words = split_state(state)
        if config.name != adapter:
            raise AdapterMismatch(adapter, f"the state is adapter {config.name!r}")
        base = self.base_fingerprint()
        if config.base_fingerprint != base:
            raise AdapterMismatch(adapter, f"trained on base {config.base_fingerprint}, the engine serves {base}")
        tensors = {s.name: (s.dtype, list(s.shape), words[s.name].tobytes()) for s in state.specs if s.name in words}
        got = lora_model(mgr, lora_int_id, config.peft_json(), tensors)
        if isinstance(got, dict):
            raise AdapterMismatch(adapter, got["reason"])
        return got

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.close()
            self._fetcher = None


SOURCE = AdapterSource()
"""This process's adapter source (the p2psync backend sets its ``backend``)."""


class AdapterRefused(Exception):
    """A p2psync adapter load refused; its message starts with the p2psync class name (what the
    HTTP caller reads)."""


def install() -> bool:
    """Route ``p2psync:`` adapter paths of vLLM's worker LoRA manager to :data:`SOURCE` (idempotent);
    False where this vLLM has no such loader to wrap (then only folder paths load)."""
    try:
        from vllm.lora.worker_manager import WorkerLoRAManager
    except ImportError:
        return False
    original = getattr(WorkerLoRAManager, "_load_adapter", None)
    if original is None:
        logger.warning("p2psync: vLLM's WorkerLoRAManager has no _load_adapter; p2psync: adapter paths not served")
        return False
    if getattr(original, "_p2psync", False):
        return True

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        try:
            where = parse_path(str(lora_request.lora_path))
            if where is None:
                return original(self, lora_request)
            return SOURCE.load(self, where[0], where[1], int(lora_request.lora_int_id))
        except P2PSyncError as exc:
            text = f"{type(exc).__name__}: {exc}"  # as the backend tags its refusals
            logger.error("p2psync adapter %s refused: %s", lora_request.lora_path, text)
            if isinstance(exc, MissingVersion):
                # vLLM's API server answers its own not-found error (404) for this one.
                from vllm.exceptions import LoRAAdapterNotFoundError

                raise LoRAAdapterNotFoundError(lora_request.lora_name, lora_request.lora_path) from exc
            raise AdapterRefused(text) from exc

    _load_adapter._p2psync = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = _load_adapter  # type: ignore[method-assign]
    try:
        from vllm.v1.worker.worker_base import WorkerWrapperBase
    except ImportError:
        return True
    if not hasattr(WorkerWrapperBase, KEEP_RPC):
        setattr(WorkerWrapperBase, KEEP_RPC, _keep_rpc)
    return True


def _keep_rpc(worker: Any, adapter: str, versions: list[int], seq: int) -> list[int]:
    """:data:`KEEP_RPC` on a vLLM worker: :meth:`AdapterSource.keep` of :data:`SOURCE`."""
    return SOURCE.keep(adapter, [int(v) for v in versions], int(seq))
