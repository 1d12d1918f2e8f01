"""Calibration where the K/V are: the fit of torch tensors (on a GPU, where ``gaac.hf.GAACCache`` calibrates
itself) and the vectorised NumPy fit choose exactly what the encoder's own counts choose.

``fit_windows`` of a torch tensor runs the device fit (``gaac.calibration._fit_on_device``) on whatever device
the tensor is on: the CPU here, a GPU where there is one.  Both fits must give the windows, capacities and raw-tile
counts that the reference codec's mode choice gives (the per-tile escapes below are counted with
``gaac.reference.codec.choose_modes``, the encoder's rule), and ``calibrate`` must give one calibration id for NumPy
bits, CPU tensors and GPU tensors.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import kv_dump
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import bf16_bits, exponent_centres, head_dims

import gaac
import gaac.calibration as C
from gaac import layout as L
from gaac.reference.codec import choose_modes, escape_bytes, tile_exponents
from gaac.tiles import block_tiles, cache_blocks, tile_bases

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def encoder_escapes(x, b_narrow, b_wide, modes=L.BF16_MODES):
    """Escape bytes of every tile of one layer ``[heads, tokens, head_dim]``, by the encoder's mode choice."""
    blocks = x.shape[1] // L.BLOCK_TOKENS
    if blocks == 0:
        return np.zeros(0, dtype=np.int64)
    tiles = block_tiles(cache_blocks(x))
    tn, tw = (np.tile(t, (blocks, 1)) for t in tile_bases(b_narrow, b_wide))
    return escape_bytes(choose_modes(tile_exponents(tiles, modes.fmt), tn, tw, modes), modes)


def plain_windows(x, modes=L.BF16_MODES, capacity=None, slot_line=None) -> C.Windows:
    """fit_windows written out: histograms by np.add.at, brute-force windows, the encoder's escapes."""
    layers, heads, tokens, dim = x.shape
    counts = np.zeros((layers, heads, dim, modes.fmt.exponent_values), dtype=np.int64)
    layer_, head, _, channel = np.indices(x.shape).reshape(4, -1)
    e = (x.ravel() >> modes.fmt.mantissa_bits) & modes.fmt.max_exponent_field
    np.add.at(counts, (layer_, head, channel, e), 1)
    sums = [np.lib.stride_tricks.sliding_window_view(counts, w, axis=-1).sum(axis=-1)
            for w in (modes.narrow_window, modes.wide_window)]
    bn, bw = (np.argmax(s, axis=-1) for s in sums)
    if capacity is not None:
        return C.Windows(bn, bw, np.full(layers, capacity, dtype=np.int64))
    escapes = [encoder_escapes(x[layer], bn[layer], bw[layer], modes) for layer in range(layers)]
    geo = modes.geometry(dim)
    cap = np.array([C.best_capacity(e, geo, slot_line) for e in escapes], dtype=np.int64)
    return C.Windows(bn, bw, cap, raw_tiles=int(sum((e > c).sum() for e, c in zip(escapes, cap))),
                     tiles=int(sum(e.size for e in escapes)))


def same_windows(got: C.Windows, want: C.Windows) -> None:
    for field in ("b_narrow", "b_wide", "capacity"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
        assert getattr(got, field).dtype == getattr(want, field).dtype, field
    assert (got.raw_tiles, got.tiles) == (want.raw_tiles, want.tiles)


@st.composite
def caches(draw):
    """One kind of a cache: 1..3 layers, 1..3 heads, any head_dim, 0..70 tokens near drawn exponent centres,
    with edge patterns (zeros, infinities, NaNs, subnormals) dropped in by the strategy."""
    layers, heads, dim = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(head_dims)
    tokens = draw(st.integers(0, 70))
    centres = draw(st.one_of(st.none(), exponent_centres(heads, dim)))
    return draw(bf16_bits((layers, heads, tokens, dim), None if centres is None else centres[None]))


def bits_tensor(x, device):
    return torch.from_numpy(x.view(np.int16)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(caches(), st.sampled_from([None, 128]), st.sampled_from([None, 32]), st.sampled_from([1 << 25, 4096, 700]))
def test_both_fits_are_the_encoders_choice(device, x, slot_line, capacity, chunk):
    """NumPy and device fits equal the plain fit, also when the device fit works in chunks of layers and of
    tokens (``DEVICE_CHUNK`` elements), with a forced capacity and on 128-byte slot lines."""
    want = plain_windows(x, capacity=capacity, slot_line=slot_line)
    same_windows(C.fit_windows(x, capacity=capacity, slot_line=slot_line), want)
    saved = C.DEVICE_CHUNK
    C.DEVICE_CHUNK = chunk
    try:
        same_windows(C.fit_windows(bits_tensor(x, device), capacity=capacity, slot_line=slot_line), want)
    finally:
        C.DEVICE_CHUNK = saved


@settings(max_examples=40, deadline=None)
@given(caches(), st.data())
def test_tile_escape_bytes_is_the_encoders_count(x, data):
    """In tile order, for valid bases and for bases outside the exponent field (which no group fits)."""
    heads, dim = x.shape[1], x.shape[3]
    bases = st.integers(-300, 300) if data.draw(st.booleans()) else st.integers(0, L.B4_MAX)
    bn = np.array(data.draw(st.lists(bases, min_size=heads * dim, max_size=heads * dim))).reshape(heads, dim)
    bw = np.array(data.draw(st.lists(bases, min_size=heads * dim, max_size=heads * dim))).reshape(heads, dim)
    for layer in range(x.shape[0]):
        want = encoder_escapes(x[layer], bn, bw)
        np.testing.assert_array_equal(C.tile_escape_bytes(x[layer], bn, bw), want)


@settings(max_examples=30, deadline=None)
@given(caches(), st.sampled_from([L.BF16, L.E4M3, L.E5M2]))
def test_exponent_histograms_count_every_field(x, fmt):
    if fmt is not L.BF16:
        x = (x & 0xFF).astype(np.uint8)          # FP8 bytes: any pattern
    counts = np.zeros((x.shape[0], x.shape[1], x.shape[3], fmt.exponent_values), dtype=np.int64)
    layer, head, _, channel = np.indices(x.shape).reshape(4, -1)
    np.add.at(counts, (layer, head, channel, (x.ravel() >> fmt.mantissa_bits) & fmt.max_exponent_field), 1)
    np.testing.assert_array_equal(C.exponent_histograms(x, fmt), counts)


@pytest.mark.parametrize("device", DEVICES)
def test_real_dump_calibrates_alike_everywhere(device):
    """A real SmolLM2 dump: one calibration (id, capacities, raw-tile rate) from NumPy bits, CPU BF16 tensors
    and tensors on ``device`` (fitted there)."""
    k, v = kv_dump("prose", "k"), kv_dump("prose", "v")
    want = gaac.calibrate(k, v, show_progress=False)
    as_bf16 = [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device) for a in (k, v)]
    for got in (gaac.calibrate(*as_bf16, show_progress=False),
                gaac.calibrate(*(bits_tensor(a, device) for a in (k, v)), show_progress=False)):
        assert got.id == want.id and got.notes == want.notes and got.to_dict() == want.to_dict()
    for kind, x in enumerate((k, v)):
        same_windows(C.fit_windows(bits_tensor(x, device)), plain_windows(x))


def test_device_fit_refuses_what_calibrate_refuses():
    x = torch.zeros((1, 1, 16, 64), dtype=torch.float32)
    with pytest.raises(gaac.InputError, match="float32"):
        C.sample_caches(x.to("meta"), x.to("meta"))
    with pytest.raises(gaac.InputError, match="4 dimensions"):
        C.sample_caches(torch.zeros((1, 16, 64), dtype=torch.int16, device="meta"),
                        torch.zeros((1, 16, 64), dtype=torch.int16, device="meta"))
    with pytest.raises(gaac.InputError, match="one device"):
        C.sample_caches(torch.zeros((1, 1, 16, 64), dtype=torch.int16, device="meta"),
                        np.zeros((1, 1, 16, 64), np.uint16))
