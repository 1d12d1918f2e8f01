"""gaac in LMCache's KV offload tier: a serde that stores each KV chunk as a sequence container.

LMCache (``lmcache`` 0.5.x) runs a *serde* between its L1 host buffers and an L2 adapter
(``lmcache.v1.distributed.serde``): a :class:`Serializer` turns a KV chunk into bytes before
the adapter stores them, a :class:`Deserializer` turns the bytes the adapter loads back into
the chunk, and ``AsyncSerdeProcessor`` runs both on a thread pool.  Importing this module
registers the factory :func:`make_serde` under the name ``"gaac"`` with LMCache's
``register_serde_factory``, so that an adapter configured as::

    {"type": "fs", "base_path": "/cache", "serde": {"type": "gaac", "calibration": "cal.json"}}

stores every chunk losslessly compressed: the bytes an adapter keeps are a GAAC sequence
container (FORMAT.md section 11) per KV group of the chunk, one after the other, and what
comes back is the chunk bit for bit.  LMCache looks serdes up only in its registry (it does
not scan entry points), so the process that builds LMCache's ``StorageManager`` imports
``gaac.lmcache`` (or calls :func:`register`) first; nothing in LMCache changes.

The chunk.  LMCache holds a chunk of a non-MLA model as one tensor per KV group,
``[2, layers, tokens, kv_heads * head_dim]`` (``MemoryFormat.KV_2LTD``: K then V, every
layer, token-major, the heads side by side).  The serde views it, without a copy, as gaac's
K and V ``[layers, kv_heads, tokens, head_dim]``; ``head_dim`` comes from the calibration
or from the ``"head_dim"`` key of the config (default 128).  Only BF16 chunks are taken:
the codec is lossless, so it converts nothing.

The codec.  A chunk goes through a :class:`gaac.PagedKVCache` made with ``adapt=False`` on the
coding device: the ``"device"`` key of the config (``"cuda"``: the chunk is copied there, and
the container written back into LMCache's host buffer), else the chunk's own device.  On the
CPU the reference codec encodes its blocks, on a CUDA device the CUDA codec;
:func:`gaac.transfer.export_sequence` then writes the container straight into LMCache's byte
buffer.  LMCache's L1 buffers are host memory, so on a GPU server ``"device": "cuda"`` is what
puts the GPU codec to work.  Deserializing imports the container into a cache on the coding
device (:func:`gaac.transfer.import_sequence`: every CRC, table and epoch is checked first)
and decodes it layer by layer into the destination (through one buffer on the coding device
when the destination is elsewhere).  Each serializer and deserializer keeps its caches, one
per thread, calibration and device, and adds, moves and removes one chunk at a time, so that
pools, tables and encoders are made once, not per chunk (a container with epoch records is
imported into a cache of its own: the epochs join that cache's calibration).
Without adaptation a container has no epoch records, so its size is bounded by
:func:`gaac.transfer.worst_case_bytes` with ``epoch_records=0``: what :meth:`GaacSerializer.estimate_serialized_size`
returns, and what LMCache allocates.  A chunk is at most a few hundred tokens, too few
blocks for an adaptation epoch to pay for its bases.

The calibration.  With ``"calibration": "cal.json"`` (a file of
:meth:`gaac.Calibration.save`) every chunk is coded with it and the containers do not
embed it; a container then names it by id, and reading it back with another calibration
is a :class:`gaac.CalibrationError`, never wrong data.  Without one, the serde calibrates
on the first chunk of each shape that has a full block of 16 tokens, keeps that
calibration for the chunks after it, and embeds it in every container.  Embedding is what
makes a stored chunk readable on its own: an L2 store outlives the process that wrote it
and is read by other processes, which never saw that first chunk.  It costs
``20 + 4 * layers * (kv_heads * head_dim + 1)`` bytes a container (FORMAT.md 3.3), about
0.4% of a 256-token chunk; a calibration file saves it and also picks windows from more
data than one chunk.

What LMCache's adapters do with the bytes.  ``AsyncSerdeProcessor`` narrows the buffer to the
bytes :meth:`GaacSerializer.serialize` wrote, so an adapter stores the compressed chunk; LMCache
0.5.6's ``fs`` and ``fs_native`` adapters then load a key only into a buffer of the estimate's size
and count a file shorter than that buffer as a miss, so a chunk they stored compressed is not
served back (tests/test_lmcache.py keeps that case as an expected failure).  The serde's bytes
are right either way: a container is cut from the start of whatever buffer it arrives in
(:func:`gaac.transfer.container_nbytes`).

The size bound.  :func:`gaac.transfer.worst_case_bytes` is the largest container FORMAT.md section 11
allows for given dimensions, capacities and epoch records: every tile in whichever of a
slot or a raw tile is larger, every section's tail, table and block epochs, the epoch
records, the embedded calibration, the chunk CRCs and the padding (FORMAT.md 11.11).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

from . import layout as L
from .calibration import Calibration, calibrate
from .errors import CalibrationError, FormatError, InputError
from .transfer import container_nbytes, worst_case_bytes

SERDE_NAME = "gaac"
DEFAULT_HEAD_DIM = 128

try:        # LMCache is optional: without it the classes are plain, and register() says what is missing.
    from lmcache.v1.distributed.serde.base import Deserializer as _Deserializer
    from lmcache.v1.distributed.serde.base import Serializer as _Serializer
except ImportError:
    _Serializer = _Deserializer = object


# ----------------------------------------------------------------------------------------------
# LMCache's memory objects.

def _kv_tensors(obj) -> list:
    """The KV groups of a memory object, each a tensor ``[2, layers, tokens, kv_heads * head_dim]``."""
    shapes = getattr(getattr(obj, "metadata", None), "shapes", None)
    tensors = [obj.get_tensor(i) for i in range(len(shapes))] if shapes is not None and len(shapes) > 1 \
        else [obj.tensor]
    if any(t is None for t in tensors):
        raise InputError("the memory object holds no tensor (invalidated)")
    return tensors


def _byte_tensor(obj):
    """A memory object's bytes as a flat uint8 tensor (a view)."""
    import torch

    t = obj.tensor
    if t is None:
        raise InputError("the memory object holds no tensor (invalidated)")
    if t.dtype != torch.uint8:
        t = t.contiguous().view(torch.uint8)
    return t.reshape(-1)


def _chunk_dims(shape, dtype, head_dim: int) -> tuple[int, int, int, int]:
    """``(layers, kv_heads, head_dim, tokens)`` of a chunk ``[2, layers, tokens, kv_heads * head_dim]``."""
    import torch

    if dtype != torch.bfloat16:
        raise InputError(f"the gaac serde stores BF16 KV caches; this chunk is {dtype}")
    shape = tuple(int(n) for n in shape)
    if len(shape) != 4 or shape[0] != 2 or shape[3] % head_dim or 0 in shape[1:]:
        raise InputError(f"the gaac serde takes chunks [2, layers, tokens, kv_heads * head_dim] with head_dim "
                         f"{head_dim}; got {list(shape)} (MLA chunks are not KV heads)")
    return shape[1], shape[3] // head_dim, head_dim, shape[2]


def _as_kv(x, head_dim: int):
    """Chunk ``x`` ``[2, layers, tokens, kv_heads * head_dim]`` as K and V ``[layers, kv_heads, tokens,
    head_dim]``: views, no copy."""
    layers, heads, dim, tokens = _chunk_dims(x.shape, x.dtype, head_dim)
    kv = x.view(2, layers, tokens, heads, dim).permute(0, 1, 3, 2, 4)
    return kv[0], kv[1]


# ----------------------------------------------------------------------------------------------
# Where chunks are coded, and the caches that code them.

def _check_device(device):
    """``device`` as a torch device (None: each chunk's own)."""
    if device is None:
        return None
    import torch

    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"device {device!r}: not a torch device ({exc})") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"device {device}: gaac codes on the CPU or a CUDA device")
    return device


def _coding_device(device, x):
    """The device that codes chunk ``x``: the serde's (a CUDA device with its index), else the chunk's."""
    import torch

    if device is None:
        return x.device
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _Caches:
    """The paged caches a serializer or deserializer codes chunks with, one per thread and (calibration,
    device, codec), each holding one chunk at a time: a chunk is added, moved and removed, and the pools,
    tables and encoders stay for the next.  A cache that raised is dropped."""

    def __init__(self):
        self._local = threading.local()

    @contextmanager
    def lend(self, cal: Calibration, device, codec, *, blocks: int, slots: int | None = None,
             raw_tiles: int | None = None):
        from .cache.paged import PagedKVCache

        caches = self._local.__dict__.setdefault("caches", {})
        key = (cal.id, str(device), codec)
        cache = caches.pop(key, None)
        if cache is None:
            cache = PagedKVCache(cal, max_blocks=max(1, blocks), slots=slots, raw_tiles=raw_tiles, grow=True,
                                 device=device, codec=codec, adapt=False)
        yield cache                                      # an exception leaves it out of the dict
        caches[key] = cache


# ----------------------------------------------------------------------------------------------
# The serializer and deserializer.

class GaacSerializer(_Serializer):
    """LMCache ``Serializer``: a KV chunk into its sequence containers (module docstring).

    ``calibration``: a :class:`gaac.Calibration` for every chunk (not embedded), or None to calibrate on
    the first chunk of each shape (embedded).  ``head_dim``: the head width of the chunks, the
    calibration's when it is given.  ``codec``: as :class:`gaac.PagedKVCache` takes it (None: the
    device's).  ``device``: where chunks are coded (a torch device, e.g. ``"cuda"``), None for each
    chunk's own device.
    """

    def __init__(self, calibration: Calibration | None = None, head_dim: int | None = None, codec: str | None = None,
                 device=None):
        if calibration is not None and not isinstance(calibration, Calibration):
            raise InputError(f"calibration: expected a gaac.Calibration, got {type(calibration).__name__}")
        if calibration is not None and head_dim not in (None, calibration.head_dim):
            raise InputError(f"head_dim {head_dim} differs from the calibration's {calibration.head_dim}")
        self.calibration = calibration
        self.head_dim = calibration.head_dim if calibration is not None else int(head_dim or DEFAULT_HEAD_DIM)
        L.geometry(self.head_dim)                        # a head width the format has
        self.codec = codec
        self.device = _check_device(device)
        self._made = {}                                  # (layers, kv_heads, head_dim) -> its first chunk's calibration
        self._lock = threading.Lock()
        self._caches = _Caches()

    def _calibration_for(self, k, v) -> Calibration:
        if self.calibration is not None:
            self.calibration.check_shape(k.shape[0], k.shape[1], k.shape[3])
            return self.calibration
        shape = (k.shape[0], k.shape[1], k.shape[3])
        with self._lock:
            cal = self._made.get(shape)
            if cal is None:
                if k.shape[2] < L.BLOCK_TOKENS:          # a chunk of tail tokens only: they are stored as they are
                    return calibrate(k.cpu(), v.cpu(), capacity=0)
                cal = self._made[shape] = calibrate(k.cpu(), v.cpu())
            return cal

    def serialize(self, src, dst, key=None) -> int:
        """The containers of ``src``'s KV groups, one after the other, into ``dst``'s bytes; returns how many."""
        out = _byte_tensor(dst)
        at = 0
        for x in _kv_tensors(src):
            at += self._export(x, out[at:])
        return at

    def _export(self, x, out) -> int:
        import torch

        from .transfer import export_sequence

        device = _coding_device(self.device, x)
        _chunk_dims(x.shape, x.dtype, self.head_dim)
        if x.device != device:
            x = x.to(device)                             # the chunk's one copy to the coding device
        k, v = _as_kv(x, self.head_dim)
        cal = self._calibration_for(k, v)
        embed = self.calibration is None
        with self._caches.lend(cal, device, self.codec, blocks=k.shape[2] // L.BLOCK_TOKENS) as cache:
            seq = cache.add_sequence(k, v)
            try:
                if out.device.type == "cpu":
                    return len(export_sequence(cache, seq, calibration=embed, out=out))
                data = export_sequence(cache, seq, calibration=embed)      # pinned host memory on a CUDA cache
                out[:len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8), non_blocking=False)
                return len(data)
            finally:
                cache.remove_sequence(seq)

    def estimate_serialized_size(self, layout_desc) -> int:
        """The most bytes :meth:`serialize` writes for a memory object of ``layout_desc``: the sum over its KV
        groups of :func:`gaac.transfer.worst_case_bytes` (no epoch records; the calibration embedded without a file)."""
        total = 0
        for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes, strict=True):
            layers, heads, dim, tokens = _chunk_dims(shape, dtype, self.head_dim)
            capacities = None
            if self.calibration is not None:
                self.calibration.check_shape(layers, heads, dim)
                capacities = self.calibration.capacity
            total += worst_case_bytes(layers, heads, dim, tokens, capacities, epoch_records=0,
                                      calibration=self.calibration is None)
        return total


class GaacDeserializer(_Deserializer):
    """LMCache ``Deserializer``: sequence containers back into a KV chunk, bit for bit.

    A container's embedded calibration decodes it; one without (written with a calibration file) needs
    ``calibration``, the same one.  ``head_dim``, ``codec`` and ``device`` as :class:`GaacSerializer` takes them.
    """

    def __init__(self, calibration: Calibration | None = None, head_dim: int | None = None, codec: str | None = None,
                 device=None):
        if calibration is not None and not isinstance(calibration, Calibration):
            raise InputError(f"calibration: expected a gaac.Calibration, got {type(calibration).__name__}")
        self.calibration = calibration
        self.head_dim = calibration.head_dim if calibration is not None else int(head_dim or DEFAULT_HEAD_DIM)
        self.codec = codec
        self.device = _check_device(device)
        self._caches = _Caches()

    def deserialize(self, src, dst, key=None) -> None:
        """The containers at the start of ``src``'s bytes (it may hold more) into ``dst``'s KV groups."""
        data = _byte_tensor(src)
        if data.device.type != "cpu":
            data = data.cpu()
        at = 0
        for x in _kv_tensors(dst):
            n = container_nbytes(data[at:])
            self._import(data[at:at + n], x)
            at += n

    def _import(self, data, x) -> None:
        from .cache.paged import PagedKVCache
        from .transfer import import_sequence, read_head

        layers, heads, dim, tokens = _chunk_dims(x.shape, x.dtype, self.head_dim)
        c = read_head(data)
        lay = c.layout
        if (lay.layers, lay.kv_heads, lay.head_dim, lay.tokens) != (layers, heads, dim, tokens):
            raise FormatError(f"the container holds {lay.tokens} tokens of {lay.layers} layers x {lay.kv_heads} KV "
                              f"heads x head_dim {lay.head_dim}; the chunk is {list(x.shape)}")
        cal = c.calibration if c.calibration is not None else self.calibration
        if cal is None:
            raise CalibrationError(f"the container carries no calibration: configure the serde with the "
                                   f"calibration {c.calibration_id:08x} it was written with")
        device = _coding_device(self.device, x)
        if any(s.epochs for s in lay.sections):          # epochs join the cache's calibration: a cache of its own
            cache = PagedKVCache(cal, max_blocks=max(1, lay.blocks), slots=max(s.slot_tiles for s in lay.sections),
                                 raw_tiles=sum(s.raw_tiles for s in lay.sections), adapt=True, device=device,
                                 codec=self.codec)
            self._read(cache, import_sequence(cache, c.data), x)
            return
        with self._caches.lend(cal, device, self.codec, blocks=lay.blocks,
                               slots=max(s.slot_tiles for s in lay.sections),
                               raw_tiles=sum(s.raw_tiles for s in lay.sections)) as cache:
            seq = import_sequence(cache, c.data)
            try:
                self._read(cache, seq, x)
            finally:
                cache.remove_sequence(seq)

    @staticmethod
    def _read(cache, seq: int, x) -> None:
        """Sequence ``seq`` of ``cache`` decoded into chunk ``x``: in place on the cache's device, else through
        one buffer there and one copy."""
        import torch

        layers, tokens = x.shape[1], x.shape[2]
        heads, dim = cache.kv_heads, cache.head_dim
        here = x.device == cache.device
        bits = x.view(torch.int16).view(2, layers, tokens, heads, dim) if here else \
            torch.empty((2, layers, tokens, heads, dim), dtype=torch.int16, device=cache.device)
        for layer in range(layers):
            k, v = cache.read_layer(layer, [seq])                  # int16 [1, kv_heads, tokens, head_dim]
            bits[0, layer].copy_(k[0].transpose(0, 1))
            bits[1, layer].copy_(v[0].transpose(0, 1))
        if not here:
            x.view(torch.int16).view(2, layers, tokens, heads, dim).copy_(bits)


# ----------------------------------------------------------------------------------------------
# Registration.

def make_serde(kwargs: dict):
    """LMCache's serde factory for ``{"type": "gaac", ...}``: ``calibration`` (a calibration file's path,
    optional), ``head_dim`` (without a file; default 128), ``device`` (where chunks are coded, e.g.
    ``"cuda"``; default: where each chunk is), ``codec`` and ``max_workers`` (the thread pool of
    ``AsyncSerdeProcessor``, default 1)."""
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor

    known = {"calibration", "head_dim", "device", "codec", "max_workers"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InputError(f"gaac serde: unknown config keys {unknown}; it takes {sorted(known)}")
    path = kwargs.get("calibration")
    cal = Calibration.load(path) if path else None
    head_dim = kwargs.get("head_dim")
    head_dim = None if head_dim is None else int(head_dim)
    codec, device = kwargs.get("codec"), kwargs.get("device")
    return AsyncSerdeProcessor(GaacSerializer(cal, head_dim, codec, device),
                               GaacDeserializer(cal, head_dim, codec, device),
                               max_workers=int(kwargs.get("max_workers", 1)))


def register(name: str = SERDE_NAME) -> None:
    """Register :func:`make_serde` with LMCache under ``name`` (once; later calls do nothing).

    Raises ImportError when LMCache is not installed."""
    from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory

    if name not in get_registered_serde_types():
        register_serde_factory(name, make_serde)


if _Serializer is not object:
    register()
