"""benchmarks/serving.py times BF16's and GAAC's runs of a scenario in alternating windows, both runs live, so that
a host whose speed drifts moves both alike; where both do not fit on the device, one runs after the other.  These
tests drive its :func:`run_pair` with stand-in runs that record which steps ran in which order."""
from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
from conftest import benchmark_module  # noqa: E402


@pytest.fixture(scope="module")
def serving():
    mod = benchmark_module("serving")
    saved = mod.SMOKE, mod.ds.SMOKE
    mod.SMOKE = mod.ds.SMOKE = True           # no CUDA events or synchronisation: the stand-ins run on the host
    yield mod
    mod.SMOKE, mod.ds.SMOKE = saved


def stand_in(serving, name: str, log: list, fail_setup=None):
    """A run function's generator as run_bf16 / run_gaac are: set up, then yield its step, then finish with the
    figures it is sent."""
    def make():
        if fail_setup is not None and fail_setup():
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        log.append((name, "setup"))
        res = yield serving.Arm(lambda j: log.append((name, j)))
        res["finished"] = name
        return res
    return make


def args(steps: int, interleave: int, warmup: int = 3):
    return argparse.Namespace(steps=steps, interleave=interleave, warmup=warmup)


def steps_of(log: list, name: str) -> list:
    return [j for n, j in log if n == name and j != "setup"]


def test_windows_alternate_and_each_run_gets_its_steps(serving):
    log = []
    out = serving.run_pair({"a": stand_in(serving, "a", log), "b": stand_in(serving, "b", log)},
                           args(steps=10, interleave=4))
    assert steps_of(log, "a") == list(range(3, 13)) and steps_of(log, "b") == list(range(3, 13))
    runs = [n for n, j in log if j != "setup"]
    # windows of 4, 4, 2 steps, the order reversed each round: a b b a a b
    assert runs == ["a"] * 4 + ["b"] * 8 + ["a"] * 6 + ["b"] * 2
    assert log[:2] == [("a", "setup"), ("b", "setup")]          # both live before the first timed step
    for name in "ab":
        assert out[name]["finished"] == name and out[name]["steps"] == 10 and out[name]["windows"] == 3
        assert "note" not in out[name]


def test_interleave_zero_runs_one_after_the_other(serving):
    log = []
    out = serving.run_pair({"a": stand_in(serving, "a", log), "b": stand_in(serving, "b", log)},
                           args(steps=5, interleave=0))
    assert log == [("a", "setup"), *[("a", j) for j in range(3, 8)], ("b", "setup"), *[("b", j) for j in range(3, 8)]]
    assert out["a"]["windows"] == out["b"]["windows"] == 1


def test_runs_that_do_not_fit_together_run_alone_and_say_so(serving):
    log = []
    b_made = []

    def b_fails_beside_a():          # the second run's set-up runs out of memory while the first is live, once
        b_made.append(1)
        return len(b_made) == 1

    out = serving.run_pair({"a": stand_in(serving, "a", log), "b": stand_in(serving, "b", log, b_fails_beside_a)},
                           args(steps=6, interleave=2))
    assert log == [("a", "setup"), *[("a", j) for j in range(3, 9)], ("b", "setup"), *[("b", j) for j in range(3, 9)]]
    assert "both did not fit" in out["a"]["note"] and "both did not fit" in out["b"]["note"]
    assert out["a"]["finished"] == "a" and out["b"]["finished"] == "b"


def test_a_run_that_fails_is_reported_and_the_other_still_runs(serving):
    log = []

    def broken():
        raise ValueError("set-up failed")
        yield  # pragma: no cover

    out = serving.run_pair({"a": broken, "b": stand_in(serving, "b", log)}, args(steps=4, interleave=2))
    assert "ValueError: set-up failed" in out["a"]["error"]
    assert steps_of(log, "b") == [3, 4, 5, 6] and out["b"]["steps"] == 4


def test_each_pair_of_windows_gives_a_ratio_and_the_report_lists_them(serving):
    log = []
    out = serving.run_pair({"bf16_eager": stand_in(serving, "a", log), "gaac_eager": stand_in(serving, "b", log)},
                           args(steps=6, interleave=2))
    assert len(out["bf16_eager"]["window_ms"]) == len(out["gaac_eager"]["window_ms"]) == 3
    out["bf16_eager"]["window_ms"] = [2.0, 3.0, 4.0]
    out["gaac_eager"]["window_ms"] = [1.0, 2.0, 5.0]
    assert serving.window_ratios(out["bf16_eager"], out["gaac_eager"]) == [2.0, 1.5, 0.8]
    assert serving.window_ratios({"window_ms": [2.0]}, {"window_ms": [1.0]}) == []       # one window: no pairs
    rep = {"date": "d", "device": "cpu", "commit": "c", "command": "serving.py", "steps": 6, "warmup": 3,
           "cal_tokens": 1024, "interleave": 2, "scenarios": {
               "s": {"batch": 1, "context": 8, "every": 0, "prompt": 0, "target_graph": 1.0, "target_eager": 1.0,
                     **out}}}
    text = serving.render(rep)
    assert "- s eager: BF16 / GAAC ms of each pair of windows 2.000, 1.500, 0.800 (min 0.800, max 2.000)" in text
    assert "diagnostic run" not in text
    # a run with the loop altered says so in its header
    rep["join_drain"] = True
    marked = [x for x in serving.render(rep).splitlines() if x.startswith("- a diagnostic run, not the user's loop")]
    assert len(marked) == 1 and "`--join-drain`" in marked[0] and "`--join-profile`" not in marked[0]


def test_a_run_kept_from_an_earlier_report_keeps_its_isolated_attention_marked(serving):
    """``--isolate``'s figures reach the report, a run merged from an earlier one marked * as its row is, and the
    layers' spread names the slowest layer's raw share."""
    log = []
    out = serving.run_pair({"bf16_graph": stand_in(serving, "a", log), "gaac_graph": stand_in(serving, "b", log)},
                           args(steps=2, interleave=2))
    iso = {"plan_us": 94.8, "plan_kernel_us": 90.6, "plan_merge_us": 16.5, "step_fused_us": 114.3,
           "plan_splits": [196, 21], "raw_tiles_share": 0.0042, "bucket1_us": 93.9,
           "layer_us": [87.3, 97.2, 90.0], "layer_raw": [0.0029, 0.0024, 0.0136]}
    out["gaac_graph"].update(isolate=iso, earlier=True)
    rep = {"date": "d", "device": "cpu", "commit": "c", "command": "serving.py", "steps": 2, "warmup": 3,
           "cal_tokens": 1024, "interleave": 2, "scenarios": {
               "s": {"batch": 1, "context": 8, "every": 0, "prompt": 0, "target_graph": 1.0, "target_eager": 1.0,
                     **out}}}
    line = next(x for x in serving.render(rep).splitlines() if x.startswith("- s* gaac_graph: AttentionPlan"))
    assert "AttentionPlan 94.8 (kernel 90.6, merge alone 16.5), one-step plan with the fused merge 114.3" in line
    assert "splits 196 of 21 blocks; raw tiles 0.42%; the bucket's kernel and merge 93.9" in line
    assert line.endswith("by layer 87.3-97.2 (raw tiles 0.24-1.36%, the slowest layer's 0.24%)")


def test_a_merged_report_names_each_kept_runs_commit_once(serving):
    """Runs kept from an earlier report keep the commit they ran at, and the header names the kept runs' commits
    once each, however many reports they passed through (an older report's nested header included)."""
    old = {"commit": "aaaaaaa (runs marked *: bbbbbbb (runs marked *: ccccccc))", "scenarios": {
        "s": {"gaac_graph": {"ms": 1.0}, "bf16_graph": {"ms": 1.1}},
        "t": {"gaac_graph": {"ms": 2.0, "earlier": True}, "bf16_graph": {"ms": 2.2, "earlier": True}},
        "u": {"gaac_graph": {"ms": 3.0}, "bf16_graph": {"ms": 3.3}}}}
    rep = {"date": "d", "device": "cpu", "commit": "ddddddd", "command": "serving.py",
           "steps": 2, "warmup": 3, "cal_tokens": 1024, "interleave": 0}
    serving.keep_earlier(rep, old)
    assert rep["scenarios"]["s"]["gaac_graph"]["commit"] == "aaaaaaa"
    assert rep["scenarios"]["t"]["gaac_graph"]["commit"] == "bbbbbbb"
    for sc in ("s", "t", "u"):
        rep["scenarios"][sc].update({"batch": 1, "context": 8, "every": 0, "prompt": 0, "target_graph": 1.0,
                                     "target_eager": 1.0})
    # a new run replaces u's pair: its commit leaves the header's list
    rep["scenarios"]["u"].update(gaac_graph={"ms": 3.0, "commit": "ddddddd"}, bf16_graph={"ms": 3.3, "commit": "ddddddd"})
    header = next(x for x in serving.render(rep).splitlines() if x.startswith("- commit"))
    assert header == "- commit: ddddddd (runs marked *: aaaaaaa, bbbbbbb)"
    # merged again, the runs keep their own commits and the header stays one level deep
    again = {"commit": "eeeeeee", "date": "d", "device": "cpu", "command": "serving.py",
             "steps": 2, "warmup": 3, "cal_tokens": 1024, "interleave": 0}
    serving.keep_earlier(again, json.loads(json.dumps(rep)))
    header = next(x for x in serving.render(again).splitlines() if x.startswith("- commit"))
    assert header == "- commit: eeeeeee (runs marked *: aaaaaaa, bbbbbbb, ddddddd)"


def test_joins_drain_the_queue_before_each_join_and_profile_only_the_joins(serving, monkeypatch):
    """--join-drain: the device is synchronised before each join and that wait kept apart from the join's time;
    --join-profile: the profiler runs around the joins and nothing else."""
    import cProfile
    import pstats

    calls = []
    monkeypatch.setattr(serving.ds, "sync", lambda: calls.append("sync"))

    def join_row(row):
        calls.append(("join", row))

    def not_a_join():
        calls.append("step")

    prof = cProfile.Profile()
    joins = serving.Joins(join_row, 4, 3, drain=True, prof=prof)
    for j in range(12):
        joins(j)
        not_a_join()
    rows = [serving.replaced(j, 4, 3) for j in range(12)]
    want = []
    for row in rows:
        want += ["sync", ("join", row), "step"] if row is not None else ["step"]
    assert calls == want
    assert [j for j, _ in joins.timed] == [j for j, _ in joins.drained] == [3, 7, 11]
    assert joins.drained_since(7) == [ms for j, ms in joins.drained if j >= 7] and len(joins.since(4)) == 2
    profiled = {fn for _, _, fn in pstats.Stats(prof).stats}
    assert "join_row" in profiled and "not_a_join" not in profiled
