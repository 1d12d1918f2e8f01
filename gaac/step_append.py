"""A decode step's one-token append on the device: one launch a layer, for K and V, block ends included.

Every step of a decode loop appends one token to each of its sequences in every layer.
:class:`StepAppend` launches :func:`gaac.cuda.codec.step_append_kernel` for a layer: a warp per
(head, kind) writes its share of the token into the tails at the sequence's length on the device,
the last of them advances that length, and where the token completes a block the same warp encodes
its tile straight from the tail into the pools (records popped from the device free lists), and
writes the block-table entry and the block's epoch.  Nothing is read back: the host keeps its own
account (:meth:`StepAppend.account`), since it knows which blocks a step of one token per sequence
finishes.

The eager one-step plan (:class:`gaac.step.StepPlan`) and the captured plan of many steps
(:mod:`gaac.captured`) both append through it.  The cache keeps one per list of sequences, with the
layers' packed launch parameters, so that a step's call writes only its two token addresses.

It needs one tile per head (``head_dim`` 64 or 128): the kernel encodes a head's tile from its tail.
"""
from __future__ import annotations

import weakref

import numpy as np

from . import layout as L
from .cuda.launch import DATA_SLOT, ParamBuffer, params, plain, simulated
from .cuda.primitives import SIMULATOR


def supported(cache) -> bool:
    """Whether ``cache``'s steps can append through :class:`StepAppend` (the CUDA codec, one tile per head)."""
    return bool(cache._cuda_codec) and L.tiles_per_head(cache.head_dim) == 1


def step_append(cache, rows: np.ndarray) -> "StepAppend":
    """The cache's :class:`StepAppend` for the sequences ``rows`` (in that order), made once and kept."""
    key = rows.tobytes()
    app = cache._step_appends.get(key)
    if app is None:
        cache._step_appends.clear()          # one list of sequences at a time: a batch changes rarely
        app = cache._step_appends[key] = StepAppend(cache, rows)
    return app


class StepAppend:
    """One-token appends of the sequences ``rows`` (module docstring).

    The cache holds it (and the plans that append through it); it names the cache by a weak reference
    (:attr:`cache`), so that no cycle keeps a dropped cache's storage."""

    def __init__(self, cache, rows: np.ndarray):
        import torch

        from .cuda.codec import STEP_APPEND_SIG, step_append_kernel
        from .cuda.launch import FastLaunch
        from .cuda.primitives import SIMULATOR, WARP

        self._cache, self.rows = weakref.ref(cache), np.asarray(rows, np.int64)
        dev, n = cache.device, len(self.rows)
        self.rows_dev = cache._to_device(self.rows.astype(np.int32))
        self.arrivals = torch.zeros(cache.max_seqs, dtype=torch.int32, device=dev)
        self.escape_used = torch.zeros(2 * n * cache.tiles_per_block, dtype=torch.int32, device=dev)
        self.no_epochs = torch.zeros(1, dtype=torch.int16, device=dev)
        self.token = n * cache.kv_heads              # rows of a token's words
        self.launcher = FastLaunch(step_append_kernel(cache.geometry.channels), (n * cache.tiles_per_block, 2),
                                   WARP)
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
        return tuple(s.published for s in self.cache._store[layer])

    def args(self, layer: int, k, v) -> tuple:
        """The kernel's arguments for ``layer`` with the token ``k``/``v`` (contiguous int16, 16-byte aligned)."""
        from .cuda.launch import words

        cache = self.cache
        stores = cache._store[layer]
        # the pools' part of each kind's encoder (capacity, slots, free list, raw, free list, counts); the
        # bases are the published epoch's buffer, rewritten in place when the rule publishes another
        fixed = [(cache.current_bases(layer, kind),) + cache._encoder(s, None, 0, layer, kind)._fixed[1:]
                 for kind, s in enumerate(stores)]
        tiles = cache.max_seqs * cache.kv_heads
        return (*(words(x.reshape(self.token, cache.head_dim)) for x in (k, v)),
                *(words(s.tail.reshape(tiles, L.BLOCK_TOKENS, cache.head_dim)) for s in stores),
                *(x for pair in zip(*fixed) for x in pair), *(s.table.reshape(-1) for s in stores),
                *(s.epoch.reshape(-1) if s.epoch is not None else self.no_epochs for s in stores),
                cache.epochs_now[layer], int(stores[0].epoch is not None), self.escape_used, self.rows_dev,
                cache._seq_lens[layer], self.arrivals, cache.max_blocks)

    def launch(self, layer: int, k, v, contiguous: bool = False) -> None:
        """Append the token ``k``/``v`` (int16 or BF16 ``[len(rows), kv_heads, 1, head_dim]``; ``contiguous``:
        known to be) to ``layer``; its finished blocks take the published epochs.

        On the GPU the layer's parameters are packed once (until its pools change) and a call writes the two
        token addresses; in the simulator numba's dispatcher launches."""
        if not contiguous:
            k, v = k.contiguous(), v.contiguous()
        if k.data_ptr() % 16 or v.data_ptr() % 16:             # the kernel reads 16-byte rows
            k, v = k.clone(), v.clone()
        if SIMULATOR:
            args = self.args(layer, k, v)
            self.launcher._dispatcher[self.launcher._grid, self.launcher._block](*simulated(plain(a) for a in args))
            return
        # A layer's parameters hold while its pools keep their free lists; the arrays they name (tails,
        # tables, epochs, lengths, bases buffers) are replaced only by growth, which drops this object (the
        # cache's _storage_changed).
        ks, vs = self.cache._store[layer]
        versions = (ks.slots.version, ks.raw.version, vs.slots.version, vs.raw.version)
        entry = self._buffers.get(layer)
        if entry is None or entry[0] != versions:
            packed = [params(a) for a in self.args(layer, k, v)]
            # the data pointers of the first two arguments, the token's K and V words
            slots = (DATA_SLOT, len(packed[0]) + DATA_SLOT)
            entry = self._buffers[layer] = (versions, ParamBuffer([x for p in packed for x in p]), slots)
        _, buffer, (k_slot, v_slot) = entry
        buffer.slots[k_slot], buffer.slots[v_slot] = k.data_ptr(), v.data_ptr()
        self.launcher.run(buffer)

    def account(self, layers, fin: np.ndarray, blk: np.ndarray, epochs, index=None):
        """The host's account of a decode step's appends to ``layers`` (an iterable), once launched (no
        synchronisation; the caller advances its copy of the lengths): the sequences ``fin`` finished
        block ``blk``, in each layer's K and V epochs ``epochs[layer]`` (those published when the appends
        were launched).  The pools count the records the encodes may have taken, and ask for the device's
        count without waiting for it; the blocks' epochs are recorded; with adaptation the finished blocks
        are copied (pinned, in flight) for the rule, which takes them up a few steps later
        (:meth:`PagedKVCache._flush_due <gaac.cache.PagedKVCache._flush_due>`).  ``index`` is ``fin`` on the
        device (made here if needed, returned for the next call)."""
        cache = self.cache
        cache._step_clock += 1
        if not len(fin):
            cache._flush_due()
            return index
        tiles = len(fin) * cache.tiles_per_block
        stores, observing = [], []
        for layer in layers:
            for kind, store in enumerate(cache._store[layer]):
                cache._encodes_launched(store, tiles)
                stores.append(store)
                if store.adapter is None:
                    continue
                store.epochs[fin, blk] = epochs[layer][kind]
                observing.append(store)
            cache.blocks_encoded += len(fin)
        # one copy for every store's counts, one for every adapter's finished blocks
        cache._ask_counts(stores)
        if observing:
            if index is None:
                index = cache._to_device(fin)
            on_device = [store.tail.index_select(0, index) for store in observing]
            for store, copied, dev in zip(observing, cache._host_copies(on_device), on_device):
                cache._defer_observed(store, copied, dev)
        cache._flush_due()
        return index
