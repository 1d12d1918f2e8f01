"""The sequence-container reader against hostile or unusual input: limits, buffers that change, containers that
state large counts, and arguments of the wrong kind (gaac.transfer, FORMAT.md section 11).

Every case is small: a synthetic calibration of a few layers, one KV head, head_dim 64.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

from gaac import transfer
from gaac.cache import transfer as cache_transfer
from gaac import layout as L
from gaac.cache import MAX_INDEXED_EPOCHS, PagedKVCache
from gaac.calibration import Calibration, epoch_canonical_bytes
from gaac.errors import CalibrationError, FormatError, InputError, PoolExhaustedError
from gaac.format.sequence import sequence_layout, write_head

ROOT = Path(__file__).resolve().parents[1]
B3, B4 = 120, 116


def calibration(layers: int = 2) -> Calibration:
    return Calibration(b3=np.full((2, layers, 1, 64), B3), b4=np.full((2, layers, 1, 64), B4),
                       capacity=np.full((2, layers), 32))


def bf16(layers: int, tokens: int, low: int, seed: int = 0) -> np.ndarray:
    """uint16 ``[layers, 1, tokens, 64]`` with exponents in ``low .. low + 7``, random signs and mantissas."""
    rng = np.random.default_rng(seed)
    e = rng.integers(low, low + 8, (layers, 1, tokens, 64))
    return ((rng.integers(0, 2, e.shape) << 15) | (e << 7) | rng.integers(0, 128, e.shape)).astype(np.uint16)


def with_epoch(cal: Calibration, b3: int, count: int = 1) -> Calibration:
    """A copy of ``cal`` with ``count`` epochs of layer 0 K appended, each with bases ``b3``, ``b3 - 4``."""
    out = cal.copy()
    for _ in range(count):
        out.add_epoch(0, L.KIND_K, np.full((1, 64), b3), np.full((1, 64), b3 - 4))
    return out


def epoch_container(tokens: int = 17) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A container whose layer 0 K blocks use an epoch 1 (bases 124 / 120): one epoch record."""
    source = PagedKVCache(with_epoch(calibration(), 124), max_blocks=4)
    k, v = bf16(2, tokens, 124), bf16(2, tokens, B3, seed=1)
    return bytes(source.export_sequence(source.add_sequence(k, v))), k, v


@contextlib.contextmanager
def within(seconds: int):
    """Fail instead of hanging when the code inside runs longer than ``seconds``."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def load_parts():
    """The container (un)packer of format_spec/vectors/sequence/make_sequence_vectors.py."""
    path = ROOT / "format_spec" / "vectors" / "sequence" / "make_sequence_vectors.py"
    spec = importlib.util.spec_from_file_location("make_sequence_vectors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Parts


# ----------------------------------------------------------------------------------------------
# Epochs past what a cache's int16 block-epoch index can name.

def test_an_import_past_the_indexed_epochs_is_refused_before_anything_is_written():
    data, k, _ = epoch_container()
    full = PagedKVCache(with_epoch(calibration(), 121, MAX_INDEXED_EPOCHS - 1), max_blocks=4, grow=True)
    store = full._store[0][L.KIND_K]
    before = (store.b3.shape, full.calibration.n_epochs(0, L.KIND_K), store.slots.size, store.raw.size)
    with pytest.raises(PoolExhaustedError, match=f"MAX_INDEXED_EPOCHS.*{MAX_INDEXED_EPOCHS}"):
        full.import_sequence(data)
    assert full.sequences == []
    assert (store.b3.shape, full.calibration.n_epochs(0, L.KIND_K), store.slots.size, store.raw.size) == before

    # one epoch fewer: the record becomes the last epoch the index names, and decodes with its own bases
    room = PagedKVCache(with_epoch(calibration(), 121, MAX_INDEXED_EPOCHS - 2), max_blocks=4)
    seq = room.import_sequence(data)
    assert room.calibration.n_epochs(0, L.KIND_K) == MAX_INDEXED_EPOCHS
    np.testing.assert_array_equal(room.read(seq)[0], k)


# ----------------------------------------------------------------------------------------------
# The caller's buffer is read once.

def test_a_buffer_changed_after_the_checks_does_not_change_the_import(monkeypatch):
    data, k, v = epoch_container()
    buffer = bytearray(data)
    c = transfer.read_head(data)
    tail = c.layout.body_offset + c.layout.sections[0].tail
    verdict = cache_transfer._BodyCheck.verdict

    def verdict_then_change(self):
        checked = verdict(self)
        buffer[tail:tail + 64] = bytes(64)         # the caller's buffer changes once the checks passed
        return checked

    monkeypatch.setattr(cache_transfer._BodyCheck, "verdict", verdict_then_change)
    cache = PagedKVCache(calibration(), max_blocks=4)
    seq = cache.import_sequence(buffer)
    got = cache.read(seq)
    np.testing.assert_array_equal(got[0], k)
    np.testing.assert_array_equal(got[1], v)


# ----------------------------------------------------------------------------------------------
# Counts a container states are checked before anything is allocated or looped over by them.

def test_a_container_of_65535_epoch_records_is_refused_in_bounded_time():
    Parts = load_parts()
    data, _, _ = epoch_container(tokens=16)
    parts = Parts.of(data)
    cal_id = parts.header[8]
    _, _, _, b3, b4 = parts.records[0]
    tables = (np.frombuffer(b3, np.uint8).reshape(1, 64), np.frombuffer(b4, np.uint8).reshape(1, 64))
    n = 0xFFFF
    records = tuple((e, 0, zlib.crc32(epoch_canonical_bytes(cal_id, 0, L.KIND_K, e, *tables)), b3, b4)
                    for e in range(1, n + 1))
    header = list(parts.header)
    header[9] = n
    bomb = parts._replace(header=tuple(header), records=records,
                          sections=((parts.sections[0][0], n, parts.sections[0][2]),) + parts.sections[1:]).pack()
    cache = PagedKVCache(calibration(), max_blocks=4, grow=True)
    with within(20), pytest.raises(FormatError, match="no block uses"):
        cache.import_sequence(bomb)
    assert cache.sequences == []


def test_unpack_of_many_layers_and_no_tokens_allocates_in_proportion(tmp_path):
    """A valid container of 4096 layers x 1 head x 0 tokens: unpack's cache keeps no per-layer epoch state (the
    container has no epoch records), so its memory stays small."""
    layers = 4096
    cal = calibration(layers)
    lay = sequence_layout(layers, 1, 64, 0, [32] * 2 * layers, [0] * 2 * layers, [[]] * 2 * layers, True)
    head = write_head(lay, cal.id, cal.canonical_bytes(), [])
    path = tmp_path / "layers.gaac"
    path.write_bytes(head + bytes(lay.nbytes - len(head)))
    script = textwrap.dedent(f"""
        import resource
        from gaac import transfer
        data = open({str(path)!r}, "rb").read()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        k, v = transfer.unpack(data)
        assert k.shape == v.shape == ({layers}, 1, 0, 64), k.shape
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 256, f"unpack grew by {out.stdout.split()[-1]} MiB"


def test_unpack_checks_the_calibration_before_it_sizes_a_cache(monkeypatch):
    import gaac.cache

    data, _, _ = epoch_container()
    other = calibration(layers=3)

    def no_cache(*args, **kwargs):
        raise AssertionError("a cache was made before the calibration was checked")

    monkeypatch.setattr(gaac.cache, "PagedKVCache", no_cache)
    with pytest.raises(CalibrationError, match="exported from a cache with calibration"):
        transfer.unpack(data, calibration=other)


# ----------------------------------------------------------------------------------------------
# Arguments of the wrong kind: typed errors that name the argument.

def strided(data: bytes) -> np.ndarray:
    a = np.zeros(2 * len(data), np.uint8)
    a[::2] = np.frombuffer(data, np.uint8)
    return a[::2]


@pytest.mark.parametrize("make", [strided, lambda d: memoryview(strided(d))], ids=["array", "memoryview"])
def test_a_strided_container_is_an_input_error(make):
    data, _, _ = epoch_container()
    cache = PagedKVCache(calibration(), max_blocks=4)
    for call in (transfer.read_head, cache.import_sequence, transfer.unpack):
        with pytest.raises(InputError, match="data"):
            call(make(data))
    assert cache.sequences == []


@pytest.mark.parametrize("make", [lambda n: np.zeros(2 * n, np.uint8)[::2],
                                  lambda n: memoryview(np.zeros(2 * n, np.uint8))[::2]], ids=["array", "memoryview"])
def test_export_into_a_strided_buffer_is_an_input_error(make):
    source = PagedKVCache(calibration(), max_blocks=4)
    seq = source.add_sequence(bf16(2, 17, B3), bf16(2, 17, B3, seed=1))
    n = transfer.exported_layout(source, seq).nbytes
    with pytest.raises(InputError, match="out"):
        source.export_sequence(seq, out=make(n))


def test_a_calibration_that_is_not_one_is_an_input_error():
    k = bf16(2, 17, B3)
    with pytest.raises(InputError, match="calibration"):
        transfer.pack(k, k, calibration=json.loads(json.dumps(calibration().to_dict())))
    data = bytes(transfer.pack(k, k, calibration=calibration()))
    with pytest.raises(InputError, match="calibration"):
        transfer.unpack(data, calibration={"layers": 2})
    assert struct.unpack_from("<7s", data)[0] == L.SEQUENCE_MAGIC
