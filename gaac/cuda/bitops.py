"""Device functions for GAAC's bit manipulation, written once for the GPU and the CUDA simulator.

Everything here works on **64-bit words holding four 16-bit lanes**: a word
loaded from a BF16 tile viewed as ``int64`` holds four consecutive elements,
element ``k`` in bits ``16k .. 16k+15`` (little-endian).  Keeping four
elements per register lets one integer instruction act on four elements
(SIMD within a register), which is what makes a memory-bound codec possible
without byte-permute intrinsics.

Why ``int64`` and not ``uint64``: numba types a literal as ``int64`` and
promotes ``uint64 op int64`` to ``float64``; staying signed keeps every
expression integer on the GPU, and the same code runs unchanged in the CUDA
simulator (NumPy ``int64`` scalars wrap on shifts like the GPU does).  Rules
the functions follow so that both agree: every mask is below ``2**63``; a value
is masked after each right shift (arithmetic shifts copy the sign bit); no
shift count reaches 64; a value loaded from a narrower array (uint8, int32) is
widened with ``int64()`` before it is shifted or used in a shift count (NumPy
would keep the narrow type, where the GPU code is 64-bit).

The simulator has no warp vote, so :func:`ballot` has a shared-memory fallback
that is correct only when **every thread of the block** calls it (block-uniform
control flow); the GPU version has the weaker ``ballot_sync`` requirement.

The second half of the module is the **32-bit toolkit** the codec kernels use
(``uint32`` registers, byte lanes, ``PRMT``): on the GPU, 64-bit
integer operations cost two instructions each, and a byte permute does in one
instruction what takes five shifts and masks on 16-bit lanes.  Each helper has
a plain-Python twin for the simulator, which has no libdevice, no inline PTX
and no warp primitives.  Kernels in :mod:`gaac.cuda.codec` and
:mod:`gaac.cuda.attention` import these.
"""
from __future__ import annotations

import threading

import numpy as np
from numba import config, cuda, int64, uint32, uint64

SIMULATOR = bool(config.ENABLE_CUDASIM)

WARP = 32
LANES = 0x0001000100010001        # bit 0 of each 16-bit lane
LOW_BYTES = 0x00FF00FF00FF00FF    # low byte of each lane
SIGN_LANES = 0x0080008000800080   # bit 7 of each lane (where the sign sits in a sign+mantissa byte)
MANT_LANES = 0x007F007F007F007F   # bits 0..6 of each lane
EVEN_BITS = 0x5555555555555555


@cuda.jit(device=True)
def split_bf16x4(x):
    """Four BF16 lanes -> (sign+mantissa lanes ``sign<<7 | mantissa``, exponent lanes), each 0..255."""
    sm = ((x >> 8) & SIGN_LANES) | (x & MANT_LANES)
    e = (x >> 7) & LOW_BYTES
    return sm, e


@cuda.jit(device=True)
def join_bf16x4(sm, e):
    """Inverse of :func:`split_bf16x4`: lanes of sign+mantissa bytes and exponents -> four BF16 lanes."""
    return ((sm & SIGN_LANES) << 8) | (e << 7) | (sm & MANT_LANES)


@cuda.jit(device=True)
def narrow4(x):
    """Four lanes holding values < 256 -> those four bytes in bits 0..31 (lane k -> byte k)."""
    y = (x | (x >> 8)) & 0x0000FFFF0000FFFF
    return (y | (y >> 16)) & 0xFFFFFFFF


@cuda.jit(device=True)
def widen4(b):
    """Inverse of :func:`narrow4`: bytes 0..3 of ``b`` -> four lanes (higher bits of ``b`` ignored)."""
    x = b & 0xFFFFFFFF
    x = (x | (x << 16)) & 0x0000FFFF0000FFFF
    return (x | (x << 8)) & LOW_BYTES


@cuda.jit(device=True)
def pack3x4(c):
    """Low 3 bits of four lanes -> a 12-bit field, lane k at bits 3k..3k+2 (the code stream's order)."""
    c = c & 0x0007000700070007
    c = c | (c >> 13)
    return (c | (c >> 26)) & 0xFFF


@cuda.jit(device=True)
def unpack3x4(v):
    """Inverse of :func:`pack3x4`: a 12-bit field -> four lanes of 3 bits."""
    x = v & 0xFFF
    x = (x | (x << 26)) & 0x0000003F0000003F
    return (x | (x << 13)) & 0x0007000700070007


@cuda.jit(device=True)
def gather4(x):
    """Bit 0 of four lanes -> a 4-bit field, lane k at bit k (an escape byte's nibble)."""
    x = x & LANES
    x = x | (x >> 15)
    return (x | (x >> 30)) & 0xF


@cuda.jit(device=True)
def spread4(b):
    """Inverse of :func:`gather4`: bits 0..3 of ``b`` -> bit 0 of four lanes."""
    x = b & 0xF
    x = (x | (x << 30)) & 0x0000000300000003
    return (x | (x << 15)) & LANES


@cuda.jit(device=True)
def spread_even(m):
    """A 32-bit mask -> 64 bits with mask bit i at bit 2i (interleaves two ballots into 2-bit fields)."""
    x = int64(m) & 0xFFFFFFFF
    x = (x | (x << 16)) & 0x0000FFFF0000FFFF
    x = (x | (x << 8)) & 0x00FF00FF00FF00FF
    x = (x | (x << 4)) & 0x0F0F0F0F0F0F0F0F
    x = (x | (x << 2)) & 0x3333333333333333
    return (x | (x << 1)) & EVEN_BITS


@cuda.jit(device=True)
def window(lo, hi, shift, nbits):
    """Bits ``shift .. shift+nbits-1`` of the 128-bit little-endian value ``hi:lo``.

    ``0 <= shift < 64`` and ``nbits <= 62``: a field that may straddle two
    64-bit words of a bit stream (pass ``hi = 0`` when it cannot).
    """
    shift = int64(shift)          # a narrower type would make the masks below wrap in the simulator
    v = lo >> shift
    if shift + nbits > 64:
        v = (v & ((1 << (64 - shift)) - 1)) | (hi << (64 - shift))
    return v & ((1 << nbits) - 1)


@cuda.jit(device=True)
def lanes_below(lane):
    """Mask of the lanes of a warp below ``lane`` (the exclusive-prefix mask of a ballot)."""
    return (int64(1) << lane) - 1


def ballot_scratch(threads: int) -> int:
    """Entries of the shared int32 ``scratch`` array :func:`ballot` needs in a block of ``threads``
    (one per thread in the simulator, a placeholder of one on the GPU)."""
    return threads if SIMULATOR else 1


if SIMULATOR:
    @cuda.jit(device=True)
    def ballot(pred, scratch):
        """Warp vote in the simulator: bit i = ``pred`` of lane i of the caller's warp.

        ``scratch`` is a shared int32 array with one entry per thread of the
        block; every thread of the block must call this (it synchronises the block).
        """
        tid = cuda.threadIdx.x
        scratch[tid] = 1 if pred else 0
        cuda.syncthreads()
        first = tid - tid % WARP
        m = 0
        for i in range(WARP):
            if first + i < cuda.blockDim.x and scratch[first + i]:
                m |= 1 << i
        cuda.syncthreads()
        return int64(m)
else:
    @cuda.jit(device=True)
    def ballot(pred, scratch):
        """Warp vote: bit i = ``pred`` of lane i (``scratch`` is unused on the GPU)."""
        return int64(cuda.ballot_sync(0xFFFFFFFF, pred)) & 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------
# 32-bit toolkit.
#
# Rules that keep the GPU code 32-bit and the simulator in step with it: values are ``uint32``
# (NumPy ``uint32`` scalars in the simulator, where kernels see arrays as ``uint32`` views);
# constants are ``np.uint32`` module globals (numba freezes them as 32-bit constants); a sum or
# product is wrapped in ``uint32(...)`` in kernel code (numba types ``uint32 + uint32`` as 64-bit;
# the wrap lets NVVM narrow it back), or goes through :func:`mul32` when it may exceed 32 bits
# (NumPy would warn on the wrap-around); array indices are unsigned (numba adds a compare and a
# select per index for negative-index wrap-around otherwise).

FULL_MASK = 0xFFFFFFFF


def device(fn):
    """``fn`` as an inlined device function on the GPU; the plain Python function in the simulator,
    where every call of a ``cuda.jit`` device function takes a lock that all threads contend for."""
    return fn if SIMULATOR else cuda.jit(device=True, inline=True)(fn)


def _u32(x):
    return np.uint32(int(x) & FULL_MASK)


if SIMULATOR:
    _LOCK = threading.Lock()

    def prmt(x, y, s):
        """Byte permute (CUDA ``__byte_perm``): byte k of the result is byte ``(s >> 4k) & 7`` of
        ``y:x`` (bytes 0..3 from ``x``, 4..7 from ``y``)."""
        v = (int(y) << 32) | int(x)
        s = int(s)
        return _u32(sum(((v >> (8 * ((s >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4)))

    def popc32(x):
        """Set bits of a 32-bit word."""
        return bin(int(x) & FULL_MASK).count("1")

    def mul32(a, b):
        """Low 32 bits of ``a * b``."""
        return _u32(int(a) * int(b))

    def funnel_r(lo, hi, r):
        """Bits ``r .. r+31`` of the 64-bit value ``hi:lo`` (``0 <= r < 32``)."""
        return _u32(((int(hi) << 32) | int(lo)) >> int(r))

    def ldg2(a, row, col):
        """Words ``col, col+1`` of row ``row`` of a 2-D 32-bit array (one 8-byte load on the GPU)."""
        return a[row, col], a[row, col + 1]

    def ldg4(a, row, col):
        """Words ``col .. col+3`` of row ``row`` (one 16-byte load on the GPU; ``col % 4 == 0``)."""
        return a[row, col], a[row, col + 1], a[row, col + 2], a[row, col + 3]

    def stg2(a, row, col, x, y):
        """Store two words at ``col, col+1`` of row ``row`` (one 8-byte store on the GPU)."""
        a[row, col] = x
        a[row, col + 1] = y

    def stg4(a, row, col, x, y, z, w):
        """Store four words at ``col .. col+3`` of row ``row`` (one 16-byte store; ``col % 4 == 0``)."""
        a[row, col] = x
        a[row, col + 1] = y
        a[row, col + 2] = z
        a[row, col + 3] = w

    def syncwarp():
        """Warp barrier.  The simulator's block barrier waits for every *live* thread of the block,
        so it acts as a warp barrier as long as all 32 threads of each warp that is still running
        reach their barriers in the same order (threads that returned do not hold it up)."""
        threading.current_thread().syncthreads()
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)

    @cuda.jit(device=True, inline=True)
    def prmt(x, y, s):
        """Byte permute: one PRMT instruction (see the simulator twin for the semantics)."""
        return uint32(libdevice.byte_perm(x, y, s))

    @cuda.jit(device=True, inline=True)
    def popc32(x):
        """Set bits of a 32-bit word: one POPC."""
        return libdevice.popc(x)

    @cuda.jit(device=True, inline=True)
    def mul32(a, b):
        """Low 32 bits of ``a * b``: one IMAD."""
        return uint32(uint32(a) * uint32(b))

    @cuda.jit(device=True, inline=True)
    def funnel_r(lo, hi, r):
        """Bits ``r .. r+31`` of ``hi:lo``: one SHF.R."""
        return uint32(((uint64(hi) << uint64(32)) | uint64(lo)) >> uint64(r))

    def _pointer(context, builder, sig, args):
        """Address of element ``[row, col]`` of the 2-D array in ``args[0..2]``, no wrap-around."""
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, value=args[0])
        idx = [context.cast(builder, args[i], sig.args[i], types.intp) for i in (1, 2)]
        return cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False)

    def _asm(builder, ret, args, text, constraints, side_effect=False):
        fn = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(ir.InlineAsm(fn, text, constraints, side_effect=side_effect), args)

    def _load(width):
        regs = ",".join(f"${i}" for i in range(width))
        text = f"ld.global.nc.v{width}.u32 {{{regs}}}, [${width}];"
        constraints = ",".join(["=r"] * width) + ",l"

        @intrinsic
        def load(typingctx, a, row, col):
            """Words ``col .. col+width-1`` of row ``row``: one read-only (``.nc``) vector load."""
            rt = types.UniTuple(types.uint32, width)

            def codegen(context, builder, sig, args):
                r = _asm(builder, ir.LiteralStructType([_I32] * width), [_pointer(context, builder, sig, args)],
                         text, constraints)
                return context.make_tuple(builder, rt, [builder.extract_value(r, i) for i in range(width)])
            return rt(a, row, col), codegen
        return load

    def _store_codegen(width):
        regs = ",".join(f"${i + 1}" for i in range(width))
        text = f"st.global.v{width}.u32 [$0], {{{regs}}};"
        constraints = "l," + ",".join(["r"] * width) + ",~{memory}"

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[3:], sig.args[3:])]
            _asm(builder, ir.VoidType(), [_pointer(context, builder, sig, args)] + vals, text, constraints,
                 side_effect=True)
            return context.get_dummy_value()
        return codegen

    @intrinsic
    def stg2(typingctx, a, row, col, x, y):
        """Store two words at ``col, col+1`` of row ``row``: one 8-byte store."""
        return types.void(a, row, col, x, y), _store_codegen(2)

    @intrinsic
    def stg4(typingctx, a, row, col, x, y, z, w):
        """Store four words at ``col .. col+3`` of row ``row``: one 16-byte store (``col % 4 == 0``)."""
        return types.void(a, row, col, x, y, z, w), _store_codegen(4)

    ldg2 = _load(2)
    ldg4 = _load(4)

    @cuda.jit(device=True, inline=True)
    def syncwarp():
        """Warp barrier (``bar.warp.sync``)."""
        cuda.syncwarp(FULL_MASK)
