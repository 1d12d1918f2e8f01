"""``del`` frees: a cache, its plans and a StepGraph hold no reference cycles and nothing module-level holds a
cache's storage, so that its memory returns when the caller drops the last reference, without ``gc.collect()``.

Each test runs what a caller runs with the garbage collector disabled, drops its references and checks that
weak references to the cache and to its storage (the raw-tile arena, a slot pool, a block table) are dead at
once.  The GPU test checks ``torch.cuda.memory_allocated()`` after a StepGraph; it runs only with a CUDA device
and the simulator off (the simulated CUDA codec's tests are then skipped):

    NUMBA_ENABLE_CUDASIM=0 python -m pytest -q tests/test_release.py
"""
import copy
import gc
import os
import weakref
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from test_cache import synthetic

from gaac.cache import PagedKVCache
from gaac.calibration import calibrate

LAYERS, HEADS, DIM = 2, 1, 64
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
# The CUDA codec on the CPU runs in numba's simulator (tests/conftest.py turns it on unless told otherwise).
simulated = pytest.mark.skipif(not SIMULATED, reason="the CUDA codec on the CPU needs NUMBA_ENABLE_CUDASIM=1")
START = 14          # two steps from a block end: the second step's token finishes a block


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(11)
    n = START + 8
    k, v = synthetic(rng, LAYERS, HEADS, n, DIM), synthetic(rng, LAYERS, HEADS, n, DIM)
    return k, v, calibrate(k[:, :, :32], v[:, :, :32])


@contextmanager
def no_gc():
    """The garbage collector off (what is freed inside is freed by reference counts alone)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _token(x, layer, pos):
    return torch.from_numpy(np.ascontiguousarray(x[None, layer, :, pos:pos + 1]).view(np.int16))


def _q(rng):
    return torch.from_numpy(rng.standard_normal((2, 2, DIM)).astype(np.float32)).to(torch.bfloat16)


def _watch(cache) -> dict:
    """Weak references to the cache and to its storage."""
    store = cache.stores(0)[0]
    return {"cache": weakref.ref(cache), "arena": weakref.ref(cache._arena.data),
            "slots": weakref.ref(store.slots.data), "raw share": weakref.ref(store.raw.data),
            "table": weakref.ref(store.table), "tail": weakref.ref(store.tail)}


def _alive(refs: dict) -> list:
    return [name for name, ref in refs.items() if ref() is not None]


def _cache(cal, codec, adapt=True):
    return PagedKVCache(cal, max_seqs=2, max_blocks=8, raw_tiles=32, codec=codec, adapt=adapt)


def _eager_steps(cache, seq, k, v, pos, steps, rng, attention=True):
    """``steps`` eager decode steps of one token (attention at every layer where ``attention``)."""
    plan = None
    for _ in range(steps):
        plan = cache.decode_plan(2, seqs=[seq])
        for layer in range(LAYERS):
            cache.update_layer(layer, [seq], _token(k, layer, pos), _token(v, layer, pos))
            if attention:
                plan.run(_q(rng), layer)
        pos += 1
    return plan, pos


@pytest.mark.parametrize("adapt", [False, True])
def test_a_reference_cache_is_freed_at_del(data, adapt):
    k, v, cal = data
    rng = np.random.default_rng(0)
    with no_gc():
        cache = _cache(cal, "reference", adapt)
        seq = cache.add_sequence(k[:, :, :START], v[:, :, :START])
        other = cache.add_sequence(k[:, :, :5], v[:, :, :5])
        cache.remove_sequence(other)
        plan, pos = _eager_steps(cache, seq, k, v, START, 3, rng)
        cache.read(seq)
        cache.read_layer(0, [seq])
        cache.memory()
        assert cache.calibration.n_epochs(0, 0) >= 1
        refs = _watch(cache)
        del cache
        assert len(_alive(refs)) == len(refs)      # the plan holds its cache, which stays usable through it
        plan.run(_q(rng), 0)
        del plan
        assert not _alive(refs)


def test_the_arena_and_its_shares_make_no_cycle(data):
    """The raw-tile arena holds its shares; a share names the arena weakly, and a copy of a cache names its own."""
    k, v, cal = data
    with no_gc():
        cache = _cache(cal, "reference", adapt=False)
        cache.add_sequence(k[:, :, :START], v[:, :, :START])
        twin = copy.deepcopy(cache)
        share = twin.stores(0)[0].raw
        assert share.arena is twin._arena and share.arena is not cache._arena
        assert all(s.arena is twin._arena for s in twin._arena.shares)
        refs, twin_refs = _watch(cache), _watch(twin)
        del cache
        assert not _alive(refs)
        twin.append(0, k[:, :, START:START + 3], v[:, :, START:START + 3])     # finishes a block in the twin
        np.testing.assert_array_equal(twin.read(0)[0], k[:, :, :START + 3])
        del twin, share
        assert not _alive(twin_refs)


@simulated
@pytest.mark.parametrize("adapt", [False, True])
def test_a_cuda_codec_cache_is_freed_at_del(data, adapt):
    """The simulated CUDA codec: eager steps through the plan's device appends (one of them finishing a
    block, whose account waits for the step's last layer), then the cache and its plan dropped."""
    k, v, cal = data
    rng = np.random.default_rng(1)
    with no_gc():
        cache = _cache(cal, "cuda", adapt)
        seq = cache.add_sequence(k[:, :, :START], v[:, :, :START])
        plan, pos = _eager_steps(cache, seq, k, v, START, 3, rng, attention=False)
        assert plan._appender is not None and cache.serving.eager_plan is plan
        plan.run(_q(rng), LAYERS - 1)
        refs = _watch(cache)
        refs["plan"] = weakref.ref(plan)
        refs["appender"] = weakref.ref(plan._appender)
        del cache, plan
        assert not _alive(refs)


@simulated
def test_a_cache_whose_steps_dropped_their_plans_is_freed_at_del(data):
    """Eager steps whose plans are made inside a function and dropped: the cache keeps its record of the last
    finished step for the next plan to follow; it names no cache, and the cache is freed at del."""
    k, v, cal = data
    with no_gc():
        cache = _cache(cal, "cuda", adapt=True)
        seq = cache.add_sequence(k[:, :, :START], v[:, :, :START])

        def step(pos):
            plan = cache.decode_plan(2, seqs=[seq])             # held for the step's layers, dropped at return
            for layer in range(LAYERS):
                cache.update_layer(layer, [seq], _token(k, layer, pos), _token(v, layer, pos))
            return plan.lens[seq]
        for pos in range(START, START + 3):
            step(pos)
        record = cache.serving.last_step
        assert cache.serving.eager_plan is None and record is not None and record._appender is not None
        refs = _watch(cache)
        refs["appender"] = weakref.ref(record._appender)
        del cache, record, step
        assert not _alive(refs)


@simulated
def test_a_step_left_part_way_is_accounted_and_freed(data):
    """A step whose token finishes a block, appended to one layer only: the cache keeps the pending account
    (not the plan), makes it at its next call even after the plan is dropped, and is freed at del."""
    k, v, cal = data
    rng = np.random.default_rng(2)
    with no_gc():
        cache = _cache(cal, "cuda", adapt=False)
        seq = cache.add_sequence(k[:, :, :START], v[:, :, :START])
        pos = _eager_steps(cache, seq, k, v, START, 1, rng, attention=False)[1]
        plan = cache.decode_plan(2, seqs=[seq])              # this step's token finishes block 0
        cache.update_layer(0, [seq], _token(k, 0, pos), _token(v, 0, pos))
        assert cache.serving.unsettled is not None
        refs = {"plan": weakref.ref(plan)}
        del plan
        assert not _alive(refs), "the cache holds the plan"
        cache.update_layer(1, [seq], _token(k, 1, pos), _token(v, 1, pos))    # settles the account first
        assert cache.serving.unsettled is None
        got_k, got_v = cache.read(seq)
        np.testing.assert_array_equal(got_k, k[:, :, :pos + 1])
        np.testing.assert_array_equal(got_v, v[:, :, :pos + 1])
        refs = _watch(cache)
        del cache
        assert not _alive(refs)


@simulated
def test_a_device_driven_plan_is_freed_at_del(data):
    """A plan of steps recorded (run eagerly in the simulator) and accounted, then dropped with its cache."""
    k, v, cal = data
    rng = np.random.default_rng(3)
    with no_gc():
        cache = _cache(cal, "cuda", adapt=False)
        seq = cache.add_sequence(k[:, :, :START], v[:, :, :START])
        plan = cache.decode_plan(2, steps=3)
        pos = START
        for step in range(plan.steps):
            with plan.device_driven() as recorded:
                assert recorded is plan
                for layer in range(LAYERS):
                    cache.update_layer(layer, [seq], _token(k, layer, pos), _token(v, layer, pos))
                    if step == plan.steps - 1 and layer == 0:
                        plan.run(_q(rng), layer)
            plan.replayed()
            pos += 1
        del recorded
        np.testing.assert_array_equal(cache.read(seq)[0], k[:, :, :pos])
        refs = _watch(cache)
        refs["plan"], refs["steps"] = weakref.ref(plan), weakref.ref(plan.captured)
        del cache
        assert _alive(refs) and plan.captured.plan is plan
        del plan
        assert not _alive(refs)


@simulated
def test_a_recording_holds_its_plan(data):
    """``with cache.decode_plan(..., steps=N).device_driven():`` holds the plan it records, unnamed."""
    k, v, cal = data
    with no_gc():
        cache = _cache(cal, "cuda", adapt=False)
        seq = cache.add_sequence(k[:, :, :START], v[:, :, :START])
        with cache.decode_plan(2, steps=2).device_driven() as plan:
            for layer in range(LAYERS):
                cache.update_layer(layer, [seq], _token(k, layer, START), _token(v, layer, START))
        plan.replayed()
        assert cache.seq_len(seq) == START + 1
        refs = _watch(cache)
        del cache, plan
        assert not _alive(refs)


# -- GPU: a StepGraph's memory returns at del --------------------------------------------------------------

gpu = pytest.mark.skipif(SIMULATED or not torch.cuda.is_available(),
                         reason="needs a CUDA device and NUMBA_ENABLE_CUDASIM=0")


def _step_graph_run(cal, k, v, dev, steps: int) -> dict:
    """A StepGraph loop on a new cache (eager, then the bucket's graph captured and replayed), checked, and
    every reference to it dropped: weak references to the cache and its storage."""
    from gaac.serving.graph import StepGraph

    cache = PagedKVCache(cal, max_seqs=2, max_blocks=8, raw_tiles=64, device=dev, adapt=False)
    rows = [cache.add_sequence(k[:, :, :START], v[:, :, :START])]
    kbuf = torch.zeros((LAYERS, 1, HEADS, 1, DIM), dtype=torch.int16, device=dev)
    vbuf = torch.zeros_like(kbuf)
    qbuf = torch.randn((cache.max_seqs, 2, DIM), device=dev).to(torch.bfloat16)
    out = torch.zeros((LAYERS, cache.max_seqs, 2, DIM), dtype=torch.bfloat16, device=dev)

    def step(plan):
        for layer in range(LAYERS):
            cache.update_layer(layer, plan.seqs, kbuf[layer], vbuf[layer])
            plan.run(qbuf, layer, out=out[layer])

    graph = StepGraph(cache, 2, step, buckets=(1,), seqs=rows)
    for t in range(steps):
        for layer in range(LAYERS):
            kbuf[layer, 0, :, 0] = torch.from_numpy(k[layer, :, START + t].view(np.int16))
            vbuf[layer, 0, :, 0] = torch.from_numpy(v[layer, :, START + t].view(np.int16))
        graph()
    torch.cuda.synchronize()
    assert graph.captures == 1 and cache.seq_len(rows[0]) == START + steps
    np.testing.assert_array_equal(cache.read(rows[0])[0], k)
    refs = _watch(cache)
    del graph, step, cache, kbuf, vbuf, qbuf, out
    torch.cuda.synchronize()
    return refs


@gpu
def test_a_step_graph_frees_its_cache_at_del():
    """A StepGraph captures and replays a model's step on a cache; dropping the graph, its cache and the step's
    buffers returns the memory allocated since before the cache was made, with the garbage collector off.
    (torch collects garbage as a capture begins; the last capture's plan is made before that, so a cycle
    through it would still show here.)

    The process's first loop compiles the kernels: numba's compiler leaves reference cycles through the
    frames that called it, and so holds the cache whose call compiled until the next collection.  A warm-up
    loop compiles them first; what is checked is a cache of a process whose kernels are built."""
    steps = 10
    rng = np.random.default_rng(12)
    k, v = (synthetic(rng, LAYERS, HEADS, START + steps, DIM) for _ in range(2))
    cal = calibrate(k, v)
    dev = torch.device("cuda")
    _step_graph_run(cal, k, v, dev, steps)
    gc.collect()
    torch.cuda.synchronize()
    with no_gc():
        before = torch.cuda.memory_allocated(dev)
        refs = _step_graph_run(cal, k, v, dev, steps)
        assert not _alive(refs)
        assert torch.cuda.memory_allocated(dev) == before
