"""Little-endian bit streams and the element split of every element format, in plain NumPy.

Bit ``k`` of a stream is bit ``k % 8`` of byte ``k // 8`` (FORMAT.md section 1).
Every function works on the last axis and keeps any leading batch axes.
"""
from __future__ import annotations

import numpy as np

from ..layout import BF16


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Pack unsigned ``values`` (each < 2**width) into a little-endian bit stream of uint8."""
    if width == 8:              # a stream of whole bytes is the values themselves
        return np.asarray(values).astype(np.uint8)
    v = np.asarray(values).astype(np.uint32)
    planes = (v[..., None] >> np.arange(width, dtype=np.uint32)) & 1
    flat = planes.reshape(*v.shape[:-1], v.shape[-1] * width).astype(np.uint8)
    return np.packbits(flat, axis=-1, bitorder="little")


def unpack_bits(stream: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: the first ``count`` fields of ``width`` bits, as uint8."""
    if width == 8:
        return np.asarray(stream, dtype=np.uint8)[..., :count].copy()
    bits = np.unpackbits(np.asarray(stream, dtype=np.uint8), axis=-1, bitorder="little")
    bits = bits[..., : count * width].reshape(*bits.shape[:-1], count, width)
    weights = (1 << np.arange(width)).astype(np.uint8)
    return (bits * weights).sum(axis=-1, dtype=np.uint32).astype(np.uint8)


def element_dtype(fmt) -> np.dtype:
    """The NumPy dtype of the bit patterns of element format ``fmt`` (uint16 for BF16, uint8 for FP8)."""
    return np.dtype(f"u{fmt.element_bytes}")


def split_elements(bits: np.ndarray, fmt) -> tuple[np.ndarray, np.ndarray]:
    """Split bit patterns of element format ``fmt`` into (sign+mantissa field, exponent field), uint8 each.

    The sign+mantissa field is ``sign << mantissa_bits | mantissa``: the element with the exponent
    taken out, so the field keeps its natural bit order (FORMAT.md 5.1, FORMAT-FP8.md 2.2).
    """
    b = np.asarray(bits, dtype=element_dtype(fmt))
    m = fmt.mantissa_bits
    sm = ((b >> (fmt.bits - 1)) << m) | (b & ((1 << m) - 1))
    return sm.astype(np.uint8), ((b >> m) & fmt.max_exponent_field).astype(np.uint8)


def join_elements(sm: np.ndarray, exponent: np.ndarray, fmt) -> np.ndarray:
    """Inverse of :func:`split_elements`."""
    dt = element_dtype(fmt)
    m = fmt.mantissa_bits
    sm = np.asarray(sm).astype(dt)
    e = np.asarray(exponent).astype(dt)
    return ((((sm >> m) & 1) << (fmt.bits - 1)) | (e << m) | (sm & ((1 << m) - 1))).astype(dt)


def split_bf16(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`split_elements` of BF16 bit patterns: the sign+mantissa byte and the exponent byte."""
    return split_elements(bits, BF16)


def join_bf16(sm: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    """Inverse of :func:`split_bf16`."""
    return join_elements(sm, exponent, BF16)


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
