"""Calibration: its choices against brute force, its file, its validation, and that it never costs losslessness.

A calibration from other data stays lossless (random caches
and the real SmolLM2 dumps), ``best_windows`` and ``best_capacity`` equal a
brute-force search, a saved calibration loads with the same id, and a
hand-edited or out-of-range one raises :class:`gaac.CalibrationError`.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import kv_dump
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from strategies import bf16_bits, calibrations, exponent_centres, head_dims, max_tile_escapes, tile_escapes

import gaac
from gaac import CalibrationError, InputError
from gaac import layout as L
from gaac.calibration import Calibration, best_capacity, best_windows
from gaac.tiles import cache_blocks


def raises(exc_type, fn, *args, match: str, **kwargs):
    """Require exactly ``exc_type`` (not a subclass, not another error) with ``match`` in its message."""
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    assert match in str(info.value), str(info.value)


def brute_windows(counts, width: int) -> np.ndarray:
    """Per row of ``counts [..., 256]``: the first start whose ``width``-wide window holds the most counts."""
    sums = np.lib.stride_tricks.sliding_window_view(np.asarray(counts), width, axis=-1).sum(axis=-1)
    return np.argmax(sums, axis=-1)                # the first of equal maxima


def fixed_bytes(head_dim: int) -> int:
    """Sign+mantissa bytes, 3-bit codes and 2-bit tags of one tile (FORMAT.md section 6)."""
    n = L.BLOCK_TOKENS * L.tile_channels(head_dim)
    return n + n * L.CODE_BITS // 8 + (n // L.GROUP_SIZE) * L.TAG_BITS // 8


def brute_capacity(escapes, head_dim: int, line: int | None = None, slack: float | None = None) -> int:
    """The smallest capacity, of all the header can hold, with the fewest resident bytes; with ``line``, of those whose
    slots are whole ``line``-byte lines, and with ``slack`` too, that one only where its bytes are at most ``slack``
    more than the fewest (else the first)."""
    raw = 2 * L.BLOCK_TOKENS * L.tile_channels(head_dim)
    caps = np.arange(0, L.MAX_ESCAPE_CAPACITY + 1, L.SLOT_ALIGN)
    esc = np.asarray(escapes, dtype=np.int64)
    costs = np.where(esc[None, :] <= caps[:, None], fixed_bytes(head_dim) + caps[:, None], raw).sum(axis=1)
    best = int(caps[np.flatnonzero(costs == costs.min())[0]])
    if not line:
        return best
    lined = (fixed_bytes(head_dim) + caps) % line == 0
    least = costs[lined].min()
    on_line = int(caps[lined][np.flatnonzero(costs[lined] == least)[0]])
    return on_line if slack is None or least <= costs.min() * (1 + slack) else best


def encode_cache(x, cal: Calibration, kind: str, layers=None, max_blocks=None):
    """Encode and decode every block of the ``layers`` of cache ``x``; return the encoded blocks."""
    out = []
    for layer in range(x.shape[0]) if layers is None else layers:
        for block in cache_blocks(x[layer])[:max_blocks]:
            enc = gaac.encode_block(block, cal, layer, kind)
            assert np.array_equal(gaac.decode_block(enc, cal), block), (kind, layer)
            out.append(enc)
    return out


# -- the search functions against brute force -----------------------------------------------------------

histograms = hnp.arrays(np.int64, st.tuples(st.integers(1, 4), st.just(256)),
                        elements=st.integers(0, 3), fill=st.sampled_from([0, 1]))


@settings(max_examples=120, deadline=None)
@given(histograms, st.sampled_from((L.WINDOW_3BIT, L.WINDOW_4BIT)))
def test_best_windows_is_brute_force(hist, width):
    assert best_windows(hist, width).tolist() == brute_windows(hist, width).tolist()


def test_best_windows_tie_goes_to_smallest_base():
    hist = np.zeros((2, 256), dtype=np.int64)
    hist[0, [10, 200]] = 5           # two equal peaks, far apart
    hist[1, 250:] = 1                # the window must stop at 255
    assert best_windows(hist, L.WINDOW_3BIT).tolist() == [3, L.B3_MAX]
    assert best_windows(hist, L.WINDOW_4BIT).tolist() == [0, L.B4_MAX]


@st.composite
def tile_escape_counts(draw):
    dim = draw(head_dims)
    top = max_tile_escapes(dim)
    values = st.one_of(st.integers(0, top), st.sampled_from((0, 1, 15, 16, 17, top)))
    return draw(st.lists(values, max_size=40)), dim


@settings(max_examples=120, deadline=None)
@given(tile_escape_counts())
def test_best_capacity_is_brute_force(case):
    escapes, dim = case
    assert best_capacity(np.array(escapes, dtype=np.int64), dim) == brute_capacity(escapes, dim)


@settings(max_examples=60, deadline=None)
@given(tile_escape_counts())
def test_best_capacity_on_lines_is_brute_force(case):
    escapes, dim = case
    got = best_capacity(np.array(escapes, dtype=np.int64), dim, slot_line=128)
    assert (fixed_bytes(dim) + got) % 128 == 0
    assert got == brute_capacity(escapes, dim, line=128)


@st.composite
def small_caches(draw, tokens_min: int = L.BLOCK_TOKENS):
    """``(k, v)`` of 1..2 layers, 1..2 heads, any head_dim, ``tokens_min``..48 tokens, near drawn centres."""
    layers, heads, dim = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(head_dims)
    tokens = draw(st.integers(tokens_min, 3 * L.BLOCK_TOKENS))
    centres = draw(exponent_centres(heads, dim))
    k = draw(bf16_bits((layers, heads, tokens, dim), centres[None]))
    v = draw(bf16_bits((layers, heads, draw(st.integers(tokens_min, 3 * L.BLOCK_TOKENS)), dim), centres[None]))
    return k, v


@settings(max_examples=25, deadline=None)
@given(small_caches())
def test_calibrate_chooses_brute_force_windows_and_capacity(kv):
    """The windows covering the most values; the capacity with the fewest resident bytes, or by default the best
    one whose slots fill whole 128-byte lines where it costs at most 1% more."""
    cal = gaac.calibrate(*kv, show_progress=False)
    fewest = gaac.calibrate(*kv, slot_line=None, show_progress=False)
    for kind, x in enumerate(kv):
        layers, dim = x.shape[0], x.shape[3]
        counts = np.zeros((x.shape[0], x.shape[1], dim, 256), dtype=np.int64)
        layer_, head, _, channel = np.indices(x.shape).reshape(4, -1)
        np.add.at(counts, (layer_, head, channel, (x.ravel() >> 7) & 0xFF), 1)
        assert np.array_equal(cal.b3[kind], brute_windows(counts, L.WINDOW_3BIT))
        assert np.array_equal(cal.b4[kind], brute_windows(counts, L.WINDOW_4BIT))
        for layer in range(layers):
            # Escapes as the block encoder counts them, then the brute-force capacity.
            escapes = [int(t) for enc in encode_cache(x, cal, "kv"[kind], [layer]) for t in tile_escapes(enc.modes)]
            assert cal.capacity[kind, layer] == brute_capacity(escapes, dim, line=128, slack=0.01)
            assert fewest.capacity[kind, layer] == brute_capacity(escapes, dim)


# -- a calibration from other data stays lossless ----------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(small_caches(), st.data())
def test_calibration_from_other_random_data_is_lossless(train, data):
    k, v = train
    cal = gaac.calibrate(k, v, show_progress=False)
    shape = (k.shape[0], k.shape[1], data.draw(st.integers(0, 3 * L.BLOCK_TOKENS)), k.shape[3])
    other = data.draw(st.one_of(bf16_bits(shape), bf16_bits(shape, data.draw(exponent_centres(*shape[1::2]))[None])))
    for kind in "kv":
        assert len(encode_cache(other, cal, kind)) == shape[0] * (shape[2] // L.BLOCK_TOKENS)


@pytest.mark.parametrize("train,test", [("list", "math"), ("prose", "code"), ("code", "list")])
def test_calibration_from_other_real_dump_is_lossless(train, test):
    cal = gaac.calibrate(kv_dump(train, "k"), kv_dump(train, "v"), model="smollm2-135m", show_progress=False)
    for which in "kv":
        x = kv_dump(test, which)
        blocks = encode_cache(x, cal, which, layers=range(0, x.shape[0], 5), max_blocks=4)
        assert blocks and sum(b.payload_bytes for b in blocks) < sum(b.bf16_bytes for b in blocks)


def test_torch_bf16_and_uint16_calibrate_alike():
    k, v = kv_dump("list", "k")[:2], kv_dump("list", "v")[:2]
    as_torch = [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for a in (k, v)]
    assert gaac.calibrate(*as_torch, show_progress=False).id == gaac.calibrate(k, v, show_progress=False).id


# -- the file ---------------------------------------------------------------------------------------------

@st.composite
def any_calibration(draw):
    return draw(calibrations(draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(head_dims)))


@settings(max_examples=30, deadline=None)
@given(any_calibration())
def test_save_load_preserves_id(cal):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cal.json"
        cal.save(path)
        back = Calibration.load(path)
        assert json.loads(path.read_text())["id"] == f"{cal.id:08x}"
    assert back.id == cal.id
    assert (np.array_equal(back.b3, cal.b3), np.array_equal(back.b4, cal.b4),
            np.array_equal(back.capacity, cal.capacity), back.model) == (True, True, True, cal.model)


@settings(max_examples=30, deadline=None)
@given(any_calibration(), st.data())
def test_hand_edited_file_fails_id_check(cal, data):
    d = json.loads(json.dumps(cal.to_dict()))
    kind = data.draw(st.sampled_from("kv"))
    what = data.draw(st.sampled_from(("b3", "b4", "capacity")))
    if what == "capacity":
        layer = data.draw(st.integers(0, cal.layers - 1))
        d[kind]["capacity"][layer] ^= L.SLOT_ALIGN                 # another valid capacity
    else:
        layer, head = data.draw(st.integers(0, cal.layers - 1)), data.draw(st.integers(0, cal.kv_heads - 1))
        channel = data.draw(st.integers(0, cal.head_dim - 1))
        row = d[kind][what][layer][head]
        row[channel] = 1 if row[channel] == 0 else row[channel] - 1   # another base, still in range
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cal.json"
        path.write_text(json.dumps(d))
        raises(CalibrationError, Calibration.load, path, match="edited")


def make(b3=120, b4=116, capacity=32, layers=2, heads=1, head_dim=64):
    return Calibration(b3=np.full((2, layers, heads, head_dim), b3), b4=np.full((2, layers, heads, head_dim), b4),
                       capacity=np.full((2, layers), capacity))


@pytest.mark.parametrize("field,value,fragment", [
    ("b3", L.B3_MAX + 1, "3-bit bases"), ("b3", -1, "3-bit bases"),
    ("b4", L.B4_MAX + 1, "4-bit bases"), ("b4", -1, "4-bit bases"),
    ("capacity", L.SLOT_ALIGN // 2, "multiples"), ("capacity", L.SLOT_ALIGN + 1, "multiples"),
    ("capacity", -L.SLOT_ALIGN, "multiples"), ("capacity", L.MAX_ESCAPE_CAPACITY + L.SLOT_ALIGN, "multiples"),
])
def test_out_of_range_values_rejected(field, value, fragment):
    raises(CalibrationError, make, **{field: value}, match=fragment)
    d = make().to_dict()                       # the same values arriving through a file, id removed
    del d["id"]
    for kind in "kv":
        d[kind][field] = np.asarray(d[kind][field]) * 0 + value
        d[kind][field] = d[kind][field].tolist()
    raises(CalibrationError, Calibration.from_dict, d, match=fragment)


@pytest.mark.parametrize("shape,fragment", [
    ((2, 0, 1, 64), "layers"), ((2, 1, 0, 64), "KV heads"), ((2, 1, 1, 96), "head_dim"),
    ((1, 1, 1, 64), "[2, layers"), ((2, 1, 64), "[2, layers"),
])
def test_bad_table_shapes_rejected(shape, fragment):
    raises(CalibrationError, Calibration, b3=np.zeros(shape), b4=np.zeros(shape),
           capacity=np.zeros((2, shape[1] if len(shape) > 1 else 1)), match=fragment)


@pytest.mark.parametrize("edit,fragment", [
    (lambda d: d.update(format="something-else"), "not a GAAC calibration"),
    (lambda d: d.update(version=L.FORMAT_VERSION + 1), "version"),
    (lambda d: d.update(layers=d["layers"] + 1), "header says"),
    (lambda d: d["k"].pop("b4"), "malformed"),
    (lambda d: d["v"].update(b3="many"), "malformed"),
    (lambda d: d["k"]["b4"][0][0].__setitem__(0, 2**70), "malformed"),
    (lambda d: d["v"]["capacity"].__setitem__(0, -2**70), "malformed"),
    (lambda d: d["k"]["b3"][1].append([1] * 64), "malformed"),
])
def test_malformed_dict_rejected(edit, fragment):
    d = make().to_dict()
    edit(d)
    raises(CalibrationError, Calibration.from_dict, d, match=fragment)


@pytest.mark.parametrize("b3", [[[[2**70] * 64]] * 2, [[["x"] * 64]] * 2, [[[1] * 64], [[1] * 63]]])
def test_unconvertible_tables_rejected(b3):
    raises(CalibrationError, Calibration, b3=b3, b4=np.zeros((2, 1, 1, 64)), capacity=np.zeros((2, 1)),
           match="malformed")


def test_not_json_rejected(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text("{ not json")
    raises(CalibrationError, Calibration.load, path, match="not JSON")


# -- calibrate's own input errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("k_shape,v_shape,error,fragment", [
    ((2, 1, 32, 64), (3, 1, 32, 64), CalibrationError, "disagree"),
    ((2, 1, 32, 64), (2, 2, 32, 64), CalibrationError, "disagree"),
    ((2, 1, 32, 64), (2, 1, 32, 128), CalibrationError, "disagree"),
    ((2, 1, 8, 64), (2, 1, 32, 64), CalibrationError, "full block"),
    ((2, 1, 32, 96), (2, 1, 32, 96), InputError, "head_dim 96"),
    ((1, 32, 64), (1, 32, 64), InputError, "dimensions"),
])
def test_calibrate_rejects_bad_shapes(k_shape, v_shape, error, fragment):
    raises(error, gaac.calibrate, np.zeros(k_shape, np.uint16), np.zeros(v_shape, np.uint16),
           show_progress=False, match=fragment)


def test_calibrate_rejects_float_input():
    raises(InputError, gaac.calibrate, np.zeros((1, 1, 16, 64), np.float32), np.zeros((1, 1, 16, 64), np.uint16),
           show_progress=False, match="dtype float32")


def test_forced_capacity_is_used_and_validated():
    x = np.zeros((1, 1, 4, 64), np.uint16)            # fewer than 16 tokens is fine when capacity is given
    assert gaac.calibrate(x, x, capacity=48, show_progress=False).capacity.tolist() == [[48], [48]]
    raises(CalibrationError, gaac.calibrate, x, x, capacity=40, show_progress=False, match="multiples")


@pytest.mark.parametrize("share", [False, True])
def test_a_copy_takes_epochs_of_its_own_and_leaves_the_original_alone(share):
    """``copy()`` checks and copies the tables; ``copy(share_tables=True)`` shares them (the adaptation
    rule's trial copies): either way epochs appended to the copy are the copy's alone, and the copy has
    the original's id, tables and epochs."""
    cal = Calibration(np.full((2, 2, 2, 64), 120, np.uint8), np.full((2, 2, 2, 64), 118, np.uint8),
                      np.full((2, 2), 64, np.uint16))
    cal.add_epoch(1, 0, np.full((2, 64), 121, np.uint8), np.full((2, 64), 119, np.uint8))
    twin = cal.copy(share_tables=share)
    assert twin.id == cal.id and twin.n_epochs(1, 0) == 2 and (twin.b_narrow is cal.b_narrow) == share
    twin.add_epoch(1, 0, np.full((2, 64), 122, np.uint8), np.full((2, 64), 120, np.uint8))
    twin.add_epoch(0, 1, np.full((2, 64), 122, np.uint8), np.full((2, 64), 120, np.uint8))
    assert (cal.n_epochs(1, 0), cal.n_epochs(0, 1)) == (2, 1) and (twin.n_epochs(1, 0), twin.n_epochs(0, 1)) == (3, 2)
    np.testing.assert_array_equal(twin.bases(1, 0, 1)[0], cal.bases(1, 0, 1)[0])


def test_epochs_added_together_are_all_appended_or_none_and_the_first_bad_one_is_named():
    """``add_epochs`` appends what ``add_epoch`` one at a time appends (indices, bases, in order, two in one layer
    and kind numbered in turn); where one of them is out of range or misshapen, nothing is appended and the error
    names that epoch."""
    def fresh():
        return Calibration(np.full((2, 2, 2, 64), 120, np.uint8), np.full((2, 2, 2, 64), 118, np.uint8),
                           np.full((2, 2), 64, np.uint16))

    ok = [(1, 0, np.full((2, 64), 121), np.full((2, 64), 119)), (0, 1, np.full((2, 64), 122), np.full((2, 64), 117)),
          (1, 0, np.full((2, 64), 123), np.full((2, 64), 116))]
    together, one_by_one = fresh(), fresh()
    assert together.add_epochs(ok) == [one_by_one.add_epoch(*item) for item in ok] == [1, 1, 2]
    for layer, kind in ((1, 0), (0, 1), (0, 0)):
        assert together.n_epochs(layer, kind) == one_by_one.n_epochs(layer, kind)
        for e in range(together.n_epochs(layer, kind)):
            for got, want in zip(together.bases(layer, kind, e), one_by_one.bases(layer, kind, e)):
                np.testing.assert_array_equal(got, want)
    assert together.add_epochs([]) == []
    wide_max = together.modes.wide_base_max
    for bad, match in (((0, 1, np.full((2, 64), 121), np.full((2, 64), wide_max + 1)), "epoch 1 of layer 0 v"),
                       ((1, 0, np.full((2, 64), 121), np.full((2, 63), 119)), "epoch 3 of layer 1 k: bases must be")):
        cal = fresh()
        cal.add_epochs(ok[:1])
        raises(CalibrationError, cal.add_epochs, [ok[2], bad], match=match)
        assert (cal.n_epochs(1, 0), cal.n_epochs(0, 1)) == (2, 1)      # neither the good one nor the bad one
