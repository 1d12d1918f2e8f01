"""A SplitZip-style BF16 codec in NumPy: OUR implementation of the idea, not the authors' code.

SplitZip (Guo and Joshi, "SplitZip: Ultra Fast Lossless KV Compression for
Disaggregated LLM Serving", arXiv:2605.01708; their Triton codec is at
github.com/Intelligent-Microsystems-Lab/SplitZip) is the codec the GAAC paper
compares with for KV transfer.  It is written here from its published
description only, so that the comparison in ``benchmarks/codecs.py`` has a
ratio for it measured on our own K/V:

* a BF16 element splits into its sign+mantissa byte, stored unchanged, and its
  8-bit exponent (the same split GAAC uses: :func:`gaac.reference.bits.split_bf16`);
* an offline-calibrated codebook holds the 16 most frequent exponents, and every
  element gets a fixed 4-bit code (two per byte), so the dense path needs no
  histogram and no variable-length decoding;
* an exponent outside the codebook goes to a sparse escape stream of
  (position, exponent) pairs, kept chunk-local: the tensor is cut into chunks
  of ``CHUNK_ELEMENTS`` elements, each chunk stores how many escapes it has and
  each escape its position inside the chunk (16 bits) and its exponent (8 bits).
  The escaped element's own 4-bit code is written as 0 and overwritten on decode.

Our choices where the description leaves room (they change sizes by well under
1%): 16-bit per-chunk escape counts, 16-bit chunk-local positions, the 16-byte
codebook counted in the stream, no container header.  Throughput measured with
this module is that of a plain NumPy implementation, not of SplitZip's kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gaac.reference.bits import join_bf16, split_bf16

CODE_BITS = 4
CODEBOOK_SIZE = 1 << CODE_BITS      # 16 exponents get a code
CHUNK_ELEMENTS = 1024               # the published default chunk size
EXPONENTS = 256                     # BF16 has 8 exponent bits
_NO_CODE = 0xFF                     # lookup-table mark: this exponent escapes


def calibrate_codebook(bits: np.ndarray) -> np.ndarray:
    """The 16 most frequent exponents of BF16 bit patterns ``bits``, most frequent first.

    Ties go to the smaller exponent, so the codebook is a pure function of the
    data.  Data with fewer than 16 distinct exponents still gets 16 entries
    (the unused ones are never-seen exponents), so the code width stays fixed.
    """
    _, exponent = split_bf16(np.asarray(bits, dtype=np.uint16).ravel())
    counts = np.bincount(exponent, minlength=EXPONENTS)
    order = np.lexsort((np.arange(EXPONENTS), -counts))   # by count desc, then exponent asc
    return order[:CODEBOOK_SIZE].astype(np.uint8)


@dataclass(frozen=True)
class SplitZipStream:
    """One encoded tensor: the dense streams, the escape stream and what decoding needs."""

    shape: tuple
    codebook: np.ndarray        # uint8[16]
    sm: np.ndarray              # uint8[n]: sign+mantissa bytes
    codes: np.ndarray           # uint8[ceil(n/2)]: 4-bit codes, element 2i in the low nibble
    escape_counts: np.ndarray   # uint16[chunks]: escapes in each chunk
    escape_pos: np.ndarray      # uint16[escapes]: position inside its chunk
    escape_exp: np.ndarray      # uint8[escapes]: the escaped exponent
    chunk: int

    @property
    def escapes(self) -> int:
        return int(self.escape_pos.size)

    @property
    def nbytes(self) -> int:
        """Compressed size: every stream, the codebook included."""
        return sum(int(a.nbytes) for a in (self.codebook, self.sm, self.codes, self.escape_counts,
                                           self.escape_pos, self.escape_exp))


def encode(bits: np.ndarray, codebook: np.ndarray, chunk: int = CHUNK_ELEMENTS) -> SplitZipStream:
    """Encode BF16 bit patterns ``bits`` (any shape, uint16) with a 16-entry exponent ``codebook``."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"expected uint16 BF16 bit patterns, got {bits.dtype}")
    codebook = np.asarray(codebook, dtype=np.uint8)
    if codebook.shape != (CODEBOOK_SIZE,) or np.unique(codebook).size != CODEBOOK_SIZE:
        raise ValueError(f"a codebook is {CODEBOOK_SIZE} distinct exponents, got {codebook.tolist()}")
    if not 0 < chunk <= 1 << 16:
        raise ValueError(f"chunk must be 1..65536 elements so that positions fit 16 bits, got {chunk}")
    sm, exponent = split_bf16(bits.ravel())
    n = exponent.size
    lut = np.full(EXPONENTS, _NO_CODE, dtype=np.uint8)
    lut[codebook] = np.arange(CODEBOOK_SIZE, dtype=np.uint8)
    code = lut[exponent]
    escaped = np.flatnonzero(code == _NO_CODE)
    code[escaped] = 0
    if n % 2:
        code = np.append(code, np.uint8(0))
    packed = code[0::2] | (code[1::2] << CODE_BITS)
    chunks = -(-n // chunk)
    return SplitZipStream(
        shape=bits.shape, codebook=codebook.copy(), sm=sm, codes=packed.astype(np.uint8),
        escape_counts=np.bincount(escaped // chunk, minlength=chunks).astype(np.uint16),
        escape_pos=(escaped % chunk).astype(np.uint16), escape_exp=exponent[escaped], chunk=chunk)


def decode(stream: SplitZipStream) -> np.ndarray:
    """The uint16 BF16 bit patterns ``stream`` was encoded from, in their original shape."""
    n = stream.sm.size
    code = np.empty(2 * stream.codes.size, dtype=np.uint8)
    code[0::2] = stream.codes & 0x0F
    code[1::2] = stream.codes >> CODE_BITS
    exponent = stream.codebook[code[:n]]
    chunk_of_escape = np.repeat(np.arange(stream.escape_counts.size, dtype=np.int64),
                                stream.escape_counts.astype(np.int64))
    exponent[chunk_of_escape * stream.chunk + stream.escape_pos] = stream.escape_exp
    return join_bf16(stream.sm, exponent).astype(np.uint16).reshape(stream.shape)
