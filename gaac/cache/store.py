"""One layer and kind's storage in a paged cache: the records :meth:`gaac.cache.paged.PagedKVCache.stores` hands
out, which the cache's update transaction (:mod:`gaac.cache.update`) and its side of a transfer
(:mod:`gaac.cache.transfer`) write.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import layout as L
from ..epochs import Adapter
from ..tiles import tile_bases
from .pools import Pool

KINDS = (L.KIND_K, L.KIND_V)


@dataclass
class _Kind:
    """One layer's storage for K or for V."""

    capacity: int
    slots: Pool                  # this layer and kind's slots
    raw: Pool                    # its share of the cache's raw-tile arena (gaac.cache.pools.RawArena)
    table: torch.Tensor          # int32 [max_seqs, max_blocks, tiles_per_block]
    tail: torch.Tensor           # int16 [max_seqs, kv_heads, 16, head_dim]
    b3: torch.Tensor             # uint8 [n_epochs, kv_heads, head_dim] on the device (for attention)
    b4: torch.Tensor
    tb3: torch.Tensor            # uint8 per-tile bases of one block [n_epochs, tiles_per_block, C] (for the codec)
    tb4: torch.Tensor
    epochs: np.ndarray           # int16 [max_seqs, max_blocks]: each finalized block's epoch (host: the logic's)
    epoch: torch.Tensor | None   # the same on the device (LayerView.epoch); None without adaptation
    adapter: Adapter | None      # None without adaptation
    heads: torch.Tensor | None = None    # int32 [2]: the device free lists' taken counts (CUDA codec)
    deferred: list = field(default_factory=list)    # finalized blocks on their way to the adapter (GPU)
    published: int = 0           # the epoch decode appends encode finished blocks with (PagedKVCache._publish)
    current: torch.Tensor | None = None             # its bases, packed for the CUDA encoder (current_bases)
    encoders: dict = field(default_factory=dict)    # (epoch, pools) -> the CUDA codec's EncodePlan
    packed: dict = field(default_factory=dict)      # epoch -> its per-tile bases packed for the CUDA codec (device)

    def add_epoch(self, b3: np.ndarray, b4: np.ndarray) -> None:
        """Append one epoch's bases ``[kv_heads, head_dim]`` to the device tables."""
        self.add_epochs([(b3, b4)])

    def add_epochs(self, tables: list) -> None:
        """Append epochs ``tables`` ((b3, b4) ``[kv_heads, head_dim]`` each, in order) to the device tables with
        one concatenation per table: appending them one by one would copy each table once per epoch."""
        tiles = [tile_bases(b3, b4) for b3, b4 in tables]
        for name, new in (("b3", [t[0] for t in tables]), ("b4", [t[1] for t in tables]),
                          ("tb3", [t[0] for t in tiles]), ("tb4", [t[1] for t in tiles])):
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, torch.from_numpy(np.stack(new).astype(np.uint8)).to(old.device)]))

    def give_back(self, entries: np.ndarray) -> None:
        """Return the records that table ``entries`` (uint32 words as int64) point at: slots to the slot pool,
        raw tiles (entries with the raw flag, bit 31) to this kind's share of the arena."""
        is_raw = (entries & L.TABLE_RAW_FLAG) != 0
        self.slots.give(entries[~is_raw])
        self.raw.give(entries[is_raw] & L.TABLE_INDEX_MASK)

    def pools_key(self) -> tuple:
        """What an EncodePlan bakes in: the versions of the pools' arrays and free lists."""
        return self.slots.version, self.raw.version
