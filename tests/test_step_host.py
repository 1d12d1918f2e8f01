"""An eager decode step asks the device for a few operations a layer and waits for nothing; its account of the
blocks it finished and the adaptation rule's decode checks ask for a few a step, however many layers the cache
has.  On a GPU each device operation costs the host microseconds and a wait far more, and an eager step is
bound by the host, so a count that grows fails here rather than showing as a slower step.

The counts are benchmarks/step_host.py's (:class:`StepOps`, run on the CPU with the CUDA codec in numba's
simulator and the cache's GPU-only copies counted as a GPU makes them); checks come every two blocks here
(the rule's check size patched) so that a short run holds steps that launch checks and take up decisions.
"""
from __future__ import annotations

import argparse

import pytest

pytest.importorskip("torch")
pytest.importorskip("numba")

import gaac.epochs as epochs_mod  # noqa: E402
from conftest import benchmark_module  # noqa: E402

PER_LAYER = 3        # a layer: the two launches (append, attention) and the output's allocation
ACCOUNT = 8          # a step's account: fin's upload, one gather of the finished blocks, two copies (the counts' from
                     # where they lie)
CHECKS = 8           # the decode checks' batch: its inputs' upload, one zeroed allocation, the histograms' stack, every
                     # (layer, kind)'s queued blocks in one allocation and one concatenation, launches
DECISIONS = 4        # taking up a batch's decisions, besides a histogram kept per (layer, kind)


def _step_host():
    return benchmark_module("step_host")


def _run(mod, layers: int) -> dict:
    args = argparse.Namespace(device="cpu", layers=layers, kv_heads=1, head_dim=64, group=2, base=40, spacing=97,
                              calib=32, drift=0.0, warmup=2, steps=10, seed=0, time=False, simulate_attention=False)
    return mod.measure(args, 4)


def _device_ops(mod, counts: dict) -> int:
    return sum(counts.get(k, 0) for k in mod.DEVICE_OPS)


@pytest.fixture(scope="module")
def runs():
    mp = pytest.MonkeyPatch()
    mp.setattr(epochs_mod, "ADAPT_EVERY", 2)         # (no epoch before the rule's warm-up: decisions that keep)
    try:
        mod = _step_host()
        yield mod, {layers: _run(mod, layers) for layers in (2, 4)}
    finally:
        mp.undo()


def test_steady_layers_and_account(runs):
    """Every layer of every step: at most PER_LAYER device operations and no wait; the account of a step's
    finished blocks: the same few operations at 2 and at 4 layers, and no wait in a step without checks."""
    mod, by_layers = runs
    accounts = {}
    for layers, r in by_layers.items():
        finishing = 0
        for phases, _, marks, _ in r["steps"]:
            lay = phases.get("layers", {})
            assert _device_ops(mod, lay) <= PER_LAYER * layers, (layers, lay)
            assert lay.get("sync", 0) == 0, lay
            account = phases.get("account", {})
            if _device_ops(mod, account):
                finishing += 1
                assert _device_ops(mod, account) <= ACCOUNT, account
                accounts.setdefault(layers, set()).add(_device_ops(mod, account))
            if not marks:
                assert sum(c.get("sync", 0) for c in phases.values()) == 0, phases
        assert finishing >= 3
    assert accounts[2] == accounts[4]


def test_decode_checks_do_not_grow_with_layers(runs):
    """A step that launches the decode checks: one batch for every (layer, kind), whose set-up and launches
    (every (layer, kind)'s queued blocks gathered in one concatenation) are the same few operations at 2 and at 4
    layers; taking up its decisions adds one read of them and a histogram kept per (layer, kind)."""
    mod, by_layers = runs
    launched, decided = {}, {}
    for layers, r in by_layers.items():
        for phases, _, marks, _ in r["steps"]:
            if "batch" in marks:
                ops = _device_ops(mod, phases["checks"])
                assert ops <= CHECKS, phases["checks"]
                launched.setdefault(layers, []).append(ops)
            if "finish" in marks and "epoch" not in marks:      # (an epoch appended writes its tables)
                ops = _device_ops(mod, phases["decisions"])
                assert ops <= DECISIONS + 2 * layers, phases["decisions"]
                assert phases["decisions"].get("sync", 0) <= 1      # the read of the decisions
                decided.setdefault(layers, []).append(ops)
    assert launched[2] and launched[4] and any(decided.values())
    assert max(launched[4]) == max(launched[2])
