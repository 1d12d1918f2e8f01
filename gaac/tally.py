"""The tallies ``gaac stats`` reports, for any element format: what coding a layer's tiles gives
(:func:`measure_layer`, :class:`TileTally`) and their sums per kind and cache (:class:`KindStats`,
:class:`CacheStats`).  :mod:`gaac.stats` measures a BF16 cache's lifecycle with them, :mod:`gaac.fp8.stats`
an FP8 cache's.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from . import layout as L
from .arrays import as_bits
from .calibration import Calibration
from .errors import InputError
from .reference.bits import element_dtype
from .reference.codec import decode_tiles, encode_tiles, tile_exponents
from .tiles import block_tiles, cache_blocks, tile_bases

BITS_PER_BYTE = 8


@dataclass
class TileTally:
    """Additive counts over the complete blocks of one or more layers of one kind, for any element format.

    The mode set gives the tile geometry and the names of the three coded modes; :class:`Tally` (BF16)
    and :class:`gaac.fp8.stats.FP8Tally` add what they report besides.  Every count adds, so the tally
    of a model is the sum of its layers' tallies.
    """

    head_dim: int
    mode_set: L.ModeSet = L.BF16_MODES
    tiles: int = 0
    slot_tiles: int = 0                  # tiles whose escapes fit the capacity
    slot_capacity_bytes: int = 0         # sum of the capacity over slot tiles
    escapes_needed: int = 0              # escape bytes of every tile (stream sense)
    escapes_in_slots: int = 0            # escape bytes of slot tiles
    modes: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))   # groups per mode tag
    exponents: np.ndarray = field(default_factory=lambda: np.zeros(256, dtype=np.int64))
    mismatched: int = 0                  # elements whose decoded bits differ

    SHARED = ("head_dim", "mode_set")    # fields that are the same in every summand, not added

    def __add__(self, other):
        return type(self)(**{f.name: getattr(self, f.name) if f.name in self.SHARED
                             else getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def geometry(self) -> L.TileGeometry:
        return self.mode_set.geometry(self.head_dim)

    @property
    def mode_names(self) -> tuple[str, str, str]:
        """Names of the mode tags 0, 1, 2 in the reported ``frac_*`` keys."""
        names = self.mode_set.mode_names
        return tuple(names[m] for m in (L.MODE_NARROW, L.MODE_WIDE, L.MODE_RAW))

    @property
    def elements(self) -> int:
        return self.tiles * self.geometry.elements

    def resident_parts(self) -> dict[str, int]:
        """Resident bytes by what they hold (cf. the paper's Table 9); they add up to the resident size."""
        g = self.geometry
        return {
            "sign_mantissa": self.tiles * g.sm_bytes,
            "codes": self.tiles * g.code_bytes,
            "tags": self.tiles * g.tag_bytes,
            "escapes": self.escapes_in_slots,
            "unused_slot": self.slot_capacity_bytes - self.escapes_in_slots,
            "raw_fallback": (self.tiles - self.slot_tiles) * (g.raw_bytes - g.fixed_bytes),   # beyond a fixed part
            "table": self.tiles * L.TABLE_ENTRY_BYTES,
        }

    def sizes(self) -> tuple[int, int, int]:
        """(uncompressed, stream, resident) bytes of the tiles."""
        g = self.geometry
        return self.tiles * g.raw_bytes, self.tiles * g.fixed_bytes + self.escapes_needed, \
            sum(self.resident_parts().values())

    def summary(self) -> dict:
        """The reported numbers (module docstring)."""
        raw, stream, resident = self.sizes()
        parts = self.resident_parts()
        groups = int(self.modes.sum())
        p = self.exponents[self.exponents > 0] / self.exponents.sum()
        return {
            "ratio_stream": raw / stream,
            "ratio_resident": raw / resident,
            "bits_per_element_stream": BITS_PER_BYTE * stream / self.elements,
            "bits_per_element_resident": BITS_PER_BYTE * resident / self.elements,
            **{f"frac_{name}": int(self.modes[m]) / groups for m, name in enumerate(self.mode_names)},
            "frac_raw_tiles": (self.tiles - self.slot_tiles) / self.tiles,
            "exponent_entropy": float(-(p * np.log2(p)).sum()),
            "roundtrip": self.mismatched == 0,
            "resident_bits_per_element": {k: BITS_PER_BYTE * v / self.elements for k, v in parts.items()},
            "tiles": self.tiles,
            "raw_tiles": self.tiles - self.slot_tiles,
        }


@dataclass
class Tally(TileTally):
    """A BF16 :class:`TileTally`, with what calibration epochs cost the cache."""

    epoch_bytes: int = 0                 # appended epochs' bases and the per-block epoch index
    new_epochs: int = 0                  # epochs the adaptation appended

    def resident_parts(self) -> dict[str, int]:
        return {**super().resident_parts(), "epochs": self.epoch_bytes}

    def summary(self) -> dict:
        return {**super().summary(), "epochs_appended": self.new_epochs}


def measure_layer(x: np.ndarray, b_narrow: np.ndarray, b_wide: np.ndarray, capacity: int,
                  modes: L.ModeSet = L.BF16_MODES, tally: type = Tally) -> TileTally:
    """Encode, decode and count one layer ``[kv_heads, tokens, head_dim]`` of ``modes``' format.

    The bases are ``[kv_heads, head_dim]`` for every block, or ``[blocks,
    kv_heads, head_dim]``: each block's own (its epoch's).  ``tally`` is the
    :class:`TileTally` class to fill.
    """
    blocks = cache_blocks(x)
    tiles = block_tiles(blocks)                                         # [blocks * tiles_per_block, 16, C]
    if np.ndim(b_narrow) == 2:
        tn, tw = (np.tile(t, (blocks.shape[0], 1)) for t in tile_bases(b_narrow, b_wide))
    else:                # [blocks * kv_heads, head_dim] cuts into tiles in block_tiles' order
        tn, tw = tile_bases(*(np.reshape(b, (-1, x.shape[-1])) for b in (b_narrow, b_wide)))
    enc = encode_tiles(tiles, tn, tw, capacity, modes)
    fits = enc.fits

    stored_raw = enc.raw[~fits].view(element_dtype(modes.fmt).newbyteorder("<")).reshape(-1, *tiles.shape[1:])
    mismatched = int((stored_raw != tiles[~fits]).sum())
    if fits.any():
        decoded = decode_tiles(enc.slots[fits], tn[fits], tw[fits], capacity, tiles.shape[2], modes)
        mismatched += int((decoded != tiles[fits]).sum())

    return tally(
        head_dim=x.shape[-1], mode_set=modes, tiles=len(fits), slot_tiles=int(fits.sum()),
        slot_capacity_bytes=int(fits.sum()) * capacity,
        escapes_needed=int(enc.escape_used.sum()), escapes_in_slots=int(enc.escape_used[fits].sum()),
        modes=np.bincount(enc.modes.ravel(), minlength=3)[:3].astype(np.int64),
        exponents=np.bincount(tile_exponents(tiles, modes.fmt).ravel(),
                              minlength=modes.fmt.exponent_values).astype(np.int64),
        mismatched=mismatched)


@dataclass
class KindStats:
    """Per-layer and per-segment tallies of one kind (K or V) of a cache."""

    name: str
    tokens: int
    layers: list[Tally]
    capacity: list[int]
    layer_ids: list[int]
    adapt: bool = False
    segment_tokens: int | None = None
    segments: list[Tally] = field(default_factory=list)    # summed over layers, positions in token order

    @property
    def total(self) -> Tally:
        return sum_tallies(self.layers)

    def summary(self) -> dict:
        return {**self.total.summary(), "capacity": self.capacity, "layers": len(self.layers),
                "tokens": self.tokens, "blocks": self.tokens // L.BLOCK_TOKENS,
                "tail_tokens": self.tokens % L.BLOCK_TOKENS, "ratios_include_tail": False, "adapt": self.adapt}

    def per_layer(self) -> list[dict]:
        return [{"layer": i, "capacity": c, **t.summary()}
                for i, c, t in zip(self.layer_ids, self.capacity, self.layers)]

    def per_segment(self) -> list[dict]:
        """One summary per ``segment_tokens`` span of positions: ``tokens`` is ``[first, end)``."""
        span = self.segment_tokens or self.tokens
        in_blocks = self.tokens // L.BLOCK_TOKENS * L.BLOCK_TOKENS        # the tail is in no segment
        return [{"tokens": [i * span, min((i + 1) * span, in_blocks)], **t.summary()}
                for i, t in enumerate(self.segments)]


def sum_tallies(tallies: list[Tally]) -> Tally:
    total = tallies[0]
    for t in tallies[1:]:
        total = total + t
    return total


@dataclass
class CacheStats:
    k: KindStats
    v: KindStats
    calibration: Calibration | None = None      # the calibration (BF16: with the epochs the cache appended)

    def as_dict(self, per_layer: bool = False) -> dict:
        """``{"k": {...}, "v": {...}}``, plus ``"per_layer"`` when asked and ``"segments"`` when measured."""
        out = {"k": self.k.summary(), "v": self.v.summary()}
        if per_layer:
            out["per_layer"] = {"k": self.k.per_layer(), "v": self.v.per_layer()}
        if self.k.segment_tokens:
            out["segments"] = {"k": self.k.per_segment(), "v": self.v.per_segment()}
        return out


def measured_cache(x, name: str, calibration, layer_ids) -> tuple[np.ndarray, list[int]]:
    """A cache ``gaac stats`` can measure with ``calibration`` (BF16 or FP8): its bits and layer ids.

    Refuses, naming the problem, an unsupported head_dim, a cache without one complete
    block, a calibration for another shape, and layer ids that do not match the layers.
    """
    bits = as_bits(x, name, ndim=4)
    layers, heads, tokens, dim = bits.shape
    if dim not in L.SUPPORTED_HEAD_DIMS:
        raise InputError(f"{name}: head_dim {dim} is not supported; GAAC supports {L.SUPPORTED_HEAD_DIMS}")
    if tokens < L.BLOCK_TOKENS:
        raise InputError(f"{name}: {tokens} tokens make no complete block of {L.BLOCK_TOKENS}; "
                         "there is nothing to measure")
    calibration.check_shape(layers, heads, dim)
    ids = list(range(layers)) if layer_ids is None else [int(i) for i in layer_ids]
    if len(ids) != layers:
        raise InputError(f"{len(ids)} layer ids given for {layers} layers")
    return bits, ids
