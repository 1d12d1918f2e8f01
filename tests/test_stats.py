"""gaac.stats against counts known by construction, and on the real shipped sample."""
import numpy as np
import pytest

import gaac.tally
from gaac import layout as L
from gaac.calibration import Calibration, calibrate
from gaac.errors import CalibrationError, InputError
from gaac.io import load_sample
from gaac.epochs import EPOCH_INDEX_BYTES
from gaac.stats import measure

HEAD_DIM = 64
B3, B4 = 100, 96            # every channel's windows: 3-bit 100..107, 4-bit 96..111
CAPACITY = 32
ALL_3BIT_RATIO = 16 / (8 + L.CODE_BITS + L.TAG_BITS / L.GROUP_SIZE)      # 16 / 11.25


def constructed_cache(seed: int, layers: int = 2, heads: int = 2, blocks: int = 3, tail: int = 5):
    """A cache ``[layers, heads, 16*blocks + tail, 64]`` whose every group's mode is drawn first.

    Returns the cache and the drawn modes ``[layers, heads, tokens_in_blocks, groups_per_row]``.
    One tile (layer 0, block 1, head 0) is made all-raw so that it overflows any capacity here.
    """
    rng = np.random.default_rng(seed)
    tokens = L.BLOCK_TOKENS * blocks
    gpr = HEAD_DIM // L.GROUP_SIZE
    modes = rng.choice([L.MODE_3BIT, L.MODE_4BIT, L.MODE_RAW], p=[0.85, 0.14, 0.01],
                       size=(layers, heads, tokens, gpr))
    modes[0, 0, L.BLOCK_TOKENS:2 * L.BLOCK_TOKENS] = L.MODE_RAW
    e = rng.integers(B3, B3 + L.WINDOW_3BIT, size=(layers, heads, tokens, gpr, L.GROUP_SIZE))
    lane = rng.integers(0, L.GROUP_SIZE, size=modes.shape)
    # a 4-bit group: one exponent in the 16-window but below the 8-window; a raw group: one far outside both.
    outlier = np.where(modes == L.MODE_4BIT, rng.integers(B4, B3, size=modes.shape), rng.integers(200, 256,
                                                                                             size=modes.shape))
    np.put_along_axis(e, lane[..., None], np.where(modes == L.MODE_3BIT, np.take_along_axis(
        e, lane[..., None], -1)[..., 0], outlier)[..., None], axis=-1)
    e = e.reshape(layers, heads, tokens, HEAD_DIM)
    tail_e = np.full((layers, heads, tail, HEAD_DIM), 255)        # the tail is all raw: it must not count
    e = np.concatenate([e, tail_e], axis=2).astype(np.uint16)
    sign_mantissa = rng.integers(0, 1 << 16, size=e.shape, dtype=np.uint16) & 0x807F
    return (e << 7) | sign_mantissa, modes


def flat_calibration(layers: int, heads: int, capacity: int = CAPACITY) -> Calibration:
    shape = (2, layers, heads, HEAD_DIM)
    return Calibration(b3=np.full(shape, B3), b4=np.full(shape, B4), capacity=np.full((2, layers), capacity))


@pytest.mark.parametrize("adapt", [False, True])
def test_counts_match_the_construction(adapt):
    """With adaptation on, 3 blocks are too few for a check: the same tiles, plus each block's epoch index."""
    k, k_modes = constructed_cache(1)
    v, v_modes = constructed_cache(2)
    layers, heads = k.shape[:2]
    stats = measure(k, v, flat_calibration(layers, heads), adapt=adapt).as_dict(per_layer=True)
    geo = L.geometry(HEAD_DIM)
    for name, x, modes in (("k", k, k_modes), ("v", v, v_modes)):
        s = stats[name]
        groups = modes.size
        assert s["frac_3bit"] == pytest.approx((modes == L.MODE_3BIT).sum() / groups, abs=0)
        assert s["frac_4bit"] == pytest.approx((modes == L.MODE_4BIT).sum() / groups, abs=0)
        assert s["frac_raw"] == pytest.approx((modes == L.MODE_RAW).sum() / groups, abs=0)
        # escape bytes per tile: 1 per 4-bit group, 5 per raw group, over 16 tokens of one head
        tiles = modes.reshape(layers, heads, -1, L.BLOCK_TOKENS * modes.shape[-1])
        escapes = ((tiles == L.MODE_4BIT) * 1 + (tiles == L.MODE_RAW) * 5).sum(axis=-1)
        n = escapes.size
        over = escapes > CAPACITY
        assert over[0, 0, 1] and 0 < over.sum() < n            # both kinds of tile, the all-raw one raw
        assert s["tiles"] == n and s["raw_tiles"] == over.sum()
        assert s["frac_raw_tiles"] == over.sum() / n
        bf16 = n * geo.elements * 2
        assert s["ratio_stream"] == pytest.approx(bf16 / (n * geo.fixed_bytes + escapes.sum()), rel=1e-12)
        resident = (~over).sum() * (geo.fixed_bytes + CAPACITY) + over.sum() * geo.elements * 2 \
            + n * L.TABLE_ENTRY_BYTES + adapt * layers * 3 * EPOCH_INDEX_BYTES
        assert s["ratio_resident"] == pytest.approx(bf16 / resident, rel=1e-12)
        assert (s["adapt"], s["epochs_appended"]) == (adapt, 0)
        assert sum(s["resident_bits_per_element"].values()) == pytest.approx(s["bits_per_element_resident"])
        assert s["bits_per_element_resident"] == pytest.approx(16 / s["ratio_resident"])
        # entropy of the exponents of the complete blocks only
        _, counts = np.unique((x[:, :, :-5] >> 7) & 0xFF, return_counts=True)
        p = counts / counts.sum()
        assert s["exponent_entropy"] == pytest.approx(-(p * np.log2(p)).sum())
        assert s["roundtrip"] is True
        assert (s["tokens"], s["blocks"], s["tail_tokens"], s["ratios_include_tail"]) == (53, 3, 5, False)
        assert s["capacity"] == [CAPACITY] * layers
        per = stats["per_layer"][name]
        assert [p["layer"] for p in per] == list(range(layers))
        assert [p["raw_tiles"] for p in per] == over.reshape(layers, -1).sum(axis=1).tolist()


def test_all_3bit_cache_reaches_the_bound():
    rng = np.random.default_rng(3)
    x = ((rng.integers(B3, B3 + 8, size=(1, 1, 32, HEAD_DIM)) << 7) | 0x8001).astype(np.uint16)
    s = measure(x, x, flat_calibration(1, 1)).as_dict()["k"]
    assert s["frac_3bit"] == 1.0 and s["ratio_stream"] == pytest.approx(ALL_3BIT_RATIO)
    assert s["bits_per_element_stream"] == pytest.approx(8 + L.CODE_BITS + L.TAG_BITS / L.GROUP_SIZE)


def test_a_layer_with_no_slot_tile():
    """Capacity 0 and a raw group in every tile: every tile stays raw BF16 and still round-trips."""
    x, _ = constructed_cache(6, layers=1, heads=1, blocks=2, tail=0)
    x[..., 0] |= 0xFF << 7                                   # channel 0 of every token: exponent 255, raw
    s = measure(x, x, flat_calibration(1, 1, capacity=0), adapt=False).as_dict()["k"]
    assert s["raw_tiles"] == s["tiles"] == 2 and s["roundtrip"] is True
    raw = L.geometry(HEAD_DIM).raw_bytes
    assert s["ratio_resident"] == pytest.approx(raw / (raw + L.TABLE_ENTRY_BYTES))


def test_a_wrong_decode_is_reported(monkeypatch):
    x, _ = constructed_cache(4, layers=1, heads=1, blocks=1, tail=0)
    real = gaac.tally.decode_tiles

    def flip_one_bit(*args, **kw):
        out = real(*args, **kw)
        out[0, 0, 0] ^= 1
        return out

    monkeypatch.setattr(gaac.tally, "decode_tiles", flip_one_bit)
    d = measure(x, x, flat_calibration(1, 1, capacity=L.geometry(HEAD_DIM).max_useful_capacity)).as_dict()
    assert d["k"]["roundtrip"] is False and d["v"]["roundtrip"] is False


def test_bad_inputs_are_named():
    x, _ = constructed_cache(5, layers=1, heads=1, blocks=1, tail=0)
    with pytest.raises(InputError, match="no complete block"):
        measure(x[:, :, :10], x[:, :, :10], flat_calibration(1, 1))
    with pytest.raises(CalibrationError, match="calibration is for 2 layers"):
        measure(x, x, flat_calibration(2, 1))
    with pytest.raises(InputError, match="float32"):
        measure(x.astype(np.float32), x, flat_calibration(1, 1))


def test_shipped_sample_cross_task():
    """Calibration transfers across tasks on real data: calibrated on prose, measured on code, it round-trips
    with a ratio near the all-3-bit bound and few raw groups."""
    ck, cv, _ = load_sample("prose")
    k, v, meta = load_sample("code")
    assert meta["layers"] == [0, 10, 20, 29] and k.shape == (4, 3, 256, 64)
    d = measure(k, v, calibrate(ck, cv)).as_dict()
    for s in d.values():
        assert s["roundtrip"] is True
        assert 1.38 < s["ratio_stream"] < ALL_3BIT_RATIO
        assert 1.25 < s["ratio_resident"] < s["ratio_stream"]
        assert s["frac_3bit"] > 0.8 and s["frac_raw"] < 0.02
        assert 2.5 < s["exponent_entropy"] < 3.5
