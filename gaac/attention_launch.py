"""What the attention kernel reads of one layer of a paged cache, packed once: the kernel, the layer's arrays
and scalars, and (GPU) a parameter buffer in which a step plan writes its own part and a call its tensors'
addresses.  Step plans (:mod:`gaac.serving.plan`) and captured steps (:mod:`gaac.serving.graph`) launch through it."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import layout as L
from .attention import kernel_options

STEP_PARAMS = ("work", "o_part", "lse_part")      # the plan's arrays in the attention kernel's parameters
MERGE_PARAMS = 3 * 7 + 2   # the kernel's fused-merge parameters: mrg, out, lse (7 slots each), batch, group


def c_float(x):
    """``x`` as a packed float32 kernel parameter."""
    return ctypes.c_float(x)


@dataclass
class _LayerLaunch:
    """What the attention kernel reads of one layer, packed once (kept by the cache per layer)."""

    kernel: object
    arrays: tuple                 # the kernel's per-layer array arguments, flat
    scalars: tuple                # max_blocks, kv_heads, g, slot bytes, capacities, epochs, slot and raw records
    main: object = None           # FastLaunch of the kernel (GPU)
    fixed: list = None            # packed parameters of ``arrays`` (GPU)
    fixed_scalars: list = None    # packed parameters of ``scalars`` (GPU)
    buffer: object = None         # the launch's ParamBuffer (GPU)
    scale_at: int = 0             # the buffer's slot of the scale; the fused merge's parameters follow it
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
    flat = [store_k.slots.data, store_v.slots.data, store_k.raw.data.view(torch.uint8),
            store_v.raw.data.view(torch.uint8), store_k.table, store_v.table, store_k.tail.view(torch.uint8),
            store_v.tail.view(torch.uint8), bases, eps[0], eps[1], cache.device_lengths[layer]]
    flat = tuple(x.reshape(-1) for x in flat)
    scalars = (cache.max_blocks, hk, g, *sizes, store_k.capacity, store_v.capacity, room, room,
               store_k.slots.data.shape[0], store_v.slots.data.shape[0],
               store_k.raw.data.shape[0], store_v.raw.data.shape[0])
    state = _LayerLaunch(kernel=kernel, arrays=flat, scalars=tuple(int(s) for s in scalars))
    if not K.SIMULATOR:
        from .cuda.launch import DATA_SLOT, FastLaunch, ParamBuffer, packed_params

        state.main = FastLaunch(kernel, None, K.WARP)
        state.main.prepare(K.kernel_signature())
        state.fixed = packed_params(flat)
        state.fixed_scalars = packed_params(state.scalars)
        # q, the layer's arrays, the plan's work list and partials, the status word, scalars, the scale:
        # a plan writes its part once per layer (StepPlan._launch), a call writes q's address.
        state.buffer = ParamBuffer([0] * 7 + state.fixed + [0] * (len(STEP_PARAMS) * 7 + 7) + state.fixed_scalars
                                   + [c_float(0.0)] + [0] * MERGE_PARAMS)
        state.scale_at = len(state.buffer) - MERGE_PARAMS - 1
        state.out_slots = (state.scale_at + 1 + 7 + DATA_SLOT, state.scale_at + 1 + 14 + DATA_SLOT)  # after mrg
    state.bases = bases            # kept alive with the state
    states[key] = state
    return state
