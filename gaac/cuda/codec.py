"""numba.cuda kernels that encode tiles into GAAC slots and decode them, bit-exact with the reference.

Contract
========
Arrays are torch CUDA tensors (NumPy arrays or torch CPU tensors under the
CUDA simulator), C-contiguous.  ``C = min(head_dim, 128)``, ``N = 16*C``,
``G = N/8`` groups per tile; ``slot_bytes = TileGeometry(C).slot_bytes(capacity)``.
The plans, :func:`pack_bases` and the one-shot helpers take an element format
(``fmt``, BF16 by default) that picks the kernels (:func:`device_codec`); the
arrays below are BF16's, and :mod:`gaac.fp8.cuda` says what differs for FP8.

Encode (:class:`EncodePlan`), one launch for any number of tiles ``n``
(all KV heads of one finished block, or every complete block of a prompt):

* ``bits``     int16 ``[n, 16, C]``  -- BF16 bit patterns of the tiles, tile order of
  :func:`gaac.tiles.block_tiles` (pass ``bf16.view(torch.int16)``);
* ``bases``    int16 ``[P, 2, C]``   -- :func:`pack_bases`; tile ``i`` uses row ``i % P`` (``P`` = tiles
  per block for a layer's bases, or ``P = n`` for one row per tile);
* ``slots``    uint8 ``[S, slot_bytes]`` and ``raw`` int16 ``[R, 16, C]`` -- the two storage pools;
* ``slot_free`` / ``raw_free`` int32 -- device-side free lists: indices of free slots / raw tiles;
* ``heads``    int32 ``[2]``         -- how many entries of each free list are taken; the kernel pops
  with ``atomicAdd`` (``heads[0]`` for slots, ``heads[1]`` for raw tiles);
* out ``entries`` int32 ``[n]``      -- each tile's block-table entry (FORMAT.md 7.2): the slot index,
  or ``raw index | 1 << 31`` (a negative int32) when the escapes overflow the slot.  ``-1``
  (:data:`NO_STORAGE`) means the free list was exhausted; the tile was not stored, and
  ``heads`` exceeds the list's length -- check it whenever the host syncs anyway;
* out ``escape_used`` int32 ``[n]``  -- escape bytes each tile needs (beyond ``capacity``: raw).

A fitting tile's slot receives exactly ``gaac.reference.codec.encode_tiles``'s
bytes; an overflowing tile's BF16 bits are copied to its raw tile and no slot is
touched.  Nothing is synchronised with the host: the storage decision lives in
``entries`` on the device, where the cache's block table (``entries`` may be a
view of it) and attention read it.

Decode (:class:`DecodePlan`): ``entries [n]`` (slot or raw entries, as above) ->
``out`` int16 ``[n, 16, C]`` plus ``status`` int32 ``[n]``: 0 valid, :data:`BAD_TAG`
(a group has the reserved mode tag 3) or :data:`BAD_ESCAPES` (the tags need
more escape bytes than ``capacity``); a bad tile's output is unspecified.
The escape area's zero padding is not checked here (the block container's
decoder checks it, and its CRC covers it).

Kernel shape (docs/design/codec.md has the shapes tried and the measurements): **one
warp per tile**, ``TILES_PER_BLOCK`` tiles per thread block.  Lane ``l`` owns the
groups ``32j + l`` (``j < G/32``), so every chunk ``j`` of a warp reads or writes
one contiguous run of the tile with 16-byte (BF16) or 8-byte (sign+mantissa)
vector accesses, and a lane's 8 channels -- hence its bases -- are the same in
every chunk.  The arithmetic is 32-bit (:mod:`gaac.cuda.primitives`, the 32-bit toolkit):
exponents in 16-bit lanes for the window tests, byte lanes and ``PRMT`` for
codes, sign+mantissa bytes and BF16 assembly, one multiply to gather or spread
an escape byte's 8 bit-plane bits.  Escape offsets come from popcounts over the
tag words (a group's offset = escape bytes of the tags before it), so the
decoder needs no communication between lanes at all; each lane first issues
every load of its groups (tag words, sign+mantissa, codes, escape words) and
then computes.  The encoder keeps its groups' BF16 words in registers across
two passes: pass 1 picks the modes and builds the tag words in shared memory;
the tile's escape total decides slot or raw tile, popped with one atomic per
block and pool (warps ranked in warp order); pass 2 writes sign+mantissa bytes
directly and stages codes and escape bytes in shared memory, from which the
warp writes whole words of the code stream and the escape area (zeros after
the last escape byte).  Block barriers: four; the rest is warp-synchronous.

Host overhead: kernels are compiled once per tile width with explicit types;
a plan validates its pools once and keeps the launch configuration; on the GPU
a launch packs the kernel parameters itself and calls ``cuda.core.launch``
(:mod:`gaac.cuda.launch`; ``fast=False`` takes numba's ordinary dispatcher path instead).
"""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import cuda, int32, uint8, uint32

from .. import layout as L
from ..errors import InputError
from .launch import (WORD, TileLauncher, allocators, check_array, is_torch, packed_params, params, plain, word_params,
                     words)
from .primitives import (SIMULATOR, WARP, device, funnel_r, grid_launch_dependents, i32, i64, ldg2, ldg4, mul32, popc32,
                         prmt, stg2, stg4, syncwarp, u32)

NO_STORAGE = -1                                  # entry of a tile whose free list ran dry
BAD_TAG = 1                                      # decode status: a group has the reserved tag
BAD_ESCAPES = 2                                  # decode status: the tags need more escape bytes than the slot has
_RAW_ENTRY_BIAS = L.TABLE_RAW_FLAG - (1 << 32)   # raw index + this = the entry as a (negative) int32

# Warps (one tile each) per thread block, both kernels.  One is fastest (docs/design/codec.md): the
# encoder's block barriers, which make a block's warps wait for the slowest, cost more than the atomic pops
# that larger blocks share.
TILES_PER_BLOCK = 1
_ESC4 = L.ESCAPE_BYTES[L.MODE_4BIT]
_ESCR = L.ESCAPE_BYTES[L.MODE_RAW]

# Encode: an element's exponent e sits in a 16-bit lane of a word (two elements per word); with
# K = 512 - base per lane, w = e + K lies in 264..767 (no borrow between lanes), and e is inside
# the 3-bit window exactly when bits 3..8 of w are zero (bit 9 set, w - 512 = code in 0..7);
# likewise bits 4..8 for the 4-bit window.  w's low bits are then the code (FORMAT.md 5.2-5.3).
_EXP_LANES = np.uint32(0x00FF00FF)
_BIAS = np.uint32(0x02000200)
_OUT3 = np.uint32(0x01F801F8)
_OUT4 = np.uint32(0x01F001F0)
# Byte permutes (selector nibble k = source byte of result byte k; bytes 4..7 are the 2nd word).
_LOW_BYTES = np.uint32(0x6420)                   # low byte of each 16-bit lane of two words
_HIGH_BYTES = np.uint32(0x7531)                  # high byte of each lane
_ZIP_LO = np.uint32(0x5140)                      # interleave bytes 0, 1 of two words -> two 16-bit lanes
_ZIP_HI = np.uint32(0x7362)                      # bytes 2, 3
_SIGN_BYTES = np.uint32(0x80808080)
_MANT_BYTES = np.uint32(0x7F7F7F7F)
_CODE_BYTES = np.uint32(0x07070707)
_BIT0_BYTES = np.uint32(0x01010101)
_BIT4_BYTES = np.uint32(0x10101010)
_BIT3_BYTES = np.uint32(0x08080808)
# Multiplying a word whose bytes hold bit 0 (elements 0..3) and bit 4 (elements 4..7) by this
# gathers those 8 bits into the top byte (element i at bit 24 + i), with no carries below it;
# multiplying a 4-bit nibble by it spreads nibble bit i to bit 8i + 3 (section 5.4's planes).
_GATHER = np.uint32(0x01020408)
_PAIR_LO = np.uint32(0x003F003F)
_LOW12 = np.uint32(0xFFF)
_LOW24 = np.uint32(0xFFFFFF)
_ODD_BITS = np.uint32(0xAAAAAAAA)                # bit 1 of every 2-bit tag: the raw tags' (and tag 3's)
_EVEN_BITS = np.uint32(0x55555555)
_M3, _M4, _MR = np.uint32(L.MODE_3BIT), np.uint32(L.MODE_4BIT), np.uint32(L.MODE_RAW)
_ZERO, _ONE, _FIVE = np.uint32(0), np.uint32(_ESC4), np.uint32(_ESCR)
# The kernels read tags as (bit 0 = 4-bit, bit 1 = raw): a tag's escape bytes are popc + 4 * bit 1.
# gaac.fp8.cuda's kernels read theirs alike (bit 0 = wide, bit 1 = raw) with other escape byte counts.
_TAG_BITS_OK = (L.MODE_3BIT, L.MODE_4BIT, L.MODE_RAW, L.TAG_BITS, _ESC4, _ESCR) == (0, 1, 2, 2, 1, 5)
assert _TAG_BITS_OK, "the kernels' tag arithmetic no longer matches gaac.layout's modes"

# Kernel arrays are 32-bit words: int32 views of the torch tensors on the GPU (uint32 in the simulator).
# gaac.fp8.cuda's kernels take the same arguments.
ENCODE_SIG = ("void(int32[:, ::1], int32[:, ::1], int64, int32[:, ::1], int32[::1], int32[:, ::1], "
              "int32[::1], int32[::1], int32[::1], int32[::1])")
ENCODE_IN_PLACE_SIG = ENCODE_SIG.replace("void(int32[:, ::1], ", "void(int32[:, ::1], int64, ", 1)
ENCODE_BY_ROWS_SIG = ENCODE_IN_PLACE_SIG.replace("int64, int32[:, ::1], int64, ", "int64, int32[:, ::1], int32[::1], int64, ", 1)
_W2, _W1 = "int32[:, ::1]", "int32[::1]"
STEP_APPEND_SIG = ("void(" + ", ".join([_W2] * 6 + ["int64"] * 2 + [_W2, _W2, _W1, _W1, _W2, _W2]
                                      + [_W1] * 6 + ["int16[::1]"] * 2 + [_W1, "int64"] + [_W1] * 4 + ["int64"]) + ")")
DECODE_SIG = "void(int32[:, ::1], int32[:, ::1], int32[::1], int32[:, ::1], int64, int32[:, ::1], int32[::1])"


def _check_channels(channels: int) -> L.TileGeometry:
    if channels not in {L.tile_channels(d) for d in L.SUPPORTED_HEAD_DIMS}:
        raise InputError(f"tiles of {channels} channels do not exist in the GAAC format (64 or 128)")
    return L.TileGeometry(channels)


@functools.lru_cache(maxsize=None)
def encode_kernel(channels: int, tiles_per_block: int = TILES_PER_BLOCK):
    """The encode kernel for ``channels``-wide tiles, compiled once (see the module docstring)."""
    return cuda.jit(ENCODE_SIG)(encode_source(channels, tiles_per_block))


@functools.lru_cache(maxsize=None)
def encode_in_place_kernel(channels: int, tiles_per_block: int = TILES_PER_BLOCK):
    """The encode kernel that reads a sequence's blocks in its input's layout (:meth:`EncodePlan.in_place`)."""
    return cuda.jit(ENCODE_IN_PLACE_SIG)(encode_source(channels, tiles_per_block, in_place=True))


@functools.lru_cache(maxsize=None)
def encode_by_rows_kernel(channels: int, tiles_per_block: int = TILES_PER_BLOCK):
    """The in-place encode kernel whose bases come from a table, a row of it per block
    (:meth:`EncodePlan.in_place_by_rows`)."""
    return cuda.jit(ENCODE_BY_ROWS_SIG)(encode_source(channels, tiles_per_block, in_place=True, by_rows=True))


@functools.lru_cache(maxsize=None)
def step_append_kernel(channels: int):
    """A captured decode step's append of one layer, compiled once per tile width: one launch for K and V.

    Grid ``(len(rows) * P, 2)`` of one-warp blocks (``P`` = the rows of ``bases_k``: tiles per block, one per
    KV head, so ``head_dim`` = ``C``).  Warp ``(i, kind)`` writes its head's channels of the new token
    ``new_k/new_v`` (words ``[len(rows) * P, C / 2]``) into the tails ``bits_k/v`` (words
    ``[max_seqs * P, 8 * C]``: a tile a row) at the sequence's length on the device (``seq_lens[rows[i // P]]``
    mod 16); a negative ``rows`` entry is a free place of the batch (nothing is written).  The last warp of
    the sequence to read that length advances it (``arrivals`` int32 ``[max_seqs]``, zero between launches,
    counts the readers).  Where the token completes the block, the warp encodes its tile straight from the
    tail into the pools with the bases ``bases_k/v``, as the encode kernel does, writes its entry to the flat
    block table ``[max_seqs * max_blocks * P]`` and, with ``with_epochs``, the block's epoch to ``epoch_k/v``
    int16 ``[max_seqs * max_blocks]``: ``epochs_now[0]`` for K, ``[1]`` for V, the epoch whose bases
    ``bases_k/v`` hold (both read on the device, so that the host publishes a new epoch between steps
    without changing the launch).  ``escape_used`` int32 ``[2 * len(rows) * P]`` receives each encoded
    tile's escape bytes (K, then V)."""
    return cuda.jit(STEP_APPEND_SIG)(encode_source(channels, 1, step_append=True))


@functools.lru_cache(maxsize=None)
def decode_kernel(channels: int, tiles_per_block: int = TILES_PER_BLOCK):
    """The decode kernel for ``channels``-wide tiles, compiled once (see the module docstring)."""
    return cuda.jit(DECODE_SIG)(decode_source(channels, tiles_per_block))


def _shape(channels: int):
    """Word counts of a tile and a slot (``WORD``-byte words; every section is a whole number)."""
    geo = _check_channels(channels)
    return dict(G=geo.groups, J=geo.groups // WARP, GPR=geo.groups_per_row, TW=geo.tag_bytes // WORD,
                SMW=geo.sm_bytes // WORD, CODEW=geo.code_bytes // WORD, TAGW0=geo.tag_offset // WORD,
                ESCW0=geo.escape_offset // WORD, HALF=channels // 2)


@device
def _exponents(x):
    """The exponents of the two BF16 values in ``x``, one per 16-bit lane (FORMAT.md 5.1)."""
    return u32((x >> u32(7)) & _EXP_LANES)


@device
def _code_bytes(a):
    """Four 3-bit codes at bits 0, 3, 6, 9 of ``a`` -> one per byte (bits 0..2 of bytes 0..3)."""
    t = u32((a | (a << u32(10))) & _PAIR_LO)
    return u32((t | (t << u32(5))) & _CODE_BYTES)


@device
def _pack_codes(y):
    """Inverse of :func:`_code_bytes`: 3-bit values in bytes 0..3 of ``y`` -> bits 0..11."""
    t = u32((y | (y >> u32(5))) & _PAIR_LO)
    return u32((t | (t >> u32(10))) & _LOW12)


@device
def _gather_bits(lo, hi, b):
    """Bit ``b`` (3..7) of the bytes of ``lo`` (elements 0..3) and ``hi`` (4..7) -> one escape byte,
    element i at bit i: the bits go to bits 0 and 4 of each byte, then one multiply gathers them."""
    up = u32(hi << u32(1)) if b == 3 else u32(hi >> u32(b - 4))
    return u32(mul32(((lo >> u32(b)) & _BIT0_BYTES) | (up & _BIT4_BYTES), _GATHER) >> u32(24))


@device
def _plane(x, bits, p):
    """``x`` with bits 0..3 of ``bits`` set at bit 3 + p of bytes 0..3: escape plane ``p`` (FORMAT.md
    5.4) of four elements added to their code bytes (one multiply spreads the 4 bits)."""
    return u32(x | (mul32(bits & u32(0xF), _GATHER << u32(p)) & (_BIT3_BYTES << u32(p))))


# ----------------------------------------------------------------------------------------------
# Device functions of both tile codecs: gaac.fp8.cuda's kernels call them with their own constants
# (escape bytes per mode, bytes per group of a stream, slot sections).  In the order the kernels
# use them: the encoders', then the decoders'.

@device
def _escape_count(tags, wide, raw):
    """Escape bytes of the (up to 16) groups whose 2-bit tags are in ``tags``: ``wide`` per tag 1, ``raw`` per
    tag 2, both per the reserved tag 3 (a decoder flags it anyway).  Counted as ``wide`` per set bit and
    ``raw - wide`` more per odd bit, so that BF16's (1, 5) costs two popcounts and a shift-add (FP8 passes its
    own counts)."""
    return u32(u32(u32(popc32(tags)) * wide) + u32(u32(popc32(tags & _ODD_BITS)) * u32(raw - wide)))


# _tag_words and _free_list_position hold block barriers and atomics, and every thread of the block
# calls them.  They are cuda.jit device functions in the simulator too (not primitives.device's plain
# functions): only a simulated cuda.jit function gets the launching kernel's cuda module when that
# kernel lives in another module (gaac.fp8.cuda).  Once per thread, the simulator's lock costs little.

@cuda.jit(device=True, inline=True)
def _tag_words(stage, tagw, tagc, tot, warp, lane, words, wide, raw):
    """The end of pass 1: after a block barrier (``stage[warp, g]`` holds group g's mode, ``tot[warp]`` is 0),
    lane ``w < words`` of each warp packs tag word ``w`` of its tile (groups 16w .. 16w+15) into ``tagw`` and
    its escape bytes (``wide``, ``raw`` per wide and raw tag) into ``tagc``.  Returns the tile's escape bytes,
    after a second barrier."""
    cuda.syncthreads()
    if lane < u32(words):
        first = u32(lane * u32(16))
        word = u32(0)
        for i in range(16):
            word = u32(word | u32(u32(stage[warp, u32(first + u32(i))]) << u32(2 * i)))
        tagw[warp, lane] = word
        count = _escape_count(word, wide, raw)
        tagc[warp, lane] = count
        cuda.atomic.add(tot, warp, count)
    cuda.syncthreads()
    return tot[warp]


@cuda.jit(device=True, inline=True)
def _free_list_position(heads, cls, base, tid, warp, lane, valid, fits, tpb):
    """The storage decision (FORMAT.md 6.4) of a block of ``tpb`` warps: a slot for a tile that ``fits``, a raw
    tile for another, popped from the free lists with one atomic per block and pool, the warps ranked in warp
    order (``cls`` and ``base`` are shared scratch).  Returns the warp's position in its free list for
    :func:`_take_storage` (0 where the warp has no tile: not ``valid``, no position was popped for it)."""
    my_cls = (i32(0) if fits else i32(1)) if valid else i32(2)
    if lane == _ZERO:
        cls[warp] = my_cls
    if tid == _ZERO:
        base[0] = 0
        base[1] = 0
    cuda.syncthreads()
    rank = i32(0)
    count0 = i32(0)
    count1 = i32(0)
    for w in range(tpb):
        c = cls[w]
        if c == my_cls and u32(w) < warp:
            rank += 1
        if c == 0:
            count0 += 1
        elif c == 1:
            count1 += 1
    if tid == _ZERO:
        if count0:
            base[0] = cuda.atomic.add(heads, 0, count0)
        if count1:
            base[1] = cuda.atomic.add(heads, 1, count1)
    cuda.syncthreads()
    return u32(base[my_cls] + rank) if valid else _ZERO


@device
def _take_storage(slot_free, raw_free, entries, escape_used, k, fits, tile, dest, lane, total):
    """The slot (a tile that ``fits``) or raw tile at position ``k`` of its free list, or NO_STORAGE where the
    list ran dry; lane 0 writes the tile's entry (FORMAT.md 7.2) to ``entries[dest]`` and its ``total``
    escape bytes to ``escape_used[tile]``."""
    if fits:
        d = slot_free[k] if k < u32(slot_free.shape[0]) else NO_STORAGE
        entry = d
    else:
        d = raw_free[k] if k < u32(raw_free.shape[0]) else NO_STORAGE
        entry = d + _RAW_ENTRY_BIAS if d >= 0 else NO_STORAGE
    if lane == _ZERO:
        entries[dest] = entry
        escape_used[tile] = total
    return d


@device
def _staged_offset(tagw, tagc, warp, lane, j, before, wide, raw):
    """Pass 2 of an encoder: the escape offset of this lane's group in chunk ``j`` (tag words ``2j``, ``2j+1``
    of ``tagw``, with ``tagc``'s escape bytes: lanes 0..15's groups, then 16..31's) = ``before`` (the escape
    bytes of earlier chunks) + those of the tags before the group.  Returns the offset and the escape bytes
    before chunk ``j + 1``."""
    second = lane >= u32(16)
    below = u32(u32(u32(1) << u32(u32(2) * (lane & u32(15)))) - u32(1))
    ta = tagw[warp, 2 * j]
    ca = tagc[warp, 2 * j]
    mine = tagw[warp, 2 * j + 1] if second else ta
    off = u32(u32(before + (ca if second else _ZERO)) + _escape_count(u32(mine & below), wide, raw))
    return off, u32(u32(before + ca) + tagc[warp, 2 * j + 1])


@device
def _stream_word(stage, warp, w, b):
    """Word ``w`` of a bit stream whose group ``g`` is the ``b`` bytes (2 or 3) of ``stage[warp, g]``:
    a word never spans more than two groups."""
    byte = u32(w * u32(WORD))
    g0 = u32(byte // u32(b))
    sh = u32(u32(8) * (byte % u32(b)))
    return u32((stage[warp, g0] >> sh) | (stage[warp, u32(g0 + u32(1))] << u32(u32(8 * b) - sh)))


@device
def _write_stream(slots, dw, w0, words, stage, warp, lane, b):
    """Words ``w0 .. w0 + words - 1`` of slot ``dw``: the bit stream staged in ``stage[warp]`` (``b`` bytes
    per group, :func:`_stream_word`), written by the warp in whole words."""
    for i in range(-(-words // WARP)):
        w = u32(lane + u32(WARP * i))
        if w < u32(words):
            slots[dw, u32(u32(w0) + w)] = _stream_word(stage, warp, w, b)


@device
def _write_tags_escapes(slots, dw, tagw, stage, warp, lane, cap, total, tag_words, tagw0, escw0):
    """The end of an encoder: the tile's tag stream (``tag_words`` words of ``tagw[warp]``) to word ``tagw0`` of
    slot ``dw``, and its ``total`` escape bytes staged in ``stage[warp]`` to the escape area at word ``escw0``
    (``cap`` bytes, zero after the escape bytes), the warp writing whole words."""
    if lane < u32(tag_words):
        slots[dw, u32(u32(tagw0) + lane)] = tagw[warp, lane]
    for w in range(i64(lane), cap // u32(WORD), WARP):
        b = u32(u32(w) * u32(WORD))
        word = u32(0)
        for i in range(WORD):
            if u32(b + u32(i)) < total:
                word = u32(word | u32(u32(stage[warp, u32(b + u32(i))]) << u32(8 * i)))
        slots[dw, u32(u32(escw0) + u32(w))] = word


@device
def _copy_raw(raw, entry, out, status, tile, lane, rounds):
    """Decoding a raw ``entry`` (FORMAT.md 7.2): its raw tile to row ``tile`` of ``out`` as it is, 16 bytes per
    lane and round, and status 0."""
    r = u32(entry & L.TABLE_INDEX_MASK)
    for i in range(rounds):
        w4 = u32(u32(lane + u32(WARP * i)) * u32(4))
        x0, x1, x2, x3 = ldg4(raw, r, w4)
        stg4(out, tile, w4, x0, x1, x2, x3)
    if lane == _ZERO:
        status[tile] = 0


@device
def _group_escapes(slots, d, tw, lane, bad, before, cap, escw0, wide, raw):
    """A decoder's tag arithmetic for this lane's group in one chunk, whose tag words are words ``tw``, ``tw + 1``
    of slot ``d`` (lanes 0..15's groups, then 16..31's): the group's escape offset is ``before`` (the escape
    bytes of earlier chunks) plus the escape bytes (``wide`` or ``raw`` a tag) of the tags before it.  Returns
    ``bad`` with the two words' reserved-tag bits added, the escape bytes before the next chunk, the group's
    mode | 4 if its escape bytes lie inside the slot (``cap`` bytes from word ``escw0``), the escape area's
    bytes 0..3 from the offset, and byte 4 in the low byte of the last value (the words read stay in the slot)."""
    second = lane >= u32(16)
    shift = u32(u32(2) * (lane & u32(15)))
    below = u32(u32(1) << shift) - u32(1)
    last = u32(u32(u32(escw0) + cap // u32(WORD)) - u32(1))     # last word of the slot
    ta, tb = ldg2(slots, d, tw)
    bad = u32(u32(bad | (ta & (ta >> u32(1)))) | (tb & (tb >> u32(1))))
    ca = _escape_count(ta, wide, raw)
    mine = tb if second else ta
    mode = u32(u32(mine >> shift) & u32(3))
    off = u32(u32(before + (ca if second else _ZERO)) + _escape_count(u32(mine & below), wide, raw))
    after = u32(u32(before + ca) + _escape_count(tb, wide, raw))
    need = wide if mode == _M4 else (raw if mode == _MR else _ZERO)
    inside = need != _ZERO and u32(off + need) <= cap
    q = min(u32(u32(escw0) + (off >> u32(2))), last)
    sh = u32(u32(8) * (off & u32(3)))
    lo = u32(slots[d, q])
    hi = u32(slots[d, min(u32(q + u32(1)), last)])
    return bad, after, u32(mode | (u32(4) if inside else _ZERO)), funnel_r(lo, hi, sh), u32(hi >> sh)


@device
def _stream_field(slots, d, w0, g, b):
    """Inverse of :func:`_stream_word`: group ``g``'s ``b`` bytes (2..4) of the bit stream at word ``w0`` of
    slot ``d``, from bit 0 (above them, the next group's bits)."""
    if b == WORD:
        return u32(slots[d, u32(u32(w0) + g)])
    byte = u32(g * u32(b))
    w = u32(u32(w0) + (byte >> u32(2)))
    sh = u32(u32(8) * (byte & u32(3)))
    return funnel_r(u32(slots[d, w]), u32(slots[d, u32(w + u32(1))]), sh)


@device
def _write_status(status, tile, lane, bad, total, cap):
    """Lane 0 writes the tile's decode status: BAD_TAG where a tag word held the reserved tag 3 (even bits of
    ``bad``, the words' ``t & t >> 1``), else BAD_ESCAPES where the tags need more than ``cap`` escape bytes."""
    if lane == _ZERO:
        status[tile] = BAD_TAG if bad & _EVEN_BITS else (BAD_ESCAPES if total > cap else 0)


def encode_source(channels: int, tiles_per_block: int = TILES_PER_BLOCK, step_append: bool = False,
                  in_place: bool = False, by_rows: bool = False):
    """The Python function of the encode kernel, its tile geometry baked in as constants.

    ``step_append``: the kernel of a captured decode step (:func:`step_append_kernel`), which appends the
    step's token to the tails and encodes the blocks it completes, straight from the tails.  ``in_place``:
    the kernel that reads one sequence's blocks where its input holds them (:meth:`EncodePlan.in_place`); with
    ``by_rows``, each block's bases are the table's row ``rows[block]`` (:meth:`EncodePlan.in_place_by_rows`)."""
    s = _shape(channels)
    G, J, GPR, TW, SMW, CODEW, TAGW0, ESCW0, HALF = (s[k] for k in
                                                    ("G", "J", "GPR", "TW", "SMW", "CODEW", "TAGW0", "ESCW0", "HALF"))
    TPB = tiles_per_block
    TILE_WORDS = L.BLOCK_TOKENS * channels // 2
    STAGE = (TPB, G * _ESCR)
    CODES = (TPB, G)
    TAGS = (TPB, TW)
    u = u32

    @device
    def encode_tile(bits, bases, capacity, slots, slot_free, raw, raw_free, heads, entries, escape_used, tile, valid,
                    t, dest, c0):
        """One warp's tile: words ``c0 ..`` of row ``t`` of ``bits`` (a tile's 16 tokens), entry to
        ``entries[dest]``, escape bytes to ``escape_used[tile]``, bases from row ``t % P`` of ``bases``; a warp
        without a tile (not ``valid``) only takes part in the block's pops."""
        stage = cuda.shared.array(STAGE, uint8)            # mode of each group; later the escape bytes
        codes = cuda.shared.array(CODES, uint32)           # 24 code bits of each group
        tagw = cuda.shared.array(TAGS, uint32)             # the tile's tag stream
        tagc = cuda.shared.array(TAGS, uint32)             # escape bytes of each tag word
        tot = cuda.shared.array(TPB, uint32)               # escape bytes of each warp's tile
        cls = cuda.shared.array(TPB, int32)                # per warp: 0 slot, 1 raw tile, 2 no tile
        base = cuda.shared.array(2, int32)                 # first free-list position of this block's pops
        sm_lo = cuda.local.array(J, uint32)                # per group of this lane: sign+mantissa bytes 0..3,
        sm_hi = cuda.local.array(J, uint32)                # 4..7, and the 24 code bits | the 4-bit escape
        code = cuda.local.array(J, uint32)                 # byte << 24

        tid = u(cuda.threadIdx.x)
        warp = tid // u(WARP)
        lane = tid % u(WARP)
        cap = u(capacity)
        row = t % u(bases.shape[0])
        col = u((lane % u(GPR)) * u(4))                    # this lane's 8 channels are the same in every chunk
        b0, b1, b2, b3 = ldg4(bases, row, col)
        k30, k31, k32, k33 = u(_BIAS - b0), u(_BIAS - b1), u(_BIAS - b2), u(_BIAS - b3)
        b0, b1, b2, b3 = ldg4(bases, row, u(col + u(HALF)))
        k40, k41, k42, k43 = u(_BIAS - b0), u(_BIAS - b1), u(_BIAS - b2), u(_BIAS - b3)

        # Pass 1, per group (lane l has groups 32j + l): the narrowest mode (FORMAT.md 5.2), the
        # sign+mantissa bytes (5.1), the low 3 bits of the codes (5.3) and a 4-bit group's escape
        # byte (5.4).  Only these stay in registers; a raw group's 5 escape bytes are made in pass 2.
        if lane == _ZERO:
            tot[warp] = 0
        modes = u(0)
        for j in range(J):
            g = u(u(WARP * j) + lane)
            x0, x1, x2, x3 = ldg4(bits, t, u(c0 + u(g * u(4))))
            e0, e1, e2, e3 = _exponents(x0), _exponents(x1), _exponents(x2), _exponents(x3)
            w0, w1, w2, w3 = u(e0 + k30), u(e1 + k31), u(e2 + k32), u(e3 + k33)
            v0, v1, v2, v3 = u(e0 + k40), u(e1 + k41), u(e2 + k42), u(e3 + k43)
            if ((w0 | w1 | w2 | w3) & _OUT3) == _ZERO:
                mode = _M3
            elif ((v0 | v1 | v2 | v3) & _OUT4) == _ZERO:
                mode = _M4
                w0, w1, w2, w3 = v0, v1, v2, v3
            else:
                mode = _MR
                w0, w1, w2, w3 = e0, e1, e2, e3
            lo = prmt(w0, w1, _LOW_BYTES)                  # the codes (raw: exponents), one per byte
            hi = prmt(w2, w3, _LOW_BYTES)
            c = u(_pack_codes(u(lo & _CODE_BYTES)) | u(_pack_codes(u(hi & _CODE_BYTES)) << u(12)))
            code[j] = u(c | u(_gather_bits(lo, hi, 3) << u(24))) if mode == _M4 else c
            sm_lo[j] = u((prmt(x0, x1, _HIGH_BYTES) & _SIGN_BYTES) | (prmt(x0, x1, _LOW_BYTES) & _MANT_BYTES))
            sm_hi[j] = u((prmt(x2, x3, _HIGH_BYTES) & _SIGN_BYTES) | (prmt(x2, x3, _LOW_BYTES) & _MANT_BYTES))
            stage[warp, g] = mode
            modes = u(modes | u(mode << u(2 * j)))
        total = _tag_words(stage, tagw, tagc, tot, warp, lane, TW, _ONE, _FIVE)
        fits = total <= cap                                # else a raw tile (FORMAT.md 6.4)
        k = _free_list_position(heads, cls, base, tid, warp, lane, valid, fits, TPB)
        if not valid:
            return
        d = _take_storage(slot_free, raw_free, entries, escape_used, k, fits, tile, dest, lane, total)
        if d < 0:
            return
        dw = u(d)
        if not fits:                                       # the tile as it is, read again (rare)
            for j in range(J):
                g4 = u(u(u(WARP * j) + lane) * u(4))
                s4 = u(c0 + g4)
                raw[dw, g4] = bits[t, s4]
                raw[dw, u(g4 + u(1))] = bits[t, u(s4 + u(1))]
                raw[dw, u(g4 + u(2))] = bits[t, u(s4 + u(2))]
                raw[dw, u(g4 + u(3))] = bits[t, u(s4 + u(3))]
            return

        # Pass 2: sign+mantissa bytes to the slot; codes and escape bytes to shared memory, a group's
        # escape bytes at its offset = escape bytes of the tag stream before it (tag words 2j, 2j+1
        # hold chunk j: lanes 0..15, then 16..31).
        before = u(0)
        for j in range(J):
            g = u(u(WARP * j) + lane)
            mode = u(u(modes >> u(2 * j)) & u(3))
            stg2(slots, dw, u(g * u(2)), sm_lo[j], sm_hi[j])
            c = code[j]
            codes[warp, g] = u(c & _LOW24)
            off, before = _staged_offset(tagw, tagc, warp, lane, j, before, _ONE, _FIVE)
            if mode == _M4:
                stage[warp, off] = u(c >> u(24))
            elif mode == _MR:                               # planes 3..7 of the exponents, read again (rare)
                g4 = u(c0 + u(g * u(4)))
                e0, e1 = _exponents(u(bits[t, g4])), _exponents(u(bits[t, u(g4 + u(1))]))
                e2, e3 = _exponents(u(bits[t, u(g4 + u(2))])), _exponents(u(bits[t, u(g4 + u(3))]))
                lo = prmt(e0, e1, _LOW_BYTES)
                hi = prmt(e2, e3, _LOW_BYTES)
                for p in range(_ESCR):
                    stage[warp, u(off + u(p))] = _gather_bits(lo, hi, 3 + p)
        syncwarp()

        # Whole words of the code stream (24 bits a group), the tag stream and the escape area.
        _write_stream(slots, dw, SMW, CODEW, codes, warp, lane, 3)
        _write_tags_escapes(slots, dw, tagw, stage, warp, lane, cap, total, TW, TAGW0, ESCW0)

    if step_append:
        def kernel(new_k, new_v, bits_k, bits_v, bases_k, bases_v, cap_k, cap_v, slots_k, slots_v,
                   slot_free_k, slot_free_v, raw_k, raw_v, raw_free_k, raw_free_v, heads_k, heads_v, table_k, table_v,
                   epoch_k, epoch_v, epochs_now, with_epochs, escape_used, rows, seq_lens, arrivals, max_blocks):
            # One warp a block (TPB 1): blockIdx.x = tile i of the step's sequences (P tiles each: one per KV
            # head), blockIdx.y = kind.  The warp appends its head's channels of the new token to the tail,
            # then, where the token completes the block, encodes the tile from the tail.
            # The layer's attention kernel, launched as a programmatic dependent of this one, may start now:
            # it waits for this grid before it reads what this grid writes (gaac.cuda.attention).
            grid_launch_dependents()
            i = u(cuda.blockIdx.x)
            kind = u(cuda.blockIdx.y)
            lane = u(cuda.threadIdx.x)
            per = u(bases_k.shape[0])                      # tiles (heads) per block of the layer
            if rows[i // per] < 0:                         # a free place of the batch
                return
            row = u(rows[i // per])
            j = i % per
            n = u(seq_lens[row])
            r = n % u(L.BLOCK_TOKENS)
            t = u(row * per + j)                           # the tile's row of the tails
            w0 = u(r * u(HALF))                            # the token's first word in it
            for w in range(lane, HALF, WARP):
                if kind == _ZERO:
                    bits_k[t, u(w0 + u(w))] = new_k[i, w]
                else:
                    bits_v[t, u(w0 + u(w))] = new_v[i, w]
            syncwarp()
            # The length advances once every warp of the sequence has read it: the last to arrive writes it.
            if lane == _ZERO:
                cuda.threadfence()
                if u(cuda.atomic.add(arrivals, row, 1)) == u(2 * per - 1):
                    arrivals[row] = 0
                    seq_lens[row] = n + u(1)
            if r != u(L.BLOCK_TOKENS - 1):
                return
            last = u(n // u(L.BLOCK_TOKENS))               # the block this token completes
            dest = u((row * u(max_blocks) + last) * per + j)
            if kind == _ZERO:
                if with_epochs and j == _ZERO and lane == _ZERO:
                    epoch_k[row * u(max_blocks) + last] = epochs_now[0]
                encode_tile(bits_k, bases_k, cap_k, slots_k, slot_free_k, raw_k, raw_free_k, heads_k, table_k,
                            escape_used, i, True, t, dest, _ZERO)
            else:
                if with_epochs and j == _ZERO and lane == _ZERO:
                    epoch_v[row * u(max_blocks) + last] = epochs_now[1]
                encode_tile(bits_v, bases_v, cap_v, slots_v, slot_free_v, raw_v, raw_free_v, heads_v, table_v,
                            escape_used, u(i + u(cuda.gridDim.x)), True, t, dest, _ZERO)
        return kernel

    if in_place and by_rows:
        def kernel(bits, first, table, rows, capacity, slots, slot_free, raw, raw_free, heads, entries, escape_used):
            # as the in-place kernel, but block b's bases are rows rows[b] * P .. + P - 1 of the table (P = the
            # rows of bits, a tile a head): the epoch each block is coded with, as the adaptation rule decided
            # it on the device
            n = u(entries.shape[0])
            per = u(bits.shape[0])
            tile = u(u(cuda.blockIdx.x) * u(TPB) + u(cuda.threadIdx.x) // u(WARP))
            valid = tile < n
            i = tile if valid else u(n - u(1))             # a warp past the end mirrors the last tile
            b = i // per
            r = u(u(rows[b]) * per)
            encode_tile(bits, table[r:u(r + per)], capacity, slots, slot_free, raw, raw_free, heads, entries,
                        escape_used, tile, valid, u(i % per), tile, u(u(u(first) + b) * u(TILE_WORDS)))
        return kernel

    if in_place:
        def kernel(bits, first, bases, capacity, slots, slot_free, raw, raw_free, heads, entries, escape_used):
            # bits: one sequence's tokens as its input holds them, a row per head ([P, tokens * C / 2] words);
            # tile i of the launch is head i % P of block first + i // P, whose 16 tokens are 8 * C words of
            # the head's row.
            n = u(entries.shape[0])
            per = u(bases.shape[0])
            tile = u(u(cuda.blockIdx.x) * u(TPB) + u(cuda.threadIdx.x) // u(WARP))
            valid = tile < n
            i = tile if valid else u(n - u(1))             # a warp past the end mirrors the last tile
            encode_tile(bits, bases, capacity, slots, slot_free, raw, raw_free, heads, entries, escape_used, tile,
                        valid, u(i % per), tile, u(u(u(first) + i // per) * u(TILE_WORDS)))
        return kernel

    def kernel(bits, bases, capacity, slots, slot_free, raw, raw_free, heads, entries, escape_used):
        n = u(bits.shape[0])
        tile = u(u(cuda.blockIdx.x) * u(TPB) + u(cuda.threadIdx.x) // u(WARP))
        valid = tile < n
        t = tile if valid else u(n - u(1))                 # a warp past the end mirrors the last tile
        encode_tile(bits, bases, capacity, slots, slot_free, raw, raw_free, heads, entries, escape_used, tile, valid,
                    t, tile, _ZERO)

    return kernel


def decode_source(channels: int, tiles_per_block: int = TILES_PER_BLOCK):
    """The Python function of the decode kernel, its tile geometry baked in as constants."""
    s = _shape(channels)
    J, GPR, SMW, TAGW0, ESCW0, HALF = (s[k] for k in ("J", "GPR", "SMW", "TAGW0", "ESCW0", "HALF"))
    TPB = tiles_per_block
    SM = 2 * J
    u = u32

    def kernel(slots, raw, entries, bases, capacity, out, status):
        sm = cuda.local.array(SM, uint32)                 # this lane's sign+mantissa words
        code = cuda.local.array(J, uint32)                # its 24 code bits per group
        esc = cuda.local.array(J, uint32)                 # escape bytes 0..3 of its group
        esc4 = cuda.local.array(J, uint32)                # escape byte 4 (raw groups)
        what = cuda.local.array(J, uint32)                # mode | 4 if the escapes lie inside the slot

        tid = u(cuda.threadIdx.x)
        warp = tid // u(WARP)
        lane = tid % u(WARP)
        tile = u(u(cuda.blockIdx.x) * u(TPB) + warp)
        if tile >= u(entries.shape[0]):
            return
        entry = entries[tile]
        if entry < 0:
            _copy_raw(raw, entry, out, status, tile, lane, J)
            return
        d = u(entry)
        cap = u(capacity)

        # Loads first (every chunk's words in flight at once), with the tag arithmetic that places
        # each group's escape bytes: offset = escape bytes of the tag stream before the group.
        total = u(0)
        bad = u(0)
        for j in range(J):
            g = u(u(WARP * j) + lane)
            bad, total, what[j], esc[j], top = _group_escapes(slots, d, u(TAGW0 + 2 * j), lane, bad, total, cap, ESCW0,
                                                              _ONE, _FIVE)
            esc4[j] = u(top & u(0xFF))
            s_lo, s_hi = ldg2(slots, d, u(g * u(2)))
            sm[2 * j] = s_lo
            sm[2 * j + 1] = s_hi
            code[j] = _stream_field(slots, d, SMW, g, 3)            # 24 code bits a group
        _write_status(status, tile, lane, bad, total, cap)

        row = tile % u(bases.shape[0])
        col = u((lane % u(GPR)) * u(4))
        b0, b1, b2, b3 = ldg4(bases, row, col)
        b3lo, b3hi = prmt(b0, b1, _LOW_BYTES), prmt(b2, b3, _LOW_BYTES)
        b0, b1, b2, b3 = ldg4(bases, row, u(col + u(HALF)))
        b4lo, b4hi = prmt(b0, b1, _LOW_BYTES), prmt(b2, b3, _LOW_BYTES)

        # Exponent bytes = base + code (no carry between bytes: base + code <= 255, FORMAT.md 5.3),
        # then each BF16 as (low byte, high byte) = (e0 m6..m0, s e7..e1).
        for j in range(J):
            g = u(u(WARP * j) + lane)
            v = code[j]
            lo = _code_bytes(u(v & _LOW12))
            hi = _code_bytes(u(u(v >> u(12)) & _LOW12))
            w = what[j]
            mode = u(w & u(3))
            if w & u(4):
                e = esc[j]
                lo = _plane(lo, e, 0)
                hi = _plane(hi, u(e >> u(4)), 0)
                if mode == _MR:
                    for p in range(1, _ESCR):
                        byte = u(e >> u(8 * p)) if p < 4 else esc4[j]
                        lo = _plane(lo, byte, p)
                        hi = _plane(hi, u(byte >> u(4)), p)
            if mode == _M3:
                lo, hi = u(lo + b3lo), u(hi + b3hi)
            elif mode == _M4:
                lo, hi = u(lo + b4lo), u(hi + b4hi)
            s_lo, s_hi = sm[2 * j], sm[2 * j + 1]
            h_lo = u((s_lo & _SIGN_BYTES) | ((lo >> u(1)) & _MANT_BYTES))
            l_lo = u(((lo << u(7)) & _SIGN_BYTES) | (s_lo & _MANT_BYTES))
            h_hi = u((s_hi & _SIGN_BYTES) | ((hi >> u(1)) & _MANT_BYTES))
            l_hi = u(((hi << u(7)) & _SIGN_BYTES) | (s_hi & _MANT_BYTES))
            stg4(out, tile, u(g * u(4)), prmt(l_lo, h_lo, _ZIP_LO), prmt(l_lo, h_lo, _ZIP_HI),
                 prmt(l_hi, h_hi, _ZIP_LO), prmt(l_hi, h_hi, _ZIP_HI))

    return kernel


# ----------------------------------------------------------------------------------------------
# Host side: checking arrays once, packing kernel parameters, launching on torch's stream (the
# machinery is gaac.cuda.launch's).  The plans, the bases and the one-shot helpers are one layer for
# every element format; the format picks its kernels and dtypes (:func:`device_codec`).

@dataclass(frozen=True)
class DeviceCodec:
    """The device side of one element format's codec: the mode set its kernels implement, the dtype of
    the tiles' bits and of the raw pool, the dtype of the packed bases, and its kernel factories
    (``(channels, tiles_per_block) -> compiled kernel``, each compiled once)."""

    modes: L.ModeSet
    element: str                # BF16: int16 (the kernels read 16-bit lanes); FP8: uint8
    bases: str                  # packed bases: int16 lanes for BF16, byte lanes for FP8
    encode_kernel: Callable
    decode_kernel: Callable

    def geometry(self, channels: int) -> L.TileGeometry:
        if channels not in L.TILE_WIDTHS:
            raise InputError(f"tiles of {channels} channels do not exist in the GAAC format (tile widths "
                             f"{L.TILE_WIDTHS})")
        return L.TileGeometry(channels, self.modes)


BF16_CODEC = DeviceCodec(L.BF16_MODES, "int16", "int16", encode_kernel, decode_kernel)

_CODECS: dict = {}
"""Element format name -> the factory ``mode set -> DeviceCodec`` of its kernels, for the formats other than
BF16 (:func:`register_codec`)."""


def register_codec(fmt: L.ElementFormat, factory: Callable[[L.ModeSet], DeviceCodec]) -> None:
    """Make ``factory`` (``mode set -> DeviceCodec``) the device codec of element format ``fmt``'s mode sets.
    The kernels of a format other than BF16 live in a module above this one, which registers them when it is
    imported (:mod:`gaac.fp8.cuda` registers E4M3's and E5M2's), so that the plans, :func:`pack_bases` and
    the one-shot helpers run them by element format without this module importing that one."""
    _CODECS[fmt.name] = factory


def device_codec(fmt=L.BF16) -> DeviceCodec:
    """The device codec of ``fmt``: an element format, its name, or a mode set.  BF16's kernels implement
    its mode set 3/4/raw8; the FP8 kernels (:mod:`gaac.fp8.cuda`, registered when it is imported:
    :func:`register_codec`) are built for any FP8 mode set."""
    try:
        modes = fmt if isinstance(fmt, L.ModeSet) else L.mode_set(fmt)
    except (ValueError, TypeError) as exc:
        raise InputError(str(exc)) from None
    if modes.fmt is L.BF16:
        if modes != L.BF16_MODES:
            raise InputError(f"the BF16 kernels implement mode set {L.BF16_MODES.label}, not {modes.label}")
        return BF16_CODEC
    factory = _CODECS.get(modes.fmt.name)
    if factory is None:
        raise InputError(f"no device kernels are registered for {modes.fmt.name}: import gaac.fp8.cuda, which "
                         "registers the FP8 kernels (gaac.cuda.codec.register_codec)")
    return factory(modes)


def check_capacity(capacity) -> int:
    """``capacity`` (escape bytes per slot) as an int, or :class:`InputError`: the kernels size the
    escape area in whole words and trust it, so it is checked once, when a plan is built."""
    if int(capacity) != capacity or capacity % L.SLOT_ALIGN or not 0 <= capacity <= L.MAX_ESCAPE_CAPACITY:
        raise InputError(f"capacity {capacity}: must be a multiple of {L.SLOT_ALIGN} in 0..{L.MAX_ESCAPE_CAPACITY}")
    return int(capacity)


def _bases_words(bases, codec: DeviceCodec, channels: int):
    check_array(bases, "bases", codec.bases, (None, 2, channels))
    if bases.shape[0] == 0:
        raise InputError("bases: needs at least one row")
    return words(bases)


def pack_bases(b_narrow, b_wide, fmt=L.BF16):
    """Per-tile bases ``[P, C]`` (as :func:`gaac.tiles.tile_bases` gives) -> ``[P, 2, C]`` for ``fmt``'s kernels:
    narrow bases, then wide bases, in the codec's base dtype (BF16: int16; FP8: uint8).

    Torch in, torch out (same device); NumPy in, NumPy out.  Done once per layer and
    kind.  Bases outside the mode set's windows (FORMAT.md 3.2 rule 2) raise :class:`InputError`.
    """
    codec = device_codec(fmt)
    modes = codec.modes
    if is_torch(b_narrow):
        import torch

        out = torch.stack([b_narrow.to(torch.int16), b_wide.to(torch.int16)], dim=1).contiguous()
    else:
        out = np.stack([np.asarray(b_narrow, dtype=np.int64), np.asarray(b_wide, dtype=np.int64)], axis=1)
    if len(out.shape) != 3 or out.shape[0] == 0 or out.shape[2] not in L.TILE_WIDTHS:
        raise InputError(f"bases must be [tiles, C] with tiles >= 1 and C in {L.TILE_WIDTHS}; "
                         f"got {list(np.shape(b_narrow))} and {list(np.shape(b_wide))}")
    (lo_n, lo_w), (hi_n, hi_w) = ([int(out[:, i].min()) for i in (0, 1)], [int(out[:, i].max()) for i in (0, 1)])
    if lo_n < 0 or hi_n > modes.narrow_base_max or lo_w < 0 or hi_w > modes.wide_base_max:
        raise InputError(f"{modes.fmt.name}: narrow ({modes.low_bits}-bit) bases must lie in "
                         f"0..{modes.narrow_base_max} and wide bases in 0..{modes.wide_base_max}; got "
                         f"{lo_n}..{hi_n} and {lo_w}..{hi_w}")
    if is_torch(out):
        import torch

        return out.to(getattr(torch, codec.bases))
    return np.ascontiguousarray(out.astype(codec.bases))


class EncodePlan:
    """Encoding into one pair of pools (slots + raw tiles) with one set of bases: build once, call per block.

    See the module docstring for every array.  ``fmt`` (an element format, its name or a mode set; BF16
    by default) picks the kernel and the dtype of the tiles and the raw pool (:func:`device_codec`).  A
    call checks only the per-call arrays (``bits``, ``entries``, ``escape_used``) and launches once.
    """

    def __init__(self, channels: int, capacity: int, bases, slots, slot_free, raw, raw_free, heads, *,
                 fmt=L.BF16, tiles_per_block: int = TILES_PER_BLOCK, checked: bool = True):
        codec = device_codec(fmt)
        geo = codec.geometry(channels)
        self.modes, self.element, self.geometry = codec.modes, codec.element, geo
        self.channels = channels
        if checked:
            _bases_words(bases, codec, channels)
            self.capacity = check_capacity(capacity)
            check_array(slots, "slots", "uint8", (None, geo.slot_bytes(capacity)))
            check_array(raw, "raw", self.element, (None, L.BLOCK_TOKENS, channels))
            check_array(slot_free, "slot_free", "int32", (None,))
            check_array(raw_free, "raw_free", "int32", (None,))
            check_array(heads, "heads", "int32", (2,))
        else:
            self.capacity = int(capacity)
        self._arrays = (bases, slots, slot_free, raw, raw_free, heads)
        self._fixed_views = None
        self._launcher = TileLauncher(codec.encode_kernel(channels, tiles_per_block), tiles_per_block)
        # the fixed parameters packed from the arrays themselves (no views made): what a launch appends
        self._pools_params = None if SIMULATOR else (
            packed_params((self.capacity,)) + word_params(slots) + params(slot_free) + word_params(raw)
            + params(raw_free) + params(heads))
        self._fixed_params = None if SIMULATOR else word_params(bases) + self._pools_params
        self._codec, self._rows, self._tiles_per_block, self._in_place = codec, bases.shape[0], tiles_per_block, None
        self._by_rows = None

    @classmethod
    def of_pools(cls, channels: int, capacity: int, bases, slots, slot_free, raw, raw_free, heads) -> "EncodePlan":
        """A BF16 plan of arrays a paged cache made and keeps in the form the kernels take (its own pools,
        free lists and packed bases): not checked again, so that a cache's plans for every layer and kind
        cost their packing only."""
        return cls(channels, capacity, bases, slots, slot_free, raw, raw_free, heads, checked=False)

    @property
    def _fixed(self) -> tuple:
        """The fixed arguments as the kernels take them: the bases' and pools' word views, the capacity, the
        free lists and counts (made at first use)."""
        if self._fixed_views is None:
            bases, slots, slot_free, raw, raw_free, heads = self._arrays
            self._fixed_views = (words(bases), self.capacity, words(slots), plain(slot_free), words(raw),
                                 plain(raw_free), plain(heads))
        return self._fixed_views

    def with_bases(self, bases) -> "EncodePlan":
        """This plan with other bases (``[P, 2, C]`` as :func:`pack_bases` gives them, the same ``P``): the
        pools, the kernels and their launch state are shared, so that a plan for an epoch the adaptation rule
        appends costs the check of its bases, not a plan's construction."""
        _bases_words(bases, self._codec, self.channels)
        if bases.shape[0] != self._rows:
            raise InputError(f"bases: {bases.shape[0]} rows, but this plan's have {self._rows}")
        plan = copy.copy(self)
        plan._arrays = (bases, *self._arrays[1:])
        plan._fixed_views = None
        plan._fixed_params = None if SIMULATOR else word_params(bases) + self._pools_params
        return plan

    def in_place(self, bits, first: int, entries, escape_used, *, stream=None, fast: bool = True,
                 checked: bool = True):
        """Encode blocks ``first .. first + n / P - 1`` of one sequence from its input as it lies: ``bits``
        ``[P, tokens, C]`` (BF16 bits, C-contiguous; ``P`` = the rows of the bases, a tile a head, so
        ``head_dim`` = ``C``), the ``n`` = ``len(entries)`` tiles in tile order (block-major), so that a
        prefill encodes without first copying its blocks into tiles.  ``checked=False``: the arrays' kinds
        are not checked again (a paged cache's, which it made in these forms); their extents still are."""
        if self._codec is not BF16_CODEC:
            raise InputError("encoding in place takes BF16 tiles")
        p = self._rows
        if checked:
            check_array(bits, "bits", self.element, (p, None, self.channels))
            n = check_array(entries, "entries", "int32", (None,)).shape[0]
            check_array(escape_used, "escape_used", "int32", (n,))
        else:
            n = entries.shape[0]
            if escape_used.shape[0] != n or bits.shape[0] != p:
                raise InputError(f"in place: {n} entries, {escape_used.shape[0]} escape counts, {bits.shape[0]} "
                                 f"rows of bits for {p} tiles a block")
        if n % p or first < 0 or (first + n // p) * L.BLOCK_TOKENS > bits.shape[1]:
            raise InputError(f"{n} tiles from block {first}: not whole blocks of {p} tiles within "
                             f"{bits.shape[1]} tokens")
        if n == 0:
            return
        if self._in_place is None:
            self._in_place = TileLauncher(encode_in_place_kernel(self.channels, self._tiles_per_block),
                                          self._tiles_per_block)
        self._launch(self._in_place, n, bits, (int(first),), entries, escape_used, stream, fast)

    @property
    def bases(self):
        """The packed bases ``[P, 2, C]`` this plan encodes with."""
        return self._arrays[0]

    def in_place_by_rows(self, bits, table, rows, entries, escape_used, *, stream=None, fast: bool = True):
        """:meth:`in_place` from block 0, each block ``b`` coded with the bases of row ``rows[b]`` of ``table``
        (int16 ``[R * P, 2, C]``: ``R`` sets of packed bases, as :func:`pack_bases` gives each; ``rows`` int32, a
        row a block, each below ``R``): one launch for blocks whose epochs differ, and whose epochs the host need
        not know -- the adaptation rule's decisions on the device give ``rows``.  The plan's own bases are not
        read; its pools are.  The arrays are a paged cache's, made in these forms: their kinds are not checked,
        their extents are."""
        if self._codec is not BF16_CODEC:
            raise InputError("encoding in place takes BF16 tiles")
        p, n = self._rows, entries.shape[0]
        if (escape_used.shape[0] != n or bits.shape[0] != p or n % p or rows.shape[0] < n // p
                or table.shape[0] % p or (n // p) * L.BLOCK_TOKENS > bits.shape[1]):
            raise InputError(f"by rows: {n} entries, {escape_used.shape[0]} escape counts, {bits.shape[0]} rows of "
                             f"bits ({bits.shape[1]} tokens), {rows.shape[0]} block rows and a table of "
                             f"{table.shape[0]} rows for {p} tiles a block")
        if n == 0:
            return
        if self._by_rows is None:
            self._by_rows = TileLauncher(encode_by_rows_kernel(self.channels, self._tiles_per_block),
                                         self._tiles_per_block)
        if self._pools_params is not None and fast:
            packed = (word_params(bits) + packed_params((0,)) + word_params(table) + params(rows)
                      + self._pools_params + params(entries) + params(escape_used))
            self._by_rows.launch(n, None, stream, fast, packed)
            return
        self._by_rows.launch(n, (words(bits), 0, words(table), plain(rows), *self._fixed[1:], plain(entries),
                                 plain(escape_used)), stream, fast)

    def __call__(self, bits, entries, escape_used, *, stream=None, fast: bool = True):
        n = check_array(bits, "bits", self.element, (None, L.BLOCK_TOKENS, self.channels)).shape[0]
        check_array(entries, "entries", "int32", (n,))
        check_array(escape_used, "escape_used", "int32", (n,))
        if n == 0:
            return
        self._launch(self._launcher, n, bits, (), entries, escape_used, stream, fast)

    def _launch(self, launcher, n: int, bits, scalars: tuple, entries, escape_used, stream, fast: bool) -> None:
        """Launch ``launcher`` over ``n`` tiles: the words of ``bits``, then ``scalars`` (ints), the plan's
        fixed arguments, ``entries`` and ``escape_used``; packed by hand on the fast path."""
        if self._fixed_params is not None and fast:
            packed = (word_params(bits) + packed_params(scalars) + self._fixed_params
                      + params(entries) + params(escape_used))
            launcher.launch(n, None, stream, fast, packed)
            return
        launcher.launch(n, (words(bits), *scalars, *self._fixed, plain(entries), plain(escape_used)), stream, fast)


class DecodePlan:
    """Decoding from one pair of pools with one set of bases: build once, call per batch of tiles.

    ``fmt`` picks the kernel and dtypes, as for :class:`EncodePlan`."""

    def __init__(self, channels: int, capacity: int, bases, slots, raw, *, fmt=L.BF16,
                 tiles_per_block: int = TILES_PER_BLOCK):
        codec = device_codec(fmt)
        geo = codec.geometry(channels)
        bases_words = _bases_words(bases, codec, channels)
        self.modes, self.element, self.geometry = codec.modes, codec.element, geo
        self.channels, self.capacity = channels, check_capacity(capacity)
        check_array(slots, "slots", "uint8", (None, geo.slot_bytes(capacity)))
        check_array(raw, "raw", self.element, (None, L.BLOCK_TOKENS, channels))
        self._slots, self._raw = words(slots), words(raw)
        self._bases = bases_words
        self._launcher = TileLauncher(codec.decode_kernel(channels, tiles_per_block), tiles_per_block)
        self._pool_params = None if SIMULATOR else params(self._slots) + params(self._raw)
        self._bases_params = None if SIMULATOR else params(self._bases) + params(self.capacity)

    def __call__(self, entries, out, status, *, stream=None, fast: bool = True):
        n = check_array(entries, "entries", "int32", (None,)).shape[0]
        check_array(out, "out", self.element, (n, L.BLOCK_TOKENS, self.channels))
        check_array(status, "status", "int32", (n,))
        if n == 0:
            return
        if self._pool_params is not None and fast:
            packed = (self._pool_params + params(entries) + self._bases_params + word_params(out)
                      + params(status))
            self._launcher.launch(n, None, stream, fast, packed)
            return
        args = (self._slots, self._raw, plain(entries), self._bases, self.capacity, words(out), plain(status))
        self._launcher.launch(n, args, stream, fast)


# ----------------------------------------------------------------------------------------------
# One-shot helpers: a pool of n slots and n raw tiles for n tiles (tests, benchmarks, containers).

def encode_tiles(bits, b_narrow, b_wide, capacity: int, fmt=L.BF16, *, stream=None) -> dict:
    """Encode tiles ``bits`` ``[n, 16, C]`` of format ``fmt`` (BF16: int16, FP8: uint8) with per-tile bases
    ``[P, C]`` into fresh pools of ``n``.

    Returns ``slots``, ``raw``, ``entries``, ``escape_used`` and ``heads`` (see the
    module docstring); tile ``i`` sits at ``entries[i]``.  Asynchronous on the GPU.
    """
    codec = device_codec(fmt)
    n, _, channels = check_array(bits, "bits", codec.element, (None, L.BLOCK_TOKENS, None)).shape
    geo = codec.geometry(channels)
    zeros, arange = allocators(bits)
    out = dict(slots=zeros((n, geo.slot_bytes(capacity)), "uint8"),
               raw=zeros((n, L.BLOCK_TOKENS, channels), codec.element),
               entries=zeros((n,), "int32"), escape_used=zeros((n,), "int32"), heads=zeros((2,), "int32"))
    plan = EncodePlan(channels, capacity, pack_bases(b_narrow, b_wide, codec.modes), out["slots"], arange(n),
                      out["raw"], arange(n), out["heads"], fmt=codec.modes)
    plan(bits, out["entries"], out["escape_used"], stream=stream)
    return out


def decode_tiles(slots, raw, entries, b_narrow, b_wide, capacity: int, fmt=L.BF16, *, stream=None):
    """Decode the tiles that ``entries`` point at -> (``[n, 16, C]`` of ``fmt``'s dtype, status int32 ``[n]``)."""
    codec = device_codec(fmt)
    channels = check_array(raw, "raw", codec.element, (None, L.BLOCK_TOKENS, None)).shape[2]
    n = check_array(entries, "entries", "int32", (None,)).shape[0]
    zeros, _ = allocators(entries)
    out, status = zeros((n, L.BLOCK_TOKENS, channels), codec.element), zeros((n,), "int32")
    DecodePlan(channels, capacity, pack_bases(b_narrow, b_wide, codec.modes), slots, raw, fmt=codec.modes)(
        entries, out, status, stream=stream)
    return out, status
