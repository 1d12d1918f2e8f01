"""One 16-token block of an FP8 cache: encode/decode and the version 2 block container (FORMAT-FP8.md 6-7).

The container is v1's (FORMAT.md section 7, gaac/block.py) byte for byte --
header struct, block table, slots, raw tiles, CRC-32 -- with version byte 2,
element-format byte 2 (E4M3) or 3 (E5M2), FP8 slots and raw tiles of one byte
per element.  Its input and output are FP8 bit patterns (``uint8``): the
conversion from BF16 is not part of the lossless codec (see
:func:`encode_bf16_block` for the two steps together).
"""
from __future__ import annotations

import zlib

import numpy as np

from .. import layout as L
from ..block import EncodedBlock, parse_kind
from ..errors import CalibrationError, FormatError, InputError
from ..tiles import block_tiles, tile_bases, untile
from .calibration import FP8Calibration
from .codec import decode_tiles, encode_tiles
from .convert import to_fp8
from .layout import FORMATS_BY_ELEMENT, FP8_FORMAT_VERSION, MODE_SETS


def _check_calibration(calibration) -> None:
    if not isinstance(calibration, FP8Calibration):
        raise CalibrationError(f"expected an FP8Calibration, got {type(calibration).__name__} "
                               "(a BF16 Calibration codes BF16 blocks: gaac.encode_block)")


def _check_layer(layer) -> int:
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
        raise InputError(f"layer must be an integer, got {layer!r}")
    return int(layer)


def encode_fp8_block(x, calibration: FP8Calibration, layer: int, kind) -> EncodedBlock:
    """Encode one FP8 block ``uint8[kv_heads, 16, head_dim]`` of layer ``layer``'s K or V."""
    _check_calibration(calibration)
    kind = parse_kind(kind)
    layer = _check_layer(layer)
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.ndim != 3:
        raise InputError("an FP8 block is a uint8 array [kv_heads, 16, head_dim] of FP8 bit patterns; got "
                         + (f"{x.dtype} {list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__))
    heads, tokens, dim = x.shape
    if tokens != L.BLOCK_TOKENS:
        raise InputError(f"a block has {L.BLOCK_TOKENS} tokens; got shape {list(x.shape)}")
    if dim not in L.SUPPORTED_HEAD_DIMS:
        raise InputError(f"head_dim {dim} is not supported; GAAC supports {L.SUPPORTED_HEAD_DIMS}")
    calibration.check_shape(None, heads, dim)
    calibration.check_layer(layer)
    modes = calibration.modes
    capacity = int(calibration.capacity[kind, layer])
    bn, bw = tile_bases(*calibration.bases(layer, kind))
    enc = encode_tiles(block_tiles(x), bn, bw, capacity, modes)

    fits = enc.fits
    slot_index = np.cumsum(fits) - 1
    raw_index = np.cumsum(~fits) - 1
    entries = np.where(fits, slot_index, L.TABLE_RAW_FLAG | raw_index).astype("<u4")
    header = L.STREAM_HEADER.pack(L.STREAM_MAGIC, FP8_FORMAT_VERSION, calibration.element, kind, L.BLOCK_TOKENS,
                                  layer, heads, dim, capacity, calibration.id, 0)
    body = header + entries.tobytes() + enc.slots[fits].tobytes() + enc.raw[~fits].tobytes()
    data = body + np.uint32(zlib.crc32(body)).astype("<u4").tobytes()

    geo = calibration.geometry
    payload = int(enc.payload_bytes[fits].sum()) + int((~fits).sum()) * geo.raw_bytes
    resident = int(fits.sum()) * geo.slot_bytes(capacity) + int((~fits).sum()) * geo.raw_bytes \
        + len(entries) * L.TABLE_ENTRY_BYTES
    return EncodedBlock(data=data, layer=layer, kind=kind, kv_heads=heads, head_dim=dim, modes=enc.modes,
                        raw_tiles=tuple(int(t) for t in np.flatnonzero(~fits)),
                        payload_bytes=payload, resident_bytes=resident)


def encode_bf16_block(x_bits: np.ndarray, calibration: FP8Calibration, layer: int, kind) -> EncodedBlock:
    """Convert a BF16 block (uint16 bits) with the calibration's scales, then encode it losslessly."""
    _check_calibration(calibration)
    kind, layer = parse_kind(kind), _check_layer(layer)
    calibration.check_layer(layer)
    scales = calibration.scale_log2[kind, layer].astype(np.int64)[:, None, None]
    return encode_fp8_block(to_fp8(np.asarray(x_bits, dtype=np.uint16), calibration.modes.fmt, scales),
                            calibration, layer, kind)


def decode_fp8_block(block, calibration: FP8Calibration) -> np.ndarray:
    """Decode an FP8 block container to ``uint8[kv_heads, 16, head_dim]`` FP8 bit patterns.

    Every rule of FORMAT-FP8.md section 7 is checked, in the order of its
    table; a stream that breaks one raises :class:`FormatError` (or
    :class:`CalibrationError` when it is valid but belongs to another calibration).
    """
    if not isinstance(block, (bytes, bytearray, memoryview, EncodedBlock)):
        raise InputError(f"expected bytes or EncodedBlock, got {type(block).__name__}")
    _check_calibration(calibration)
    data = bytes(block)
    need = L.STREAM_HEADER_BYTES + L.STREAM_CRC_BYTES
    if len(data) < need:
        raise FormatError(f"truncated stream: {len(data)} bytes, a block container has at least {need}")
    (magic, version, element, kind, tokens, layer, heads, dim, capacity, cal_id,
     reserved) = L.STREAM_HEADER.unpack_from(data)
    if magic != L.STREAM_MAGIC:
        raise FormatError(f"bad magic {magic!r}: not a GAAC block stream (expected {L.STREAM_MAGIC!r})")
    if version != FP8_FORMAT_VERSION:
        raise FormatError(f"stream version {version} is not supported by the FP8 decoder "
                          f"(FP8 streams are version {FP8_FORMAT_VERSION})")
    if element not in FORMATS_BY_ELEMENT:
        raise FormatError(f"element format {element} is not supported in version {FP8_FORMAT_VERSION} "
                          f"(E4M3 is 2, E5M2 is 3)")
    if kind not in L.KIND_NAMES or tokens != L.BLOCK_TOKENS or reserved != 0:
        raise FormatError(f"bad header: kind={kind}, tokens={tokens}, reserved={reserved}")
    if dim not in L.SUPPORTED_HEAD_DIMS or heads == 0:
        raise FormatError(f"bad header: kv_heads={heads}, head_dim={dim}")
    if capacity % L.SLOT_ALIGN:
        raise FormatError(f"bad header: escape capacity {capacity} is not a multiple of {L.SLOT_ALIGN}")

    modes = MODE_SETS[FORMATS_BY_ELEMENT[element].name]
    geo = modes.geometry(dim)
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

    if cal_id != calibration.id:
        raise CalibrationError(f"stream was encoded with calibration {cal_id:08x}, this calibration is "
                               f"{calibration.id:08x} (model {calibration.model!r})")
    if element != calibration.element:
        raise CalibrationError(f"stream element format {element} differs from the calibration's "
                               f"{calibration.element} ({calibration.format})")
    calibration.check_shape(None, heads, dim)
    calibration.check_layer(layer)
    if capacity != calibration.capacity[kind, layer]:
        raise CalibrationError(f"stream escape capacity {capacity} differs from the calibration's "
                               f"{calibration.capacity[kind, layer]} for layer {layer} {L.KIND_NAMES[kind]}")

    bn, bw = tile_bases(*calibration.bases(layer, kind))
    out = np.empty((n_tiles, L.BLOCK_TOKENS, geo.channels), dtype=np.uint8)
    body = np.frombuffer(data, dtype=np.uint8, offset=table_end, count=len(data) - table_end - 4)
    slots = body[: n_slot * slot_size].reshape(n_slot, slot_size)
    slot_tiles = np.flatnonzero(~is_raw)
    if n_slot:
        out[slot_tiles] = decode_tiles(slots, bn[slot_tiles], bw[slot_tiles], capacity, geo.channels, modes,
                                      tile_ids=slot_tiles)
    out[is_raw] = body[n_slot * slot_size:].reshape(n_raw, L.BLOCK_TOKENS, geo.channels)
    return untile(out, heads, dim)
