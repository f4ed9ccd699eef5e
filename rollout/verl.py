"""The rollout side of verl's checkpoint engine ``p2psync``: the vLLM engine verl launched pulls the
trainer's version through p2psync's worker backend.

verl builds this class in each rollout ``CheckpointEngineWorker`` (through the registered
:class:`trainer.verl.engine.P2PSyncCheckpointEngine`, which returns it when built without
``is_master``), and per sync calls ``prepare``, ``init_process_group(trainer=...)`` with what the
trainer's ``prepare`` answered (its node's address and key, and the version this sync publishes),
then ``server_adapter.update_weights(receive_weights(global_steps), wire_format="delta_flush")``.

How verl's own delta engine (``delta_sharded``) feeds vLLM, and why this one differs: its flushes
go to verl's server adapter, which sends them over same-GPU CUDA IPC to verl's ``verl_delta_ipc``
weight-transfer backend, with ``init_info={}`` and verl's worker-extension method
``update_verl_delta_weights``. Those calls cannot carry p2psync's init (parent, token, trainer key,
certificate folder) or its update (a version), and the payload is the decoded delta, which p2psync
never materialises outside the engine that holds the base words. So this engine makes the
weight-transfer calls itself, on the same vLLM server handle the adapter uses (``collective_rpc``
on the engine's workers), in the order the adapter makes them for a delta:
``init_weight_transfer_engine`` (first sync, or a new parent), ``start_weight_update``,
``update_weights({"version": v})``, ``finish_weight_update``, then a prefix-cache reset (the
adapter's ``clear_kv_cache``). vLLM must run the ``p2psync`` backend (verl's
``engine_kwargs.vllm.weight_transfer_config={"backend": "p2psync"}``); its workers fetch only the
chunks they need from their parent, check each against the signed manifest and apply in place,
all-or-nothing. The flush stream handed back to the adapter is then empty: verl's vLLM adapter
reads an empty ``delta_flush`` stream as "weights unchanged" and only advances its step tag, so it
neither re-loads nor re-processes the weights p2psync just wrote.

Contract: when the stream ends, every worker of the vLLM engine holds exactly the bits of the
trainer's version for this sync (its fingerprint checked), and the engine's prefix cache holds
nothing computed with older weights; on any refusal the stream raises, and the engine keeps the
last version it fully reached, still serving.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from verl.checkpoint_engine.base import CheckpointEngine

from p2psync.errors import ConfigError, P2PSyncError

logger = logging.getLogger(__name__)

_PARENT_FIELDS = ("url", "token", "public_key", "node_id", "tls_dir", "timeout", "threads")
_OPTIONS = (*_PARENT_FIELDS, "wait_s")


class Server(Protocol):
    """The vLLM engine's weight-transfer calls, as verl's server adapter reaches them."""

    async def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> Any:
        """``collective_rpc(method, kwargs=kwargs)`` on every worker of the engine."""

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (computed with the old weights)."""


class AdapterServer:
    """:class:`Server` over verl's vLLM ``ServerAdapter`` (its Ray handle to the vLLM server actor).

    Only the adapter of a replica's leader rank holds that handle; on the others ``rpc`` does
    nothing, as verl's own calls do (the leader's ``collective_rpc`` reaches every worker)."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    async def rpc(self, method: str, kwargs: dict[str, Any] | None = None) -> Any:
        return await self.adapter._execute_method(method, kwargs=kwargs or {})

    async def reset_prefix_cache(self) -> None:
        if self.adapter._ensure_server_handle():
            await self.adapter.server_handle.clear_kv_cache.remote()


class P2PSyncRolloutEngine(CheckpointEngine):
    """The rollout side (see module doc).

    ``rollout`` (from ``engine_kwargs.p2psync.rollout``): how the vLLM workers reach their p2psync
    parent: ``token`` (the cluster token; required), ``tls_dir`` (the certificate folder they
    present over mutual TLS), ``node_id`` (the id that certificate names), ``url`` (the parent,
    e.g. the p2psync node on the rollout machine; default: the trainer node verl's topology names),
    ``public_key`` (the trainer's key, PEM text or a path; default: the trainer's answer),
    ``timeout``, ``threads``; ``wait_s``: how long a sync waits for the parent to hold its version
    (verl runs the trainer's send and this receive at once; default 600). ``server``: a :class:`Server` (tests; in a verl run the server
    adapter of the ``CheckpointEngineWorker`` that owns this engine is found on first use).
    """

    wire_format = "delta_flush"

    def __init__(self, bucket_size: int = 0, rollout: Mapping[str, Any] | None = None, server: Server | None = None,
                 **_trainer_side: Any) -> None:
        self.bucket_size = bucket_size
        self.options = dict(rollout or {})
        unknown = sorted(set(self.options) - set(_OPTIONS))
        if unknown:
            raise ConfigError(f"engine_kwargs.p2psync.rollout.{unknown[0]}",
                              f"unknown key (known: {', '.join(_OPTIONS)})")
        self.wait_s = float(self.options.get("wait_s", 600.0))
        if "token" not in self.options:
            raise ConfigError("engine_kwargs.p2psync.rollout.token", "missing (the cluster token)")
        self.server = server
        self.trainer: dict[str, Any] | None = None
        self.sent_init: dict[str, Any] | None = None
        """The ``init_info`` the engine accepted last (sent again only when it changes)."""
        self.version: int | None = None
        """The version the engine reached last."""

    # --- verl's contract ------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        return {"role": "rollout"}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        raise NotImplementedError("verl calls build_topology on the registered class "
                                  "(trainer.verl.engine.P2PSyncCheckpointEngine)")

    def init_process_group(self, trainer: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        """Take this sync's target from the trainer's ``prepare`` answer (via verl's topology)."""
        if trainer is None or not isinstance(trainer.get("version"), int) or not trainer.get("url"):
            raise ValueError(f"trainer: expected the trainer's prepare() answer (url, version), got {trainer!r}")
        self.trainer = dict(trainer)

    def finalize(self) -> None:
        """Nothing per sync (the engine keeps its parent between syncs)."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> None:
        raise NotImplementedError("the rollout side only receives")

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[Any]:
        """Have the vLLM engine reach this sync's version (see module doc); yields no flush."""
        await self.reach(global_steps)
        return
        yield  # an async generator, as verl's adapters iterate it

    # --- the work -------------------------------------------------------------------------------
    def init_info(self) -> dict[str, Any]:
        """The ``init_info`` for the p2psync backend: this side's options over the trainer's answer."""
        if self.trainer is None:
            raise P2PSyncError("p2psync rollout: no target yet (verl calls init_process_group before a sync)")
        info = {k: v for k, v in self.options.items() if k in _PARENT_FIELDS}
        info.setdefault("url", self.trainer["url"])
        info.setdefault("public_key", self.trainer.get("public_key", ""))
        if not info["public_key"]:
            raise ConfigError("engine_kwargs.p2psync.rollout.public_key",
                              "missing, and the trainer answered none (its node has no trainer_public_key)")
        return info

    async def reach(self, global_steps: int | None = None) -> int:
        """The weight-transfer calls for one sync, in the order verl's adapter makes them."""
        info = self.init_info()
        assert self.trainer is not None
        target = int(self.trainer["version"])
        server = self.server if self.server is not None else self._owner_server()
        await self.wait_held(info, target)
        if info != self.sent_init:
            # no "version": the backend keeps the one it holds; with none, the first update
            # starts from the trainer's snapshot (what verl's vLLM loaded is not trusted)
            await server.rpc("init_weight_transfer_engine", {"init_info": info})
            self.sent_init = info
        await server.rpc("start_weight_update")
        await server.rpc("update_weights", {"update_info": {"version": target}})
        await server.rpc("finish_weight_update")
        await server.reset_prefix_cache()
        self.version = target
        logger.info("p2psync: vLLM engine reached version %d (global step %s)", target, global_steps)
        return target

    async def wait_held(self, info: Mapping[str, Any], target: int) -> None:
        """Return once the parent lists a way to ``target`` (verl starts this receive together with
        the trainer's send: the version may not be published yet); :class:`TimeoutError` after
        ``wait_s``. Asked from this process with the same parent fields the vLLM workers use."""
        from p2psync.retry import Backoff
        from p2psync.transport.leaf import NoCatchup, Parent, fetch_plan

        parent = Parent.create(info["url"], info["token"], info["public_key"], info.get("node_id", "vllm"),
                               info.get("tls_dir", ""), float(info.get("timeout", 30.0)),
                               prefix="engine_kwargs.p2psync.rollout.")
        loop = asyncio.get_running_loop()
        deadline, backoff, attempt = loop.time() + self.wait_s, Backoff(first=0.1, cap=2.0), 0
        while True:
            try:
                await fetch_plan(parent, self.version, target)
                return
            except NoCatchup as exc:
                if loop.time() >= deadline:
                    raise TimeoutError(f"p2psync rollout: {parent.url} has no way to version {target} after "
                                       f"{self.wait_s:.0f} s (newest it lists: {exc.newest})") from None
            await asyncio.sleep(backoff.delay(attempt))
            attempt += 1

    def _owner_server(self) -> Server:
        """The server adapter of the verl ``CheckpointEngineWorker`` holding this engine.

        verl 0.9.1 offers no supported way to it: ``CheckpointEngineWorker.__init__`` builds the
        engine (from ``bucket_size`` and ``engine_kwargs`` alone) before the adapter, its
        ``update_weights`` hands the adapter the engine's stream and never the adapter to the engine,
        and ``execute_checkpoint_engine`` calls the engine's methods with the manager's arguments
        only. The worker keeps both (``checkpoint_engine``, ``server_adapter``), so the worker is
        the object whose ``checkpoint_engine`` is this engine."""
        for ref in gc.get_referrers(self):
            owner = ref if not isinstance(ref, dict) else None
            attrs = ref if isinstance(ref, dict) else getattr(ref, "__dict__", {})
            if attrs.get("checkpoint_engine") is self and attrs.get("server_adapter") is not None:
                self.server = AdapterServer(attrs["server_adapter"])
                logger.info("p2psync: driving the vLLM server through %s's adapter", type(owner).__name__)
                return self.server
        raise P2PSyncError("p2psync rollout: no server to drive (not inside verl's CheckpointEngineWorker, "
                           "and no server= given)")
