"""numba.cuda kernels that encode FP8 tiles into GAAC-FP8 slots and decode them, bit-exact with gaac/reference/codec.py.

Contract
========
The contract of :mod:`gaac.cuda.codec` (read its docstring), with FP8 elements: its
:class:`~gaac.cuda.codec.EncodePlan` and :class:`~gaac.cuda.codec.DecodePlan`,
:func:`~gaac.cuda.codec.pack_bases` and one-shot helpers take an FP8 format (a name such as
``"fp8_e4m3"``, an :class:`~gaac.layout.ElementFormat`, or any FP8
:class:`~gaac.layout.ModeSet`) and run this module's kernels (:func:`fp8_codec`), which importing this
module registers with :func:`gaac.cuda.codec.register_codec`.
``C = min(head_dim, 128)``, ``N = 16*C``, ``G = N/8``;
``slot_bytes = TileGeometry(C, modes).slot_bytes(capacity)`` (FORMAT-FP8.md 5.1).  What differs from
BF16's arrays: ``bits``, ``raw`` and ``out`` are uint8 ``[*, 16, C]`` -- FP8 bit patterns
(``float8_e4m3fn`` / ``float8_e5m2`` tensors as ``.view(torch.uint8)``; a raw tile is the FP8 bytes
as they are, FORMAT-FP8.md 5.2) -- and the packed ``bases`` are uint8 ``[P, 2, C]``: narrow bases,
then wide bases.

Kernel shape: the BF16 kernels' (one warp per tile, lane ``l`` owns groups ``32j + l``, the
storage decision on the device, escape offsets from popcounts over the tag words), with byte
lanes instead of 16-bit lanes.  A group of 8 FP8 elements is two 32-bit words, one 8-byte load
per lane per chunk (a warp moves 256 contiguous bytes at a time).  The arithmetic is branch-free
per element: with ``w = e + (0x80 - base)`` in every byte lane (no carry: ``e, base < 0x80``),
``v = w ^ 0x80`` is the code ``e - base`` when ``e >= base`` and has bit 7 set otherwise, so a
group is inside a window of ``2^k`` exactly when ``v`` has no bit ``>= k`` in its 8 bytes.  Codes,
sign+mantissa fields and escape planes are packed and unpacked with shifts, masks and one
multiply per escape plane (:func:`_pack4`, :func:`_unpack4`, :func:`_plane_byte`,
:func:`_spread_plane`).  Bit streams whose group is a whole word (E4M3's sign+mantissa nibbles)
are written by each lane directly; narrower ones (the 2-bit codes, E5M2's 3-bit fields) and the
escape bytes are staged in shared memory and written as whole words.  What does not depend on
the element format (tag words, storage decision, escape offsets, stream words, raw tiles, status)
is :mod:`gaac.cuda.codec`'s device functions, called with this mode set's constants.

Every number comes from :mod:`gaac.layout`; the kernels are built
per (mode set, tile width) and compiled once.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, int32, uint8, uint32

from .. import layout as L
from ..cuda.codec import (DECODE_SIG, ENCODE_SIG, TILES_PER_BLOCK, DeviceCodec, _copy_raw, _free_list_position,
                          _group_escapes, register_codec, _staged_offset, _stream_field, _tag_words, _take_storage, _write_status,
                          _write_stream, _write_tags_escapes)
from ..cuda.launch import WORD
from ..cuda.primitives import WARP, device, ldg2, mul32, stg2, syncwarp, u32
from ..errors import InputError
from ..layout import FP8_FORMATS, MODE_NARROW, MODE_RAW, MODE_WIDE, TILE_WIDTHS, ModeSet, TileGeometry

__all__ = ["decode_kernel", "decode_source", "encode_kernel", "encode_source", "fp8_codec"]

_GROUP_WORDS = L.GROUP_SIZE // WORD              # 32-bit words of one group of FP8 bytes (2)
# The kernels read a tag as (bit 0 = wide, bit 1 = raw), as the BF16 kernels do: a tag word's escape
# bytes are gaac.cuda.codec._escape_count's, with the mode set's wide and raw escape bytes.
assert (MODE_NARROW, MODE_WIDE, MODE_RAW, L.TAG_BITS, _GROUP_WORDS) == (0, 1, 2, 2, 2), \
    "the FP8 kernels' tag and group arithmetic no longer matches gaac.layout"

_FLAG = np.uint32(0x80808080)                    # bit 7 of every byte lane
_BYTE0 = np.uint32(0x01010101)
# Multiplying bytes that hold one bit at bit 0 (elements 0..3) and bit 4 (elements 4..7) by this
# gathers the 8 bits into the top byte, element i at bit 24 + i (no two partial products collide).
_GATHER = np.uint32(0x01020408)
# Multiplying a 4-bit value by this puts its bit i at bit 8i (and nowhere else at a multiple of 8).
_SPREAD = np.uint32(0x00204081)
_U8 = np.uint32(0xFF)


def _bytes(value: int) -> np.uint32:
    """``value`` (< 256) in all four byte lanes of a word."""
    return np.uint32(value * 0x01010101)


@device
def _pack4(y, w):
    """Four ``w``-bit values (``w <= 4``) in bytes 0..3 of ``y`` -> bits 0..4w-1, value k at bit ``w*k``."""
    pair = u32(u32(u32(1) << u32(2 * w)) - u32(1))
    t = u32((y | (y >> u32(8 - w))) & u32(pair | (pair << u32(16))))
    return u32((t | (t >> u32(16 - 2 * w))) & u32(u32(u32(1) << u32(4 * w)) - u32(1)))


@device
def _unpack4(v, w):
    """Inverse of :func:`_pack4`: bits 0..4w-1 of ``v`` -> four ``w``-bit values, one per byte."""
    pair = u32(u32(u32(1) << u32(2 * w)) - u32(1))
    t = u32(v & u32(u32(u32(1) << u32(4 * w)) - u32(1)))
    t = u32((t | (t << u32(16 - 2 * w))) & u32(pair | (pair << u32(16))))
    return u32((t | (t << u32(8 - w))) & mul32(u32(u32(u32(1) << u32(w)) - u32(1)), _BYTE0))


@device
def _plane_byte(c0, c1, b):
    """Bit ``b`` of the code bytes of elements 0..3 (``c0``) and 4..7 (``c1``) -> one escape byte,
    element i at bit i (a bit plane, FORMAT-FP8.md 3.2)."""
    lo = u32((c0 >> u32(b)) & _BYTE0)
    hi = u32((c1 >> u32(b)) & _BYTE0)
    return u32(mul32(lo | (hi << u32(4)), _GATHER) >> u32(24))


@device
def _spread_plane(byte, b):
    """Inverse of :func:`_plane_byte`: escape byte -> bit ``b`` of the code bytes of elements 0..3, 4..7."""
    lo = u32(mul32(byte & u32(0xF), _SPREAD) & _BYTE0)
    hi = u32(mul32((byte >> u32(4)) & u32(0xF), _SPREAD) & _BYTE0)
    return u32(lo << u32(b)), u32(hi << u32(b))


def _shape(modes: ModeSet, channels: int) -> dict:
    """The constants a kernel is built with, all from the FP8 layout: word offsets and counts of the slot
    sections, bytes per group of each bit stream, escape bytes per mode, and byte-lane masks."""
    if channels not in TILE_WIDTHS:
        raise InputError(f"tiles of {channels} channels do not exist in GAAC-FP8 (tile widths {TILE_WIDTHS})")
    geo = TileGeometry(channels, modes)
    fmt = modes.fmt
    sm_b = L.GROUP_SIZE * fmt.sm_bits // 8             # bytes of one group in the sign+mantissa stream
    code_b = L.GROUP_SIZE * modes.low_bits // 8        # ... in the code stream
    esc = modes.escape_bytes
    if not {sm_b, code_b} <= {2, 3, 4} or esc[MODE_RAW] > WORD:
        raise InputError(f"mode set {modes.label} of {fmt.name}: the kernels need 2..4-bit low codes")
    m = fmt.mantissa_bits
    return dict(
        G=geo.groups, J=geo.groups // WARP, GPR=geo.groups_per_row, TW=geo.tag_bytes // WORD,
        BW=channels // WORD, TILEW=geo.raw_bytes // WORD,
        SMW0=geo.sm_offset // WORD, SMW=geo.sm_bytes // WORD, SMB=sm_b,
        CODEW0=geo.code_offset // WORD, CODEW=geo.code_bytes // WORD, CODEB=code_b,
        TAGW0=geo.tag_offset // WORD, ESCW0=geo.escape_offset // WORD,
        WIDEB=np.uint32(esc[MODE_WIDE]), RAWB=np.uint32(esc[MODE_RAW]), LOW=modes.low_bits, M=m,
        EXP=_bytes(fmt.max_exponent_field), MANT=_bytes((1 << m) - 1), SIGN=_bytes(1 << m),
        LOWM=_bytes(modes.narrow_window - 1), OUTN=_bytes(0xFF ^ (modes.narrow_window - 1)),
        OUTW=_bytes(0xFF ^ (modes.wide_window - 1)))


_MN, _MW, _MR = np.uint32(MODE_NARROW), np.uint32(MODE_WIDE), np.uint32(MODE_RAW)
_ZERO = np.uint32(0)


def encode_source(modes: ModeSet, channels: int, tiles_per_block: int = TILES_PER_BLOCK):
    """The Python function of the encode kernel, the mode set's and tile's constants baked in."""
    s = _shape(modes, channels)
    G, J, GPR, TW, BW, LOW, M = (s[k] for k in ("G", "J", "GPR", "TW", "BW", "LOW", "M"))
    SMW0, SMW, SMB, CODEW0, CODEW, CODEB, TAGW0, ESCW0 = (s[k] for k in ("SMW0", "SMW", "SMB", "CODEW0", "CODEW",
                                                                        "CODEB", "TAGW0", "ESCW0"))
    WIDEB, RAWB, EXP, MANT, SIGN, LOWM, OUTN, OUTW = (s[k] for k in ("WIDEB", "RAWB", "EXP", "MANT", "SIGN", "LOWM",
                                                                     "OUTN", "OUTW"))
    NRAW = int(RAWB)
    SM_DIRECT, CODE_DIRECT = SMB == WORD, CODEB == WORD
    TPB = tiles_per_block
    STAGE = (TPB, G * NRAW)
    SM_STAGE = (TPB, 1 if SM_DIRECT else G)
    CODE_STAGE = (TPB, 1 if CODE_DIRECT else G)
    TAGS = (TPB, TW)
    u = u32

    def kernel(bits, bases, capacity, slots, slot_free, raw, raw_free, heads, entries, escape_used):
        stage = cuda.shared.array(STAGE, uint8)            # mode of each group; later the escape bytes
        smst = cuda.shared.array(SM_STAGE, uint32)         # sign+mantissa fields of each group (staged streams)
        codest = cuda.shared.array(CODE_STAGE, uint32)     # low codes of each group (staged streams)
        tagw = cuda.shared.array(TAGS, uint32)             # the tile's tag stream
        tagc = cuda.shared.array(TAGS, uint32)             # escape bytes of each tag word
        tot = cuda.shared.array(TPB, uint32)               # escape bytes of each warp's tile
        cls = cuda.shared.array(TPB, int32)                # per warp: 0 slot, 1 raw tile, 2 no tile
        base = cuda.shared.array(2, int32)                 # first free-list position of this block's pops
        sm = cuda.local.array(J, uint32)                   # per group of this lane: sign+mantissa fields,
        code = cuda.local.array(J, uint32)                 # low codes,
        esc = cuda.local.array(J, uint32)                  # escape bytes (byte p = plane low_bits + p)

        tid = u(cuda.threadIdx.x)
        warp = tid // u(WARP)
        lane = tid % u(WARP)
        n = u(bits.shape[0])
        cap = u(capacity)
        tile = u(u(cuda.blockIdx.x) * u(TPB) + warp)
        valid = tile < n
        t = tile if valid else u(n - u(1))                 # a warp past the end mirrors the last tile
        row = t % u(bases.shape[0])
        col = u((lane % u(GPR)) * u(_GROUP_WORDS))         # this lane's 8 channels are the same in every chunk
        n0, n1 = ldg2(bases, row, col)
        w0, w1 = ldg2(bases, row, u(col + u(BW)))
        kn0, kn1 = u(_FLAG - n0), u(_FLAG - n1)            # 0x80 - base per byte: no borrow (base < 0x80)
        kw0, kw1 = u(_FLAG - w0), u(_FLAG - w1)

        # Pass 1, per group: the narrowest mode (FORMAT-FP8.md 3.1), the low codes, the escape bytes
        # and the sign+mantissa fields (2.2), kept in registers until the storage is known.
        if lane == _ZERO:
            tot[warp] = 0
        modes = u(0)
        for j in range(J):
            g = u(u(WARP * j) + lane)
            x0, x1 = ldg2(bits, t, u(g * u(_GROUP_WORDS)))
            e0, e1 = u((x0 >> u(M)) & EXP), u((x1 >> u(M)) & EXP)
            c0, c1 = u(u(e0 + kn0) ^ _FLAG), u(u(e1 + kn1) ^ _FLAG)    # e - b_narrow, bit 7 set if below
            d0, d1 = u(u(e0 + kw0) ^ _FLAG), u(u(e1 + kw1) ^ _FLAG)
            if ((c0 | c1) & OUTN) == _ZERO:
                mode = _MN
                need = _ZERO
            elif ((d0 | d1) & OUTW) == _ZERO:
                mode = _MW
                need = WIDEB
                c0, c1 = d0, d1
            else:
                mode = _MR
                need = RAWB
                c0, c1 = e0, e1
            code[j] = u(_pack4(u(c0 & LOWM), LOW) | u(_pack4(u(c1 & LOWM), LOW) << u(4 * LOW)))
            ex = u(0)
            for p in range(NRAW):
                if u(p) < need:
                    ex = u(ex | u(_plane_byte(c0, c1, LOW + p) << u(8 * p)))
            esc[j] = ex
            s0 = u(((x0 >> u(7 - M)) & SIGN) | (x0 & MANT))
            s1 = u(((x1 >> u(7 - M)) & SIGN) | (x1 & MANT))
            sm[j] = u(_pack4(s0, SMB) | u(_pack4(s1, SMB) << u(4 * SMB)))
            stage[warp, g] = mode
            modes = u(modes | u(mode << u(2 * j)))
        total = _tag_words(stage, tagw, tagc, tot, warp, lane, TW, WIDEB, RAWB)
        fits = total <= cap                                # else a raw tile, as for BF16
        k = _free_list_position(heads, cls, base, tid, warp, lane, valid, fits, TPB)
        if not valid:
            return
        d = _take_storage(slot_free, raw_free, entries, escape_used, k, fits, tile, tile, lane, total)
        if d < 0:
            return
        dw = u(d)
        if not fits:                                       # the FP8 bytes as they are, read again (rare)
            for j in range(J):
                g2 = u(u(u(WARP * j) + lane) * u(_GROUP_WORDS))
                x0, x1 = ldg2(bits, t, g2)
                stg2(raw, dw, g2, x0, x1)
            return

        # Pass 2: whole-word streams straight to the slot; narrower streams and the escape bytes to
        # shared memory, a group's escape bytes at its offset = escape bytes of the tags before it
        # (tag words 2j, 2j+1 hold chunk j: lanes 0..15, then 16..31).
        before = u(0)
        for j in range(J):
            g = u(u(WARP * j) + lane)
            mode = u(u(modes >> u(2 * j)) & u(3))
            if SM_DIRECT:
                slots[dw, u(u(SMW0) + g)] = sm[j]
            else:
                smst[warp, g] = sm[j]
            if CODE_DIRECT:
                slots[dw, u(u(CODEW0) + g)] = code[j]
            else:
                codest[warp, g] = code[j]
            off, before = _staged_offset(tagw, tagc, warp, lane, j, before, WIDEB, RAWB)
            need = WIDEB if mode == _MW else (RAWB if mode == _MR else _ZERO)
            ex = esc[j]
            for p in range(NRAW):
                if u(p) < need:
                    stage[warp, u(off + u(p))] = u(u(ex >> u(8 * p)) & _U8)
        syncwarp()

        # Whole words of the staged streams, the tag stream and the escape area.
        if not SM_DIRECT:
            _write_stream(slots, dw, SMW0, SMW, smst, warp, lane, SMB)
        if not CODE_DIRECT:
            _write_stream(slots, dw, CODEW0, CODEW, codest, warp, lane, CODEB)
        _write_tags_escapes(slots, dw, tagw, stage, warp, lane, cap, total, TW, TAGW0, ESCW0)

    return kernel


def decode_source(modes: ModeSet, channels: int, tiles_per_block: int = TILES_PER_BLOCK):
    """The Python function of the decode kernel, the mode set's and tile's constants baked in."""
    s = _shape(modes, channels)
    J, GPR, BW, TILEW, LOW, M = (s[k] for k in ("J", "GPR", "BW", "TILEW", "LOW", "M"))
    SMW0, SMB, CODEW0, CODEB, TAGW0, ESCW0 = (s[k] for k in ("SMW0", "SMB", "CODEW0", "CODEB", "TAGW0", "ESCW0"))
    WIDEB, RAWB, MANT = (s[k] for k in ("WIDEB", "RAWB", "MANT"))
    NRAW = int(RAWB)
    RAW_ROUNDS = TILEW // (4 * WARP)                      # 16-byte copies per lane of a raw tile
    TPB = tiles_per_block
    u = u32

    def kernel(slots, raw, entries, bases, capacity, out, status):
        sm = cuda.local.array(J, uint32)                 # this lane's sign+mantissa fields per group
        code = cuda.local.array(J, uint32)               # its low codes
        esc = cuda.local.array(J, uint32)                # the 4 escape-area bytes from its group's offset
        what = cuda.local.array(J, uint32)               # mode | 4 if the escapes lie inside the slot

        tid = u(cuda.threadIdx.x)
        warp = tid // u(WARP)
        lane = tid % u(WARP)
        tile = u(u(cuda.blockIdx.x) * u(TPB) + warp)
        if tile >= u(entries.shape[0]):
            return
        entry = entries[tile]
        if entry < 0:
            _copy_raw(raw, entry, out, status, tile, lane, RAW_ROUNDS)
            return
        d = u(entry)
        cap = u(capacity)

        # Loads first, with the tag arithmetic that places each group's escape bytes.
        total = u(0)
        bad = u(0)
        for j in range(J):
            g = u(u(WARP * j) + lane)
            bad, total, what[j], esc[j], _ = _group_escapes(slots, d, u(TAGW0 + 2 * j), lane, bad, total, cap, ESCW0,
                                                            WIDEB, RAWB)
            sm[j] = _stream_field(slots, d, SMW0, g, SMB)
            code[j] = _stream_field(slots, d, CODEW0, g, CODEB)
        _write_status(status, tile, lane, bad, total, cap)

        row = tile % u(bases.shape[0])
        col = u((lane % u(GPR)) * u(_GROUP_WORDS))
        n0, n1 = ldg2(bases, row, col)
        w0, w1 = ldg2(bases, row, u(col + u(BW)))

        # Exponent bytes = base + code (no carry: base + code < 2^E, FORMAT-FP8.md 3.2), then each
        # FP8 byte = sign << 7 | exponent << M | mantissa (2.2).
        for j in range(J):
            g = u(u(WARP * j) + lane)
            v = code[j]
            c0, c1 = _unpack4(v, LOW), _unpack4(u(v >> u(4 * LOW)), LOW)
            wh = what[j]
            mode = u(wh & u(3))
            if wh & u(4):
                ex = esc[j]
                need = WIDEB if mode == _MW else RAWB
                for p in range(NRAW):
                    if u(p) < need:
                        a, b = _spread_plane(u(u(ex >> u(8 * p)) & _U8), LOW + p)
                        c0, c1 = u(c0 | a), u(c1 | b)
            if mode == _MN:
                c0, c1 = u(c0 + n0), u(c1 + n1)
            elif mode == _MW:
                c0, c1 = u(c0 + w0), u(c1 + w1)
            f = sm[j]
            s0, s1 = _unpack4(f, SMB), _unpack4(u(f >> u(4 * SMB)), SMB)
            x0 = u(u(u(s0 << u(7 - M)) & _FLAG) | u(c0 << u(M)) | (s0 & MANT))
            x1 = u(u(u(s1 << u(7 - M)) & _FLAG) | u(c1 << u(M)) | (s1 & MANT))
            stg2(out, tile, u(g * u(_GROUP_WORDS)), x0, x1)

    return kernel


@functools.lru_cache(maxsize=None)
def encode_kernel(modes: ModeSet, channels: int, tiles_per_block: int = TILES_PER_BLOCK):
    """The encode kernel of ``modes`` for ``channels``-wide tiles, compiled once."""
    return cuda.jit(ENCODE_SIG)(encode_source(modes, channels, tiles_per_block))


@functools.lru_cache(maxsize=None)
def decode_kernel(modes: ModeSet, channels: int, tiles_per_block: int = TILES_PER_BLOCK):
    """The decode kernel of ``modes`` for ``channels``-wide tiles, compiled once."""
    return cuda.jit(DECODE_SIG)(decode_source(modes, channels, tiles_per_block))


@functools.lru_cache(maxsize=None)
def fp8_codec(modes: ModeSet) -> DeviceCodec:
    """The device codec of an FP8 mode set: uint8 elements and bases, this module's kernels.  The plans,
    :func:`gaac.cuda.codec.pack_bases` and the one-shot helpers take it through the element format, once
    this module is imported (it registers itself below)."""
    return DeviceCodec(modes, "uint8", "uint8", functools.partial(encode_kernel, modes),
                       functools.partial(decode_kernel, modes))


for _fmt in FP8_FORMATS.values():
    register_codec(_fmt, fp8_codec)
