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

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from p2psync.wordops import is_word_array, prefetch_codegen
from p2psync.wordops import prefetch_l2  # noqa: F401 - one of the primitives, kept beside the scatter that uses it

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


@intrinsic
def gt_mask64(typingctx, arr, idx, keymask, threshold):
    """Bit i set iff ``(arr[idx + i] & keymask) > threshold`` (unsigned), for i in 0..63."""
    if not is_word_array(arr):
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
    if not (is_word_array(a) and is_word_array(b)) or a.dtype != b.dtype:
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


def _fast_pdep() -> bool:
    """BMI2 ``pdep`` is one instruction on Intel (Haswell on) and AMD Zen 3 on; Zen 1/2 have it
    in microcode (~250 cycles), slower than the portable select."""
    try:
        return bool(llvm.get_host_cpu_features().get("bmi2")) and llvm.get_host_cpu_name() not in ("znver1", "znver2")
    except RuntimeError:  # llvmlite cannot tell on this host: the portable select works everywhere
        return False


HAS_FAST_PDEP = _fast_pdep()
"""Whether :func:`select64` compiles to ``pdep`` + ``tzcnt`` (else a branch-free binary search)."""


@intrinsic
def _pdep64(typingctx, src, mask):
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(64)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.bmi.pdep.64")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def load_be64(typingctx, buf, idx):
    """The 8 bytes ``buf[idx:idx + 8]`` of a byte array as a big-endian u64 (one unaligned load and
    a byte swap; the caller guarantees ``idx + 8 <= len(buf)``)."""
    if not (is_word_array(buf) and buf.dtype.bitwidth == 8):
        return None
    sig = types.uint64(buf, types.intp)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), ir.IntType(64).as_pointer())
        v = builder.load(ptr, align=1)
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)])
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.bswap.i64"), [v])

    return sig, codegen


@intrinsic
def store_be64(typingctx, buf, idx, value):
    """Store the u64 ``value`` big-endian at ``buf[idx:idx + 8]`` of a byte array (a byte swap and
    one unaligned store; the caller guarantees ``idx + 8 <= len(buf)``)."""
    if not (is_word_array(buf) and buf.dtype.bitwidth == 8):
        return None
    sig = types.void(buf, types.intp, types.uint64)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), ir.IntType(64).as_pointer())
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)])
        v = builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.bswap.i64"), [args[2]])
        builder.store(v, ptr, align=1)
        return context.get_dummy_value()

    return sig, codegen


PREFETCH_BYTES = 16384
"""How far ahead of a block pass :func:`prefetch_ahead` asks for memory. The passes over the base
and new words stream hundreds of MB; on the benchmark VM the hardware prefetcher alone kept a
block pass at ~7 GB/s and a 16 KiB software prefetch distance brought it to 10-13 GB/s (the
machine's read bandwidth), measured with 4, 8, 16 and 32 KiB."""


@intrinsic
def prefetch_ahead(typingctx, arr, idx):
    """Prefetch (for reading, into all cache levels) the block of 64 words that starts
    ``PREFETCH_BYTES`` after word ``idx``: one hint per 64-byte line. A hint never faults, so the
    address may lie past the end of the array (the last blocks of a pass)."""
    if not is_word_array(arr):
        return None
    sig = types.void(arr, types.intp)
    width = arr.dtype.bitwidth // 8

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        base = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        i32 = ir.IntType(32)
        for line in range(0, _LANES * width, 64):
            ptr = builder.gep(base, [ir.Constant(ir.IntType(64), PREFETCH_BYTES + line)])
            builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch_read(typingctx, arr, idx):
    """Prefetch the line of word ``idx`` for reading (a hint: never faults, so ``idx`` may lie past
    the end of the array)."""
    if not is_word_array(arr):
        return None
    return types.void(arr, types.intp), prefetch_codegen(3)


_ONE = np.uint64(1)


@njit(nogil=True, cache=True, inline="always")
def _select_pdep(m, j):
    # pdep(1 << j, m) keeps only the j-th set bit of m; its trailing zeros are its index
    return np.int64(ctz64(_pdep64(_ONE << np.uint64(j), m)))


@njit(nogil=True, cache=True, inline="always")
def _select_search(m, j):
    at = np.uint64(0)
    jj = np.uint64(j)
    for half in (32, 16, 8, 4, 2, 1):
        h = np.uint64(half)
        c = popcount64(m & ((_ONE << h) - _ONE))
        go = np.uint64(jj >= c)
        jj -= c * go
        sh = h * go
        m >>= sh
        at += sh
    return np.int64(at)


select64 = _select_pdep if HAS_FAST_PDEP else _select_search
"""Index of the ``j``-th (from 0) set bit of ``m`` (``j`` below its popcount), without branches."""


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


@njit(nogil=True, cache=True)
def gt3_tail(old, blk, cnt, consts):
    """:func:`gt_mask_tail` of the last ``cnt`` (< 64) words from ``blk`` against each of the three
    thresholds ``consts[1:4]`` (key mask ``consts[0]``): the bucket masks of a segment's last block."""
    km = consts[0]
    return gt_mask_tail(old, blk, cnt, km, consts[1]), gt_mask_tail(old, blk, cnt, km, consts[2]), \
        gt_mask_tail(old, blk, cnt, km, consts[3])
