"""GAAC on NVIDIA GPUs: numba.cuda kernels that read and write GAAC slots and raw tiles (FORMAT.md) on the device.

``gaac.cuda.codec`` encodes and decodes tiles of any element format (the paged
cache's finalize step and the decompress-first path; FP8's kernels are
``gaac.fp8.cuda``'s, picked by the format once that module is imported); ``gaac.cuda.attention`` is the fused
decode attention kernel (its slot decoder ``gaac.cuda.tile_decoder``, its split
merge ``gaac.cuda.merge``); ``gaac.cuda.epochs`` runs the epoch adaptation rule
of a prefill; ``gaac.cuda.primitives`` holds the device primitives the kernels
share, ``gaac.cuda.launch`` the host side of launching them cheaply.
Importing this package imports numba; under ``NUMBA_ENABLE_CUDASIM=1`` the
kernels run in numba's CUDA simulator on NumPy arrays and torch CPU tensors.
"""
from .codec import (BAD_ESCAPES, BAD_TAG, NO_STORAGE, DecodePlan, DeviceCodec, EncodePlan, decode_tiles,
                    device_codec, encode_tiles, pack_bases)

__all__ = ["BAD_ESCAPES", "BAD_TAG", "NO_STORAGE", "DecodePlan", "DeviceCodec", "EncodePlan", "decode_tiles",
           "device_codec", "encode_tiles", "pack_bases"]
