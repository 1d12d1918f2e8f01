"""The GAAC layout (format version 2): every constant of the bitstream, in one place.

BF16, FP8 E4M3 and FP8 E5M2 are three instances of one :class:`ElementFormat`;
a :class:`ModeSet` gives each its code widths and :class:`TileGeometry` the
byte offsets of its tiles.  Everything else (groups, tiles, mode tags, escape
planes, slots, containers) is the same for every element format.

The reference codec, the CUDA kernels, the paged cache and the tables of
``format_spec/FORMAT.md`` all derive their numbers from this module, so a
change to the format is a change here first.  Nothing in this module touches
data; it only says where bytes go.

Vocabulary (FORMAT.md, section 2):

* element  -- one value of an element format (:class:`ElementFormat`: BF16, or FP8 E4M3 / E5M2 of
  FORMAT-FP8.md), split into a sign+mantissa field and an exponent field;
* group    -- 8 consecutive channels of one token; it shares one 2-bit mode tag;
* tile     -- 16 tokens x ``C`` channels of one KV head, ``C = min(head_dim, 128)``;
* block    -- 16 tokens of one layer's K (or V), all KV heads: ``kv_heads * head_dim / C`` tiles;
* slot     -- the fixed-capacity storage of one compressed tile;
* raw tile -- a tile kept as plain BF16 because its escapes overflow the slot.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

FORMAT_VERSION = 2         # the newest version this gaac reads and writes
READABLE_VERSIONS = (1, 2)  # a version 1 stream is a version 2 stream of epoch 0

BLOCK_TOKENS = 16          # tokens per block and per tile
GROUP_SIZE = 8             # consecutive channels of one token sharing a mode tag
TILE_MAX_CHANNELS = 128    # a 256-wide head is two 128-wide half-head tiles
SUPPORTED_HEAD_DIMS = (64, 128, 256)

CODE_BITS = 3              # the common low-code stream: 3 bits per element
TAG_BITS = 2               # one mode tag per group

# Mode tags (2 bits per group).
MODE_3BIT = 0              # exponent = b3 + code, code in 0..7
MODE_4BIT = 1              # exponent = b4 + code, code in 0..15 (bit 3 in one escape byte)
MODE_RAW = 2               # exponent stored whole: low 3 bits in the code stream, bits 3..7 in 5 escape bytes
MODE_RESERVED = 3          # a compliant decoder must reject it
MODE_NAMES = {MODE_3BIT: "3bit", MODE_4BIT: "4bit", MODE_RAW: "raw"}

# Escape bytes a group of each mode appends to the tile's escape area.
ESCAPE_BYTES = {MODE_3BIT: 0, MODE_4BIT: 1, MODE_RAW: 5}
RAW_PLANES = 5             # exponent bit planes 3..7 of a raw group

# Window widths and the largest base that keeps base + offset <= 255.
WINDOW_3BIT = 1 << CODE_BITS          # 8 exponents
WINDOW_4BIT = 1 << (CODE_BITS + 1)    # 16 exponents
B3_MAX = 256 - WINDOW_3BIT            # 248
B4_MAX = 256 - WINDOW_4BIT            # 240

SLOT_ALIGN = 16            # slot sizes (and so escape capacities) are multiples of 16 bytes
MAX_ESCAPE_CAPACITY = 65520  # fits the u16 header field and is a multiple of 16
MAX_LAYERS = 0xFFFF        # layers and KV heads fit the u16 fields of the block and sequence headers and the
MAX_KV_HEADS = 0xFFFF      # epoch bytes (FORMAT.md 3.2), though the calibration's canonical bytes hold u32

# Element formats (stream header byte 5).
ELEMENT_BF16 = 1
ELEMENT_FP8_E4M3 = 2
ELEMENT_FP8_E5M2 = 3

# An FP8 block container (FORMAT-FP8.md 6) has version byte 2 and element-format byte 2 or 3.  Version 2 is
# also BF16's calibration-epoch version (FORMAT.md 7.1, element byte 1); the element byte tells them apart.
# FP8 has no epochs: header bytes 20..23 are version 1's reserved u32, written and checked 0, which version
# 2's layout reads as epoch 0, reserved 0.
FP8_FORMAT_VERSION = 2

# K / V (stream header byte 6).
KIND_K = 0
KIND_V = 1
KIND_NAMES = {KIND_K: "k", KIND_V: "v"}

# Block-table entry: u32, bit 31 set = raw BF16 tile, bits 0..30 = index in that pool.
TABLE_ENTRY_BYTES = 4
TABLE_RAW_FLAG = 1 << 31
TABLE_INDEX_MASK = TABLE_RAW_FLAG - 1

# Block stream container (FORMAT.md section 7): header, tile table, slots, raw tiles, CRC-32.
STREAM_MAGIC = b"GAAC"
STREAM_HEADER = struct.Struct("<4sBBBBHHHHII")
# magic, version, element format, kind, tokens, layer, kv_heads, head_dim,
# escape capacity, calibration id, reserved (must be 0).  The version 1 layout, which FP8 containers
# (FORMAT-FP8.md) keep: their last u32 is reserved.
STREAM_HEADER_V2 = struct.Struct("<4sBBBBHHHHIHH")
# The version 2 layout of a BF16 container: the last u32 of version 1 split into the block's calibration
# epoch (u16) and a reserved u16 (must be 0); the u32 before it identifies the epoch's bases (FORMAT.md 3.5).
# Little-endian, so a version 1 header read with it has epoch 0 and reserved 0 exactly when its u32 is 0.
STREAM_HEADER_BYTES = STREAM_HEADER.size  # 24, both layouts
STREAM_CRC_BYTES = 4

# Sequence container (FORMAT.md section 11): one sequence of a paged cache, every layer, K and V, its blocks
# as the cache stores them.  Head: header, 2 * layers section records, epoch records, the calibration's
# canonical bytes (optional), the chunk CRC table, the head CRC, zero padding to SEQUENCE_ALIGN; then the body.
SEQUENCE_MAGIC = b"GAACSEQ"
SEQUENCE_VERSION = 2                       # the version byte: format version 2's sequence container
SEQUENCE_HEADER = struct.Struct("<7sBBBHHHIIIIQ")
# magic, version, element format, flags, layers, kv_heads, head_dim, tokens, calibration id,
# epoch records, reserved (must be 0), body bytes.
SEQUENCE_FLAG_CALIBRATION = 1              # flags bit 0: the calibration's canonical bytes follow the epoch records
SEQUENCE_SECTION = struct.Struct("<HHI")   # per (layer, kind): escape capacity, epoch records, raw tiles
SEQUENCE_EPOCH = struct.Struct("<HHI")     # epoch, reserved (must be 0), bases id; then b3 and b4, H * D bytes each
SEQUENCE_CHUNK_BYTES = 1 << 20             # the body's CRC-32s cover chunks of 1 MiB (the last may be shorter)
SEQUENCE_ALIGN = 16                        # the body, and each part of a section in it, starts on a multiple of 16
SEQUENCE_EPOCH_BYTES = 2                   # a block's epoch in the body: u16
MAX_INDEXED_EPOCHS = 1 << 15               # the most epochs of one layer and kind a paged cache holds: it names a
                                           # block's epoch in an int16 index (FORMAT.md 11.8)


@dataclass(frozen=True)
class ElementFormat:
    """One element format: field widths, bias, special values, and the block containers it is written in.

    An element of ``1 + exponent_bits + mantissa_bits`` bits is ``S E..E M..M``; the codec keeps its
    sign+mantissa field ``sign << mantissa_bits | mantissa`` and codes its exponent field.
    """

    name: str
    element: int            # element-format byte of the stream header
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_inf: bool           # E5M2 and BF16 have +-Inf; E4M3 ("fn") has none and uses S.1111.111 for NaN only
    versions: tuple         # container versions of this format, oldest first (FORMAT.md 7.1, FORMAT-FP8.md 6)
    epochs: bool            # whether its blocks name a calibration epoch (FORMAT.md 3.5)

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def element_bytes(self) -> int:
        """Bytes of one element kept as it is (a raw tile), little-endian."""
        return self.bits // 8

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
        """The NaN a conversion writes (sign bit clear): all ones without Inf (0x7F for E4M3), else the
        quiet NaN (0x7E for E5M2)."""
        if not self.has_inf:
            return (1 << (self.bits - 1)) - 1
        return (self.max_exponent_field << self.mantissa_bits) | (1 << (self.mantissa_bits - 1))

    @property
    def inf_bits(self) -> int | None:
        return (self.max_exponent_field << self.mantissa_bits) if self.has_inf else None

    def container_version(self, epoch: int) -> int:
        """The version byte of a block of ``epoch``: the oldest of the format's versions that can say it."""
        return self.versions[0] if epoch == 0 else FORMAT_VERSION


BF16 = ElementFormat("bf16", ELEMENT_BF16, exponent_bits=8, mantissa_bits=7, bias=127, has_inf=True,
                     versions=READABLE_VERSIONS, epochs=True)
E4M3 = ElementFormat("fp8_e4m3", ELEMENT_FP8_E4M3, exponent_bits=4, mantissa_bits=3, bias=7, has_inf=False,
                     versions=(FP8_FORMAT_VERSION,), epochs=False)
E5M2 = ElementFormat("fp8_e5m2", ELEMENT_FP8_E5M2, exponent_bits=5, mantissa_bits=2, bias=15, has_inf=True,
                     versions=(FP8_FORMAT_VERSION,), epochs=False)
FORMATS = {f.name: f for f in (BF16, E4M3, E5M2)}
FP8_FORMATS = {f.name: f for f in (E4M3, E5M2)}
FORMATS_BY_ELEMENT = {f.element: f for f in FORMATS.values()}

# The mode tags by what they mean in every element format: narrow window, wide window, raw.
MODE_NARROW = MODE_3BIT
MODE_WIDE = MODE_4BIT


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
    BF16's is 3/4/raw8 (:data:`CODE_BITS`); the format fixes one per element
    format (:data:`MODE_SETS`), and the codec takes any valid one so that the
    benchmarks measure the alternatives with the very code that implements it.
    """

    fmt: ElementFormat
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

    def geometry(self, head_dim: int) -> "TileGeometry":
        """Geometry of the tiles of a ``head_dim``-wide head (64 -> 64 channels, 128 and 256 -> 128)."""
        return TileGeometry(tile_channels(head_dim), self)


# The mode set of each element format (FORMAT.md 5, FORMAT-FP8.md 3; the FP8 ratios of the alternatives:
# benchmarks/results/fp8-ratios.md).
MODE_SETS = {
    BF16.name: ModeSet(BF16, low_bits=CODE_BITS, wide_bits=CODE_BITS + 1),
    E4M3.name: ModeSet(E4M3, low_bits=2, wide_bits=3),
    E5M2.name: ModeSet(E5M2, low_bits=2, wide_bits=3),
}
BF16_MODES = MODE_SETS[BF16.name]
FP8_MODE_SETS = {name: MODE_SETS[name] for name in FP8_FORMATS}


def element_format(name) -> ElementFormat:
    """``'bf16'``, ``'fp8_e4m3'`` / ``'fp8_e5m2'`` (also ``'e4m3'``, ``'e5m2'``, any case), or an
    :class:`ElementFormat` -> its :class:`ElementFormat`."""
    if isinstance(name, ElementFormat):
        return name
    key = str(name).lower()
    key = key if key in FORMATS or key.startswith("fp8_") else f"fp8_{key}"
    if key not in FORMATS:
        raise ValueError(f"unknown element format {name!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[key]


def fp8_format(name: str) -> ElementFormat:
    """``'fp8_e4m3'`` / ``'fp8_e5m2'`` (also ``'e4m3'``, ``'e5m2'``, any case) -> its :class:`ElementFormat`."""
    key = str(name).lower()
    key = key if key.startswith("fp8_") else f"fp8_{key}"
    if key not in FP8_FORMATS:
        raise ValueError(f"unknown FP8 format {name!r}; expected one of {sorted(FP8_FORMATS)}")
    return FP8_FORMATS[key]


def mode_set(name) -> ModeSet:
    """The mode set of element format ``name`` (:data:`MODE_SETS`); FP8 names as :func:`fp8_format` takes them."""
    fmt = element_format(name)
    return MODE_SETS[fmt.name]


@dataclass(frozen=True)
class TileGeometry:
    """Byte offsets of the sections of one compressed tile of ``channels`` channels of ``modes``' format.

    The four sections are the same for every element format; their sizes follow the
    widths: the sign+mantissa fields and the low codes are little-endian bit streams of
    ``sm_bits`` and ``low_bits`` bits (for BF16 the sign+mantissa fields are whole bytes),
    and a raw tile is the elements as they are.  All sections start on a 16-byte boundary
    for 64- and 128-channel tiles, so a kernel can move a slot with 16-byte loads.
    """

    channels: int
    modes: ModeSet = BF16_MODES

    @property
    def elements(self) -> int:
        return BLOCK_TOKENS * self.channels

    @property
    def groups(self) -> int:
        return self.elements // GROUP_SIZE

    @property
    def groups_per_row(self) -> int:
        return self.channels // GROUP_SIZE

    # Section 1: sign+mantissa bytes, one per element, token-major.
    @property
    def sm_offset(self) -> int:
        return 0

    @property
    def sm_bytes(self) -> int:
        return self.elements * self.modes.fmt.sm_bits // 8

    # Section 2: the low codes (3 bits for BF16), a little-endian bit stream, element order.
    @property
    def code_offset(self) -> int:
        return self.sm_offset + self.sm_bytes

    @property
    def code_bytes(self) -> int:
        return self.elements * self.modes.low_bits // 8

    # Section 3: the 2-bit mode tags, a little-endian bit stream, group order.
    @property
    def tag_offset(self) -> int:
        return self.code_offset + self.code_bytes

    @property
    def tag_bytes(self) -> int:
        return self.groups * TAG_BITS // 8

    # Section 4: the escape area, ``capacity`` bytes, filled in group order then zero.
    @property
    def escape_offset(self) -> int:
        return self.tag_offset + self.tag_bytes

    @property
    def fixed_bytes(self) -> int:
        """Bytes of a compressed tile before its escape area."""
        return self.escape_offset

    def slot_bytes(self, capacity: int) -> int:
        """Bytes of one slot with an escape capacity of ``capacity`` bytes."""
        return self.fixed_bytes + capacity

    @property
    def raw_bytes(self) -> int:
        """Bytes of the tile kept as its plain little-endian elements."""
        return self.modes.fmt.element_bytes * self.elements

    @property
    def max_escapes(self) -> int:
        """Escape bytes of a tile whose every group is raw."""
        return self.groups * self.modes.escape_bytes[MODE_RAW]

    @property
    def max_useful_capacity(self) -> int:
        """Largest capacity worth having: beyond it a slot is bigger than the raw tile."""
        return max(self.raw_bytes - self.fixed_bytes, 0) // SLOT_ALIGN * SLOT_ALIGN


def tile_channels(head_dim: int) -> int:
    """Channels per tile for a head of ``head_dim`` channels (64 -> 64, 128 -> 128, 256 -> 2 x 128)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; the GAAC format supports {SUPPORTED_HEAD_DIMS}")
    return min(head_dim, TILE_MAX_CHANNELS)


TILE_WIDTHS = tuple(sorted({tile_channels(d) for d in SUPPORTED_HEAD_DIMS}))   # (64, 128)


def tiles_per_head(head_dim: int) -> int:
    return head_dim // tile_channels(head_dim)


def geometry(head_dim: int, modes: ModeSet = BF16_MODES) -> TileGeometry:
    return TileGeometry(tile_channels(head_dim), modes)
