"""The decode of one staged GAAC slot into a padded BF16 tile in shared memory, and the copy that stages it.

The attention kernel (:mod:`gaac.cuda.attention`) copies a block's slots into shared memory
(:func:`stage_slot_fn`) and decodes each into a BF16 tile that ``ldmatrix`` reads (:func:`decode_tile_fn`),
one warp per tile: lane ``l`` rebuilds row ``l % 16``, half ``l // 16`` of the channels, two BF16
elements per 32-bit operation.

Pair words
==========
Decoding builds each output word (two BF16 elements ``c, c+1`` of one token)
directly: ``(prmt(sm, dup) & 0x807F807F) | (e_c << 7 | e_{c+1} << 23)``.  The
exponent pair ``Z`` is ``code pair + base pair + escape bits``: the 3-bit codes
of two elements move from bits ``0..5`` of a 12-bit code field to bits 7 and 23
with one multiply (the two shifted copies cannot overlap, so no carries), the
bases are stored pre-shifted per channel pair (rows b3, b4 and a zero row for
raw groups, selected by the mode tag), and an escape byte's bits land on bits
10 and 26 (exponent bit 3) by one more multiply.  Raw groups add bit planes 1..4 on a slow path.
"""
from __future__ import annotations

import functools

from numba import uint32

from .. import layout as L
from .primitives import (WARP, cp16, device, escape_scan, gaddr, i32, kernel_api, lane_id, lds, lds2, lds4, lds_u8,
                         mul32, popc, prmt0, sts4, u32, u64)


BASE_ROWS = 3                # pre-shifted base rows per kind, indexed by the mode tag: b3, b4, 0 (raw); the
                             # reserved tag 3 (flagged) reads the next row, so shared memory follows the bases
PAD_WORDS = 4                # 16 bytes of padding per BF16 row: ldmatrix and the decoder's stores are conflict-free

# Status bits (``status[0]``, OR-ed in) the decoder sets when a slot breaks FORMAT.md section 8; the
# attention kernel adds its own above them (gaac.cuda.attention).
STATUS_BAD_TAG = 1
STATUS_BAD_ESCAPES = 2


# ----------------------------------------------------------------------------------------------
# Shared-memory layout (bytes).

def row_bytes(channels: int) -> int:
    """Bytes per row of a staged or decoded BF16 tile: 2C plus 16 bytes of padding."""
    return 2 * channels + 4 * PAD_WORDS


def tile_bytes(channels: int) -> int:
    """Bytes of one staging area: a padded BF16 tile, which also holds any slot (slot <= raw bytes)."""
    return L.BLOCK_TOKENS * row_bytes(channels)


def base_row_words(head_dim: int) -> int:
    """Words per pre-shifted base row in shared memory: D/2 pair words and 16 bytes of padding, so that
    the rows of one channel group (read by lanes of different mode tags) fall in different banks."""
    return head_dim // 2 + PAD_WORDS


@device
def escape_scan2(a, b, scr):
    """Two exclusive escape scans in one: the counts packed in 16-bit halves (a tile needs at most
    256 x 5 escape bytes, so the low half never carries into the high one)."""
    x = escape_scan(i32(a | (b << 16)), scr)
    return i32(x & 0xFFFF), i32(x >> 16)


@device
def escape_pair(e, p):
    """Bits ``2p``, ``2p+1`` of escape byte ``e`` -> bits 10 and 26 (exponent bit 3 of pair word ``p``'s
    two elements): one multiply and one mask.  The multiplier places two copies of the byte, shifted
    by ``10 - 2p`` and ``25 - 2p``; they occupy disjoint bits, so the product has no carries."""
    return u32(mul32(e, (1 << (10 - 2 * p)) + (1 << (25 - 2 * p))) & 0x04000400)


@functools.lru_cache(maxsize=None)
def decode_tile_fn(channels: int):
    """Device functions for C-wide tiles: ``decode(smem, src, dst, base, base_stride, cap, status, scr)``,
    and its stages (tags, reads, compute+stores, fix-up) for callers that interleave two decodes with
    other work (:func:`gaac.cuda.attention.attention_kernel`'s ``overlap``); last, the sizes of the stages'
    local arrays.

    Lane ``l`` decodes row ``t = l % 16``, channels ``(l // 16) * C/2 ..`` (``C/16`` groups): with the
    staging swizzle of the sign+mantissa chunks (chunk ``c`` at ``c ^ ((c >> 3) & SWZ)``) and the
    16 bytes of row padding, every 16-byte shared access of a phase of 8 lanes is conflict-free.
    ``src``/``dst``: byte addresses of the staged slot and of the BF16 tile; ``base``: of this lane's
    first b3 pair word (rows b3, b4, zeros ``base_stride`` bytes apart: row = mode tag; the reserved tag
    reads the row after them, which must be shared memory: its output is garbage, its status flagged).
    """
    geo = L.TileGeometry(channels)
    C = channels
    GPL = C // 16                       # groups per lane
    CPL = C // 32                       # 16-byte sign+mantissa chunks per lane
    SM_WORDS = 2 * GPL                  # sign+mantissa words per lane
    CODE_WORDS = 3 * C // 64            # code words per lane (8-byte aligned for C=128, 4 for C=64)
    CODE_ARRAY = CODE_WORDS + 1         # and a zero word after them
    BASE_WORDS = 4 * GPL                # base pair words of a lane's groups
    ROWB = row_bytes(C)
    SWZ = 7 if C == 128 else 3
    CODE_OFF, TAG_OFF, ESC_OFF = geo.code_offset, geo.tag_offset, geo.escape_offset
    ESC_MAX = i32(2 * L.BLOCK_TOKENS * C - ESC_OFF - L.RAW_PLANES)   # escape reads stay in a raw tile's size
    K_EVEN = (1 << 7) | (1 << 20)       # codes at bits 0-2, 3-5 of a 12-bit field -> bits 7, 23
    K_ODD = (1 << 1) | (1 << 14)        # codes at bits 6-8, 9-11 -> bits 7, 23
    ESC4 = L.ESCAPE_BYTES[L.MODE_4BIT]
    ESCR = L.ESCAPE_BYTES[L.MODE_RAW]

    @device
    def decode_tags(smem, src):
        """This lane's mode tags (2 bits a group) and the escape bytes its groups need."""
        lane = lane_id()
        t = lane & 15
        if C == 128:
            tags = u32(lds(smem, u32(src + TAG_OFF + 4 * t)) >> (16 * (lane >> 4)))
        else:
            tags = u32(lds(smem, u32(src + TAG_OFF + 4 * (t >> 1))) >> (16 * (t & 1) + 8 * (lane >> 4)))
        tags = u32(tags & (0xFFFF if C == 128 else 0xFF))
        return tags, i32(popc(tags & 0x5555) * ESC4 + popc(tags & 0xAAAA) * ESCR)

    @device
    def decode_loads(smem, src, base, base_stride, tags, off, cap, smw, cw, ev, bw):
        """Every other shared-memory read of this lane's part of a tile, issued back to back so that
        their latencies overlap (the compiler cannot move a read above the decoder's stores, which
        might alias): sign+mantissa words ``smw``, code words ``cw``, each group's first escape byte
        ``ev`` (``off`` = escape bytes of the tile's earlier groups) and base pair words ``bw``."""
        lane = lane_id()
        t = lane & 15
        h = lane >> 4
        # Chunks c0 + k (k < CPL) share c >> 3, and c0 is a multiple of CPL: chunk k's swizzled offset
        # is chunk 0's xor 16k.
        c0 = u32(t * (C // 16) + h * CPL)
        sm0 = u32(16 * (c0 ^ ((c0 >> 3) & SWZ)))
        for k in range(CPL):
            w0, w1, w2, w3 = lds4(smem, u32(src + (sm0 ^ (16 * k))))
            smw[4 * k] = w0
            smw[4 * k + 1] = w1
            smw[4 * k + 2] = w2
            smw[4 * k + 3] = w3
        code = u32(src + CODE_OFF + t * (3 * C // 8) + h * (4 * CODE_WORDS))
        if C == 128:
            for i in range(CODE_WORDS // 2):
                u0, u1 = lds2(smem, u32(code + 8 * i))
                cw[2 * i] = u0
                cw[2 * i + 1] = u1
        else:
            for i in range(CODE_WORDS):
                cw[i] = lds(smem, u32(code + 4 * i))
        cw[CODE_WORDS] = u32(0)
        # In a valid slot off + (this lane's escape bytes) <= cap.  Clamped to cap, a corrupt ``off``
        # still reads inside shared memory: at most 6 * GPL bytes past the slot (the decode tile, or the
        # next stage, follows every staged slot), and the status word reports it.
        pos = i32(min(off, i32(cap)))
        esc = u32(src + ESC_OFF)
        for k in range(GPL):
            m = u32((tags >> (2 * k)) & 3)
            ev[k] = lds_u8(smem, u32(esc + pos))                  # read even for a 3-bit group, then dropped
            pos = i32(pos + m + 3 * (m >> 1))                     # escape bytes of mode m: 0, 1, 5
            b0, b1, b2, b3 = lds4(smem, u32(base + m * base_stride + 16 * k))
            bw[4 * k] = b0
            bw[4 * k + 1] = b1
            bw[4 * k + 2] = b2
            bw[4 * k + 3] = b3

    @device
    def decode_compute(smem, dst, tags, smw, cw, ev, bw):
        """Branch-free over the groups: the BF16 words of 3-bit and 4-bit groups; a raw group gets
        exponent bits 0..3 here and bits 4..7 in :func:`decode_fix`."""
        lane = lane_id()
        out = u32(dst + (lane & 15) * ROWB + (lane >> 4) * C)
        for k in range(GPL):
            bit = 24 * k
            sh = bit % 32
            y = cw[bit // 32] >> sh
            if sh > 8:
                y = u32(y | (cw[bit // 32 + 1] << (32 - sh)))
            y_lo = u32(y & 0xFFF)
            y_hi = u32((y >> 12) & 0xFFF)
            sp = ev[k] if (tags >> (2 * k)) & 3 else u32(0)
            s0 = smw[2 * k]
            s1 = smw[2 * k + 1]
            sts4(smem, u32(out + 16 * k),
                 u32((prmt0(s0, 0x1100) & 0x807F807F) | u32(((y_lo * K_EVEN) & 0x03800380) + bw[4 * k]
                                                            + escape_pair(sp, 0))),
                 u32((prmt0(s0, 0x3322) & 0x807F807F) | u32(((y_lo * K_ODD) & 0x03800380) + bw[4 * k + 1]
                                                            + escape_pair(sp, 1))),
                 u32((prmt0(s1, 0x1100) & 0x807F807F) | u32(((y_hi * K_EVEN) & 0x03800380) + bw[4 * k + 2]
                                                            + escape_pair(sp, 2))),
                 u32((prmt0(s1, 0x3322) & 0x807F807F) | u32(((y_hi * K_ODD) & 0x03800380) + bw[4 * k + 3]
                                                            + escape_pair(sp, 3))))

    @device
    def decode_fix(smem, src, dst, tags, off, cnt, cap, status):
        """The rare part: format checks (status word) and exponent bits 4..7 of raw groups."""
        lane = lane_id()
        if off + cnt > cap:
            kernel_api.atomic.or_(status, 0, STATUS_BAD_ESCAPES)
        if tags & (tags >> 1) & 0x5555:
            kernel_api.atomic.or_(status, 0, STATUS_BAD_TAG)
        raw = u32(tags & 0xAAAA)                                  # bit 2k+1: group k is raw
        if raw:
            # Raw groups (about 0.3% of groups): exponent bits 4..7 from bit planes 1..4, added to the
            # words just stored (the exponent field has no carry out: exponents are at most 255).  Only
            # the raw groups are visited, lowest first: a tile with raw groups makes the whole warp
            # take this branch (half of the K tiles of real caches), so the warp runs as many passes
            # as its lane with the most raw groups has (usually one), not one pass per group.
            esc = u32(src + ESC_OFF)
            out = u32(dst + (lane & 15) * ROWB + (lane >> 4) * C)
            while raw:
                low = u32(raw & u32(~raw + 1))                       # bit 2k+1 alone
                raw = u32(raw ^ low)
                below = u32(tags & ((low >> 1) - 1))                 # the tags of groups 0..k-1
                pos = u32(esc + min(i32(off + popc(below & 0x5555) * ESC4 + popc(below & 0xAAAA) * ESCR),
                                    ESC_MAX))
                at = u32(out + 8 * (popc(low - 1) - 1))              # 16 k bytes into the lane's row
                w0, w1, w2, w3 = lds4(smem, at)
                for j in range(1, L.RAW_PLANES):
                    pj = lds_u8(smem, u32(pos + j))
                    w0 = u32(w0 + (escape_pair(pj, 0) << j))
                    w1 = u32(w1 + (escape_pair(pj, 1) << j))
                    w2 = u32(w2 + (escape_pair(pj, 2) << j))
                    w3 = u32(w3 + (escape_pair(pj, 3) << j))
                sts4(smem, at, w0, w1, w2, w3)

    @device
    def decode(smem, src, dst, base, base_stride, cap, status, scr):
        smw = kernel_api.local.array(SM_WORDS, uint32)
        cw = kernel_api.local.array(CODE_ARRAY, uint32)
        ev = kernel_api.local.array(GPL, uint32)
        bw = kernel_api.local.array(BASE_WORDS, uint32)
        tags, cnt = decode_tags(smem, src)
        off = escape_scan(cnt, scr)
        decode_loads(smem, src, base, base_stride, tags, off, cap, smw, cw, ev, bw)
        decode_compute(smem, dst, tags, smw, cw, ev, bw)
        decode_fix(smem, src, dst, tags, off, cnt, cap, status)

    return decode, decode_tags, decode_loads, decode_compute, decode_fix, (SM_WORDS, CODE_ARRAY, GPL, BASE_WORDS)


def stage_slot_fn(channels: int, max_bytes: int):
    """Device function ``stage_slot(smem, dst, entry, slots, slot_bytes, lane)``: start copying slot
    ``entry`` (of at most ``max_bytes``) to the staging area at byte ``dst``, sign+mantissa chunk ``c``
    at ``c ^ ((c >> 3) & SWZ)`` (the layout :func:`decode_tile_fn` reads without bank conflicts).

    Lane ``l`` copies chunks ``l + 32k``.  Their swizzle is ``l ^ ((l >> 3) & SWZ) ^ ((4k) & SWZ)`` (``l >> 3``
    is below 4, so adding ``4k`` only flips bit 2), so every copy's shared and global addresses are one
    per-lane value plus a constant: one 64-bit multiply-add per slot for the source, immediates for the
    rest.  The tail of the slot takes a fixed number of predicated copies.  (Written per copy, the
    swizzle and 64-bit address arithmetic cost ~90 instructions a slot in the attention kernel's block
    loop, more than the copies themselves.)"""
    C = channels
    SM_PER_LANE = C // WARP             # the sign+mantissa section is C chunks of 16 bytes
    REST_PER_LANE = -(-(max_bytes // 16 - C) // WARP)
    SWZ = 7 if C == 128 else 3

    @device
    def stage_slot(smem, dst, entry, slots, slot_bytes, lane):
        g0 = gaddr(slots, u64(u32(entry)) * u64(u32(slot_bytes)) + u64(16 * lane))
        sw = u32(16 * (lane ^ ((lane >> 3) & SWZ)))
        for k in range(SM_PER_LANE):
            cp16(smem, u32(dst + (sw ^ (16 * ((4 * k) & SWZ))) + 512 * k), slots, g0 + 512 * k)
        left = i32(i32(slot_bytes >> 4) - C - i32(lane))     # chunks of the tail from this lane's first one
        rest = u32(dst + 16 * (C + lane))
        for k in range(REST_PER_LANE):
            if 32 * k < left:
                cp16(smem, u32(rest + 512 * k), slots, g0 + 16 * (C + 32 * k))
    return stage_slot
