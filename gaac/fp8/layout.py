"""The GAAC-FP8 layout: the two FP8 element formats and the tile geometry built on the BF16 layout.

FORMAT-FP8.md extends FORMAT.md (BF16): groups of 8, tiles of 16 tokens x
``C = min(head_dim, 128)`` channels, 2-bit mode tags, escape bytes that are
bit planes, fixed-capacity slots and raw-tile fallback are all the BF16 format's and are
imported from :mod:`gaac.layout`.  What changes with an FP8 element is only
its split and its exponent width, and so the code widths of the modes:

* E4M3 (element byte 2): ``S EEEE MMM``, bias 7, no Inf, NaN = ``S 1111 111``;
  the sign+mantissa field is a 4-bit nibble, the exponent 4 bits.
* E5M2 (element byte 3): ``S EEEEE MM``, bias 15, Inf = ``S 11111 00``,
  NaN = ``S 11111 {01,10,11}``; sign+mantissa 3 bits, exponent 5 bits.

A :class:`ModeSet` says how wide the codes of the three modes are.  The
format fixes one per element format (:data:`MODE_SETS`, chosen by measuring
the alternatives on real caches, see ``benchmarks/results/fp8-ratios.md``);
the codec takes any valid mode set so that the benchmark measures the
alternatives with the very code that implements the chosen one.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import layout as L

# An FP8 block container (FORMAT-FP8.md 6) has version byte 2 and element-format byte 2 or 3.  Version 2 is
# also BF16's calibration-epoch version (FORMAT.md 7.1, element byte 1); the element byte tells them apart.
# FP8 has no epochs: header bytes 20..23 are version 1's reserved u32, written and checked 0 (gaac/fp8/block.py,
# read_container(epochs=False)), which version 2's layout reads as epoch 0, reserved 0.
FP8_FORMAT_VERSION = 2

# Element formats (stream header byte 5); 1 is BF16 (gaac.layout.ELEMENT_BF16).
ELEMENT_FP8_E4M3 = 2
ELEMENT_FP8_E5M2 = 3

# The mode tags keep their BF16 numbers and meaning: narrow window, wide window, raw, reserved.
MODE_NARROW = L.MODE_3BIT
MODE_WIDE = L.MODE_4BIT
MODE_RAW = L.MODE_RAW
MODE_RESERVED = L.MODE_RESERVED

TILE_WIDTHS = tuple(sorted({L.tile_channels(d) for d in L.SUPPORTED_HEAD_DIMS}))   # (64, 128)


@dataclass(frozen=True)
class FP8Format:
    """One FP8 element format: field widths, bias and special values (OCP 8-bit FP, v1.0)."""

    name: str
    element: int            # element-format byte of the stream header
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_inf: bool           # E5M2 has +-Inf; E4M3 ("fn") has none and uses S.1111.111 for NaN only

    @property
    def sm_bits(self) -> int:
        """Width of the kept sign+mantissa field: ``sign << mantissa_bits | mantissa``."""
        return 1 + self.mantissa_bits

    @property
    def exponent_values(self) -> int:
        return 1 << self.exponent_bits

    @property
    def max_exponent_field(self) -> int:
        return self.exponent_values - 1

    @property
    def min_normal_exp(self) -> int:
        """Unbiased exponent of the smallest normal (exponent field 1)."""
        return 1 - self.bias

    @property
    def max_finite_bits(self) -> int:
        """Bit pattern of the largest finite value: 0x7E (448) for E4M3, 0x7B (57344) for E5M2."""
        if self.has_inf:   # exponent field all ones is Inf/NaN
            return ((self.max_exponent_field - 1) << self.mantissa_bits) | ((1 << self.mantissa_bits) - 1)
        return (self.max_exponent_field << self.mantissa_bits) | ((1 << self.mantissa_bits) - 2)

    @property
    def max_finite(self) -> float:
        e = self.max_finite_bits >> self.mantissa_bits
        m = self.max_finite_bits & ((1 << self.mantissa_bits) - 1)
        return float((1 << self.mantissa_bits | m) * 2.0 ** (e - self.bias - self.mantissa_bits))

    @property
    def nan_bits(self) -> int:
        """The NaN a conversion writes (sign bit clear): 0x7F for E4M3, the quiet NaN 0x7E for E5M2."""
        return 0x7F if not self.has_inf else (self.max_exponent_field << self.mantissa_bits) | 0b10

    @property
    def inf_bits(self) -> int | None:
        return (self.max_exponent_field << self.mantissa_bits) if self.has_inf else None


E4M3 = FP8Format("fp8_e4m3", ELEMENT_FP8_E4M3, exponent_bits=4, mantissa_bits=3, bias=7, has_inf=False)
E5M2 = FP8Format("fp8_e5m2", ELEMENT_FP8_E5M2, exponent_bits=5, mantissa_bits=2, bias=15, has_inf=True)
FORMATS = {f.name: f for f in (E4M3, E5M2)}
FORMATS_BY_ELEMENT = {f.element: f for f in (E4M3, E5M2)}


@dataclass(frozen=True)
class ModeSet:
    """Code widths of the three modes for one element format.

    * narrow (tag 0): ``e = b_narrow + code``, ``code < 2**low_bits``; no escape byte;
    * wide   (tag 1): ``e = b_wide + code``, ``code < 2**wide_bits``; planes ``low_bits .. wide_bits-1``
      of the code in ``wide_bits - low_bits`` escape bytes;
    * raw    (tag 2): ``e = code``; planes ``low_bits .. exponent_bits-1`` in escape bytes.

    The low ``low_bits`` bits of every code sit in the common code stream.
    ``wide_bits == exponent_bits`` leaves only base 0 for the wide window, which
    makes it the raw mode: that is how "narrow + raw only" is expressed.
    """

    fmt: FP8Format
    low_bits: int
    wide_bits: int

    def __post_init__(self):
        if not 1 <= self.low_bits < self.wide_bits <= self.fmt.exponent_bits:
            raise ValueError(f"{self.fmt.name}: need 1 <= low_bits < wide_bits <= {self.fmt.exponent_bits}, "
                             f"got low_bits={self.low_bits}, wide_bits={self.wide_bits}")

    @property
    def narrow_window(self) -> int:
        return 1 << self.low_bits

    @property
    def wide_window(self) -> int:
        return 1 << self.wide_bits

    @property
    def narrow_base_max(self) -> int:
        """Largest narrow base: ``base + narrow_window - 1`` is the largest exponent field."""
        return self.fmt.exponent_values - self.narrow_window

    @property
    def wide_base_max(self) -> int:
        return self.fmt.exponent_values - self.wide_window

    @property
    def escape_bytes(self) -> dict[int, int]:
        """Escape bytes (bit planes) a group of each mode appends to the escape area."""
        return {MODE_NARROW: 0, MODE_WIDE: self.wide_bits - self.low_bits,
                MODE_RAW: self.fmt.exponent_bits - self.low_bits}

    @property
    def mode_names(self) -> dict[int, str]:
        return {MODE_NARROW: f"{self.low_bits}bit", MODE_WIDE: f"{self.wide_bits}bit", MODE_RAW: "raw"}

    @property
    def label(self) -> str:
        return f"{self.low_bits}/{self.wide_bits}/raw{self.fmt.exponent_bits}"

    def geometry(self, head_dim: int) -> "FP8TileGeometry":
        """Geometry of the tiles of a ``head_dim``-wide head (64 -> 64 channels, 128 and 256 -> 128)."""
        return FP8TileGeometry(L.tile_channels(head_dim), self)


# The mode sets of GAAC-FP8 (FORMAT-FP8.md section 3; their ratios: benchmarks/results/fp8-ratios.md).
MODE_SETS = {
    E4M3.name: ModeSet(E4M3, low_bits=2, wide_bits=3),
    E5M2.name: ModeSet(E5M2, low_bits=2, wide_bits=3),
}


def fp8_format(name: str) -> FP8Format:
    """``'fp8_e4m3'`` / ``'fp8_e5m2'`` (also ``'e4m3'``, ``'e5m2'``, any case) -> its :class:`FP8Format`."""
    key = str(name).lower()
    key = key if key.startswith("fp8_") else f"fp8_{key}"
    if key not in FORMATS:
        raise ValueError(f"unknown FP8 format {name!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[key]


def mode_set(name: str) -> ModeSet:
    """The mode set of FP8 format ``name`` (:data:`MODE_SETS`)."""
    return MODE_SETS[fp8_format(name).name]


@dataclass(frozen=True)
class FP8TileGeometry(L.TileGeometry):
    """Byte offsets of the sections of one compressed FP8 tile (FORMAT-FP8.md section 4).

    Same four sections as a BF16 tile (so the offsets, slot and capacity arithmetic
    are the same), narrower: the sign+mantissa fields and the low codes are little-endian
    bit streams of ``sm_bits`` and ``low_bits`` bits, and a raw tile is one byte
    per element.  Every section is a multiple of 16 bytes for 64- and 128-channel tiles.
    """

    modes: ModeSet

    @property
    def sm_bytes(self) -> int:
        return self.elements * self.modes.fmt.sm_bits // 8

    @property
    def code_bytes(self) -> int:
        return self.elements * self.modes.low_bits // 8

    @property
    def raw_bytes(self) -> int:
        """Bytes of the tile kept as plain FP8: one byte per element, element order."""
        return self.elements

    @property
    def max_escapes(self) -> int:
        """Escape bytes of a tile whose every group is raw."""
        return self.groups * self.modes.escape_bytes[MODE_RAW]


