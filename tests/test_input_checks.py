"""Misuse of the Python API is an InputError that names the argument, what it expected and what it got:
never a bare RuntimeError, TypeError or OverflowError, and never a silently wrong result (BF16 bits in a
float16 buffer, a NaN output from a scale that overflows float32, a calibration lookup under kind 'k')."""
import numpy as np
import pytest

from gaac import layout as L
from gaac.attention import MAX_SCALE, AttentionPlan, _check_q, check_scale, decode_attention, float_to_bf16
from gaac.calibration import calibrate
from gaac.errors import CalibrationError, InputError
from gaac.io import load_sample
from gaac.testing import plain_view

BATCH, KV_HEADS, Q_HEADS, D = 2, 3, 9, 64


@pytest.fixture(scope="module")
def view():
    """A plain (raw-tile) view of 3 KV heads: sequences of 20 and 33 tokens of random BF16 values."""
    rng = np.random.default_rng(0)
    ks, vs = ([float_to_bf16(rng.standard_normal((KV_HEADS, n, D)).astype(np.float32)) for n in (20, 33)]
              for _ in range(2))
    return plain_view(ks, vs)


@pytest.fixture(scope="module")
def q():
    return float_to_bf16(np.random.default_rng(1).standard_normal((BATCH, Q_HEADS, D)).astype(np.float32))


# -- out= and lse= ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, buffer, message", [
    ("out", np.zeros((BATCH, Q_HEADS, D), np.float16), r"out: expected uint16 or int16 \[2, 9, 64\], got float16"),
    ("out", np.zeros((BATCH, Q_HEADS, D), np.float32), r"out: expected uint16 or int16 \[2, 9, 64\], got float32"),
    ("out", np.zeros((BATCH, 6, D), np.uint16), r"out: expected uint16 or int16 \[2, 9, 64\], got uint16 \[2, 6, 64\]"),
    ("out", [[0]], r"out: expected a NumPy array \(as q is\) uint16 or int16 \[2, 9, 64\], got list"),
    ("lse", np.zeros((BATCH, Q_HEADS), np.int32), r"lse: expected float32 \[2, 9\], got int32 \[2, 9\]"),
    ("lse", np.zeros((BATCH, Q_HEADS), np.float64), r"lse: expected float32 \[2, 9\], got float64"),
    ("lse", np.zeros((BATCH, Q_HEADS + 1), np.float32), r"lse: expected float32 \[2, 9\], got float32 \[2, 10\]"),
])
def test_cpu_output_buffers_of_another_dtype_or_shape_are_refused(view, q, name, buffer, message):
    before = np.copy(buffer) if isinstance(buffer, np.ndarray) else None
    with pytest.raises(InputError, match=message):
        decode_attention(q, view, backend="cpu", return_lse=True, **{name: buffer})
    if before is not None:
        np.testing.assert_array_equal(buffer, before)            # nothing written


def test_cpu_output_buffers_are_filled_and_returned(view, q):
    ref_out, ref_lse = decode_attention(q, view, backend="cpu", return_lse=True)
    out, lse = np.full((BATCH, Q_HEADS, D), 7, np.int16), np.zeros((BATCH, Q_HEADS), np.float32)
    got_out, got_lse = decode_attention(q, view, backend="cpu", return_lse=True, out=out, lse=lse)
    assert got_lse is lse and np.shares_memory(got_out, out) and got_out.dtype == np.uint16
    np.testing.assert_array_equal(out.view(np.uint16), ref_out)
    np.testing.assert_array_equal(lse, ref_lse)
    read_only = np.zeros((BATCH, Q_HEADS, D), np.uint16)
    read_only.flags.writeable = False
    with pytest.raises(InputError, match="out: a read-only array"):
        decode_attention(q, view, backend="cpu", out=read_only)


def test_cpu_output_buffers_as_torch_tensors(view, q):
    torch = pytest.importorskip("torch")
    tq = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16)
    ref_out, ref_lse = decode_attention(tq, view, backend="cpu", return_lse=True)
    for name, buffer, message in (
            ("out", torch.zeros(BATCH, Q_HEADS, D, dtype=torch.float16),
             r"out: expected bfloat16 or int16 \[2, 9, 64\], got float16"),
            ("out", torch.zeros(BATCH, Q_HEADS, D + 1, dtype=torch.bfloat16), r"got bfloat16 \[2, 9, 65\]"),
            ("out", np.zeros((BATCH, Q_HEADS, D), np.uint16), r"out: expected a torch tensor \(as q is\)"),
            ("lse", torch.zeros(BATCH, Q_HEADS, dtype=torch.int32), r"lse: expected float32 \[2, 9\], got int32"),
            ("lse", torch.zeros(Q_HEADS, dtype=torch.float32), r"lse: expected float32 \[2, 9\], got float32 \[9\]")):
        with pytest.raises(InputError, match=message):
            decode_attention(tq, view, backend="cpu", **{name: buffer})
    out, lse = torch.zeros(BATCH, Q_HEADS, D, dtype=torch.int16), torch.zeros(BATCH, Q_HEADS)
    got_out, got_lse = decode_attention(tq, view, backend="cpu", return_lse=True, out=out, lse=lse)
    assert got_lse is lse and got_out.dtype == torch.bfloat16 and got_out.data_ptr() == out.data_ptr()
    assert torch.equal(out.view(torch.bfloat16), ref_out) and torch.equal(lse, ref_lse)


# -- scale -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [10 ** 400, 1e39, np.float64(1e39), 3e38, -0.125, 0.0, 1e-50, -(10 ** 400)],
                         ids=["10**400", "1e39", "np.float64(1e39)", "3e38", "-0.125", "0", "1e-50", "-10**400"])
def test_a_scale_that_is_not_a_positive_finite_float32_is_refused(view, q, scale):
    with pytest.raises(InputError, match=r"scale: .* is not a positive finite float32 number"):
        decode_attention(q, view, scale=scale, backend="cpu")
    with pytest.raises(InputError, match="scale"):
        AttentionPlan(view, Q_HEADS, scale=scale)                # the kernel path (the simulator here)


def test_the_largest_scale_stays_finite_in_the_kernels_float32():
    assert check_scale(MAX_SCALE, D) == MAX_SCALE and check_scale(10 ** 3, D) == 1000.0
    assert np.isfinite(np.float32(MAX_SCALE * 1.4426950408889634))
    with pytest.raises(InputError):
        check_scale(float(np.nextafter(np.float32(MAX_SCALE), np.float32(np.inf))), D)


# -- q against a plan's heads -------------------------------------------------------------------

def test_q_with_another_head_count_than_planned_is_refused(view, q):
    six = np.ascontiguousarray(q[:, :6])                         # 6 = 2 per KV head: valid on its own
    assert decode_attention(six, view, backend="cpu").shape == (BATCH, 6, D)
    for backend in ("cpu", "cuda"):
        with pytest.raises(InputError, match=r"q: shape \[2, 6, 64\] has 6 query heads; expected 9"):
            decode_attention(six, view, backend=backend, q_heads=Q_HEADS)
    with pytest.raises(InputError, match=r"q: shape \[2, 6, 64\] has 6 query heads; expected 9"):
        AttentionPlan(view, Q_HEADS).run(six)


def test_a_bad_q_checked_against_a_shape_names_q():
    """A caller without a view (a cache's decode plan) checks q against its batch, head size and KV heads."""
    pytest.importorskip("torch")
    from gaac.serving.plan import _Shape

    shape = _Shape(BATCH, D, KV_HEADS)
    for bad, message in ((np.zeros((BATCH, Q_HEADS, D), np.float32), "q: dtype float32 is not BF16"),
                         (np.zeros((BATCH, Q_HEADS, 32), np.uint16), r"q: shape \[2, 9, 32\]"),
                         ([1, 2], "q: expected a torch tensor or NumPy array, got list")):
        with pytest.raises(InputError, match=message):
            _check_q(bad, shape, "cpu")
    with pytest.raises(InputError, match="view: expected a gaac.cache.view.LayerView"):
        _check_q(np.zeros((BATCH, Q_HEADS, D), np.uint16), object(), "cpu")


# -- Calibration's (layer, kind) ----------------------------------------------------------------

@pytest.fixture(scope="module")
def cal():
    k, v, _ = load_sample("code")
    return calibrate(k[:2, :, :64], v[:2, :, :64])


@pytest.mark.parametrize("kind", ["k", "v", True, False, 2, -1, 1.0, None, np.bool_(True)])
def test_calibration_kinds_are_0_or_1(cal, kind):
    bases = cal.bases(0, L.KIND_K)
    for call in (lambda: cal.n_epochs(0, kind), lambda: cal.bases(0, kind), lambda: cal.check_epoch(0, kind, 0),
                 lambda: cal.epoch_id(0, kind, 0), lambda: cal.epoch_canonical_bytes(0, kind, 1),
                 lambda: cal.copy().add_epoch(0, kind, *bases), lambda: cal.check_block(kind, 0, 3, 64, 32)):
        with pytest.raises(InputError, match=r"kind must be 0 \(K, gaac.layout.KIND_K\) or 1 \(V, KIND_V\), got "):
            call()


def test_calibration_layers_and_epochs_are_integers(cal):
    assert cal.n_epochs(np.int64(1), np.int8(L.KIND_V)) == 1 and cal.epoch_id(0, L.KIND_K, np.int32(0)) == cal.id
    for layer in ("0", 0.0, True, None):
        with pytest.raises(InputError, match="layer must be an integer"):
            cal.n_epochs(layer, L.KIND_K)
    for epoch in ("0", 0.0, False):
        with pytest.raises(InputError, match="epoch must be an integer"):
            cal.bases(0, L.KIND_K, epoch)
    with pytest.raises(CalibrationError, match="layer 2 out of range"):
        cal.n_epochs(2, L.KIND_K)


# -- a cache's decode plan on the CPU path (gaac.serving.plan.StepPlan without the kernel) ------------------

def test_a_cpu_decode_plan_refuses_what_its_kernel_path_refuses():
    """Scale, q's head count and the out/lse buffers are checked as on the kernel path: InputErrors that
    name the argument, never a buffer filled with the bits of another number format."""
    torch = pytest.importorskip("torch")
    from gaac.cache import PagedKVCache

    k, v, _ = load_sample("code")
    k, v = np.ascontiguousarray(k[:1, :, :40]), np.ascontiguousarray(v[:1, :, :40])
    cache = PagedKVCache(calibrate(k, v), max_seqs=2, max_blocks=4, codec="reference")
    seq = cache.add_sequence(k[:, :, :39], v[:, :, :39])
    for scale in (10 ** 400, 1e39):
        with pytest.raises(InputError, match="scale"):
            cache.decode_plan(Q_HEADS, scale=scale)
    plan = cache.decode_plan(Q_HEADS)
    cache.update_layer(0, [seq], *(torch.from_numpy(x[None, 0, :, 39:40].view(np.int16)) for x in (k, v)))
    rows = cache.max_seqs
    q = torch.zeros(rows, Q_HEADS, D, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"q: shape \[2, 6, 64\] has 6 query heads; expected 9"):
        plan.run(q[:, :6].contiguous(), 0)
    for name, buffer, message in (
            ("out", torch.zeros(rows, Q_HEADS, D, dtype=torch.float16), r"out: expected bfloat16 or int16 \[2, 9, 64\]"),
            ("out", torch.zeros(rows, Q_HEADS, 32, dtype=torch.bfloat16), r"got bfloat16 \[2, 9, 32\]"),
            ("lse", torch.zeros(rows, Q_HEADS, dtype=torch.int32), r"lse: expected float32 \[2, 9\], got int32"),
            ("lse", np.zeros((rows, Q_HEADS), np.float32), r"lse: expected a torch tensor")):
        with pytest.raises(InputError, match=message):
            plan.run(q, 0, **{name: buffer})
    out, lse = torch.zeros(rows, Q_HEADS, D, dtype=torch.int16), torch.zeros(rows, Q_HEADS)
    got_out, got_lse = plan.run(q, 0, out=out, lse=lse, return_lse=True)
    assert got_out.data_ptr() == out.data_ptr() and got_out.dtype == torch.bfloat16 and got_lse is lse
    assert torch.isfinite(lse[seq]).all() and (lse[1 - seq] == -torch.inf).all()


def test_a_step_plan_refuses_a_sequence_named_twice():
    """decode_plan(seqs=[a, a]) would append two tokens to ``a`` in a step planned for one."""
    from gaac.cache import PagedKVCache

    k, v, _ = load_sample("code")
    cache = PagedKVCache(calibrate(k, v), max_seqs=2, max_blocks=8, codec="reference")
    a = cache.add_sequence(k[:, :, :20], v[:, :, :20])
    for seqs in ([a, a], [a, cache.add_sequence(), a]):
        with pytest.raises(InputError, match="each sequence may appear once"):
            cache.decode_plan(Q_HEADS, seqs=seqs)
    cache.decode_plan(Q_HEADS, seqs=[a])
