"""The paged GAAC KV cache, by responsibility.

* :mod:`gaac.cache.paged` -- :class:`PagedKVCache`: sequences, updates, reading, memory and capacity, and the
  storage interface the serving loop (:mod:`gaac.serving`) uses;
* :mod:`gaac.cache.pools` -- the fixed-size records the cache is made of and their free lists;
* :mod:`gaac.cache.view` -- :class:`~gaac.cache.view.LayerView`, one layer's arrays as attention reads them;
* :mod:`gaac.cache.transfer` -- a sequence gathered from the cache into container bytes and scattered back.

The names below are imported on first use (:func:`__getattr__`): the serving package imports
:mod:`gaac.cache.pools`, and the cache imports the serving package, so importing this package imports
none of its modules.
"""
from __future__ import annotations

_NAMES = {
    "PagedKVCache": "paged",
    "MAX_INDEXED_EPOCHS": "paged",
    "ADAPT_LAG": "paged",
    "EPOCH_ROOM": "paged",
    "KINDS": "paged",
    "PROGRESS_TOKENS": "paged",
    "MemoryReport": "paged",
    "ReferenceCodec": "paged",
    "CudaCodec": "paged",
    "blocks_to_tiles": "paged",
    "tiles_to_tokens": "paged",
    "PoolExhaustedError": "paged",
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
