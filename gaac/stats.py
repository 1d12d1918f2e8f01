"""What a calibration makes of a cache: sizes, mode mix, entropy, and a bit-exact round trip.

:func:`measure` codes a cache the way the paged cache holds it: every complete
16-token block of every layer is cut into tiles, encoded with the layer's
bases and escape capacity, decoded again and compared bit for bit.  Two ratios
answer two questions:

* ``ratio_stream``   = BF16 bytes / payload bytes, where a tile's payload is its
  sign+mantissa bytes, 3-bit codes, mode tags and the escape bytes its groups
  need -- no slot rounding, no fallback.  It is what the format itself achieves
  and what the paper reports (1.402-1.406 across tasks; 16/11.25 = 1.422 if
  every group were 3-bit).  It ignores the capacity, so a tile that overflows
  its slot still counts its escapes here (``EncodedBlock.payload_bytes``, by
  contrast, counts such a tile at its raw BF16 size).
* ``ratio_resident`` = BF16 bytes / the bytes the paged cache really holds:
  a slot of ``fixed + capacity`` bytes for every tile that fits, a raw BF16
  tile for every tile that does not, and a 4-byte block-table entry per tile.

The last ``tokens % 16`` tokens of a sequence form no block: the cache keeps
them in its BF16 tail buffer until the block fills.  They are reported as
``tail_tokens`` and left out of every other number (ratios, fractions,
entropy), so the numbers describe the codec and do not drift with the prompt
length; ``ratios_include_tail`` says so in the output.

The measurement follows the cache's whole lifecycle: each layer's blocks are
finalized in token order and, with ``adapt=True`` (the default, what the cache
does), the rule of :mod:`gaac.epochs` appends calibration epochs as the
context grows and each block is coded with the epoch it would get.  The
resident bytes then include what adaptation costs the cache: the appended
epochs' bases and a 2-byte epoch index per block (part ``epochs``).  Epoch
0, the calibration itself, is shared by every cache of the model and is not
counted.  ``segment_tokens`` adds the same numbers per span of positions, to
show how a context's later tokens fare.
"""
from __future__ import annotations

import numpy as np

from . import layout as L
from .calibration import Calibration
from .epochs import EPOCH_INDEX_BYTES, Adapter, epoch_table_bytes
from .errors import InputError
from .progress import progress
from .tiles import cache_blocks

from .tally import CacheStats, KindStats, Tally, measure_layer, measured_cache, sum_tallies


def measure(k, v, calibration: Calibration, *, layer_ids=None, show_progress: bool | None = None,
            adapt: bool = True, segment_tokens: int | None = None, fitted_tokens: int = 0) -> CacheStats:
    """Measure caches ``k``, ``v`` ``[layers, kv_heads, tokens, head_dim]`` coded with ``calibration``.

    ``layer_ids`` names the layers in the per-layer view (default ``0..layers-1``),
    e.g. the model's layer numbers when the cache is a slice of its layers.
    ``adapt`` runs the epoch rule of :mod:`gaac.epochs` as the cache would (on a
    copy: ``calibration`` is left as it is; the result's ``calibration`` holds
    the epochs).  ``fitted_tokens``: the calibration was fitted on the first
    that many tokens, which a cache appends as fitted (``PagedKVCache.append(...,
    fitted=True)``, as ``gaac.hf.GAACCache`` appends the prompt it calibrates
    itself on): the rule appends no epoch among their blocks and decides from the
    blocks after them.  ``segment_tokens`` (a multiple of 16) adds per-segment numbers.
    With an FP8 calibration ``k`` and ``v`` are the BF16 caches it converts
    (:func:`gaac.fp8.stats.measure_fp8`); FP8 has no epochs to adapt or segment by.
    """
    if segment_tokens is not None and (segment_tokens <= 0 or segment_tokens % L.BLOCK_TOKENS):
        raise InputError(f"segment length {segment_tokens} is not a positive multiple of {L.BLOCK_TOKENS} tokens")
    if isinstance(fitted_tokens, bool) or not isinstance(fitted_tokens, int) or fitted_tokens < 0:
        raise InputError(f"fitted_tokens must be a token count (an int >= 0), got {fitted_tokens!r}")
    if calibration.scale_log2 is not None:      # an FP8 calibration: convert, then code with epoch 0 only
        if segment_tokens:
            raise InputError(f"segments follow calibration epochs; {calibration.format.name} has none")
        from .fp8.stats import measure_fp8

        return measure_fp8(k, v, calibration, layer_ids=layer_ids)
    learned = calibration.copy()
    out = {}
    for kind, name, x in ((L.KIND_K, "k", k), (L.KIND_V, "v", v)):
        bits, ids = measured_cache(x, name, calibration, layer_ids)
        layers, heads, tokens, dim = bits.shape
        span = (segment_tokens or tokens) // L.BLOCK_TOKENS                # blocks per segment
        per_layer = []
        for layer in progress(range(layers), desc=f"stats {name}", unit="layer", enable=show_progress):
            per_layer.append(_lifecycle(bits[layer], learned, layer, kind, adapt, span,
                                        fitted_tokens // L.BLOCK_TOKENS))
        segments = [sum_tallies(list(seg)) for seg in zip(*per_layer)]
        out[name] = KindStats(name, tokens, [sum_tallies(s) for s in per_layer],
                              [int(c) for c in calibration.capacity[kind]], ids, adapt, segment_tokens, segments)
    return CacheStats(**out, calibration=learned)


def _lifecycle(x: np.ndarray, calibration: Calibration, layer: int, kind: int, adapt: bool,
               span: int, fitted: int = 0) -> list[Tally]:
    """One layer ``[kv_heads, tokens, head_dim]`` finalized block by block: a tally per ``span`` blocks.

    With ``adapt`` the epoch rule runs over the blocks (appending to
    ``calibration``; its checks among the first ``fitted`` blocks append nothing)
    and each segment is charged the epoch index of its blocks and the tables of
    the epochs appended while its blocks were finalized.
    """
    blocks = cache_blocks(x)
    start = calibration.n_epochs(layer, kind) - 1
    if adapt:
        adapter = Adapter(calibration, layer, kind)
        epochs = np.concatenate([adapter.assign(blocks[:fitted], decide=False), adapter.assign(blocks[fitted:])])
    else:
        epochs = np.full(len(blocks), start, dtype=np.int64)
    tables = [calibration.bases(layer, kind, e) for e in range(calibration.n_epochs(layer, kind))]
    b3, b4 = (np.stack([t[i] for t in tables])[epochs] for i in (0, 1))     # each block's bases
    new = np.arange(start + 1, calibration.n_epochs(layer, kind))
    # an epoch is appended at the check after the block before its first use
    appended_at = np.searchsorted(epochs, new) - 1
    capacity = int(calibration.capacity[kind, layer])
    tallies = []
    for first in range(0, len(blocks), span):
        stop = min(first + span, len(blocks))
        tally = measure_layer(x[:, first * L.BLOCK_TOKENS:stop * L.BLOCK_TOKENS], b3[first:stop], b4[first:stop],
                              capacity)
        if adapt:
            tally.new_epochs = int(((appended_at >= first) & (appended_at < stop)).sum())
            tally.epoch_bytes = tally.new_epochs * epoch_table_bytes(calibration) \
                + (stop - first) * EPOCH_INDEX_BYTES
        tallies.append(tally)
    return tallies
