"""What the serving loop keeps per cache between decode steps: :class:`ServingState`, defined below the
serving loop in :mod:`gaac.cache.hooks` (the cache makes one at its creation and holds it as
:attr:`gaac.PagedKVCache.serving`, and never imports this package).  Named here too, for the serving loop's
readers and for caches pickled while the class lived in this module.
"""
from __future__ import annotations

from ..cache.hooks import ServingState

__all__ = ["ServingState"]
