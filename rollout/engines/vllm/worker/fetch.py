"""The vLLM backend's fetch from its p2psync parent: the leaf fetch of :mod:`p2psync.transport.leaf`
(signed manifests, verified chunks, one kept client), each refusal named by the ``init_info`` /
``update_info`` field that caused it, and :func:`decoding`, which hands each verified chunk to a
:class:`~rollout.engines.vllm.apply.stream.Streamed` decode while later chunks are on the wire.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from p2psync import workers
from p2psync.transport.fetch import Pipeline
from p2psync.transport.leaf import NoCatchup, NothingPublished, OnChunk, Parent, check_key, fetch_artifact, fetch_plan
from rollout.engines.vllm.worker.infos import TransferInfoError

if TYPE_CHECKING:
    from p2psync.artifact import Manifest
    from p2psync.transport.client import PeerClient
    from rollout.engines.vllm.apply.stream import Streamed

T = TypeVar("T")


async def plan_to(parent: Parent, current: int | None, target: int, client: PeerClient | None = None,
                  in_flight: bool = False) -> list[Any]:
    """:func:`~p2psync.transport.leaf.fetch_plan`, a missing chain refused as ``update_info.version``."""
    try:
        return await fetch_plan(parent, current, target, client, in_flight)
    except NoCatchup as exc:
        raise TransferInfoError("update_info.version", str(exc)) from None


async def key_checked(parent: Parent, client: PeerClient | None = None) -> int:
    """:func:`~p2psync.transport.leaf.check_key` (what an init without ``version`` checks, so that a
    wrong key is refused at init, not at the first update), a parent with nothing published
    refused as ``init_info.url``."""
    try:
        return await check_key(parent, client)
    except NothingPublished as exc:
        raise TransferInfoError("init_info.url", f"{exc} (init again once it has one)") from None


async def decoding(stream: Streamed, source: Callable[[OnChunk], Awaitable[T]], threads: int,
                   cpus: set[int] | None = None) -> T:
    """``await source(on_chunk)`` (a fetch that calls ``on_chunk(i, data)`` with each chunk once
    its hash matched), each chunk decoded into ``stream`` on ``threads`` worker threads as it
    arrives. Returns once every decode ended; raises the fetch's failure, else the first decode's
    (with every decode in flight ended first)."""
    with workers.pool(threads, cpus, "p2psync-decode") as pool:
        pipe = Pipeline(stream.add, max(1, threads) + 2, pool)
        try:
            got = await source(pipe.submit)
        except BaseException:
            try:
                await pipe.drain()
            except BaseException:  # noqa: BLE001 - the fetch's failure is the one raised
                pass
            raise
        await pipe.drain()
    return got


def fetch_decoding(fetching: Callable[..., Any], parent: Parent, aid: str, manifest: Manifest,
                   need: list[int] | None, stream: Streamed | None) -> list[Any]:
    """The chunks of ``aid`` this rank needs (``need``; the others None), fetched from ``parent``
    through ``fetching(call)`` (the backend's kept client), each checked against ``manifest``; with
    ``stream``, each decoded into it as it arrives."""
    def fetch(client: Any, on_chunk: OnChunk | None = None) -> Any:
        return fetch_artifact(parent, aid, manifest=manifest, need=need, on_chunk=on_chunk, client=client)

    if stream is None:
        return list(fetching(fetch)[1])
    live = stream.live
    return list(fetching(lambda c: decoding(stream, lambda on_chunk: fetch(c, on_chunk), live.threads,
                                            live.cpus))[1])
