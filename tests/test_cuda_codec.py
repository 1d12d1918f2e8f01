"""The numba.cuda tile codec against the reference codec, run in numba's CUDA simulator.

Shapes stay tiny (a few tiles a launch): the simulator runs one Python thread
per CUDA thread.  What is checked: a fitting tile's slot holds exactly the
reference's bytes, an overflowing tile's BF16 bits land in the raw pool, the
block-table entries and escape counts agree, decode inverts encode, and nothing
outside the popped slots and raw tiles is written.  The kernels put several
tiles (one per warp) in a thread block and pop storage once per block, so the
tests use tile counts that leave the last block partly empty and mix slot and
raw tiles inside one block.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import block_cases, forced_blocks, overflow_blocks

from gaac import layout as L
from gaac.calibration import calibrate
from gaac.cuda import BAD_ESCAPES, BAD_TAG, NO_STORAGE, DecodePlan, EncodePlan, decode_tiles, encode_tiles, pack_bases
from gaac.cuda import primitives
from gaac.errors import InputError
from gaac.reference.codec import encode_tiles as ref_encode_tiles
from gaac.tiles import block_tiles, cache_blocks, tile_bases

POISON = 0xA5
SIM = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def encode_checked(tiles: np.ndarray, b3: np.ndarray, b4: np.ndarray, capacity: int, **plan) -> dict:
    """Encode with the kernel into poisoned pools and check everything against the reference."""
    n, _, channels = tiles.shape
    geo = L.TileGeometry(channels)
    ref = ref_encode_tiles(tiles, b3, b4, capacity)
    spare = 2                                           # pool entries nothing may touch
    slots = np.full((n + spare, geo.slot_bytes(capacity)), POISON, np.uint8)
    raw = np.full((n + spare, L.BLOCK_TOKENS, channels), POISON * 0x101, np.uint16).view(np.int16)
    heads = np.zeros(2, np.int32)
    entries, used = np.full(n, 7, np.int32), np.full(n, -7, np.int32)
    encode = EncodePlan(channels, capacity, pack_bases(b3, b4), slots,
                        np.arange(n + spare, dtype=np.int32)[::-1].copy(), raw, np.arange(n + spare, dtype=np.int32),
                        heads, **plan)
    encode(tiles.view(np.int16), entries, used)
    check_storage(tiles, ref, slots, raw, entries, used, heads)
    return dict(slots=slots, raw=raw, entries=entries, ref=ref)


def check_storage(tiles, ref, slots, raw, entries, used, heads):
    """An encode kernel's output against the reference codec's (BF16 or FP8, tests/test_fp8_cuda.py uses it
    too): the escape counts, free-list heads and entries agree, a fitting tile's slot holds the reference's
    bytes, an overflowing tile's raw tile its bits, and every slot and raw tile not popped still holds POISON."""
    np.testing.assert_array_equal(used, ref.escape_used)
    assert list(heads) == [int(ref.fits.sum()), int((~ref.fits).sum())]
    assert ((entries < 0) == ~ref.fits).all()
    index = entries.astype(np.int64) & L.TABLE_INDEX_MASK
    for t in range(len(tiles)):
        if ref.fits[t]:
            np.testing.assert_array_equal(slots[index[t]], ref.slots[t], err_msg=f"slot of tile {t}")
        else:
            np.testing.assert_array_equal(raw[index[t]].view(tiles.dtype), tiles[t], err_msg=f"raw tile {t}")
    assert (slots[np.setdiff1d(np.arange(len(slots)), index[ref.fits])] == POISON).all()
    assert (raw[np.setdiff1d(np.arange(len(raw)), index[~ref.fits])].view(np.uint8) == POISON).all()


def roundtrip(tiles, b3, b4, capacity, **plan):
    enc = encode_checked(tiles, b3, b4, capacity, **plan)
    n, _, channels = tiles.shape
    out, status = np.full((n, 16, channels), -1, np.int16), np.full(n, -1, np.int32)
    DecodePlan(channels, capacity, pack_bases(b3, b4), enc["slots"], enc["raw"], **plan)(enc["entries"], out, status)
    assert (status == 0).all()
    np.testing.assert_array_equal(out.view(np.uint16), tiles)
    return enc


def case_tiles(case):
    b3, b4 = tile_bases(*case.calibration.bases(case.layer, case.kind_index))
    return block_tiles(case.bits), b3, b4


@SIM
@given(st.integers(1, 2).flatmap(lambda h: forced_blocks(head_dim=64, heads=h)))
def test_forced_modes_match_reference(case):
    tiles, b3, b4 = case_tiles(case)
    enc = roundtrip(tiles, b3, b4, case.capacity)
    np.testing.assert_array_equal(enc["ref"].modes, case.modes)


@SIM
@given(overflow_blocks(head_dim=64, heads=2))
def test_slot_overflow_goes_to_the_raw_pool(case):
    tiles, b3, b4 = case_tiles(case)
    enc = roundtrip(tiles, b3, b4, case.capacity)
    assert tuple(np.flatnonzero(enc["entries"] < 0)) == case.raw_tiles


@SIM
@given(block_cases(head_dim=64, heads=1))
def test_any_patterns_any_bases(case):
    tiles, b3, b4 = case_tiles(case)
    roundtrip(tiles, b3, b4, case.capacity)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_wide_heads_with_every_mode(head_dim):
    """128-channel tiles (a 256 head is two): every mode, escapes past a 64-bit word, a spilled tile."""
    rng = np.random.default_rng(head_dim)
    b3 = rng.integers(0, L.B3_MAX + 1, size=(1, head_dim)).astype(np.uint8)
    b4 = np.clip(b3.astype(int) - 4, 0, L.B4_MAX).astype(np.uint8)
    e = b3[:, None, :] + rng.choice([0, 3, 7, 9, 11, -4, 40], size=(1, 16, head_dim), p=[.3, .3, .2, .08, .08, .02, .02])
    sm = rng.integers(0, 256, size=e.shape)
    bits = (((sm & 0x80) << 8) | ((e % 256) << 7) | (sm & 0x7F)).astype(np.uint16)
    tiles = block_tiles(bits)
    t3, t4 = tile_bases(b3, b4)
    used = ref_encode_tiles(tiles, t3, t4, 0).escape_used
    assert used.min() > 8                               # escapes span several 64-bit words
    roundtrip(tiles, t3, t4, -(-int(used.max()) // 16) * 16)
    roundtrip(tiles, t3, t4, int(used.min()) // 16 * 16)  # at least one tile spills


@pytest.mark.parametrize("tiles_per_block", [1, 3, 8])
def test_slot_and_raw_tiles_share_a_block(tiles_per_block):
    """Tiles that fit and tiles that spill in one thread block; 7 tiles leave the last block partly empty.

    A block pops its slots and its raw tiles with one atomic each and hands them out in warp order;
    the simulator runs the blocks one after the other, so the entries are the free lists' first
    entries in tile order within each class (on the GPU, blocks pop in any order)."""
    rng = np.random.default_rng(7)
    c = 64
    b3 = rng.integers(100, 131, size=(7, c)).astype(np.uint8)
    b4 = (b3 - 4).astype(np.uint8)
    e = b3[:, None, :] + rng.integers(0, 8, size=(7, 16, c))
    spill = np.array([0, 1, 1, 0, 1, 0, 0], bool)
    e[spill, :, :8] = 0                                 # 16 raw groups: 80 escape bytes > capacity 64
    e[~spill, 0, 8:16] += 9                             # one 4-bit group
    sm = rng.integers(0, 256, size=e.shape)
    tiles = (((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)).astype(np.uint16)
    enc = roundtrip(tiles, b3, b4, 64, tiles_per_block=tiles_per_block)
    np.testing.assert_array_equal(enc["ref"].fits, ~spill)
    slot_free, raw_free = np.arange(9)[::-1], np.arange(9)   # the free lists encode_checked passes
    np.testing.assert_array_equal(enc["entries"][~spill], slot_free[:4])
    np.testing.assert_array_equal(enc["entries"][spill].astype(np.int64) & L.TABLE_INDEX_MASK, raw_free[:3])


def test_real_kv_blocks_with_shared_bases():
    """Two blocks of a real layer, bases given once per block (row = tile % tiles_per_block)."""
    from conftest import kv_dump

    k, v = kv_dump("code", "k"), kv_dump("code", "v")
    cal = calibrate(k[:2], v[:2], show_progress=False)
    b3, b4 = tile_bases(*cal.bases(1, L.KIND_V))
    tiles = block_tiles(cache_blocks(v[1])[:2])         # 2 blocks x 3 heads = 6 tiles
    capacity = int(cal.capacity[L.KIND_V, 1])
    n_ref = np.tile(b3, (2, 1)), np.tile(b4, (2, 1))
    ref = ref_encode_tiles(tiles, *n_ref, capacity)
    out = encode_tiles(tiles.view(np.int16), b3, b4, capacity)
    for t in range(len(tiles)):
        e = int(out["entries"][t])
        assert (e >= 0) == bool(ref.fits[t])
        if e >= 0:
            np.testing.assert_array_equal(out["slots"][e], ref.slots[t])
    dec, status = decode_tiles(out["slots"], out["raw"], out["entries"], b3, b4, capacity)
    assert (status == 0).all()
    np.testing.assert_array_equal(dec.view(np.uint16), tiles)


def _one_slot(capacity=16):
    rng = np.random.default_rng(1)
    b3 = np.full((1, 64), 120, np.uint8)
    b4 = np.full((1, 64), 116, np.uint8)
    e = 120 + rng.integers(0, 8, size=(1, 16, 64))
    tiles = ((e << 7) | rng.integers(0, 128, size=e.shape)).astype(np.uint16)
    out = encode_tiles(tiles.view(np.int16), b3, b4, capacity)
    return out, b3, b4


def test_decoder_flags_reserved_tags_and_escape_overflow():
    geo = L.TileGeometry(64)
    out, b3, b4 = _one_slot()
    entries = np.zeros(3, np.int32)
    slots = np.repeat(out["slots"], 3, axis=0)
    slots[1, geo.tag_offset + 5] |= 0b11 << 4            # group 22: tag 3
    slots[2, geo.tag_offset: geo.tag_offset + 5] = 0xAA  # 20 raw groups: 100 escape bytes > 16
    entries[:] = np.arange(3)
    _, status = decode_tiles(slots, out["raw"], entries, b3, b4, 16)
    assert list(status) == [0, BAD_TAG, BAD_ESCAPES]


def test_exhausted_free_list_stores_nothing():
    rng = np.random.default_rng(2)
    tiles = ((120 + rng.integers(0, 8, size=(3, 16, 64))) << 7).astype(np.uint16)
    b3, b4 = np.full((1, 64), 120, np.uint8), np.full((1, 64), 116, np.uint8)
    slots = np.zeros((1, L.TileGeometry(64).slot_bytes(0)), np.uint8)
    raw = np.zeros((1, 16, 64), np.int16)
    heads = np.zeros(2, np.int32)
    entries, used = np.zeros(3, np.int32), np.zeros(3, np.int32)
    EncodePlan(64, 0, pack_bases(b3, b4), slots, np.zeros(1, np.int32), raw, np.zeros(1, np.int32), heads)(
        tiles.view(np.int16), entries, used)
    assert heads[0] == 3 and sorted(entries) == [NO_STORAGE, NO_STORAGE, 0]


def test_input_errors_name_the_problem():
    out, b3, b4 = _one_slot()
    bases = pack_bases(b3, b4)
    with pytest.raises(InputError, match="bits: dtype uint16"):
        EncodePlan(64, 16, bases, out["slots"], np.arange(1, dtype=np.int32), out["raw"],
                   np.arange(1, dtype=np.int32), np.zeros(2, np.int32))(
            np.zeros((1, 16, 64), np.uint16), np.zeros(1, np.int32), np.zeros(1, np.int32))
    with pytest.raises(InputError, match=r"slots: shape \[1, 1456\], expected \[\*, 1472\]"):
        EncodePlan(64, 32, bases, out["slots"], np.arange(1, dtype=np.int32), out["raw"],
                   np.arange(1, dtype=np.int32), np.zeros(2, np.int32))
    with pytest.raises(InputError, match="capacity 8"):
        DecodePlan(64, 8, bases, out["slots"], out["raw"])
    with pytest.raises(InputError, match="96 channels"):
        DecodePlan(96, 16, bases, out["slots"], out["raw"])
    with pytest.raises(InputError, match="wide bases in 0..240"):
        pack_bases(b3, np.full_like(b4, L.B4_MAX + 1))
    with pytest.raises(InputError, match="C-contiguous"):
        DecodePlan(64, 16, bases, out["slots"], out["raw"])(
            out["entries"], np.zeros((1, 64, 16), np.int16).transpose(0, 2, 1), np.zeros(1, np.int32))


def test_32bit_toolkit_against_numpy():
    """The 32-bit toolkit's simulator twins (the GPU versions are PTX/libdevice; --check covers those)."""
    rng = np.random.default_rng(4)
    x, y = rng.integers(0, 2**32, size=(2, 50), dtype=np.uint64)
    sel = rng.integers(0, 8, size=(50, 4))
    for a, b, s in zip(x, y, sel):
        both = np.array([a, b], "<u4").view(np.uint8)    # bytes 0..3 of a, then 4..7 of b
        want = int(both[s].view("<u4")[0])
        assert primitives.prmt(a, b, int(s @ [1, 16, 256, 4096])) == want
        assert primitives.prmt0(a, int(s @ [1, 16, 256, 4096])) == primitives.prmt(a, 0, int(s @ [1, 16, 256, 4096]))
        assert primitives.mul32(a, b) == (int(a) * int(b)) % 2**32
        assert primitives.popc32(a) == bin(int(a)).count("1")
        r = int(b) % 32
        assert primitives.funnel_r(a, b, r) == ((int(b) << 32 | int(a)) >> r) % 2**32


def _poisoned_pools(n: int, channels: int, capacity: int) -> tuple:
    """Pools of ``n`` slots and ``n`` raw tiles filled with a poison byte, their free lists in order, zero counts,
    and entries and escape counts of ``n`` tiles filled with other values: ``(slots, raw, heads, entries,
    escape_used, the EncodePlan pool arguments)``."""
    geo = L.TileGeometry(channels)
    slots = np.full((n, geo.slot_bytes(capacity)), POISON, np.uint8)
    raw = np.full((n, L.BLOCK_TOKENS, channels), POISON * 0x101, np.uint16).view(np.int16)
    heads = np.zeros(2, np.int32)
    entries, used = np.full(n, 7, np.int32), np.full(n, -7, np.int32)
    return slots, raw, heads, entries, used, (slots, np.arange(n, dtype=np.int32), raw, np.arange(n, dtype=np.int32),
                                              heads)


def test_in_place_encode_reads_a_sequence_where_it_lies():
    """EncodePlan.in_place on a [heads, tokens, C] input writes what the ordinary encode writes for the same
    blocks cut into tiles: entries, escape counts, slots and raw tiles (a tile of wide exponents overflows)."""
    rng = np.random.default_rng(5)
    heads, channels, tokens = 3, 64, 4 * L.BLOCK_TOKENS + 5
    e = 120 + rng.choice([0, 1, 2, 5, 9], size=(heads, tokens, channels), p=[.4, .3, .2, .095, .005])
    e[1, 2 * L.BLOCK_TOKENS:3 * L.BLOCK_TOKENS] = rng.integers(1, 250, size=(L.BLOCK_TOKENS, channels))
    bits = ((rng.integers(0, 2, e.shape) << 15) | (e << 7) | rng.integers(0, 128, e.shape)).astype(np.uint16)
    b3 = np.full((heads, channels), 120, np.uint8)
    b4 = np.full((heads, channels), 118, np.uint8)
    first, blocks = 1, 3                                  # blocks 1..3 of the sequence
    tiles = block_tiles(bits[:, first * L.BLOCK_TOKENS:(first + blocks) * L.BLOCK_TOKENS]
                        .reshape(heads, blocks, L.BLOCK_TOKENS, channels).transpose(1, 0, 2, 3))
    n, capacity = len(tiles), 16
    out = []
    for in_place in (False, True):
        slots, raw, heads_at, entries, used, pools = _poisoned_pools(n, channels, capacity)
        plan = EncodePlan(channels, capacity, pack_bases(*tile_bases(b3, b4)), *pools)
        if in_place:
            plan.in_place(bits.view(np.int16), first, entries, used)
        else:
            plan(tiles.view(np.int16), entries, used)
        out.append((slots, raw, entries, used, heads_at))
    for want, got in zip(*out):
        np.testing.assert_array_equal(got, want)
    assert (out[1][2] < 0).any() and (out[1][2] >= 0).any()        # raw and slot tiles both
    with pytest.raises(InputError, match="not whole blocks"):
        plan.in_place(bits.view(np.int16), 3, entries, used)       # blocks 3..5 run past the 4 whole blocks


def test_an_encode_by_rows_codes_each_block_with_its_rows_bases():
    """EncodePlan.in_place_by_rows (a prompt's encode that reads each block's epoch on the device) writes what
    in-place encodes of each block with that block's bases write, in the same order: entries, escape counts,
    slots, raw tiles and the free-list counts; its extents are checked."""
    rng = np.random.default_rng(7)
    heads, channels, blocks = 2, 64, 4
    e = 118 + rng.choice([0, 1, 2, 3, 5, 9], size=(heads, blocks * L.BLOCK_TOKENS, channels),
                         p=[.3, .3, .2, .15, .045, .005])
    e[1, 2 * L.BLOCK_TOKENS:3 * L.BLOCK_TOKENS] = rng.integers(1, 250, size=(L.BLOCK_TOKENS, channels))
    bits = ((rng.integers(0, 2, e.shape) << 15) | (e << 7) | rng.integers(0, 128, e.shape)).astype(np.uint16)
    sets = [pack_bases(*tile_bases(np.full((heads, channels), b3, np.uint8), np.full((heads, channels), b4, np.uint8)))
            for b3, b4 in ((118, 114), (121, 112), (119, 118))]
    rows = np.array([2, 0, 0, 1], np.int32)
    n, capacity = heads * blocks, 16
    out = []
    for by_rows in (False, True):
        slots, raw, heads_at, entries, used, pools = _poisoned_pools(n, channels, capacity)
        if by_rows:
            plan = EncodePlan(channels, capacity, sets[1], *pools)
            plan.in_place_by_rows(bits.view(np.int16), np.concatenate(sets), rows, entries, used)
        else:
            for b, r in enumerate(rows):
                EncodePlan(channels, capacity, sets[r], *pools).in_place(
                    bits.view(np.int16), b, entries[b * heads:(b + 1) * heads], used[b * heads:(b + 1) * heads])
        out.append((slots, raw, entries, used, heads_at))
    for want, got in zip(*out):
        np.testing.assert_array_equal(got, want)
    assert (out[1][2] < 0).any() and (out[1][2] >= 0).any()        # raw and slot tiles both
    one = [EncodePlan(channels, capacity, sets[r], slots.copy(), np.arange(n, dtype=np.int32), raw.copy(),
                      np.arange(n, dtype=np.int32), np.zeros(2, np.int32)) for r in range(3)]
    used_one = [np.zeros(n, np.int32) for _ in range(3)]
    for plan, u in zip(one, used_one):
        plan.in_place(bits.view(np.int16), 0, np.zeros(n, np.int32), u)
    assert len({u.tobytes() for u in used_one}) == 3                  # each set of bases codes the blocks its way
    with pytest.raises(InputError, match="by rows"):
        plan.in_place_by_rows(bits.view(np.int16), np.concatenate(sets), rows[:3], entries, used)


def test_a_plan_with_other_bases_encodes_what_a_plan_made_with_them_encodes():
    """``EncodePlan.with_bases`` (how the cache makes the plan of an epoch the rule appends) shares the pools and
    the kernel but codes with its own bases: its storage is the reference codec's for those bases, which differ
    from the first plan's, and a plan's rows must match."""
    rng = np.random.default_rng(3)
    n, channels, capacity = 5, 64, 16
    e = rng.integers(118, 126, size=(n, L.BLOCK_TOKENS, channels))
    tiles = (((rng.integers(0, 256, size=e.shape) & 0x80) << 8) | (e << 7)
             | rng.integers(0, 128, size=e.shape)).astype(np.uint16)
    first = (np.full((1, channels), 114), np.full((1, channels), 106))
    other = (np.full((1, channels), 118), np.full((1, channels), 110))
    ref_first, ref = (ref_encode_tiles(tiles, *b, capacity) for b in (first, other))
    assert not np.array_equal(ref_first.escape_used, ref.escape_used)          # the bases change the coding
    geo = L.TileGeometry(channels)
    slots = np.full((n + 2, geo.slot_bytes(capacity)), POISON, np.uint8)
    raw = np.full((n + 2, L.BLOCK_TOKENS, channels), POISON * 0x101, np.uint16).view(np.int16)
    heads = np.zeros(2, np.int32)
    plan = EncodePlan(channels, capacity, pack_bases(*first), slots, np.arange(n + 2, dtype=np.int32)[::-1].copy(),
                      raw, np.arange(n + 2, dtype=np.int32), heads)
    entries, used = np.full(n, 7, np.int32), np.full(n, -7, np.int32)
    plan.with_bases(pack_bases(*other))(tiles.view(np.int16), entries, used)
    check_storage(tiles, ref, slots, raw, entries, used, heads)
    with pytest.raises(InputError, match="rows"):
        plan.with_bases(pack_bases(np.full((2, channels), 118), np.full((2, channels), 110)))
