"""What a paged cache's tokens occupy, against a plain BF16 cache of the same tokens
(:meth:`gaac.cache.paged.PagedKVCache.memory`).  How a cache is sized for a budget is :mod:`gaac.budget`'s."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a :class:`PagedKVCache` holds for its tokens, against a plain BF16 cache of the same tokens.

    ``resident_bytes`` counts what the tokens occupy: used slots and raw tiles,
    used block-table entries, each live sequence's 16-token BF16 tails (K and
    V of every layer) and, with calibration epochs, ``epoch_bytes``: the bases
    tables of every epoch after epoch 0 (``2 * kv_heads * head_dim`` bytes each,
    per layer and kind, held however many sequences use them) and the epoch index
    of every finalized block (``gaac.epochs.EPOCH_INDEX_BYTES`` per block, layer
    and kind) -- what adaptation costs, as ``gaac stats`` counts it.  The
    calibration's own bases are counted in neither mode.  ``allocated_bytes``
    counts every pool record, table entry, epoch index entry and tail allocated,
    used or free, and the appended epochs' tables.
    """

    tokens: int                  # tokens summed over sequences (layer 0's count)
    slot_bytes: int
    raw_bytes: int
    table_bytes: int
    tail_bytes: int
    bf16_bytes: int              # K and V of every token in every layer at 2 bytes per element
    allocated_bytes: int
    epoch_bytes: int = 0         # epochs after epoch 0 and the per-block epoch index (0 without adaptation)

    @property
    def resident_bytes(self) -> int:
        return self.slot_bytes + self.raw_bytes + self.table_bytes + self.tail_bytes + self.epoch_bytes

    @property
    def ratio(self) -> float:
        """BF16 bytes per resident byte (above 1: the cache is smaller than BF16)."""
        return self.bf16_bytes / self.resident_bytes if self.resident_bytes else float("nan")

    @property
    def allocated_ratio(self) -> float:
        """BF16 bytes per allocated byte: above 1 where the cache's whole allocation is smaller than its
        tokens in BF16; below 1 where free records (room for more tokens) outweigh the compression."""
        return self.bf16_bytes / self.allocated_bytes if self.allocated_bytes else float("nan")

    def __str__(self) -> str:
        mib = 2 ** 20
        return (f"{self.tokens} tokens: allocated {self.allocated_bytes / mib:.2f} MiB, resident "
                f"{self.resident_bytes / mib:.2f} MiB, BF16 {self.bf16_bytes / mib:.2f} MiB; BF16/resident "
                f"{self.ratio:.3f}x, BF16/allocated {self.allocated_ratio:.3f}x")
