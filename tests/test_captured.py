"""Plans of device-driven steps (``cache.decode_plan(q_heads, steps=N)``), the form a CUDA graph captures.

In the simulator each step is recorded and run eagerly (``with plan.device_driven():``), then accounted
for by ``plan.replayed()`` -- the same launches a graph replays on a GPU (tests/test_step_gpu.py captures
and replays them).  The cache must end up holding what a reference-codec cache holds after the same eager
steps: the same bits, epochs and block epochs; attention must match float64.
"""
import numpy as np
import pytest
import torch
from test_cache import B, assert_same_epochs, drifting, synthetic
from test_step import _check_attention, _q

import gaac
import gaac.epochs as epochs_mod
from gaac.cache import PagedKVCache
from gaac.calibration import calibrate
from gaac.errors import InputError


def _token(x, rows, layer, pos):
    return torch.from_numpy(np.stack([x[i][layer, :, pos[i]:pos[i] + 1] for i in range(len(rows))]).view(np.int16))


def _steps(cache, rows, k, v, pos, q_heads, steps, rng, check_at=()):
    """Run up to ``steps`` device-driven steps of one plan; returns how many ran."""
    plan = cache.decode_plan(q_heads, steps=steps)
    for _ in range(plan.steps):
        q = _q(rng, cache.max_seqs, q_heads, cache.head_dim)
        with plan.device_driven():
            for layer in range(cache.layers):
                cache.update_layer(layer, rows, _token(k, rows, layer, pos), _token(v, rows, layer, pos))
                if pos[0] in check_at:                   # attention where checked (the simulator is slow)
                    out = plan.run(q, layer)
                    held = {r: (k[i][:, :, :pos[i] + 1], v[i][:, :, :pos[i] + 1]) for i, r in enumerate(rows)}
                    _check_attention(out, q, held, layer, rows)
        plan.replayed()
        for i in range(len(pos)):
            pos[i] += 1
    plan.check_status()
    return plan.steps


def _eager(cache, rows, k, v, pos):
    for layer in range(cache.layers):
        cache.update_layer(layer, rows, _token(k, rows, layer, pos), _token(v, rows, layer, pos))
    for i in range(len(pos)):
        pos[i] += 1


@pytest.mark.parametrize("adapt", [False, True])
def test_device_driven_steps_match_the_reference_cache(adapt, monkeypatch):
    """Steps across block ends (and, with adaptation, checks that append epochs): plans end where the
    rule needs the host; the cache holds the reference cache's bits and epochs, attention matches."""
    for name in ("WARMUP_BLOCKS", "ADAPT_EVERY"):
        monkeypatch.setattr(epochs_mod, name, 2)
    rng = np.random.default_rng(5)
    layers, heads, dim, steps = 2, 1, 64, 40
    start = [2 * B + 9, B + 14]
    k = [drifting(rng, layers, heads, n + steps, dim, 8.0) for n in start]
    v = [synthetic(rng, layers, heads, n + steps, dim) for n in start]
    cal = calibrate(k[0][:, :, :32], v[0][:, :, :32])
    gpu, ref = (PagedKVCache(cal, max_seqs=2, max_blocks=8, raw_tiles=32 * 2 * cal.layers, codec=c, adapt=adapt)
                for c in ("cuda", "reference"))
    rows = [[c.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) for i in range(2)] for c in (gpu, ref)]
    pos, pos_ref = list(start), list(start)
    plans = eager = 0
    while pos[0] < start[0] + steps:
        ran = _steps(gpu, rows[0], k, v, pos, 2 * heads, min(12, start[0] + steps - pos[0]), rng,
                     check_at={start[0] + 2, start[0] + steps - 1})
        plans += 1
        if not ran:                              # the next step passes a check: eagerly, then plan again
            _eager(gpu, rows[0], k, v, pos)
            eager += 1
        while pos_ref[0] < pos[0]:
            _eager(ref, rows[1], k, v, pos_ref)
    assert plans >= 4
    if adapt:
        assert max(gpu.calibration.n_epochs(layer, 0) for layer in range(layers)) > 1
        assert_same_epochs(gpu.calibration, ref.calibration)
    for i in range(2):
        for c, r in ((gpu, rows[0][i]), (ref, rows[1][i])):
            got_k, got_v = c.read(r)
            np.testing.assert_array_equal(got_k, k[i])
            np.testing.assert_array_equal(got_v, v[i])
        for layer in range(layers):
            for kind in (0, 1):
                a, b = gpu._store[layer][kind], ref._store[layer][kind]
                np.testing.assert_array_equal(a.epochs[rows[0][i]], b.epochs[rows[1][i]])
                np.testing.assert_array_equal(a.epoch[rows[0][i]].numpy() if a.epoch is not None else 0,
                                              b.epochs[rows[1][i]] if a.epoch is not None else 0)
    assert gpu.blocks_encoded == ref.blocks_encoded


def test_a_plan_of_steps_refuses_what_would_break_its_launches():
    rng = np.random.default_rng(2)
    k, v = synthetic(rng, 1, 1, 40, 64), synthetic(rng, 1, 1, 40, 64)
    cal = calibrate(k, v)
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=8, codec="cuda", adapt=False)
    seq = cache.add_sequence(k[:, :, :20], v[:, :, :20])
    plan = cache.decode_plan(2, steps=2)
    assert plan.steps == 2
    kn, vn = (torch.from_numpy(x[:, :, 20:21].view(np.int16)) for x in (k, v))
    with pytest.raises(InputError, match="device_driven"):
        plan.run(_q(rng, 2, 2, 64), 0)
    with pytest.raises(InputError, match="steps is 2|used|one eager step"):
        cache.decode_plan(2).replayed()
    with plan.device_driven():
        with pytest.raises(InputError, match="one token"):
            cache.update_layer(0, [seq], torch.cat([kn, kn], dim=2), torch.cat([vn, vn], dim=2))
        cache.update_layer(0, [seq], kn, vn)
    plan.replayed()
    assert cache.seq_len(seq) == 21
    cache.append(seq, k[:, :, 21:22], v[:, :, 21:22])      # an eager update: the plan's launches are stale
    with pytest.raises(InputError, match="changed"):
        plan.replayed()
    with pytest.raises(InputError, match="positive"):
        cache.decode_plan(2, steps=0)
    ref = PagedKVCache(cal, max_seqs=1, codec="reference")
    ref.add_sequence(k[:, :, :3], v[:, :, :3])
    with pytest.raises(InputError, match="reference codec"):
        ref.decode_plan(2, steps=4)
    with pytest.raises(InputError, match="callable"):
        gaac.StepGraph(cache, 2, None)
