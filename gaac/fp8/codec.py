"""The reference GAAC-FP8 tile codec: FORMAT-FP8.md sections 3-6 in NumPy.

The steps are the BF16 codec's (gaac/reference/codec.py) with the widths of a
:class:`~gaac.fp8.layout.ModeSet`: split each FP8 byte into its sign+mantissa
field and exponent, give each group of 8 the narrowest mode whose window holds
its 8 exponents, keep the low ``low_bits`` of every code in one stream and the
higher bits of wide and raw groups as bit-plane escape bytes, in group order.
Bit streams, bit planes and the result container are the BF16 codec's own
(:mod:`gaac.reference.bits`, :class:`gaac.reference.codec.EncodedTiles`).
"""
from __future__ import annotations

import numpy as np

from .. import layout as L
from ..errors import CalibrationError, FormatError
from ..reference.bits import bit_planes, from_planes, pack_bits, unpack_bits
from ..reference.codec import EncodedTiles, check_slot_tags, fill_escape_area, gather_escapes
from .layout import (MODE_NARROW, MODE_RAW, MODE_WIDE, TILE_WIDTHS, FP8Format, FP8TileGeometry,
                     ModeSet)


def split_fp8(fp8: np.ndarray, fmt: FP8Format) -> tuple[np.ndarray, np.ndarray]:
    """FP8 bytes -> (sign+mantissa field ``sign << mantissa_bits | mantissa``, exponent field)."""
    b = np.asarray(fp8, dtype=np.uint8)
    m = fmt.mantissa_bits
    sm = ((b >> 7) << m) | (b & ((1 << m) - 1))
    return sm.astype(np.uint8), ((b >> m) & fmt.max_exponent_field).astype(np.uint8)


def join_fp8(sm: np.ndarray, exponent: np.ndarray, fmt: FP8Format) -> np.ndarray:
    """Inverse of :func:`split_fp8`."""
    m = fmt.mantissa_bits
    sm = np.asarray(sm).astype(np.uint8)
    e = np.asarray(exponent).astype(np.uint8)
    return (((sm >> m) & 1) << 7 | (e << m) | (sm & ((1 << m) - 1))).astype(np.uint8)


def check_bases(b_narrow, b_wide, modes: ModeSet) -> None:
    """Raise :class:`CalibrationError` unless every window lies inside the exponent field's range."""
    bn, bw = np.asarray(b_narrow, dtype=np.int64), np.asarray(b_wide, dtype=np.int64)
    if bn.size and (bn.min() < 0 or bn.max() > modes.narrow_base_max):
        raise CalibrationError(f"{modes.fmt.name}: narrow bases must lie in 0..{modes.narrow_base_max}, "
                               f"got {bn.min()}..{bn.max()}")
    if bw.size and (bw.min() < 0 or bw.max() > modes.wide_base_max):
        raise CalibrationError(f"{modes.fmt.name}: wide bases must lie in 0..{modes.wide_base_max}, "
                               f"got {bw.min()}..{bw.max()}")


def _escape_lengths(modes: ModeSet) -> np.ndarray:
    esc = modes.escape_bytes
    return np.array([esc[MODE_NARROW], esc[MODE_WIDE], esc[MODE_RAW], 0], dtype=np.int64)


def _per_element(bases: np.ndarray) -> np.ndarray:
    """Per-channel bases ``[n, C]`` repeated for every token: ``[n, 16*C]`` (element order)."""
    return np.tile(np.asarray(bases, dtype=np.int16), (1, L.BLOCK_TOKENS))


def choose_modes(exponent: np.ndarray, b_narrow: np.ndarray, b_wide: np.ndarray, modes: ModeSet) -> np.ndarray:
    """The narrowest mode that holds all 8 exponents of each group: ``[n, groups]`` tags."""
    n = exponent.shape[0]
    e = exponent.astype(np.int16)
    dn = (e - _per_element(b_narrow)).reshape(n, -1, L.GROUP_SIZE)
    dw = (e - _per_element(b_wide)).reshape(n, -1, L.GROUP_SIZE)
    fits_n = ((dn >= 0) & (dn < modes.narrow_window)).all(axis=-1)
    fits_w = ((dw >= 0) & (dw < modes.wide_window)).all(axis=-1)
    return np.where(fits_n, MODE_NARROW, np.where(fits_w, MODE_WIDE, MODE_RAW)).astype(np.uint8)


def escape_bytes(tags: np.ndarray, modes: ModeSet) -> np.ndarray:
    """Escape bytes each tile's groups need."""
    return _escape_lengths(modes)[tags].sum(axis=-1)


def tile_exponents(fp8_tiles: np.ndarray, fmt: FP8Format) -> np.ndarray:
    """Exponent fields of tiles ``[n, 16, C]`` in element order: ``[n, 16*C]``."""
    return split_fp8(fp8_tiles.reshape(fp8_tiles.shape[0], -1), fmt)[1]


def encode_tiles(fp8_tiles: np.ndarray, b_narrow: np.ndarray, b_wide: np.ndarray, capacity: int,
                 modes: ModeSet) -> EncodedTiles:
    """Encode FP8 tiles ``uint8[n, 16, C]`` with per-tile bases ``[n, C]``; raw tiles are the FP8 bytes."""
    n, _, channels = fp8_tiles.shape
    check_bases(b_narrow, b_wide, modes)
    geo = FP8TileGeometry(channels, modes)
    flat = np.ascontiguousarray(fp8_tiles, dtype=np.uint8).reshape(n, geo.elements)
    sm, exponent = split_fp8(flat, modes.fmt)

    tags = choose_modes(exponent, b_narrow, b_wide, modes)
    tag_of_element = np.repeat(tags, L.GROUP_SIZE, axis=1)
    e = exponent.astype(np.int16)
    code = np.where(tag_of_element == MODE_NARROW, e - _per_element(b_narrow),
                    np.where(tag_of_element == MODE_WIDE, e - _per_element(b_wide), e)).astype(np.uint8)

    # Escape bytes: planes low_bits.. of each wide or raw group's codes, group order, then zeros.
    planes = modes.escape_bytes[MODE_RAW]
    escapes = bit_planes(code.reshape(n, geo.groups, L.GROUP_SIZE), modes.low_bits, planes)   # [n, G, planes]
    lengths = _escape_lengths(modes)[tags]
    used = lengths.sum(axis=1)
    fits = used <= capacity
    area = fill_escape_area(escapes, lengths, capacity)

    slots = np.concatenate([
        pack_bits(sm, modes.fmt.sm_bits),                         # section 1: sign+mantissa fields
        pack_bits(code & (modes.narrow_window - 1), modes.low_bits),  # section 2: low code bits
        pack_bits(tags, L.TAG_BITS),                              # section 3: mode tags
        area,                                                     # section 4: escape area
    ], axis=1)
    return EncodedTiles(modes=tags, escape_used=used, fits=fits, slots=slots, raw=flat.copy(),
                        fixed_bytes=geo.fixed_bytes)


def decode_tiles(slots: np.ndarray, b_narrow: np.ndarray, b_wide: np.ndarray, capacity: int, channels: int,
                 modes: ModeSet, tile_ids=None) -> np.ndarray:
    """Decode slots ``[n, slot_bytes]`` into FP8 bytes ``[n, 16, channels]``.

    Raises :class:`FormatError` naming the tile (``tile_ids[i]`` for row ``i``, default ``i``)
    for every rule of FORMAT-FP8.md section 7 that a slot breaks.
    """
    if channels not in TILE_WIDTHS:
        raise FormatError(f"{channels} channels is not a tile width; tiles have {TILE_WIDTHS} channels")
    check_bases(b_narrow, b_wide, modes)
    geo = FP8TileGeometry(channels, modes)
    slots = np.asarray(slots, dtype=np.uint8)
    if slots.ndim != 2 or slots.shape[1] != geo.slot_bytes(capacity):
        raise FormatError(f"slots of shape {list(slots.shape)}; a {channels}-channel {modes.fmt.name} tile "
                          f"with escape capacity {capacity} takes {geo.slot_bytes(capacity)} bytes")
    n = slots.shape[0]
    tile_ids = np.arange(n) if tile_ids is None else np.asarray(tile_ids)
    sm = unpack_bits(slots[:, geo.sm_offset:geo.code_offset], modes.fmt.sm_bits, geo.elements)
    low = unpack_bits(slots[:, geo.code_offset:geo.tag_offset], modes.low_bits, geo.elements)
    tags = unpack_bits(slots[:, geo.tag_offset:geo.escape_offset], L.TAG_BITS, geo.groups)
    area = slots[:, geo.escape_offset:]

    lengths = check_slot_tags(tags, area, _escape_lengths(modes), capacity, tile_ids)
    planes = modes.escape_bytes[MODE_RAW]
    high = from_planes(gather_escapes(area, lengths, planes), modes.low_bits).reshape(n, geo.elements)

    tag_of_element = np.repeat(tags, L.GROUP_SIZE, axis=1)
    code = low.astype(np.int32) | high.astype(np.int32)
    exponent = np.where(tag_of_element == MODE_NARROW, _per_element(b_narrow) + code,
                        np.where(tag_of_element == MODE_WIDE, _per_element(b_wide) + code, code))
    return join_fp8(sm, exponent.astype(np.uint8), modes.fmt).reshape(n, L.BLOCK_TOKENS, channels)
