"""One tensor-parallel rank's slice of a delta: which chunks it fetches, which segments it decodes.

The trainer cuts and orders a delta's segments so that a column-parallel or
vocab-parallel rank's rows are whole segments, and signs an index of every
chunk's segments (:mod:`p2psync.codec.slices`). From that index and its
placements (:mod:`rollout.engines.vllm.placement.boxes`) a rank classifies every
segment (:func:`plan`):

- **not needed**: it holds none of the segment's elements (another rank's rows or
  experts); the chunk is fetched only if another of its segments is needed;
- **local**: it holds every element of the range (a tensor held whole, replicated
  or not, or a segment inside its own rows): decoded against its own words, on
  the update's threads, with no collective;
- **gathered**: it holds part of the range (a row of a row-parallel weight spans
  every rank's columns): the ranks rebuild the range together
  (:func:`rollout.engines.vllm.apply.ranks.gather_ranges`), and one rank decodes it for the
  group: the rank whose row block (rows ``[r R/N, (r+1) R/N)`` of the tensor's ``R``
  rows at ``N`` ranks, the blocks the trainer cuts at) holds the segment. Only that
  rank fetches its chunk; after the decode the ranks swap the changes, so each rank
  writes those in its own columns. A segment in no single row block is fetched and
  decoded by every rank holding part of it. Every rank learns the set of gathered
  segments from a sum over the ranks, so their collectives stay in step.

Each rank counts towards the fingerprint the changes at the positions it owns (its
placement is ``counted``), so the ranks' sums are the trainer's fingerprint, and
the verify-then-commit of :class:`~rollout.engines.vllm.apply.weights.LiveWeights` is
unchanged. A manifest with no index (written before the index existed) is
fetched whole, and its index is read from the chunks themselves. A fetched chunk
that does not hold exactly the segments the signed index gives it is refused
(:class:`~p2psync.errors.SegmentIndexError`) before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from p2psync import wordops
from p2psync.codec import slabs
from p2psync.codec.decode import split_chunk
from p2psync.codec.segindex import Index, index_of
from p2psync.errors import CodecError, SegmentIndexError, WrongBase
from p2psync.workers import run_ordered
from rollout.engines.vllm.placement.boxes import Family, Placement
from rollout.engines.vllm.apply.ranks import RankRefused, gather_ranges

if TYPE_CHECKING:
    from p2psync.artifact import Manifest

LiveWeights = Any
"""A :class:`rollout.engines.vllm.apply.weights.LiveWeights` (which imports this module)."""

MASK64 = 0xFFFFFFFFFFFFFFFF


def _below(dims: tuple[tuple[int, int, int], ...], rel: np.ndarray) -> np.ndarray:
    """Elements of one block (dims outermost first, nested checkpoint strides) at offsets ``< rel``."""
    if not dims:
        return (rel > 0).astype(np.int64)
    size, cs, _ = dims[0]
    inner = int(np.prod([s for s, _, _ in dims[1:]])) if len(dims) > 1 else 1
    q = np.floor_divide(rel, max(1, cs))
    inside = (q >= 0) & (q < size)
    out = np.clip(q, 0, size) * inner
    if inside.any():
        out[inside] += _below(dims[1:], rel[inside] - q[inside] * cs)
    return out


def _family_below(f: Family, x: int) -> int:
    """Elements of family ``f`` at checkpoint positions ``< x``."""
    extent = 1 + sum((s - 1) * cs for s, cs, _ in f.dims)
    lo = int(np.searchsorted(f.ck, x - extent, side="right"))  # blocks ending at or before x: whole
    hi = int(np.searchsorted(f.ck, x, side="left"))  # blocks starting at or after x: none
    n = lo * f.block
    if hi > lo:
        n += int(_below(f.dims, x - f.ck[lo:hi]).sum())
    return n


def held_in(place: Placement | None, start: int, stop: int) -> int:
    """How many checkpoint elements of ``[start, stop)`` this rank holds in ``place``."""
    if place is None:
        return 0
    if place.whole:
        return stop - start
    return sum(_family_below(f, stop) - _family_below(f, start) for f in place.families)


@dataclass(frozen=True)
class SegmentRef:
    """One segment of the index, as this rank sees it."""

    chunk: int
    tensor: int
    start: int
    stop: int
    need: bool
    """This rank fetches and decodes it: it holds some of its elements, or decodes it for the group."""
    local: bool
    """This rank holds all of them (decoded alone)."""
    partial: bool = False
    """This rank holds some of its elements, not all (its range is rebuilt with the group; its
    placement is then not whole, so the tensor is sharded)."""
    decoder: int | None = None
    """The rank that decodes it for the group when it is gathered (None: every rank holding part of it)."""


def decoder_of(spec: Any, start: int, stop: int, size: int) -> int | None:
    """The rank whose block of rows (``N`` = ``size`` equal blocks of dimension 0) holds elements
    ``[start, stop)`` of ``spec``, if one does."""
    if size < 2 or len(spec.shape) < 2 or spec.shape[0] % size:
        return None
    block = spec.numel // size
    first, last = start // block, (stop - 1) // block
    return int(first) if first == last else None


def plan(live: LiveWeights, index: Index) -> list[SegmentRef]:
    """Every segment of ``index`` (chunk order), classified for this rank (module doc); the last
    plan is kept on ``live`` (the fetch and the decode of one artifact ask for the same)."""
    kept = live.slice_plan
    if kept is not None and kept[0] is index:
        return kept[1]
    out = []
    for i, entry in enumerate(index):
        for k in range(0, len(entry), 3):
            t, s, e = entry[k:k + 3]
            if t >= len(live.specs):
                raise SegmentIndexError("segments", f"chunk {i} names tensor #{t}, the table has {len(live.specs)}")
            place = live.places[t]
            h = held_in(place, s, e)
            whole = h == e - s
            dec = decoder_of(live.specs[t], s, e, live.group.size) if live.sharded[t] and not whole else None
            need = h > 0 if dec is None else dec == live.group.rank
            out.append(SegmentRef(i, t, s, e, need, whole, 0 < h < e - s, dec))
    live.slice_plan = (index, out)
    return out


def outputs() -> slabs.Arena:
    """Where one update's decoded positions and new words go: memory of that update's own, in huge
    pages where the kernel gives them, given back once its changes are committed or refused
    (:class:`~p2psync.codec.slabs.Arena` ``fresh``). Ten bytes per change are far more than is worth
    keeping between updates (226 MB for the 533 M workload's 22.6 M changes); taken in 4 KiB pages,
    that fresh memory cost a first update 57,000 page faults more than a repeated one, whose
    allocator gave back the memory the first had freed."""
    return slabs.Arena(fresh=True)


def chunks_needed(live: LiveWeights, manifest: Manifest) -> list[int] | None:
    """The chunks this rank needs of ``manifest`` (None: all of them, as with a manifest with no index)."""
    if manifest.kind != "delta" or not manifest.segments:
        return None
    return sorted({r.chunk for r in plan(live, manifest.segments) if r.need})


def decode(live: LiveWeights, manifest: Manifest, chunks: Sequence[bytes | memoryview | None]
           ) -> tuple[dict[int, list[tuple[np.ndarray, np.ndarray]]], list[tuple[int, int]]]:
    """:meth:`LiveWeights.decode <rollout.engines.vllm.apply.weights.LiveWeights.decode>` of this rank's slice:
    ``chunks`` holds every chunk this rank needs (None for the others)."""
    live.check_manifest(manifest)
    if manifest.kind != "delta":
        raise CodecError(f"expected a delta, got a {manifest.kind}")
    if live.fingerprint != manifest.base_fingerprint:
        raise WrongBase(str(manifest.base_fingerprint), live.fingerprint, manifest.base_version)
    if len(chunks) != len(manifest.chunks):
        raise CodecError(f"{len(chunks)} of {len(manifest.chunks)} chunks given")
    group = live.group
    failed: Exception | None = None
    refs: list[SegmentRef] = []
    heads: dict[int, Any] = {}
    try:
        refs, heads = _heads(live, manifest, chunks)
    except Exception as exc:
        failed = exc
    if group.size > 1:
        # Rebuilding a range is a collective: every rank must see the same segments.
        agreed = group.first(len(refs)) == len(refs)
        if not group.all_true(failed is None and agreed):
            raise failed or RankRefused("the tensor-parallel ranks were given different deltas")
        flags = group.sum_u64([1 if r.partial else 0 for r in refs])
        gathered = [k for k, f in enumerate(flags) if f]
    elif failed is not None:
        raise failed
    else:
        gathered = []
    skip = set(gathered)
    alone = sorted((k for k, r in enumerate(refs) if r.need and k not in skip), key=lambda k: -len(heads[k].raw))
    arena = outputs()
    out, _, err = run_ordered(len(alone), list(range(len(alone))),
                              lambda j: live.decode_segment(heads[alone[j]], out=arena),
                              min(live.threads, max(1, len(alone))), live.cpus)
    results: list[Any] = [o for o in out if o is not None]
    counted = [(o[0], o[4]) for o in results if live.counts(o[0])]
    g_out, received, g_err = decode_gathered(live, refs, heads, gathered, arena)
    err = err or g_err
    if err is not None:
        raise err
    results += [o for o, _ in g_out]
    counted += [(o[0], ab) for o, ab in g_out if ab is not None]
    return assembled(live, results, counted, received)


def assembled(live: LiveWeights, results: list[Any], counted: list[tuple[int, tuple[int, int]]],
              received: Sequence[Any] = ()
              ) -> tuple[dict[int, list[tuple[np.ndarray, np.ndarray]]], list[tuple[int, int]]]:
    """``(changes, sums)`` from the decoded segments (``(tensor, range, positions, new words, _)``;
    ``received``: those other ranks decoded for the group) and the sums' changes this rank counts:
    the group's sums, segments checked not to overlap."""
    delta = [(0, 0)] * len(live.specs)
    for t, (da, db) in counted:
        delta[t] = ((delta[t][0] + int(da)) & MASK64, (delta[t][1] + int(db)) & MASK64)
    summed = live.group_sums(delta)
    sums = [((a[0] + d[0]) & MASK64, (a[1] + d[1]) & MASK64) for a, d in zip(live.sums, summed)]
    by: dict[int, list[tuple[tuple[int, int], np.ndarray, np.ndarray]]] = {}
    for t, span, pos, new, _ in list(results) + list(received):
        by.setdefault(t, []).append((span, pos, new))
    changes: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for t, parts in by.items():
        parts.sort(key=lambda x: x[0])
        for x, y in zip(parts, parts[1:]):
            if y[0][0] < x[0][1]:  # positions are distinct inside a segment; segments must not overlap
                raise CodecError(f"segments of {live.specs[t].name} overlap")
        # One part per segment, not concatenated: no second copy of the changes.
        changes[t] = [(pos.astype(np.int64, copy=False), new) for _, pos, new in parts]
    live.decoded = len(results)
    return changes, sums


def _heads(live: LiveWeights, manifest: Manifest, chunks: Sequence[bytes | memoryview | None]
           ) -> tuple[list[SegmentRef], dict[int, Any]]:
    """The classified segments and the parsed heads of those this rank needs (index order), each
    fetched chunk checked against the signed index."""
    signed = bool(manifest.segments)
    if not signed and any(c is None for c in chunks):
        raise CodecError("a delta with no segment index needs every chunk")
    split = {i: split_chunk(c) for i, c in enumerate(chunks) if c is not None}
    index: Index = manifest.segments if signed else index_of([c for c in chunks if c is not None])
    refs = plan(live, index)
    first = np.cumsum([0] + [len(e) // 3 for e in index]).tolist()
    heads: dict[int, Any] = {}
    for i, segs in split.items():
        heads.update(chunk_heads(live, index, refs, first, i, segs))
    missing = next((r.chunk for k, r in enumerate(refs) if r.need and k not in heads), None)
    if missing is not None:
        raise CodecError(f"chunk {missing} holds segments this rank needs and was not given")
    return refs, heads


def chunk_heads(live: LiveWeights, index: Index, refs: list[SegmentRef], first: list[int], i: int,
                 segs: list[memoryview]) -> dict[int, Any]:
    """The parsed heads of the segments of chunk ``i`` (``segs``) this rank needs, by their place in
    the index; the chunk checked against the signed index."""
    if len(segs) * 3 != len(index[i]):
        raise SegmentIndexError("segments", f"chunk {i} holds {len(segs)} segments, the signed index "
                                f"gives it {len(index[i]) // 3}")
    heads: dict[int, Any] = {}
    for j, seg in enumerate(segs):
        k = first[i] + j
        r = refs[k]
        p = live.segment_head(seg)
        if (p.tensor, p.start, p.stop) != (r.tensor, r.start, r.stop):
            raise SegmentIndexError("segments", f"chunk {i} does not hold the segments the signed index "
                                    "gives it")
        if r.need:
            heads[k] = p
    return heads


_GATHER_WORDS = 1 << 22
"""Words of the ranges rebuilt by one collective (the last batch and the one being decoded are held)."""


def decode_gathered(live: LiveWeights, refs: list[SegmentRef], heads: dict[int, Any], gathered: list[int],
                    arena: slabs.Arena | None = None
                    ) -> tuple[list[tuple[Any, tuple[int, int] | None]], list[Any], Exception | None]:
    """Rebuild the gathered ranges with the group (the same batches, in the same order, on every
    rank: one collective per :data:`_GATHER_WORDS` of ranges) and decode each this rank needs (those
    it decodes for the group, or every one it holds part of when no one rank decodes it), on the
    update's threads while the next batch is rebuilt; each result with the sums' change it brings
    (of every change when this rank decodes it for the group, else of those it owns; None where
    that is none). Then the ranks swap what they decoded for the group (one more collective): the
    results other ranks decoded come second. Results and the error are those of decoding in index
    order, stopping at the first failure; after a failure the remaining ranges are still rebuilt
    (not decoded) and the swap still made, so the ranks' collectives stay in step. Decoded
    positions and new words are cut from ``arena`` (the update's :func:`outputs`) when given."""
    import concurrent.futures

    from p2psync.workers import pool as pinned_pool

    def one(k: int, base: np.ndarray) -> tuple[Any, tuple[int, int] | None]:
        r = refs[k]
        place = live.places[r.tensor]
        res = live.decode_segment(heads[k], base, arena)
        ab = None
        if r.decoder is not None:  # decoded once, for the group: every change counts here
            ab = (int(res[4][0]), int(res[4][1]))
        elif place is not None and place.counted:
            pos, new = res[2], res[3]
            which, _ = place.local(pos)
            a, b = wordops.hash_change(pos[which], base[pos[which] - r.start], new[which],
                                       np.uint64(live.seeds[r.tensor]))
            ab = (int(a), int(b))
        return res, ab

    batches: list[list[int]] = [[]]
    words = 0
    for k in gathered:
        n = refs[k].stop - refs[k].start
        if batches[-1] and words + n > _GATHER_WORDS:
            batches.append([])
            words = 0
        batches[-1].append(k)
        words += n
    out: list[tuple[Any, tuple[int, int] | None]] = []
    err: list[Exception] = []

    def collect(futures: list[concurrent.futures.Future[tuple[Any, tuple[int, int] | None]]]) -> None:
        for f in futures:
            try:
                got = f.result()
            except Exception as exc:
                err.append(exc)
            else:
                if not err:
                    out.append(got)

    with pinned_pool(live.threads, live.cpus, "p2psync-gathered") as pool:
        pending: list[concurrent.futures.Future[tuple[Any, tuple[int, int] | None]]] = []
        for batch in batches:
            bases = rebuilt(live, [(refs[k].tensor, refs[k].start, refs[k].stop) for k in batch])
            collect(pending)  # at most this batch and the last one held
            pending = [] if err else [pool.submit(one, k, base) for k, base in zip(batch, bases) if refs[k].need]
        collect(pending)
    for_group = {(refs[k].tensor, refs[k].start) for k in gathered if refs[k].decoder is not None}
    received = _swap(live, [] if err else [o for o, _ in out if (o[0], o[1][0]) in for_group]) \
        if live.group.size > 1 and for_group else []
    return out, received, (err[0] if err else None)


def _empty(word: Any) -> Any:
    """A binding of no words of ``word``'s size (a rank holding none of a range adds nothing)."""
    import torch

    return torch.empty(0, dtype={1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[np.dtype(word).itemsize])


def rebuilt(live: LiveWeights, ranges: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
    """Checkpoint words ``[start, stop)`` of sharded tensor ``t`` for each ``(t, start, stop)``,
    rebuilt with the group (:func:`~rollout.engines.vllm.apply.ranks.gather_ranges`; every rank calls
    it with the same ranges). A tensor vLLM converts at load (``live.rebuild_casts``, known to every
    rank) is rebuilt as checkpoint words too: a rounded one from each rank's kept box of it
    (:class:`~rollout.engines.vllm.apply.kept.Kept`, checked against the live words first; one host
    collective of their own), a widened one as live words, read back exactly after the sum."""
    import torch

    plain: list[int] = []
    kept_ones: list[int] = []
    for k, (t, _, _) in enumerate(ranges):
        cast = live.rebuild_casts[t]
        (kept_ones if cast is not None and not cast.readable else plain).append(k)
    out: list[np.ndarray] = [np.empty(0)] * len(ranges)
    args = []
    for k in plain:
        t, start, stop = ranges[k]
        cast, flat, word = live.rebuild_casts[t], live.flat[t], live.word_types[t]
        if cast is not None:  # widened: rebuilt as live words, each owned by one rank
            word = cast.live
            if live.places[t] is None:
                flat = _empty(word)
        args.append((live.places[t], flat, start, stop, word))
    for k, got in zip(plain, gather_ranges(live.group, args)):
        t = ranges[k][0]
        cast = live.rebuild_casts[t]
        out[k] = got if cast is None else cast.to_checkpoint(got, live.specs[t].name)
    args = []
    for k in kept_ones:
        t, start, stop = ranges[k]
        kept, place, word = live.kept[t], live.places[t], live.word_types[t]
        if kept is None or place is None:  # this rank holds none of it
            args.append((None, _empty(word), start, stop, word))
            continue
        ck = np.arange(start, stop, dtype=np.int64)
        which, dst = place.local(ck)
        if which.shape[0]:  # the check every read of kept words makes: they round to the live words
            live.checkpoint_words(t, live.live_at(t, dst), ck[which])
        signed = kept.words.view(np.dtype(f"<i{kept.words.itemsize}"))
        args.append((kept.placement(place), torch.from_numpy(signed), start, stop, word))
    for k, got in zip(kept_ones, gather_ranges(live.group, args)):
        out[k] = got
    return out


def _swap(live: LiveWeights, mine: list[Any]) -> list[Any]:
    """Send each other rank the changes of ``mine`` (segments this rank decoded for the group) at the
    positions that rank holds, and return those the others sent this rank (one collective round per
    rank; every rank calls it). The ranks' placements of the sharded tensors are swapped once, at the
    first call, to know who holds what."""
    group = live.group
    if live.peer_places is None:
        live.peer_places = group.objects({t: live.places[t] for t, sh in enumerate(live.sharded) if sh})
    outgoing: list[list[Any]] = [[] for _ in range(group.size)]
    for t, span, pos, new, _ in mine:
        # Positions travel as offsets in their segment: 4 bytes, not 8, where it spans < 2**32 elements.
        rel_type = np.uint32 if span[1] - span[0] < 1 << 32 else np.int64
        for q, theirs in enumerate(live.peer_places):
            place = theirs.get(t) if q != group.rank else None
            if place is not None:
                which, _ = place.local(pos)
                if which.shape[0]:
                    outgoing[q].append((t, span, (pos[which] - span[0]).astype(rel_type), new[which]))
    received: list[Any] = []
    for q, theirs in enumerate(group.exchange(outgoing)):
        if q != group.rank:
            received += [(t, span, rel.astype(np.int64) + span[0], new, None) for t, span, rel, new in theirs]
    return received
