"""Fixed-size records and their free lists: the storage a :class:`gaac.PagedKVCache` is made of.

Per layer and kind the cache holds a slot pool (compressed tiles, FORMAT.md 6) and draws raw tiles (tiles
whose escapes overflow their slot, kept as BF16) from one :class:`RawArena` that every layer and kind
shares: how many tiles overflow differs from layer to layer and drifts as a context grows, so one arena
sized for the whole cache absorbs a layer whose rate spikes with what the others leave.

A pool's free list is on the host (:class:`Pool`, the reference codec) or on the device, where the CUDA
encoder pops records itself (:class:`DevicePool`).  A layer and kind's share of the arena is a pool of the
same kind whose records the arena lends it (:class:`HostShare`, :class:`DeviceShare`).
"""
from __future__ import annotations

import itertools
import math
import weakref

import numpy as np
import torch

from .. import arrays
from .. import layout as L

# Growth step of a pool, table or arena of a cache made with ``grow=True``: a 32nd of its size (or what is
# asked, if more), so that a growing cache allocates at most about 3% more than it holds, at the cost of a
# copy of the grown array every 32nd part of its size.
GROWTH = 1 / 32


def grown(size: int, extra: int) -> int:
    """The size a pool of ``size`` records grows to when it lacks ``extra`` records (``grow=True``)."""
    return size + max(extra, math.ceil(size * GROWTH), 1)


class Pool:
    """Fixed-size records with a free list on the host: a slot pool of one layer and kind.

    The free list is a stack of record indices in a NumPy array (the lowest free index on top, taken
    first): a sequence of a long context takes and gives back tens of thousands of records per pool at
    once (a prefill, an import, a removal), which a list of Python ints would convert one by one.
    """

    exact = True          # the host's counts are the pool's (a device pool's are a bound: DevicePool.exact)

    def __init__(self, name: str, n: int, record: tuple, dtype: torch.dtype, device: torch.device):
        self.name = name
        self.data = torch.zeros((n, *record), dtype=dtype, device=device)
        self._stack = np.arange(n - 1, -1, -1, dtype=np.int64)     # [:_top] are free; the top is the end
        self._top = n

    @property
    def free(self) -> np.ndarray:
        """The free record indices, int64, the next one taken last (a view: copy it to keep it)."""
        return self._stack[:self._top]

    @property
    def size(self) -> int:
        return self.data.shape[0]

    @property
    def used(self) -> int:
        return self.size - self.n_free()

    def n_free(self) -> int:
        return self._top

    def free_lower(self) -> int:
        """Free records, at least: exact for a host free list (see :meth:`DevicePool.free_lower`)."""
        return self._top

    def grow_to(self, n: int, read: bool = True) -> None:
        """Enlarge the pool to ``n`` records, the new ones free (``read``: a device pool's, see
        :meth:`DevicePool.grow_to`)."""
        old = self.size
        extra = torch.zeros((n - old, *self.data.shape[1:]), dtype=self.data.dtype, device=self.data.device)
        self.data = torch.cat([self.data, extra])
        self._stack = np.concatenate([np.arange(n - 1, old - 1, -1, dtype=np.int64), self.free,
                                      np.zeros(old - self._top, dtype=np.int64)])
        self._top += n - old

    def grow_by(self, extra: int, read: bool = True) -> None:
        """Make room for ``extra`` more records than are free (``grow=True``): a growth step of :func:`grown`
        (``read`` False: the caller has just read a device pool's count, :func:`grow_pools`)."""
        self.grow_to(grown(self.size, extra), read)

    def take(self, k: int) -> np.ndarray:
        """The ``k`` lowest-placed free records (the top of the stack), removed from the free list."""
        taken = self._stack[self._top - k:self._top][::-1].copy()
        self._top -= k
        return taken

    def give(self, indices, read: bool = True) -> None:
        """Return records to the free list (the lowest of them is taken first; ``read``: a device pool's)."""
        back = np.sort(np.asarray(indices, dtype=np.int64).reshape(-1))[::-1]
        self._stack[self._top:self._top + len(back)] = back
        self._top += len(back)

    def upcoming(self, k: int) -> torch.Tensor:
        """The ``k`` records :meth:`take` would hand out next, in its order, as an int64 tensor; none is taken.
        An import writes into them before it knows whether it keeps them (:meth:`take_upcoming` keeps them)."""
        return torch.from_numpy(self._stack[self._top - k:self._top][::-1].copy()).to(self.data.device)

    def take_upcoming(self, k: int) -> None:
        """Take the ``k`` records :meth:`upcoming` named (nothing taken or given since)."""
        self._top -= k


_VERSIONS = itertools.count(1)
_latest = 0             # the newest version any pool took: unchanged, no pool's arrays changed (latest_version)


def new_version() -> int:
    """A version number no pool had before (a pool's arrays or free list were replaced)."""
    global _latest
    _latest = next(_VERSIONS)
    return _latest


def latest_version() -> int:
    """The newest version any pool took: a captured step whose launches name pools' arrays is valid while this
    is what it was when the step was captured (else it compares its own pools' versions)."""
    return _latest
NO_RECORD = -1          # a free list's entry past its end: the CUDA encoder's "ran dry" (gaac.cuda.codec.NO_STORAGE)


class Arrival:
    """The event of a copy that many readers share (every pool's counts, every adapter's blocks): queried until
    it has completed, then known to have, so that a hundred readers cost one query of the device."""

    __slots__ = ("event", "done")

    def __init__(self, event):
        self.event, self.done = event, False

    def query(self) -> bool:
        if not self.done:
            self.done = self.event.query()
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.event.synchronize()
            self.done = True


class DevicePool(Pool):
    """A pool whose free list lives on the device, where the CUDA encoder pops records itself.

    ``order`` int32 holds the free records in the order they are taken; ``heads[cls]`` (device) counts
    the entries the encoder has taken (it pops with atomics, and counts on past the end when the list
    runs dry).  The host never waits for that count on the serving path: it keeps ``taken``, the count
    when it last read it, and ``pending``, how many records encodes launched since may have taken --
    so ``order``'s length minus both is a lower bound of the free records, exact after :meth:`sync`.
    On a GPU each encode is followed by an asynchronous copy of the counts to the host
    (:meth:`snapshot`), which the lower bound takes up once it has arrived: the bound stays within an
    update of the truth without waiting for the device.
    """

    _unlisted = False     # the free list is an array that is not the pool's own (DeviceShare's first): never written

    def __init__(self, name: str, n: int, record: tuple, dtype: torch.dtype, device: torch.device,
                 heads: torch.Tensor, cls: int, *, data: torch.Tensor | None = None,
                 order: torch.Tensor | None = None):
        """A pool of ``n`` records, all free, taken in index order.  ``heads[cls]`` must read zero (a new count:
        the pool does not write it).  ``data`` (``[max(n, 1), *record]``, zeros) and ``order`` (the free list's
        array: ``0 .. n - 1``, or one :data:`NO_RECORD` where ``n`` is 0) are the arrays to use where the caller
        made them (views of larger ones, :func:`gaac.cache.store.make_stores`); else the pool allocates them."""
        self.name = name
        # The kernels cannot take an empty array: an empty pool holds one record that no list hands out.
        self.data = torch.zeros((max(n, 1), *record), dtype=dtype, device=device) if data is None else data
        self._size = n
        self.heads, self.cls = heads, cls
        if order is None:
            order = (torch.arange(n, dtype=torch.int32, device=device) if n
                     else torch.full((1,), NO_RECORD, dtype=torch.int32, device=device))
        self._adopt(order, n)

    def _adopt(self, held: torch.Tensor, n: int) -> None:
        """Make ``held`` the free list's array, its first ``n`` entries listed (the rest :data:`NO_RECORD`), where
        the device's count already reads zero: nothing is written."""
        self.order, self.listed = held, n
        self.version = new_version()
        self.taken = self.pending = 0
        self._snap = None
        self._unlisted = False

    @property
    def size(self) -> int:
        return self._size

    def _set_order(self, order: torch.Tensor, room: int | None = None) -> None:
        """Make ``order`` the free list, the device's count of taken records zero.  Where it fits the list's
        array it is written there (entries past it set to :data:`NO_RECORD`, which the encoder takes for a
        list run dry), so that launches made with the array -- a captured step's -- stay valid; otherwise
        (``room``: at least that many entries) a new array takes it and :attr:`version` changes."""
        n = int(order.shape[0])
        held = None if self._unlisted else getattr(self, "order", None)
        if held is not None and n <= held.shape[0] and room is None:
            if n:
                # a copy first where the list is read from the array it is written to (a view of it)
                same = order.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
                held[:n] = order.clone() if same else order
            held[n:] = NO_RECORD
        else:
            held = torch.full((max(n, room or 0, 1),), NO_RECORD, dtype=torch.int32, device=order.device)
            held[:n] = order
            self.version = new_version()      # a new free list (and perhaps new data): plans made before are stale
            self._unlisted = False
        self.order, self.listed = held, n
        self.heads[self.cls] = 0
        self.taken = self.pending = 0
        self._snap = None

    def sync(self) -> None:
        """Read the device's count of taken records (waits for the encodes in flight)."""
        self.taken, self.pending, self._snap = int(self.heads[self.cls]), 0, None

    def snapshot(self, counts: tuple) -> None:
        """Take up, once it has arrived, ``counts``: (a NumPy view of a pinned copy of ``heads`` -- read through
        NumPy: a torch index costs more --, its event), started after the encodes that ``pending`` counts now."""
        host, event = counts
        self._snap = (host, event, self.pending)

    @property
    def exact(self) -> bool:
        """Whether :meth:`free_lower` is exact: no encode launched since the device's count was last read."""
        return self.pending == 0 and self._snap is None

    def settled(self) -> bool:
        """:attr:`exact`, once a copy of the device's counts that has arrived is taken up (no synchronisation)."""
        self.free_lower()
        return self.exact

    def free_lower(self) -> int:
        """Free records, at least (no synchronisation)."""
        if self._snap is not None and self._snap[1].query():
            host, _, counted = self._snap
            self.taken, self.pending, self._snap = int(host[self.cls]), self.pending - counted, None
        return self.listed - self.taken - self.pending

    def n_free(self) -> int:
        self.sync()
        return max(self.listed - self.taken, 0)

    def _rest(self, read: bool = True) -> torch.Tensor:
        # the device's count, read (``read``): appends the host does not account (a refused recording run
        # eagerly) take records without making the host's bound inexact.  ``read=False``: the caller read every
        # count it relies on (sync_pools) and launched nothing since, so the host's count is the device's.  An
        # empty list has nothing to read, whatever the count.
        if self.listed == 0:
            return self.order[:0]
        if read or not self.exact:
            self.sync()
        return self.order[min(self.taken, self.listed):self.listed]

    def grow_to(self, n: int, read: bool = True) -> None:
        """Enlarge the pool to ``n`` records: a new array and a new free list, the free records and then the new
        ones (``read`` False: the caller has just read the count, so the list's free part needs no wait)."""
        old = self.size
        extra = torch.zeros((n - old, *self.data.shape[1:]), dtype=self.data.dtype, device=self.data.device)
        self.data = torch.cat([self.data[:old], extra])
        self._size = n
        order = torch.cat([self._rest(read), torch.arange(old, n, dtype=torch.int32, device=self.data.device)])
        self._set_order(order, n)           # a new list, as the data is new

    def take(self, k: int) -> np.ndarray:
        rest = self._rest()
        taken = rest[:k].cpu().numpy().astype(np.int64)
        self.heads[self.cls] += k
        self.taken += k
        return taken

    def give(self, indices, read: bool = True, on_device=None, writes: ListWrites | None = None) -> None:
        """Return records to the free list, after the free ones (the lowest of them first).  ``read`` False: the
        caller has just read this pool's count from the device (:func:`sync_pools`); ``on_device``: the records,
        sorted, already on the device (int32; the caller brought several pools' in one copy, or sorted them
        there), in which case ``indices`` is not read; ``writes``: a write past the list's end joins them, for the
        caller to make with its other pools' (:class:`ListWrites`).  Where the list's
        array has room past its end they are written there: the list's records are then the same, with no
        count reset and no copy of the records already listed (a removed sequence gives back to every
        layer's pools).  Otherwise the list is rebuilt from its start, which leaves room past its end for
        as many records as are in use: every record given back until the list is taken to its end again."""
        if on_device is None:
            back = np.sort(np.asarray(indices, dtype=np.int64).reshape(-1)).astype(np.int32)
            if not len(back):
                return
            on_device = arrays.upload(back, self.data.device)
        elif not on_device.numel():
            return
        m, end = on_device.numel(), self.listed
        if self.reads_count(m):
            self.sync()
        if self.taken <= end and end + m <= self.order.shape[0]:
            if writes is not None:
                writes.add(self.order, end, on_device)
            else:
                self.order[end:end + m].copy_(on_device)
            self.listed = end + m
            return
        if writes is not None:
            writes.apply()              # the writes gathered so far first: this list is read and rebuilt
        self._set_order(torch.cat([self._rest(read), on_device]))

    def reads_count(self, m: int) -> bool:
        """Whether :meth:`give` of ``m`` records reads the device's count: not where the host's count is exact,
        nor where the list's array has room past its end and the encodes launched since the count was read
        cannot have taken the list past that end (the entries there read as run dry until they are written)."""
        return not self.exact and not (self.listed + m <= self.order.shape[0] and self.free_lower() >= 0)

    def upcoming(self, k: int) -> torch.Tensor:
        """The ``k`` records :meth:`take` would hand out next, as an int64 tensor on the device, none taken and
        nothing read back: valid right after :func:`sync_pools` (or :meth:`sync`), before anything else takes
        records."""
        start = min(self.taken, self.listed)
        return self.order[start:min(start + k, self.listed)].long()

    def take_upcoming(self, k: int) -> None:
        """Take the ``k`` records :meth:`upcoming` named, on the device's count and the host's, without waiting."""
        self.heads.narrow(0, self.cls, 1).add_(k)
        self.taken += k


def count_arrays(pools) -> list:
    """The device arrays that hold ``pools``' counts of taken records (one per layer and kind, for both its pools),
    for a caller that reads them in a copy of its own and hands them to :func:`counts_read`."""
    return list({id(p.heads): p.heads for p in pools if isinstance(p, DevicePool)}.values())


def counts_read(pools, heads: list, values) -> None:
    """``pools``' counts, read: ``values[i]`` holds what ``heads[i]`` (:func:`count_arrays`) held."""
    counts = dict(zip(map(id, heads), values))
    for p in pools:
        if isinstance(p, DevicePool):
            p.taken, p.pending, p._snap = int(counts[id(p.heads)][p.cls]), 0, None


def grow_pools(lacks, read: bool = True) -> None:
    """Grow each ``(pool, records it lacks)`` of ``lacks`` (``grow=True``; a pool named twice lacks the sum)
    with one wait for the device however many pools: their counts are read together (not at all with ``read``
    False: the caller has just read them), each slot pool takes a growth step's new list, and the raw shares
    are lent by their arena together (:meth:`RawArena.lend_growing`)."""
    merged: dict = {}
    for pool, n in lacks:
        merged[id(pool)] = (pool, merged.get(id(pool), (pool, 0))[1] + n)
    lacks = [(pool, n) for pool, n in merged.values() if n > 0]
    if not lacks:
        return
    if read:
        sync_pools([pool for pool, _ in lacks])
    shares = [(pool, n) for pool, n in lacks if isinstance(pool, _Share)]
    for pool, n in lacks:
        if not isinstance(pool, _Share):
            pool.grow_by(n, read=False)
    arenas = {id(s.arena): s.arena for s, _ in shares}
    for key, arena in arenas.items():
        arena.lend_growing([(s, n) for s, n in shares if id(s.arena) == key], read=False)


def sync_pools(pools, known: bool = False) -> list[int]:
    """The free records of each pool, exact: the device pools' counts read with one synchronisation for all of
    them (:meth:`DevicePool.n_free` waits once per pool).  ``known``: the caller knows that no launch the host has
    not accounted took records (no device-driven steps were made), so a pool whose count is exact
    (:meth:`DevicePool.settled`) is taken at the host's count, not read; where every pool's is, nothing waits."""
    read = [p for p in pools if not (known and isinstance(p, DevicePool) and p.settled())]
    heads = count_arrays(read)
    if heads:
        counts_read(read, heads, torch.stack(heads).tolist())
    return [max(p.listed - p.taken, 0) if isinstance(p, DevicePool) else p.n_free() for p in pools]




class ListWrites:
    """Writes of records past the ends of device free lists, gathered and made together: each
    ``(order, at, values)`` puts ``values`` (int32 on the device) at ``order[at:]``.  A cache makes its pools'
    and shares' list arrays as views of one allocation (:func:`gaac.cache.store.make_stores`), so the writes of a
    removal given back to every layer's pools, or of a prompt's loans to every share, are one indexed write per
    allocation instead of one copy a list."""

    def __init__(self):
        self.items = []

    def add(self, order: torch.Tensor, at: int, values: torch.Tensor) -> None:
        self.items.append((order, at, values))

    def apply(self) -> None:
        """Make the writes: one alone as a copy; several into arrays of one allocation as one ``index_copy_`` (the
        positions brought over in one asynchronous copy), the values one tensor where they lie in order in one."""
        items, self.items = self.items, []
        groups = {}
        for order, at, values in items:
            if values.numel():
                groups.setdefault(order.untyped_storage().data_ptr(), []).append((order, at, values))
        for group in groups.values():
            if len(group) == 1:
                order, at, values = group[0]
                order[at:at + values.numel()].copy_(values)
                continue
            storage = group[0][0].untyped_storage()
            base = storage.data_ptr()
            flat = group[0][0].as_strided((storage.nbytes() // 4,), (1,), 0)     # the whole allocation, int32
            flat.index_copy_(0, _positions(group, base, flat.device), _joined([values for _, _, values in group]))


def _positions(group: list, base: int, device) -> torch.Tensor:
    """The int32 positions (from ``base``) that the writes ``(order, at, values)`` of ``group`` fill, in order, as
    an int64 tensor on ``device``: made there from each write's start and length (one small upload), not
    uploaded whole (a removal gives back a record a tile: a host array of megabytes, pinned for its copy)."""
    counts = np.array([values.numel() for _, _, values in group], dtype=np.int64)
    starts = np.array([(order.data_ptr() - base) // 4 + at for order, at, _ in group], dtype=np.int64)
    total = int(counts.sum())
    # element j of write i goes to starts[i] + j: its index in the concatenation plus starts[i] - (writes before)
    shift = arrays.upload(np.concatenate([starts - (np.cumsum(counts) - counts), counts]), device)
    n = len(group)
    return torch.arange(total, dtype=torch.int64, device=device) + torch.repeat_interleave(
        shift[:n], shift[n:], output_size=total)


def _joined(parts: list) -> torch.Tensor:
    """``torch.cat(parts)`` of 1-D int32 tensors, without a copy where they lie one after another in one tensor."""
    first, storage = parts[0], parts[0].untyped_storage().data_ptr()
    at = first.data_ptr()
    for t in parts:
        if t.untyped_storage().data_ptr() != storage or t.data_ptr() != at or not t.is_contiguous():
            return torch.cat(parts)
        at += 4 * t.numel()
    total = (at - first.data_ptr()) // 4
    return first.as_strided((total,), (1,))


# ----------------------------------------------------------------------------------------------
# The raw-tile arena and its shares.

class _Share:
    """What a layer and kind's raw pool adds to a pool: its records are lent by a :class:`RawArena`.

    ``size`` is the records the share holds (its sequences' raw tiles and its free ones); records given
    back by a removed sequence return to the arena, where any layer may take them.

    The arena holds its shares and a share names its arena by a weak reference (:attr:`arena`): the cache
    holds both, so that dropping the cache frees the arena's array at once, without a garbage collection."""

    _arena: "weakref.ref[RawArena]"
    granted: int
    #: The highest fraction of its tiles an encode of this share's layer and kind took raw, where an encode ran
    #: its list dry (0.0 until one did): the loans before the next encode follow it, so that content which
    #: overflows more than the calibration planned is not encoded twice again.
    seen_rate: float = 0.0

    @property
    def arena(self) -> "RawArena":
        """The arena that lends this share its records."""
        return self._arena()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_arena"] = self.arena        # a copy of the share names the copy of its arena
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._arena = weakref.ref(state["_arena"])

    @property
    def size(self) -> int:
        return self.granted

    def give(self, indices, read: bool = True) -> None:
        self.arena.release(self, indices)

    def lends_in_place(self, k: int) -> bool:
        """Whether a loan of ``k`` records joins the free list without the device's count: a stack on the host
        has no count; a device list takes them past its end where its array has room."""
        return True

    def grow_to(self, n: int, read: bool = True) -> None:
        self.arena.lend_growing([(self, n - self.size)], read)

    def grow_by(self, extra: int, read: bool = True) -> None:
        self.arena.lend_growing([(self, extra)], read)


class HostShare(_Share, Pool):
    """A layer and kind's raw pool on the host (the reference codec): arena records on a free-list stack."""

    def __init__(self, name: str, arena: "RawArena"):
        self.name, self._arena, self.data = name, weakref.ref(arena), arena.data
        self._stack = np.zeros(0, np.int64)
        self._top = self.granted = 0

    def extend(self, indices: np.ndarray, room: int | None = None, read: bool = True, on_device=None,
               writes=None) -> None:
        """Records lent by the arena join the free list, below the free records already there (``room``,
        ``read``, ``on_device``, ``writes``: a device share's; a stack on the host has room for every record and
        no count to read)."""
        self._stack = np.concatenate([np.sort(indices)[::-1], self.free])
        self._top = len(self._stack)
        self.granted += len(indices)

    def surrender(self) -> np.ndarray:
        """Every free record, out of the free list, for the arena to lend elsewhere."""
        out = self.free.copy()
        self._top = 0
        self.granted -= len(out)
        return out


class DeviceShare(_Share, DevicePool):
    """A layer and kind's raw pool whose free list lives on the device (the CUDA encoder pops from it)."""

    def __init__(self, name: str, arena: "RawArena", heads: torch.Tensor, cls: int):
        """A share with no records.  ``heads[cls]`` must read zero (a new count: the share does not write it); its
        free list is the arena's empty one (:attr:`RawArena.empty_list`, never written) until its first loan."""
        self.name, self._arena, self.data = name, weakref.ref(arena), arena.data
        self.heads, self.cls = heads, cls
        self.granted = 0
        self._adopt(arena.empty_list, 0)
        self._unlisted = True

    def extend(self, indices: np.ndarray, room: int | None = None, read: bool = True, on_device=None,
               writes: ListWrites | None = None) -> None:
        """Records lent by the arena join the end of the free list.  The device's count is read (unless the list is
        empty, or ``read`` is False: the caller has just read it, :meth:`DevicePool._rest`).  ``room``: the list
        takes a new array with room for at least that many entries; else the records are written past the list's
        end while its array has room (one copy: the list and its count stay), or the list takes a new array of
        twice its length.  ``on_device``: ``indices``, sorted, already on the device (int32; the arena brings
        several shares' loans in one copy); ``writes``: a write past the list's end joins them
        (:class:`ListWrites`)."""
        indices = np.sort(indices).astype(np.int32)
        k, device = len(indices), self.data.device

        def up():
            return on_device if on_device is not None else arrays.upload(indices, device)

        if self.listed == 0:
            if writes is not None:
                writes.apply()
            if room is None and (self._unlisted or k > self.order.shape[0]):
                room = 2 * k if k > self.order.shape[0] else self.order.shape[0]
            if room is None:
                self._set_order(up())
            else:                 # a new array, written on the host: one copy, no wait
                held = np.full(max(k, room, 1), NO_RECORD, dtype=np.int32)
                held[:k] = indices
                self._set_listed(arrays.upload(held, device), k)
        else:
            rest = self._rest() if read else None        # read=False: the count only where the list moves
            end = self.listed
            in_place = room is None and self.taken <= end and end + k <= self.order.shape[0]
            if writes is not None and not in_place:
                writes.apply()          # the writes gathered so far first: this list is read and rebuilt
            if in_place:
                # room past the list's end: the records are written there, the list's array and count kept
                if writes is not None:
                    writes.add(self.order, end, up())
                else:
                    self.order[end:end + k].copy_(up())
                self.listed = end + k
            else:
                order = torch.cat([rest if rest is not None else self._rest(read), up()])
                if room is None and order.shape[0] > self.order.shape[0]:
                    room = 2 * order.shape[0]
                self._set_order(order, room)
        self.granted += k

    def lends_in_place(self, k: int) -> bool:
        """Whether a loan of ``k`` records is written past the list's end, keeping its array and count, so that
        the device's count need not be read first (:meth:`extend`): a list with records whose array has room
        for ``k`` more, which the device has not taken past its end (it runs past only where an encode ran it
        dry, which that encode's check then undoes)."""
        return self.listed > 0 and self.taken <= self.listed and self.listed + k <= self.order.shape[0]

    def adopt_loan(self, held: torch.Tensor, n: int) -> None:
        """The first loan of a share just made (its count reads zero): ``held``, an array the caller wrote, is
        the free list, its first ``n`` entries listed (:meth:`RawArena.first_loans`).  Nothing is written."""
        self._adopt(held, n)
        self.granted += n

    def _set_listed(self, held: torch.Tensor, n: int) -> None:
        """A new array ``held`` as the free list, its first ``n`` entries listed; the device's count set to zero."""
        self._adopt(held, n)
        self.heads[self.cls] = 0


class RawArena:
    """The raw tiles of every layer and kind of a cache: one int16 ``[n, 16, C]`` array (FORMAT.md 7.2's raw
    pool: a table entry with bit 31 set names a record of it), whose records are lent to the layers' shares.

    A share (one per layer and kind, :meth:`share`) holds the records its sequences' raw tiles occupy and
    a few free ones for the blocks it finishes next; the records no share holds are the arena's
    ``reserve``.  A share short of free records is lent more (:meth:`cover`), at least ``chunk`` at a time
    so that a decode loop asks rarely; when the reserve cannot cover a shortfall, every share's free records
    return to it first (one read of the device's counts) and each share asked is lent what it needs.  Where
    even every free record cannot cover every ask -- a prompt for which each layer and kind asks for more than
    its part of the arena -- no record moves between shares and the reserve is spread over the shares short in
    proportion to what each lacks, so that every share holds a part.  A removed sequence's raw tiles return to
    the reserve, where any layer may take them.  Lending writes a share's free list in place where the list's
    array has room (else a new array, with room for at least twice an even split of the arena, which launches
    made before must follow); it happens only where a share runs short, never inside a captured step.
    """

    def __init__(self, n: int, channels: int, device: torch.device):
        self.name = "the raw-tile arena"
        # The kernels cannot take an empty array: an empty arena holds one record that is never lent.
        self.data = torch.zeros((max(n, 1), L.BLOCK_TOKENS, channels), dtype=torch.int16, device=device)
        self.size = n
        self._stack = np.arange(n - 1, -1, -1, dtype=np.int64)     # the reserve: [:_top], lowest on top
        self._top = n
        self.shares = []
        self._empty = None

    @property
    def empty_list(self) -> torch.Tensor:
        """The free list of a device share that was never lent records: one :data:`NO_RECORD`, never written,
        shared by every such share (so that making a share writes nothing on the device)."""
        if self._empty is None:
            self._empty = torch.full((1,), NO_RECORD, dtype=torch.int32, device=self.data.device)
        return self._empty

    def share(self, name: str, heads: torch.Tensor | None = None, cls: int = 1):
        """A new share of the arena: on the device (popped by the CUDA encoder, counted in ``heads[cls]``)
        where ``heads`` is given, else on the host."""
        s = HostShare(name, self) if heads is None else DeviceShare(name, self, heads, cls)
        self.shares.append(s)
        return s

    def first_loans(self, shares: int) -> list | None:
        """What :meth:`cover` lends ``shares`` device shares about to be made (an arena with none yet), each
        asking for :attr:`chunk` records: per share ``(records, length)``, its records and the length of the new
        free-list array the loan gives it, for the caller to write every list at once
        (:func:`gaac.cache.store.make_stores`; :meth:`DeviceShare.adopt_loan`, then :meth:`take_first_loans`).
        None where the reserve cannot lend each its chunk (then :meth:`cover` lends, spreading the reserve)."""
        if self.shares or shares < 1:
            return None
        chunk = max(1, self.size // (4 * shares))
        if shares * chunk > self._top:
            return None
        room = 2 * (self.size // shares)
        # as _room and DeviceShare.extend size the array of a share whose list is the arena's empty one
        length = max(room, chunk) if room > 1 and chunk > 1 else (2 * chunk if chunk > 1 else 1)
        top, loans = self._top, []
        for _ in range(shares):
            loans.append((np.sort(self._stack[top - chunk:top]).astype(np.int32), length))
            top -= chunk
        return loans

    def take_first_loans(self, loans: list) -> None:
        """The records of :meth:`first_loans`'s ``loans``, adopted by the shares, leave the reserve."""
        self._top -= sum(len(records) for records, _ in loans)

    @property
    def reserve(self) -> int:
        """Records no share holds."""
        return self._top

    @property
    def chunk(self) -> int:
        """The fewest records a share is lent at once: a quarter of an even split of the arena."""
        return max(1, self.size // (4 * max(len(self.shares), 1)))

    def available(self) -> int:
        """Records any one share could be lent now, at least: the reserve and every share's free records."""
        return self._top + sum(max(s.free_lower(), 0) for s in self.shares)

    def used(self) -> int:
        """Records that hold a tile (exact: reads the device's counts)."""
        return self.size - self._top - sum(sync_pools(self.shares))

    def free_records(self) -> np.ndarray:
        """Every record that holds no tile, sorted: the reserve's and every share's free ones (which share
        holds a free record is lending, not content)."""
        parts = [self._stack[:self._top]]
        parts += [s.free if isinstance(s, HostShare) else s._rest().cpu().numpy() for s in self.shares]
        return np.sort(np.concatenate(parts).astype(np.int64))

    def _lend_all(self, asks: list) -> list:
        """Lend each ``(share, k)`` of ``asks`` ``k`` records of the reserve (fewer where it holds fewer), in
        turn, after the caller has just read every one's count (``read=False``); the device shares' records are
        brought to the device in one copy.  Returns what each was lent."""
        loans = []
        for share, k in asks:
            k = min(k, self._top)
            records = np.sort(self._stack[self._top - k:self._top]).astype(np.int32)
            self._top -= k
            loans.append((share, records, self._room(share, k, False) if k else None))
        batched = [r for s, r, _ in loans if isinstance(s, DeviceShare) and len(r)]
        device = (arrays.upload(np.concatenate(batched), self.data.device)
                  if len(batched) > 1 else None)
        at, writes = 0, ListWrites()
        for share, records, room in loans:
            if not len(records):
                continue
            on = None
            if device is not None and isinstance(share, DeviceShare):
                on, at = device[at:at + len(records)], at + len(records)
            share.extend(records, room, read=False, on_device=on, writes=writes)
        writes.apply()
        return [len(r) for _, r, _ in loans]

    def _room(self, share, k: int, read: bool = True) -> int | None:
        """Before a loan of ``k`` records that a device share's free-list array cannot hold (so that the loan
        would replace the array), the room to give the share's new array: at least twice an even split of the
        arena, so that the loans that follow, a prompt's after the cache's first, write the list in place and
        the encoder plans made with the array stay valid.  None where the loan needs no such array."""
        room = 2 * (self.size // max(len(self.shares), 1))
        if isinstance(share, DeviceShare) and share.order.shape[0] < room:
            if share.listed and share.listed - min(share.taken, share.listed) + k <= share.order.shape[0]:
                return None       # the free records by the host's count (at least the device's) leave room: no read
            rest = 0 if share.listed == 0 else share._rest(read).shape[0]     # an empty list is read without a wait
            if rest + k > share.order.shape[0]:
                return max(room, rest + k)
        return None

    def _put(self, indices: np.ndarray) -> None:
        """Records back on the reserve's stack, in place (it has room for every record of the arena)."""
        back = np.sort(np.asarray(indices, dtype=np.int64).reshape(-1))[::-1]
        self._stack[self._top:self._top + len(back)] = back
        self._top += len(back)

    def release(self, share, indices) -> None:
        """Records of ``share`` that held a removed sequence's raw tiles return to the reserve."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(indices):
            share.granted -= len(indices)
            self._put(indices)

    def reclaim(self) -> None:
        """Every share's free records return to the reserve (the device's counts read once)."""
        self._reclaim(sync_pools(self.shares))

    def _reclaim(self, free: list) -> None:
        """:meth:`reclaim`, with ``free``: each share's free records, as :func:`sync_pools` just read them (the
        device shares' records come to the host in one copy)."""
        giving = [s for s, n in zip(self.shares, free) if n]
        rests = [s._rest(read=False) for s in giving if isinstance(s, DeviceShare)]
        held = torch.cat(rests).cpu().numpy().astype(np.int64) if rests else None
        at = 0
        for s in giving:
            if isinstance(s, DeviceShare):
                n = s.listed - min(s.taken, s.listed)
                out, at = held[at:at + n], at + n
                s._set_order(s.order[:0])
                s.granted -= n
                self._put(out)
            else:
                self._put(s.surrender())

    def cover(self, needs, read: bool = True, known: bool = False) -> list:
        """Lend each ``(share, n)`` of ``needs`` records until it holds ``n`` free ones (at least ``chunk``
        at a time while the reserve allows).  Where the reserve cannot cover what the shares lack, every
        share's free records return to it first if the arena can then lend each share asked all it asks;
        if it cannot, no record moves between shares and the reserve is spread over the shares short, in
        proportion to what each lacks, so that no share is left with nothing.  Returns ``(share, records it
        still lacks)`` where the arena cannot cover them (nothing is taken back from what was lent).

        ``read`` False: where the reserve covers what the shares lack by their lower bounds and every loan is
        written past its list's end, the shares are lent that without reading the device's counts (so without
        waiting for the steps queued ahead; a share may be lent a little more than it lacks); otherwise as
        with ``read``.  For loans that an encode's own check backs (a guess), not a captured step's.

        ``known``: no launch the host has not accounted took records (:func:`sync_pools`): the counts that are
        exact are not read, so a new cache's first prompt lends without a wait even where its loans need new
        list arrays or the reserve is spread."""
        asked = [(s, n) for s, n in needs if n > 0]
        needs = [(s, n) for s, n in asked if s.free_lower() < n]
        if not needs:
            return []
        if not read:
            lack = [(s, n - max(s.free_lower(), 0)) for s, n in needs]
            if sum(d for _, d in lack) <= self._top:
                asks = self._asks(lack, in_place=True)
                if all(s.lends_in_place(k) for s, k in asks):
                    self._lend_all(asks)
                    return []
        # the counts of the shares asked, read in one wait: a share's records are listed from its count on,
        # and a step the host has not accounted yet (a graph replayed, not yet told) may have taken some
        free = dict(zip(map(id, (s for s, _ in needs)), sync_pools([s for s, _ in needs], known)))
        lack = [(s, n - free[id(s)]) for s, n in needs if free[id(s)] < n]
        if sum(d for _, d in lack) > self._top:
            every = sync_pools(self.shares, known)
            if self._top + sum(every) < sum(n for _, n in asked):
                return self._spread(lack)
            # Every free record back to the reserve, then each share asked is lent all it needs.
            self._reclaim(every)
            lack = asked
        lent = self._lend_all(self._asks(lack))
        return [(s, d - n) for (s, d), n in zip(lack, lent) if n < d]

    def covers_unread(self, needs, known: bool = False) -> bool:
        """Whether :meth:`cover` of ``needs`` with ``read=False`` (and ``known``) lends without reading a count
        (nothing is lent here): every share asked holds what it needs by its lower bound, or the reserve covers
        what they lack and every loan is written past its list's end; or, with ``known``, every share's count is
        exact and the loans take no share's free records back (which reads them from the device)."""
        asked = [(s, n) for s, n in needs if n > 0]
        needs = [(s, n) for s, n in asked if s.free_lower() < n]
        if not needs:
            return True
        lack = [(s, n - max(s.free_lower(), 0)) for s, n in needs]
        from_reserve = sum(d for _, d in lack) <= self._top
        if from_reserve and all(s.lends_in_place(k) for s, k in self._asks(lack, in_place=True)):
            return True
        if not known or not all(s.settled() for s in self.shares if isinstance(s, DevicePool)):
            return False
        # the counts are the host's: cover lends from the reserve, or spreads it where even every share's free
        # records would not cover every ask; only taking those records back reads the device
        return from_reserve or self._top + sum(max(s.free_lower(), 0) for s in self.shares) < sum(n for _, n in asked)

    def _asks(self, lack: list, in_place: bool = False) -> list:
        """What each ``(share, records it lacks)`` of ``lack`` is lent: what it lacks, at least a chunk while the
        reserve keeps what the later ones lack (``in_place``: only what it lacks where a chunk would not fit its
        list's array)."""
        asks, top, later = [], self._top, sum(d for _, d in lack)
        for s, d in lack:
            later -= d
            k = min(max(d, min(self.chunk, top - later)), top)
            if in_place and not s.lends_in_place(k):
                k = d
            asks.append((s, k))
            top -= k
        return asks

    def _spread(self, lack: list) -> list:
        """Lend the whole reserve to the shares of ``lack`` (``(share, records it lacks)``, more in all than the
        reserve holds), to each in proportion to what it lacks (the records left by rounding down go one each
        to the largest remainders, the first of equal ones first); return ``(share, records it still lacks)``."""
        top, total = self._top, sum(d for _, d in lack)
        give = [d * top // total for _, d in lack]
        left = top - sum(give)
        for i in sorted(range(len(lack)), key=lambda i: -(lack[i][1] * top % total))[:left]:
            give[i] += 1
        lent = self._lend_all(list(zip((s for s, _ in lack), give)))
        return [(s, d - n) for (s, d), n in zip(lack, lent) if n < d]

    def grow_to(self, n: int) -> None:
        """Enlarge the arena to ``n`` records (``grow=True``); every share sees the new array."""
        old = self.size
        extra = torch.zeros((n - old, *self.data.shape[1:]), dtype=self.data.dtype, device=self.data.device)
        self.data = torch.cat([self.data[:old], extra])
        self.size = n
        self._stack = np.concatenate([self._stack, np.zeros(n - old, dtype=np.int64)])
        self._put(np.arange(old, n, dtype=np.int64))
        for s in self.shares:
            s.data = self.data
            s.version = new_version()      # plans made with the old array are stale

    def lend_growing(self, asks: list, read: bool = True) -> None:
        """Lend each ``(share, extra)`` of ``asks`` ``extra`` more records from the reserve, growing the arena
        once, by a step of :func:`grown`, where the reserve lacks what they ask together (no other share gives
        any back: they may need theirs for the same update).  The shares' counts are read in one wait (not
        at all with ``read`` False: the caller has just read them) and every loan comes to the device in one
        copy."""
        asks = [(s, k) for s, k in asks if k > 0]
        total = sum(k for _, k in asks)
        if self._top < total:
            self.grow_to(grown(self.size, total - self._top))
        if read:
            sync_pools([s for s, _ in asks])
        self._lend_all(asks)

