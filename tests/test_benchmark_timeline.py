"""benchmarks/report.py's ``timeline`` turns torch's profiler's GPU spans into what a report says of a call: runs of
one kernel merged, the time the GPU ran something, and the gaps in which it ran nothing (the host's turns)."""
from __future__ import annotations

import random

from conftest import benchmark_module

report = benchmark_module("report")


def test_runs_merge_only_near_spans_of_one_name():
    t = report.timeline([(100, 110, "enc"), (150, 160, "enc"), (400, 420, "enc"), (420, 430, "copy")],
                        join_us=100, idle_us=1000)
    assert t["runs"] == [[0.0, 60.0, 2, "enc"], [300.0, 320.0, 1, "enc"], [320.0, 330.0, 1, "copy"]]
    assert t["span_us"] == 330.0 and t["busy_us"] == 50.0 and t["idle"] == []


def test_overlapping_spans_count_once_and_gaps_name_their_neighbours():
    # a copy overlapping the scan, a long idle gap, then phases
    spans = [(0, 1000, "scan"), (500, 1200, "copy"), (1300, 1400, "copy"), (5000, 5600, "phase")]
    t = report.timeline(spans, join_us=50, idle_us=500)
    assert t["busy_us"] == 1200 + 100 + 600
    assert t["idle"] == [[1400.0, 5000.0, "copy", "phase"]]
    assert t["span_us"] == 5600.0


def test_busy_and_idle_partition_the_span_of_random_spans():
    rng = random.Random(3)
    for _ in range(50):
        spans = []
        for _ in range(rng.randint(1, 30)):
            a = rng.uniform(0, 10_000)
            spans.append((a, a + rng.uniform(0, 800), rng.choice("abc")))
        t = report.timeline(spans, join_us=200, idle_us=0)
        # the union of the spans, by brute force on a grid of 1 us
        t0 = min(a for a, _, _ in spans)
        grid = [False] * (int(max(b for _, b, _ in spans) - t0) + 2)
        for a, b, _ in spans:
            for i in range(int(a - t0), int(b - t0)):
                grid[i] = True
        covered = sum(grid)
        assert abs(t["busy_us"] - covered) <= len(spans) + 1
        gaps = sum(b - a for a, b, _, _ in t["idle"])
        assert abs(t["busy_us"] + gaps - t["span_us"]) < 1e-6
        assert sum(n for _, _, n, _ in t["runs"]) == len(spans)


def test_no_spans():
    assert report.timeline([]) == {"runs": [], "busy_us": 0.0, "span_us": 0.0, "idle": []}
