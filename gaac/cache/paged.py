"""The paged GAAC KV cache: fill-then-finalize blocks in two fixed-size storage classes.

The cache holds two storage classes of fixed-size records (:mod:`gaac.cache.pools`):

* per layer and kind (K, V), a slot pool, uint8 ``[n_slots, slot_bytes]`` -- compressed tiles
  (FORMAT.md section 6);
* one raw-tile arena for every layer and kind, int16 ``[n_raw, 16, C]`` -- tiles whose escapes
  overflow their slot, kept as BF16; each layer and kind draws from it through a share of its own;

and, per layer, kind and sequence, a row of the block table (FORMAT.md 7.2: a u32 entry per tile,
bit 31 set = raw-tile index in the arena, clear = slot index; stored as int32) plus an
uncompressed BF16 tail of at most 15 tokens.  Fixed-size records are why the
paper's serving system never manages variable-size allocations: a finished
block costs ``tiles_per_block`` records, each from one of two free lists.  How many
records the cache allocates follows from a byte budget or the table's size (:mod:`gaac.budget`).

Lifecycle (the paper's fill-then-finalize).  New tokens go to the tail; when a
block's 16th token arrives, the block -- all KV heads of the layer, K and V --
is encoded once, its tiles land in slots or raw tiles, the table records where,
and the tail is reused for the next block.  A finalized block is never encoded
again.  A prefill is the same step with many tokens: its complete blocks are
encoded straight from the input and only the incomplete suffix stays in the tail.

Calibration epochs (FORMAT.md 3.5, :mod:`gaac.epochs`; ``adapt=True``, the
default).  RoPE drift moves K's exponents away from what the calibration saw
as a context grows, so the cache runs one :class:`gaac.epochs.Adapter` per
layer and kind over the blocks it finalizes and appends the bases it proposes
as new epochs of its own copy of the calibration.  Each block is encoded with
the newest epoch of its layer and kind at the moment it is finalized, in runs
of at most ``adapter.until_check`` blocks (the adapter observes each run after
it is coded and may append an epoch before the next), and records that epoch
in a per-block index, which decoding follows.  The adapter sees blocks in
finalized order: token order within a sequence, and with several sequences in
one :meth:`PagedKVCache.update_layer` call, the order of ``seqs``.  Because the
adapter never looks at how a block was coded, an update first runs it over
all its blocks and then encodes each run of one epoch in one codec call.  The
histogram the adapter keeps is on the host, so on a GPU a finalized block is
also copied to the host once: asynchronously where the blocks reach no check
(a decode loop), the adapter observing them when it next needs its state.
``adapt=False`` codes every block with the calibration's own bases (epoch 0)
and keeps no index.

Every update is all-or-nothing: an exhausted pool raises :class:`PoolExhaustedError`
and leaves the cache as it was -- adapters and epochs included.  With the reference
codec the encode runs first (the adapters on copies of their state), the pools and
tables are checked next, and only then is anything written.  The CUDA encoder takes
its records from free lists on the device as it writes; where the host cannot prove
they suffice it reads the device's counts afterwards and, if a list ran dry, puts
them back (the records return to their lists) before raising.  A decode step
planned with :meth:`PagedKVCache.decode_plan` is reserved for every layer at once, and a
prompt given a layer at a time is one update over its layers inside
:meth:`PagedKVCache.deferred`.
``grow=True`` instead enlarges a pool or table that runs out (what a dynamic cache
such as ``gaac.hf.GAACCache`` wants).

Arrays are torch tensors on the cache's device, in the dtypes of
:class:`gaac.cache.view.LayerView`, so :meth:`PagedKVCache.layer_view` hands
attention the live storage without a copy.  The tile codec is the NumPy
reference on the CPU; on a CUDA device it is :mod:`gaac.cuda.codec` (both behind
:class:`gaac.cache.codec.TileCodec`).  The update transaction and the epochs'
bookkeeping are :mod:`gaac.cache.update`'s: the cache derives its methods for them
from :class:`gaac.cache.update.UpdateTransaction`.
"""
from __future__ import annotations

import functools
import math
import operator
import sys
import threading

import numpy as np
import torch

from .. import arrays
from .. import layout as L
from ..arrays import as_bits, stacked_view
from ..budget import Capacity, raw_share, size_cache
from ..calibration import Calibration
from ..epochs import EPOCH_INDEX_BYTES, epoch_table_bytes
from ..errors import CalibrationError, InputError, PoolExhaustedError
from ..progress import progress
from . import hooks
from .codec import codec_for, tiles_to_tokens
from .hooks import RECORDING, ServingState, check_not_recording
from .memory import MemoryReport
from .pools import DevicePool, ListWrites, count_arrays, counts_read, RawArena, grow_pools, grown, sync_pools
from .store import KINDS, give_back_all, make_stores
from .update import Deferral, UpdateTransaction, _runs
from .view import LayerView

PROGRESS_TOKENS = 512        # appends of this many tokens show a progress bar on a terminal (PagedKVCache.append)
# Epochs a block's epoch index can name: it is stored as int16 (LayerView.epoch), so epochs 0..32767.
MAX_INDEXED_EPOCHS = L.MAX_INDEXED_EPOCHS
EPOCH_ROOM = 16              # epochs a layer's attention base table holds at first (PagedKVCache.epoch_table)


def _locked(method, returned: bool = True):
    """Run a :class:`PagedKVCache` method holding the cache's lock (a re-entrant lock: methods call each other),
    after the host's account of an eager step's finished blocks where the step left it pending
    (:meth:`gaac.serving.plan.StepPlan.settle`: a step accounts once, at its last layer), and after the
    records of removed sequences are back in their pools (:meth:`PagedKVCache._take_returns`; ``returned``
    False: only those whose copy has arrived, for a method that reads no pool or checks its room itself)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            self.serving.settle()
            if self._returning:
                self._take_returns(wait=returned)
            if self._queued:            # updates a deferral queued come first (PagedKVCache.deferred)
                self._apply_deferred()
            return method(self, *args, **kwargs)
    return locked


def _locked_pools_later(method):
    """:func:`_locked` for a method that reads no pool, or checks its room itself (:meth:`PagedKVCache._reserve`,
    :meth:`PagedKVCache.reserve_step`): a removal's records still on their way do not make it wait."""
    return _locked(method, returned=False)


# ----------------------------------------------------------------------------------------------

def _give_back(stores: list, rows, wait: bool = True):
    """Every record that each store's table entries ``rows`` (device int32: a 1-D tensor a store, or one 2-D
    tensor, a row a store, where every store gives as many) point at goes back to its pools.
    Where the slot pools' free lists live on the device the entries are sorted there (one sort for every
    store: a sequence of a long context holds tens of thousands of entries per layer and kind, which the host
    would sort pool by pool), each slot pool takes its sorted records as a view of that one array, and the
    host needs only the raw records, which return to the arena's stack, and each pool's share: one copy,
    started here.  ``wait`` False: the host does not wait for it, and the returned :class:`_Returning` gives
    the records back once it has arrived (``None``: nothing to give, or given already)."""
    if not stores:
        return None
    if not all(isinstance(store.slots, DevicePool) for store in stores):
        give_back_all(stores, _read_back(stores, list(rows)))
        return None
    n = len(stores)
    if isinstance(rows, torch.Tensor):          # as many entries a store: each store's count is known on the device
        device, total = rows.device, rows.numel()
        if not total:
            return None
        words = rows.reshape(-1).long() & 0xFFFFFFFF
        store_of = torch.repeat_interleave(torch.arange(n, device=device), total // n, output_size=total)
    else:
        device, lengths = rows[0].device, [row.numel() for row in rows]
        total = sum(lengths)
        if not total:
            return None
        words = torch.cat(rows).long() & 0xFFFFFFFF
        store_of = torch.repeat_interleave(torch.arange(n, device=device),
                                           arrays.upload(np.asarray(lengths, dtype=np.int64), device),
                                           output_size=total)
    # a key per entry: the section (store i's slots: i, its raw tiles: n + i) above the record, so that one sort
    # groups every section's records, in order
    section = store_of + n * (words >> 31)
    records = (torch.sort((section << 32) | (words & L.TABLE_INDEX_MASK)).values & L.TABLE_INDEX_MASK).int()
    # each section's size, without the wait for its largest key that torch.bincount makes on a GPU
    sizes = torch.zeros(2 * n, dtype=torch.int64, device=device).scatter_add_(0, section, torch.ones_like(section))
    # where the records are given back at once, every pool's count comes in the same copy: appends the host does
    # not account (a refused recording run eagerly) moved them, and the lists are then written without a wait
    heads = count_arrays([pool for store in stores for pool in (store.slots, store.raw)]) if wait else []
    flat = torch.cat([records, sizes.int()] + [h.reshape(-1) for h in heads])
    if device.type == "cuda":
        host = torch.empty(flat.shape, dtype=torch.int32, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host, event = flat, None
    back = _Returning(stores, records, host, event, heads)
    if wait:
        back.give()
        return None
    return back


class _Returning:
    """A removed sequence's records on their way back (:func:`_give_back`): sorted by pool on the device, and
    their copy with each pool's share on its way to the host.  Until :meth:`give` they are in no free list,
    so nothing takes them: the pools' counts of free records stay lower bounds."""

    def __init__(self, stores: list, records: torch.Tensor, host: torch.Tensor, event, heads: list = ()):
        self.stores, self.records, self.host, self.event = stores, records, host, event
        self.heads = heads       # the pools' count arrays whose values the copy ends with (given back at once)

    def arrived(self) -> bool:
        """Whether the copy to the host has arrived (no wait)."""
        return self.event is None or self.event.query()

    def give(self) -> None:
        """Give every record back (waiting for the copy where it has not arrived): each slot pool's after its
        free ones, on the device; the raw records to the arena.  The slot pools whose lists cannot take
        their records without reading the device's count are read together, with one wait."""
        if self.event is not None:
            self.event.synchronize()
        stores, n = self.stores, len(self.stores)
        host = self.host.numpy()
        if self.heads:
            counted = 2 * len(self.heads)
            counts_read([pool for store in stores for pool in (store.slots, store.raw)], self.heads,
                        host[host.shape[0] - counted:].reshape(-1, 2))
            host = host[:host.shape[0] - counted]
        total = host.shape[0] - 2 * n
        sizes = host[total:].astype(np.int64)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        stale = [store.slots for store, m in zip(stores, sizes[:n]) if m and store.slots.reads_count(int(m))]
        if stale:
            sync_pools(stale)
        writes = ListWrites()           # the slot pools' lists written together (one write for all, as a rule)
        for i, store in enumerate(stores):
            a, z = int(starts[i]), int(ends[i])
            if z > a:
                store.slots.give(None, read=False, on_device=self.records[a:z], writes=writes)
            a, z = int(starts[n + i]), int(ends[n + i])
            store.raw.give(host[a:z].astype(np.int64), read=False)
        writes.apply()


def _read_back(stores: list, rows: list) -> list:
    """Each store's table entries ``rows`` (device int32) as uint32 words in int64 on the host, with every free
    list's count of ``stores`` read too: one copy, one wait, after which giving the records back reads nothing."""
    pools = [pool for store in stores for pool in (store.slots, store.raw)]
    heads = count_arrays(pools)
    host = torch.cat(rows + [h.reshape(-1) for h in heads]).cpu().numpy()
    n = host.shape[0] - 2 * len(heads)
    counts_read(pools, heads, host[n:].reshape(-1, 2))
    words = host[:n].view(np.uint32).astype(np.int64)
    ends = np.cumsum([row.numel() for row in rows])
    return [words[end - row.numel():end] for row, end in zip(rows, ends)]


class PagedKVCache(UpdateTransaction):
    """A paged, compressed KV cache for the layers, heads and head size of ``calibration``.

    Size.  ``budget`` (bytes, or a float in (0, 1]: that fraction of the device's free memory) sizes the
    cache: the pools, the raw-tile arena, the block tables, epoch indices and tails it allocates fit in it
    (:mod:`gaac.budget`; :attr:`capacity` says how many tokens that is).  Without a budget the cache is
    sized for the tokens its table promises: ``max_seqs`` sequences (default 1) of ``max_blocks``
    complete blocks each (default 64: 1024 tokens, plus a tail of up to 15).  Either way each layer and
    kind gets one compressed-tile slot per tile of that capacity, and the tiles whose escapes overflow
    their slot go to one raw-tile arena that every layer and kind shares, sized for
    ``gaac.budget.RAW_SHARE`` (4%) of the tiles, or twice the rate the calibration measured on its own
    text if that is more.  With content that overflows no more than that the cache holds
    :attr:`capacity`'s ``expected`` tokens; ``guaranteed`` is what it holds if every tile overflows.
    ``slots`` (per layer and kind) and ``raw_tiles`` (the arena's records) override the sizes.  An
    update that needs more than is free raises :class:`PoolExhaustedError` before anything is written
    (:meth:`free_tokens` and :meth:`fits` ask beforehand; :meth:`export_sequence` and
    :meth:`import_sequence` swap a sequence out to the host and back), or, with ``grow=True``, enlarges
    the pool, arena or table by a 32nd (``gaac.cache.pools.GROWTH``) or what it needs; a budget and
    ``grow=True`` exclude each other.
    ``device`` is any torch device; ``codec`` is ``'reference'`` (CPU), ``'cuda'``
    (gaac.cuda.codec), or None for the device's default.

    ``adapt`` runs calibration epochs (module docstring).  The cache works on its
    own copy of ``calibration``, :attr:`calibration`, so the caller's object never
    changes; with ``adapt`` that copy gains the epochs the cache appends, and it is
    the calibration to save with any block taken out of the cache.  A calibration
    that already carries epochs starts each layer and kind at its newest one; with
    ``adapt`` it may hold at most ``MAX_INDEXED_EPOCHS`` (32768) epochs per layer and kind,
    the most a block's int16 epoch index can name (:class:`CalibrationError` otherwise).

    Threads.  One cache may be used from several threads: every public method holds the
    cache's re-entrant lock (:attr:`lock`) for its whole run, so calls from different
    threads run one after the other, each all-or-nothing as above.  What
    :meth:`layer_view` returns is the live storage, read after the method returns: a
    thread that runs attention on a view while others append holds :attr:`lock` around
    taking the view and using it.

    Serving.  The decode loop (:mod:`gaac.serving`: :meth:`decode_plan`'s plans, the one-token appends,
    :class:`gaac.StepGraph`) sits above the cache, which imports none of it.  The loop keeps its own state
    in :attr:`serving` (a :class:`gaac.cache.hooks.ServingState`) and reaches the cache only through this
    storage interface:

    * :attr:`host_lengths` (the host's lengths, int64 ``[layers, max_seqs]``; the loop advances the entries
      of tokens its device appends wrote) and :attr:`device_lengths` (int32 on the device, what kernels read);
    * :meth:`stores` (a layer's K and V records: pools, table, tail, block epochs, capacity, published
      epoch), :meth:`epoch_table`, :meth:`current_bases`, :attr:`epochs_now`, :meth:`encoder_pools`,
      :meth:`layer_view`;
    * :attr:`storage_version` (advances whenever an array a launch names is replaced: growth, a full epoch
      table), :attr:`cuda_codec`, :meth:`to_device`, :meth:`check_seqs`, :meth:`check_layer`, :attr:`lock`;
    * the step's storage work: :meth:`reserve_step` (room for a step's finished blocks, before anything is
      written), :meth:`account_decode_step` (the host's account of blocks the device appends finished),
      :meth:`undo_device_appends` (appends that ran but are not accounted).

    In return the cache calls :attr:`serving`'s hooks where its storage changes behind the loop:
    ``storage_changed(layer=None)`` when arrays are replaced (launch states naming them are dropped) and
    ``lengths_changed()`` when lengths or sequences change other than through the loop's appends; both
    advance ``serving.generation``, which plans compare to tell that they are stale.  Before each public
    method the cache makes the account an eager step left pending (``serving.settle()``).  ``update_layer``
    and ``append`` refuse a change while this thread records another cache's device-driven step
    (:func:`gaac.cache.hooks.check_not_recording`).  And the cache calls the two entry points the loop
    registers when it is imported (:mod:`gaac.cache.hooks`): ``update_layer``'s append of one token outside
    a plan, and the plan :meth:`decode_plan` returns; the package ``gaac`` has the cache import the loop the
    first time it needs either.
    """

    _rule_on_device: bool | None = None    # where an update runs the epoch rule (None: on a GPU, there)
    def __init__(self, calibration: Calibration, *, budget: int | float | None = None, max_seqs: int = 1,
                 max_blocks: int | None = None, slots: int | None = None, raw_tiles: int | None = None, device="cpu",
                 grow: bool = False, codec: str | None = None, adapt: bool = True):
        self._lock = threading.RLock()
        self._deferral = None        # (thread, token) of the open deferral (deferred), else None
        self._queued = []            # the updates it queued: (layer, seqs, k, v), checked (_defer)
        if not isinstance(calibration, Calibration):
            raise InputError(f"calibration: expected a gaac.Calibration, got {type(calibration).__name__}")
        if calibration.format is not L.BF16:
            raise InputError(f"calibration: the paged cache holds BF16; this calibration is for "
                             f"{calibration.format.name}")
        for name, value in (("max_seqs", max_seqs), ("max_blocks", 1 if max_blocks is None else max_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(adapt, bool):
            raise InputError(f"adapt must be True or False, got {adapt!r}")
        self.adapt = adapt
        if adapt:
            # The adapters append at most gaac.epochs.MAX_EPOCHS epochs and nothing past that cap, so
            # only a calibration that starts with more epochs than the index can name can exceed it.
            most = max(calibration.n_epochs(layer, kind) for layer in range(calibration.layers) for kind in KINDS)
            if most > MAX_INDEXED_EPOCHS:
                raise CalibrationError(f"the calibration holds {most} epochs of one layer and kind; a cache with "
                                       f"adapt=True names a block's epoch in an int16 index, at most "
                                       f"{MAX_INDEXED_EPOCHS} epochs (0..{MAX_INDEXED_EPOCHS - 1}); use adapt=False "
                                       "(epoch 0 only) or a calibration with fewer epochs")
        self._calibration = calibration.copy()
        self.layers, self.kv_heads, self.head_dim = calibration.layers, calibration.kv_heads, calibration.head_dim
        self.geometry = L.geometry(self.head_dim)
        self.tiles_per_block = self.kv_heads * L.tiles_per_head(self.head_dim)
        self.device = torch.device(device)
        if not isinstance(grow, bool):
            raise InputError(f"grow must be True or False, got {grow!r}")
        if grow and budget is not None:
            raise InputError("budget and grow=True exclude each other: a budget fixes what the cache allocates, "
                             "grow=True enlarges it as needed")
        self.grow = grow
        self.codec = codec_for(codec, self.device)
        sizing = size_cache(calibration, budget=budget, max_seqs=max_seqs, max_blocks=max_blocks, adapt=adapt,
                            device=self.device)
        max_blocks = sizing.max_blocks
        n_slots = sizing.blocks * self.tiles_per_block if slots is None else slots
        n_raw = sizing.raw_tiles if raw_tiles is None else raw_tiles
        for name, value in (("slots", n_slots), ("raw_tiles", n_raw)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"{name} must be a non-negative integer, got {value!r}")
        self._raw_share = raw_share(calibration)
        self._arena = RawArena(n_raw, self.geometry.channels, self.device)
        self._store = make_stores(self._calibration, self._arena, device=self.device, cuda=self._cuda_codec,
                                  adapt=adapt, max_seqs=max_seqs, max_blocks=max_blocks, n_slots=n_slots, grow=grow)
        self._arena.cover([(store.raw, self._arena.chunk) for layer_store in self._store for store in layer_store])
        self._lens = np.zeros((self.layers, max_seqs), dtype=np.int64)       # host copy: the cache's logic
        self._seq_lens = torch.zeros((self.layers, max_seqs), dtype=torch.int32, device=self.device)
        self._live = np.zeros(max_seqs, dtype=bool)
        self._epoch_tables = {}      # layer -> [its attention base table, epochs written per kind] (epoch_table)
        self._epochs_now = None      # int32 [layers, 2] on the device: the published epochs (epochs_now)
        self._step_clock = 0         # decode steps accounted (account_decode_step): the rule's lag counts them
        self._next_due = None        # the earliest step whose finished blocks wait for the rule (_flush_due)
        self._rule_batches = []      # (step, GPU rule batch, its jobs) of decode checks in flight (_flush_due)
        self._checks_settled = None  # inside _settling_once: whether the queued decode checks were settled (None: outside)
        self._leading = set()        # stores whose queued decode blocks an update's rule batch takes (_lead)
        self._returning = []         # removed sequences' records on their way back to the pools (_take_returns)
        self._guess_misses = 1.0     # running share of a prompt's rule jobs that appended an epoch (_guess_pays)
        self.storage_version = 0     # counts replacements of arrays that launches name (growth, a full epoch table)
        self.serving = ServingState()    # the decode steps' state: plans, launch states, appends (gaac.serving)
        self.blocks_encoded = 0      # (layer, sequence, block) finalizations, each encoding K and V once
        if self._cuda_codec:         # every layer's encoders for the calibration's bases, made with the pools
            for layer, layer_store in enumerate(self._store):
                for kind, store in enumerate(layer_store):
                    self._encoder(store, None, 0, layer, kind)

    @property
    @_locked
    def calibration(self) -> Calibration:
        """The cache's own calibration, with every epoch the cache has appended (the one to save with
        blocks taken out of the cache)."""
        self._flush_all()
        return self._calibration

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock every public method holds (see the class docstring on threads)."""
        return self._lock

    def __getstate__(self):
        with self._lock:
            self.serving.settle()                    # a copy takes the account of every block written
            self._take_returns()                     # ... every record a removal gives back
            self._apply_deferred()                   # ... and every update a deferral queued
            state = self.__dict__.copy()
        del state["_lock"]                 # a lock is not copied or pickled: a copy gets a lock of its own
        state["_deferral"], state["_queued"] = None, []      # nor a deferral: it is this cache's caller's
        return state

    def __setstate__(self, state):
        # a cache pickled before these attributes existed starts as a new cache does
        state.setdefault("_returning", [])
        state.setdefault("_guess_misses", 1.0)
        state["_checks_settled"] = None
        state["_leading"] = set()
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # -- shape ------------------------------------------------------------------
    @property
    def max_seqs(self) -> int:
        return len(self._live)

    @property
    def max_blocks(self) -> int:
        return self._store[0][0].table.shape[1]

    @property
    @_locked_pools_later
    def sequences(self) -> list[int]:
        """Ids of the live sequences (their rows in every layer's block table)."""
        return self._live_ids()

    @_locked_pools_later
    def seq_len(self, seq: int, layer: int = 0) -> int:
        """Tokens sequence ``seq`` holds in ``layer``."""
        self._check_seq(seq)
        self._check_layer(layer)
        return int(self._lens[layer, seq])

    def _check_seq(self, seq) -> None:
        """A live sequence id: an integer (Python or NumPy; never a bool, float or string) of a live row."""
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)):
            raise InputError(f"sequence id {seq!r} is a {type(seq).__name__}: sequence ids are integers "
                             f"(live sequences: {self._live_ids()})")
        if not 0 <= seq < self.max_seqs or not self._live[seq]:
            raise InputError(f"sequence {seq!r} is not in the cache (live sequences: {self._live_ids()})")

    def _live_ids(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self._live)]

    def _check_seqs(self, seqs) -> list[int]:
        """Live sequence ids from an iterable of them (a list, a NumPy or torch integer array): each checked
        as :meth:`_check_seq` does, never coerced -- ``[0.7]``, ``['0']`` and ``[True]`` are refused."""
        if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
            raise InputError(f"seqs: expected a sequence of sequence ids, got {type(seqs).__name__}")
        out = []
        for s in seqs:
            if isinstance(s, torch.Tensor) and s.dim() == 0 and not s.dtype.is_floating_point \
                    and not s.dtype.is_complex and s.dtype != torch.bool:
                s = int(s)
            self._check_seq(s)
            out.append(operator.index(s))
        return out

    def _check_layer(self, layer) -> None:
        if (isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer))
                or not 0 <= layer < self.layers):
            raise InputError(f"layer {layer!r} out of range: the cache has {self.layers} layers")

    # -- sequences --------------------------------------------------------------
    @_locked_pools_later
    def add_sequence(self, k=None, v=None, *, show_progress: bool | None = None, fitted: bool = False) -> int:
        """Start a sequence and return its id; ``k``/``v`` ``[layers, kv_heads, tokens, head_dim]`` prefill it.

        ``show_progress``, ``fitted`` (the calibration was fitted on ``k``/``v``): as in :meth:`append`.
        """
        free = np.flatnonzero(~self._live)
        if free.size == 0:
            if not self.grow:
                raise PoolExhaustedError(f"all {self.max_seqs} sequence rows are in use; remove a sequence first")
            self._grow_rows(2 * self.max_seqs)
            free = np.flatnonzero(~self._live)
        seq = int(free[0])
        self._live[seq] = True
        self.serving.lengths_changed()           # a plan for every live sequence is stale
        if k is not None or v is not None:
            try:
                self.append(seq, k, v, show_progress=show_progress, fitted=fitted)
            except Exception:
                self._live[seq] = False
                raise
        return seq

    @_locked_pools_later
    def remove_sequence(self, seq: int) -> None:
        """Drop a sequence: its slots and raw tiles go back to the free lists, its row is reusable."""
        self._check_seq(seq)
        stores = [store for layer_store in self._store for store in layer_store]
        # every layer and kind's tables (and block epochs): one view where they lie at equal distances in one
        # allocation, as a cache makes them
        tables = [store.table for store in stores]
        indices = [store.epoch for store in stores if store.epoch is not None]
        views = [stacked_view(tables), stacked_view(indices) if indices else None]
        blocks = self._lens[:, seq] // L.BLOCK_TOKENS
        if views[0] is not None and (blocks == blocks[0]).all():     # every layer as long (between steps)
            rows = views[0][:, seq, :int(blocks[0])].reshape(len(stores), -1)
        else:
            rows = [table[seq, :int(n)].reshape(-1) for table, n in zip(tables, np.repeat(blocks, len(KINDS)))]
        # the records come back once their copy to the host has arrived: the host queues on meanwhile (a serving
        # loop's removal would otherwise wait for the steps queued before it)
        back = _give_back(stores, rows, wait=False)
        if back is not None:
            self._returning.append(back)
        # the row's table entries and block epochs, zeroed in every layer and kind at once where there is a view
        for held, view in zip((tables, indices), views):
            if view is not None:
                view[:, seq] = 0
            else:
                for t in held:
                    t[seq] = 0
        for store in stores:
            store.epochs[seq] = 0
        self._lens[:, seq] = 0
        self._seq_lens[:, seq] = 0
        self._live[seq] = False
        self._lengths_changed()

    def _grow_rows(self, n: int) -> None:
        extra = n - self.max_seqs
        for layer_store in self._store:
            for store in layer_store:
                store.table = torch.cat([store.table, store.table.new_zeros((extra, *store.table.shape[1:]))])
                store.tail = torch.cat([store.tail, store.tail.new_zeros((extra, *store.tail.shape[1:]))])
                store.epochs = np.concatenate([store.epochs, np.zeros((extra, store.epochs.shape[1]), np.int16)])
                if store.epoch is not None:
                    store.epoch = torch.cat([store.epoch, store.epoch.new_zeros((extra, store.epoch.shape[1]))])
        self._lens = np.concatenate([self._lens, np.zeros((self.layers, extra), np.int64)], axis=1)
        self._seq_lens = torch.cat([self._seq_lens, self._seq_lens.new_zeros((self.layers, extra))], dim=1)
        self._live = np.concatenate([self._live, np.zeros(extra, bool)])
        self._storage_changed()
        self._lengths_changed()

    # -- appending --------------------------------------------------------------
    @_locked_pools_later
    def append(self, seq: int, k, v, *, show_progress: bool | None = None, fitted: bool = False) -> None:
        """Append tokens ``[layers, kv_heads, t, head_dim]`` of K and V to sequence ``seq`` in every layer.

        All layers or none: if any pool cannot take the finished blocks, nothing changes.  A sequence
        longer than the block table (``max_blocks`` blocks of 16 tokens) is refused before any block is
        encoded, unless the cache was made with ``grow=True``.  ``show_progress``: a progress bar over
        the layers being encoded (None: on a terminal, for appends of at least ``PROGRESS_TOKENS`` tokens;
        the reference codec on a CPU encodes a few hundred blocks a second).

        ``fitted=True``: the calibration was fitted on these tokens (a cache that calibrated itself on its
        prompt, as :class:`gaac.hf.GAACCache` does).  Their blocks keep each layer's newest epoch: with
        adaptation on, the rule takes them into its histograms and appends no epoch among them
        (:meth:`gaac.epochs.Adapter.assign` with ``decide=False``), so that the prompt waits for no decision
        of the rule and encodes with one plan a layer and kind; it decides from the blocks after them.
        """
        if RECORDING.plans:                # a recording's launches would replay this prefill every step
            check_not_recording(self, "append")
        self._check_seq(seq)
        k = self._bits(k, "k", 4)
        v = self._bits(v, "v", 4)
        if k.shape[0] != self.layers or v.shape[0] != self.layers:
            raise InputError(f"k {list(k.shape)} / v {list(v.shape)}: expected {self.layers} layers first "
                             "([layers, kv_heads, tokens, head_dim])")
        self._check_table_room(seq, k.shape[2])
        if show_progress is None:
            show_progress = k.shape[2] >= PROGRESS_TOKENS and sys.stderr.isatty()
        layers = progress(range(self.layers), desc=f"encode {k.shape[2]} tokens", unit="layer",
                          enable=show_progress)
        self._apply(self._prepare_all((layer, [seq], k[layer][None], v[layer][None], not fitted) for layer in layers))

    def _check_table_room(self, seq: int, tokens: int) -> None:
        """Refuse, before encoding anything, an append that would outgrow the block table (unless ``grow``)."""
        held = int(self._lens[:, seq].max())
        need = (held + tokens) // L.BLOCK_TOKENS
        if need > self.max_blocks and not self.grow:
            raise PoolExhaustedError(
                f"sequence {seq} would hold {held + tokens} tokens = {need} blocks of {L.BLOCK_TOKENS}; the block "
                f"table holds {self.max_blocks} ({self.max_blocks * L.BLOCK_TOKENS} tokens) per sequence: make the "
                f"cache with max_blocks={need} or more, or with grow=True to enlarge it as needed")

    def update_layer(self, layer: int, seqs, k, v) -> None:
        """Append ``t`` tokens to each sequence of ``seqs`` in one layer: ``k``/``v`` ``[len(seqs), kv_heads, t, D]``.

        The form a model's forward pass produces (one layer at a time, a batch of
        sequences); the finished blocks of the batch are encoded together, one codec
        call per epoch.  With calibration epochs they are finalized -- seen by the
        layer's adapters -- in the order of ``seqs``, each sequence's in token order.

        On a GPU a step that finishes no block is a few device writes (the tails and
        the layer's lengths) with no synchronisation; a finished block is encoded
        straight into the pools by the CUDA encoder, which takes its records from free
        lists on the device.  Within a one-step plan (:meth:`decode_plan`), a token given as
        the plan expects it (``seqs`` the plan's list, contiguous BF16 or int16 tensors on
        the cache's GPU) is one launch whose parameters are written in place.

        Inside a deferral (:meth:`deferred`) a call of more than one token is checked here and queued; it
        is applied with the deferral's other calls, in one transaction.
        """
        with self._lock:
            if self._deferral is not None and self._defer(layer, seqs, k, v):
                return
            if RECORDING.plans:            # another cache's step is being recorded on this thread
                check_not_recording(self, "update_layer")
            serving = self.serving
            plan = serving.eager_plan
            if plan is not None and serving.recording is None and plan.append_token(layer, seqs, k, v):
                return
            self._update_layer(layer, seqs, k, v)

    @_locked_pools_later
    def _update_layer(self, layer: int, seqs, k, v) -> None:
        """:meth:`update_layer` checked in full (any call its step plan's fast path does not take)."""
        self._check_layer(layer)
        recording = self.serving.recording
        if recording is not None and recording.places:
            # A step for a batch-size bucket: ``seqs`` is the recording's list of places, which may hold
            # free places (-1); the recording checks it.
            recording.record_append(layer, seqs, self._bits(k, "k", 4), self._bits(v, "v", 4))
            return
        seqs, k, v = self._checked_update(seqs, k, v)
        if recording is not None:
            recording.record_append(layer, seqs, k, v)
            return
        if k.shape[2] == 1 and hooks.append_token(self, layer, seqs, k, v):
            return
        self._apply(self._prepare_all([(layer, seqs, k, v, True)]))

    def _checked_update(self, seqs, k, v) -> tuple:
        """``update_layer``'s sequences and tokens checked (:class:`InputError` naming what is wrong): the live
        sequence ids, each once, and K and V as int16 on the cache's device, of one shape ``[len(seqs),
        kv_heads, t, head_dim]``."""
        seqs = self._check_seqs(seqs)
        if len(set(seqs)) != len(seqs):
            raise InputError(f"sequences {seqs}: each may appear once")
        k, v = self._bits(k, "k", 4), self._bits(v, "v", 4)
        if k.shape != v.shape or k.shape[0] != len(seqs):
            raise InputError(f"k {list(k.shape)} and v {list(v.shape)} must both be [{len(seqs)} sequences, "
                             f"kv_heads, tokens, head_dim]")
        return seqs, k, v

    # -- a deferral -------------------------------------------------------------
    def deferred(self) -> Deferral:
        """A deferral of :meth:`update_layer` calls (:class:`gaac.cache.update.Deferral`), so that a prompt a
        model hands the cache one layer at a time is encoded as one transaction over its layers, as
        :meth:`append` encodes it: one adaptation-rule batch for every layer and kind, one reservation, one
        commit::

            with cache.deferred():
                for layer in range(cache.layers):
                    cache.update_layer(layer, [seq], k[layer], v[layer])    # checked, queued
                    ...                      # the layer's attention, over the prompt's own K/V
            # applied here: every queued layer, or none and the error

        Inside it, an ``update_layer`` call of the thread that opened it, of more than one token, is checked
        in full at the call (the errors it raises there are those of an update outside it) and queued; the
        tensors it is given are read when the queue is applied, so the caller leaves them unchanged until
        then (the queue holds them).  The queue is applied -- a flush: each layer's blocks cut and their epochs
        decided, then one transaction for all of them, every layer or none -- when the deferral ends
        normally, and before anything else touches the cache: any other public method (a read, a plan, an
        export, :meth:`memory`, :meth:`seq_len`, :meth:`remove_sequence`, ...), a second call for a layer
        already queued (the first is applied, the second queued), a call of one token (applied, then the
        token appended as outside a deferral), a call of another thread, a call while this cache records a
        step, and the storage interface's lengths, sequence checks and step reservations
        (:attr:`host_lengths`, :meth:`check_seqs`, :meth:`reserve_step`: where a serving loop starts a step).
        So no path reads lengths, tables or tails that a queued update would change; an attention launch of
        a plan made before the queued calls reads the cache as the plan saw it, without them (as if the calls
        came after it).

        What a flush raises (:class:`PoolExhaustedError` where a pool runs dry and the cache cannot grow)
        the call that flushed raises, with the cache as it was before the queued updates, which are
        dropped.  A block that raises drops the queue: nothing queued is written (what an earlier flush
        applied stays).  Deferrals do not nest (:class:`InputError`); :attr:`deferring` says whether one is
        open."""
        return Deferral(self)

    @property
    def deferring(self) -> bool:
        """Whether a deferral (:meth:`deferred`) is open on the cache."""
        return self._deferral is not None

    def _defer(self, layer, seqs, k, v) -> bool:
        """:meth:`update_layer` inside a deferral: checked in full and queued (True), or, where the call is
        not one to queue (another thread's, one token, a recording's), the queue applied first and False
        (the caller then runs the call as outside a deferral)."""
        self.serving.settle()
        if self._deferral[0] != threading.get_ident() or self.serving.recording is not None:
            self._apply_deferred()
            return False
        if RECORDING.plans:
            check_not_recording(self, "update_layer")
        self._check_layer(layer)
        seqs, k, v = self._checked_update(seqs, k, v)
        if k.shape[2] == 1:
            self._apply_deferred()
            return False
        if any(queued[0] == layer for queued in self._queued):
            self._apply_deferred()
        # the block table's room, as the transaction's reservation checks it: refused at the call
        need = max((int(self._lens[layer, s]) + k.shape[2]) // L.BLOCK_TOKENS for s in seqs)
        if need > self.max_blocks and not self.grow:
            raise self._exhausted(None, need, "this update")
        self._queued.append((layer, seqs, k, v))
        return True

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array on the cache's device without waiting for the device (pinned, asynchronous copy)."""
        return arrays.upload(a, self.device)

    def _bits(self, x, name: str, ndim: int) -> torch.Tensor:
        """``x`` (torch BF16/int16/uint16 on any device, or NumPy bits, any strides) as int16 on the cache's device."""
        if isinstance(x, torch.Tensor):
            if x.device.type == "meta" or x.layout != torch.strided:
                raise InputError(f"{name}: a {'meta' if x.device.type == 'meta' else str(x.layout)} tensor holds no "
                                 "dense data to append; pass a dense tensor on a real device")
            x = x.detach()
            if x.dtype == torch.bfloat16 or x.dtype == torch.uint16:
                x = x.contiguous().view(torch.int16)
            elif x.dtype != torch.int16:
                raise InputError(f"{name}: dtype {x.dtype} is not BF16; pass torch.bfloat16 or its int16 bits")
            t = x.to(self.device)
        else:
            # A copy where the strides are negative (a reversed view): torch takes none.
            t = torch.from_numpy(np.ascontiguousarray(as_bits(x, name)).view(np.int16)).to(self.device)
        if t.dim() != ndim or t.shape[-3] != self.kv_heads or t.shape[-1] != self.head_dim:
            raise InputError(f"{name}: shape {list(t.shape)}, expected [..., kv_heads={self.kv_heads}, tokens, "
                             f"head_dim={self.head_dim}] with {ndim} dimensions")
        return t

    def current_bases(self, layer: int, kind: int) -> torch.Tensor:
        """The bases (the CUDA encoder's packed words) the decode appends of ``layer`` and ``kind`` encode with:
        the published epoch's, in a buffer that keeps its place as epochs are published (:meth:`_publish`)."""
        store = self._store[layer][kind]
        if store.current is None:
            words = self._encoder(store, None, store.published, layer, kind)._fixed[0]
            store.current = words.copy() if isinstance(words, np.ndarray) else words.clone()
        return store.current

    @property
    def epochs_now(self) -> torch.Tensor:
        """int32 ``[layers, 2]`` on the device: the epoch the decode appends record for each layer's finished K
        and V blocks (the one whose bases :meth:`current_bases` holds)."""
        if self._epochs_now is None:
            now = np.array([[store.published for store in layer_store] for layer_store in self._store], np.int32)
            self._epochs_now = self._to_device(now).clone() if self.device.type == "cuda" else torch.from_numpy(now)
        return self._epochs_now

    def _drop_layer_state(self, layer: int) -> None:
        """Forget what attention launches ``layer`` with: its arrays changed."""
        self.storage_version += 1
        self.serving.storage_changed(layer)

    def epoch_table(self, layer: int) -> torch.Tensor:
        """``layer``'s attention base table: pair words int32 ``[2, room, kv_heads, 3, head_dim / 2]`` of every
        epoch its K and V stores hold (:func:`gaac.attention._pair_base_words`), rows past an epoch count zero.
        It lives as long as it has room: an appended epoch is written into it (an asynchronous copy on the
        current stream, after the launches that read the rows before it); a full table is replaced by one
        of twice the room (from :data:`EPOCH_ROOM`), which drops the layer's attention launch state."""
        from ..attention import _pair_base_words

        held = [store.b3.shape[0] for store in self._store[layer]]
        entry = self._epoch_tables.get(layer)
        if entry is None or entry[0].shape[1] < max(held):
            room = max(EPOCH_ROOM, 2 * entry[0].shape[1] if entry is not None else 0)
            while room < max(held):
                room *= 2
            table = torch.zeros((2, room, self.kv_heads, 3, self.head_dim // 2), dtype=torch.int32, device=self.device)
            if entry is not None:
                table[:, :entry[0].shape[1]] = entry[0]
                self._drop_layer_state(layer)
            entry = self._epoch_tables[layer] = [table, entry[1] if entry is not None else [0, 0]]
        table, written = entry
        for kind, n in enumerate(held):
            if written[kind] < n:
                words = np.stack([_pair_base_words(*self._calibration.bases(layer, kind, e))
                                  for e in range(written[kind], n)])
                table[kind, written[kind]:n].copy_(self._to_device(words))
                written[kind] = n
        return table

    def _storage_changed(self) -> None:
        """Forget what attention launches every layer with: arrays were replaced (growth)."""
        self.storage_version += 1
        self.serving.storage_changed()

    def _lengths_changed(self) -> None:
        """Forget the one-token step's device indices (made for the old lengths); a captured plan is stale."""
        self.serving.lengths_changed()

    def _grow_blocks(self, n: int) -> None:
        for layer_store in self._store:
            for store in layer_store:
                t = store.table
                store.table = torch.cat([t, t.new_zeros((t.shape[0], n - t.shape[1], t.shape[2]))], dim=1)
                store.epochs = np.concatenate([store.epochs, np.zeros((t.shape[0], n - t.shape[1]), np.int16)], axis=1)
                if store.epoch is not None:
                    e = store.epoch
                    store.epoch = torch.cat([e, e.new_zeros((e.shape[0], n - e.shape[1]))], dim=1)
        self._storage_changed()

    # -- the storage interface of the serving loop (gaac.serving) --------------------------------------
    # What the decode-step machinery reads and writes of the cache; the contract is in the class docstring.
    @property
    def host_lengths(self) -> np.ndarray:
        """int64 ``[layers, max_seqs]``: the host's copy of every sequence's length per layer, the one the cache's
        logic reads (no device synchronisation).  The live array: a serving loop advances the entries of the
        tokens its device appends wrote.  Growth of the rows replaces it (:attr:`serving`'s generation changes).
        Updates a deferral queued are applied first (:meth:`deferred`)."""
        if self._queued:
            self._apply_deferred()
        return self._lens

    @property
    def device_lengths(self) -> torch.Tensor:
        """int32 ``[layers, max_seqs]`` on the cache's device: the lengths the kernels read (and the device
        appends advance).  Growth of the rows replaces it (:attr:`storage_version` changes)."""
        return self._seq_lens

    def stores(self, layer: int) -> list:
        """Layer ``layer``'s storage records, K then V: per kind its pools (``slots``, ``raw``: ``data``,
        ``order``, ``version``), block ``table``, ``tail``, block epochs (``epoch`` on the device, ``epochs`` on
        the host), ``capacity`` and ``published`` epoch.  The records live as long as the cache; growth
        replaces the arrays they hold (:attr:`storage_version` changes)."""
        return self._store[layer]

    @property
    def cuda_codec(self) -> bool:
        """Whether the cache runs the CUDA codec (a GPU, or numba's simulator): free lists on the device, the
        append kernels, and the attention kernel in step plans."""
        return self._cuda_codec

    def to_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array on the cache's device without waiting for the device (pinned, asynchronous copy)."""
        return self._to_device(a)

    def check_seqs(self, seqs) -> list[int]:
        """Live sequence ids from an iterable of them, each checked (:class:`InputError` otherwise); updates a
        deferral queued are applied first (:meth:`deferred`)."""
        if self._queued:
            self._apply_deferred()
        return self._check_seqs(seqs)

    def check_layer(self, layer) -> None:
        """:class:`InputError` unless ``layer`` is a layer index of the cache."""
        self._check_layer(layer)

    def encoder_pools(self, layer: int, kind: int) -> tuple:
        """The CUDA encoder's arguments after the bases for ``layer`` and ``kind``: capacity, slots, their free
        list, raw tiles, their free list, the lists' taken counts (what a device append that encodes a finished
        block passes the encoder; they change with the pools' versions)."""
        return self._encoder(self._store[layer][kind], None, 0, layer, kind)._fixed[1:]

    def _take_returns(self, wait: bool = True) -> None:
        """Give back the records of removed sequences (:func:`_give_back`): all of them, waiting for their copies
        where they have not arrived, or (``wait`` False) those whose copy has."""
        while self._returning and (wait or self._returning[0].arrived()):
            self._returning.pop(0).give()

    def reserve_step(self, before: np.ndarray, after: np.ndarray) -> None:
        """Check (or, with ``grow``, make) room in every layer for the blocks a step from lengths ``before``
        to ``after`` finishes, before anything is written; :class:`PoolExhaustedError` names the first pool
        short.  A finished tile takes a slot or a raw tile, decided only as it is encoded, so each slot pool
        and each layer and kind's share of the raw-tile arena must be able to take every tile the step
        finishes: then no layer of the step can run out part way.  The device's exact counts are read only
        when the lower bound of free records falls short.  Updates a deferral queued are applied first."""
        if self._queued:
            self._apply_deferred()
        blocks = after // L.BLOCK_TOKENS - before // L.BLOCK_TOKENS
        need_rows = int((after // L.BLOCK_TOKENS).max(initial=0))
        if need_rows > self.max_blocks:
            if not self.grow:
                raise self._exhausted(None, need_rows, "the steps planned")
            self._grow_blocks(grown(self.max_blocks, need_rows - self.max_blocks))
        n = int(blocks.sum()) * self.tiles_per_block
        if not n:
            return
        stores = [store for layer_store in self._store for store in layer_store]
        self._take_returns_for((store, n) for store in stores)
        short = self._arena.cover([(store.raw, n) for store in stores])
        for store in stores:
            pool = store.slots
            if pool.free_lower() < n and pool.n_free() < n:
                short.append((pool, n - pool.n_free()))
        if short and not self.grow:
            raise self._exhausted(*short[0], f"the steps planned (they finish {n} tiles per layer and kind, each of "
                                             "which may need a slot or a raw tile)")
        if short:
            grow_pools(short)
            self._storage_changed()

    def account_decode_step(self, layers, fin: np.ndarray, blk: np.ndarray, epochs, index=None):
        """The host's account of a decode step whose one-token appends to ``layers`` (an iterable) ran on the
        device, once launched (no synchronisation; the caller advances :attr:`host_lengths`): the sequences
        ``fin`` finished block ``blk``, in each layer's K and V epochs ``epochs[layer]`` (those published when
        the appends were launched).  The pools count the records the encodes may have taken, and ask for the
        device's count without waiting for it; the blocks' epochs are recorded; with adaptation the finished
        blocks are gathered for the rule (on the device for the GPU rule, else copied to pinned host memory, in
        flight), which takes them up a few steps later (:data:`ADAPT_LAG`; the GPU rule's, once they complete a
        check).  ``index`` is ``fin`` on the device (made here if needed, returned for the next call)."""
        self._step_clock += 1
        if not len(fin):
            self._flush_due()
            return index
        tiles = len(fin) * self.tiles_per_block
        stores, observing = [], []
        for layer in layers:
            for kind, store in enumerate(self._store[layer]):
                self._encodes_launched(store, tiles)
                stores.append(store)
                if store.adapter is None:
                    continue
                store.epochs[fin, blk] = epochs[layer][kind]
                observing.append(store)
            self.blocks_encoded += len(fin)
        # one copy for every store's counts; every adapter's finished blocks in one gather where the tails lie
        # at equal distances in one allocation (as the cache makes them), and, where the rule runs on the host,
        # one pinned copy of them (the GPU rule reads them on the device: nothing comes to the host)
        self._ask_counts(stores)
        if observing:
            if index is None:
                index = self._to_device(fin)
            tails = stacked_view([store.tail for store in observing])
            on_device = (tails.index_select(1, index) if tails is not None
                         else [store.tail.index_select(0, index) for store in observing])
            copies = None if self._device_rule else self._host_copies(on_device)
            self._defer_observed(observing, len(fin), copies, on_device)
        self._flush_due()
        return index

    def undo_device_appends(self, rows: np.ndarray, layers) -> None:
        """Undo one-token appends to the sequences ``rows`` that ran on the device in ``layers`` and that the
        host does not account (a refused recording run eagerly): their device lengths return to the host's,
        and the records that the encodes of the blocks they finished took (read from the block table: this
        waits for the device) go back to the pools, as a removal gives them back."""
        with self._lock:
            self._seq_lens[:, self._to_device(rows)] = self._to_device(self._lens[:, rows].astype(np.int32))
            after = self._lens[0, rows] + 1
            done = after % L.BLOCK_TOKENS == 0
            if done.any():
                at = (self._to_device(rows[done]), self._to_device(after[done] // L.BLOCK_TOKENS - 1))
                stores = [store for layer in sorted(layers) for store in self._store[layer]]
                # (the pools' counts, which the appends moved unaccounted, read with the entries)
                _give_back(stores, [store.table[at].reshape(-1) for store in stores])
                for store in stores:
                    store.table[at] = 0
                    if store.epoch is not None:
                        store.epoch[at] = 0
            self._lengths_changed()

    # -- a decode step -----------------------------------------------------------
    @_locked_pools_later
    def decode_plan(self, q_heads: int, *, append: int = 1, seqs=None, scale: float | None = None,
                    steps: int | None = None, bucket: int | None = None):
        """Plan one decode step for every layer: a :class:`gaac.serving.plan.StepPlan` whose ``run(q, layer)``
        launches that layer's attention.

        ``append`` tokens (the step's new token) are added to each of ``seqs`` (default: every live
        sequence) in every layer before that layer's attention runs; the plan is made for the lengths
        after them, from the host's copy of the lengths (no device synchronisation), and reserves the
        records the step's finished blocks need in every layer: an exhausted pool raises
        :class:`PoolExhaustedError` here, before anything is written.  ``append=0`` plans attention
        over what the cache holds (after a prefill).

        ``steps=N`` plans the next ``N`` steps (or fewer: ``plan.steps``) for a CUDA graph: the step that
        ``with plan.device_driven():`` records reads its positions and lengths on the device, encodes the
        blocks it finishes there, and is replayed with ``plan.replayed()`` after each replay
        (:mod:`gaac.serving.graph`).  ``bucket=size`` plans the device-driven step of a batch-size bucket, which a
        graph captures once and replays for any batch of up to ``size`` sequences
        (:class:`gaac.serving.graph.BucketSteps`; :class:`gaac.StepGraph` runs that loop).

        The plan is the serving loop's, registered with the cache when :mod:`gaac.serving` is imported
        (:mod:`gaac.cache.hooks`); the package ``gaac`` has the cache import it here if it is not yet."""
        return hooks.step_plan(self, q_heads, append=append, seqs=seqs, scale=scale, steps=steps, bucket=bucket)

    @property
    def _device_rule(self) -> bool:
        """Whether the adaptation rule runs on the GPU where an update reaches a check: with the CUDA codec
        on a GPU (``_rule_on_device`` set on a cache, the simulator's tests run it there too)."""
        on = self._rule_on_device
        if not self._cuda_codec or not (self.device.type == "cuda" if on is None else on):
            return False
        return self._rule_fits

    @functools.cached_property
    def _rule_fits(self) -> bool:
        """Whether the GPU rule takes this cache's heads (:func:`gaac.cuda.epochs.supported`): asked once, as an
        update asks :attr:`_device_rule` a few times a layer and kind."""
        from ..cuda.epochs import supported

        return supported(self.kv_heads, self.head_dim)

    @property
    def _cuda_codec(self) -> bool:
        """Whether the cache runs the CUDA codec (a GPU, or numba's simulator): free lists on the device, the
        append kernel, and the fused kernel in step plans."""
        return self.codec.pools_on_device

    # -- reading ------------------------------------------------------------------
    @_locked_pools_later
    def read_layer(self, layer: int, seqs) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode ``seqs`` (all of one length ``T``) in ``layer``: K and V int16 ``[len(seqs), kv_heads, T, D]``.

        Finalized blocks are decoded from their slots (or copied from raw tiles),
        each with its own epoch's bases (one codec call per epoch), and the tail is
        appended: the exact BF16 bits that went in.
        """
        self._check_layer(layer)
        seqs = self._check_seqs(seqs)
        lens = {int(self._lens[layer, s]) for s in seqs}
        if len(lens) != 1:
            raise InputError(f"sequences {seqs} hold {sorted(lens)} tokens in layer {layer}; read_layer reads "
                             "sequences of one length (read them one at a time)")
        tokens = lens.pop()
        nblocks, rest = divmod(tokens, L.BLOCK_TOKENS)
        rows = torch.tensor(seqs, dtype=torch.long, device=self.device)
        out = []
        per = self.tiles_per_block
        for kind in KINDS:
            store = self._store[layer][kind]
            entries = store.table[rows, :nblocks].reshape(-1, per)
            epochs = store.epochs[seqs, :nblocks].reshape(-1)
            # The blocks sorted by epoch, decoded one epoch at a time, then put back in order (a gather: torch's
            # scatter into a preallocated tensor costs milliseconds on the CPU).
            order = np.argsort(epochs, kind="stable")
            runs = _runs(epochs[order])
            if len(runs) > 1:
                entries = entries[torch.from_numpy(order).to(self.device)]
            parts = [self.codec.decode(store.slots.data, store.raw.data, entries[start:stop].reshape(-1),
                                       store.tb3[epoch], store.tb4[epoch], store.capacity).to(self.device)
                     for epoch, start, stop in runs]
            tiles = torch.cat(parts) if parts else entries.new_zeros((0, L.BLOCK_TOKENS, self.geometry.channels),
                                                                     dtype=torch.int16)
            if len(runs) > 1:
                tiles = tiles.reshape(len(epochs), per, L.BLOCK_TOKENS, -1)[torch.from_numpy(np.argsort(order))
                                                                            .to(self.device)]
            full = tiles_to_tokens(tiles, len(seqs), nblocks, self.kv_heads, self.head_dim)
            out.append(torch.cat([full, store.tail[rows, :, :rest]], dim=2))
        return out[0], out[1]

    @_locked_pools_later
    def read(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ``seq``'s whole cache: K and V as uint16 ``[layers, kv_heads, tokens, head_dim]``."""
        self._check_seq(seq)
        if len(set(self._lens[:, seq].tolist())) != 1:
            raise InputError(f"sequence {seq} holds {self._lens[:, seq].tolist()} tokens per layer: it is mid-update")
        per_layer = [self.read_layer(layer, [seq]) for layer in range(self.layers)]
        return tuple(np.stack([p[kind][0].cpu().numpy() for p in per_layer]).view(np.uint16) for kind in KINDS)

    @_locked_pools_later
    def layer_view(self, layer: int) -> LayerView:
        """Layer ``layer``'s live storage as a :class:`LayerView` (no copy): what decode attention reads.

        Its batch is every sequence row; rows without a live sequence have ``seq_lens`` 0.
        With ``adapt`` the bases are ``[n_epochs, kv_heads, head_dim]`` and ``epoch``
        holds each block's epoch (int16 ``[max_seqs, max_blocks]``, non-decreasing
        along a sequence); without, the bases are ``[kv_heads, head_dim]`` and
        ``epoch`` is None.  Appends show up in it; growth (``grow=True``) and new
        epochs allocate new arrays, so take a fresh view after every update.
        """
        self._check_layer(layer)
        k, v = self._store[layer]
        if self.adapt:
            b3, b4, epoch = (k.b3, v.b3), (k.b4, v.b4), (k.epoch, v.epoch)
        else:
            b3, b4, epoch = (k.b3[0], v.b3[0]), (k.b4[0], v.b4[0]), None
        return LayerView(slots=(k.slots.data, v.slots.data), raw=(k.raw.data, v.raw.data), table=(k.table, v.table),
                         b3=b3, b4=b4, capacity=(k.capacity, v.capacity), tail_k=k.tail, tail_v=v.tail,
                         seq_lens=self._seq_lens[layer], kv_heads=self.kv_heads, head_dim=self.head_dim, epoch=epoch)

    # -- accounting ---------------------------------------------------------------
    @_locked
    def memory(self) -> MemoryReport:
        """What the live sequences occupy, against BF16 (see :class:`MemoryReport`)."""
        geo, live = self.geometry, self._live
        element_bytes = self.kv_heads * self.head_dim * 2           # one token of one kind in one layer
        slot = extra_epochs = 0
        raw = self._arena.used() * geo.raw_bytes
        allocated = self._arena.data.nbytes
        for layer_store in self._store:
            for store in layer_store:
                slot += store.slots.used * geo.slot_bytes(store.capacity)
                allocated += sum(t.nbytes for t in (store.slots.data, store.table, store.tail))
                if store.epoch is not None:
                    allocated += store.epoch.nbytes
                extra_epochs += store.b3.shape[0] - 1
        blocks = int((self._lens[:, live] // L.BLOCK_TOKENS).sum())
        tables = extra_epochs * epoch_table_bytes(self.calibration)
        epoch_bytes = tables + blocks * len(KINDS) * EPOCH_INDEX_BYTES if self.adapt else 0
        return MemoryReport(tokens=int(self._lens[0, live].sum()), slot_bytes=slot, raw_bytes=raw,
                            table_bytes=blocks * len(KINDS) * self.tiles_per_block * L.TABLE_ENTRY_BYTES,
                            tail_bytes=int(live.sum()) * self.layers * len(KINDS) * L.BLOCK_TOKENS * element_bytes,
                            bf16_bytes=int(self._lens[:, live].sum()) * len(KINDS) * element_bytes,
                            allocated_bytes=allocated + tables, epoch_bytes=epoch_bytes)

    # -- room -------------------------------------------------------------------------
    def _raw_per_block(self, expected: bool) -> float:
        """Arena records one block (every layer and kind) takes: at the arena's planned share of its tiles
        (``expected``), or every tile."""
        tiles = self.tiles_per_block * self.layers * len(KINDS)
        return tiles * (self._raw_share if expected else 1.0)

    def _exact_counts(self) -> None:
        """Read the device's free-list counts where the host's are only a bound (encodes in flight): one wait."""
        pools = [p for layer_store in self._store for store in layer_store for p in (store.slots, store.raw)]
        sync_pools([p for p in pools if not p.exact])

    def _free_slots(self) -> int:
        """Free slots of the layer and kind with the fewest (a lower bound: exact after :meth:`_exact_counts`)."""
        return min(store.slots.free_lower() for layer_store in self._store for store in layer_store)

    @property
    @_locked
    def capacity(self) -> Capacity:
        """Tokens the cache holds with no sequence in it, summed over sequences (:class:`gaac.budget.Capacity`):
        ``expected`` where the content overflows no more tiles than the arena is sized for (content like the
        calibration's), ``guaranteed`` if every tile overflows its slot."""
        per = self.tiles_per_block
        table = self.max_seqs * self.max_blocks
        slots = min(store.slots.size for layer_store in self._store for store in layer_store) // per
        arena = self._arena.size
        expected = min(table, slots, math.floor(arena / self._raw_per_block(True)))
        guaranteed = min(table, math.floor(arena / self._raw_per_block(False)))
        return Capacity(expected=expected * L.BLOCK_TOKENS, guaranteed=guaranteed * L.BLOCK_TOKENS)

    @_locked
    def free_tokens(self, expected: bool = True) -> int:
        """Tokens the cache can still take, summed over sequences (and new ones, in its free rows): with
        ``expected``, at the arena's planned share of overflowing tiles; else if every tile overflows.  On a
        GPU it reads the device's free-list counts where encodes are in flight (one wait: an admission
        check, not a step's); an append that overflows more tiles than planned is still refused whole
        (:class:`PoolExhaustedError`) before anything is written."""
        per = self.tiles_per_block
        self._exact_counts()
        lens = self._lens.max(axis=0)
        table = int((self.max_blocks - lens[self._live] // L.BLOCK_TOKENS).sum()
                    + (~self._live).sum() * self.max_blocks)
        arena = math.floor(self._arena.available() / self._raw_per_block(expected))
        blocks = min(table, arena)
        if expected:
            blocks = min(blocks, self._free_slots() // per)
        return max(blocks, 0) * L.BLOCK_TOKENS

    @_locked
    def fits(self, tokens: int, seq: int | None = None) -> bool:
        """Whether ``tokens`` more tokens fit at the arena's planned share of overflowing tiles: appended to
        sequence ``seq``, or as a new sequence (``seq=None``).  Always True with ``grow=True``.  An admission
        check for a serving loop; the update itself stays all-or-nothing."""
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
            raise InputError(f"tokens must be a non-negative integer, got {tokens!r}")
        if self.grow:
            return True
        if seq is None:
            if self._live.all():
                return False
            held = 0
        else:
            self._check_seq(seq)
            held = int(self._lens[:, seq].max())
        if held + tokens > self.max_blocks * L.BLOCK_TOKENS + L.BLOCK_TOKENS - 1:
            return False
        blocks = (held + tokens) // L.BLOCK_TOKENS - held // L.BLOCK_TOKENS
        self._exact_counts()
        slots = self._free_slots()
        return slots >= blocks * self.tiles_per_block and \
            self._arena.available() >= math.ceil(blocks * self._raw_per_block(True))

    # -- transfer (gaac.transfer) --------------------------------------------------
    @_locked
    def export_sequence(self, seq: int, *, calibration: bool = False, out=None, heads=None) -> memoryview:
        """Sequence ``seq``, every layer, as a sequence container (FORMAT.md 11): its blocks as stored (no
        re-encoding), the bases of the epochs they use, the tails and the calibration id; ``calibration=True``
        embeds the calibration too.  A read-only memoryview (pinned host memory on CUDA); ``out``: a host buffer
        to write it into; ``heads=(start, stop)``: those KV heads only (FORMAT.md 11.12), for a cache made with
        ``calibration.slice_heads(start, stop)``.  See :func:`gaac.transfer.export_sequence`."""
        from .transfer import export_sequence

        return export_sequence(self, seq, calibration=calibration, out=out, heads=heads)

    @_locked
    def import_sequence(self, data) -> int:
        """A sequence container (from :meth:`export_sequence` of a cache with the same calibration id) as a new
        sequence of this cache, bit for bit; returns its id.  See :func:`gaac.transfer.import_sequence`."""
        from .transfer import import_sequence

        return import_sequence(self, data)
