"""The hand-packed kernel parameters of gaac.cuda.launch: the layout numba's own launch uses, checked on the CPU.

The GPU launches (decode steps, the adaptation rule's kernels) pass these parameters straight to the driver;
a slot out of place would launch with garbage, so the layout is checked against numba's array data model.
"""
import ctypes

import numpy as np
import pytest
import torch

pytest.importorskip("numba")
from numba import types  # noqa: E402
from numba.core.datamodel import default_manager  # noqa: E402

from gaac.cuda.launch import (ARRAY_FIELDS, ParamBuffer, ParamLayout, kernel_arg_names, packed_params,  # noqa: E402
                              params, signature_of)


def test_an_array_packs_as_numbas_array_model_lays_it_out():
    x = torch.arange(4 * 6 * 10, dtype=torch.int16).reshape(4, 6, 10)[:, 1:5, ::2]       # strided view
    fields = default_manager[types.Array(types.int16, 3, "A")]._fields
    assert fields == ("meminfo", "parent", "nitems", "itemsize", "data", "shape", "strides")
    packed = params(x)
    assert len(packed) == 5 + 2 * x.dim()
    assert packed[:5] == [0, 0, x.numel(), 2, x.data_ptr()]
    assert ARRAY_FIELDS == fields[:len(ARRAY_FIELDS)]
    assert packed[fields.index("data")] == packed[ARRAY_FIELDS.index("data")] == x.data_ptr()
    assert packed[5:8] == list(x.shape)
    assert packed[8:] == [s * 2 for s in x.stride()]                  # bytes, as numba's strides are
    assert isinstance(params(7)[0], ctypes.c_int64) and params(7)[0].value == 7


def test_signatures_type_contiguous_tensors_c_and_any_other_a():
    c = torch.zeros((3, 4), dtype=torch.int32)
    a = torch.zeros((4, 6), dtype=torch.int16)[:, ::2]
    sig = signature_of((c, a, 5, np.int64(2), torch.zeros(3, dtype=torch.uint8)))
    assert sig == (types.Array(types.int32, 2, "C"), types.Array(types.int16, 2, "A"), types.int64, types.int64,
                   types.Array(types.uint8, 1, "C"))


def test_packed_parameters_take_numpy_integers_as_int64_and_a_buffer_keeps_them():
    x = torch.zeros(8, dtype=torch.int32)
    packed = packed_params((x, np.int64(3), 4))
    assert [p.value for p in packed[-2:]] == [3, 4]
    buf = ParamBuffer(packed + [ctypes.c_float(1.5)])
    assert len(buf) == len(packed) + 1
    assert list(buf.slots[:7]) == [0, 0, 8, 4, x.data_ptr(), 8, 4]
    assert list(buf.slots[7:9]) == [3, 4]
    assert ctypes.c_float.from_address(ctypes.addressof(buf.slots) + 8 * 9).value == 1.5
    # every pointer names its own slot: what the driver reads
    assert [buf.pointers[i] for i in range(len(buf))] == [ctypes.addressof(buf.slots) + 8 * i for i in range(len(buf))]
    buf.write(4, [123])
    assert buf.slots[4] == 123


# -- buffers by argument name: the byte layout of the hand-counted buffers they replace ------------------------------

DATA = 4       # the data pointer's slot among an array's parameters, as the hand-counted buffers wrote it


def _same(buf: ParamBuffer, packed: list) -> None:
    """``buf`` holds exactly what ``ParamBuffer(packed)`` holds, slot for slot, floats in the same slots."""
    old = ParamBuffer(packed)
    assert len(buf) == len(old)
    assert list(buf.slots) == list(old.slots)
    assert buf._floats == old._floats


def _t(*shape, dtype=torch.int32):
    return torch.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)


def test_the_attention_kernels_layer_buffer_is_the_hand_counted_one():
    """A step plan's layer buffer (gaac.attention_launch.layer_launch) built by name against the layout it was
    counted by hand with: q (7 slots), the layer's 12 arrays, work, o_part, lse_part, status (7 each), 13
    scalars, the scale, mrg, out, lse (7 each), batch, group; and the slots a call writes."""
    from gaac import attention as A
    from gaac.cuda import attention as K

    from gaac import layout as L

    stage = -(-L.TileGeometry(64).slot_bytes(6) // 16) * 16
    kernel = K.attention_kernel(64, False, 2, stage, False, None, fused_merge=True)
    layout = A.attention_layout(kernel)
    flat = lambda x, dt=None: (x if dt is None else x.view(getattr(torch, dt))).reshape(-1)  # noqa: E731
    slots, raw = (_t(9, 40, dtype=torch.uint8), _t(5, 40, dtype=torch.uint8)), (_t(6, 16, 64, dtype=torch.int16),) * 2
    table, tails = (_t(2, 3, 4), _t(2, 3, 4)), (_t(2, 4, 16, 64, dtype=torch.int16),) * 2
    bases, eps, lens = _t(2, 16, 4, 3, 32), (_t(2, 3, dtype=torch.int16),) * 2, _t(2)
    values = A.layer_arguments(slots=slots, raw=raw, table=table, tails=tails, bases=bases, epoch=eps, seq_lens=lens,
                               max_blocks=3, kv_heads=4, g=2, slot_bytes=(40, 40), capacity=(5, 6), epochs=(16, 16),
                               records=(9, 5, 6, 6), flat=flat)
    buf = layout.buffer(values)
    fixed = packed_params([slots[0].reshape(-1), slots[1].reshape(-1), raw[0].view(torch.uint8).reshape(-1),
                           raw[1].view(torch.uint8).reshape(-1), table[0].reshape(-1), table[1].reshape(-1),
                           tails[0].view(torch.uint8).reshape(-1), tails[1].view(torch.uint8).reshape(-1),
                           bases.reshape(-1), eps[0].reshape(-1), eps[1].reshape(-1), lens.reshape(-1)])
    scalars = packed_params((3, 4, 2, 40, 40, 5, 6, 16, 16, 9, 5, 6, 6))
    merge_params = 3 * 7 + 2
    _same(buf, [0] * 7 + fixed + [0] * (3 * 7 + 7) + scalars + [ctypes.c_float(0.0)] + [0] * merge_params)
    scale_at = len(buf) - merge_params - 1
    assert layout.slot("scale_log2") == scale_at and layout.data_slot("q32") == DATA
    assert (layout.data_slot("out"), layout.data_slot("lse_out")) == (scale_at + 1 + 7 + DATA, scale_at + 1 + 14 + DATA)
    # what a plan writes once per layer, by name, against the hand-counted writes
    work, o_part, lse_part, status, mrg = _t(9), _t(8, dtype=torch.float32), _t(4, dtype=torch.float32), _t(3), _t(5)
    for at, packed in [layout.vector("q32", 256), layout.pack("work", work), layout.pack("o_part", o_part),
                       layout.pack("lse_part", lse_part), layout.vector("status", 1, status.data_ptr() + 8),
                       layout.pack("scale_log2", np.float32(0.25)), layout.pack("mrg", mrg),
                       layout.vector("out", 512), layout.vector("lse_out", 8), layout.pack("merge_batch", 2),
                       layout.pack("group", 8)]:
        buf.write(at, packed)
    old = ParamBuffer([0] * 7 + fixed + [0] * (3 * 7 + 7) + scalars + [ctypes.c_float(0.0)] + [0] * merge_params)
    old.write(0, [0, 0, 256, 4, 0, 256, 4])
    old.write(7 + len(fixed), packed_params((work, o_part, lse_part)) + [0, 0, 1, 4, status.data_ptr() + 8, 1, 4])
    old.write(scale_at, [ctypes.c_float(np.float32(0.25))] + packed_params((mrg,)) + [0, 0, 512, 2, 0, 512, 2]
              + [0, 0, 8, 4, 0, 8, 4] + [2, 8])
    assert list(buf.slots) == list(old.slots)
    # AttentionPlan's list for a launch through cuda.core: the same parameters, of the same ctypes kinds, as the
    # list it packed by hand (q's, the arrays', the outputs', the scalars, the scale, the fused merge's off)
    q32, out, lse = _t(256), _t(1, dtype=torch.int16), _t(1, dtype=torch.float32)
    got = layout.packed({**values, "q32": q32, "work": work, "o_part": o_part, "lse_part": lse_part,
                         "status": status, "scale_log2": np.float32(0.25), "mrg": mrg, "out": out, "lse_out": lse,
                         "merge_batch": 0, "group": 0})
    hand = (params(q32) + fixed + packed_params((work, o_part, lse_part, status)) + scalars
            + [ctypes.c_float(np.float32(0.25))] + packed_params((mrg, out, lse, 0, 0)))
    kind = lambda p: (type(p), p.value if isinstance(p, (ctypes.c_int64, ctypes.c_float)) else p)  # noqa: E731
    assert [kind(p) for p in got] == [kind(p) for p in hand]


def test_the_one_token_append_buffer_is_the_hand_counted_one():
    from gaac.serving.append import append_buffer

    tail_k, tail_v, lens = _t(3, 4, 16, 64, dtype=torch.int16), _t(3, 4, 16, 64, dtype=torch.int16), _t(2, 3)
    buf, (k_data, v_data, k_items) = append_buffer(tail_k, tail_v, lens[1], 4, 64)
    arrays = [x for a in (tail_k.reshape(-1), tail_v.reshape(-1)) for x in params(a)]
    hand = [0] * 14 + arrays + [0] * 21 + params(lens[1]) + params(4) + params(64)
    _same(buf, hand)
    assert (k_data, v_data, k_items) == (DATA, 7 + DATA, 2)
    index, m = _t(3, 2), 2 * 4 * 64
    buf.set_vector("k", m)
    buf.set_vector("v", m)
    for name, row in zip(("rows", "rpos", "lens_after"), index):
        buf.set(name, row)
    old = ParamBuffer(hand)
    old.write(0, [0, 0, m, 2, 0, m, 2] * 2)
    old.write(28, [x for i in range(3) for x in params(index[i])])
    assert list(buf.slots) == list(old.slots)


def test_the_step_append_and_merge_buffers_are_the_hand_packed_ones():
    from gaac.cuda import codec, merge

    kernel = codec.step_append_kernel(64)
    names = kernel_arg_names(kernel)
    layout = ParamLayout(codec.STEP_APPEND_SIG, names)
    args = []
    for name in names:                       # an argument of each argument's type
        t = layout.types[name]
        if hasattr(t, "ndim"):
            dtype = getattr(torch, str(t.dtype).replace("uint", "int"))
            args.append(_t(*(3,) * t.ndim, dtype=dtype))
        else:
            args.append(7)
    buf = ParamBuffer.for_signature(codec.STEP_APPEND_SIG, names, dict(zip(names, args)))
    packed = [params(a) for a in args]
    _same(buf, [x for p in packed for x in p])
    assert (buf.layout.data_slot("new_k"), buf.layout.data_slot("new_v")) == (DATA, len(packed[0]) + DATA)

    k = merge.merge_kernel(64, 4)
    o_part, lse_part, split0 = _t(8, dtype=torch.float32), _t(4, dtype=torch.float32), _t(3)
    buf = ParamBuffer.for_signature(merge.merge_signature(), kernel_arg_names(k),
                                    dict(o_part=o_part, lse_part=lse_part, split0=split0, kv_heads=4, g=2))
    buf.set_vector("out", 512)
    buf.set_vector("lse", 8)
    partials = packed_params((o_part, lse_part, split0))
    _same(buf, partials + [0, 0, 512, 2, 0, 512, 2] + [0, 0, 8, 4, 0, 8, 4] + params(4) + params(2))
    out_at = len(partials)
    assert (buf.layout.data_slot("out"), buf.layout.data_slot("lse")) == (out_at + DATA, out_at + 7 + DATA)


def test_a_value_that_does_not_fit_its_argument_is_refused():
    from gaac.cuda import merge

    layout = ParamLayout(merge.merge_signature(), kernel_arg_names(merge.merge_kernel(64, 4)))
    with pytest.raises(ValueError, match="split0: 9 packed parameters for an argument of 7 slots"):
        layout.pack("split0", _t(2, 3))                    # a 2-D array for a 1-D argument
    with pytest.raises(KeyError):
        layout.pack("no_such_argument", 1)
    with pytest.raises(ValueError, match="argument names for a signature"):
        ParamLayout(merge.merge_signature(), ("o_part",))


def test_a_layout_is_one_per_signature_and_copies_as_itself():
    import copy
    import pickle

    from gaac.cuda import merge

    layout = ParamLayout(merge.merge_signature(), kernel_arg_names(merge.merge_kernel(64, 4)))
    assert ParamLayout(merge.merge_signature(), layout.names) is layout
    assert copy.deepcopy(layout) is layout and pickle.loads(pickle.dumps(layout)) is layout
    buf = layout.buffer({"kv_heads": 3})
    assert buf.layout is layout and buf.slots[layout.slot("kv_heads")] == 3
