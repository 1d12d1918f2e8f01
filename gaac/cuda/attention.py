"""Fused split-KV decode attention on the GAAC paged cache, and a BF16 kernel of the same structure.

Why this shape
==============
On an H200 the cache streams at ~4 TB/s, so the kernel has about 5 integer
operations per element for reconstruction before it stops being memory-bound;
CUDA-core FMAs for ``q.k`` and ``p.v`` alone would cost 2*g more per element
(g = query heads per KV head).  So the arithmetic of attention goes to the
tensor cores (``mma.sync m16n8k16`` BF16 -> FP32 with the 16 tokens of a block
as the M dimension and the query heads as N: ``S^T = K.Q^T`` and ``O^T = V^T.P``,
so that no MMA row is padding for g <= 8; P goes from the C layout of the first
product to the B layout of the second by one ``movmatrix`` transpose per 8
tokens), and the CUDA cores only rebuild BF16 bits.  BF16 products are exact in
FP32, so the scores are those of the exact cache.

One thread block = one warp = one *split*: a run of 16-token blocks of one
sequence and one KV head.  Per block the warp

1. copies the K and V slots of the block ``NSTAGE - 1`` blocks ahead into shared
   memory with ``cp.async`` (16-byte copies, no registers, so the loads of later
   blocks are in flight while this one is computed; ``nstage=1`` instead keeps one
   area per kind and refills it with the next block as soon as it has been read);
2. decodes each slot into a padded BF16 tile in shared memory (the device
   functions of :func:`gaac.cuda.tile_decoder.decode_tile_fn`: each lane rebuilds 8 groups of 8
   consecutive channels, two BF16 elements per 32-bit operation); a raw tile
   (slot overflow, rare) or the sequence's BF16 tail is loaded into that tile
   when it is used, from L2 (prefetched there with the copies of the block ahead;
   not with ``nstage=1``, whose refills have no block ahead to prefetch for);
3. loads MMA fragments with ``ldmatrix`` (``.trans`` for V), computes the 16
   scores of every query head of the group, updates the online softmax in the
   log2 domain (the accumulators are rescaled only when a head's maximum rose),
   and accumulates ``P.V`` in FP32 registers.

Each split writes its normalised partial output and log-sum-exp; a second small
kernel merges the splits of a sequence (:mod:`gaac.cuda.merge`), or, with the fused
merge, the warps that finish last merge them in two levels (``fused_merge``): a
decode step's layer is then one launch fewer, which is host time on every layer.  The BF16
baseline (``plain=True``) is the same kernel with every tile raw: step 1 stages
BF16 tiles and step 2 is compiled out.

Performance: the compressed slots are fewer bytes to load than the BF16 twin's
tiles, and the decode hides most of its work under those loads; what remains
bounds the kernel by its shared-memory traffic (the L1 data pipe) and its integer
instructions (the ALU pipe), at 12 one-warp blocks per SM (168 registers and
18 KB of shared memory each).  A split's prologue and epilogue run in every warp
at once with nothing to overlap them, so their instruction counts and round trips
to memory are kept short; the staging areas start on 128-byte lines
(:data:`LINE`).  docs/design/attention.md has the analysis, and
benchmarks/results/attention-h200.md the measurements.

The kernel's device primitives (PTX on the GPU, Python twins in the simulator) are
:mod:`gaac.cuda.primitives`; the decode of a staged slot is :mod:`gaac.cuda.tile_decoder`.
"""
from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, uint8, uint32

from .. import layout as L
from .primitives import (SCRATCH_WORDS, SIMULATOR, WARP, col_max, col_sum, cp16, cp_commit, cp_wait_fn, device,
                         escape_scan, ex2, f32, gaddr, grid_launch_dependents, grid_wait, i32, lane_id, ldcg4f, ldcg_i16,
                         ldcg_i32, ldcgf, ldg4_at,
                         ldsm_cols, ldsm_rows, lg2, mma, pack_bf16x2, prefetch_l2, rcp, scratch_init, smem_base,
                         sts4, transpose8, u32, warp_any, warp_sync)
from .merge import as_int16
from .tile_decoder import (BASE_ROWS, base_row_words, decode_tile_fn, escape_scan2, row_bytes, stage_slot_fn,
                           tile_bytes)


# The staging areas start on 128-byte lines of shared memory: a cp.async copy's 16-byte chunks are written a
# line at a time, and a group of 8 lanes whose destinations straddle two lines costs two wavefronts of the L1
# data pipe instead of one, and the copies are a large share of the kernel's shared-memory wavefronts
# (docs/design/attention.md).  A slot's source is best on a line too: gaac.calibrate's slot_line
# chooses a capacity whose slots are whole lines.  Every area is on a line when the stage size is a multiple
# of 128 bytes (the real caches' 2944); the plan does not round it up, which would cost shared memory, so
# occupancy.
LINE = 128
SMEM_ALIGN = None if SIMULATOR else LINE   # (the simulator takes no alignment)
MAX_BLOCKS_PER_SPLIT = 64    # the split's block-table entries are staged in shared memory
MERGE_GROUP_MAX = 8          # query heads per KV head the fused merge takes (gaac.attention.MAX_GROUP)
MERGE_ROWS = 2               # partial rows a lane of the fused merge loads at once

_NEG_INF = float("-inf")
_LOG2E = 1.4426950408889634

# Status bits the kernel sets (``status[0]``, OR-ed in), above the tile decoder's (gaac.cuda.tile_decoder:
# STATUS_BAD_TAG = 1, STATUS_BAD_ESCAPES = 2).
STATUS_BAD_EPOCH = 4         # a block's epoch is past the epochs its bases table holds (its bases: epoch 0's)
STATUS_BAD_ENTRY = 8         # a finalized block's table entry points past its slot or raw-tile pool (read: entry 0)


# ----------------------------------------------------------------------------------------------
# Shared-memory layout (bytes).

def bases_bytes(head_dim: int) -> int:
    """Shared bytes of the pre-shifted bases (2 kinds x :data:`BASE_ROWS` rows of :func:`base_row_words`),
    rounded up to a :data:`LINE` so that the staging areas after them start on one."""
    return -(-4 * 2 * BASE_ROWS * base_row_words(head_dim) // LINE) * LINE


def smem_bytes(channels: int, tph: int, nstage: int, plain: bool, stage_bytes: int) -> int:
    """Shared bytes of the tile area of one block: unless ``plain``, the bases (:func:`bases_bytes`); the
    stages (K and V, ``tph`` areas of ``stage_bytes`` each); unless ``plain``, one decode tile."""
    stages = nstage * 2 * tph * stage_bytes
    return stages if plain else bases_bytes(tph * channels) + stages + tile_bytes(channels)


# ----------------------------------------------------------------------------------------------
# The attention kernel.

def kernel_signature() -> tuple:
    """The argument types :class:`gaac.attention.AttentionPlan` launches :func:`attention_kernel` with
    (to compile it before the first launch: its occupancy sizes the plan's splits)."""
    from numba import types

    def array(dtype):
        return types.Array(dtype, 1, "C")
    arrays = [types.int32] + [types.uint8] * 4 + [types.int32] * 2 + [types.uint8] * 2 + [types.int32] + \
        [types.int16] * 2 + [types.int32] * 2 + [types.float32] * 2 + [types.int32]
    merge = [array(types.int32), array(types.int16), array(types.float32), types.int64, types.int64]
    return tuple([array(a) for a in arrays] + [types.int64] * 13 + [types.float32] + merge)


@functools.lru_cache(maxsize=None)
def attention_kernel(head_dim: int, plain: bool, nstage: int = 3, stage_bytes: int = 0, overlap: bool = False,
                     max_registers: int | None = None, fused_merge: bool = False):
    """The split-KV decode kernel for ``head_dim``; ``plain`` = every tile is BF16 (the baseline).

    ``overlap`` (compressed, head_dim <= 128): when both tiles of a block are slots, one escape scan
    serves K and V, and the V tile's reads, then its decode, sit in one straight-line region with the
    q.k MMAs and the softmax, so that the compiler overlaps their latencies.  ``max_registers``
    caps registers per thread (more resident warps, possibly spills).  ``fused_merge`` (compressed,
    head_dim <= 128) compiles the fused merge in; the kernel without it has the same parameters and leaves
    them unread, and its block loop is not changed by the merge's code (which costs the loop a few
    instructions in register allocation).

    ``stage_bytes``: bytes of a staging area, at least the larger slot of K and V (compressed kernel;
    raw tiles and the tail are loaded when used, so the stages only hold slots); the plain kernel
    stages padded BF16 tiles.  Arguments (all 1-D, C-contiguous; ``D = head_dim``,
    ``C = min(D, 128)``, ``T = D // C``): ``q32`` int32 ``[B*Hq*D/2]`` (BF16 pairs); ``slots_k/v``
    uint8 slot pools (flat); ``raw_k/v`` uint8 raw-tile pools (flat, 32*C bytes a tile);
    ``table_k/v`` int32 ``[B*MB*Hkv*T]``; ``tail_k/v`` uint8 ``[B*Hkv*16*D*2]``; ``bases`` int32
    ``[2, E, Hkv, 3, D/2]`` pair words (b3, b4, zeros) of each calibration epoch;
    ``epoch_k/v`` int16 ``[B*MB]`` each block's epoch (FORMAT.md 3.5); ``seq_lens`` int32 ``[B]``;
    ``work`` int32 ``[W*3]`` (sequence, first block, end block); out ``o_part`` float32
    ``[W*Hkv*g*D]``, ``lse_part`` float32 ``[W*Hkv*g]`` (log2 domain); ``status`` int32 ``[1]``; then
    ``max_blocks, kv_heads, g, slot_bytes_k, slot_bytes_v, cap_k, cap_v, epochs_k, epochs_v`` (epoch
    counts; ``E = max``), ``n_slots_k, n_slots_v, n_raw_k, n_raw_v`` (records in the pools: a
    finalized block's entry at or past its pool's is flagged, :data:`STATUS_BAD_ENTRY`, and entry 0
    is read instead, so each pool needs a record) and ``scale_log2``; then the fused merge's ``mrg`` int32,
    ``out`` int16 ``[B*Hq*D]`` (BF16 bits), ``lse_out`` float32 ``[B*Hq]`` (natural log), ``merge_batch`` (B) and
    ``group`` (splits a group; 0, or a kernel built without ``fused_merge``: :mod:`gaac.cuda.merge` merges):
    see ``fused_merge``, whose group rows follow the splits' in ``o_part`` and ``lse_part``.  Grid ``(W, Hkv)``, one warp per block.

    Epochs: a split's blocks may hold different epochs (splits depend on lengths only).  The kernel
    marks, with its table entries, the blocks whose K or V epoch differs from the block before (a byte a
    block in shared memory), loads the first block's bases, and at a marked block loads that block's
    epochs and bases (rare: an epoch covers many blocks).  ``epochs_k/v`` bound the epochs ``bases`` holds rows for
    (its room; a larger epoch is flagged, :data:`STATUS_BAD_EPOCH`).
    """
    D = head_dim
    C = L.tile_channels(D)
    T = D // C
    NS = nstage
    ROWB = row_bytes(C)
    TB = tile_bytes(C)
    SB = TB if plain else stage_bytes
    if not plain and (stage_bytes % 16 or not L.TileGeometry(C).fixed_bytes <= stage_bytes <= 2 * L.BLOCK_TOKENS * C):
        raise ValueError(f"stage_bytes {stage_bytes}: a multiple of 16 that holds a slot of {C}-channel tiles")
    NCHUNK = D // 16                    # k-chunks of the score MMA (16 channels each)
    KF_WORDS = C // 4                   # K fragment words of one tile (4 per 16 channels)
    NACC = D // 4                       # O^T accumulators: 4 per 16 channels
    ROW_CHUNKS = C // 8                 # 16-byte chunks of a BF16 row
    RAW_PER_LANE = L.BLOCK_TOKENS * ROW_CHUNKS // WARP
    RAW_WORDS = 4 * RAW_PER_LANE        # a lane's words of a BF16 tile loaded through registers
    if overlap and (T != 1 or plain):
        raise ValueError("overlap is for the compressed kernel with head_dim <= 128")
    BASES = 0                           # byte offsets in the shared array: the bases, the stages, the decode tile
    STG = 0 if plain else bases_bytes(D)
    DEC = STG + NS * 2 * T * SB
    PAIRS = D // 2                      # base pair words per row of one kind
    RS = base_row_words(D)              # words per base row in shared memory
    SMEM_WORDS = smem_bytes(C, T, NS, plain, SB) // 4
    NENT = MAX_BLOCKS_PER_SPLIT * 2 * T
    KIND_BASE = BASE_ROWS * PAIRS       # base words of one kind, one head, one epoch
    KIND_PER_LANE = 0 if plain else KIND_BASE // WARP
    BASE_REGS = max(1, 2 * KIND_PER_LANE)  # a lane's base words of both kinds, held while the first copies go out
    TILE_BYTES = L.BLOCK_TOKENS * C * 2
    ROW_LINES = 2 * C // LINE           # 128-byte lines of a BF16 tile row (the tail's rows are 2D bytes apart)
    TILE_LINES = L.BLOCK_TOKENS * ROW_LINES
    decode, decode_tags, decode_loads, decode_compute, decode_fix, SIZES = decode_tile_fn(C)
    SM_WORDS, CODE_ARRAY, GPL, BASE_WORDS = SIZES
    stage_slot = stage_slot_fn(C, SB)
    REFILL = NS == 1                    # one area per kind, refilled as soon as it is read (see refill_fn)
    cp_wait = cp_wait_fn(1 if REFILL else NS - 1)

    @device
    def copy_bf16_tile(smem, dst, is_tail, entry, raw, tail, tail_byte, valid, lane, wait):
        """Copy a raw tile or the tail to the padded BF16 tile at byte ``dst`` (tail rows at or after
        ``valid`` are zeroed so that 0 * garbage cannot make a NaN): asynchronously (``cp.async``), or
        with ``wait``, through registers so that the tile is ready after the next warp barrier."""
        g0 = gaddr(tail, tail_byte) if is_tail else gaddr(raw, (entry & 0x7FFFFFFF) * TILE_BYTES)
        if wait:
            # Every load before the first store: one round trip to memory, not one per chunk.  (The
            # tail's rows at or after ``valid`` are read too, inside its 16-row buffer, and dropped.)
            words = cuda.local.array(RAW_WORDS, uint32)
            for k in range(RAW_PER_LANE):
                i = u32(lane + WARP * k)
                r = i // ROW_CHUNKS
                ga = g0 + i32(r * (2 * D) + 16 * (i % ROW_CHUNKS)) if is_tail else g0 + i32(16 * i)
                words[4 * k], words[4 * k + 1], words[4 * k + 2], words[4 * k + 3] = ldg4_at(
                    tail if is_tail else raw, ga)
            for k in range(RAW_PER_LANE):
                i = u32(lane + WARP * k)
                r = i // ROW_CHUNKS
                keep = u32(0) if is_tail and r >= valid else u32(0xFFFFFFFF)
                sts4(smem, u32(dst + r * ROWB + 16 * (i % ROW_CHUNKS)), u32(words[4 * k] & keep),
                     u32(words[4 * k + 1] & keep), u32(words[4 * k + 2] & keep), u32(words[4 * k + 3] & keep))
            return
        for k in range(RAW_PER_LANE):
            i = u32(lane + WARP * k)
            r = i // ROW_CHUNKS
            a = u32(dst + r * ROWB + 16 * (i % ROW_CHUNKS))
            ga = g0 + i32(r * (2 * D) + 16 * (i % ROW_CHUNKS)) if is_tail else g0 + i32(16 * i)
            if is_tail and r >= valid:
                sts4(smem, a, u32(0), u32(0), u32(0), u32(0))
            else:
                cp16(smem, a, tail if is_tail else raw, ga)

    @device
    def prefetch_bf16_tiles(ents, i, is_tail, raw_k, raw_v, tail_k, tail_v, tail_base, lane):
        """Bring block ``i``'s raw tiles, or its tail, into L2 (a line a lane) when its slots would be staged:
        they are read when used (:func:`copy_bf16_tile` with ``wait``), and a read from L2 stalls the split
        less than one from DRAM.  (Even so, a split holding a raw tile ends later than one without:
        benchmarks/results/attention-timeline-h200.md.)"""
        if lane < TILE_LINES:
            for kind in range(2):
                for j in range(T):
                    if is_tail:
                        tail = tail_k if kind == 0 else tail_v
                        prefetch_l2(tail, gaddr(tail, tail_base + j * C * 2)
                                    + i32((lane // ROW_LINES) * (2 * D) + LINE * (lane % ROW_LINES)))
                    else:
                        e = ents[u32((i * 2 + kind) * T + j)]
                        if e < 0:
                            raw = raw_k if kind == 0 else raw_v
                            prefetch_l2(raw, gaddr(raw, (e & 0x7FFFFFFF) * TILE_BYTES) + i32(LINE * lane))

    @device
    def entry(ents, i, kind):
        """Block-table entry of tile 0 of kind ``kind`` of split-relative block ``i`` (clamped to the staged
        entries: past the split's last block the value is not used)."""
        return ents[u32(min(i32(i), i32(MAX_BLOCKS_PER_SPLIT - 1)) * 2 * T + kind * T)]

    def issue_fn(kind: int):
        """Device function starting the copies of kind ``kind``'s tiles of block ``blk`` (split-relative
        ``i``) into stage ``st``: every tile for the plain kernel, the slots for the compressed one.  With
        one tile a head (T = 1) the caller passes the tile's block-table entry ``e1`` (see :func:`entry`)."""
        @device
        def issue(smem, sb, ents, i, st, blk, nfull, slots, slot_bytes, raw, tail, tail_base, tail_valid, lane, e1):
            is_tail = blk >= nfull
            for j in range(T):
                e = i32(-1) if is_tail else (i32(e1) if T == 1 else ents[u32((i * 2 + kind) * T + j)])
                dst = u32(sb + STG + ((st * 2 + kind) * T + j) * SB)
                if plain:
                    copy_bf16_tile(smem, dst, is_tail, e, raw, tail, tail_base + j * C * 2, tail_valid, lane, False)
                elif not is_tail and e >= 0:
                    stage_slot(smem, dst, e, slots, slot_bytes, lane)
        return issue

    issue_k, issue_v = issue_fn(0), issue_fn(1)

    def refill_fn(issue, kind: int):
        """``nstage=1``: start block i+1's copies of one kind into the area block i's tiles of that kind
        have just left (read into registers or decoded, then a warp barrier), as one copy group."""
        @device
        def refill(smem, sb, ents, i, blk, blk1, nfull, slots, slot_bytes, raw, tail, tail_base, tail_valid, lane):
            if blk + 1 < blk1:
                issue(smem, sb, ents, i32(i + 1), 0, i32(blk + 1), nfull, slots, slot_bytes, raw, tail, tail_base,
                      tail_valid, lane, entry(ents, i + 1, kind))
            cp_commit()
        return refill

    refill_k, refill_v = refill_fn(issue_k, 0), refill_fn(issue_v, 1)

    @device
    def tile_of(smem, sb, ents, i, st, kind, j, is_tail, raw, tail, tail_byte, tail_valid, cap, status, scr, sync):
        """Byte address of the BF16 tile (kind, j) of the block in stage ``st``: the staged tile (plain),
        or the kind's decode tile after decoding the slot / loading the raw tile or tail into it (ready
        after a warp barrier: this one if ``sync``)."""
        src = u32(sb + STG + ((st * 2 + kind) * T + j) * SB)
        if plain:
            return src
        e = i32(-1) if is_tail else ents[u32((i * 2 + kind) * T + j)]
        dec = u32(sb + DEC)
        if is_tail or e < 0:
            copy_bf16_tile(smem, dec, is_tail, e, raw, tail, tail_byte, tail_valid, lane_id(), True)
        else:
            base = u32(sb + BASES + 4 * (kind * BASE_ROWS * RS + j * (C // 2)) + C * (lane_id() >> 4))
            decode(smem, src, dec, base, 4 * RS, cap, status, scr)
        if sync:
            warp_sync(scr)
        return dec

    @device
    def load_k_frags(smem, tile, kf, scr):
        """A fragments of q.k for a K tile: 16 tokens x 16 channels a ``ldmatrix.x4``."""
        for kk in range(C // 16):
            a0, a1, a2, a3 = ldsm_rows(smem, u32(tile + 32 * kk), ROWB, scr)
            kf[4 * kk] = a0
            kf[4 * kk + 1] = a1
            kf[4 * kk + 2] = a2
            kf[4 * kk + 3] = a3

    @device
    def qk_mma(kf, j, qb0, qb1, sc, scr):
        """Scores S^T[token][head] += K . Q^T for tile j: ``sc[4 par + i]`` holds token ``r + 8 (i // 2)``,
        head ``2q + i % 2``, accumulated in two chains (par) so that an MMA waits for half as many."""
        for kk in range(C // 16):
            c = 4 * (kk & 1)
            kq = j * (C // 16) + kk
            sc[c], sc[c + 1], sc[c + 2], sc[c + 3] = mma(kf[4 * kk], kf[4 * kk + 1], kf[4 * kk + 2], kf[4 * kk + 3],
                                                         qb0[kq], qb1[kq], sc[c], sc[c + 1], sc[c + 2], sc[c + 3], scr)

    @device
    def softmax_update(sc, valid, r, m0, m1, l0, l1, scale_log2, scr):
        """Online softmax in the log2 domain over the block's tokens (those at or after ``valid`` masked)
        for this lane's heads ``2q`` and ``2q+1``: returns their maxima, this lane's partial sums, P as
        the two B fragments of p.v (tokens 0..7, 8..15) and the factors :func:`rescale` applies."""
        x0 = (sc[0] + sc[4]) * scale_log2 if r < valid else f32(_NEG_INF)
        x1 = (sc[1] + sc[5]) * scale_log2 if r < valid else f32(_NEG_INF)
        x2 = (sc[2] + sc[6]) * scale_log2 if r + 8 < valid else f32(_NEG_INF)
        x3 = (sc[3] + sc[7]) * scale_log2 if r + 8 < valid else f32(_NEG_INF)
        n0 = max(m0, col_max(max(x0, x2), scr))
        n1 = max(m1, col_max(max(x1, x3), scr))
        al0 = ex2(m0 - n0)
        al1 = ex2(m1 - n1)
        p0 = ex2(x0 - n0)
        p1 = ex2(x1 - n1)
        p2 = ex2(x2 - n0)
        p3 = ex2(x3 - n1)
        return (n0, n1, l0 * al0 + (p0 + p2), l1 * al1 + (p1 + p3),
                transpose8(pack_bf16x2(p0, p1), scr), transpose8(pack_bf16x2(p2, p3), scr), al0, al1)

    @device
    def rescale(acc, al0, al1, scr):
        """The accumulators times the heads' factors, skipped (one warp vote) when no head's maximum
        rose: past a split's first blocks that is most blocks, and the factors are then exactly 1."""
        if warp_any(al0 != f32(1) or al1 != f32(1), scr):
            for t in range(NACC // 4):
                acc[4 * t] *= al0
                acc[4 * t + 1] *= al1
                acc[4 * t + 2] *= al0
                acc[4 * t + 3] *= al1

    @device
    def pv_mma(smem, tile, j, pb0, pb1, acc, scr):
        """O^T[channel][head] += V^T . P for V tile j (``ldmatrix.trans``): ``acc[4 t + i]`` holds channel
        ``16 t + r + 8 (i // 2)``, head ``2q + i % 2``."""
        for mt in range(C // 16):
            o = 4 * (j * (C // 16) + mt)
            a0, a1, a2, a3 = ldsm_cols(smem, u32(tile + 32 * mt), ROWB, scr)
            acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma(a0, a1, a2, a3, pb0, pb1, acc[o], acc[o + 1],
                                                             acc[o + 2], acc[o + 3], scr)

    @device
    def store_head(o_part, lse_part, acc, i, row, r, m, l_):
        """The normalised output of partial row ``row`` (this lane's head ``2q + i``: channels ``16 t + r``
        and ``+ 8`` from ``acc[4 t + i]``, ``acc[4 t + i + 2]``) and, from lane r = 0, its log2-sum-exp."""
        inv = rcp(l_) if l_ > 0 else f32(0)
        o = u32(row * D + r)                    # unsigned indices: no negative-index fix-up a store
        for t in range(NACC // 4):
            o_part[u32(o + 16 * t)] = acc[4 * t + i] * inv
            o_part[u32(o + 16 * t + 8)] = acc[4 * t + i + 2] * inv
        if r == 0:
            lse_part[u32(row)] = m + lg2(l_) if l_ > 0 else m

    @device
    def load_bases(bases, kind, e, ne, h, kv_heads, lane, words):
        """This lane's words of epoch ``e``'s base rows of ``kind`` and head ``h`` into ``words`` (``ne`` = the
        larger epoch count of K and V); :func:`store_bases` puts them in shared memory after the first stages'
        copies are issued: loaded after the copies, they would arrive only after them."""
        src = u32(((kind * ne + e) * kv_heads + h) * KIND_BASE)
        for k in range(KIND_PER_LANE):
            words[kind * KIND_PER_LANE + k] = bases[u32(src + lane + WARP * k)]

    @device
    def store_bases(smem, words, lane):
        for kind in range(2):
            for k in range(KIND_PER_LANE):
                i = lane + WARP * k
                smem[BASES // 4 + (kind * BASE_ROWS + i // PAIRS) * RS + i % PAIRS] = words[kind * KIND_PER_LANE + k]

    @device
    def checked_epoch(e, n, status):
        """A block's epoch, or 0 with :data:`STATUS_BAD_EPOCH` flagged if the view has no bases for it."""
        if e < 0 or e >= n:
            cuda.atomic.or_(status, 0, STATUS_BAD_EPOCH)
            return i32(0)
        return i32(e)

    @device
    def checked_entry(e, finalized, n_slots, n_raw, status):
        """A block-table entry, or entry 0 with :data:`STATUS_BAD_ENTRY` flagged if it belongs to a finalized
        block and points past its pool (the plain kernel reads every entry as a raw-tile index).  Entries of
        the tail block are not read, whatever they hold."""
        if finalized and (e & 0x7FFFFFFF) >= (n_raw if plain or e < 0 else n_slots):
            cuda.atomic.or_(status, 0, STATUS_BAD_ENTRY)
            return i32(0)
        return i32(e)

    # The fused merge (``group`` > 0): a lane holds quads (4 channels of one query head) of the KV head's g*D outputs.
    FUSED = fused_merge and not plain and D <= 128
    MQ = D // 4                         # quads of one query head
    MCH = max(1, MERGE_GROUP_MAX * MQ // WARP)   # quads a lane holds at most
    MST = 6 * MCH                       # per quad: log2 maximum, sum, 4 weighted channel sums
    MLS = MCH * MERGE_ROWS              # a round's loads of a lane: log2-sum-exps, then channels
    MOS = 4 * MLS

    @device
    def arrive(mrg, at, ents, lane, scr):
        """This warp's arrival at the counter ``mrg[at]``, after its stores (each lane fences its own): the
        count before it, in every lane."""
        cuda.threadfence()
        warp_sync(scr)
        if lane == 0:
            ents[0] = cuda.atomic.add(mrg, at, 1)
        warp_sync(scr)
        return ents[0]

    @device
    def merge_rows(o_part, lse_part, row0, n, h, kv_heads, g, lane, st):
        """Fold the partial rows ``row0 .. row0 + n - 1`` of KV head ``h`` (normalised outputs, log2-sum-exps)
        into ``st``, this lane's quads as one softmax.  Each round loads :data:`MERGE_ROWS` rows of every quad
        before it folds any, so that the loads are in flight together; they read L2, where the other
        warps' stores are."""
        nq = u32(g * MQ)
        for k in range(MCH):
            st[6 * k] = f32(_NEG_INF)
            for c in range(1, 6):
                st[6 * k + c] = f32(0)
        ls = cuda.local.array(MLS, float32)
        os_ = cuda.local.array(MOS, float32)
        for s in range(0, n, MERGE_ROWS):
            for k in range(MCH):
                quad = u32(lane + WARP * k)
                for u in range(MERGE_ROWS):
                    x = k * MERGE_ROWS + u
                    ls[x] = f32(_NEG_INF)
                    if quad < nq and s + u < n:
                        row = u32((u32(row0 + s + u) * u32(kv_heads) + u32(h)) * u32(g) + quad // MQ)
                        ls[x] = ldcgf(lse_part, row)
                        os_[4 * x], os_[4 * x + 1], os_[4 * x + 2], os_[4 * x + 3] = ldcg4f(
                            o_part, u32(row * D + 4 * (quad % MQ)))
            for k in range(MCH):
                for u in range(MERGE_ROWS):
                    x = k * MERGE_ROWS + u
                    lx = ls[x]
                    if lx != f32(_NEG_INF):         # an empty split (or none) adds nothing
                        m = st[6 * k]
                        mn = max(m, lx)
                        a = ex2(m - mn) if m != f32(_NEG_INF) else f32(0)
                        wx = ex2(lx - mn)
                        st[6 * k] = mn
                        st[6 * k + 1] = st[6 * k + 1] * a + wx
                        for c in range(4):
                            st[6 * k + 2 + c] = st[6 * k + 2 + c] * a + wx * os_[4 * x + c]

    @device
    def merge_store(st, o_part, lse_part, row, h, kv_heads, g, lane):
        """This lane's merged quads as partial row ``row`` (normalised, log2-sum-exp), for the next merge."""
        nq = u32(g * MQ)
        for k in range(MCH):
            quad = u32(lane + WARP * k)
            if quad < nq:
                at = u32((u32(row) * u32(kv_heads) + u32(h)) * u32(g) + quad // MQ)
                den = st[6 * k + 1]
                inv = f32(1) / den if den > 0 else f32(0)
                for c in range(4):
                    o_part[u32(at * D + 4 * (quad % MQ) + c)] = st[6 * k + 2 + c] * inv
                if quad % MQ == 0:
                    lse_part[at] = st[6 * k] + lg2(den) if den > 0 else st[6 * k]

    @device
    def merge_out(st, out, lse_out, b, h, kv_heads, g, lane):
        """This lane's merged quads as the output (BF16 bits) and natural-log LSE of sequence ``b``."""
        nq = u32(g * MQ)
        for k in range(MCH):
            quad = u32(lane + WARP * k)
            if quad < nq:
                hq = u32((u32(b) * u32(kv_heads) + u32(h)) * u32(g) + quad // MQ)
                den = st[6 * k + 1]
                inv = f32(1) / den if den > 0 else f32(0)     # no split: an empty sequence, output 0
                lo = pack_bf16x2(st[6 * k + 2] * inv, st[6 * k + 3] * inv)
                hi = pack_bf16x2(st[6 * k + 4] * inv, st[6 * k + 5] * inv)
                base = u32(hq * D + 4 * (quad % MQ))
                out[base] = as_int16(lo & 0xFFFF)
                out[base + 1] = as_int16(lo >> 16)
                out[base + 2] = as_int16(hi & 0xFFFF)
                out[base + 3] = as_int16(hi >> 16)
                if quad % MQ == 0:
                    lse_out[hq] = (st[6 * k] + math.log2(den)) * f32(1 / _LOG2E) if den > 0 else f32(_NEG_INF)

    @device
    def fused_merge(o_part, lse_part, mrg, out, lse_out, merge_batch, group, b, w, h, kv_heads, g, lane, ents, scr):
        """The merge of the splits of sequence ``b``, KV head ``h``, by the warps that finish last: the splits
        come in groups of ``group``; the last warp of a group to store its partial merges the group's into a
        partial row of its own (rows ``W + slot``, after the splits'), and the last of those merges the
        groups' rows into the output.  A lone group's last warp writes the output.  Each counter is
        reset by the warp that finds itself last, for the next launch.  ``mrg`` int32: the splits' first
        index per sequence ``[B + 1]``, the groups' first slot per sequence ``[B + 1]``, a counter per
        (slot, KV head), then one per (sequence, KV head)."""
        nw = i32(cuda.gridDim.x)
        mb = i32(merge_batch + 1)
        s0 = mrg[u32(b)]
        nb = mrg[u32(b + 1)] - s0
        g0 = mrg[u32(mb + b)]
        ng = mrg[u32(mb + b + 1)] - g0
        first = i32(2 * mb)
        k = (w - s0) // group
        slot = g0 + k
        size = min(group, nb - k * group)
        at = i32(first + slot * kv_heads + h)
        if arrive(mrg, u32(at), ents, lane, scr) != size - 1:
            return
        cuda.threadfence()
        if lane == 0:
            mrg[u32(at)] = 0
        st = cuda.local.array(MST, float32)
        row0 = s0 + k * group
        n = size
        last_level = ng == 1
        at = i32(first + mrg[u32(mb + merge_batch)] * kv_heads + b * kv_heads + h)
        while True:                     # (a loop, not two copies of the merge: the code is large)
            merge_rows(o_part, lse_part, row0, n, h, kv_heads, g, lane, st)
            if last_level:
                merge_out(st, out, lse_out, b, h, kv_heads, g, lane)
                return
            merge_store(st, o_part, lse_part, nw + slot, h, kv_heads, g, lane)
            if arrive(mrg, u32(at), ents, lane, scr) != ng - 1:
                return
            cuda.threadfence()
            if lane == 0:
                mrg[u32(at)] = 0
            row0 = nw + g0
            n = ng
            last_level = True

    jit = cuda.jit if max_registers is None or SIMULATOR else cuda.jit(max_registers=max_registers)

    @jit
    def kernel(q32, slots_k, slots_v, raw_k, raw_v, table_k, table_v, tail_k, tail_v, bases, epoch_k, epoch_v,
               seq_lens, work, o_part, lse_part, status, max_blocks, kv_heads, g, slot_bytes_k, slot_bytes_v, cap_k,
               cap_v, epochs_k, epochs_v, n_slots_k, n_slots_v, n_raw_k, n_raw_v, scale_log2, mrg, out, lse_out,
               merge_batch, group):
        smem = cuda.shared.array(SMEM_WORDS, uint32, alignment=SMEM_ALIGN)
        ents = cuda.shared.array(NENT, int32)
        # Where the split's blocks change epoch (a byte a block, 1: its K or V epoch differs from the block
        # before it): bytes, not the epochs, so that the kernel keeps its occupancy.
        eps = cuda.shared.array(MAX_BLOCKS_PER_SPLIT, uint8)
        scr = cuda.shared.array(SCRATCH_WORDS, uint32)
        scratch_init(scr)
        # The merge kernel may be scheduled from now on (it waits for this grid before it reads): its
        # launch and its first loads overlap this grid's last blocks.
        grid_launch_dependents()
        sb = smem_base(smem)
        w = i32(cuda.blockIdx.x)
        h = i32(cuda.blockIdx.y)
        lane = lane_id()
        r = i32(lane >> 2)
        q = i32(lane & 3)
        # Unsigned indices in the prologue and epilogue: numba's signed ones add a negative-index fix-up
        # to every load and store, and every warp runs these at the same time (nothing overlaps them).
        b = work[u32(3 * w)]
        blk0 = work[u32(3 * w + 1)]
        blk1w = work[u32(3 * w + 2)]
        if not FUSED and blk1w <= blk0:
            # A free entry of a work list with room to spare (a captured step's: gaac.captured.BucketSteps),
            # which no row's merge reads.
            return
        # A decode step launches this kernel as a programmatic dependent of the layer's one-token append
        # (gaac.serving.plan), which writes the token into the tail, advances the length and, where the token
        # completes a block, that block's table entries and epoch.  A split whose blocks all ended before the
        # token (its last block ends before the length it reads, whether that is the length before or after
        # the append) reads nothing the append writes until it needs the query: it loads its table entries,
        # epochs and bases and starts its first copies while the append runs, and waits (``griddepcontrol.wait``)
        # before it reads the query.  Any other split waits first.  What a split reads that the append may
        # write (length, table entries, epochs) is read from L2: a line this grid brought into L1 before the
        # wait may be stale.  Launched without the attribute, the waits are no-ops.
        seq = ldcg_i32(seq_lens, u32(b))
        early = i32(blk1w * L.BLOCK_TOKENS) < seq
        if not early:
            grid_wait()
            seq = ldcg_i32(seq_lens, u32(b))
        nfull = i32(seq // L.BLOCK_TOKENS)
        tail_valid = i32(seq - nfull * L.BLOCK_TOKENS)
        # A captured step's work list covers the lengths of its last step: a split stops at the sequence's
        # blocks now (one past the tail), and one wholly past them is empty (output 0, LSE -inf).
        blk1 = min(blk1w, i32(nfull + (1 if tail_valid > 0 else 0)))
        hq = i32(kv_heads * g)

        # Block-table entries of this split (K then V, T tiles each).  The loads depend on the work item
        # only (not on the sequence length, which would put a second round trip to memory before them)
        # and are unconditional (a lane past the split's entries reloads its last one): all of them in
        # flight at once, where a load and store per lane under a condition made a round trip each.
        # Each is checked against its pool as it is stored (checked_entry).
        ntab = i32((min(blk1w, max_blocks) - blk0) * 2 * T)
        if ntab > 0:
            last = i32(min(blk1w, max_blocks) - 1)
            for k in range(NENT // WARP):
                i = i32(lane + WARP * k)
                blk_i = i32(min(blk0 + i // (2 * T), last))
                row = u32((b * max_blocks + blk_i) * (kv_heads * T) + h * T + i % T)
                if (i // T) % 2 == 0:
                    ents[i] = checked_entry(ldcg_i32(table_k, row), blk_i < nfull, n_slots_k, n_raw_k, status)
                else:
                    ents[i] = checked_entry(ldcg_i32(table_v, row), blk_i < nfull, n_slots_v, n_raw_v, status)
        # The split's blocks' epochs, K and V in one word each (loaded like the table entries, before the
        # sequence length is known, and checked where a block is decoded); the first block's bases are loaded
        # now, and the block loop loads another epoch's where a block's differs.  A split of only the tail
        # reads epoch 0.
        if not plain and ntab > 0:
            last = i32(min(blk1w, max_blocks) - 1)
            for k in range(MAX_BLOCKS_PER_SPLIT // WARP):
                j = i32(lane + WARP * k)
                at = u32(b * max_blocks + min(blk0 + j, last))
                before = u32(at - 1) if j > 0 and blk0 + j <= last else at      # (past the split: unread)
                eps[j] = uint8(1 if (ldcg_i16(epoch_k, at) != ldcg_i16(epoch_k, before))
                               | (ldcg_i16(epoch_v, at) != ldcg_i16(epoch_v, before)) else 0)
        ek = ldcg_i16(epoch_k, u32(b * max_blocks + blk0)) if not plain and blk0 < max_blocks else i32(0)
        ev_ = ldcg_i16(epoch_v, u32(b * max_blocks + blk0)) if not plain and blk0 < max_blocks else i32(0)
        tail_base = (b * kv_heads + h) * (L.BLOCK_TOKENS * D * 2)
        bw0 = cuda.local.array(BASE_REGS, int32)
        ne = max(epochs_k, epochs_v)
        if not plain:
            ek = checked_epoch(ek, epochs_k, status) if blk0 < nfull else i32(0)
            ev_ = checked_epoch(ev_, epochs_v, status) if blk0 < nfull else i32(0)
            load_bases(bases, 0, ek, ne, h, kv_heads, lane, bw0)
            load_bases(bases, 1, ev_, ne, h, kv_heads, lane, bw0)
        warp_sync(scr)
        # The first stages' copies start as soon as the entries are in shared memory, right behind the
        # bases' loads above (the first decode waits for both; the bases are stored after the copies).
        if REFILL:                              # prologue: block blk0, K and V in copy groups of their own
            if blk0 < blk1:
                issue_k(smem, sb, ents, 0, 0, blk0, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                        tail_valid, lane, entry(ents, 0, 0))
            cp_commit()
            if blk0 < blk1:
                issue_v(smem, sb, ents, 0, 0, blk0, nfull, slots_v, slot_bytes_v, raw_v, tail_v, tail_base,
                        tail_valid, lane, entry(ents, 0, 1))
            cp_commit()
        for s in range(NS - 1):                 # prologue: blocks blk0 .. blk0 + NS - 2
            if blk0 + s < blk1:
                issue_k(smem, sb, ents, s, s, blk0 + s, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                        tail_valid, lane, entry(ents, s, 0))
                issue_v(smem, sb, ents, s, s, blk0 + s, nfull, slots_v, slot_bytes_v, raw_v, tail_v, tail_base,
                        tail_valid, lane, entry(ents, s, 1))
            cp_commit()
        if early:
            grid_wait()
        # Query fragments (B operand of q.k: column r = query head r of the group; columns >= g zero), after
        # the wait (the kernel before may have written the query), in flight with the first copies.
        qb0 = cuda.local.array(NCHUNK, uint32)
        qb1 = cuda.local.array(NCHUNK, uint32)
        qrow = u32((b * hq + h * g + r) * (D // 2))
        for kk in range(NCHUNK):
            qb0[kk] = u32(q32[u32(qrow + 8 * kk + q)]) if r < g else u32(0)
            qb1[kk] = u32(q32[u32(qrow + 8 * kk + 4 + q)]) if r < g else u32(0)
        if not plain:
            store_bases(smem, bw0, lane)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = f32(0)
        m0 = f32(_NEG_INF)                      # running maxima and this lane's sums, heads 2q and 2q + 1
        m1 = f32(_NEG_INF)
        l0 = f32(0)
        l1 = f32(0)
        sc = cuda.local.array(8, float32)           # score accumulators (see qk_mma)
        kf = cuda.local.array(KF_WORDS, uint32)      # K fragments of one tile
        smw = cuda.local.array(SM_WORDS, uint32)     # decoder state (overlap path)
        cw = cuda.local.array(CODE_ARRAY, uint32)
        ev = cuda.local.array(GPL, uint32)
        bw = cuda.local.array(BASE_WORDS, uint32)
        warp_sync(scr)

        # 32-bit counters: numba's int64 loop arithmetic and `i % NS` cost ~60 instructions a block.
        st = i32(NS - 1)                        # stage of block i - 1 (that of block i + NS - 1)
        for i in range(i32(blk1 - blk0)):
            blk = i32(blk0 + i)
            ahead = i32(i + (NS - 1))
            sa = st                             # into the stage the previous iteration finished with
            st = i32(st + 1) if st < NS - 1 else i32(0)
            # The block-table entries this iteration uses, read together before any of them is needed: read
            # where each is used, they put two shared-memory round trips one after the other in the
            # copies' path and a third before the overlap test (the profile's top stalls of a block).
            ek_n = entry(ents, ahead, 0)
            ev_n = entry(ents, ahead, 1)
            ek_c = entry(ents, i, 0)
            ev_c = entry(ents, i, 1)
            if not REFILL:
                if blk0 + ahead < blk1:
                    issue_k(smem, sb, ents, ahead, sa, i32(blk0 + ahead), nfull, slots_k, slot_bytes_k, raw_k, tail_k,
                            tail_base, tail_valid, lane, ek_n)
                    issue_v(smem, sb, ents, ahead, sa, i32(blk0 + ahead), nfull, slots_v, slot_bytes_v, raw_v, tail_v,
                            tail_base, tail_valid, lane, ev_n)
                    # (ek_n, ev_n: tile 0's entries; a head of two tiles tests its entries there)
                    ahead_tail = blk0 + ahead >= nfull
                    if not plain and (T > 1 or i32(ek_n | ev_n) < 0 or ahead_tail):
                        prefetch_bf16_tiles(ents, ahead, ahead_tail, raw_k, raw_v, tail_k, tail_v, tail_base, lane)
                cp_commit()
            cp_wait()                           # REFILL: block i's K (its V may still be in flight)
            warp_sync(scr)
            is_tail = blk >= nfull
            valid = tail_valid if is_tail else i32(L.BLOCK_TOKENS)
            if not plain and not is_tail:
                # Where this block's epoch of K or V differs from the bases in shared memory, load its own
                # (the previous block's decode has finished with them: its last warp_sync).  Uniform in
                # the warp, and rare: an epoch covers hundreds of blocks.
                if eps[i] != 0:
                    at = u32(b * max_blocks + blk)
                    ek = checked_epoch(ldcg_i16(epoch_k, at), epochs_k, status)
                    ev_ = checked_epoch(ldcg_i16(epoch_v, at), epochs_v, status)
                    load_bases(bases, 0, ek, ne, h, kv_heads, lane, bw0)
                    load_bases(bases, 1, ev_, ne, h, kv_heads, lane, bw0)
                    store_bases(smem, bw0, lane)
                    warp_sync(scr)
            for c in range(8):
                sc[c] = f32(0)
            if overlap and not is_tail and ek_c >= 0 and ev_c >= 0:
                # Both tiles compressed: one escape scan; K decoded; then the V tile's reads, the q.k
                # MMAs, the softmax and the V decode in one straight-line region.
                src_k = u32(sb + STG + 2 * st * SB)
                src_v = u32(src_k + SB)
                base_k = u32(sb + BASES + C * (lane >> 4))
                base_v = u32(base_k + 4 * BASE_ROWS * RS)
                dec = u32(sb + DEC)
                tags_k, cnt_k = decode_tags(smem, src_k)
                if REFILL:
                    off_k = escape_scan(cnt_k, scr)
                else:
                    tags_v, cnt_v = decode_tags(smem, src_v)
                    off_k, off_v = escape_scan2(cnt_k, cnt_v, scr)
                decode_loads(smem, src_k, base_k, 4 * RS, tags_k, off_k, cap_k, smw, cw, ev, bw)
                decode_compute(smem, dec, tags_k, smw, cw, ev, bw)
                decode_fix(smem, src_k, dec, tags_k, off_k, cnt_k, cap_k, status)
                warp_sync(scr)
                if REFILL:
                    refill_k(smem, sb, ents, i, blk, blk1, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                             tail_valid, lane)
                load_k_frags(smem, dec, kf, scr)
                warp_sync(scr)                  # the V decode below overwrites the decode tile
                if REFILL:
                    cp_wait()
                    warp_sync(scr)
                    tags_v, cnt_v = decode_tags(smem, src_v)
                    off_v = escape_scan(cnt_v, scr)
                decode_loads(smem, src_v, base_v, 4 * RS, tags_v, off_v, cap_v, smw, cw, ev, bw)
                qk_mma(kf, 0, qb0, qb1, sc, scr)
                m0, m1, l0, l1, pb0, pb1, al0, al1 = softmax_update(sc, valid, r, m0, m1, l0, l1, scale_log2, scr)
                decode_compute(smem, dec, tags_v, smw, cw, ev, bw)
                decode_fix(smem, src_v, dec, tags_v, off_v, cnt_v, cap_v, status)
                warp_sync(scr)
                if REFILL:
                    refill_v(smem, sb, ents, i, blk, blk1, nfull, slots_v, slot_bytes_v, raw_v, tail_v, tail_base,
                             tail_valid, lane)
                rescale(acc, al0, al1, scr)
                pv_mma(smem, dec, 0, pb0, pb1, acc, scr)
                warp_sync(scr)
                continue
            for j in range(T):
                tile = tile_of(smem, sb, ents, i, st, 0, j, is_tail, raw_k, tail_k, tail_base + j * C * 2,
                               tail_valid, cap_k, status, scr, True)
                load_k_frags(smem, tile, kf, scr)
                qk_mma(kf, j, qb0, qb1, sc, scr)
                warp_sync(scr)
            if REFILL:
                refill_k(smem, sb, ents, i, blk, blk1, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                         tail_valid, lane)
            m0, m1, l0, l1, pb0, pb1, al0, al1 = softmax_update(sc, valid, r, m0, m1, l0, l1, scale_log2, scr)
            rescale(acc, al0, al1, scr)
            if REFILL:
                cp_wait()
                warp_sync(scr)
            for j in range(T):
                tile = tile_of(smem, sb, ents, i, st, 1, j, is_tail, raw_v, tail_v, tail_base + j * C * 2,
                               tail_valid, cap_v, status, scr, True)
                pv_mma(smem, tile, j, pb0, pb1, acc, scr)
                warp_sync(scr)
            if REFILL:
                refill_v(smem, sb, ents, i, blk, blk1, nfull, slots_v, slot_bytes_v, raw_v, tail_v, tail_base,
                         tail_valid, lane)

        # This split's normalised partial output and log-sum-exp (log2 domain).
        l0 = col_sum(l0, scr)
        l1 = col_sum(l1, scr)
        row = (w * kv_heads + h) * g + 2 * q
        if 2 * q < g:
            store_head(o_part, lse_part, acc, 0, row, r, m0, l0)
        if 2 * q + 1 < g:
            store_head(o_part, lse_part, acc, 1, row + 1, r, m1, l1)
        if FUSED and group > 0:
            fused_merge(o_part, lse_part, mrg, out, lse_out, merge_batch, group, b, w, h, kv_heads, g, lane, ents, scr)
    return kernel
