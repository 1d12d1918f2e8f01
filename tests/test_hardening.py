"""Bad input is refused with a typed error that names the problem, never a stray exception or a wrong answer.

Each test feeds one kind of malformed input -- a file, a calibration, an argument, a view,
concurrent calls -- and checks the exact error class and what its message names, or, where the
input is valid after all, that the result is bit-exact.
"""
import json
import struct

import numpy as np
import pytest

import gaac
from gaac.calibration import Calibration, calibrate
from gaac.errors import CalibrationError, FormatError, GAACError, InputError
from gaac.io import load_cache, load_sample


@pytest.fixture(scope="module")
def sample():
    """Two layers, two KV heads and 64 tokens of the shipped prose sample, and a calibration on it."""
    k, v, _ = load_sample("prose")
    k, v = np.ascontiguousarray(k[:2, :2, :64]), np.ascontiguousarray(v[:2, :2, :64])
    return k, v, calibrate(k, v)


# -- calibration files -------------------------------------------------------------------------------

@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe\x00{}", "not a UTF-8 text file"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_calibration_load_refuses_undecodable_files(tmp_path, content, message):
    path = tmp_path / "cal.json"
    path.write_bytes(content)
    with pytest.raises(CalibrationError, match=message):
        Calibration.load(path)


@pytest.mark.parametrize("notes", [[1, 2], "free text", 3])
def test_calibration_notes_must_be_an_object(sample, tmp_path, notes):
    d = sample[2].to_dict()
    d["notes"] = notes
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CalibrationError, match="notes must be an object"):
        Calibration.load(path)
    with pytest.raises(CalibrationError, match="notes must be an object"):
        Calibration(b3=sample[2].b3, b4=sample[2].b4, capacity=sample[2].capacity, notes=notes)


def test_calibration_notes_absent_or_null_load_as_none(sample, tmp_path):
    d = sample[2].to_dict()
    for notes in (None, "absent"):
        if notes == "absent":
            del d["notes"]
        else:
            d["notes"] = notes
        cal = Calibration.from_dict(d)
        assert cal.notes == {} and cal.copy().id == sample[2].id


def test_fp8_calibration_notes_must_be_an_object(sample):
    from gaac.fp8 import calibrate_fp8

    d = calibrate_fp8(sample[0], sample[1], "e4m3").to_dict()
    d["notes"] = ["x"]
    with pytest.raises(CalibrationError, match="notes must be an object"):
        Calibration.from_dict(d)


@pytest.mark.parametrize("value", [121.5, 2 ** 70, True, "121", None])
def test_fp8_calibration_tables_hold_integers_only(sample, value):
    from gaac.fp8 import calibrate_fp8

    d = calibrate_fp8(sample[0], sample[1], "e4m3").to_dict()
    d["k"]["b_narrow"][0][0][0] = value                 # neither rounded (121.5, True) nor overflowing (2**70)
    with pytest.raises(CalibrationError, match="b_narrow|malformed"):
        Calibration.from_dict(d)


@pytest.mark.parametrize("which", ["bf16", "fp8"])
def test_calibrate_refuses_caches_without_kv_heads(which):
    from gaac.fp8 import calibrate_fp8

    x = np.zeros((1, 0, 16, 64), np.uint16)
    run = (lambda: calibrate(x, x)) if which == "bf16" else (lambda: calibrate_fp8(x, x, "e4m3"))
    with pytest.raises(CalibrationError, match="at least one layer and one KV head"):
        run()


def test_calibrate_fp8_refuses_an_unsupported_head_dim():
    from gaac.fp8 import calibrate_fp8

    x = np.zeros((1, 1, 16, 48), np.uint16)
    with pytest.raises(InputError, match="48"):
        calibrate_fp8(x, x, "e4m3")


@pytest.mark.parametrize("kind", [np.array([0, 1]), np.array([0]), np.array(1), [0], 0.0, True])
def test_encode_block_refuses_a_kind_that_is_not_k_or_v(sample, kind):
    with pytest.raises(InputError, match="kind must be 'k' or 'v'"):
        gaac.encode_block(sample[0][0, :, :16], sample[2], 0, kind)


def test_encode_block_takes_numpy_integer_kinds(sample):
    block = gaac.encode_block(sample[1][1, :, 16:32], sample[2], 1, np.int64(1))
    assert (gaac.decode_block(block.data, sample[2]) == sample[1][1, :, 16:32]).all()


# -- cache files ---------------------------------------------------------------------------------------

def _safetensors(path, header: dict, body: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return path


def test_empty_npy_is_an_input_error(tmp_path):
    (tmp_path / "k.npy").write_bytes(b"")
    with pytest.raises(InputError, match="not a plain NumPy array file"):
        load_cache(tmp_path / "k.npy", "k")


def test_npz_archive_named_npy_is_an_input_error(tmp_path):
    np.savez(tmp_path / "k.npz", k=np.zeros((1, 1, 16, 64), np.uint16))
    (tmp_path / "k.npz").rename(tmp_path / "k.npy")
    with pytest.raises(InputError, match="archive"):
        load_cache(tmp_path / "k.npy", "k")


def _npy_with_header(path, header: str, body: bytes = b""):
    raw = header.encode("latin1")
    raw += b" " * (-(10 + len(raw) + 1) % 64) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(raw)) + raw + body)
    return path


@pytest.mark.parametrize("header, body, message", [
    ("{'descr': '<u2', 'fortran_order': False, 'shape': (1, 1, 16, 64(, }", b"", "not a plain NumPy array"),
    ("{'descr': '<u2', 'fortran_order': False, 'shape': (1099511627776, 1099511627776, 16, 64), }", b"",
     "declares"),
    ("{'descr': '<u2', 'fortran_order': False, 'shape': (1, 1, 16, 64), }", b"\0" * 100, "declares"),
    ("{'descr': '<u2', 'fortran_order': False, 'shape': (1, 1, 16, 64), }", b"\0" * 4096, "declares"),
    ("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", b"\0" * 8, "Python objects"),
], ids=["unparsable", "terabytes", "truncated", "padded", "objects"])
def test_npy_with_a_broken_or_false_header_is_an_input_error(tmp_path, header, body, message):
    with pytest.raises(InputError, match=message):
        load_cache(_npy_with_header(tmp_path / "k.npy", header, body), "k")


def test_npy_padded_header_still_loads(tmp_path):
    x = np.arange(16 * 64, dtype=np.uint16).reshape(1, 1, 16, 64)
    path = _npy_with_header(tmp_path / "k.npy", "{'descr': '<u2', 'fortran_order': False, 'shape': (1, 1, 16, 64), }",
                            x.tobytes())
    assert (load_cache(path, "k") == x).all()


BODY = np.arange(16 * 64, dtype=np.uint16).tobytes()


@pytest.mark.parametrize("entry, message", [
    ({"dtype": ["BF16"], "shape": [1, 1, 16, 64], "data_offsets": [0, 2048]}, "dtype .* is not a string"),
    ({"dtype": "BF16", "shape": [1, 1, 16, 64], "data_offsets": ["0", "2048"]}, "data_offsets"),
    ({"dtype": "BF16", "shape": [1, 1, 16, 64], "data_offsets": [0.0, 2048.0]}, "data_offsets"),
    ({"dtype": "BF16", "shape": [1, 1, 16, 64], "data_offsets": [0]}, "data_offsets"),
    ({"dtype": "BF16", "shape": [1, 1, 16, 64], "data_offsets": [-2048, 0]}, "data_offsets"),
    ({"dtype": "BF16", "shape": [-1, -1, 16, 64], "data_offsets": [0, 2048]}, "shape"),
    ({"dtype": "BF16", "shape": [1.0, 1, 16, 64], "data_offsets": [0, 2048]}, "shape"),
    ({"dtype": "BF16", "shape": [True, 1, 16, 64], "data_offsets": [0, 2048]}, "shape"),
    ({"dtype": "BF16", "shape": "1,1,16,64", "data_offsets": [0, 2048]}, "shape"),
    ({"dtype": "BF16", "shape": [2 ** 40, 2 ** 40, 16, 64], "data_offsets": [0, 2048]}, "do not hold"),
    ({"dtype": "BF16", "shape": [1, 1, 16, 64]}, "malformed safetensors entry"),
    (7, "malformed safetensors entry"),
])
def test_malformed_safetensors_headers_are_input_errors(tmp_path, entry, message):
    path = _safetensors(tmp_path / "k.safetensors", {"k": entry}, BODY)
    with pytest.raises(InputError, match=message):
        load_cache(path, "k")


def test_deeply_nested_safetensors_header_is_an_input_error(tmp_path):
    raw = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "k.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(InputError, match="nested too deeply"):
        load_cache(path, "k")


def test_well_formed_safetensors_still_loads_bit_exact(tmp_path):
    path = _safetensors(tmp_path / "k.safetensors",
                        {"__metadata__": {"a": "b"}, "k": {"dtype": "BF16", "shape": [1, 1, 16, 64],
                                                          "data_offsets": [0, 2048]}}, BODY)
    assert (load_cache(path, "k").reshape(-1) == np.frombuffer(BODY, np.uint16)).all()


def test_torch_file_refusals_are_one_line(tmp_path):
    import fractions

    torch = pytest.importorskip("torch")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file at all")
    torch.save({"k": fractions.Fraction(1, 3)}, tmp_path / "object.pt")     # weights_only refuses it at length
    torch.save({"a": torch.zeros(1), 3: torch.zeros(1)}, tmp_path / "keys.pt")  # keys that do not sort together
    for name, message in (("junk.pt", "not a torch tensor file"), ("object.pt", "not a torch tensor file"),
                          ("keys.pt", "holds tensors")):
        with pytest.raises(InputError, match=message) as info:
            load_cache(tmp_path / name, "k")
        assert "\n" not in str(info.value) and "weights_only" not in str(info.value)


# -- the gaac command: one line on stderr, exit status 2 -----------------------------------------------

def _cli(capsys, *argv):
    from gaac.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc, err, *needles):
    assert rc == 2
    assert err.startswith("gaac: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.fixture(scope="module")
def cache_files(tmp_path_factory, sample):
    d = tmp_path_factory.mktemp("files")
    np.save(d / "k.npy", sample[0])
    np.save(d / "v.npy", sample[1])
    return d


@pytest.mark.parametrize("blocked, argv, extra", [
    ("torch", ["capture", "--text", "hello"], "gaac[torch]"),
    ("transformers", ["capture", "--text", "hello"], "gaac[hf]"),
    ("torch", ["stats", "--k", "{d}/k.pt", "--v", "{d}/v.npy"], "gaac[torch]"),
    ("matplotlib", ["stats", "--k", "{d}/k.npy", "--v", "{d}/v.npy", "--plot", "{d}/x.png"], "gaac[plot]"),
])
def test_commands_without_their_optional_package_name_the_extra(capsys, monkeypatch, cache_files, blocked, argv,
                                                                  extra):
    (cache_files / "k.pt").write_bytes(b"")            # never read: torch is missing
    monkeypatch.setitem(__import__("sys").modules, blocked, None)       # `import blocked` now fails
    rc, _, err = _cli(capsys, *(a.format(d=cache_files) for a in argv))
    _one_line_error(rc, err, f"pip install '{extra}'")


@pytest.mark.parametrize("name", ["x.unknownext", "x"])
def test_stats_plot_path_of_no_known_image_type(capsys, cache_files, name):
    pytest.importorskip("matplotlib")
    rc, out, err = _cli(capsys, "stats", "--k", str(cache_files / "k.npy"), "--v", str(cache_files / "v.npy"),
                        "--plot", str(cache_files / name))
    _one_line_error(rc, err, "--plot", "image type", ".png")
    assert out == "" and not (cache_files / name).exists()


def test_torch_refusal_in_the_command_is_one_line(capsys, cache_files):
    import fractions

    torch = pytest.importorskip("torch")
    torch.save({"k": fractions.Fraction(1, 3)}, cache_files / "object.pt")
    rc, _, err = _cli(capsys, "stats", "--k", str(cache_files / "object.pt"), "--v", str(cache_files / "v.npy"))
    _one_line_error(rc, err, "object.pt", "not a torch tensor file")


@pytest.mark.parametrize("write, argv, needle", [
    (lambda d: (d / "bad.json").write_bytes(b"\xff\xfe"), ["--calibration", "{d}/bad.json"], "not a UTF-8"),
    (lambda d: (d / "deep.json").write_bytes(b"[" * 100_000 + b"]" * 100_000), ["--calibration", "{d}/deep.json"],
     "nested too deeply"),
    (lambda d: (d / "e.npy").write_bytes(b""), ["--k", "{d}/e.npy", "--v", "{d}/v.npy"], "e.npy"),
    (lambda d: _safetensors(d / "s.safetensors", {"k": {"dtype": "BF16", "shape": [-1], "data_offsets": [0, 2]}}),
     ["--k", "{d}/s.safetensors", "--v", "{d}/v.npy"], "shape"),
])
def test_untyped_failures_of_files_are_one_line_in_the_command(capsys, cache_files, write, argv, needle):
    write(cache_files)
    files = [] if "--k" in argv else ["--k", str(cache_files / "k.npy"), "--v", str(cache_files / "v.npy")]
    rc, _, err = _cli(capsys, "stats", *files, *(a.format(d=cache_files) for a in argv))
    _one_line_error(rc, err, needle)


# -- the paged cache -----------------------------------------------------------------------------------

@pytest.fixture
def cache(sample):
    pytest.importorskip("torch")
    k, v, cal = sample
    c = gaac.PagedKVCache(cal, max_seqs=3)
    c.add_sequence(k[:, :, :20], v[:, :, :20])
    return c


@pytest.mark.parametrize("seq", [True, False, np.True_, 0.0, 0.7, "0", None, [0]])
def test_sequence_ids_must_be_integers(cache, sample, seq):
    k, v, _ = sample
    before = cache.read(0)
    for call in (lambda: cache.append(seq, k[:, :, :1], v[:, :, :1]), lambda: cache.remove_sequence(seq),
                 lambda: cache.seq_len(seq), lambda: cache.read(seq),
                 lambda: cache.update_layer(0, [seq], k[:1, :, :1], v[:1, :, :1]),
                 lambda: cache.read_layer(0, [seq])):
        with pytest.raises(InputError, match="sequence"):
            call()
    after = cache.read(0)
    assert all((a == b).all() for a, b in zip(before, after)) and cache.sequences == [0]


def test_update_layer_takes_integer_ids_of_any_kind(cache, sample):
    import torch

    k, v, _ = sample
    for n, seqs in enumerate(([np.int64(0)], np.array([0]), torch.tensor([0])), start=21):
        cache.update_layer(0, seqs, k[:1, :, n - 1:n], v[:1, :, n - 1:n])
        cache.update_layer(1, seqs, k[1:2, :, n - 1:n], v[1:2, :, n - 1:n])
        got_k, got_v = cache.read(0)
        assert got_k.shape[2] == n and (got_k == k[:, :, :n]).all() and (got_v == v[:, :, :n]).all()
    with pytest.raises(InputError, match="seqs"):
        cache.update_layer(0, 0, k[:1, :, 23:24], v[:1, :, 23:24])


def test_negative_stride_arrays_are_appended_bit_exact(cache, sample):
    k, v, _ = sample
    rk, rv = k[:, :, ::-1], v[:, :, ::-1]                   # reversed views: negative strides
    seq = cache.add_sequence(rk[:, :, :40], rv[:, :, :40])
    cache.append(seq, rk[:, :, 40:45], rv[:, :, 40:45])
    got_k, got_v = cache.read(seq)
    assert (got_k == rk[:, :, :45]).all() and (got_v == rv[:, :, :45]).all()


def test_meta_and_sparse_tensors_are_refused(cache, sample):
    import torch

    k, v, _ = sample
    meta = torch.empty((2, 2, 1, 64), dtype=torch.bfloat16, device="meta")
    with pytest.raises(InputError, match="meta"):
        cache.append(0, meta, v[:, :, 20:21])
    sparse = torch.from_numpy(k[:, :, 20:21].view(np.int16)).to_sparse()
    with pytest.raises(InputError, match="sparse"):
        cache.append(0, sparse, v[:, :, 20:21])
    assert cache.seq_len(0, 0) == cache.seq_len(0, 1) == 20


def test_tensors_that_require_grad_are_appended(cache, sample):
    import torch

    k, v, _ = sample
    kt = torch.from_numpy(k[:, :, 20:22].view(np.int16)).view(torch.bfloat16).float().bfloat16().requires_grad_()
    cache.append(0, kt, v[:, :, 20:22])
    assert (cache.read(0)[0] == k[:, :, :22]).all()


def _calibration_with_epochs(cal, layer: int, kind: int, n: int):
    """``cal`` with ``n`` epochs of one layer and kind: epoch ``e``'s bases are the calibration's, shifted
    by ``e % 3`` (so that an epoch confused for another decodes to other values)."""
    b3, b4 = cal.bases(layer, kind)
    tables = [(np.minimum(b3 + e % 3, 248), np.minimum(b4 + e % 3, 240)) for e in range(1, n)]
    return Calibration(b3=cal.b3, b4=cal.b4, capacity=cal.capacity, model=cal.model,
                       epochs={(kind, layer): tables})


def test_cache_refuses_more_epochs_than_its_int16_index_names(sample):
    from gaac.cache import MAX_INDEXED_EPOCHS

    pytest.importorskip("torch")
    k, v, cal = sample
    over = _calibration_with_epochs(cal, 1, 0, MAX_INDEXED_EPOCHS + 1)
    with pytest.raises(CalibrationError, match=f"{MAX_INDEXED_EPOCHS + 1} epochs.*int16"):
        gaac.PagedKVCache(over)
    # Without adaptation only epoch 0 codes blocks: the calibration is fine there.
    plain = gaac.PagedKVCache(over, adapt=False)
    seq = plain.add_sequence(k, v)
    assert (plain.read(seq)[0] == k).all()


def test_cache_codes_with_the_highest_epoch_its_index_names(sample):
    from gaac.cache import MAX_INDEXED_EPOCHS

    pytest.importorskip("torch")
    k, v, cal = sample
    full = _calibration_with_epochs(cal, 1, 0, MAX_INDEXED_EPOCHS)
    cache = gaac.PagedKVCache(full)
    seq = cache.add_sequence(k, v)
    assert int(cache.layer_view(1).epoch[0][seq, 0]) == MAX_INDEXED_EPOCHS - 1
    got_k, got_v = cache.read(seq)
    assert (got_k == k).all() and (got_v == v).all()


def test_four_threads_on_one_cache(sample):
    """Four threads add, append to, read and remove sequences of one cache with adaptation on: no
    exception, every sequence reads back bit-exact, and removing them all returns every pool record."""
    import sys
    import threading

    pytest.importorskip("torch")
    k_all, v_all, _ = load_sample("prose")
    k_all, v_all = k_all[:2], v_all[:2]                  # 2 layers, 3 KV heads, 768 tokens
    cal = calibrate(k_all[:, :, :256], v_all[:, :, :256])
    cache = gaac.PagedKVCache(cal, max_seqs=4, max_blocks=48)
    assert cache.adapt
    errors, seqs = [], {}
    start = threading.Barrier(4)

    def worker(w):
        try:
            lo = 192 * w                                     # each thread its own stretch of the sample
            k, v = k_all[:, :, lo:lo + 192], v_all[:, :, lo:lo + 192]
            start.wait()
            seq = cache.add_sequence(k[:, :, :5], v[:, :, :5])
            t = 5
            for step in (1, 7, 16, 3, 30, 1, 17, 40, 2, 9, 50, 11):
                cache.append(seq, k[:, :, t:t + step], v[:, :, t:t + step])
                t += step
                got = cache.read(seq)
                assert (got[0] == k[:, :, :t]).all() and (got[1] == v[:, :, :t]).all()
            seqs[w] = (seq, k, v)
        except BaseException as exc:            # reported by the main thread
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)                  # switch threads often: races show up within a few calls
    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert sorted(s for s, _, _ in seqs.values()) == [0, 1, 2, 3]
    for seq, k, v in seqs.values():
        got = cache.read(seq)
        assert (got[0] == k).all() and (got[1] == v).all()
    assert cache.calibration.n_epochs(0, 0) >= 1
    for seq, _, _ in seqs.values():
        cache.remove_sequence(seq)
    report = cache.memory()
    assert report.slot_bytes == 0 and report.raw_bytes == 0 and report.tokens == 0
    free = [len(p.free) == p.size for layer in map(cache.stores, range(cache.layers)) for store in layer for p in (store.slots, store.raw)]
    assert all(free)


def test_cache_copies_get_a_lock_of_their_own(cache, sample):
    import copy

    twin = copy.deepcopy(cache)
    assert twin.lock is not cache.lock
    k, v, _ = sample
    twin.append(0, k[:, :, 20:21], v[:, :, 20:21])
    assert twin.seq_len(0) == 21 and cache.seq_len(0) == 20


# -- decode attention: the CPU path and the fused kernel (simulated here) -------------------------------

def _view_and_q(sample, lens=(40, 20), max_blocks=None, seed=0):
    """A compressed view of layer 0, KV head 0 of the sample, sequences of ``lens`` tokens, and a query of
    2 heads (one KV head keeps the simulated kernel quick)."""
    from gaac.attention import float_to_bf16
    from gaac.testing import view_from_dense

    k, v, cal = sample
    ks = [np.ascontiguousarray(k[0, :1, :n]) for n in lens]
    vs = [np.ascontiguousarray(v[0, :1, :n]) for n in lens]
    view = view_from_dense(ks, vs, (cal.b3[0, 0, :1], cal.b3[1, 0, :1]), (cal.b4[0, 0, :1], cal.b4[1, 0, :1]),
                           (int(cal.capacity[0, 0]), int(cal.capacity[1, 0])), max_blocks=max_blocks)
    rng = np.random.default_rng(seed)
    q = float_to_bf16(rng.standard_normal((len(lens), 2, 64)).astype(np.float32))
    return view, q


def _replace(view, **arrays):
    import dataclasses

    return dataclasses.replace(view, **arrays)


BACKENDS = ("cpu", "cuda")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lens, message", [([-5, 20], "non-negative"), ([40, -1], "non-negative"),
                                           ([400, 20], "block table holds")])
def test_seq_lens_outside_the_table_are_refused(sample, backend, lens, message):
    view, q = _view_and_q(sample)
    with pytest.raises(InputError, match=message):
        gaac.decode_attention(q, _replace(view, seq_lens=np.array(lens, np.int32)), backend=backend)


@pytest.mark.parametrize("backend, kind, raw", [("cpu", 0, False), ("cpu", 1, False), ("cpu", 0, True),
                                                ("cpu", 1, True), ("cuda", 0, False), ("cuda", 1, True)])
def test_a_table_entry_past_its_pool_is_a_format_error(sample, backend, kind, raw):
    view, q = _view_and_q(sample)
    table = [t.copy() for t in view.table]
    pool = view.raw[kind] if raw else view.slots[kind]
    entry = np.uint32(len(pool) + 7) | (np.uint32(L_RAW) if raw else np.uint32(0))
    table[kind][1, 0, 0] = entry.view(np.int32)
    with pytest.raises(FormatError, match="past"):
        gaac.decode_attention(q, _replace(view, table=tuple(table)), backend=backend)


L_RAW = 0x80000000


def test_kernel_flags_entries_past_its_pools_in_the_status_word(sample):
    from gaac.attention import AttentionPlan
    from gaac.cuda import attention as K

    view, q = _view_and_q(sample)
    table = [t.copy() for t in view.table]
    table[1][0, 1, 0] = np.int32(2 ** 31 - 1)                # a slot index far past the V slot pool
    plan = AttentionPlan(_replace(view, table=tuple(table)), 2)
    plan.run(q)
    assert int(plan.status[0]) == K.STATUS_BAD_ENTRY
    with pytest.raises(FormatError, match=r"\(layer 3, sequence 0\).*past its slot or raw-tile pool"):
        plan.check_status(layer=3, seqs=[0])


def test_kernel_reads_no_empty_pool(sample):
    """An empty raw pool (a cache whose tiles all fit) with an entry pointing into it: flagged, not read."""
    from gaac.attention import AttentionPlan

    view, q = _view_and_q(sample)
    assert all((t >= 0).all() for t in view.table)           # every tile of this view fits its slot
    raw = tuple(r[:0] for r in view.raw)
    plan = AttentionPlan(_replace(view, raw=raw), 2)
    plan.run(q)
    assert int(plan.status[0]) == 0
    table = [t.copy() for t in view.table]
    table[0][0, 0, 0] = np.int32(-2 ** 31)                   # raw tile 0 of an empty pool
    with pytest.raises(FormatError, match="past its slot or raw-tile pool"):
        gaac.decode_attention(q, _replace(view, raw=raw, table=tuple(table)), backend="cuda")


def test_plain_kernel_flags_entries_past_its_raw_pool(sample):
    from gaac.attention import AttentionPlan
    from gaac.testing import plain_view

    k, _, _ = sample
    ks = [np.ascontiguousarray(k[0, :1, :n]) for n in (40, 20)]
    view = plain_view(ks, ks)
    _, q = _view_and_q(sample)
    table = [t.copy() for t in view.table]
    table[0][0, 1, 0] = np.int32(len(view.raw[0]))           # a slot-flagged entry: the plain kernel reads raw
    plan = AttentionPlan(_replace(view, table=tuple(table)), 2, plain=True)
    plan.run(q)
    with pytest.raises(FormatError, match="past its slot or raw-tile pool"):
        plan.check_status()


@pytest.mark.parametrize("backend", BACKENDS)
def test_entries_of_the_tail_block_are_never_read(sample, backend):
    """The table row of a sequence's unfinished block may hold anything (a freed sequence's old entries)."""
    view, q = _view_and_q(sample, lens=(40, 20), max_blocks=4)
    table = [t.copy() for t in view.table]
    for t in table:
        t[0, 2:] = np.int32(2 ** 31 - 1)                     # blocks 2, 3 of sequence 0: its tail and beyond
        t[1, 1:] = np.int32(-1)
    clean = gaac.decode_attention(q, view, backend=backend)
    assert (gaac.decode_attention(q, _replace(view, table=tuple(table)), backend=backend) == clean).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("corrupt, message", [("tag", "reserved mode tag 3"), ("escapes", "more escape bytes")])
def test_one_shot_attention_raises_on_a_corrupt_slot(sample, backend, corrupt, message):
    from gaac import layout as L

    view, q = _view_and_q(sample)
    slots = view.slots[0].copy()
    geo = L.geometry(64)
    if corrupt == "tag":
        slots[:, geo.tag_offset] |= 0x03                     # group 0 of every K slot: the reserved tag
    else:
        slots[:, geo.tag_offset:geo.escape_offset] = 0xAA    # every group raw: 5 escape bytes each
    cpu_message = {"tag": "reserved", "escapes": "escape bytes but the slot holds"}[corrupt]
    with pytest.raises(FormatError, match=message if backend == "cuda" else cpu_message):
        gaac.decode_attention(q, _replace(view, slots=(slots, view.slots[1])), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stacked_bases_without_block_epochs_are_refused(sample, backend):
    view, q = _view_and_q(sample)
    b3 = tuple(np.stack([b, b]) for b in view.b3)
    b4 = tuple(np.stack([b, b]) for b in view.b4)
    with pytest.raises(InputError, match="no block epochs"):
        gaac.decode_attention(q, _replace(view, b3=b3, b4=b4), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view", [None, "view", {"seq_lens": [1]}])
def test_attention_needs_a_layer_view(sample, backend, view):
    _, q = _view_and_q(sample)
    with pytest.raises(InputError, match="LayerView"):
        gaac.decode_attention(q, view, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1j, "0.1", float("nan"), float("inf"), True, [0.1]])
def test_attention_scale_must_be_a_finite_real(sample, backend, scale):
    view, q = _view_and_q(sample)
    with pytest.raises(InputError, match="scale"):
        gaac.decode_attention(q, view, scale=scale, backend=backend)


def test_attention_takes_numpy_and_integer_scales(sample):
    view, q = _view_and_q(sample)
    a = gaac.decode_attention(q, view, scale=np.float32(0.125), backend="cpu")
    assert (a == gaac.decode_attention(q, view, scale=0.125, backend="cpu")).all()
    assert (gaac.decode_attention(q, view, scale=1, backend="cpu")
            == gaac.decode_attention(q, view, scale=1.0, backend="cpu")).all()
    assert not (a == gaac.decode_attention(q, view, scale=1.0, backend="cpu")).all()


def test_status_error_names_every_bit_and_where():
    from gaac.attention import status_error
    from gaac.cuda import attention as K
    from gaac.cuda import tile_decoder as D

    assert status_error(0) is None
    bits = D.STATUS_BAD_TAG | D.STATUS_BAD_ESCAPES | K.STATUS_BAD_EPOCH | K.STATUS_BAD_ENTRY
    assert len({D.STATUS_BAD_TAG, D.STATUS_BAD_ESCAPES, K.STATUS_BAD_EPOCH, K.STATUS_BAD_ENTRY}) == 4
    text = str(status_error(bits | 64, layer=7, seqs=[2, 5]))
    for needle in ("layer 7", "sequences [2, 5]", "reserved mode tag 3", "more escape bytes", "epoch",
                   "past its slot or raw-tile pool", "unknown status bits 0x40"):
        assert needle in text, text
    assert "sequence 4" in str(status_error(K.STATUS_BAD_ENTRY, seqs=4))
    assert isinstance(status_error(D.STATUS_BAD_TAG), FormatError)


@pytest.mark.parametrize("layer", [True, np.True_, 1.0, "1"])
def test_layer_numbers_must_be_integers(cache, sample, layer):
    k, v, _ = sample
    for call in (lambda: cache.update_layer(layer, [0], k[1:2, :, 20:21], v[1:2, :, 20:21]),
                 lambda: cache.read_layer(layer, [0]), lambda: cache.seq_len(0, layer),
                 lambda: cache.layer_view(layer)):
        with pytest.raises(InputError, match="layer"):
            call()
    assert cache.seq_len(0, 1) == 20


@pytest.mark.parametrize("option", ["max_seqs", "max_blocks", "slots", "raw_tiles"])
def test_cache_sizes_must_be_integers(sample, option):
    pytest.importorskip("torch")
    with pytest.raises(InputError, match=option):
        gaac.PagedKVCache(sample[2], **{option: True})
