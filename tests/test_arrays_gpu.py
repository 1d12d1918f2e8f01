"""Uploads through the pinned staging memory (gaac.arrays.Staging) on a real GPU.

Runs only with a CUDA device and ``NUMBA_ENABLE_CUDASIM=0`` (on the CPU an upload is the array itself):

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -q tests/test_arrays_gpu.py

Hundreds of uploads of every dtype the cache uploads, small and larger than a chunk, are launched behind queued
kernels (so that their copies have not run when the next upload takes staging memory), on the default stream
and on another; the host arrays are overwritten right after each call; every tensor on the device must hold
what its array held at the call.  The staging keeps at most its chunk limit.
"""
import os

import numpy as np
import pytest
import torch

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device and NUMBA_ENABLE_CUDASIM=0", allow_module_level=True)

from gaac import arrays  # noqa: E402

DTYPES = (np.int16, np.int32, np.int64, np.uint8, np.bool_)


def _busy(x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        x.mul_(1.0001)


@pytest.mark.parametrize("side_stream", [False, True])
def test_uploads_behind_queued_work_hold_their_arrays(side_stream):
    dev = torch.device("cuda")
    rng = np.random.default_rng(7)
    x = torch.ones(1 << 24, device=dev)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    sizes = [1, 3, 100, 4097, 70_000, (arrays.Staging.CHUNK // 2) + 5, arrays.Staging.CHUNK + 3]
    expected, got = [], []
    with torch.cuda.stream(stream):
        for i in range(300):
            if i % 25 == 0:
                _busy(x, 20)                # the next uploads' copies queue behind these kernels
            dtype = DTYPES[i % len(DTYPES)]
            n = sizes[i % len(sizes)] // np.dtype(dtype).itemsize or 1
            shape = (n,) if i % 3 else (1, n)
            a = rng.integers(0, 2 if dtype is np.bool_ else 100, shape).astype(dtype)
            if i % 4 == 0:
                a = np.asfortranarray(np.stack([a, a]))[..., ::1]      # not C-contiguous
            expected.append(a.copy())
            got.append(arrays.upload(a, dev))
            a[...] = 0                      # the array may change as soon as the call returns
    torch.cuda.synchronize()
    for i, (want, out) in enumerate(zip(expected, got)):
        assert out.device.type == "cuda" and tuple(out.shape) == want.shape, i
        assert np.array_equal(out.cpu().numpy(), want), f"upload {i} ({want.dtype}, {want.shape}) differs"
    assert len(arrays.Staging.of(dev).chunks) <= arrays.Staging.MAX_CHUNKS


def test_an_upload_takes_no_new_pinned_memory_once_its_chunk_is_free():
    dev = torch.device("cuda")
    staging = arrays.Staging.of(dev)
    arrays.upload(np.arange(10, dtype=np.int32), dev)
    torch.cuda.synchronize()
    chunks = sorted(id(c[0]) for c in staging.chunks)
    for i in range(200):
        out = arrays.upload(np.full(5000, i, dtype=np.int32), dev)
        torch.cuda.synchronize()
        assert int(out[0]) == i and int(out[-1]) == i
    assert sorted(id(c[0]) for c in staging.chunks) == chunks
