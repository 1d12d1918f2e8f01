"""The arrays a paged GAAC cache holds for one layer: the contract between the cache and attention.

``gaac.PagedKVCache`` (gaac/cache/paged.py) fills these; ``gaac.decode_attention``
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
* ``b3[kind]``, ``b4[kind]`` uint8 ``[kv_heads, head_dim]`` -- the layer's calibrated bases; or, when
  the cache keeps calibration epochs (FORMAT.md 3.5, :mod:`gaac.epochs`), ``[n_epochs, kv_heads, head_dim]``
  -- row ``e`` the bases of epoch ``e``, row 0 the calibration's own;
* ``epoch[kind]`` int16 ``[batch, max_blocks]`` or ``None`` (the whole field may be ``None``) -- the epoch
  each finalized block was encoded with: block ``j`` of sequence ``i`` is decoded with
  ``b3[kind][epoch[kind][i, j]]``.  ``None`` means every block is epoch 0, and then 2-D bases are the
  bases of every block.  Along a sequence the epochs never decrease (blocks are finalized in token order
  and epochs are only appended), so a kernel walking a range of blocks reloads its bases only where the
  epoch changes.

Shared by both kinds:

* ``tail_k``, ``tail_v`` int16 ``[batch, kv_heads, 16, head_dim]`` -- each sequence's unfinished block;
* ``seq_lens`` int32 ``[batch]`` -- tokens of each sequence: ``16 * full_blocks + tail tokens``.
  Sequence ``i`` has ``seq_lens[i] // 16`` finalized blocks in ``table[kind][i]`` and
  ``seq_lens[i] % 16`` valid tail tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import layout as L
from ..errors import InputError


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
    epoch: tuple[Any, Any] | None = None     # (K, V) block epochs; None: every block is epoch 0

    def bases(self, kind: int, epoch: int = 0) -> tuple[Any, Any]:
        """``(b3, b4)`` ``[kv_heads, head_dim]`` of epoch ``epoch`` of ``kind``, whichever form the view holds."""
        b3, b4 = self.b3[kind], self.b4[kind]
        if b3.ndim == 2:
            if epoch != 0:
                raise InputError(f"the view holds only epoch 0's bases for {L.KIND_NAMES[kind]}, not epoch {epoch}")
            return b3, b4
        if not 0 <= epoch < b3.shape[0]:
            raise InputError(f"epoch {epoch} of {L.KIND_NAMES[kind]} is not in the view's {b3.shape[0]} epochs")
        return b3[epoch], b4[epoch]

    def map_arrays(self, fn) -> "LayerView":
        """The same view with ``fn`` applied to every array it holds (to move or convert them)."""
        pair = lambda xs: tuple(None if x is None else fn(x) for x in xs)  # noqa: E731
        return LayerView(slots=pair(self.slots), raw=pair(self.raw), table=pair(self.table), b3=pair(self.b3),
                         b4=pair(self.b4), capacity=self.capacity, tail_k=fn(self.tail_k), tail_v=fn(self.tail_v),
                         seq_lens=fn(self.seq_lens), kv_heads=self.kv_heads, head_dim=self.head_dim,
                         epoch=None if self.epoch is None else pair(self.epoch))

    @property
    def channels(self) -> int:
        return L.tile_channels(self.head_dim)

    @property
    def tiles_per_head(self) -> int:
        return L.tiles_per_head(self.head_dim)
