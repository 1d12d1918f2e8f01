"""format_spec/FORMAT.md cannot drift from the code: its tables and examples are checked against gaac.

Each checked table in FORMAT.md follows a ``<!-- gaac:table NAME -->`` marker.
Numbers are compared with gaac/layout.py (the one module every number comes
from), byte layouts with bytes the reference actually writes, and the worked
example with the reference codec and the spec-only decoder.
"""
from __future__ import annotations

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
from gaac.calibration import CALIBRATION_VERSION
from gaac.reference.bits import join_bf16
from gaac.reference.codec import encode_tiles

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "format_spec" / "FORMAT.md").read_text()
CAL_FILE = ROOT / "format_spec" / "vectors" / "cal_one_head.json"
EPOCH_CAL_FILE = ROOT / "format_spec" / "vectors" / "cal_epochs.json"


def table(name: str, text: str = TEXT) -> list[dict]:
    """The rows of the markdown table after ``<!-- gaac:table name -->``, as {header: cell}, backticks removed.

    ``text`` is FORMAT.md by default; test_fp8 reads FORMAT-FP8.md's tables with it,
    since both documents mark their checked tables the same way.
    """
    lines = text.split(f"<!-- gaac:table {name} -->\n", 1)[1].splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip().replace("`", "") for c in line.strip().strip("|").split(" | ")])
    header, body = rows[0], rows[2:]
    assert rows[1][0].startswith("---") and body, f"table {name} is empty or malformed"
    return [dict(zip(header, r, strict=True)) for r in body]


def numbers(cell: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", cell)]


def test_constants_table_matches_layout():
    rows = table("constants")
    assert len(rows) >= 20
    for row in rows:
        assert getattr(L, row["name"]) == int(row["value"], 0), row


def test_tiles_table_matches_layout():
    rows = table("tiles")
    assert [int(r["head_dim"]) for r in rows] == list(L.SUPPORTED_HEAD_DIMS)
    for r in rows:
        dim = int(r["head_dim"])
        geo = L.geometry(dim)
        assert (int(r["C"]), int(r["tiles per head"])) == (L.tile_channels(dim), L.tiles_per_head(dim))
        assert (int(r["elements per tile"]), int(r["groups per tile"]), int(r["groups per token row"])) == \
            (geo.elements, geo.groups, geo.groups_per_row)


def test_slot_table_matches_tile_geometry():
    rows = {r["section"]: r for r in table("slot")}
    for c in (64, 128):
        geo = L.TileGeometry(c)
        want = {"sign+mantissa": (geo.sm_offset, geo.sm_bytes), "code stream": (geo.code_offset, geo.code_bytes),
                "tag stream": (geo.tag_offset, geo.tag_bytes), "escape area": (geo.escape_offset, "capacity")}
        assert list(rows) == list(want)
        for section, (offset, size) in want.items():
            row = rows[section]
            assert int(row[f"offset, C = {c}"]) == offset and offset % L.SLOT_ALIGN == 0
            assert row[f"bytes, C = {c}"] == str(size)


def test_sizes_table_matches_tile_geometry():
    rows = table("sizes")
    assert [int(r["C"]) for r in rows] == [64, 128]
    for r in rows:
        geo = L.TileGeometry(int(r["C"]))
        assert (int(r["fixed size"]), int(r["raw tile"]), int(r["largest useful capacity"])) == \
            (geo.fixed_bytes, geo.raw_bytes, geo.max_useful_capacity)


def _struct_fields(fmt: str) -> list[tuple[int, int, str]]:
    """(offset, size, type) of every field of a little-endian struct format such as ``<4sBH``."""
    names = {"s": "bytes", "B": "u8", "H": "u16", "I": "u32", "Q": "u64"}
    out, offset = [], 0
    for count, code in re.findall(r"(\d*)([sBHIQ])", fmt):
        if code == "s":
            out.append((offset, int(count), "bytes"))
            offset += int(count)
            continue
        for _ in range(int(count or 1)):
            size = struct.calcsize("<" + code)
            out.append((offset, size, names[code]))
            offset += size
    return out


@pytest.mark.parametrize("epoch", [0, 2])
def test_header_table_matches_stream_header_and_real_headers(epoch):
    """Epoch 0 is written as version 1 (its bytes 20..23 zero), a later epoch as version 2 naming it."""
    rows = table("header")
    assert [(int(r["offset"]), int(r["size"]), r["type"]) for r in rows] == _struct_fields(L.STREAM_HEADER_V2.format)
    assert sum(int(r["size"]) for r in rows) == L.STREAM_HEADER_BYTES == L.STREAM_HEADER_V2.size
    # the version 1 layout (still FP8's) is the same bytes with the last u32 whole
    assert _struct_fields(L.STREAM_HEADER.format)[:-1] == _struct_fields(L.STREAM_HEADER_V2.format)[:-2]

    cal = gaac.Calibration.load(EPOCH_CAL_FILE)
    block = np.full((2, L.BLOCK_TOKENS, 64), 0x3F80, dtype=np.uint16)
    data = gaac.encode_block(block, cal, 0, "k", epoch=epoch).data
    field = {r["field"]: r for r in rows}

    def read(name):
        r = field[name]
        raw = data[int(r["offset"]):int(r["offset"]) + int(r["size"])]
        return raw if r["type"] == "bytes" else int.from_bytes(raw, "little")

    assert read("magic") == L.STREAM_MAGIC and L.STREAM_MAGIC.hex() == field["magic"]["value"].split("(")[1]\
        .strip(")").replace(" ", "")
    assert read("version") == (1 if epoch == 0 else L.FORMAT_VERSION) and numbers(field["version"]["value"])[:2] \
        == [1, L.FORMAT_VERSION]
    assert read("element format") == L.ELEMENT_BF16 == numbers(field["element format"]["value"])[0]
    assert read("kind") == L.KIND_K
    assert read("tokens") == L.BLOCK_TOKENS == int(field["tokens"]["value"])
    assert (read("layer"), read("kv_heads"), read("head_dim")) == (0, 2, 64)
    assert read("escape capacity") == cal.capacity[L.KIND_K, 0]
    assert read("calibration id") == cal.epoch_id(0, L.KIND_K, epoch) and (read("calibration id") == cal.id) \
        == (epoch == 0)
    assert (read("epoch"), read("reserved")) == (epoch, 0)


def check_byte_table(name: str, data: bytes, dims: dict[str, int], fields: list[bytes]) -> None:
    """Table ``name`` lists ``data`` field by field: each row's offset and size hold the field, the last ends it.

    The byte tables give offsets and sizes as sums of terms such as ``20``, ``HD``
    or ``2LHD`` (a count times dimensions named by one letter), read with ``dims``.
    """
    def size(expr: str) -> int:
        terms = re.findall(rf"(\d*)([{''.join(dims)}]*)", expr)
        return sum(int(n or 1) * int(np.prod([dims[v] for v in vs])) for n, vs in terms if n or vs)

    rows = table(name)
    assert len(rows) == len(fields)
    for row, expect in zip(rows, fields):
        start = size(row["offset"])
        assert data[start:start + size(row["size"])] == expect, row
    assert len(data) == size(rows[-1]["offset"]) + size(rows[-1]["size"])


def test_epoch_bytes_table_matches_epoch_canonical_bytes():
    cal = gaac.Calibration.load(EPOCH_CAL_FILE)
    layer, kind, epoch = 0, L.KIND_K, 2
    data = cal.epoch_canonical_bytes(layer, kind, epoch)
    b3, b4 = cal.bases(layer, kind, epoch)
    check_byte_table("epoch-bytes", data, {"H": cal.kv_heads, "D": cal.head_dim},
                     [b"GAACEPCH", struct.pack("<I", cal.id), struct.pack("<H", layer), struct.pack("<H", epoch),
                      bytes([kind]), b3.tobytes(), b4.tobytes()])
    assert zlib.crc32(data) == cal.epoch_id(layer, kind, epoch) == spec_decoder.load_calibration(EPOCH_CAL_FILE)\
        .epoch_id(kind, layer, epoch)


def test_modes_table_matches_layout():
    rows = {int(r["tag"]): r for r in table("modes")}
    assert sorted(rows) == [L.MODE_3BIT, L.MODE_4BIT, L.MODE_RAW, L.MODE_RESERVED]
    for tag, width in ((L.MODE_3BIT, L.WINDOW_3BIT), (L.MODE_4BIT, L.WINDOW_4BIT), (L.MODE_RAW, 256)):
        assert rows[tag]["mode"].replace("-", "") == L.MODE_NAMES[tag]
        assert numbers(rows[tag]["code range"]) == [0, width - 1]
        assert int(rows[tag]["escape bytes per group"]) == L.ESCAPE_BYTES[tag]
    assert rows[L.MODE_RESERVED]["mode"] == "reserved"


def test_calibration_bytes_table_matches_canonical_bytes():
    layers, heads, dim = 2, 3, 64
    rng = np.random.default_rng(0)
    cal = gaac.Calibration(b3=rng.integers(0, L.B3_MAX + 1, (2, layers, heads, dim)),
                           b4=rng.integers(0, L.B4_MAX + 1, (2, layers, heads, dim)),
                           capacity=rng.integers(0, 50, (2, layers)) * L.SLOT_ALIGN)
    data = cal.canonical_bytes()
    check_byte_table("calibration-bytes", data, {"L": layers, "H": heads, "D": dim},
                     [b"GAACCAL", bytes([CALIBRATION_VERSION]), struct.pack("<I", layers), struct.pack("<I", heads),
                      struct.pack("<I", dim), cal.b3.tobytes(), cal.b4.tobytes(),
                      cal.capacity.astype("<u2").tobytes()])
    assert zlib.crc32(data) == cal.id


def test_calibration_json_table_lists_the_keys_of_a_saved_file():
    keys = [r["key"] for r in table("calibration-json")]
    with_epochs = json.loads(EPOCH_CAL_FILE.read_text())
    without = json.loads(CAL_FILE.read_text())
    assert keys == list(with_epochs) and [k for k in keys if k != "epochs"] == list(without)
    assert (without["version"], with_epochs["version"]) == (1, 2)
    assert without["format"] == table("calibration-json")[0]["content"].strip('"')


def test_worked_example_matches_the_reference_and_the_spec_decoder():
    rows = table("example-groups")
    b3, b4 = 120, 116
    exponent = np.full((L.BLOCK_TOKENS, 64), b3, dtype=np.uint8)
    for g, row in enumerate(rows):
        exponent[0, 8 * g:8 * g + 8] = numbers(row["exponents e_0 .. e_7"])
    bits = join_bf16(np.zeros_like(exponent), exponent).reshape(1, L.BLOCK_TOKENS, 64)
    enc = encode_tiles(bits, np.full((1, 64), b3), np.full((1, 64), b4), capacity=16)
    slot = enc.slots[0].tobytes()
    geo = L.TileGeometry(64)

    escapes = []
    for g, row in enumerate(rows):
        assert L.MODE_NAMES[int(enc.modes[0, g])] == row["mode"].replace("-", "")
        e = numbers(row["exponents e_0 .. e_7"])
        base = {"3bit": b3, "4bit": b4, "raw": 0}[L.MODE_NAMES[int(enc.modes[0, g])]]
        assert numbers(row["codes"]) == [x - base for x in e]
        escapes += bytes.fromhex(row["escape bytes"]) if row["escape bytes"] != "-" else b""

    block = TEXT.split("<!-- gaac:example slot-bytes -->\n```\n", 1)[1].split("```", 1)[0]
    listed = {}
    for line in block.strip().splitlines():
        label, rest = line.split(":", 1)
        listed[label] = bytes(int(x, 16) for x in re.findall(r"\b[0-9A-F]{2}\b", rest.split("(")[0]))
    assert listed["code stream bytes 0..8"] == slot[geo.code_offset:geo.code_offset + 9]
    assert listed["tag stream byte 0"] == slot[geo.tag_offset:geo.tag_offset + 1]
    assert listed["escape area bytes 0..5"] == bytes(escapes) == slot[geo.escape_offset:geo.escape_offset + 6]

    decoded, modes, used = spec_decoder.decode_slot(slot, [b3] * 64, [b4] * 64, 16, 64, 0)
    assert decoded == bits.ravel().tolist() and used == len(escapes)


def test_table9_numbers_follow_from_the_layout():
    rows = {r["field"]: r["this format, bytes per tile"] for r in table("table9")}
    geo = L.TileGeometry(L.TILE_MAX_CHANNELS)
    assert numbers(rows["sign and mantissa"])[0] == geo.sm_bytes
    assert numbers(rows["3-bit exponent codes"])[1 - 1] == geo.code_bytes
    assert numbers(rows["mode tags"])[0] == geo.tag_bytes
    assert numbers(rows["block-table entry"]) == [L.TABLE_ENTRY_BYTES]
    assert numbers(rows["fallback raw tiles"])[:2] == [geo.raw_bytes, geo.fixed_bytes]
    assert numbers(rows["total"])[:3] == [geo.fixed_bytes, L.TABLE_ENTRY_BYTES, geo.raw_bytes - geo.fixed_bytes]
    assert geo.sm_bytes * 8 / geo.elements == 8 and (geo.fixed_bytes * 8 / geo.elements) == 11.25


def test_crc_check_value_in_section_7_4():
    check = re.search(r"`123456789` is `0x([0-9A-F]{8})`", TEXT).group(1)
    assert zlib.crc32(b"123456789") == spec_decoder.crc32(b"123456789") == int(check, 16)


def test_sections_cited_by_the_code_exist():
    headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", TEXT, flags=re.M))
    cited = set()
    pattern = r"FORMAT\.md,?\s+(?:sections?\s+)?(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?"
    for path in (ROOT / "gaac").rglob("*.py"):
        for first, last in re.findall(pattern, path.read_text()):
            cited |= {first, last} - {""}
            if last:      # a range "4-6" or "5.1-5.3": every section between
                *major, a = first.split(".")
                b = last.split(".")[-1]
                cited |= {".".join(major + [str(n)]) for n in range(int(a), int(b) + 1)}
    assert len(cited) > 5 and cited <= headings, sorted(cited - headings)


# -- the calibration rules of FORMAT.md 3.2 and 3.4, in both decoders ------------------------------------

def _mutated(change) -> dict:
    """The calibration file with one change and without its optional id, so the id check cannot catch it."""
    d = json.loads(CAL_FILE.read_text())
    del d["id"]
    change(d)
    return d


def _set(path, value):
    def change(d):
        *head, last = path
        for key in head:
            d = d[key]
        d[last] = value
    return change


BAD_CALIBRATIONS = {
    "format": _set(["format"], "gaac-calib"),
    "version": _set(["version"], 3),
    "epochs in a version 1 file": lambda d: d.update(epochs={"k": [[]], "v": [[]]}),
    "b3 above 248": _set(["k", "b3", 0, 0, 5], L.B3_MAX + 1),
    "b4 above 240": _set(["v", "b4", 0, 0, 7], L.B4_MAX + 1),
    "negative base": _set(["k", "b4", 0, 0, 0], -1),
    "capacity not a multiple of 16": _set(["k", "capacity", 0], 24),
    "capacity above 65520": _set(["v", "capacity", 0], L.MAX_ESCAPE_CAPACITY + L.SLOT_ALIGN),
    "head_dim disagrees with tables": _set(["head_dim"], 128),
    "layers disagree with tables": _set(["layers"], 2),
    "ragged table": lambda d: d["k"]["b3"][0][0].pop(),
    "missing v": lambda d: d.pop("v"),
    "id differs": _set(["id"], "00000000"),
    "no layers": lambda d: d.update(layers=0, k={"b3": [], "b4": [], "capacity": []},
                                    v={"b3": [], "b4": [], "capacity": []}),
    "layers as 1.0": _set(["layers"], 1.0),
    "kv_heads as true": _set(["kv_heads"], True),
    "id in upper case": lambda d: d.update(id=json.loads(CAL_FILE.read_text())["id"].upper()),
    "id as a number": lambda d: d.update(id=int(json.loads(CAL_FILE.read_text())["id"], 16)),
    "model a number": _set(["model"], 5),
    "epochs of another shape: a third key": lambda d: d.update(version=2, epochs={"k": [[]], "v": [[]], "q": []}),
    "an epoch entry with another key": lambda d: d.update(version=2, epochs={"k": [[{
        "b3": d["k"]["b3"][0], "b4": d["k"]["b4"][0], "scale": 1}]]}),
}


@pytest.mark.parametrize("case", sorted(BAD_CALIBRATIONS))
def test_bad_calibration_is_refused_by_both_decoders(case):
    d = _mutated(BAD_CALIBRATIONS[case])
    with pytest.raises(gaac.CalibrationError):
        gaac.Calibration.from_dict(d)
    with pytest.raises(spec_decoder.CalibrationError):
        spec_decoder.load_calibration(d)


def test_calibration_files_load_alike_in_both_decoders():
    for path in sorted((ROOT / "format_spec" / "vectors").glob("cal_*.json")):
        assert spec_decoder.load_calibration(path).id == gaac.Calibration.load(path).id \
            == int(json.loads(path.read_text())["id"], 16), path.name


@pytest.mark.parametrize("value", [1.5, True], ids=["float", "bool"])
def test_spec_decoder_refuses_non_integer_bases(value):
    with pytest.raises(spec_decoder.CalibrationError):
        spec_decoder.load_calibration(_mutated(_set(["k", "b3", 0, 0, 0], value)))


def test_reference_refuses_non_integer_bases():
    with pytest.raises(gaac.CalibrationError):
        gaac.Calibration.from_dict(_mutated(_set(["k", "b3", 0, 0, 0], 121.5)))



def test_unknown_keys_outside_the_epochs_section_are_ignored_by_both_decoders():
    """FORMAT.md 3.4: the top-level object and k / v are open (unknown keys ignored); a version 2 file without
    an epochs section is a calibration without epochs."""
    d = json.loads(CAL_FILE.read_text())
    d.update(future={"x": 1}, version=2)
    d["k"]["scale_log2"] = [[0]]
    assert gaac.Calibration.from_dict(d).id == spec_decoder.load_calibration(d).id == int(d["id"], 16)
    assert not gaac.Calibration.from_dict(d).epochs


def test_more_layers_or_kv_heads_than_a_u16_holds_are_refused():
    """FORMAT.md 3.2 rule 4: headers and epoch bytes name a layer and count heads in a u16: a calibration of
    more is refused however it is made (from tables here; a file's tables go through the same check)."""
    for layers, heads in ((L.MAX_LAYERS + 1, 1), (1, L.MAX_KV_HEADS + 1)):
        b3, b4 = (np.full((2, layers, heads, 64), base, np.uint8) for base in (120, 112))
        with pytest.raises(gaac.CalibrationError, match="at most 65535"):
            gaac.Calibration(b3=b3, b4=b4, capacity=np.zeros((2, layers), np.int64))
        with pytest.raises(spec_decoder.CalibrationError, match="65535"):
            spec_decoder.check_dimensions(layers, heads, 64)
    assert L.MAX_LAYERS == L.MAX_KV_HEADS == 0xFFFF
