"""Round trips of the reference codec and block API, and modes forced on purpose.

Properties:

* any BF16 bit patterns, shape, bases and capacity round-trip bit-exactly through
  ``encode_block``/``decode_block`` and ``encode_tiles``/``decode_tiles``;
* a cache of any number of tokens is ``T // 16`` blocks plus a BF16 tail, and nothing is lost;
* groups built to need 3-bit, 4-bit or raw mode get exactly that mode, and tiles built to
  overflow their slot stay raw; every size the encoder reports matches a computation made
  here from ``gaac.layout`` alone, and every slot matches a plain-Python rendering of the spec.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (EDGE_PATTERNS, bases, bf16_bits, block_cases, capacities, forced_blocks, head_dims,
                        kv_heads, overflow_blocks, tile_escapes)

import gaac
from gaac import layout as L
from gaac.calibration import Calibration
from gaac.reference.codec import decode_tiles, encode_tiles
from gaac.tiles import block_tiles, cache_blocks, tile_bases


def encode(case):
    return gaac.encode_block(case.bits, case.calibration, case.layer, case.kind)


# -- independent oracles: FORMAT.md re-derived here, not taken from the codec --------------------

def fixed_bytes(channels: int) -> int:
    """Sign+mantissa bytes, 3-bit codes and 2-bit tags of a ``channels``-wide tile."""
    n = L.BLOCK_TOKENS * channels
    return n + n * L.CODE_BITS // 8 + (n // L.GROUP_SIZE) * L.TAG_BITS // 8


def expected_sizes(modes: np.ndarray, channels: int, capacity: int) -> dict:
    """Payload, resident and container bytes of a block whose tiles have ``modes``."""
    raw = 2 * L.BLOCK_TOKENS * channels
    esc = tile_escapes(modes)
    fits = esc <= capacity
    n = len(modes)
    stored = int(np.where(fits, fixed_bytes(channels) + capacity, raw).sum())
    return {
        "payload": int(np.where(fits, fixed_bytes(channels) + esc, raw).sum()),
        "resident": stored + n * L.TABLE_ENTRY_BYTES,
        "container": L.STREAM_HEADER_BYTES + n * L.TABLE_ENTRY_BYTES + stored + L.STREAM_CRC_BYTES,
    }


def spec_slot(tile: np.ndarray, b3: np.ndarray, b4: np.ndarray, capacity: int) -> bytes | None:
    """One tile's slot, element by element in plain Python; ``None`` when its escapes overflow."""
    channels = len(b3)
    n = L.BLOCK_TOKENS * channels
    bits = [int(v) for v in tile.reshape(-1)]
    sm = bytes(((v >> 8) & 0x80) | (v & 0x7F) for v in bits)
    ex = [(v >> 7) & 0xFF for v in bits]
    codes = tags = 0
    escapes = []
    for g in range(n // L.GROUP_SIZE):
        members = range(g * L.GROUP_SIZE, (g + 1) * L.GROUP_SIZE)
        if all(0 <= ex[i] - int(b3[i % channels]) < 8 for i in members):
            mode, code = 0, [ex[i] - int(b3[i % channels]) for i in members]
        elif all(0 <= ex[i] - int(b4[i % channels]) < 16 for i in members):
            mode, code = 1, [ex[i] - int(b4[i % channels]) for i in members]
            escapes.append(sum(((c >> 3) & 1) << k for k, c in enumerate(code)))
        else:
            mode, code = 2, [ex[i] for i in members]
            escapes += [sum(((c >> (3 + p)) & 1) << k for k, c in enumerate(code)) for p in range(5)]
        tags |= mode << (2 * g)
        for k, i in enumerate(members):
            codes |= (code[k] & 7) << (3 * i)
    if len(escapes) > capacity:
        return None
    return sm + codes.to_bytes(3 * n // 8, "little") + tags.to_bytes(n // 32, "little") \
        + bytes(escapes) + bytes(capacity - len(escapes))


# -- property 1: anything round-trips ---------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(block_cases())
def test_any_block_roundtrips(case):
    enc = encode(case)
    assert np.array_equal(gaac.decode_block(enc, case.calibration), case.bits)
    assert np.array_equal(gaac.decode_block(enc.data, case.calibration), case.bits)
    assert (enc.layer, enc.kind, enc.kv_heads, enc.head_dim) == \
        (case.layer, case.kind_index, case.kv_heads, case.head_dim)
    sizes = expected_sizes(enc.modes, L.tile_channels(case.head_dim), case.capacity)
    assert enc.nbytes == sizes["container"]


def test_all_65536_patterns_roundtrip():
    """Every BF16 bit pattern, in blocks of every head_dim, against windows at both ends and the middle."""
    every = np.arange(0x10000, dtype=np.uint16)
    for dim in L.SUPPORTED_HEAD_DIMS:
        heads = 4
        blocks = every.reshape(-1, heads, L.BLOCK_TOKENS, dim)
        for b3, b4 in ((0, 0), (L.B3_MAX, L.B4_MAX), (120, 116)):
            for capacity in (0, 64 * L.SLOT_ALIGN):
                cal = Calibration(b3=np.full((2, 1, heads, dim), b3), b4=np.full((2, 1, heads, dim), b4),
                                  capacity=np.full((2, 1), capacity))
                for block in blocks:
                    enc = gaac.encode_block(block, cal, 0, "v")
                    assert np.array_equal(gaac.decode_block(enc, cal), block)


@st.composite
def tile_batches(draw):
    """Tiles ``[n, 16, C]`` of any patterns with any per-tile bases and capacity."""
    channels = L.tile_channels(draw(head_dims))
    n = draw(st.integers(0, 6))                        # 0: no complete block yet
    b3, b4 = draw(bases(n, channels))
    centres = draw(st.one_of(st.none(), st.just(b3.astype(np.int64) + 3)))
    return draw(bf16_bits((n, L.BLOCK_TOKENS, channels), centres)), b3, b4, draw(capacities(channels))


@settings(max_examples=100, deadline=None)
@given(tile_batches())
def test_tiles_roundtrip(batch):
    bits, b3, b4, capacity = batch
    enc = encode_tiles(bits, b3, b4, capacity)
    assert np.array_equal(enc.raw.view("<u2").reshape(bits.shape), bits)
    fit = enc.fits
    if fit.any():
        out = decode_tiles(enc.slots[fit], b3[fit], b4[fit], capacity, bits.shape[2])
        assert np.array_equal(out, bits[fit])
    assert np.array_equal(enc.escape_used, tile_escapes(enc.modes))
    assert np.array_equal(fit, enc.escape_used <= capacity)


@st.composite
def caches(draw):
    """One layer's cache ``[heads, tokens, head_dim]`` of any token count, 0 included."""
    heads, dim = draw(kv_heads), draw(head_dims)
    tokens = draw(st.integers(0, 5 * L.BLOCK_TOKENS))
    return draw(bf16_bits((heads, tokens, dim)))


@settings(max_examples=40, deadline=None)
@given(caches(), st.data())
def test_cache_is_blocks_plus_tail(x, data):
    heads, tokens, dim = x.shape
    blocks = cache_blocks(x)
    n = tokens // L.BLOCK_TOKENS
    assert blocks.shape == (n, heads, L.BLOCK_TOKENS, dim)
    tail = x[:, n * L.BLOCK_TOKENS:]
    assert tail.shape[1] == tokens % L.BLOCK_TOKENS
    joined = np.concatenate([blocks.transpose(1, 0, 2, 3).reshape(heads, -1, dim), tail], axis=1)
    assert np.array_equal(joined, x)

    b3, b4 = data.draw(bases(heads, dim))
    cal = Calibration(b3=np.broadcast_to(b3, (2, 1, heads, dim)), b4=np.broadcast_to(b4, (2, 1, heads, dim)),
                      capacity=np.full((2, 1), data.draw(capacities(dim))))
    decoded = [gaac.decode_block(gaac.encode_block(b, cal, 0, "k"), cal) for b in blocks]
    rebuilt = np.concatenate([np.stack(decoded, axis=1).reshape(heads, -1, dim) if decoded
                              else np.zeros((heads, 0, dim), np.uint16), tail], axis=1)
    assert np.array_equal(rebuilt, x)


def test_block_tile_order_is_head_major():
    """Tile ``h * (head_dim / C) + j`` is channels ``j*C..j*C+C-1`` of head ``h`` (FORMAT.md section 4)."""
    for dim in L.SUPPORTED_HEAD_DIMS:
        heads, c = 3, L.tile_channels(dim)
        block = np.arange(heads * L.BLOCK_TOKENS * dim, dtype=np.uint16).reshape(heads, L.BLOCK_TOKENS, dim)
        tiles = block_tiles(block)
        for h in range(heads):
            for j in range(dim // c):
                assert np.array_equal(tiles[h * (dim // c) + j], block[h, :, j * c:(j + 1) * c])


# -- property 2: modes forced on purpose ---------------------------------------------------------------

def check_forced(case):
    """The encoder picks the forced modes and raw tiles, reports the sizes, and round-trips."""
    enc = encode(case)
    assert np.array_equal(enc.modes, case.modes)
    assert enc.raw_tiles == case.raw_tiles
    assert enc.fell_back == bool(case.raw_tiles)
    sizes = expected_sizes(case.modes, L.tile_channels(case.head_dim), case.capacity)
    assert (enc.payload_bytes, enc.resident_bytes, enc.nbytes) == \
        (sizes["payload"], sizes["resident"], sizes["container"])
    kd = case.kind_index
    tiles = encode_tiles(block_tiles(case.bits), *tile_bases(case.calibration.b3[kd, case.layer],
                                                              case.calibration.b4[kd, case.layer]), case.capacity)
    assert np.array_equal(tiles.escape_used, tile_escapes(case.modes))
    assert np.array_equal(gaac.decode_block(enc, case.calibration), case.bits)
    return enc


@settings(max_examples=60, deadline=None)
@given(forced_blocks())
def test_forced_modes(case):
    check_forced(case)


@pytest.mark.parametrize("weights", [(1, 0, 0), (0, 1, 0), (0, 0, 1)], ids=["3bit", "4bit", "raw"])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_forced_single_mode(weights, data):
    case = data.draw(forced_blocks(weights=weights))
    assert (case.modes == weights.index(1)).all()
    check_forced(case)


@settings(max_examples=60, deadline=None)
@given(overflow_blocks())
def test_slot_overflow_keeps_tile_raw(case):
    enc = check_forced(case)
    assert enc.fell_back and enc.raw_tiles
    c = L.tile_channels(case.head_dim)
    n_tiles = len(case.modes)
    entries = np.frombuffer(enc.data, "<u4", n_tiles, L.STREAM_HEADER_BYTES)
    raw_flag = (entries & L.TABLE_RAW_FLAG) != 0
    assert tuple(np.flatnonzero(raw_flag)) == case.raw_tiles
    # The raw pool holds the overflowing tiles' BF16 bits, little-endian, in tile order.
    raw_pool = enc.data[-L.STREAM_CRC_BYTES - len(case.raw_tiles) * 2 * L.BLOCK_TOKENS * c:-L.STREAM_CRC_BYTES]
    expect = block_tiles(case.bits)[list(case.raw_tiles)].astype("<u2").tobytes()
    assert raw_pool == expect


@settings(max_examples=25, deadline=None)
@given(st.one_of(forced_blocks(head_dim=64, heads=1), forced_blocks(head_dim=128, heads=1),
                 overflow_blocks(head_dim=64, heads=2)))
def test_slots_match_spec_rendering(case):
    """Every slot equals the plain-Python rendering of FORMAT.md (byte order, bit order, escape order)."""
    kd = case.kind_index
    b3, b4 = tile_bases(case.calibration.b3[kd, case.layer], case.calibration.b4[kd, case.layer])
    tiles = block_tiles(case.bits)
    enc = encode_tiles(tiles, b3, b4, case.capacity)
    for t, tile in enumerate(tiles):
        want = spec_slot(tile, b3[t], b4[t], case.capacity)
        assert enc.fits[t] == (want is not None)
        if want is not None:
            assert enc.slots[t].tobytes() == want


@pytest.mark.parametrize("channels", sorted({L.tile_channels(d) for d in L.SUPPORTED_HEAD_DIMS}))
def test_edge_patterns_in_every_mode(channels):
    """Each edge pattern (+-0, subnormals, +-Inf, NaNs) sits in a raw, a 4-bit and a 3-bit group.

    Per-channel bases place the windows: channels 0..7 far from the pattern's
    exponent (raw), 8..15 with it in the 4-bit window only, the rest with it
    in the 3-bit window.
    """
    g = L.GROUP_SIZE
    row = [L.MODE_RAW, L.MODE_4BIT] + [L.MODE_3BIT] * (channels // g - 2)
    for pattern in EDGE_PATTERNS:
        e = (pattern >> 7) & 0xFF
        tile = np.full((1, L.BLOCK_TOKENS, channels), pattern, dtype=np.uint16)
        b3 = np.full((1, channels), min(e, L.B3_MAX), dtype=np.uint8)
        b4 = np.zeros((1, channels), dtype=np.uint8)
        far = min((e + 128) % 256, L.B4_MAX)
        b3[0, :g] = b4[0, :g] = far
        b3[0, g:2 * g] = e - L.WINDOW_3BIT if e >= L.WINDOW_3BIT else e + 1
        b4[0, g:2 * g] = min(e, L.B4_MAX)
        capacity = L.BLOCK_TOKENS * (L.ESCAPE_BYTES[L.MODE_RAW] + L.ESCAPE_BYTES[L.MODE_4BIT])
        enc = encode_tiles(tile, b3, b4, capacity)
        assert (enc.modes.reshape(L.BLOCK_TOKENS, -1) == row).all(), hex(pattern)
        assert enc.slots[0].tobytes() == spec_slot(tile[0], b3[0], b4[0], capacity)
        assert np.array_equal(decode_tiles(enc.slots, b3, b4, capacity, channels), tile), hex(pattern)
