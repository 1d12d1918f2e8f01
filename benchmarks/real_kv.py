"""The real SmolLM2-135M-Instruct K/V dumps tiled to another model's shape (the benchmarks' shared source)."""
from __future__ import annotations

import numpy as np


def tile_heads(x: np.ndarray, layers: int, heads: int, dim: int) -> np.ndarray:
    """Real uint16 ``[30, 3, T, 64]`` K or V as ``[layers, heads, T, dim]``: head ``h`` of layer ``l`` is ``dim / 64``
    real (layer, head) slices side by side, slice ``j`` the real pair ``divmod(((l * heads + h) * per + j) % 90, 3)``
    (the model's own shape is the dump itself)."""
    rl, rh, tokens, rd = x.shape
    per = dim // rd
    out = np.empty((layers, heads, tokens, dim), np.uint16)
    for layer in range(layers):
        for h in range(heads):
            for j in range(per):
                a, b = divmod(((layer * heads + h) * per + j) % (rl * rh), rh)
                out[layer, h, :, j * rd:(j + 1) * rd] = x[a, b]
    return out
