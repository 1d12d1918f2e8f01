"""Calibration epochs: bases that follow a context past what its calibration saw (FORMAT.md 3.5).

Why.  RoPE rotates the channel pairs of K with position, so the exponents of
the slowly rotating pairs drift as a context grows: windows calibrated on the
first 512 tokens of an 8K prompt leave 10 % of K's groups raw after token
4096 (``benchmarks/results/drift-smollm2.md``).  A cache therefore keeps, per
(kind, layer), a list of base tables -- **epochs** -- in its
:class:`~gaac.calibration.Calibration`: epoch 0 is the calibration's own
bases, later ones are appended by the rule below.  Every finalized block is
encoded once, with the newest epoch of its layer and kind, and records that
epoch; it is never re-encoded.  Decoding a block uses its own epoch's bases.

The rule (:class:`Adapter`, one per (kind, layer) of a cache), applied to the
blocks in the order they are finalized:

* a running exponent histogram ``[kv_heads, head_dim, 256]`` of the finalized
  blocks;
* every ``ADAPT_EVERY`` (16) blocks -- a **check** -- the histogram is first
  decayed, ``hist -= hist >> DECAY_SHIFT`` (it keeps 3/4 of its weight, so it
  follows the drift instead of averaging over the whole past), then the
  exponents of those 16 blocks are added;
* from the first check at which at least ``WARMUP_BLOCKS`` (48 blocks, 768
  tokens) have been finalized, the best 8- and 16-wide windows of the
  histogram (:func:`gaac.calibration.best_windows`) become the candidate --
  earlier, the blocks it is judged on weigh far more than their steady-state
  quarter of the histogram it comes from, and such an in-sample candidate
  displaces good bases too easily; it is appended as a new epoch when it
  differs from the newest epoch and would have saved, on the 16 blocks just
  finalized, at least ``1/PAYBACK_CHECKS`` of its table bytes
  (``2 * kv_heads * head_dim``) in escape bytes -- so that, if the saving
  lasts, the table pays for itself within 6 checks;
* a (kind, layer) holds at most ``MAX_EPOCHS`` (256) epochs; at the cap the
  rule appends nothing more and new blocks keep the newest epoch.

The escape capacity stays the calibration's: a slot size is fixed per pool.

Every number above was chosen by measurement on 8192-token captures of a
real model: ``python benchmarks/drift.py --sweep`` tries each around its value
(``benchmarks/results/drift-sweep-smollm2.md``).  A check every 8 blocks
compresses a few hundredths of a percent better than every 16; 16 stays
within the same 0.5 % of whole-context calibration and halves the checks, so
the rule's share of a long prefill.  The rule is what gaac does;
a decoder never runs it -- it reads each block's epoch.
"""
from __future__ import annotations

import operator

import numpy as np

from . import layout as L
from .calibration import Calibration, best_windows, exponent_histograms, tile_escape_bytes
from .errors import InputError

ADAPT_EVERY = 16        # R: finalized blocks between two checks
WARMUP_BLOCKS = 48      # no epoch before 48 blocks (768 tokens) are finalized
DECAY_SHIFT = 2         # at each check the histogram keeps 1 - 2**-2 = 3/4 of its weight
PAYBACK_CHECKS = 6      # an epoch must save 1/6 of its table bytes on the last ADAPT_EVERY blocks
MAX_EPOCHS = 256        # per (kind, layer), epoch 0 included
EPOCH_INDEX_BYTES = 2   # what a cache keeps per block to record its epoch (LayerView.epoch is int16)


def epoch_table_bytes(calibration: Calibration) -> int:
    """Bytes of one epoch's bases: ``b3`` and ``b4``, one byte per (head, channel) each."""
    return 2 * calibration.kv_heads * calibration.head_dim


class DeviceBlock(tuple):
    """One finalized block whose values stay on the device: row ``i`` of ``run``, a device tensor (int16
    ``[n, kv_heads, 16, head_dim]``) that holds a copy of its own, never written again.  An adapter whose rule
    runs on the GPU keeps such blocks among those since its last check (with ``run`` among its device runs,
    :meth:`Adapter.recent_on`) and nothing copies them to the host: only a check of the host rule reads the
    values (``np.asarray``, a copy that waits for the device).  A copy of the adapter takes the values.

    Made as ``DeviceBlock((run, i))``: a pair, so that making one runs no Python code (a join in a decode loop
    makes one for every block the steps queued, in every layer and kind)."""

    __slots__ = ()
    dtype = np.dtype(np.uint16)
    run = property(operator.itemgetter(0))
    i = property(operator.itemgetter(1))

    @property
    def shape(self) -> tuple:
        return tuple(self.run.shape[1:])

    def __array__(self, dtype=None, copy=None):
        values = self.run[self.i].cpu().numpy().view(np.uint16)
        return values if dtype is None else values.astype(dtype)

    def __reduce__(self):
        return np.array, (np.asarray(self),)


def host_values(blocks) -> np.ndarray:
    """The values of ``blocks`` (each ``[kv_heads, 16, head_dim]``: an array, or a :class:`DeviceBlock`) as uint16
    ``[n, kv_heads, 16, head_dim]``, every DeviceBlock's in one copy from the device (one wait, not one a block)."""
    out = [None] * len(blocks)
    on_device = [j for j, b in enumerate(blocks) if isinstance(b, DeviceBlock)]
    if on_device:
        import torch

        got = torch.stack([blocks[j].run[blocks[j].i] for j in on_device]).cpu().numpy().view(np.uint16)
        for j, values in zip(on_device, got):
            out[j] = values
    for j, b in enumerate(blocks):
        if out[j] is None:
            out[j] = np.asarray(b).view(np.uint16)
    return np.stack(out)


def device_blocks(*runs) -> list:
    """The blocks of device tensors ``runs`` (each int16 ``[n, kv_heads, 16, head_dim]``, a copy of its own), in
    order, as :class:`DeviceBlock`: what an adapter keeps without copying them to the host."""
    return [DeviceBlock((run, i)) for run in runs for i in range(run.shape[0])]


class Adapter:
    """The adaptation rule for one (kind, layer) of one cache; it appends epochs to ``calibration``.

    Feed it every finalized block of that layer and kind, in the order the cache
    finalizes them, after encoding each with :attr:`epoch`::

        epoch = adapter.epoch
        encode_block(block, calibration, layer, kind, epoch)
        adapter.observe(block[None])
    """

    def __init__(self, calibration: Calibration, layer: int, kind: int):
        if kind not in L.KIND_NAMES:
            raise InputError(f"kind must be 0 (K) or 1 (V), got {kind!r}")
        calibration.check_epoch(layer, kind, 0)
        self.calibration, self.layer, self.kind = calibration, layer, kind
        self._hist = None         # made at first use: a cache makes an adapter per layer and kind (1-2 MB each)
        self._hist_device = None  # where the rule last ran on the GPU: its histogram there, fetched when needed
        self.finalized = 0        # blocks observed
        self._recent = []         # the blocks since the last check, each [kv_heads, 16, head_dim]
        self._recent_device = []  # the same blocks on a GPU, in runs [n, kv_heads, 16, head_dim] (None: not all there)

    def __copy__(self) -> "Adapter":
        """A shallow copy (the histogram and the lists of blocks shared until either replaces them), without the
        copy module's reduction: the GPU rule copies every adapter of a batch."""
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        return out

    @property
    def hist(self) -> np.ndarray:
        """The running exponent histogram ``int64 [kv_heads, head_dim, 256]``."""
        if self._hist_device is not None:
            self._hist = self._hist_device.cpu().numpy().astype(np.int64)
            self._hist_device = None
        elif self._hist is None:
            self._hist = np.zeros((self.calibration.kv_heads, self.calibration.head_dim, 256), dtype=np.int64)
        return self._hist

    @hist.setter
    def hist(self, value) -> None:
        self._hist, self._hist_device = value, None

    def hist_if_on(self, device):
        """The histogram as the int32 tensor on ``device`` the GPU rule left it in, or None where it is
        not there (the GPU rule's batch then brings it over with its other inputs)."""
        if self._hist_device is not None and self._hist_device.device == device:
            return self._hist_device
        return None

    def keep_hist_on_device(self, hist) -> None:
        """Take the GPU rule's histogram (an int32 tensor ``[kv_heads, head_dim, 256]``) as this adapter's;
        it comes to the host only if the host rule needs it."""
        self._hist_device = hist

    @property
    def epoch(self) -> int:
        """The newest epoch: the one the next finalized block is encoded with."""
        # Calibration.n_epochs less its checks of the layer and kind, which the adapter's own are
        return len(self.calibration.epochs.get((self.kind, self.layer), ()))

    def recent_on(self, device) -> list | None:
        """The blocks since the last check as runs of device tensors on ``device`` (int16 ``[n, kv_heads, 16,
        head_dim]``, in order), where the GPU rule or the cache left a copy of every one there; else None (the
        GPU rule's batch then copies the host's blocks over)."""
        runs = self._recent_device
        if runs is None:
            return None
        held = 0
        for run in runs:
            if run.device != device:
                return None
            held += run.shape[0]
        return runs if held == len(self._recent) else None

    def keep_recent(self, blocks, runs=None) -> None:
        """Make ``blocks`` (host, each ``[kv_heads, 16, head_dim]``) the blocks since the last check, and ``runs``
        (device tensors ``[n, kv_heads, 16, head_dim]`` holding the same in order, or None where they are not all
        on the device) their device copy: what the GPU rule leaves after a batch."""
        self._recent = list(blocks)
        self._recent_device = list(runs) if runs is not None else [] if not self._recent else None

    @property
    def until_check(self) -> int:
        """Blocks still to be observed before the next check (1..ADAPT_EVERY)."""
        return ADAPT_EVERY - len(self._recent)

    def observe(self, blocks, device=None, decide: bool = True) -> int | None:
        """Record finalized blocks ``uint16 [n, kv_heads, 16, head_dim]``, all coded with :attr:`epoch` (or a list of
        ``n`` blocks, each anything with that block's ``shape`` and ``dtype`` that NumPy reads as one: its values are
        read only at a check).

        ``n`` may not exceed :attr:`until_check`: a block finalized after a check
        must be coded with the epoch that check may append.  Returns the index of
        the epoch appended by this call's check, else ``None``.  ``device``: the
        same blocks on a GPU (a tensor), kept while no check is due, so that the
        GPU rule's next batch reads them there rather than copying the host's over.  ``decide=False``: a check
        among these blocks takes them into the histogram and appends nothing (blocks the calibration was fitted
        on, :meth:`assign`).
        """
        want = (self.calibration.kv_heads, L.BLOCK_TOKENS, self.calibration.head_dim)
        if isinstance(blocks, list):        # one by one, perhaps some with values still to come (read at a check)
            bad = next((b for b in blocks if tuple(b.shape) != want or np.dtype(b.dtype) != np.uint16), None)
            if bad is not None:
                raise InputError(f"expected uint16 blocks [{', '.join(map(str, want))}], got {np.dtype(bad.dtype)} "
                                 f"{list(bad.shape)}")
        else:
            blocks = np.asarray(blocks)
            if blocks.ndim != 4 or blocks.shape[1:] != want or blocks.dtype != np.uint16:
                raise InputError(f"expected uint16 blocks [n, {', '.join(map(str, want))}], got {blocks.dtype} "
                                 f"{list(blocks.shape)}")
        if len(blocks) > self.until_check:
            raise InputError(f"{len(blocks)} blocks given, but a check is due after {self.until_check}: "
                             "the blocks after it must be coded with the epoch it may append")
        if len(blocks):                                     # the device runs follow the host's blocks, or stop
            if device is None or self._recent_device is None:
                self._recent_device = None
            else:
                self._recent_device.append(device)
        self._recent.extend(blocks)
        self.finalized += len(blocks)
        if self.until_check:
            return None
        x = np.concatenate(host_values(self._recent), axis=1)   # [kv_heads, R * 16, head_dim]
        self._recent, self._recent_device = [], []
        self.hist -= self.hist >> DECAY_SHIFT
        self.hist += exponent_histograms(x[None])[0]
        return self._check(x) if decide else None

    def assign(self, blocks, decide: bool = True) -> np.ndarray:
        """Finalize ``blocks`` ``[n, kv_heads, 16, head_dim]`` in order, each coded with the epoch current
        when it is finalized (observed in runs that end at the checks); returns those epochs (``int64 [n]``).

        ``decide=False``: the checks among ``blocks`` update the histogram and append no epoch, so every block
        keeps the newest epoch.  For blocks the calibration was fitted on (a cache that calibrated itself on
        its prompt): that calibration is already their best fit over the whole of them, and the rule then
        decides from the blocks after them with a histogram that has seen them."""
        epochs = np.empty(len(blocks), dtype=np.int64)
        start = 0
        while start < len(blocks):
            stop = min(start + self.until_check, len(blocks))
            epochs[start:stop] = self.epoch
            self.observe(blocks[start:stop], decide=decide)
            start = stop
        return epochs

    def _check(self, x: np.ndarray) -> int | None:
        """Append the histogram's windows as an epoch if the rule says so (module docstring)."""
        if self.finalized < WARMUP_BLOCKS or self.epoch + 1 >= MAX_EPOCHS:
            return None
        b3, b4 = best_windows(self.hist, L.WINDOW_3BIT), best_windows(self.hist, L.WINDOW_4BIT)
        c3, c4 = self.calibration.bases(self.layer, self.kind, self.epoch)
        if np.array_equal(b3, c3) and np.array_equal(b4, c4):
            return None
        saved = int(tile_escape_bytes(x, c3, c4).sum()) - int(tile_escape_bytes(x, b3, b4).sum())
        if saved * PAYBACK_CHECKS < epoch_table_bytes(self.calibration):
            return None
        return self.calibration.add_epoch(self.layer, self.kind, b3, b4)


def assign_epochs(blocks: np.ndarray, calibration: Calibration, layer: int, kind: int) -> np.ndarray:
    """Run the rule over one layer's finalized blocks ``[n, kv_heads, 16, head_dim]`` in order.

    Appends the epochs the rule makes to ``calibration`` and returns the epoch
    each block is encoded with (``int64 [n]``), what a cache filled with these
    blocks in this order would record.
    """
    return Adapter(calibration, layer, kind).assign(blocks)
