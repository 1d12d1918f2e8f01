"""Accepting user arrays: NumPy uint16 bit patterns or torch BF16 tensors, nothing silently converted."""
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
