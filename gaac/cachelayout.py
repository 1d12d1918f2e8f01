"""The arrays a paged GAAC cache holds for one layer: the contract between the cache and attention.

``gaac.PagedKVCache`` (gaac/cache.py) fills these; ``gaac.decode_attention``
(gaac/attention.py) and the CUDA kernels read them.  Arrays are torch tensors
(CUDA for the fused kernel, CPU for the reference path) or NumPy arrays on the
CPU.  BF16 data is always carried as its bits (int16), never as a float dtype,
so numba and NumPy see exactly what the format defines.

Per kind (K and V), with ``C = min(head_dim, 128)`` and ``tph = head_dim // C``:

* ``slots[kind]``  uint8 ``[n_slots, slot_bytes]`` -- compressed tiles, FORMAT.md section 6,
  ``slot_bytes = fixed_bytes(C) + capacity[kind]``;
* ``raw[kind]``    int16 ``[n_raw, 16, C]`` -- tiles kept as BF16 (slot overflow);
* ``table[kind]``  int32 ``[batch, max_blocks, kv_heads * tph]`` -- block-table entries
  (FORMAT.md 7.2: bit 31 set = raw pool index, clear = slot index), tile order of a block;
* ``b3[kind]``, ``b4[kind]`` uint8 ``[kv_heads, head_dim]`` -- the layer's calibrated bases.

Shared by both kinds:

* ``tail_k``, ``tail_v`` int16 ``[batch, kv_heads, 16, head_dim]`` -- each sequence's unfinished block;
* ``seq_lens`` int32 ``[batch]`` -- tokens of each sequence: ``16 * full_blocks + tail tokens``.
  Sequence ``i`` has ``seq_lens[i] // 16`` finalized blocks in ``table[kind][i]`` and
  ``seq_lens[i] % 16`` valid tail tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import layout as L


@dataclass
class LayerView:
    """One layer of a paged cache, as attention reads it."""

    slots: tuple[Any, Any]       # (K, V)
    raw: tuple[Any, Any]
    table: tuple[Any, Any]
    b3: tuple[Any, Any]
    b4: tuple[Any, Any]
    capacity: tuple[int, int]
    tail_k: Any
    tail_v: Any
    seq_lens: Any
    kv_heads: int
    head_dim: int

    @property
    def channels(self) -> int:
        return L.tile_channels(self.head_dim)

    @property
    def tiles_per_head(self) -> int:
        return L.tiles_per_head(self.head_dim)
