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
    at = [t.data_ptr() for t in tensors]
    gap = at[1] - at[0]
    if gap <= 0 or gap % size or any(b - a != gap for a, b in zip(at, at[1:])):
        return None
    shape, stride, dtype = first.shape, first.stride(), first.dtype
    if any(t.shape != shape or t.stride() != stride or t.dtype != dtype for t in tensors):
        return None
    # every tensor within the first one's storage (allocations do not overlap, so they share it)
    storage = first.untyped_storage()
    extent = size * (1 + sum((n - 1) * st for n, st in zip(shape, stride))) if first.numel() else 0
    if at[0] < storage.data_ptr() or at[-1] + extent > storage.data_ptr() + storage.nbytes():
        return None
    return torch.as_strided(first, (len(tensors),) + tuple(first.shape), (gap // size,) + tuple(first.stride()))


def upload(a: np.ndarray, device):
    """Host array ``a`` as a torch tensor on ``device`` (a ``torch.device``) without the host waiting for the
    device: through pinned memory and an asynchronous copy on CUDA, where a copy from pageable memory waits
    for the stream; ``a`` itself, as a tensor, on the CPU.  The one way the cache and its pools copy host
    arrays to the device (benchmarks/construction.py counts its calls as one pinned copy each)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda" or t.numel() == 0:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
