"""Between a sharded publisher's ranks: each rank's part of a version to rank 0, chunk by chunk, and
rank 0's outcome back to every rank still there.

Point to point over the publisher's gloo group. From each rank ``r > 0`` to rank 0, in order, a
stream of messages, each an int64 header then its bytes: a header ``n >= 0`` is one chunk of ``n``
bytes; a header ``n < 0`` is the rest of the part (its :class:`~trainer.shard_io.Part` without
chunks, pickled, ``-n`` bytes), which ends the stream. Rank 0 takes one message from each rank in
turn, its own next chunk among them, so that every rank encodes its next chunk while rank 0 takes
the others'. A rank holds one chunk in flight beyond what it keeps, never its whole part packed
and pickled: for version 0 (a raw snapshot of the rank's share) that copy would otherwise sit
beside the rank's CPU copy of its share, and then be copied again to be sent.

Losing a rank: a rank whose process dies (gloo reports the closed connection) or that stays silent
past the group's timeout is a failed part on rank 0 (``rank r: lost during the exchange``); rank 0
takes the other ranks' streams to their end, so no rank is left blocked on a send, and then tells
each rank still there the version's outcome point to point (a broadcast would wait on the lost
rank). A rank that cannot reach rank 0 raises the transport's error to its caller.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import torch

from p2psync.codec.segment import SegmentStats

logger = logging.getLogger(__name__)

_HEADER = 8


@dataclass
class Part:
    """One rank's share of one version: chunks plus fingerprint contributions."""

    chunks: list[bytes]
    sums: dict[int, tuple[int, int]]
    """Snapshot: absolute sums per tensor; delta: sum changes per tensor."""
    changed: dict[int, int]
    stats: SegmentStats
    streams: dict[int, list[bytes]] = field(default_factory=dict)
    """Changes of strided pieces, per tensor, for rank 0 to encode (:mod:`trainer.strided`)."""
    error: str | None = None
    """Set when this rank failed this version: rank 0 publishes nothing and every rank stops."""


@dataclass
class Gathered:
    """What rank 0 took in: every rank's part in rank order (a lost rank's carries its error)."""

    parts: list[Part]
    lost: set[int]
    """Ranks lost during the exchange (told nothing afterwards)."""
    received: int
    """Bytes received from the other ranks, headers included."""
    error: BaseException | None = None
    """What iterating rank 0's own chunks raised (also in ``parts[0].error``)."""


def _send(data: bytes | bytearray, n: int, dst: int, group: Any) -> int:
    import torch.distributed as dist

    dist.send(torch.tensor([n], dtype=torch.int64), dst=dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst, group=group)
    return _HEADER + len(data)


def _recv(src: int, group: Any) -> tuple[int, bytes]:
    import torch.distributed as dist

    head = torch.zeros(1, dtype=torch.int64)
    dist.recv(head, src=src, group=group)
    n = int(head.item())
    if n == 0:
        return 0, b""
    buf = torch.empty(abs(n), dtype=torch.uint8)
    dist.recv(buf, src=src, group=group)
    return n, buf.numpy().tobytes()


def _own(part: Part, more: Iterable[bytes]) -> Iterator[bytes]:
    return chain(list(part.chunks), more)


def send_part(part: Part, more: Iterable[bytes], rank: int, group: Any) -> tuple[int, BaseException | None]:
    """A rank ``> 0``: send ``part.chunks`` then ``more`` (consumed as sent), then the rest of ``part``.

    If iterating ``more`` raises, the part is sent as failed (its ``error`` set) with what was sent so
    far, and the exception is returned beside the bytes sent. A failed send raises."""
    import torch.distributed as dist

    root = dist.get_global_rank(group, 0)
    sent = 0
    failure: BaseException | None = None
    chunks = _own(part, more)
    while True:
        try:
            chunk = next(chunks)
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 - rank 0 learns it from the part; the caller raises it
            failure = exc
            part.error = f"rank {rank}: {exc!r}"
            break
        sent += _send(chunk, len(chunk), root, group)
    blob = pickle.dumps(replace(part, chunks=[]), protocol=pickle.HIGHEST_PROTOCOL)
    sent += _send(blob, -len(blob), root, group)
    return sent, failure


def gather_parts(part: Part, more: Iterable[bytes], world: int, group: Any) -> Gathered:
    """Rank 0: its own part (``part.chunks`` then ``more``) and every other rank's stream, one message
    from each in turn (see module doc)."""
    import torch.distributed as dist

    own = _own(part, more)
    chunks: dict[int, list[bytes]] = {r: [] for r in range(world)}
    parts: dict[int, Part] = {}
    lost: set[int] = set()
    received = 0
    failure: BaseException | None = None
    active = list(range(world))
    while active:
        for r in list(active):
            if r == 0:
                try:
                    chunks[0].append(next(own))
                    continue
                except StopIteration:
                    pass
                except Exception as exc:  # noqa: BLE001 - every rank learns it through the outcome
                    failure = exc
                    part.error = f"rank 0: {exc!r}"
                parts[0] = replace(part, chunks=chunks[0])
                active.remove(0)
                continue
            try:
                n, data = _recv(dist.get_global_rank(group, r), group)
            except Exception as exc:  # noqa: BLE001 - that rank is lost; the others' streams go on
                logger.error("rank %d lost during the exchange: %r", r, exc)
                parts[r] = Part([], {}, {}, SegmentStats(), error=f"rank {r}: lost during the exchange ({exc})")
                lost.add(r)
                active.remove(r)
                chunks[r].clear()
                continue
            received += _HEADER + len(data)
            if n >= 0:
                chunks[r].append(data)
                continue
            rest = pickle.loads(data)
            parts[r] = replace(rest, chunks=chunks[r])
            active.remove(r)
    return Gathered([parts[r] for r in range(world)], lost, received, failure)


def tell(value: Any, world: int, group: Any, lost: set[int]) -> None:
    """Rank 0: ``value`` (small, picklable) to every rank but those ``lost``; a rank that cannot be told
    is logged (it learns from its own transport error)."""
    import torch.distributed as dist

    blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    for r in range(1, world):
        if r in lost:
            continue
        try:
            _send(blob, len(blob), dist.get_global_rank(group, r), group)
        except Exception as exc:  # noqa: BLE001 - that rank raises its own transport error
            logger.error("could not tell rank %d the outcome: %r", r, exc)


def hear(group: Any) -> Any:
    """A rank ``> 0``: the value rank 0 :func:`tell` s (the transport's error if rank 0 is gone)."""
    import torch.distributed as dist

    _, data = _recv(dist.get_global_rank(group, 0), group)
    return pickle.loads(data)
