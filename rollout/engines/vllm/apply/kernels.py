"""Compiled loops of the vLLM backend for tensors held as one strided block of a parameter.

An expert inside a repacked ``w13_weight``, a transposed weight: the tensor's
checkpoint position ``p`` lives at ``base + sum_k (p // cstr_k mod size_k) * dstr_k``
(:meth:`rollout.engines.vllm.placement.boxes.Placement.strided`). The checkpoint
strides are row-major, so the innermost one is 1 and a *line* (``cstr[-2]``
consecutive checkpoint positions, the block's last dimension) lies at a fixed
stride ``dstr[-1]`` in memory. The loops below map a position by its offset in
the line they last mapped (the full map, with a division per dimension, only
when a position leaves that line): the changes of a segment come in a few
ascending runs (one per bucket of the codec), so most positions stay in the
line of the one before.

- :func:`gather_mapped` copies a checkpoint range out of the block (the base
  words a segment is decoded against): 16 lines at a time, by a vector
  transpose where they are a 16-row block of vLLM's CPU MoE repacking.
- :func:`scatter_mapped_logged` maps, keeps the old word, writes and hashes in
  one pass over the changes, as :func:`p2psync.wordops.scatter_logged` does for a
  tensor stored contiguously.
- :func:`map_positions` maps positions (the undo of a refused write).

The backend's warm-up (:mod:`rollout.engines.vllm.worker.warm`) compiles them before
the first update.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from p2psync.wordops import SCATTER_AHEAD, change_lanes, is_word_array, prefetch_l2

_U64 = np.uint64
_ONE_LINE = np.int64(1) << np.int64(62)
"""The line width of a one-dimensional block: every position is in the line starting at 0."""


@njit(nogil=True, cache=True, inline="always")
def _mapped(p, base, cstr, dstr):
    """The parameter position of checkpoint position ``p`` in the block (module doc)."""
    rem = p
    dst = base
    for k in range(cstr.shape[0]):
        q = rem // cstr[k]
        rem -= q * cstr[k]
        dst += q * dstr[k]
    return dst


@njit(nogil=True, cache=True, inline="always")
def _width(cstr):
    """Checkpoint positions per line of the block (module doc)."""
    last = cstr.shape[0] - 1
    return cstr[last - 1] if last > 0 else _ONE_LINE


_TILE = 16
"""Rows of a block of vLLM's CPU MoE repacking (16 rows stored column by column): 16 lines whose
words lie interleaved in ``16 x width`` adjacent words, copied out by :func:`_transpose16`."""
_GROUP = 16
"""Lines :func:`gather_mapped` copies together, column block by column block, elsewhere."""
_COLUMNS = 64
"""Columns of such a line group copied at a time (its words for them are a few cache lines)."""


@intrinsic
def _transpose16(typingctx, src, at, dst, to, stride):
    """``dst[to + r * stride + c] = src[at + c * 16 + r]`` for ``r, c < 16``: 256 adjacent words
    loaded as one vector, transposed by one shuffle, stored as 16 rows (no bounds check: the
    caller keeps both inside their arrays)."""
    if not (is_word_array(src) and is_word_array(dst)) or src.dtype != dst.dtype:
        return None
    sig = types.void(src, types.intp, dst, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        s = context.make_array(signature.args[0])(context, builder, args[0])
        d = context.make_array(signature.args[2])(context, builder, args[2])
        width = signature.args[0].dtype.bitwidth
        tile = ir.VectorType(ir.IntType(width), _TILE * _TILE)
        undef = ir.Constant(tile, ir.Undefined)
        v = builder.load(builder.bitcast(builder.gep(s.data, [args[1]]), tile.as_pointer()), align=width // 8)
        lanes = ir.VectorType(ir.IntType(32), _TILE * _TILE)
        t = builder.shuffle_vector(v, undef, ir.Constant(lanes, [(k % _TILE) * _TILE + k // _TILE
                                                                 for k in range(_TILE * _TILE)]))
        row = ir.VectorType(ir.IntType(width), _TILE)
        for r in range(_TILE):
            part = builder.shuffle_vector(t, undef, ir.Constant(ir.VectorType(ir.IntType(32), _TILE),
                                                                list(range(r * _TILE, (r + 1) * _TILE))))
            idx = builder.add(args[3], builder.mul(args[4], ir.Constant(args[4].type, r)))
            builder.store(part, builder.bitcast(builder.gep(d.data, [idx]), row.as_pointer()), align=width // 8)
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def gather_mapped(words, start, stop, base, cstr, dstr, out):
    """``out[k] = words[map(start + k)]`` for ``k < stop - start``: checkpoint range ``[start, stop)``
    of the block as contiguous words (``start <= stop``, inside the tensor).

    Whole lines are copied 16 at a time. Where they are 16 rows of a CPU MoE block (their words
    ``16 x width`` adjacent ones, column by column) by a vector transpose of 16 columns at a time
    (:func:`_transpose16`): 1.5-2x a plain copy of as many words. Elsewhere (a transposed weight)
    :data:`_COLUMNS` columns at a time, so the words read lie in a few cache lines: one line at a
    time, each of its words in another cache line, is several times slower. Partial lines at the
    ends are copied alone."""
    nd = cstr.shape[0]
    width = _width(cstr)
    step = dstr[nd - 1]
    tiles = nd >= 2 and step == _TILE and dstr[nd - 2] == 1 and width >= _TILE
    run = cstr[nd - 3] // width if nd >= 3 else _ONE_LINE  # lines before the next dimension's step
    cols = width - width % _TILE
    at = np.empty(_GROUP, dtype=np.int64)
    p = start
    k = 0
    while p < stop:
        off = p % width
        lines = (stop - p) // width if off == 0 else 0
        if tiles and lines >= _TILE and (p // width) % run + _TILE <= run:
            d = _mapped(p, base, cstr, dstr)  # line r, column c at d + c * 16 + r
            for c0 in range(0, cols, _TILE):
                _transpose16(words, d + c0 * _TILE, out, k + c0, width)
            for c in range(cols, width):
                for r in range(_TILE):
                    out[k + r * width + c] = words[d + c * _TILE + r]
            k += _TILE * width
            p += _TILE * width
            continue
        if lines >= 2:
            g = min(_GROUP, lines)
            for r in range(g):
                at[r] = _mapped(p + r * width, base, cstr, dstr)
            for c0 in range(0, width, _COLUMNS):
                c1 = min(width, c0 + _COLUMNS)
                for r in range(g):
                    o = k + r * width
                    d = at[r]
                    for c in range(c0, c1):
                        out[o + c] = words[d + c * step]
            k += g * width
            p += g * width
            continue
        end = min(stop, p - off + width)
        d = _mapped(p, base, cstr, dstr)
        for q in range(end - p):
            out[k + q] = words[d + q * step]
        k += end - p
        p = end
    return out


@njit(nogil=True, cache=True)
def scatter_mapped_logged(words, positions, values, undo, seed, base, cstr, dstr):
    """For each change ``j``: the word at the parameter position of checkpoint position
    ``positions[j]`` is kept in ``undo[j]`` and replaced by ``values[j]``; returns what the
    writes add to the fingerprint lanes, hashed at the checkpoint positions (as read back from
    ``words``). ``cstr`` are the block's row-major checkpoint strides, outermost first, and
    ``dstr`` its parameter strides; positions must lie in the tensor (the decoder checks)."""
    n = positions.shape[0]
    width = _width(cstr)
    step = dstr[cstr.shape[0] - 1]
    s = _U64(seed)
    a = _U64(0)
    b = _U64(0)
    lo = np.int64(-width)  # the line last mapped (none yet): its first position and where it lies
    at = np.int64(0)
    flo = np.int64(-width)  # the same for the prefetch SCATTER_AHEAD changes ahead
    fat = np.int64(0)
    for j in range(n):
        if j + SCATTER_AHEAD < n:  # the line written SCATTER_AHEAD changes later, as scatter_logged does
            f = positions[j + SCATTER_AHEAD]
            if f < flo or f - flo >= width:
                flo = f - f % width
                fat = _mapped(flo, base, cstr, dstr)
            prefetch_l2(words, fat + (f - flo) * step)
        p = positions[j]
        if p < lo or p - lo >= width:
            lo = p - p % width
            at = _mapped(lo, base, cstr, dstr)
        dst = at + (p - lo) * step
        o = words[dst]
        undo[j] = o
        words[dst] = values[j]
        da, db = change_lanes(p, _U64(o), _U64(words[dst]), s)
        a += da
        b += db
    return a, b


@njit(nogil=True, cache=True)
def map_positions(positions, base, cstr, dstr):
    """The parameter positions of checkpoint ``positions`` (the map of :func:`scatter_mapped_logged`)."""
    n = positions.shape[0]
    width = _width(cstr)
    step = dstr[cstr.shape[0] - 1]
    out = np.empty(n, dtype=np.int64)
    lo = np.int64(-width)
    at = np.int64(0)
    for j in range(n):
        p = positions[j]
        if p < lo or p - lo >= width:
            lo = p - p % width
            at = _mapped(lo, base, cstr, dstr)
        out[j] = at + (p - lo) * step
    return out
