"""BF16 -> FP8 conversion (round to nearest even, saturating) and FP8 -> float, exactly, in NumPy.

The scale is a power of two, ``2**scale_log2``, one per (kind, layer, KV head):
``fp8 = sat_rne(x * 2**-scale_log2)`` and ``x' = fp8 * 2**scale_log2``.

Why a power of two.  Multiplying a BF16 value by ``2**-s`` is exact, so the
conversion rounds once (BF16 -> FP8) instead of twice (``x / s`` in FP32, then
FP8), is the same on every device, and dequantisation is an exponent add.
It costs at most one binade of headroom against ``amax / max_finite``.

Why "per tensor" by default.  vLLM and most serving engines keep one static
``k_scale`` / ``v_scale`` per layer: a block is converted when its tokens
arrive, so the scale cannot depend on tokens that come later.  The scale is
therefore chosen at calibration from the sample's absolute maximum
(:func:`choose_scale_log2`) and recorded in the FP8 calibration; a cache
whose values exceed it saturates to +-max_finite.  ``per="head"`` gives every
KV head its own scale with the same rule; ``per="one"`` is scale 1
(``scale_log2 = 0``), what an engine uses without calibrated scales.

Conversion rules (FORMAT-FP8.md section 2): round to nearest, ties to even;
finite values beyond max_finite and +-Inf saturate to +-max_finite (E5M2 too,
as CUDA's ``__NV_SATFINITE``); NaN -> ``sign | nan_bits``; the sign of zero is
kept; values below the smallest subnormal round to +-0.
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from ..layout import ElementFormat

SCALE_POLICIES = ("tensor", "head", "one")


def bf16_to_float(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float64 values, exactly."""
    b = np.asarray(bits, dtype=np.uint16)
    with np.errstate(invalid="ignore"):          # signalling NaNs become quiet NaNs; still NaN
        return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def round_to_fp8(x: np.ndarray, fmt: ElementFormat) -> np.ndarray:
    """float64 values -> FP8 bit patterns (uint8), round to nearest even, saturating."""
    x = np.asarray(x, dtype=np.float64)
    sign = np.signbit(x).astype(np.uint8) << 7
    nan = np.isnan(x)
    # Saturate before rounding: max_finite is representable and rounding is monotonic,
    # so this equals rounding and then clamping, and never produces Inf or NaN.
    a = np.minimum(np.where(nan, 0.0, np.abs(x)), fmt.max_finite)
    _, e2 = np.frexp(a)                                       # a = f * 2**e2, f in [0.5, 1)
    unbiased = np.maximum(e2.astype(np.int64) - 1, fmt.min_normal_exp)
    quantum = unbiased - fmt.mantissa_bits                    # log2 of the spacing at that exponent
    m = np.rint(np.ldexp(a, -quantum)).astype(np.int64)       # exact: a has at most 53 significant bits
    one = 1 << fmt.mantissa_bits
    carry = m >= 2 * one                                      # rounded up into the next binade
    m = np.where(carry, one, m)
    unbiased = unbiased + carry
    normal = m >= one
    e_field = np.where(normal, unbiased + fmt.bias, 0)
    mant = np.where(normal, m - one, m)
    out = sign | ((e_field << fmt.mantissa_bits) | mant).astype(np.uint8)
    return np.where(nan, sign | np.uint8(fmt.nan_bits), out).astype(np.uint8)


def fp8_values(fmt: ElementFormat) -> np.ndarray:
    """float64 value of each of the 256 FP8 bit patterns (a decode table)."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> fmt.mantissa_bits) & fmt.max_exponent_field
    m = b & ((1 << fmt.mantissa_bits) - 1)
    sub = np.ldexp(m.astype(np.float64), fmt.min_normal_exp - fmt.mantissa_bits)
    norm = np.ldexp((m | 1 << fmt.mantissa_bits).astype(np.float64), e - fmt.bias - fmt.mantissa_bits)
    v = sign * np.where(e == 0, sub, norm)
    top = e == fmt.max_exponent_field
    if fmt.has_inf:
        v = np.where(top & (m == 0), sign * np.inf, np.where(top, np.nan, v))
    else:
        v = np.where(top & (m == (1 << fmt.mantissa_bits) - 1), np.nan, v)
    return v


def fp8_to_float(fp8: np.ndarray, fmt: ElementFormat, scale_log2=0) -> np.ndarray:
    """FP8 bit patterns -> float64 values times ``2**scale_log2`` (broadcast), exactly."""
    return np.ldexp(fp8_values(fmt)[np.asarray(fp8, dtype=np.uint8)], np.asarray(scale_log2, dtype=np.int64))


def choose_scale_log2(amax: np.ndarray, fmt: ElementFormat) -> np.ndarray:
    """The least ``s`` with ``amax <= max_finite * 2**s``: the largest values land in the top binade.

    An all-zero (or non-finite) ``amax`` gets ``s = 0``.  Results are int64.
    """
    amax = np.asarray(amax, dtype=np.float64)
    ok = np.isfinite(amax) & (amax > 0)
    s = np.ceil(np.log2(np.where(ok, amax, fmt.max_finite) / fmt.max_finite)).astype(np.int64)
    # log2 rounding: make sure amax fits and one step less would not.
    s = np.where(np.where(ok, amax, 0) > np.ldexp(fmt.max_finite, s), s + 1, s)
    s = np.where(np.where(ok, amax, np.inf) <= np.ldexp(fmt.max_finite, s - 1), s - 1, s)
    return np.where(ok, s, 0)


def cache_scales(x_bits: np.ndarray, fmt: ElementFormat, per: str = "tensor") -> np.ndarray:
    """Scale exponents ``int64[layers, kv_heads]`` for one kind of a cache ``[layers, kv_heads, tokens, dim]``."""
    if per not in SCALE_POLICIES:
        raise InputError(f"scale policy {per!r}: expected one of {SCALE_POLICIES}")
    layers, heads = x_bits.shape[:2]
    if per == "one":
        return np.zeros((layers, heads), dtype=np.int64)
    a = np.abs(bf16_to_float(x_bits))
    a = np.where(np.isfinite(a), a, 0.0)
    amax = a.max(axis=(2, 3))                                   # [layers, heads]
    if per == "tensor":
        amax = np.broadcast_to(amax.max(axis=1, keepdims=True), amax.shape)
    return choose_scale_log2(amax, fmt)


def bf16_to_fp8_table(fmt: ElementFormat, scale_log2: int) -> np.ndarray:
    """FP8 bits of every BF16 pattern times ``2**-scale_log2``: ``uint8[65536]``.

    A BF16 cache has only 65536 distinct values, so converting through this
    table is :func:`round_to_fp8` itself, once per pattern instead of per element.
    """
    return round_to_fp8(np.ldexp(bf16_to_float(np.arange(1 << 16, dtype=np.uint16)), -int(scale_log2)), fmt)


def to_fp8(bits: np.ndarray, fmt: ElementFormat, scale_log2=0) -> np.ndarray:
    """BF16 bit patterns -> FP8 bit patterns of ``bits * 2**-scale_log2`` (``scale_log2`` broadcast)."""
    b = np.asarray(bits, dtype=np.uint16)
    s = np.asarray(scale_log2, dtype=np.int64)
    out = np.empty(np.broadcast_shapes(b.shape, s.shape), dtype=np.uint8)
    b = np.broadcast_to(b, out.shape)
    for value in np.unique(s):
        where = np.broadcast_to(s == value, out.shape)
        out[where] = bf16_to_fp8_table(fmt, int(value))[b[where]]
    return out


def cache_to_fp8(x_bits: np.ndarray, fmt: ElementFormat, scale_log2: np.ndarray) -> np.ndarray:
    """One kind of a cache ``[layers, kv_heads, tokens, dim]`` -> FP8 bytes, scales ``[layers, kv_heads]``."""
    return to_fp8(x_bits, fmt, np.asarray(scale_log2)[:, :, None, None])
