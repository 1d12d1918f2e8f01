"""Little-endian bit streams and the BF16 element split, in plain NumPy.

Bit ``k`` of a stream is bit ``k % 8`` of byte ``k // 8`` (FORMAT.md section 1).
Every function works on the last axis and keeps any leading batch axes.
"""
from __future__ import annotations

import numpy as np


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Pack unsigned ``values`` (each < 2**width) into a little-endian bit stream of uint8."""
    v = np.asarray(values).astype(np.uint32)
    planes = (v[..., None] >> np.arange(width, dtype=np.uint32)) & 1
    flat = planes.reshape(*v.shape[:-1], v.shape[-1] * width).astype(np.uint8)
    return np.packbits(flat, axis=-1, bitorder="little")


def unpack_bits(stream: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: the first ``count`` fields of ``width`` bits, as uint8."""
    bits = np.unpackbits(np.asarray(stream, dtype=np.uint8), axis=-1, bitorder="little")
    bits = bits[..., : count * width].reshape(*bits.shape[:-1], count, width)
    weights = (1 << np.arange(width)).astype(np.uint8)
    return (bits * weights).sum(axis=-1, dtype=np.uint32).astype(np.uint8)


def split_bf16(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split BF16 bit patterns into (sign+mantissa byte, exponent byte).

    The sign+mantissa byte is ``sign << 7 | mantissa``: the BF16 high byte with
    the exponent taken out, so the byte keeps its natural bit order.
    """
    b = np.asarray(bits, dtype=np.uint16)
    sm = (((b >> 8) & 0x80) | (b & 0x7F)).astype(np.uint8)
    exponent = ((b >> 7) & 0xFF).astype(np.uint8)
    return sm, exponent


def join_bf16(sm: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    """Inverse of :func:`split_bf16`."""
    sm16 = np.asarray(sm).astype(np.uint16)
    e16 = np.asarray(exponent).astype(np.uint16)
    return ((sm16 & 0x80) << 8) | (e16 << 7) | (sm16 & 0x7F)


def bit_planes(values: np.ndarray, first: int, count: int) -> np.ndarray:
    """Bit planes ``first .. first+count-1`` of groups of 8 values: ``[..., count]`` uint8.

    Byte ``p`` holds bit ``first + p`` of value ``i`` at bit ``i`` (FORMAT.md 5.4).
    """
    v = np.asarray(values).astype(np.uint32)
    shifts = np.arange(first, first + count, dtype=np.uint32)
    planes = (v[..., None, :] >> shifts[:, None]) & 1            # [..., count, 8]
    weights = (1 << np.arange(v.shape[-1], dtype=np.uint32))
    return (planes * weights).sum(axis=-1).astype(np.uint8)


def from_planes(planes: np.ndarray, first: int) -> np.ndarray:
    """Inverse of :func:`bit_planes`: values of 8 elements from ``[..., count]`` plane bytes."""
    p = np.asarray(planes).astype(np.uint32)
    count = p.shape[-1]
    bits = (p[..., :, None] >> np.arange(8, dtype=np.uint32)) & 1   # [..., count, 8]
    shifts = np.arange(first, first + count, dtype=np.uint32)[:, None]
    return (bits << shifts).sum(axis=-2).astype(np.uint32)
