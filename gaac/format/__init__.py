"""The GAAC byte formats apart from the cache: the two containers, read and written with NumPy alone.

Nothing here imports torch or numba: a third party reads, checks, writes and decodes GAAC bytes with
this package and NumPy.

* :mod:`gaac.format.block`: the block container of FORMAT.md section 7, one 16-token block of one layer's K
  or V as a stream (``encode_block``, ``decode_block``, the container's reader and its reject rules).
* :mod:`gaac.format.sequence`: the sequence container of FORMAT.md section 11 (one sequence of a paged
  cache, every layer, K and V, its blocks as the cache stores them): its layout (header, section records,
  epoch records, chunk CRC table, body parts, each offset and size computed from the counts), a reader
  that applies every reject rule of 11.7 and returns the sections as NumPy arrays, a writer from NumPy
  arrays, and a decoder of the sections back to K and V.  :mod:`gaac.cache.transfer` is the cache's side
  of the same container and takes its layout and its checks from here.

Both stand on the torch-free modules below them that every part of gaac shares: the constants and
geometry (:mod:`gaac.layout`), tiles (:mod:`gaac.tiles`), calibrations and their canonical bytes
(:mod:`gaac.calibration`) and the reference codec (:mod:`gaac.reference`).
"""
from .sequence import (KINDS, MAX_INDEXED_EPOCHS, Container, EpochRecord, Layout, Section, SectionData, Sequence,
                       as_array, check_calibration, chunk_crcs, container_nbytes, read_head, read_sequence,
                       sequence_layout, worst_case_bytes, write_head, write_sequence)

__all__ = ["KINDS", "MAX_INDEXED_EPOCHS", "Container", "EpochRecord", "Layout", "Section", "SectionData", "Sequence",
           "as_array", "check_calibration", "chunk_crcs", "container_nbytes", "read_head", "read_sequence",
           "sequence_layout", "worst_case_bytes", "write_head", "write_sequence"]
