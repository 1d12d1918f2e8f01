"""What a calibration makes of a cache: sizes, mode mix, entropy, and a bit-exact round trip.

:func:`measure` codes a cache the way the paged cache holds it: every complete
16-token block of every layer is cut into tiles, encoded with the layer's
bases and escape capacity, decoded again and compared bit for bit.  Two ratios
answer two questions:

* ``ratio_stream``   = BF16 bytes / payload bytes, where a tile's payload is its
  sign+mantissa bytes, 3-bit codes, mode tags and the escape bytes its groups
  need -- no slot rounding, no fallback.  It is what the format itself achieves
  and what the paper reports (1.402-1.406 across tasks; 16/11.25 = 1.422 if
  every group were 3-bit).  It ignores the capacity, so a tile that overflows
  its slot still counts its escapes here (``EncodedBlock.payload_bytes``, by
  contrast, counts such a tile at its raw BF16 size).
* ``ratio_resident`` = BF16 bytes / the bytes the paged cache really holds:
  a slot of ``fixed + capacity`` bytes for every tile that fits, a raw BF16
  tile for every tile that does not, and a 4-byte block-table entry per tile.

The last ``tokens % 16`` tokens of a sequence form no block: the cache keeps
them in its BF16 tail buffer until the block fills.  They are reported as
``tail_tokens`` and left out of every other number (ratios, fractions,
entropy), so the numbers describe the codec and do not drift with the prompt
length; ``ratios_include_tail`` says so in the output.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import layout as L
from .arrays import as_bits
from .calibration import Calibration
from .errors import InputError
from .progress import progress
from .reference.codec import decode_tiles, encode_tiles
from .tiles import block_tiles, cache_blocks, tile_bases

BITS_PER_BYTE = 8


@dataclass
class Tally:
    """Additive counts over the complete blocks of one or more layers of one kind."""

    head_dim: int
    tiles: int = 0
    slot_tiles: int = 0                  # tiles whose escapes fit the capacity
    slot_capacity_bytes: int = 0         # sum of the capacity over slot tiles
    escapes_needed: int = 0              # escape bytes of every tile (stream sense)
    escapes_in_slots: int = 0            # escape bytes of slot tiles
    modes: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))
    exponents: np.ndarray = field(default_factory=lambda: np.zeros(256, dtype=np.int64))
    mismatched: int = 0                  # elements whose decoded bits differ

    def __add__(self, other: "Tally") -> "Tally":
        return Tally(self.head_dim, self.tiles + other.tiles, self.slot_tiles + other.slot_tiles,
                     self.slot_capacity_bytes + other.slot_capacity_bytes,
                     self.escapes_needed + other.escapes_needed, self.escapes_in_slots + other.escapes_in_slots,
                     self.modes + other.modes, self.exponents + other.exponents,
                     self.mismatched + other.mismatched)

    @property
    def geometry(self) -> L.TileGeometry:
        return L.geometry(self.head_dim)

    @property
    def elements(self) -> int:
        return self.tiles * self.geometry.elements

    def resident_parts(self) -> dict[str, int]:
        """Resident bytes by what they hold (cf. the paper's Table 9); they add up to the resident size."""
        g = self.geometry
        raw_tiles = self.tiles - self.slot_tiles
        return {
            "sign_mantissa": self.tiles * g.sm_bytes,
            "codes": self.tiles * g.code_bytes,
            "tags": self.tiles * g.tag_bytes,
            "escapes": self.escapes_in_slots,
            "unused_slot": self.slot_capacity_bytes - self.escapes_in_slots,
            "raw_fallback": raw_tiles * (g.raw_bytes - g.fixed_bytes),   # a raw tile beyond a fixed part
            "table": self.tiles * L.TABLE_ENTRY_BYTES,
        }

    def summary(self) -> dict:
        """The reported numbers (module docstring)."""
        g = self.geometry
        bf16 = self.tiles * g.raw_bytes
        stream = self.tiles * g.fixed_bytes + self.escapes_needed
        parts = self.resident_parts()
        resident = sum(parts.values())
        groups = int(self.modes.sum())
        p = self.exponents[self.exponents > 0] / self.exponents.sum()
        return {
            "ratio_stream": bf16 / stream,
            "ratio_resident": bf16 / resident,
            "bits_per_element_stream": BITS_PER_BYTE * stream / self.elements,
            "bits_per_element_resident": BITS_PER_BYTE * resident / self.elements,
            "frac_3bit": int(self.modes[L.MODE_3BIT]) / groups,
            "frac_4bit": int(self.modes[L.MODE_4BIT]) / groups,
            "frac_raw": int(self.modes[L.MODE_RAW]) / groups,
            "frac_raw_tiles": (self.tiles - self.slot_tiles) / self.tiles,
            "exponent_entropy": float(-(p * np.log2(p)).sum()),
            "roundtrip": self.mismatched == 0,
            "resident_bits_per_element": {k: BITS_PER_BYTE * v / self.elements for k, v in parts.items()},
            "tiles": self.tiles,
            "raw_tiles": self.tiles - self.slot_tiles,
        }


def measure_layer(x: np.ndarray, b3: np.ndarray, b4: np.ndarray, capacity: int) -> Tally:
    """Encode, decode and count one layer ``[kv_heads, tokens, head_dim]`` with bases ``[kv_heads, head_dim]``."""
    blocks = cache_blocks(x)
    tiles = block_tiles(blocks)                                         # [blocks * tiles_per_block, 16, C]
    t3, t4 = (np.tile(t, (blocks.shape[0], 1)) for t in tile_bases(b3, b4))
    enc = encode_tiles(tiles, t3, t4, capacity)
    fits = enc.fits

    stored_raw = enc.raw[~fits].view("<u2").reshape(-1, *tiles.shape[1:])
    mismatched = int((stored_raw != tiles[~fits]).sum())
    if fits.any():       # decode_tiles wants at least one slot
        decoded = decode_tiles(enc.slots[fits], t3[fits], t4[fits], capacity, tiles.shape[2])
        mismatched += int((decoded != tiles[fits]).sum())

    return Tally(
        head_dim=x.shape[-1], tiles=len(fits), slot_tiles=int(fits.sum()),
        slot_capacity_bytes=int(fits.sum()) * capacity,
        escapes_needed=int(enc.escape_used.sum()), escapes_in_slots=int(enc.escape_used[fits].sum()),
        modes=np.bincount(enc.modes.ravel(), minlength=3)[:3].astype(np.int64),
        exponents=np.bincount(((tiles >> 7) & 0xFF).ravel(), minlength=256).astype(np.int64),
        mismatched=mismatched)


@dataclass
class KindStats:
    """Per-layer tallies of one kind (K or V) of a cache."""

    name: str
    tokens: int
    layers: list[Tally]
    capacity: list[int]
    layer_ids: list[int]

    @property
    def total(self) -> Tally:
        total = self.layers[0]
        for t in self.layers[1:]:
            total = total + t
        return total

    def summary(self) -> dict:
        return {**self.total.summary(), "capacity": self.capacity, "layers": len(self.layers),
                "tokens": self.tokens, "blocks": self.tokens // L.BLOCK_TOKENS,
                "tail_tokens": self.tokens % L.BLOCK_TOKENS, "ratios_include_tail": False}

    def per_layer(self) -> list[dict]:
        return [{"layer": i, "capacity": c, **t.summary()}
                for i, c, t in zip(self.layer_ids, self.capacity, self.layers)]


@dataclass
class CacheStats:
    k: KindStats
    v: KindStats

    def as_dict(self, per_layer: bool = False) -> dict:
        """``{"k": {...}, "v": {...}}``, plus ``"per_layer": {"k": [...], "v": [...]}`` when asked."""
        out = {"k": self.k.summary(), "v": self.v.summary()}
        if per_layer:
            out["per_layer"] = {"k": self.k.per_layer(), "v": self.v.per_layer()}
        return out


def measure(k, v, calibration: Calibration, *, layer_ids=None, show_progress: bool | None = None) -> CacheStats:
    """Measure caches ``k``, ``v`` ``[layers, kv_heads, tokens, head_dim]`` coded with ``calibration``.

    ``layer_ids`` names the layers in the per-layer view (default ``0..layers-1``),
    e.g. the model's layer numbers when the cache is a slice of its layers.
    """
    out = {}
    for kind, name, x in ((L.KIND_K, "k", k), (L.KIND_V, "v", v)):
        bits = as_bits(x, name, ndim=4)
        layers, heads, tokens, dim = bits.shape
        if dim not in L.SUPPORTED_HEAD_DIMS:
            raise InputError(f"{name}: head_dim {dim} is not supported; GAAC v1 supports {L.SUPPORTED_HEAD_DIMS}")
        if tokens < L.BLOCK_TOKENS:
            raise InputError(f"{name}: {tokens} tokens make no complete block of {L.BLOCK_TOKENS}; "
                             "there is nothing to measure")
        calibration.check_shape(layers, heads, dim)
        ids = list(range(layers)) if layer_ids is None else [int(i) for i in layer_ids]
        if len(ids) != layers:
            raise InputError(f"{len(ids)} layer ids given for {layers} layers")
        tallies = []
        for layer in progress(range(layers), desc=f"stats {name}", unit="layer", enable=show_progress):
            b3, b4 = calibration.bases(layer, kind)
            tallies.append(measure_layer(bits[layer], b3, b4, int(calibration.capacity[kind, layer])))
        out[name] = KindStats(name, tokens, tallies, [int(c) for c in calibration.capacity[kind]], ids)
    return CacheStats(**out)
