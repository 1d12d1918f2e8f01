"""Transfers on a real GPU: the piecewise copies of gaac.transfer (a copy stream, events, one wait per transfer).

Runs only with a CUDA device and ``NUMBA_ENABLE_CUDASIM=0`` (the CPU path is tests/test_transfer.py):

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -q tests/test_transfer_gpu.py

Pieces of one chunk make a small body move in several pieces.  A container exported on the CPU (the reference
codec) enters a GPU cache and leaves it as the same bytes, from the default stream and from another one; a
corrupt chunk in a later piece or in the partial last chunk is refused after earlier pieces were scattered, and
leaves the cache as it was; the sequence reads back bit for bit.
"""
import os

import numpy as np
import pytest
import torch

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device and NUMBA_ENABLE_CUDASIM=0", allow_module_level=True)

from conftest import every_tile  # noqa: E402
from test_transfer import assert_unchanged, drifting, mutate, snapshot  # noqa: E402

from gaac import layout as L  # noqa: E402
from gaac import transfer  # noqa: E402
from gaac.cache import transfer as cache_transfer  # noqa: E402
from gaac.cache import PagedKVCache  # noqa: E402
from gaac.calibration import calibrate  # noqa: E402
from gaac.errors import FormatError  # noqa: E402


def test_gpu_transfers_in_pieces_keep_the_bytes(monkeypatch):
    monkeypatch.setattr(cache_transfer, "PIECE_BYTES", L.SEQUENCE_CHUNK_BYTES)
    rng = np.random.default_rng(5)
    k, v = drifting(rng, 2, 8, 1100, 128, 0.0), drifting(rng, 2, 8, 1100, 128, 0.0)
    cal = calibrate(k, v)
    cpu = PagedKVCache(cal, **every_tile(cal, 1, 70))          # synthetic content: room for every tile raw
    data = bytes(cpu.export_sequence(cpu.add_sequence(k, v)))
    lay = transfer.read_head(data).layout
    ends = cache_transfer._piece_ends(lay)
    assert len(ends) >= 3 and lay.body_bytes % L.SEQUENCE_CHUNK_BYTES
    gpu = PagedKVCache(cal, **every_tile(cal, 3, 70), device="cuda")
    first = gpu.import_sequence(data)
    assert bytes(gpu.export_sequence(first)) == data
    out = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert bytes(gpu.export_sequence(first, out=out)) == data
    before = snapshot(gpu)
    for at, chunk in ((ends[1] + 17, ends[1] // L.SEQUENCE_CHUNK_BYTES), (lay.body_bytes - 1, lay.chunks - 1)):
        with pytest.raises(FormatError, match=f"chunk {chunk} of the body"):
            flipped = bytes([data[lay.body_offset + at] ^ 1])
            gpu.import_sequence(mutate(data, lay.body_offset + at, flipped, fix_crcs=False))
        assert_unchanged(gpu, before)
    with torch.cuda.stream(side):
        second = gpu.import_sequence(torch.frombuffer(bytearray(data), dtype=torch.uint8))   # pageable memory
    torch.cuda.synchronize()
    got_k, got_v = gpu.read(second)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    for layer in gpu._store:                                         # each record holds one sequence's tile
        for st in layer:
            a, b = (set(st.table[s, :lay.blocks].reshape(-1).tolist()) for s in (first, second))
            assert not a & b
    assert bytes(gpu.export_sequence(second)) == data
