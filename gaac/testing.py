"""LayerViews built from dense caches, for tests and benchmarks (as ``numpy.testing`` is to NumPy).

:func:`view_from_dense` encodes dense BF16 caches with the reference codec into a compressed
:class:`~gaac.cache.view.LayerView`, :func:`plain_view` lays the same caches out as a plain BF16 paged
cache (every tile raw: the baseline kernel's input), and :func:`view_to` moves a view's arrays to a torch
device.  The serving path builds its views through ``gaac.PagedKVCache``; :func:`gaac.attention.gather_dense`
rebuilds the dense caches of any view.
"""
from __future__ import annotations

import numpy as np

from . import layout as L
from .attention import _block_tile_bases, _is_torch
from .cache.view import LayerView
from .errors import InputError
from .reference.codec import encode_tiles
from .tiles import block_tiles


def _full_block_tiles(xs, nfull) -> np.ndarray:
    """Tiles ``[n, 16, C]`` (uint16) of every complete block of every sequence, in table order."""
    kv_heads, _, d = np.asarray(xs[0]).shape
    blocks = [np.asarray(x).view(np.uint16)[:, :n * L.BLOCK_TOKENS].reshape(kv_heads, n, L.BLOCK_TOKENS, d)
              .transpose(1, 0, 2, 3) for x, n in zip(xs, nfull)]
    return block_tiles(np.concatenate(blocks, axis=0))


def _table(entry: np.ndarray, nfull: np.ndarray, max_blocks: int, per_block: int) -> np.ndarray:
    """Block table ``[B, max_blocks, per_block]`` int32 from the entries of all tiles in table order."""
    table = np.zeros((len(nfull), max_blocks, per_block), np.uint32)
    start = 0
    for b, n in enumerate(nfull):
        table[b, :n] = entry[start:start + n * per_block].reshape(n, per_block)
        start += n * per_block
    return table.view(np.int32)


def _tail(xs, lens, fill: int) -> np.ndarray:
    """The unfinished block of each sequence ``[B, Hkv, 16, D]`` int16; unused rows hold ``fill``."""
    kv_heads, _, d = np.asarray(xs[0]).shape
    tail = np.full((len(xs), kv_heads, L.BLOCK_TOKENS, d), fill, np.uint16)
    for b, x in enumerate(xs):
        start = lens[b] // L.BLOCK_TOKENS * L.BLOCK_TOKENS
        tail[b, :, :lens[b] - start] = np.asarray(x).view(np.uint16)[:, start:]
    return tail.view(np.int16)


def _shape_of(k, max_blocks):
    kv_heads, _, d = np.asarray(k[0]).shape
    lens = np.array([np.asarray(x).shape[1] for x in k], dtype=np.int32)
    nfull = lens // L.BLOCK_TOKENS
    mb = max(int(nfull.max()), 1) if max_blocks is None else max_blocks
    if mb < nfull.max():
        raise InputError(f"max_blocks {mb} < {nfull.max()} complete blocks")
    return kv_heads, d, lens, nfull, mb


def view_from_dense(k, v, b3, b4, capacity, *, max_blocks: int | None = None, rng=None,
                    tail_fill: int = 0x7FC1, epochs=None) -> LayerView:
    """Encode dense caches into a compressed :class:`LayerView` (NumPy arrays).

    ``k[b]``, ``v[b]``: BF16 bits ``[Hkv, L_b, D]`` of sequence ``b``; ``b3``/``b4``: ``(K, V)``
    pairs of ``[Hkv, D]`` bases; ``capacity``: ``(K, V)`` escape capacities.  Complete blocks are
    encoded with the reference codec (overflowing tiles go to the raw pool); the rest is the
    tail, whose unused rows hold ``tail_fill`` (a NaN by default: attention must ignore them).
    With ``rng``, physical slot and raw indices are shuffled so that the table's indirection is
    exercised.

    ``epochs``: calibration epochs (FORMAT.md 3.5), a ``(K, V)`` pair of int ``[B, max_blocks]`` arrays
    giving each complete block's epoch; ``b3``/``b4`` are then ``[E, Hkv, D]`` per kind (row ``e`` =
    epoch ``e``'s bases) and the view carries ``epoch`` as int16.
    """
    kv_heads, d, lens, nfull, mb = _shape_of(k, max_blocks)
    geo = L.geometry(d)
    per = kv_heads * L.tiles_per_head(d)
    slots, raws, tables = [], [], []
    for kind, xs in enumerate((k, v)):
        tiles = _full_block_tiles(xs, nfull)
        n = tiles.shape[0]
        tb3, tb4 = _block_tile_bases(np.asarray(b3[kind]), np.asarray(b4[kind]),
                                     None if epochs is None else np.asarray(epochs[kind]), nfull)
        enc = encode_tiles(tiles, tb3, tb4, int(capacity[kind]))
        fit, over = np.flatnonzero(enc.fits), np.flatnonzero(~enc.fits)
        slot_at = rng.permutation(len(fit)) if rng is not None else np.arange(len(fit))
        raw_at = rng.permutation(len(over)) if rng is not None else np.arange(len(over))
        slot_pool = np.zeros((max(len(fit), 1), geo.slot_bytes(int(capacity[kind]))), np.uint8)
        raw_pool = np.zeros((max(len(over), 1), L.BLOCK_TOKENS, geo.channels), np.int16)
        slot_pool[slot_at] = enc.slots[fit]
        raw_pool[raw_at] = tiles[over].view(np.int16)
        entry = np.zeros(n, np.uint32)
        entry[fit] = slot_at
        entry[over] = raw_at | L.TABLE_RAW_FLAG
        slots.append(slot_pool)
        raws.append(raw_pool)
        tables.append(_table(entry, nfull, mb, per))
    return LayerView(slots=tuple(slots), raw=tuple(raws), table=tuple(tables),
                     b3=tuple(np.asarray(x, np.uint8) for x in b3), b4=tuple(np.asarray(x, np.uint8) for x in b4),
                     capacity=(int(capacity[0]), int(capacity[1])), tail_k=_tail(k, lens, tail_fill),
                     tail_v=_tail(v, lens, tail_fill), seq_lens=lens, kv_heads=kv_heads, head_dim=d,
                     epoch=None if epochs is None else tuple(np.ascontiguousarray(e, np.int16) for e in epochs))


def plain_view(k, v, *, max_blocks: int | None = None, tail_fill: int = 0x7FC1) -> LayerView:
    """The same caches as a plain BF16 paged cache: every complete block's tiles in the raw pool.

    The ablation baseline: ``decode_attention(..., plain=True)`` runs the same kernel structure
    with the decode step compiled out.  Slot pools are empty (one zero slot of capacity 0).
    """
    kv_heads, d, lens, nfull, mb = _shape_of(k, max_blocks)
    geo = L.geometry(d)
    per = kv_heads * L.tiles_per_head(d)
    raws, tables = [], []
    for xs in (k, v):
        tiles = _full_block_tiles(xs, nfull)
        raws.append(np.ascontiguousarray(tiles.view(np.int16)) if len(tiles) else
                    np.zeros((1, L.BLOCK_TOKENS, geo.channels), np.int16))
        tables.append(_table(np.arange(len(tiles), dtype=np.uint32) | np.uint32(L.TABLE_RAW_FLAG), nfull, mb, per))
    zeros = np.zeros((kv_heads, d), np.uint8)
    empty = np.zeros((1, geo.slot_bytes(0)), np.uint8)
    return LayerView(slots=(empty, empty), raw=tuple(raws), table=tuple(tables), b3=(zeros, zeros),
                     b4=(zeros, zeros), capacity=(0, 0), tail_k=_tail(k, lens, tail_fill),
                     tail_v=_tail(v, lens, tail_fill), seq_lens=lens, kv_heads=kv_heads, head_dim=d)


def view_to(view: LayerView, device) -> LayerView:
    """The view with every array as a torch tensor on ``device`` (e.g. ``"cuda"``)."""
    import torch

    def t(x):
        x = x if _is_torch(x) else torch.from_numpy(np.ascontiguousarray(x))
        return x.to(device).contiguous()
    return view.map_arrays(t)
