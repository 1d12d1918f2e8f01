"""The all-or-nothing update of a paged cache, and the bookkeeping of its calibration epochs.

:class:`UpdateTransaction` holds the methods a :class:`~gaac.cache.paged.PagedKVCache` runs an update with:

* ``_prepare`` cuts the blocks the new tokens finish and decides their epochs (``_plan_epochs``: the adapter on
  copies of its state; on a GPU the rule is launched there, ``_launch_rule`` / ``_finish_rule``); with the
  reference codec it also encodes them.  Nothing in the cache changes.
* ``_apply`` reserves (``_reserve``: room in the pools and the table, or an error before anything is written),
  encodes on the device (``_encode_on_device``: the CUDA encoder takes its records from free lists on the
  device; where a list runs dry the counts are put back, ``_put_back``) and commits (``_commit``,
  ``_commit_epochs``): every update of a call, or none and an error.  Where every encode used the epochs the
  rule decided, the host writes before the encodes' counts are in, epochs appended included, and undoes the
  write if a list ran dry (``_written_early``).
* A deferral (:class:`Deferral`, :meth:`gaac.cache.paged.PagedKVCache.deferred`) queues ``update_layer`` calls
  and applies them in one ``_apply`` when it ends or when anything else touches the cache
  (``_apply_deferred``): a prompt given a layer at a time is one transaction, as ``append`` makes it.
* The adapters observe finished blocks (``_flush``, and in a decode loop ``_flush_due`` :data:`ADAPT_LAG`
  steps later); an epoch they append joins the device tables and is published for the blocks the device
  appends finish (``_epochs_appended``, ``_publish``).

The module docstring of :mod:`gaac.cache.paged` states what an update promises.
"""
from __future__ import annotations

import contextlib
import copy
import math
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import layout as L
from ..arrays import stacked_view
from ..epochs import Adapter, device_blocks
from ..errors import InputError, PoolExhaustedError
from ..tiles import tile_bases
from .codec import blocks_to_tiles
from .pools import Arrival, _Share, counts_read, grow_pools, grown, sync_pools
from .store import BASE_TABLES, KINDS, _Kind, add_epochs_all

ADAPT_LAG = 2                # decode steps between a block's finish and the adaptation rule's look at it
GUESS_MISSES = 0.5           # an update's encodes guess the rule's epochs while fewer of the jobs missed (_guess_pays)

_UNKNOWN = object()      # an update's in_table before PagedKVCache._in_table has found it
_RULE_STREAMS = {}       # CUDA device index -> the stream the adaptation rule runs on (PagedKVCache._rule_stream)


def _runs(epochs: np.ndarray):
    """``(epoch, start, stop)`` of each run of equal values in ``epochs``: one codec call each."""
    if not len(epochs):
        return []
    if (epochs == epochs[0]).all():     # one run (a pass, cheaper than finding cuts)
        return [(int(epochs[0]), 0, len(epochs))]
    cuts = np.flatnonzero(np.diff(epochs)) + 1
    bounds = [0, *cuts.tolist(), len(epochs)]
    return [(int(epochs[a]), a, b) for a, b in zip(bounds[:-1], bounds[1:])]


# ----------------------------------------------------------------------------------------------
# An update on its way: prepared, reserved, encoded, then committed.

@dataclass
class _Epochs:
    """The epochs of one layer and kind's blocks in an update: what its adapter decided, not yet applied."""

    epochs: np.ndarray           # int64 [n]: each finalized block's epoch, in finalized order (non-decreasing)
    tables: list                 # the epochs it appends: (b3, b4) [kv_heads, head_dim] each, in order
    after: Adapter | None        # a check ran: the adapter after the blocks (on a copy of the calibration)
    pending: object              # no check was due: the blocks the live adapter observes after commit
                                 # (NumPy, or a pinned host copy and its event on a GPU)
    blocks: object = None        # the rule runs on the GPU: the blocks, until the update's batch is decided
                                 # (``after`` is the live adapter until then)
    first_new: int = 0           # the rule runs on the GPU: the index of the first epoch it may append
    decide: bool = True          # False: the checks among these blocks append nothing (Adapter.assign)
    packed: list = field(default_factory=list)  # the GPU rule's: the appended epochs' bases packed for the CUDA
                                                # encoder on the device (as ``tables``, in order), or none
    table: object = None         # the GPU rule still deciding: every set of bases a block may be coded with,
    rows: object = None          # and each block's set, on the device (Batch.encode_rows), or None
    lead: list = field(default_factory=list)    # the GPU rule's: the decode steps' blocks queued ahead of these
                                                # (the store's queue's first items), which the update's rule
                                                # batch checks as its job's first blocks; out of the queue at commit


@dataclass
class _InPlace:
    """One sequence's finished blocks where its input holds them: ``bits`` int16 ``[heads, tokens, head_dim]``
    (C-contiguous, ``head_dim`` one tile wide), ``shape[0]`` tiles from its first token on, which the CUDA
    encoder reads there (:meth:`gaac.cuda.codec.EncodePlan.in_place`) instead of from a copy cut into tiles."""

    bits: torch.Tensor
    n_tiles: int

    @property
    def shape(self) -> tuple:
        return (self.n_tiles,)


@dataclass
class _Update:
    """One layer's update, encoded but not yet written: what :meth:`PagedKVCache._commit` applies."""

    layer: int
    seqs: list
    new: tuple                   # (K, V) int16 [b, heads, t, D] on the device
    blocks: list                 # per sequence: how many blocks the new tokens finish
    tiles: tuple                 # per kind: the finished blocks' tiles int16 [n_tiles, 16, C] (or _InPlace), or None
    slots: tuple                 # per kind: slot bytes of the fitting tiles uint8 [n_fit, slot_bytes], tile order
    fits: tuple                  # per kind: bool [n_tiles] (None: the CUDA encoder decides as it writes)
    epochs: tuple                # per kind: _Epochs, or None where no block finishes
    entries: list = field(default_factory=lambda: [None, None])   # per kind: table entries int32 [n_tiles] (GPU)
    heads_before: list = field(default_factory=lambda: [None, None])   # per kind, where the rule may undo the
                                                                       # encode: its _Counts before it
    in_table: object = _UNKNOWN  # where the encoder writes the table entries in place (PagedKVCache._in_table)


@dataclass
class _Counts:
    """A store's free-list counts (``heads``) saved before an encode, to put back if the encode is undone: a
    copy on the device, and the same on its way to the host (copied before the encode ran, so that reading it
    waits only for that copy, never for the encodes queued after it)."""

    device: torch.Tensor         # int32 [2]
    held: object                 # every saved store's counts: an array (CPU), or a pinned copy and its event (GPU)
    row: int

    def host(self) -> np.ndarray:
        """The counts on the host: ``[slots taken, raw records taken]``."""
        return _arrived(self.held)[self.row]


def _records_view(arrays: list) -> torch.Tensor | None:
    """Every layer and kind's array of one kind (tails, block-epoch indices) as one view ``[len(arrays), *shape]``
    where they lie evenly spaced in one allocation, as :func:`gaac.cache.store.make_stores` lays them out
    (:func:`gaac.arrays.stacked_view`), apart from each other; None where they do not (or are None)."""
    if len(arrays) < 2 or any(a is None for a in arrays):
        return None
    view = stacked_view(arrays)
    return view if view is not None and arrays[0].is_contiguous() and view.stride(0) >= arrays[0].numel() else None


def _tail_part(r: int, t: int, q: int) -> tuple:
    """Where an update's tokens past its last finished block go in a tail, and how many: ``(at, rest)``, for
    ``t`` new tokens after ``r`` in the tail that finish ``q`` blocks (the last ``rest`` of the new tokens)."""
    return (r, t) if q == 0 else (0, r + t - q * L.BLOCK_TOKENS)


def _arrived(blocks) -> np.ndarray:
    """Blocks on their way to an adapter, on the host: a pinned copy and its event (GPU; waited for where it has
    not arrived), or an array."""
    if isinstance(blocks, tuple):
        host, event = blocks
        if not event.query():            # a decode step's copy has arrived by the rule's turn, as a rule
            event.synchronize()
        return host.numpy()
    return np.asarray(blocks)


@dataclass
class _Observed:
    """Finished blocks of a decode step on their way to an adapter, and the step
    (:attr:`PagedKVCache._step_clock`) that finished them: the rule takes them up :data:`ADAPT_LAG` steps later.
    Where the rule runs on the GPU it reads ``device`` (the blocks on the device, a copy of their own) and the
    host never copies them (``blocks`` None: the adapter keeps :class:`~gaac.epochs.DeviceBlock` of them);
    else ``blocks`` is their host copy in flight and ``device`` None."""

    blocks: object
    step: int
    device: object = None
    n: int = field(init=False, default=0)    # the blocks on the device (a queue's counts read it, not the tensor)

    def __post_init__(self):
        if self.device is not None:
            self.n = self.device.shape[0]


def _on_device(item) -> bool:
    """Whether a queued item is a decode step's blocks that the GPU rule reads on the device."""
    return isinstance(item, _Observed) and item.device is not None


def _all_on_device(deferred: list) -> bool:
    """Whether every item of ``deferred`` (a store's queue) is a decode step's blocks that the GPU rule reads on
    the device (one comprehension: a join after N decode steps finds about N items in every layer and kind)."""
    return all([isinstance(item, _Observed) and item.device is not None for item in deferred])


def _waiting(deferred: list) -> int:
    """The blocks of ``deferred`` (a store's queue) that the GPU rule reads on the device (:attr:`_Kind.waiting`)."""
    return sum(item.n for item in deferred if _on_device(item))


def _check_span(store: _Kind):
    """Where the GPU rule runs: ``(items, need)`` where the first ``items`` of ``store``'s queue, all decode steps'
    blocks on the device, complete its adapter's next check, ``-need`` blocks of the last one after it; None where
    they complete none or other blocks come first."""
    need = store.adapter.until_check
    for i, item in enumerate(store.deferred):
        if not _on_device(item):
            return None
        need -= item.n
        if need <= 0:
            return i + 1, need
    return None


@dataclass
class _EarlyWrite:
    """An update committed before its encodes' counts are known (:meth:`PagedKVCache._written_early`), and what
    puts the cache back if a free list ran dry.  Only what later calls read is put back: the host's lengths,
    the tails that held tokens, the adapters and their pending blocks, the block count, and where the update
    appended epochs, each such store's epochs as they were (:class:`_Appended`).  Table entries and block epochs
    past the restored lengths are never read (a later update overwrites them)."""

    cache: object
    lens: np.ndarray
    adapters: list               # per store written: (layer, kind, its adapter, its queue of deferred blocks)
    tails: list                  # (store, sequence, its tail before the write)
    blocks_encoded: int
    appended: list = field(default_factory=list)     # _Appended, a store whose update appends epochs

    def undo(self) -> None:
        cache = self.cache
        cache._lens[...] = self.lens
        for layer, kind, adapter, queue in self.adapters:
            store = cache._store[layer][kind]
            store.adapter = adapter
            store.deferred[:] = queue
            store.waiting = _waiting(store.deferred)
        for store, seq, tail in self.tails:
            store.tail[seq].copy_(tail)
        cache.blocks_encoded = self.blocks_encoded
        for appended in self.appended:
            appended.undo(cache)

    def settle(self) -> None:
        """The write stands: a CPU cache's adapters observe the new blocks now."""
        cache = self.cache
        if cache.device.type != "cuda":
            for layer, kind, _, _ in self.adapters:
                cache._flush(cache._store[layer][kind], layer, kind)


@dataclass
class _Appended:
    """A store's epochs before an early write appended to them: what :meth:`_EarlyWrite.undo` restores -- the
    calibration's epochs of the layer and kind, the store's four base tables (the write replaced them by views
    of a new allocation, so the old ones are as they were), the encoders' bases and plans of the new epochs,
    the epoch the decode appends encode with, and the rows of the layer's attention base table counted as
    written (rows past them are written again by the next epoch appended)."""

    layer: int
    kind: int
    epochs: int                  # the layer and kind's epochs before, epoch 0 included
    tables: tuple                # the store's (b3, b4, tb3, tb4) before
    published: int

    def undo(self, cache) -> None:
        store = cache._store[self.layer][self.kind]
        del cache._calibration.epochs.setdefault((self.kind, self.layer), [])[self.epochs - 1:]
        for name, table in zip(BASE_TABLES, self.tables):
            setattr(store, name, table)
        store.packed = {e: bases for e, bases in store.packed.items() if e < self.epochs}
        store.encoders = {key: enc for key, enc in store.encoders.items() if key[0] < self.epochs}
        if store.published != self.published:
            cache._publish(self.layer, self.kind, self.published)
        entry = cache._epoch_tables.get(self.layer)
        if entry is not None:
            entry[1][self.kind] = min(entry[1][self.kind], self.epochs)


class Deferral:
    """A deferral of a cache's ``update_layer`` calls (what :meth:`gaac.cache.paged.PagedKVCache.deferred`
    returns): while it is open, the calls of the thread that opened it are checked at once and queued; they are
    applied together, one transaction over every queued layer, when it is applied.

    As a context manager (``with cache.deferred(): ...``) it opens on entry and is applied on a normal exit, or
    discarded (nothing queued is written) where the block raises.  Where the calls span more than one block of
    code (a model's forward pass that hands the cache one layer per call), :meth:`start`, :meth:`apply` and
    :meth:`discard` do the same one at a time.  It names the cache but the cache does not name it (the cache
    keeps only its token), so it makes no reference cycle."""

    def __init__(self, cache):
        self._cache = cache
        self._token = object()

    def start(self) -> "Deferral":
        """Open the deferral: :class:`InputError` where one is open already on the cache (deferrals do not
        nest)."""
        self._cache._open_deferral(self._token)
        return self

    def apply(self) -> None:
        """Close the deferral and apply what it queued (all of it, or nothing and the error:
        :class:`PoolExhaustedError` where a pool runs dry)."""
        self._cache._close_deferral(self._token, apply=True)

    def discard(self) -> None:
        """Close the deferral and drop what it queued: the cache stays as it was before the queued calls."""
        self._cache._close_deferral(self._token, apply=False)

    def __enter__(self) -> "Deferral":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.apply()
        else:
            self.discard()
        return False


class UpdateTransaction:
    """The update transaction and the epochs bookkeeping of a :class:`~gaac.cache.paged.PagedKVCache`, which
    derives from this class: ``self`` is the cache, whose storage (``_store``, ``_lens``, ``_arena``) these
    methods read and write and whose helpers (``_to_device``, ``_grow_blocks``, ``_storage_changed``,
    ``_device_rule``, ``_cuda_codec``) they call.  A base class rather than an object that holds the cache: a
    cache keeps no reference cycle (its memory returns when the last reference goes), copies and pickles as
    one object, and a method replaced on a cache or its class is the one every call reaches."""

    def _apply(self, updates: list) -> None:
        """Reserve, encode (GPU) and commit prepared updates (:meth:`_apply_updates`); the decode blocks their
        plans took as their rule jobs' first (:attr:`_leading`) are the decode checks' again afterwards."""
        try:
            self._apply_updates(updates)
        finally:
            self._leading.clear()

    def _apply_updates(self, updates: list) -> None:
        """Reserve, encode (GPU) and commit prepared updates: all of them, or nothing and an error.

        On a GPU the host launches the adaptation rule and reserves (the reservation first where it may wait for the
        device or grow, :meth:`_reserve_waits`), then launches the encodes before it waits for the rule's
        decisions.  A sequence's blocks read where its input holds them (a prompt's) are encoded in one
        launch a layer and kind, each block with the bases of the epoch the rule decides for it, read from the
        rule's results on the device (:meth:`gaac.cuda.epochs.Batch.encode_rows`); a job the rule decides in
        more phases than the encode read is encoded again once the decisions are in.  Other blocks the rule
        still decides are encoded with their layer's newest epoch, which is what the rule keeps unless it
        appends an epoch; where it does, that layer and kind is encoded again once the decision is in (every
        one, where an encode ran a free list dry), and where the prompts before appended in most layers, the
        host waits for the decisions first (:meth:`_guess_pays`).  The host takes the rule's decisions while
        the encodes run.  Where every encode coded its blocks with the epochs the rule decided, the host also
        writes the update (tables, tails, lengths, block epochs, adapters, the epochs it appends) before it
        waits for the encodes' counts, and undoes that write if a free list ran dry (:meth:`_written_early`)."""
        # The reservation first where it may read the device's counts: it then waits only for what ran before
        # the update, not behind the rule's kernels, which hold the GPU once launched.  Where it cannot wait (the
        # common case: a prompt into a cache with room), the rule is launched first and the reservation's host
        # work runs while the GPU scans.
        jobs = self._reserve_jobs(updates)
        if self._reserve_waits(updates, jobs):
            self._reserve(updates, jobs)
            rule = self._launch_rule(updates)
        else:
            rule = self._launch_rule(updates)
            self._reserve(updates, jobs)
        encoded, redo, done, early = True, [], False, None
        # the encodes start before the decisions where they read them on the device, or where a guess pays
        guess = self._guess_pays(rule) or bool(rule) and all(plan.rows is not None for _, items in rule
                                                             for _, _, plan in items)

        def decided():          # the rule's decisions, taken once: before the encodes are checked, or on an error
            nonlocal redo, done
            if not done:
                done = True
                redo = self._finish_rule(rule)

        def before_check():
            nonlocal early
            decided()
            if not redo:
                early = self._written_early(updates)

        def ran_dry():
            nonlocal early
            if early is not None:
                early.undo()
                early = None

        try:
            if not guess:               # the rule is likely to append: its decisions first, one encode
                decided()
            if self._cuda_codec:
                encoded = self._encode_on_device(updates, guessing=bool(rule) and guess, before_check=before_check,
                                                 ran_dry=ran_dry)
        finally:
            decided()
        if not encoded:                 # a guessed epoch ran a free list dry: encode with the rule's epochs
            self._encode_on_device(updates)
        elif redo:
            self._encode_again(redo)
        if early is None:
            self._commit_all(updates)
        else:
            early.settle()
        # the device's lengths of every layer the updates changed, in one copy
        layers = sorted({u.layer for u in updates})
        if len(layers) == self.layers:
            self._seq_lens.copy_(self._to_device(self._lens.astype(np.int32)), non_blocking=True)
        else:
            for layer in layers:
                self._seq_lens[layer].copy_(self._to_device(self._lens[layer].astype(np.int32)), non_blocking=True)
        self._lengths_changed()

    # -- a deferral (Deferral, PagedKVCache.deferred) -------------------------------------------------
    def _open_deferral(self, token) -> None:
        """Open a deferral for the calling thread, named by ``token``."""
        with self._lock:
            if self._deferral is not None:
                raise InputError("update_layer calls are already deferred on this cache (a deferral is open); "
                                 "deferrals do not nest: apply or discard the open one first")
            self._deferral = (threading.get_ident(), token)

    def _close_deferral(self, token, apply: bool) -> None:
        """Close the deferral ``token`` names: apply its queued updates (``apply``) or drop them.  Closed either
        way, also where applying raises (the queued updates are then dropped and nothing of them is written)."""
        with self._lock:
            if self._deferral is None or self._deferral[1] is not token:
                raise InputError("this deferral is not open on the cache (it was applied or discarded already, or "
                                 "never started)")
            self._deferral = None
            if apply:
                self._apply_deferred()
            else:
                self._queued = []

    def _apply_deferred(self) -> None:
        """Apply the queued updates (a flush): each layer's prepared in the order queued, then one
        :meth:`_apply` over all of them -- every one, or none and the error.  The queue is emptied first, so
        an error drops it and what :meth:`_apply` calls never applies it again."""
        with self._lock:
            queued, self._queued = self._queued, []
            if queued:
                self.serving.settle()
                self._apply(self._prepare_all((layer, seqs, k, v, True) for layer, seqs, k, v in queued))

    def _written_early(self, updates: list) -> "_EarlyWrite":
        """Commit ``updates`` while their encodes may still run dry: what the write changes that a later
        update could see is kept to be put back (:class:`_EarlyWrite`).  The adapters' observation of the
        new blocks waits for :meth:`_EarlyWrite.settle`."""
        tails = [(store, seq, store.tail[seq].clone()) for u in updates for store in self._store[u.layer]
                 for seq in u.seqs if self._lens[u.layer, seq] % L.BLOCK_TOKENS]
        adapters = [(u.layer, kind, store.adapter, list(store.deferred))
                    for u in updates for kind, store in zip(KINDS, self._store[u.layer])]
        appended = [_Appended(u.layer, kind, store.tb3.shape[0], tuple(getattr(store, name) for name in BASE_TABLES),
                              store.published)
                    for u in updates for kind, store in zip(KINDS, self._store[u.layer])
                    if u.tiles[kind] is not None and u.epochs[kind].tables]
        early = _EarlyWrite(self, lens=self._lens.copy(), adapters=adapters, tails=tails,
                            blocks_encoded=self.blocks_encoded, appended=appended)
        self._commit_all(updates, observe=False)
        return early

    def _prepare(self, layer: int, seqs: list, k: torch.Tensor, v: torch.Tensor, decide: bool = True) -> _Update:
        """Cut the blocks the new tokens complete and decide their epochs; with the reference codec also
        encode them (the CUDA encoder writes into the pools, after :meth:`_reserve`).  Nothing in the
        cache changes.  ``decide=False``: the rule's checks among these blocks append nothing
        (:meth:`gaac.epochs.Adapter.assign`)."""
        if k.shape != v.shape or k.shape[0] != len(seqs):
            raise InputError(f"k {list(k.shape)} and v {list(v.shape)} must both be [{len(seqs)} sequences, "
                             f"kv_heads, tokens, head_dim]")
        t = k.shape[2]
        blocks, cut = [], ([], [])
        # One sequence's blocks from its first new token on, head_dim one tile wide: the CUDA encoder reads
        # them where the input holds them, so that a prefill copies nothing before encoding.
        in_place = (self._cuda_codec and len(seqs) == 1 and int(self._lens[layer, seqs[0]]) % L.BLOCK_TOKENS == 0
                    and self.head_dim == self.geometry.channels and k[0].is_contiguous() and v[0].is_contiguous())
        for i, seq in enumerate(seqs):
            r = int(self._lens[layer, seq]) % L.BLOCK_TOKENS
            q = (r + t) // L.BLOCK_TOKENS
            blocks.append(q)
            if q == 0:
                continue
            for kind, new in zip(KINDS, (k, v)):
                head = new[i, :, :q * L.BLOCK_TOKENS - r]
                if r:          # the tail's tokens start the first finished block
                    head = torch.cat([self._store[layer][kind].tail[seq, :, :r], head], dim=1)
                cut[kind].append(head.reshape(self.kv_heads, q, L.BLOCK_TOKENS, self.head_dim).transpose(0, 1))
        tiles, slots, fits, epochs = [], [], [], []
        per = self.tiles_per_block
        on_device = self._cuda_codec
        for kind in KINDS:
            store = self._store[layer][kind]
            if not cut[kind]:
                tiles.append(None)
                slots.append(None)
                fits.append(np.zeros(0, bool))
                epochs.append(None)
                continue
            # [n, heads, 16, D] in finalized order; a single sequence's blocks stay a view of its input.
            finished = cut[kind][0] if len(cut[kind]) == 1 else torch.cat(cut[kind])
            plan = self._plan_epochs(store, layer, kind, finished, decide)
            tiles.append(_InPlace((k, v)[kind][0], finished.shape[0] * per) if in_place else blocks_to_tiles(finished))
            epochs.append(plan)
            if on_device:
                slots.append(None)
                fits.append(None)
                continue
            parts = []
            for epoch, start, stop in _runs(plan.epochs):
                tb3, tb4 = (torch.from_numpy(t) for t in self._tile_bases(store, plan, epoch, layer, kind))
                parts.append(self.codec.encode(tiles[-1][start * per:stop * per], tb3, tb4, store.capacity))
            slots.append(torch.cat([p[0] for p in parts]))
            fits.append(np.concatenate([p[1] for p in parts]))
        return _Update(layer=layer, seqs=seqs, new=(k, v), blocks=blocks, tiles=tuple(tiles), slots=tuple(slots),
                       fits=tuple(fits), epochs=tuple(epochs))

    def _tile_bases(self, store: _Kind, plan: _Epochs, epoch: int, layer: int, kind: int):
        """One block's per-tile bases ``(tb3, tb4)`` of ``epoch`` (NumPy): from the host's calibration, which
        holds every epoch the store does, or one the update appends -- never read back from the device."""
        held = store.tb3.shape[0]
        b3, b4 = self._calibration.bases(layer, kind, epoch) if epoch < held else plan.tables[epoch - held]
        return tuple(np.ascontiguousarray(t) for t in tile_bases(b3, b4))

    def _plan_epochs(self, store: _Kind, layer: int, kind: int, finished: torch.Tensor,
                     decide: bool = True) -> _Epochs:
        """The epoch each of ``finished`` ``[n, heads, 16, D]`` is coded with; the cache's adapter stays as it is.

        Where the blocks reach no check before their last one, the newest epoch codes them all and
        the adapter only has to observe them, after commit; on a GPU their copy to the host is
        started here and waited for only when the adapter next needs them (:meth:`_flush`), which in
        a decode loop is a block later.  Otherwise the rule runs now, on a copy of the adapter and of
        the calibration, in runs of at most ``until_check`` blocks (:meth:`gaac.epochs.Adapter.assign`); on a
        GPU the decode steps' blocks queued ahead of them come first in its batch (:meth:`_lead`).
        """
        n = finished.shape[0]
        adapter = store.adapter
        if adapter is None:
            return _Epochs(epochs=np.zeros(n, np.int64), tables=[], after=None, pending=None)
        lead = self._lead(store, layer, kind, n, decide)
        if lead is None:
            self._flush(store, layer, kind)
        # (blocks whose last one completes a check are observed after commit only where that check may decide)
        if not lead and (n < adapter.until_check or (decide and n == adapter.until_check)):
            return _Epochs(epochs=np.full(n, adapter.epoch, np.int64), tables=[], after=None,
                           pending=self._host_copy(finished))
        if self._device_rule:
            return _Epochs(epochs=None, tables=[], after=adapter, pending=None, blocks=finished, decide=decide,
                           lead=lead or [])
        after = copy.deepcopy(adapter, {id(adapter.calibration): self._calibration.copy(share_tables=True)})
        host = finished.cpu().numpy().view(np.uint16)
        epochs = after.assign(host, decide=decide)
        tables = [after.calibration.bases(layer, kind, e) for e in range(adapter.epoch + 1, after.epoch + 1)]
        return _Epochs(epochs=epochs, tables=tables, after=after, pending=None)

    def _lead(self, store: _Kind, layer: int, kind: int, n: int, decide: bool) -> list | None:
        """Where the GPU rule decides ``n`` new blocks of ``store`` and checks them (``decide``, and at least a
        check's worth, so that its batch holds a check and keeps fewer blocks than these for the next): the
        decode steps' blocks queued ahead of them on the device, which the update's rule batch then takes as its
        job's first blocks, their checks the batch's first.  So a prompt after decode steps (a join) launches no
        batch of the steps' checks of its own that the host waits for before the prompt's, and no adapter
        observes their blocks a step at a time.  They stay in the store's queue, left alone by the decode checks
        (:attr:`_leading`), until the update commits; blocks a prefill queued ahead of them are observed first.
        None where this does not apply (the caller brings the adapter up to date, :meth:`_flush`)."""
        every = store.adapter.until_check + len(store.adapter._recent)      # blocks a check reads
        if not (self._device_rule and decide and n >= every):
            return None
        self._finish_rule_batches()                 # the rule's checks in flight come first
        self._flush(store, layer, kind, front=True)
        if not _all_on_device(store.deferred):
            return None
        if store.deferred:
            self._leading.add(id(store))
        return list(store.deferred)

    def _launch_rule(self, updates: list) -> list:
        """Launch the adaptation rule on the GPU for every (layer, kind) of ``updates`` that reaches a check:
        one batch per shape of finished blocks (:class:`gaac.cuda.epochs.Batch`).  Until
        :meth:`_finish_rule`, each such plan's epochs are its adapter's newest epoch for every block (the
        encode's guess); where every job of a batch is read in place, each plan also holds the table of bases
        and the rows by which its encode reads each block's epoch on the device (``table``, ``rows``)."""
        waiting = [(u, kind, u.epochs[kind]) for u in updates for kind in KINDS
                   if u.epochs[kind] is not None and u.epochs[kind].blocks is not None]
        if not waiting:
            return []
        from ..cuda.epochs import Batch

        # The rule runs on copies: of each adapter (a shallow one: the GPU rule replaces its histogram and
        # pending blocks rather than changing them) and of the calibration (one for the batch: each job
        # appends to its own layer and kind), so that the cache is unchanged until commit.
        calibration = self._calibration.copy(share_tables=True)
        for _, _, plan in waiting:
            epoch = plan.after.epoch
            plan.first_new = epoch + 1
            plan.epochs = np.full(plan.blocks.shape[0], epoch, np.int64)
            after = copy.copy(plan.after)
            after.calibration = calibration
            # the decode blocks queued ahead: the job's first blocks (every step's run at once, rather than a few
            # calls a run: a join after N steps of a batch finds about N runs in every layer and kind)
            runs = [item.device for item in plan.lead]
            after._recent = after._recent + device_blocks(*runs)
            if after._recent_device is not None:
                after._recent_device = [*after._recent_device, *runs]
            after.finalized += sum([item.n for item in plan.lead])
            plan.after = after
        by_shape = {}
        for item in waiting:
            by_shape.setdefault((tuple(item[2].blocks.shape), item[2].decide), []).append(item)
        launched = []
        for (_, decide), items in by_shape.items():
            batch = Batch([(plan.after, plan.blocks) for _, _, plan in items], stream=self._rule_stream(),
                          decide=decide)
            batch.scan()
            batch.chain()
            if decide and batch.launched and all(isinstance(u.tiles[kind], _InPlace) for u, kind, _ in items):
                # the encodes read each block's epoch from the rule's results on the device: launched before
                # the decisions reach the host
                current = [self._encoder(self._store[u.layer][kind], plan, plan.first_new - 1, u.layer, kind).bases
                           for u, kind, plan in items]
                for (_, _, plan), (table, rows) in zip(items, batch.encode_rows(current)):
                    plan.table, plan.rows = table, rows
            batch.copy_hists()          # the histograms' copies while the GPU scans (the host waits for it next)
            launched.append((batch, items))
        return launched

    def _rule_stream(self):
        """The CUDA stream the adaptation rule runs on, beside the encodes (None on the CPU): of a higher
        priority, so that the GPU schedules the rule's blocks first -- the host waits for its decisions,
        while the encodes are waited for only later, if at all.  One per device for the process: torch's
        allocator keeps freed memory per stream, so a stream per cache would strand the rule's buffers."""
        if self.device.type != "cuda":
            return None
        from ..cuda.launch import device_index

        key = device_index(self.device)
        stream = _RULE_STREAMS.get(key)
        if stream is None:
            stream = _RULE_STREAMS[key] = torch.cuda.Stream(key, priority=-1)
        return stream

    def _guess_pays(self, launched: list) -> bool:
        """Whether the encodes of an update whose rule is ``launched`` (on the GPU) start at once with each
        layer's newest epoch, the rule's guess, rather than after the rule's decisions.  A guess runs the
        encodes beside the rule, and costs a second encode of every layer and kind where the rule appends
        an epoch; so the cache guesses where the prompts before missed in fewer than half of their layers
        and kinds (:attr:`_guess_misses`), and a new cache, whose calibration came from other text, decides
        first."""
        return bool(launched) and self._guess_misses < GUESS_MISSES

    def _finish_rule(self, launched: list) -> list:
        """Wait for the rule's decisions and put them in the plans; return the (update, kind) pairs whose
        encode guessed an epoch the rule did not keep.  The share of the jobs that appended an epoch (where a
        guess misses) joins :attr:`_guess_misses`, a running mean that halves the weight of each earlier
        update (of the batches that decide)."""
        redo, jobs, missed = [], 0, 0
        for batch, items in launched:
            decided = batch.finish()
            for (u, kind, plan), epochs, packed, read in zip(items, decided, batch.new_bases(),
                                                             batch.rows_epochs(decided)):
                guessed = plan.epochs if read is None else read     # what the encode coded the blocks with
                plan.table = plan.rows = None
                plan.epochs = epochs
                plan.tables = [plan.after.calibration.bases(u.layer, kind, e)
                               for e in range(plan.first_new, plan.after.epoch + 1)]
                plan.packed = packed
                plan.blocks = None
                if batch.decide:        # a fitted prompt's jobs, which cannot append, say nothing of the next
                    jobs, missed = jobs + 1, missed + bool(plan.tables)
                # (both [n] int64: one comparison, not np.array_equal's checks and conversions a job)
                if u.entries[kind] is not None and not (guessed == epochs).all():
                    redo.append((u, kind))
        if jobs:
            self._guess_misses = (self._guess_misses + missed / jobs) / 2
        return redo

    def _encode_again(self, redo: list) -> None:
        """Encode ``redo``'s (update, kind) pairs again with the epochs the rule decided: their stores' free
        lists go back to where they were before the first encode (nothing else was written)."""
        self._put_back([(u, kind, u.heads_before[kind]) for u, kind in redo])
        self._encode_on_device(list({id(u): u for u, _ in redo}.values()), only={(id(u), kind) for u, kind in redo})

    def _host_copy(self, x: torch.Tensor):
        """``x`` on the host: NumPy on the CPU; on a GPU a pinned copy in flight and its event."""
        if x.device.type != "cuda":
            return x.numpy()
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _host_copies(self, tensors) -> list:
        """Equal-shaped device tensors (a list, or one tensor whose rows they are) on the host, each as
        :meth:`_host_copy` gives it (a pinned copy in flight and its event), made as :meth:`_host_copy_rows`
        makes them."""
        if self.device.type != "cuda":
            return [self._host_copy(t) for t in tensors]
        host, arrival = self._host_copy_rows(tensors)
        return [(host[i], arrival) for i in range(len(tensors))]

    def _host_copy_rows(self, tensors) -> tuple:
        """Equal-shaped device tensors (a list, or one tensor whose rows they are) on the host as the rows of
        one pinned copy in flight, and its :class:`Arrival`: one pinned buffer and one copy for all of them,
        from where they lie where a list's tensors lie at equal distances in one allocation (as the cache makes
        its arrays), else after one gather kernel."""
        if not isinstance(tensors, torch.Tensor):
            together = stacked_view(tensors)
            tensors = together if together is not None else torch.stack(tensors)
        host, event = self._host_copy(tensors)
        return host, Arrival(event)

    def _flush(self, store: _Kind, layer: int, kind: int, upto: int | None = None, front: bool = False) -> None:
        """Let the adapter observe the blocks deferred to it, in order (``upto``: only those of decode steps up
        to that step of :attr:`_step_clock`; ``front``: only those ahead of the first decode step's blocks the
        GPU rule reads on the device); an epoch it appends joins the device tables and is published for the
        blocks finished from then on (:meth:`_epochs_appended`)."""
        if upto is None and not front:
            self._finish_rule_batches()             # the rule's checks in flight come first
            if self._device_rule and not self._checks_settled and any(_on_device(item) for item in store.deferred):
                self._settle_decode_checks()
        while store.deferred:
            item = store.deferred[0]
            if upto is not None and isinstance(item, _Observed) and item.step > upto or front and _on_device(item):
                return
            store.deferred.pop(0)
            device = item.device if isinstance(item, _Observed) else None
            if device is not None:
                store.waiting -= item.n
            # blocks the GPU rule reads on the device stay there: the adapter keeps them as values only the host
            # rule's check reads (nothing waits for a copy, which a join's prompt would find behind the queued steps)
            blocks = (device_blocks(device) if device is not None else
                      _arrived(item.blocks if isinstance(item, _Observed) else item).view(np.uint16))
            appended = False
            while len(blocks):              # a decode step's blocks may pass a check: observed in runs up to it
                n = min(store.adapter.until_check, len(blocks))
                epoch = store.adapter.observe(blocks[:n], device=None if device is None else device[:n])
                if epoch is not None:
                    store.add_epoch(*self._calibration.bases(layer, kind, epoch))
                    appended = True
                blocks = blocks[n:]
                device = None if device is None else device[n:]
            if appended:
                self._epochs_appended(layer)

    def _settle_decode_checks(self) -> None:
        """Run on the GPU every check the queued decode blocks of every layer and kind complete, each round of
        checks one batch (a store takes one check a batch), and take up their decisions: a prefill needs the
        adapters current, and the host rule would take milliseconds a check.  Inside :meth:`_prepare_all` once
        for all its layers (:attr:`_checks_settled`): their flushes change only their own stores, so no check
        comes due between them (and inside :meth:`_flush_all`, for the same reason)."""
        while True:
            before = len(self._rule_batches)
            self._launch_decode_checks(self._step_clock)
            launched = len(self._rule_batches) > before
            self._finish_rule_batches()
            if not launched:
                break
        if self._checks_settled is False:
            self._checks_settled = True

    @contextlib.contextmanager
    def _settling_once(self):
        """A span of flushes of several stores in which the queued decode checks are settled once, at the first
        flush that needs them, rather than at every layer and kind's flush (which looked at every store's queue
        once a store: 64 times 64 at 32 layers)."""
        outer = self._checks_settled
        if outer is None:
            self._checks_settled = False
        try:
            yield
        finally:
            self._checks_settled = outer

    def _prepare_all(self, updates) -> list:
        """:meth:`_prepare` of every ``(layer, seqs, k, v, decide)`` of ``updates`` (one transaction's), the decode
        checks settled once for all of them (:meth:`_settling_once`); where one raises, the decode blocks the
        others' plans took (:meth:`_lead`) are the decode checks' again."""
        with self._settling_once():
            try:
                return [self._prepare(layer, seqs, k, v, decide) for layer, seqs, k, v, decide in updates]
            except BaseException:
                self._leading.clear()       # (no update is applied: the queued decode blocks stay the checks')
                raise

    def _flush_due(self) -> None:
        """The adaptation rule's turn in a decode loop, after each step's account: the adapters observe the
        blocks finished :data:`ADAPT_LAG` steps ago or earlier, whose copies to the host have arrived by now
        (the device runs the steps in order and the host is at most a few ahead), so the loop does not
        wait for the device; an epoch a check appends takes effect from the next step the host launches.

        On a GPU (:attr:`_device_rule`) the checks those blocks complete run there, every layer and kind in one
        batch (:class:`gaac.cuda.epochs.Batch`) on the rule's stream, from the blocks' device copies; the
        batch's decisions are taken up :data:`ADAPT_LAG` steps later, so its checks cost the host a launch,
        not the milliseconds of the host rule.  Blocks there come due only once they complete a check
        (:meth:`_defer_observed`): a step that completes none costs this turn a comparison."""
        upto = self._step_clock - ADAPT_LAG
        if self._rule_batches and self._rule_batches[0][0] <= upto:
            self._finish_rule_batches(upto)
        if self._next_due is None or self._next_due > upto:
            return
        self._launch_decode_checks(upto)

    def _launch_decode_checks(self, upto: int) -> None:
        """:meth:`_flush_due`'s work for the blocks of decode steps up to ``upto``.  Where the rule runs on the
        GPU, the checks they complete are launched in rule batches, and blocks that complete no check stay
        queued, observed by nobody until they do (observing them one step at a time cost the host tens of
        microseconds a layer and kind); blocks a prefill queued ahead of them are observed first.  Where the
        rule runs on the host, the adapters observe every due block."""
        self._next_due = None
        jobs = []
        device_rule = self._device_rule
        busy = {id(store) for _, _, items in self._rule_batches for store, *_ in items} | self._leading
        for layer, layer_store in enumerate(self._store):
            for kind, store in zip(KINDS, layer_store):
                if not store.deferred or id(store) in busy:
                    continue        # (a store in a batch in flight comes due again when the batch is taken up)
                if not device_rule:
                    self._flush(store, layer, kind, upto)
                    first = next((item for item in store.deferred if isinstance(item, _Observed)), None)
                    if first is not None:
                        self._due_at(first.step)
                    continue
                if not _on_device(store.deferred[0]):
                    self._flush(store, layer, kind, front=True)
                job = self._due_check(store, layer, kind, upto)
                if job is not None:
                    jobs.append(job)
                else:
                    self._due_at(self._due_step(store))
        if jobs:
            from ..cuda.epochs import Batch

            by_shape = {}
            for job in jobs:
                by_shape.setdefault((sum(len(run) for run in job[4]), tuple(job[4][0].shape[1:])), []).append(job)
            for (n, shape), items in by_shape.items():
                # every job's blocks, from the queued steps' copies, in one allocation and one concatenation
                first = items[0][4][0]
                blocks = torch.empty((len(items), n, *shape), dtype=first.dtype, device=first.device)
                torch.cat([run for job in items for run in job[4]], out=blocks.view(-1, *shape))
                batch = Batch([(store.adapter, b) for (store, *_), b in zip(items, blocks)], stream=self._rule_stream())
                batch.scan()
                batch.chain()
                self._rule_batches.append((self._step_clock, batch, [(store, layer, kind, epoch, rest)
                                                                     for store, layer, kind, epoch, _, rest in items]))

    def _due_check(self, store: _Kind, layer: int, kind: int, upto: int):
        """Where the queued blocks of ``store``'s decode steps up to step ``upto`` (all with device copies)
        complete the adapter's next check: take those the check reads out of the queue and return the GPU
        rule's job, ``(store, layer, kind, the epoch before, the check's blocks on the device as runs, the
        blocks after it from the last run)``; otherwise None (the blocks wait)."""
        span = _check_span(store)
        if span is None or store.deferred[span[0] - 1].step > upto:
            return None
        taken, need = span
        runs = [item.device for item in store.deferred[:taken]]
        step = store.deferred[taken - 1].step
        del store.deferred[:taken]
        store.waiting -= store.adapter.until_check - need
        rest = []
        if need < 0:                                # the last run's blocks after the check, observed once it is decided
            last = runs[-1]
            runs[-1], rest = last[:len(last) + need], [_Observed(None, step, last[len(last) + need:])]
        return store, layer, kind, store.adapter.epoch, runs, rest

    def _finish_rule_batches(self, upto: int | None = None) -> None:
        """Take up the decisions of the GPU rule's decode checks launched at step ``upto`` or before (None:
        all, waiting for them): the epochs they append join the device tables and are published, and the
        blocks after each check are observed."""
        while self._rule_batches and (upto is None or self._rule_batches[0][0] <= upto):
            _, batch, items = self._rule_batches.pop(0)
            batch.finish()
            layers, appended = set(), []
            for store, layer, kind, before, rest in items:
                if store.adapter.epoch != before:
                    appended.append((store, [self._calibration.bases(layer, kind, e)
                                             for e in range(before + 1, store.adapter.epoch + 1)]))
                    layers.add(layer)
                store.deferred[:0] = rest
                store.waiting += _waiting(rest)
                self._due_at(self._due_step(store))     # where the blocks after the check complete the next one
            add_epochs_all(appended)                # every store's new epochs in one copy to the device
            for layer in sorted(layers):            # once every store holds its new epochs
                self._epochs_appended(layer)

    def _defer_observed(self, stores: list, n: int, copies: list, devices) -> None:
        """Queue a decode step's ``n`` finished blocks for the adapters of ``stores``, stamped with the step.  Where
        the rule runs on the GPU each store's ``devices`` (on the device, a copy of their own) wait until they
        complete the adapter's next check (:attr:`_Kind.waiting` counts them) and come due only then;
        otherwise each store's ``copies`` (a host copy in flight) come due at once, for the host rule to
        observe as they arrive."""
        clock = self._step_clock
        if not self._device_rule:
            for store, copied in zip(stores, copies):
                store.deferred.append(_Observed(copied, clock))
            self._due_at(clock)
            return
        due = False
        for store, device in zip(stores, devices):
            queue = store.deferred
            queue.append(_Observed(None, clock, device))
            store.waiting += n
            due = due or store.waiting >= store.adapter.until_check or not _on_device(queue[0])
        if due:
            self._due_at(clock)

    def _due_step(self, store: _Kind) -> int | None:
        """Where the GPU rule runs: the decode step from which ``store``'s queued blocks are due, the step of the
        block that completes its adapter's next check (0, at once, where blocks a prefill queued lead the
        queue), or None while they complete none."""
        if store.deferred and not _on_device(store.deferred[0]):
            return 0
        span = _check_span(store)
        return None if span is None else store.deferred[span[0] - 1].step

    def _due_at(self, step: int | None) -> None:
        """Blocks of decode step ``step`` wait for the rule: :meth:`_flush_due` takes them up from then on
        (None: none)."""
        if step is not None:
            self._next_due = step if self._next_due is None else min(self._next_due, step)

    def _publish(self, layer: int, kind: int, epoch: int) -> None:
        """Make ``epoch`` the one the device's decode appends encode ``layer``'s finished ``kind`` blocks with:
        its bases into the appends' bases buffer and its index into :attr:`_epochs_now`, both in place on
        the current stream, so that steps launched (or replayed) from now on use it and those launched
        before do not."""
        store = self._store[layer][kind]
        store.published = epoch
        if store.current is not None:
            words = self._encoder(store, None, epoch, layer, kind)._fixed[0]
            if isinstance(store.current, np.ndarray):           # the simulator's encoder holds NumPy words
                store.current[...] = words
            else:
                store.current.copy_(words)
        if self._epochs_now is not None:
            self._epochs_now[layer, kind] = epoch

    def _epochs_appended(self, layer: int) -> None:
        """Epochs were appended to ``layer``'s stores: their bases join the layer's attention base table in
        place (:meth:`epoch_table`), so that plans and captured steps launched with it stay valid (only a
        table that runs out of room is replaced, which drops what attention launches the layer with), and
        each store's newest epoch is published for the blocks its decode appends finish (:meth:`_publish`)."""
        if layer in self._epoch_tables:
            self.epoch_table(layer)
        for kind, store in zip(KINDS, self._store[layer]):
            if store.adapter is not None and store.published != store.adapter.epoch:
                self._publish(layer, kind, store.adapter.epoch)

    def _flush_all(self) -> None:
        self._finish_rule_batches()
        with self._settling_once():
            for layer, layer_store in enumerate(self._store):
                for kind, store in zip(KINDS, layer_store):
                    if store.deferred:
                        self._flush(store, layer, kind)

    def _reserve(self, updates: list, jobs: list) -> None:
        """Make room for ``updates`` (``jobs``: their :meth:`_reserve_jobs`; growing, where allowed) or raise before
        anything is written.

        The reference codec has encoded already, so its counts are exact: each layer and kind's share of
        the raw-tile arena is lent what its overflowing tiles need.  The CUDA encoder decides slot or raw
        tile as it writes: each share is lent what its tiles may need at about twice the arena's planned
        rate (every tile, for a few); where the free records (a lower bound, read from the device only
        when the bound is short) cover every tile, the update is certain to fit; otherwise
        :meth:`_encode_on_device` checks after encoding, lends more and encodes again if a list ran dry.
        """
        need_blocks = self._blocks_needed(updates)
        # a removal's records: a join's prompt waits for the steps queued before it only where its pools fall short
        self._take_returns_for((store, n) for store, n, _, _ in jobs)
        short = []               # (pool, records it lacks) or (None, blocks the table must hold)
        if need_blocks > self.max_blocks:
            short.append((None, need_blocks))
        exact = [(store.raw, int((~fits).sum())) for store, _, fits, _ in jobs if fits is not None]
        guess = self._raw_guesses(jobs)
        short += self._arena.cover(exact)
        # a guess lends what the arena holds and never grows it: where the tiles take more, the encode's
        # check finds out and the arena grows by what they took, not by a guess; so it is lent by the shares'
        # lower bounds, without waiting for the device's counts where the loans go in place
        self._arena.cover(guess, read=False, known=self._counts_known)
        # The device's exact counts where a job's lower bounds together fall short of its tiles: one wait for all
        # such pools.  Where they cover the tiles the update has room whatever the counts are (a pool whose own
        # bound is short, as a share of the arena's usually is, is read after the encodes, which check it), so
        # in a serving loop the reservation does not wait for the steps queued ahead.  (A count already exact
        # needs no wait: a new cache's, or one read since its last encode.)
        stale = [pool for store, n, fits, _ in jobs if fits is None and self._room_lower(store) < n
                 for pool in (store.slots, store.raw) if not pool.exact]
        if stale:
            sync_pools(stale)
        for store, n, fits, _ in jobs:
            if fits is None:
                room = self._room_lower(store)
                if room < n:
                    pool = store.slots if store.slots.free_lower() < n else store.raw
                    short.append((pool, n - room))
            elif int(fits.sum()) > store.slots.n_free():
                short.append((store.slots, int(fits.sum()) - store.slots.n_free()))
        if short and not self.grow:
            raise self._exhausted(*short[0], "this update")
        for pool, n in short:
            if pool is None:
                self._grow_blocks(grown(self.max_blocks, n - self.max_blocks))
        pools = [(pool, n) for pool, n in short if pool is not None]
        if pools:
            grow_pools(pools)
            self._storage_changed()

    def _reserve_waits(self, updates: list, jobs: list) -> bool:
        """Whether :meth:`_reserve` of ``updates`` (``jobs``: their :meth:`_reserve_jobs`) may wait for the device
        or grow anything; False where it certainly does neither: every update is the CUDA encoder's (its tiles
        slot or raw as they are encoded), the block table holds the new blocks, each job's slot pool alone has a
        free record for every tile by its lower bound (then no bound falls short, so neither a removal's records
        nor the device's counts are waited for, and nothing grows), and the arena lends the raw shares their
        guesses without reading a count (:meth:`~gaac.cache.pools.RawArena.covers_unread`; a new cache's first
        prompt reads them)."""
        if self._blocks_needed(updates) > self.max_blocks:
            return True
        if any(fits is not None or store.slots.free_lower() < n for store, n, fits, _ in jobs):
            return True
        return not self._arena.covers_unread(self._raw_guesses(jobs), known=self._counts_known)

    @property
    def _counts_known(self) -> bool:
        """Whether the pools' exact counts (:meth:`~gaac.cache.pools.DevicePool.settled`: no encode or append
        launched since the host read or set them) are the device's: no plan of device-driven steps was made for
        this cache, whose steps pop records that the host accounts only when told (``replayed()``; an eager
        step's appends are accounted, their counts asked for, by the cache's next call at the latest).  A prompt
        then lends its raw shares new lists, or spreads the arena's reserve, without reading a count where the
        counts have come back since the last encode or step: a new cache's first prompt, a join in an eager loop
        whose steps the device has caught up with."""
        return not self.serving.device_steps

    def _blocks_needed(self, updates: list) -> int:
        """The blocks the longest sequence of ``updates`` holds once they are written: what the table must hold."""
        return max(int(self._lens[u.layer, s]) // L.BLOCK_TOKENS + q for u in updates for s, q in zip(u.seqs, u.blocks))

    def _reserve_jobs(self, updates: list) -> list:
        """``(store, tiles, fits, guess)`` of each layer and kind ``updates`` encode (``fits`` None: the CUDA
        encoder's; ``guess``: then the raw records to lend its share, :meth:`_raw_guess`, made once for both
        :meth:`_reserve_waits` and :meth:`_reserve`)."""
        jobs = []
        for u in updates:
            for kind in KINDS:
                if u.tiles[kind] is not None:
                    store, n, fits = self._store[u.layer][kind], u.tiles[kind].shape[0], u.fits[kind]
                    jobs.append((store, n, fits, self._raw_guess(store.raw, n) if fits is None else None))
        return jobs

    def _raw_guesses(self, jobs: list) -> list:
        """``(raw share, records to lend it)`` for each CUDA-encoded job of ``jobs`` (their guesses)."""
        return [(store.raw, guess) for store, _, fits, guess in jobs if fits is None]

    def _room_lower(self, store: _Kind) -> int:
        """Records ``store``'s tiles can take at least, by the bounds (no wait): its free slots and raw records and
        what the arena's reserve can lend it."""
        return store.slots.free_lower() + store.raw.free_lower() + self._arena.reserve

    def _take_returns_for(self, needs) -> None:
        """Give back a removal's records whose copy has arrived, and all of them (waiting for their copies) where
        a ``(store, tiles)`` of ``needs`` (an iterable, read only while records are on their way) may lack room by
        the bounds without them: a slot or raw record a tile, and a slot for each where every tile may fit one."""
        self._take_returns(wait=False)
        if self._returning and any(store.slots.free_lower() < tiles or self._room_lower(store) < tiles
                                   for store, tiles in needs):
            self._take_returns()

    def _raw_guess(self, share, tiles: int) -> int:
        """Raw records to lend ``share`` before the CUDA encoder codes ``tiles`` of its tiles: every tile for a
        few (a decode step's blocks), else about twice the arena's planned rate, or the share's rate where an
        encode of its layer and kind ran dry before (:attr:`~gaac.cache.pools._Share.seen_rate`), whichever
        is higher (the encode checks after)."""
        chunk = self._arena.chunk
        if tiles <= chunk:
            return tiles
        rate = max(2 * self._raw_share, share.seen_rate)
        return min(tiles, max(chunk, math.ceil(rate * tiles)))

    def _exhausted(self, pool, lack: int, what: str) -> PoolExhaustedError:
        """The error of ``what`` (an update, a step, an import) that lacks ``lack`` records of ``pool`` (None:
        blocks of the table): it names the pool or the arena, its size, what is free and what was asked."""
        if pool is None:
            return PoolExhaustedError(f"{what}: a sequence would hold {lack} blocks; the block table holds "
                                      f"{self.max_blocks} ({self.max_blocks * L.BLOCK_TOKENS} tokens) per sequence "
                                      "(make the cache with a larger max_blocks or budget, or grow=True)")
        if isinstance(pool, _Share):
            arena = pool.arena
            return PoolExhaustedError(f"{what}: {arena.name} is exhausted: {arena.size} records, "
                                      f"{arena.size - arena.available()} of them holding tiles; {pool.name} need "
                                      f"{lack} more than it can lend; remove a sequence or swap one out "
                                      "(export_sequence), or give the cache a larger budget")
        return PoolExhaustedError(f"{what}: {pool.name} is exhausted: it needs {lack} more records than the "
                                  f"{pool.n_free()} of {pool.size} free; remove a sequence or swap one out "
                                  "(export_sequence), or give the cache a larger budget")

    def _encode_on_device(self, updates: list, only: set | None = None, guessing: bool = False,
                          before_check=None, ran_dry=None) -> bool:
        """Encode every finished tile of ``updates`` (of its ``(id(update), kind)`` pairs in ``only``) into its
        pools with the CUDA encoder (one launch per epoch run and kind, or per kind where the rule's rows give
        each block's epoch), leaving each tile's table entry in ``u.entries``; return True.

        Where :meth:`_reserve` could not prove that the records suffice, the device's counts are read
        after the launches: if a free list ran dry, the counts of each store whose list ran dry are put back
        (the records taken return to their lists; nothing else was written), the pool grows (``grow``) and
        those stores' jobs are encoded again, the others keeping what they wrote; or, every count put back,
        :class:`PoolExhaustedError` is raised with the cache unchanged.  With ``guessing``
        (some epochs are the rule's, still being decided) a list that runs dry returns False instead, the
        counts put back: the epochs the rule decides may need fewer records.  ``before_check`` runs once,
        after the first launches and before that wait (host work that overlaps the encodes); ``ran_dry``
        runs where a list ran dry, before the counts are put back."""
        jobs = [(u, kind) for u in updates for kind in KINDS if u.tiles[kind] is not None
                and (only is None or (id(u), kind) in only)]
        kept = []               # (update, kind, counts before) of the jobs whose encodes stand after a list ran dry
        while True:
            unsure = [(u, kind) for u, kind in jobs
                      if min((store := self._store[u.layer][kind]).slots.free_lower(), store.raw.free_lower())
                      < u.tiles[kind].shape[0]]
            # where a list may run dry or the rule may undo a guess, every job's counts, so that they can be put
            # back (one copy for all of them)
            saved = {}
            if unsure or any(u.epochs[kind].blocks is not None for u, kind in jobs):
                stores = [self._store[u.layer][kind] for u, kind in jobs]
                copies = torch.stack([store.heads for store in stores])
                held = self._host_copy(copies)   # on its way to the host before the encodes are launched
                saved = {id(store): _Counts(copies[i], held, i) for i, store in enumerate(stores)}
            unsure_ids = {(id(u), kind) for u, kind in unsure}
            asked = []           # where a list may run dry the counts are read below, after a wait
            # every job's escape counts, and the table entries of a job the table cannot take in place: views of
            # one allocation
            out = torch.empty(sum((1 if self._in_table(u) is not None else 2) * u.tiles[kind].shape[0]
                                  for u, kind in jobs), dtype=torch.int32, device=self.device)
            at = 0
            for u, kind in jobs:
                store = self._store[u.layer][kind]
                if u.epochs[kind].blocks is not None:     # the rule is still deciding: keep what to go back to
                    u.heads_before[kind] = saved[id(store)]
                tiles, plan, per = u.tiles[kind], u.epochs[kind], self.tiles_per_block
                n = tiles.shape[0]
                rows = self._in_table(u)
                if rows is not None:
                    entries, used, at = store.table[rows].reshape(-1), out[at:at + n], at + n
                else:
                    entries, used, at = out[at:at + n], out[at + n:at + 2 * n], at + 2 * n
                if plan.blocks is not None and plan.rows is not None:     # each block's epoch read on the device
                    encoder = self._encoder(store, plan, plan.first_new - 1, u.layer, kind)
                    encoder.in_place_by_rows(tiles.bits, plan.table, plan.rows, entries, used)
                else:
                    for epoch, start, stop in _runs(plan.epochs):
                        a, z = start * per, stop * per
                        encoder = self._encoder(store, plan, epoch, u.layer, kind)
                        if isinstance(tiles, _InPlace):
                            encoder.in_place(tiles.bits, start, entries[a:z], used[a:z], checked=False)
                        else:
                            encoder(tiles[a:z], entries[a:z], used[a:z])
                u.entries[kind] = entries
                self._encodes_launched(store, tiles.shape[0])
                if (id(u), kind) not in unsure_ids:
                    asked.append(store)
            self._ask_counts(asked)
            if before_check is not None:
                before_check()
                before_check = None
            checked = [pool for u, kind in unsure for pool in self._pools(u.layer, kind)]
            if checked:
                # one wait for the device: every job's counts (those in doubt, and what each share took)
                sync_pools([pool for u, kind in jobs for pool in self._pools(u.layer, kind)])
            over = [(pool, pool.taken - pool.listed) for pool in checked if pool.taken > pool.listed]
            if not over:
                return True
            if ran_dry is not None:
                ran_dry()
            # What each job's share of the arena took (past its list's end where it ran dry): what the same
            # tiles take when encoded again.
            stores = [self._store[u.layer][kind] for u, kind in jobs]
            took = [(store.raw, store.raw.taken - int(saved[id(store)].host()[store.raw.cls])) for store in stores]
            for (u, kind), (share, n) in zip(jobs, took):
                share.seen_rate = max(share.seen_rate, n / u.tiles[kind].shape[0])
            if guessing:        # the caller encodes every job again, with the rule's epochs
                self._put_back([(u, kind, saved[id(store)]) for (u, kind), store in zip(jobs, stores)])
                return False
            # Only the stores a list of which ran dry go back and encode again; the others keep what they wrote
            # (each store's lists are its own: its records, its counts).
            dry = {id(pool) for pool, _ in over}
            again = [id(store.slots) in dry or id(store.raw) in dry for store in stores]
            kept += [(u, kind, saved[id(store)]) for (u, kind), store, a in zip(jobs, stores, again) if not a]
            jobs, stores, took = ([x for x, a in zip(xs, again) if a] for xs in (jobs, stores, took))
            self._put_back([(u, kind, saved[id(store)]) for (u, kind), store in zip(jobs, stores)])
            # Every share is lent what it takes (so that lending to one never leaves another short); a slot
            # pool, or an arena that cannot lend enough, grows (grow=True) or the update is refused.
            lack = [(pool, n) for pool, n in over if not isinstance(pool, _Share)]
            lack += self._arena.cover(took)
            if lack and not self.grow:
                self._put_back(kept)        # refused: the cache as it was
                raise self._exhausted(*lack[0], "this update")
            grow_pools(lack, read=False)          # the counts are the put back ones, nothing launched since
            self._storage_changed()

    def _in_table(self, u: _Update) -> tuple | None:
        """Where the encoder writes ``u``'s table entries straight into the table: the one sequence's rows of
        the blocks the update finishes (contiguous), past its length, which nothing reads until the update
        is committed, and which a later update overwrites if this one is undone.  None for an update of
        several sequences (its entries go to a buffer the commit copies from).  Found once an update (the
        encodes and the commit ask for each kind): the length it starts from is the same until it commits, and
        again where a commit is undone."""
        if u.in_table is _UNKNOWN:
            if len(u.seqs) != 1 or not u.blocks[0]:
                u.in_table = None
            else:
                seq, first = u.seqs[0], int(self._lens[u.layer, u.seqs[0]]) // L.BLOCK_TOKENS
                u.in_table = seq, slice(first, first + u.blocks[0])
        return u.in_table

    def _put_back(self, undo: list) -> None:
        """Undo encodes: for each ``(update, kind, counts)`` of ``undo`` the store's free lists go back to the
        :class:`_Counts` saved before its encode (the records taken return to their lists; nothing else was
        written) and its entries are dropped.  The host takes the saved counts as the pools' own: they were
        copied to the host before the encodes, so nothing waits for the encodes."""
        for u, kind, counts in undo:
            self._store[u.layer][kind].heads.copy_(counts.device)
            u.entries[kind] = None
        stores = [self._store[u.layer][kind] for u, kind, _ in undo]
        counts_read([pool for store in stores for pool in (store.slots, store.raw)],
                    [store.heads for store in stores], [counts.host() for _, _, counts in undo])

    def _encodes_launched(self, store: _Kind, tiles: int) -> None:
        """``store``'s pools count the records that encodes of ``tiles`` tiles, just launched, may take."""
        for pool in (store.slots, store.raw):
            pool.pending += tiles

    @property
    def _counts_copied(self) -> bool:
        """Whether the pools' counts come to the host in asynchronous copies (:meth:`_ask_counts`): on a GPU; on
        the CPU a pool reads them where they lie."""
        return self.device.type == "cuda"

    def _ask_counts(self, stores: list) -> None:
        """On a GPU, ask for the device's free-list counts of ``stores`` (after the encodes just launched) in
        one asynchronous copy (of the counts where they lie, as the cache makes them: at equal distances in
        one allocation); each pool's lower bound of free records takes its count up once it has arrived (no
        synchronisation), every pool reading its row of one NumPy view of the copy."""
        if not self._counts_copied or not stores:
            return
        host, arrival = self._host_copy_rows([store.heads for store in stores])
        for store, row in zip(stores, host.numpy()):
            counts = (row, arrival)
            store.slots.snapshot(counts)
            store.raw.snapshot(counts)

    def _pools(self, layer: int, kind: int) -> tuple:
        store = self._store[layer][kind]
        return store.slots, store.raw

    def _encoder(self, store: _Kind, plan: _Epochs, epoch: int, layer: int, kind: int):
        """The CUDA codec's EncodePlan of ``store``'s pools and ``epoch``'s bases, made once; the bases come
        from the host (:meth:`_tile_bases`), so that making a plan never waits for the device."""
        key = (epoch, store.pools_key())
        enc = store.encoders.get(key)
        if enc is None:
            from ..cuda.codec import EncodePlan, pack_bases

            # An epoch's bases outlive the pools' versions (growth, removals make new free lists).  Those of an
            # epoch the store holds are packed on the device from its per-tile tables (a few small kernels, where
            # a copy from the host pins a buffer: a quarter of a millisecond behind queued steps, for each epoch a
            # join appends and publishes); those of an epoch the GPU rule appends may come packed on the device;
            # others are packed here and copied over.
            bases = store.packed.get(epoch)
            held = store.tb3.shape[0]
            if bases is None and epoch < held:
                bases = store.packed[epoch] = torch.stack([store.tb3[epoch], store.tb4[epoch]], dim=1).to(torch.int16)
            elif bases is None and plan is not None and 0 <= epoch - held < len(plan.packed):
                bases = plan.packed[epoch - held]
            elif bases is None:
                bases = self._to_device(pack_bases(*self._tile_bases(store, plan, epoch, layer, kind)))
            # a plan of the same pools for another epoch differs only in its bases
            same = next((e for k, e in store.encoders.items() if k[1] == key[1]), None)
            enc = (same.with_bases(bases) if same is not None else
                   EncodePlan.of_pools(self.geometry.channels, store.capacity, bases, store.slots.data,
                                       store.slots.order, store.raw.data, store.raw.order, store.heads))
            if epoch < store.tb3.shape[0]:          # an epoch this update appends is cached once committed
                store.encoders = {k: e for k, e in store.encoders.items() if k[1] == key[1]}
                store.encoders[key] = enc
        return enc

    def _commit_all(self, updates: list, observe: bool = True) -> None:
        """:meth:`_commit` every update of ``updates``.  Where they add the same tokens to the same sequence in
        layers whose tails (and block-epoch indices) lie evenly spaced in one allocation -- a prompt's layers,
        as the cache lays them out -- each of those arrays is written for every layer and kind with one copy
        rather than one a layer and kind."""
        # every store's new epochs: into the calibration, then to the device in one copy (before any layer's
        # attention table takes them up, which reads both)
        appending = [(u, kind) for u in updates for kind in KINDS
                     if u.tiles[kind] is not None and u.epochs[kind].tables]
        self._calibration.add_epochs((u.layer, kind, b3, b4) for u, kind in appending
                                     for b3, b4 in u.epochs[kind].tables)
        add_epochs_all([(self._store[u.layer][kind], u.epochs[kind].tables) for u, kind in appending])
        for u, kind in appending:           # the encoders' bases the GPU rule packed, kept for later plans
            store, plan = self._store[u.layer][kind], u.epochs[kind]
            held = store.tb3.shape[0] - len(plan.tables)
            store.packed.update((held + i, bases) for i, bases in enumerate(plan.packed))
        together = self._together(updates)
        tails = epochs = False
        if together is not None:
            seq, r, t, q, first = together
            tails = _records_view([self._store[u.layer][kind].tail for u in updates for kind in KINDS])
            # the tokens past the last finished block, every layer and kind's stacked: [jobs, heads, rest, D]
            at, rest = _tail_part(r, t, q)
            if tails is not None and rest:
                tails[:, seq, :, at:at + rest].copy_(
                    torch.stack([u.new[kind][0, :, t - rest:] for u in updates for kind in KINDS]))
            index = _records_view([self._store[u.layer][kind].epoch for u in updates for kind in KINDS]) if q else None
            if index is not None:
                values = np.stack([u.epochs[kind].epochs[:q] for u in updates for kind in KINDS])
                index[:, seq, first:first + q].copy_(self._to_device(values.astype(np.int16)))
            tails, epochs = tails is not None, index is not None
        for u in updates:
            self._commit(u, observe, tails=not tails, epochs=not epochs)

    def _together(self, updates: list) -> tuple | None:
        """``(seq, r, t, q, first)`` where every update of ``updates`` adds ``t`` tokens to the one sequence
        ``seq``, in each layer from a length ``first * 16 + r`` and finishing ``q`` blocks (so that one copy
        can write what each writes); else None."""
        if len(updates) < 2 or any(len(u.seqs) != 1 for u in updates):
            return None
        seq, t, q = updates[0].seqs[0], updates[0].new[0].shape[2], updates[0].blocks[0]
        n = int(self._lens[updates[0].layer, seq])
        if any(u.seqs[0] != seq or u.new[0].shape[2] != t or int(self._lens[u.layer, seq]) != n for u in updates):
            return None
        if q and any(u.tiles[kind] is None for u in updates for kind in KINDS):
            return None
        return seq, n % L.BLOCK_TOKENS, t, q, n // L.BLOCK_TOKENS

    def _commit(self, u: _Update, observe: bool = True, tails: bool = True, epochs: bool = True) -> None:
        """Write an update prepared and reserved for: slots, raw tiles, table entries, tails, the host's
        lengths (the caller copies them to the device).  ``observe``: a CPU cache's adapters observe the
        new blocks now (else the caller has them do it).  ``tails`` / ``epochs`` False: the caller writes the
        tails / the device's block-epoch index.  :meth:`_commit_all` has appended the update's new epochs."""
        per = self.tiles_per_block
        for kind in KINDS:
            store, tiles, fits = self._store[u.layer][kind], u.tiles[kind], u.fits[kind]
            if tiles is not None:
                self._commit_epochs(store, u, kind, observe, device=epochs)
                if u.entries[kind] is not None:
                    entries = u.entries[kind]
                    rows = self._in_table(u)
                    if rows is not None and entries.data_ptr() == store.table[rows].data_ptr():
                        entries = None            # the encoder wrote them in place
                else:
                    slot_at = store.slots.take(int(fits.sum()))
                    raw_at = store.raw.take(int((~fits).sum()))
                    store.slots.data[torch.from_numpy(slot_at).to(self.device)] = u.slots[kind].to(self.device)
                    fits_t = torch.from_numpy(fits).to(self.device)
                    store.raw.data[torch.from_numpy(raw_at).to(self.device)] = tiles[~fits_t]
                    entries = np.empty(len(fits), dtype=np.int64)
                    entries[fits] = slot_at
                    entries[~fits] = raw_at | L.TABLE_RAW_FLAG
                    entries = torch.from_numpy(entries.astype(np.uint32).view(np.int32)).to(self.device)
                start = 0
                for seq, q in zip(u.seqs, u.blocks):
                    if entries is None:
                        break
                    first = int(self._lens[u.layer, seq]) // L.BLOCK_TOKENS
                    store.table[seq, first:first + q] = entries[start:start + q * per].reshape(q, per)
                    start += q * per
            new = u.new[kind]
            t = new.shape[2]
            for i, (seq, q) in enumerate(zip(u.seqs, u.blocks)):
                if not tails:
                    break
                at, rest = _tail_part(int(self._lens[u.layer, seq]) % L.BLOCK_TOKENS, t, q)
                if rest:
                    store.tail[seq, :, at:at + rest] = new[i, :, t - rest:]
        for seq, q in zip(u.seqs, u.blocks):
            self._lens[u.layer, seq] += u.new[0].shape[2]
            self.blocks_encoded += q

    def _commit_epochs(self, store: _Kind, u: _Update, kind: int, observe: bool = True,
                       device: bool = True) -> None:
        """Apply an update's epoch decisions (its new epochs already appended, :meth:`_commit_all`): the
        layer's tables take them up, the adapter's state, each finished block's epoch (on the device too,
        unless ``device`` is False: the caller writes it)."""
        plan = u.epochs[kind]
        if plan.tables:
            self._epochs_appended(u.layer)
        if plan.after is not None:
            plan.after.calibration = self._calibration
            store.adapter = plan.after
            if plan.lead:                           # the decode blocks its rule batch checked first
                del store.deferred[:len(plan.lead)]
                store.waiting = _waiting(store.deferred)
        elif plan.pending is not None:
            store.deferred.append(plan.pending)
            if self.device.type != "cuda" and observe:
                self._flush(store, u.layer, kind)
        start = 0
        for seq, q in zip(u.seqs, u.blocks):
            if not q:
                continue
            first = int(self._lens[u.layer, seq]) // L.BLOCK_TOKENS
            new = plan.epochs[start:start + q]
            store.epochs[seq, first:first + q] = new
            if store.epoch is not None and device:
                if (new == new[0]).all():     # one epoch: a device fill, no copy from the host
                    store.epoch[seq, first:first + q] = int(new[0])
                else:
                    store.epoch[seq, first:first + q].copy_(self._to_device(new.astype(np.int16)))
            start += q
