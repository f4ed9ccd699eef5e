"""Memory for decoded changes, kept between decodes.

A decoded delta segment yields its positions (int64) and new words, which live until the
commit wrote them (or, with ``keep_changes``, as long as the caller keeps them). Allocated
fresh per segment, that memory comes back from the allocator as new pages each decode: for the
benchmark delta (lr 1e-6, 1.44 M changes, ~14 MB of outputs) up to ~1,500-2,300 page faults per
decode+apply, ~2.6 us each on the benchmark VM, almost all on the helper thread (its malloc
arena returns freed memory to the kernel; docs/CODEC.md, "Speed").

:class:`Arena` hands out those arrays from slabs of :data:`SLAB_BYTES`. A slab goes back to a
free list when the last array cut from it is gone (a weak reference on the slab's lease: every
piece is a view of the lease, so it lives while any piece, or anything made from one, does), so
memory is never reused while anything can still read it, whatever the caller keeps. At most
:data:`KEEP_BYTES` of slabs are kept; past that, slabs are plain allocations that die with their
pieces, and pieces larger than a slab are allocated on their own. :func:`release` drops the free
slabs.

An arena made with ``fresh=True`` keeps nothing: it cuts from memory mapped for it alone
(:func:`fresh`; slabs of :data:`FRESH_SLAB_BYTES`, advised for transparent huge pages), which goes
back to the system as soon as the last array cut from it is gone. That is for decodes whose
outputs are far larger than what is worth keeping between updates (a large model's delta in a
rollout engine: 10 bytes per change, hundreds of MB), where fresh memory cannot be avoided: a
2 MiB huge page takes one fault where 4 KiB pages take 512 (226 MB of fresh outputs, 57,000 faults:
0.18 s on the benchmark VM; in huge pages 0.06 s). Where the kernel gives no huge pages (THP
``never``) the advice changes nothing. :meth:`Arena.array` cuts any other array an update writes
once and drops with its changes (the engine's received chunks, its undo log).

Decoding writes every element of the arrays it is given before it returns them (the positions
found and the new words decoded, one per change) and returns nothing from a segment that fails,
so a reused slab's old contents never reach a result.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

SLAB_BYTES = 4 << 20
"""Size of one slab (the benchmark delta's largest segment needs ~1.3 MB of outputs)."""
KEEP_BYTES = 32 << 20
"""Most slab memory kept by the process (in use or free). The benchmark delta's outputs take 4-5
slabs; a delta whose outputs need more uses plain allocations for the rest."""
FRESH_SLAB_BYTES = 32 << 20
"""Size of one slab of a ``fresh`` arena (16 huge pages)."""
_HUGE = 2 << 20
_ALIGN = 64

_lock = threading.RLock()  # reentrant: a lease's callback may run from a collection inside the lock
_free: list[np.ndarray] = []
_pooled = [0]  # bytes of slabs that belong to the pool (free or leased)
_leases: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def _returned(key: int) -> None:
    with _lock:
        _, slab = _leases.pop(key)
        _free.append(slab)


def _lease() -> np.ndarray:
    """A writable uint8 array of :data:`SLAB_BYTES` that no live array shares memory with."""
    with _lock:
        if _free:
            slab = _free.pop()
        elif _pooled[0] + SLAB_BYTES <= KEEP_BYTES:
            slab = np.empty(SLAB_BYTES, dtype=np.uint8)
            _pooled[0] += SLAB_BYTES
        else:
            return np.empty(SLAB_BYTES, dtype=np.uint8)
        # The lease wraps the slab's buffer, so views cut from it keep the lease (not the slab)
        # as their base: the lease dies exactly when the last of them does.
        lease = np.frombuffer(slab.data, dtype=np.uint8)
        key = id(lease)

        def back(_: object, k: int = key) -> None:
            _returned(k)

        _leases[key] = (weakref.ref(lease, back), slab)
        return lease


def fresh(nbytes: int) -> np.ndarray:
    """A writable uint8 array of ``nbytes`` in an anonymous private mapping of its own, aligned to
    and advised for transparent huge pages; unmapped when the last array that views it is gone."""
    mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE)  # fd -1: anonymous
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None:
        try:
            mm.madvise(advise)
        except OSError:  # a kernel built without THP: plain pages
            pass
    raw = np.frombuffer(mm, dtype=np.uint8)
    skip = (-raw.ctypes.data) % _HUGE
    return raw[skip:skip + nbytes]


def release() -> None:
    """Free the slabs no decode is using (the next decodes allocate them again)."""
    with _lock:
        _pooled[0] -= sum(slab.shape[0] for slab in _free)
        _free.clear()


def kept_bytes() -> int:
    """Bytes of slab memory the process keeps (free or in use)."""
    with _lock:
        return _pooled[0]


class Arena:
    """Cuts arrays for one applier's decoded changes from leased slabs (``fresh``: from memory
    mapped for this arena alone, kept by nothing; see module doc). Thread-safe."""

    def __init__(self, fresh: bool = False) -> None:
        self.fresh = fresh
        self._slab_bytes = FRESH_SLAB_BYTES if fresh else SLAB_BYTES
        self._mutex = threading.Lock()
        self._slab: np.ndarray | None = None
        self._at = 0

    def _cut(self, nbytes: int) -> np.ndarray:
        # caller holds self._mutex
        if self._slab is None or self._at + nbytes > self._slab.shape[0]:
            self._slab = fresh(self._slab_bytes) if self.fresh else _lease()
            self._at = 0
        piece = self._slab[self._at:self._at + nbytes]
        self._at += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return piece

    def take(self, n: int, word: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """(int64 positions, words of dtype ``word``), ``n`` elements each, contents undefined."""
        word = np.dtype(word)
        with self._mutex:
            return self._piece(n, np.dtype(np.int64)), self._piece(n, word)

    def array(self, n: int, dtype: np.dtype | type) -> np.ndarray:
        """One array of ``n`` elements of ``dtype``, contents undefined (a received chunk, an
        undo log: what an update writes once and drops with its changes)."""
        with self._mutex:
            return self._piece(n, np.dtype(dtype))

    def _piece(self, n: int, dtype: np.dtype) -> np.ndarray:
        # caller holds self._mutex; a piece larger than a slab is memory of its own
        nbytes = n * dtype.itemsize
        if nbytes <= self._slab_bytes:
            return self._cut(nbytes).view(dtype)
        return fresh(nbytes).view(dtype) if self.fresh else np.empty(n, dtype=dtype)

    def close(self) -> None:
        """Stop cutting from the current slab (it returns once the arrays cut from it are gone)."""
        with self._mutex:
            self._slab = None
