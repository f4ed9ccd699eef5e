"""LoRA adapter versions delivered by p2psync, served by a vLLM engine's live LoRA slots.

:class:`AdapterSlots` takes each artifact of an adapter stream (:mod:`p2psync.adapter`; the
snapshot, then deltas), checks it, and registers the version in every worker under an
``lora_int_id`` of its own, from memory (:mod:`rollout.engines.vllm.worker.lora`). A request
names the version it is served with: :meth:`AdapterSlots.request` gives the ``LoRARequest`` of
the newest version or of a named one. Because every version has its own id, loading version
``v + 1`` never touches version ``v``: a request in flight finishes on the version it started
with, and a new request gets the newest version as soon as :meth:`AdapterSlots.apply` returned.
:func:`following` keeps a node's versions flowing into the slots for the length of a block
(:func:`follow` as a task; ``until`` waits for a version). The last ``window`` versions of each
adapter stay loaded (TRL's ``max_staleness + 1``); older ones are removed once a newer version is
loaded (with one worker, in the same call to it), except a version pinned by a batch still running
on it (:meth:`AdapterSlots.pin`; :mod:`rollout.engines.vllm.pins`): it stays, taking no place in
the window, and is removed when its last batch lets it go.

Refusals, each typed and each leaving the loaded set and the stream's state untouched:
:class:`~p2psync.errors.SignatureError` (wrong key, unsigned),
:class:`~p2psync.errors.WrongBase` (a delta whose base is not the version held),
:class:`~p2psync.errors.AdapterMismatch` (another base model than the engine's weights, a rank
above ``max_lora_rank``, target modules the engine does not serve LoRA on),
:class:`~p2psync.errors.MissingVersion` (a request for a version not loaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from p2psync.adapter import AdapterConfig, split_state
from p2psync.adapter import stream_id as adapter_stream
from p2psync.artifact import Manifest
from p2psync.codec.decode import Applier
from p2psync.errors import AdapterMismatch, ConfigError, MissingVersion, WrongBase
from p2psync.state import ModelState
from p2psync.transport.client import cancel_quietly
from rollout.engines.vllm.pins import Pins, kept


@dataclass
class _Stream:
    state: ModelState
    version: int
    config: AdapterConfig
    loaded: dict[int, int] = field(default_factory=dict)
    """version -> lora_int_id, oldest first."""


class AdapterSlots:
    """The adapter versions one vLLM engine serves (module docstring).

    ``llm``: a ``vllm.LLM`` built with ``enable_lora=True`` (``collective_rpc`` reaches its workers).
    ``base_fingerprint``: the p2psync fingerprint of the engine's base weights; an adapter trained
    on another base is refused. ``public_key``: the trainer's key (``None`` with
    ``allow_unsigned`` only). ``window``: versions of each adapter kept loaded (at least 1)."""

    def __init__(self, llm: Any, *, base_fingerprint: str, public_key: Any = None, window: int = 2,
                 allow_unsigned: bool = False) -> None:
        if window < 1:
            raise ConfigError("window", f"must be at least 1, got {window}")
        self.llm = llm
        self.base_fingerprint = base_fingerprint
        self.public_key = public_key
        self.allow_unsigned = allow_unsigned
        self.window = window
        self.last_load_s: float | None = None
        """Seconds the last successful :meth:`load` took (the round trip to the workers included)."""
        self._streams: dict[str, _Stream] = {}
        self._pins = Pins()
        self._lock = threading.RLock()  # a batch pins from the generating thread while follow() loads
        from rollout.engines.vllm.worker.lora import rpc_lora_limits

        ranks = self._rpc(rpc_lora_limits)
        self.limits: dict[str, Any] = ranks[0]
        self._ranks = len(ranks)
        # Ids clear of those a caller picks for folder adapters and of any registered already.
        self._ids = itertools.count(max([1 << 20, *(i + 1 for i in self.limits["registered"])]))
        cap = int(self.limits["max_cpu_loras"])
        if window > cap:
            raise ConfigError("window", f"{window} versions do not fit the engine's max_cpu_loras={cap}")

    def _rpc(self, fn: Any, *args: Any) -> list[Any]:
        return list(self.llm.collective_rpc(fn, args=args))

    # --- what a request names -------------------------------------------------------------
    def loaded(self, name: str) -> list[int]:
        """Versions of adapter ``name`` loaded now, oldest first."""
        s = self._streams.get(name)
        return list(s.loaded) if s is not None else []

    def request(self, name: str, version: int | None = None) -> Any:
        """The ``LoRARequest`` of adapter ``name`` at ``version`` (default: the newest loaded);
        :class:`~p2psync.errors.MissingVersion` when that version is not loaded."""
        from vllm.lora.request import LoRARequest

        s = self._streams.get(name)
        have = self.loaded(name)
        v = (have[-1] if have else -1) if version is None else version
        if s is None or v not in s.loaded:
            raise MissingVersion(name, v, have)
        return LoRARequest(lora_name=f"{name}@{v}", lora_int_id=s.loaded[v], lora_path=f"p2psync:{name}@{v}")

    def pin(self, name: str, version: int) -> Callable[[], None]:
        """Keep ``version`` of adapter ``name`` loaded while a batch runs on it, whatever newer
        versions load meanwhile; returns the release (call it once the batch ended; idempotent),
        which removes the version if the window has moved past it and no other batch holds it.
        :class:`~p2psync.errors.MissingVersion` when that version is not loaded."""
        with self._lock:
            self.request(name, version)  # loaded?
            self._pins.start(name, version)
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                if self._pins.finish(name, version):
                    self._evict(name)
        return release

    def _evict(self, name: str) -> None:
        """Remove the versions of ``name`` neither in the window nor pinned (caller holds the lock)."""
        s = self._streams[name]
        keep = kept(s.loaded, self.window, self._pins.pinned(name))
        drop = [v for v in s.loaded if v not in keep]
        if drop:
            from rollout.engines.vllm.worker.lora import rpc_lora_remove

            self._rpc(rpc_lora_remove, [s.loaded.pop(v) for v in drop])

    # --- taking versions ------------------------------------------------------------------
    def apply(self, manifest: Manifest, chunks: Iterable[tuple[int, bytes | memoryview]]) -> int:
        """Check the adapter artifact ``manifest`` (signature, base, fit) and its chunks (hashes are
        the caller's: a node verifies them as it stores them), decode the version and load it.
        Returns the version, now the newest :meth:`request` gives."""
        manifest.verify(self.public_key, allow_unsigned=self.allow_unsigned)
        name = _name(manifest.model_id)
        s = self._streams.get(name)
        if manifest.kind == "delta":
            if s is None or s.version != manifest.base_version:
                have = "nothing" if s is None else f"version {s.version}"
                raise WrongBase(str(manifest.base_fingerprint), have, manifest.base_version)
            state = s.state.clone()
        else:
            state = None
        ap = Applier.onto(state, manifest)
        ap.add_chunks(chunks, 2)
        ap.commit()
        return self.load(name, ap.state, manifest.target_version)

    def load(self, name: str, state: ModelState, version: int) -> int:
        """Load the adapter state ``state`` (already verified) as ``version`` of adapter ``name``."""
        with self._lock:
            return self._load(name, state, version)

    def _load(self, name: str, state: ModelState, version: int) -> int:
        t0 = time.perf_counter()
        config, words = split_state(state)
        if config.name != name:
            raise AdapterMismatch(name, f"the state is adapter {config.name!r}")
        self._check_fit(config)
        s = self._streams.get(name)
        if s is not None and version <= s.version:
            raise AdapterMismatch(name, f"version {version} is not newer than the loaded {s.version}")
        from rollout.engines.vllm.worker.lora import rpc_lora_add, rpc_lora_remove

        lora_id = next(self._ids)
        tensors = {n: (spec.dtype, list(spec.shape), words[n].tobytes())
                   for n, spec in ((sp.name, sp) for sp in state.specs) if n in words}
        # The versions this one pushes out of the window. One worker: removed in the add's own call
        # (only once the add succeeded there), so a version costs one round trip to the worker.
        # Several: after every rank took it, so that a rank's refusal leaves every rank's set as it was.
        # Pinned versions stay (rollout.engines.vllm.pins).
        loaded = list(s.loaded) if s is not None else []
        keep = set(kept([*loaded, version], self.window, self._pins.pinned(name)))
        drop = [v for v in loaded if v not in keep]
        ids = [s.loaded[v] for v in drop] if s is not None else []
        together = self._ranks == 1
        results = self._rpc(rpc_lora_add, lora_id, config.peft_json(), tensors, ids if together else None)
        failed = [r for r in results if not r["ok"]]
        if failed:
            self._rpc(rpc_lora_remove, [lora_id])  # ranks that took it give it back
            raise AdapterMismatch(name, failed[0]["reason"])
        if s is None:
            s = self._streams[name] = _Stream(state, version, config)
        s.state, s.version, s.config = state, version, config
        s.loaded[version] = lora_id
        for v in drop:
            s.loaded.pop(v)
        if ids and not together:
            self._rpc(rpc_lora_remove, ids)
        self.last_load_s = time.perf_counter() - t0
        return version

    def _check_fit(self, config: AdapterConfig) -> None:
        if config.base_fingerprint != self.base_fingerprint:
            raise AdapterMismatch(config.name, f"trained on base {config.base_fingerprint}, the engine serves "
                                               f"{self.base_fingerprint}")
        if config.r > int(self.limits["max_lora_rank"]):
            raise AdapterMismatch(config.name, f"rank {config.r} exceeds the engine's max_lora_rank="
                                               f"{self.limits['max_lora_rank']}")
        served = set(self.limits["modules"])
        if not set(config.target_modules) <= served:
            raise AdapterMismatch(config.name, f"target modules {sorted(set(config.target_modules) - served)} are "
                                               f"not served with LoRA by this engine (it serves {sorted(served)})")


async def follow(node: Any, slots: AdapterSlots, on_load: Callable[[str, int], None] | None = None) -> None:
    """Load into ``slots`` every version of the adapter stream that ``node`` (a p2psync node
    following ``lora:<name>``; it verified signature, chunks and fingerprint) applies, newest first
    where several arrived meanwhile. Runs until cancelled; a refused version (e.g. an adapter that
    does not fit the engine) is raised and ends the loop, the loaded set untouched.
    ``on_load(name, version)``: called on the event loop after each version is loaded."""
    async def take(model_id: str) -> None:
        state, version = node.state, node.version
        if state is None or version is None:
            return
        name = _name(model_id)
        have = slots.loaded(name)
        if have and version <= have[-1]:
            return
        await asyncio.to_thread(slots.load, name, state.clone(), version)
        if on_load is not None:
            on_load(name, version)

    subscription = node.subscribe()
    # Started before the version held now is loaded, so that none applied meanwhile is missed.
    nxt = asyncio.ensure_future(anext(subscription))
    try:
        if node.state is not None and node.version is not None:
            config, _ = split_state(node.state)
            await take(adapter_stream(config.name))
        while True:
            m = await nxt
            nxt = asyncio.ensure_future(anext(subscription))
            await take(m.model_id)
    finally:
        nxt.cancel()


class Following:
    """:func:`follow` of one node into one :class:`AdapterSlots`, running as a task (:func:`following`).

    Contract: :meth:`until` returns once the version asked for (or a newer one) is loaded, and
    raises the loop's own error if the loop ended (a refused version), instead of waiting on."""

    def __init__(self, node: Any, slots: AdapterSlots, name: str = "follow-adapter") -> None:
        self.slots = slots
        self._loaded = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(follow(node, slots, self._on_load), name=name)
        self.task.add_done_callback(lambda _: self._loaded.set())

    def _on_load(self, name: str, version: int) -> None:
        self._loaded.set()

    async def until(self, name: str, version: int) -> None:
        """Wait until ``version`` of adapter ``name`` or a newer one is loaded (no timeout: wrap it
        in ``asyncio.timeout``)."""
        while True:
            have = self.slots.loaded(name)
            if have and have[-1] >= version:
                return
            if self.task.done():
                if not self.task.cancelled():
                    self.task.result()  # the loop's error
                raise MissingVersion(name, version, have)  # the loop was stopped from elsewhere
            self._loaded.clear()
            await self._loaded.wait()


@contextlib.asynccontextmanager
async def following(node: Any, slots: AdapterSlots) -> AsyncIterator[Following]:
    """Run :func:`follow` of ``node`` into ``slots`` for the block; on leaving it the loop is
    cancelled and waited for (its error, if it ended on one, is raised unless the block raised)."""
    f = Following(node, slots)
    failed = False
    try:
        yield f
    except BaseException:
        failed = True
        raise
    finally:
        if not f.task.done():
            await cancel_quietly(f.task)
        elif not f.task.cancelled():
            exc = f.task.exception()  # looked at either way: never "exception was never retrieved"
            if exc is not None and not failed:
                raise exc


def _name(model_id: str) -> str:
    if not model_id.startswith("lora:"):
        raise AdapterMismatch(model_id, "not an adapter stream (its model id does not start with 'lora:')")
    return model_id[len("lora:"):]
