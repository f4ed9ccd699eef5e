"""The signed segment index of a delta: per chunk, ``(tensor, start, stop)`` of each of its segments.

Written into the manifest by :func:`p2psync.artifact.build_manifest` and read by
tensor-parallel ranks that fetch only their slice (:mod:`p2psync.codec.slices`,
``rollout.engines.vllm.apply.slices``). Chunk hashes are signed already; the index is
signed with them, and a rank checks that every chunk it fetches holds exactly
the segments the index gives it.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2psync.codec.decode import split_chunk
from p2psync.codec.segment import _HEAD
from p2psync.errors import SegmentIndexError
from p2psync.state import TensorSpec

Index = tuple[tuple[int, ...], ...]
"""Per chunk: ``tensor, start, stop`` of each segment, flat, in the chunk's order."""


def chunk_entries(chunk: bytes | memoryview) -> tuple[int, ...]:
    """The index entry of ``chunk``: ``tensor, start, stop`` of each of its segments."""
    out: list[int] = []
    for seg in split_chunk(chunk):
        if len(seg) < _HEAD.size:
            raise SegmentIndexError("segments", "a chunk holds a segment shorter than its header")
        _, t, start, stop = _HEAD.unpack_from(seg)
        out += (t, start, stop)
    return tuple(out)


def index_of(chunks: Sequence[bytes | memoryview]) -> Index:
    """The index of an artifact's chunks (what the manifest signs)."""
    return tuple(chunk_entries(c) for c in chunks)


def parse_index(raw: object, tensors: Sequence[TensorSpec], n_chunks: int) -> Index:
    """A manifest's ``segments`` field, checked: one entry per chunk, whole triples, known tensors,
    ranges inside their tensor, and no two segments of one tensor overlapping."""
    if not isinstance(raw, list) or len(raw) != n_chunks:
        raise SegmentIndexError("segments", f"must list one entry per chunk ({n_chunks})")
    out = []
    spans: dict[int, list[tuple[int, int]]] = {}
    for i, e in enumerate(raw):
        if not (isinstance(e, list) and len(e) % 3 == 0
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in e)):
            raise SegmentIndexError("segments", f"entry of chunk {i} is not a list of (tensor, start, stop)")
        for k in range(0, len(e), 3):
            t, s, stop = e[k:k + 3]
            if t >= len(tensors) or not s < stop <= tensors[t].numel:
                raise SegmentIndexError("segments", f"chunk {i} names tensor #{t} range [{s}, {stop}), outside "
                                        "the tensor table")
            spans.setdefault(t, []).append((s, stop))
        out.append(tuple(e))
    for t, ss in spans.items():
        ss.sort()
        if any(b[0] < a[1] for a, b in zip(ss, ss[1:])):
            raise SegmentIndexError("segments", f"segments of tensor {tensors[t].name!r} overlap")
    return tuple(out)


def check_chunk(index: Index, i: int, chunk: bytes | memoryview) -> None:
    """Raise :class:`SegmentIndexError` unless chunk ``i`` holds exactly the segments ``index`` gives it."""
    if chunk_entries(chunk) != index[i]:
        raise SegmentIndexError("segments", f"chunk {i} does not hold the segments the signed index gives it")
