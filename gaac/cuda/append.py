"""The one-token append of a decode step: each sequence's new token into its BF16 tails, K and V, and its length.

``append_kernel`` has a thread block per (sequence of the step, KV head) and a thread per channel.
Sequence ``i`` of the step is cache row ``rows[i]``; its token goes to tail position ``rpos[i]`` (its length
mod 16) and its length becomes ``lens_after[i]``, both worked out by the host.  A token that finishes a
block is not written here: the cache encodes that block through its ordinary update.

A captured step appends with :func:`gaac.cuda.codec.step_append_kernel` instead, which reads the positions
on the device and encodes the blocks the token completes.
"""
from __future__ import annotations

import functools

from numba import cuda, types

from .. import layout as L
from .primitives import grid_launch_dependents

# The argument types of a launch (torch tensors flattened to 1-D, Python ints): compiled before the
# first launch, which then goes through the driver (gaac.cuda.launch.FastLaunch.run).
APPEND_SIG = (*(types.Array(types.int16, 1, "C"),) * 4, *(types.Array(types.int32, 1, "C"),) * 4,
              types.int64, types.int64)


@functools.lru_cache(maxsize=None)
def append_kernel():
    @cuda.jit
    def kernel(k, v, tail_k, tail_v, rows, rpos, lens_after, seq_lens, kv_heads, head_dim):
        # the layer's attention kernel, a programmatic dependent of this one, may start now (it waits for
        # this grid before it reads what this grid writes: gaac.cuda.attention)
        grid_launch_dependents()
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
