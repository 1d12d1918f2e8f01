"""The paged GAAC KV cache, by responsibility.

* :mod:`gaac.cache.paged` -- :class:`PagedKVCache`, the facade: sequences, ``append`` and ``update_layer``,
  reading, memory and capacity, and the storage interface the serving loop (:mod:`gaac.serving`) uses;
* :mod:`gaac.cache.update` -- the all-or-nothing update transaction and the bookkeeping of calibration epochs
  and the adaptation rule, methods the cache derives from :class:`~gaac.cache.update.UpdateTransaction`;
* :mod:`gaac.cache.codec` -- the codec protocol (:class:`~gaac.cache.codec.TileCodec`) and its reference and
  CUDA implementations;
* :mod:`gaac.cache.store` -- one layer and kind's storage record (what ``PagedKVCache.stores`` hands out);
* :mod:`gaac.cache.memory` -- :class:`~gaac.cache.memory.MemoryReport`;
* :mod:`gaac.cache.pools` -- the fixed-size records the cache is made of and their free lists;
* :mod:`gaac.cache.view` -- :class:`~gaac.cache.view.LayerView`, one layer's arrays as attention reads them;
* :mod:`gaac.cache.transfer` -- a sequence gathered from the cache into container bytes and scattered back;
* :mod:`gaac.cache.hooks` -- what the cache keeps and calls for the serving loop above it
  (:class:`~gaac.cache.hooks.ServingState`, the recordings of device-driven steps, the entry points
  :mod:`gaac.serving` registers), so that the cache imports none of :mod:`gaac.serving`.

The names below are imported on first use (:func:`__getattr__`): ``import gaac`` imports
:mod:`gaac.cache.hooks`, which needs neither torch nor numba, so importing this package imports none of its
modules.
"""
from __future__ import annotations

_NAMES = {
    "PagedKVCache": "paged",
    "MAX_INDEXED_EPOCHS": "paged",
    "EPOCH_ROOM": "paged",
    "PROGRESS_TOKENS": "paged",
    "PoolExhaustedError": "paged",
    "ADAPT_LAG": "update",
    "UpdateTransaction": "update",
    "KINDS": "store",
    "MemoryReport": "memory",
    "TileCodec": "codec",
    "ReferenceCodec": "codec",
    "CudaCodec": "codec",
    "blocks_to_tiles": "codec",
    "tiles_to_tokens": "codec",
    "LayerView": "view",
}


def __getattr__(name):
    """``gaac.cache.PagedKVCache`` and the other names of :data:`_NAMES`, from the module that defines them."""
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'gaac.cache' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__():
    return sorted([*globals(), *_NAMES])


__all__ = sorted(_NAMES)
