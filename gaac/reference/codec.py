"""The reference tile codec of every element format: FORMAT.md sections 4-6 (BF16) and FORMAT-FP8.md
sections 3-6 (FP8), line by line, in NumPy.

Slow and plain on purpose: this is the oracle that the CUDA kernels and the
test vectors are checked against.  Functions take a batch of tiles
``[n, 16, C]`` so that whole caches can be measured, but every step is the
spec's step for one tile, applied along the batch axis.  One
:class:`~gaac.layout.ModeSet` (default BF16's) gives the widths: split each
element into its sign+mantissa field and exponent, give each group of 8 the
narrowest mode whose window holds its 8 exponents, keep the low ``low_bits``
of every code in one stream and the higher bits of wide and raw groups as
bit-plane escape bytes, in group order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import layout as L
from ..errors import CalibrationError, FormatError
from .bits import bit_planes, element_dtype, from_planes, join_elements, pack_bits, split_elements, unpack_bits


def escape_lengths(modes: L.ModeSet = L.BF16_MODES) -> np.ndarray:
    """Escape bytes of a group of each tag 0..3 (the reserved tag 3 counts 0: it is refused by itself)."""
    esc = modes.escape_bytes
    return np.array([esc[L.MODE_NARROW], esc[L.MODE_WIDE], esc[L.MODE_RAW], 0], dtype=np.int64)


def _per_element(bases: np.ndarray) -> np.ndarray:
    """Per-channel bases ``[n, C]`` repeated for every token: ``[n, 16*C]`` (element order)."""
    return np.tile(np.asarray(bases, dtype=np.int16), (1, L.BLOCK_TOKENS))


def check_bases(b_narrow, b_wide, modes: L.ModeSet) -> None:
    """Raise :class:`CalibrationError` unless every window lies inside the exponent field's range."""
    bn, bw = np.asarray(b_narrow, dtype=np.int64), np.asarray(b_wide, dtype=np.int64)
    if bn.size and (bn.min() < 0 or bn.max() > modes.narrow_base_max):
        raise CalibrationError(f"{modes.fmt.name}: narrow bases must lie in 0..{modes.narrow_base_max}, "
                               f"got {bn.min()}..{bn.max()}")
    if bw.size and (bw.min() < 0 or bw.max() > modes.wide_base_max):
        raise CalibrationError(f"{modes.fmt.name}: wide bases must lie in 0..{modes.wide_base_max}, "
                               f"got {bw.min()}..{bw.max()}")


def choose_modes(exponent: np.ndarray, b_narrow: np.ndarray, b_wide: np.ndarray,
                 modes: L.ModeSet = L.BF16_MODES) -> np.ndarray:
    """FORMAT.md 5.2: the narrowest mode that holds all 8 exponents of each group.

    ``exponent`` is ``[n, 16*C]`` in element order; returns ``[n, groups]`` mode tags.
    """
    n, groups = exponent.shape[0], exponent.shape[1] // L.GROUP_SIZE     # (explicit: n may be 0)
    e = exponent.astype(np.int16)
    dn = (e - _per_element(b_narrow)).reshape(n, groups, L.GROUP_SIZE)
    dw = (e - _per_element(b_wide)).reshape(n, groups, L.GROUP_SIZE)
    fits_n = ((dn >= 0) & (dn < modes.narrow_window)).all(axis=-1)
    fits_w = ((dw >= 0) & (dw < modes.wide_window)).all(axis=-1)
    return np.where(fits_n, L.MODE_NARROW, np.where(fits_w, L.MODE_WIDE, L.MODE_RAW)).astype(np.uint8)


def escape_bytes(tags: np.ndarray, modes: L.ModeSet = L.BF16_MODES) -> np.ndarray:
    """Escape bytes each tile needs (BF16: 1 per 4-bit group, 5 per raw group)."""
    return escape_lengths(modes)[tags].sum(axis=-1)


def tile_exponents(tiles: np.ndarray, fmt: L.ElementFormat = L.BF16) -> np.ndarray:
    """Exponent fields of tiles ``[n, 16, C]`` in element order: ``[n, 16*C]``."""
    return split_elements(tiles.reshape(tiles.shape[0], -1), fmt)[1]


@dataclass
class EncodedTiles:
    """A batch of encoded tiles.

    ``slots[i]`` is tile ``i``'s slot (valid only where ``fits[i]``); a tile that
    does not fit stays raw and its bytes are ``raw[i]`` (the little-endian elements).
    """

    modes: np.ndarray          # [n, groups] uint8
    escape_used: np.ndarray    # [n] escape bytes each tile needs
    fits: np.ndarray           # [n] bool: escapes fit the capacity
    slots: np.ndarray          # [n, slot_bytes] uint8
    raw: np.ndarray            # [n, raw_bytes] uint8

    fixed_bytes: int           # bytes of a slot before its escape area

    @property
    def payload_bytes(self) -> np.ndarray:
        """Bytes each tile takes in the stream sense: fixed sections plus the escapes it uses."""
        return self.fixed_bytes + self.escape_used


def encode_tiles(tiles: np.ndarray, b_narrow: np.ndarray, b_wide: np.ndarray, capacity: int,
                 modes: L.ModeSet = L.BF16_MODES) -> EncodedTiles:
    """Encode tiles ``[n, 16, C]`` of bit patterns of ``modes``' format (uint16 for BF16, uint8 for FP8)
    with per-tile bases ``[n, C]``."""
    n, tokens, channels = tiles.shape
    fmt = modes.fmt
    check_bases(b_narrow, b_wide, modes)
    geo = L.TileGeometry(channels, modes)
    flat = np.ascontiguousarray(tiles, dtype=element_dtype(fmt)).reshape(n, geo.elements)

    # 5.1 split every element into its sign+mantissa field and exponent.
    sm, exponent = split_elements(flat, fmt)

    # 5.2 one mode per group; 5.3 the code of every element.
    tags = choose_modes(exponent, b_narrow, b_wide, modes)
    tag_of_element = np.repeat(tags, L.GROUP_SIZE, axis=1)
    e = exponent.astype(np.int16)
    code = np.where(tag_of_element == L.MODE_NARROW, e - _per_element(b_narrow),
                    np.where(tag_of_element == L.MODE_WIDE, e - _per_element(b_wide), e)).astype(np.uint8)

    # 5.4 escape bytes of each group: planes low_bits.. of its codes (BF16: 4-bit -> plane 3 of the code;
    # raw -> planes 3..7 of the exponent).
    planes = modes.escape_bytes[L.MODE_RAW]
    escapes = bit_planes(code.reshape(n, geo.groups, L.GROUP_SIZE), modes.low_bits, planes)   # [n, G, planes]
    lengths = escape_lengths(modes)[tags]                              # [n, G]
    used = lengths.sum(axis=1)
    fits = used <= capacity

    # Section 6: fill the escape area in group order, zero after the last escape byte.
    area = fill_escape_area(escapes, lengths, capacity)

    slots = np.concatenate([
        pack_bits(sm, fmt.sm_bits),                                # section 1: sign+mantissa fields
        pack_bits(code & (modes.narrow_window - 1), modes.low_bits),  # section 2: low code bits
        pack_bits(tags, L.TAG_BITS),                               # section 3: mode tags
        area,                                                      # section 4: escape area
    ], axis=1)
    raw = flat.astype(element_dtype(fmt).newbyteorder("<")).view(np.uint8).reshape(n, geo.raw_bytes)
    return EncodedTiles(modes=tags, escape_used=used, fits=fits, slots=slots, raw=raw,
                        fixed_bytes=geo.fixed_bytes)


def decode_tiles(slots: np.ndarray, b_narrow: np.ndarray, b_wide: np.ndarray, capacity: int, channels: int,
                 modes: L.ModeSet = L.BF16_MODES, tile_ids=None) -> np.ndarray:
    """Decode slots ``[n, slot_bytes]`` into bit patterns ``[n, 16, channels]`` of ``modes``' format.

    Raises :class:`FormatError` naming the tile (``tile_ids[i]`` for row ``i``, default ``i``)
    for every rule of FORMAT.md section 8 (FORMAT-FP8.md section 7) that a slot breaks.
    """
    fmt = modes.fmt
    if channels not in L.TILE_WIDTHS:
        raise FormatError(f"{channels} channels is not a tile width; tiles have {L.TILE_WIDTHS} channels")
    check_bases(b_narrow, b_wide, modes)
    geo = L.TileGeometry(channels, modes)
    slots = np.asarray(slots, dtype=np.uint8)
    if slots.ndim != 2 or slots.shape[1] != geo.slot_bytes(capacity):
        raise FormatError(f"slots of shape {list(slots.shape)}; a {channels}-channel {fmt.name} tile "
                          f"with escape capacity {capacity} takes {geo.slot_bytes(capacity)} bytes")
    n = slots.shape[0]
    if n == 0:
        return np.empty((0, L.BLOCK_TOKENS, channels), dtype=element_dtype(fmt))
    tile_ids = np.arange(n) if tile_ids is None else np.asarray(tile_ids)

    sm = unpack_bits(slots[:, geo.sm_offset:geo.code_offset], fmt.sm_bits, geo.elements)
    low = unpack_bits(slots[:, geo.code_offset:geo.tag_offset], modes.low_bits, geo.elements)
    tags = unpack_bits(slots[:, geo.tag_offset:geo.escape_offset], L.TAG_BITS, geo.groups)
    area = slots[:, geo.escape_offset:]

    lengths = check_slot_tags(tags, area, escape_lengths(modes), capacity, tile_ids)
    planes = modes.escape_bytes[L.MODE_RAW]
    high = from_planes(gather_escapes(area, lengths, planes), modes.low_bits).reshape(n, geo.elements)

    tag_of_element = np.repeat(tags, L.GROUP_SIZE, axis=1)
    code = low.astype(np.int32) | high.astype(np.int32)
    exponent = np.where(tag_of_element == L.MODE_NARROW, _per_element(b_narrow) + code,
                        np.where(tag_of_element == L.MODE_WIDE, _per_element(b_wide) + code, code))
    return join_elements(sm, exponent.astype(np.uint8), fmt).reshape(n, L.BLOCK_TOKENS, channels)


def decode_entries(entries: np.ndarray, slots: np.ndarray, raw: np.ndarray, b_narrow: np.ndarray,
                   b_wide: np.ndarray, capacity: int, modes: L.ModeSet = L.BF16_MODES, tile_ids=None) -> np.ndarray:
    """The tiles that block-table ``entries`` ``[n]`` point at (FORMAT.md 7.3): ``[n, 16, C]`` bit patterns.

    An entry with bit 31 set is an index into the raw tiles ``raw`` ``[R, 16, C]`` (the elements as they
    are), any other an index into the slot pool ``slots`` ``[S, slot_bytes]``; compressed tile ``i`` is
    decoded with row ``i % P`` of the per-tile bases ``[P, C]``.  The indices must be in range (the
    caller checks them).  ``tile_ids`` names the compressed tiles in a :class:`FormatError` (default:
    their order among the compressed ones).
    """
    e = np.asarray(entries).astype(np.int64) & 0xFFFFFFFF
    is_raw = (e & L.TABLE_RAW_FLAG) != 0
    index = e & L.TABLE_INDEX_MASK
    channels = raw.shape[2]
    out = np.empty((len(e), L.BLOCK_TOKENS, channels), dtype=element_dtype(modes.fmt))
    out[is_raw] = raw[index[is_raw]]
    comp = np.flatnonzero(~is_raw)
    if comp.size:
        b_narrow, b_wide = np.asarray(b_narrow), np.asarray(b_wide)
        p = b_narrow.shape[0]
        out[comp] = decode_tiles(slots[index[comp]], b_narrow[comp % p], b_wide[comp % p], capacity, channels,
                                 modes, tile_ids=tile_ids)
    return out


def fill_escape_area(escapes: np.ndarray, lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Section 6: each tile's escape area, ``[n, capacity]``.

    ``escapes[n, G, P]`` holds every group's candidate escape bytes and
    ``lengths[n, G]`` how many of them the group's mode keeps; the kept bytes go
    in group order, then zeros.  Bytes beyond the capacity are dropped (the tile
    overflows and stays raw).  Shared by every element format.
    """
    n, flat = escapes.shape[0], int(np.prod(escapes.shape[1:]))          # (explicit: n may be 0)
    valid = (np.arange(escapes.shape[-1]) < lengths[..., None]).reshape(n, flat)
    position = np.cumsum(valid, axis=1) - 1
    keep = valid & (position < capacity)
    area = np.zeros((n, capacity), dtype=np.uint8)
    rows = np.broadcast_to(np.arange(n)[:, None], keep.shape)
    area[rows[keep], position[keep]] = escapes.reshape(n, flat)[keep]
    return area


def check_slot_tags(tags: np.ndarray, area: np.ndarray, escape_len: np.ndarray, capacity: int,
                    tile_ids: np.ndarray) -> np.ndarray:
    """FORMAT.md section 8's slot rules: no reserved tag, escapes within capacity, zero padding.

    Returns each group's escape length ``[n, G]``; raises :class:`FormatError`
    naming the tile (``tile_ids[row]``) and group.  Shared by every element format.
    """
    bad = np.argwhere(tags == L.MODE_RESERVED)
    if bad.size:
        t, g = bad[0]
        raise FormatError(f"tile {tile_ids[t]}, group {g}: mode tag {L.MODE_RESERVED} is reserved "
                          f"in GAAC v{L.FORMAT_VERSION}")
    lengths = escape_len[tags]
    used = lengths.sum(axis=1)
    over = np.flatnonzero(used > capacity)
    if over.size:
        t = over[0]
        raise FormatError(f"tile {tile_ids[t]}: its mode tags need {used[t]} escape bytes but the slot "
                          f"holds {capacity}")
    padding = np.arange(capacity) >= used[:, None]
    dirty = np.flatnonzero((area * padding).any(axis=1))
    if dirty.size:
        t = dirty[0]
        raise FormatError(f"tile {tile_ids[t]}: escape area is not zero after its {used[t]} escape bytes")
    return lengths


def gather_escapes(area: np.ndarray, lengths: np.ndarray, planes: int) -> np.ndarray:
    """Each group's escape bytes ``[n, G, planes]`` from the escape areas, zeros past a group's length."""
    n, groups = lengths.shape
    if area.shape[1] == 0:
        return np.zeros((n, groups, planes), dtype=np.uint8)
    start = np.cumsum(lengths, axis=1) - lengths                          # [n, G]
    k = np.arange(planes)
    index = np.minimum(start[..., None] + k, area.shape[1] - 1).reshape(n, groups * planes)
    gathered = np.take_along_axis(area, index, axis=1).reshape(n, groups, planes)
    return np.where(k < lengths[..., None], gathered, 0).astype(np.uint8)
