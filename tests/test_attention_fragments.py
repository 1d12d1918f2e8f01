"""The attention kernel's ``fragments`` hook: a decoder of another in-slot byte order that decodes slots straight
into MMA fragments (benchmarks/v3_attention.py builds it from the fragment-order layout of
benchmarks/v3_layout.py).  The kernel built with it must give today's results on the same cache re-encoded in
that order: slots, raw tiles and the tail, with query and output channels permuted back."""
import math

import numpy as np

import gaac
from benchmarks.v3_attention import v3r_plan, v3r_tables, v3r_view
from gaac.attention import AttentionPlan, bf16_to_float, float_to_bf16, reference_attention
from gaac.testing import view_from_dense

D = 128


def _cache(rng, n: int):
    """BF16 ``[1, n, 128]`` K and V of mixed scales per channel; block 1 of K holds values scaled by 2^-60..2^0
    and of V by 2^-60..2^60 (their groups' exponents fit no window: raw tiles)."""
    scale = np.exp2(rng.integers(-3, 4, size=D))
    k = rng.standard_normal((1, n, D)) * scale
    v = rng.standard_normal((1, n, D)) * scale[::-1]
    k[0, 16:32] *= np.exp2(rng.integers(-60, 1, size=(16, D)))
    v[0, 16:32] *= np.exp2(rng.integers(-60, 61, size=(16, D)))
    return float_to_bf16(k.astype(np.float32)), float_to_bf16(v.astype(np.float32))


def test_fragment_decoder_matches_float64_and_todays_kernel():
    rng = np.random.default_rng(5)
    n, g = 56, 2                                   # 3 complete blocks (one raw) and a tail of 8 tokens
    k, v = _cache(rng, n)
    cal = gaac.calibrate(k[None], v[None], show_progress=False)
    b3, b4 = (cal.b3[0, 0], cal.b3[1, 0]), (cal.b4[0, 0], cal.b4[1, 0])
    cap = (int(cal.capacity[0, 0]), int(cal.capacity[1, 0]))
    view = view_from_dense([k], [v], b3, b4, cap, rng=rng)
    assert view.raw[0].shape[0] >= 1 and view.raw[1].shape[0] >= 1 and view.slots[0].shape[0] >= 2
    q = float_to_bf16(rng.standard_normal((1, g, D)).astype(np.float32))
    ref, lse_ref = reference_attention(bf16_to_float(q), [bf16_to_float(k)], [bf16_to_float(v)], 1 / math.sqrt(D))
    outs = {}
    for name, plan in (("v2", AttentionPlan(view, g)),
                       ("v3r", v3r_plan(v3r_view(view, [k], [v]), v3r_tables(view), g))):
        out = np.full((1, g, D), 0x7FC1, np.int16)
        lse = np.full((1, g), np.nan, np.float32)
        plan.run(q, out=out, lse=lse)
        assert int(plan.status[0]) == 0, name
        o = bf16_to_float(out).astype(np.float64)
        assert np.isfinite(o).all() and np.isfinite(lse).all(), name
        assert np.linalg.norm(o - ref) / np.linalg.norm(ref) < 4e-3, name
        assert np.abs(lse - lse_ref).max() < 1e-3, name
        outs[name] = o
    # the same values, channels summed in another order: BF16 roundings apart at most
    assert np.abs(outs["v3r"] - outs["v2"]).max() <= 2 ** -6 * np.abs(outs["v2"]).max()
