"""Merging the split-KV partials of decode attention: one BF16 output and log-sum-exp per query head.

The attention kernel (:mod:`gaac.cuda.attention`) leaves, for every split of a sequence, its normalised
partial output and its log2-sum-exp; :func:`merge_kernel` combines a sequence's splits as one softmax.
"""
from __future__ import annotations

import functools
import math

from numba import cuda, float32

from .primitives import SIMULATOR, WARP, device, ex2, f32, grid_wait, i32, pack_bf16x2, u32

_LOG2E = 1.4426950408889634
_NEG_INF = float("-inf")


@device
def as_int16(x):
    """A 16-bit pattern as the int16 value with those bits."""
    return i32((i32(x) ^ 0x8000) - 0x8000)


MERGE_CHANNELS = 32                 # channels of one merge block
MERGE_UNROLL = 4                    # splits a merge thread loads at once


def merge_launch(batch: int, q_heads: int, head_dim: int, max_splits: int) -> tuple:
    """Grid, threads and split lanes of :func:`merge_kernel`: a block per (sequence, query head, 32
    channels), so that a batch-1 merge of 32 heads fills 128 SMs, not 32; 8 channel quads x ``lanes``
    split lanes, as many as make the longest sequence's splits one round of loads (64 at most; one
    lane in the simulator, where every barrier costs milliseconds).  More lanes than splits would only
    lengthen the reduction and cut the blocks that fit an SM."""
    lanes = 1
    while not SIMULATOR and lanes < 64 and lanes * MERGE_UNROLL < max_splits:
        lanes *= 2
    return (batch, q_heads, head_dim // MERGE_CHANNELS), MERGE_CHANNELS // 4 * lanes, lanes


@device
def merge_pair(m, d, a0, a1, a2, a3, m2, d2, b0, b1, b2, b3):
    """Two partial softmax states (log2 maximum, sum, 4 weighted channel sums) as one."""
    mn = max(m, m2)
    s1 = ex2(m - mn) if m != _NEG_INF else f32(0)
    s2 = ex2(m2 - mn) if m2 != _NEG_INF else f32(0)
    return mn, d * s1 + d2 * s2, a0 * s1 + b0 * s2, a1 * s1 + b1 * s2, a2 * s1 + b2 * s2, a3 * s1 + b3 * s2


if SIMULATOR:
    def merge_shuffle(x, off, mask, scr):
        """``merge_pair`` of this thread's state (a 6-tuple) and thread ``tid ^ off``'s, every thread of the
        block taking part: through ``scr`` (6 words a thread) in the simulator, which has no shuffles."""
        tid = cuda.threadIdx.x
        for c in range(6):
            scr[6 * tid + c] = x[c]
        cuda.syncthreads()
        y = [scr[6 * (tid ^ off) + c] for c in range(6)]
        cuda.syncthreads()
        return merge_pair(*x, *y)
else:
    @device
    def merge_shuffle(x, off, mask, scr):
        """``merge_pair`` of this lane's state (a 6-tuple) and lane ``lane ^ off``'s (``scr``: unused here)."""
        m, d, a0, a1, a2, a3 = x
        return merge_pair(m, d, a0, a1, a2, a3, cuda.shfl_xor_sync(mask, m, off), cuda.shfl_xor_sync(mask, d, off),
                          cuda.shfl_xor_sync(mask, a0, off), cuda.shfl_xor_sync(mask, a1, off),
                          cuda.shfl_xor_sync(mask, a2, off), cuda.shfl_xor_sync(mask, a3, off))


@functools.lru_cache(maxsize=None)
def merge_kernel(head_dim: int, lanes: int):
    """Merge split partials (grid, threads and ``lanes`` from :func:`merge_launch`).  Each thread folds
    its splits into a running (max, sum, 4 channels) :data:`MERGE_UNROLL` splits at a time (their loads
    in flight together); then the lanes of a channel quad are combined by shuffles within each warp and
    across the warps through shared memory with one barrier (a pairwise tree in shared memory needs one a
    level).
    Indices are 32-bit and unsigned: numba's signed indexing adds a negative-index fix-up to every load.
    Launched as a programmatic dependent of the split kernel (``AttentionPlan``'s ``pdl``), it reads its
    split range, then waits for that grid (``griddepcontrol.wait``) before it reads the partials.

    ``o_part`` float32 ``[W*Hkv*g*D]``, ``lse_part`` float32 ``[W*Hkv*g]`` (log2), ``split0`` int32
    ``[B+1]`` (the splits of sequence ``b`` are ``split0[b] .. split0[b+1]-1``), out ``out`` int16
    ``[B*Hq*D]`` (BF16 bits) and ``lse`` float32 ``[B*Hq]`` (natural log, written by the first channel block).
    """
    D = head_dim
    QUADS = MERGE_CHANNELS // 4
    LANES = lanes
    THREADS = QUADS * LANES
    WARPS = -(-THREADS // WARP)
    MASK = (1 << min(THREADS, WARP)) - 1
    UNROLL = MERGE_UNROLL
    OS = 4 * UNROLL
    STATE = 6                           # max, sum, 4 channel sums
    PART = WARPS * QUADS * STATE if WARPS > 1 else 1
    SCR = STATE * THREADS if SIMULATOR else 1

    @cuda.jit
    def kernel(o_part, lse_part, split0, out, lse, kv_heads, g):
        part = cuda.shared.array(PART, float32)
        scr = cuda.shared.array(SCR, float32)
        b = cuda.blockIdx.x
        hq = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        quad = tid % QUADS
        sl = tid // QUADS
        ch = u32(cuda.blockIdx.z * MERGE_CHANNELS + 4 * quad)
        s0 = split0[b]
        s1 = split0[b + 1]
        grid_wait()                     # the split kernel's partials (a no-op without the launch attribute)
        m = f32(_NEG_INF)
        den = f32(0)
        acc = cuda.local.array(4, float32)
        for c in range(4):
            acc[c] = f32(0)
        nq = u32(kv_heads * g)
        for s in range(s0 + sl, s1, UNROLL * LANES):
            ls = cuda.local.array(UNROLL, float32)
            os_ = cuda.local.array(OS, float32)
            for u in range(UNROLL):
                su = s + u * LANES
                row = u32(u32(su) * nq + hq)
                ls[u] = lse_part[row] if su < s1 else f32(_NEG_INF)
                for c in range(4):
                    os_[4 * u + c] = o_part[u32(row * D + ch + c)] if su < s1 else f32(0)
            mu = ls[0]
            for u in range(1, UNROLL):
                mu = max(mu, ls[u])
            m_new = max(m, mu)
            if m_new == f32(_NEG_INF):          # only empty splits so far (a captured step's splits past the end)
                continue
            scale = ex2(m - m_new)
            den *= scale
            for c in range(4):
                acc[c] *= scale
            for u in range(UNROLL):
                wgt = ex2(ls[u] - m_new)
                den += wgt
                for c in range(4):
                    acc[c] += wgt * os_[4 * u + c]
            m = m_new
        x = (m, den, acc[0], acc[1], acc[2], acc[3])
        # The lanes of a quad: within a warp (lanes 8 apart), then across the warps.
        if THREADS > QUADS:
            x = merge_shuffle(x, QUADS, MASK, scr)
        if THREADS > 2 * QUADS:
            x = merge_shuffle(x, 2 * QUADS, MASK, scr)
        if WARPS > 1:
            wid = tid // WARP
            if tid % WARP < QUADS:
                at = (wid * QUADS + quad) * STATE
                for c in range(STATE):
                    part[at + c] = x[c]
            cuda.syncthreads()
            x = (f32(_NEG_INF), f32(0), f32(0), f32(0), f32(0), f32(0))
            if wid == 0:
                for k in range(tid // QUADS, WARPS, WARP // QUADS):     # warps k, k + 4, ...: 4 lanes a quad
                    at = (k * QUADS + quad) * STATE
                    m, d, a0, a1, a2, a3 = x
                    x = merge_pair(m, d, a0, a1, a2, a3, part[at], part[at + 1], part[at + 2], part[at + 3],
                                   part[at + 4], part[at + 5])
            # (every warp shuffles, as the simulator's exchange needs; only warp 0's lanes 0..7 are kept)
            x = merge_shuffle(x, QUADS, 0xFFFFFFFF, scr)
            x = merge_shuffle(x, 2 * QUADS, 0xFFFFFFFF, scr)
        m, den, a0, a1, a2, a3 = x
        if tid < QUADS:
            inv = f32(1) / den if den > 0 else f32(0)   # no split: an empty sequence, output 0
            base = (b * kv_heads * g + hq) * D + cuda.blockIdx.z * MERGE_CHANNELS + 4 * tid
            lo = pack_bf16x2(a0 * inv, a1 * inv)
            hi = pack_bf16x2(a2 * inv, a3 * inv)
            out[base] = as_int16(lo & 0xFFFF)
            out[base + 1] = as_int16(lo >> 16)
            out[base + 2] = as_int16(hi & 0xFFFF)
            out[base + 3] = as_int16(hi >> 16)
            if tid == 0 and cuda.blockIdx.z == 0:
                lse[b * kv_heads * g + hq] = ((m + math.log2(den)) * f32(1 / _LOG2E) if den > 0
                                              else f32(_NEG_INF))
    return kernel


def merge_signature() -> tuple:
    """The argument types the merge kernel is launched with (:mod:`gaac.cuda.merge`)."""
    from numba import types

    def array(dtype):
        return types.Array(dtype, 1, "C")
    return (array(types.float32), array(types.float32), array(types.int32), array(types.int16),
            array(types.float32), types.int64, types.int64)
