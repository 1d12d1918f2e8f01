"""A join's host side, counted as benchmarks/join_host.py counts it (CPU, the CUDA codec in numba's simulator): the
benchmark runs, and a join waits for the device a fixed few times (README: 5 a join once the cache's shares have
seen the content, 6-7 while the arena grows), none of them in the rule's launch."""
from __future__ import annotations

import argparse

import pytest

from conftest import benchmark_module

pytest.importorskip("torch")
cuda = pytest.importorskip("numba.cuda")


def test_a_join_waits_a_fixed_few_times():
    mod = benchmark_module("join_host")
    args = argparse.Namespace(device="cpu", layers="1", kv_heads=1, head_dim=64, batch=2, base=200, prompt=296,
                              calib=64, joins=1, steps=0, runs=0, out=None, fine=False, calls=0, host_ms=2)
    r = mod.measure(args, 1)
    assert r["bare_ms"] > 0                      # the host-only joins ran, after the counted one
    (join,) = r["joins"]
    counts = join["counts"]
    assert set(counts) >= {"remove", "reserve", "rule", "encode", "decisions", "commit"}, counts
    assert counts["encode"].get("launch", 0) >= 2, counts["encode"]          # the prompt's K and V encodes
    assert counts["rule"].get("launch", 0) >= 1 and counts["rule"].get("sync", 0) == 0, counts["rule"]
    waits = sum(c.get("sync", 0) for c in counts.values())
    assert 1 <= waits <= 7, {p: c.get("sync", 0) for p, c in counts.items()}


def _fill(out):
    out[cuda.grid(1)] = 7


def test_no_kernels_skips_the_simulators_launches_and_restores_them():
    """``--host-ms``'s joins run no kernel; afterwards kernels run again."""
    import os

    import numpy as np

    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        pytest.skip("no_kernels stubs the simulator's launches")

    mod = benchmark_module("join_host")
    fill = cuda.jit(_fill)
    out = np.zeros(4, np.int32)
    with mod.no_kernels():
        fill[1, 4](out)
    assert not out.any()
    fill[1, 4](out)
    assert (out == 7).all()


def test_the_part_clock_gives_each_part_its_own_time(monkeypatch):
    """A part called inside another is taken out of the outer one's time, and what no part covers is ``other``."""
    import time

    mod = benchmark_module("join_host")

    class Owner:
        def outer(self):
            time.sleep(0.02)
            self.inner()
            time.sleep(0.02)

        def inner(self):
            time.sleep(0.03)

    monkeypatch.setattr(mod, "owners", lambda: {"Owner": Owner})
    with mod.PartClock((("Owner", "outer", "encode"), ("Owner", "inner", "rule"))) as clock:
        time.sleep(0.01)
        Owner().outer()
    assert Owner.outer.__name__ == "outer" and Owner.inner.__name__ == "inner"     # the methods restored
    assert 39 <= clock.ms["encode"] < 55, clock.ms
    assert 29 <= clock.ms["rule"] < 45, clock.ms
    assert 9 <= clock.ms["other"] < 25, clock.ms


def test_part_calls_count_each_parts_own_calls_and_leave_launches_out(monkeypatch):
    """Every Python call and builtin call goes to the innermost part it is made in (``other`` outside every
    part), and nothing inside a kernel launch is counted; the methods are put back after."""
    from gaac.cuda.epochs import Batch
    from gaac.cuda.launch import TileLauncher

    mod = benchmark_module("join_host")

    def leaf():
        return 1

    class Owner:
        def outer(self):
            leaf()
            self.inner()
            leaf()

        def inner(self):
            for _ in range(3):
                leaf()
            TileLauncher.launch(None)

    launched = []
    monkeypatch.setattr(TileLauncher, "launch", lambda *a: launched.append([leaf() for _ in range(5)]))
    monkeypatch.setattr(mod, "owners", lambda: {"Owner": Owner})
    with mod.PartCalls((("Owner", "outer", "encode"), ("Owner", "inner", "rule"))) as counted:
        leaf()
        Owner().outer()
    assert launched == [[1] * 5]                      # the launch ran, its calls uncounted
    assert Owner.outer.__name__ == "outer" and TileLauncher.launch is not None
    assert getattr(Batch._launch, "__name__", "") == "_launch"
    # encode: the call of inner (counted where it is made, once) and two leaves; rule: three leaves and the launch
    # (range is a type, whose call the profiler does not report)
    assert counted.calls["encode"] == 3, counted.calls
    assert counted.calls["rule"] == 4, counted.calls
    assert counted.calls["other"] >= 2, counted.calls  # leaf and outer, and the counter's own set-up


def test_decode_steps_take_the_plans_fast_path(monkeypatch):
    """The benchmark's decode steps append each token through their step's plan, as a serving loop does (the cache
    holds a plan only weakly: a step that drops it sends every token down update_layer's full path, and every
    finished block to the adapters as a host copy)."""
    from gaac.cache.paged import PagedKVCache

    mod = benchmark_module("join_host")
    args = argparse.Namespace(device="cpu", layers="1", kv_heads=1, head_dim=64, batch=2, base=200, prompt=296,
                              calib=64, joins=1, steps=0, runs=0, out=None, fine=False)
    cache, rows, pk, pv, tokens = mod.make_cache(args, 1)
    full = []
    update = PagedKVCache._update_layer
    monkeypatch.setattr(PagedKVCache, "_update_layer", lambda self, *a: (full.append(a[0]), update(self, *a))[1])
    before = [cache.seq_len(r) for r in rows]
    mod.decode_steps(cache, rows, tokens, 3, 0)
    assert [cache.seq_len(r) for r in rows] == [n + 3 for n in before]
    assert full == []
    cache.update_layer(0, rows, *(t[0][0][None, :, None].expand(len(rows), -1, -1, -1).contiguous() for t in tokens))
    assert full == [0]                  # without a plan, the token takes the full path (what the test tells apart)
