"""The test vectors of format_spec/vectors/ against the reference (gaac) and the spec-only decoder.

Every valid vector must decode to its expected BF16 patterns in both decoders,
re-encode to the same bytes, and agree with the reference on modes and sizes;
every must-reject vector must raise the stated error class in both.  The
vectors must be what ``format_spec/make_vectors.py`` makes, byte for byte.
"""
from __future__ import annotations

import importlib.util
import json
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

import gaac
import spec_decoder
from gaac import layout as L

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "format_spec"
VECTORS = SPEC / "vectors"
METAS = {p.stem: json.loads(p.read_text()) for p in sorted(VECTORS.glob("*.json")) if not p.stem.startswith("cal_")}
VALID = sorted(n for n, m in METAS.items() if m["valid"])
REJECT = sorted(n for n, m in METAS.items() if not m["valid"])


def load_make_vectors():
    spec = importlib.util.spec_from_file_location("make_vectors", SPEC / "make_vectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stream(name: str) -> bytes:
    return (VECTORS / f"{name}.bin").read_bytes()


def expected(meta: dict) -> np.ndarray:
    return np.array([[[int(row[i:i + 4], 16) for i in range(0, len(row), 4)] for row in head]
                     for head in meta["expected"]], dtype=np.uint16)


def gaac_cal(meta: dict) -> gaac.Calibration:
    return gaac.Calibration.load(VECTORS / meta["calibration"])


def spec_cal(meta: dict) -> spec_decoder.Calibration:
    return spec_decoder.load_calibration(VECTORS / meta["calibration"])


def test_spec_decoder_imports_nothing_but_the_standard_library_basics():
    """Its whole point is that FORMAT.md alone suffices: no NumPy, no gaac, no zlib."""
    source = (ROOT / "tests" / "spec_decoder.py").read_text()
    imported = set(re.findall(r"^(?:from|import) (\w+)", source, flags=re.M))
    assert imported == {"__future__", "json", "dataclasses", "pathlib"}


def test_the_vector_set_covers_what_the_spec_promises():
    metas = [METAS[n] for n in VALID]
    assert {m["head_dim"] for m in metas} == set(L.SUPPORTED_HEAD_DIMS)
    assert any(m["escape_capacity"] == 0 and m["raw_tiles"] for m in metas)
    assert any(m["canonical"] and m["raw_tiles"] for m in metas), "no slot overflow"
    assert not all(m["canonical"] for m in metas)
    for mode in L.MODE_NAMES.values():
        assert any(m["mode_counts"][mode] for m in metas), mode
    assert {"prose_layer0_k", "prose_layer0_v"} <= set(VALID)
    assert len(REJECT) >= 23
    # version 2: blocks of later epochs, of both kinds, one with a raw tile; and epoch 0 in a version 2 header
    later = [m for m in metas if m["epoch"] > 0]
    assert {m["kind"] for m in later} == {"k", "v"} and any(m["raw_tiles"] for m in later)
    assert all(m["version"] == 2 and m["bases_id"] != m["calibration_id"] for m in later)
    assert any(m["version"] == 2 and m["epoch"] == 0 and not m["canonical"] for m in metas)
    assert all(m["version"] == 1 for m in metas if m["epoch"] == 0 and m["canonical"])
    size = sum(p.stat().st_size for p in VECTORS.iterdir())
    assert size < 400_000, f"format_spec/vectors holds {size} bytes"


def test_edge_vector_has_every_edge_pattern_and_exponents_0_and_255_in_every_mode():
    meta = METAS["edge_patterns"]
    values = expected(meta)
    patterns = set(values.ravel().tolist())
    edge = {0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x807F,        # zeros, smallest and largest subnormals
            0x7F80, 0xFF80,                                        # infinities
            0x7FC0, 0xFFC0, 0x7FC1, 0xFFFF,                        # quiet NaNs with payloads, both signs
            0x7F81, 0xFF81, 0x7FBF, 0xFFBF,                        # signalling NaNs, both signs
            0x7F7F, 0xFF7F, 0x0080, 0x8080}                        # largest and smallest normals
    assert edge <= patterns, sorted(hex(x) for x in edge - patterns)
    exponent = (values >> 7) & 0xFF
    for tile in meta["tiles"]:
        assert tile["storage"] == "slot"
    seen = set()
    for tile in meta["tiles"]:
        e = exponent[tile["head"]].reshape(-1, L.GROUP_SIZE)        # head_dim 64: tile = head
        for g, mode in enumerate(tile["modes"]):
            seen |= {(int(mode), int(x)) for x in e[g] if x in (0, 255)}
    assert seen == {(m, x) for m in L.MODE_NAMES for x in (0, 255)}


@pytest.mark.parametrize("name", VALID)
def test_reference_decodes_valid_vector(name):
    meta = METAS[name]
    cal = gaac_cal(meta)
    assert cal.id == int(meta["calibration_id"], 16)
    assert cal.epoch_id(meta["layer"], gaac.format.block.parse_kind(meta["kind"]), meta["epoch"]) == int(meta["bases_id"], 16)
    np.testing.assert_array_equal(gaac.decode_block(stream(name), cal), expected(meta))


@pytest.mark.parametrize("name", VALID)
def test_spec_decoder_decodes_valid_vector(name):
    meta = METAS[name]
    data = stream(name)
    assert len(data) == meta["bytes"]
    cal = spec_cal(meta)
    assert cal.id == int(meta["calibration_id"], 16)
    if meta["epoch"]:
        assert cal.epoch_id("kv".index(meta["kind"]), meta["layer"], meta["epoch"]) == int(meta["bases_id"], 16)
    out = spec_decoder.decode_block(data, cal)
    assert out.values == expected(meta).tolist()
    assert out.storage == [t["storage"] for t in meta["tiles"]]
    for t, tile in enumerate(meta["tiles"]):
        if tile["storage"] == "slot":
            assert "".join(map(str, out.modes[t])) == tile["modes"]
            assert out.escape_bytes[t] == tile["escape_bytes"]
    assert (out.payload_bytes, out.resident_bytes) == (meta["payload_bytes"], meta["resident_bytes"])


@pytest.mark.parametrize("name", VALID)
def test_reference_encoder_agrees_with_vector(name):
    meta = METAS[name]
    cal = gaac_cal(meta)
    values = expected(meta)
    enc = gaac.encode_block(values, cal, meta["layer"], meta["kind"], epoch=meta["epoch"])
    if not meta["canonical"]:
        assert enc.data != stream(name)
        np.testing.assert_array_equal(gaac.decode_block(enc, cal), values)
        return
    assert enc.data == stream(name)
    assert ["".join(map(str, row)) for row in enc.modes] == [t["modes"] for t in meta["tiles"]]
    assert list(enc.raw_tiles) == meta["raw_tiles"]
    assert (enc.payload_bytes, enc.resident_bytes) == (meta["payload_bytes"], meta["resident_bytes"])
    slot_modes = enc.modes[[t for t in range(enc.n_tiles) if t not in enc.raw_tiles]]
    assert {name: int((slot_modes == m).sum()) for m, name in L.MODE_NAMES.items()} == meta["mode_counts"]


@pytest.mark.parametrize("name", REJECT)
def test_reference_rejects(name):
    meta = METAS[name]
    error = getattr(gaac, meta["error"])
    with pytest.raises(error, match=re.escape(meta["message"])):
        gaac.decode_block(stream(name), gaac_cal(meta))


@pytest.mark.parametrize("name", REJECT)
def test_spec_decoder_rejects(name):
    meta = METAS[name]
    with pytest.raises(getattr(spec_decoder, meta["error"])) as info:
        spec_decoder.decode_block(stream(name), spec_cal(meta))
    assert info.value.rule == meta["rule"]


def test_reject_vectors_cover_every_rule_of_section_8():
    rows = {}
    for line in (SPEC / "FORMAT.md").read_text().splitlines():
        m = re.match(r"\| (R\d+) \|.*\| (\w+Error) \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    # the table lists the rules in numeric order (the reference checks R23 and R22 before the slot rules); R21 is
    # FORMAT-FP8.md's element-format rule, which a BF16 stream cannot break
    assert list(rows) == [f"R{i}" for i in (*range(1, 21), 22, 23)]
    for name in REJECT:
        meta = METAS[name]
        error, phrases = rows[meta["rule"]]
        assert meta["error"] == error, name
        assert meta["message"] in phrases.split("; "), name
    assert {METAS[n]["rule"] for n in REJECT} == set(rows)


def test_mutated_vectors_keep_a_valid_crc():
    """Only the CRC vector may have a wrong CRC-32: elsewhere the rule under test must be what trips."""
    for name in REJECT:
        data = stream(name)
        if METAS[name]["rule"] in ("R1", "R12"):
            continue
        assert struct.unpack("<I", data[-4:])[0] == zlib.crc32(data[:-4]), name


def reserved_tag_in_tile_1() -> bytes:
    """Vector slot_overflow (tile 0 raw, tile 1 slot 0) with a reserved tag in tile 1 and a fresh CRC."""
    data = bytearray(stream("slot_overflow"))
    data[L.STREAM_HEADER_BYTES + 2 * L.TABLE_ENTRY_BYTES + L.geometry(64).tag_offset] |= 3
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    return bytes(data)


def test_spec_decoder_names_the_broken_tile():
    with pytest.raises(spec_decoder.FormatError, match="tile 1, group 0"):
        spec_decoder.decode_block(reserved_tag_in_tile_1(), spec_cal(METAS["slot_overflow"]))


def test_reference_names_the_broken_tile():
    with pytest.raises(gaac.FormatError, match="tile 1, group 0"):
        gaac.decode_block(reserved_tag_in_tile_1(), gaac_cal(METAS["slot_overflow"]))


def _committed(names):
    return {n: (VECTORS / n).read_bytes() for n in names}


def test_regenerating_the_synthetic_vectors_gives_identical_bytes(tmp_path):
    written = load_make_vectors().generate(tmp_path, kv_dir=None)
    assert written and all(not n.startswith(("prose_", "cal_prose")) for n in written)
    assert {n: (tmp_path / n).read_bytes() for n in written} == _committed(written)


def test_regenerating_every_vector_gives_the_committed_folder(tmp_path):
    module = load_make_vectors()
    if not (module.KV_DIR / module.REAL_DUMP.format("k")).exists():
        pytest.skip(f"real KV dumps not present in {module.KV_DIR}")
    written = module.generate(tmp_path, module.KV_DIR)
    # Sub-folders (fp8/) hold other element formats with generators of their own.
    assert sorted(written) == sorted(p.name for p in VECTORS.iterdir() if p.is_file())
    assert {n: (tmp_path / n).read_bytes() for n in written} == _committed(written)


# -- the sequence container's must-reject vectors (FORMAT.md 11.7, appendix A) --------------------------

SEQUENCE = VECTORS / "sequence"
SEQUENCE_REJECT = json.loads((SEQUENCE / "reject.json").read_text())


def sequence_rules() -> dict:
    rows = {}
    for line in (SPEC / "FORMAT.md").read_text().splitlines():
        m = re.match(r"\| ([SC]\d+) \|.*\| (\w+Error) \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_sequence_reject_vectors_cover_every_rule_of_11_7():
    rows = sequence_rules()
    assert list(rows) == [f"S{i}" for i in range(1, 17)] + [f"C{i}" for i in range(1, 6)]
    assert {e["rule"] for e in SEQUENCE_REJECT} == set(rows)
    for entry in SEQUENCE_REJECT:
        error, phrases = rows[entry["rule"]]
        assert entry["error"] == error and entry["message"] in phrases.split("; "), entry["name"]
        assert (SEQUENCE / f"{entry['name']}.bin").is_file()


@pytest.mark.parametrize("entry", SEQUENCE_REJECT, ids=[e["name"] for e in SEQUENCE_REJECT])
def test_reference_rejects_sequence_vector(entry):
    """gaac.transfer refuses each with the class and phrase of its rule: an import leaves the cache empty, and a
    container with its calibration embedded is refused by unpack without one."""
    from gaac import transfer
    from gaac.cache import PagedKVCache

    data = (SEQUENCE / f"{entry['name']}.bin").read_bytes()
    with pytest.raises(getattr(gaac, entry["error"]), match=re.escape(entry["message"])):
        if entry["calibration"] is None:
            transfer.unpack(data)
        else:
            cache = PagedKVCache(gaac.Calibration.load(SEQUENCE / entry["calibration"]), max_blocks=2,
                                 adapt=entry["adapt"])
            try:
                cache.import_sequence(data)
            finally:
                assert cache.sequences == []


@pytest.mark.parametrize("entry", SEQUENCE_REJECT, ids=[e["name"] for e in SEQUENCE_REJECT])
def test_spec_decoder_rejects_sequence_vector(entry):
    cal = None if entry["calibration"] is None else spec_decoder.load_calibration(SEQUENCE / entry["calibration"])
    with pytest.raises(getattr(spec_decoder, entry["error"])) as info:
        spec_decoder.read_sequence((SEQUENCE / f"{entry['name']}.bin").read_bytes(), cal, keeps_epochs=entry["adapt"])
    assert info.value.rule == entry["rule"]


@pytest.mark.parametrize("name", ["seq_epochs", "seq_embedded"])
def test_spec_decoder_reads_the_sequence_vectors(name):
    """FORMAT.md section 11 alone: the container's checks, its epoch records and the K and V it holds."""
    meta = json.loads((SEQUENCE / f"{name}.json").read_text())
    cal = None if meta["calibration_embedded"] else spec_decoder.load_calibration(SEQUENCE / meta["calibration"])
    out = spec_decoder.read_sequence((SEQUENCE / f"{name}.bin").read_bytes(), cal)
    for kind, values in zip("kv", out.values):
        assert values == [[[[int(row[i:i + 4], 16) for i in range(0, len(row), 4)] for row in head] for head in layer]
                          for layer in meta["expected"][kind]], kind
    assert [[f"{b:08x}" for _, b in s] for s in out.epochs] == [[e["bases_id"] for e in s["epochs"]]
                                                                 for s in meta["sections"]]


# -- slices by KV head (FORMAT.md 11.12, appendix A) ------------------------------------------------------

SLICED = ["seq_heads", "seq_heads_d256"]


def spec_slice(cal: spec_decoder.Calibration, start: int, stop: int) -> spec_decoder.Calibration:
    """FORMAT.md 11.12 alone: the calibration of KV heads start .. stop - 1, every base table (epochs' too) sliced
    on the heads axis, the capacities and epoch numbers as they are."""
    return spec_decoder.Calibration(cal.layers, stop - start, cal.head_dim,
                                    b3=[[layer[start:stop] for layer in kind] for kind in cal.b3],
                                    b4=[[layer[start:stop] for layer in kind] for kind in cal.b4],
                                    capacity=cal.capacity,
                                    epochs=[[[(b3[start:stop], b4[start:stop]) for b3, b4 in layer] for layer in kind]
                                            for kind in cal.epochs])


def sliced_vector(name: str):
    meta = json.loads((SEQUENCE / f"{name}.json").read_text())
    return meta, (SEQUENCE / f"{name}.bin").read_bytes(), tuple(meta["sliced_from"]["heads"])


@pytest.mark.parametrize("name", SLICED)
def test_spec_decoder_reads_the_sliced_sequence_vectors(name):
    """The sliced calibration's id is the id of its own tables, its epochs' ids follow from it, and with it the
    slice reads as any container: the K and V of the heads it holds."""
    meta, data, (a, b) = sliced_vector(name)
    source = spec_decoder.load_calibration(SEQUENCE / meta["sliced_from"]["calibration"])
    sliced = spec_slice(source, a, b)
    given = spec_decoder.load_calibration(SEQUENCE / meta["calibration"])     # checks every id the file names
    assert (given.canonical_bytes(), given.epochs) == (sliced.canonical_bytes(), sliced.epochs)
    assert f"{sliced.id:08x}" == meta["calibration_id"] != f"{source.id:08x}"
    for cal in [sliced] + ([None] if meta["calibration_embedded"] else []):
        out = spec_decoder.read_sequence(data, cal)
        for kind, values in zip("kv", out.values):
            assert values == [[[[int(row[i:i + 4], 16) for i in range(0, len(row), 4)] for row in head]
                               for head in layer] for layer in meta["expected"][kind]], kind
        assert [[f"{b:08x}" for _, b in s] for s in out.epochs] == [[e["bases_id"] for e in s["epochs"]]
                                                                     for s in meta["sections"]]
        assert [[bases_id for _, bases_id in s] for s in out.epochs] == \
            [[sliced.epoch_id(i % 2, i // 2, e) for e, _ in s] for i, s in enumerate(out.epochs)]
    with pytest.raises(spec_decoder.CalibrationError) as info:
        spec_decoder.read_sequence(data, source)
    assert info.value.rule == "C1"


@pytest.mark.parametrize("name", SLICED)
def test_reference_reads_the_sliced_sequence_vectors(name):
    """gaac's slice_heads gives the vector's calibration file; a cache made with it imports the slice to the
    expected K and V, and one made with the unsliced calibration refuses it (C1).  The slice of a sequence
    imported from the whole vector is the vector, byte for byte."""
    from gaac import transfer
    from gaac.cache import PagedKVCache

    meta, data, (a, b) = sliced_vector(name)
    source = gaac.Calibration.load(SEQUENCE / meta["sliced_from"]["calibration"])
    sliced = source.slice_heads(a, b)
    assert sliced.to_dict() == gaac.Calibration.load(SEQUENCE / meta["calibration"]).to_dict()
    cache = PagedKVCache(sliced, max_blocks=4, grow=True)
    k, v = cache.read(cache.import_sequence(data))
    for kind, x in zip("kv", (k, v)):
        np.testing.assert_array_equal(x, np.array([[[[int(row[i:i + 4], 16) for i in range(0, len(row), 4)]
                                                      for row in head] for head in layer]
                                                    for layer in meta["expected"][kind]], dtype=np.uint16))
    with pytest.raises(gaac.CalibrationError, match="exported from a cache with calibration"):
        PagedKVCache(source, max_blocks=4, grow=True).import_sequence(data)
    if meta["sliced_from"]["vector"] is not None:
        whole = PagedKVCache(source, max_blocks=4, grow=True)
        seq = whole.import_sequence((SEQUENCE / f"{meta['sliced_from']['vector']}.bin").read_bytes())
        assert bytes(transfer.export_sequence(whole, seq, heads=(a, b),
                                              calibration=meta["calibration_embedded"])) == data
