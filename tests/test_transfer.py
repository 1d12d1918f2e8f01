"""gaac.transfer: a sequence leaves a paged cache as a sequence container (FORMAT.md 11) and re-enters any cache
with the same calibration bit for bit; a wrong calibration or a corrupt container is a typed error and leaves the
cache as it was."""
import contextlib
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import gaac
from strategies import drifting
from test_spec import _struct_fields, table as spec_table
from gaac import layout as L
from gaac import transfer
from gaac.cache import transfer as cache_transfer
from gaac.cache import PagedKVCache
from gaac.calibration import Calibration, calibrate
from gaac.errors import CalibrationError, FormatError, InputError, PoolExhaustedError
from gaac.io import load_sample

B = L.BLOCK_TOKENS
SPEC_RULES = {row["id"]: row for row in spec_table("sequence-reject")}
SPEC_TEXT = (Path(__file__).resolve().parents[1] / "format_spec" / "FORMAT.md").read_text()


@pytest.fixture(scope="module")
def real():
    k, v, _ = load_sample("prose")
    ck, cv, _ = load_sample("code")
    return k, v, calibrate(ck, cv)


@contextlib.contextmanager
def breaks(rule: str, match: str | None = None):
    """The code inside raises the error class of rule ``rule`` of FORMAT.md 11.7, with its message phrase (and
    ``match``)."""
    row = SPEC_RULES[rule]
    with pytest.raises({"FormatError": FormatError, "CalibrationError": CalibrationError}[row["class"]],
                       match=match) as info:
        yield
    assert any(p.strip() in str(info.value) for p in row["reference message contains"].split(";")), \
        (str(info.value), row)


def snapshot(cache):
    """What a failed import must leave alone: contents, sizes, epochs and lengths."""
    return ({s: cache.read(s) for s in cache.sequences}, cache.memory(),
            [[cache.calibration.n_epochs(layer, kind) for kind in (0, 1)] for layer in range(cache.layers)],
            cache._lens.copy(), cache.blocks_encoded)


def assert_unchanged(cache, before):
    after = snapshot(cache)
    assert after[1:3] == before[1:3] and after[4] == before[4]
    np.testing.assert_array_equal(after[3], before[3])
    assert after[0].keys() == before[0].keys()
    for s in before[0]:
        for a, b in zip(after[0][s], before[0][s]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("tokens", [0, 5, 16, 333, 768])
@pytest.mark.parametrize("adapt", [True, False])
def test_roundtrip_is_bit_exact_and_needs_no_encoding(real, tokens, adapt):
    k, v, cal = real
    # A calibration from another prompt's 256 tokens overflows many tiles: room for every one in the arena.
    source = PagedKVCache(cal, max_seqs=2, max_blocks=48, adapt=adapt, raw_tiles=2 * 48 * cal.kv_heads * 2 * cal.layers)
    source.add_sequence(k[:, :, :7], v[:, :, :7])                   # another sequence: other pool positions
    seq = source.add_sequence(k[:, :, :tokens], v[:, :, :tokens])
    data = source.export_sequence(seq)
    assert isinstance(data, memoryview) and data.readonly

    target = PagedKVCache(cal, max_blocks=48, raw_tiles=200 * 2 * cal.layers, adapt=adapt)
    got = target.import_sequence(data)
    assert target.blocks_encoded == 0                              # copied, never encoded
    for a, b, want in zip(target.read(got), source.read(seq), (k[:, :, :tokens], v[:, :, :tokens])):
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b, want)
    assert bytes(target.export_sequence(got)) == bytes(data)       # the container is canonical
    # the bytes moved are the resident bytes: slots, raw tiles, table entries, epochs and the tail tokens
    m = target.memory()
    sections, blocks, tiles = 2 * cal.layers, tokens // B, tokens // B * cal.kv_heads
    unused_tail = sections * (B - tokens % B) * cal.kv_heads * cal.head_dim * 2     # the cache holds 16 a tail
    padding = sections * (-(4 * tiles) % 16 + -(2 * blocks) % 16)
    epoch_index = 0 if adapt else sections * 2 * blocks                             # counted only with epochs
    body = transfer.read_head(data).layout.body_bytes
    assert body == m.resident_bytes - unused_tail + padding + epoch_index
    assert len(data) - body <= 64 + 8 * sections + 4 + 15                          # header, records, CRCs


def test_the_container_decodes_attention_alike(real):
    k, v, cal = real
    source = PagedKVCache(cal, max_blocks=48)
    seq = source.add_sequence(k[:, :, :300], v[:, :, :300])
    target = PagedKVCache(cal, max_blocks=48)
    target.import_sequence(source.export_sequence(seq))
    q = torch.randn(1, 9, cal.head_dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for layer in (0, cal.layers - 1):
        assert torch.equal(gaac.decode_attention(q, source.layer_view(layer)),
                           gaac.decode_attention(q, target.layer_view(layer)))


def test_export_into_a_buffer_and_import_from_any_buffer(real):
    k, v, cal = real
    cache = PagedKVCache(cal, max_seqs=5, max_blocks=48)
    seq = cache.add_sequence(k[:, :, :100], v[:, :, :100])
    size = transfer.exported_layout(cache, seq).nbytes
    buffer = torch.full((size + 10,), 7, dtype=torch.uint8)
    data = cache.export_sequence(seq, out=buffer)
    assert len(data) == size and bytes(data) == bytes(buffer[:size].numpy()) == bytes(cache.export_sequence(seq))
    for form in (bytes(data), bytearray(data), np.frombuffer(data, np.uint8), buffer[:size]):
        np.testing.assert_array_equal(cache.read(cache.import_sequence(form))[0], k[:, :, :100])
    with pytest.raises(InputError, match=f"at least {size} bytes"):
        cache.export_sequence(seq, out=bytearray(size - 1))
    with pytest.raises(InputError, match="read-only"):
        cache.export_sequence(seq, out=bytes(size))
    into = bytearray(size)
    assert bytes(cache.export_sequence(seq, out=into)) == bytes(into) == bytes(data)
    with pytest.raises(InputError, match="container's bytes"):
        cache.import_sequence("not bytes")


# ----------------------------------------------------------------------------------------------
# Calibration epochs travel with the blocks.

@pytest.fixture(scope="module")
def drift():
    """64 blocks of 2 layers whose K drifts; the cache appends epochs to its calibration."""
    rng = np.random.default_rng(8)
    k, v = drifting(rng, 2, 2, 64 * B + 3, 64, 8.0), drifting(rng, 2, 2, 64 * B + 3, 64, 0.0)
    cal = calibrate(k[:, :, :256], v[:, :, :256])
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=80, grow=True)
    seq = cache.add_sequence(k, v)
    assert cache.calibration.n_epochs(0, L.KIND_K) > 2               # the data really drifted
    return k, v, cal, cache, seq


def block_epochs(cache, seq, layer, kind):
    return cache.layer_view(layer).epoch[kind][seq, :cache.seq_len(seq) // B].numpy()


def test_epochs_are_carried_matched_or_appended(drift):
    k, v, cal, source, seq = drift
    data = source.export_sequence(seq)
    head = transfer.read_head(data)
    used = {(s.layer, s.kind): [r.epoch for r in s.epochs] for s in head.layout.sections}
    assert used[(0, L.KIND_K)] == sorted(set(block_epochs(source, seq, 0, L.KIND_K).tolist()) - {0})

    fresh = PagedKVCache(cal, max_blocks=80, grow=True)        # the calibration without epochs: appended
    got = fresh.import_sequence(data)
    for layer in range(2):
        for kind in (0, 1):
            assert fresh.calibration.n_epochs(layer, kind) == 1 + len(used[(layer, kind)])
            np.testing.assert_array_equal(np.unique(block_epochs(fresh, got, layer, kind)),
                                          np.arange(1 + len(used[(layer, kind)])))
    np.testing.assert_array_equal(fresh.read(got)[0], k)

    before = [source.calibration.n_epochs(0, kind) for kind in (0, 1)]
    again = source.import_sequence(data)                            # the exporting cache: its own epochs
    assert [source.calibration.n_epochs(0, kind) for kind in (0, 1)] == before
    np.testing.assert_array_equal(block_epochs(source, again, 0, 0), block_epochs(source, seq, 0, 0))
    np.testing.assert_array_equal(source.read(again)[1], v)
    source.remove_sequence(again)

    # A cache of the same calibration whose epoch 1 differs: the container's epochs go after it, in order.
    other = cal.copy()
    rng = np.random.default_rng(1)
    other.add_epoch(0, L.KIND_K, rng.integers(100, 130, (2, 64)), rng.integers(100, 130, (2, 64)))
    target = PagedKVCache(other, max_blocks=80, grow=True)
    got = target.import_sequence(data)
    e = block_epochs(target, got, 0, L.KIND_K)
    assert (np.diff(e) >= 0).all() and 1 not in e and e.max() == len(used[(0, L.KIND_K)]) + 1
    np.testing.assert_array_equal(target.read(got)[0], k)
    # later blocks of that cache are coded with the newest epoch, now an imported one: still lossless
    target.append(got, k[:, :, :40], v[:, :, :40])
    np.testing.assert_array_equal(target.read(got)[0][:, :, -40:], k[:, :, :40])

    no_epochs = PagedKVCache(cal, max_blocks=80, adapt=False)
    before = snapshot(no_epochs)
    with breaks("C5"):
        no_epochs.import_sequence(data)
    assert_unchanged(no_epochs, before)


def test_epoch_records_are_checked(drift):
    _, _, cal, source, seq = drift
    data = bytes(source.export_sequence(seq, calibration=True))
    records = L.SEQUENCE_HEADER.size + 2 * cal.layers * L.SEQUENCE_SECTION.size
    epoch = struct.unpack_from("<H", data, records)[0]
    table = cal.kv_heads * cal.head_dim
    cases = [(mutate(data, records + 8, bytes([data[records + 8] ^ 1])), "S11", "bases id"),
             (mutate(data, records, b"\0\0"), "S11", "bad epoch record"),
             (mutate(data, records + 2, b"\1"), "S11", "bad epoch record"),
             (mutate(data, records + 8, bytes([255])), "C3", "bases above"),
             (mutate(data, len(data) - transfer.read_head(data).layout.body_bytes - 100, b"\x77"), "S12",
              "embedded calibration")]
    assert epoch >= 1
    for bad, rule, message in cases:
        target = PagedKVCache(cal, max_blocks=80, grow=True)
        with breaks(rule, match=message):
            if message == "bases above":      # a valid id for bases out of range: recompute it
                c = bytearray(bad)
                b3 = np.frombuffer(bytes(c[records + 8:records + 8 + table]), np.uint8).reshape(cal.kv_heads, -1)
                b4 = np.frombuffer(bytes(c[records + 8 + table:records + 8 + 2 * table]), np.uint8).reshape(
                    cal.kv_heads, -1)
                from gaac.calibration import epoch_canonical_bytes

                struct.pack_into("<I", c, records + 4, zlib.crc32(epoch_canonical_bytes(cal.id, 0, 0, epoch, b3, b4)))
                bad = rewrite_crcs(bytes(c))
            target.import_sequence(bad)
        assert target.sequences == []


# ----------------------------------------------------------------------------------------------
# Errors: typed, and the cache is left as it was.

def test_another_calibration_is_refused(real):
    k, v, cal = real
    source = PagedKVCache(cal, max_blocks=48)
    data = source.export_sequence(source.add_sequence(k[:, :, :50], v[:, :, :50]))
    other = calibrate(k, v)
    target = PagedKVCache(other, max_blocks=48)
    target.add_sequence(k[:, :, :20], v[:, :, :20])
    before = snapshot(target)
    with breaks("C1", match=f"{cal.id:08x}; this cache's calibration is {other.id:08x}"):
        target.import_sequence(data)
    assert_unchanged(target, before)
    # "compatible": the same id -- another model name, notes or epochs do not matter
    same = Calibration(b3=cal.b3, b4=cal.b4, capacity=cal.capacity, model="renamed", notes={"x": 1})
    same.add_epoch(1, L.KIND_V, cal.b3[1, 1], cal.b4[1, 1])
    got = PagedKVCache(same, max_blocks=48).import_sequence(data)
    assert got == 0


def rewrite_crcs(data: bytes) -> bytes:
    """``data`` with its chunk CRCs and head CRC recomputed: a container corrupt in ways only its rules catch."""
    a = bytearray(data)
    (_, _, _, flags, layers, heads, dim, tokens, _, n_records, _, body) = L.SEQUENCE_HEADER.unpack_from(a)
    table = heads * dim
    at = L.SEQUENCE_HEADER.size + 2 * layers * L.SEQUENCE_SECTION.size + n_records * (L.SEQUENCE_EPOCH.size + 2 * table)
    if flags & L.SEQUENCE_FLAG_CALIBRATION:
        at += 20 + 4 * layers * table + 4 * layers
    chunks = -(-body // L.SEQUENCE_CHUNK_BYTES)
    body_at = len(a) - body
    for i in range(chunks):
        part = a[body_at + i * L.SEQUENCE_CHUNK_BYTES:body_at + min((i + 1) * L.SEQUENCE_CHUNK_BYTES, body)]
        struct.pack_into("<I", a, at + 4 * i, zlib.crc32(part))
    at += 4 * chunks
    struct.pack_into("<I", a, at, zlib.crc32(a[:at]))
    return bytes(a)


@pytest.fixture(scope="module")
def exported(real):
    k, v, cal = real
    cache = PagedKVCache(cal, max_blocks=48)
    seq = cache.add_sequence(k[:, :, :210], v[:, :, :210])
    data = bytes(cache.export_sequence(seq, calibration=True))
    c = transfer.read_head(data)
    assert c.layout.body_offset > c.layout.head_bytes                 # the head is padded (rule S10 can be broken)
    return cal, data


def mutate(data: bytes, offset: int, value: bytes, fix_crcs: bool = True) -> bytes:
    a = bytearray(data)
    a[offset:offset + len(value)] = value
    return rewrite_crcs(bytes(a)) if fix_crcs else bytes(a)


def body_offsets(data: bytes):
    c = transfer.read_head(data)
    return c.layout.body_offset, c.layout.sections


def in_body(data: bytes, section: int, part: str, offset: int = 0) -> int:
    """Where ``part`` of section ``section`` starts in the container, plus ``offset``."""
    c = transfer.read_head(data)
    return c.layout.body_offset + getattr(c.layout.sections[section], part) + offset


# Rule id of FORMAT.md 11.7 -> containers that break it (each made from a valid one, with its CRCs recomputed
# unless the CRC is what breaks).
CORRUPTIONS = {
    "S1": [lambda d: d[:30], lambda d: d[:-1], lambda d: d + b"\0"],
    "S2": [lambda d: mutate(d, 0, b"GAACSEX")],
    "S3": [lambda d: mutate(d, 7, b"\x03")],
    "S4": [lambda d: mutate(d, 8, b"\x02")],
    "S5": [lambda d: mutate(d, 9, b"\x02"), lambda d: mutate(d, 28, b"\x01")],
    "S6": [lambda d: mutate(d, 14, struct.pack("<H", 96)), lambda d: mutate(d, 12, b"\0\0")],
    "S7": [lambda d: mutate(d, 40, struct.pack("<H", 24)), lambda d: mutate(d, 44, struct.pack("<I", 10 ** 6))],
    "S8": [lambda d: mutate(d, 24, b"\x01"), lambda d: mutate(d, 32, b"\x01")],
    "S9": [lambda d: mutate(d, 20, b"\x99", fix_crcs=False)],
    "S10": [lambda d: mutate(d, transfer.read_head(d).layout.body_offset - 1, b"\x01")],
    "S13": [lambda d: mutate(d, in_body(d, 0, "slots", 5000), b"\x5a", fix_crcs=False)],
    "S14": [lambda d: mutate(d, in_body(d, 3, "table", 8), struct.pack("<I", 0)),
            lambda d: mutate(d, in_body(d, 1, "block_epochs", -1), b"\x01"),
            lambda d: mutate(d, in_body(d, 1, "table"), struct.pack("<I", L.TABLE_RAW_FLAG))],
    "S15": [lambda d: mutate(d, in_body(d, 2, "block_epochs"), struct.pack("<H", 1))],
}


@pytest.mark.parametrize("rule, case", [(r, i) for r in CORRUPTIONS for i in range(len(CORRUPTIONS[r]))])
def test_a_corrupt_container_is_refused_and_changes_nothing(exported, rule, case):
    """Each rule of FORMAT.md 11.7, with the class and message phrase its table gives."""
    cal, data = exported
    bad = CORRUPTIONS[rule][case](data)
    target = PagedKVCache(cal, max_seqs=2, max_blocks=48)
    target.add_sequence(np.zeros((cal.layers, cal.kv_heads, 20, cal.head_dim), np.uint16),
                        np.zeros((cal.layers, cal.kv_heads, 20, cal.head_dim), np.uint16))
    before = snapshot(target)
    with breaks(rule):
        target.import_sequence(bad)
    assert_unchanged(target, before)


def test_every_rule_of_the_spec_has_a_case():
    assert set(SPEC_RULES) == set(CORRUPTIONS) | {"S11", "S12", "S16", "C1", "C2", "C3", "C4", "C5"}


def test_a_section_capacity_other_than_the_calibrations(exported):
    cal, data = exported
    # a wider slot in section 0: the header's body size and the body grow with it, CRCs recomputed
    grown = 16 * transfer.read_head(data).layout.sections[0].slot_tiles
    bad = bytearray(data)
    struct.pack_into("<H", bad, 40, int(cal.capacity[0, 0]) + 16)
    struct.pack_into("<Q", bad, 32, struct.unpack_from("<Q", bad, 32)[0] + grown)
    bad = rewrite_crcs(bytes(bad) + bytes(grown))
    assert transfer.read_head(bad).layout.sections[0].capacity == cal.capacity[0, 0] + 16
    target = PagedKVCache(cal, max_blocks=48)
    with breaks("C2"):
        target.import_sequence(bad)
    assert target.sequences == []


def test_a_full_cache_raises_pool_exhausted_or_grows(exported, real):
    cal, data = exported
    k, v, _ = real
    for kwargs, message in (({"max_blocks": 4}, "max_blocks=13 or more"), ({"max_blocks": 48, "slots": 20},
                                                                          "slot pool is exhausted")):
        target = PagedKVCache(cal, **kwargs)
        before = snapshot(target)
        with pytest.raises(PoolExhaustedError, match=message):
            target.import_sequence(data)
        assert_unchanged(target, before)
    full = PagedKVCache(cal, max_blocks=48)
    full.add_sequence()
    with pytest.raises(PoolExhaustedError, match="sequence rows"):
        full.import_sequence(data)
    roomy = PagedKVCache(cal, max_blocks=2, slots=1, raw_tiles=0, grow=True)
    roomy.add_sequence(k[:, :, :3], v[:, :, :3])
    got = roomy.import_sequence(data)
    np.testing.assert_array_equal(roomy.read(got)[1], v[:, :, :210])
    assert roomy.max_seqs >= 2 and roomy.max_blocks >= 13


def test_a_sequence_mid_update_is_not_exported(real):
    k, v, cal = real
    cache = PagedKVCache(cal, max_blocks=48)
    seq = cache.add_sequence()
    cache.update_layer(0, [seq], k[:1, :, :20], v[:1, :, :20])
    with pytest.raises(InputError, match="mid-update"):
        cache.export_sequence(seq)


# ----------------------------------------------------------------------------------------------
# Bodies of several chunks, and the CUDA chunk CRC kernel (numba's simulator here).

@pytest.fixture(scope="module")
def chunked():
    """A sequence whose container's body spans several 1 MiB chunks: (calibration, cache, sequence, bytes)."""
    rng = np.random.default_rng(5)
    k, v = drifting(rng, 2, 8, 1100, 128, 0.0), drifting(rng, 2, 8, 1100, 128, 0.0)
    cal = calibrate(k, v)
    cache = PagedKVCache(cal, max_blocks=70)
    seq = cache.add_sequence(k, v)
    return cal, cache, seq, bytes(cache.export_sequence(seq))


def test_a_body_of_several_chunks(chunked):
    cal, cache, seq, data = chunked
    c = transfer.read_head(data)
    assert c.layout.chunks >= 4 and c.layout.body_bytes % L.SEQUENCE_CHUNK_BYTES
    got = PagedKVCache(cal, max_blocks=70).import_sequence(data) == 0
    assert got
    chunk = 2 * L.SEQUENCE_CHUNK_BYTES + 17                        # corrupt the third chunk only
    with pytest.raises(FormatError, match="chunk 2 of the body"):
        PagedKVCache(cal, max_blocks=70).import_sequence(mutate(data, c.layout.body_offset + chunk, b"\1",
                                                                fix_crcs=False))


def test_the_body_moves_in_pieces(chunked, monkeypatch):
    """Pieces of one chunk: the same container as in one piece; imports piece by piece into host and device free
    lists (the CUDA codec's, in the simulator) take their records once each; a corrupt chunk of a later piece is
    refused after the earlier pieces were scattered, and takes no record."""
    cal, cache, seq, whole = chunked
    lay = transfer.read_head(whole).layout
    assert cache_transfer._piece_ends(lay) == [lay.body_bytes]
    monkeypatch.setattr(cache_transfer, "PIECE_BYTES", L.SEQUENCE_CHUNK_BYTES)
    ends = cache_transfer._piece_ends(lay)
    assert len(ends) >= 3 and ends[-1] == lay.body_bytes and ends == sorted(set(ends))
    assert all(e % L.SEQUENCE_CHUNK_BYTES == 0 for e in ends[:-1])
    assert bytes(cache.export_sequence(seq)) == whole
    records = [(s.slot_tiles, s.raw_tiles) for s in lay.sections]
    at = lay.body_offset + ends[1] + 17                             # a byte of the third piece, flipped
    bad = mutate(whole, at, bytes([whole[at] ^ 1]), fix_crcs=False)
    for codec in ("reference", "cuda"):
        target = PagedKVCache(cal, max_seqs=3, max_blocks=70, codec=codec)
        used = lambda: [(st.slots.used, st.raw.used) for layer in target._store for st in layer]  # noqa: E731
        first = target.import_sequence(whole)
        assert used() == records
        with pytest.raises(FormatError, match=f"chunk {ends[1] // L.SEQUENCE_CHUNK_BYTES} of the body"):
            target.import_sequence(bad)
        assert target.sequences == [first] and used() == records
        second = target.import_sequence(whole)
        assert used() == [(2 * a, 2 * b) for a, b in records]
        for layer in target._store:                                  # each record holds one sequence's tile
            for st in layer:
                a, b = (set(st.table[s, :lay.blocks].reshape(-1).tolist()) for s in (first, second))
                assert not a & b
        assert bytes(target.export_sequence(first)) == whole == bytes(target.export_sequence(second))


def test_a_corrupt_container_does_not_grow_the_cache(exported):
    """A cache that must grow for the sequence grows only once the body passed its checks."""
    cal, data = exported
    target = PagedKVCache(cal, max_blocks=2, slots=1, raw_tiles=0, grow=True)
    before = snapshot(target)
    with breaks("S13"):
        target.import_sequence(CORRUPTIONS["S13"][0](data))
    assert_unchanged(target, before)
    assert target.import_sequence(data) == 0 and target.max_blocks >= 13


def test_chunk_crc_kernel_matches_zlib():
    pytest.importorskip("numba")
    from gaac.cuda import crc

    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, 3 * 4096 + 100, dtype=np.uint8)
    for threads, chunk in ((32, 4096), (64, 1024 * 4)):
        got = crc.chunk_crcs(torch.from_numpy(data), chunk, threads=threads).numpy().view(np.uint32)
        assert got.tolist() == [zlib.crc32(data[i * chunk:(i + 1) * chunk]) for i in range(len(data) // chunk)]
    assert crc.chunk_crcs(data[:100], 4096, threads=32).shape == (0,)
    assert crc.crc_adjust(9) ^ zlib.crc32(b"123456789") == crc.multmodp(crc.x8n(0), 0) ^ \
        (zlib.crc32(b"123456789") ^ crc.crc_adjust(9))             # c(n) is the gap between zlib and r
    # the tables of the production shape: 256 threads, 16-byte pieces fold a 1 MiB chunk exactly
    assert L.SEQUENCE_CHUNK_BYTES % (crc.PIECE_BYTES * crc.THREADS) == 0
    with pytest.raises(ValueError, match="pieces"):
        crc.chunk_crcs(data, 1000, threads=32)


# ----------------------------------------------------------------------------------------------
# The file form.

def test_pack_unpack_embed_the_calibration(real):
    k, v, cal = real
    data = transfer.pack(k, v, cal)
    c = transfer.read_head(data)
    assert c.calibration is not None and c.calibration.id == cal.id and c.describe()["calibration_embedded"]
    for a, b in zip(transfer.unpack(data), (k, v)):
        np.testing.assert_array_equal(a, b)
    info = c.describe()
    assert info["tokens"] == k.shape[2] and info["bytes"] == len(data) and info["ratio"] > 1.2
    self_calibrated = transfer.pack(k[:, :, :100], v[:, :, :100])
    np.testing.assert_array_equal(transfer.unpack(self_calibrated)[0], k[:, :, :100])
    cache = PagedKVCache(cal, max_blocks=48)
    bare = cache.export_sequence(cache.add_sequence(k[:, :, :40], v[:, :, :40]))
    with pytest.raises(CalibrationError, match="carries no calibration"):
        transfer.unpack(bare)
    np.testing.assert_array_equal(transfer.unpack(bare, cal)[1], v[:, :, :40])


# ----------------------------------------------------------------------------------------------
# FORMAT.md section 11 says what the code writes.

def test_spec_tables_match_layout(exported):
    cal, data = exported
    header = spec_table("sequence-header")
    assert [(int(r["offset"]), int(r["size"]), r["type"]) for r in header] == _struct_fields(L.SEQUENCE_HEADER.format)
    fields = dict(zip([r["field"] for r in header], L.SEQUENCE_HEADER.unpack_from(data)))
    assert fields["magic"] == L.SEQUENCE_MAGIC and L.SEQUENCE_MAGIC.hex() == \
        header[0]["value"].split("(")[1].strip(")").replace(" ", "")
    assert (fields["version"], fields["element format"]) == (L.SEQUENCE_VERSION, L.ELEMENT_BF16) == \
        (int(header[1]["value"]), int(header[2]["value"].split()[0]))
    assert (fields["layers"], fields["kv_heads"], fields["head_dim"], fields["tokens"]) == \
        (cal.layers, cal.kv_heads, cal.head_dim, 210)
    assert fields["flags"] == L.SEQUENCE_FLAG_CALIBRATION and fields["calibration id"] == cal.id
    assert fields["body bytes"] == transfer.read_head(data).layout.body_bytes
    for name, record in (("sequence-section", L.SEQUENCE_SECTION), ("sequence-epoch", L.SEQUENCE_EPOCH)):
        rows = spec_table(name)
        fixed = [(int(r["offset"]), int(r["size"]), r["type"]) for r in rows if r["size"].isdigit()]
        assert fixed == _struct_fields(record.format), name
    assert [r["offset"] for r in spec_table("sequence-epoch")][-2:] == ["8", "8 + HD"]
    assert "1 MiB (`2^20` bytes)" in SPEC_TEXT and L.SEQUENCE_CHUNK_BYTES == 2 ** 20
    assert [r["part"] for r in spec_table("sequence-body")] == ["block table", "block epochs", "slots", "raw tiles",
                                                                "tail"]


def spec_blocks(data: bytes):
    """Every block of a sequence container as a block container (section 7), built only from what FORMAT.md 11
    says: ``{(layer, kind): [block bytes, ...]}``, and the tails ``{(layer, kind): uint16 [H, t, D]}``."""
    (_, _, _, _, layers, heads, dim, tokens, cal_id, _, _, body) = struct.unpack_from("<7sBBBHHHIIIIQ", data)
    c = min(dim, 128)
    per, fixed, nb, t = heads * dim // c, {64: 1440, 128: 2880}[c], tokens // 16, tokens % 16
    at, records = 40, []
    for _ in range(2 * layers):
        records.append(struct.unpack_from("<HHI", data, at))
        at += 8
    epochs = []
    for capacity, count, _ in records:
        listed = {}
        for _ in range(count):
            epoch, _, bases_id = struct.unpack_from("<HHI", data, at)
            listed[epoch] = bases_id
            at += 8 + 2 * heads * dim
        epochs.append(listed)
    at = len(data) - body                                           # the body (its offset: S1)
    align = lambda n: -(-n // 16) * 16                             # noqa: E731
    blocks, tails = {}, {}
    for i, (capacity, _, n_raw) in enumerate(records):
        layer, kind = divmod(i, 2)
        table = np.frombuffer(data, "<u4", nb * per, at)
        at += align(4 * nb * per)
        block_epochs = np.frombuffer(data, "<u2", nb, at)
        at += align(2 * nb)
        slot_size = fixed + capacity
        slots_at = at
        raws_at = at + (nb * per - n_raw) * slot_size
        at = raws_at + n_raw * 2 * 16 * c
        tails[(layer, kind)] = np.frombuffer(data, "<u2", heads * t * dim, at).reshape(heads, t, dim)
        at += 2 * heads * t * dim
        out = []
        for j in range(nb):
            entries = table[j * per:(j + 1) * per]
            is_raw = entries >> 31 == 1
            epoch = int(block_epochs[j])
            header = struct.pack("<4sBBBBHHHHIHH", b"GAAC", 2, 1, kind, 16, layer, heads, dim, capacity,
                                 cal_id if epoch == 0 else epochs[i][epoch], epoch, 0)
            renumbered = np.where(is_raw, (1 << 31) | (np.cumsum(is_raw) - 1), np.cumsum(~is_raw) - 1)
            slots = b"".join(data[slots_at + int(e) * slot_size:slots_at + (int(e) + 1) * slot_size]
                             for e in entries[~is_raw])
            raw_size = 2 * 16 * c
            raws = b"".join(data[raws_at + int(e & 0x7FFFFFFF) * raw_size:raws_at + (int(e & 0x7FFFFFFF) + 1) * raw_size]
                            for e in entries[is_raw])
            stream = header + renumbered.astype("<u4").tobytes() + slots + raws
            out.append(stream + struct.pack("<I", zlib.crc32(stream)))
        blocks[(layer, kind)] = out
    assert at == len(data)
    return blocks, tails


def test_a_sections_blocks_are_block_containers(drift):
    """FORMAT.md 11.6: each block, framed as section 7 says, decodes (gaac.decode_block) to the input."""
    k, v, _, source, seq = drift
    data = bytes(source.export_sequence(seq))
    blocks, tails = spec_blocks(data)
    tokens = k.shape[2]
    for layer in range(k.shape[0]):
        for kind, x in enumerate((k, v)):
            decoded = [gaac.decode_block(b, source.calibration) for b in blocks[(layer, kind)]]
            np.testing.assert_array_equal(np.concatenate(decoded + [tails[(layer, kind)]], axis=1), x[layer])
    assert len(blocks[(0, 0)]) == tokens // B


# ----------------------------------------------------------------------------------------------
# The sequence-container test vectors (format_spec/vectors/sequence/).

SEQ_VECTORS = Path(__file__).resolve().parents[1] / "format_spec" / "vectors" / "sequence"


def load_seq_vector_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_sequence_vectors", SEQ_VECTORS / "make_sequence_vectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_cache(meta: dict, kind: str) -> np.ndarray:
    return np.array([[[[int(row[i:i + 4], 16) for i in range(0, len(row), 4)] for row in head] for head in layer]
                     for layer in meta["expected"][kind]], dtype=np.uint16)


@pytest.mark.parametrize("name", ["seq_epochs", "seq_embedded"])
def test_sequence_vectors_import_and_unpack_to_their_caches(name):
    meta = json.loads((SEQ_VECTORS / f"{name}.json").read_text())
    data = (SEQ_VECTORS / f"{name}.bin").read_bytes()
    cal = Calibration.load(SEQ_VECTORS / meta["calibration"])
    k, v = expected_cache(meta, "k"), expected_cache(meta, "v")
    assert len(data) == meta["bytes"] and k.shape == (meta["layers"], meta["kv_heads"], meta["tokens"],
                                                       meta["head_dim"])
    assert f"{cal.id:08x}" == meta["calibration_id"]
    c = transfer.read_head(data)
    assert [s.raw_tiles for s in c.layout.sections] == [s["raw_tiles"] for s in meta["sections"]]
    assert [[f"{r.bases_id:08x}" for r in s.epochs] for s in c.layout.sections] == \
        [[e["bases_id"] for e in s["epochs"]] for s in meta["sections"]]
    cache = PagedKVCache(Calibration(b3=cal.b3, b4=cal.b4, capacity=cal.capacity), max_blocks=8, grow=True)
    got = cache.read(cache.import_sequence(data))           # a cache without the vector's epochs: appended
    np.testing.assert_array_equal(got[0], k)
    np.testing.assert_array_equal(got[1], v)
    if meta["calibration_embedded"]:
        np.testing.assert_array_equal(transfer.unpack(data)[1], v)
    blocks, tails = spec_blocks(data)                         # FORMAT.md alone, block by block
    for layer in range(meta["layers"]):
        for kind, x in enumerate((k, v)):
            decoded = [gaac.decode_block(b, cal) for b in blocks[(layer, kind)]]
            np.testing.assert_array_equal(np.concatenate(decoded + [tails[(layer, kind)]], axis=1), x[layer])
    assert {s["raw_tiles"] > 0 for s in meta["sections"]} == {True, False}    # raw tiles and slots both occur


def test_regenerating_the_sequence_vectors_gives_identical_bytes(tmp_path):
    written = load_seq_vector_module().generate(tmp_path)
    assert sorted(written) == sorted(p.name for p in SEQ_VECTORS.iterdir() if p.suffix in (".bin", ".json"))
    assert {n: (tmp_path / n).read_bytes() for n in written} == {n: (SEQ_VECTORS / n).read_bytes() for n in written}
