"""One 16-token block of one layer's K or V: the public encode/decode API and the stream container.

The container (FORMAT.md section 7) is what a block looks like outside the
GPU cache -- on disk, on the wire, in a test vector: a header, the block table
entries of its tiles, the compressed slots, the raw tiles, and a CRC-32.
Inside the paged cache the same slots and raw tiles live in two pools and
the same table entries point into them.

One container serves every element format: the calibration says which
(``calibration.modes``), and so the element-format byte, the versions, the
slot sizes and the raw tiles (BF16 ``uint16``, FP8 ``uint8``, FORMAT-FP8.md 6).

A BF16 block is coded with the bases of one calibration **epoch** (FORMAT.md 3.5):
epoch 0 is the calibration's own bases and is written as a version 1
container, exactly as before epochs existed; a later epoch is written as a
version 2 container whose header names the epoch and carries that epoch's id.
An FP8 container has version 2 and no epochs (its last header word is reserved).
"""
from __future__ import annotations

import numbers
import zlib
from dataclasses import dataclass

import numpy as np

from .. import layout as L
from ..arrays import as_bits
from ..calibration import Calibration
from ..errors import CalibrationError, FormatError, InputError
from ..reference.bits import element_dtype
from ..reference.codec import decode_entries, encode_tiles
from ..tiles import block_tiles, tile_bases, untile


def parse_kind(kind) -> int:
    """``'k'``/``'v'`` (any case) or ``0``/``1`` -> the kind byte."""
    if isinstance(kind, str) and kind.lower() in ("k", "v"):
        return L.KIND_K if kind.lower() == "k" else L.KIND_V
    if isinstance(kind, (int, np.integer)) and not isinstance(kind, bool) and kind in (L.KIND_K, L.KIND_V):
        return int(kind)
    raise InputError(f"kind must be 'k' or 'v', got {kind!r}")


def parse_layer(layer) -> int:
    """An integer layer number (``bool`` is refused) -> ``int``."""
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, numbers.Integral):
        raise InputError(f"layer must be an integer, got {layer!r}")
    return int(layer)


def check_calibration(calibration) -> None:
    """A path or dict where a :class:`Calibration` belongs is refused by name, not by an AttributeError."""
    if not isinstance(calibration, Calibration):
        raise CalibrationError(f"expected a gaac.Calibration, got {type(calibration).__name__} "
                               "(read a file with gaac.Calibration.load)")


def block_elements(x, fmt: L.ElementFormat) -> np.ndarray:
    """A block's bit patterns of format ``fmt``, ``[kv_heads, 16, head_dim]``: BF16 as :func:`gaac.arrays.as_bits`
    takes them, FP8 as a uint8 array of FP8 bit patterns."""
    if fmt is L.BF16:
        bits = as_bits(x, "block", ndim=3)
    elif not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 3:
        raise InputError("an FP8 block is a uint8 array [kv_heads, 16, head_dim] of FP8 bit patterns; got "
                         + (f"{x.dtype} {list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__))
    else:
        bits = x
    heads, tokens, dim = bits.shape
    if tokens != L.BLOCK_TOKENS:
        raise InputError(f"a block has {L.BLOCK_TOKENS} tokens; got shape {list(bits.shape)} "
                         "([kv_heads, tokens, head_dim])")
    if dim not in L.SUPPORTED_HEAD_DIMS:
        raise InputError(f"head_dim {dim} is not supported; the GAAC format supports {L.SUPPORTED_HEAD_DIMS}")
    return bits


@dataclass(frozen=True)
class EncodedBlock:
    """An encoded block: its container bytes and what it costs."""

    data: bytes
    layer: int
    kind: int
    kv_heads: int
    head_dim: int
    modes: np.ndarray            # [n_tiles, groups] mode tag of every group
    raw_tiles: tuple             # indices of tiles kept as raw elements (slot overflow)
    payload_bytes: int           # codes, tags, sign/mantissa and used escapes; raw tiles at their elements' size
    resident_bytes: int          # what the paged cache holds: slots, raw tiles, table entries
    epoch: int = 0               # the calibration epoch whose bases coded the block (FORMAT.md 3.5)

    @property
    def n_tiles(self) -> int:
        return self.modes.shape[0]

    @property
    def fell_back(self) -> bool:
        """True when at least one tile overflowed its slot and stays raw."""
        return bool(self.raw_tiles)

    @property
    def bf16_bytes(self) -> int:
        return self.kv_heads * L.BLOCK_TOKENS * self.head_dim * 2

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def __bytes__(self) -> bytes:
        return self.data


def encode_block(x, calibration: Calibration, layer: int, kind, epoch: int = 0) -> EncodedBlock:
    """Encode one block ``[kv_heads, 16, head_dim]`` of layer ``layer``'s K (``kind='k'``) or V.

    The calibration's element format says what ``x`` holds: BF16 bit patterns (uint16 or a torch
    BF16 tensor) or FP8 bit patterns (uint8).  ``epoch`` picks the calibration epoch whose bases
    code it (default 0, the calibration's own bases; FORMAT.md 3.5).
    """
    check_calibration(calibration)
    kind = parse_kind(kind)
    layer = parse_layer(layer)
    if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral):
        raise InputError(f"epoch must be an integer, got {epoch!r}")
    epoch = int(epoch)
    modes = calibration.modes
    fmt = modes.fmt
    bits = block_elements(x, fmt)
    heads, tokens, dim = bits.shape
    calibration.check_shape(None, heads, dim)
    calibration.check_epoch(layer, kind, epoch)
    capacity = int(calibration.capacity[kind, layer])
    bn, bw = tile_bases(*calibration.bases(layer, kind, epoch))
    enc = encode_tiles(block_tiles(bits), bn, bw, capacity, modes)

    fits = enc.fits
    entries = np.where(fits, np.cumsum(fits) - 1, L.TABLE_RAW_FLAG | (np.cumsum(~fits) - 1)).astype("<u4")
    header = L.STREAM_HEADER_V2.pack(L.STREAM_MAGIC, fmt.container_version(epoch), fmt.element, kind,
                                     L.BLOCK_TOKENS, layer, heads, dim, capacity,
                                     calibration.epoch_id(layer, kind, epoch), epoch, 0)
    body = header + entries.tobytes() + enc.slots[fits].tobytes() + enc.raw[~fits].tobytes()
    data = body + np.uint32(zlib.crc32(body)).astype("<u4").tobytes()

    geo = L.geometry(dim, modes)
    payload = int(enc.payload_bytes[fits].sum()) + int((~fits).sum()) * geo.raw_bytes
    resident = int(fits.sum()) * geo.slot_bytes(capacity) + int((~fits).sum()) * geo.raw_bytes \
        + len(entries) * L.TABLE_ENTRY_BYTES
    return EncodedBlock(data=data, layer=layer, kind=kind, kv_heads=heads, head_dim=dim, modes=enc.modes,
                        raw_tiles=tuple(int(t) for t in np.flatnonzero(~fits)),
                        payload_bytes=payload, resident_bytes=resident, epoch=epoch)


def decode_block(block, calibration: Calibration) -> np.ndarray:
    """Decode a block container (bytes or :class:`EncodedBlock`) to ``[kv_heads, 16, head_dim]`` bit patterns
    of the calibration's element format (uint16 for BF16, uint8 for FP8).

    Every rule of FORMAT.md section 8 (FORMAT-FP8.md section 7) is checked; a stream
    that breaks one raises :class:`FormatError` (or :class:`CalibrationError` when the
    stream is valid but was made with another calibration, or with an epoch this
    calibration does not hold).  BF16 containers of versions 1 and 2 are read, FP8
    containers of version 2.
    """
    if not isinstance(block, (bytes, bytearray, memoryview, EncodedBlock)):
        raise InputError(f"expected bytes or EncodedBlock, got {type(block).__name__}")
    check_calibration(calibration)
    modes = calibration.modes
    fmt = modes.fmt
    c = read_container(bytes(block), fmt)
    kind, layer, heads, dim, capacity, cal_id, epoch = c.kind, c.layer, c.heads, c.dim, c.capacity, c.cal_id, c.epoch

    if epoch == 0 and cal_id != calibration.id:
        raise CalibrationError(f"stream was encoded with calibration {cal_id:08x}, this calibration is "
                               f"{calibration.id:08x} (model {calibration.model!r})")
    if c.element != fmt.element:
        raise CalibrationError(f"stream element format {c.element} differs from the calibration's "
                               f"{fmt.element} ({fmt.name})")
    calibration.check_block(kind, layer, heads, dim, capacity)                # R15-R17
    if epoch:
        calibration.check_epoch(layer, kind, epoch)                         # R23: "unknown epoch"
        if cal_id != calibration.epoch_id(layer, kind, epoch):              # R22
            raise CalibrationError(f"stream epoch {epoch} has id {cal_id:08x}, but epoch {epoch} of this "
                                   f"calibration (layer {layer} {L.KIND_NAMES[kind]}) has id "
                                   f"{calibration.epoch_id(layer, kind, epoch):08x}: the stream belongs to "
                                   "another cache's epochs")

    bn, bw = tile_bases(*calibration.bases(layer, kind, epoch))
    raw = c.raw.view(element_dtype(fmt).newbyteorder("<")).reshape(-1, L.BLOCK_TOKENS, c.geo.channels)
    out = decode_entries(c.entries, c.slots, raw, bn, bw, capacity, modes, tile_ids=c.slot_tiles)
    return untile(out, heads, dim)


@dataclass(frozen=True)
class Container:
    """A block container whose framing passed FORMAT.md section 8 (R1-R13): header, table, sizes, CRC."""

    version: int
    element: int
    kind: int
    layer: int
    heads: int
    dim: int
    capacity: int
    cal_id: int
    epoch: int
    geo: L.TileGeometry
    entries: np.ndarray      # [n_tiles] int64: the block-table entries
    is_raw: np.ndarray       # [n_tiles] bool: the table entry points into the raw pool
    slots: np.ndarray        # [n_slots, slot_bytes] uint8, in slot order
    raw: np.ndarray          # the raw tiles' bytes, in raw-pool order (uint8, flat)

    @property
    def n_tiles(self) -> int:
        return len(self.is_raw)

    @property
    def slot_tiles(self) -> np.ndarray:
        return np.flatnonzero(~self.is_raw)


def read_container(data: bytes, fmt: L.ElementFormat) -> Container:
    """Check and cut a block container of element format ``fmt``'s family into its parts.

    The family is the formats written with ``fmt``'s container versions (BF16; or FP8 E4M3 and
    E5M2): a container of another format of the family passes here and is refused by the caller
    against its calibration.  Version 2's epoch field may be non-zero only where the format has
    epochs (otherwise the whole last header word is reserved).
    """
    versions, epochs = fmt.versions, fmt.epochs
    family = [f for f in L.FORMATS.values() if f.versions == fmt.versions]
    if fmt is L.BF16:
        element_names = f"BF16 is {L.ELEMENT_BF16}"
    else:
        element_names = f"version {L.FP8_FORMAT_VERSION}: " + ", ".join(
            f"{f.name[4:].upper()} is {f.element}" for f in family)
    family_modes = {f.element: L.MODE_SETS[f.name] for f in family}
    need = L.STREAM_HEADER_BYTES + L.STREAM_CRC_BYTES
    if len(data) < need:
        raise FormatError(f"truncated stream: {len(data)} bytes, a block container has at least {need}")
    (magic, version, element, kind, tokens, layer, heads, dim, capacity, cal_id, epoch,
     reserved) = L.STREAM_HEADER_V2.unpack_from(data)
    if magic != L.STREAM_MAGIC:
        raise FormatError(f"bad magic {magic!r}: not a GAAC block stream (expected {L.STREAM_MAGIC!r})")
    if version not in versions:
        raise FormatError(f"stream version {version} is not supported (this decoder reads versions "
                          f"{' and '.join(map(str, versions))})")
    if version == 1 or not epochs:      # no epoch field: the whole last u32 is reserved (R7)
        epoch, reserved = 0, epoch | reserved << 16
    if element not in family_modes:
        raise FormatError(f"element format {element} is not supported ({element_names})")
    if kind not in L.KIND_NAMES or tokens != L.BLOCK_TOKENS or reserved != 0:
        raise FormatError(f"bad header: kind={kind}, tokens={tokens}, reserved={reserved}")
    if dim not in L.SUPPORTED_HEAD_DIMS or heads == 0:
        raise FormatError(f"bad header: kv_heads={heads}, head_dim={dim}")
    if capacity % L.SLOT_ALIGN:
        raise FormatError(f"bad header: escape capacity {capacity} is not a multiple of {L.SLOT_ALIGN}")

    geo = L.geometry(dim, family_modes[element])
    n_tiles = heads * L.tiles_per_head(dim)
    table_end = L.STREAM_HEADER_BYTES + n_tiles * L.TABLE_ENTRY_BYTES
    if len(data) < table_end + L.STREAM_CRC_BYTES:
        raise FormatError(f"truncated stream: {len(data)} bytes, its tile table alone ends at {table_end}")
    entries = np.frombuffer(data, dtype="<u4", count=n_tiles, offset=L.STREAM_HEADER_BYTES).astype(np.int64)
    is_raw = (entries & L.TABLE_RAW_FLAG) != 0
    n_raw = int(is_raw.sum())
    n_slot = n_tiles - n_raw
    slot_size = geo.slot_bytes(capacity)
    expected = table_end + n_slot * slot_size + n_raw * geo.raw_bytes + L.STREAM_CRC_BYTES
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "trailing bytes after"
        raise FormatError(f"{what} stream: {len(data)} bytes, its header and tile table make it {expected}")
    crc = int(np.frombuffer(data, dtype="<u4", count=1, offset=len(data) - 4)[0])
    if crc != zlib.crc32(data[:-4]):
        raise FormatError(f"CRC-32 mismatch (stored {crc:08x}, computed {zlib.crc32(data[:-4]):08x}): "
                          "the stream is corrupt")
    index = entries & L.TABLE_INDEX_MASK
    want = np.where(is_raw, np.cumsum(is_raw) - 1, np.cumsum(~is_raw) - 1)
    if (index != want).any():
        t = int(np.flatnonzero(index != want)[0])
        raise FormatError(f"tile table entry {t} points at index {index[t]}, expected {want[t]} "
                          "(tiles of each class are numbered in tile order)")
    body = np.frombuffer(data, dtype=np.uint8, offset=table_end, count=len(data) - table_end - 4)
    return Container(version=version, element=element, kind=kind, layer=layer, heads=heads, dim=dim,
                     capacity=capacity, cal_id=cal_id, epoch=epoch, geo=geo, entries=entries, is_raw=is_raw,
                     slots=body[: n_slot * slot_size].reshape(n_slot, slot_size), raw=body[n_slot * slot_size:])
