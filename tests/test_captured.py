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


def assert_lagged_epochs(cache, ref, row, ref_row, layers):
    """The block epochs of a decode loop (the rule's epochs published a few steps after their check) against
    a reference cache's (the rule applied at once): the device's match the host's, never decrease along the
    sequence and never run ahead of the reference's; they are the reference's before the decode began."""
    for layer in range(layers):
        for kind in (0, 1):
            a, b = cache.stores(layer)[kind], ref.stores(layer)[kind]
            if a.epoch is None:
                continue
            n = int(cache.host_lengths[layer, row]) // B
            assert n == int(ref.host_lengths[layer, ref_row]) // B
            got, want = a.epochs[row, :n], b.epochs[ref_row, :n]
            np.testing.assert_array_equal(a.epoch[row, :n].numpy(), got)
            assert (np.diff(got) >= 0).all() and (got <= want).all()


@pytest.mark.parametrize("adapt", [False, True])
def test_device_driven_steps_match_the_reference_cache(adapt, monkeypatch):
    """Steps across block ends (and, with adaptation, checks that append epochs): no plan ends at a check
    and no step runs eagerly; the cache holds the reference cache's bits and epochs (the block epochs
    lagging by the rule's few steps), attention matches."""
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
    assert plans >= 4 and eager == 0
    if adapt:
        assert max(gpu.calibration.n_epochs(layer, 0) for layer in range(layers)) > 1
        assert_same_epochs(gpu.calibration, ref.calibration)
    for i in range(2):
        for c, r in ((gpu, rows[0][i]), (ref, rows[1][i])):
            got_k, got_v = c.read(r)
            np.testing.assert_array_equal(got_k, k[i])
            np.testing.assert_array_equal(got_v, v[i])
        assert_lagged_epochs(gpu, ref, rows[0][i], rows[1][i], layers)
    assert gpu.blocks_encoded == ref.blocks_encoded


def test_a_check_inside_a_plan_publishes_its_epoch_and_a_split_reads_several(monkeypatch):
    """One plan of steps runs through adaptation checks: an epoch a check appends is published through the
    device's buffers a few steps later (the plan goes on; later blocks record it), the work list is not cut
    where epochs change, so a split reads blocks of several epochs, and attention over them matches
    float64 while every token reads back bit-exact."""
    from gaac.cache import ADAPT_LAG

    for name in ("WARMUP_BLOCKS", "ADAPT_EVERY"):
        monkeypatch.setattr(epochs_mod, name, 2)
    rng = np.random.default_rng(7)
    layers, heads, dim = 1, 1, 64
    start, steps = [3 * B, 3 * B + 8], 3 * B
    total = [n + steps for n in start]
    k = [drifting(rng, layers, heads, n, dim, 24.0) for n in total]
    v = [synthetic(rng, layers, heads, n, dim) for n in total]
    cal = calibrate(k[0][:, :, :32], v[0][:, :, :32])
    caches = [PagedKVCache(cal, max_seqs=2, max_blocks=16, raw_tiles=64, codec="cuda", adapt=True) for _ in range(2)]
    caches[1]._rule_on_device = True             # the decode checks in GPU rule batches, as on a GPU
    jobs = []
    due_check = PagedKVCache._due_check
    monkeypatch.setattr(PagedKVCache, "_due_check",
                        lambda self, *a: (lambda job: (jobs.append(job is not None), job)[1])(due_check(self, *a)))
    for cache in caches:
        rows = [cache.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) for i in range(2)]
        before = cache.calibration.n_epochs(0, 0)
        pos = list(start)
        assert _steps(cache, rows, k, v, pos, 2 * heads, steps, rng, check_at={start[0] + steps - 1}) == steps
    assert sum(jobs) >= 4                        # decode checks ran in GPU rule batches
    assert_same_epochs(caches[0].calibration, caches[1].calibration)
    for layer in range(caches[0].layers):
        layer_a, layer_b = caches[0].stores(layer), caches[1].stores(layer)
        for a, b in zip(layer_a, layer_b):
            np.testing.assert_array_equal(a.epochs, b.epochs)      # the same decisions, published alike
    cache = caches[1]
    store = cache.stores(0)[0]
    assert cache.calibration.n_epochs(0, 0) > before + 1           # checks inside the plan appended epochs
    assert store.published == cache.calibration.n_epochs(0, 0) - 1 or store.deferred
    seen = set()
    for i, r in enumerate(rows):
        epochs = store.epochs[r, :total[i] // B]
        assert set(epochs[start[i] // B:].tolist()) - {int(epochs[start[i] // B - 1])}   # decode blocks took new ones
        seen |= set(epochs.tolist())
    plan = cache.decode_plan(2 * heads, steps=1)
    splits = plan._work.numpy().reshape(-1, 3)
    mixed = [(b, s, e) for b, s, e in splits if len(set(store.epochs[b, s:min(e, total[rows.index(b)] // B)])) > 1]
    assert mixed, "no split of the work list holds blocks of two epochs"
    assert len(seen) > 2 and ADAPT_LAG >= 1
    for i, r in enumerate(rows):
        got_k, got_v = cache.read(r)
        np.testing.assert_array_equal(got_k, k[i])
        np.testing.assert_array_equal(got_v, v[i])


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


def test_a_refused_plan_of_steps_leaves_the_host_reading_its_own_counts():
    """A plan of device-driven steps or a bucket's step refused for its arguments makes no steps, so the host
    still takes its exact pool counts as the device's (a join then reserves without reading a count); the first
    plan made marks the cache as one whose steps the device drives."""
    rng = np.random.default_rng(3)
    k, v = synthetic(rng, 1, 1, 40, 64), synthetic(rng, 1, 1, 40, 64)
    cache = PagedKVCache(calibrate(k, v), max_seqs=2, max_blocks=8, codec="cuda", adapt=False)
    with pytest.raises(InputError, match="at least one live sequence"):
        cache.decode_plan(2, steps=2)
    assert not cache.serving.device_steps
    cache.add_sequence(k[:, :, :20], v[:, :, :20])
    cache.add_sequence(k[:, :, :17], v[:, :, :17])
    with pytest.raises(InputError, match="2 sequences for a bucket of 1"):
        cache.decode_plan(2, bucket=1)
    assert not cache.serving.device_steps
    plan = cache.decode_plan(2, steps=1)
    assert cache.serving.device_steps and plan.steps == 1


def test_step_graph_keeps_a_bucket_through_joins_leaves_and_checks(monkeypatch):
    """gaac.StepGraph's loop (every step through the bucket's recording, as the simulator runs it): sequences of
    different lengths step together, one leaves and a new prompt takes its row, the batch shrinks into a
    smaller bucket and grows back, and adaptation checks append epochs on the way.  Each bucket's plan is
    made once (its buffers are refreshed, never remade), the refreshed work list is the one the host would
    plan for the lengths, and the cache ends holding every token bit-exact with the reference cache's epochs;
    the last step's attention matches float64."""
    for name in ("WARMUP_BLOCKS", "ADAPT_EVERY"):
        monkeypatch.setattr(epochs_mod, name, 2)
    rng = np.random.default_rng(31)
    layers, heads, dim, steps = 1, 1, 64, 26
    start = [2 * B + 5, B + 11, 3 * B + 2, B - 3]          # the last one joins later, in the row that leaves
    k = [drifting(rng, layers, heads, n + steps, dim, 16.0) for n in start]
    v = [synthetic(rng, layers, heads, n + steps, dim) for n in start]
    cal = calibrate(k[0][:, :, :32], v[0][:, :, :32])
    cache = PagedKVCache(cal, max_seqs=3, max_blocks=12, raw_tiles=96, codec="cuda", adapt=True)
    cache._rule_on_device = True                 # the rule's checks in GPU batches, as on a GPU (a join's
    ref = PagedKVCache(cal, max_seqs=3, max_blocks=12, raw_tiles=96, codec="reference", adapt=True)  # too)
    rows = [cache.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) for i in range(3)]
    ref_rows = [ref.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) for i in range(3)]
    held = {i: start[i] for i in range(3)}                 # content index -> tokens held
    where = dict(zip(range(3), rows))                      # content index -> cache row
    kbuf = torch.zeros((layers, 4, heads, 1, dim), dtype=torch.int16)
    vbuf = torch.zeros_like(kbuf)
    q = _q(rng, cache.max_seqs, 2 * heads, dim)
    out = torch.zeros((layers, cache.max_seqs, 2 * heads, dim), dtype=torch.bfloat16)

    attend = [False]            # attention where checked (the simulator is slow; a graph would run it every step)

    def step(plan):             # where it attends, the token and the attention in one call (plan.run with k, v)
        n = len(plan.seqs)
        for layer in range(layers):
            if attend[0]:
                plan.run(q, layer, k=kbuf[layer, :n], v=vbuf[layer, :n], out=out[layer])
            else:
                cache.update_layer(layer, plan.seqs, kbuf[layer, :n], vbuf[layer, :n])

    runner = gaac.StepGraph(cache, 2 * heads, step, buckets=(2, 4))
    batch = [0, 1, 2]
    for t in range(steps):
        if t == 8:                                       # content 1 leaves; content 3's prompt takes its row
            cache.remove_sequence(where[1])
            ref.remove_sequence(ref_rows[1])
            where[3] = cache.add_sequence(k[3][:, :, :start[3]], v[3][:, :, :start[3]])
            ref_rows.append(ref.add_sequence(k[3][:, :, :start[3]], v[3][:, :, :start[3]]))
            assert where[3] == where[1]
            held[3] = start[3]
            del held[1]
            batch = [0, 3, 2]
        if t == 14:
            batch = [2, 3]                                # into the bucket of 2
        if t == 20:
            batch = [3, 0, 2]                             # back into the bucket of 4, in another order
        for i, c in enumerate(batch):
            for layer in range(layers):
                kbuf[layer, i, :, 0] = torch.from_numpy(k[c][layer, :, held[c]].view(np.int16))
                vbuf[layer, i, :, 0] = torch.from_numpy(v[c][layer, :, held[c]].view(np.int16))
        attend[0] = t in (9, 15, steps - 1)
        runner([where[c] for c in batch])
        if attend[0]:
            for layer in range(layers):
                contents = {where[c]: (k[c][:, :, :held[c] + 1], v[c][:, :, :held[c] + 1]) for c in batch}
                _check_attention(out[layer], q, contents, layer, [where[c] for c in batch])
        ref_seqs = [ref_rows[c] for c in batch]
        for layer in range(layers):
            ref.update_layer(layer, ref_seqs, kbuf[layer, :len(batch)], vbuf[layer, :len(batch)])
        for c in batch:
            held[c] += 1
        plan = runner._plans[runner.bucket(len(batch))]
        split, _, _ = plan._split(plan.captured.cover)
        np.testing.assert_array_equal(plan._work.numpy()[:3 * split.n_work], split.work)
        assert (plan._work.numpy()[3 * split.n_work:] == 0).all()
    assert sorted(runner._plans) == [2, 4] and runner.eager_steps == steps and runner.captures == 0
    assert max(cache.calibration.n_epochs(layer, 0) for layer in range(layers)) > 1
    assert_same_epochs(cache.calibration, ref.calibration)
    for c in held:
        got_k, got_v = cache.read(where[c])
        np.testing.assert_array_equal(got_k, k[c][:, :, :held[c]])
        np.testing.assert_array_equal(got_v, v[c][:, :, :held[c]])
        assert_lagged_epochs(cache, ref, where[c], ref_rows[c], layers)
