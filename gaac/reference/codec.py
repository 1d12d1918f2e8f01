"""The reference tile codec: FORMAT.md sections 4-6, line by line, in NumPy.

Slow and plain on purpose: this is the oracle that the CUDA kernels and the
test vectors are checked against.  Functions take a batch of tiles
``[n, 16, C]`` so that whole caches can be measured, but every step is the
spec's step for one tile, applied along the batch axis.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import layout as L
from ..errors import FormatError
from .bits import bit_planes, from_planes, join_bf16, pack_bits, split_bf16, unpack_bits

_ESC_LEN = np.array([L.ESCAPE_BYTES[L.MODE_3BIT], L.ESCAPE_BYTES[L.MODE_4BIT],
                     L.ESCAPE_BYTES[L.MODE_RAW], 0], dtype=np.int64)


def _per_element(bases: np.ndarray) -> np.ndarray:
    """Per-channel bases ``[n, C]`` repeated for every token: ``[n, 16*C]`` (element order)."""
    return np.tile(np.asarray(bases, dtype=np.int16), (1, L.BLOCK_TOKENS))


def choose_modes(exponent: np.ndarray, b3: np.ndarray, b4: np.ndarray) -> np.ndarray:
    """FORMAT.md 5.2: the narrowest mode that holds all 8 exponents of each group.

    ``exponent`` is ``[n, 16*C]`` in element order; returns ``[n, groups]`` mode tags.
    """
    n, groups = exponent.shape[0], exponent.shape[1] // L.GROUP_SIZE     # (explicit: n may be 0)
    e = exponent.astype(np.int16)
    d3 = (e - _per_element(b3)).reshape(n, groups, L.GROUP_SIZE)
    d4 = (e - _per_element(b4)).reshape(n, groups, L.GROUP_SIZE)
    fits3 = ((d3 >= 0) & (d3 < L.WINDOW_3BIT)).all(axis=-1)
    fits4 = ((d4 >= 0) & (d4 < L.WINDOW_4BIT)).all(axis=-1)
    return np.where(fits3, L.MODE_3BIT, np.where(fits4, L.MODE_4BIT, L.MODE_RAW)).astype(np.uint8)


def escape_bytes(modes: np.ndarray) -> np.ndarray:
    """Escape bytes each tile needs: 1 per 4-bit group, 5 per raw group."""
    return _ESC_LEN[modes].sum(axis=-1)


@dataclass
class EncodedTiles:
    """A batch of encoded tiles.

    ``slots[i]`` is tile ``i``'s slot (valid only where ``fits[i]``); a tile that
    does not fit stays raw and its bytes are ``raw[i]`` (little-endian BF16).
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


def encode_tiles(bits: np.ndarray, b3: np.ndarray, b4: np.ndarray, capacity: int) -> EncodedTiles:
    """Encode tiles ``bits[n, 16, C]`` (uint16 BF16 patterns) with per-tile bases ``[n, C]``."""
    n, tokens, channels = bits.shape
    geo = L.TileGeometry(channels)
    flat = np.ascontiguousarray(bits, dtype=np.uint16).reshape(n, geo.elements)

    # 5.1 split every element into its sign+mantissa byte and exponent.
    sm, exponent = split_bf16(flat)

    # 5.2 one mode per group; 5.3 the code of every element.
    modes = choose_modes(exponent, b3, b4)
    mode_of_element = np.repeat(modes, L.GROUP_SIZE, axis=1)
    e = exponent.astype(np.int16)
    code = np.where(mode_of_element == L.MODE_3BIT, e - _per_element(b3),
                    np.where(mode_of_element == L.MODE_4BIT, e - _per_element(b4), e)).astype(np.uint8)

    # 5.4 escape bytes of each group: 4-bit -> plane 3 of the code; raw -> planes 3..7 of the exponent.
    groups = code.reshape(n, geo.groups, L.GROUP_SIZE)
    escapes = bit_planes(groups, 3, L.RAW_PLANES)                       # [n, G, 5]
    lengths = _ESC_LEN[modes]                                           # [n, G]
    used = lengths.sum(axis=1)
    fits = used <= capacity

    # Section 6: fill the escape area in group order, zero after the last escape byte.
    area = fill_escape_area(escapes, lengths, capacity)

    slots = np.concatenate([
        sm,                                       # section 1: sign+mantissa bytes
        pack_bits(code & 0x7, L.CODE_BITS),       # section 2: low 3 bits of every code
        pack_bits(modes, L.TAG_BITS),             # section 3: mode tags
        area,                                     # section 4: escape area
    ], axis=1)
    raw = flat.astype("<u2").view(np.uint8).reshape(n, geo.raw_bytes)
    return EncodedTiles(modes=modes, escape_used=used, fits=fits, slots=slots, raw=raw,
                        fixed_bytes=geo.fixed_bytes)


def decode_tiles(slots: np.ndarray, b3: np.ndarray, b4: np.ndarray, capacity: int,
                 channels: int, tile_ids=None) -> np.ndarray:
    """Decode slots ``[n, slot_bytes]`` into BF16 bit patterns ``[n, 16, channels]``.

    Raises :class:`FormatError` naming the tile (``tile_ids[i]`` for row ``i``, default ``i``)
    for every rule of FORMAT.md section 8 that a slot breaks.
    """
    geo = L.TileGeometry(channels)
    slots = np.asarray(slots, dtype=np.uint8)
    n = slots.shape[0]
    if n == 0:
        return np.empty((0, L.BLOCK_TOKENS, channels), dtype=np.uint16)
    tile_ids = np.arange(n) if tile_ids is None else np.asarray(tile_ids)
    if slots.shape[1] != geo.slot_bytes(capacity):
        raise FormatError(f"slot of {slots.shape[1]} bytes; a {channels}-channel tile with escape capacity "
                          f"{capacity} takes {geo.slot_bytes(capacity)}")

    sm = slots[:, geo.sm_offset:geo.sm_offset + geo.sm_bytes]
    low = unpack_bits(slots[:, geo.code_offset:geo.code_offset + geo.code_bytes], L.CODE_BITS, geo.elements)
    modes = unpack_bits(slots[:, geo.tag_offset:geo.tag_offset + geo.tag_bytes], L.TAG_BITS, geo.groups)
    area = slots[:, geo.escape_offset:]

    lengths = check_slot_tags(modes, area, _ESC_LEN, capacity, tile_ids)
    high = from_planes(gather_escapes(area, lengths, L.RAW_PLANES), 3).reshape(n, geo.elements)  # bits 3..7

    mode_of_element = np.repeat(modes, L.GROUP_SIZE, axis=1)
    code = low.astype(np.int32) | high.astype(np.int32)
    exponent = np.where(mode_of_element == L.MODE_3BIT, _per_element(b3) + code,
                        np.where(mode_of_element == L.MODE_4BIT, _per_element(b4) + code, code))
    return join_bf16(sm, exponent.astype(np.uint8)).reshape(n, L.BLOCK_TOKENS, channels)


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
