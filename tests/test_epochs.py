"""Calibration epochs (FORMAT.md 3.5, 3.6): their ids, files and streams, the rule that appends them, and
what `gaac stats` makes of a context that drifts.

The drifting cache here is built so that the answer is known: a block of
channels moves its exponents up one step every 512 tokens, the rest stay put.  Windows calibrated on the first 256 tokens then leave the moved channels'
groups 4-bit and raw; epochs must follow them, and every block must still decode
to its exact bits.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import bases, block_cases

import gaac
import gaac.epochs as epochs
from gaac import layout as L
from gaac.cache.view import LayerView
from gaac.calibration import Calibration, calibrate
from gaac.errors import CalibrationError, FormatError, InputError
from gaac.reference.bits import join_bf16
from gaac.stats import measure
from gaac.tiles import cache_blocks

HEAD_DIM, HEADS = 64, 2
DRIFT_CHANNELS = slice(0, 24)      # the channels whose exponents move
DRIFT_STEP, DRIFT_EVERY = 1, 512   # they move DRIFT_STEP up every DRIFT_EVERY tokens


def drifting_cache(tokens: int, seed: int = 0, layers: int = 1) -> np.ndarray:
    """``uint16 [layers, HEADS, tokens, HEAD_DIM]``: exponents within 3 of 110, 0.2 % of them 4..6 away;
    the drift channels' centre moving up as the context grows."""
    rng = np.random.default_rng(seed)
    centre = np.full((tokens, HEAD_DIM), 110)
    centre[:, DRIFT_CHANNELS] += (np.arange(tokens) // DRIFT_EVERY * DRIFT_STEP)[:, None]
    shape = (layers, HEADS, tokens, HEAD_DIM)
    offset = rng.integers(-3, 4, size=shape)
    far = rng.random(shape) < 0.002
    offset[far] = (rng.integers(4, 7, size=shape) * rng.choice([-1, 1], size=shape))[far]
    sm = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return join_bf16(sm, (centre + offset).astype(np.uint8)).astype(np.uint16)


@pytest.fixture(scope="module")
def drift():
    """(cache of 96 blocks, calibration on its first 256 tokens)."""
    x = drifting_cache(96 * L.BLOCK_TOKENS)
    return x, calibrate(x[:, :, :256], x[:, :, :256])


def with_epoch(cal: Calibration, shift: int, layer: int = 0, kind: int = L.KIND_K) -> Calibration:
    """A copy of ``cal`` with one epoch appended: epoch 0's bases of (kind, layer) plus ``shift``."""
    out = cal.copy()
    b3, b4 = (b.astype(np.int64) + shift for b in cal.bases(layer, kind))
    out.add_epoch(layer, kind, b3, b4)
    return out


# -- calibrations with epochs --------------------------------------------------------------------

def test_epochs_leave_the_calibration_id_and_the_version_1_file_alone(drift, tmp_path):
    _, cal = drift
    plain = tmp_path / "plain.json"
    cal.save(plain)
    assert json.loads(plain.read_text())["version"] == 1 and "epochs" not in json.loads(plain.read_text())
    ext = with_epoch(cal, 2)
    assert ext.id == cal.id and ext.n_epochs(0, L.KIND_K) == 2 and ext.n_epochs(0, L.KIND_V) == 1
    assert cal.n_epochs(0, L.KIND_K) == 1, "copy() must not share the epoch lists"
    path = tmp_path / "ext.json"
    ext.save(path)
    d = json.loads(path.read_text())
    assert d["version"] == 2 and d["id"] == f"{cal.id:08x}"
    assert d["epochs"]["k"][0][0]["id"] == f"{ext.epoch_id(0, L.KIND_K, 1):08x}" and d["epochs"]["v"] == [[]]
    back = Calibration.load(path)
    assert back.id == ext.id and back.n_epochs(0, L.KIND_K) == 2
    for a, b in zip(back.bases(0, L.KIND_K, 1), ext.bases(0, L.KIND_K, 1)):
        np.testing.assert_array_equal(a, b)
    assert back.epoch_id(0, L.KIND_K, 1) == ext.epoch_id(0, L.KIND_K, 1) != ext.epoch_id(0, L.KIND_K, 0) == cal.id


def test_an_epoch_id_depends_on_calibration_layer_kind_index_and_bases():
    rng = np.random.default_rng(5)
    b3 = rng.integers(100, 120, size=(2, 2, HEADS, HEAD_DIM))
    cal = Calibration(b3=b3, b4=b3 - 4, capacity=np.full((2, 2), 32))
    b = cal.bases(0, L.KIND_K)
    for layer in (0, 1):
        for kind in (L.KIND_K, L.KIND_V):
            cal.add_epoch(layer, kind, *b)                  # the same tables everywhere ...
    cal.add_epoch(0, L.KIND_K, *b)                          # ... and twice in (K, layer 0)
    other = Calibration(b3=b3, b4=b3 - 5, capacity=np.full((2, 2), 32), epochs={(L.KIND_K, 0): [b]})
    ids = {cal.epoch_id(layer, kind, 1) for layer in (0, 1) for kind in (0, 1)} | {cal.epoch_id(0, 0, 2)} \
        | {other.epoch_id(0, 0, 1)}
    assert len(ids) == 6                                    # ... but six different ids


BAD_EPOCHS = {
    "b3 above 248": (lambda e: e["k"][0][0]["b3"][0].__setitem__(3, 249), "3-bit bases"),
    "b4 negative": (lambda e: e["k"][0][0]["b4"][1].__setitem__(0, -1), "4-bit bases"),
    "float": (lambda e: e["k"][0][0]["b3"][0].__setitem__(0, 1.5), "integer tables"),
    "wrong shape": (lambda e: e["k"][0][0]["b3"].pop(), "bases must be"),
    "id differs": (lambda e: e["k"][0][0].__setitem__("id", "00000000"), "does not match its tables"),
    "missing layer": (lambda e: e["k"].pop(), "each of the 1 layers"),
    "not a list": (lambda e: e["k"].__setitem__(0, {}), "is not a list"),
    "unknown key": (lambda e: e.__setitem__("q", []), "keys \"k\" and \"v\""),
}


@pytest.mark.parametrize("case", sorted(BAD_EPOCHS))
def test_a_damaged_epochs_section_is_refused(drift, case):
    change, message = BAD_EPOCHS[case]
    d = with_epoch(drift[1], 1).to_dict()
    change(d["epochs"])
    with pytest.raises(CalibrationError, match=message):
        Calibration.from_dict(d)


def test_epochs_need_version_2_and_valid_keys(drift):
    d = with_epoch(drift[1], 1).to_dict()
    d["version"] = 1
    with pytest.raises(CalibrationError, match="is version 2"):
        Calibration.from_dict(d)
    _, cal = drift
    with pytest.raises(CalibrationError, match="is not \\(kind 0 or 1"):
        Calibration(b3=cal.b3, b4=cal.b4, capacity=cal.capacity, epochs={(0, 5): []})
    with pytest.raises(CalibrationError, match="unknown epoch 2"):
        with_epoch(cal, 1).bases(0, L.KIND_K, 2)
    with pytest.raises(CalibrationError, match="only epochs 1 and later"):
        cal.epoch_canonical_bytes(0, L.KIND_K, 0)


# -- streams of later epochs -------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(case=block_cases(), data=st.data())
def test_a_block_of_a_later_epoch_round_trips_and_only_with_its_own_epoch(case, data):
    """A stream can never be decoded with another cache's epoch of the same index: CalibrationError."""
    kind = case.kind_index
    mine, theirs = case.calibration.copy(), case.calibration.copy()
    mine.add_epoch(case.layer, kind, *data.draw(bases(case.kv_heads, case.head_dim)))
    other = data.draw(bases(case.kv_heads, case.head_dim))
    theirs.add_epoch(case.layer, kind, *other)
    enc = gaac.encode_block(case.bits, mine, case.layer, case.kind, epoch=1)
    head = L.STREAM_HEADER_V2.unpack_from(enc.data)
    assert (head[1], head[9], head[10], head[11], enc.epoch) == (2, mine.epoch_id(case.layer, kind, 1), 1, 0, 1)
    np.testing.assert_array_equal(gaac.decode_block(enc, mine), case.bits)
    if all(np.array_equal(a, b) for a, b in zip(other, mine.bases(case.layer, kind, 1))):
        return                                  # the same bases: the same id, and decoding is right anyway
    with pytest.raises(CalibrationError, match="another cache's epochs"):
        gaac.decode_block(enc, theirs)
    with pytest.raises(CalibrationError, match="unknown epoch 1"):
        gaac.decode_block(enc, case.calibration)


def test_version_2_header_rules(drift):
    x, cal = drift
    cal = with_epoch(cal, 1)
    block = cache_blocks(x[0])[0]
    v1 = gaac.encode_block(block, cal, 0, "k").data
    assert v1[4] == 1 and v1[20:24] == bytes(4)

    def resealed(data: bytes, **fields) -> bytes:
        names = ("magic", "version", "element", "kind", "tokens", "layer", "kv_heads", "head_dim", "capacity",
                 "cal_id", "epoch", "reserved")
        head = dict(zip(names, L.STREAM_HEADER_V2.unpack_from(data)))
        head.update(fields)
        body = L.STREAM_HEADER_V2.pack(*head.values()) + data[L.STREAM_HEADER_BYTES:-4]
        import zlib
        return body + zlib.crc32(body).to_bytes(4, "little")

    np.testing.assert_array_equal(gaac.decode_block(resealed(v1, version=2), cal), block)   # v2, epoch 0
    with pytest.raises(FormatError, match="reserved=65536"):                  # v1: bytes 20..23 are reserved
        gaac.decode_block(resealed(v1, reserved=1), cal)
    with pytest.raises(FormatError, match="reserved=1"):
        gaac.decode_block(resealed(v1, version=2, reserved=1), cal)
    with pytest.raises(FormatError, match="reads versions 1 and 2"):
        gaac.decode_block(resealed(v1, version=3), cal)
    with pytest.raises(InputError, match="epoch must be an integer"):
        gaac.encode_block(block, cal, 0, "k", epoch=True)
    with pytest.raises(CalibrationError, match="unknown epoch 2"):
        gaac.encode_block(block, cal, 0, "k", epoch=2)


# -- the rule --------------------------------------------------------------------------------------

def test_the_rule_follows_the_drift_after_its_warm_up(drift):
    x, cal = drift
    blocks = cache_blocks(x[0])
    learned = cal.copy()
    got = epochs.assign_epochs(blocks, learned, 0, L.KIND_K)
    first = int(np.argmax(got > 0))
    # no epoch before the third check, then at least one per drift step; epochs never decrease
    assert first >= epochs.WARMUP_BLOCKS and (np.diff(got) >= 0).all() and got[-1] >= 2
    # the check after the last block may append one epoch no block uses yet
    assert got[-1] + 1 >= learned.n_epochs(0, L.KIND_K) - 1 >= got[-1] and learned.n_epochs(0, L.KIND_V) == 1
    b3 = learned.bases(0, L.KIND_K, int(got[-1]))[0].astype(int)
    assert (b3[:, DRIFT_CHANNELS] > cal.b3[0, 0][:, DRIFT_CHANNELS]).all()      # the moved windows moved up
    assert (np.abs(b3[:, 24:] - cal.b3[0, 0][:, 24:]) <= 1).all()                # the others did not (ties)

    fed = cal.copy()                         # block by block, as a cache finalizes them: the same epochs
    adapter = epochs.Adapter(fed, 0, L.KIND_K)
    one_by_one = []
    for block in blocks:
        one_by_one.append(adapter.epoch)
        adapter.observe(block[None])
    assert one_by_one == got.tolist() and adapter.finalized == len(blocks)


def test_blocks_kept_on_the_device_are_read_at_a_host_check_in_one_copy_and_decide_as_arrays(drift, monkeypatch):
    """An adapter fed :class:`~gaac.epochs.DeviceBlock` (values on the device, a GPU rule's leftovers) makes the
    epochs one fed the same blocks as arrays makes, and its host checks read each check's blocks in one copy
    from the device, never a block at a time (on a GPU each of those would wait for the device)."""
    torch = pytest.importorskip("torch")
    x, cal = drift
    blocks = cache_blocks(x[0])
    want = epochs.assign_epochs(blocks, cal.copy(), 0, L.KIND_K)

    def one_by_one(*args, **kwargs):
        raise AssertionError("a block's values were read on their own")

    monkeypatch.setattr(epochs.DeviceBlock, "__array__", one_by_one)
    run = torch.from_numpy(blocks.view(np.int16).copy())
    adapter = epochs.Adapter(cal.copy(), 0, L.KIND_K)
    got = []
    kept = epochs.device_blocks(run)
    while kept:
        n = adapter.until_check
        got += [adapter.epoch] * len(kept[:n])
        adapter.observe(kept[:n])
        kept = kept[n:]
    assert got == want.tolist() and adapter.finalized == len(blocks)


def test_no_epoch_when_the_calibration_already_fits():
    x = drifting_cache(64 * L.BLOCK_TOKENS)[:, :, :, 24:].repeat(2, axis=-1)[..., :HEAD_DIM]   # no drift
    cal = calibrate(x, x)
    got = epochs.assign_epochs(cache_blocks(x[0]), cal, 0, L.KIND_K)
    assert (got == 0).all() and cal.n_epochs(0, L.KIND_K) == 1


def test_the_threshold_and_the_cap_are_what_decide(drift, monkeypatch):
    x, cal = drift
    blocks = cache_blocks(x[0])
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)      # any saving at all pays
    eager = epochs.assign_epochs(blocks, cal.copy(), 0, L.KIND_K)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 0)            # no saving is enough
    assert (epochs.assign_epochs(blocks, cal.copy(), 0, L.KIND_K) == 0).all()
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    monkeypatch.setattr(epochs, "MAX_EPOCHS", 2)
    capped = epochs.assign_epochs(blocks, cal.copy(), 0, L.KIND_K)
    assert eager.max() > 1 and capped.max() == 1 and (capped[np.argmax(capped > 0):] == 1).all()


def test_the_adapter_refuses_what_would_break_the_rule(drift):
    x, cal = drift
    adapter = epochs.Adapter(cal.copy(), 0, L.KIND_V)
    blocks = cache_blocks(x[0])
    with pytest.raises(InputError, match=f"a check is due after {epochs.ADAPT_EVERY}"):
        adapter.observe(blocks[:epochs.ADAPT_EVERY + 1])
    with pytest.raises(InputError, match="expected uint16 blocks"):
        adapter.observe(blocks[:2].astype(np.int32))
    with pytest.raises(InputError, match="kind must be 0"):
        epochs.Adapter(cal, 0, 2)
    with pytest.raises(CalibrationError, match="out of range"):
        epochs.Adapter(cal, 3, L.KIND_K)


# -- gaac stats models the lifecycle -----------------------------------------------------------------

def test_stats_codes_each_block_with_its_epoch_and_charges_the_epochs(drift):
    x, cal = drift
    adapted = measure(x, x, cal, segment_tokens=DRIFT_EVERY)
    fixed = measure(x, x, cal, adapt=False, segment_tokens=DRIFT_EVERY)
    assert cal.n_epochs(0, L.KIND_K) == 1, "measure must not append to the caller's calibration"
    learned = adapted.calibration
    for name, kind in (("k", L.KIND_K), ("v", L.KIND_V)):
        a, f = adapted.as_dict()[name], fixed.as_dict()[name]
        assert a["roundtrip"] and f["roundtrip"] and a["adapt"] and not f["adapt"]
        n_new = learned.n_epochs(0, kind) - 1
        assert a["epochs_appended"] == n_new >= 2 and f["epochs_appended"] == 0
        blocks = x.shape[2] // L.BLOCK_TOKENS
        charged = n_new * epochs.epoch_table_bytes(cal) + blocks * epochs.EPOCH_INDEX_BYTES
        assert a["resident_bits_per_element"]["epochs"] * a["tiles"] * L.geometry(HEAD_DIM).elements / 8 \
            == pytest.approx(charged)
        assert f["resident_bits_per_element"]["epochs"] == 0
        assert a["frac_raw"] < f["frac_raw"] / 2 and a["ratio_resident"] > f["ratio_resident"]
        segs = adapted.as_dict()["segments"][name]
        assert [s["tokens"] for s in segs] == [[0, 512], [512, 1024], [1024, 1536]]
        assert sum(s["epochs_appended"] for s in segs) == n_new and segs[0]["epochs_appended"] == 0
        assert sum(s["tiles"] for s in segs) == a["tiles"]
        fsegs = fixed.as_dict()["segments"][name]
        assert fsegs[0]["frac_raw"] < fsegs[1]["frac_raw"] < fsegs[2]["frac_raw"]       # the drift, unchecked
        assert segs[2]["frac_raw"] < fsegs[2]["frac_raw"] / 4                           # ... and followed

    # the learned calibration, saved and loaded, decodes the blocks of every epoch
    loaded = Calibration.from_dict(json.loads(json.dumps(learned.to_dict())))
    blocks = cache_blocks(x[0])
    got = epochs.assign_epochs(blocks, cal.copy(), 0, L.KIND_K)
    for j in (0, len(blocks) // 2, len(blocks) - 1):
        enc = gaac.encode_block(blocks[j], learned, 0, "k", epoch=int(got[j]))
        np.testing.assert_array_equal(gaac.decode_block(enc.data, loaded), blocks[j])


def test_stats_of_fitted_tokens_append_no_epoch_among_them_and_decide_after_them(drift):
    """``fitted_tokens``: the rule appends no epoch among the blocks the calibration was fitted on and decides
    from the blocks after them, as a cache appending them with ``fitted=True`` records; a token count that is not
    one is an InputError."""
    from gaac.cache import PagedKVCache
    from test_cache import assert_same_epochs

    x, cal = drift
    fitted = measure(x, x, cal, fitted_tokens=512, segment_tokens=512)
    cache = PagedKVCache(cal, max_blocks=x.shape[2] // L.BLOCK_TOKENS, grow=True)
    seq = cache.add_sequence(x[:, :, :512], x[:, :, :512], fitted=True)
    cache.append(seq, x[:, :, 512:], x[:, :, 512:])
    for name, kind in (("k", L.KIND_K), ("v", L.KIND_V)):
        segs = fitted.as_dict()["segments"][name]
        assert segs[0]["epochs_appended"] == 0 and sum(s["epochs_appended"] for s in segs) >= 2
    assert_same_epochs(fitted.calibration, cache.calibration)
    whole = measure(x, x, cal, fitted_tokens=x.shape[2])
    assert whole.as_dict()["k"]["epochs_appended"] == 0 and whole.calibration.n_epochs(0, L.KIND_K) == 1
    for bad in (-16, 1.5, True):
        with pytest.raises(InputError, match="fitted_tokens"):
            measure(x, x, cal, fitted_tokens=bad)


def test_segments_must_be_whole_blocks(drift):
    x, cal = drift
    with pytest.raises(InputError, match="multiple of 16"):
        measure(x, x, cal, segment_tokens=100)
    d = measure(x[:, :, :40], x[:, :, :40], cal, segment_tokens=16).as_dict()
    assert [s["tokens"] for s in d["segments"]["k"]] == [[0, 16], [16, 32]]


# -- the cache's view of epochs ------------------------------------------------------------------------

def test_layer_view_bases_of_either_form():
    b = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    common = dict(slots=(None, None), raw=(None, None), table=(None, None), capacity=(0, 0), tail_k=None,
                  tail_v=None, seq_lens=None, kv_heads=3, head_dim=64)
    flat = LayerView(b3=(b[0], b[0]), b4=(b[1], b[1]), **common)
    assert flat.epoch is None and flat.bases(L.KIND_V)[1] is flat.b4[L.KIND_V]
    with pytest.raises(InputError, match="only epoch 0"):
        flat.bases(L.KIND_K, 1)
    stacked = LayerView(b3=(b, b), b4=(b + 1, b + 1), epoch=(np.zeros((1, 4), np.int16),) * 2, **common)
    np.testing.assert_array_equal(stacked.bases(L.KIND_K, 1)[1], b[1] + 1)
    with pytest.raises(InputError, match="not in the view's 2 epochs"):
        stacked.bases(L.KIND_K, 2)


def test_blocks_the_calibration_was_fitted_on_append_no_epoch_and_leave_the_histogram_as_deciding_does(drift):
    """``decide=False`` (a prompt the calibration was fitted on): every block keeps the newest epoch, nothing is
    appended, and the adapter leaves with the histogram, count and pending blocks a deciding run leaves, so the
    checks after it decide as they would have from there."""
    x, cal = drift
    blocks = cache_blocks(x[0])
    deciding, fitted = epochs.Adapter(cal.copy(), 0, L.KIND_K), epochs.Adapter(cal.copy(), 0, L.KIND_K)
    decided = deciding.assign(blocks[:90])
    kept = fitted.assign(blocks[:90], decide=False)
    assert decided.max() >= 1                                 # the data drifts: deciding appends
    assert (kept == 0).all() and fitted.calibration.n_epochs(0, L.KIND_K) == 1
    assert fitted.finalized == deciding.finalized == 90
    assert np.array_equal(fitted.hist, deciding.hist)
    assert len(fitted._recent) == len(deciding._recent) == 90 % epochs.ADAPT_EVERY
    assert all(np.array_equal(a, b) for a, b in zip(fitted._recent, deciding._recent))
    # from there on it decides: the next check, past the drift, appends against epoch 0
    after = fitted.assign(blocks[90:])
    assert fitted.calibration.n_epochs(0, L.KIND_K) == 2 and (after == 0).all()
