"""The decode loop on a real GPU: device appends, asynchronous epoch observation, the fused kernel per layer.

Runs only with a CUDA device and ``NUMBA_ENABLE_CUDASIM=0`` (the simulator path is tests/test_step.py):

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -q tests/test_step_gpu.py

A GPU cache and a CPU cache with the reference codec run the same loop (prefills, one-token steps across
block ends and epochs, a removal and a new sequence); they must hold the same bits, the same epochs and the
same slot/raw decisions, and every checked attention must match float64 within BF16 rounding.
"""
import os

import numpy as np
import pytest
import torch

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device and NUMBA_ENABLE_CUDASIM=0", allow_module_level=True)

from conftest import assert_reads_back  # noqa: E402
from test_cache import B, assert_same_epochs, drifting, synthetic, with_capacity  # noqa: E402

import gaac.epochs as epochs_mod  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.attention import bf16_to_float, reference_attention  # noqa: E402
from gaac.cache import PagedKVCache  # noqa: E402
from gaac.calibration import calibrate  # noqa: E402
from gaac.errors import InputError, PoolExhaustedError  # noqa: E402
from gaac.cache.pools import grown  # noqa: E402


def assert_same_caches(caches, seqs, k, v, adapt: bool):
    """A GPU cache and the reference cache after the same steps: the same bits and (with adaptation) epochs, at
    least one of them appended; each block's epoch the reference's or, where a decode loop's check appended
    one, an earlier one (the loop publishes it a few steps after the check); the same slot/raw decisions
    wherever the block's epochs agree."""
    if adapt:
        assert_same_epochs(caches[0].calibration, caches[1].calibration)
        assert caches[0].calibration.n_epochs(0, 0) > 1
    assert_reads_back(caches, seqs, k, v)
    for layer in range(caches[0].layers):
        g, r = (c.layer_view(layer) for c in caches)
        for kind in range(2):
            same = torch.ones(g.table[kind].shape[:2], dtype=torch.bool)
            if adapt:
                ge, re_ = g.epoch[kind].cpu(), r.epoch[kind]
                assert (ge <= re_).all()
                same = ge == re_
            assert torch.equal((g.table[kind].cpu() < 0)[same], (r.table[kind] < 0)[same])


def test_gpu_loop_matches_the_reference_cache(monkeypatch):
    for name in ("WARMUP_BLOCKS", "ADAPT_EVERY"):
        monkeypatch.setattr(epochs_mod, name, 4)
    rng = np.random.default_rng(7)
    layers, heads, dim, steps = 3, 4, 128, 150
    start = [40 * B + 3, 9 * B + 15, 0]
    n_tok = [s + steps for s in start]
    k = [drifting(rng, layers, heads, n, dim, 12.0) for n in n_tok]
    v = [synthetic(rng, layers, heads, n, dim) for n in n_tok]
    cal = calibrate(k[0][:, :, :256], v[0][:, :, :256])
    caches = [PagedKVCache(cal, max_seqs=3, max_blocks=64, raw_tiles=3 * 64 * 4 * 2 * cal.layers, device=d)
              for d in ("cuda", "cpu")]
    rows = [[c.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) if start[i] else c.add_sequence()
             for i in range(3)] for c in caches]
    assert rows[0] == rows[1]
    seqs = rows[0]
    worst = 0.0
    for step in range(steps):
        q = torch.randn((3, 2 * heads, dim)).to(torch.bfloat16)
        plans = [c.decode_plan(2 * heads) for c in caches]
        for layer in range(layers):
            pos = [start[i] + step for i in range(3)]
            kn = np.stack([k[i][layer, :, pos[i]:pos[i] + 1] for i in range(3)]).view(np.int16)
            vn = np.stack([v[i][layer, :, pos[i]:pos[i] + 1] for i in range(3)]).view(np.int16)
            caches[0].update_layer(layer, seqs, torch.from_numpy(kn).cuda(), torch.from_numpy(vn).cuda())
            caches[1].update_layer(layer, seqs, torch.from_numpy(kn), torch.from_numpy(vn))
            out = plans[0].run(q.cuda(), layer)
            if step % 37 == 0 or step == steps - 1:
                qf = bf16_to_float(q.view(torch.int16).numpy())
                ks = [bf16_to_float(k[i][layer, :, :pos[i] + 1]) for i in range(3)]
                vs = [bf16_to_float(v[i][layer, :, :pos[i] + 1]) for i in range(3)]
                ref, _ = reference_attention(qf, ks, vs)
                got = out.float().cpu().numpy()
                err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
                worst = max(worst, err)
                assert err < 8e-3, (step, layer, err)
        plans[0].check_status()
    print(f"worst attention error against float64: {worst:.2e}")
    assert_same_caches(caches, seqs, k, v, adapt=True)
    for c in caches:                       # a removal gives its records back; a new sequence reuses them
        before = c.memory().slot_bytes
        c.remove_sequence(seqs[0])
        assert c.memory().slot_bytes < before
        again = c.add_sequence(k[0][:, :, :20 * B], v[0][:, :, :20 * B])
        np.testing.assert_array_equal(c.read(again)[0], k[0][:, :, :20 * B])


def test_gpu_eager_calls_take_the_fast_path_and_fall_back_where_they_must():
    """The eager step's per-call fast paths (appends, block ends included, and attention through parameter
    buffers) and the full paths they fall back to (a strided token, a tuple of sequences, a strided ``out``)
    leave the same bits, epochs and memory as the reference cache, and the same attention."""
    rng = np.random.default_rng(11)
    layers, heads, dim, steps = 2, 2, 128, 40
    start = 2 * B - 5
    k = [synthetic(rng, layers, heads, start + steps, dim) for _ in range(2)]
    v = [synthetic(rng, layers, heads, start + steps, dim) for _ in range(2)]
    cal = calibrate(k[0][:, :, :64], v[0][:, :, :64])
    caches = [PagedKVCache(cal, max_seqs=2, max_blocks=8, raw_tiles=2 * 8 * heads * 2 * cal.layers, device=d)
              for d in ("cuda", "cpu")]
    seqs = [[c.add_sequence(k[i][:, :, :start], v[i][:, :, :start]) for i in range(2)] for c in caches][0]
    fast_appends = 0
    for step in range(steps):
        pos = start + step
        plans = [c.decode_plan(2 * heads) for c in caches]
        for layer in range(layers):
            kn = np.stack([k[i][layer, :, pos:pos + 1] for i in range(2)]).view(np.int16)
            vn = np.stack([v[i][layer, :, pos:pos + 1] for i in range(2)]).view(np.int16)
            kg, vg = torch.from_numpy(kn).cuda(), torch.from_numpy(vn).cuda()
            variant = (step + layer) % 3
            if variant == 1:                                  # BF16 tensors: the fast path too
                kg, vg = kg.view(torch.bfloat16), vg.view(torch.bfloat16)
            if variant == 2:                                  # strided tokens, a tuple: the full path
                kg = kg.transpose(0, 1).contiguous().transpose(0, 1)
                assert not kg.is_contiguous()
            caches[0].update_layer(layer, tuple(seqs) if variant == 2 else seqs, kg, vg)
            caches[1].update_layer(layer, seqs, torch.from_numpy(kn), torch.from_numpy(vn))
            # A token that finishes a block takes the fast path too: the append encodes it on the device.
            assert plans[0]._appended[layer] == (variant != 2), (step, layer)
            fast_appends += plans[0]._appended[layer]
            q = torch.randn((2, 2 * heads, dim)).to(torch.bfloat16)
            want = plans[1].run(q, layer).float().numpy()
            if variant == 2:                                  # a strided out receives the result
                out = torch.zeros((2, dim, 2 * heads), dtype=torch.bfloat16, device="cuda").transpose(1, 2)
                got = plans[0].run(q.cuda(), layer, out=out)
                assert got.data_ptr() == out.data_ptr()
            else:
                got = plans[0].run(q.cuda(), layer)
            got = got.float().cpu().numpy()
            assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want), (step, layer)
        with pytest.raises(InputError):
            plans[0].run(torch.zeros((1, 2 * heads, dim), dtype=torch.bfloat16, device="cuda"), 0)
        plans[0].check_status()
    assert fast_appends > steps // 2
    for c in caches:
        c._flush_all()
    for layer in range(layers):
        for kind in range(2):
            np.testing.assert_array_equal(caches[0].stores(layer)[kind].epochs, caches[1].stores(layer)[kind].epochs)
    assert caches[0].memory() == caches[1].memory()
    assert_reads_back(caches, seqs, k, v)


def test_gpu_step_reservation_refuses_before_writing():
    rng = np.random.default_rng(3)
    k, v = synthetic(rng, 2, 2, 3 * B, 128), synthetic(rng, 2, 2, 3 * B, 128)
    roomy = with_capacity(calibrate(k, v), np.full((2, 2), L.geometry(128).max_useful_capacity))
    cache = PagedKVCache(roomy, max_blocks=4, slots=2, raw_tiles=0, device="cuda")
    seq = cache.add_sequence(k[:, :, :2 * B - 1], v[:, :, :2 * B - 1])
    with pytest.raises(PoolExhaustedError):
        cache.decode_plan(4)
    np.testing.assert_array_equal(cache.read(seq)[0], k[:, :, :2 * B - 1])


def test_gpu_attention_covers_a_tail_past_the_tables_last_block():
    """A full block table and a tail after it (a table that never grows, and one that grows at the next
    finished block): the fused kernel's attention matches the reference cache's at every step."""
    rng = np.random.default_rng(8)
    heads, dim = 2, 128
    k, v = synthetic(rng, 1, heads, 3 * B + 2, dim), synthetic(rng, 1, heads, 3 * B + 2, dim)
    for grow in (False, True):
        caches = [PagedKVCache(calibrate(k, v), max_blocks=2, raw_tiles=4 * heads * 2, grow=grow, device=d)
                  for d in ("cuda", "cpu")]
        seq = [c.add_sequence(k[:, :, :2 * B - 1], v[:, :, :2 * B - 1]) for c in caches][0]
        steps = B + 3 if grow else B
        for step in range(steps):
            n = 2 * B - 1 + step
            plans = [c.decode_plan(2 * heads) for c in caches]
            kn, vn = k[None, 0, :, n:n + 1].view(np.int16), v[None, 0, :, n:n + 1].view(np.int16)
            caches[0].update_layer(0, [seq], torch.from_numpy(kn).cuda(), torch.from_numpy(vn).cuda())
            caches[1].update_layer(0, [seq], torch.from_numpy(kn), torch.from_numpy(vn))
            q = torch.randn((1, 2 * heads, dim)).to(torch.bfloat16)
            want = plans[1].run(q, 0).float().numpy()
            got = plans[0].run(q.cuda(), 0).float().cpu().numpy()
            assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want), (grow, step)
            plans[0].check_status()
        assert caches[0].max_blocks == (grown(2, 1) if grow else 2)
        np.testing.assert_array_equal(caches[0].read(seq)[0], k[:, :, :2 * B - 1 + steps])


@pytest.mark.parametrize("adapt", [False, True])
def test_captured_graph_steps_match_the_reference_cache(adapt, monkeypatch):
    """The whole step of every layer (appends, tail encodes, attention) captured in one CUDA graph and
    replayed over block ends, batch rows finishing blocks on different steps; with adaptation, plans end at
    the rule's checks and are captured again.  The GPU cache then holds the reference cache's bits, epochs
    and slot/raw decisions, and every replayed step's attention matches float64."""
    for name in ("WARMUP_BLOCKS", "ADAPT_EVERY"):
        monkeypatch.setattr(epochs_mod, name, 4)
    rng = np.random.default_rng(17)
    layers, heads, dim, steps = 2, 4, 128, 120
    start = [30 * B + 3, 9 * B + 10, 5]
    n_tok = [s + steps for s in start]
    k = [drifting(rng, layers, heads, n, dim, 12.0) for n in n_tok]
    v = [synthetic(rng, layers, heads, n, dim) for n in n_tok]
    cal = calibrate(k[0][:, :, :256], v[0][:, :, :256])
    caches = [PagedKVCache(cal, max_seqs=3, max_blocks=48, raw_tiles=3 * 48 * 4 * 2 * cal.layers, device=d, adapt=adapt)
              for d in ("cuda", "cpu")]
    seqs = [[c.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) for i in range(3)] for c in caches][0]
    kbuf = torch.zeros((layers, 3, heads, 1, dim), dtype=torch.int16, device="cuda")
    vbuf = torch.zeros_like(kbuf)
    qbuf = torch.zeros((3, 2 * heads, dim), dtype=torch.bfloat16, device="cuda")
    out = torch.zeros((layers, 3, 2 * heads, dim), dtype=torch.bfloat16, device="cuda")

    def fill(step):
        for layer in range(layers):
            for i in range(3):
                p = start[i] + step
                kbuf[layer, i, :, 0] = torch.from_numpy(k[i][layer, :, p].view(np.int16))
                vbuf[layer, i, :, 0] = torch.from_numpy(v[i][layer, :, p].view(np.int16))

    def eager_ref(step):
        for layer in range(layers):
            caches[1].update_layer(layer, seqs, kbuf[layer].cpu(), vbuf[layer].cpu())

    step, graphs, worst = 0, 0, 0.0
    while step < steps:
        plan = caches[0].decode_plan(2 * heads, steps=min(48, steps - step))
        if not plan.steps:                        # the next step passes a check: eagerly
            fill(step)
            eager = caches[0].decode_plan(2 * heads)
            for layer in range(layers):
                caches[0].update_layer(layer, seqs, kbuf[layer], vbuf[layer])
                eager.run(qbuf, layer)
            eager_ref(step)
            step += 1
            continue
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), plan.device_driven():
            for layer in range(layers):
                caches[0].update_layer(layer, seqs, kbuf[layer], vbuf[layer])
                plan.run(qbuf, layer, out=out[layer])
        graphs += 1
        for _ in range(plan.steps):
            fill(step)
            qbuf.copy_(torch.randn((3, 2 * heads, dim)).to(torch.bfloat16))
            graph.replay()
            plan.replayed()
            eager_ref(step)
            if step % 13 == 0 or step == steps - 1:
                qf = bf16_to_float(qbuf.view(torch.int16).cpu().numpy())
                for layer in range(layers):
                    ks = [bf16_to_float(k[i][layer, :, :start[i] + step + 1]) for i in range(3)]
                    vs = [bf16_to_float(v[i][layer, :, :start[i] + step + 1]) for i in range(3)]
                    ref, _ = reference_attention(qf, ks, vs)
                    got = out[layer].float().cpu().numpy()
                    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
                    worst = max(worst, err)
                    assert err < 8e-3, (step, layer, err)
            step += 1
        plan.check_status()
    print(f"{graphs} graphs; worst attention error against float64: {worst:.2e}")
    assert graphs >= (3 if adapt else 2)
    assert_same_caches(caches, seqs, k, v, adapt)


def test_step_graph_runs_a_loop_through_checks_joins_and_buckets(monkeypatch):
    """gaac.StepGraph: a bucket's first step eager, then its one graph replayed through the rule's checks (the
    epochs they append published between replays), a sequence that leaves and a prompt that takes its row, and
    a batch that moves to a smaller bucket and back; the cache ends holding every token bit-exact with the
    reference cache's epochs, and the last step's attention is right."""
    import gaac

    for name in ("WARMUP_BLOCKS", "ADAPT_EVERY"):
        monkeypatch.setattr(epochs_mod, name, 4)
    rng = np.random.default_rng(23)
    layers, heads, dim, steps = 2, 4, 128, 90
    start = [20 * B + 7, 3 * B]
    k = [drifting(rng, layers, heads, s + steps, dim, 12.0) for s in start]
    v = [synthetic(rng, layers, heads, s + steps, dim) for s in start]
    cal = calibrate(k[0][:, :, :256], v[0][:, :, :256])
    caches = [PagedKVCache(cal, max_seqs=2, max_blocks=32, raw_tiles=2 * 32 * 4 * 2 * cal.layers, device=d) for d in ("cuda", "cpu")]
    seqs = [[c.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) for i in range(2)] for c in caches][0]
    kbuf = torch.zeros((layers, 2, heads, 1, dim), dtype=torch.int16, device="cuda")
    vbuf = torch.zeros_like(kbuf)
    qbuf = torch.randn((2, 2 * heads, dim), device="cuda").to(torch.bfloat16)
    out = torch.zeros((layers, 2, 2 * heads, dim), dtype=torch.bfloat16, device="cuda")

    def step(plan):
        n = len(plan.seqs)
        for layer in range(layers):
            caches[0].update_layer(layer, plan.seqs, kbuf[layer, :n], vbuf[layer, :n])
            plan.run(qbuf, layer, out=out[layer])

    runner = gaac.StepGraph(caches[0], 2 * heads, step)
    pos = list(start)
    for t in range(steps):
        batch = [0] if 40 <= t < 50 else [0, 1]            # sequence 1 sits out ten steps: the bucket of 1
        if t == 60:                                         # sequence 1 leaves; its first tokens come back as new
            for c in caches:
                c.remove_sequence(seqs[1])
                assert c.add_sequence(k[1][:, :, :start[1]], v[1][:, :, :start[1]]) == seqs[1]
            pos[1] = start[1]
        for i in batch:
            for layer in range(layers):
                kbuf[layer, batch.index(i), :, 0] = torch.from_numpy(k[i][layer, :, pos[i]].view(np.int16))
                vbuf[layer, batch.index(i), :, 0] = torch.from_numpy(v[i][layer, :, pos[i]].view(np.int16))
        for layer in range(layers):
            caches[1].update_layer(layer, [seqs[i] for i in batch], kbuf[layer, :len(batch)].cpu(),
                                   vbuf[layer, :len(batch)].cpu())
        runner([seqs[i] for i in batch])
        for i in batch:
            pos[i] += 1
    assert runner.captures == 2 and runner.eager_steps == 2          # a graph per bucket (2 and 1), warmed once
    assert max(caches[0].calibration.n_epochs(layer, 0) for layer in range(layers)) > 1
    qf = bf16_to_float(qbuf.view(torch.int16).cpu().numpy())
    for layer in range(layers):
        ks = [bf16_to_float(k[i][layer, :, :pos[i]]) for i in range(2)]
        vs = [bf16_to_float(v[i][layer, :, :pos[i]]) for i in range(2)]
        ref, _ = reference_attention(qf, ks, vs)
        got = out[layer].float().cpu().numpy()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 8e-3
    assert_reads_back(caches, seqs[:2], k, v, pos)
    assert_same_epochs(caches[0].calibration, caches[1].calibration)


def test_gpu_attention_started_during_the_append_sees_the_appended_token(monkeypatch):
    """An eager step launches each layer's attention as a programmatic dependent of the layer's append (its
    splits over older blocks start while the append runs): through block ends, with the query written by a
    kernel between the two, the attention equals the same plan's attention launched again after the append
    has finished, bit for bit, and matches float64 over every token the layer holds."""
    from gaac.cuda.launch import FastLaunch

    launched = []
    run = FastLaunch.run

    def counting(self, buffer, grid=None, handle=None, pdl=None):
        launched.append(bool(pdl))
        return run(self, buffer, grid, handle, pdl)
    monkeypatch.setattr(FastLaunch, "run", counting)
    rng = np.random.default_rng(5)
    layers, heads, dim, steps = 3, 4, 128, 40
    start = [20 * B - 7, 3 * B + 2]
    k = [synthetic(rng, layers, heads, s + steps, dim) for s in start]
    v = [synthetic(rng, layers, heads, s + steps, dim) for s in start]
    cal = calibrate(k[0][:, :, :256], v[0][:, :, :256])
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=32, raw_tiles=2 * 32 * heads * 2 * layers, device="cuda")
    seqs = [cache.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) for i in range(2)]
    qs = torch.randn((2, 2 * heads, dim), device="cuda").to(torch.bfloat16)
    for step in range(steps):
        plan = cache.decode_plan(2 * heads)
        for layer in range(layers):
            pos = [start[i] + step for i in range(2)]
            kn = torch.from_numpy(np.stack([k[i][layer, :, p:p + 1] for i, p in enumerate(pos)]).view(np.int16)).cuda()
            vn = torch.from_numpy(np.stack([v[i][layer, :, p:p + 1] for i, p in enumerate(pos)]).view(np.int16)).cuda()
            cache.update_layer(layer, seqs, kn, vn)
            q = qs * 1                                      # a kernel between the append and the attention
            first = plan.run(q, layer)
            again = plan.run(q, layer)
            assert torch.equal(first.view(torch.int16), again.view(torch.int16)), (step, layer)
            if step % 13 == 0:
                qf = bf16_to_float(q.view(torch.int16).cpu().numpy())
                ks = [bf16_to_float(k[i][layer, :, :p + 1]) for i, p in enumerate(pos)]
                vs = [bf16_to_float(v[i][layer, :, :p + 1]) for i, p in enumerate(pos)]
                ref, _ = reference_attention(qf, ks, vs)
                err = np.linalg.norm(first.float().cpu().numpy() - ref) / np.linalg.norm(ref)
                assert err < 8e-3, (step, layer, err)
        plan.check_status()
    assert sum(launched) >= steps * (layers - 1), launched.count(True)


def test_gpu_run_with_the_token_is_one_fast_call_and_matches_the_two_calls(monkeypatch):
    """``plan.run(q, layer, k=, v=)`` on the GPU: the append and the attention from one call's checks (no
    ``update_layer``), across block ends and epochs appended, bit for bit what ``update_layer`` + ``run`` give
    on a twin cache; a strided token takes the full path and still matches."""
    for name in ("WARMUP_BLOCKS", "ADAPT_EVERY"):
        monkeypatch.setattr(epochs_mod, name, 4)
    rng = np.random.default_rng(13)
    layers, heads, dim, steps = 2, 2, 128, 70
    start = [3 * B - 2, B + 5]
    k = [drifting(rng, layers, heads, n + steps, dim, 12.0) for n in start]
    v = [synthetic(rng, layers, heads, n + steps, dim) for n in start]
    cal = calibrate(k[0][:, :, :64], v[0][:, :, :64])
    caches = [PagedKVCache(cal, max_seqs=2, max_blocks=16, raw_tiles=2 * 16 * heads * 2 * cal.layers, device="cuda")
              for _ in range(2)]
    seqs = [[c.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) for i in range(2)] for c in caches][0]
    calls = []
    original = caches[1].update_layer
    monkeypatch.setattr(caches[1], "update_layer", lambda *a: calls.append(a[0]) or original(*a))
    slow = 0
    for step in range(steps):
        plans = [c.decode_plan(2 * heads) for c in caches]
        q = torch.randn((2, 2 * heads, dim)).to(torch.bfloat16).cuda()
        for layer in range(layers):
            pos = [start[i] + step for i in range(2)]
            kn = torch.from_numpy(np.stack([k[i][layer, :, pos[i]:pos[i] + 1] for i in range(2)]).view(np.int16)).cuda()
            vn = torch.from_numpy(np.stack([v[i][layer, :, pos[i]:pos[i] + 1] for i in range(2)]).view(np.int16)).cuda()
            caches[0].update_layer(layer, seqs, kn, vn)
            want = plans[0].run(q, layer)
            strided = step % 9 == 4
            kb = kn.transpose(0, 1).contiguous().transpose(0, 1) if strided else kn.view(torch.bfloat16)
            slow += strided
            got = plans[1].run(q, layer, k=kb, v=vn)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (step, layer)
        for p in plans:
            p.check_status()
    assert len(calls) == slow                   # only the strided tokens went through update_layer
    assert caches[1].calibration.n_epochs(0, 0) > 1
    for c in caches:
        c._flush_all()
    assert caches[0].memory() == caches[1].memory()
    assert_reads_back(caches, seqs, k, v, [n + steps for n in start])
