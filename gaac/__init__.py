"""gaac: lossless compression of BF16 KV caches (GAAC, the Group-Adaptive Additive Codec).

The codec (``encode_block``/``decode_block``, ``calibrate``) needs only NumPy.
The paged cache and attention need torch; they are imported on first use, so
``import gaac`` works without torch.
"""
__version__ = "0.1.0"     # setup.cfg reads it from here: one place says which gaac this is

from .format.block import EncodedBlock, decode_block, encode_block
from .calibration import Calibration, calibrate
from .errors import CalibrationError, FormatError, GAACError, InputError, PoolExhaustedError
from .io import sample
from .layout import FORMAT_VERSION
from .cache.hooks import set_loader as _set_loader


def _import_serving() -> None:
    """Import the serving loop (gaac.serving), which registers with the cache the entry points its
    ``decode_plan`` and ``update_layer`` call (gaac.cache.hooks): the cache runs this the first time it needs
    one, so that a cache works the same whichever gaac module made it, and never imports gaac.serving itself."""
    import importlib

    importlib.import_module("gaac.serving")


_set_loader(_import_serving)

_LAZY = {
    "PagedKVCache": ("gaac.cache.paged", "PagedKVCache"),
    "decode_attention": ("gaac.attention", "decode_attention"),
    "AttentionPlan": ("gaac.attention", "AttentionPlan"),
    "StepPlan": ("gaac.serving.plan", "StepPlan"),
    "StepGraph": ("gaac.serving.graph", "StepGraph"),
    "measure": ("gaac.stats", "measure"),
}


def __getattr__(name):
    """Import torch-backed parts of the API only when they are used."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'gaac' has no attribute {name!r}")


__all__ = [
    "AttentionPlan", "Calibration", "CalibrationError", "EncodedBlock", "FORMAT_VERSION", "FormatError", "GAACError",
    "InputError", "PagedKVCache", "PoolExhaustedError", "StepGraph", "StepPlan",
    "calibrate", "decode_attention", "decode_block",
    "encode_block", "measure", "sample",
]
