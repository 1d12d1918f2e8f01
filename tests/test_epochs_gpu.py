"""The adaptation rule on a real GPU (:mod:`gaac.cuda.epochs`) decides exactly what the host rule decides.

Runs only with a CUDA device and ``NUMBA_ENABLE_CUDASIM=0`` (the simulator's version, on small shapes, is
tests/test_epochs_device.py):

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -q tests/test_epochs_gpu.py
"""
import copy
import os

import numpy as np
import pytest
import torch

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device and NUMBA_ENABLE_CUDASIM=0", allow_module_level=True)

from test_cache import B, assert_same_epochs, drifting, synthetic  # noqa: E402
from test_epochs_device import _same_adapter  # noqa: E402

import gaac.epochs as epochs  # noqa: E402
from gaac.cache import PagedKVCache  # noqa: E402
from gaac.calibration import calibrate  # noqa: E402
from gaac.cuda import epochs as device_epochs  # noqa: E402
from gaac.tiles import cache_blocks  # noqa: E402


def _at_offset(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """``blocks`` on the GPU, ``offset`` int16 elements into a larger buffer (1: no run of 8 channels is
    16-byte aligned)."""
    flat = torch.zeros(blocks.size + offset, dtype=torch.int16, device="cuda")
    flat[offset:] = torch.from_numpy(blocks.view(np.int16).reshape(-1)).cuda()
    return flat[offset:].view(blocks.shape)


@pytest.mark.parametrize("every, payback, cap, offset",
                         [(8, 6, 256, 0), (4, 10 ** 9, 256, 0), (8, 10 ** 9, 3, 0), (8, 10 ** 9, 256, 1)])
def test_the_device_rule_decides_what_the_host_rule_decides(monkeypatch, every, payback, cap, offset):
    monkeypatch.setattr(epochs, "ADAPT_EVERY", every)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", payback)
    monkeypatch.setattr(epochs, "MAX_EPOCHS", cap)
    rng = np.random.default_rng(every + cap)
    layers, heads, dim, tokens = 3, 8, 128, 300 * B
    k = drifting(rng, layers, heads, tokens, dim, 12.0)
    v = synthetic(rng, layers, heads, tokens, dim)
    cal = calibrate(k[:, :, :256], v[:, :, :256])
    jobs, want = [], []
    for layer in range(layers):
        for kind, x in ((0, k), (1, v)):
            blocks = cache_blocks(x[layer])
            adapter = epochs.Adapter(cal.copy(), layer, kind)
            adapter.assign(blocks[:every * 7 + layer])           # 0, 1 or 2 blocks pending, by layer
            reference = copy.deepcopy(adapter)
            want.append((reference, reference.assign(blocks[every * 7 + 2:])))
            jobs.append((adapter, _at_offset(blocks[every * 7 + 2:], offset)))
    got = device_epochs.assign(jobs)
    appended = 0
    for (adapter, _), e, (reference, e_want) in zip(jobs, got, want):
        assert np.array_equal(e, e_want)
        _same_adapter(adapter, reference)
        appended += adapter.epoch
    assert appended >= 3


def test_a_gpu_prefill_matches_the_reference_cache():
    rng = np.random.default_rng(3)
    layers, heads, dim = 2, 8, 128
    n = [500 * B + 5, 130 * B + 9]
    k = [drifting(rng, layers, heads, t, dim, 12.0) for t in n]
    v = [synthetic(rng, layers, heads, t, dim) for t in n]
    cal = calibrate(k[0][:, :, :256], v[0][:, :, :256])
    caches = [PagedKVCache(cal, max_seqs=2, max_blocks=520, grow=True, device=d) for d in ("cuda", "cpu")]
    rows = [[c.add_sequence(k[0], v[0]) for c in caches]]
    rows.append([c.add_sequence() for c in caches])
    for c, row in zip(caches, rows[1]):            # a second sequence through update_layer, in two chunks
        for a, z in ((0, 70 * B + 3), (70 * B + 3, n[1])):
            for layer in range(layers):
                c.update_layer(layer, [row], torch.from_numpy(k[1][layer:layer + 1, :, a:z].view(np.int16)),
                               torch.from_numpy(v[1][layer:layer + 1, :, a:z].view(np.int16)))
    gpu, cpu = caches
    assert_same_epochs(gpu.calibration, cpu.calibration)
    assert sum(gpu.calibration.n_epochs(l, kind) - 1 for l in range(layers) for kind in (0, 1)) >= 4
    for layer in range(layers):
        for kind in (0, 1):
            assert np.array_equal(gpu.stores(layer)[kind].epochs, cpu.stores(layer)[kind].epochs)
    for i, row in enumerate(rows):
        for layer in range(layers):
            gk, gv = gpu.read_layer(layer, [row[0]])
            assert np.array_equal(gk[0].cpu().numpy().view(np.uint16), k[i][layer])
            assert np.array_equal(gv[0].cpu().numpy().view(np.uint16), v[i][layer])
