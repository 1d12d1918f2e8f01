"""Cutting blocks into tiles and back (FORMAT.md section 4).

A block ``[kv_heads, 16, head_dim]`` is ``kv_heads * head_dim / C`` tiles of
``[16, C]``, head-major: tile ``h * (head_dim / C) + j`` holds channels
``j*C .. j*C + C - 1`` of head ``h``.
"""
from __future__ import annotations

import numpy as np

from . import layout as L


def block_tiles(blocks: np.ndarray) -> np.ndarray:
    """``[..., heads, 16, head_dim]`` -> ``[n_tiles, 16, C]`` in tile order (batch axes first)."""
    *batch, heads, tokens, dim = blocks.shape
    c = L.tile_channels(dim)
    per = dim // c
    x = blocks.reshape(*batch, heads, tokens, per, c)
    x = np.moveaxis(x, -2, -3)                        # [..., heads, per, tokens, C]
    return np.ascontiguousarray(x).reshape(-1, tokens, c)


def untile(tiles: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Inverse of :func:`block_tiles` for one block: ``[n_tiles, 16, C]`` -> ``[heads, 16, head_dim]``."""
    c = L.tile_channels(head_dim)
    per = head_dim // c
    x = tiles.reshape(heads, per, L.BLOCK_TOKENS, c)
    return np.ascontiguousarray(np.moveaxis(x, 1, 2)).reshape(heads, L.BLOCK_TOKENS, head_dim)


def tile_bases(b3: np.ndarray, b4: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel bases ``[heads, head_dim]`` -> per-tile bases ``[n_tiles, C]`` (tile order of one block)."""
    heads, dim = b3.shape
    c = L.tile_channels(dim)
    return b3.reshape(heads * (dim // c), c), b4.reshape(heads * (dim // c), c)


def cache_blocks(x: np.ndarray) -> np.ndarray:
    """One layer's cache ``[heads, tokens, head_dim]`` -> its complete blocks ``[blocks, heads, 16, head_dim]``.

    The incomplete tail (``tokens % 16``) is not part of any block: it stays BF16.
    """
    heads, tokens, dim = x.shape
    n = tokens // L.BLOCK_TOKENS
    xb = x[:, : n * L.BLOCK_TOKENS].reshape(heads, n, L.BLOCK_TOKENS, dim)
    return np.ascontiguousarray(xb.transpose(1, 0, 2, 3))
