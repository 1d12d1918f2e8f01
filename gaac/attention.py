"""Decode attention over one layer of a GAAC paged cache.

``decode_attention(q, view)`` computes, for one new query token per sequence,
softmax attention over everything the cache holds for that sequence: the
finalized blocks (compressed slots or raw BF16 tiles, through the block table)
and the BF16 tail, in one softmax.  Grouped-query attention maps query head
``i`` to KV head ``i // g``.

Two paths, one contract:

* CUDA (``q`` and the view's arrays on a GPU): the fused kernel of
  :mod:`gaac.cuda.attention` reads the compressed tiles and never writes a
  decompressed copy.  :class:`AttentionPlan` is the FlashInfer-style split:
  ``plan`` validates the view, reads ``seq_lens`` once, chooses the split-KV
  work list and allocates the partial buffers; ``run`` only launches (two
  kernels), so a decode step can reuse one plan for every layer, or capture
  its launches in a CUDA graph.
* CPU: the reference decoder rebuilds the cache and attention runs in float32.

:func:`reference_attention` is the float64 oracle both are tested against, and
:func:`gather_dense` rebuilds a view's dense caches (the CPU path's input);
:mod:`gaac.testing` builds LayerViews from dense caches for tests and benchmarks
(the serving path is ``gaac.PagedKVCache``).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from . import layout as L
from .cache.view import LayerView
from .errors import FormatError, InputError
from .reference.codec import decode_entries
from .tiles import tile_bases, untile

MAX_GROUP = 8            # query heads per KV head: the MMA's N dimension


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _on_cuda(x) -> bool:
    return _is_torch(x) and x.device.type == "cuda"


# ----------------------------------------------------------------------------------------------
# BF16 bits <-> floats, and the float64 reference.

def bf16_to_float(bits) -> np.ndarray:
    """BF16 bit patterns (uint16/int16) -> float32, exactly."""
    b = np.asarray(bits).view(np.uint16) if np.asarray(bits).dtype == np.int16 else np.asarray(bits, np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def float_to_bf16(x) -> np.ndarray:
    """float32 -> BF16 bits (uint16), round to nearest even; NaN stays NaN."""
    f = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, np.uint16(0x7FC0), rounded)


def reference_attention(q, ks, vs, scale: float | None = None, dtype=np.float64):
    """Attention of one query token per sequence: ``(out [B, Hq, D], lse [B, Hq])`` in ``dtype``.

    ``q`` float ``[B, Hq, D]``; ``ks[b]``, ``vs[b]`` float ``[Hkv, L_b, D]`` (the whole
    cache of sequence ``b``).  ``lse`` is the natural-log log-sum-exp of the scaled scores;
    a sequence with no token gives output 0 and LSE -inf (the paged cache's empty rows).
    """
    q = np.asarray(q, dtype=dtype)
    batch, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.empty((batch, hq, d), dtype=dtype)
    lse = np.empty((batch, hq), dtype=dtype)
    for b in range(batch):
        k = np.asarray(ks[b], dtype=dtype)
        v = np.asarray(vs[b], dtype=dtype)
        if k.shape[1] == 0:
            out[b], lse[b] = 0, -np.inf
            continue
        g = hq // k.shape[0]
        kq = np.repeat(k, g, axis=0)                               # [Hq, L, D]
        vq = np.repeat(v, g, axis=0)
        s = np.einsum("hd,hld->hl", q[b], kq) * dtype(scale)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        den = p.sum(axis=1, keepdims=True)
        out[b] = np.einsum("hl,hld->hd", p / den, vq)
        lse[b] = (m + np.log(den))[:, 0]
    return out, lse


# ----------------------------------------------------------------------------------------------
# Building LayerViews from dense caches (tests, benchmarks).

def _pair_base_words(b3, b4) -> np.ndarray:
    """Per-channel bases ``[..., Hkv, D]`` -> pair words ``[..., Hkv, 3, D/2]`` int32: rows b3, b4, 0.

    Word ``p`` of a row is ``b[2p] << 7 | b[2p+1] << 23``: the exponent fields of two BF16
    lanes, which the kernel adds to a code pair; the row is the group's mode tag (the base of a
    raw group is 0; tag 3 is reserved and flagged: the kernel reads the row after these).  See
    gaac.cuda.attention.
    """
    rows = [np.asarray(b).astype(np.int32) for b in (b3, b4)]
    rows = [(x[..., 0::2] << 7) | (x[..., 1::2] << 23) for x in rows]
    zero = np.zeros_like(rows[0])
    return np.stack([rows[0], rows[1], zero], axis=-2)


def _epoch_bases(view: LayerView) -> np.ndarray:
    """The kernel's base table: pair words ``[2, E, Hkv, 3, D/2]`` int32, ``E`` = the larger epoch count of
    K and V (the other kind's rows past its own count are zero and never read: the kernel flags such
    an epoch instead)."""
    words = [_pair_base_words(*(np.asarray(_host(b[kind])) for b in (view.b3, view.b4))) for kind in range(2)]
    words = [w[None] if w.ndim == 3 else w for w in words]
    n = max(len(w) for w in words)
    out = np.zeros((2, n, *words[0].shape[1:]), np.int32)
    for kind, w in enumerate(words):
        out[kind, :len(w)] = w
    return out


def n_epochs(view: LayerView, kind: int) -> int:
    """Epochs whose bases the view holds for ``kind`` (1 for 2-D bases)."""
    b3 = view.b3[kind]
    return 1 if len(b3.shape) == 2 else int(b3.shape[0])


def block_epochs(view: LayerView, kind: int):
    """The epoch array of ``kind`` (int16 ``[batch, max_blocks]``), or None when every block is epoch 0."""
    return None if view.epoch is None else view.epoch[kind]


@dataclass
class DenseLayer:
    """The dense per-sequence caches of a view (BF16 bits, ``[Hkv, L_b, D]`` each)."""

    k: list
    v: list


def _block_tile_bases(b3, b4, epochs, nfull):
    """Per-tile bases ``[n, C]`` of the complete blocks in table order: each block's epoch's bases
    (``b3``/``b4`` ``[E, Hkv, D]`` with ``epochs`` ``[B, max_blocks]``), or the one table ``[Hkv, D]``."""
    if epochs is not None and b3.ndim == 2:
        b3, b4 = b3[None], b4[None]
    if epochs is None:
        tb3, tb4 = tile_bases(b3, b4)
        n = int(np.sum(nfull))
        return np.tile(tb3, (n, 1)), np.tile(tb4, (n, 1))
    per_epoch = [tile_bases(b3[e], b4[e]) for e in range(len(b3))]          # [P, C] pairs per epoch
    order = np.concatenate([epochs[b, :n] for b, n in enumerate(nfull)]).astype(np.int64)
    if order.size and (order.min() < 0 or order.max() >= len(b3)):
        raise InputError(f"a block's epoch is outside the {len(b3)} epochs whose bases are given")
    c = per_epoch[0][0].shape[-1]
    return tuple(np.stack([p[i] for p in per_epoch])[order].reshape(-1, c) for i in range(2))


def gather_dense(view: LayerView) -> DenseLayer:
    """Rebuild every sequence's K and V (BF16 bits ``[Hkv, L_b, D]``) with the reference decoder."""
    v_ = _host_view(view)
    d, kv_heads = v_.head_dim, v_.kv_heads
    c, tph = L.tile_channels(d), L.tiles_per_head(d)
    lens = np.asarray(v_.seq_lens).astype(np.int64)
    out = ([], [])
    for kind in range(2):
        table = np.asarray(v_.table[kind]).view(np.uint32)
        eps = block_epochs(v_, kind)
        b3s, b4s = np.asarray(v_.b3[kind]), np.asarray(v_.b4[kind])
        slots = np.asarray(v_.slots[kind])
        raw = np.asarray(v_.raw[kind]).view(np.uint16)
        tail = np.asarray(v_.tail_k if kind == 0 else v_.tail_v).view(np.uint16)
        for b in range(len(lens)):
            nfull = int(lens[b]) // L.BLOCK_TOKENS
            ent = table[b, :nfull].reshape(-1)
            is_raw = ent >= L.TABLE_RAW_FLAG
            idx = (ent & L.TABLE_INDEX_MASK).astype(np.int64)
            _check_entries(idx, is_raw, len(slots), len(raw), kind, b, kv_heads * tph)
            tb3 = tb4 = np.zeros((1, c), np.uint8)
            if not is_raw.all():
                tb3, tb4 = _block_tile_bases(b3s, b4s, None if eps is None else np.asarray(eps)[b:b + 1],
                                             np.array([nfull]))
            tiles = decode_entries(ent, slots, raw, tb3, tb4, v_.capacity[kind])
            blocks = [untile(tiles[i * kv_heads * tph:(i + 1) * kv_heads * tph], kv_heads, d) for i in range(nfull)]
            full = np.concatenate(blocks, axis=1) if blocks else np.zeros((kv_heads, 0, d), np.uint16)
            rest = int(lens[b]) - nfull * L.BLOCK_TOKENS
            out[kind].append(np.concatenate([full, tail[b, :, :rest]], axis=1))
    return DenseLayer(k=out[0], v=out[1])


def _check_entries(idx, is_raw, n_slots: int, n_raw: int, kind: int, seq: int, per_block: int) -> None:
    """:class:`FormatError` naming the first of a sequence's table entries (pool indices ``idx``, raw where
    ``is_raw``, in table order) that points past its pool of ``n_slots`` slots or ``n_raw`` raw tiles."""
    bad = np.flatnonzero(idx >= np.where(is_raw, n_raw, n_slots))
    if bad.size:
        t = int(bad[0])
        pool, size = ("raw tile", n_raw) if is_raw[t] else ("slot", n_slots)
        raise FormatError(f"table[{'kv'[kind]}][{seq}, {t // per_block}, {t % per_block}] points at {pool} "
                          f"{idx[t]}, past the {size} record(s) of its pool")


def _host_view(view: LayerView) -> LayerView:
    """The view with every array as a NumPy array on the host."""
    def h(x):
        if _is_torch(x):
            return x.detach().cpu().numpy()
        return np.asarray(x)
    return view.map_arrays(h)


# ----------------------------------------------------------------------------------------------
# Validation.

def _dtype_name(x) -> str:
    return str(x.dtype).replace("torch.", "")


def _check(x, name: str, dtype: str, shape: tuple, device) -> None:
    """``x`` must be a C-contiguous array of ``dtype`` and ``shape`` (None = any) on ``device``."""
    if not (_is_torch(x) or isinstance(x, np.ndarray)):
        raise InputError(f"{name}: expected a torch tensor or NumPy array, got {type(x).__name__}")
    if _dtype_name(x) != dtype:
        raise InputError(f"{name}: dtype {_dtype_name(x)}, expected {dtype}")
    if len(x.shape) != len(shape) or any(s is not None and s != n for s, n in zip(shape, x.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InputError(f"{name}: shape {list(x.shape)}, expected {want}")
    dev = x.device.type if _is_torch(x) else "cpu"
    if device is not None and dev != device:
        raise InputError(f"{name}: on {dev}, expected {device} (all arrays of a call on one device)")
    contiguous = x.is_contiguous() if _is_torch(x) else x.flags.c_contiguous
    if not contiguous:
        raise InputError(f"{name}: must be C-contiguous")


def _check_is_view(view) -> None:
    if not isinstance(view, LayerView):
        raise InputError(f"view: expected a gaac.cache.view.LayerView (e.g. PagedKVCache.layer_view), got "
                         f"{type(view).__name__}")


def _check_view(view: LayerView, device) -> None:
    _check_is_view(view)
    if view.head_dim not in L.SUPPORTED_HEAD_DIMS:
        raise InputError(f"head_dim {view.head_dim} is not supported; one of {L.SUPPORTED_HEAD_DIMS}")
    d, hk = view.head_dim, view.kv_heads
    c, tph = L.tile_channels(d), L.tiles_per_head(d)
    geo = L.TileGeometry(c)
    batch = view.seq_lens.shape[0] if hasattr(view.seq_lens, "shape") else -1
    _check(view.seq_lens, "seq_lens", "int32", (None,), device)
    for kind, kn in enumerate("kv"):
        cap = view.capacity[kind]
        if cap % L.SLOT_ALIGN or not 0 <= cap <= geo.max_useful_capacity:
            raise InputError(f"capacity[{kn}] = {cap}: must be a multiple of {L.SLOT_ALIGN} in "
                             f"0..{geo.max_useful_capacity} for {c}-channel tiles")
        _check(view.slots[kind], f"slots[{kn}]", "uint8", (None, geo.slot_bytes(cap)), device)
        _check(view.raw[kind], f"raw[{kn}]", "int16", (None, L.BLOCK_TOKENS, c), device)
        _check(view.table[kind], f"table[{kn}]", "int32", (batch, None, hk * tph), device)
        bshape = (hk, d) if len(view.b3[kind].shape) == 2 else (None, hk, d)
        _check(view.b3[kind], f"b3[{kn}]", "uint8", bshape, device)
        _check(view.b4[kind], f"b4[{kn}]", "uint8", (n_epochs(view, kind), hk, d)[-len(bshape):], device)
        if bshape[0] == 0:
            raise InputError(f"b3[{kn}]: no epoch's bases")
        eps = block_epochs(view, kind)
        if eps is None and len(bshape) == 3:
            raise InputError(f"b3[{kn}] holds the bases of {view.b3[kind].shape[0]} epochs [n_epochs, kv_heads, "
                             f"head_dim] but the view records no block epochs (epoch[{kn}] is None): give each "
                             "block's epoch, or 2-D bases [kv_heads, head_dim] for a view of epoch 0 only")
        if eps is not None:
            _check(eps, f"epoch[{kn}]", "int16", (batch, view.table[kind].shape[1]), device)
    _check(view.tail_k, "tail_k", "int16", (batch, hk, L.BLOCK_TOKENS, d), device)
    _check(view.tail_v, "tail_v", "int16", (batch, hk, L.BLOCK_TOKENS, d), device)


def check_seq_lens(view: LayerView) -> np.ndarray:
    """The view's ``seq_lens`` on the host (int64), or :class:`InputError` where one is negative or holds
    more complete blocks than the block table has room for (``seq_lens`` itself already checked)."""
    lens = _host(view.seq_lens).astype(np.int64)
    if lens.size == 0 or lens.min() < 0:
        raise InputError(f"seq_lens: need one non-negative length per sequence, got {lens.tolist()}")
    mb = view.table[0].shape[1]
    if (lens // L.BLOCK_TOKENS).max() > mb:
        raise InputError(f"seq_lens: a sequence has {(lens // L.BLOCK_TOKENS).max()} complete blocks but the "
                         f"block table holds {mb}")
    return lens


LOG2_E = 1.4426950408889634
# The largest softmax scale: the kernels scale scores by float32(scale * log2(e)), which must be finite.
MAX_SCALE = float(np.nextafter(np.float32(np.finfo(np.float32).max / LOG2_E), np.float32(0)))


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` for None, else a real number (not a bool) that is a
    positive, finite float32 and stays finite times log2(e), as the kernels use it (0 < scale <=
    :data:`MAX_SCALE`, about 2.4e38; 1e39 is finite in Python but infinite in float32, and would make
    every output NaN).  Anything else is an :class:`InputError`.  Every path that takes a scale
    (:func:`decode_attention`, :class:`AttentionPlan`, a cache's decode plans) checks it here."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise InputError(f"scale: expected a real number (or None for 1/sqrt(head_dim)), got {scale!r}")
    try:
        value = float(scale)
    except OverflowError:                   # an int beyond float64 (10**400)
        value = math.inf
    if not (math.isfinite(value) and 0 < value <= MAX_SCALE and np.float32(value) > 0):
        raise InputError(f"scale: {scale!r} is not a positive finite float32 number no larger than "
                         f"{MAX_SCALE:.4g} (the softmax scale; None for 1/sqrt(head_dim))")
    return value


def status_error(status: int, *, layer: int | None = None, seqs=None) -> FormatError | None:
    """The :class:`FormatError` a decode-attention status word reports (None for 0), naming ``layer`` and
    the sequences ``seqs`` (an id or a list of them) of the launch where given.

    The kernel ORs one bit into the word per kind of fault it finds (the bits of
    :mod:`gaac.cuda.tile_decoder` and :mod:`gaac.cuda.attention`) and carries on with a safe stand-in, so that
    output is unspecified."""
    from .cuda.attention import STATUS_BAD_ENTRY, STATUS_BAD_EPOCH
    from .cuda.tile_decoder import STATUS_BAD_ESCAPES, STATUS_BAD_TAG

    status = int(status)
    if not status:
        return None
    why = [text for bit, text in ((STATUS_BAD_TAG, "a slot's group has the reserved mode tag 3"),
                                  (STATUS_BAD_ESCAPES, "a slot's tags need more escape bytes than its capacity"),
                                  (STATUS_BAD_EPOCH, "a block's epoch has no bases in the view"),
                                  (STATUS_BAD_ENTRY, "a block-table entry points past its slot or raw-tile pool "
                                                     "(that record was not read)")) if status & bit]
    known = STATUS_BAD_TAG | STATUS_BAD_ESCAPES | STATUS_BAD_EPOCH | STATUS_BAD_ENTRY
    if status & ~known:
        why.append(f"unknown status bits {status & ~known:#x}")
    where = [] if layer is None else [f"layer {layer}"]
    if seqs is not None:
        ids = [int(s) for s in np.atleast_1d(seqs)]
        where.append(f"sequence {ids[0]}" if len(ids) == 1 else f"sequences {ids}")
    return FormatError(f"decode attention{' (' + ', '.join(where) + ')' if where else ''}: " + "; ".join(why)
                       + "; the output of that launch is unspecified")


def _check_q(q, view: LayerView, device, q_heads: int | None = None):
    """``q`` BF16 ``[B, Hq, D]`` (torch bfloat16, or uint16/int16 bits) -> (bits as int16, q_heads).

    ``view`` is a LayerView, or anything else with its ``seq_lens`` (the batch), ``head_dim`` and
    ``kv_heads`` (a caller that has no view checks ``q`` against its shape so); ``q_heads``, where
    given, is the number of query heads ``q`` must have (a plan's).  Every error names ``q``."""
    if not all(hasattr(view, name) for name in ("seq_lens", "head_dim", "kv_heads")):
        _check_is_view(view)
    if _is_torch(q):
        import torch

        if q.dtype == torch.bfloat16:
            q = q.view(torch.int16)
        elif q.dtype not in (torch.int16, torch.uint16):
            raise InputError(f"q: dtype {q.dtype} is not BF16 (pass torch.bfloat16 or its int16 bits)")
    elif isinstance(q, np.ndarray):
        if q.dtype == np.uint16:
            q = q.view(np.int16)
        elif q.dtype != np.int16:
            raise InputError(f"q: dtype {q.dtype} is not BF16 bits (pass uint16/int16 bit patterns)")
    else:
        raise InputError(f"q: expected a torch tensor or NumPy array, got {type(q).__name__}")
    batch = view.seq_lens.shape[0]
    if len(q.shape) != 3 or q.shape[0] != batch or q.shape[2] != view.head_dim:
        raise InputError(f"q: shape {list(q.shape)}, expected [batch={batch}, q_heads, head_dim={view.head_dim}]")
    hq = q.shape[1]
    if q_heads is not None and hq != q_heads:
        raise InputError(f"q: shape {list(q.shape)} has {hq} query heads; expected {q_heads} (the plan's "
                         f"q_heads): [batch={batch}, {q_heads}, head_dim={view.head_dim}]")
    if hq % view.kv_heads or not 1 <= hq // view.kv_heads <= MAX_GROUP:
        raise InputError(f"q: {hq} query heads for {view.kv_heads} KV heads; need 1..{MAX_GROUP} query "
                         "heads per KV head")
    _check(q, "q", _dtype_name(q), (batch, hq, view.head_dim), device)
    return q, hq


# ----------------------------------------------------------------------------------------------
# The CUDA path: plan once, run per step.

# The default configuration, the fastest of those compared in docs/design/attention.md: two stages and at
# most 168 registers a thread, so that 12 one-warp blocks fit an SM (3 warps per scheduler: each
# scheduler has a quarter of the register file, 16384 registers), and the overlapped V decode.
DEFAULT_MAX_REGISTERS = 168
# Whole waves of shorter splits replace a partial last wave filled below this fraction (AttentionPlan).
WHOLE_WAVES_BELOW = 0.5


def kernel_options(head_dim: int, plain: bool, overlap: bool | None, max_registers: int | None):
    """``(overlap, max_registers)`` with :class:`AttentionPlan`'s defaults resolved: ``overlap=None`` is on
    for the compressed kernel with head_dim <= 128, ``max_registers=-1`` is
    :data:`DEFAULT_MAX_REGISTERS` for head_dim <= 128 and no cap above."""
    if overlap is None:
        overlap = not plain and head_dim <= 128
    if max_registers == -1:
        max_registers = DEFAULT_MAX_REGISTERS if head_dim <= 128 else None
    return overlap, max_registers


@dataclass
class SplitWork:
    """The split-KV work list of one decode step: what the attention kernel's grid walks.

    ``work`` int32 ``[n_work * 3]`` holds (sequence, first block, end block) per split; the splits of
    sequence ``b`` are ``split0[b] .. split0[b + 1]``; ``splits`` counts them per sequence."""

    blocks_per_split: int
    work: np.ndarray
    split0: np.ndarray
    splits: np.ndarray

    @property
    def n_work(self) -> int:
        return len(self.work) // 3


def wave_target(kernel, like, blocks_per_sm: int | None = None):
    """``(warps in one wave of the attention kernel, resources)``: as many one-warp blocks as the
    driver says fit an SM (registers, shared memory) times the SMs of ``like``'s device; 4 in the
    simulator (resources None)."""
    from .cuda import attention as K

    if K.SIMULATOR:
        return 4, None
    import torch

    from .cuda.launch import resident_blocks

    sms = torch.cuda.get_device_properties(like.device).multi_processor_count
    resources = dict(zip(("blocks_per_sm", "registers", "shared_bytes"),
                         resident_blocks(kernel, K.kernel_signature(), K.WARP)))
    return sms * max(1, blocks_per_sm or resources["blocks_per_sm"]), resources


def split_work(runs, batch: int, kv_heads: int, target: int | None, blocks_per_split: int | None = None,
               whole_waves: bool | None = None) -> SplitWork:
    """Cut ``runs`` ``(sequence, first block, end block)`` -- no split crosses a run's end -- into splits
    of at most ``blocks_per_split`` blocks; ``None`` chooses the fewest blocks per split whose splits
    (times ``kv_heads``) fit one wave of ``target`` warps (see :class:`AttentionPlan` for
    ``whole_waves``)."""
    from .cuda import attention as K

    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    run_len = runs[:, 2] - runs[:, 1]
    if blocks_per_split is None:
        # The fewest blocks per split that still fit one wave: each run rounds its splits up, so the
        # bare quotient can spill a few blocks into a second, almost empty wave.
        total = int(run_len.sum()) * kv_heads
        longest = kv_heads * int((-(-run_len // K.MAX_BLOCKS_PER_SPLIT)).sum())   # splits of the longest kind
        if longest > target:
            last = longest % target / target                            # fill of the partial last wave
            if whole_waves or (whole_waves is None and 0 < last < WHOLE_WAVES_BELOW):
                target *= -(-longest // target)
        blocks_per_split = max(1, -(-total // target))
        while (blocks_per_split < min(K.MAX_BLOCKS_PER_SPLIT, max(int(run_len.max(initial=1)), 1))
               and kv_heads * int((-(-run_len // blocks_per_split)).sum()) > target):
            blocks_per_split += 1
    bps = int(min(max(blocks_per_split, 1), K.MAX_BLOCKS_PER_SPLIT))
    per_run = -(-run_len // bps)
    first = np.repeat(runs[:, 1], per_run) + bps * (np.arange(int(per_run.sum())) -
                                                  np.repeat(np.cumsum(per_run) - per_run, per_run))
    work = np.stack([np.repeat(runs[:, 0], per_run), first, np.minimum(first + bps, np.repeat(runs[:, 2], per_run))],
                    axis=1).astype(np.int32).reshape(-1)
    splits = np.bincount(runs[:, 0], weights=per_run, minlength=batch).astype(np.int64)
    split0 = np.concatenate([[0], np.cumsum(splits)]).astype(np.int32)
    return SplitWork(blocks_per_split=bps, work=work, split0=split0, splits=splits)


# The attention kernel's arguments of one layer (gaac.cuda.attention.attention_kernel), by its argument names.
LAYER_ARRAYS = ("slots_k", "slots_v", "raw_k", "raw_v", "table_k", "table_v", "tail_k", "tail_v", "bases", "epoch_k",
                "epoch_v", "seq_lens")
LAYER_SCALARS = ("max_blocks", "kv_heads", "g", "slot_bytes_k", "slot_bytes_v", "cap_k", "cap_v", "epochs_k",
                 "epochs_v", "n_slots_k", "n_slots_v", "n_raw_k", "n_raw_v")


def layer_arguments(*, slots, raw, table, tails, bases, epoch, seq_lens, max_blocks: int, kv_heads: int, g: int,
                    slot_bytes, capacity, epochs, records, flat) -> dict:
    """The attention kernel's arguments of one layer, by name: its arrays (:data:`LAYER_ARRAYS`) flat as the
    kernel reads them, and its scalars (:data:`LAYER_SCALARS`).  The one builder of a layer's launch, for
    :class:`AttentionPlan` (from a :class:`LayerView`) and a cache's step plans
    (:func:`gaac.attention_launch.layer_launch`, from its storage).

    ``slots``, ``raw``, ``table``, ``tails``, ``epoch``, ``slot_bytes``, ``capacity`` and ``epochs`` (the
    epoch counts the kernel accepts) are (K, V) pairs; ``bases`` the pair-word table ``[2, E, Hkv, 3, D/2]``;
    ``records`` the pools' record counts (slots K, V, raw K, V); ``flat(x, dtype=None)`` views an array flat
    (as ``dtype``, where given)."""
    arrays = (flat(slots[0]), flat(slots[1]), flat(raw[0], "uint8"), flat(raw[1], "uint8"), flat(table[0]),
              flat(table[1]), flat(tails[0], "uint8"), flat(tails[1], "uint8"), flat(bases), flat(epoch[0]),
              flat(epoch[1]), flat(seq_lens))
    scalars = (max_blocks, kv_heads, g, *slot_bytes, *capacity, *epochs, *records)
    return {**dict(zip(LAYER_ARRAYS, arrays)), **dict(zip(LAYER_SCALARS, (int(x) for x in scalars)))}


def kernel_arguments(kernel, values: dict) -> tuple:
    """The positional arguments of ``kernel`` (a numba kernel) from ``values``, by its argument names."""
    from .cuda.launch import kernel_arg_names

    return tuple(values[name] for name in kernel_arg_names(kernel))


def attention_layout(kernel):
    """The :class:`gaac.cuda.launch.ParamLayout` of the attention kernel ``kernel`` (its signature, its names)."""
    from .cuda import attention as K
    from .cuda.launch import ParamLayout, kernel_arg_names

    return ParamLayout(K.kernel_signature(), kernel_arg_names(kernel))


class AttentionPlan:
    """Launch plan of decode attention for one LayerView shape and one set of sequence lengths.

    ``plan`` (the constructor) validates the view, copies ``seq_lens`` to the host once, chooses
    blocks per split so that one wave of one-warp thread blocks fills the GPU, and allocates the
    split partials.  :meth:`run` launches the attention kernel and the merge kernel; nothing in it
    synchronises with the host.  ``plain=True`` is the BF16 baseline (every tile raw, the same
    defaults).  Defaults:
    ``nstage=2`` (``nstage`` K+V staging areas in a ring; ``1``: one area per kind, refilled as soon as
    it is read, for 16 warps per SM with ``max_registers=128``: measured slower, see
    docs/design/attention.md), ``overlap`` and ``max_registers`` as :func:`kernel_options` resolves them.  The
    wave is sized by the driver's occupancy of the compiled kernel (``resources``); ``blocks_per_sm``
    overrides it, for experiments only (a wrong value costs a second wave, not correctness).
    Where one wave of splits of ``MAX_BLOCKS_PER_SPLIT`` blocks cannot hold the work (batch 8 at 32K),
    ``whole_waves=True`` plans whole waves of shorter splits, and ``False`` keeps the longest splits and
    a partial last wave.  The default (``None``) plans whole waves where that last wave would be less
    than half full: a last wave filled less than that leaves much of the memory bandwidth unused, while a
    fuller one already draws most of it, and the extra splits of whole waves each pay their prologue
    (docs/design/attention.md has the comparison).  ``pdl`` launches the
    merge kernel as a programmatic dependent of the split kernel, so that its launch and first loads
    overlap the split kernel's last blocks (the merge waits for that grid before reading the partials).
    """

    def __init__(self, view: LayerView, q_heads: int, *, scale: float | None = None, plain: bool = False,
                 nstage: int = 2, blocks_per_split: int | None = None, overlap: bool | None = None,
                 max_registers: int | None = -1, blocks_per_sm: int | None = None, whole_waves: bool | None = None,
                 pdl: bool = True):
        from .cuda import attention as K
        from .cuda import merge

        self._K = K
        device = None if K.SIMULATOR else "cuda"
        _check_view(view, device)
        self.view = view
        d, hk = view.head_dim, view.kv_heads
        if q_heads % hk or not 1 <= q_heads // hk <= MAX_GROUP:
            raise InputError(f"{q_heads} query heads for {hk} KV heads; need 1..{MAX_GROUP} per KV head")
        self.q_heads, self.g = q_heads, q_heads // hk
        self.scale = check_scale(scale, d)
        overlap, max_registers = kernel_options(d, plain, overlap, max_registers)
        self.plain = plain
        lens = check_seq_lens(view)
        mb = view.table[0].shape[1]
        self.batch = len(lens)
        nblk = -(-lens // L.BLOCK_TOKENS)
        c = L.tile_channels(d)
        geo = L.TileGeometry(c)
        self._sizes = (geo.slot_bytes(view.capacity[0]), geo.slot_bytes(view.capacity[1]))
        stage = K.tile_bytes(c) if plain else -(-max(self._sizes) // 16) * 16
        # Each sequence's blocks, one run: the kernel loads the bases of each block's epoch.
        runs = _epoch_runs(view, lens // L.BLOCK_TOKENS, nblk)
        self._kernel = K.attention_kernel(d, plain, nstage, 0 if plain else stage, overlap, max_registers)
        self.resources = None               # what the driver says of the kernel's occupancy (GPU, planned splits)
        if blocks_per_split is None:
            target, self.resources = wave_target(self._kernel, view.slots[0], blocks_per_sm)
        else:
            target = None
        split = split_work(runs, self.batch, hk, target, blocks_per_split, whole_waves)
        self.blocks_per_split, self.n_work = split.blocks_per_split, split.n_work
        work, split0, splits = split.work, split.split0, split.splits
        grid, threads, lanes = merge.merge_launch(self.batch, q_heads, d, int(splits.max(initial=0)))
        self._merge, self._merge_grid = merge.merge_kernel(d, lanes), (grid, threads)
        bases = _epoch_bases(view)
        self.n_epochs = (n_epochs(view, 0), n_epochs(view, 1))
        if K.SIMULATOR:
            alloc = lambda shape, dt: np.zeros(shape, dt)  # noqa: E731
            self._work, self._split0, self._bases = work, split0, bases
            flat = lambda x, dt=None: _host(x).reshape(-1) if dt is None else _host(x).view(dt).reshape(-1)  # noqa: E731
        else:
            import torch

            dev = view.slots[0].device
            alloc = lambda shape, dt: torch.empty(shape, dtype=getattr(torch, dt), device=dev)  # noqa: E731
            self._work = torch.from_numpy(work).to(dev)
            self._split0 = torch.from_numpy(split0).to(dev)
            self._bases = torch.from_numpy(bases).to(dev)
            flat = lambda x, dt=None: (x if dt is None else x.view(getattr(torch, dt))).reshape(-1)  # noqa: E731
        # Blocks without recorded epochs are epoch 0: one zero array serves both kinds.
        zeros = None
        eps = []
        for kind in range(2):
            e = block_epochs(view, kind)
            if e is None:
                if zeros is None:
                    zeros = alloc((self.batch, mb), "int16")
                    zeros[:] = 0
                e = zeros
            eps.append(e)
        self.o_part = alloc((self.n_work * hk * self.g * d,), "float32")
        self.lse_part = alloc((self.n_work * hk * self.g,), "float32")
        self.status = alloc((1,), "int32")
        self.status[0] = 0
        # The kernel reads entry 0 in place of an entry past its pool: an empty pool gets one zero record.
        pools = [p if p.shape[0] else _zero_record(p, alloc) for p in (*view.slots, *view.raw)]
        self._alloc = alloc
        self._scale_log2 = np.float32(self.scale * 1.4426950408889634)
        # Every argument but q, by name: the layer's, the split list and outputs, the scale, and the fused
        # merge's, off (the merge kernel merges the splits; group 0).
        self._values = layer_arguments(
            slots=pools[:2], raw=pools[2:], table=view.table, tails=(view.tail_k, view.tail_v), bases=self._bases,
            epoch=eps, seq_lens=view.seq_lens, max_blocks=mb, kv_heads=hk, g=self.g, slot_bytes=self._sizes,
            capacity=view.capacity, epochs=self.n_epochs, records=(p.shape[0] for p in (*view.slots, *view.raw)),
            flat=flat)
        self._values.update(work=flat(self._work), o_part=self.o_part, lse_part=self.lse_part, status=self.status,
                            scale_log2=self._scale_log2, mrg=alloc((1,), "int32"), out=alloc((1,), "int16"),
                            lse_out=alloc((1,), "float32"), merge_batch=0, group=0)
        if not K.SIMULATOR:
            from .cuda.launch import FastLaunch, ParamLayout, kernel_arg_names
            from .cuda.merge import merge_signature

            self._main = FastLaunch(self._kernel, (self.n_work, hk), K.WARP)
            self._pack_main()
            self._merge_launch = FastLaunch(self._merge, *self._merge_grid, pdl=pdl)
            # the merge's parameters, by name; a call writes the addresses of out and lse
            merge = ParamLayout(merge_signature(), kernel_arg_names(self._merge))
            self._merge_args = merge.packed(dict(o_part=self.o_part, lse_part=self.lse_part, split0=self._split0,
                                                 kv_heads=hk, g=self.g))
            for name, n in (("out", self.batch * q_heads * d), ("lse", self.batch * q_heads)):
                at, packed = merge.vector(name, n)
                self._merge_args[at:at + len(packed)] = packed
            self._merge_data = (merge.data_slot("out"), merge.data_slot("lse"))

    def _pack_main(self) -> None:
        """The split kernel's parameters, packed once by name (its arrays, outputs and scalars; ``q32`` a vector
        of the plan's shape whose address a call writes)."""
        layout = attention_layout(self._kernel)
        self._main_args = layout.packed({name: v for name, v in self._values.items()})
        at, packed = layout.vector("q32", self.batch * self.q_heads * self.view.head_dim // 2)
        self._main_args[at:at + len(packed)] = packed
        self._q_data = layout.data_slot("q32")

    def run(self, q, *, out=None, lse=None, return_lse: bool = False):
        """Attention output ``[B, Hq, D]``: torch bfloat16 on the GPU, int16 BF16 bits in the simulator.

        ``out`` (int16 ``[B, Hq, D]``) and ``lse`` (float32 ``[B, Hq]``) may be given to reuse buffers
        (and to capture the call in a CUDA graph)."""
        qb, hq = _check_q(q, self.view, None if self._K.SIMULATOR else "cuda", self.q_heads)
        d = self.view.head_dim
        out = self._alloc((self.batch, hq, d), "int16") if out is None else out
        lse = self._alloc((self.batch, hq), "float32") if lse is None else lse
        _check(out, "out", "int16", (self.batch, hq, d), None)
        _check(lse, "lse", "float32", (self.batch, hq), None)
        if self.n_work:                      # an empty sequence has no split; its output is 0, its LSE -inf
            self._launch_attention(qb)
        self._launch_merge(out, lse)
        if not self._K.SIMULATOR:
            import torch

            out = out.view(torch.bfloat16)
        return (out, lse) if return_lse else out

    def _launch_attention(self, qb) -> None:
        """The split kernel: partial outputs and log-sum-exps of every split."""
        K = self._K
        if K.SIMULATOR:
            q32 = _host(qb).view(np.int32).reshape(-1)
            self._kernel[(self.n_work, self.view.kv_heads), K.WARP](*kernel_arguments(self._kernel,
                                                                                     {**self._values, "q32": q32}))
            return
        import torch

        q32 = qb.view(torch.int16).view(torch.int32).reshape(-1)
        args = self._main_args
        args[self._q_data] = q32.data_ptr()
        self._main(kernel_arguments(self._kernel, {**self._values, "q32": q32}), lambda params: args)

    def _launch_merge(self, out, lse) -> None:
        """The merge kernel: splits -> BF16 output and natural-log LSE."""
        K = self._K
        hk = self.view.kv_heads
        if K.SIMULATOR:
            self._merge[self._merge_grid](
                self.o_part, self.lse_part, self._split0, out.reshape(-1), lse.reshape(-1), hk, self.g)
            return
        import torch

        o, l_ = out.view(torch.int16).reshape(-1), lse.reshape(-1)
        args = self._merge_args
        args[self._merge_data[0]], args[self._merge_data[1]] = o.data_ptr(), l_.data_ptr()
        self._merge_launch((self.o_part, self.lse_part, self._split0, o, l_, hk, self.g), lambda params: args)

    def check_status(self, *, layer: int | None = None, seqs=None) -> None:
        """Raise :class:`FormatError` if a kernel found a malformed slot, a block epoch without bases or a
        table entry past its pool, in any run since the plan was made (synchronises with the device).

        The kernels only flag these (their output is then unspecified; nothing outside the view's
        arrays is read); checking costs a device-to-host copy, so it is the caller's choice when to
        pay it.  ``layer`` and ``seqs`` name where the plan's view came from in the message
        (:func:`status_error`)."""
        error = status_error(int(self.status[0]), layer=layer, seqs=seqs)
        if error is not None:
            raise error


def _epoch_runs(view: LayerView, nfull: np.ndarray, nblk: np.ndarray) -> list:
    """``(sequence, 0, nblk)``: each sequence's blocks as one run (a sequence without blocks has none), once
    its finalized blocks' epochs are checked: epochs outside the view's bases raise :class:`InputError` (the
    kernel would only flag them).  Each kind's epoch table is copied to the host once."""
    tables = [(kind, _host(e).astype(np.int64)) for kind in range(2) if (e := block_epochs(view, kind)) is not None]
    for b in range(len(nblk)):
        for kind, table in tables:
            e = table[b, :nfull[b]]
            bad = np.flatnonzero((e < 0) | (e >= n_epochs(view, kind)))
            if bad.size:
                raise InputError(f"epoch[{'kv'[kind]}][{b}, {bad[0]}] = {e[bad[0]]}: the view holds bases for "
                                 f"epochs 0..{n_epochs(view, kind) - 1}")
    return [(b, 0, int(nblk[b])) for b in range(len(nblk)) if nblk[b] > 0]


def _host(x) -> np.ndarray:
    return x.detach().cpu().numpy() if _is_torch(x) else np.asarray(x)


def _zero_record(pool, alloc):
    """One zero record shaped like ``pool``'s, in its dtype and place (a stand-in for an empty pool)."""
    record = alloc((1, *pool.shape[1:]), _dtype_name(pool))
    record[:] = 0
    return record


# ----------------------------------------------------------------------------------------------
# The public entry point and the CPU path.

def check_outputs(q, out, lse, shape: tuple) -> None:
    """:class:`InputError` unless ``out`` and ``lse`` (each None, or a buffer to write) can receive the
    output ``[batch, q_heads, head_dim]`` (``shape``) and the LSE ``[batch, q_heads]`` of attention
    for ``q``: of ``q``'s kind (torch tensors on ``q``'s device, or NumPy arrays), ``out`` BF16 (torch
    bfloat16 or int16 bits; NumPy uint16 or int16 bits) and ``lse`` float32, of exactly those shapes,
    writable.  A buffer of another dtype would receive the bits of the wrong number format."""
    torch_q = _is_torch(q)
    for name, buf, dtypes, want in (("out", out, ("bfloat16", "int16") if torch_q else ("uint16", "int16"), shape),
                                    ("lse", lse, ("float32",), shape[:2])):
        if buf is None:
            continue
        if not (_is_torch(buf) if torch_q else isinstance(buf, np.ndarray)):
            raise InputError(f"{name}: expected a {'torch tensor' if torch_q else 'NumPy array'} (as q is) "
                             f"{' or '.join(dtypes)} {list(want)}, got {type(buf).__name__}")
        if _dtype_name(buf) not in dtypes or tuple(buf.shape) != tuple(want):
            raise InputError(f"{name}: expected {' or '.join(dtypes)} {list(want)}, got {_dtype_name(buf)} "
                             f"{list(buf.shape)}")
        if torch_q and buf.device != q.device:
            raise InputError(f"{name}: on {buf.device}, expected q's device {q.device}")
        if not torch_q and not buf.flags.writeable:
            raise InputError(f"{name}: a read-only array")


def decode_attention(q, view: LayerView, *, scale: float | None = None, return_lse: bool = False,
                     plain: bool = False, backend: str = "auto", q_heads: int | None = None, out=None, lse=None):
    """Attention of one new query token per sequence over the cache ``view`` (one layer).

    ``q`` BF16 ``[batch, q_heads, head_dim]`` (torch ``bfloat16``, or uint16 bits as NumPy);
    ``q_heads`` = g x ``view.kv_heads`` with g in 1..8.  Returns the BF16 output in ``q``'s
    kind (torch bfloat16 / uint16 bits) and, with ``return_lse``, the float32 natural-log
    log-sum-exp ``[batch, q_heads]``.  ``scale`` defaults to ``1/sqrt(head_dim)``.

    ``backend``: ``"auto"`` (CUDA when ``q`` is a CUDA tensor, else CPU), ``"cpu"`` or
    ``"cuda"`` (under ``NUMBA_ENABLE_CUDASIM=1`` the kernel runs in the simulator on host
    arrays).  ``plain=True`` runs the BF16 baseline kernel on a view of raw tiles only.
    For repeated calls build an :class:`AttentionPlan` once and call its ``run``.

    ``q_heads``: where given, the number of query heads ``q`` must have (a caller's plan).  ``out`` and
    ``lse``: buffers to write the output and the LSE into, which are then what is returned (``out``
    seen as ``q``'s kind); on the CPU path :func:`check_outputs` says what they may be, on the CUDA path
    :meth:`AttentionPlan.run`.

    Both paths check the view's arrays and ``seq_lens`` first (:class:`InputError`).  A corrupt
    slot, or a table entry past its pool, is a :class:`FormatError`: the CPU path finds it while
    decoding; on CUDA the kernel flags it in its status word and reads nothing outside the view,
    and this one-shot form synchronises and checks that word before it returns
    (:meth:`AttentionPlan.check_status`; a serving loop that reuses a plan chooses when to).
    """
    if backend not in ("auto", "cpu", "cuda"):
        raise InputError(f"backend {backend!r}: one of 'auto', 'cpu', 'cuda'")
    if backend == "auto":
        backend = "cuda" if _on_cuda(q) else "cpu"
    if backend == "cuda":
        _check_q(q, view, None, q_heads)
        plan = AttentionPlan(view, q.shape[1], scale=scale, plain=plain)
        result = plan.run(q, out=out, lse=lse, return_lse=return_lse)
        plan.check_status()
        return result
    _check_view(view, None)
    if _on_cuda(q):
        raise InputError("q is on a CUDA device; backend='cpu' takes host arrays")
    qb, hq = _check_q(q, view, "cpu", q_heads)
    check_outputs(q, out, lse, (qb.shape[0], hq, view.head_dim))
    scale = check_scale(scale, view.head_dim)
    check_seq_lens(view)
    dense = gather_dense(view)
    qf = bf16_to_float(_host(qb))
    ks = [bf16_to_float(x) for x in dense.k]
    vs = [bf16_to_float(x) for x in dense.v]
    result, lse_result = reference_attention(qf, ks, vs, scale, dtype=np.float32)
    res, lse_res = float_to_bf16(result), lse_result.astype(np.float32)
    if _is_torch(q):
        import torch

        res, lse_res = torch.from_numpy(res.view(np.int16)).view(torch.bfloat16), torch.from_numpy(lse_res)
        if out is not None:
            out.copy_(res.view(out.dtype))
            res = out.view(torch.bfloat16)
        if lse is not None:
            lse.copy_(lse_res)
            lse_res = lse
    else:
        if out is not None:
            np.copyto(out, res.view(out.dtype))
            res = out.view(np.uint16)
        if lse is not None:
            np.copyto(lse, lse_res)
            lse_res = lse
    return (res, lse_res) if return_lse else res
