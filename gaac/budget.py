"""How many tokens a :class:`gaac.PagedKVCache` holds in how many bytes: the sizing of its pools.

A cache is sized for a number of blocks (16 tokens of one sequence, every layer, K and V), its
*expected capacity*.  Each layer and kind gets one slot per tile of that capacity, so a layer whose
tiles all fit their slots never runs short; tiles whose escapes overflow their slot (FORMAT.md 6.4)
go to one raw-tile arena that every layer and kind shares (:class:`gaac.cache.pools.RawArena`), sized for
``raw_share`` of the capacity's tiles:

    raw_share = max(RAW_SHARE, RAW_MARGIN * the rate the calibration measured on its own text)

On real content with a calibration from the first 1024 tokens of the text (or from other text) and
adaptation on, about one tile in a hundred overflows overall, more in single layers and as a context
drifts, which one shared arena absorbs (benchmarks/results/memory-smollm2.md); ``RAW_SHARE`` leaves a
margin of several times that.  Without adaptation K's drift can send half of a layer's tiles to the
arena: a cache with ``adapt=False`` on long contexts wants ``raw_tiles`` (or ``grow=True``) set for it.
The calibration's own rate (``notes["raw_rate"]``, written by :func:`gaac.calibrate`) only raises the
share.  The *guaranteed capacity* is what the cache holds if every tile overflows: the arena's records
alone.

A budget in bytes (or a fraction of the device's free memory) gives the expected capacity that
fits it: pools, the arena, block tables, epoch indices and tails counted as :class:`MemoryReport`'s
``allocated_bytes`` counts them.  Epochs the adaptation appends later add their bases tables (a few
KiB each) on top.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from . import layout as L
from .errors import InputError

RAW_SHARE = 0.04      # the arena's records per tile of the expected capacity, at least
RAW_MARGIN = 2.0      # times the raw-tile rate the calibration measured on its own text


@dataclass(frozen=True)
class Capacity:
    """Tokens a cache holds, summed over its sequences: ``expected`` with content that overflows no more
    tiles than the arena is sized for, ``guaranteed`` even if every tile overflows."""

    expected: int
    guaranteed: int

    def __str__(self) -> str:
        return f"{self.expected} tokens expected, {self.guaranteed} guaranteed (every tile raw)"


def raw_share(calibration) -> float:
    """The arena's records per tile of expected capacity for ``calibration`` (module docstring)."""
    rate = calibration.notes.get("raw_rate") if isinstance(calibration.notes, dict) else None
    measured = rate if isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate <= 1 else 0.0
    return min(1.0, max(RAW_SHARE, RAW_MARGIN * measured))


@dataclass(frozen=True)
class Sizing:
    """What a cache allocates: ``blocks`` of expected capacity (slots: ``blocks * tiles_per_block`` per
    layer and kind), ``raw_tiles`` in the arena, block tables of ``max_seqs`` x ``max_blocks``."""

    blocks: int
    raw_tiles: int
    max_seqs: int
    max_blocks: int


def block_bytes(calibration, share: float) -> float:
    """Pool bytes of one block of expected capacity: every layer and kind's slots, and its share of the arena."""
    geo = L.geometry(calibration.head_dim)
    per = calibration.kv_heads * L.tiles_per_head(calibration.head_dim)
    slots = sum(per * geo.slot_bytes(int(c)) for c in calibration.capacity.reshape(-1))
    return slots + share * per * calibration.capacity.size * geo.raw_bytes


def row_block_bytes(calibration, adapt: bool) -> int:
    """Block-table bytes of one (sequence row, block): a table entry per tile and, with ``adapt``, the
    block's epoch index, in every layer and kind."""
    per = calibration.kv_heads * L.tiles_per_head(calibration.head_dim)
    return calibration.capacity.size * (per * L.TABLE_ENTRY_BYTES + (2 if adapt else 0))


def row_bytes(calibration) -> int:
    """Tail bytes of one sequence row: 16 BF16 tokens of every layer and kind."""
    return calibration.capacity.size * calibration.kv_heads * L.BLOCK_TOKENS * calibration.head_dim * 2


def budget_bytes(budget, device: torch.device) -> int:
    """``budget`` in bytes: an int is bytes, a float in (0, 1] a fraction of the device's free memory."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise InputError(f"budget: bytes (an int) or a fraction of the device's free memory (a float in (0, 1]), "
                         f"got {budget!r}")
    if isinstance(budget, int):
        if budget < 1:
            raise InputError(f"budget: {budget} bytes; give a positive number of bytes")
        return budget
    if not 0 < budget <= 1:
        raise InputError(f"budget: a float is a fraction of the device's free memory, in (0, 1]; got {budget!r}")
    return int(budget * free_memory(device))


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: the GPU's free memory, or the host's available memory for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def size_cache(calibration, *, budget, max_seqs: int, max_blocks: int | None, adapt: bool, device) -> Sizing:
    """The pools of a cache: for ``budget`` bytes when given, else for ``max_seqs * max_blocks`` blocks (the
    tokens the table sizes promise).  With a budget and no ``max_blocks``, one sequence may use the whole
    capacity (its table row spans it)."""
    share = raw_share(calibration)
    per_tiles = calibration.kv_heads * L.tiles_per_head(calibration.head_dim) * calibration.capacity.size
    if budget is None:
        max_blocks = 64 if max_blocks is None else max_blocks
        blocks = max_seqs * max_blocks
        return Sizing(blocks=blocks, raw_tiles=math.ceil(share * blocks * per_tiles), max_seqs=max_seqs,
                      max_blocks=max_blocks)
    total = budget_bytes(budget, torch.device(device))
    room = total - max_seqs * row_bytes(calibration)
    pool, table = block_bytes(calibration, share), row_block_bytes(calibration, adapt)
    fixed = max_blocks is not None
    blocks = math.floor((room - max_seqs * max_blocks * table) / pool if fixed else room / (pool + max_seqs * table))
    sizing = None
    while blocks >= 1:          # the arena's whole records can round up past the budget: one block less then
        sizing = Sizing(blocks=blocks, raw_tiles=math.ceil(share * blocks * per_tiles), max_seqs=max_seqs,
                        max_blocks=max_blocks if fixed else blocks)
        if allocated_bytes(calibration, sizing, adapt) <= total:
            return sizing
        blocks -= 1
    raise InputError(f"budget: {total} bytes do not hold one block of {L.BLOCK_TOKENS} tokens for "
                     f"{max_seqs} sequence(s) (a block takes {pool + max_seqs * table:.0f} bytes, each "
                     f"sequence's tails {row_bytes(calibration)}); give a larger budget or fewer max_seqs")


def allocated_bytes(calibration, sizing: Sizing, adapt: bool) -> int:
    """What a cache of ``sizing`` allocates, as :class:`gaac.cache.MemoryReport` counts ``allocated_bytes``
    before any epoch is appended."""
    geo = L.geometry(calibration.head_dim)
    per = calibration.kv_heads * L.tiles_per_head(calibration.head_dim)
    slots = sum(sizing.blocks * per * geo.slot_bytes(int(c)) for c in calibration.capacity.reshape(-1))
    rows = sizing.max_seqs * (row_bytes(calibration) + sizing.max_blocks * row_block_bytes(calibration, adapt))
    return slots + max(sizing.raw_tiles, 1) * geo.raw_bytes + rows
