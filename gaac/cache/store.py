"""One layer and kind's storage in a paged cache: the records :meth:`gaac.cache.paged.PagedKVCache.stores` hands
out, which the cache's update transaction (:mod:`gaac.cache.update`) and its side of a transfer
(:mod:`gaac.cache.transfer`) write.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import arrays
from .. import layout as L
from ..epochs import Adapter
from ..tiles import tile_bases
from .pools import DevicePool, Pool, RawArena

KINDS = (L.KIND_K, L.KIND_V)


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
    waiting: int = 0             # of them, blocks the GPU rule's next check reads on the device (update._waiting)
    published: int = 0           # the epoch decode appends encode finished blocks with (PagedKVCache._publish)
    current: torch.Tensor | None = None             # its bases, packed for the CUDA encoder (current_bases)
    encoders: dict = field(default_factory=dict)    # (epoch, pools) -> the CUDA codec's EncodePlan
    packed: dict = field(default_factory=dict)      # epoch -> its per-tile bases packed for the CUDA codec (device)

    def add_epoch(self, b3: np.ndarray, b4: np.ndarray) -> None:
        """Append one epoch's bases ``[kv_heads, head_dim]`` to the device tables."""
        self.add_epochs([(b3, b4)])

    def add_epochs(self, tables: list) -> None:
        """Append epochs ``tables`` ((b3, b4) ``[kv_heads, head_dim]`` each, in order) to the device tables with
        one concatenation per table (appending them one by one would copy each table once per epoch), their
        bytes brought over in one asynchronous copy (:func:`gaac.arrays.upload`: appending epochs never waits
        for the device)."""
        add_epochs_all([(self, tables)])

    def pools_key(self) -> tuple:
        """What an EncodePlan bakes in: the versions of the pools' arrays and free lists."""
        return self.slots.version, self.raw.version


BASE_TABLES = ("b3", "b4", "tb3", "tb4")      # a store's epoch tables on the device (uint8, an epoch a row)


def add_epochs_all(items: list) -> None:
    """:meth:`_Kind.add_epochs` for each ``(store, tables)`` of ``items``, every store's new bytes brought to the
    device in one asynchronous copy (a prompt whose rule appends epochs in every layer copies once), and every
    store's four tables, old rows and new, joined by one concatenation into one allocation of which they are
    views (a prompt that appends epochs in 64 layers and kinds makes one concatenation, not 256).  The tables
    are a few kilobytes an epoch; a store's later append moves its own into a new allocation."""
    # each store's new rows of each table, in table order: one flat host array of every store's (no stack a table)
    rows = []
    for _, tables in items:
        tiles = [tile_bases(b3, b4) for b3, b4 in tables]
        rows.append(([t[0] for t in tables], [t[1] for t in tables], [t[0] for t in tiles], [t[1] for t in tiles]))
    if not rows:
        return
    host = np.concatenate([row.reshape(-1) for new in rows for part in new for row in part]).astype(np.uint8)
    flat = arrays.upload(host, items[0][0].b3.device)
    # the new rows' pieces of ``flat`` and the joined tables' pieces, each by one split (not a slice a table:
    # a prompt that appends epochs in 64 layers and kinds has 256 of each)
    sizes, pieces, shapes = [], [], []
    for (store, tables), new in zip(items, rows):
        for name, part in zip(BASE_TABLES, new):
            old = getattr(store, name)
            sizes.append(sum(row.size for row in part))
            pieces.append(old.reshape(-1))
            shapes.append((old.shape[0] + len(tables), *old.shape[1:]))
    added = flat.split(sizes)
    joined = torch.cat([x for pair in zip(pieces, added) for x in pair])
    tables = iter(zip(joined.split([math.prod(shape) for shape in shapes]), shapes))
    for store, _ in items:
        for name in BASE_TABLES:
            table, shape = next(tables)
            setattr(store, name, table.view(shape))


def give_back_all(stores: list, entries: list) -> None:
    """Return the records that each store's table ``entries`` (uint32 words as int64) point at: slots to its slot
    pool, raw tiles (entries with the raw flag, bit 31) to its share of the arena.  For pools whose free lists
    the host holds (the reference codec's); a cache whose lists live on the device gives back through
    :func:`gaac.cache.paged._give_back`, which sorts every store's records in one device sort."""
    for store, e in zip(stores, entries):
        is_raw = (e & L.TABLE_RAW_FLAG) != 0
        store.slots.give(e[~is_raw])
        store.raw.give(e[is_raw] & L.TABLE_INDEX_MASK)


# ----------------------------------------------------------------------------------------------
# Making every layer and kind's records at once.

ALIGN = 256          # bytes: where each array of a shared allocation starts (as the device's allocator aligns)


class _Slab:
    """Arrays laid out in one byte buffer, each at an :data:`ALIGN`-byte offset: one allocation (or one copy
    from the host) makes all of them, each a view of it."""

    def __init__(self):
        self.parts = []              # (offset, shape, dtype, host array or None, bytes)
        self.size = 0

    def add(self, shape, dtype: torch.dtype, host: np.ndarray | None = None) -> int:
        nbytes = math.prod(shape) * dtype.itemsize
        self.parts.append((self.size, tuple(shape), dtype, host, nbytes))
        self.size += -(-nbytes // ALIGN) * ALIGN
        return len(self.parts) - 1

    def zeros(self, device) -> list:
        """Every array, zeros, in one allocation on ``device``."""
        return self._views(torch.zeros(max(self.size, 1), dtype=torch.uint8, device=device))

    def upload(self, device) -> list:
        """Every array with its host contents, on ``device`` with one copy that does not wait for the device."""
        buf = np.zeros(max(self.size, 1), dtype=np.uint8)
        for offset, shape, _, host, _ in self.parts:
            raw = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
            buf[offset:offset + raw.size] = raw
        return self._views(torch.from_numpy(buf).to(device, non_blocking=True))

    def _views(self, flat: torch.Tensor) -> list:
        return [flat[offset:offset + n].view(dtype).view(shape) for offset, shape, dtype, _, n in self.parts]


def make_stores(calibration, arena: RawArena, *, device: torch.device, cuda: bool, adapt: bool, max_seqs: int,
                max_blocks: int, n_slots: int, grow: bool) -> list:
    """Every layer and kind's storage record of a cache (``[layer][kind]`` :class:`_Kind`), with what each
    needs on the device made for all of them at once rather than array by array:

    * one allocation of zeros holds every block table and block-epoch index, another every tail, another
      every slot pool, unless the cache may ``grow`` (a pool that grows replaces its array, so each has its
      own, which growth frees).  Growth of the blocks replaces every table and epoch index, growth of the
      rows those and every tail: so each allocation is freed whole when growth replaces what it holds, and
      no stale bytes outlive it uncounted;
    * one copy from the host brings every epoch's bases (``b3``, ``b4``, ``tb3``, ``tb4``), the CUDA encoder's
      packed bases of every epoch held (``packed``, which the encoder plans then use), (``cuda``) the free
      lists' taken counts, zeros, and the first free list of each layer and kind's share of ``arena`` (each
      lent ``arena.chunk`` records, as :meth:`RawArena.cover` lends them: the cache's ``cover`` then finds
      every share covered);
    * one array holds every slot pool's first free list (``0 .. n_slots - 1``).

    Each record's arrays are views of those, each exactly its own size, so :meth:`PagedKVCache.memory` counts
    what the records hold as before; growth of tables and tails replaces every record's at once, which frees
    the shared allocation.  The records, their contents and the arena's loans are those of making each
    record on its own; ``calibration`` is the cache's own copy."""
    layers, heads, dim = calibration.layers, calibration.kv_heads, calibration.head_dim
    geo = L.geometry(dim)
    per = heads * L.tiles_per_head(dim)
    c = L.tile_channels(dim)
    zeros, tails, host, slots = _Slab(), _Slab(), _Slab(), _Slab()
    # Epoch 0 of every layer and kind, in the records' order (layer, then kind), each table made for all of them
    # at once: the bases [n, heads, dim], their per-tile form [n, per, C] and (cuda) the encoder's packing
    # [n, per, 2, C].  A record that holds only epoch 0 takes a row of each; one holding later epochs its own.
    first = [np.ascontiguousarray(np.swapaxes(b, 0, 1)).reshape(2 * layers, heads, dim)
             for b in (calibration.b_narrow, calibration.b_wide)]
    shared = [host.add((2 * layers, 1, heads, dim), torch.uint8, b) for b in first]
    shared += [host.add((2 * layers, 1, per, c), torch.uint8, b) for b in first]
    if cuda:
        from ..cuda.codec import pack_bases

        packed0 = pack_bases(*(b.reshape(2 * layers * per, c) for b in first))
        shared.append(host.add((2 * layers, per, 2, c), torch.int16, packed0))
        shared.append(host.add((2 * layers, 4), torch.int32, np.zeros((2 * layers, 4), np.int32)))   # [2] used
    plan = []
    for layer in range(layers):
        for kind in KINDS:
            # Without adaptation only epoch 0 codes blocks; with it, every epoch the calibration holds may.
            n_epochs = 1 + len(calibration.epochs.get((kind, layer), ())) if adapt else 1
            capacity = int(calibration.capacity[kind, layer])
            p = dict(layer=layer, kind=kind, capacity=capacity, n_epochs=n_epochs, b=None, packed=None,
                     table=zeros.add((max_seqs, max_blocks, per), torch.int32),
                     tail=tails.add((max_seqs, heads, L.BLOCK_TOKENS, dim), torch.int16),
                     epoch=zeros.add((max_seqs, max_blocks), torch.int16) if adapt else None)
            if n_epochs > 1:
                bases = [calibration.bases(layer, kind, e) for e in range(n_epochs)]
                b3, b4 = (np.stack(t) for t in zip(*bases))
                tiles = [tile_bases(x3, x4) for x3, x4 in bases]
                tb3, tb4 = (np.stack(t) for t in zip(*tiles))
                p["b"] = [host.add(x.shape, torch.uint8, x) for x in (b3, b4, tb3, tb4)]
                if cuda:
                    p["packed"] = [host.add(w.shape, torch.int16, w) for w in
                                   (pack_bases(np.ascontiguousarray(t3), np.ascontiguousarray(t4))
                                    for t3, t4 in tiles)]
            if cuda and not grow:
                p["slots"] = slots.add((max(n_slots, 1), geo.slot_bytes(capacity)), torch.uint8)
            plan.append(p)
    loans = arena.first_loans(len(plan)) if cuda else None
    if loans is not None:
        for p, (records, room) in zip(plan, loans):
            held = np.full(room, -1, dtype=np.int32)
            held[:len(records)] = records
            p["order"] = host.add(held.shape, torch.int32, held)
    z, t, h = zeros.zeros(device), tails.zeros(device), host.upload(device)
    sb3, sb4, stb3, stb4, *rest = (h[j] for j in shared)
    spacked, sheads = rest if cuda else (None, None)
    s = slots.zeros(device) if cuda and not grow else None
    if cuda:
        stride = -(-max(n_slots, 1) // 64) * 64
        orders = (torch.arange(stride, dtype=torch.int32, device=device).expand(len(plan), stride).contiguous()
                  if n_slots else torch.full((len(plan), 1), -1, dtype=torch.int32, device=device))
    stores = [[None] * len(KINDS) for _ in range(layers)]
    for i, p in enumerate(plan):
        layer, kind, capacity = p["layer"], p["kind"], p["capacity"]
        name = f"layer {layer} {L.KIND_NAMES[kind].upper()}"
        record = (geo.slot_bytes(capacity),)
        heads_i = None
        if cuda:                                 # the encoder pops records from free lists on the device
            heads_i = sheads[i, :2]
            pool = DevicePool(f"{name} slot pool", n_slots, record, torch.uint8, device, heads_i, 0,
                              data=None if grow else s[p["slots"]], order=orders[i, :max(n_slots, 1)]
                              if n_slots else orders[i])
            share = arena.share(f"{name} raw tiles", heads_i, 1)
            if loans is not None:
                records, room = loans[i]
                share.adopt_loan(h[p["order"]], len(records))
        else:
            pool = Pool(f"{name} slot pool", n_slots, record, torch.uint8, device)
            share = arena.share(f"{name} raw tiles")
        b3, b4, tb3, tb4 = ((h[j] for j in p["b"]) if p["b"] is not None else
                            (sb3[i], sb4[i], stb3[i], stb4[i]))
        store = _Kind(capacity=capacity, heads=heads_i, slots=pool, raw=share, table=z[p["table"]], tail=t[p["tail"]],
                      b3=b3, b4=b4, tb3=tb3, tb4=tb4, epochs=np.zeros((max_seqs, max_blocks), dtype=np.int16),
                      epoch=z[p["epoch"]] if adapt else None,
                      adapter=Adapter(calibration, layer, kind) if adapt else None, published=p["n_epochs"] - 1)
        if cuda:
            store.packed = ({e: h[j] for e, j in enumerate(p["packed"])} if p["packed"] is not None else
                            {0: spacked[i]})
        stores[layer][kind] = store
    if loans is not None:
        arena.take_first_loans(loans)
    return stores
