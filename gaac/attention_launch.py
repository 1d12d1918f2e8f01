"""What the attention kernel reads of one layer of a paged cache, packed once: the kernel, the layer's arguments
by name, and (GPU) a parameter buffer in which a step plan writes its own part and a call its tensors'
addresses.  Step plans (:mod:`gaac.serving.plan`) and captured steps (:mod:`gaac.serving.graph`) launch through it;
the layer's arguments come from the one builder :class:`gaac.attention.AttentionPlan` uses too
(:func:`gaac.attention.layer_arguments`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import layout as L
from .attention import attention_layout, kernel_options, layer_arguments


@dataclass
class _LayerLaunch:
    """What the attention kernel reads of one layer, packed once (kept in the cache's serving state per layer)."""

    kernel: object
    values: dict                  # the kernel's per-layer arguments by name (gaac.attention.layer_arguments)
    layout: object = None         # the kernel's ParamLayout (GPU)
    main: object = None           # FastLaunch of the kernel (GPU)
    buffer: object = None         # the launch's ParamBuffer, the layer's arguments packed in (GPU)
    q_slot: int = 0               # the buffer's slot of q's data pointer (a call writes it)
    out_slots: tuple = ()         # the buffer's slots of the data pointers of the fused merge's out and lse


def layer_launch(cache, layer: int, g: int, fused: bool = False) -> _LayerLaunch:
    """The attention kernel's per-layer state for ``g`` query heads per KV head (``fused``: the kernel with
    the fused merge), made once per layer and storage version and kept in the cache's serving state (which
    drops it when the layer's arrays change)."""
    key = (layer, g, fused)
    states = cache.serving.layer_launch
    state = states.get(key)
    if state is not None:
        return state
    from .cuda import attention as K

    store_k, store_v = cache.stores(layer)
    d = cache.head_dim
    geo = L.TileGeometry(L.tile_channels(d))
    sizes = (geo.slot_bytes(store_k.capacity), geo.slot_bytes(store_v.capacity))
    overlap, max_registers = kernel_options(d, False, None, -1)
    kernel = K.attention_kernel(d, False, 2, -(-max(sizes) // 16) * 16, overlap, max_registers, fused_merge=fused)
    # Every epoch's bases, in a table that keeps its place while epochs are appended (the kernel loads
    # each block's own); its room bounds the epochs the kernel accepts.
    bases = cache.epoch_table(layer)
    room = bases.shape[1]
    hk = cache.kv_heads
    eps = [s.epoch if s.epoch is not None else None for s in (store_k, store_v)]
    if eps[0] is None:
        zeros = torch.zeros((cache.max_seqs, cache.max_blocks), dtype=torch.int16, device=cache.device)
        eps = [zeros, zeros]
    values = layer_arguments(
        slots=(store_k.slots.data, store_v.slots.data), raw=(store_k.raw.data, store_v.raw.data),
        table=(store_k.table, store_v.table), tails=(store_k.tail, store_v.tail), bases=bases, epoch=eps,
        seq_lens=cache.device_lengths[layer], max_blocks=cache.max_blocks, kv_heads=hk, g=g, slot_bytes=sizes,
        capacity=(store_k.capacity, store_v.capacity), epochs=(room, room),
        records=(store_k.slots.data.shape[0], store_v.slots.data.shape[0], store_k.raw.data.shape[0],
                 store_v.raw.data.shape[0]),
        flat=lambda x, dt=None: (x if dt is None else x.view(getattr(torch, dt))).reshape(-1))
    state = _LayerLaunch(kernel=kernel, values=values)
    if not K.SIMULATOR:
        from .cuda.launch import FastLaunch

        state.main = FastLaunch(kernel, None, K.WARP)
        state.main.prepare(K.kernel_signature())
        # The layer's arguments by name, the rest zero: a plan writes its part (q's shape, the work list and
        # partials, the status word, the scale, the fused merge's) once per layer (StepPlan._launch), a call
        # writes q's address (and the fused merge's out and lse).
        state.layout = attention_layout(kernel)
        state.buffer = state.layout.buffer(values)
        state.q_slot = state.layout.data_slot("q32")
        state.out_slots = (state.layout.data_slot("out"), state.layout.data_slot("lse_out"))
    state.bases = bases            # kept alive with the state
    states[key] = state
    return state
