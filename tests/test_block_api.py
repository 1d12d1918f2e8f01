"""The block API under attack: corrupt streams and bad inputs raise the typed error.

A decoder meets streams from disk and the wire, so every truncation, every
byte burst, and every rule of FORMAT.md section 8 broken on purpose (with the
CRC recomputed so that the inner rule is the one that trips) must raise
exactly :class:`gaac.FormatError` -- or :class:`gaac.CalibrationError` for a
valid stream read with another calibration -- never an IndexError, a crash or
a hang.  Inputs to ``encode_block`` that are not one BF16 block raise
:class:`gaac.InputError` naming the problem.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import block_cases, calibrations, forced_blocks, overflow_blocks

import gaac
from gaac import CalibrationError, FormatError, InputError
from gaac import layout as L
from gaac.calibration import Calibration

HEADER_FIELDS = ("magic", "version", "element", "kind", "tokens", "layer", "kv_heads", "head_dim",
                 "capacity", "calibration_id", "reserved")    # the order of layout.STREAM_HEADER


def raises(exc_type, fn, *args, match: str | None = None):
    """Call ``fn`` and require exactly ``exc_type`` (not a subclass, not another error), with ``match`` in it."""
    with pytest.raises(Exception) as info:
        fn(*args)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    if match is not None:
        assert match in str(info.value), str(info.value)
    return info.value


def reseal(data: bytes) -> bytes:
    """Replace the trailing CRC-32 so that only the inner rule can reject the stream."""
    return data[:-L.STREAM_CRC_BYTES] + zlib.crc32(data[:-L.STREAM_CRC_BYTES]).to_bytes(4, "little")


def with_header(data: bytes, **changes) -> bytes:
    fields = dict(zip(HEADER_FIELDS, L.STREAM_HEADER.unpack_from(data)))
    fields.update(changes)
    return reseal(L.STREAM_HEADER.pack(*fields.values()) + data[L.STREAM_HEADER_BYTES:])


class Stream:
    """Where things are in one encoded block's container."""

    def __init__(self, case):
        self.case = case
        self.enc = gaac.encode_block(case.bits, case.calibration, case.layer, case.kind)
        self.data = self.enc.data
        self.geo = L.geometry(case.head_dim)
        self.n_tiles = self.enc.n_tiles
        self.table_end = L.STREAM_HEADER_BYTES + self.n_tiles * L.TABLE_ENTRY_BYTES
        self.slot_bytes = self.geo.slot_bytes(case.capacity)
        self.slot_tiles = [t for t in range(self.n_tiles) if t not in self.enc.raw_tiles]

    def slot_offset(self, tile: int) -> int:
        return self.table_end + self.slot_tiles.index(tile) * self.slot_bytes

    def escape_used(self, tile: int) -> int:
        return sum(L.ESCAPE_BYTES[int(m)] for m in self.enc.modes[tile])

    def decode(self, data: bytes):
        return gaac.decode_block(data, self.case.calibration)


# -- truncation and corruption ------------------------------------------------------------------------

@settings(max_examples=8, deadline=None)
@given(st.one_of(overflow_blocks(heads=2), block_cases(head_dim=64, heads=1), overflow_blocks(head_dim=256, heads=1)))
def test_every_truncation_raises(case):
    s = Stream(case)
    for n in range(len(s.data)):
        raises(FormatError, s.decode, s.data[:n])
    raises(FormatError, s.decode, s.data + b"\0", match="trailing")


@settings(max_examples=150, deadline=None)
@given(block_cases(), st.data())
def test_byte_bursts_are_caught(case, data):
    """Any burst of 1..4 corrupted bytes (at most 32 bits: CRC-32 catches every such burst)."""
    s = Stream(case)
    start = data.draw(st.integers(0, len(s.data) - 1), label="start")
    width = data.draw(st.integers(1, min(4, len(s.data) - start)), label="width")
    mask = data.draw(st.binary(min_size=width, max_size=width).filter(lambda b: b[0] and b[-1]), label="xor")
    bad = bytearray(s.data)
    for i, m in enumerate(mask):
        bad[start + i] ^= m
    raises(FormatError, s.decode, bytes(bad))


def set_tag(data: bytearray, s: Stream, tile: int, group: int, mode: int) -> None:
    at = s.slot_offset(tile) + s.geo.tag_offset + group * L.TAG_BITS // 8
    shift = group * L.TAG_BITS % 8
    data[at] = (data[at] & ~(3 << shift) & 0xFF) | (mode << shift)


@settings(max_examples=40, deadline=None)
@given(forced_blocks(), st.data())
def test_reserved_tag_rejected(case, data):
    s = Stream(case)
    tile = data.draw(st.sampled_from(s.slot_tiles))
    group = data.draw(st.integers(0, s.geo.groups - 1))
    bad = bytearray(s.data)
    set_tag(bad, s, tile, group, L.MODE_RESERVED)
    raises(FormatError, s.decode, reseal(bytes(bad)), match="reserved")


@settings(max_examples=40, deadline=None)
@given(forced_blocks(), st.data())
def test_escapes_over_capacity_rejected(case, data):
    """Tags that ask for more escape bytes than the slot holds."""
    s = Stream(case)
    assume(s.geo.groups * L.ESCAPE_BYTES[L.MODE_RAW] > case.capacity)
    tile = data.draw(st.sampled_from(s.slot_tiles))
    bad = bytearray(s.data)
    for g in range(s.geo.groups):
        set_tag(bad, s, tile, g, L.MODE_RAW)
    raises(FormatError, s.decode, reseal(bytes(bad)), match="escape bytes")


@settings(max_examples=40, deadline=None)
@given(forced_blocks(), st.data())
def test_nonzero_escape_padding_rejected(case, data):
    s = Stream(case)
    spare = [t for t in s.slot_tiles if s.escape_used(t) < case.capacity]
    assume(spare)
    tile = data.draw(st.sampled_from(spare))
    at = data.draw(st.integers(s.escape_used(tile), case.capacity - 1))
    bad = bytearray(s.data)
    bad[s.slot_offset(tile) + s.geo.escape_offset + at] = data.draw(st.integers(1, 255))
    raises(FormatError, s.decode, reseal(bytes(bad)), match="not zero")


@settings(max_examples=40, deadline=None)
@given(st.one_of(overflow_blocks(), block_cases()), st.data())
def test_wrong_table_index_rejected(case, data):
    s = Stream(case)
    tile = data.draw(st.integers(0, s.n_tiles - 1))
    at = L.STREAM_HEADER_BYTES + tile * L.TABLE_ENTRY_BYTES
    entry = int.from_bytes(s.data[at:at + 4], "little")
    index = data.draw(st.integers(0, L.TABLE_INDEX_MASK).filter(lambda i: i != entry & L.TABLE_INDEX_MASK))
    new = (entry & L.TABLE_RAW_FLAG) | index
    bad = s.data[:at] + new.to_bytes(4, "little") + s.data[at + 4:]
    raises(FormatError, s.decode, reseal(bad), match="table entry")


@settings(max_examples=20, deadline=None)
@given(overflow_blocks(), st.data())
def test_flipped_raw_flag_rejected(case, data):
    """A table entry moved to the other pool changes the stream's expected length."""
    s = Stream(case)
    tile = data.draw(st.integers(0, s.n_tiles - 1))
    at = L.STREAM_HEADER_BYTES + tile * L.TABLE_ENTRY_BYTES
    entry = int.from_bytes(s.data[at:at + 4], "little") ^ L.TABLE_RAW_FLAG
    raises(FormatError, s.decode, reseal(s.data[:at] + entry.to_bytes(4, "little") + s.data[at + 4:]))


def other_supported(value, choices):
    return next(c for c in choices if c != value)


BAD_HEADERS = [
    # (field, new value from the stream's own fields, error, fragment of its message)
    ("magic", lambda f: b"GAAD", FormatError, "magic"),
    ("version", lambda f: L.FORMAT_VERSION + 1, FormatError, "version"),
    ("element", lambda f: L.ELEMENT_BF16 + 1, FormatError, "element format"),
    ("element", lambda f: 0, FormatError, "element format"),
    ("kind", lambda f: max(L.KIND_NAMES) + 1, FormatError, "kind="),
    ("tokens", lambda f: L.BLOCK_TOKENS // 2, FormatError, "tokens="),
    ("reserved", lambda f: 1, FormatError, "reserved="),
    ("head_dim", lambda f: 96, FormatError, "head_dim="),
    ("head_dim", lambda f: other_supported(f["head_dim"], L.SUPPORTED_HEAD_DIMS), FormatError, "stream"),
    ("kv_heads", lambda f: 0, FormatError, "kv_heads="),
    ("kv_heads", lambda f: f["kv_heads"] + 1, FormatError, "stream"),
    ("capacity", lambda f: f["capacity"] + L.SLOT_ALIGN // 2, FormatError, "multiple"),
    ("capacity", lambda f: f["capacity"] + L.SLOT_ALIGN, FormatError, "stream"),
    ("layer", lambda f: 3, CalibrationError, "out of range"),
    ("calibration_id", lambda f: f["calibration_id"] ^ 1, CalibrationError, "calibration"),
]


@pytest.mark.parametrize("field,value,error,fragment", BAD_HEADERS,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_HEADERS)])
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_bad_header_rejected(field, value, error, fragment, data):
    case = data.draw(forced_blocks())       # no raw tiles: a changed capacity or head_dim changes the length
    s = Stream(case)
    fields = dict(zip(HEADER_FIELDS, L.STREAM_HEADER.unpack_from(s.data)))
    assert case.calibration.layers <= 3          # block_cases draws 1..3 layers, so layer 3 is out of range
    raises(error, s.decode, with_header(s.data, **{field: value(fields)}), match=fragment)


@settings(max_examples=30, deadline=None)
@given(block_cases(), st.data())
def test_other_calibration_rejected(case, data):
    s = Stream(case)
    cal = case.calibration
    other = data.draw(calibrations(cal.layers, cal.kv_heads, cal.head_dim))
    assume(other.id != cal.id)
    raises(CalibrationError, gaac.decode_block, s.data, other, match="calibration")


def forged_for(s: Stream, other: Calibration) -> bytes:
    """The stream with its calibration id replaced by ``other``'s, so only the checks behind the id remain."""
    return with_header(s.data, calibration_id=other.id)


@settings(max_examples=10, deadline=None)
@given(block_cases())
def test_forged_id_other_shape_rejected(case):
    s = Stream(case)
    cal = case.calibration
    other = Calibration(b3=np.zeros((2, cal.layers, cal.kv_heads + 1, cal.head_dim)),
                        b4=np.zeros((2, cal.layers, cal.kv_heads + 1, cal.head_dim)), capacity=cal.capacity)
    raises(CalibrationError, gaac.decode_block, forged_for(s, other), other, match="KV heads")


@settings(max_examples=10, deadline=None)
@given(block_cases())
def test_forged_id_other_capacity_rejected(case):
    s = Stream(case)
    cal = case.calibration
    capacity = cal.capacity.copy()
    capacity[case.kind_index, case.layer] += L.SLOT_ALIGN
    other = Calibration(b3=cal.b3, b4=cal.b4, capacity=capacity)
    raises(CalibrationError, gaac.decode_block, forged_for(s, other), other, match="escape capacity")


# -- API input errors ---------------------------------------------------------------------------------

def one_block_calibration(heads=2, head_dim=64, layers=2):
    return Calibration(b3=np.full((2, layers, heads, head_dim), 120), b4=np.full((2, layers, heads, head_dim), 116),
                       capacity=np.full((2, layers), 64))


GOOD = np.full((2, L.BLOCK_TOKENS, 64), 0x3F80, dtype=np.uint16)

BAD_INPUTS = [
    (GOOD.astype(np.float32), InputError, "dtype float32"),
    (GOOD.astype(np.float16), InputError, "dtype float16"),
    (GOOD.astype(np.int32), InputError, "dtype int32"),
    (GOOD.astype(np.float64), InputError, "dtype float64"),
    (GOOD.astype(bool), InputError, "dtype bool"),
    (torch.ones(2, L.BLOCK_TOKENS, 64, dtype=torch.float16), InputError, "torch.float16"),
    (torch.ones(2, L.BLOCK_TOKENS, 64, dtype=torch.float32), InputError, "torch.float32"),
    (torch.ones(2, L.BLOCK_TOKENS, 64, dtype=torch.bfloat16, device="meta"), InputError, "meta"),
    (GOOD.tolist(), InputError, "list"),
    (GOOD[0], InputError, "dimensions"),
    (GOOD[None], InputError, "dimensions"),
    (GOOD[:, :8], InputError, "16 tokens"),
    (np.zeros((2, 2 * L.BLOCK_TOKENS, 64), np.uint16), InputError, "16 tokens"),
    (np.zeros((2, L.BLOCK_TOKENS, 96), np.uint16), InputError, "head_dim 96"),
    (np.zeros((2, L.BLOCK_TOKENS, 512), np.uint16), InputError, "head_dim 512"),
    (np.zeros((2, L.BLOCK_TOKENS, 128), np.uint16), CalibrationError, "head_dim 64"),
    (np.zeros((3, L.BLOCK_TOKENS, 64), np.uint16), CalibrationError, "2 KV heads"),
]


@pytest.mark.parametrize("x,error,fragment", BAD_INPUTS, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_INPUTS)])
def test_encode_rejects_bad_block(x, error, fragment):
    raises(error, gaac.encode_block, x, one_block_calibration(), 0, "k", match=fragment)


@pytest.mark.parametrize("layer", [-1, 2, 1000])
def test_encode_rejects_layer_out_of_range(layer):
    raises(CalibrationError, gaac.encode_block, GOOD, one_block_calibration(), layer, "k", match="out of range")


@pytest.mark.parametrize("layer", [1.0, "0", None, True])
def test_encode_rejects_non_integer_layer(layer):
    raises(InputError, gaac.encode_block, GOOD, one_block_calibration(), layer, "k", match="layer")


@pytest.mark.parametrize("kind", ["q", "", 2, -1, None, True, "kv"])
def test_encode_rejects_bad_kind(kind):
    raises(InputError, gaac.encode_block, GOOD, one_block_calibration(), 0, kind, match="kind")


@pytest.mark.parametrize("kind", ["k", "K", 0, np.int64(0)])
def test_kind_spellings(kind):
    assert gaac.encode_block(GOOD, one_block_calibration(), 0, kind).kind == L.KIND_K


@pytest.mark.parametrize("calibration", [None, "cal.json", {"format": "gaac-calibration"}])
def test_encode_rejects_non_calibration(calibration):
    raises(CalibrationError, gaac.encode_block, GOOD, calibration, 0, "k", match="Calibration")


@pytest.mark.parametrize("calibration", [None, "cal.json", {"format": "gaac-calibration"}])
def test_decode_rejects_non_calibration(calibration):
    data = gaac.encode_block(GOOD, one_block_calibration(), 0, "k").data
    raises(CalibrationError, gaac.decode_block, data, calibration, match="Calibration")


@pytest.mark.parametrize("block", ["GAAC", None, 12, 10**12, [1, 2, 3], GOOD])
def test_decode_rejects_non_bytes(block):
    raises(InputError, gaac.decode_block, block, one_block_calibration(), match="bytes")


def test_decode_accepts_bytearray_and_memoryview():
    cal = one_block_calibration()
    data = gaac.encode_block(GOOD, cal, 1, "v").data
    for form in (bytearray(data), memoryview(data)):
        assert np.array_equal(gaac.decode_block(form, cal), GOOD)


@settings(max_examples=40, deadline=None)
@given(block_cases())
def test_torch_bf16_and_integer_views_give_identical_bytes(case):
    bits = case.bits
    forms = [
        bits,
        bits.view(np.int16),
        torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16),
        torch.from_numpy(bits.view(np.int16)),
        torch.from_numpy(bits.view(np.int16)).view(torch.uint16),
        torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).transpose(0, 2).contiguous().transpose(0, 2),
    ]
    data = {gaac.encode_block(x, case.calibration, case.layer, case.kind).data for x in forms}
    assert len(data) == 1
