"""The one-token append of a decode step: each sequence's new token into its BF16 tails, K and V, and its length.

``append_kernel`` (an eager step) has a thread block per (sequence of the step, KV head) and a thread per
channel.  Sequence ``i`` of the step is cache row ``rows[i]``; its token goes to tail position ``rpos[i]``
(its length mod 16) and its length becomes ``lens_after[i]``, both worked out by the host.  A token that
finishes a block is not written here: the cache encodes that block through its ordinary update.

``device_append_kernel`` (a captured step, :mod:`gaac.step`) reads each position from the lengths on the
device, so the same launch serves every replay.  It writes every token, the one that completes a block
too, and sets ``finish[row]`` to 1 exactly where the token completes the block, with the block's epochs
(``epoch_k``/``epoch_v`` at the block, where the cache keeps epochs); the tail encode kernel
(:func:`gaac.cuda.codec.tail_encode_kernel`) that follows then encodes that block from the tail into the
pools and the block table.  A thread block per sequence: its threads read the length before one of them
advances it.
"""
from __future__ import annotations

import functools

from numba import cuda

from .. import layout as L


@functools.lru_cache(maxsize=None)
def append_kernel():
    @cuda.jit
    def kernel(k, v, tail_k, tail_v, rows, rpos, lens_after, seq_lens, kv_heads, head_dim):
        i = cuda.blockIdx.x
        h = cuda.blockIdx.y
        d = cuda.threadIdx.x
        row = rows[i]
        src = (i * kv_heads + h) * head_dim + d
        dst = ((row * kv_heads + h) * L.BLOCK_TOKENS + rpos[i]) * head_dim + d
        tail_k[dst] = k[src]
        tail_v[dst] = v[src]
        if h == 0 and d == 0:
            seq_lens[row] = lens_after[i]
    return kernel


DEVICE_APPEND_THREADS = 256
DEVICE_APPEND_SIG = ("void(int16[::1], int16[::1], int16[::1], int16[::1], int32[::1], int32[::1], int32[::1], "
                     "int16[::1], int16[::1], int64, int64, int64, int64, int64, int64)")


@functools.lru_cache(maxsize=None)
def device_append_kernel():
    @cuda.jit
    def kernel(k, v, tail_k, tail_v, rows, seq_lens, finish, epoch_k, epoch_v, ek, ev, kv_heads, head_dim,
               max_blocks, with_epochs):
        i = cuda.blockIdx.x
        row = rows[i]
        n = seq_lens[row]
        r = n % L.BLOCK_TOKENS
        width = kv_heads * head_dim
        for x in range(cuda.threadIdx.x, width, cuda.blockDim.x):
            h = x // head_dim
            dst = ((row * kv_heads + h) * L.BLOCK_TOKENS + r) * head_dim + x % head_dim
            tail_k[dst] = k[i * width + x]
            tail_v[dst] = v[i * width + x]
        cuda.syncthreads()                 # every thread has read the length before it advances
        if cuda.threadIdx.x == 0:
            seq_lens[row] = n + 1
            done = r == L.BLOCK_TOKENS - 1
            finish[row] = 1 if done else 0
            if done and with_epochs:
                at = row * max_blocks + (n + 1) // L.BLOCK_TOKENS - 1
                epoch_k[at] = ek
                epoch_v[at] = ev
    return kernel
