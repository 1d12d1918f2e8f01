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
Kernels in :mod:`gaac.cuda.codec` and :mod:`gaac.cuda.attention` import these.
"""
from __future__ import annotations

from numba import config, cuda, int64

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
