"""numba.cuda kernels that encode tiles into GAAC v1 slots and decode them, bit-exact with the reference.

Contract
========
Arrays are torch CUDA tensors (NumPy arrays or torch CPU tensors under the
CUDA simulator), C-contiguous.  ``C = min(head_dim, 128)``, ``N = 16*C``,
``G = N/8`` groups per tile; ``slot_bytes = TileGeometry(C).slot_bytes(capacity)``.

Encode (:class:`EncodePlan`), one launch for any number of tiles ``n``
(all KV heads of one finished block, or every complete block of a prompt):

* ``bits``     int16 ``[n, 16, C]``  -- BF16 bit patterns of the tiles, tile order of
  :func:`gaac.tiles.block_tiles` (pass ``bf16.view(torch.int16)``);
* ``bases``    int16 ``[P, 2, C]``   -- :func:`pack_bases`; tile ``i`` uses row ``i % P`` (``P`` = tiles
  per block for a layer's bases, or ``P = n`` for one row per tile);
* ``slots``    uint8 ``[S, slot_bytes]`` and ``raw`` int16 ``[R, 16, C]`` -- the two storage pools;
* ``slot_free`` / ``raw_free`` int32 -- device-side free lists: indices of free slots / raw tiles;
* ``heads``    int32 ``[2]``         -- how many entries of each free list are taken; the kernel pops
  with ``atomicAdd`` (``heads[0]`` for slots, ``heads[1]`` for raw tiles);
* out ``entries`` int32 ``[n]``      -- each tile's block-table entry (FORMAT.md 7.2): the slot index,
  or ``raw index | 1 << 31`` (a negative int32) when the escapes overflow the slot.  ``-1``
  (:data:`NO_STORAGE`) means the free list was exhausted; the tile was not stored, and
  ``heads`` exceeds the list's length -- check it whenever the host syncs anyway;
* out ``escape_used`` int32 ``[n]``  -- escape bytes each tile needs (beyond ``capacity``: raw).

A fitting tile's slot receives exactly ``gaac.reference.codec.encode_tiles``'s
bytes; an overflowing tile's BF16 bits are copied to its raw tile and no slot is
touched.  Nothing is synchronised with the host: the storage decision lives in
``entries`` on the device, where the cache's block table (``entries`` may be a
view of it) and attention read it.

Decode (:class:`DecodePlan`): ``entries [n]`` (slot or raw entries, as above) ->
``out`` int16 ``[n, 16, C]`` plus ``status`` int32 ``[n]``: 0 valid, :data:`BAD_TAG`
(a group has the reserved mode tag 3) or :data:`BAD_ESCAPES` (the tags need
more escape bytes than ``capacity``); a bad tile's output is unspecified.
The escape area's zero padding is not checked here (the block container's
decoder checks it, and its CRC covers it).

Kernel shape: one thread block per tile, one thread per 8-element group
(256 threads for C=128, 128 for C=64).  A thread loads its group as two 64-bit
words and works on four 16-bit lanes per register (:mod:`gaac.cuda.bitops`);
escape offsets are an exclusive prefix sum over the tile's groups, from two warp
ballots (4-bit and raw groups) and a shared-memory sum of warp totals.  The
encoder stages the 3-bit codes, the tag words and the escape bytes in shared
memory and writes every section of the slot with 64-bit stores.

Host overhead: kernels are compiled once per tile width with explicit types;
a plan validates its pools once and keeps the launch configuration; on the GPU
a launch packs the kernel parameters itself and calls ``cuda.core.launch``
(``fast=False`` takes numba's ordinary dispatcher path instead).
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
from numba import cuda, int32, int64, uint8

from .. import layout as L
from ..errors import InputError
from .bitops import (LANES, SIMULATOR, WARP, ballot, ballot_scratch, gather4, join_bf16x4, lanes_below, narrow4, pack3x4,
                     spread4, spread_even, split_bf16x4, unpack3x4, widen4, window)

NO_STORAGE = -1                                  # entry of a tile whose free list ran dry
BAD_TAG = 1                                      # decode status: a group has the reserved tag
BAD_ESCAPES = 2                                  # decode status: the tags need more escape bytes than the slot has
_RAW_ENTRY_BIAS = L.TABLE_RAW_FLAG - (1 << 32)   # raw index + this = the entry as a (negative) int32
_BAD_TAG_WEIGHT = 1 << 20                        # added to a warp's escape total when it has a reserved tag

_WORD = 8                                        # bytes per int64 word
_LANES_PER_WORD = 4                              # 16-bit lanes (elements, bases) per word
_ESC4 = L.ESCAPE_BYTES[L.MODE_4BIT]
_ESCR = L.ESCAPE_BYTES[L.MODE_RAW]
_ONE_LANES = 0x100 * LANES                       # 256 in every lane: e + 256 - base stays positive
# 256 + e - base lies in 256 .. 256+window-1 exactly when these lane bits read 256 (lanes stay below 512).
_MASK3 = (0x1FF & ~(L.WINDOW_3BIT - 1)) * LANES
_MASK4 = (0x1FF & ~(L.WINDOW_4BIT - 1)) * LANES
_LOW3 = (1 << L.CODE_BITS) - 1
_CODE_FIELD = L.GROUP_SIZE * L.CODE_BITS          # 24 bits of codes per group
_HALF_FIELD = _CODE_FIELD // 2
# The kernels build and read a warp's 2-bit tags from the 4-bit and raw ballots as bit 0 and bit 1.
_TAG_BITS_OK = (L.MODE_3BIT, L.MODE_4BIT, L.MODE_RAW, L.TAG_BITS) == (0, 1, 2, 2)
assert _TAG_BITS_OK, "the kernels' tag layout no longer matches gaac.layout's mode numbers"

_ENCODE_SIG = ("void(int64[:, ::1], int64[:, :, ::1], int64, int64[:, ::1], int32[::1], int64[:, ::1], "
               "int32[::1], int32[::1], int32[::1], int32[::1])")
_DECODE_SIG = "void(int64[:, ::1], int64[:, ::1], int32[::1], int64[:, :, ::1], int64, int64[:, ::1], int32[::1])"


def _check_channels(channels: int) -> L.TileGeometry:
    if channels not in {L.tile_channels(d) for d in L.SUPPORTED_HEAD_DIMS}:
        raise InputError(f"tiles of {channels} channels do not exist in GAAC v1 (64 or 128)")
    return L.TileGeometry(channels)


@functools.lru_cache(maxsize=None)
def encode_kernel(channels: int):
    """The encode kernel for ``channels``-wide tiles, compiled once (see the module docstring)."""
    return cuda.jit(_ENCODE_SIG)(encode_source(channels))


@functools.lru_cache(maxsize=None)
def decode_kernel(channels: int):
    """The decode kernel for ``channels``-wide tiles, compiled once (see the module docstring)."""
    return cuda.jit(_DECODE_SIG)(decode_source(channels))


def encode_source(channels: int):
    """The Python function of the encode kernel, its tile geometry baked in as constants."""
    geo = _check_channels(channels)
    G = geo.groups
    GPR = geo.groups_per_row
    WARPS = G // WARP
    CODE_WORDS = geo.code_bytes // _WORD
    TAG_WORDS = geo.tag_bytes // _WORD
    STAGE = G * _ESCR
    SCRATCH = ballot_scratch(G)

    def kernel(bits, bases, capacity, slots, slot_free, raw, raw_free, heads, entries, escape_used):
        code24 = cuda.shared.array(G, int32)
        stage = cuda.shared.array(STAGE, uint8)
        tag_words = cuda.shared.array(WARPS, int64)
        warp_total = cuda.shared.array(WARPS, int32)
        dest = cuda.shared.array(1, int32)
        scratch = cuda.shared.array(SCRATCH, int32)

        tile = cuda.blockIdx.x
        g = cuda.threadIdx.x
        lane = g % WARP
        warp = g // WARP

        # Split the group's 8 elements; pick the narrowest mode (FORMAT.md 5.1-5.3).
        x0 = bits[tile, 2 * g]
        x1 = bits[tile, 2 * g + 1]
        row = tile % bases.shape[0]
        col = (g % GPR) * 2
        sm0, e0 = split_bf16x4(x0)
        sm1, e1 = split_bf16x4(x1)
        d3a = (e0 | _ONE_LANES) - bases[row, 0, col]
        d3b = (e1 | _ONE_LANES) - bases[row, 0, col + 1]
        d4a = (e0 | _ONE_LANES) - bases[row, 1, col]
        d4b = (e1 | _ONE_LANES) - bases[row, 1, col + 1]
        if (((d3a & _MASK3) ^ _ONE_LANES) | ((d3b & _MASK3) ^ _ONE_LANES)) == 0:
            mode = L.MODE_3BIT
            ca, cb = d3a, d3b
        elif (((d4a & _MASK4) ^ _ONE_LANES) | ((d4b & _MASK4) ^ _ONE_LANES)) == 0:
            mode = L.MODE_4BIT
            ca, cb = d4a, d4b
        else:
            mode = L.MODE_RAW
            ca, cb = e0, e1
        code24[g] = pack3x4(ca) | (pack3x4(cb) << _HALF_FIELD)

        # Escape offsets: exclusive prefix sum of 0/1/5 bytes over the tile's groups.
        m4 = ballot(mode == L.MODE_4BIT, scratch)
        mr = ballot(mode == L.MODE_RAW, scratch)
        below = lanes_below(lane)
        offset = cuda.popc(m4 & below) * _ESC4 + cuda.popc(mr & below) * _ESCR
        if lane == 0:
            warp_total[warp] = cuda.popc(m4) * _ESC4 + cuda.popc(mr) * _ESCR
            tag_words[warp] = spread_even(m4) | (spread_even(mr) << 1)   # tags 1 and 2: see _TAG_BITS_OK
        cuda.syncthreads()
        total = 0
        for w in range(WARPS):
            t = int64(warp_total[w])
            total += t
            if w < warp:
                offset += t
        fits = total <= capacity

        # Storage decision: pop a slot, or a raw tile when the escapes overflow (FORMAT.md 6).
        if g == 0:
            if fits:
                k = cuda.atomic.add(heads, 0, 1)
                d = slot_free[k] if k < slot_free.shape[0] else NO_STORAGE
                entries[tile] = d
            else:
                k = cuda.atomic.add(heads, 1, 1)
                d = raw_free[k] if k < raw_free.shape[0] else NO_STORAGE
                entries[tile] = d + _RAW_ENTRY_BIAS if d >= 0 else NO_STORAGE
            dest[0] = d
            escape_used[tile] = total
        if fits and mode == L.MODE_4BIT:
            stage[offset] = gather4(ca >> L.CODE_BITS) | (gather4(cb >> L.CODE_BITS) << 4)
        elif fits and mode == L.MODE_RAW:
            for p in range(_ESCR):
                stage[offset + p] = (gather4(ca >> (L.CODE_BITS + p))
                                     | (gather4(cb >> (L.CODE_BITS + p)) << 4))
        cuda.syncthreads()

        d = dest[0]
        if d < 0:
            return
        if not fits:
            raw[d, 2 * g] = x0
            raw[d, 2 * g + 1] = x1
            return
        slots[d, g] = narrow4(sm0) | (narrow4(sm1) << 32)
        for k in range(g, slots.shape[1] - G, G):
            if k < CODE_WORDS:
                g0 = (k * 64) // _CODE_FIELD
                s = k * 64 - g0 * _CODE_FIELD
                acc = int64(code24[g0]) >> s
                for j in range(1, 4):
                    sh = j * _CODE_FIELD - s
                    if sh < 64 and g0 + j < G:
                        acc |= int64(code24[g0 + j]) << sh
            elif k < CODE_WORDS + TAG_WORDS:
                acc = tag_words[k - CODE_WORDS]
            else:
                b = (k - CODE_WORDS - TAG_WORDS) * _WORD
                acc = 0
                for i in range(_WORD):
                    if b + i < total:
                        acc |= int64(stage[b + i]) << (8 * i)
            slots[d, G + k] = acc

    return kernel


def decode_source(channels: int):
    """The Python function of the decode kernel, its tile geometry baked in as constants."""
    geo = _check_channels(channels)
    G = geo.groups
    GPR = geo.groups_per_row
    WARPS = G // WARP
    CODE0 = geo.code_offset // _WORD
    TAG0 = geo.tag_offset // _WORD
    ESC_BIT0 = geo.escape_offset * 8

    def kernel(slots, raw, entries, bases, capacity, out, status):
        warp_total = cuda.shared.array(WARPS, int32)
        tile = cuda.blockIdx.x
        g = cuda.threadIdx.x
        lane = g % WARP
        warp = g // WARP

        entry = entries[tile]
        if entry < 0:
            r = int64(entry) & L.TABLE_INDEX_MASK
            out[tile, 2 * g] = raw[r, 2 * g]
            out[tile, 2 * g + 1] = raw[r, 2 * g + 1]
            if g == 0:
                status[tile] = 0
            return

        # The warp's 32 tags are one 64-bit word: count 4-bit and raw groups below this lane.
        tw = slots[entry, TAG0 + warp]
        lo = tw & 0x5555555555555555
        hi = (tw >> 1) & 0x5555555555555555
        t4 = lo & ~hi
        tr = hi & ~lo
        mode = (tw >> (2 * lane)) & 3
        below = lanes_below(2 * lane)
        offset = cuda.popc(t4 & below) * _ESC4 + cuda.popc(tr & below) * _ESCR
        if lane == 0:
            warp_total[warp] = (cuda.popc(t4) * _ESC4 + cuda.popc(tr) * _ESCR
                                + (_BAD_TAG_WEIGHT if (lo & hi) != 0 else 0))
        cuda.syncthreads()
        total = 0
        for w in range(WARPS):
            t = int64(warp_total[w])
            total += t
            if w < warp:
                offset += t
        if g == 0:
            status[tile] = BAD_TAG if total >= _BAD_TAG_WEIGHT else (BAD_ESCAPES if total > capacity else 0)

        # 24 bits of 3-bit codes at bit 24g of the code stream (may straddle two words).
        bit = g * _CODE_FIELD
        sh = bit & 63
        w0 = CODE0 + (bit >> 6)
        v = window(slots[entry, w0], slots[entry, w0 + 1] if sh + _CODE_FIELD > 64 else 0, sh, _CODE_FIELD)
        ca = unpack3x4(v)
        cb = unpack3x4(v >> _HALF_FIELD)
        row = tile % bases.shape[0]
        col = (g % GPR) * 2
        n_esc = _ESC4 if mode == L.MODE_4BIT else (_ESCR if mode == L.MODE_RAW else 0)
        if n_esc and offset + n_esc <= capacity:
            pos = ESC_BIT0 + offset * 8
            sh = pos & 63
            w0 = pos >> 6
            esc = window(slots[entry, w0], slots[entry, w0 + 1] if sh + 8 * n_esc > 64 else 0, sh, 8 * n_esc)
            for p in range(n_esc):
                byte = esc >> (8 * p)
                ca |= spread4(byte) << (L.CODE_BITS + p)
                cb |= spread4(byte >> 4) << (L.CODE_BITS + p)
        if mode == L.MODE_RAW:
            ea, eb = ca, cb
        elif mode == L.MODE_4BIT:
            ea = ca + bases[row, 1, col]
            eb = cb + bases[row, 1, col + 1]
        else:
            ea = ca + bases[row, 0, col]
            eb = cb + bases[row, 0, col + 1]
        smw = slots[entry, g]
        out[tile, 2 * g] = join_bf16x4(widen4(smw), ea)
        out[tile, 2 * g + 1] = join_bf16x4(widen4(smw >> 32), eb)

    return kernel


# ----------------------------------------------------------------------------------------------
# Host side: checking arrays once, packing kernel parameters, launching on torch's stream.

def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _array(x, name: str, dtype: str, shape: tuple):
    """Check ``x`` (dtype name, shape with ``None`` for any size, C-contiguous, right device); return it."""
    if _is_torch(x):
        got = str(x.dtype).removeprefix("torch.")
        contiguous = x.is_contiguous()
        if SIMULATOR and x.device.type != "cpu":
            raise InputError(f"{name}: the CUDA simulator runs on the CPU; got a tensor on {x.device}")
        if not SIMULATOR and x.device.type != "cuda":
            raise InputError(f"{name}: expected a CUDA tensor, got one on {x.device}")
    elif isinstance(x, np.ndarray) and SIMULATOR:
        got = str(x.dtype)
        contiguous = x.flags.c_contiguous
    else:
        want = "a torch tensor" + (" or NumPy array" if SIMULATOR else " on a CUDA device")
        raise InputError(f"{name}: expected {want}, got {type(x).__name__}")
    if got != dtype:
        raise InputError(f"{name}: dtype {got}, expected {dtype}")
    if len(x.shape) != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InputError(f"{name}: shape {list(x.shape)}, expected {want}")
    if not contiguous:
        raise InputError(f"{name}: must be C-contiguous")
    return x


def _words(x):
    """``x`` reinterpreted as int64 words, its trailing axes (after the first) merged into whole words."""
    lead = x.shape[0]
    if _is_torch(x):
        import torch

        if x.numel() and x.data_ptr() % 16:
            raise InputError("arrays must start on a 16-byte boundary (slice whole rows of a pool)")
        w = x.reshape(lead, -1).view(torch.int64)
        return w.numpy() if SIMULATOR else w
    return x.reshape(lead, -1).view(np.int64)


def _plain(x):
    """A 1-D int32 array as the kernel takes it (a NumPy view in the simulator)."""
    return x.numpy() if SIMULATOR and _is_torch(x) else x


def _check_capacity(capacity) -> int:
    if int(capacity) != capacity or capacity % L.SLOT_ALIGN or not 0 <= capacity <= L.MAX_ESCAPE_CAPACITY:
        raise InputError(f"capacity {capacity}: must be a multiple of {L.SLOT_ALIGN} in 0..{L.MAX_ESCAPE_CAPACITY}")
    return int(capacity)


def _bases_words(bases, channels: int):
    _array(bases, "bases", "int16", (None, 2, channels))
    if bases.shape[0] == 0:
        raise InputError("bases: needs at least one row")
    w = _words(bases)
    return w.reshape(bases.shape[0], 2, channels // _LANES_PER_WORD)


def pack_bases(b3, b4):
    """Per-tile bases ``b3``, ``b4`` ``[P, C]`` (as :func:`gaac.tiles.tile_bases` gives) -> int16 ``[P, 2, C]``.

    Torch in, torch out (same device); NumPy in, NumPy out.  Done once per
    layer and kind: the kernels read the bases as 16-bit lanes.
    """
    if _is_torch(b3):
        import torch

        out = torch.stack([b3.to(torch.int16), b4.to(torch.int16)], dim=1).contiguous()
        lo, hi = int(out[:, 0].min()), int(out[:, 0].max())
        lo4, hi4 = int(out[:, 1].min()), int(out[:, 1].max())
    else:
        out = np.ascontiguousarray(np.stack([np.asarray(b3), np.asarray(b4)], axis=1).astype(np.int16))
        lo, hi, lo4, hi4 = out[:, 0].min(), out[:, 0].max(), out[:, 1].min(), out[:, 1].max()
    if len(out.shape) != 3 or out.shape[2] not in (L.tile_channels(d) for d in L.SUPPORTED_HEAD_DIMS):
        raise InputError(f"bases must be [tiles, C] with C in (64, 128); got b3 {list(b3.shape)}, b4 {list(b4.shape)}")
    if lo < 0 or hi > L.B3_MAX or lo4 < 0 or hi4 > L.B4_MAX:
        raise InputError(f"3-bit bases must lie in 0..{L.B3_MAX} and 4-bit bases in 0..{L.B4_MAX}")
    return out


def _params(a) -> list:
    """Kernel parameters of one argument (an int64 scalar or a C-contiguous tensor), laid out as
    numba's own launch lays them out: meminfo, parent, size, itemsize, data, shape, strides."""
    if isinstance(a, int):
        return [ctypes.c_int64(a)]
    item = a.element_size()
    return [0, 0, a.numel(), item, a.data_ptr(), *a.shape, *(s * item for s in a.stride())]


def _word_params(x) -> list:
    """:func:`_params` of ``_words(x)`` without building that view (saves host time per call)."""
    if x.data_ptr() % 16:
        raise InputError("arrays must start on a 16-byte boundary (slice whole rows of a pool)")
    rows = x.shape[0]
    cols = x.numel() * x.element_size() // _WORD // rows if rows else 0
    return [0, 0, rows * cols, _WORD, x.data_ptr(), rows, cols, cols * _WORD, _WORD]


class _Launcher:
    """A compiled kernel at a fixed block size, launched on a torch stream (or in the simulator)."""

    def __init__(self, dispatcher, threads: int):
        self._dispatcher = dispatcher
        self._threads = threads
        self._configs = {}
        self._streams = {}
        self._cufunc = None

    def launch(self, n: int, args, stream=None, fast: bool = True, params=None):
        """Launch over ``n`` tiles, with ``args`` or, on the fast path, the packed ``params``."""
        if SIMULATOR:
            self._dispatcher[n, self._threads](*args)
            return
        import torch

        handle = (stream if stream is not None else torch.cuda.current_stream()).cuda_stream
        if not fast:
            s = self._streams.get(("numba", handle))
            if s is None:
                s = self._streams[("numba", handle)] = cuda.external_stream(handle)
            self._dispatcher[n, self._threads, s](*args)
            return
        from cuda.core import LaunchConfig, Stream, launch

        if self._cufunc is None:
            kernel = next(iter(self._dispatcher.overloads.values()))
            self._cufunc = kernel._codelibrary.get_cufunc().kernel
        config = self._configs.get(n)
        if config is None:
            config = self._configs[n] = LaunchConfig(grid=n, block=self._threads, shmem_size=0)
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = Stream.from_handle(handle)
        launch(s, config, self._cufunc, *(params if params is not None else [p for a in args for p in _params(a)]))


class EncodePlan:
    """Encoding into one pair of pools (slots + raw tiles) with one set of bases: build once, call per block.

    See the module docstring for every array.  A call checks only the
    per-call arrays (``bits``, ``entries``, ``escape_used``) and launches once.
    """

    def __init__(self, channels: int, capacity: int, bases, slots, slot_free, raw, raw_free, heads):
        self.geometry = geo = _check_channels(channels)
        self.channels, self.capacity = channels, _check_capacity(capacity)
        _array(slots, "slots", "uint8", (None, geo.slot_bytes(capacity)))
        _array(raw, "raw", "int16", (None, L.BLOCK_TOKENS, channels))
        _array(slot_free, "slot_free", "int32", (None,))
        _array(raw_free, "raw_free", "int32", (None,))
        _array(heads, "heads", "int32", (2,))
        self._fixed = (_bases_words(bases, channels), self.capacity, _words(slots), _plain(slot_free),
                       _words(raw), _plain(raw_free), _plain(heads))
        self._launcher = _Launcher(encode_kernel(channels), geo.groups)
        self._fixed_params = None if SIMULATOR else [p for a in self._fixed for p in _params(a)]

    def __call__(self, bits, entries, escape_used, *, stream=None, fast: bool = True):
        n = _array(bits, "bits", "int16", (None, L.BLOCK_TOKENS, self.channels)).shape[0]
        _array(entries, "entries", "int32", (n,))
        _array(escape_used, "escape_used", "int32", (n,))
        if n == 0:
            return
        if self._fixed_params is not None and fast:
            params = _word_params(bits) + self._fixed_params + _params(entries) + _params(escape_used)
            self._launcher.launch(n, None, stream, fast, params)
            return
        args = (_words(bits), *self._fixed, _plain(entries), _plain(escape_used))
        self._launcher.launch(n, args, stream, fast)


class DecodePlan:
    """Decoding from one pair of pools with one set of bases: build once, call per batch of tiles."""

    def __init__(self, channels: int, capacity: int, bases, slots, raw):
        self.geometry = geo = _check_channels(channels)
        self.channels, self.capacity = channels, _check_capacity(capacity)
        _array(slots, "slots", "uint8", (None, geo.slot_bytes(capacity)))
        _array(raw, "raw", "int16", (None, L.BLOCK_TOKENS, channels))
        self._slots, self._raw = _words(slots), _words(raw)
        self._bases = _bases_words(bases, channels)
        self._launcher = _Launcher(decode_kernel(channels), geo.groups)
        self._pool_params = None if SIMULATOR else _params(self._slots) + _params(self._raw)
        self._bases_params = None if SIMULATOR else _params(self._bases) + _params(self.capacity)

    def __call__(self, entries, out, status, *, stream=None, fast: bool = True):
        n = _array(entries, "entries", "int32", (None,)).shape[0]
        _array(out, "out", "int16", (n, L.BLOCK_TOKENS, self.channels))
        _array(status, "status", "int32", (n,))
        if n == 0:
            return
        if self._pool_params is not None and fast:
            params = (self._pool_params + _params(entries) + self._bases_params + _word_params(out)
                      + _params(status))
            self._launcher.launch(n, None, stream, fast, params)
            return
        args = (self._slots, self._raw, _plain(entries), self._bases, self.capacity, _words(out), _plain(status))
        self._launcher.launch(n, args, stream, fast)


# ----------------------------------------------------------------------------------------------
# One-shot helpers: a pool of n slots and n raw tiles for n tiles (tests, benchmarks, containers).

def _lib(x):
    """(zeros, arange) allocating like ``x``: torch on its device, or NumPy."""
    if _is_torch(x):
        import torch

        return (lambda shape, dt: torch.zeros(shape, dtype=getattr(torch, dt), device=x.device),
                lambda n: torch.arange(n, dtype=torch.int32, device=x.device))
    return (lambda shape, dt: np.zeros(shape, dtype=dt), lambda n: np.arange(n, dtype=np.int32))


def encode_tiles(bits, b3, b4, capacity: int, *, stream=None) -> dict:
    """Encode tiles ``bits`` int16 ``[n, 16, C]`` with per-tile bases ``[P, C]`` into fresh pools of ``n``.

    Returns ``slots``, ``raw``, ``entries``, ``escape_used`` and ``heads`` (see the
    module docstring); tile ``i`` sits at ``entries[i]``.  Asynchronous on the GPU.
    """
    n, _, channels = _array(bits, "bits", "int16", (None, L.BLOCK_TOKENS, None)).shape
    geo = _check_channels(channels)
    zeros, arange = _lib(bits)
    out = dict(slots=zeros((n, geo.slot_bytes(capacity)), "uint8"), raw=zeros((n, L.BLOCK_TOKENS, channels), "int16"),
               entries=zeros((n,), "int32"), escape_used=zeros((n,), "int32"), heads=zeros((2,), "int32"))
    plan = EncodePlan(channels, capacity, pack_bases(b3, b4), out["slots"], arange(n), out["raw"], arange(n),
                      out["heads"])
    plan(bits, out["entries"], out["escape_used"], stream=stream)
    return out


def decode_tiles(slots, raw, entries, b3, b4, capacity: int, *, stream=None):
    """Decode the tiles that ``entries`` point at -> (int16 ``[n, 16, C]``, status int32 ``[n]``)."""
    channels = _array(raw, "raw", "int16", (None, L.BLOCK_TOKENS, None)).shape[2]
    n = _array(entries, "entries", "int32", (None,)).shape[0]
    zeros, _ = _lib(entries)
    out, status = zeros((n, L.BLOCK_TOKENS, channels), "int16"), zeros((n,), "int32")
    DecodePlan(channels, capacity, pack_bases(b3, b4), slots, raw)(entries, out, status, stream=stream)
    return out, status
