"""A decode step's one-token appends on the device: one launch a layer, for K and V.

Every step of a decode loop appends one token to each of its sequences in every layer.
:class:`StepAppend` launches :func:`gaac.cuda.codec.step_append_kernel` for a layer: a warp per
(head, kind) writes its share of the token into the tails at the sequence's length on the device,
the last of them advances that length, and where the token completes a block the same warp encodes
its tile straight from the tail into the pools (records popped from the device free lists), and
writes the block-table entry and the block's epoch.  Nothing is read back: the host keeps its own
account (:meth:`StepAppend.account`), since it knows which blocks a step of one token per sequence
finishes.

The eager one-step plan (:class:`gaac.serving.plan.StepPlan`) and the captured plan of many steps
(:mod:`gaac.serving.graph`) both append through it.  The cache's serving state keeps one per list of
sequences, with the layers' packed launch parameters, so that a step's call writes only its two token
addresses.  It needs one tile per head (``head_dim`` 64 or 128): the kernel encodes a head's tile from its
tail.

A token that finishes no block, outside a plan's appends, takes :func:`append_token`: the tails and the
lengths written at positions the host knows (:mod:`gaac.cuda.append` with the CUDA codec, tensor indexing on
the CPU), one launch a layer whose parameters (:func:`append_token_launch`) are packed once per layer.

Everything here reads the cache through its storage interface (:class:`gaac.PagedKVCache`'s docstring) and
keeps its own state in the cache's :class:`gaac.serving.state.ServingState`.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from .. import layout as L


def supported(cache) -> bool:
    """Whether ``cache``'s steps can append through :class:`StepAppend` (the CUDA codec, one tile per head)."""
    return bool(cache.cuda_codec) and L.tiles_per_head(cache.head_dim) == 1


def step_append(cache, rows: np.ndarray) -> "StepAppend":
    """The cache's :class:`StepAppend` for the sequences ``rows`` (in that order), made once and kept."""
    key = rows.tobytes()
    appends = cache.serving.step_appends
    app = appends.get(key)
    if app is None:
        appends.clear()          # one list of sequences at a time: a batch changes rarely
        app = appends[key] = StepAppend(cache, rows)
    return app


class StepAppend:
    """One-token appends of the sequences ``rows`` (module docstring).

    The cache holds it (and the plans that append through it); it names the cache by a weak reference
    (:attr:`cache`), so that no cycle keeps a dropped cache's storage."""

    def __init__(self, cache, rows: np.ndarray):
        from ..cuda.codec import STEP_APPEND_SIG, step_append_kernel
        from ..cuda.launch import FastLaunch
        from ..cuda.primitives import SIMULATOR, WARP

        self._cache, self.rows = weakref.ref(cache), np.asarray(rows, np.int64)
        self._stores = [cache.stores(layer) for layer in range(cache.layers)]    # records that live with the cache
        dev, n = cache.device, len(self.rows)
        self.rows_dev = cache.to_device(self.rows.astype(np.int32))
        self.arrivals = torch.zeros(cache.max_seqs, dtype=torch.int32, device=dev)
        self.escape_used = torch.zeros(2 * n * cache.tiles_per_block, dtype=torch.int32, device=dev)
        self.no_epochs = torch.zeros(1, dtype=torch.int16, device=dev)
        self.token = n * cache.kv_heads              # rows of a token's words
        self.launcher = FastLaunch(step_append_kernel(cache.geometry.channels), (n * cache.tiles_per_block, 2),
                                   WARP)
        self._simulated = SIMULATOR
        self._signature = STEP_APPEND_SIG
        if not SIMULATOR:
            self.launcher.prepare(STEP_APPEND_SIG)    # compiled once per tile width, before any launch
        self._buffers = {}      # layer -> (pool versions and epochs, ParamBuffer, token slots) (GPU)

    @property
    def cache(self):
        """The cache whose sequences this appends to."""
        return self._cache()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cache"] = self.cache        # a copy appends to the copy of its cache
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._cache = weakref.ref(state["_cache"])

    def prepare(self) -> None:
        """Make every layer's bases buffers and the published epochs' device words ahead of the launches: a
        launch being captured in a CUDA graph must not allocate or copy from the host."""
        cache = self.cache
        cache.epochs_now
        for layer in range(cache.layers):
            for kind in range(2):
                cache.current_bases(layer, kind)

    def epochs(self, layer: int) -> tuple:
        """The epochs this layer's appends encode finished blocks with, K and V: the published ones."""
        ks, vs = self._stores[layer]
        return ks.published, vs.published

    def args(self, layer: int, k, v) -> tuple:
        """The kernel's arguments for ``layer`` with the token ``k``/``v`` (contiguous int16, 16-byte aligned)."""
        from ..cuda.launch import words

        cache = self.cache
        stores = self._stores[layer]
        # the pools' part of each kind's encoder (capacity, slots, free list, raw, free list, counts); the
        # bases are the published epoch's buffer, rewritten in place when the rule publishes another
        fixed = [(cache.current_bases(layer, kind),) + cache.encoder_pools(layer, kind) for kind in range(2)]
        tiles = cache.max_seqs * cache.kv_heads
        return (*(words(x.reshape(self.token, cache.head_dim)) for x in (k, v)),
                *(words(s.tail.reshape(tiles, L.BLOCK_TOKENS, cache.head_dim)) for s in stores),
                *(x for pair in zip(*fixed) for x in pair), *(s.table.reshape(-1) for s in stores),
                *(s.epoch.reshape(-1) if s.epoch is not None else self.no_epochs for s in stores),
                cache.epochs_now[layer], int(stores[0].epoch is not None), self.escape_used, self.rows_dev,
                cache.device_lengths[layer], self.arrivals, cache.max_blocks)

    def launch(self, layer: int, k, v, contiguous: bool = False, handle: int | None = None) -> None:
        """Append the token ``k``/``v`` (int16 or BF16 ``[len(rows), kv_heads, 1, head_dim]``; ``contiguous``:
        known to be) to ``layer``; its finished blocks take the published epochs.  ``handle``: the raw stream
        to launch on (default torch's current one).

        On the GPU the layer's parameters are packed once (until its pools change) and a call writes the two
        token addresses; in the simulator numba's dispatcher launches."""
        if not contiguous:
            k, v = k.contiguous(), v.contiguous()
        k_ptr, v_ptr = k.data_ptr(), v.data_ptr()
        if k_ptr % 16 or v_ptr % 16:                           # the kernel reads 16-byte rows
            k, v = k.clone(), v.clone()
            k_ptr, v_ptr = k.data_ptr(), v.data_ptr()
        if self._simulated:
            from ..cuda.launch import plain, simulated

            args = self.args(layer, k, v)
            self.launcher._dispatcher[self.launcher._grid, self.launcher._block](*simulated(plain(a) for a in args))
            return
        # A layer's parameters hold while its pools keep their free lists; the arrays they name (tails,
        # tables, epochs, lengths, bases buffers) are replaced only by growth, which drops this object (the
        # cache's serving state, at the storage_changed hook).
        ks, vs = self._stores[layer]
        versions = (ks.slots.version, ks.raw.version, vs.slots.version, vs.raw.version)
        entry = self._buffers.get(layer)
        if entry is None or entry[0] != versions:
            from ..cuda.launch import ParamBuffer, kernel_arg_names

            names = kernel_arg_names(self.launcher._dispatcher)
            buffer = ParamBuffer.for_signature(self._signature, names, dict(zip(names, self.args(layer, k, v))))
            # a call writes the data pointers of the token's K and V words
            slots = (buffer.layout.data_slot("new_k"), buffer.layout.data_slot("new_v"))
            entry = self._buffers[layer] = (versions, buffer, slots)
        _, buffer, (k_slot, v_slot) = entry
        buffer.slots[k_slot], buffer.slots[v_slot] = k_ptr, v_ptr
        self.launcher.run(buffer, handle=handle)

    def account(self, layers, fin: np.ndarray, blk: np.ndarray, epochs, index=None):
        """The host's account of a decode step's appends to ``layers`` (an iterable), once launched: the
        sequences ``fin`` finished block ``blk`` in each layer's K and V epochs ``epochs[layer]``
        (:meth:`gaac.PagedKVCache.account_decode_step`; ``index`` is ``fin`` on the device, returned for
        the next call)."""
        return self.cache.account_decode_step(layers, fin, blk, epochs, index)


# ----------------------------------------------------------------------------------------------
# A token that finishes no block, outside a plan's appends (the cache's update_layer).

def append_token(cache, layer: int, seqs: list, k: torch.Tensor, v: torch.Tensor) -> bool:
    """One new token per sequence of ``seqs`` in ``layer`` that finishes no block: written on the device, no
    host sync.

    Returns False (nothing written) where a block finishes.  The index arrays are made once per
    step -- every layer of a step appends at the same positions -- and the lengths the kernel reads
    are the host's, which the host advances itself.  With the CUDA codec one launch writes both
    tails and the lengths (:mod:`gaac.cuda.append`); on the CPU, tensor indexing does."""
    rows = np.asarray(seqs, dtype=np.int64)
    host = cache.host_lengths
    lens = host[layer, rows]
    r = lens % L.BLOCK_TOKENS
    if (r == L.BLOCK_TOKENS - 1).any():
        return False
    state = cache.serving
    key = (rows.tobytes(), lens.tobytes())
    on_device = cache.cuda_codec
    if state.step_index is None or state.step_index[0] != key:
        index = np.stack([rows, r, lens + 1]).astype(np.int32)
        dev = cache.to_device(index)
        state.step_index = (key, dev, dev.long() if not on_device else None)
    _, index, long_index = state.step_index
    k_store, v_store = cache.stores(layer)
    if on_device:
        _launch_append(cache, layer, k, v, index, k_store, v_store)
    else:
        rows_t, r_t, after_t = long_index
        k_store.tail[rows_t, :, r_t] = k[:, :, 0]
        v_store.tail[rows_t, :, r_t] = v[:, :, 0]
        cache.device_lengths[layer, rows_t] = after_t.to(torch.int32)
    host[layer, rows] += 1
    state.generation += 1
    return True


def _launch_append(cache, layer, k, v, index, k_store, v_store) -> None:
    from ..cuda.append import append_kernel
    from ..cuda.primitives import SIMULATOR

    if SIMULATOR:
        args = (k.reshape(-1), v.reshape(-1), k_store.tail.reshape(-1), v_store.tail.reshape(-1), index[0],
                index[1], index[2], cache.device_lengths[layer])
        append_kernel()[(k.shape[0], cache.kv_heads), cache.head_dim](*(a.numpy() for a in args), cache.kv_heads,
                                                                       cache.head_dim)
        return
    k, v = k.contiguous(), v.contiguous()
    append_token_launch(cache, layer, index, k.shape[0], k.data_ptr(), v.data_ptr())


def append_token_launch(cache, layer: int, index: torch.Tensor, n: int, k_ptr: int, v_ptr: int) -> None:
    """Launch the one-token append of ``layer`` (GPU): ``n`` sequences' tokens at ``k_ptr``/``v_ptr``
    (contiguous int16 ``[n, kv_heads, 1, head_dim]``), to the rows and positions of ``index``.

    The kernel's parameters live in one buffer per layer, written when the layer's arrays change
    (its tails and lengths) or the step's index does; a call writes the two token pointers."""
    state = cache.serving
    if state.append_launch is None:
        from ..cuda.append import APPEND_SIG, append_kernel
        from ..cuda.launch import FastLaunch

        state.append_launch = FastLaunch(append_kernel(), None, cache.head_dim)
        state.append_launch.prepare(APPEND_SIG)
    k_store, v_store = cache.stores(layer)
    seq_lens = cache.device_lengths
    entry = state.append_params.get(layer)
    if entry is None or entry[0] is not k_store.tail or entry[1] is not seq_lens:
        entry = state.append_params[layer] = (k_store.tail, seq_lens, *append_buffer(
            k_store.tail, v_store.tail, seq_lens[layer], cache.kv_heads, cache.head_dim))
    buf, (k_data, v_data, k_items) = entry[2], entry[3]
    m = n * cache.kv_heads * cache.head_dim
    if buf.owner is not index or buf.slots[k_items] != m:
        buf.set_vector("k", m)
        buf.set_vector("v", m)
        for name, row in zip(("rows", "rpos", "lens_after"), index):
            buf.set(name, row)
        buf.owner = index
    buf.slots[k_data], buf.slots[v_data] = k_ptr, v_ptr
    state.append_launch.run(buf, (n, cache.kv_heads))


def append_buffer(tail_k, tail_v, seq_lens, kv_heads: int, head_dim: int) -> tuple:
    """The one-token append kernel's parameter buffer of a layer (its tails and lengths, by argument name; the
    token and the step's index written per step), and the slots a call writes: the data pointers of the
    token's K and V and the token's item count."""
    from ..cuda.append import APPEND_SIG, append_kernel
    from ..cuda.launch import ParamBuffer, kernel_arg_names

    buf = ParamBuffer.for_signature(APPEND_SIG, kernel_arg_names(append_kernel()), dict(
        tail_k=tail_k.reshape(-1), tail_v=tail_v.reshape(-1), seq_lens=seq_lens, kv_heads=kv_heads, head_dim=head_dim))
    layout = buf.layout
    return buf, (layout.data_slot("k"), layout.data_slot("v"), layout.slot("k", "nitems"))
