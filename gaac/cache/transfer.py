"""The cache's side of a transfer: a paged cache's sequence gathered into container bytes, and scattered back in.

What a transfer is for and what the container holds: :mod:`gaac.transfer` (the public face) and
FORMAT.md section 11.  This module is the cache's side of it: :func:`export_sequence` gathers one
sequence's slots, raw tiles, block tables, block epochs and tails from the pools, and
:func:`import_sequence` puts them into the pools of a cache with the same calibration, bit for bit.

The container's body is what the cache stores, part after part; its head
(dimensions, per (layer, kind) counts, the bases of the epochs the blocks
use, the chunk CRC table) is built on the host.  On a CUDA cache the body
moves in pieces of whole chunks (:func:`_pipeline`), each copied on a stream
of its own while the device works on its neighbour: export gathers a piece's
sections into a device buffer and computes its chunk CRCs there
(:mod:`gaac.cuda.crc`) while the piece before it copies into pinned memory;
import checks a piece's chunk CRCs and its sections' tables and scatters
their slots and raw tiles into free pool records while the piece after it
arrives, and waits once, for the verdict, before the sequence's tables,
epochs and tails go into the cache.  On the CPU the same torch code runs on
host tensors and zlib computes the CRCs.

What "the same calibration" means (FORMAT.md 11.8): the container names the
calibration id of 3.3, which covers the epoch-0 bases and the escape
capacities -- everything a slot's bytes depend on besides its epoch.  Any
cache whose calibration has that id takes the container, whatever its model
name, notes or epochs.  The bases of every later epoch the blocks use travel
in the container; the importing cache maps each to an epoch of its own with
the same bases or appends it (:func:`_epoch_map`), so an epoch appended this
way becomes the newest of its layer and kind and codes the blocks that cache
finalizes next, as an epoch of its own rule would.  A cache without epochs
(``adapt=False``) takes only containers whose blocks are all of epoch 0.

Slices by KV head (FORMAT.md 11.12): ``export_sequence(..., heads=(start, stop))`` writes the container of
KV heads ``start .. stop - 1`` of every layer, for a worker of another tensor-parallel size (prefill at one,
decode at another).  A tile holds channels of one head, coded with that head's bases and its section's
capacity, so the slice's tiles are the cache's tiles of those heads as stored; the container names the
calibration ``cache.calibration.slice_heads(start, stop)`` -- a calibration like any other, with the id of
its own tables -- and a cache made with it imports the slice as it imports any container.

Coupling: the cache's storage is read in :func:`_read_storage` and written by
:class:`_Writer`, and nowhere else.

The container's bytes -- its layout, head, and the rules a reader applies -- are
:mod:`gaac.format.sequence`'s, which reads and writes them with NumPy alone;
this module adds the cache's pools, torch and the GPU.  :mod:`gaac.transfer` is
the public face of both, with the file form (:func:`gaac.transfer.pack`,
:func:`gaac.transfer.unpack`), which builds a cache of its own; the cache's
``export_sequence`` and ``import_sequence`` methods call this module.
"""
from __future__ import annotations

import functools
import warnings
import zlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from .. import arrays
from .. import layout as L
from .pools import grow_pools, grown, sync_pools
from ..calibration import Calibration, check_heads
from ..errors import FormatError, InputError, PoolExhaustedError
from ..format import sequence as F
from ..format.sequence import (KINDS, RAW_ENTRY_BIAS, Container, EpochRecord, Layout, Section, check_calibration,
                              sequence_layout)


# ----------------------------------------------------------------------------------------------
# The container's bytes as NumPy, its head and its size: gaac.format.sequence's, for torch CPU tensors too.

def _as_array(data, name: str = "data") -> np.ndarray:
    """A bytes-like object, NumPy uint8 array or torch CPU uint8 tensor as a 1-D uint8 array (no copy):
    :func:`gaac.format.sequence.as_array`, which reads all but the tensor."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or data.dtype != torch.uint8:
            raise InputError(f"{name}: a container as a tensor must be uint8 on the CPU, got {data.dtype} on "
                             f"{data.device}")
        data = data.contiguous().reshape(-1).numpy()
    return F.as_array(data, name)


def read_head(data) -> Container:
    """Check a container's head (FORMAT.md 11.7, S1-S12, C4, and S16's count) and return what it says:
    :func:`gaac.format.sequence.read_head`, for a CPU uint8 tensor too.  The body is checked where it is used
    (:func:`import_sequence`)."""
    return F.read_head(_as_array(data))


def container_nbytes(data) -> int:
    """The length of the sequence container that starts ``data`` (bytes-like, uint8 array or CPU tensor),
    from its header alone: :func:`gaac.format.sequence.container_nbytes`, for a CPU uint8 tensor too."""
    return F.container_nbytes(_as_array(data))


# ----------------------------------------------------------------------------------------------
# The body, on the cache's device, moved piece by piece.

PIECE_BYTES = 64 << 20
"""The least size of a piece of the body that moves between a CUDA device and the host in one copy: large
enough that each copy runs at the link's bandwidth, small enough that the work on the first piece (export) or
the last (import), which no copy hides, is short."""


def _view(body: torch.Tensor, start: int, count: int, dtype: torch.dtype, shape=None) -> torch.Tensor:
    """``count`` elements of ``dtype`` at byte ``start`` of the uint8 ``body``, shaped ``shape``."""
    size = torch.empty(0, dtype=dtype).element_size()
    x = body[start:start + count * size].view(dtype)
    return x.view(shape) if shape is not None else x


def _rows(x: torch.Tensor, record_bytes: int) -> torch.Tensor:
    """The records of ``x`` (a pool, or a part of the body; contiguous) as int64 rows: records are multiples of
    16 bytes, and torch gathers and scatters 8-byte elements many times faster than single bytes."""
    return x.reshape(-1).view(torch.uint8).view(torch.int64).view(-1, record_bytes // 8)


def _chunk_crcs(body: torch.Tensor):
    """CRC-32 of the chunks of ``body`` (FORMAT.md 11.5; ``body`` starts on a chunk): on the CPU all of them, by
    zlib (uint32); on a CUDA device the whole chunks, by :mod:`gaac.cuda.crc` (int32 bits, on the device,
    asynchronously on the current stream) -- the partial last chunk is the caller's, on the host, where its bytes
    are (or will be)."""
    if body.device.type == "cuda":
        from ..cuda.crc import chunk_crcs

        return chunk_crcs(body, L.SEQUENCE_CHUNK_BYTES)
    return F.chunk_crcs(body.numpy())


def _piece_ends(lay: Layout) -> list[int]:
    """Where the pieces of the body end: each at the end of a section's last whole chunk, at least
    :data:`PIECE_BYTES` after the previous end; the last at the body's end.  A piece is whole chunks (the last
    piece may end in the body's partial chunk), so each piece's chunk CRCs are its own."""
    ends = [0]
    for s in lay.sections:
        end = s.end // L.SEQUENCE_CHUNK_BYTES * L.SEQUENCE_CHUNK_BYTES
        if end - ends[-1] >= PIECE_BYTES:
            ends.append(end)
    if ends[-1] < lay.body_bytes or len(ends) == 1:
        ends.append(lay.body_bytes)
    return ends[1:]


@functools.lru_cache(maxsize=None)
def _copy_stream(device: torch.device):
    """The CUDA stream the body's copies run on, one per device, kept for the process."""
    return torch.cuda.Stream(device)


def _pipeline(lay: Layout, body: torch.Tensor, host: torch.Tensor, work, *, to_host: bool) -> None:
    """Move ``body`` (uint8 on the cache's device) to ``host`` (export, ``to_host``) or from it (import) piece
    by piece (:func:`_piece_ends`), calling ``work(start, end, sections)`` for each piece, in order, where the
    device work on it belongs: export gathers the sections that write into the piece (the indices of
    ``lay.sections`` not given before) and checksums it, then copies it out; import copies it in, then
    checksums it and checks and scatters the sections it completes.

    On a CUDA device the copies run on a stream of their own (:func:`_copy_stream`) and ``work`` on the
    current stream, ordered by events: export copies piece i while piece i + 1 is gathered; import queues
    every copy at once and works on piece i while piece i + 1 arrives.  Neither stream waits for more than the
    piece it needs and the host never waits; on return the current stream is ordered after every copy.  On the
    CPU ``body`` is ``host`` and only ``work`` runs."""
    ends = _piece_ends(lay)
    bounds = list(zip([0, *ends[:-1]], ends))
    given = 0

    def due(end: int) -> range:
        nonlocal given
        first = given
        while given < len(lay.sections) and (end == lay.body_bytes or (lay.sections[given].table < end if to_host
                                                                        else lay.sections[given].end <= end)):
            given += 1
        return range(first, given)

    if body.device.type != "cuda":
        for a, b in bounds:
            work(a, b, due(b))
        return
    main = torch.cuda.current_stream(body.device)
    copy = _copy_stream(body.device)
    copy.wait_stream(main)                  # the buffers as the work queued before this call leaves them
    body.record_stream(copy)                # body's memory is reused only after its copies
    arrived = []
    try:
        if not to_host:
            with torch.cuda.stream(copy):
                for a, b in bounds:
                    body[a:b].copy_(host[a:b], non_blocking=True)
                    arrived.append(copy.record_event())
        for i, (a, b) in enumerate(bounds):
            if to_host:
                work(a, b, due(b))
                copy.wait_event(main.record_event())
                with torch.cuda.stream(copy):
                    host[a:b].copy_(body[a:b], non_blocking=True)
            else:
                main.wait_event(arrived[i])
                work(a, b, due(b))
    except BaseException:
        copy.synchronize()                  # no copy still reads or writes the caller's buffer once this raises
        raise
    main.wait_stream(copy)


def _fill_section(st, s: Section, lay: Layout, body: torch.Tensor, epochs: torch.Tensor) -> None:
    """Gather section ``s``'s parts from the pools of ``st`` (a :class:`_Stored`) into ``body``: FORMAT.md 11.6.
    ``epochs``: its block epochs, int16 on the body's device.  Nothing waits for the device."""
    per, nb = lay.tiles_per_block, lay.blocks
    geo = L.geometry(lay.head_dim)
    entries = st.entries
    is_raw = entries < 0
    number = torch.where(is_raw, is_raw.cumsum(0) - 1, (~is_raw).cumsum(0) - 1)
    _view(body, s.table, nb * per, torch.int32).copy_(torch.where(is_raw, number + RAW_ENTRY_BIAS, number))
    body[s.table + nb * per * L.TABLE_ENTRY_BYTES:s.block_epochs] = 0
    _view(body, s.block_epochs, nb, torch.int16).copy_(epochs)
    body[s.block_epochs + nb * L.SEQUENCE_EPOCH_BYTES:s.slots] = 0
    # each tile's pool record at its place in the body: its number among the slot tiles, or after them among
    # the raw tiles (a scatter by a permutation; a boolean mask would make the host wait for its count)
    records = torch.empty(entries.shape[0], dtype=torch.int64, device=entries.device)
    records.index_copy_(0, torch.where(is_raw, number + s.slot_tiles, number), entries.long() & L.TABLE_INDEX_MASK)
    slot_bytes = geo.slot_bytes(s.capacity)
    torch.index_select(_rows(st.slots, slot_bytes), 0, records[:s.slot_tiles],
                       out=_rows(body[s.slots:s.raw], slot_bytes))
    torch.index_select(_rows(st.raw, geo.raw_bytes), 0, records[s.slot_tiles:],
                       out=_rows(body[s.raw:s.tail], geo.raw_bytes))
    _view(body, s.tail, lay.kv_heads * lay.tail_tokens * lay.head_dim, torch.int16,
          (lay.kv_heads, lay.tail_tokens, lay.head_dim)).copy_(st.tail)


class _BodyCheck:
    """FORMAT.md 11.7 on the body (S13-S16) as it arrives, piece by piece, where it is, with one wait for the
    verdict (:meth:`verdict`): the chunk CRCs (:meth:`chunks`) and each section's zero padding and block table
    numbering (:meth:`section`) on the body's device; after the wait, the block epochs and on CUDA the partial
    last chunk, brought to the host from the body as it arrived, so that what is checked is what is used."""

    def __init__(self, c: Container, body: torch.Tensor):
        self.c, self.body = c, body
        self.cuda = body.device.type == "cuda"
        self.crcs, self.flags, self.messages = [], [], []
        lay = c.layout
        self.whole = lay.body_bytes // L.SEQUENCE_CHUNK_BYTES if self.cuda else lay.chunks   # CRCs on the device
        if self.cuda:
            self.expected = arrays.upload(c.chunk_crcs[:self.whole].view(np.int32), body.device)

    def chunks(self, start: int, end: int) -> None:
        """The CRCs of the chunks of ``body[start:end]`` (``start`` on a chunk)."""
        self.crcs.append(_chunk_crcs(self.body[start:end]))

    def section(self, s: Section) -> None:
        """Section ``s``'s zero padding and block table (S14), once its bytes are in ``body``."""
        lay, body = self.c.layout, self.body
        per, nb = lay.tiles_per_block, lay.blocks
        pads = torch.cat([body[s.table + nb * per * L.TABLE_ENTRY_BYTES:s.block_epochs],
                          body[s.block_epochs + nb * L.SEQUENCE_EPOCH_BYTES:s.slots]])
        self.flags.append(torch.logical_not(pads.any()))
        self.messages.append(F.padding_message(s))
        entries = _view(body, s.table, nb * per, torch.int32)
        is_raw = entries < 0
        number = torch.where(is_raw, is_raw.cumsum(0) - 1, (~is_raw).cumsum(0) - 1)
        self.flags.append(((entries & L.TABLE_INDEX_MASK) == number).all() & (is_raw.sum() == s.raw_tiles))
        self.messages.append(F.table_message(s))

    def _computed(self, partial: list) -> np.ndarray:
        """Every chunk's CRC as computed, uint32 on the host."""
        if not self.cuda:
            return np.concatenate(self.crcs)
        return np.concatenate([torch.cat(self.crcs).cpu().numpy().view(np.uint32), partial]).astype(np.uint32)

    def verdict(self) -> list:
        """Raise :class:`FormatError` for the first rule the body breaks: a chunk CRC (S13), then the block epochs
        (S15, S16), then padding and tables (S14); else return each section's block epochs (int64 ``[blocks]``)
        as checked, for the commit.  One wait, for one small array of flags; then the block epochs (and on CUDA
        the partial last chunk) come to the host from the body."""
        c, body = self.c, self.body
        lay = c.layout
        if self.cuda:
            crc_ok = (torch.cat(self.crcs) == self.expected).all()
        else:
            crc_ok = torch.tensor(bool(np.array_equal(self._computed([]), c.chunk_crcs)))
        ok = torch.stack([crc_ok, *self.flags]).cpu().numpy()
        partial = [np.uint32(zlib.crc32(body[self.whole * L.SEQUENCE_CHUNK_BYTES:].cpu().numpy()))] \
            if self.whole < lay.chunks else []
        if not ok[0] or any(p != want for p, want in zip(partial, c.chunk_crcs[self.whole:])):
            raise F.chunk_crc_error(c.chunk_crcs, self._computed(partial))
        block_epochs = [_view(body, s.block_epochs, lay.blocks, torch.int16).cpu().numpy().astype(np.int64) & 0xFFFF
                        for s in lay.sections]
        message = F.block_epochs_message(lay, block_epochs)
        if message is not None:
            raise FormatError(message)
        if not ok.all():
            raise FormatError(self.messages[int(np.flatnonzero(~ok[1:])[0])])
        return block_epochs


# ----------------------------------------------------------------------------------------------
# The cache's storage: read for export, written by import.  The only functions that know its structures.

@dataclass
class _Stored:
    """One (layer, kind) of a sequence as the cache holds it."""

    layer: int
    kind: int
    capacity: int
    entries: torch.Tensor        # int32 [blocks * tiles_per_block]: pool entries (FORMAT.md 7.2), tile order
    epochs: np.ndarray           # int16 [blocks]: each block's epoch
    slots: torch.Tensor          # the slot pool, uint8 [n_slots, slot_bytes]
    raw: torch.Tensor            # the raw-tile pool, int16 [n_raw, 16, C]
    tail: torch.Tensor           # int16 [kv_heads, tail_tokens, head_dim]


def _read_storage(cache, seq: int) -> tuple[int, list]:
    """``(tokens, [_Stored per (layer, kind), in body order])`` of sequence ``seq`` of ``cache``."""
    cache._check_seq(seq)
    lens = cache._lens[:, seq]
    if len(set(lens.tolist())) != 1:
        raise InputError(f"sequence {seq} holds {lens.tolist()} tokens per layer: it is mid-update; export it "
                         "once every layer holds the same tokens")
    tokens = int(lens[0])
    nb, t = divmod(tokens, L.BLOCK_TOKENS)
    out = []
    for layer in range(cache.layers):
        for kind in KINDS:
            store = cache._store[layer][kind]
            out.append(_Stored(layer=layer, kind=kind, capacity=store.capacity,
                               entries=store.table[seq, :nb].reshape(-1), epochs=store.epochs[seq, :nb].copy(),
                               slots=store.slots.data, raw=store.raw.data, tail=store.tail[seq, :, :t]))
    return tokens, out


class _Writer:
    """Puts a checked container's sequence into ``cache``: a row, pool records, table entries, block epochs,
    tails, lengths and appended epochs.

    Where the cache has room as it is, the records are chosen at once -- those each pool hands out next, none
    taken -- and :meth:`scatter` writes the slots and raw tiles into them while the body still arrives,
    before its checks are in: free records are read by nothing.  :meth:`commit`, after the checks, takes
    them and writes what the cache reads (tables, epochs, tails, lengths).  Where the cache lacks room,
    :meth:`commit` makes it (``cache.grow``) or raises :class:`PoolExhaustedError` before anything is written,
    then scatters.  Either way a container the checks refuse leaves the cache as it was: no record taken, no
    pool or table grown."""

    def __init__(self, cache, c: Container):
        self.cache, self.c = cache, c
        self.short = self._shortfalls()
        self.records = None if self.short else self._records()
        self.tables = [None] * len(c.layout.sections)

    def _shortfalls(self) -> list:
        """What the cache lacks for the sequence: ``(message, (pool, records it lacks), or None)``; each layer
        and kind's share of the raw-tile arena is lent what the sequence's raw tiles need first; the device
        pools' counts are read with one wait."""
        cache, lay = self.cache, self.c.layout
        nb, short = lay.blocks, []
        if not (~cache._live).any():
            short.append((f"all {cache.max_seqs} sequence rows are in use", None))
        if nb > cache.max_blocks:
            short.append((f"the sequence holds {nb} blocks; the block table holds {cache.max_blocks} "
                          f"({cache.max_blocks * L.BLOCK_TOKENS} tokens) per sequence (max_blocks={nb} or more, or "
                          "grow=True, makes room)", None))
        stores = [(cache._store[s.layer][s.kind], s) for s in lay.sections]
        for pool, lack in cache._arena.cover([(store.raw, s.raw_tiles) for store, s in stores]):
            short.append((str(cache._exhausted(pool, lack, "the sequence")), (pool, lack)))
        slots = [store.slots for store, _ in stores]
        for pool, (_, s), free in zip(slots, stores, sync_pools(slots)):
            if s.slot_tiles > free:
                short.append((str(cache._exhausted(pool, s.slot_tiles - free, "the sequence")),
                              (pool, s.slot_tiles - free)))
        return short

    def _records(self) -> list:
        """Per section, the slot and raw-tile records its tiles go to (int64 on the cache's device), not taken."""
        out = []
        for s in self.c.layout.sections:
            store = self.cache._store[s.layer][s.kind]
            out.append((store.slots.upcoming(s.slot_tiles), store.raw.upcoming(s.raw_tiles)))
        return out

    def scatter(self, i: int, body: torch.Tensor) -> None:
        """Section ``i``'s slots and raw tiles into its records, and its block table translated to them (kept
        for :meth:`commit`).  Nothing waits for the device; a corrupt table entry (the checks refuse the
        container) is clamped into the section's records."""
        lay = self.c.layout
        s = lay.sections[i]
        store = self.cache._store[s.layer][s.kind]
        geo = L.geometry(lay.head_dim)
        slot_at, raw_at = self.records[i]
        slot_bytes = geo.slot_bytes(s.capacity)
        _rows(store.slots.data, slot_bytes).index_copy_(0, slot_at, _rows(body[s.slots:s.raw], slot_bytes))
        _rows(store.raw.data, geo.raw_bytes).index_copy_(0, raw_at, _rows(body[s.raw:s.tail], geo.raw_bytes))
        entries = _view(body, s.table, lay.blocks * lay.tiles_per_block, torch.int32)
        index = (entries & L.TABLE_INDEX_MASK).long()
        position = torch.where(entries < 0, index + s.slot_tiles, index)
        lut = torch.cat([slot_at, raw_at + RAW_ENTRY_BIAS])
        if lut.numel():
            position.clamp_(0, lut.numel() - 1)
        self.tables[i] = lut.index_select(0, position).to(torch.int32).view(lay.blocks, lay.tiles_per_block)

    def commit(self, body: torch.Tensor, appended: list, maps: list, block_epochs: list) -> int:
        """The sequence into the cache, with the epochs ``appended`` (per section: (b3, b4) to append, in
        order), ``maps`` (per section: container epoch -> cache epoch) and ``block_epochs`` (per section: its
        blocks' epochs as the checks read them); returns its id."""
        cache, c = self.cache, self.c
        lay = c.layout
        nb, t = lay.blocks, lay.tail_tokens
        if self.records is None:
            if not cache.grow:
                raise PoolExhaustedError(self.short[0][0])
            if not (~cache._live).any():
                cache._grow_rows(2 * cache.max_seqs)
            if nb > cache.max_blocks:
                cache._grow_blocks(grown(cache.max_blocks, nb - cache.max_blocks))
            lacks = [grow for _, grow in self.short if grow is not None]
            if lacks:
                grow_pools(lacks)
                cache._storage_changed()
            self.records = self._records()       # the counts _shortfalls read, or a grown pool's new list
            for i in range(len(lay.sections)):
                self.scatter(i, body)
        seq = int(np.flatnonzero(~cache._live)[0])
        epochs = [to_cache[e].astype(np.int16) for e, to_cache in zip(block_epochs, maps)]
        on_device = arrays.upload(np.stack(epochs), cache.device) if cache.adapt else None
        for i, (s, tables) in enumerate(zip(lay.sections, appended)):
            store = cache._store[s.layer][s.kind]
            for b3, b4 in tables:
                cache.calibration.add_epoch(s.layer, s.kind, b3, b4)
            if tables:
                store.add_epochs(tables)
                cache._epochs_appended(s.layer)
            store.slots.take_upcoming(s.slot_tiles)
            store.raw.take_upcoming(s.raw_tiles)
            store.table[seq, :nb] = self.tables[i]
            store.epochs[seq, :nb] = epochs[i]
            if store.epoch is not None:
                store.epoch[seq, :nb] = on_device[i]
            store.tail[seq, :, :t] = _view(body, s.tail, lay.kv_heads * t * lay.head_dim, torch.int16,
                                           (lay.kv_heads, t, lay.head_dim))
        cache._live[seq] = True
        cache._lens[:, seq] = lay.tokens
        cache._seq_lens[:, seq] = lay.tokens
        cache._lengths_changed()
        return seq


def _epoch_map(c: Container, cal: Calibration) -> tuple[list, list]:
    """Per section, the epochs to append to ``cal`` and the map container epoch -> cache epoch (FORMAT.md 11.8).

    Each epoch record, in increasing order, goes to the first epoch of ``cal`` (same layer and kind) after the
    one the previous record went to whose bases are the record's, or else to a new epoch appended to ``cal``:
    the blocks keep their bases and their epochs stay non-decreasing along the sequence.
    """
    appended, maps = [], []
    for s in c.layout.sections:
        have = cal.n_epochs(s.layer, s.kind)
        to_cache = np.zeros(1 + (s.epochs[-1].epoch if s.epochs else 0), dtype=np.int64)
        new, last = [], 0
        for r in s.epochs:
            match = next((e for e in range(last + 1, have)
                          if all(np.array_equal(x, y) for x, y in zip(cal.bases(s.layer, s.kind, e), (r.b3, r.b4)))),
                         None)
            if match is None:
                new.append((r.b3.copy(), r.b4.copy()))
                match = have + len(new) - 1
            to_cache[r.epoch] = last = match
        if have + len(new) > L.MAX_INDEXED_EPOCHS:
            raise PoolExhaustedError(f"layer {s.layer} {L.KIND_NAMES[s.kind]} would hold {have + len(new)} epochs: "
                                     "a cache names a block's epoch in an int16 index, at most MAX_INDEXED_EPOCHS = "
                                     f"{L.MAX_INDEXED_EPOCHS} epochs (gaac.cache); nothing was imported")
        appended.append(new)
        maps.append(to_cache)
    return appended, maps


# ----------------------------------------------------------------------------------------------
# Export and import.

def exported_layout(cache, seq: int, *, calibration: bool = False, heads=None) -> Layout:
    """The layout of :func:`export_sequence`'s container for ``seq`` (its size: ``.nbytes``)."""
    return _export_plan(cache, seq, calibration, heads)[0]


def _export_plan(cache, seq: int, calibration: bool, heads=None):
    """``(layout, stored, calibration)`` of the container of ``seq``: of KV heads ``heads = (start, stop)`` only
    when given (FORMAT.md 11.12), with the sliced calibration whose id and epoch ids the container names."""
    tokens, stored = _read_storage(cache, seq)
    cal = cache.calibration
    if heads is not None:
        cal, stored = _slice(cache, stored, heads)
    n_raw = torch.stack([(s.entries < 0).sum() for s in stored]).tolist() if stored else []
    epochs = [[EpochRecord(int(e), cal.epoch_id(s.layer, s.kind, int(e)), *cal.bases(s.layer, s.kind, int(e)))
               for e in np.unique(s.epochs) if e > 0] for s in stored]
    lay = sequence_layout(cal.layers, cal.kv_heads, cal.head_dim, tokens, [s.capacity for s in stored], n_raw,
                  epochs, calibration)
    return lay, stored, cal


def _slice(cache, stored: list, heads) -> tuple[Calibration, list]:
    """KV heads ``heads = (start, stop)`` of a sequence's storage (FORMAT.md 11.12): the sliced calibration, and
    per section the table entries of those heads' tiles (each block's tiles ``start * P .. stop * P - 1``, ``P``
    tiles per head) and their tails.  The entries still name the cache's pool records, so the slots and raw
    tiles are gathered as stored: a tile's bytes depend on its head's bases and its section's capacity, which
    the slice keeps."""
    start, stop = check_heads(heads, cache.kv_heads)
    per_head = L.tiles_per_head(cache.head_dim)
    per = cache.kv_heads * per_head
    out = [replace(st, entries=st.entries.view(-1, per)[:, start * per_head:stop * per_head].reshape(-1),
                   tail=st.tail[start:stop]) for st in stored]
    return cache.calibration.slice_heads(start, stop), out


def export_sequence(cache, seq: int, *, calibration: bool = False, out=None, heads=None) -> memoryview:
    """Sequence ``seq`` of ``cache`` (a :class:`gaac.PagedKVCache`) as a sequence container (FORMAT.md 11).

    Its blocks as stored -- no decoding, no encoding -- with the bases of every epoch they use, the
    tails and the calibration id; ``calibration=True`` embeds the calibration's canonical bytes (the file
    form).  Returns a read-only memoryview of the container: of ``out`` when given (a writable uint8
    buffer, array or CPU tensor of at least :func:`exported_layout`'s ``nbytes``), else of a new buffer,
    in pinned host memory when the cache is on a CUDA device.  The cache is left as it was.

    ``heads=(start, stop)``: KV heads ``start .. stop - 1`` only, of every layer (FORMAT.md 11.12), for a
    worker of another tensor-parallel size: the container of the same sequence in a cache made with
    ``cache.calibration.slice_heads(start, stop)``, whose id it names, and which imports it bit for bit.
    Its tiles are the cache's tiles of those heads, copied as stored.  An empty range or one past the
    cache's KV heads is an :class:`InputError`.
    """
    lay, stored, cal = _export_plan(cache, seq, calibration, heads)
    cuda = cache.device.type == "cuda"
    if out is None:
        host = torch.empty(lay.nbytes, dtype=torch.uint8, pin_memory=cuda)
    else:
        if not isinstance(out, torch.Tensor):
            array = _as_array(out, "out")
            if not array.flags.writeable:
                raise InputError("out: the buffer is read-only; pass a writable one (bytearray, NumPy array, tensor)")
            out = torch.from_numpy(array)
        host = out
        if host.dtype != torch.uint8 or host.device.type != "cpu" or host.dim() != 1 or host.shape[0] < lay.nbytes:
            raise InputError(f"out: expected a writable 1-D uint8 host buffer of at least {lay.nbytes} bytes, got "
                             f"{host.dtype} {list(host.shape)} on {host.device}")
        if not host.is_contiguous():
            raise InputError(f"out: the buffer is strided (strides {host.stride()}); pass a contiguous one")
        host = host[:lay.nbytes]
    body = torch.empty(lay.body_bytes, dtype=torch.uint8, device=cache.device) if cuda else host[lay.body_offset:]
    epochs = arrays.upload(np.stack([st.epochs for st in stored]).astype(np.int16), body.device)
    crcs = []

    def work(start: int, end: int, sections: range) -> None:
        for i in sections:
            _fill_section(stored[i], lay.sections[i], lay, body, epochs[i])
        crcs.append(_chunk_crcs(body[start:end]))

    _pipeline(lay, body, host[lay.body_offset:], work, to_host=True)
    if cuda:
        crcs = torch.cat(crcs).to("cpu", non_blocking=True)
        torch.cuda.current_stream(body.device).synchronize()      # the one wait: every gather, CRC and copy
        crcs = crcs.numpy().view(np.uint32)
        if len(crcs) < lay.chunks:               # the partial last chunk, now on the host
            crcs = np.append(crcs, zlib.crc32(host[lay.body_offset + len(crcs) * L.SEQUENCE_CHUNK_BYTES:].numpy()))
    else:
        crcs = np.concatenate(crcs)
    head = F.write_head(lay, cal.id, cal.canonical_bytes() if calibration else None, crcs)
    array = host.numpy()
    array[:len(head)] = np.frombuffer(head, np.uint8)
    array[len(head):lay.body_offset] = 0
    return memoryview(array).toreadonly()


def import_sequence(cache, data) -> int:
    """Put the sequence of container ``data`` (FORMAT.md 11; bytes-like, a uint8 array or CPU tensor) into
    ``cache`` as a new sequence and return its id.

    The cache's calibration must have the container's calibration id; epochs are matched or appended (module
    docstring).  Every CRC, table and epoch is checked before the sequence enters the cache: a corrupt
    container raises :class:`FormatError`, one for another calibration :class:`CalibrationError`, a cache
    without room :class:`PoolExhaustedError` (unless it grows) -- and the cache is then unchanged (free pool
    records may hold the container's bytes, which nothing reads).  The slots are copied, not decoded:
    decoding them (reading the sequence, attention) checks them as it checks a block's.  On a CUDA cache the
    host waits once, for the checks' verdict; the writes after it run on the current stream.

    ``data`` is read once: on the CPU into a private copy, on CUDA into the device's copy (the head into host
    memory of its own); the checks and the cache's writes read that copy, so a caller's buffer that changes
    during the call changes nothing that was checked.  An import that would give a layer and kind more epochs
    than the cache's block-epoch index names (``gaac.cache.MAX_INDEXED_EPOCHS``) raises
    :class:`PoolExhaustedError` before any of the body moves.
    """
    a = _as_array(data)
    c = read_head(a if cache.device.type == "cuda" else a.copy())
    check_calibration(c, cache.calibration, cache.adapt)
    appended, maps = _epoch_map(c, cache.calibration)
    with warnings.catch_warnings():                  # read-only bytes: torch warns, and nothing writes to them
        warnings.simplefilter("ignore", UserWarning)
        host = torch.from_numpy(c.body)
    lay = c.layout
    body = torch.empty(lay.body_bytes, dtype=torch.uint8, device=cache.device) if cache.device.type == "cuda" \
        else host
    check = _BodyCheck(c, body)
    writer = _Writer(cache, c)

    def work(start: int, end: int, sections: range) -> None:
        check.chunks(start, end)
        for i in sections:
            check.section(lay.sections[i])
            if writer.records is not None:
                writer.scatter(i, body)

    _pipeline(lay, body, host, work, to_host=False)
    block_epochs = check.verdict()
    return writer.commit(body, appended, maps, block_epochs)
