"""Bit-mask primitives for the codec's per-element passes (numba intrinsics over LLVM IR).

A block is 64 consecutive words. ``gt_mask64`` loads a block, masks each word
with ``keymask`` and compares it with a threshold; ``ne_mask64`` compares two
arrays' blocks. Both return one bit per word (bit ``i`` = word ``idx + i``) by
bitcasting LLVM's ``<64 x i1>`` compare result to ``i64``, which LLVM lowers to a
couple of vector compares and a mask move on any x86 or ARM vector unit (AVX-512:
``vpcmpuw`` + ``kmovq``). numba does not auto-vectorise a loop that builds such a
mask (it widens every lane to 64 bits), and that loop is what every element of a
delta goes through, so it is written once here.

Callers guarantee ``idx + 64 <= len(arr)`` (no bounds check: these are raw vector
loads); the ``*_tail`` helpers handle a last, shorter block with a scalar loop.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_U64 = np.uint64
_LANES = 64


def _splat(builder, value, vtype):
    undef = ir.Constant(vtype, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(ir.IntType(32), _LANES), None))


def _load_block(context, builder, arrtype, arr, idx):
    ary = context.make_array(arrtype)(context, builder, arr)
    width = arrtype.dtype.bitwidth
    vtype = ir.VectorType(ir.IntType(width), _LANES)
    ptr = builder.gep(ary.data, [idx])
    return builder.load(builder.bitcast(ptr, vtype.as_pointer()), align=width // 8), vtype


def _word_array(a) -> bool:
    return isinstance(a, types.Array) and isinstance(a.dtype, types.Integer) and a.layout in "CA" and a.ndim == 1


@intrinsic
def gt_mask64(typingctx, arr, idx, keymask, threshold):
    """Bit i set iff ``(arr[idx + i] & keymask) > threshold`` (unsigned), for i in 0..63."""
    if not _word_array(arr):
        return None
    sig = types.uint64(arr, types.intp, arr.dtype, arr.dtype)

    def codegen(context, builder, signature, args):
        v, vtype = _load_block(context, builder, signature.args[0], args[0], args[1])
        key = builder.and_(v, _splat(builder, args[2], vtype))
        cmp = builder.icmp_unsigned(">", key, _splat(builder, args[3], vtype))
        return builder.bitcast(cmp, ir.IntType(64))

    return sig, codegen


@intrinsic
def ne_mask64(typingctx, a, b, idx):
    """Bit i set iff ``a[idx + i] != b[idx + i]``, for i in 0..63."""
    if not (_word_array(a) and _word_array(b)) or a.dtype != b.dtype:
        return None
    sig = types.uint64(a, b, types.intp)

    def codegen(context, builder, signature, args):
        va, _ = _load_block(context, builder, signature.args[0], args[0], args[2])
        vb, _ = _load_block(context, builder, signature.args[1], args[1], args[2])
        return builder.bitcast(builder.icmp_unsigned("!=", va, vb), ir.IntType(64))

    return sig, codegen


@intrinsic
def popcount64(typingctx, x):
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return sig, codegen


@intrinsic
def ctz64(typingctx, x):
    """Trailing zeros (64 for 0)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return sig, codegen


@intrinsic
def clz64(typingctx, x):
    """Leading zeros (64 for 0)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0))

    return sig, codegen


# The tails are deliberately not inlined: a scalar loop inlined into a block loop's body
# costs that loop ~5x (measured), while a call once per segment costs nothing.
@njit(nogil=True, cache=True)
def gt_mask_tail(arr, idx, count, keymask, threshold):
    """:func:`gt_mask64` for the ``count`` (< 64) words from ``idx``; higher bits are zero."""
    m = _U64(0)
    for i in range(count):
        if (arr[idx + i] & keymask) > threshold:
            m |= _U64(1) << _U64(i)
    return m


@njit(nogil=True, cache=True)
def ne_mask_tail(a, b, idx, count):
    m = _U64(0)
    for i in range(count):
        if a[idx + i] != b[idx + i]:
            m |= _U64(1) << _U64(i)
    return m


@njit(nogil=True, cache=True, inline="always")
def low_bits(count):
    """A mask of the ``count`` (0..64) lowest bits."""
    if count >= 64:
        return ~_U64(0)
    return (_U64(1) << _U64(count)) - _U64(1)
