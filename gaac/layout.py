"""The GAAC layout (format version 2): every constant of the bitstream, in one place.

The reference codec, the CUDA kernels, the paged cache and the tables of
``format_spec/FORMAT.md`` all derive their numbers from this module, so a
change to the format is a change here first.  Nothing in this module touches
data; it only says where bytes go.

Vocabulary (FORMAT.md, section 2):

* element  -- one BF16 value, split into a sign+mantissa byte and an 8-bit exponent;
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

# Element formats (stream header byte 5).
ELEMENT_BF16 = 1

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


@dataclass(frozen=True)
class TileGeometry:
    """Byte offsets of the sections of one compressed tile of ``channels`` channels.

    All sections start on a 16-byte boundary for 64- and 128-channel tiles, so a
    kernel can move a slot with 16-byte loads.
    """

    channels: int

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
        return self.elements

    # Section 2: the 3-bit low codes, a little-endian bit stream, element order.
    @property
    def code_offset(self) -> int:
        return self.sm_offset + self.sm_bytes

    @property
    def code_bytes(self) -> int:
        return self.elements * CODE_BITS // 8

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
        """Bytes of the tile kept as plain little-endian BF16."""
        return 2 * self.elements

    @property
    def max_useful_capacity(self) -> int:
        """Largest capacity worth having: beyond it a slot is bigger than the raw tile."""
        return max(self.raw_bytes - self.fixed_bytes, 0) // SLOT_ALIGN * SLOT_ALIGN


def tile_channels(head_dim: int) -> int:
    """Channels per tile for a head of ``head_dim`` channels (64 -> 64, 128 -> 128, 256 -> 2 x 128)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; the GAAC format supports {SUPPORTED_HEAD_DIMS}")
    return min(head_dim, TILE_MAX_CHANNELS)


def tiles_per_head(head_dim: int) -> int:
    return head_dim // tile_channels(head_dim)


def geometry(head_dim: int) -> TileGeometry:
    return TileGeometry(tile_channels(head_dim))
