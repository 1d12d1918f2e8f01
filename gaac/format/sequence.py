"""The sequence container (FORMAT.md section 11) with NumPy alone: its layout, reader, checks, writer and decoder.

A container is a head -- header (11.1), ``2 * layers`` section records (11.2), epoch records (11.3), the
calibration's canonical bytes when flags bit 0 is set (11.4), the chunk CRC table and the head CRC (11.5),
zero padding to :data:`gaac.layout.SEQUENCE_ALIGN` -- and a body of one section per (layer, kind), layer 0 K,
layer 0 V, layer 1 K, ...: block table, block epochs, slots, raw tiles, tail (11.6).  Every offset and size
follows from the header's dimensions and the section records' counts (:func:`sequence_layout`).

* :func:`read_head` checks the head (11.7, S1-S12, C4 and S16's count) and returns a :class:`Container`;
* :func:`read_sequence` checks the body too (S13-S16) and returns a :class:`Sequence`: per section its
  parts as NumPy arrays (:class:`SectionData`), which :meth:`Sequence.decode` turns into K and V;
* :func:`check_calibration` checks a container against the calibration it is read with (C1-C3, C5);
* :func:`write_sequence` writes a container from :class:`SectionData`, :func:`write_head` its head alone;
* :func:`worst_case_bytes` and :func:`container_nbytes` size a container before and after it is made.

:mod:`gaac.transfer` writes and reads the same bytes from and into a paged cache's pools (on a GPU where
the cache is) and takes its layout, head and rules from here.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from .. import layout as L
from ..calibration import CALIBRATION_VERSION, CANONICAL_HEAD_BYTES, BF16_FILE, Calibration, canonical_bytes_size, \
    epoch_canonical_bytes
from ..errors import CalibrationError, FormatError, InputError
from ..layout import MAX_INDEXED_EPOCHS
from ..reference.codec import decode_entries
from ..tiles import tile_bases

__all__ = ["KINDS", "MAX_INDEXED_EPOCHS", "RAW_ENTRY_BIAS", "Container", "EpochRecord", "Layout", "Section",
           "SectionData", "Sequence", "as_array", "check_calibration", "chunk_crcs", "container_nbytes", "read_head",
           "read_sequence", "sequence_layout", "worst_case_bytes", "write_head", "write_sequence"]

KINDS = (L.KIND_K, L.KIND_V)
CANONICAL_MAGIC = BF16_FILE.magic + bytes([CALIBRATION_VERSION])   # FORMAT.md 3.3: the first 8 canonical bytes
RAW_ENTRY_BIAS = L.TABLE_RAW_FLAG - (1 << 32)   # raw index + this = its table entry as a (negative) int32


def align(n: int) -> int:
    """``n`` rounded up to :data:`gaac.layout.SEQUENCE_ALIGN`: where the body and each part of a section start."""
    return -(-n // L.SEQUENCE_ALIGN) * L.SEQUENCE_ALIGN


def _where(layer: int, kind: int) -> str:
    return f"layer {layer} {L.KIND_NAMES[kind]}"


# ----------------------------------------------------------------------------------------------
# The layout of a container: what FORMAT.md section 11 computes from the header and section records.

@dataclass(frozen=True)
class EpochRecord:
    """An epoch the blocks of one section use (FORMAT.md 11.3): its index, bases id and bases."""

    epoch: int
    bases_id: int
    b3: np.ndarray               # uint8 [kv_heads, head_dim]
    b4: np.ndarray


@dataclass(frozen=True)
class Section:
    """One (layer, kind) of the sequence: its record (11.2) and where its parts lie in the body (11.6)."""

    layer: int
    kind: int
    capacity: int
    raw_tiles: int
    slot_tiles: int
    epochs: tuple                # EpochRecord, increasing epochs
    table: int                   # body offsets of the parts
    block_epochs: int
    slots: int
    raw: int
    tail: int
    end: int


@dataclass(frozen=True)
class Layout:
    """Where everything of a container lies, from its header and section records."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    sections: tuple              # Section, in body order: layer 0 K, layer 0 V, layer 1 K, ...
    head_bytes: int              # header .. head CRC
    body_offset: int             # head_bytes rounded up to SEQUENCE_ALIGN
    body_bytes: int

    @property
    def blocks(self) -> int:
        return self.tokens // L.BLOCK_TOKENS

    @property
    def tail_tokens(self) -> int:
        return self.tokens % L.BLOCK_TOKENS

    @property
    def tiles_per_block(self) -> int:
        return self.kv_heads * L.tiles_per_head(self.head_dim)

    @property
    def chunks(self) -> int:
        return -(-self.body_bytes // L.SEQUENCE_CHUNK_BYTES)

    @property
    def nbytes(self) -> int:
        return self.body_offset + self.body_bytes


def _head_bytes(layers: int, kv_heads: int, head_dim: int, records: int, with_calibration: bool,
                body_bytes: int) -> int:
    """The bytes of a head, header to head CRC (FORMAT.md 11.1-11.5)."""
    return (L.SEQUENCE_HEADER.size + 2 * layers * L.SEQUENCE_SECTION.size
            + records * (L.SEQUENCE_EPOCH.size + 2 * kv_heads * head_dim)
            + (canonical_bytes_size(layers, kv_heads, head_dim) if with_calibration else 0)
            + 4 * -(-body_bytes // L.SEQUENCE_CHUNK_BYTES) + 4)


def sequence_layout(layers, kv_heads, head_dim, tokens, capacities, raw_tiles, epochs,
                    with_calibration: bool) -> Layout:
    """The layout of a container with these dimensions and, per section (body order), escape capacity, raw
    tiles and epoch records (:class:`EpochRecord`); ``with_calibration``: the canonical bytes embedded."""
    geo = L.geometry(head_dim)
    nb, t = divmod(tokens, L.BLOCK_TOKENS)
    per = kv_heads * L.tiles_per_head(head_dim)
    sections, at = [], 0
    for i, (capacity, n_raw, records) in enumerate(zip(capacities, raw_tiles, epochs)):
        n_slot = nb * per - n_raw
        table = at
        block_epochs = table + align(nb * per * L.TABLE_ENTRY_BYTES)
        slots = block_epochs + align(nb * L.SEQUENCE_EPOCH_BYTES)
        raw = slots + n_slot * geo.slot_bytes(capacity)
        tail = raw + n_raw * geo.raw_bytes
        at = tail + 2 * kv_heads * t * head_dim
        sections.append(Section(layer=i // 2, kind=KINDS[i % 2], capacity=capacity, raw_tiles=n_raw,
                                slot_tiles=n_slot, epochs=tuple(records), table=table, block_epochs=block_epochs,
                                slots=slots, raw=raw, tail=tail, end=at))
    head = _head_bytes(layers, kv_heads, head_dim, sum(len(r) for r in epochs), with_calibration, at)
    return Layout(layers=layers, kv_heads=kv_heads, head_dim=head_dim, tokens=tokens, sections=tuple(sections),
                  head_bytes=head, body_offset=align(head), body_bytes=at)


# ----------------------------------------------------------------------------------------------
# Reading a container's head (FORMAT.md 11.7, the rules on the head).

@dataclass(frozen=True)
class Container:
    """A sequence container whose head passed FORMAT.md 11.7: its layout and what its head says."""

    layout: Layout
    calibration_id: int
    calibration: Calibration | None   # the embedded calibration (flags bit 0), else None
    chunk_crcs: np.ndarray            # uint32 [chunks]
    data: np.ndarray                  # the whole container, uint8 (a view of the buffer read_head was given)

    @property
    def body(self) -> np.ndarray:
        return self.data[self.layout.body_offset:]

    def describe(self) -> dict:
        """Dimensions, sizes and ratio: what ``gaac pack`` and ``gaac unpack`` print."""
        lay = self.layout
        bf16 = 2 * 2 * lay.layers * lay.kv_heads * lay.tokens * lay.head_dim
        return {"layers": lay.layers, "kv_heads": lay.kv_heads, "head_dim": lay.head_dim, "tokens": lay.tokens,
                "calibration_id": f"{self.calibration_id:08x}", "calibration_embedded": self.calibration is not None,
                "bytes": lay.nbytes, "bf16_bytes": bf16, "ratio": bf16 / lay.nbytes,
                "raw_tiles": sum(s.raw_tiles for s in lay.sections),
                "tiles": sum(s.raw_tiles + s.slot_tiles for s in lay.sections),
                "epoch_records": sum(len(s.epochs) for s in lay.sections)}


def as_array(data, name: str = "data") -> np.ndarray:
    """A bytes-like object or NumPy uint8 array as a 1-D uint8 array (no copy).

    A strided array or buffer (a view with steps) is an :class:`InputError` naming the argument ``name``, as is
    anything else that is not bytes."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise InputError(f"{name}: a container as an array must be uint8, got {data.dtype}")
        if not data.flags.c_contiguous:
            raise InputError(f"{name}: the array is strided (a view with steps, strides {data.strides}); pass a "
                             "contiguous one (np.ascontiguousarray)")
        return data.reshape(-1)
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except TypeError:
        raise InputError(f"{name}: expected the container's bytes (bytes, memoryview, a uint8 array or tensor), "
                         f"got {type(data).__name__}") from None
    except (BufferError, ValueError) as exc:          # a strided memoryview, or a buffer NumPy cannot view
        raise InputError(f"{name}: the buffer is not one contiguous run of bytes ({exc}); pass a contiguous "
                         "copy (bytes(...))") from None


def read_head(data) -> Container:
    """Check a container's head (FORMAT.md 11.7, S1-S12, C4, and S16's count: no more records than blocks) and
    return what it says; the body is checked where it is used (:func:`read_sequence`,
    :func:`gaac.transfer.import_sequence`).  Each count the header and records state is checked against the
    bytes there are before anything is read or looped over by it."""
    a = as_array(data)
    n = len(a)
    if n < L.SEQUENCE_HEADER.size:
        raise FormatError(f"truncated sequence container: {n} bytes, its header alone is {L.SEQUENCE_HEADER.size}")
    (magic, version, element, flags, layers, heads, dim, tokens, cal_id, n_records, reserved,
     body_bytes) = L.SEQUENCE_HEADER.unpack_from(a)
    if magic != L.SEQUENCE_MAGIC:
        raise FormatError(f"bad magic {magic!r}: not a GAAC sequence container (expected {L.SEQUENCE_MAGIC!r})")
    if version != L.SEQUENCE_VERSION:
        raise FormatError(f"sequence container version {version} is not supported (this gaac reads version "
                          f"{L.SEQUENCE_VERSION})")
    if element != L.ELEMENT_BF16:
        raise FormatError(f"element format {element} is not supported (BF16 is {L.ELEMENT_BF16})")
    if flags & ~L.SEQUENCE_FLAG_CALIBRATION or reserved:
        raise FormatError(f"bad header: reserved flags or field not zero (flags {flags:#04x}, reserved {reserved})")
    if layers == 0 or heads == 0 or dim not in L.SUPPORTED_HEAD_DIMS:
        raise FormatError(f"bad header: layers={layers}, kv_heads={heads}, head_dim={dim}")
    at = L.SEQUENCE_HEADER.size
    need = at + 2 * layers * L.SEQUENCE_SECTION.size
    if n < need:
        raise FormatError(f"truncated sequence container: {n} bytes, its section records end at {need}")
    per = heads * L.tiles_per_head(dim)
    nb = tokens // L.BLOCK_TOKENS
    records = []
    for i in range(2 * layers):
        capacity, count, n_raw = L.SEQUENCE_SECTION.unpack_from(a, at)
        at += L.SEQUENCE_SECTION.size
        if capacity % L.SLOT_ALIGN or n_raw > nb * per:
            raise FormatError(f"bad section record {i} (layer {i // 2} {L.KIND_NAMES[KINDS[i % 2]]}): escape capacity "
                              f"{capacity}, {n_raw} raw tiles of {nb * per}")
        if count > nb:               # S16 before the records are read: each record needs a block of its own
            raise FormatError(f"section record {i} (layer {i // 2} {L.KIND_NAMES[KINDS[i % 2]]}) lists {count} epoch "
                              f"records for {nb} blocks: a record no block uses (FORMAT.md 11.3)")
        records.append((capacity, count, n_raw))
    if sum(r[1] for r in records) != n_records:
        raise FormatError(f"bad header: {n_records} epoch records, the section records list "
                          f"{sum(r[1] for r in records)}")
    table = heads * dim
    need = at + n_records * (L.SEQUENCE_EPOCH.size + 2 * table)
    if n < need:
        raise FormatError(f"truncated sequence container: {n} bytes, its epoch records end at {need}")
    epochs = []
    for i, (_, count, _) in enumerate(records):
        section = []
        for _ in range(count):
            epoch, zero, bases_id = L.SEQUENCE_EPOCH.unpack_from(a, at)
            at += L.SEQUENCE_EPOCH.size
            b3 = a[at:at + table].reshape(heads, dim).copy()
            b4 = a[at + table:at + 2 * table].reshape(heads, dim).copy()
            at += 2 * table
            if zero or epoch == 0 or (section and epoch <= section[-1].epoch):
                raise FormatError(f"bad epoch record of section {i}: epoch {epoch} (reserved {zero}); epochs 1 and "
                                  "later are listed once each, in increasing order")
            section.append(EpochRecord(epoch, bases_id, b3, b4))
        epochs.append(section)
    with_cal = bool(flags & L.SEQUENCE_FLAG_CALIBRATION)
    layout = sequence_layout(layers, heads, dim, tokens, [r[0] for r in records], [r[2] for r in records], epochs,
                             with_cal)
    if body_bytes != layout.body_bytes:
        raise FormatError(f"bad header: body of {body_bytes} bytes, the section records make it {layout.body_bytes}")
    if n < layout.head_bytes:
        raise FormatError(f"truncated sequence container: {n} bytes, its head alone is {layout.head_bytes}")
    crc_at = layout.head_bytes - 4
    stored = int(np.frombuffer(a, "<u4", 1, crc_at)[0])
    computed = zlib.crc32(a[:crc_at])
    if stored != computed:
        raise FormatError(f"head CRC-32 mismatch (stored {stored:08x}, computed {computed:08x}): the container's "
                          "head is corrupt")
    if n != layout.nbytes:
        what = "truncated" if n < layout.nbytes else "trailing bytes after"
        raise FormatError(f"{what} sequence container: {n} bytes, its head makes it {layout.nbytes}")
    if a[layout.head_bytes:layout.body_offset].any():
        raise FormatError("the padding after the head CRC is not zero")
    for i, section in enumerate(epochs):
        s = layout.sections[i]
        for r in section:
            want = zlib.crc32(epoch_canonical_bytes(cal_id, s.layer, s.kind, r.epoch, r.b3, r.b4))
            if r.bases_id != want:
                raise FormatError(f"epoch record {r.epoch} of {_where(s.layer, s.kind)}: bases id "
                                  f"{r.bases_id:08x}, its bases give {want:08x}")
    calibration = None
    if with_cal:
        size = canonical_bytes_size(layers, heads, dim)
        start = crc_at - 4 * layout.chunks - size
        raw = a[start:start + size].tobytes()
        head = raw[:CANONICAL_HEAD_BYTES]
        dims = tuple(int(x) for x in np.frombuffer(head, "<u4", 3, 8))
        if head[:8] != CANONICAL_MAGIC or dims != (layers, heads, dim):
            raise FormatError(f"the embedded calibration starts {head[:8]!r} for (layers, kv_heads, head_dim) "
                              f"{dims}; the header's {(layers, heads, dim)} need canonical bytes that start "
                              f"{CANONICAL_MAGIC!r} and name them (FORMAT.md 11.4)")
        if zlib.crc32(raw) != cal_id:
            raise FormatError(f"the embedded calibration's CRC-32 is {zlib.crc32(raw):08x}, the header names "
                              f"{cal_id:08x}")
        try:
            calibration = Calibration.from_canonical_bytes(raw)
        except CalibrationError as exc:
            raise CalibrationError(f"the embedded calibration breaks FORMAT.md 3.2: {exc}") from None
    crcs = np.frombuffer(a, "<u4", layout.chunks, crc_at - 4 * layout.chunks).astype(np.uint32)
    return Container(layout=layout, calibration_id=cal_id, calibration=calibration, chunk_crcs=crcs, data=a)


def check_calibration(c: Container, cal: Calibration, adapt: bool = True) -> None:
    """FORMAT.md 11.7, C1-C3 and C5: container ``c`` against the calibration it is read with; ``adapt``: whether
    its reader keeps epochs (a cache made with ``adapt=False`` does not: C5)."""
    lay = c.layout
    if c.calibration_id != cal.id:
        raise CalibrationError(f"the sequence was exported from a cache with calibration {c.calibration_id:08x}; "
                               f"this cache's calibration is {cal.id:08x} (model {cal.model!r}): import it into a "
                               "cache made with the same calibration (the same bases and escape capacities)")
    cal.check_shape(lay.layers, lay.kv_heads, lay.head_dim)
    for s in lay.sections:
        if s.capacity != cal.capacity[s.kind, s.layer]:
            raise CalibrationError(f"section {_where(s.layer, s.kind)}: escape capacity {s.capacity} "
                                   f"differs from the calibration's {cal.capacity[s.kind, s.layer]}")
        for r in s.epochs:
            if r.b3.max(initial=0) > L.B3_MAX or r.b4.max(initial=0) > L.B4_MAX:
                raise CalibrationError(f"epoch {r.epoch} of {_where(s.layer, s.kind)}: bases above "
                                       f"{L.B3_MAX} / {L.B4_MAX} (FORMAT.md 3.2)")
        if s.epochs and not adapt:
            raise CalibrationError(f"the sequence's blocks of {_where(s.layer, s.kind)} use calibration "
                                   f"epoch {s.epochs[-1].epoch}; a cache made with adapt=False keeps no epochs "
                                   "(make it with adapt=True)")


# ----------------------------------------------------------------------------------------------
# The rules on the body (FORMAT.md 11.7, S13-S16): the checks, and the words a reader raises them with.

def chunk_crcs(body: np.ndarray) -> np.ndarray:
    """CRC-32 of each chunk of ``body`` (uint8, starting on a chunk; FORMAT.md 11.5): uint32 ``[chunks]``."""
    chunk = L.SEQUENCE_CHUNK_BYTES
    return np.array([zlib.crc32(body[i:i + chunk]) for i in range(0, len(body), chunk)], dtype=np.uint32)


def chunk_crc_error(stored: np.ndarray, computed: np.ndarray) -> FormatError:
    """S13: the error for the first chunk whose computed CRC differs from the stored one."""
    i = int(np.flatnonzero(computed != stored)[0])
    return FormatError(f"chunk {i} of the body: CRC-32 mismatch (stored {int(stored[i]):08x}, "
                       f"computed {int(computed[i]):08x}): the container is corrupt")


def padding_message(s: Section) -> str:
    """S14: what a section whose padding after its block table or block epochs is not zero breaks."""
    return f"{_where(s.layer, s.kind)}: the padding after its block table or block epochs is not zero"


def table_message(s: Section) -> str:
    """S14: what a section whose block table does not number its tiles within their storage class breaks."""
    return (f"{_where(s.layer, s.kind)}: a block table entry is not its tile's number within its storage class, or "
            f"the table holds other than the {s.raw_tiles} raw tiles of its section record (FORMAT.md 11.6)")


def table_numbers(entries: np.ndarray) -> np.ndarray:
    """Each tile's number within its storage class -- among the slot tiles, or among the raw tiles -- for
    the block table ``entries`` (int32, tile order): what a valid table's entries hold (FORMAT.md 11.6)."""
    is_raw = entries < 0
    return np.where(is_raw, np.cumsum(is_raw) - 1, np.cumsum(~is_raw) - 1)


def block_epochs_message(lay: Layout, block_epochs: list) -> str | None:
    """S15, S16: the message for the first section whose block epochs (int64 ``[blocks]`` each) are not
    non-decreasing among its epochs, or leave one of its epoch records unused; None when none does."""
    for s, epochs in zip(lay.sections, block_epochs):
        records = np.array([r.epoch for r in s.epochs], dtype=np.int64)
        allowed = np.array([0, *records])
        where = _where(s.layer, s.kind)
        if (np.diff(epochs) < 0).any() or not np.isin(epochs, allowed).all():
            return (f"{where}: block epochs {sorted(set(epochs.tolist()))} must be non-decreasing and among the "
                    f"section's epochs {allowed.tolist()}")
        unused = records[~np.isin(records, epochs)]
        if unused.size:
            return (f"{where}: no block uses epoch record(s) {unused.tolist()}; a section holds a record only for "
                    "an epoch its blocks use (FORMAT.md 11.3)")
    return None


# ----------------------------------------------------------------------------------------------
# A whole container as NumPy arrays: read, decoded, written.

@dataclass(frozen=True)
class SectionData:
    """One (layer, kind) of a sequence as the container holds it (FORMAT.md 11.6)."""

    layer: int
    kind: int
    capacity: int                # escape bytes per slot
    epochs: tuple                # EpochRecord of each epoch 1 and later its blocks use, increasing
    table: np.ndarray            # int32 [blocks, tiles_per_block]: slot number, or raw number + RAW_ENTRY_BIAS
    block_epochs: np.ndarray     # uint16 [blocks]
    slots: np.ndarray            # uint8 [slot tiles, slot_bytes]
    raw: np.ndarray              # uint16 [raw tiles, 16, C]: BF16 bits
    tail: np.ndarray             # uint16 [kv_heads, tail tokens, head_dim]: BF16 bits


@dataclass(frozen=True)
class Sequence:
    """A sequence container that passed every rule of FORMAT.md 11.7 on its own (S1-S16, C4), as arrays."""

    container: Container
    sections: tuple              # SectionData, in body order: layer 0 K, layer 0 V, layer 1 K, ...

    @property
    def layout(self) -> Layout:
        return self.container.layout

    def decode(self, calibration: Calibration | None = None) -> tuple[np.ndarray, np.ndarray]:
        """K and V, uint16 BF16 bits ``[layers, kv_heads, tokens, head_dim]``, bit for bit.

        ``calibration``: the one the container is read with (its epoch-0 bases decode the blocks of epoch
        0), checked against the container (C1-C3); the embedded one when not given.  A slot that breaks
        FORMAT.md section 8 raises :class:`FormatError`."""
        c, lay = self.container, self.layout
        cal = calibration if calibration is not None else c.calibration
        if cal is None:
            raise CalibrationError("the container carries no calibration (exported without calibration=True): pass "
                                   f"the calibration {c.calibration_id:08x} it was made with")
        check_calibration(c, cal)
        dim, heads, nb = lay.head_dim, lay.kv_heads, lay.blocks
        out = np.empty((2, lay.layers, heads, lay.tokens, dim), dtype=np.uint16)
        for s in self.sections:
            bases = {0: cal.bases(s.layer, s.kind, 0), **{r.epoch: (r.b3, r.b4) for r in s.epochs}}
            tiles = np.empty((nb, lay.tiles_per_block, L.BLOCK_TOKENS, L.tile_channels(dim)), dtype=np.uint16)
            entries = s.table.astype(np.int64) & 0xFFFFFFFF
            for epoch in np.unique(s.block_epochs):
                blocks = np.flatnonzero(s.block_epochs == epoch)
                b_narrow, b_wide = tile_bases(*bases[int(epoch)])
                tiles[blocks] = decode_entries(entries[blocks].reshape(-1), s.slots, s.raw, b_narrow, b_wide,
                                               s.capacity).reshape(len(blocks), *tiles.shape[1:])
            # tiles [blocks, heads, tiles_per_head, 16, C] -> [heads, blocks, 16, tiles_per_head, C]
            x = tiles.reshape(nb, heads, L.tiles_per_head(dim), L.BLOCK_TOKENS, -1).transpose(1, 0, 3, 2, 4)
            k_or_v = out[KINDS.index(s.kind), s.layer]
            k_or_v[:, :nb * L.BLOCK_TOKENS] = x.reshape(heads, nb * L.BLOCK_TOKENS, dim)
            k_or_v[:, nb * L.BLOCK_TOKENS:] = s.tail
        return out[0], out[1]


def read_sequence(data) -> Sequence:
    """Check sequence container ``data`` (bytes-like or a uint8 array) against every rule of FORMAT.md 11.7 a
    container breaks on its own -- the head's (S1-S12, C4, :func:`read_head`), then the body's in the order a
    reader reports them: chunk CRCs (S13), block epochs (S15, S16), padding and block tables (S14) -- and
    return its sections as arrays.  ``data`` is read once, into a private copy the arrays view."""
    c = read_head(as_array(data).copy())
    lay, body = c.layout, c.body
    computed = chunk_crcs(body)
    if not np.array_equal(computed, c.chunk_crcs):
        raise chunk_crc_error(c.chunk_crcs, computed)
    per, nb = lay.tiles_per_block, lay.blocks
    geo = L.geometry(lay.head_dim)
    channels = L.tile_channels(lay.head_dim)
    sections, problems = [], []
    for s in lay.sections:
        table_end = s.table + nb * per * L.TABLE_ENTRY_BYTES
        epochs_end = s.block_epochs + nb * L.SEQUENCE_EPOCH_BYTES
        if body[table_end:s.block_epochs].any() or body[epochs_end:s.slots].any():
            problems.append(padding_message(s))
        entries = body[s.table:table_end].view("<i4")
        if not ((entries & L.TABLE_INDEX_MASK) == table_numbers(entries)).all() \
                or int((entries < 0).sum()) != s.raw_tiles:
            problems.append(table_message(s))
        sections.append(SectionData(
            layer=s.layer, kind=s.kind, capacity=s.capacity, epochs=s.epochs,
            table=entries.astype(np.int32).reshape(nb, per),
            block_epochs=body[s.block_epochs:epochs_end].view("<u2").astype(np.uint16),
            slots=body[s.slots:s.raw].reshape(s.slot_tiles, geo.slot_bytes(s.capacity)),
            raw=body[s.raw:s.tail].view("<u2").astype(np.uint16).reshape(s.raw_tiles, L.BLOCK_TOKENS, channels),
            tail=body[s.tail:s.end].view("<u2").astype(np.uint16).reshape(lay.kv_heads, lay.tail_tokens,
                                                                            lay.head_dim)))
    message = block_epochs_message(lay, [d.block_epochs.astype(np.int64) for d in sections])
    if message is not None:
        raise FormatError(message)
    if problems:
        raise FormatError(problems[0])
    return Sequence(container=c, sections=tuple(sections))


def write_head(lay: Layout, cal_id: int, calibration: bytes | None, chunk_crcs) -> bytes:
    """The container's head: header, section records, epoch records, calibration (its canonical bytes, or
    None), chunk CRCs, head CRC (FORMAT.md 11.1-11.5); the zero padding to the body is the caller's."""
    n_records = sum(len(s.epochs) for s in lay.sections)
    flags = L.SEQUENCE_FLAG_CALIBRATION if calibration is not None else 0
    parts = [L.SEQUENCE_HEADER.pack(L.SEQUENCE_MAGIC, L.SEQUENCE_VERSION, L.ELEMENT_BF16, flags, lay.layers,
                                    lay.kv_heads, lay.head_dim, lay.tokens, cal_id, n_records, 0, lay.body_bytes)]
    parts += [L.SEQUENCE_SECTION.pack(s.capacity, len(s.epochs), s.raw_tiles) for s in lay.sections]
    for s in lay.sections:
        for r in s.epochs:
            parts += [L.SEQUENCE_EPOCH.pack(r.epoch, 0, r.bases_id), np.ascontiguousarray(r.b3, np.uint8).tobytes(),
                      np.ascontiguousarray(r.b4, np.uint8).tobytes()]
    if calibration is not None:
        parts.append(calibration)
    parts.append(np.asarray(chunk_crcs, dtype="<u4").tobytes())
    head = b"".join(parts)
    return head + np.uint32(zlib.crc32(head)).astype("<u4").tobytes()


def write_sequence(kv_heads: int, head_dim: int, tokens: int, sections, calibration_id: int,
                   calibration: bytes | None = None) -> bytes:
    """The sequence container of ``sections`` (:class:`SectionData`, body order: ``2 * layers`` of them) of a
    sequence of ``tokens`` tokens: the inverse of :func:`read_sequence`.  ``calibration_id``: the id of the
    calibration the slots were coded with (FORMAT.md 3.3); ``calibration``: its canonical bytes, to embed
    (the file form), or None.  The parts are written as given: a block table that does not number its tiles
    within their storage class makes a container :func:`read_sequence` refuses."""
    sections = list(sections)
    if not sections or len(sections) % 2:
        raise InputError(f"sections: expected 2 * layers of them (K and V of each layer), got {len(sections)}")
    lay = sequence_layout(len(sections) // 2, kv_heads, head_dim, tokens, [d.capacity for d in sections],
                          [int((np.asarray(d.table) < 0).sum()) for d in sections], [d.epochs for d in sections],
                          calibration is not None)
    per, nb = lay.tiles_per_block, lay.blocks
    body = np.zeros(lay.body_bytes, dtype=np.uint8)
    for d, s in zip(sections, lay.sections):
        if (d.layer, d.kind) != (s.layer, s.kind):
            raise InputError(f"sections: {_where(d.layer, d.kind)} where the body order has "
                             f"{_where(s.layer, s.kind)}")
        parts = [(s.table, np.asarray(d.table, dtype="<i4"), nb * per * L.TABLE_ENTRY_BYTES),
                 (s.block_epochs, np.asarray(d.block_epochs, dtype="<u2"), nb * L.SEQUENCE_EPOCH_BYTES),
                 (s.slots, np.asarray(d.slots, dtype=np.uint8), s.raw - s.slots),
                 (s.raw, np.asarray(d.raw, dtype="<u2"), s.tail - s.raw),
                 (s.tail, np.asarray(d.tail, dtype="<u2"), s.end - s.tail)]
        for at, part, size in parts:
            raw = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
            if raw.size != size:
                raise InputError(f"{_where(s.layer, s.kind)}: a part of {raw.size} bytes where the layout "
                                 f"has {size}")
            body[at:at + size] = raw
    head = write_head(lay, calibration_id, calibration, chunk_crcs(body))
    return head + bytes(lay.body_offset - len(head)) + body.tobytes()


# ----------------------------------------------------------------------------------------------
# The size of a sequence container before it is made (a buffer sized first), and after (a buffer holding more).

def worst_case_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, capacities=None, *,
                     epoch_records: int | None = None, calibration: bool = False) -> int:
    """The most bytes a sequence container (FORMAT.md 11) of these dimensions can have.

    ``capacities``: the escape capacities of the sections, an int for all of them or ``[2, layers]``
    indexed ``[kind, layer]`` as :attr:`gaac.Calibration.capacity`; ``None`` for any calibration made
    by :func:`gaac.calibrate`, whose capacities never make a slot larger than a raw tile.
    ``epoch_records``: the most epoch records one section lists; ``None`` for the format's limit,
    one per block (11.7, S16).  ``calibration``: whether the calibration's canonical bytes are
    embedded (flags bit 0).

    Each of a section's ``blocks * kv_heads * tiles_per_head`` tiles costs the larger of its slot
    and a raw tile; the bound is reached by a container whose every tile is raw (and whose slots are
    no larger than raw tiles) with that many epoch records.
    """
    for name, value in (("layers", layers), ("kv_heads", kv_heads), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < (name != "tokens"):
            raise InputError(f"{name} must be a {'non-negative' if name == 'tokens' else 'positive'} integer, "
                             f"got {value!r}")
    geo = L.geometry(head_dim)
    if capacities is None:
        tile = np.full((2, layers), geo.raw_bytes, dtype=np.int64)
    else:
        cap = np.broadcast_to(np.asarray(capacities, dtype=np.int64), (2, layers))
        tile = np.maximum(geo.fixed_bytes + cap, geo.raw_bytes)
    blocks, tail = divmod(int(tokens), L.BLOCK_TOKENS)
    tiles = blocks * kv_heads * L.tiles_per_head(head_dim)
    per_section = (align(tiles * L.TABLE_ENTRY_BYTES) + align(blocks * L.SEQUENCE_EPOCH_BYTES)
                   + 2 * kv_heads * tail * head_dim)
    body = 2 * layers * per_section + tiles * int(tile.sum())
    records = blocks if epoch_records is None else min(int(epoch_records), blocks)
    return align(_head_bytes(layers, kv_heads, head_dim, 2 * layers * records, calibration, body)) + body


def container_nbytes(data) -> int:
    """The length of the sequence container that starts ``data`` (bytes-like or a uint8 array), from its
    header alone: what to cut from a buffer that holds more than the container.  The container itself is
    checked where it is read (:func:`read_head`)."""
    a = as_array(data)
    if len(a) < L.SEQUENCE_HEADER.size:
        raise FormatError(f"truncated sequence container: {len(a)} bytes, its header alone is "
                          f"{L.SEQUENCE_HEADER.size}")
    (magic, _, _, flags, layers, heads, dim, _, _, n_records, _, body_bytes) = L.SEQUENCE_HEADER.unpack_from(a)
    if magic != L.SEQUENCE_MAGIC:
        raise FormatError(f"bad magic {magic!r}: not a GAAC sequence container (expected {L.SEQUENCE_MAGIC!r})")
    if dim not in L.SUPPORTED_HEAD_DIMS:
        raise FormatError(f"bad header: head_dim={dim}")
    head = _head_bytes(layers, heads, dim, n_records, bool(flags & L.SEQUENCE_FLAG_CALIBRATION), body_bytes)
    return align(head) + body_bytes
