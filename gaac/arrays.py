"""Accepting user arrays: NumPy uint16 bit patterns or torch BF16 tensors, nothing silently converted; and
equal tensors that lie at equal distances in one storage seen as one (:func:`stacked_view`)."""
from __future__ import annotations

import numpy as np

from .errors import InputError


def as_bits(x, name: str = "input", ndim: int | None = None) -> np.ndarray:
    """BF16 bit patterns of ``x`` as a NumPy ``uint16`` array.

    Accepts a NumPy ``uint16``/``int16`` array (the bits), or a torch CPU tensor of
    dtype ``bfloat16``, ``int16`` or ``uint16``.  Floats of other widths are refused
    rather than rounded: the codec is lossless, so it never invents a conversion.
    """
    if type(x).__module__.startswith("torch"):
        import torch

        if x.device.type != "cpu":
            raise InputError(f"{name}: tensor is on {x.device}; the reference codec takes CPU tensors "
                             "(use gaac.cuda for device tensors)")
        if x.dtype == torch.bfloat16:
            x = x.contiguous().view(torch.int16)
        elif x.dtype not in (torch.int16, torch.uint16):
            raise InputError(f"{name}: dtype {x.dtype} is not BF16; pass a torch.bfloat16 tensor "
                             "or its bits as int16/uint16")
        x = x.numpy()
    if not isinstance(x, np.ndarray):
        raise InputError(f"{name}: expected a NumPy array or torch tensor, got {type(x).__name__}")
    if x.dtype == np.int16:
        x = x.view(np.uint16)
    if x.dtype != np.uint16:
        raise InputError(f"{name}: dtype {x.dtype} is not BF16 bits; pass uint16 bit patterns "
                         "(e.g. tensor.view(torch.int16).numpy().view(np.uint16))")
    if ndim is not None and x.ndim != ndim:
        raise InputError(f"{name}: expected {ndim} dimensions, got shape {list(x.shape)}")
    return x


def stacked_view(tensors: list):
    """``tensors`` (torch, equal shapes, strides and dtypes) as one view with a leading axis, where they lie at
    equal distances in one storage (a prefill's layers, the tails a cache makes as views of one allocation);
    else None.  One tensor is its own view with an axis of one."""
    import torch

    first = tensors[0]
    if len(tensors) == 1:
        return first[None]
    size = first.element_size()
    storage = first.untyped_storage().data_ptr()
    gap = tensors[1].data_ptr() - first.data_ptr()
    if gap <= 0 or gap % size:
        return None
    for a, b in zip(tensors, tensors[1:]):
        if (b.data_ptr() - a.data_ptr() != gap or b.shape != first.shape or b.stride() != first.stride()
                or b.dtype != first.dtype or b.untyped_storage().data_ptr() != storage):
            return None
    return torch.as_strided(first, (len(tensors),) + tuple(first.shape), (gap // size,) + tuple(first.stride()))


def upload(a: np.ndarray, device):
    """Host array ``a`` as a torch tensor on ``device`` (a ``torch.device``) without the host waiting for the
    device: on CUDA through pinned staging memory the process keeps (:class:`Staging`) and an asynchronous
    copy on the current stream, where a copy from pageable memory waits for the stream; ``a`` itself, as a
    tensor, on the CPU.  The one way the cache and its pools copy host arrays to the device
    (benchmarks/construction.py counts its calls as one pinned copy each)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda" or t.numel() == 0:
        return t.to(device)
    return Staging.of(device).upload(t, device)


class Staging:
    """Pinned host memory that uploads pass through, kept per device.

    Pinning host memory costs the host about a millisecond a megabyte and more when the GPU is busy, which a
    prompt's few uploads (its lists, its block epochs) paid on every call where they went through a new pinned
    buffer each.  Here an upload takes the next bytes of a pinned chunk (256-byte aligned), copies the array
    there and launches the copy to the device on the current stream; the chunk keeps the event of the last
    copy out of it on each stream.  A chunk is used again from its start once those copies are done; where none
    is (uploads launched behind queued work), a new chunk is pinned rather than waiting, up to
    :data:`MAX_CHUNKS`, after which the oldest chunk's copies are waited for."""

    CHUNK = 4 << 20         # bytes of a chunk (more where one upload needs more)
    MAX_CHUNKS = 8
    ALIGN = 256
    _by_device: dict = {}

    def __init__(self):
        self.chunks = []    # [pinned uint8 buffer, bytes used, {stream handle: event of its last copy}], oldest first

    @classmethod
    def of(cls, device) -> "Staging":
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        staging = cls._by_device.get(index)
        if staging is None:
            staging = cls._by_device[index] = cls()
        return staging

    def _room(self, nbytes: int) -> list:
        """A chunk with ``nbytes`` free past its used bytes (the newest chunk, a chunk whose copies are done, a
        new one, or the oldest once its copies are done)."""
        import torch

        chunks = self.chunks
        if chunks and chunks[-1][1] + nbytes <= chunks[-1][0].numel():
            return chunks[-1]
        for i, chunk in enumerate(chunks):
            if chunk[0].numel() >= nbytes and all(event.query() for event in chunk[2].values()):
                break
        else:
            if len(chunks) < self.MAX_CHUNKS or not any(c[0].numel() >= nbytes for c in chunks):
                size = max(self.CHUNK, 1 << (nbytes - 1).bit_length())
                chunks.append([torch.empty(size, dtype=torch.uint8, pin_memory=True), 0, {}])
                if len(chunks) > self.MAX_CHUNKS:         # a larger chunk replaces the oldest
                    old = chunks.pop(0)
                    for event in old[2].values():
                        event.synchronize()
                return chunks[-1]
            i = next(i for i, c in enumerate(chunks) if c[0].numel() >= nbytes)
            for event in chunks[i][2].values():
                event.synchronize()
        chunk = chunks.pop(i)
        chunk[1] = 0
        chunk[2].clear()
        chunks.append(chunk)
        return chunk

    def upload(self, t, device):
        """``t`` (a contiguous CPU tensor) copied into a new tensor on ``device`` through the staging memory."""
        import torch

        nbytes = t.numel() * t.element_size()
        chunk = self._room(nbytes)
        at = chunk[1]
        chunk[1] = -(-(at + nbytes) // self.ALIGN) * self.ALIGN
        host = chunk[0][at:at + nbytes].view(t.dtype).view(t.shape)
        host.copy_(t)
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        out.copy_(host, non_blocking=True)
        stream = torch.cuda.current_stream(device)
        event = chunk[2].get(stream.cuda_stream)
        if event is None:
            event = chunk[2][stream.cuda_stream] = torch.cuda.Event()
        event.record(stream)
        return out
