"""Decode attention (gaac.attention, gaac.cuda.attention) in numba's CUDA simulator.

The kernels run with their GPU source in the simulator (one Python thread per
CUDA thread, warp primitives emulated through shared memory), so shapes stay
tiny.  Checked: the in-kernel decoder is bit-exact against the reference codec
for every mode (3-bit, 4-bit, raw, exponents 0 and 255); attention over slots,
raw tiles and the tail (with NaN garbage in its unused rows) matches a float64
reference within BF16 rounding, for every head_dim and group size, with many
splits and with one; the output and LSE are fully written; the BF16 baseline
kernel computes the same function; malformed slots raise the status word; the
CPU path agrees; bad inputs raise InputError.  Inputs are drawn fresh each run.
"""
import os
import sys

import numpy as np
import pytest
from conftest import kv_dump
from decode_check import decode_check_kernel

import gaac
from gaac import layout as L
from gaac.attention import (AttentionPlan, _pair_base_words, bf16_to_float, decode_attention, float_to_bf16,
                            gather_dense, reference_attention)
from gaac.cuda import attention as K
from gaac.cuda import merge
from gaac.cuda.tile_decoder import STATUS_BAD_ESCAPES, STATUS_BAD_TAG
from gaac.errors import FormatError, InputError
from gaac.reference.codec import encode_tiles
from gaac.testing import plain_view, view_from_dense

NAN_BITS = 0x7FC1


@pytest.fixture(autouse=True, scope="module")
def fast_thread_switching():
    """The simulator's block barrier polls threads; a short switch interval makes it ~10x faster."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(old)


@pytest.fixture
def rng():
    """A fresh generator per test; the seed is printed, and GAAC_TEST_SEED=<seed> replays it."""
    seed = int(os.environ.get("GAAC_TEST_SEED") or np.random.SeedSequence().entropy)
    print(f"seed {seed}  (replay: GAAC_TEST_SEED={seed})")
    return np.random.default_rng(seed)


def synth_cache(rng, heads, tokens, d):
    """BF16 bits ``[heads, tokens, d]`` with per-channel scales (narrow exponent windows), some large
    values (4-bit and raw groups), exact zeros and a few subnormals."""
    scale = np.exp2(rng.integers(-6, 3, size=(heads, 1, d))).astype(np.float32)
    x = rng.standard_normal((heads, tokens, d)).astype(np.float32) * scale
    x[rng.random(x.shape) < 0.02] *= 40.0
    x[rng.random(x.shape) < 0.002] *= 1e5
    x[rng.random(x.shape) < 0.003] = 0.0
    x[rng.random(x.shape) < 0.001] = 1e-39
    return float_to_bf16(x)


def calibrated_view(rng, ks, vs, capacity=None):
    cal = gaac.calibrate(np.concatenate(ks, axis=1)[None], np.concatenate(vs, axis=1)[None], capacity=capacity)
    return view_from_dense(ks, vs, (cal.b3[0, 0], cal.b3[1, 0]), (cal.b4[0, 0], cal.b4[1, 0]),
                           tuple(int(c) for c in cal.capacity[:, 0]), rng=rng)


def run_kernel(view, q, **plan):
    """Launch in the simulator into poisoned buffers; return (out bits float64, lse, plan)."""
    batch, hq, d = q.shape
    p = AttentionPlan(view, hq, **plan)
    out = np.full((batch, hq, d), NAN_BITS, np.uint16).view(np.int16)
    lse = np.full((batch, hq), np.nan, np.float32)
    p.run(q, out=out, lse=lse)
    assert not np.isnan(bf16_to_float(out)).any(), "output not fully written"
    assert np.isfinite(lse).all(), "lse not fully written"
    assert int(p.status[0]) == 0
    return bf16_to_float(out).astype(np.float64), lse, p


U_BF16, U_F32 = 2.0 ** -8, 2.0 ** -24     # unit roundoff: 8- and 24-bit significands, round to nearest


def rounding_bound(q, ks, vs, scale=None):
    """Per-element bounds on ``|out - exact|`` and ``|lse - exact|`` for BF16 decode attention computed
    the way the kernel (and the CPU path) compute it; a decoding mistake is far outside them.

    First-order forward error analysis: FP32 scores from BF16 inputs (products exact, ``D``-term FP32
    sums: ``|ds_j| <= D u32 scale sum|q k_j|``), scaled into the log2 domain, the running max subtracted
    and ``ex2.approx`` (a few FP32 ulps): ``|ds_j| <= eps_j``.  The weight ``w_j = pi_j e^ds_j / sum_i
    pi_i e^ds_i`` is largest with ``ds_j = eps_j`` and every other ``ds_i = -eps_i`` (and the other way
    round), which bounds ``|w_j - pi_j|`` without counting token ``j``'s own error twice: a dominant
    token's large score error barely moves its weight.  ``P`` is rounded to BF16 for ``P.V`` while the
    row sum keeps FP32 ``P`` (FlashAttention's choice): ``u_bf16 sum w_j |v_j|``, not a relative error of
    the output.  FP32 accumulation over the tokens and the split merge, then the BF16 output rounding
    ``u_bf16 |out|``.  Terms of second order are covered by a factor 1.5; ``ex2.approx.ftz`` flushing
    weights below 2^-126 by an absolute term.  (A relative-norm tolerance of 4e-3 failed: with outliers
    in V one ``p_j v_j`` dominates the output, and P's and the output's roundings, up to ``u_bf16``
    each, then add up coherently instead of averaging out.)
    """
    q = np.asarray(q, np.float64)
    batch, hq, d = q.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out_bound = np.zeros((batch, hq, d))
    lse_bound = np.zeros((batch, hq))
    for b in range(batch):
        k, v = np.asarray(ks[b], np.float64), np.asarray(vs[b], np.float64)
        if k.shape[1] == 0:
            continue
        g, n = hq // k.shape[0], k.shape[1]
        kq, vq = np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)
        s = np.einsum("hd,hld->hl", q[b], kq) * scale
        m = s.max(axis=1, keepdims=True)
        eps = (d * U_F32 * 2 * scale * np.einsum("hd,hld->hl", np.abs(q[b]), np.abs(kq))
               + 4 * U_F32 * (np.abs(s) + np.abs(s - m) + 1))
        e = np.exp(s - m)
        den = e.sum(axis=1, keepdims=True)
        pi = e / den
        up, down = pi * np.exp(eps), pi * np.exp(-eps)
        s_hi, s_lo = up.sum(axis=1, keepdims=True), down.sum(axis=1, keepdims=True)
        w_hi = up / (up + np.maximum(s_lo - down, 0))                 # the others at their smallest
        w_lo = down / (down + np.maximum(s_hi - up, 0))               # the others at their largest
        dw = np.maximum(w_hi - pi, pi - w_lo)
        av = np.abs(vq)
        pre = (np.einsum("hl,hld->hd", dw, av) + (U_BF16 + 2 * (n + 2) * U_F32) * np.einsum("hl,hld->hd", pi + dw, av)
               + n * 2.0 ** -120 * av.max(axis=1))
        exact_abs = np.abs(np.einsum("hl,hld->hd", pi, vq))
        out_bound[b] = 1.5 * (pre + U_BF16 * (exact_abs + pre)) + 2.0 ** -133
        lse = m[:, 0] + np.log(den[:, 0])
        lse_bound[b] = 1.5 * (np.maximum(np.log(s_hi), -np.log(s_lo))[:, 0]
                              + 4 * U_F32 * (np.abs(lse) + np.abs(m[:, 0]) + n + 1))
    return out_bound, lse_bound


def assert_within_rounding(out, lse, q, ks, vs, scale=None):
    """``out`` (float) and ``lse`` agree with float64 attention within :func:`rounding_bound`, element
    by element; an empty sequence must give 0 and -inf exactly."""
    qf = bf16_to_float(q)
    kf, vf = [bf16_to_float(x) for x in ks], [bf16_to_float(x) for x in vs]
    ref, lse_ref = reference_attention(qf, kf, vf, scale=scale)
    out_bound, lse_bound = rounding_bound(qf, kf, vf, scale=scale)
    over = np.abs(out - ref) > out_bound
    assert not over.any(), (f"{over.sum()} outputs outside the rounding bound, e.g. {np.argwhere(over)[0]}: "
                            f"max |err|/bound {np.max(np.abs(out - ref) / out_bound):.3g}")
    finite = np.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    lse_err = np.abs(np.asarray(lse, np.float64)[finite] - lse_ref[finite])
    assert (lse_err <= lse_bound[finite]).all(), f"lse error {lse_err.max():.3g} beyond its bound"


def check_against_reference(rng, ks, vs, g, view=None, **plan):
    heads, _, d = ks[0].shape
    view = calibrated_view(rng, ks, vs) if view is None else view
    q = float_to_bf16(rng.standard_normal((len(ks), heads * g, d)).astype(np.float32))
    out, lse, _ = run_kernel(view, q, **plan)
    assert_within_rounding(out, lse, q, ks, vs)
    return out


# ------------------------------------------------------------------------------------------------
# The in-kernel decoder

@pytest.mark.parametrize("channels", [64, 128])
def test_decoder_is_bit_exact(rng, channels):
    n = 3
    b3 = rng.integers(0, L.B3_MAX + 1, channels).astype(np.uint8)
    b3[:2] = (0, L.B3_MAX)                              # windows at both ends of the exponent range
    b4 = np.minimum(b3.astype(int) - rng.integers(0, 8, channels), L.B4_MAX).clip(0).astype(np.uint8)
    e = b3[None, None, :].astype(np.int64) + rng.integers(0, 8, (n, 16, channels))
    groups = (n, 16, channels // 8)
    four = np.repeat(rng.random(groups) < 0.2, 8, axis=2)
    raw = rng.random(groups) < 0.05
    raw[:, 5, -3:] = True                               # one lane with several raw groups, the last among them
    raw = np.repeat(raw, 8, axis=2)
    e = np.where(four, b4[None, None, :] + rng.integers(0, 16, e.shape), e)
    e = np.where(raw, rng.choice([0, 1, 127, 254, 255], e.shape), e)
    sm = rng.integers(0, 256, e.shape)
    bits = (((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)).astype(np.uint16)
    capacity = 640
    enc = encode_tiles(bits, np.tile(b3, (n, 1)), np.tile(b4, (n, 1)), capacity)
    assert enc.fits.all() and (enc.modes == L.MODE_RAW).any() and (enc.modes == L.MODE_4BIT).any()
    slot_bytes = L.TileGeometry(channels).slot_bytes(capacity)
    tiles = np.zeros(n * 16 * channels // 2, np.int32)
    status = np.zeros(1, np.int32)
    decode_check_kernel(channels, slot_bytes)[n, K.WARP](
        enc.slots.reshape(-1), _pair_base_words(b3[None], b4[None])[0].reshape(-1), capacity, tiles, status)
    np.testing.assert_array_equal(tiles.view(np.uint16).reshape(n, 16, channels), bits)
    assert status[0] == 0


def test_decoder_flags_reserved_tag_and_overfull_escapes(rng):
    channels = 64
    b3 = np.full(channels, 120, np.uint8)
    b4 = np.full(channels, 116, np.uint8)
    e = 120 + rng.integers(0, 8, (2, 16, channels))
    e[1, 0, :8] = 131                                   # one 4-bit group in tile 1
    bits = ((e << 7) | rng.integers(0, 128, e.shape)).astype(np.uint16)
    enc = encode_tiles(bits, np.tile(b3, (2, 1)), np.tile(b4, (2, 1)), 16)
    geo = L.TileGeometry(channels)
    kern = decode_check_kernel(channels, geo.slot_bytes(16))
    bases = _pair_base_words(b3[None], b4[None])[0].reshape(-1)
    for tamper, flag in ((lambda s: s.__setitem__((0, geo.tag_offset), 0x03), STATUS_BAD_TAG),
                         (lambda s: None, STATUS_BAD_ESCAPES)):
        slots = enc.slots.copy()
        tamper(slots)
        status = np.zeros(1, np.int32)
        cap = 0 if flag == STATUS_BAD_ESCAPES else 16   # tile 1 needs one escape byte
        kern[2, K.WARP](slots.reshape(-1), bases, cap, np.zeros(2 * 16 * channels // 2, np.int32), status)
        assert status[0] == flag


# ------------------------------------------------------------------------------------------------
# Attention against the float64 reference

def test_real_kv_gqa_with_tails(rng):
    """SmolLM2's real K/V (d=64, 3 KV heads, 9 query heads), ragged lengths, tails of every size."""
    k, v = kv_dump("code", "k"), kv_dump("code", "v")
    layer = int(rng.integers(0, k.shape[0]))
    lens = [int(rng.integers(17, 60)), int(rng.integers(1, 16)), 32]
    ks = [np.ascontiguousarray(k[layer, :, :n]) for n in lens]
    vs = [np.ascontiguousarray(v[layer, :, :n]) for n in lens]
    check_against_reference(rng, ks, vs, g=3, blocks_per_split=2)


@pytest.mark.parametrize("d, heads, g, plan", [
    (128, 1, 4, {"overlap": True, "blocks_per_split": 1}),     # every block its own split: the merge
    (128, 1, 8, {"nstage": 2}),
    (128, 1, 2, {"nstage": 1, "overlap": True}),               # one area per kind, refilled once read
    (64, 2, 3, {"nstage": 1, "overlap": False}),
    (256, 1, 1, {}),                                           # two half-head tiles per head
    (256, 1, 2, {"nstage": 1}),
])
def test_synthetic_shapes(rng, d, heads, g, plan):
    lens = [int(rng.integers(33, 50)), int(rng.integers(1, 16))]
    ks = [synth_cache(rng, heads, n, d) for n in lens]
    vs = [synth_cache(rng, heads, n, d) for n in lens]
    check_against_reference(rng, ks, vs, g, **plan)


def test_whole_wave_planning(rng):
    """Where one wave of the longest splits cannot hold the work, ``whole_waves`` plans whole waves of
    shorter splits; the default keeps the longest splits and a partial last wave.  (The simulator's
    wave is 4 blocks; 300 blocks x 2 KV heads need ceil(600 / (4 * 64)) = 3 waves.)"""
    heads, d, tokens = 2, 64, 300 * L.BLOCK_TOKENS
    ks, vs = [synth_cache(rng, heads, tokens, d)], [synth_cache(rng, heads, tokens, d)]
    view = calibrated_view(rng, ks, vs)
    default = AttentionPlan(view, heads)
    assert default.blocks_per_split == K.MAX_BLOCKS_PER_SPLIT
    assert heads * default.n_work == 10                       # 2.5 waves of 4 blocks
    whole = AttentionPlan(view, heads, whole_waves=True)
    assert whole.blocks_per_split == 50
    assert heads * whole.n_work == 3 * 4                      # 3 full waves
    assert AttentionPlan(view, heads, whole_waves=None).blocks_per_split == K.MAX_BLOCKS_PER_SPLIT  # half full


def test_whole_waves_by_default_below_half_a_wave(rng):
    """By default a last wave filled below half becomes whole waves: 130 blocks x 3 KV heads take 9
    longest splits, 2.25 waves of the simulator's 4, so 3 waves of 12 shorter splits."""
    heads, d, tokens = 3, 64, 130 * L.BLOCK_TOKENS
    ks, vs = [synth_cache(rng, heads, tokens, d)], [synth_cache(rng, heads, tokens, d)]
    view = calibrated_view(rng, ks, vs)
    assert heads * AttentionPlan(view, heads, whole_waves=False).n_work == 9
    auto = AttentionPlan(view, heads)
    assert auto.blocks_per_split == 33 and heads * auto.n_work == 12


@pytest.mark.parametrize("lanes", [1, 2, 8])
def test_merge_kernel_split_lanes(rng, lanes):
    """The merge with several split lanes per channel quad (the GPU uses up to 64; the simulator's
    plans use 1) against a float64 log-sum-exp merge: ragged split counts, one sequence without splits
    (output 0, LSE -inf), and partials whose maxima differ by far more than FP32's range."""
    d, kv_heads, g = 64, 2, 3
    counts = [int(rng.integers(1, 4 * lanes + 3)), 0, int(rng.integers(1, 3))]
    split0 = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    w, hq = int(split0[-1]), kv_heads * g
    o_part = rng.standard_normal((w, hq, d)).astype(np.float32)
    lse_part = (rng.standard_normal((w, hq)) * 60).astype(np.float32)     # log2 domain
    out = np.full((len(counts), hq, d), NAN_BITS, np.int16)
    lse = np.full((len(counts), hq), np.nan, np.float32)
    kernel = merge.merge_kernel(d, lanes)
    kernel[(len(counts), hq, d // merge.MERGE_CHANNELS), merge.MERGE_CHANNELS // 4 * lanes](
        o_part.reshape(-1), lse_part.reshape(-1), split0, out.reshape(-1), lse.reshape(-1), kv_heads, g)
    for b, (s0, s1) in enumerate(zip(split0[:-1], split0[1:])):
        if s0 == s1:
            assert (out[b] == 0).all() and np.isneginf(lse[b]).all()
            continue
        ls = lse_part[s0:s1].astype(np.float64)
        m = ls.max(axis=0)
        wgt = np.exp2(ls - m)
        ref = (wgt[..., None] * o_part[s0:s1]).sum(axis=0) / wgt.sum(axis=0)[..., None]
        got = bf16_to_float(out[b]).astype(np.float64)
        np.testing.assert_allclose(got, ref, rtol=2 ** -7, atol=1e-6)
        np.testing.assert_allclose(lse[b], (m + np.log2(wgt.sum(axis=0))) * np.log(2), rtol=1e-5, atol=1e-5)


def test_raw_tiles_and_plain_kernel_agree(rng):
    """A capacity of 0 sends every tile with a 4-bit or raw group to the raw pool; the BF16 baseline
    (every tile raw, decode compiled out) computes the same output bits."""
    d, heads, g = 64, 2, 2
    lens = [40, 9]
    ks = [synth_cache(rng, heads, n, d) for n in lens]
    vs = [synth_cache(rng, heads, n, d) for n in lens]
    view = calibrated_view(rng, ks, vs, capacity=0)
    assert any((t.view(np.uint32) >= L.TABLE_RAW_FLAG).any() for t in view.table)
    out = check_against_reference(rng, ks, vs, g, view=view)
    q = float_to_bf16(rng.standard_normal((len(ks), heads * g, d)).astype(np.float32))
    a, lse_a, _ = run_kernel(view, q)
    for nstage in (2, 1):
        b, lse_b, _ = run_kernel(plain_view(ks, vs), q, plain=True, nstage=nstage)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(lse_a, lse_b)
    assert out.shape == a.shape


def test_status_word_reports_a_corrupt_slot(rng):
    d, heads = 64, 1
    ks = [synth_cache(rng, heads, 32, d)]
    vs = [synth_cache(rng, heads, 32, d)]
    view = calibrated_view(rng, ks, vs)
    view.slots[0][:, L.geometry(d).tag_offset] |= 0x03    # first group of every K slot: reserved tag
    q = float_to_bf16(rng.standard_normal((1, heads, d)).astype(np.float32))
    p = AttentionPlan(view, heads)
    p.run(q)
    with pytest.raises(FormatError, match="reserved"):
        p.check_status()


# ------------------------------------------------------------------------------------------------
# CPU path, views, errors

def test_cpu_path_and_view_are_lossless(rng):
    torch = pytest.importorskip("torch")
    d, heads, g = 128, 2, 3
    lens = [37, 16]
    ks = [synth_cache(rng, heads, n, d) for n in lens]
    vs = [synth_cache(rng, heads, n, d) for n in lens]
    view = calibrated_view(rng, ks, vs)
    dense = gather_dense(view)
    for b in range(len(lens)):
        np.testing.assert_array_equal(dense.k[b], ks[b])
        np.testing.assert_array_equal(dense.v[b], vs[b])
    q = float_to_bf16(rng.standard_normal((2, heads * g, d)).astype(np.float32))
    out, lse = decode_attention(torch.from_numpy(q.view(np.int16)).view(torch.bfloat16), view, scale=0.05,
                                return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == (2, heads * g, d)
    assert_within_rounding(out.float().numpy().astype(np.float64), lse.numpy(), q, ks, vs, scale=0.05)


def test_bad_inputs_raise_input_error(rng):
    d, heads = 64, 2
    view = calibrated_view(rng, [synth_cache(rng, heads, 20, d)], [synth_cache(rng, heads, 20, d)])
    q = float_to_bf16(rng.standard_normal((1, heads, d)).astype(np.float32))
    with pytest.raises(InputError, match="dtype"):
        decode_attention(q.astype(np.float32), view)
    with pytest.raises(InputError, match="shape"):
        decode_attention(q[:, :, :32], view)
    with pytest.raises(InputError, match="query heads"):
        decode_attention(np.zeros((1, 3, d), np.uint16), view)
    with pytest.raises(InputError, match="query heads"):
        decode_attention(np.zeros((1, 9 * heads, d), np.uint16), view)
    with pytest.raises(InputError, match="backend"):
        decode_attention(q, view, backend="tpu")
    bad = calibrated_view(rng, [synth_cache(rng, heads, 20, d)], [synth_cache(rng, heads, 20, d)])
    bad.table = (bad.table[0].astype(np.int64), bad.table[1])
    with pytest.raises(InputError, match=r"table\[k\]: dtype int64"):
        decode_attention(q, bad)
    negative = calibrated_view(rng, [synth_cache(rng, heads, 20, d)], [synth_cache(rng, heads, 20, d)])
    negative.seq_lens = np.full(1, -1, np.int32)
    with pytest.raises(InputError, match="non-negative"):
        AttentionPlan(negative, heads)


def test_paged_cache_view_with_an_empty_row(rng):
    """gaac.PagedKVCache's LayerView, whose unused sequence rows have length 0 (output 0, LSE -inf)."""
    from gaac.cache import PagedKVCache

    k, v = kv_dump("list", "k"), kv_dump("list", "v")
    cal = gaac.calibrate(k, v, show_progress=False)
    cache = PagedKVCache(cal, max_seqs=3, max_blocks=4)
    lens = [int(rng.integers(17, 64)), int(rng.integers(1, 16))]
    for n in lens:
        cache.add_sequence(k[:, :, :n], v[:, :, :n])
    layer = int(rng.integers(0, k.shape[0]))
    view = cache.layer_view(layer)
    heads, d, g = k.shape[1], k.shape[3], 3
    q = float_to_bf16(rng.standard_normal((3, heads * g, d)).astype(np.float32))
    ks = [k[layer, :, :n] for n in lens] + [k[layer, :, :0]]
    vs = [v[layer, :, :n] for n in lens] + [v[layer, :, :0]]
    for backend in ("cuda", "cpu"):
        out, lse = decode_attention(q, view, backend=backend, return_lse=True)
        got = bf16_to_float(out).astype(np.float64)
        assert (got[2] == 0).all() and np.isneginf(lse[2]).all()
        assert_within_rounding(got, lse, q, ks, vs)


def test_only_tails(rng):
    """Sequences shorter than one block: no slot or raw tile anywhere, every split reads only a tail
    (its unused rows NaN), against float64."""
    heads, d, g = 2, 64, 3
    cal = gaac.calibrate(synth_cache(rng, heads, 32, d)[None], synth_cache(rng, heads, 32, d)[None],
                         show_progress=False)
    lens = [int(rng.integers(1, 16)), int(rng.integers(1, 16))]
    ks = [synth_cache(rng, heads, n, d) for n in lens]
    vs = [synth_cache(rng, heads, n, d) for n in lens]
    view = view_from_dense(ks, vs, (cal.b3[0, 0], cal.b3[1, 0]), (cal.b4[0, 0], cal.b4[1, 0]),
                           tuple(int(c) for c in cal.capacity[:, 0]), rng=rng)
    check_against_reference(rng, ks, vs, g, view=view)


def epoch_view(rng, d=64, heads=1, lens=(80, 50), bad=False):
    """Two calibration epochs (FORMAT.md 3.5) over drifting caches: the first 32 tokens of each
    sequence are small, the rest 2^6 larger, so epoch 0's windows (calibrated on the small part)
    would send the later tiles to raw tiles or decode them wrongly; the later blocks are encoded
    with epoch 1's bases, K's from block 2 and V's from block 3 (epochs are per kind)."""
    def drifting(n):
        x = rng.standard_normal((heads, n, d)).astype(np.float32)
        x[:, 32:] *= 64
        x[rng.random(x.shape) < 0.001] *= 1e4                # a few raw groups
        return float_to_bf16(x)
    ks = [drifting(n) for n in lens]
    vs = [drifting(n) for n in lens]
    cals = [gaac.calibrate(np.concatenate([k[:, a:b] for k in ks], axis=1)[None],
                           np.concatenate([v[:, a:b] for v in vs], axis=1)[None], capacity=48)
            for a, b in ((0, 32), (32, None))]
    b3 = tuple(np.stack([c.b3[kind, 0] for c in cals]) for kind in range(2))
    b4 = tuple(np.stack([c.b4[kind, 0] for c in cals]) for kind in range(2))
    mb = max(lens) // L.BLOCK_TOKENS
    epochs = (np.where(np.arange(mb) >= 2, 1, 0)[None].repeat(len(lens), 0),
              np.where(np.arange(mb) >= 3, 1, 0)[None].repeat(len(lens), 0))
    view = view_from_dense(ks, vs, b3, b4, (48, 48), rng=rng, epochs=epochs)
    assert all((np.asarray(t)[0, :4] >= 0).mean() > 0.5 for t in view.table)      # mostly slots
    if bad:
        view.epoch[1][0, 1] = 2          # no bases for epoch 2
    return ks, vs, view


def test_calibration_epochs_per_block(rng):
    """Every block is decoded with its own epoch's bases: the CPU path is lossless, and the kernel
    (bases reloaded where a split crosses an epoch boundary, or loaded per split) matches float64."""
    ks, vs, view = epoch_view(rng)
    assert view.epoch[0].dtype == np.int16 and view.b3[0].shape == (2, 1, 64)
    dense = gather_dense(view)
    for b in range(2):
        np.testing.assert_array_equal(dense.k[b], ks[b])
        np.testing.assert_array_equal(dense.v[b], vs[b])
    # Read with only epoch 0's bases the later blocks come out different: the epochs matter.
    import dataclasses
    wrong = gather_dense(dataclasses.replace(view, epoch=None, b3=tuple(b[0] for b in view.b3),
                                             b4=tuple(b[0] for b in view.b4)))
    assert not np.array_equal(wrong.k[0], ks[0])
    for bps in (4, 1):
        check_against_reference(rng, ks, vs, 2, view=view, blocks_per_split=bps)


def test_bad_block_epoch_is_refused_or_flagged(rng):
    """An epoch without bases: refused by the plan and the CPU path; flagged by the kernel if the view
    changes after planning."""
    ks, vs, view = epoch_view(rng, lens=(40,), bad=True)
    q = float_to_bf16(rng.standard_normal((1, 2, 64)).astype(np.float32))
    with pytest.raises(InputError, match=r"epoch\[v\]\[0, 1\] = 2"):
        AttentionPlan(view, 2)
    with pytest.raises(InputError, match="epoch"):
        decode_attention(q, view, backend="cpu")
    view.epoch[1][0, 1] = 1
    p = AttentionPlan(view, 2, blocks_per_split=1)
    view.epoch[1][0, 1] = 2                 # after planning: the split starting at block 1 reads it
    p.run(q)
    with pytest.raises(FormatError, match="epoch"):
        p.check_status()
