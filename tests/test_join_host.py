"""A join's host side, counted as benchmarks/join_host.py counts it (CPU, the CUDA codec in numba's simulator): the
benchmark runs, and a join waits for the device a fixed few times (README: 5 a join once the cache's shares have
seen the content, 6-7 while the arena grows), none of them in the rule's launch."""
from __future__ import annotations

import argparse

import pytest

from conftest import benchmark_module

pytest.importorskip("torch")
pytest.importorskip("numba")


def test_a_join_waits_a_fixed_few_times():
    mod = benchmark_module("join_host")
    args = argparse.Namespace(device="cpu", layers="1", kv_heads=1, head_dim=64, batch=2, base=200, prompt=296,
                              calib=64, joins=1, steps=0, runs=0, out=None, fine=False)
    r = mod.measure(args, 1)
    (join,) = r["joins"]
    counts = join["counts"]
    assert set(counts) >= {"remove", "reserve", "rule", "encode", "decisions", "commit"}, counts
    assert counts["encode"].get("launch", 0) >= 2, counts["encode"]          # the prompt's K and V encodes
    assert counts["rule"].get("launch", 0) >= 1 and counts["rule"].get("sync", 0) == 0, counts["rule"]
    waits = sum(c.get("sync", 0) for c in counts.values())
    assert 1 <= waits <= 7, {p: c.get("sync", 0) for p, c in counts.items()}


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
