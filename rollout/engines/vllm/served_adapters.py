"""The names ``vllm serve``'s OpenAI server gives p2psync adapter versions, and their staleness window.

A client loads version ``N`` of adapter ``<a>`` (the trainer's stream ``lora:<a>``) with vLLM's own
route, ``POST /v1/load_lora_adapter {"lora_name": "<a>@v<N>", "lora_path": "p2psync:<a>@<N>"}``;
every worker pulls it from its p2psync node into memory
(:mod:`rollout.engines.vllm.worker.adapter_source`). :func:`install` (run by the p2psync vLLM
plugin in the API server's process) wraps vLLM's ``OpenAIServingModels`` so that, once the load
succeeded:

- ``<a>@v<N>`` names exactly that version, for as long as it is in the window;
- ``<a>`` names the newest version loaded: a request naming it gets that version's
  ``lora_int_id`` at the moment it is received, and its response's ``model`` field says which
  (``"<a>@v<N>"``). Loading ``N+1`` re-points ``<a>`` and registers a new id; it never touches
  ``N``'s, so a request in flight finishes on the version it started with;
- the newest ``P2PSYNC_LORA_WINDOW`` (default 2) versions of ``<a>`` stay named, and so does an
  older one while requests run on it (pinned, :mod:`rollout.engines.vllm.pins`: the wrap of
  ``AsyncLLM.generate`` counts each request from its start to its end). A version neither in the
  window nor pinned leaves ``GET /v1/models`` and a request naming it is answered vLLM's 404.
  Whenever versions leave, the API server tells every worker which versions it still keeps
  (``collective_rpc`` :data:`~rollout.engines.vllm.worker.adapter_source.KEEP_RPC`, numbered so that
  a late message never undoes a newer one); the workers keep exactly those in memory, so a pinned
  version vLLM's LRU evicted is registered again from memory when its request is next scheduled;
- ``GET /v1/models`` lists ``<a>@v<N>`` for each version in the window and ``<a>`` (its ``root``
  is the path of the version it names).

A load whose name is not ``<a>@v<N>`` of its path is refused 400 before anything reaches the
engine; a load the workers refuse answers vLLM's error (500 with the p2psync class first in the
message, or 404 for a version the adapter's node does not hold) and changes no name. vLLM 0.32
has no hook for this (a resolver plugin runs only for names never seen, and ``load_inplace``
would swap the weights under running requests), hence the wrap; paths other than ``p2psync:``
are left to vLLM as they were.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from http import HTTPStatus
from typing import Any

from p2psync.errors import ConfigError
from rollout.engines.vllm.pins import Pins, kept
from rollout.engines.vllm.worker.adapter_source import KEEP_RPC, parse_path, served_name, window

logger = logging.getLogger(__name__)

PINS = Pins()
"""Requests in flight per adapter version in this API server."""
_served: dict[str, Any] = {}
"""adapter -> the ``OpenAIServingModels`` that names its versions."""
_seq = itertools.count(1)
_tasks: set[asyncio.Task[Any]] = set()


def install() -> bool:
    """Wrap vLLM's ``OpenAIServingModels`` (see module doc; idempotent). False where this vLLM has
    no such class (then ``p2psync:`` paths load, but no alias and no window are kept)."""
    try:
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    except ImportError:
        return False
    load = OpenAIServingModels.load_lora_adapter
    if getattr(load, "_p2psync", False):
        return True
    show = OpenAIServingModels.show_available_models

    async def load_lora_adapter(self: Any, request: Any, base_model_name: str | None = None) -> Any:
        try:
            where = parse_path(str(request.lora_path or ""))
        except ConfigError as exc:  # the client's path
            return _bad_request(str(exc))
        if where is None:
            return await load(self, request, base_model_name)
        adapter, version = where
        want = served_name(adapter, version)
        if request.lora_name != want:
            return _bad_request(f"lora_name {request.lora_name!r}: a p2psync adapter version is served as "
                                f"<adapter>@v<version>, here {want!r}")
        if getattr(request, "load_inplace", False):
            return _bad_request("load_inplace: a p2psync adapter version is never replaced in place "
                                "(load the next version under its own name)")
        got = await load(self, request, base_model_name)
        if isinstance(got, str):  # loaded
            _served[adapter] = self
            keep, _ = _settle(self, adapter)
            await _tell_workers(self.engine_client, adapter, keep)
        return got

    async def show_available_models(self: Any) -> Any:
        listing = await show(self)
        # vLLM names each card by the request's lora_name: the alias would repeat its version's card.
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

        base = [c for c in listing.data if c.parent is None]
        listing.data = base + [
            ModelCard(id=name, root=lora.path, parent=lora.base_model_name or self.base_model_paths[0].name,
                      permission=[ModelPermission()])
            for name, lora in self.lora_requests.items()]
        return listing

    load_lora_adapter._p2psync = True  # type: ignore[attr-defined]
    OpenAIServingModels.load_lora_adapter = load_lora_adapter  # type: ignore[method-assign]
    OpenAIServingModels.show_available_models = show_available_models  # type: ignore[method-assign]
    _pin_requests()
    return True


def _pin_requests() -> None:
    """Wrap ``AsyncLLM.generate`` (every request the API server runs) to pin its adapter version."""
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        return
    if not getattr(AsyncLLM.generate, "_p2psync", False):
        AsyncLLM.generate = pinning(AsyncLLM.generate)  # type: ignore[method-assign]


def pinning(generate: Any) -> Any:
    """``generate`` (an async-generator method taking ``lora_request=``) that pins the p2psync
    adapter version a request names from its start to its end, and lets the version go then."""

    async def pinned_generate(self: Any, *args: Any, lora_request: Any = None, **kw: Any) -> Any:
        try:
            where = parse_path(str(getattr(lora_request, "lora_path", "") or ""))
        except ConfigError:
            where = None
        if where is None:
            async for out in generate(self, *args, lora_request=lora_request, **kw):
                yield out
            return
        adapter, version = where
        models = _served.get(adapter)
        if models is not None and served_name(adapter, version) not in models.lora_requests:
            # Named when the request was read, gone by the time it starts: as if never named.
            from vllm.exceptions import VLLMNotFoundError

            raise VLLMNotFoundError(f"The model `{served_name(adapter, version)}` does not exist.")
        PINS.start(adapter, version)
        try:
            async for out in generate(self, *args, lora_request=lora_request, **kw):
                yield out
        finally:
            if PINS.finish(adapter, version) and models is not None:
                keep, dropped = _settle(models, adapter)
                if dropped:  # the version this request held left: the workers may drop it too
                    task = asyncio.get_running_loop().create_task(
                        _tell_workers(self, adapter, keep), name=f"p2psync-keep-{adapter}")
                    _tasks.add(task)
                    task.add_done_callback(_tasks.discard)

    pinned_generate._p2psync = True  # type: ignore[attr-defined]
    return pinned_generate


def _settle(models: Any, adapter: str) -> tuple[list[int], bool]:
    """Point ``adapter`` at its newest version and drop the names of versions neither in the window
    nor pinned. Returns the versions kept and whether any name was dropped."""
    versions = sorted(v for name, lora in models.lora_requests.items()
                      if name != adapter and (v := _version_of(lora, adapter)) is not None)
    keep = kept(versions, window(), PINS.pinned(adapter))
    for old in set(versions) - set(keep):
        models.lora_requests.pop(served_name(adapter, old), None)
    newest = versions[-1]
    models.lora_requests[adapter] = models.lora_requests[served_name(adapter, newest)]
    logger.info("p2psync: adapter %s serves version %d (named: %s; pinned by requests in flight: %s)", adapter,
                newest, [served_name(adapter, v) for v in keep], sorted(PINS.pinned(adapter)))
    return keep, len(keep) < len(versions)


async def _tell_workers(engine: Any, adapter: str, keep: list[int]) -> None:
    """Every worker keeps exactly ``keep`` of ``adapter``'s versions older than its newest (see
    module doc); a failure is logged (the workers then keep more, never less)."""
    try:
        await engine.collective_rpc(KEEP_RPC, args=(adapter, keep, next(_seq)))
    except Exception:  # the versions stay in the workers' memory; nothing a request runs on is lost
        logger.exception("p2psync: could not tell the workers which versions of %s to keep", adapter)


def _version_of(lora: Any, adapter: str) -> int | None:
    try:
        where = parse_path(str(lora.lora_path))
    except ConfigError:  # not a path of ours
        return None
    return where[1] if where is not None and where[0] == adapter else None


def _bad_request(message: str) -> Any:
    from vllm.entrypoints.serve import create_error_response

    return create_error_response(message=message, err_type="InvalidUserInput", status_code=HTTPStatus.BAD_REQUEST)
