"""One 16-token block of an FP8 cache: encode/decode and the version 2 block container (FORMAT-FP8.md 6-7).

The container is the BF16 one (FORMAT.md section 7, gaac/block.py) byte for byte --
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
from ..block import EncodedBlock, parse_kind, read_container
from ..errors import CalibrationError, InputError
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
    c = read_container(bytes(block), versions=(FP8_FORMAT_VERSION,), epochs=False,
                       geometries={e: MODE_SETS[f.name].geometry for e, f in FORMATS_BY_ELEMENT.items()},
                       element_names=f"version {FP8_FORMAT_VERSION}: E4M3 is 2, E5M2 is 3")
    element, kind, layer, heads, dim = c.element, c.kind, c.layer, c.heads, c.dim
    capacity, cal_id = c.capacity, c.cal_id
    modes = MODE_SETS[FORMATS_BY_ELEMENT[element].name]

    if cal_id != calibration.id:
        raise CalibrationError(f"stream was encoded with calibration {cal_id:08x}, this calibration is "
                               f"{calibration.id:08x} (model {calibration.model!r})")
    if element != calibration.element:
        raise CalibrationError(f"stream element format {element} differs from the calibration's "
                               f"{calibration.element} ({calibration.format})")
    calibration.check_block(kind, layer, heads, dim, capacity)                # R15-R17

    bn, bw = tile_bases(*calibration.bases(layer, kind))
    out = np.empty((c.n_tiles, L.BLOCK_TOKENS, c.geo.channels), dtype=np.uint8)
    if len(c.slot_tiles):
        out[c.slot_tiles] = decode_tiles(c.slots, bn[c.slot_tiles], bw[c.slot_tiles], capacity, c.geo.channels,
                                        modes, tile_ids=c.slot_tiles)
    out[c.is_raw] = c.raw.reshape(-1, L.BLOCK_TOKENS, c.geo.channels)
    return untile(out, heads, dim)
