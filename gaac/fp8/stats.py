"""What a GAAC-FP8 calibration makes of a cache: the BF16 ``gaac stats`` fields, plus the ratios over FP8.

:func:`measure_fp8` converts a BF16 cache to FP8 with the calibration's scales
(:mod:`gaac.fp8.convert`), codes every complete 16-token block the way a paged
cache holds it, decodes it again and compares the FP8 bytes bit for bit.  The
fields mean what they mean for BF16 (gaac/tally.py), with FP8 as the
uncompressed reference:

* ``ratio_stream``   = FP8 bytes / payload bytes (sign+mantissa fields, low codes,
  tags and the escape bytes the groups need; no slot rounding, no fallback);
* ``ratio_resident`` = FP8 bytes / what the paged cache holds (slots of
  ``fixed + capacity`` bytes, raw FP8 tiles, 4-byte table entries);
* ``ratio_over_fp8`` = ``ratio_stream``: the paper's "additional ratio" (Table 7),
  in the same sense as its BF16 1.405;
* ``ratio_total_vs_bf16`` = 2 x ``ratio_stream``: BF16 bytes / payload bytes,
  the paper's "total vs. BF16"; ``ratio_total_resident_vs_bf16`` = 2 x ``ratio_resident``;
* ``frac_<mode>`` -- the share of groups in each mode, named by code width
  (e.g. ``frac_2bit``, ``frac_3bit``, ``frac_raw``); ``mode_names`` lists them;
* ``exponent_entropy`` -- of the FP8 exponent fields; ``roundtrip`` -- every FP8 byte decoded back;
* ``conversion`` -- the scale exponents, how many values saturated or flushed
  to zero, and the relative RMS error: what the FP8 conversion itself changed
  (the codec changes nothing).

The last ``tokens % 16`` tokens form no block and are left out, as for BF16.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import layout as L
from ..errors import InputError
from ..layout import MODE_SETS, ModeSet, fp8_format
from ..tally import CacheStats, KindStats, TileTally, measure_layer, measured_cache
from ..calibration import Calibration, calibrate
from .convert import bf16_to_float, cache_to_fp8, fp8_to_float

BF16_BYTES_PER_FP8_BYTE = 2


@dataclass
class FP8Tally(TileTally):
    """A :class:`gaac.tally.TileTally` of an FP8 cache whose summary adds the ratio over FP8 and the total
    over BF16."""

    def summary(self) -> dict:
        base = super().summary()
        fp8, stream, resident = self.sizes()
        return {"ratio_stream": base.pop("ratio_stream"), "ratio_resident": base.pop("ratio_resident"),
                "ratio_over_fp8": fp8 / stream,
                "ratio_total_vs_bf16": BF16_BYTES_PER_FP8_BYTE * fp8 / stream,
                "ratio_total_resident_vs_bf16": BF16_BYTES_PER_FP8_BYTE * fp8 / resident,
                **base, "mode_names": list(self.mode_names)}


def measure_fp8_layer(fp8: np.ndarray, b_narrow: np.ndarray, b_wide: np.ndarray, capacity: int,
                      modes: ModeSet) -> FP8Tally:
    """Encode, decode and count one layer of FP8 bytes ``[kv_heads, tokens, head_dim]``."""
    return measure_layer(fp8, b_narrow, b_wide, capacity, modes, tally=FP8Tally)


def conversion_counts(bits: np.ndarray, fp8: np.ndarray, modes: ModeSet, scale_log2: np.ndarray) -> dict:
    """What the BF16 -> FP8 conversion changed: saturated values, non-zeros flushed to zero, the error.

    ``rel_rms_error`` is ``||x' - x|| / ||x||`` over the finite values, ``x'`` the dequantised FP8.
    """
    x = bf16_to_float(bits)
    y = fp8_to_float(fp8, modes.fmt, np.asarray(scale_log2)[:, :, None, None])
    limit = np.ldexp(modes.fmt.max_finite, np.asarray(scale_log2, dtype=np.int64))[:, :, None, None]
    finite = np.isfinite(x)
    xf, yf = x[finite], y[finite]
    norm = float(np.sqrt(np.square(xf).sum()))
    return {"elements": int(x.size), "saturated": int((finite & (np.abs(x) > limit)).sum()),
            "flushed_to_zero": int((finite & (x != 0) & (y == 0)).sum()),
            "rel_rms_error": float(np.sqrt(np.square(yf - xf).sum())) / norm if norm else 0.0}


@dataclass
class FP8KindStats(KindStats):
    """The :class:`gaac.tally.KindStats` of one kind of an FP8 cache, with what its conversion changed
    (GAAC-FP8 has no epochs to adapt, so its summary has no ``adapt``)."""

    scale_log2: list = field(default_factory=list)      # [kv_heads] per layer
    conversion: dict = field(default_factory=dict)

    def summary(self) -> dict:
        out = super().summary()
        del out["adapt"]
        return {**out, "conversion": {"scale_log2": self.scale_log2, **self.conversion}}


def measure_fp8(k, v, calibration: Calibration, *, layer_ids=None) -> CacheStats:
    """Convert BF16 caches ``k``, ``v`` ``[layers, kv_heads, tokens, head_dim]`` to FP8 and measure them."""
    modes = calibration.modes
    out = {}
    for kind, name, x in ((L.KIND_K, "k", k), (L.KIND_V, "v", v)):
        bits, ids = measured_cache(x, name, calibration, layer_ids)
        layers, heads, tokens, dim = bits.shape
        scales = calibration.scale_log2[kind].astype(np.int64)
        fp8 = cache_to_fp8(bits, modes.fmt, scales)
        tallies = [measure_fp8_layer(fp8[layer], *calibration.bases(layer, kind),
                                     int(calibration.capacity[kind, layer]), modes) for layer in range(layers)]
        out[name] = FP8KindStats(name, tokens, tallies, [int(c) for c in calibration.capacity[kind]], ids,
                                 scale_log2=scales.tolist(), conversion=conversion_counts(bits, fp8, modes, scales))
    return CacheStats(**out, calibration=calibration)


def fp8_stats(k, v, fmt: str, *, calibration: Calibration | None = None, scale: str = "tensor",
              per_layer: bool = False, layer_ids=None, model: str | None = None) -> dict:
    """What ``gaac stats --format fp8_e4m3|fp8_e5m2`` prints: the ``CacheStats.as_dict`` shape.

    Without ``calibration`` the cache is calibrated on itself (scales by ``scale``).
    A given calibration must be for ``fmt``.
    """
    try:
        want = MODE_SETS[fp8_format(fmt).name]
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if calibration is None:
        calibration = calibrate(k, v, format=want.fmt, scale=scale, model=model)
    elif calibration.modes != want:
        raise InputError(f"calibration is for {calibration.format.name}, not {want.fmt.name}")
    out = measure_fp8(k, v, calibration, layer_ids=layer_ids).as_dict(per_layer=per_layer)
    out["format"] = calibration.format.name
    out["calibration_id"] = f"{calibration.id:08x}"
    return out


def format_fp8_table(d: dict, per_layer: bool = False) -> str:
    """The readable view of :func:`fp8_stats`'s dict, K and V side by side (as ``gaac stats`` prints BF16)."""
    k, v = d["k"], d["v"]

    def pct(x: float) -> str:
        return f"{100 * x:.2f}%"

    rows = [
        ("ratio_over_fp8 (FP8 / payload)", lambda s: f"{s['ratio_over_fp8']:.4f}"),
        ("ratio_total_vs_bf16 (BF16 / payload)", lambda s: f"{s['ratio_total_vs_bf16']:.4f}"),
        ("ratio_resident (FP8 / slots+raw+table)", lambda s: f"{s['ratio_resident']:.4f}"),
        ("ratio_total_resident_vs_bf16", lambda s: f"{s['ratio_total_resident_vs_bf16']:.4f}"),
        ("bits per element, stream", lambda s: f"{s['bits_per_element_stream']:.3f}"),
        ("bits per element, resident", lambda s: f"{s['bits_per_element_resident']:.3f}"),
        *[(f"groups {name}", lambda s, n=name: pct(s[f"frac_{n}"])) for name in k["mode_names"]],
        ("tiles raw (slot overflow)", lambda s: f"{pct(s['frac_raw_tiles'])} ({s['raw_tiles']}/{s['tiles']})"),
        ("exponent entropy (bits)", lambda s: f"{s['exponent_entropy']:.3f}"),
        ("escape capacity (bytes/slot)", lambda s: f"{min(s['capacity'])}..{max(s['capacity'])}"),
        ("scale exponents (2**s)", lambda s: f"{min(map(min, s['conversion']['scale_log2']))}.."
                                             f"{max(map(max, s['conversion']['scale_log2']))}"),
        ("conversion: saturated / flushed to 0", lambda s: f"{s['conversion']['saturated']} / "
                                                           f"{s['conversion']['flushed_to_zero']}"),
        ("conversion: relative RMS error", lambda s: f"{s['conversion']['rel_rms_error']:.4f}"),
        ("roundtrip bit-exact (FP8)", lambda s: "yes" if s["roundtrip"] else "NO"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{d['format']}, calibration {d['calibration_id']}", f"{'':{width}}  {'K':>16}  {'V':>16}"]
    lines += [f"{name:{width}}  {fmt(k):>16}  {fmt(v):>16}" for name, fmt in rows]
    lines.append(f"{k['layers']} layers, {k['tokens']} K / {v['tokens']} V tokens = {k['blocks']} / {v['blocks']} "
                 f"complete blocks; {k['tail_tokens']} / {v['tail_tokens']} tail tokens are not in the numbers above")
    if per_layer:
        names = k["mode_names"]
        lines += ["", f"{'layer':>5} |" + " |".join(f" {kind}: {'cap':>4} {'over':>7} {'resident':>8} "
                                                    + " ".join(f"{n:>7}" for n in names) for kind in "KV")]
        for lk, lv in zip(d["per_layer"]["k"], d["per_layer"]["v"]):
            cells = [f" {kind}: {s['capacity']:>4} {s['ratio_over_fp8']:>7.4f} {s['ratio_resident']:>8.4f} "
                     + " ".join(f"{pct(s['frac_' + n]):>7}" for n in names) for kind, s in (("K", lk), ("V", lv))]
            lines.append(f"{lk['layer']:>5} |" + " |".join(cells))
    return "\n".join(lines)
