"""``gaac.arrays.stacked_view``: equal tensors at equal distances in one storage seen as one view with a leading
axis (a prefill's layers, the tails and epoch indices a cache lays out in one allocation), and None for anything
else, so that a caller falls back to a copy rather than reading memory the tensors do not hold."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gaac.arrays import stacked_view


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), gap=st.integers(0, 40), rows=st.integers(1, 4), cols=st.integers(1, 5),
       lead=st.integers(0, 7), transposed=st.booleans())
def test_views_at_equal_distances_are_seen_as_one(n, gap, rows, cols, lead, transposed):
    """Views of one buffer at a fixed distance give a view whose items are the tensors (written through it, the
    buffer changes); anything but a fixed positive distance gives None."""
    size = rows * cols
    step = size + gap
    buf = torch.arange(lead + n * step + 3, dtype=torch.int32)
    parts = [buf[lead + i * step:lead + i * step + size].view(rows, cols) for i in range(n)]
    if transposed:
        parts = [p.t() for p in parts]
    view = stacked_view(parts)
    assert view is not None and view.shape == (n, *parts[0].shape)
    for i, p in enumerate(parts):
        assert torch.equal(view[i], p)
    view.add_(1000)
    assert all(int(p.min()) >= 1000 for p in parts)
    if n > 2:
        shuffled = [parts[1], parts[0], *parts[2:]]
        assert stacked_view(shuffled) is None
        uneven = parts[:2] + [buf[lead + 2 * step + 1:lead + 2 * step + 1 + size].view(rows, cols)]
        if transposed:
            uneven[2] = uneven[2].t()
        assert stacked_view(uneven) is None


def test_separate_allocations_shapes_strides_and_dtypes_are_not_one_view():
    # two allocations, the second at the higher address (whatever the distance, they are two storages)
    a, b = sorted((torch.zeros(8, dtype=torch.int16), torch.zeros(8, dtype=torch.int16)), key=lambda t: t.data_ptr())
    assert stacked_view([a, b]) is None
    buf = torch.zeros(64, dtype=torch.int16)
    assert stacked_view([buf[0:8], buf[16:24].view(2, 4)]) is None            # shapes differ
    assert stacked_view([buf[0:8:2], buf[16:20]]) is None                       # strides differ
    assert stacked_view([buf[0:8], buf[16:24].view(torch.uint16)]) is None      # dtypes differ
    whole = torch.zeros(40, dtype=torch.int16)
    assert stacked_view([whole[0:8], whole[32:40]]) is not None
    # the last tensor's end past the first one's storage: a view of its allocation would run off it
    first = whole[24:40]
    after = sorted((first, torch.zeros(16, dtype=torch.int16)), key=lambda t: t.data_ptr())
    assert stacked_view(after) is None


@pytest.mark.parametrize("n", [1, 2, 5])
def test_one_tensor_and_many_of_an_allocation_the_cache_makes(n):
    """Rows of one allocation, as a cache's tails are: the view is the allocation's."""
    whole = torch.randint(-5, 5, (n, 3, 16, 8), dtype=torch.int16)
    view = stacked_view([whole[i] for i in range(n)])
    assert view is not None and torch.equal(view, whole)
    assert view.data_ptr() == whole.data_ptr()
