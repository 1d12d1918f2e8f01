"""The codec behind a paged cache: how tiles become slots and back, on the cache's device.

A cache's codec is a :class:`TileCodec`: the NumPy reference (:class:`ReferenceCodec`, on the CPU) or the
numba.cuda kernels (:class:`CudaCodec`, on a GPU or numba's simulator).  Both encode tiles into slot bytes
and decode the tiles a block table's entries point at.  With the CUDA codec the cache keeps its pools' free
lists on the device and encodes finished blocks straight into the pools, the encoder taking each tile's
record as it writes (:class:`gaac.cuda.codec.EncodePlan`, :meth:`gaac.cache.update.UpdateTransaction._encoder`);
with the reference codec the cache writes what :meth:`TileCodec.encode` returns into its pools itself
(:meth:`gaac.cache.update.UpdateTransaction._commit`).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .. import layout as L
from ..errors import FormatError, InputError
from ..reference.codec import decode_entries, encode_tiles

# ----------------------------------------------------------------------------------------------
# Tiles of torch tensors.  gaac.tiles does the same for NumPy arrays; these run on any torch
# device, so the cache never moves a block to the host to cut it into tiles.

def blocks_to_tiles(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, heads, 16, head_dim]`` (any strides with a contiguous last dimension) -> ``[n * tiles_per_block, 16, C]``
    in tile order (gaac.tiles.block_tiles), contiguous: one copy."""
    n, heads, tokens, dim = blocks.shape
    c = L.tile_channels(dim)
    x = blocks.unflatten(-1, (dim // c, c)).movedim(-2, -3)
    return x.reshape(-1, tokens, c).contiguous()


def tiles_to_tokens(tiles: torch.Tensor, seqs: int, blocks: int, heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`blocks_to_tiles` for ``seqs`` sequences of ``blocks`` blocks: ``[seqs, heads, blocks*16, D]``."""
    c = L.tile_channels(head_dim)
    x = tiles.reshape(seqs, blocks, heads, head_dim // c, L.BLOCK_TOKENS, c)
    x = x.permute(0, 2, 1, 4, 3, 5)                      # [seqs, heads, blocks, 16, per, C]
    return x.reshape(seqs, heads, blocks * L.BLOCK_TOKENS, head_dim)


# ----------------------------------------------------------------------------------------------
# The codec behind the cache: how tiles become slots and back, on the cache's device.

@runtime_checkable
class TileCodec(Protocol):
    """What a paged cache's codec does, on the cache's device (torch tensors on it).

    ``pools_on_device``: whether the cache that runs this codec keeps its free lists on the device and encodes
    finished blocks straight into its pools with the codec's kernels (the CUDA codec), rather than writing
    what :meth:`encode` returns into them itself.
    """

    pools_on_device: bool

    def encode(self, tiles: torch.Tensor, tb3: torch.Tensor, tb4: torch.Tensor, capacity: int):
        """Tiles int16 ``[n, 16, C]`` -> (slots of the fitting tiles uint8 ``[n_fit, slot_bytes]``, fits bool ``[n]``
        as NumPy).  ``tb3``/``tb4`` are one block's per-tile bases uint8 ``[P, C]``; tile ``i`` uses row ``i % P``."""
        ...

    def decode(self, slots: torch.Tensor, raw: torch.Tensor, entries: torch.Tensor, tb3: torch.Tensor,
               tb4: torch.Tensor, capacity: int) -> torch.Tensor:
        """The tiles that table ``entries`` int32 ``[n]`` point at in pools ``slots`` and ``raw``, int16
        ``[n, 16, C]`` (row ``i % P`` bases)."""
        ...


class ReferenceCodec:
    """The NumPy reference codec (gaac.reference.codec) on torch CPU tensors: a :class:`TileCodec`."""

    pools_on_device = False      # the cache writes what encode returns into its pools (free lists on the host)

    def encode(self, tiles: torch.Tensor, tb3: torch.Tensor, tb4: torch.Tensor, capacity: int):
        """Tiles int16 ``[n, 16, C]`` -> (slots of the fitting tiles uint8 ``[n_fit, slot_bytes]``, fits bool ``[n]``).

        ``tb3``/``tb4`` are one block's per-tile bases uint8 ``[P, C]``; tile ``i`` uses row ``i % P``.
        """
        reps = tiles.shape[0] // tb3.shape[0]
        enc = encode_tiles(tiles.numpy().view(np.uint16), np.tile(tb3.numpy(), (reps, 1)),
                           np.tile(tb4.numpy(), (reps, 1)), capacity)
        return torch.from_numpy(enc.slots[enc.fits]), enc.fits

    def decode(self, slots: torch.Tensor, raw: torch.Tensor, entries: torch.Tensor, tb3: torch.Tensor,
               tb4: torch.Tensor, capacity: int) -> torch.Tensor:
        """The tiles that table ``entries`` int32 ``[n]`` point at, int16 ``[n, 16, C]`` (row ``i % P`` bases)."""
        out = decode_entries(entries.numpy(), slots.numpy(), raw.numpy().view(np.uint16), tb3.numpy(), tb4.numpy(),
                             capacity)
        return torch.from_numpy(out.view(np.int16))


class CudaCodec:
    """The numba.cuda kernels of :mod:`gaac.cuda.codec` (device tensors; CPU tensors in the simulator): a
    :class:`TileCodec`.

    The cache encodes through :class:`gaac.cuda.codec.EncodePlan` straight into its pools, whose free
    lists live on the device (:class:`gaac.cache.pools.DevicePool`,
    :meth:`gaac.cache.update.UpdateTransaction._encode_on_device`); the cache decodes with this class, for
    reading a cache back.  :meth:`encode` codes tiles into pools of their own.
    """

    pools_on_device = True       # the cache encodes into its pools with EncodePlan, free lists on the device

    def __init__(self):
        from ..cuda import codec

        self._codec = codec

    def encode(self, tiles, tb3, tb4, capacity):
        """As :meth:`ReferenceCodec.encode`: tiles int16 ``[n, 16, C]`` -> (slots of the fitting tiles, in tile
        order, uint8 ``[n_fit, slot_bytes]``; fits bool ``[n]``, NumPy), encoded into pools of ``n`` records each."""
        out = self._codec.encode_tiles(tiles.contiguous(), tb3, tb4, capacity)
        entries = out["entries"]
        fits = entries >= 0                 # an entry with bit 31 set (negative as int32) names a raw tile
        return out["slots"][entries[fits].long()], fits.cpu().numpy()

    def decode(self, slots, raw, entries, tb3, tb4, capacity):
        # The kernels cannot take an empty pool; no entry points into one, so one zero record stands in.
        slots, raw = (p if p.shape[0] else p.new_zeros((1, *p.shape[1:])) for p in (slots, raw))
        out, status = self._codec.decode_tiles(slots, raw, entries.contiguous(), tb3, tb4, capacity)
        bad = torch.nonzero(status).flatten()
        if bad.numel():
            raise FormatError(f"slot of tile {int(bad[0])} does not decode (status {int(status[bad[0]])})")
        return out


def codec_for(codec: str | None, device: torch.device) -> TileCodec:
    """The codec a cache on ``device`` runs: ``'reference'`` (the CPU only), ``'cuda'``, or None for the device's
    default (CUDA on a GPU, else the reference)."""
    if codec is None:
        codec = "cuda" if device.type == "cuda" else "reference"
    if codec == "reference":
        if device.type != "cpu":
            raise InputError(f"the reference codec runs on the CPU; the cache is on {device} (use codec='cuda')")
        return ReferenceCodec()
    if codec == "cuda":
        return CudaCodec()
    raise InputError(f"codec {codec!r}: one of 'reference', 'cuda' (or None for the device's default)")
