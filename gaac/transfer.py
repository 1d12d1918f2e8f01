"""Compressed sequences as a unit of transfer: a paged cache's sequence out as bytes, and back in.

Serving engines move KV caches between GPU memory, host memory, disk and
other workers (offload, prefix reuse, disaggregated prefill and decode).  A
GAAC cache's blocks are already compressed where they live, so moving one
needs no codec work: :func:`export_sequence` gathers one sequence's slots,
raw tiles, block tables, block epochs and tails -- every layer, K and V --
into the **sequence container** of FORMAT.md section 11, and
:func:`import_sequence` puts them into the pools of any cache with the same
calibration, bit for bit.  The bytes moved are the sequence's resident
bytes (about 1.39x fewer than BF16 on real caches) plus a small head.

The container's body is what the cache stores, part after part; its head
(dimensions, per (layer, kind) counts, the bases of the epochs the blocks
use, the chunk CRC table) is built on the host.  On a CUDA cache the body
moves in pieces of whole chunks (:func:`_pipeline`), each copied on a stream
of its own while the device works on its neighbour: export gathers a piece's
sections into a device buffer and computes its chunk CRCs there
(:mod:`gaac.cuda.crc`) while the piece before it copies into pinned memory;
import checks a piece's chunk CRCs and its sections' tables and scatters
their slots and raw tiles into free pool records while the piece after it
arrives, and waits once, for the verdict, before the sequence's tables,
epochs and tails go into the cache.  On the CPU the same torch code runs on
host tensors and zlib computes the CRCs.

What "the same calibration" means (FORMAT.md 11.8): the container names the
calibration id of 3.3, which covers the epoch-0 bases and the escape
capacities -- everything a slot's bytes depend on besides its epoch.  Any
cache whose calibration has that id takes the container, whatever its model
name, notes or epochs.  The bases of every later epoch the blocks use travel
in the container; the importing cache maps each to an epoch of its own with
the same bases or appends it (:func:`_epoch_map`), so an epoch appended this
way becomes the newest of its layer and kind and codes the blocks that cache
finalizes next, as an epoch of its own rule would.  A cache without epochs
(``adapt=False``) takes only containers whose blocks are all of epoch 0.

Slices by KV head (FORMAT.md 11.12): ``export_sequence(..., heads=(start, stop))`` writes the container of
KV heads ``start .. stop - 1`` of every layer, for a worker of another tensor-parallel size (prefill at one,
decode at another).  A tile holds channels of one head, coded with that head's bases and its section's
capacity, so the slice's tiles are the cache's tiles of those heads as stored; the container names the
calibration ``cache.calibration.slice_heads(start, stop)`` -- a calibration like any other, with the id of
its own tables -- and a cache made with it imports the slice as it imports any container.

Coupling: the cache's storage is read in :func:`_read_storage` and written by
:class:`_Writer`, and nowhere else.

The file form (:func:`pack`, :func:`unpack`, ``gaac pack`` / ``gaac unpack``)
is the same container with the calibration's canonical bytes embedded, so a
file decodes on its own.
"""
from __future__ import annotations

import functools
import warnings
import zlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from . import layout as L
from .pools import grown, sync_pools
from .cache import MAX_INDEXED_EPOCHS
from .calibration import (BF16_FILE, CALIBRATION_VERSION, CANONICAL_HEAD_BYTES, Calibration, canonical_bytes_size,
                          check_heads, epoch_canonical_bytes)
from .errors import CalibrationError, FormatError, InputError, PoolExhaustedError

KINDS = (L.KIND_K, L.KIND_V)
_CANONICAL_MAGIC = BF16_FILE.magic + bytes([CALIBRATION_VERSION])   # FORMAT.md 3.3: the first 8 canonical bytes
_RAW_ENTRY_BIAS = L.TABLE_RAW_FLAG - (1 << 32)   # raw index + this = its table entry as a (negative) int32


def _align(n: int) -> int:
    return -(-n // L.SEQUENCE_ALIGN) * L.SEQUENCE_ALIGN


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


def _layout(layers, kv_heads, head_dim, tokens, capacities, raw_tiles, epochs, with_calibration: bool) -> Layout:
    """The layout of a container with these dimensions and, per section, capacity, raw tiles and epoch records."""
    geo = L.geometry(head_dim)
    nb, t = divmod(tokens, L.BLOCK_TOKENS)
    per = kv_heads * L.tiles_per_head(head_dim)
    sections, at = [], 0
    for i, (capacity, n_raw, records) in enumerate(zip(capacities, raw_tiles, epochs)):
        n_slot = nb * per - n_raw
        table = at
        block_epochs = table + _align(nb * per * L.TABLE_ENTRY_BYTES)
        slots = block_epochs + _align(nb * L.SEQUENCE_EPOCH_BYTES)
        raw = slots + n_slot * geo.slot_bytes(capacity)
        tail = raw + n_raw * geo.raw_bytes
        at = tail + 2 * kv_heads * t * head_dim
        sections.append(Section(layer=i // 2, kind=KINDS[i % 2], capacity=capacity, raw_tiles=n_raw,
                                slot_tiles=n_slot, epochs=tuple(records), table=table, block_epochs=block_epochs,
                                slots=slots, raw=raw, tail=tail, end=at))
    n_records = sum(len(r) for r in epochs)
    head = (L.SEQUENCE_HEADER.size + 2 * layers * L.SEQUENCE_SECTION.size
            + n_records * (L.SEQUENCE_EPOCH.size + 2 * kv_heads * head_dim)
            + (canonical_bytes_size(layers, kv_heads, head_dim) if with_calibration else 0)
            + 4 * -(-at // L.SEQUENCE_CHUNK_BYTES) + 4)
    return Layout(layers=layers, kv_heads=kv_heads, head_dim=head_dim, tokens=tokens, sections=tuple(sections),
                  head_bytes=head, body_offset=_align(head), body_bytes=at)


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


def _as_array(data, name: str = "data") -> np.ndarray:
    """A bytes-like object, NumPy uint8 array or torch CPU uint8 tensor as a 1-D uint8 array (no copy).

    A strided array or buffer (a view with steps) is an :class:`InputError` naming the argument ``name``, as is
    anything else that is not bytes."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or data.dtype != torch.uint8:
            raise InputError(f"{name}: a container as a tensor must be uint8 on the CPU, got {data.dtype} on "
                             f"{data.device}")
        data = data.contiguous().reshape(-1).numpy()
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
    return what it says; the body is checked where it is used (:func:`import_sequence`).  Each count the header
    and records state is checked against the bytes there are before anything is read or looped over by it."""
    a = _as_array(data)
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
    layout = _layout(layers, heads, dim, tokens, [r[0] for r in records], [r[2] for r in records], epochs, with_cal)
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
                raise FormatError(f"epoch record {r.epoch} of layer {s.layer} {L.KIND_NAMES[s.kind]}: bases id "
                                  f"{r.bases_id:08x}, its bases give {want:08x}")
    calibration = None
    if with_cal:
        size = canonical_bytes_size(layers, heads, dim)
        start = crc_at - 4 * layout.chunks - size
        raw = a[start:start + size].tobytes()
        head = raw[:CANONICAL_HEAD_BYTES]
        dims = tuple(int(x) for x in np.frombuffer(head, "<u4", 3, 8))
        if head[:8] != _CANONICAL_MAGIC or dims != (layers, heads, dim):
            raise FormatError(f"the embedded calibration starts {head[:8]!r} for (layers, kv_heads, head_dim) "
                              f"{dims}; the header's {(layers, heads, dim)} need canonical bytes that start "
                              f"{_CANONICAL_MAGIC!r} and name them (FORMAT.md 11.4)")
        if zlib.crc32(raw) != cal_id:
            raise FormatError(f"the embedded calibration's CRC-32 is {zlib.crc32(raw):08x}, the header names "
                              f"{cal_id:08x}")
        try:
            calibration = Calibration.from_canonical_bytes(raw)
        except CalibrationError as exc:
            raise CalibrationError(f"the embedded calibration breaks FORMAT.md 3.2: {exc}") from None
    crcs = np.frombuffer(a, "<u4", layout.chunks, crc_at - 4 * layout.chunks).astype(np.uint32)
    return Container(layout=layout, calibration_id=cal_id, calibration=calibration, chunk_crcs=crcs, data=a)


def _check_calibration(c: Container, cal: Calibration, adapt: bool) -> None:
    """FORMAT.md 11.7, C1-C3 and C5: the container against the calibration (and epochs) of the cache it goes into."""
    lay = c.layout
    if c.calibration_id != cal.id:
        raise CalibrationError(f"the sequence was exported from a cache with calibration {c.calibration_id:08x}; "
                               f"this cache's calibration is {cal.id:08x} (model {cal.model!r}): import it into a "
                               "cache made with the same calibration (the same bases and escape capacities)")
    cal.check_shape(lay.layers, lay.kv_heads, lay.head_dim)
    for s in lay.sections:
        if s.capacity != cal.capacity[s.kind, s.layer]:
            raise CalibrationError(f"section layer {s.layer} {L.KIND_NAMES[s.kind]}: escape capacity {s.capacity} "
                                   f"differs from the calibration's {cal.capacity[s.kind, s.layer]}")
        for r in s.epochs:
            if r.b3.max(initial=0) > L.B3_MAX or r.b4.max(initial=0) > L.B4_MAX:
                raise CalibrationError(f"epoch {r.epoch} of layer {s.layer} {L.KIND_NAMES[s.kind]}: bases above "
                                       f"{L.B3_MAX} / {L.B4_MAX} (FORMAT.md 3.2)")
        if s.epochs and not adapt:
            raise CalibrationError(f"the sequence's blocks of layer {s.layer} {L.KIND_NAMES[s.kind]} use calibration "
                                   f"epoch {s.epochs[-1].epoch}; a cache made with adapt=False keeps no epochs "
                                   "(make it with adapt=True)")


# ----------------------------------------------------------------------------------------------
# The body, on the cache's device, moved piece by piece.

PIECE_BYTES = 64 << 20
"""The least size of a piece of the body that moves between a CUDA device and the host in one copy: large
enough that each copy runs at the link's bandwidth, small enough that the work on the first piece (export) or
the last (import), which no copy hides, is short."""


def _view(body: torch.Tensor, start: int, count: int, dtype: torch.dtype, shape=None) -> torch.Tensor:
    """``count`` elements of ``dtype`` at byte ``start`` of the uint8 ``body``, shaped ``shape``."""
    size = torch.empty(0, dtype=dtype).element_size()
    x = body[start:start + count * size].view(dtype)
    return x.view(shape) if shape is not None else x


def _rows(x: torch.Tensor, record_bytes: int) -> torch.Tensor:
    """The records of ``x`` (a pool, or a part of the body; contiguous) as int64 rows: records are multiples of
    16 bytes, and torch gathers and scatters 8-byte elements many times faster than single bytes."""
    return x.reshape(-1).view(torch.uint8).view(torch.int64).view(-1, record_bytes // 8)


def _upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array ``a`` as a tensor on ``device``, without the host waiting: through pinned memory on CUDA (a
    copy from pageable memory waits for the stream)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda" or t.numel() == 0:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _chunk_crcs(body: torch.Tensor):
    """CRC-32 of the chunks of ``body`` (FORMAT.md 11.5; ``body`` starts on a chunk): on the CPU all of them, by
    zlib (uint32); on a CUDA device the whole chunks, by :mod:`gaac.cuda.crc` (int32 bits, on the device,
    asynchronously on the current stream) -- the partial last chunk is the caller's, on the host, where its bytes
    are (or will be)."""
    if body.device.type == "cuda":
        from .cuda.crc import chunk_crcs

        return chunk_crcs(body, L.SEQUENCE_CHUNK_BYTES)
    data, chunk = body.numpy(), L.SEQUENCE_CHUNK_BYTES
    return np.array([zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk)], dtype=np.uint32)


def _piece_ends(lay: Layout) -> list[int]:
    """Where the pieces of the body end: each at the end of a section's last whole chunk, at least
    :data:`PIECE_BYTES` after the previous end; the last at the body's end.  A piece is whole chunks (the last
    piece may end in the body's partial chunk), so each piece's chunk CRCs are its own."""
    ends = [0]
    for s in lay.sections:
        end = s.end // L.SEQUENCE_CHUNK_BYTES * L.SEQUENCE_CHUNK_BYTES
        if end - ends[-1] >= PIECE_BYTES:
            ends.append(end)
    if ends[-1] < lay.body_bytes or len(ends) == 1:
        ends.append(lay.body_bytes)
    return ends[1:]


@functools.lru_cache(maxsize=None)
def _copy_stream(device: torch.device):
    """The CUDA stream the body's copies run on, one per device, kept for the process."""
    return torch.cuda.Stream(device)


def _pipeline(lay: Layout, body: torch.Tensor, host: torch.Tensor, work, *, to_host: bool) -> None:
    """Move ``body`` (uint8 on the cache's device) to ``host`` (export, ``to_host``) or from it (import) piece
    by piece (:func:`_piece_ends`), calling ``work(start, end, sections)`` for each piece, in order, where the
    device work on it belongs: export gathers the sections that write into the piece (the indices of
    ``lay.sections`` not given before) and checksums it, then copies it out; import copies it in, then
    checksums it and checks and scatters the sections it completes.

    On a CUDA device the copies run on a stream of their own (:func:`_copy_stream`) and ``work`` on the
    current stream, ordered by events: export copies piece i while piece i + 1 is gathered; import queues
    every copy at once and works on piece i while piece i + 1 arrives.  Neither stream waits for more than the
    piece it needs and the host never waits; on return the current stream is ordered after every copy.  On the
    CPU ``body`` is ``host`` and only ``work`` runs."""
    ends = _piece_ends(lay)
    bounds = list(zip([0, *ends[:-1]], ends))
    given = 0

    def due(end: int) -> range:
        nonlocal given
        first = given
        while given < len(lay.sections) and (end == lay.body_bytes or (lay.sections[given].table < end if to_host
                                                                        else lay.sections[given].end <= end)):
            given += 1
        return range(first, given)

    if body.device.type != "cuda":
        for a, b in bounds:
            work(a, b, due(b))
        return
    main = torch.cuda.current_stream(body.device)
    copy = _copy_stream(body.device)
    copy.wait_stream(main)                  # the buffers as the work queued before this call leaves them
    body.record_stream(copy)                # body's memory is reused only after its copies
    arrived = []
    try:
        if not to_host:
            with torch.cuda.stream(copy):
                for a, b in bounds:
                    body[a:b].copy_(host[a:b], non_blocking=True)
                    arrived.append(copy.record_event())
        for i, (a, b) in enumerate(bounds):
            if to_host:
                work(a, b, due(b))
                copy.wait_event(main.record_event())
                with torch.cuda.stream(copy):
                    host[a:b].copy_(body[a:b], non_blocking=True)
            else:
                main.wait_event(arrived[i])
                work(a, b, due(b))
    except BaseException:
        copy.synchronize()                  # no copy still reads or writes the caller's buffer once this raises
        raise
    main.wait_stream(copy)


def _fill_section(st, s: Section, lay: Layout, body: torch.Tensor, epochs: torch.Tensor) -> None:
    """Gather section ``s``'s parts from the pools of ``st`` (a :class:`_Stored`) into ``body``: FORMAT.md 11.6.
    ``epochs``: its block epochs, int16 on the body's device.  Nothing waits for the device."""
    per, nb = lay.tiles_per_block, lay.blocks
    geo = L.geometry(lay.head_dim)
    entries = st.entries
    is_raw = entries < 0
    number = torch.where(is_raw, is_raw.cumsum(0) - 1, (~is_raw).cumsum(0) - 1)
    _view(body, s.table, nb * per, torch.int32).copy_(torch.where(is_raw, number + _RAW_ENTRY_BIAS, number))
    body[s.table + nb * per * L.TABLE_ENTRY_BYTES:s.block_epochs] = 0
    _view(body, s.block_epochs, nb, torch.int16).copy_(epochs)
    body[s.block_epochs + nb * L.SEQUENCE_EPOCH_BYTES:s.slots] = 0
    # each tile's pool record at its place in the body: its number among the slot tiles, or after them among
    # the raw tiles (a scatter by a permutation; a boolean mask would make the host wait for its count)
    records = torch.empty(entries.shape[0], dtype=torch.int64, device=entries.device)
    records.index_copy_(0, torch.where(is_raw, number + s.slot_tiles, number), entries.long() & L.TABLE_INDEX_MASK)
    slot_bytes = geo.slot_bytes(s.capacity)
    torch.index_select(_rows(st.slots, slot_bytes), 0, records[:s.slot_tiles],
                       out=_rows(body[s.slots:s.raw], slot_bytes))
    torch.index_select(_rows(st.raw, geo.raw_bytes), 0, records[s.slot_tiles:],
                       out=_rows(body[s.raw:s.tail], geo.raw_bytes))
    _view(body, s.tail, lay.kv_heads * lay.tail_tokens * lay.head_dim, torch.int16,
          (lay.kv_heads, lay.tail_tokens, lay.head_dim)).copy_(st.tail)


class _BodyCheck:
    """FORMAT.md 11.7 on the body (S13-S16) as it arrives, piece by piece, where it is, with one wait for the
    verdict (:meth:`verdict`): the chunk CRCs (:meth:`chunks`) and each section's zero padding and block table
    numbering (:meth:`section`) on the body's device; after the wait, the block epochs and on CUDA the partial
    last chunk, brought to the host from the body as it arrived, so that what is checked is what is used."""

    def __init__(self, c: Container, body: torch.Tensor):
        self.c, self.body = c, body
        self.cuda = body.device.type == "cuda"
        self.crcs, self.flags, self.messages = [], [], []
        lay = c.layout
        self.whole = lay.body_bytes // L.SEQUENCE_CHUNK_BYTES if self.cuda else lay.chunks   # CRCs on the device
        if self.cuda:
            self.expected = _upload(c.chunk_crcs[:self.whole].view(np.int32), body.device)

    def chunks(self, start: int, end: int) -> None:
        """The CRCs of the chunks of ``body[start:end]`` (``start`` on a chunk)."""
        self.crcs.append(_chunk_crcs(self.body[start:end]))

    def section(self, s: Section) -> None:
        """Section ``s``'s zero padding and block table (S14), once its bytes are in ``body``."""
        lay, body = self.c.layout, self.body
        per, nb = lay.tiles_per_block, lay.blocks
        where = f"layer {s.layer} {L.KIND_NAMES[s.kind]}"
        pads = torch.cat([body[s.table + nb * per * L.TABLE_ENTRY_BYTES:s.block_epochs],
                          body[s.block_epochs + nb * L.SEQUENCE_EPOCH_BYTES:s.slots]])
        self.flags.append(torch.logical_not(pads.any()))
        self.messages.append(f"{where}: the padding after its block table or block epochs is not zero")
        entries = _view(body, s.table, nb * per, torch.int32)
        is_raw = entries < 0
        number = torch.where(is_raw, is_raw.cumsum(0) - 1, (~is_raw).cumsum(0) - 1)
        self.flags.append(((entries & L.TABLE_INDEX_MASK) == number).all() & (is_raw.sum() == s.raw_tiles))
        self.messages.append(f"{where}: a block table entry is not its tile's number within its storage class, or "
                             f"the table holds other than the {s.raw_tiles} raw tiles of its section record "
                             "(FORMAT.md 11.6)")

    def _computed(self, partial: list) -> np.ndarray:
        """Every chunk's CRC as computed, uint32 on the host."""
        if not self.cuda:
            return np.concatenate(self.crcs)
        return np.concatenate([torch.cat(self.crcs).cpu().numpy().view(np.uint32), partial]).astype(np.uint32)

    def _epochs(self, block_epochs: list) -> str | None:
        """The message for the first section whose block epochs break S15 or leave a record unused (S16), or
        None."""
        for s, epochs in zip(self.c.layout.sections, block_epochs):
            records = np.array([r.epoch for r in s.epochs], dtype=np.int64)
            allowed = np.array([0, *records])
            where = f"layer {s.layer} {L.KIND_NAMES[s.kind]}"
            if (np.diff(epochs) < 0).any() or not np.isin(epochs, allowed).all():
                return (f"{where}: block epochs {sorted(set(epochs.tolist()))} must be non-decreasing and among the "
                        f"section's epochs {allowed.tolist()}")
            unused = records[~np.isin(records, epochs)]
            if unused.size:
                return (f"{where}: no block uses epoch record(s) {unused.tolist()}; a section holds a record only for "
                        "an epoch its blocks use (FORMAT.md 11.3)")
        return None

    def verdict(self) -> list:
        """Raise :class:`FormatError` for the first rule the body breaks: a chunk CRC (S13), then the block epochs
        (S15, S16), then padding and tables (S14); else return each section's block epochs (int64 ``[blocks]``)
        as checked, for the commit.  One wait, for one small array of flags; then the block epochs (and on CUDA
        the partial last chunk) come to the host from the body."""
        c, body = self.c, self.body
        lay = c.layout
        if self.cuda:
            crc_ok = (torch.cat(self.crcs) == self.expected).all()
        else:
            crc_ok = torch.tensor(bool(np.array_equal(self._computed([]), c.chunk_crcs)))
        ok = torch.stack([crc_ok, *self.flags]).cpu().numpy()
        partial = [np.uint32(zlib.crc32(body[self.whole * L.SEQUENCE_CHUNK_BYTES:].cpu().numpy()))] \
            if self.whole < lay.chunks else []
        if not ok[0] or any(p != want for p, want in zip(partial, c.chunk_crcs[self.whole:])):
            crcs = self._computed(partial)
            i = int(np.flatnonzero(crcs != c.chunk_crcs)[0])
            raise FormatError(f"chunk {i} of the body: CRC-32 mismatch (stored {int(c.chunk_crcs[i]):08x}, "
                              f"computed {int(crcs[i]):08x}): the container is corrupt")
        block_epochs = [_view(body, s.block_epochs, lay.blocks, torch.int16).cpu().numpy().astype(np.int64) & 0xFFFF
                        for s in lay.sections]
        message = self._epochs(block_epochs)
        if message is not None:
            raise FormatError(message)
        if not ok.all():
            raise FormatError(self.messages[int(np.flatnonzero(~ok[1:])[0])])
        return block_epochs


# ----------------------------------------------------------------------------------------------
# The cache's storage: read for export, written by import.  The only functions that know its structures.

@dataclass
class _Stored:
    """One (layer, kind) of a sequence as the cache holds it."""

    layer: int
    kind: int
    capacity: int
    entries: torch.Tensor        # int32 [blocks * tiles_per_block]: pool entries (FORMAT.md 7.2), tile order
    epochs: np.ndarray           # int16 [blocks]: each block's epoch
    slots: torch.Tensor          # the slot pool, uint8 [n_slots, slot_bytes]
    raw: torch.Tensor            # the raw-tile pool, int16 [n_raw, 16, C]
    tail: torch.Tensor           # int16 [kv_heads, tail_tokens, head_dim]


def _read_storage(cache, seq: int) -> tuple[int, list]:
    """``(tokens, [_Stored per (layer, kind), in body order])`` of sequence ``seq`` of ``cache``."""
    cache._check_seq(seq)
    lens = cache._lens[:, seq]
    if len(set(lens.tolist())) != 1:
        raise InputError(f"sequence {seq} holds {lens.tolist()} tokens per layer: it is mid-update; export it "
                         "once every layer holds the same tokens")
    tokens = int(lens[0])
    nb, t = divmod(tokens, L.BLOCK_TOKENS)
    out = []
    for layer in range(cache.layers):
        for kind in KINDS:
            store = cache._store[layer][kind]
            out.append(_Stored(layer=layer, kind=kind, capacity=store.capacity,
                               entries=store.table[seq, :nb].reshape(-1), epochs=store.epochs[seq, :nb].copy(),
                               slots=store.slots.data, raw=store.raw.data, tail=store.tail[seq, :, :t]))
    return tokens, out


class _Writer:
    """Puts a checked container's sequence into ``cache``: a row, pool records, table entries, block epochs,
    tails, lengths and appended epochs.

    Where the cache has room as it is, the records are chosen at once -- those each pool hands out next, none
    taken -- and :meth:`scatter` writes the slots and raw tiles into them while the body still arrives,
    before its checks are in: free records are read by nothing.  :meth:`commit`, after the checks, takes
    them and writes what the cache reads (tables, epochs, tails, lengths).  Where the cache lacks room,
    :meth:`commit` makes it (``cache.grow``) or raises :class:`PoolExhaustedError` before anything is written,
    then scatters.  Either way a container the checks refuse leaves the cache as it was: no record taken, no
    pool or table grown."""

    def __init__(self, cache, c: Container):
        self.cache, self.c = cache, c
        self.short = self._shortfalls()
        self.records = None if self.short else self._records()
        self.tables = [None] * len(c.layout.sections)

    def _shortfalls(self) -> list:
        """What the cache lacks for the sequence: ``(message, (pool, records it lacks), or None)``; each layer
        and kind's share of the raw-tile arena is lent what the sequence's raw tiles need first; the device
        pools' counts are read with one wait."""
        cache, lay = self.cache, self.c.layout
        nb, short = lay.blocks, []
        if not (~cache._live).any():
            short.append((f"all {cache.max_seqs} sequence rows are in use", None))
        if nb > cache.max_blocks:
            short.append((f"the sequence holds {nb} blocks; the block table holds {cache.max_blocks} "
                          f"({cache.max_blocks * L.BLOCK_TOKENS} tokens) per sequence (max_blocks={nb} or more, or "
                          "grow=True, makes room)", None))
        stores = [(cache._store[s.layer][s.kind], s) for s in lay.sections]
        for pool, lack in cache._arena.cover([(store.raw, s.raw_tiles) for store, s in stores]):
            short.append((str(cache._exhausted(pool, lack, "the sequence")), (pool, lack)))
        slots = [store.slots for store, _ in stores]
        for pool, (_, s), free in zip(slots, stores, sync_pools(slots)):
            if s.slot_tiles > free:
                short.append((str(cache._exhausted(pool, s.slot_tiles - free, "the sequence")),
                              (pool, s.slot_tiles - free)))
        return short

    def _records(self) -> list:
        """Per section, the slot and raw-tile records its tiles go to (int64 on the cache's device), not taken."""
        out = []
        for s in self.c.layout.sections:
            store = self.cache._store[s.layer][s.kind]
            out.append((store.slots.upcoming(s.slot_tiles), store.raw.upcoming(s.raw_tiles)))
        return out

    def scatter(self, i: int, body: torch.Tensor) -> None:
        """Section ``i``'s slots and raw tiles into its records, and its block table translated to them (kept
        for :meth:`commit`).  Nothing waits for the device; a corrupt table entry (the checks refuse the
        container) is clamped into the section's records."""
        lay = self.c.layout
        s = lay.sections[i]
        store = self.cache._store[s.layer][s.kind]
        geo = L.geometry(lay.head_dim)
        slot_at, raw_at = self.records[i]
        slot_bytes = geo.slot_bytes(s.capacity)
        _rows(store.slots.data, slot_bytes).index_copy_(0, slot_at, _rows(body[s.slots:s.raw], slot_bytes))
        _rows(store.raw.data, geo.raw_bytes).index_copy_(0, raw_at, _rows(body[s.raw:s.tail], geo.raw_bytes))
        entries = _view(body, s.table, lay.blocks * lay.tiles_per_block, torch.int32)
        index = (entries & L.TABLE_INDEX_MASK).long()
        position = torch.where(entries < 0, index + s.slot_tiles, index)
        lut = torch.cat([slot_at, raw_at + _RAW_ENTRY_BIAS])
        if lut.numel():
            position.clamp_(0, lut.numel() - 1)
        self.tables[i] = lut.index_select(0, position).to(torch.int32).view(lay.blocks, lay.tiles_per_block)

    def commit(self, body: torch.Tensor, appended: list, maps: list, block_epochs: list) -> int:
        """The sequence into the cache, with the epochs ``appended`` (per section: (b3, b4) to append, in
        order), ``maps`` (per section: container epoch -> cache epoch) and ``block_epochs`` (per section: its
        blocks' epochs as the checks read them); returns its id."""
        cache, c = self.cache, self.c
        lay = c.layout
        nb, t = lay.blocks, lay.tail_tokens
        if self.records is None:
            if not cache.grow:
                raise PoolExhaustedError(self.short[0][0])
            if not (~cache._live).any():
                cache._grow_rows(2 * cache.max_seqs)
            if nb > cache.max_blocks:
                cache._grow_blocks(grown(cache.max_blocks, nb - cache.max_blocks))
            for _, grow in self.short:
                if grow is not None:
                    pool, lack = grow
                    pool.grow_by(lack)
                    cache._storage_changed()
            self.records = self._records()       # the counts _shortfalls read, or a grown pool's new list
            for i in range(len(lay.sections)):
                self.scatter(i, body)
        seq = int(np.flatnonzero(~cache._live)[0])
        epochs = [to_cache[e].astype(np.int16) for e, to_cache in zip(block_epochs, maps)]
        on_device = _upload(np.stack(epochs), cache.device) if cache.adapt else None
        for i, (s, tables) in enumerate(zip(lay.sections, appended)):
            store = cache._store[s.layer][s.kind]
            for b3, b4 in tables:
                cache.calibration.add_epoch(s.layer, s.kind, b3, b4)
            if tables:
                store.add_epochs(tables)
                cache._epochs_appended(s.layer)
            store.slots.take_upcoming(s.slot_tiles)
            store.raw.take_upcoming(s.raw_tiles)
            store.table[seq, :nb] = self.tables[i]
            store.epochs[seq, :nb] = epochs[i]
            if store.epoch is not None:
                store.epoch[seq, :nb] = on_device[i]
            store.tail[seq, :, :t] = _view(body, s.tail, lay.kv_heads * t * lay.head_dim, torch.int16,
                                           (lay.kv_heads, t, lay.head_dim))
        cache._live[seq] = True
        cache._lens[:, seq] = lay.tokens
        cache._seq_lens[:, seq] = lay.tokens
        cache._lengths_changed()
        return seq


def _epoch_map(c: Container, cal: Calibration) -> tuple[list, list]:
    """Per section, the epochs to append to ``cal`` and the map container epoch -> cache epoch (FORMAT.md 11.8).

    Each epoch record, in increasing order, goes to the first epoch of ``cal`` (same layer and kind) after the
    one the previous record went to whose bases are the record's, or else to a new epoch appended to ``cal``:
    the blocks keep their bases and their epochs stay non-decreasing along the sequence.
    """
    appended, maps = [], []
    for s in c.layout.sections:
        have = cal.n_epochs(s.layer, s.kind)
        to_cache = np.zeros(1 + (s.epochs[-1].epoch if s.epochs else 0), dtype=np.int64)
        new, last = [], 0
        for r in s.epochs:
            match = next((e for e in range(last + 1, have)
                          if all(np.array_equal(x, y) for x, y in zip(cal.bases(s.layer, s.kind, e), (r.b3, r.b4)))),
                         None)
            if match is None:
                new.append((r.b3.copy(), r.b4.copy()))
                match = have + len(new) - 1
            to_cache[r.epoch] = last = match
        if have + len(new) > MAX_INDEXED_EPOCHS:
            raise PoolExhaustedError(f"layer {s.layer} {L.KIND_NAMES[s.kind]} would hold {have + len(new)} epochs: "
                                     "a cache names a block's epoch in an int16 index, at most MAX_INDEXED_EPOCHS = "
                                     f"{MAX_INDEXED_EPOCHS} epochs (gaac.cache); nothing was imported")
        appended.append(new)
        maps.append(to_cache)
    return appended, maps


# ----------------------------------------------------------------------------------------------
# Export and import.

def _head(lay: Layout, cal_id: int, calibration: bytes | None, chunk_crcs) -> bytes:
    """The container's head: header, section records, epoch records, calibration, chunk CRCs, head CRC."""
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


def exported_layout(cache, seq: int, *, calibration: bool = False, heads=None) -> Layout:
    """The layout of :func:`export_sequence`'s container for ``seq`` (its size: ``.nbytes``)."""
    return _export_plan(cache, seq, calibration, heads)[0]


def _export_plan(cache, seq: int, calibration: bool, heads=None):
    """``(layout, stored, calibration)`` of the container of ``seq``: of KV heads ``heads = (start, stop)`` only
    when given (FORMAT.md 11.12), with the sliced calibration whose id and epoch ids the container names."""
    tokens, stored = _read_storage(cache, seq)
    cal = cache.calibration
    if heads is not None:
        cal, stored = _slice(cache, stored, heads)
    n_raw = torch.stack([(s.entries < 0).sum() for s in stored]).tolist() if stored else []
    epochs = [[EpochRecord(int(e), cal.epoch_id(s.layer, s.kind, int(e)), *cal.bases(s.layer, s.kind, int(e)))
               for e in np.unique(s.epochs) if e > 0] for s in stored]
    lay = _layout(cal.layers, cal.kv_heads, cal.head_dim, tokens, [s.capacity for s in stored], n_raw,
                  epochs, calibration)
    return lay, stored, cal


def _slice(cache, stored: list, heads) -> tuple[Calibration, list]:
    """KV heads ``heads = (start, stop)`` of a sequence's storage (FORMAT.md 11.12): the sliced calibration, and
    per section the table entries of those heads' tiles (each block's tiles ``start * P .. stop * P - 1``, ``P``
    tiles per head) and their tails.  The entries still name the cache's pool records, so the slots and raw
    tiles are gathered as stored: a tile's bytes depend on its head's bases and its section's capacity, which
    the slice keeps."""
    start, stop = check_heads(heads, cache.kv_heads)
    per_head = L.tiles_per_head(cache.head_dim)
    per = cache.kv_heads * per_head
    out = [replace(st, entries=st.entries.view(-1, per)[:, start * per_head:stop * per_head].reshape(-1),
                   tail=st.tail[start:stop]) for st in stored]
    return cache.calibration.slice_heads(start, stop), out


def export_sequence(cache, seq: int, *, calibration: bool = False, out=None, heads=None) -> memoryview:
    """Sequence ``seq`` of ``cache`` (a :class:`gaac.PagedKVCache`) as a sequence container (FORMAT.md 11).

    Its blocks as stored -- no decoding, no encoding -- with the bases of every epoch they use, the
    tails and the calibration id; ``calibration=True`` embeds the calibration's canonical bytes (the file
    form).  Returns a read-only memoryview of the container: of ``out`` when given (a writable uint8
    buffer, array or CPU tensor of at least :func:`exported_layout`'s ``nbytes``), else of a new buffer,
    in pinned host memory when the cache is on a CUDA device.  The cache is left as it was.

    ``heads=(start, stop)``: KV heads ``start .. stop - 1`` only, of every layer (FORMAT.md 11.12), for a
    worker of another tensor-parallel size: the container of the same sequence in a cache made with
    ``cache.calibration.slice_heads(start, stop)``, whose id it names, and which imports it bit for bit.
    Its tiles are the cache's tiles of those heads, copied as stored.  An empty range or one past the
    cache's KV heads is an :class:`InputError`.
    """
    lay, stored, cal = _export_plan(cache, seq, calibration, heads)
    cuda = cache.device.type == "cuda"
    if out is None:
        host = torch.empty(lay.nbytes, dtype=torch.uint8, pin_memory=cuda)
    else:
        if not isinstance(out, torch.Tensor):
            array = _as_array(out, "out")
            if not array.flags.writeable:
                raise InputError("out: the buffer is read-only; pass a writable one (bytearray, NumPy array, tensor)")
            out = torch.from_numpy(array)
        host = out
        if host.dtype != torch.uint8 or host.device.type != "cpu" or host.dim() != 1 or host.shape[0] < lay.nbytes:
            raise InputError(f"out: expected a writable 1-D uint8 host buffer of at least {lay.nbytes} bytes, got "
                             f"{host.dtype} {list(host.shape)} on {host.device}")
        if not host.is_contiguous():
            raise InputError(f"out: the buffer is strided (strides {host.stride()}); pass a contiguous one")
        host = host[:lay.nbytes]
    body = torch.empty(lay.body_bytes, dtype=torch.uint8, device=cache.device) if cuda else host[lay.body_offset:]
    epochs = _upload(np.stack([st.epochs for st in stored]).astype(np.int16), body.device)
    crcs = []

    def work(start: int, end: int, sections: range) -> None:
        for i in sections:
            _fill_section(stored[i], lay.sections[i], lay, body, epochs[i])
        crcs.append(_chunk_crcs(body[start:end]))

    _pipeline(lay, body, host[lay.body_offset:], work, to_host=True)
    if cuda:
        crcs = torch.cat(crcs).to("cpu", non_blocking=True)
        torch.cuda.current_stream(body.device).synchronize()      # the one wait: every gather, CRC and copy
        crcs = crcs.numpy().view(np.uint32)
        if len(crcs) < lay.chunks:               # the partial last chunk, now on the host
            crcs = np.append(crcs, zlib.crc32(host[lay.body_offset + len(crcs) * L.SEQUENCE_CHUNK_BYTES:].numpy()))
    else:
        crcs = np.concatenate(crcs)
    head = _head(lay, cal.id, cal.canonical_bytes() if calibration else None, crcs)
    array = host.numpy()
    array[:len(head)] = np.frombuffer(head, np.uint8)
    array[len(head):lay.body_offset] = 0
    return memoryview(array).toreadonly()


def import_sequence(cache, data) -> int:
    """Put the sequence of container ``data`` (FORMAT.md 11; bytes-like, a uint8 array or CPU tensor) into
    ``cache`` as a new sequence and return its id.

    The cache's calibration must have the container's calibration id; epochs are matched or appended (module
    docstring).  Every CRC, table and epoch is checked before the sequence enters the cache: a corrupt
    container raises :class:`FormatError`, one for another calibration :class:`CalibrationError`, a cache
    without room :class:`PoolExhaustedError` (unless it grows) -- and the cache is then unchanged (free pool
    records may hold the container's bytes, which nothing reads).  The slots are copied, not decoded:
    decoding them (reading the sequence, attention) checks them as it checks a block's.  On a CUDA cache the
    host waits once, for the checks' verdict; the writes after it run on the current stream.

    ``data`` is read once: on the CPU into a private copy, on CUDA into the device's copy (the head into host
    memory of its own); the checks and the cache's writes read that copy, so a caller's buffer that changes
    during the call changes nothing that was checked.  An import that would give a layer and kind more epochs
    than the cache's block-epoch index names (``gaac.cache.MAX_INDEXED_EPOCHS``) raises
    :class:`PoolExhaustedError` before any of the body moves.
    """
    a = _as_array(data)
    c = read_head(a if cache.device.type == "cuda" else a.copy())
    _check_calibration(c, cache.calibration, cache.adapt)
    appended, maps = _epoch_map(c, cache.calibration)
    with warnings.catch_warnings():                  # read-only bytes: torch warns, and nothing writes to them
        warnings.simplefilter("ignore", UserWarning)
        host = torch.from_numpy(c.body)
    lay = c.layout
    body = torch.empty(lay.body_bytes, dtype=torch.uint8, device=cache.device) if cache.device.type == "cuda" \
        else host
    check = _BodyCheck(c, body)
    writer = _Writer(cache, c)

    def work(start: int, end: int, sections: range) -> None:
        check.chunks(start, end)
        for i in sections:
            check.section(lay.sections[i])
            if writer.records is not None:
                writer.scatter(i, body)

    _pipeline(lay, body, host, work, to_host=False)
    block_epochs = check.verdict()
    return writer.commit(body, appended, maps, block_epochs)


# ----------------------------------------------------------------------------------------------
# The file form: a whole cache [layers, kv_heads, tokens, head_dim] to a self-contained container and back.

def pack(k, v, calibration: Calibration | None = None, *, show_progress: bool | None = None) -> memoryview:
    """K and V ``[layers, kv_heads, tokens, head_dim]`` (BF16 bits or tensors) as a sequence container with
    the calibration embedded: what ``gaac pack`` writes.  Without ``calibration`` it calibrates on ``k``, ``v``."""
    from .cache import PagedKVCache
    from .calibration import calibrate
    from .io import check_cache

    if calibration is not None and not isinstance(calibration, Calibration):
        raise InputError(f"calibration: expected a gaac.Calibration (Calibration.load or Calibration.from_dict "
                         f"reads a file), got {type(calibration).__name__}")
    k, v = check_cache(k, "k"), check_cache(v, "v")
    if k.shape != v.shape:
        raise InputError(f"k {list(k.shape)} and v {list(v.shape)} must have one shape")
    cal = calibrate(k, v) if calibration is None else calibration
    cal.check_shape(*k.shape[:2], k.shape[3])
    cache = PagedKVCache(cal, max_blocks=max(1, k.shape[2] // L.BLOCK_TOKENS), grow=True)
    seq = cache.add_sequence(k, v, show_progress=show_progress)
    return export_sequence(cache, seq, calibration=True)


def unpack(data, calibration: Calibration | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A sequence container back to K and V, uint16 ``[layers, kv_heads, tokens, head_dim]``, bit for bit.

    ``calibration``: the container's own (embedded) when not given; one of them is needed.  It is checked
    against the container (FORMAT.md 11.7, C1-C5) before a cache is sized from it, and the cache keeps
    epochs (a histogram per layer and kind) only when the container has epoch records, so that what unpack
    allocates follows the container's data, not the counts its header states.
    """
    from .cache import PagedKVCache

    if calibration is not None and not isinstance(calibration, Calibration):
        raise InputError(f"calibration: expected a gaac.Calibration or None, got {type(calibration).__name__}")
    c = read_head(data)
    cal = calibration if calibration is not None else c.calibration
    if cal is None:
        raise CalibrationError("the container carries no calibration (exported without calibration=True): pass "
                               f"the calibration {c.calibration_id:08x} it was made with")
    lay = c.layout
    adapt = any(s.epochs for s in lay.sections)
    _check_calibration(c, cal, adapt)
    cache = PagedKVCache(cal, max_blocks=max(1, lay.blocks), slots=max(s.slot_tiles for s in lay.sections),
                         raw_tiles=sum(s.raw_tiles for s in lay.sections), adapt=adapt)
    seq = import_sequence(cache, c.data)
    return cache.read(seq)


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
    per_section = (_align(tiles * L.TABLE_ENTRY_BYTES) + _align(blocks * L.SEQUENCE_EPOCH_BYTES)
                   + 2 * kv_heads * tail * head_dim)
    body = 2 * layers * per_section + tiles * int(tile.sum())
    records = blocks if epoch_records is None else min(int(epoch_records), blocks)
    head = (L.SEQUENCE_HEADER.size + 2 * layers * L.SEQUENCE_SECTION.size
            + 2 * layers * records * (L.SEQUENCE_EPOCH.size + 2 * kv_heads * head_dim)
            + (canonical_bytes_size(layers, kv_heads, head_dim) if calibration else 0)
            + 4 * -(-body // L.SEQUENCE_CHUNK_BYTES) + 4)
    return _align(head) + body


def container_nbytes(data) -> int:
    """The length of the sequence container that starts ``data`` (bytes-like, uint8 array or CPU tensor),
    from its header alone: what to cut from a buffer that holds more than the container.  The container
    itself is checked where it is read (:func:`gaac.transfer.read_head`)."""
    a = _as_array(data)
    if len(a) < L.SEQUENCE_HEADER.size:
        raise FormatError(f"truncated sequence container: {len(a)} bytes, its header alone is "
                          f"{L.SEQUENCE_HEADER.size}")
    (magic, _, _, flags, layers, heads, dim, _, _, n_records, _, body_bytes) = L.SEQUENCE_HEADER.unpack_from(a)
    if magic != L.SEQUENCE_MAGIC:
        raise FormatError(f"bad magic {magic!r}: not a GAAC sequence container (expected {L.SEQUENCE_MAGIC!r})")
    if dim not in L.SUPPORTED_HEAD_DIMS:
        raise FormatError(f"bad header: head_dim={dim}")
    head = (L.SEQUENCE_HEADER.size + 2 * layers * L.SEQUENCE_SECTION.size
            + n_records * (L.SEQUENCE_EPOCH.size + 2 * heads * dim)
            + (canonical_bytes_size(layers, heads, dim) if flags & L.SEQUENCE_FLAG_CALIBRATION else 0)
            + 4 * -(-body_bytes // L.SEQUENCE_CHUNK_BYTES) + 4)
    return _align(head) + body_bytes
