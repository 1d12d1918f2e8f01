"""CRC-32 of fixed-size chunks where the data is, on the GPU: the sequence container's chunk CRC table.

The sequence container (FORMAT.md section 11) protects its body with the
CRC-32 of FORMAT.md 7.4 (zlib's) of every 1 MiB chunk.  A sequence moved
between a GPU and its host is gigabytes; one host core computes zlib's CRC at
about 2 GB/s, far slower than the PCIe copy it would protect, so the GPU
computes the chunks' CRCs in device memory: before the device-to-host copy
when a sequence is exported, after the host-to-device copy when one is
imported.

The arithmetic.  Let ``r(D)`` be the CRC register after ``D`` starting from 0,
with no final XOR: a linear function of ``D`` over GF(2), and appending ``k``
zero bytes multiplies it by ``x^(8k)`` modulo the CRC polynomial.  zlib's
CRC-32 of ``n`` bytes is ``r(D) ^ c(n)``, where ``c(n) = (0xFFFFFFFF *
x^(8n)) ^ 0xFFFFFFFF`` accounts for the initial and final XOR.  A chunk is cut
into 16-byte **pieces**; thread ``t`` of a block of ``T`` threads takes pieces
``t, t + T, t + 2T, ...`` (so a warp reads 512 consecutive bytes per step) and
folds them Horner-wise, ``acc = acc * x^(128 T) ^ r(piece)``, which leaves
``acc`` = its pieces' share of ``r(chunk)`` times ``x^(-128 (T - 1 - t))``;
one multiplication by ``x^(128 (T - 1 - t))`` and an XOR over the block's
threads give ``r(chunk)``.  ``r(piece)`` is 16 lookups, one per byte, in
tables ``T_k[v] = r(byte v, then k zero bytes)``; multiplying by the constant
``x^(128 T)`` is 4 lookups, one per byte of ``acc``.  The 20 tables (20 KiB)
live in shared memory.  Polynomials are in zlib's reflected order (bit 31 is
``x^0``); :func:`multmodp` is zlib's.
"""
from __future__ import annotations

import functools
import zlib

import numpy as np
from numba import cuda

from .primitives import SIMULATOR

POLY = 0xEDB88320                 # the CRC-32 polynomial, reflected (FORMAT.md 7.4)
PIECE_BYTES = 16                  # bytes a thread folds per step
THREADS = 256                     # threads per chunk (block) on the GPU
TABLE_WORDS = (PIECE_BYTES + 4) * 256   # 16 piece tables, then 4 tables that multiply by x^(128 T)
_FOLD = PIECE_BYTES * 256         # where the multiply tables start

_ZERO = np.uint32(0)
_ONE = np.uint32(1)
_TOP = np.uint32(1 << 31)
_BYTE = np.uint32(0xFF)
_POLY = np.uint32(POLY)
_S8, _S16, _S24 = np.uint32(8), np.uint32(16), np.uint32(24)


# -- host arithmetic on CRC polynomials (reflected: bit 31 is x^0) ----------------------------------------------

def multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial."""
    p, m = 0, 1 << 31
    while m:
        if a & m:
            p ^= b
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


def x8n(n: int) -> int:
    """``x^(8n)`` modulo the polynomial: what appending ``n`` zero bytes multiplies a register by."""
    result, square = 1 << 31, 1 << 23          # x^0 and x^8
    while n:
        if n & 1:
            result = multmodp(square, result)
        square = multmodp(square, square)
        n >>= 1
    return result


def crc_adjust(n: int) -> int:
    """``c(n)``: zlib's CRC-32 of ``n`` bytes ``D`` is ``r(D) ^ c(n)`` (``r``: register from 0, no final XOR)."""
    return multmodp(x8n(n), 0xFFFFFFFF) ^ 0xFFFFFFFF


@functools.lru_cache(maxsize=None)
def tables(threads: int) -> np.ndarray:
    """uint32 ``[TABLE_WORDS]``: ``T_k[v]`` at ``256 k + v`` (``k < 16``), then ``M_j[v] = (v << 8j) * x^(128
    threads)`` at ``_FOLD + 256 j + v``."""
    byte = np.array([zlib.crc32(bytes([v])) ^ crc_adjust(1) for v in range(256)], dtype=np.int64)   # r(v)
    out = np.zeros(TABLE_WORDS, dtype=np.uint32)
    for k in range(PIECE_BYTES):
        shift = x8n(k)
        out[256 * k:256 * (k + 1)] = [multmodp(shift, int(r)) for r in byte]
    fold = x8n(PIECE_BYTES * threads)
    for j in range(4):
        out[_FOLD + 256 * j:_FOLD + 256 * (j + 1)] = [multmodp(fold, v << (8 * j)) for v in range(256)]
    return out


@functools.lru_cache(maxsize=None)
def finals(threads: int) -> np.ndarray:
    """uint32 ``[threads]``: ``x^(128 (threads - 1 - t))``, thread ``t``'s last factor."""
    return np.array([x8n(PIECE_BYTES * (threads - 1 - t)) for t in range(threads)], dtype=np.uint32)


# -- the kernel ------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def _mulmod(a, b):
    """``a * b`` modulo the polynomial, in registers (uint32; ``a`` a constant)."""
    p = _ZERO
    m = _TOP
    for _ in range(32):
        if a & m:
            p ^= b
        m >>= _ONE
        if b & _ONE:
            b = (b >> _ONE) ^ _POLY
        else:
            b = b >> _ONE
    return p


@functools.lru_cache(maxsize=None)
def kernel(threads: int):
    """The chunk CRC kernel for blocks of ``threads`` threads (a power of two): one block per chunk.

    ``words``: the data as 32-bit words (int32 on the GPU, uint32 in the simulator), ``chunk_words`` per
    chunk, a multiple of ``4 * threads``; ``table`` and ``final`` from :func:`tables` and :func:`finals`;
    ``adjust`` = ``crc_adjust(4 * chunk_words)``; out ``crcs[chunk]``.
    """
    @cuda.jit
    def crc_chunks(words, chunk_words, table, final, adjust, crcs):
        sm = cuda.shared.array(TABLE_WORDS, np.uint32)
        red = cuda.shared.array(threads, np.uint32)
        tid = cuda.threadIdx.x
        for i in range(tid, TABLE_WORDS, threads):
            sm[i] = table[i]
        cuda.syncthreads()
        base = cuda.blockIdx.x * chunk_words
        acc = _ZERO
        for piece in range(tid, chunk_words // 4, threads):
            acc = (sm[_FOLD + (acc & _BYTE)] ^ sm[_FOLD + 256 + ((acc >> _S8) & _BYTE)]
                   ^ sm[_FOLD + 512 + ((acc >> _S16) & _BYTE)] ^ sm[_FOLD + 768 + ((acc >> _S24) & _BYTE)])
            w = base + 4 * piece
            for j in range(4):
                x = words[w + j]                     # bytes 4j .. 4j+3 of the piece, little-endian
                k = 256 * (PIECE_BYTES - 1 - 4 * j)  # byte b is followed by 15 - b zero bytes in the piece
                acc ^= sm[k + (x & 0xFF)] ^ sm[k - 256 + ((x >> 8) & 0xFF)] \
                    ^ sm[k - 512 + ((x >> 16) & 0xFF)] ^ sm[k - 768 + ((x >> 24) & 0xFF)]
        red[tid] = _mulmod(final[tid], acc)
        cuda.syncthreads()
        step = threads // 2
        while step > 0:
            if tid < step:
                red[tid] ^= red[tid + step]
            cuda.syncthreads()
            step //= 2
        if tid == 0:
            crcs[cuda.blockIdx.x] = red[0] ^ adjust

    return crc_chunks


@functools.lru_cache(maxsize=None)
def _device_constants(threads: int):
    return cuda.to_device(tables(threads)), cuda.to_device(finals(threads))


def chunk_crcs(data, chunk_bytes: int, *, threads: int = THREADS):
    """zlib's CRC-32 of every whole ``chunk_bytes`` chunk of ``data`` (uint8, 1-D; a partial last chunk is
    left out): int32 ``[n]`` on the data's device (the bits of the CRCs; a NumPy uint32 array for NumPy input
    in the simulator).  ``data`` is a torch CUDA tensor (a CPU tensor or NumPy array in the simulator)
    starting on a 4-byte boundary; ``chunk_bytes`` a multiple of ``16 * threads``.  Asynchronous on the GPU
    (torch's current stream)."""
    if chunk_bytes % (PIECE_BYTES * threads) or threads & (threads - 1):
        raise ValueError(f"chunks of {chunk_bytes} bytes do not split into {PIECE_BYTES}-byte pieces for "
                         f"{threads} threads (a power of two)")
    n = data.shape[0] // chunk_bytes
    adjust = np.uint32(crc_adjust(chunk_bytes))
    if isinstance(data, np.ndarray):
        words = data[:n * chunk_bytes].view(np.uint32)
        out = np.zeros(n, dtype=np.uint32)
        if n:
            kernel(threads)[n, threads](words, chunk_bytes // 4, tables(threads), finals(threads), adjust, out)
        return out
    import torch

    out = torch.zeros(n, dtype=torch.int32, device=data.device)
    if n == 0:
        return out
    words = data[:n * chunk_bytes].view(torch.int32)
    if SIMULATOR:
        kernel(threads)[n, threads](words.numpy().view(np.uint32), chunk_bytes // 4, tables(threads),
                                    finals(threads), adjust, out.numpy().view(np.uint32))
        return out
    table, final = _device_constants(threads)
    stream = cuda.external_stream(torch.cuda.current_stream(data.device).cuda_stream)
    kernel(threads)[n, threads, stream](cuda.as_cuda_array(words), chunk_bytes // 4, table, final, adjust,
                                        cuda.as_cuda_array(out))
    return out
