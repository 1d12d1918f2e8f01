"""Compressed sequences as a unit of transfer: a paged cache's sequence out as bytes, and back in.

Serving engines move KV caches between GPU memory, host memory, disk and
other workers (offload, prefix reuse, disaggregated prefill and decode).  A
GAAC cache's blocks are already compressed where they live, so moving one
needs no codec work: :func:`export_sequence` gathers one sequence's slots,
raw tiles, block tables, block epochs and tails -- every layer, K and V --
into the **sequence container** of FORMAT.md section 11, and
:func:`import_sequence` puts them into the pools of any cache with the same
calibration, bit for bit.  The bytes moved are the sequence's resident
bytes (about 1.39x fewer than BF16 on real caches) plus a small head.

This module is the public face of three layers: the container's bytes
(:mod:`gaac.format.sequence`: layout, head, the reader's rules, NumPy only),
the cache's side (:mod:`gaac.cache.transfer`: gathering a sequence from a
cache's pools and scattering one into them, on the cache's device, with the
chunk CRCs on the GPU), and, here, the file form: :func:`pack` and
:func:`unpack` (``gaac pack`` / ``gaac unpack``), the same container with the
calibration's canonical bytes embedded, so a file decodes on its own.
"""
from __future__ import annotations

import numpy as np

from . import layout as L
from .cache.paged import PagedKVCache
from .cache.transfer import container_nbytes, export_sequence, exported_layout, import_sequence, read_head
from .calibration import Calibration, calibrate
from .errors import CalibrationError, InputError
from .format.sequence import Container, EpochRecord, Layout, Section, check_calibration, worst_case_bytes
from .io import check_cache

__all__ = ["Container", "EpochRecord", "Layout", "Section", "container_nbytes", "export_sequence",
           "exported_layout", "import_sequence", "pack", "read_head", "unpack", "worst_case_bytes"]


# ----------------------------------------------------------------------------------------------
# The file form: a whole cache [layers, kv_heads, tokens, head_dim] to a self-contained container and back.

def pack(k, v, calibration: Calibration | None = None, *, show_progress: bool | None = None) -> memoryview:
    """K and V ``[layers, kv_heads, tokens, head_dim]`` (BF16 bits or tensors) as a sequence container with
    the calibration embedded: what ``gaac pack`` writes.  Without ``calibration`` it calibrates on ``k``, ``v``."""
    if calibration is not None and not isinstance(calibration, Calibration):
        raise InputError(f"calibration: expected a gaac.Calibration (Calibration.load or Calibration.from_dict "
                         f"reads a file), got {type(calibration).__name__}")
    k, v = check_cache(k, "k"), check_cache(v, "v")
    if k.shape != v.shape:
        raise InputError(f"k {list(k.shape)} and v {list(v.shape)} must have one shape")
    cal = calibrate(k, v) if calibration is None else calibration
    cal.check_shape(*k.shape[:2], k.shape[3])
    cache = PagedKVCache(cal, max_blocks=max(1, k.shape[2] // L.BLOCK_TOKENS), grow=True)
    seq = cache.add_sequence(k, v, show_progress=show_progress)
    return export_sequence(cache, seq, calibration=True)


def unpack(data, calibration: Calibration | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A sequence container back to K and V, uint16 ``[layers, kv_heads, tokens, head_dim]``, bit for bit.

    ``calibration``: the container's own (embedded) when not given; one of them is needed.  It is checked
    against the container (FORMAT.md 11.7, C1-C5) before a cache is sized from it, and the cache keeps
    epochs (a histogram per layer and kind) only when the container has epoch records, so that what unpack
    allocates follows the container's data, not the counts its header states.
    """
    if calibration is not None and not isinstance(calibration, Calibration):
        raise InputError(f"calibration: expected a gaac.Calibration or None, got {type(calibration).__name__}")
    c = read_head(data)
    cal = calibration if calibration is not None else c.calibration
    if cal is None:
        raise CalibrationError("the container carries no calibration (exported without calibration=True): pass "
                               f"the calibration {c.calibration_id:08x} it was made with")
    lay = c.layout
    adapt = any(s.epochs for s in lay.sections)
    check_calibration(c, cal, adapt)
    cache = PagedKVCache(cal, max_blocks=max(1, lay.blocks), slots=max(s.slot_tiles for s in lay.sections),
                         raw_tiles=sum(s.raw_tiles for s in lay.sections), adapt=adapt)
    seq = import_sequence(cache, c.data)
    return cache.read(seq)
