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
planned with :meth:`PagedKVCache.decode_plan` is reserved for every layer at once.
``grow=True`` instead enlarges a pool or table that runs out (what a dynamic cache
such as ``gaac.hf.GAACCache`` wants).

Arrays are torch tensors on the cache's device, in the dtypes of
:class:`gaac.cache.view.LayerView`, so :meth:`PagedKVCache.layer_view` hands
attention the live storage without a copy.  The tile codec is the NumPy
reference on the CPU; on a CUDA device it is :mod:`gaac.cuda.codec`.
"""
from __future__ import annotations

import copy
import functools
import math
import operator
import sys
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import layout as L
from ..arrays import as_bits
from .view import LayerView
from ..calibration import Calibration
from ..epochs import EPOCH_INDEX_BYTES, Adapter, epoch_table_bytes
from ..budget import Capacity, raw_share, size_cache
from ..errors import CalibrationError, FormatError, InputError, PoolExhaustedError
from .pools import Arrival, DevicePool, Pool, RawArena, _Share, grown, sync_pools
from ..progress import progress
from ..reference.codec import decode_entries, encode_tiles
from ..serving.append import append_token
from ..serving.graph import RECORDING, check_not_recording
from ..serving.state import ServingState
from ..tiles import tile_bases

KINDS = (L.KIND_K, L.KIND_V)
PROGRESS_TOKENS = 512        # appends of this many tokens show a progress bar on a terminal (PagedKVCache.append)
# Epochs a block's epoch index can name: it is stored as int16 (LayerView.epoch), so epochs 0..32767.
MAX_INDEXED_EPOCHS = L.MAX_INDEXED_EPOCHS
ADAPT_LAG = 2                # decode steps between a block's finish and the adaptation rule's look at it
EPOCH_ROOM = 16              # epochs a layer's attention base table holds at first (PagedKVCache.epoch_table)


def _locked(method):
    """Run a :class:`PagedKVCache` method holding the cache's lock (a re-entrant lock: methods call each other),
    after the host's account of an eager step's finished blocks where the step left it pending
    (:meth:`gaac.serving.plan.StepPlan.settle`: a step accounts once, at its last layer)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            self.serving.settle()
            return method(self, *args, **kwargs)
    return locked


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

class ReferenceCodec:
    """The NumPy reference codec (gaac.reference.codec) on torch CPU tensors."""

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
    """The numba.cuda kernels of :mod:`gaac.cuda.codec` (device tensors; NumPy/CPU tensors in the simulator).

    The cache encodes through :class:`gaac.cuda.codec.EncodePlan` straight into its pools, whose free
    lists live on the device (:class:`gaac.cache.pools.DevicePool`, :meth:`PagedKVCache._encode_on_device`); this class
    decodes, for reading a cache back.
    """

    def __init__(self):
        from ..cuda import codec

        self._codec = codec

    def decode(self, slots, raw, entries, tb3, tb4, capacity):
        # The kernels cannot take an empty pool; no entry points into one, so one zero record stands in.
        slots, raw = (p if p.shape[0] else p.new_zeros((1, *p.shape[1:])) for p in (slots, raw))
        out, status = self._codec.decode_tiles(slots, raw, entries.contiguous(), tb3, tb4, capacity)
        bad = torch.nonzero(status).flatten()
        if bad.numel():
            raise FormatError(f"slot of tile {int(bad[0])} does not decode (status {int(status[bad[0]])})")
        return out


def _codec_for(codec: str | None, device: torch.device):
    if codec is None:
        codec = "cuda" if device.type == "cuda" else "reference"
    if codec == "reference":
        if device.type != "cpu":
            raise InputError(f"the reference codec runs on the CPU; the cache is on {device} (use codec='cuda')")
        return ReferenceCodec()
    if codec == "cuda":
        return CudaCodec()
    raise InputError(f"codec {codec!r}: one of 'reference', 'cuda' (or None for the device's default)")


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
# Storage.

@dataclass
class _Kind:
    """One layer's storage for K or for V."""

    capacity: int
    slots: Pool                  # this layer and kind's slots
    raw: Pool                    # its share of the cache's raw-tile arena (gaac.cache.pools.RawArena)
    table: torch.Tensor          # int32 [max_seqs, max_blocks, tiles_per_block]
    tail: torch.Tensor           # int16 [max_seqs, kv_heads, 16, head_dim]
    b3: torch.Tensor             # uint8 [n_epochs, kv_heads, head_dim] on the device (for attention)
    b4: torch.Tensor
    tb3: torch.Tensor            # uint8 per-tile bases of one block [n_epochs, tiles_per_block, C] (for the codec)
    tb4: torch.Tensor
    epochs: np.ndarray           # int16 [max_seqs, max_blocks]: each finalized block's epoch (host: the logic's)
    epoch: torch.Tensor | None   # the same on the device (LayerView.epoch); None without adaptation
    adapter: Adapter | None      # None without adaptation
    heads: torch.Tensor | None = None    # int32 [2]: the device free lists' taken counts (CUDA codec)
    deferred: list = field(default_factory=list)    # finalized blocks on their way to the adapter (GPU)
    published: int = 0           # the epoch decode appends encode finished blocks with (PagedKVCache._publish)
    current: torch.Tensor | None = None             # its bases, packed for the CUDA encoder (current_bases)
    encoders: dict = field(default_factory=dict)    # (epoch, pools) -> the CUDA codec's EncodePlan
    packed: dict = field(default_factory=dict)      # epoch -> its per-tile bases packed for the CUDA codec (device)

    def add_epoch(self, b3: np.ndarray, b4: np.ndarray) -> None:
        """Append one epoch's bases ``[kv_heads, head_dim]`` to the device tables."""
        self.add_epochs([(b3, b4)])

    def add_epochs(self, tables: list) -> None:
        """Append epochs ``tables`` ((b3, b4) ``[kv_heads, head_dim]`` each, in order) to the device tables with
        one concatenation per table: appending them one by one would copy each table once per epoch."""
        tiles = [tile_bases(b3, b4) for b3, b4 in tables]
        for name, new in (("b3", [t[0] for t in tables]), ("b4", [t[1] for t in tables]),
                          ("tb3", [t[0] for t in tiles]), ("tb4", [t[1] for t in tiles])):
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, torch.from_numpy(np.stack(new).astype(np.uint8)).to(old.device)]))

    def pools_key(self) -> tuple:
        """What an EncodePlan bakes in: the versions of the pools' arrays and free lists."""
        return self.slots.version, self.raw.version


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
                                                                       # encode: the free lists' heads before it


def _arrived(blocks) -> np.ndarray:
    """Blocks on their way to an adapter, on the host: a pinned copy and its event (GPU; waited for), or an
    array."""
    if isinstance(blocks, tuple):
        host, event = blocks
        event.synchronize()
        return host.numpy()
    return np.asarray(blocks)


@dataclass
class _Observed:
    """Finished blocks of a decode step on their way to an adapter (a host copy in flight), and the step
    (:attr:`PagedKVCache._step_clock`) that finished them: the rule takes them up :data:`ADAPT_LAG` steps later."""

    blocks: object
    step: int
    device: object = None        # the blocks on the device (for the GPU rule), else None


@dataclass
class _EarlyWrite:
    """An update committed before its encodes' counts are known (:meth:`PagedKVCache._written_early`), and what
    puts the cache back if a free list ran dry.  Only what later calls read is put back: the host's lengths,
    the tails that held tokens, the adapters and their pending blocks, the block count.
    Table entries and block epochs past the restored lengths are never read (a later update overwrites them),
    and no epoch was appended (the caller writes early only then)."""

    cache: object
    lens: np.ndarray
    adapters: list               # per store written: (layer, kind, its adapter, its deferred blocks' count)
    tails: list                  # (store, sequence, its tail before the write)
    blocks_encoded: int

    def undo(self) -> None:
        cache = self.cache
        cache._lens[...] = self.lens
        for layer, kind, adapter, n in self.adapters:
            store = cache._store[layer][kind]
            store.adapter = adapter
            del store.deferred[n:]
        for store, seq, tail in self.tails:
            store.tail[seq].copy_(tail)
        cache.blocks_encoded = self.blocks_encoded

    def settle(self) -> None:
        """The write stands: a CPU cache's adapters observe the new blocks now."""
        cache = self.cache
        if cache.device.type != "cuda":
            for layer, kind, _, _ in self.adapters:
                cache._flush(cache._store[layer][kind], layer, kind)


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


# ----------------------------------------------------------------------------------------------

class PagedKVCache:
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
    :class:`gaac.StepGraph`) keeps its own state in :attr:`serving` (a
    :class:`gaac.serving.state.ServingState`) and reaches the cache only through this storage interface:

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
    method the cache makes the account an eager step left pending (``serving.settle()``).
    """

    _rule_on_device: bool | None = None    # where an update runs the epoch rule (None: on a GPU, there)

    def __init__(self, calibration: Calibration, *, budget: int | float | None = None, max_seqs: int = 1,
                 max_blocks: int | None = None, slots: int | None = None, raw_tiles: int | None = None, device="cpu",
                 grow: bool = False, codec: str | None = None, adapt: bool = True):
        self._lock = threading.RLock()
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
        self.codec = _codec_for(codec, self.device)
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
        self._store = [[self._make_kind(layer, kind, max_seqs, max_blocks, n_slots) for kind in KINDS]
                       for layer in range(self.layers)]
        self._arena.cover([(store.raw, self._arena.chunk) for layer_store in self._store for store in layer_store])
        self._lens = np.zeros((self.layers, max_seqs), dtype=np.int64)       # host copy: the cache's logic
        self._seq_lens = torch.zeros((self.layers, max_seqs), dtype=torch.int32, device=self.device)
        self._live = np.zeros(max_seqs, dtype=bool)
        self._epoch_tables = {}      # layer -> [its attention base table, epochs written per kind] (epoch_table)
        self._epochs_now = None      # int32 [layers, 2] on the device: the published epochs (epochs_now)
        self._step_clock = 0         # decode steps accounted (account_decode_step): the rule's lag counts them
        self._next_due = None        # the earliest step whose finished blocks wait for the rule (_flush_due)
        self._rule_batches = []      # (step, GPU rule batch, its jobs) of decode checks in flight (_flush_due)
        self.storage_version = 0     # counts replacements of arrays that launches name (growth, a full epoch table)
        self.serving = ServingState()    # the decode steps' state: plans, launch states, appends (gaac.serving)
        self.blocks_encoded = 0      # (layer, sequence, block) finalizations, each encoding K and V once
        if self._cuda_codec:         # every layer's encoders for the calibration's bases, made with the pools
            for layer, layer_store in enumerate(self._store):
                for kind, store in enumerate(layer_store):
                    self._encoder(store, None, 0, layer, kind)

    def _make_kind(self, layer, kind, max_seqs, max_blocks, n_slots) -> _Kind:
        geo, dev = self.geometry, self.device
        capacity = int(self._calibration.capacity[kind, layer])
        # Without adaptation only epoch 0 codes blocks; with it, every epoch the calibration holds may.
        epochs = range(self._calibration.n_epochs(layer, kind)) if self.adapt else [0]
        b3, b4 = (np.stack(t) for t in zip(*(self._calibration.bases(layer, kind, e) for e in epochs)))
        tb3, tb4 = (np.stack(t) for t in zip(*(tile_bases(x3, x4) for x3, x4 in zip(b3, b4))))
        name = f"layer {layer} {L.KIND_NAMES[kind].upper()}"
        heads = None
        if self._cuda_codec:                      # the encoder pops records from free lists on the device
            heads = torch.zeros(2, dtype=torch.int32, device=dev)
            slots = DevicePool(f"{name} slot pool", n_slots, (geo.slot_bytes(capacity),), torch.uint8, dev, heads, 0)
        else:
            slots = Pool(f"{name} slot pool", n_slots, (geo.slot_bytes(capacity),), torch.uint8, dev)
        return _Kind(capacity=capacity, heads=heads, slots=slots,
                     raw=self._arena.share(f"{name} raw tiles", heads, 1),
                     table=torch.zeros((max_seqs, max_blocks, self.tiles_per_block), dtype=torch.int32, device=dev),
                     tail=torch.zeros((max_seqs, self.kv_heads, L.BLOCK_TOKENS, self.head_dim), dtype=torch.int16,
                                      device=dev),
                     b3=torch.from_numpy(np.ascontiguousarray(b3)).to(dev),
                     b4=torch.from_numpy(np.ascontiguousarray(b4)).to(dev),
                     tb3=torch.from_numpy(np.ascontiguousarray(tb3)).to(dev),
                     tb4=torch.from_numpy(np.ascontiguousarray(tb4)).to(dev),
                     epochs=np.zeros((max_seqs, max_blocks), dtype=np.int16),
                     epoch=torch.zeros((max_seqs, max_blocks), dtype=torch.int16, device=dev) if self.adapt else None,
                     adapter=Adapter(self._calibration, layer, kind) if self.adapt else None,
                     published=len(b3) - 1)

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
            state = self.__dict__.copy()
        del state["_lock"]                 # a lock is not copied or pickled: a copy gets a lock of its own
        return state

    def __setstate__(self, state):
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
    @_locked
    def sequences(self) -> list[int]:
        """Ids of the live sequences (their rows in every layer's block table)."""
        return [int(i) for i in np.flatnonzero(self._live)]

    @_locked
    def seq_len(self, seq: int, layer: int = 0) -> int:
        """Tokens sequence ``seq`` holds in ``layer``."""
        self._check_seq(seq)
        self._check_layer(layer)
        return int(self._lens[layer, seq])

    def _check_seq(self, seq) -> None:
        """A live sequence id: an integer (Python or NumPy; never a bool, float or string) of a live row."""
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)):
            raise InputError(f"sequence id {seq!r} is a {type(seq).__name__}: sequence ids are integers "
                             f"(live sequences: {self.sequences})")
        if not 0 <= seq < self.max_seqs or not self._live[seq]:
            raise InputError(f"sequence {seq!r} is not in the cache (live sequences: {self.sequences})")

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
    @_locked
    def add_sequence(self, k=None, v=None, *, show_progress: bool | None = None) -> int:
        """Start a sequence and return its id; ``k``/``v`` ``[layers, kv_heads, tokens, head_dim]`` prefill it.

        ``show_progress``: as in :meth:`append`.
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
                self.append(seq, k, v, show_progress=show_progress)
            except Exception:
                self._live[seq] = False
                raise
        return seq

    @_locked
    def remove_sequence(self, seq: int) -> None:
        """Drop a sequence: its slots and raw tiles go back to the free lists, its row is reusable."""
        self._check_seq(seq)
        stores = [store for layer_store in self._store for store in layer_store]
        rows = [store.table[seq, :int(self._lens[layer, seq]) // L.BLOCK_TOKENS].reshape(-1)
                for layer, layer_store in enumerate(self._store) for store in layer_store]
        # every store's entries in one copy to the host, every free list's count in one wait
        entries = torch.cat(rows).cpu().numpy().view(np.uint32).astype(np.int64)
        sync_pools([pool for store in stores for pool in (store.slots, store.raw) if not pool.exact])
        at = 0
        for store, row in zip(stores, rows):
            e = entries[at:at + row.numel()]
            at += row.numel()
            is_raw = (e & L.TABLE_RAW_FLAG) != 0
            store.slots.give(e[~is_raw])
            store.raw.give(e[is_raw] & L.TABLE_INDEX_MASK)
            store.table[seq] = 0
            store.epochs[seq] = 0
            if store.epoch is not None:
                store.epoch[seq] = 0
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
    @_locked
    def append(self, seq: int, k, v, *, show_progress: bool | None = None) -> None:
        """Append tokens ``[layers, kv_heads, t, head_dim]`` of K and V to sequence ``seq`` in every layer.

        All layers or none: if any pool cannot take the finished blocks, nothing changes.  A sequence
        longer than the block table (``max_blocks`` blocks of 16 tokens) is refused before any block is
        encoded, unless the cache was made with ``grow=True``.  ``show_progress``: a progress bar over
        the layers being encoded (None: on a terminal, for appends of at least ``PROGRESS_TOKENS`` tokens;
        the reference codec on a CPU encodes a few hundred blocks a second).
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
        self._apply([self._prepare(layer, [seq], k[layer][None], v[layer][None]) for layer in layers])

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
        """
        with self._lock:
            if RECORDING.plans:            # another cache's step is being recorded on this thread
                check_not_recording(self, "update_layer")
            serving = self.serving
            plan = serving.eager_plan
            if plan is not None and serving.recording is None and plan.append_token(layer, seqs, k, v):
                return
            self._update_layer(layer, seqs, k, v)

    @_locked
    def _update_layer(self, layer: int, seqs, k, v) -> None:
        """:meth:`update_layer` checked in full (any call its step plan's fast path does not take)."""
        self._check_layer(layer)
        recording = self.serving.recording
        if recording is not None and recording.places:
            # A step for a batch-size bucket: ``seqs`` is the recording's list of places, which may hold
            # free places (-1); the recording checks it.
            recording.record_append(layer, seqs, self._bits(k, "k", 4), self._bits(v, "v", 4))
            return
        seqs = self._check_seqs(seqs)
        if len(set(seqs)) != len(seqs):
            raise InputError(f"sequences {seqs}: each may appear once")
        k, v = self._bits(k, "k", 4), self._bits(v, "v", 4)
        if k.shape != v.shape or k.shape[0] != len(seqs):
            raise InputError(f"k {list(k.shape)} and v {list(v.shape)} must both be [{len(seqs)} sequences, "
                             f"kv_heads, tokens, head_dim]")
        if recording is not None:
            recording.record_append(layer, seqs, k, v)
            return
        if k.shape[2] == 1 and append_token(self, layer, seqs, k, v):
            return
        self._apply([self._prepare(layer, seqs, k, v)])

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        """A host array on the cache's device without waiting for the device (pinned, asynchronous copy)."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _apply(self, updates: list) -> None:
        """Reserve, encode (GPU) and commit prepared updates: all of them, or nothing and an error.

        On a GPU the adaptation rule runs while the host reserves and launches the encodes: the blocks a
        rule still decides are encoded with their layer's newest epoch, which is what the rule keeps unless
        it appends an epoch; where it does, that layer and kind is encoded again once the decision is in (every
        one, where a guessed epoch ran a free list dry).  The host takes the rule's decisions while the
        encodes run.  Where the rule keeps every guess and appends no epoch, the host also writes the update
        (tables, tails, lengths, block epochs, adapters) before it waits for the encodes' counts, and undoes
        that write if a free list ran dry (:meth:`_written_early`)."""
        rule = self._launch_rule(updates)
        encoded, redo, done, early = True, [], False, None

        def decided():          # the rule's decisions, taken once: before the encodes are checked, or on an error
            nonlocal redo, done
            if not done:
                done = True
                redo = self._finish_rule(rule)

        def before_check():
            nonlocal early
            decided()
            if not redo and not any(u.epochs[kind] is not None and u.epochs[kind].tables
                                    for u in updates for kind in KINDS):
                early = self._written_early(updates)

        def ran_dry():
            nonlocal early
            if early is not None:
                early.undo()
                early = None

        try:
            self._reserve(updates)
            if self._cuda_codec:
                encoded = self._encode_on_device(updates, guessing=bool(rule), before_check=before_check,
                                                 ran_dry=ran_dry)
        finally:
            decided()
        if not encoded:                 # a guessed epoch ran a free list dry: encode with the rule's epochs
            self._encode_on_device(updates)
        elif redo:
            self._encode_again(redo)
        if early is None:
            for u in updates:
                self._commit(u)
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

    def _written_early(self, updates: list) -> "_EarlyWrite":
        """Commit ``updates`` while their encodes may still run dry: what the write changes that a later
        update could see is kept to be put back (:class:`_EarlyWrite`).  The adapters' observation of the
        new blocks waits for :meth:`_EarlyWrite.settle`."""
        tails = [(store, seq, store.tail[seq].clone()) for u in updates for store in self._store[u.layer]
                 for seq in u.seqs if self._lens[u.layer, seq] % L.BLOCK_TOKENS]
        adapters = [(u.layer, kind, store.adapter, len(store.deferred))
                    for u in updates for kind, store in zip(KINDS, self._store[u.layer])]
        early = _EarlyWrite(self, lens=self._lens.copy(), adapters=adapters, tails=tails, blocks_encoded=self.blocks_encoded)
        for u in updates:
            self._commit(u, observe=False)
        return early

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

    def _prepare(self, layer: int, seqs: list, k: torch.Tensor, v: torch.Tensor) -> _Update:
        """Cut the blocks the new tokens complete and decide their epochs; with the reference codec also
        encode them (the CUDA encoder writes into the pools, after :meth:`_reserve`).  Nothing in the
        cache changes."""
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
            plan = self._plan_epochs(store, layer, kind, finished)
            tiles.append(_InPlace((k, v)[kind][0], len(finished) * per) if in_place else blocks_to_tiles(finished))
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

    def _plan_epochs(self, store: _Kind, layer: int, kind: int, finished: torch.Tensor) -> _Epochs:
        """The epoch each of ``finished`` ``[n, heads, 16, D]`` is coded with; the cache's adapter stays as it is.

        Where the blocks reach no check before their last one, the newest epoch codes them all and
        the adapter only has to observe them, after commit; on a GPU their copy to the host is
        started here and waited for only when the adapter next needs them (:meth:`_flush`), which in
        a decode loop is a block later.  Otherwise the rule runs now, on a copy of the adapter and of
        the calibration, in runs of at most ``until_check`` blocks (:meth:`gaac.epochs.Adapter.assign`).
        """
        n = len(finished)
        adapter = store.adapter
        if adapter is None:
            return _Epochs(epochs=np.zeros(n, np.int64), tables=[], after=None, pending=None)
        self._flush(store, layer, kind)
        if n <= adapter.until_check:
            return _Epochs(epochs=np.full(n, adapter.epoch, np.int64), tables=[], after=None,
                           pending=self._host_copy(finished))
        if self._device_rule:
            return _Epochs(epochs=None, tables=[], after=adapter, pending=None, blocks=finished)
        after = copy.deepcopy(adapter, {id(adapter.calibration): self._calibration.copy(share_tables=True)})
        host = finished.cpu().numpy().view(np.uint16)
        epochs = after.assign(host)
        tables = [after.calibration.bases(layer, kind, e) for e in range(adapter.epoch + 1, after.epoch + 1)]
        return _Epochs(epochs=epochs, tables=tables, after=after, pending=None)

    def _launch_rule(self, updates: list) -> list:
        """Launch the adaptation rule on the GPU for every (layer, kind) of ``updates`` that reaches a check:
        one batch per shape of finished blocks (:class:`gaac.cuda.epochs.Batch`).  Until
        :meth:`_finish_rule`, each such plan's epochs are its adapter's newest epoch for every block (the
        encode's guess)."""
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
            plan.first_new = plan.after.epoch + 1
            plan.epochs = np.full(len(plan.blocks), plan.after.epoch, np.int64)
            after = copy.copy(plan.after)
            after.calibration, after._recent = calibration, list(after._recent)
            plan.after = after
        by_shape = {}
        for item in waiting:
            by_shape.setdefault(tuple(item[2].blocks.shape), []).append(item)
        launched = []
        for items in by_shape.values():
            batch = Batch([(plan.after, plan.blocks) for _, _, plan in items], stream=self._rule_stream())
            batch.scan()
            batch.chain()
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

    def _finish_rule(self, launched: list) -> list:
        """Wait for the rule's decisions and put them in the plans; return the (update, kind) pairs whose
        encode guessed an epoch the rule did not keep."""
        redo = []
        for batch, items in launched:
            for (u, kind, plan), epochs in zip(items, batch.finish()):
                guessed = plan.epochs
                plan.epochs = epochs
                plan.tables = [plan.after.calibration.bases(u.layer, kind, e)
                               for e in range(plan.first_new, plan.after.epoch + 1)]
                plan.blocks = None
                if u.entries[kind] is not None and not np.array_equal(guessed, epochs):
                    redo.append((u, kind))
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

    def _host_copies(self, tensors: list) -> list:
        """Equal-shaped device tensors on the host, each as :meth:`_host_copy` gives it (a pinned copy in
        flight and its event), made with one kernel, one pinned buffer and one copy for all of them."""
        if self.device.type != "cuda":
            return [self._host_copy(t) for t in tensors]
        host, event = self._host_copy(torch.stack(tensors))
        arrival = Arrival(event)
        return [(host[i], arrival) for i in range(len(tensors))]

    def _flush(self, store: _Kind, layer: int, kind: int, upto: int | None = None) -> None:
        """Let the adapter observe the blocks deferred to it, in order (``upto``: only those of decode steps up
        to that step of :attr:`_step_clock`); an epoch it appends joins the device tables and is published
        for the blocks finished from then on (:meth:`_epochs_appended`)."""
        if upto is None:
            self._finish_rule_batches()             # the rule's checks in flight come first
            if self._device_rule and any(isinstance(item, _Observed) and item.device is not None
                                         for item in store.deferred):
                # every layer's decode checks in one GPU batch, waited for once (a prefill needs the
                # adapters current): the host rule would take milliseconds a check
                self._launch_decode_checks(self._step_clock)
                self._finish_rule_batches()
        while store.deferred:
            item = store.deferred[0]
            if upto is not None and isinstance(item, _Observed) and item.step > upto:
                return
            store.deferred.pop(0)
            blocks = _arrived(item.blocks if isinstance(item, _Observed) else item).view(np.uint16)
            appended = False
            while len(blocks):              # a decode step's blocks may pass a check: observed in runs up to it
                n = min(store.adapter.until_check, len(blocks))
                epoch = store.adapter.observe(blocks[:n])
                if epoch is not None:
                    store.add_epoch(*self._calibration.bases(layer, kind, epoch))
                    appended = True
                blocks = blocks[n:]
            if appended:
                self._epochs_appended(layer)

    def _flush_due(self) -> None:
        """The adaptation rule's turn in a decode loop, after each step's account: the adapters observe the
        blocks finished :data:`ADAPT_LAG` steps ago or earlier, whose copies to the host have arrived by now
        (the device runs the steps in order and the host is at most a few ahead), so the loop does not
        wait for the device; an epoch a check appends takes effect from the next step the host launches.

        On a GPU (:attr:`_device_rule`) the checks those blocks complete run there, every layer and kind in one
        batch (:class:`gaac.cuda.epochs.Batch`) on the rule's stream, from the blocks' device copies; the
        batch's decisions are taken up :data:`ADAPT_LAG` steps later, so its checks cost the host a launch,
        not the milliseconds of the host rule."""
        upto = self._step_clock - ADAPT_LAG
        if self._rule_batches and self._rule_batches[0][0] <= upto:
            self._finish_rule_batches(upto)
        if self._next_due is None or self._next_due > upto:
            return
        self._launch_decode_checks(upto)

    def _launch_decode_checks(self, upto: int) -> None:
        """:meth:`_flush_due`'s work for the blocks of decode steps up to ``upto``: the checks they complete
        launched in GPU rule batches (where the rule runs there), the others observed on the host."""
        self._next_due = None
        jobs = []
        busy = {id(store) for _, _, items in self._rule_batches for store, *_ in items}
        for layer, layer_store in enumerate(self._store):
            for kind, store in zip(KINDS, layer_store):
                if store.deferred and id(store) not in busy:
                    job = self._due_check(store, layer, kind, upto) if self._device_rule else None
                    if job is not None:
                        jobs.append(job)
                    else:
                        self._flush(store, layer, kind, upto)
                for item in store.deferred:
                    if isinstance(item, _Observed):
                        self._due_at(item.step)
                        break
        if jobs:
            from ..cuda.epochs import Batch

            by_shape = {}
            for job in jobs:
                by_shape.setdefault(tuple(job[4].shape), []).append(job)
            for items in by_shape.values():
                batch = Batch([(store.adapter, blocks) for store, _, _, _, blocks, _ in items],
                              stream=self._rule_stream())
                batch.scan()
                batch.chain()
                self._rule_batches.append((self._step_clock, batch, [(store, layer, kind, epoch, rest)
                                                                     for store, layer, kind, epoch, _, rest in items]))

    def _due_check(self, store: _Kind, layer: int, kind: int, upto: int):
        """Where the blocks of ``store``'s due decode steps (up to step ``upto``, all with device copies)
        complete the adapter's next check: take them out of the queue and return the GPU rule's job, ``(store,
        layer, kind, the epoch before, the check's blocks on the device, the host copies of the blocks after
        it)``; otherwise None (the host rule observes them: no check, so nothing to compute)."""
        due = []
        for item in store.deferred:
            if not isinstance(item, _Observed) or item.step > upto or item.device is None:
                break
            due.append(item)
        until = store.adapter.until_check
        if sum(len(item.device) for item in due) < until:
            return None
        del store.deferred[:len(due)]
        blocks = torch.cat([item.device for item in due]) if len(due) > 1 else due[0].device
        rest = []
        if len(blocks) > until:                     # the blocks after the check, observed once it is decided
            rest = [np.concatenate([_arrived(item.blocks) for item in due])[until:]]
        return store, layer, kind, store.adapter.epoch, blocks[:until], rest

    def _finish_rule_batches(self, upto: int | None = None) -> None:
        """Take up the decisions of the GPU rule's decode checks launched at step ``upto`` or before (None:
        all, waiting for them): the epochs they append join the device tables and are published, and the
        blocks after each check are observed."""
        while self._rule_batches and (upto is None or self._rule_batches[0][0] <= upto):
            _, batch, items = self._rule_batches.pop(0)
            batch.finish()
            layers = set()
            for store, layer, kind, before, rest in items:
                if store.adapter.epoch != before:
                    store.add_epochs([self._calibration.bases(layer, kind, e)
                                      for e in range(before + 1, store.adapter.epoch + 1)])
                    layers.add(layer)
                store.deferred[:0] = rest
                if rest and upto is not None:       # observed at the next turn
                    self._due_at(upto)
            for layer in sorted(layers):            # once every store holds its new epochs
                self._epochs_appended(layer)

    def _defer_observed(self, store: _Kind, blocks, device=None) -> None:
        """Queue a decode step's finished blocks (a host copy in flight; ``device``: the same on the device) for
        the adapter, stamped with the step."""
        store.deferred.append(_Observed(blocks, self._step_clock, device if self._device_rule else None))
        self._due_at(self._step_clock)

    def _due_at(self, step: int) -> None:
        """Blocks of decode step ``step`` wait for the rule: :meth:`_flush_due` takes them up from then on."""
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

    def _flush_all(self) -> None:
        self._finish_rule_batches()
        for layer, layer_store in enumerate(self._store):
            for kind, store in zip(KINDS, layer_store):
                if store.deferred:
                    self._flush(store, layer, kind)

    def _reserve(self, updates: list) -> None:
        """Make room for ``updates`` (growing, where allowed) or raise before anything is written.

        The reference codec has encoded already, so its counts are exact: each layer and kind's share of
        the raw-tile arena is lent what its overflowing tiles need.  The CUDA encoder decides slot or raw
        tile as it writes: each share is lent what its tiles may need at about twice the arena's planned
        rate (every tile, for a few); where the free records (a lower bound, read from the device only
        when the bound is short) cover every tile, the update is certain to fit; otherwise
        :meth:`_encode_on_device` checks after encoding, lends more and encodes again if a list ran dry.
        """
        need_blocks = max(int(self._lens[u.layer, s]) // L.BLOCK_TOKENS + q
                          for u in updates for s, q in zip(u.seqs, u.blocks))
        short = []               # (pool, records it lacks) or (None, blocks the table must hold)
        if need_blocks > self.max_blocks:
            short.append((None, need_blocks))
        jobs = [(self._store[u.layer][kind], u.tiles[kind].shape[0], u.fits[kind])
                for u in updates for kind in KINDS if u.tiles[kind] is not None]
        exact = [(store.raw, int((~fits).sum())) for store, _, fits in jobs if fits is not None]
        guess = [(store.raw, self._raw_guess(n)) for store, n, fits in jobs if fits is None]
        short += self._arena.cover(exact)
        self._arena.cover(guess)
        # The device's exact counts where the lower bounds fall short: one wait for all such pools.
        # (A count already exact needs no wait: a new cache's, or one read since its last encode.  Waiting
        # here would also wait behind the adaptation rule's kernels, which hold the GPU.)
        stale = [pool for store, n, fits in jobs if fits is None for pool in (store.slots, store.raw)
                 if pool.free_lower() < n and not pool.exact]
        if stale:
            sync_pools(stale)
        for store, n, fits in jobs:
            if fits is None:
                room = store.slots.free_lower() + store.raw.free_lower() + self._arena.reserve
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
            else:
                pool.grow_by(n)
                self._storage_changed()

    def _raw_guess(self, tiles: int) -> int:
        """Raw records to lend a share before the CUDA encoder codes ``tiles`` of its tiles: every tile for a
        few (a decode step's blocks), else about twice the arena's planned rate (the encode checks after)."""
        chunk = self._arena.chunk
        return tiles if tiles <= chunk else max(chunk, math.ceil(2 * self._raw_share * tiles))

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
        pools with the CUDA encoder (one launch per epoch run and kind), leaving each tile's table entry in
        ``u.entries``; return True.

        Where :meth:`_reserve` could not prove that the records suffice, the device's counts are read
        after the launches: if a free list ran dry, every count is put back (the records taken return
        to their lists; nothing else was written) and the pool grows (``grow``) and the encode is
        redone, or :class:`PoolExhaustedError` is raised with the cache unchanged.  With ``guessing``
        (some epochs are the rule's, still being decided) a list that runs dry returns False instead, the
        counts put back: the epochs the rule decides may need fewer records.  ``before_check`` runs once,
        after the first launches and before that wait (host work that overlaps the encodes); ``ran_dry``
        runs where a list ran dry, before the counts are put back."""
        jobs = [(u, kind) for u in updates for kind in KINDS if u.tiles[kind] is not None
                and (only is None or (id(u), kind) in only)]
        while True:
            unsure = [(u, kind) for u, kind in jobs
                      if min(p.free_lower() for p in self._pools(u.layer, kind)) < u.tiles[kind].shape[0]]
            # where a list may run dry, every job's counts, so that all of them can be put back
            saved = {id(self._store[u.layer][kind]): self._store[u.layer][kind].heads.clone()
                     for u, kind in jobs} if unsure else {}
            unsure_ids = {(id(u), kind) for u, kind in unsure}
            asked = []           # where a list may run dry the counts are read below, after a wait
            for u, kind in jobs:
                store = self._store[u.layer][kind]
                if u.epochs[kind].blocks is not None:     # the rule is still deciding: keep what to go back to
                    u.heads_before[kind] = saved[id(store)] if saved else store.heads.clone()
                tiles, plan, per = u.tiles[kind], u.epochs[kind], self.tiles_per_block
                entries = torch.empty(tiles.shape[0], dtype=torch.int32, device=self.device)
                used = torch.empty_like(entries)
                for epoch, start, stop in _runs(plan.epochs):
                    a, z = start * per, stop * per
                    encoder = self._encoder(store, plan, epoch, u.layer, kind)
                    if isinstance(tiles, _InPlace):
                        encoder.in_place(tiles.bits, start, entries[a:z], used[a:z])
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
            sync_pools(checked)                  # one wait for the device, for every pool in doubt
            over = [(pool, pool.taken - pool.listed) for pool in checked if pool.taken > pool.listed]
            if not over:
                return True
            if ran_dry is not None:
                ran_dry()
            # What each job's share of the arena took (past its list's end where it ran dry): what the same
            # tiles take when encoded again.
            stores = [self._store[u.layer][kind] for u, kind in jobs]
            sync_pools([store.raw for store in stores])
            took = [(store.raw, store.raw.taken - int(saved[id(store)][store.raw.cls])) for store in stores]
            self._put_back([(u, kind, saved[id(self._store[u.layer][kind])]) for u, kind in jobs])
            if guessing:
                return False
            # Every share is lent what it takes (so that lending to one never leaves another short); a slot
            # pool, or an arena that cannot lend enough, grows (grow=True) or the update is refused.
            lack = [(pool, n) for pool, n in over if not isinstance(pool, _Share)]
            lack += self._arena.cover(took)
            if lack and not self.grow:
                raise self._exhausted(*lack[0], "this update")
            for pool, n in lack:
                pool.grow_by(n)
            self._storage_changed()

    def _put_back(self, undo: list) -> None:
        """Undo encodes: for each ``(update, kind, heads)`` of ``undo`` the store's free lists go back to the
        counts ``heads`` saved before its encode (the records taken return to their lists; nothing else was
        written) and its entries are dropped; the pools' counts are then read with one wait for the device."""
        for u, kind, heads in undo:
            self._store[u.layer][kind].heads.copy_(heads)
            u.entries[kind] = None
        sync_pools([pool for u, kind, _ in undo for pool in self._pools(u.layer, kind)])

    def _encodes_launched(self, store: _Kind, tiles: int) -> None:
        """``store``'s pools count the records that encodes of ``tiles`` tiles, just launched, may take."""
        for pool in (store.slots, store.raw):
            pool.pending += tiles

    def _ask_counts(self, stores: list) -> None:
        """On a GPU, ask for the device's free-list counts of ``stores`` (after the encodes just launched) in
        one asynchronous copy; each pool's lower bound of free records takes its count up once it has
        arrived (no synchronisation)."""
        if self.device.type != "cuda" or not stores:
            return
        for store, counts in zip(stores, self._host_copies([store.heads for store in stores])):
            for pool in (store.slots, store.raw):
                pool.snapshot(counts)

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

            # An epoch's bases outlive the pools' versions (growth, removals make new free lists).
            bases = store.packed.get(epoch)
            if bases is None:
                bases = self._to_device(pack_bases(*self._tile_bases(store, plan, epoch, layer, kind)))
                if epoch < store.tb3.shape[0]:
                    store.packed[epoch] = bases
            enc = EncodePlan(self.geometry.channels, store.capacity, bases, store.slots.data, store.slots.order,
                             store.raw.data, store.raw.order, store.heads)
            if epoch < store.tb3.shape[0]:          # an epoch this update appends is cached once committed
                store.encoders = {k: e for k, e in store.encoders.items() if k[1] == key[1]}
                store.encoders[key] = enc
        return enc

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

    def _commit(self, u: _Update, observe: bool = True) -> None:
        """Write an update prepared and reserved for: slots, raw tiles, table entries, tails, the host's
        lengths (the caller copies them to the device).  ``observe``: a CPU cache's adapters observe the
        new blocks now (else the caller has them do it)."""
        per = self.tiles_per_block
        for kind in KINDS:
            store, tiles, fits = self._store[u.layer][kind], u.tiles[kind], u.fits[kind]
            if tiles is not None:
                self._commit_epochs(store, u, kind, observe)
                if u.entries[kind] is not None:
                    entries = u.entries[kind]
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
                    first = int(self._lens[u.layer, seq]) // L.BLOCK_TOKENS
                    store.table[seq, first:first + q] = entries[start:start + q * per].reshape(q, per)
                    start += q * per
            new = u.new[kind]
            t = new.shape[2]
            for i, (seq, q) in enumerate(zip(u.seqs, u.blocks)):
                r = int(self._lens[u.layer, seq]) % L.BLOCK_TOKENS
                if q == 0:
                    store.tail[seq, :, r:r + t] = new[i]
                else:
                    rest = r + t - q * L.BLOCK_TOKENS
                    if rest:
                        store.tail[seq, :, :rest] = new[i, :, t - rest:]
        for seq, q in zip(u.seqs, u.blocks):
            self._lens[u.layer, seq] += u.new[0].shape[2]
            self.blocks_encoded += q

    def _commit_epochs(self, store: _Kind, u: _Update, kind: int, observe: bool = True) -> None:
        """Apply an update's epoch decisions: new epochs, the adapter's state, each finished block's epoch."""
        plan = u.epochs[kind]
        for b3, b4 in plan.tables:
            self._calibration.add_epoch(u.layer, kind, b3, b4)
        if plan.tables:
            store.add_epochs(plan.tables)
            self._epochs_appended(u.layer)
        if plan.after is not None:
            plan.after.calibration = self._calibration
            store.adapter = plan.after
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
            if store.epoch is not None:
                if (new == new[0]).all():     # one epoch: a device fill, no copy from the host
                    store.epoch[seq, first:first + q] = int(new[0])
                else:
                    store.epoch[seq, first:first + q].copy_(self._to_device(new.astype(np.int16)))
            start += q

    # -- the storage interface of the serving loop (gaac.serving) --------------------------------------
    # What the decode-step machinery reads and writes of the cache; the contract is in the class docstring.
    @property
    def host_lengths(self) -> np.ndarray:
        """int64 ``[layers, max_seqs]``: the host's copy of every sequence's length per layer, the one the cache's
        logic reads (no device synchronisation).  The live array: a serving loop advances the entries of the
        tokens its device appends wrote.  Growth of the rows replaces it (:attr:`serving`'s generation changes)."""
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
        """Live sequence ids from an iterable of them, each checked (:class:`InputError` otherwise)."""
        return self._check_seqs(seqs)

    def check_layer(self, layer) -> None:
        """:class:`InputError` unless ``layer`` is a layer index of the cache."""
        self._check_layer(layer)

    def encoder_pools(self, layer: int, kind: int) -> tuple:
        """The CUDA encoder's arguments after the bases for ``layer`` and ``kind``: capacity, slots, their free
        list, raw tiles, their free list, the lists' taken counts (what a device append that encodes a finished
        block passes the encoder; they change with the pools' versions)."""
        return self._encoder(self._store[layer][kind], None, 0, layer, kind)._fixed[1:]

    def reserve_step(self, before: np.ndarray, after: np.ndarray) -> None:
        """Check (or, with ``grow``, make) room in every layer for the blocks a step from lengths ``before``
        to ``after`` finishes, before anything is written; :class:`PoolExhaustedError` names the first pool
        short.  A finished tile takes a slot or a raw tile, decided only as it is encoded, so each slot pool
        and each layer and kind's share of the raw-tile arena must be able to take every tile the step
        finishes: then no layer of the step can run out part way.  The device's exact counts are read only
        when the lower bound of free records falls short."""
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
        short = self._arena.cover([(store.raw, n) for store in stores])
        for store in stores:
            pool = store.slots
            if pool.free_lower() < n and pool.n_free() < n:
                short.append((pool, n - pool.n_free()))
        if short and not self.grow:
            raise self._exhausted(*short[0], f"the steps planned (they finish {n} tiles per layer and kind, each of "
                                             "which may need a slot or a raw tile)")
        for pool, lack in short:
            pool.grow_by(lack)
            self._storage_changed()

    def account_decode_step(self, layers, fin: np.ndarray, blk: np.ndarray, epochs, index=None):
        """The host's account of a decode step whose one-token appends to ``layers`` (an iterable) ran on the
        device, once launched (no synchronisation; the caller advances :attr:`host_lengths`): the sequences
        ``fin`` finished block ``blk``, in each layer's K and V epochs ``epochs[layer]`` (those published when
        the appends were launched).  The pools count the records the encodes may have taken, and ask for the
        device's count without waiting for it; the blocks' epochs are recorded; with adaptation the finished
        blocks are copied (pinned, in flight) for the rule, which takes them up a few steps later
        (:data:`ADAPT_LAG`).  ``index`` is ``fin`` on the device (made here if needed, returned for the next
        call)."""
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
        # one copy for every store's counts, one for every adapter's finished blocks
        self._ask_counts(stores)
        if observing:
            if index is None:
                index = self._to_device(fin)
            on_device = [store.tail.index_select(0, index) for store in observing]
            for store, copied, dev in zip(observing, self._host_copies(on_device), on_device):
                self._defer_observed(store, copied, dev)
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
                for layer in sorted(layers):
                    for store in self._store[layer]:
                        e = store.table[at].reshape(-1).cpu().numpy().view(np.uint32).astype(np.int64)
                        is_raw = (e & L.TABLE_RAW_FLAG) != 0
                        store.slots.give(e[~is_raw])
                        store.raw.give(e[is_raw] & L.TABLE_INDEX_MASK)
                        store.table[at] = 0
                        if store.epoch is not None:
                            store.epoch[at] = 0
            self._lengths_changed()

    # -- a decode step -----------------------------------------------------------
    @_locked
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
        (:class:`gaac.serving.graph.BucketSteps`; :class:`gaac.StepGraph` runs that loop)."""
        from ..serving.plan import StepPlan

        return StepPlan(self, q_heads, append=append, seqs=seqs, scale=scale, steps=steps, bucket=bucket)

    @property
    def _device_rule(self) -> bool:
        """Whether the adaptation rule runs on the GPU where an update reaches a check: with the CUDA codec
        on a GPU (``_rule_on_device`` set on a cache, the simulator's tests run it there too)."""
        on = self._rule_on_device
        if not self._cuda_codec or not (self.device.type == "cuda" if on is None else on):
            return False
        from ..cuda.epochs import supported

        return supported(self.kv_heads, self.head_dim)

    @property
    def _cuda_codec(self) -> bool:
        """Whether the cache runs the CUDA codec (a GPU, or numba's simulator): free lists on the device, the
        append kernel, and the fused kernel in step plans."""
        return isinstance(self.codec, CudaCodec)

    # -- reading ------------------------------------------------------------------
    @_locked
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

    @_locked
    def read(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence ``seq``'s whole cache: K and V as uint16 ``[layers, kv_heads, tokens, head_dim]``."""
        self._check_seq(seq)
        if len(set(self._lens[:, seq].tolist())) != 1:
            raise InputError(f"sequence {seq} holds {self._lens[:, seq].tolist()} tokens per layer: it is mid-update")
        per_layer = [self.read_layer(layer, [seq]) for layer in range(self.layers)]
        return tuple(np.stack([p[kind][0].cpu().numpy() for p in per_layer]).view(np.uint16) for kind in KINDS)

    @_locked
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
