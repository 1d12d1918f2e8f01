"""GAAC-FP8: lossless exponent coding of FP8 (E4M3, E5M2) KV caches, FORMAT-FP8.md.

A BF16 cache is converted once to FP8 (round to nearest even, saturating, with a
power-of-two scale per layer and kind that the calibration records); from then
on every FP8 byte is kept exactly by the codec of every element format
(:mod:`gaac.format.block`, :mod:`gaac.reference.codec`) with E4M3's or E5M2's
widths (:data:`gaac.layout.MODE_SETS`), calibrated by :func:`gaac.calibrate`
with an FP8 ``format`` into a :class:`gaac.Calibration` that also records the
scales.  What is FP8's own is here: the conversion, attention over the
dequantised cache, the statistics of the conversion and its CUDA kernels.
The functions below are the block API bound to an FP8 calibration.
"""
import numpy as np

from ..format.block import EncodedBlock, check_calibration, decode_block, encode_block, parse_kind, parse_layer
from ..calibration import Calibration, calibrate
from ..errors import CalibrationError
from ..layout import E4M3, E5M2, FP8_FORMATS, FP8_MODE_SETS, ElementFormat, ModeSet, fp8_format
from .attention import build_layer_cache, decode_attention_fp8
from .convert import cache_scales, fp8_to_float, to_fp8
from .stats import format_fp8_table, fp8_stats, measure_fp8

FORMATS = FP8_FORMATS
MODE_SETS = FP8_MODE_SETS
FP8Format = ElementFormat


def calibrate_fp8(k, v, fmt: str, *, scale: str = "tensor", model: str | None = None,
                  capacity: int | None = None) -> Calibration:
    """:func:`gaac.calibrate` of FP8 format ``fmt`` (``'fp8_e4m3'``, ``'e5m2'``, ...) on BF16 sample caches."""
    try:
        fmt = fp8_format(fmt)
    except ValueError as exc:
        raise CalibrationError(str(exc)) from None
    return calibrate(k, v, format=fmt, scale=scale, model=model, capacity=capacity)


def _check_calibration(calibration) -> None:
    check_calibration(calibration)
    if calibration.format.name not in FP8_FORMATS:
        raise CalibrationError(f"expected an FP8 calibration, got a {calibration.format.name} one "
                               "(a BF16 calibration codes BF16 blocks: gaac.encode_block)")


def encode_fp8_block(x, calibration: Calibration, layer: int, kind) -> EncodedBlock:
    """:func:`gaac.encode_block` of one FP8 block ``uint8[kv_heads, 16, head_dim]`` with an FP8 calibration."""
    _check_calibration(calibration)
    return encode_block(x, calibration, layer, kind)


def decode_fp8_block(block, calibration: Calibration) -> np.ndarray:
    """:func:`gaac.decode_block` of an FP8 block container with an FP8 calibration: ``uint8[kv_heads, 16, head_dim]``."""
    _check_calibration(calibration)
    return decode_block(block, calibration)


def encode_bf16_block(x_bits: np.ndarray, calibration: Calibration, layer: int, kind) -> EncodedBlock:
    """Convert a BF16 block (uint16 bits) with the calibration's scales, then encode it losslessly."""
    _check_calibration(calibration)
    kind, layer = parse_kind(kind), parse_layer(layer)
    calibration.check_layer(layer)
    scales = calibration.scale_log2[kind, layer].astype(np.int64)[:, None, None]
    return encode_block(to_fp8(np.asarray(x_bits, dtype=np.uint16), calibration.modes.fmt, scales),
                        calibration, layer, kind)


__all__ = ["E4M3", "E5M2", "FORMATS", "MODE_SETS", "FP8Format", "ModeSet", "build_layer_cache",
           "cache_scales", "calibrate_fp8", "decode_attention_fp8", "decode_fp8_block", "encode_bf16_block",
           "encode_fp8_block", "format_fp8_table", "fp8_stats", "fp8_to_float", "measure_fp8", "to_fp8"]
