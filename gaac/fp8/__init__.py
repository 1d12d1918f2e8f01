"""GAAC-FP8: lossless exponent coding of FP8 (E4M3, E5M2) KV caches, FORMAT-FP8.md.

A BF16 cache is converted once to FP8 (round to nearest even, saturating, with a
power-of-two scale per layer and kind that the calibration records); from then
on every FP8 byte is kept exactly: the BF16 format's groups, tiles, mode tags, escape
planes and slots, with the narrower sign+mantissa fields and exponent codes of
an FP8 element.
"""
from .attention import build_layer_cache, decode_attention_fp8
from .block import decode_fp8_block, encode_bf16_block, encode_fp8_block
from .calibration import FP8Calibration, calibrate_fp8
from .convert import cache_scales, fp8_to_float, to_fp8
from .layout import E4M3, E5M2, FORMATS, MODE_SETS, FP8Format, ModeSet
from .stats import format_fp8_table, fp8_stats, measure_fp8

__all__ = ["E4M3", "E5M2", "FORMATS", "MODE_SETS", "FP8Calibration", "FP8Format", "ModeSet", "build_layer_cache",
           "cache_scales", "calibrate_fp8", "decode_attention_fp8", "decode_fp8_block", "encode_bf16_block",
           "encode_fp8_block", "format_fp8_table", "fp8_stats", "fp8_to_float", "measure_fp8", "to_fp8"]
