"""GAAC-FP8 (format_spec/FORMAT-FP8.md): conversion, codec, calibration, container, vectors, stats.

The codec is checked three ways: exhaustively (every FP8 pattern under every
valid pair of bases), with Hypothesis (drawn tiles, bases and capacities, and
tiles whose modes are forced), and against a plain-Python decoder written from
FORMAT-FP8.md alone (:func:`spec_decode_slot`), which also reads the test vectors.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import kv_dump
from gaac import layout as L
from gaac.calibration import FP8_FILE, Calibration
from gaac.errors import CalibrationError, FormatError, InputError
from gaac import layout as F
from gaac.fp8 import decode_fp8_block, encode_bf16_block, encode_fp8_block
from gaac.calibration import exponent_histograms
from gaac.fp8 import calibrate_fp8
from gaac.reference.bits import join_elements, split_elements
from gaac.reference.codec import decode_tiles, encode_tiles
from gaac.fp8.convert import (bf16_to_float, cache_scales, cache_to_fp8, choose_scale_log2, fp8_to_float,
                              fp8_values, round_to_fp8, to_fp8)
from gaac.fp8.stats import format_fp8_table, fp8_stats
from test_spec import table

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "format_spec" / "vectors" / "fp8"
SPEC = (ROOT / "format_spec" / "FORMAT-FP8.md").read_text()
FORMAT_NAMES = tuple(F.FP8_FORMATS)
ALL_BF16 = np.arange(1 << 16, dtype=np.uint16)
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- a decoder written from FORMAT-FP8.md alone ----------------------------------

def _bits(data: bytes, start_bit: int, width: int) -> int:
    """FORMAT.md section 1: field of ``width`` bits at stream bit ``start_bit``, least significant bit first."""
    return sum(((data[(start_bit + j) // 8] >> ((start_bit + j) % 8)) & 1) << j for j in range(width))


def spec_decode_slot(slot: bytes, fmt: str, channels: int, capacity: int, bn: list, bw: list) -> list[int]:
    """FP8 bytes of one slot, element order; ``bn``/``bw`` are the tile's per-channel bases (sections 3, 5)."""
    E, M = (4, 3) if fmt == "fp8_e4m3" else (5, 2)
    n_el = 16 * channels
    sm_bytes, code_bytes, tag_bytes = n_el * (M + 1) // 8, n_el * 2 // 8, n_el // 32
    code_off, tag_off = sm_bytes, sm_bytes + code_bytes
    esc_off = tag_off + tag_bytes
    assert len(slot) == esc_off + capacity
    raw_planes = E - 2
    out, pos = [], 0
    for g in range(n_el // 8):
        tag = _bits(slot[tag_off:], 2 * g, 2)
        assert tag != 3
        n_esc = (0, 1, raw_planes)[tag]
        planes = slot[esc_off + pos: esc_off + pos + n_esc]
        pos += n_esc
        for i in range(8):
            n = 8 * g + i
            code = _bits(slot[code_off:], 2 * n, 2)
            for p, plane in enumerate(planes):
                code |= ((plane >> i) & 1) << (2 + p)
            c = n % channels
            e = (bn[c] + code, bw[c] + code, code)[tag]
            sm = _bits(slot, (M + 1) * n, M + 1)
            out.append(((sm >> M) << 7) | (e << M) | (sm & ((1 << M) - 1)))
    assert pos <= capacity and not any(slot[esc_off + pos: esc_off + capacity])
    return out


# -- conversion -----------------------------------------------------------------

def test_fp8_value_tables_match_torch():
    torch = pytest.importorskip("torch")
    for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double().numpy()
        got = fp8_values(F.FP8_FORMATS[name])
        assert np.array_equal(np.isnan(got), np.isnan(want))
        assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("scale", [-6, 0, 5])
def test_conversion_equals_torch_on_every_bf16_pattern(name, scale):
    """RNE with saturation == torch's clamp-then-cast, for every finite BF16 value."""
    torch = pytest.importorskip("torch")
    fmt = F.FP8_FORMATS[name]
    dtype = torch.float8_e4m3fn if name == "fp8_e4m3" else torch.float8_e5m2
    x = bf16_to_float(ALL_BF16)
    finite = np.isfinite(x)
    t = torch.from_numpy(np.ldexp(x[finite], -scale)).float()
    want = torch.clamp(t, -fmt.max_finite, fmt.max_finite).to(dtype).view(torch.uint8).numpy()
    got = to_fp8(ALL_BF16, fmt, scale)
    assert np.array_equal(got[finite], want)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_conversion_special_values_and_ties(name):
    fmt = F.FP8_FORMATS[name]
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e30, -0.0, 0.0, 1e-30, -1e-30])
    got = round_to_fp8(x, fmt)
    mx = fmt.max_finite_bits
    assert got.tolist() == [fmt.nan_bits, 0x80 | fmt.nan_bits, mx, 0x80 | mx, mx, 0x80, 0x00, 0x00, 0x80]
    # Ties to even, worked by hand: E4M3 has 1/8 steps on [1, 2), E5M2 1/4 steps.
    if name == "fp8_e4m3":
        assert round_to_fp8(np.array([1.0625, 1.1875, 1.0626, 2.0 ** -10, 3 * 2.0 ** -10]), fmt).tolist() == \
            [0x38, 0x3A, 0x39, 0x00, 0x02]
        assert (fmt.nan_bits, fmt.max_finite, fmt.inf_bits) == (0x7F, 448.0, None)
    else:
        assert round_to_fp8(np.array([1.125, 1.375, 1.126, 2.0 ** -17, 3 * 2.0 ** -17]), fmt).tolist() == \
            [0x3C, 0x3E, 0x3D, 0x00, 0x02]
        assert (fmt.nan_bits, fmt.max_finite, fmt.inf_bits) == (0x7E, 57344.0, 0x7C)


def test_conversion_roundtrips_every_fp8_value_exactly():
    """Every finite FP8 value times any power of two converts back to the same bits."""
    for fmt in F.FP8_FORMATS.values():
        v = fp8_values(fmt)
        finite = np.flatnonzero(np.isfinite(v))
        for s in (-4, 0, 3):
            assert np.array_equal(round_to_fp8(np.ldexp(v[finite], s) * 2.0 ** -s, fmt), finite.astype(np.uint8))
            assert np.array_equal(fp8_to_float(finite, fmt, s), np.ldexp(v[finite], s))


def test_scale_choice():
    e4 = F.E4M3
    assert choose_scale_log2(np.array([448.0, 449.0, 224.0, 224.5, 0.0, np.inf, 1e-3]), e4).tolist() == \
        [0, 1, -1, 0, 0, 0, -18]
    x = np.zeros((2, 3, 16, 64), dtype=np.uint16)
    x[1, 2, 5, 7] = 0x4300    # 128.0 in layer 1, head 2
    x[1, 0, 0, 0] = 0x4100    # 8.0 in layer 1, head 0
    assert cache_scales(x, e4, "tensor").tolist() == [[0, 0, 0], [-1, -1, -1]]
    assert cache_scales(x, e4, "head").tolist() == [[0, 0, 0], [-5, 0, -1]]
    assert cache_scales(x, e4, "one").tolist() == [[0, 0, 0], [0, 0, 0]]
    with pytest.raises(InputError, match="scale policy"):
        cache_scales(x, e4, "channel")


# -- the codec --------------------------------------------------------------------

@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_split_join_every_pattern(name):
    fmt = F.FP8_FORMATS[name]
    b = np.arange(256, dtype=np.uint8)
    sm, e = split_elements(b, fmt)
    assert sm.max() < (1 << fmt.sm_bits) and e.max() < (1 << fmt.exponent_bits)
    assert np.array_equal(join_elements(sm, e, fmt), b)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_pattern_under_every_pair_of_bases(name):
    """Exhaustive: all 256 patterns, 4 times in a tile, under every valid (narrow, wide) base pair.

    Two tiles per pair: one shuffled (mixed groups, mostly raw), one sorted by
    exponent (groups of equal exponents, so every mode occurs).
    """
    ms = F.MODE_SETS[name]
    pairs = [(a, b) for a in range(ms.narrow_base_max + 1) for b in range(ms.wide_base_max + 1)] * 2
    rng = np.random.default_rng(0)
    patterns = np.repeat(np.arange(256, dtype=np.uint8), 4)
    by_exponent = patterns[np.argsort(split_elements(patterns, ms.fmt)[1], kind="stable")]
    half = len(pairs) // 2
    tiles = np.stack([rng.permutation(patterns) for _ in range(half)] + [by_exponent] * half)
    tiles = tiles.reshape(len(pairs), 16, 64)
    bn = np.repeat(np.array([p[0] for p in pairs])[:, None], 64, axis=1)
    bw = np.repeat(np.array([p[1] for p in pairs])[:, None], 64, axis=1)
    cap = ms.geometry(64).max_escapes
    enc = encode_tiles(tiles, bn, bw, cap, ms)
    assert enc.fits.all()
    assert np.array_equal(decode_tiles(enc.slots, bn, bw, cap, 64, ms), tiles)
    assert set(np.unique(enc.modes)) == {F.MODE_NARROW, F.MODE_WIDE, F.MODE_RAW}


@st.composite
def fp8_tiles(draw):
    """(mode set, tiles [n,16,C], narrow bases, wide bases, capacity); exponents near drawn centres."""
    ms = F.MODE_SETS[draw(st.sampled_from(FORMAT_NAMES))]
    fmt = ms.fmt
    c = draw(st.sampled_from(F.TILE_WIDTHS))
    n = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    centre = rng.integers(0, fmt.exponent_values, size=(n, c))
    spread = draw(st.sampled_from((0.0, 0.5, 1.0, 2.0, 8.0)))
    e = np.clip(np.rint(np.tile(centre, 16) + rng.normal(0, spread, (n, 16 * c))), 0, fmt.max_exponent_field)
    sm = rng.integers(0, 1 << fmt.sm_bits, size=e.shape)
    tiles = join_elements(sm, e.astype(np.uint8), fmt).reshape(n, 16, c)
    flat = tiles.reshape(-1)
    for _ in range(draw(st.integers(0, 8))):               # any pattern anywhere, edges included
        flat[draw(st.integers(0, flat.size - 1))] = draw(st.one_of(
            st.sampled_from((0x00, 0x80, 0x01, 0x7F, 0xFF, 0x7E, 0x7C, 0xFC, 0x7B)), st.integers(0, 255)))
    bn = np.clip(centre - rng.integers(0, ms.narrow_window, size=centre.shape), 0, ms.narrow_base_max)
    bw = np.clip(centre - rng.integers(0, ms.wide_window, size=centre.shape), 0, ms.wide_base_max)
    if draw(st.booleans()):
        bn, bw = rng.integers(0, ms.narrow_base_max + 1, bn.shape), rng.integers(0, ms.wide_base_max + 1, bw.shape)
    cap = 16 * draw(st.integers(0, ms.geometry(c).max_escapes // 16 + 1))
    return ms, tiles, bn, bw, cap


@FAST
@given(fp8_tiles())
def test_roundtrip_and_narrowest_modes(case):
    ms, tiles, bn, bw, cap = case
    n, _, c = tiles.shape
    enc = encode_tiles(tiles, bn, bw, cap, ms)
    # Narrowest mode, from the definition (FORMAT-FP8.md 3.1), one group at a time.
    e = split_elements(tiles.reshape(n, -1), ms.fmt)[1].astype(int).reshape(n, -1, 8)
    ch = (np.arange(16 * c) % c).reshape(-1, 8)
    for t in range(n):
        for g in range(e.shape[1]):
            d_n, d_w = e[t, g] - bn[t, ch[g]], e[t, g] - bw[t, ch[g]]
            want = 0 if ((0 <= d_n) & (d_n < 4)).all() else 1 if ((0 <= d_w) & (d_w < 8)).all() else 2
            assert enc.modes[t, g] == want
    esc = (enc.modes == 1).sum(1) + (enc.modes == 2).sum(1) * (ms.fmt.exponent_bits - 2)
    assert np.array_equal(enc.escape_used, esc) and np.array_equal(enc.fits, esc <= cap)
    assert np.array_equal(enc.raw.reshape(tiles.shape), tiles)
    if enc.fits.any():
        got = decode_tiles(enc.slots[enc.fits], bn[enc.fits], bw[enc.fits], cap, c, ms)
        assert np.array_equal(got, tiles[enc.fits])
        t = int(np.flatnonzero(enc.fits)[0])
        assert spec_decode_slot(enc.slots[t].tobytes(), ms.fmt.name, c, cap, bn[t].tolist(), bw[t].tolist()) == \
            tiles[t].ravel().tolist()


@FAST
@given(st.sampled_from(FORMAT_NAMES), st.integers(0, 2**32 - 1), st.sampled_from(F.TILE_WIDTHS))
def test_forced_modes(name, seed, c):
    """Groups built to need a given mode get exactly that mode, and the right number of escape bytes."""
    ms = F.MODE_SETS[name]
    rng = np.random.default_rng(seed)
    bn = rng.integers(0, ms.narrow_base_max + 1, (1, c))
    bw = rng.integers(0, ms.wide_base_max + 1, (1, c))
    want = rng.integers(0, 3, size=(1, 2 * c))
    e = np.zeros((1, 16 * c), dtype=np.int64)
    values = np.arange(ms.fmt.exponent_values)
    for g in range(2 * c):
        chans = (np.arange(8) + 8 * g) % c
        for i, ch in enumerate(chans):
            in_n = (values >= bn[0, ch]) & (values < bn[0, ch] + 4)
            in_w = (values >= bw[0, ch]) & (values < bw[0, ch] + 8)
            pool = [in_n, in_w, np.ones_like(in_n)][want[0, g]]
            if i == 0 and want[0, g] == 1:
                pool = in_w & ~in_n
            if i == 0 and want[0, g] == 2:
                pool = ~in_w & ~in_n
            e[0, 8 * g + i] = rng.choice(values[pool])
    tiles = join_elements(rng.integers(0, 1 << ms.fmt.sm_bits, e.shape), e.astype(np.uint8), ms.fmt).reshape(1, 16, c)
    cap = ms.geometry(c).max_escapes
    enc = encode_tiles(tiles, bn, bw, cap, ms)
    assert np.array_equal(enc.modes, want)
    per_mode = {row["tag"]: row for row in spec_table("fp8-modes")}
    col = "escape bytes, E4M3" if name == "fp8_e4m3" else "escape bytes, E5M2"
    assert enc.escape_used[0] == sum(int(per_mode[str(m)][col]) for m in want[0])
    assert np.array_equal(decode_tiles(enc.slots, bn, bw, cap, c, ms), tiles)


def test_decoder_rejections():
    ms = F.MODE_SETS["fp8_e5m2"]
    geo = ms.geometry(64)
    tiles = np.zeros((1, 16, 64), dtype=np.uint8)
    bn, bw = np.zeros((1, 64), int), np.zeros((1, 64), int)
    slot = encode_tiles(tiles, bn, bw, 16, ms).slots
    assert np.array_equal(decode_tiles(slot, bn, bw, 16, 64, ms), tiles)
    with pytest.raises(FormatError, match="takes"):
        decode_tiles(slot[:, :-1], bn, bw, 16, 64, ms)
    with pytest.raises(FormatError, match="not a tile width"):
        decode_tiles(slot, bn, bw, 16, 256, ms)
    bad = slot.copy()
    bad[0, geo.tag_offset] = 0b11
    with pytest.raises(FormatError, match="is reserved"):
        decode_tiles(bad, bn, bw, 16, 64, ms)
    bad[0, geo.tag_offset] = 0b1010_1010             # four raw groups: 12 escape bytes fit, then 6 do not
    assert decode_tiles(bad, bn, bw, 16, 64, ms).shape == tiles.shape
    bad[0, geo.tag_offset + 1] = 0b1010
    with pytest.raises(FormatError, match="escape bytes but the slot holds"):
        decode_tiles(bad, bn, bw, 16, 64, ms)
    bad = slot.copy()
    bad[0, -1] = 1
    with pytest.raises(FormatError, match="is not zero after"):
        decode_tiles(bad, bn, bw, 16, 64, ms)
    with pytest.raises(CalibrationError, match="narrow bases"):
        decode_tiles(slot, bn + ms.narrow_base_max + 1, bw, 16, 64, ms)
    with pytest.raises(CalibrationError, match="wide bases"):
        encode_tiles(tiles, bn, bw - 1, 16, ms)
    with pytest.raises(ValueError, match="wide_bits"):
        F.ModeSet(F.E4M3, 2, 5)
    with pytest.raises(ValueError, match="unknown FP8 format"):
        F.fp8_format("fp8_e3m4")


# -- calibration, container, stats --------------------------------------------------

def _small_real():
    """Layers 0-1, tokens 0-63 of the real 'list' cache: 4 blocks, enough for every mode and a capacity."""
    return kv_dump("list", "k")[:2, :, :64], kv_dump("list", "v")[:2, :, :64]


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_calibration_windows_are_best_and_file_roundtrips(name, tmp_path):
    k, v = _small_real()
    cal = calibrate_fp8(k, v, name, model="smollm2 list, 2 layers")
    ms = cal.modes
    hist = exponent_histograms(cache_to_fp8(k, ms.fmt, cal.scale_log2[0].astype(int)), ms.fmt)
    for width, bases in ((ms.narrow_window, cal.b_narrow[0]), (ms.wide_window, cal.b_wide[0])):
        cover = np.stack([hist[..., b:b + width].sum(-1) for b in range(ms.fmt.exponent_values - width + 1)], -1)
        chosen = np.take_along_axis(cover, bases.astype(int)[..., None], -1)[..., 0]
        assert np.array_equal(chosen, cover.max(-1))
    amax = np.abs(bf16_to_float(k)).max(axis=(1, 2, 3))
    assert np.all(amax <= np.ldexp(ms.fmt.max_finite, cal.scale_log2[0, :, 0].astype(int)))
    assert np.all(amax > np.ldexp(ms.fmt.max_finite, cal.scale_log2[0, :, 0].astype(int) - 1))
    cal.save(tmp_path / "cal.json")
    again = Calibration.load(tmp_path / "cal.json")
    assert again.id == cal.id and again.format.name == name
    d = json.loads((tmp_path / "cal.json").read_text())
    d["k"]["scale_log2"][0][0] += 1
    with pytest.raises(CalibrationError, match="does not match"):
        Calibration.from_dict(d)
    for key, value, msg in (("version", 1, "version"), ("format", "gaac-calibration", "not a GAAC-FP8"),
                            ("element_format", "fp8_e3m4", "unknown FP8 format")):
        with pytest.raises(CalibrationError, match=msg):
            Calibration.from_dict({**json.loads((tmp_path / "cal.json").read_text()), key: value}, FP8_FILE)


def test_calibration_validity_rules():
    z = np.zeros((2, 1, 1, 64), dtype=np.int64)
    ok = dict(format="fp8_e4m3", scale_log2=np.zeros((2, 1, 1)), b_narrow=z, b_wide=z, capacity=[[0], [16]])
    Calibration(**ok)
    for change, msg in (({"b_narrow": z + 13}, "2-bit bases"), ({"b_wide": z + 9}, "3-bit bases"),
                        ({"capacity": [[8], [0]]}, "multiples of 16"), ({"scale_log2": np.full((2, 1, 1), 128)},
                                                                          "scale exponents"),
                        ({"scale_log2": np.zeros((2, 1))}, "scale_log2 must be"),
                        ({"b_narrow": np.zeros((2, 1, 1, 96))}, "b_wide shape"),
                        ({"format": "bf16"}, "has no scale_log2"), ({"format": "fp8_e3m4"}, "unknown element format")):
        with pytest.raises(CalibrationError, match=msg):
            Calibration(**{**ok, **change})
    Calibration(**{**ok, "format": "e5m2", "b_narrow": z + 28, "b_wide": z + 24})


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_block_container_roundtrip_and_errors(name):
    k, v = _small_real()
    cal = calibrate_fp8(k, v, name)
    bits = k[1, :, 32:48]
    enc = encode_bf16_block(bits, cal, 1, "k")
    want = to_fp8(bits, cal.modes.fmt, cal.scale_log2[0, 1].astype(int)[:, None, None])
    assert np.array_equal(decode_fp8_block(enc.data, cal), want)
    assert encode_fp8_block(want, cal, 1, "k").data == enc.data
    assert enc.data[4:6] == bytes([F.FP8_FORMAT_VERSION, cal.element])
    with pytest.raises(InputError, match="uint8"):
        encode_fp8_block(bits, cal, 1, "k")
    with pytest.raises(InputError, match="layer must be an integer"):
        encode_fp8_block(want, cal, 1.0, "k")
    with pytest.raises(InputError, match="kind"):
        encode_fp8_block(want, cal, 1, "q")
    with pytest.raises(CalibrationError, match="out of range"):
        encode_fp8_block(want, cal, 2, "k")
    bf16_cal = Calibration(b3=np.zeros((2, 2, 3, 64)), b4=np.zeros((2, 2, 3, 64)), capacity=np.zeros((2, 2)))
    with pytest.raises(CalibrationError, match="expected an FP8 calibration"):
        decode_fp8_block(enc.data, bf16_cal)
    with pytest.raises(InputError, match="expected bytes"):
        decode_fp8_block("GAAC", cal)
    other = calibrate_fp8(k, v, name, capacity=0)
    with pytest.raises(CalibrationError, match="stream was encoded with calibration"):
        decode_fp8_block(enc.data, other)


def test_vectors_decode_and_reencode():
    """Every valid vector decodes to its expected bytes (reference and spec decoder) and re-encodes identically;
    every must-reject vector raises the stated error."""
    metas = [json.loads(p.read_text()) for p in sorted(VECTORS.glob("*.json")) if not p.name.startswith("cal_")]
    assert len(metas) >= 2 * 15
    seen = {f: set() for f in FORMAT_NAMES}
    for meta in metas:
        cal = Calibration.load(VECTORS / meta["calibration"])
        data = (VECTORS / f"{meta['name']}.bin").read_bytes()
        if not meta["valid"]:
            err = {"FormatError": FormatError, "CalibrationError": CalibrationError}[meta["error"]]
            with pytest.raises(err, match=re.escape(meta["message"])):
                decode_fp8_block(data, cal)
            seen[meta["element_format"]].add(meta["rule"])
            continue
        assert meta["calibration_id"] == f"{cal.id:08x}" and len(data) == meta["bytes"]
        want = np.array([[bytes.fromhex(row) for row in head] for head in meta["expected"]], dtype=object)
        want = np.frombuffer(b"".join(b for head in want for b in head), dtype=np.uint8).reshape(
            meta["kv_heads"], 16, meta["head_dim"])
        got = decode_fp8_block(data, cal)
        assert np.array_equal(got, want), meta["name"]
        enc = encode_fp8_block(want, cal, meta["layer"], meta["kind"])
        assert enc.data == data and list(enc.raw_tiles) == meta["raw_tiles"], meta["name"]
        kind = L.KIND_K if meta["kind"] == "k" else L.KIND_V
        bn, bw = cal.bases(meta["layer"], kind)
        geo, cap = cal.geometry, meta["escape_capacity"]
        c, per = geo.channels, meta["head_dim"] // geo.channels
        pos = L.STREAM_HEADER_BYTES + 4 * len(meta["tiles"])
        for tile in meta["tiles"]:
            if tile["storage"] == "slot":
                h, j = tile["tile"] // per, tile["tile"] % per
                slot = data[pos:pos + geo.slot_bytes(cap)]
                pos += geo.slot_bytes(cap)
                decoded = spec_decode_slot(slot, cal.format.name, c, cap, bn[h, j * c:(j + 1) * c].tolist(),
                                           bw[h, j * c:(j + 1) * c].tolist())
                assert decoded == want[h, :, j * c:(j + 1) * c].ravel().tolist(), (meta["name"], tile["tile"])
        seen[meta["element_format"]].add("valid:" + meta["name"].split("_", 1)[1])
    for f in FORMAT_NAMES:
        assert {"valid:all_patterns", "valid:specials", "valid:modes", "valid:overflow", "R3", "R4", "R18", "R19",
                "R20", "R21"} <= seen[f]
    # The all-patterns vectors hold every FP8 pattern; the specials every NaN/Inf/zero/subnormal.
    for f in ("e4m3", "e5m2"):
        allp = json.loads((VECTORS / f"{f}_all_patterns.json").read_text())
        assert set(bytes.fromhex("".join(allp["expected"][0]))) == set(range(256))


def test_spec_tables_match_layout_and_codec():
    const = {r["name"]: int(r["value"]) for r in spec_table("fp8-constants")}
    for ms in F.FP8_MODE_SETS.values():
        assert (const["LOW_BITS"], const["WIDE_BITS"]) == (ms.low_bits, ms.wide_bits)
        assert (const["NARROW_WINDOW"], const["WIDE_WINDOW"]) == (ms.narrow_window, ms.wide_window)
    assert (const["FP8_FORMAT_VERSION"], const["ELEMENT_FP8_E4M3"], const["ELEMENT_FP8_E5M2"]) == \
        (F.FP8_FORMAT_VERSION, F.E4M3.element, F.E5M2.element)
    rows = spec_table("fp8-slot")
    assert len(rows) == 4
    for r in rows:
        geo = F.MODE_SETS["fp8_" + r["format"].lower()].geometry(int(r["C"]))
        assert [int(x) for x in re.findall(r"\d+", r["sign+mantissa: offset, bytes"])] == [0, geo.sm_bytes]
        assert [int(x) for x in re.findall(r"\d+", r["code stream: offset, bytes"])] == \
            [geo.code_offset, geo.code_bytes]
        assert [int(x) for x in re.findall(r"\d+", r["tag stream: offset, bytes"])] == [geo.tag_offset, geo.tag_bytes]
        assert (int(r["escape area offset (fixed size)"]), int(r["raw tile"]), int(r["largest useful capacity"])) \
            == (geo.fixed_bytes, geo.raw_bytes, geo.max_useful_capacity)
        assert all(o % 16 == 0 for o in (geo.code_offset, geo.tag_offset, geo.escape_offset))
    # The worked example (3.3): build the tile it describes and compare the bytes it lists.
    ms = F.MODE_SETS["fp8_e4m3"]
    groups = spec_table("fp8-example-groups")
    e = np.full(1024, 9)
    x = np.zeros(1024, dtype=np.uint8)
    for g, row in enumerate(groups):
        e[8 * g:8 * g + 8] = [int(v) for v in row["exponent fields e_0 .. e_7"].split()]
    sm = np.where(np.arange(1024) < 24, np.arange(1024) % 16, 0)
    x = join_elements(sm, e.astype(np.uint8), ms.fmt)
    for g, row in enumerate(groups):
        assert x[8 * g:8 * g + 8].tolist() == [int(v, 16) for v in row["FP8 bytes"].split()]
    enc = encode_tiles(x.reshape(1, 16, 64), np.full((1, 64), 9), np.full((1, 64), 8), 16, ms)
    assert [F.MODE_SETS["fp8_e4m3"].mode_names[m] for m in enc.modes[0, :3]] == \
        [r["mode"].replace("-", "") for r in groups]
    block = SPEC.split("<!-- gaac:example fp8-slot-bytes -->", 1)[1].split("```")[1]
    listed = {line.split(":")[0].strip(): [int(v, 16) for v in line.split(":")[1].split("(")[0].split()]
              for line in block.strip().splitlines()}
    geo = ms.geometry(64)
    s = enc.slots[0]
    assert listed["sign+mantissa bytes 0..11"] == s[:12].tolist()
    assert listed["code stream bytes 0..5"] == s[geo.code_offset:geo.code_offset + 6].tolist()
    assert listed["tag stream byte 0"] == [s[geo.tag_offset]]
    assert listed["escape area bytes 0..2"] == s[geo.escape_offset:geo.escape_offset + 3].tolist()


def spec_table(name: str) -> list[dict]:
    """Rows of the table after ``<!-- gaac:table name -->`` in FORMAT-FP8.md, read as test_spec reads FORMAT.md's."""
    return table(name, SPEC)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_stats_on_real_cache(name):
    k, v = _small_real()
    out = fp8_stats(k, v, name, per_layer=True)
    assert out["format"] == name and set(out) >= {"k", "v", "per_layer", "calibration_id"}
    ms = F.MODE_SETS[name]
    geo = ms.geometry(64)
    for kind in "kv":
        s = out[kind]
        assert s["roundtrip"] is True
        names = [f"frac_{n}" for n in ms.mode_names.values()]
        assert abs(sum(s[n] for n in names) - 1) < 1e-12
        # The stream ratio from the mode mix alone (FORMAT-FP8.md 5.1 sizes and 3.1 escape bytes).
        groups = s["tiles"] * geo.groups
        esc = groups * (s[names[1]] * 1 + s[names[2]] * (ms.fmt.exponent_bits - 2))
        assert s["ratio_stream"] == pytest.approx(s["tiles"] * geo.raw_bytes / (s["tiles"] * geo.fixed_bytes + esc))
        assert s["ratio_total_vs_bf16"] == pytest.approx(2 * s["ratio_over_fp8"])
        assert s["ratio_over_fp8"] == s["ratio_stream"] > s["ratio_resident"] > 1.0
        assert s["bits_per_element_stream"] == pytest.approx(8 / s["ratio_stream"])
        assert s["conversion"]["saturated"] == 0
        assert sum(s["resident_bits_per_element"].values()) == pytest.approx(s["bits_per_element_resident"])
    table = format_fp8_table(out, per_layer=True)
    assert f"{out['k']['ratio_over_fp8']:.4f}" in table and "groups 2bit" in table and "groups raw" in table
    # title, column header, 16 rows, footnote, blank, per-layer header, 2 layers
    assert len(table.splitlines()) == 2 + 16 + 1 + 1 + 1 + 2
    with pytest.raises(InputError, match="unknown FP8 format"):
        fp8_stats(k, v, "fp8_e3m4")
    other = "fp8_e5m2" if name == "fp8_e4m3" else "fp8_e4m3"
    with pytest.raises(InputError, match="calibration is for"):
        fp8_stats(k, v, other, calibration=calibrate_fp8(k, v, name))


def test_stats_counts_known_by_construction():
    """A cache made of one repeated tile whose modes are known gives exactly those fractions and a saturation."""
    ms = F.MODE_SETS["fp8_e4m3"]
    one = np.float32(1.0).view(np.uint32) >> 16           # BF16 1.0: exponent field 7 in E4M3, scale 0
    x = np.full((1, 1, 32, 64), one, dtype=np.uint16)
    x[0, 0, :, 0] = 0x4380                                # 256.0: exponent 15, outside a 4-window at 7
    x[0, 0, 0, 1] = 0x7F00                                # huge: saturates
    cal = Calibration(format="fp8_e4m3", scale_log2=np.zeros((2, 1, 1)), b_narrow=np.full((2, 1, 1, 64), 7),
                         b_wide=np.full((2, 1, 1, 64), 8), capacity=[[0], [0]])
    out = fp8_stats(x, x, "fp8_e4m3", calibration=cal)["k"]
    # Per token: group 0 (channels 0..7) holds 256 (exponent 15) and 1.0 (exponent 7): wider than 8 -> raw.
    assert out["frac_raw"] == pytest.approx(1 / 8) and out["frac_2bit"] == pytest.approx(7 / 8)
    assert out["frac_raw_tiles"] == 1.0 and out["raw_tiles"] == 2      # capacity 0: every tile overflows
    assert out["conversion"]["saturated"] == 1 and out["roundtrip"] is True
    assert ms.geometry(64).raw_bytes * 2 + 8 == pytest.approx(
        out["bits_per_element_resident"] * 2 * 1024 / 8)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_attention_over_gaac_fp8_cache(name):
    """Attention over the compressed cache (blocks + FP8 tail) == float64 attention over the dequantised cache."""
    from gaac.fp8.attention import build_layer_cache, decode_attention_fp8

    k, v = _small_real()
    cal = calibrate_fp8(k, v, name)
    layer, tokens = 1, 59                                    # 3 complete blocks and an 11-token tail
    kb, vb = k[layer, :, :tokens], v[layer, :, :tokens]
    cache = build_layer_cache(kb, vb, cal, layer)
    assert (len(cache.k_blocks), cache.k_tail.shape[1], cache.tokens) == (3, 11, tokens)
    assert sum(map(len, cache.k_blocks)) < 3 * 3 * 16 * 64        # the blocks really are compressed

    q = np.random.default_rng(7).normal(size=(9, 64))              # 9 query heads over 3 KV heads
    out, lse = decode_attention_fp8(q, cache)

    def attention(ks, vs):       # plain float64 softmax attention, one query head at a time
        o, s = np.empty((9, 64)), np.empty(9)
        for h in range(9):
            z = ks[h // 3] @ q[h] / 8.0
            w = np.exp(z - z.max())
            o[h], s[h] = w @ vs[h // 3] / w.sum(), z.max() + np.log(w.sum())
        return o, s

    fmt = cal.modes.fmt
    deq = [fp8_to_float(to_fp8(x, fmt, cal.scale_log2[i, layer].astype(int)[:, None, None]), fmt,
                        cal.scale_log2[i, layer].astype(int)[:, None, None]) for i, x in enumerate((kb, vb))]
    want, want_lse = attention(*deq)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    # Against the BF16 cache the only difference is the FP8 conversion: small, and not zero.
    exact, _ = attention(bf16_to_float(kb), bf16_to_float(vb))
    err = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert 0 < err < (0.05 if name == "fp8_e4m3" else 0.1)
    with pytest.raises(InputError, match="q must be"):
        decode_attention_fp8(q[:8], cache)
