"""The numba.cuda GAAC-FP8 kernels (gaac/fp8/cuda.py) against the reference FP8 codec, in the CUDA simulator.

Shapes stay tiny (one to seven 64-channel tiles a launch, one 128-channel case):
the simulator runs a Python thread per CUDA thread.  Every check compares bytes
with gaac/reference/codec.py: a fitting tile's slot is the reference's slot, an
overflowing tile's FP8 bytes land in the raw pool, the entries and escape counts
agree, decode gives the tiles back, and nothing outside the popped slots and raw
tiles is written.  Both formats, all 256 FP8 patterns, forced modes, slot
overflow, an exhausted free list and corrupted slots.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gaac import layout as L
from gaac.errors import FormatError, InputError
from gaac import cuda as gc
from gaac.fp8 import cuda as fc
from gaac import layout as F
from gaac.reference.bits import join_elements
from gaac.reference.codec import decode_tiles as ref_decode_tiles
from gaac.reference.codec import encode_tiles as ref_encode_tiles
from gaac.reference.bits import bit_planes, pack_bits
from test_cuda_codec import POISON, check_storage

SIM = settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FORMAT_NAMES = tuple(F.FP8_FORMATS)
SPECIALS = [0x00, 0x80, 0x01, 0x81, 0x7F, 0xFF, 0x7E, 0xFE, 0x7C, 0xFC, 0x7B, 0x7D]   # zeros, NaN, Inf, max, min


def encode_checked(tiles, bn, bw, capacity, ms, **plan) -> dict:
    """Encode with the kernel into poisoned pools; check every byte, entry and count against the reference."""
    n, _, channels = tiles.shape
    geo = ms.geometry(channels)
    ref = ref_encode_tiles(tiles, bn, bw, capacity, ms)
    spare = 2                                            # pool entries nothing may touch
    slots = np.full((n + spare, geo.slot_bytes(capacity)), POISON, np.uint8)
    raw = np.full((n + spare, L.BLOCK_TOKENS, channels), POISON, np.uint8)
    heads = np.zeros(2, np.int32)
    entries, used = np.full(n, 7, np.int32), np.full(n, -7, np.int32)
    plan_ = gc.EncodePlan(channels, capacity, gc.pack_bases(bn, bw, ms), slots,
                          np.arange(n + spare, dtype=np.int32)[::-1].copy(), raw,
                          np.arange(n + spare, dtype=np.int32), heads, fmt=ms, **plan)
    plan_(tiles, entries, used)
    check_storage(tiles, ref, slots, raw, entries, used, heads)
    return dict(slots=slots, raw=raw, entries=entries, ref=ref)


def roundtrip(tiles, bn, bw, capacity, ms, **plan) -> dict:
    enc = encode_checked(tiles, bn, bw, capacity, ms, **plan)
    n, _, channels = tiles.shape
    out, status = np.full((n, 16, channels), 0x5A, np.uint8), np.full(n, -1, np.int32)
    gc.DecodePlan(channels, capacity, gc.pack_bases(bn, bw, ms), enc["slots"], enc["raw"], fmt=ms, **plan)(
        enc["entries"], out, status)
    assert (status == 0).all()
    np.testing.assert_array_equal(out, tiles)
    return enc


def forced_tile(ms, rng, want, c):
    """One tile whose groups need exactly the modes ``want`` [2c] (first element of a wide or raw group
    outside the narrower windows), with random bases: (tiles [1,16,c], bn [1,c], bw [1,c])."""
    bn = rng.integers(0, ms.narrow_base_max + 1, (1, c))
    bw = rng.integers(0, ms.wide_base_max + 1, (1, c))
    values = np.arange(ms.fmt.exponent_values)
    e = np.zeros(16 * c, dtype=np.int64)
    for g, mode in enumerate(want):
        for i in range(L.GROUP_SIZE):
            ch = (8 * g + i) % c
            in_n = (values >= bn[0, ch]) & (values < bn[0, ch] + ms.narrow_window)
            in_w = (values >= bw[0, ch]) & (values < bw[0, ch] + ms.wide_window)
            pool = [in_n, in_w, np.ones_like(in_n)][mode]
            if i == 0 and mode != F.MODE_NARROW:
                pool = pool & ~in_n & (~in_w if mode == F.MODE_RAW else True)
            e[8 * g + i] = rng.choice(values[pool])
    sm = rng.integers(0, 1 << ms.fmt.sm_bits, e.shape)
    return join_elements(sm, e.astype(np.uint8), ms.fmt).reshape(1, 16, c), bn, bw


@pytest.mark.parametrize("name", FORMAT_NAMES)
@SIM
@given(seed=st.integers(0, 2**32 - 1))
def test_every_fp8_pattern_any_bases(name, seed):
    """A tile holding each of the 256 patterns (NaN, Inf, zeros, subnormals, max finite) 4 times, shuffled,
    under random bases, next to a tile of exponents near its bases; capacities that keep or spill it."""
    ms = F.MODE_SETS[name]
    rng = np.random.default_rng(seed)
    every = rng.permutation(np.tile(np.arange(256, dtype=np.uint8), 4)).reshape(1, 16, 64)
    bn = rng.integers(0, ms.narrow_base_max + 1, (2, 64))
    bw = np.clip(bn - rng.integers(0, 4, bn.shape), 0, ms.wide_base_max)
    e = np.clip(np.tile(bn[1], 16) + rng.choice([0, 1, 2, 3, 4, 6], 16 * 64, p=[.3, .3, .2, .1, .05, .05]),
                0, ms.fmt.max_exponent_field)
    near = join_elements(rng.integers(0, 1 << ms.fmt.sm_bits, e.shape), e.astype(np.uint8), ms.fmt).reshape(1, 16, 64)
    tiles = np.concatenate([every, near])
    used = ref_encode_tiles(tiles, bn, bw, 0, ms).escape_used
    for capacity in {-(-int(used.max()) // 16) * 16, int(used.max()) // 16 * 16}:
        roundtrip(tiles, bn, bw, min(capacity, L.MAX_ESCAPE_CAPACITY), ms)


@st.composite
def drawn_tiles(draw):
    """(mode set, tiles [n,16,64], bn, bw, capacity): exponents spread around drawn centres, any pattern
    sprinkled in, bases near the centres or anywhere, any capacity up to all-raw."""
    ms = F.MODE_SETS[draw(st.sampled_from(FORMAT_NAMES))]
    n = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    centre = rng.integers(0, ms.fmt.exponent_values, size=(n, 64))
    spread = draw(st.sampled_from((0.0, 0.7, 1.5, 4.0)))
    e = np.clip(np.rint(np.tile(centre, 16) + rng.normal(0, spread, (n, 16 * 64))), 0, ms.fmt.max_exponent_field)
    tiles = join_elements(rng.integers(0, 1 << ms.fmt.sm_bits, e.shape), e.astype(np.uint8), ms.fmt).reshape(n, 16, 64)
    flat = tiles.reshape(-1)
    k = draw(st.integers(0, 8))                              # specials and any byte, anywhere
    flat[rng.integers(0, flat.size, k)] = rng.choice(np.r_[SPECIALS, rng.integers(0, 256, 4)], k)
    bn = np.clip(centre - rng.integers(0, ms.narrow_window, centre.shape), 0, ms.narrow_base_max)
    bw = np.clip(centre - rng.integers(0, ms.wide_window, centre.shape), 0, ms.wide_base_max)
    if draw(st.booleans()):
        bn, bw = rng.integers(0, ms.narrow_base_max + 1, bn.shape), rng.integers(0, ms.wide_base_max + 1, bw.shape)
    cap = 16 * draw(st.integers(0, ms.geometry(64).max_escapes // 16 + 1))
    return ms, tiles, bn, bw, cap


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn_tiles())
def test_drawn_tiles_match_reference(case):
    ms, tiles, bn, bw, cap = case
    roundtrip(tiles, bn, bw, cap, ms)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_forced_modes(name):
    """All-narrow, all-wide, all-raw and mixed tiles: the reference's modes are the forced ones and the
    kernel's bytes are the reference's, with room for every escape (capacity = all raw)."""
    ms = F.MODE_SETS[name]
    rng = np.random.default_rng(11)
    groups = ms.geometry(64).groups
    wants = [np.full(groups, m) for m in (F.MODE_NARROW, F.MODE_WIDE, F.MODE_RAW)] + [rng.integers(0, 3, groups)]
    made = [forced_tile(ms, rng, w, 64) for w in wants]
    tiles, bn, bw = (np.concatenate(x) for x in zip(*made))
    enc = roundtrip(tiles, bn, bw, ms.geometry(64).max_escapes, ms)
    np.testing.assert_array_equal(enc["ref"].modes, np.stack(wants))


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("tiles_per_block", [1, 3])
def test_slot_overflow_goes_to_the_raw_pool(name, tiles_per_block):
    """Tiles that fit exactly, overflow by one byte or by far, mixed in one thread block (7 tiles leave
    the last block of 3 partly empty); entries are the free lists' in tile order within each class."""
    ms = F.MODE_SETS[name]
    rng = np.random.default_rng(5)
    raw_b, capacity = ms.escape_bytes[F.MODE_RAW], 48
    groups = ms.geometry(64).groups
    # Escape bytes per tile: capacity exactly, capacity + 1, 0, all raw, capacity - 1, capacity + 1, 1.
    wide_counts = [capacity % raw_b, capacity % raw_b + 1, 0, 0, capacity % raw_b - 1 + raw_b, capacity % raw_b + 1, 1]
    raw_counts = [capacity // raw_b, capacity // raw_b, 0, groups, capacity // raw_b - 1, capacity // raw_b, 0]
    made = []
    for w, r in zip(wide_counts, raw_counts):
        want = np.zeros(groups, np.int64)
        where = rng.permutation(groups)
        want[where[:r]] = F.MODE_RAW
        want[where[r:r + w]] = F.MODE_WIDE
        made.append(forced_tile(ms, rng, want, 64))
    tiles, bn, bw = (np.concatenate(x) for x in zip(*made))
    enc = roundtrip(tiles, bn, bw, capacity, ms, tiles_per_block=tiles_per_block)
    used = np.array(wide_counts) + raw_b * np.array(raw_counts)
    np.testing.assert_array_equal(enc["ref"].escape_used, used)
    spill = used > capacity
    np.testing.assert_array_equal(enc["entries"][~spill], np.arange(9)[::-1][: (~spill).sum()])
    np.testing.assert_array_equal(enc["entries"][spill].astype(np.int64),
                                  L.TABLE_RAW_FLAG - (1 << 32) + np.arange(spill.sum()))


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_128_channel_tiles(name):
    """128-channel tiles (head_dim 128, or half a 256 head): every mode, one tile spills."""
    ms = F.MODE_SETS[name]
    rng = np.random.default_rng(128)
    groups = ms.geometry(128).groups
    made = [forced_tile(ms, rng, rng.choice(3, groups, p=p), 128) for p in ([.6, .3, .1], [.2, .2, .6])]
    tiles, bn, bw = (np.concatenate(x) for x in zip(*made))
    used = ref_encode_tiles(tiles, bn, bw, 0, ms).escape_used
    assert used[0] < used[1]
    roundtrip(tiles, bn, bw, -(-int(used[0]) // 16) * 16, ms)


def test_real_kv_blocks():
    """Two blocks of a real layer converted to E5M2 and E4M3 with the calibration's scales; one row of
    bases per block (tile i uses row i % tiles per block), as the paged cache passes them."""
    from conftest import kv_dump
    from gaac.fp8 import calibrate_fp8
    from gaac.fp8.convert import to_fp8
    from gaac.tiles import block_tiles, cache_blocks, tile_bases

    v = kv_dump("code", "v")[:1, :, :64]
    for name in FORMAT_NAMES:
        cal = calibrate_fp8(v, v, name)                   # only V's tables are used
        ms = cal.modes
        fp8 = to_fp8(v[0], ms.fmt, cal.scale_log2[L.KIND_V, 0][:, None, None])
        tiles = block_tiles(cache_blocks(fp8)[:2])
        bn, bw = tile_bases(*cal.bases(0, L.KIND_V))
        capacity = int(cal.capacity[L.KIND_V, 0])
        ref = ref_encode_tiles(tiles, np.tile(bn, (2, 1)), np.tile(bw, (2, 1)), capacity, ms)
        out = gc.encode_tiles(tiles, bn, bw, capacity, name)
        for t in range(len(tiles)):
            e = int(out["entries"][t])
            assert (e >= 0) == bool(ref.fits[t])
            if e >= 0:
                np.testing.assert_array_equal(out["slots"][e], ref.slots[t])
        dec, status = gc.decode_tiles(out["slots"], out["raw"], out["entries"], bn, bw, capacity, name)
        assert (status == 0).all()
        np.testing.assert_array_equal(dec, tiles)


def test_exhausted_free_list_stores_nothing():
    ms = F.MODE_SETS["fp8_e4m3"]
    rng = np.random.default_rng(2)
    bn, bw = np.full((1, 64), 5), np.full((1, 64), 4)
    e = 5 + rng.integers(0, 4, (3, 16 * 64))
    tiles = join_elements(rng.integers(0, 16, e.shape), e.astype(np.uint8), ms.fmt).reshape(3, 16, 64)
    slots = np.zeros((1, ms.geometry(64).slot_bytes(0)), np.uint8)
    raw = np.zeros((1, 16, 64), np.uint8)
    heads = np.zeros(2, np.int32)
    entries, used = np.zeros(3, np.int32), np.zeros(3, np.int32)
    gc.EncodePlan(64, 0, gc.pack_bases(bn, bw, ms), slots, np.zeros(1, np.int32), raw,
                  np.zeros(1, np.int32), heads, fmt=ms)(tiles, entries, used)
    assert heads[0] == 3 and sorted(entries) == [gc.NO_STORAGE, gc.NO_STORAGE, 0]


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_decoder_flags_reserved_tags_and_escape_overflow(name):
    """A slot with tag 3 (R18) and one whose tags need more escape bytes than the slot holds (R19): the
    reference rejects both, the kernel flags them; an intact slot and a raw tile next to them decode."""
    ms = F.MODE_SETS[name]
    geo = ms.geometry(64)
    rng = np.random.default_rng(1)
    tiles, bn, bw = forced_tile(ms, rng, rng.choice(3, geo.groups, p=[.9, .08, .02]), 64)
    capacity = -(-int(ref_encode_tiles(tiles, bn, bw, 0, ms).escape_used[0]) // 16) * 16
    out = gc.encode_tiles(tiles, bn, bw, capacity, name)
    slots = np.repeat(out["slots"], 3, axis=0)
    slots[1, geo.tag_offset + 5] |= 0b11 << 4               # group 22: tag 3
    slots[2, geo.tag_offset: geo.tag_offset + 6] = 0xAA       # 24 raw groups: more than the capacity
    raw = np.repeat(tiles, 2, axis=0)
    entries = np.array([0, 1, 2, L.TABLE_RAW_FLAG - (1 << 32) + 1], np.int32)
    dec, status = gc.decode_tiles(slots, raw, entries, np.repeat(bn, 4, 0), np.repeat(bw, 4, 0), capacity, name)
    assert list(status) == [0, gc.BAD_TAG, gc.BAD_ESCAPES, 0]
    np.testing.assert_array_equal(dec[[0, 3]], np.repeat(tiles, 2, axis=0))
    for bad, message in ((1, "is reserved"), (2, "escape bytes but the slot holds")):
        with pytest.raises(FormatError, match=message):
            ref_decode_tiles(slots[bad:bad + 1], bn, bw, capacity, 64, ms)


def test_input_errors_name_the_problem():
    ms = F.MODE_SETS["fp8_e5m2"]
    bn, bw = np.zeros((1, 64), np.uint8), np.zeros((1, 64), np.uint8)
    bases = gc.pack_bases(bn, bw, ms)
    slots, raw = np.zeros((1, ms.geometry(64).slot_bytes(16)), np.uint8), np.zeros((1, 16, 64), np.uint8)
    free, heads = np.arange(1, dtype=np.int32), np.zeros(2, np.int32)
    with pytest.raises(InputError, match="bits: dtype int16"):
        gc.EncodePlan(64, 16, bases, slots, free, raw, free, heads, fmt=ms)(
            np.zeros((1, 16, 64), np.int16), np.zeros(1, np.int32), np.zeros(1, np.int32))
    with pytest.raises(InputError, match=r"slots: shape \[1, 688\], expected \[\*, 704\]"):
        gc.EncodePlan(64, 32, bases, slots, free, raw, free, heads, fmt=ms)
    with pytest.raises(InputError, match="raw: dtype int16"):
        gc.DecodePlan(64, 16, bases, slots, raw.view(np.int16).reshape(1, 16, 32).repeat(2, 2), fmt=ms)
    with pytest.raises(InputError, match="capacity 8"):
        gc.DecodePlan(64, 8, bases, slots, raw, fmt=ms)
    with pytest.raises(InputError, match="96 channels"):
        gc.DecodePlan(96, 16, bases, slots, raw, fmt=ms)
    with pytest.raises(InputError, match="unknown element format 'fp8_e3m4'"):
        gc.DecodePlan(64, 16, bases, slots, raw, fmt="fp8_e3m4")
    with pytest.raises(InputError, match=r"wide bases in 0..24; got 0..0 and 25..25"):
        gc.pack_bases(bn, np.full((1, 64), 25), ms)
    with pytest.raises(InputError, match="bases: dtype int16"):
        gc.DecodePlan(64, 16, bases.astype(np.int16), slots, raw, fmt=ms)


def test_bit_helpers_against_numpy():
    """The byte-lane packers and bit-plane helpers (plain Python in the simulator, inlined on the GPU)."""
    rng = np.random.default_rng(4)
    for _ in range(40):
        w = int(rng.integers(2, 5))
        vals = rng.integers(0, 1 << w, 8).astype(np.uint8)
        words = vals.view("<u4")                                  # elements 0..3, 4..7 as byte lanes
        packed = int(fc._pack4(words[0], w)) | int(fc._pack4(words[1], w)) << (4 * w)
        assert packed == int.from_bytes(pack_bits(vals, w).tobytes(), "little")
        assert fc._unpack4(np.uint32(packed), w) == words[0]
        assert fc._unpack4(np.uint32(packed >> (4 * w)), w) == words[1]
        b = int(rng.integers(0, 8))
        byte = int(fc._plane_byte(words[0], words[1], b))
        assert byte == bit_planes(vals, b, 1)[0]
        lo, hi = fc._spread_plane(np.uint32(byte), b)
        np.testing.assert_array_equal(np.array([lo, hi], "<u4").view(np.uint8), vals & (1 << b))


def test_the_fp8_kernels_register_with_the_device_codec(monkeypatch):
    """gaac.fp8.cuda registers its kernels for both FP8 formats when it is imported (gaac.cuda.codec does not
    import it); a format with no registered kernels is an InputError that says what to import."""
    for fmt in L.FP8_FORMATS.values():
        ms = L.mode_set(fmt)
        assert gc.device_codec(fmt) == fc.fp8_codec(ms) and gc.device_codec(fmt.name).modes == ms
    monkeypatch.setattr(gc.codec, "_CODECS", {})
    with pytest.raises(InputError, match="import gaac.fp8.cuda"):
        gc.device_codec("fp8_e4m3")
    assert gc.device_codec(L.BF16).modes == L.BF16_MODES
