"""FP8 calibration: scales, exponent windows and slot capacities for a GAAC-FP8 cache.

FP8 needs its own calibration because all three of its parts depend on the
element format: the scale that maps the cache into the format's range
(:mod:`gaac.fp8.convert`), the windows -- chosen on FP8 exponent fields, with
the widths of the format's mode set -- and the capacities, whose cost model is
the FP8 tile geometry.  The procedure is the BF16 one (gaac/calibration.py): per
(kind, layer, head, channel) the window covering the most values
(:func:`gaac.calibration.best_windows`), per (kind, layer) the capacity that
minimises resident bytes, ties to the smallest; it runs on the sample
converted with the scales it has just chosen.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from .. import layout as L
from ..calibration import (CacheShape, _all_ints, _int_array, check_capacities, check_notes, file_notes, fit_windows,
                           sample_caches)
from ..errors import CalibrationError
from ..layout import FP8_FORMAT_VERSION, MODE_SETS, ModeSet, fp8_format
from .convert import cache_scales, cache_to_fp8

FP8_CALIBRATION_FORMAT = "gaac-fp8-calibration"
SCALE_LOG2_RANGE = (-127, 127)    # a scale exponent is stored as a signed byte


@dataclass
class FP8Calibration(CacheShape):
    """Everything a GAAC-FP8 cache of one model needs besides its data.

    ``scale_log2`` ``[2 (K, V), layers, kv_heads]``: the cache holds ``x * 2**-scale_log2`` in FP8;
    ``b_narrow``/``b_wide`` ``[2, layers, kv_heads, head_dim]``; ``capacity`` ``[2, layers]``.
    """

    format: str
    scale_log2: np.ndarray
    b_narrow: np.ndarray
    b_wide: np.ndarray
    capacity: np.ndarray
    model: str | None = None
    notes: dict = field(default_factory=dict)

    def __post_init__(self):
        check_notes(self.notes)
        try:
            self.format = fp8_format(self.format).name
        except ValueError as exc:
            raise CalibrationError(str(exc)) from None
        self.scale_log2, self.b_narrow, self.b_wide, self.capacity = (
            _int_array(t, "FP8 calibration tables") for t in (self.scale_log2, self.b_narrow, self.b_wide,
                                                               self.capacity))
        self.validate()
        self.scale_log2 = self.scale_log2.astype(np.int8)
        self.b_narrow = self.b_narrow.astype(np.uint8)
        self.b_wide = self.b_wide.astype(np.uint8)

    @property
    def modes(self) -> ModeSet:
        return MODE_SETS[self.format]

    @property
    def base_table(self) -> np.ndarray:
        return self.b_narrow

    def validate(self) -> None:
        """FORMAT-FP8.md section 5: the rules a calibration satisfies before any stream is read with it."""
        ms = self.modes
        bn, bw, cap, sc = self.b_narrow, self.b_wide, self.capacity, self.scale_log2
        if bn.ndim != 4 or bn.shape[0] != 2:
            raise CalibrationError(f"b_narrow must be [2, layers, kv_heads, head_dim], got {list(bn.shape)}")
        if bw.shape != bn.shape:
            raise CalibrationError(f"b_wide shape {list(bw.shape)} differs from b_narrow shape {list(bn.shape)}")
        if cap.shape != (2, bn.shape[1]):
            raise CalibrationError(f"capacity must be [2, {bn.shape[1]}], got {list(cap.shape)}")
        if sc.shape != bn.shape[:3]:
            raise CalibrationError(f"scale_log2 must be {list(bn.shape[:3])}, got {list(sc.shape)}")
        if bn.shape[3] not in L.SUPPORTED_HEAD_DIMS:
            raise CalibrationError(f"head_dim {bn.shape[3]} is not one of {L.SUPPORTED_HEAD_DIMS}")
        if bn.size and (bn.min() < 0 or bn.max() > ms.narrow_base_max):
            raise CalibrationError(f"{self.format}: narrow bases must lie in 0..{ms.narrow_base_max}")
        if bw.size and (bw.min() < 0 or bw.max() > ms.wide_base_max):
            raise CalibrationError(f"{self.format}: wide bases must lie in 0..{ms.wide_base_max}")
        if sc.size and (sc.min() < SCALE_LOG2_RANGE[0] or sc.max() > SCALE_LOG2_RANGE[1]):
            raise CalibrationError(f"scale exponents must lie in {SCALE_LOG2_RANGE[0]}..{SCALE_LOG2_RANGE[1]}")
        check_capacities(cap)

    def bases(self, layer: int, kind: int, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(b_narrow, b_wide)`` of one layer and kind, each ``[kv_heads, head_dim]`` (GAAC-FP8 has epoch 0 only)."""
        self.check_epoch(layer, kind, epoch)
        return self.b_narrow[kind, layer], self.b_wide[kind, layer]

    # -- identity ------------------------------------------------------------
    def canonical_bytes(self) -> bytes:
        """FORMAT-FP8.md 5.2: the bytes whose CRC-32 is the calibration id."""
        head = b"GAACF8C" + bytes([FP8_FORMAT_VERSION, self.element])
        dims = np.array([self.layers, self.kv_heads, self.head_dim], dtype="<u4").tobytes()
        return (head + dims + self.scale_log2.astype(np.int8).tobytes() + self.b_narrow.tobytes()
                + self.b_wide.tobytes() + self.capacity.astype("<u2").tobytes())

    @property
    def id(self) -> int:
        return zlib.crc32(self.canonical_bytes())

    # -- files ---------------------------------------------------------------
    def to_dict(self) -> dict:
        def kind(i):
            return {"scale_log2": self.scale_log2[i].tolist(), "b_narrow": self.b_narrow[i].tolist(),
                    "b_wide": self.b_wide[i].tolist(), "capacity": self.capacity[i].tolist()}
        return {"format": FP8_CALIBRATION_FORMAT, "version": FP8_FORMAT_VERSION, "element_format": self.format,
                "model": self.model, "layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "id": f"{self.id:08x}", "k": kind(0), "v": kind(1), "notes": self.notes}

    @classmethod
    def from_dict(cls, d: dict) -> "FP8Calibration":
        if not isinstance(d, dict) or d.get("format") != FP8_CALIBRATION_FORMAT:
            raise CalibrationError(f"not a GAAC-FP8 calibration (expected \"format\": \"{FP8_CALIBRATION_FORMAT}\")")
        if d.get("version") != FP8_FORMAT_VERSION or type(d.get("version")) is not int:
            raise CalibrationError(f"FP8 calibration version {d.get('version')} is not supported "
                                   f"(this gaac reads version {FP8_FORMAT_VERSION})")
        for kind in ("k", "v"):
            for name in ("scale_log2", "b_narrow", "b_wide", "capacity"):
                table = d[kind].get(name) if isinstance(d.get(kind), dict) else None
                if table is None or not _all_ints(table):
                    raise CalibrationError(f"malformed FP8 calibration: {kind}.{name} is missing or holds a value "
                                           "that is not an integer")
        try:
            cal = cls(format=d["element_format"],
                      scale_log2=[d["k"]["scale_log2"], d["v"]["scale_log2"]],
                      b_narrow=[d["k"]["b_narrow"], d["v"]["b_narrow"]], b_wide=[d["k"]["b_wide"], d["v"]["b_wide"]],
                      capacity=[d["k"]["capacity"], d["v"]["capacity"]], model=d.get("model"),
                      notes=file_notes(d))
        except CalibrationError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CalibrationError(f"malformed FP8 calibration: {exc!r}") from exc
        cal.check_header(d)
        return cal


def calibrate_fp8(k, v, fmt: str, *, scale: str = "tensor", model: str | None = None,
                  capacity: int | None = None) -> FP8Calibration:
    """Calibrate a GAAC-FP8 cache of format ``fmt`` on BF16 sample caches ``k``, ``v``.

    ``scale`` is the scale policy of :func:`gaac.fp8.convert.cache_scales`
    (``'tensor'``: one power of two per layer and kind; ``'head'``: per KV head;
    ``'one'``: no scaling).  ``capacity`` forces one escape capacity everywhere.
    """
    ks, vs = sample_caches(k, v)
    if min(ks.shape[2], vs.shape[2]) < L.BLOCK_TOKENS and capacity is None:
        raise CalibrationError(f"calibration needs at least one full block of {L.BLOCK_TOKENS} tokens "
                               f"to choose a slot capacity; got {ks.shape[2]} (k) / {vs.shape[2]} (v)")
    try:
        modes = MODE_SETS[fp8_format(fmt).name]
    except ValueError as exc:
        raise CalibrationError(str(exc)) from None
    scales, parts = [], []
    for x in (ks, vs):
        s = cache_scales(x, modes.fmt, scale)
        scales.append(s)
        parts.append(fit_windows(cache_to_fp8(x, modes.fmt, s), modes, capacity))
    return FP8Calibration(format=modes.fmt.name, scale_log2=scales,
                          b_narrow=[p.b_narrow for p in parts], b_wide=[p.b_wide for p in parts],
                          capacity=[p.capacity for p in parts], model=model,
                          notes={"scale": scale, "tokens": {"k": int(ks.shape[2]), "v": int(vs.shape[2])}})
