"""An independent GAAC BF16 decoder (versions 1 and 2) of block and sequence containers, written from
``format_spec/FORMAT.md`` alone.

Plain Python: no NumPy, no ``gaac`` import, not even ``zlib`` (the CRC-32 is
built from the parameters of FORMAT.md 7.4).  It exists to prove that the spec
is enough for a third party to decode the test vectors; it is slow on purpose
and follows the spec's sections in order.  Every error carries the id of the
FORMAT.md section 8 rule (``R1`` .. ``R20``, ``R22``, ``R23``), section 11.7 rule (``S1`` .. ``S16``,
``C1`` .. ``C5``) or calibration rule it enforces.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class SpecError(Exception):
    """Base of this decoder's errors; ``rule`` is the FORMAT.md rule that failed."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"{rule}: {message}")
        self.rule = rule


class FormatError(SpecError):
    """FORMAT.md section 8: the bytes are not a valid version 1 or 2 block container."""


class CalibrationError(SpecError):
    """FORMAT.md 3.2, 3.4, 3.5 and R14-R17, R22, R23: a bad calibration, or a stream of another calibration."""


# -- section 1: bytes, bit streams, CRC-32 -------------------------------------------------------

def u16(data: bytes, offset: int) -> int:
    return data[offset] | data[offset + 1] << 8


def u32(data: bytes, offset: int) -> int:
    return u16(data, offset) | u16(data, offset + 2) << 16


def bits(stream: bytes, position: int, width: int) -> int:
    """The ``width``-bit field at bit ``position``: bit k of a stream is bit k % 8 of byte k // 8."""
    value = 0
    for j in range(width):
        k = position + j
        value |= ((stream[k // 8] >> (k % 8)) & 1) << j
    return value


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc_table()


def crc32(data: bytes) -> int:
    """CRC-32/ISO-HDLC (FORMAT.md 7.4): reflected 0x04C11DB7, init and final XOR 0xFFFFFFFF."""
    c = 0xFFFFFFFF
    for byte in data:
        c = _CRC_TABLE[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


# -- section 3: calibration ------------------------------------------------------------------

@dataclass
class Calibration:
    """Bases ``b3[kind][layer][head][channel]``, ``b4`` likewise, ``capacity[kind][layer]``, and epochs.

    ``epochs[kind][layer]`` lists the ``(b3, b4)`` of epochs 1, 2, ... (FORMAT.md 3.5).
    """

    layers: int
    kv_heads: int
    head_dim: int
    b3: list
    b4: list
    capacity: list
    epochs: list = field(default_factory=list)

    def canonical_bytes(self) -> bytes:
        """FORMAT.md 3.3."""
        out = bytearray(b"GAACCAL") + bytes([1])
        for n in (self.layers, self.kv_heads, self.head_dim):
            out += n.to_bytes(4, "little")
        for table in (self.b3, self.b4):
            for kind in table:
                for layer in kind:
                    for head in layer:
                        out += bytes(head)
        for kind in self.capacity:
            for cap in kind:
                out += cap.to_bytes(2, "little")
        return bytes(out)

    @property
    def id(self) -> int:
        return crc32(self.canonical_bytes())

    def bases(self, kind: int, layer: int, epoch: int) -> tuple[list, list]:
        """``(b3, b4)`` ``[head][channel]`` of one epoch; epoch 0 is the calibration's own."""
        if epoch == 0:
            return self.b3[kind][layer], self.b4[kind][layer]
        return self.epochs[kind][layer][epoch - 1]

    def epoch_id(self, kind: int, layer: int, epoch: int) -> int:
        """FORMAT.md 3.5: CRC-32 of GAACEPCH, the calibration id, layer, epoch, kind, b3 and b4."""
        out = bytearray(b"GAACEPCH") + self.id.to_bytes(4, "little") + layer.to_bytes(2, "little") \
            + epoch.to_bytes(2, "little") + bytes([kind])
        for table in self.bases(kind, layer, epoch):
            for head in table:
                out += bytes(head)
        return crc32(bytes(out))


def _int_table(value, shape: tuple, what: str, low: int, high: int) -> list:
    """A nested list of integers of exactly ``shape``, each in ``low..high`` (FORMAT.md 3.2, 3.4)."""
    if not shape:
        if type(value) is not int:
            raise CalibrationError("3.4", f"{what}: {value!r} is not an integer")
        if not low <= value <= high:
            raise CalibrationError("3.2", f"{what}: {value} is outside {low}..{high}")
        return value
    if not isinstance(value, list) or len(value) != shape[0]:
        raise CalibrationError("3.4", f"{what}: expected a list of {shape[0]}")
    return [_int_table(v, shape[1:], f"{what}[{i}]", low, high) for i, v in enumerate(value)]


def check_dimensions(layers: int, kv_heads: int, head_dim: int) -> None:
    """FORMAT.md 3.2 rules 1 and 4: at least one layer and head, at most 65535 of each (u16 fields), and a
    supported head_dim."""
    if not (1 <= layers <= 65535 and 1 <= kv_heads <= 65535):
        raise CalibrationError("3.2", f"layers {layers} and kv_heads {kv_heads} must lie in 1..65535")
    if head_dim not in (64, 128, 256):
        raise CalibrationError("3.2", f"head_dim {head_dim} is not 64, 128 or 256")


def load_calibration(source) -> Calibration:
    """Read a calibration file (a path) or its parsed JSON object, checking FORMAT.md 3.2 and 3.4."""
    d = json.loads(Path(source).read_text()) if not isinstance(source, dict) else source
    if not isinstance(d, dict) or d.get("format") != "gaac-calibration":
        raise CalibrationError("3.4", "not a gaac-calibration object")
    if d.get("version") not in (1, 2) or type(d.get("version")) is not int:
        raise CalibrationError("3.4", f"calibration version {d.get('version')!r} is not 1 or 2")
    if "epochs" in d and d["version"] != 2:
        raise CalibrationError("3.4", "an epochs section needs version 2")
    if d.get("model") is not None and not isinstance(d["model"], str):
        raise CalibrationError("3.4", f"model {d['model']!r} is not a string or null")
    dims = [d.get(k) for k in ("layers", "kv_heads", "head_dim")]
    if any(type(n) is not int for n in dims):
        raise CalibrationError("3.4", f"layers, kv_heads and head_dim must be JSON integers, got {dims}")
    layers, heads, dim = dims
    check_dimensions(layers, heads, dim)
    tables = {}
    for kind in ("k", "v"):
        t = d.get(kind)
        if not isinstance(t, dict):
            raise CalibrationError("3.4", f"missing table {kind!r}")
        tables[kind] = (_int_table(t.get("b3"), (layers, heads, dim), f"{kind}.b3", 0, 248),
                        _int_table(t.get("b4"), (layers, heads, dim), f"{kind}.b4", 0, 240),
                        _int_table(t.get("capacity"), (layers,), f"{kind}.capacity", 0, 65520))
        if any(c % 16 for c in tables[kind][2]):
            raise CalibrationError("3.2", f"{kind}.capacity {tables[kind][2]} has a value not a multiple of 16")
    cal = Calibration(layers, heads, dim, b3=[tables["k"][0], tables["v"][0]], b4=[tables["k"][1], tables["v"][1]],
                      capacity=[tables["k"][2], tables["v"][2]])
    if "id" in d and d["id"] != f"{cal.id:08x}":         # 8 lowercase hex digits: "6ECDAC86" is refused
        raise CalibrationError("3.4", f"id {d['id']!r} differs from the tables' id {cal.id:08x}")
    section = d.get("epochs", {})
    if not isinstance(section, dict) or not set(section) <= {"k", "v"}:
        raise CalibrationError("3.5", "epochs must be an object with keys k and v")
    for kind, name in enumerate(("k", "v")):
        per_layer = section.get(name, [[] for _ in range(layers)])
        if not isinstance(per_layer, list) or len(per_layer) != layers:
            raise CalibrationError("3.5", f"epochs.{name} must have one list per layer")
        cal.epochs.append([])
        for layer, entries in enumerate(per_layer):
            cal.epochs[kind].append([])
            if not isinstance(entries, list):
                raise CalibrationError("3.5", f"epochs.{name}[{layer}] is not a list")
            for e, entry in enumerate(entries, start=1):
                what = f"epochs.{name}[{layer}] epoch {e}"
                if not isinstance(entry, dict) or not set(entry) <= {"b3", "b4", "id"}:
                    raise CalibrationError("3.5", f"{what} is not an object with keys b3, b4 and (optional) id")
                cal.epochs[kind][layer].append((_int_table(entry.get("b3"), (heads, dim), f"{what}.b3", 0, 248),
                                                _int_table(entry.get("b4"), (heads, dim), f"{what}.b4", 0, 240)))
                if "id" in entry and entry["id"] != f"{cal.epoch_id(kind, layer, e):08x}":
                    raise CalibrationError("3.5", f"{what}: id {entry['id']!r} differs from its tables' id")
    return cal


# -- sections 4-7: decoding a block container -------------------------------------------------

ESCAPES = {0: 0, 1: 1, 2: 5}      # FORMAT.md 5.2: escape bytes per group of each mode


@dataclass
class Decoded:
    """A decoded block: ``values[head][token][channel]`` BF16 patterns, and what the stream held."""

    values: list
    storage: list = field(default_factory=list)     # per tile: "slot" or "raw"
    modes: list = field(default_factory=list)       # per tile: the mode tags of a slot, None for a raw tile
    escape_bytes: list = field(default_factory=list)
    payload_bytes: int = 0
    resident_bytes: int = 0


def decode_slot(slot: bytes, b3: list, b4: list, capacity: int, channels: int, tile: int) -> tuple[list, list, int]:
    """FORMAT.md sections 5 and 6: tile ``tile``'s slot -> (BF16 patterns in element order, tags, used escapes)."""
    n_elems = 16 * channels
    n_groups = n_elems // 8
    sm = slot[0:n_elems]
    codes = slot[n_elems:n_elems + 3 * n_elems // 8]
    tags = slot[n_elems + 3 * n_elems // 8:45 * n_elems // 32]
    area = slot[45 * n_elems // 32:]

    modes = [bits(tags, 2 * g, 2) for g in range(n_groups)]
    for g, m in enumerate(modes):
        if m == 3:
            raise FormatError("R18", f"tile {tile}, group {g}: reserved mode tag 3")
    used = sum(ESCAPES[m] for m in modes)
    if used > capacity:
        raise FormatError("R19", f"tile {tile}: its tags need {used} escape bytes, the capacity is {capacity}")
    if any(area[used:]):
        raise FormatError("R20", f"tile {tile}: escape area not zero after its {used} used bytes")

    out = []
    offset = 0
    for g, mode in enumerate(modes):
        escape = area[offset:offset + ESCAPES[mode]]
        offset += ESCAPES[mode]
        for i in range(8):
            n = 8 * g + i
            code = bits(codes, 3 * n, 3)
            for p, plane in enumerate(escape):          # 5.4: escape byte p is bit plane 3 + p
                code |= ((plane >> i) & 1) << (3 + p)
            c = n % channels
            e = b3[c] + code if mode == 0 else b4[c] + code if mode == 1 else code
            out.append(((sm[n] & 0x80) << 8) | (e << 7) | (sm[n] & 0x7F))
    return out, modes, used


def decode_block(data: bytes, cal: Calibration) -> Decoded:
    """FORMAT.md section 7, with every check of section 8 in its order (R1-R17, R23, R22, R18-R20)."""
    data = bytes(data)
    if len(data) < 28:
        raise FormatError("R1", f"{len(data)} bytes: shorter than header and CRC")
    if data[0:4] != b"GAAC":
        raise FormatError("R2", f"magic {data[0:4]!r}")
    version, element, kind, tokens = data[4], data[5], data[6], data[7]
    layer, heads, dim, capacity = u16(data, 8), u16(data, 10), u16(data, 12), u16(data, 14)
    bases_id = u32(data, 16)
    if version not in (1, 2):
        raise FormatError("R3", f"version {version}")
    if version == 1:                          # 7.1: bytes 20..23 are reserved in version 1
        epoch, reserved = 0, u32(data, 20)
    else:                                     # version 2: epoch u16, then a reserved u16
        epoch, reserved = u16(data, 20), u16(data, 22)
    if element != 1:
        raise FormatError("R4", f"element format {element}")
    if kind not in (0, 1):
        raise FormatError("R5", f"kind {kind}")
    if tokens != 16:
        raise FormatError("R6", f"tokens {tokens}")
    if reserved != 0:
        raise FormatError("R7", f"reserved field {reserved}")
    if dim not in (64, 128, 256):
        raise FormatError("R8", f"head_dim {dim}")
    if heads == 0:
        raise FormatError("R9", "kv_heads 0")
    if capacity % 16:
        raise FormatError("R10", f"escape capacity {capacity}")

    channels = min(dim, 128)                  # section 4
    per_head = dim // channels
    n_tiles = heads * per_head
    fixed = 45 * 16 * channels // 32          # 6.1
    slot_size = fixed + capacity
    raw_size = 2 * 16 * channels              # 6.4
    table_end = 24 + 4 * n_tiles
    if len(data) < table_end + 4:
        raise FormatError("R11", f"{len(data)} bytes: the block table alone ends at {table_end}")
    entries = [u32(data, 24 + 4 * t) for t in range(n_tiles)]
    is_raw = [bool(e >> 31) for e in entries]
    n_raw = sum(is_raw)
    length = table_end + (n_tiles - n_raw) * slot_size + n_raw * raw_size + 4
    if len(data) != length:
        raise FormatError("R11", f"{len(data)} bytes; header and table say {length}")
    if u32(data, len(data) - 4) != crc32(data[:-4]):
        raise FormatError("R12", "CRC-32 mismatch")
    counts = [0, 0]
    for t, entry in enumerate(entries):
        if entry & 0x7FFFFFFF != counts[is_raw[t]]:
            raise FormatError("R13", f"table entry {t} has index {entry & 0x7FFFFFFF}, expected {counts[is_raw[t]]}")
        counts[is_raw[t]] += 1

    if epoch == 0 and bases_id != cal.id:
        raise CalibrationError("R14", f"stream calibration id {bases_id:08x}, given calibration {cal.id:08x}")
    if (heads, dim) != (cal.kv_heads, cal.head_dim):
        raise CalibrationError("R15", f"stream has {heads} heads x {dim}, calibration {cal.kv_heads} x {cal.head_dim}")
    if layer >= cal.layers:
        raise CalibrationError("R16", f"layer {layer}; the calibration has {cal.layers}")
    if capacity != cal.capacity[kind][layer]:
        raise CalibrationError("R17", f"escape capacity {capacity}, calibration {cal.capacity[kind][layer]}")
    known = 1 + (len(cal.epochs[kind][layer]) if cal.epochs else 0)
    if epoch >= known:
        raise CalibrationError("R23", f"epoch {epoch}; the calibration has {known} for layer {layer} kind {kind}")
    if epoch and bases_id != cal.epoch_id(kind, layer, epoch):
        raise CalibrationError("R22", f"stream epoch id {bases_id:08x}, the calibration's epoch {epoch} has "
                                      f"{cal.epoch_id(kind, layer, epoch):08x}")
    b3_all, b4_all = cal.bases(kind, layer, epoch)

    result = Decoded(values=[[[0] * dim for _ in range(16)] for _ in range(heads)])
    slots_at = table_end
    raws_at = table_end + (n_tiles - n_raw) * slot_size
    for t, entry in enumerate(entries):
        h, j = divmod(t, per_head)
        first = j * channels
        index = entry & 0x7FFFFFFF
        if is_raw[t]:
            at = raws_at + index * raw_size
            tile = [u16(data, at + 2 * n) for n in range(16 * channels)]
            modes, used = None, None
            result.payload_bytes += raw_size
            result.resident_bytes += raw_size
        else:
            at = slots_at + index * slot_size
            bases = (b3_all[h][first:first + channels], b4_all[h][first:first + channels])
            tile, modes, used = decode_slot(data[at:at + slot_size], *bases, capacity, channels, t)
            result.payload_bytes += fixed + used
            result.resident_bytes += slot_size
        result.resident_bytes += 4
        result.storage.append("raw" if is_raw[t] else "slot")
        result.modes.append(modes)
        result.escape_bytes.append(used)
        for n, x in enumerate(tile):              # element n = token * C + channel (section 4)
            result.values[h][n // channels][first + n % channels] = x
    return result


# -- section 11: the sequence container -------------------------------------------------------------

def u64(data: bytes, offset: int) -> int:
    return u32(data, offset) | u32(data, offset + 4) << 32


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def calibration_from_canonical_bytes(raw: bytes) -> Calibration:
    """FORMAT.md 3.3 read back: the calibration whose canonical bytes are ``raw`` (no epochs)."""
    layers, heads, dim = u32(raw, 8), u32(raw, 12), u32(raw, 16)
    n = layers * heads * dim
    tables = []
    for t in range(2):                                   # b3, then b4
        at = 20 + 2 * n * t
        tables.append([[[list(raw[at + ((k * layers + l) * heads + h) * dim:][:dim]) for h in range(heads)]
                        for l in range(layers)] for k in range(2)])
    at = 20 + 4 * n
    capacity = [[u16(raw, at + 2 * (k * layers + l)) for l in range(layers)] for k in range(2)]
    return Calibration(layers, heads, dim, b3=tables[0], b4=tables[1], capacity=capacity)


@dataclass
class Sequence:
    """A read sequence container: ``values[kind][layer][head][token][channel]`` BF16 patterns, and its records."""

    values: list
    epochs: list                 # per section, in body order: [(epoch, bases id)] of its records


def read_sequence(data: bytes, cal: Calibration | None = None, keeps_epochs: bool = True) -> Sequence:
    """FORMAT.md section 11: check a sequence container with every rule of 11.7 in the order it states, and
    decode its blocks (sections 5-6) and tails.  ``cal``: the calibration it is read with (None: the embedded
    one); ``keeps_epochs=False`` reads it as an import into a cache that keeps no epochs (C5)."""
    data = bytes(data)
    n = len(data)
    if n < 40:
        raise FormatError("S1", f"{n} bytes: shorter than the 40-byte header")
    if data[0:7] != b"GAACSEQ":
        raise FormatError("S2", f"magic {data[0:7]!r}")
    version, element, flags = data[7], data[8], data[9]
    layers, heads, dim, tokens = u16(data, 10), u16(data, 12), u16(data, 14), u32(data, 16)
    cal_id, n_records, reserved, body_bytes = u32(data, 20), u32(data, 24), u32(data, 28), u64(data, 32)
    if version != 2:
        raise FormatError("S3", f"version {version}")
    if element != 1:
        raise FormatError("S4", f"element format {element}")
    if flags & 0xFE or reserved:
        raise FormatError("S5", f"flags {flags:#x}, reserved {reserved}")
    if layers == 0 or heads == 0 or dim not in (64, 128, 256):
        raise FormatError("S6", f"layers {layers}, kv_heads {heads}, head_dim {dim}")
    channels = min(dim, 128)
    tiles = heads * dim // channels                       # P, the tiles of a block
    nb, t = divmod(tokens, 16)
    at = 40
    if n < at + 16 * layers:
        raise FormatError("S1", f"{n} bytes: the section records end at {at + 16 * layers}")
    records = []
    for i in range(2 * layers):                            # 11.2
        capacity, count, n_raw = u16(data, at), u16(data, at + 2), u32(data, at + 4)
        at += 8
        if capacity % 16 or n_raw > nb * tiles:
            raise FormatError("S7", f"section {i}: escape capacity {capacity}, {n_raw} raw tiles of {nb * tiles}")
        if count > nb:
            raise FormatError("S16", f"section {i}: {count} epoch records for {nb} blocks")
        records.append((capacity, count, n_raw))
    if sum(r[1] for r in records) != n_records:
        raise FormatError("S8", f"the header says {n_records} epoch records, the sections {sum(r[1] for r in records)}")
    table = heads * dim
    if n < at + n_records * (8 + 2 * table):
        raise FormatError("S1", f"{n} bytes: the epoch records end at {at + n_records * (8 + 2 * table)}")
    epochs = []
    for i, (_, count, _) in enumerate(records):           # 11.3
        section = []
        for _ in range(count):
            epoch, zero, bases_id = u16(data, at), u16(data, at + 2), u32(data, at + 4)
            b3, b4 = data[at + 8:at + 8 + table], data[at + 8 + table:at + 8 + 2 * table]
            at += 8 + 2 * table
            if epoch == 0 or zero or (section and epoch <= section[-1][0]):
                raise FormatError("S11", f"section {i}: epoch record {epoch}, reserved {zero}")
            section.append((epoch, bases_id, b3, b4))
        epochs.append(section)
    fixed, raw_size = 45 * 16 * channels // 32, 2 * 16 * channels
    parts, size = [], 0
    for capacity, _, n_raw in records:                     # 11.6
        start = size
        block_epochs = start + _align16(4 * nb * tiles)
        slots = block_epochs + _align16(2 * nb)
        raws = slots + (nb * tiles - n_raw) * (fixed + capacity)
        tail = raws + n_raw * raw_size
        size = tail + 2 * heads * t * dim
        parts.append((start, block_epochs, slots, raws, tail))
    if body_bytes != size:
        raise FormatError("S8", f"the header says a body of {body_bytes} bytes, the records make it {size}")
    embedded = 20 + 4 * layers * heads * dim + 4 * layers if flags & 1 else 0
    chunks = -(-body_bytes // (1 << 20))
    head = at + embedded + 4 * chunks + 4
    if n < head:
        raise FormatError("S1", f"{n} bytes: the head ends at {head}")
    if u32(data, head - 4) != crc32(data[:head - 4]):
        raise FormatError("S9", "head CRC-32 mismatch")
    body_at = _align16(head)
    if n != body_at + body_bytes:
        raise FormatError("S1", f"{n} bytes; the head and B make it {body_at + body_bytes}")
    if any(data[head:body_at]):
        raise FormatError("S10", "padding after the head CRC is not zero")
    for i, section in enumerate(epochs):
        layer, kind = divmod(i, 2)
        for epoch, bases_id, b3, b4 in section:
            canonical = b"GAACEPCH" + cal_id.to_bytes(4, "little") + layer.to_bytes(2, "little") \
                + epoch.to_bytes(2, "little") + bytes([kind]) + b3 + b4
            if crc32(canonical) != bases_id:
                raise FormatError("S11", f"section {i}: epoch record {epoch}'s bases id {bases_id:08x}")
    if embedded:                                           # 11.4
        raw = data[at:at + embedded]
        if raw[:8] != b"GAACCAL\x01" or (u32(raw, 8), u32(raw, 12), u32(raw, 16)) != (layers, heads, dim) \
                or crc32(raw) != cal_id:
            raise FormatError("S12", "the embedded calibration is not the canonical bytes the header names")
        inside = calibration_from_canonical_bytes(raw)
        if any(b > 248 for k in inside.b3 for l in k for h in l for b in h) \
                or any(b > 240 for k in inside.b4 for l in k for h in l for b in h) \
                or any(c % 16 or c > 65520 for k in inside.capacity for c in k):
            raise CalibrationError("C4", "the embedded calibration breaks 3.2")
        cal = cal or inside
    if cal is None:
        raise CalibrationError("C1", "no calibration given and none embedded")
    if cal.id != cal_id:                                   # the C rules
        raise CalibrationError("C1", f"container calibration id {cal_id:08x}, given {cal.id:08x}")
    for i, (capacity, _, _) in enumerate(records):
        if capacity != cal.capacity[i % 2][i // 2]:
            raise CalibrationError("C2", f"section {i}: escape capacity {capacity}")
    for section in epochs:
        for epoch, _, b3, b4 in section:
            if max(b3, default=0) > 248 or max(b4, default=0) > 240:
                raise CalibrationError("C3", f"epoch record {epoch}: bases above 248 / 240")
    if n_records and not keeps_epochs:
        raise CalibrationError("C5", "epoch records, and the importing cache keeps no epochs")
    body = data[body_at:]
    for c in range(chunks):                                # 11.5
        if u32(data, head - 4 - 4 * chunks + 4 * c) != crc32(body[c << 20:(c + 1) << 20]):
            raise FormatError("S13", f"chunk {c}: CRC-32 mismatch")
    block_epochs = []
    for i, (start, at_epochs, slots, _, _) in enumerate(parts):
        be = [u16(body, at_epochs + 2 * j) for j in range(nb)]
        known = {0} | {r[0] for r in epochs[i]}
        if any(e not in known for e in be) or any(a > b for a, b in zip(be, be[1:])):
            raise FormatError("S15", f"section {i}: block epochs {be}")
        if any(r[0] not in be for r in epochs[i]):
            raise FormatError("S16", f"section {i}: an epoch record no block uses")
        block_epochs.append(be)
    for i, (start, at_epochs, slots, _, _) in enumerate(parts):
        if any(body[start + 4 * nb * tiles:at_epochs]) or any(body[at_epochs + 2 * nb:slots]):
            raise FormatError("S14", f"section {i}: padding after its block table or block epochs is not zero")
        counts = [0, 0]
        for j in range(nb * tiles):
            entry = u32(body, start + 4 * j)
            if entry & 0x7FFFFFFF != counts[entry >> 31]:
                raise FormatError("S14", f"section {i}: block table entry {j}")
            counts[entry >> 31] += 1
        if counts[1] != records[i][2]:
            raise FormatError("S14", f"section {i}: {counts[1]} raw tiles, the record says {records[i][2]}")

    values = [[[[[0] * dim for _ in range(tokens)] for _ in range(heads)] for _ in range(layers)] for _ in range(2)]
    for i, (start, _, slots, raws, tail) in enumerate(parts):
        layer, kind = divmod(i, 2)
        capacity = records[i][0]
        by_epoch = {e: ([list(b3[h * dim:(h + 1) * dim]) for h in range(heads)],
                        [list(b4[h * dim:(h + 1) * dim]) for h in range(heads)]) for e, _, b3, b4 in epochs[i]}
        by_epoch[0] = (cal.b3[kind][layer], cal.b4[kind][layer])
        for j in range(nb):
            b3_all, b4_all = by_epoch[block_epochs[i][j]]
            for tile in range(tiles):
                entry = u32(body, start + 4 * (j * tiles + tile))
                h, part = divmod(tile, dim // channels)
                first = part * channels
                if entry >> 31:
                    at = raws + (entry & 0x7FFFFFFF) * raw_size
                    out = [u16(body, at + 2 * e) for e in range(16 * channels)]
                else:
                    at = slots + entry * (fixed + capacity)
                    out, _, _ = decode_slot(body[at:at + fixed + capacity], b3_all[h][first:first + channels],
                                            b4_all[h][first:first + channels], capacity, channels, tile)
                for e, x in enumerate(out):
                    values[kind][layer][h][16 * j + e // channels][first + e % channels] = x
        for h in range(heads):                             # the tail: u16, head, token, channel
            for r in range(t):
                for c in range(dim):
                    values[kind][layer][h][16 * nb + r][c] = u16(body, tail + 2 * ((h * t + r) * dim + c))
    return Sequence(values=values, epochs=[[(e, bases_id) for e, bases_id, _, _ in s] for s in epochs])
