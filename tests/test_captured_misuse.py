"""A plan of device-driven steps refuses a recording or an account that would part the host's lengths from
the device's (:mod:`gaac.serving.graph`), and a refused recording leaves the cache as it was.

In the simulator a recording runs its launches eagerly, so a refused one has appended to the layers it
reached: the plan takes them back.  The sequence starts one token short of a block end, so that a first
step's appends also encode a block, whose records go back to the pools.  Caches are tiny (2 layers,
1 KV head, ``head_dim`` 64): every launch is simulated.
"""
import numpy as np
import pytest
import torch
from conftest import every_tile
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_cache import B, synthetic
from test_step import _q

from gaac.cache import PagedKVCache
from gaac.calibration import calibrate
from gaac.errors import InputError

LAYERS, START = 2, B - 1            # a sequence one token short of its first block end
_RNG = np.random.default_rng(11)
K, V = (synthetic(_RNG, LAYERS, 1, START + 4, 64) for _ in range(2))
CAL = calibrate(K, V)


def _cache():
    cache = PagedKVCache(CAL, codec="cuda", adapt=False, **every_tile(CAL, 1, 4))
    return cache, cache.add_sequence(K[:, :, :START], V[:, :, :START])


def _update(cache, seq, layer, pos):
    """``cache.update_layer`` of the token at ``pos`` to ``layer``."""
    k, v = (torch.from_numpy(np.ascontiguousarray(x[layer:layer + 1, :, pos:pos + 1]).view(np.int16)) for x in (K, V))
    cache.update_layer(layer, [seq], k, v)


def _step(cache, seq, plan, pos):
    with plan.device_driven():
        for layer in range(LAYERS):
            _update(cache, seq, layer, pos)
    plan.replayed()


def _holds(cache, seq, n):
    """The cache holds the first ``n`` tokens, on the host and the device alike."""
    assert cache.host_lengths[:, seq].tolist() == [n] * LAYERS
    assert cache.device_lengths[:, seq].tolist() == [n] * LAYERS
    got_k, got_v = cache.read(seq)
    np.testing.assert_array_equal(got_k, K[:, :, :n])
    np.testing.assert_array_equal(got_v, V[:, :, :n])


def _as_before(cache, seq, memory):
    """Nothing of a refused recording stays (the records its encodes took are free again), and a new plan's
    step appends the next token."""
    assert cache.memory() == memory
    _step(cache, seq, cache.decode_plan(1, steps=1), START)
    _holds(cache, seq, START + 1)


def test_a_layer_appended_twice_is_refused():
    cache, seq = _cache()
    memory = cache.memory()
    plan = cache.decode_plan(1, steps=2)
    with pytest.raises(InputError, match="layer 0 already took"):
        with plan.device_driven():
            _update(cache, seq, 0, START)
            _update(cache, seq, 0, START + 1)
    _as_before(cache, seq, memory)


def test_a_layer_left_out_is_refused():
    cache, seq = _cache()
    memory = cache.memory()
    plan = cache.decode_plan(1, steps=2)
    with pytest.raises(InputError, match=r"no token to layer\(s\) \[1\]"):
        with plan.device_driven():
            _update(cache, seq, 0, START)
    with pytest.raises(InputError, match="changed"):     # the plan ended with the appends it took back
        plan.replayed()
    _as_before(cache, seq, memory)


def test_replayed_once_per_step_run():
    cache, seq = _cache()
    plan = cache.decode_plan(1, steps=3)
    with pytest.raises(InputError, match="no step of this plan ran"):
        plan.replayed()                                  # nothing recorded yet
    _step(cache, seq, plan, START)
    with pytest.raises(InputError, match="no step of this plan ran"):
        plan.replayed()                                  # the one step run is accounted already
    with plan.device_driven():
        _update(cache, seq, 0, START + 1)
        with pytest.raises(InputError, match="being recorded"):
            plan.replayed()
        _update(cache, seq, 1, START + 1)
    with pytest.raises(InputError, match="not accounted"):
        with plan.device_driven():                       # the step just run awaits its account
            pass
    plan.replayed()
    _holds(cache, seq, START + 2)


def test_another_cache_is_not_changed_inside_a_recording():
    """:func:`check_not_recording` refuses a cache that records no plan while this thread records one."""
    from gaac.cache.hooks import RECORDING, check_not_recording

    cache, seq = _cache()
    other, _ = _cache()
    plan = cache.decode_plan(1, steps=1)
    check_not_recording(other)                           # no recording: anything goes
    with plan.device_driven():
        assert RECORDING.plans == [plan.captured]
        check_not_recording(cache)                       # the recording cache's own update is the plan's
        with pytest.raises(InputError, match="another cache"):
            check_not_recording(other)
        for layer in range(LAYERS):
            _update(cache, seq, layer, START)
    assert RECORDING.plans == []
    plan.replayed()
    _holds(cache, seq, START + 1)


def test_another_cache_updated_inside_a_recording_is_refused():
    cache, seq = _cache()
    other, seq_other = _cache()
    memory = cache.memory()
    plan = cache.decode_plan(1, steps=1)
    refused = False
    try:
        with plan.device_driven():
            _update(cache, seq, 0, START)
            _update(other, seq_other, 0, START)
            _update(cache, seq, 1, START)
    except InputError as e:
        refused = "another cache" in str(e)
    assert refused, "an update of another cache inside the recording was accepted"
    _holds(other, seq_other, START)
    _as_before(cache, seq, memory)


def test_attention_before_the_layers_append_is_refused():
    cache, seq = _cache()
    memory = cache.memory()
    plan = cache.decode_plan(1, steps=2)
    q = _q(np.random.default_rng(0), 1, 1, 64)
    with pytest.raises(InputError, match=r"run\(q, 1\): layer 1 has not taken"):
        with plan.device_driven():
            _update(cache, seq, 0, START)
            plan.run(q, 1)
    _as_before(cache, seq, memory)


# ----------------------------------------------------------------------------------------------
# Any order of calls: refused, or the cache holds what the accepted steps appended.

@st.composite
def _recording(draw):
    """A step's calls: every layer's append in some order, some followed by the layer's attention, then
    perhaps one misuse (an append left out or repeated, attention before the append)."""
    ops = []
    for layer in draw(st.permutations(range(LAYERS))):
        ops.append(("u", layer))
        if draw(st.booleans()):
            ops.append(("r", layer))
    fault = draw(st.sampled_from(["none", "none", "none", "drop", "repeat", "early run"]))
    at = draw(st.integers(0, len(ops) - 1))
    layer = draw(st.integers(0, LAYERS - 1))
    if fault == "drop":
        ops = [op for op in ops if op[1] != layer]
    elif fault == "repeat":
        ops.insert(at + 1, ("u", layer))
    elif fault == "early run":
        ops.insert(0, ("r", layer))
    return ops


def _expected(ops) -> tuple:
    """Whether a recording of ``ops`` is sound, and whether it appends a layer before it is refused."""
    appended = set()
    for op, layer in ops:
        if (op == "u") == (layer in appended):          # a second append, or attention before the append
            return False, bool(appended)
        appended.add(layer)
    return len(appended) == LAYERS, bool(appended)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_recording(), st.sampled_from([1, 1, 2, 0])), min_size=1, max_size=3))
def test_any_call_order_is_refused_or_appends_exactly(steps):
    """Recordings of drawn calls, each followed by drawn ``replayed()`` calls: each call is refused exactly
    where the oracle says, and the host's and the device's lengths agree with what was accepted."""
    cache, seq = _cache()
    plan = cache.decode_plan(1, steps=2)
    q = _q(np.random.default_rng(1), 1, 1, 64)
    done, ran, alive = 0, False, True          # steps accounted; a step run, unaccounted; the plan not ended
    for ops, replays in steps:
        sound, appends = _expected(ops)
        accept = alive and not ran and done < plan.steps and sound
        try:
            with plan.device_driven():
                for op, layer in ops:
                    if op == "u":
                        _update(cache, seq, layer, START + done)
                    else:
                        plan.run(q, layer)
            accepted = True
        except InputError:
            accepted = False
        assert accepted == accept, (ops, alive, ran, done)
        if accepted:
            ran = True
            event("a step recorded")
        elif alive and not ran and done < plan.steps and appends:
            alive = False                      # its appends were taken back: the plan ended
            event("a refused step's appends taken back")
        for _ in range(replays):
            try:
                plan.replayed()
                accounted = True
            except InputError:
                accounted = False
            assert accounted == (alive and ran), (alive, ran)
            if accounted:
                done, ran = done + 1, False
                event("a step accounted")
    assert cache.host_lengths[:, seq].tolist() == [START + done] * LAYERS
    assert cache.device_lengths[:, seq].tolist() == [START + done + ran] * LAYERS
    got_k, _ = cache.read(seq)
    np.testing.assert_array_equal(got_k, K[:, :, :START + done])
