"""Decode attention over one layer of a GAAC-FP8 cache: the CPU reference (FORMAT-FP8.md section 8).

A sequence's layer holds its complete 16-token blocks of K and V as FP8 block
containers (:mod:`gaac.format.block`) and its unfinished block as plain FP8 bytes
(the tail).  Attention decodes every block back to its FP8 bytes, reads them
as FP8 values, and applies the calibration's power-of-two scales once per KV
head -- to the scores (``q . k * 2**s_K``) and to the output
(``sum p v * 2**s_V``) -- which is exact in binary floating point, so the result
is attention over the dequantised cache.  Compressed blocks and the tail share
one softmax.  Float64 throughout: this is the oracle an FP8 kernel would be
checked against, as :func:`gaac.attention.reference_attention` is for BF16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import layout as L
from ..arrays import as_bits
from ..errors import InputError
from ..format.block import decode_block, encode_block
from ..calibration import Calibration
from .convert import fp8_values, to_fp8


@dataclass
class FP8LayerCache:
    """One layer of one sequence of a GAAC-FP8 cache."""

    calibration: Calibration
    layer: int
    k_blocks: list[bytes]          # FP8 block containers, in token order
    v_blocks: list[bytes]
    k_tail: np.ndarray             # uint8 [kv_heads, tail_tokens, head_dim], FP8 bytes
    v_tail: np.ndarray

    @property
    def tokens(self) -> int:
        return L.BLOCK_TOKENS * len(self.k_blocks) + self.k_tail.shape[1]

    def fp8(self, kind: int) -> np.ndarray:
        """The whole K (``kind`` 0) or V (1) as FP8 bytes ``[kv_heads, tokens, head_dim]``, blocks decoded."""
        blocks, tail = (self.k_blocks, self.k_tail) if kind == L.KIND_K else (self.v_blocks, self.v_tail)
        parts = [decode_block(b, self.calibration) for b in blocks]
        return np.concatenate(parts + [tail], axis=1)


def build_layer_cache(k, v, calibration: Calibration, layer: int) -> FP8LayerCache:
    """Convert one layer of one sequence (BF16 bits ``[kv_heads, tokens, head_dim]``) with the
    calibration's scales, encode its complete blocks, and keep the rest as the FP8 tail."""
    kb, vb = as_bits(k, "k", ndim=3), as_bits(v, "v", ndim=3)
    if kb.shape != vb.shape:
        raise InputError(f"k {list(kb.shape)} and v {list(vb.shape)} differ; a cache holds both for every token")
    calibration.check_shape(None, kb.shape[0], kb.shape[2])
    calibration.check_layer(layer)
    full = kb.shape[1] // L.BLOCK_TOKENS * L.BLOCK_TOKENS
    parts = []
    for kind, bits in ((L.KIND_K, kb), (L.KIND_V, vb)):
        scales = calibration.scale_log2[kind, layer].astype(np.int64)[:, None, None]
        fp8 = to_fp8(bits, calibration.modes.fmt, scales)
        blocks = [encode_block(np.ascontiguousarray(fp8[:, t:t + L.BLOCK_TOKENS]), calibration, layer,
                                   kind).data for t in range(0, full, L.BLOCK_TOKENS)]
        parts.append((blocks, fp8[:, full:]))
    (k_blocks, k_tail), (v_blocks, v_tail) = parts
    return FP8LayerCache(calibration, layer, k_blocks, v_blocks, k_tail, v_tail)


def decode_attention_fp8(q, cache: FP8LayerCache, *, scale: float | None = None):
    """Attention of one query token ``q`` ``[q_heads, head_dim]`` over ``cache``: ``(out, lse)`` in float64.

    Grouped-query attention: query head ``i`` reads KV head ``i // (q_heads // kv_heads)``.
    ``scale`` defaults to ``1 / sqrt(head_dim)``; ``lse`` is the natural log-sum-exp of the scaled scores.
    """
    q = np.asarray(q, dtype=np.float64)
    cal = cache.calibration
    if q.ndim != 2 or q.shape[1] != cal.head_dim or q.shape[0] % cal.kv_heads:
        raise InputError(f"q must be [q_heads, {cal.head_dim}] with q_heads a multiple of {cal.kv_heads}; "
                         f"got {list(q.shape)}")
    if cache.tokens == 0:
        raise InputError("the cache is empty: attention needs at least one token")
    table = fp8_values(cal.modes.fmt)
    group = q.shape[0] // cal.kv_heads
    scale = 1.0 / math.sqrt(cal.head_dim) if scale is None else float(scale)
    k = np.repeat(table[cache.fp8(L.KIND_K)], group, axis=0)             # [q_heads, tokens, dim], unscaled
    v = np.repeat(table[cache.fp8(L.KIND_V)], group, axis=0)
    sk = np.repeat(cal.scale_log2[L.KIND_K, cache.layer].astype(np.int64), group)
    sv = np.repeat(cal.scale_log2[L.KIND_V, cache.layer].astype(np.int64), group)
    scores = np.ldexp(np.einsum("hd,htd->ht", q, k), sk[:, None]) * scale
    top = scores.max(axis=1, keepdims=True)
    p = np.exp(scores - top)
    total = p.sum(axis=1, keepdims=True)
    out = np.ldexp(np.einsum("ht,htd->hd", p, v) / total, sv[:, None])
    return out, (top + np.log(total))[:, 0]
