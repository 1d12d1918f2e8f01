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

from gaac.cuda.launch import DATA_SLOT, ParamBuffer, packed_params, params, signature_of  # noqa: E402


def test_an_array_packs_as_numbas_array_model_lays_it_out():
    x = torch.arange(4 * 6 * 10, dtype=torch.int16).reshape(4, 6, 10)[:, 1:5, ::2]       # strided view
    fields = default_manager[types.Array(types.int16, 3, "A")]._fields
    assert fields == ("meminfo", "parent", "nitems", "itemsize", "data", "shape", "strides")
    packed = params(x)
    assert len(packed) == 5 + 2 * x.dim()
    assert packed[:5] == [0, 0, x.numel(), 2, x.data_ptr()]
    assert packed[fields.index("data")] == packed[DATA_SLOT] == x.data_ptr()
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
