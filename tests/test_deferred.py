"""A deferral of update_layer calls (PagedKVCache.deferred): a prompt given a layer at a time is one transaction.

A prompt through ``update_layer`` inside a deferral leaves the cache exactly as ``append`` of the same tokens and
as the same calls outside one (decoded contents, block epochs, calibration epochs, adapters, lengths), with the
reference codec and the host rule and with the CUDA codec and the rule on the device (numba's simulator, the
warm-up shortened so that epochs are appended); it is one ``_apply`` over every layer.  Anything else that touches
the cache applies the queue first; a block that raises, or a flush that runs a pool dry, writes nothing.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import gaac.epochs as epochs
from conftest import every_tile
from gaac import layout as L
from gaac.cache import PagedKVCache
from gaac.calibration import calibrate
from gaac.errors import InputError, PoolExhaustedError
from test_cache import assert_same_epochs, synthetic
from test_epochs import drifting_cache
from test_release import _alive, _watch, no_gc

pytestmark = pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaPerformanceWarning")

LAYERS = 2


def _bits(x) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x).view(np.int16))


@pytest.fixture(scope="module")
def drift():
    """K and V ``[2 layers, 1 head, 20 blocks, 64]`` (the simulator is slow), and a calibration on their first
    128 tokens: with the warm-up shortened, the check at block 16 appends an epoch in every layer and kind."""
    x = drifting_cache(20 * L.BLOCK_TOKENS + 3, layers=2 * LAYERS)[:, :1]
    k, v = x[:LAYERS], x[LAYERS:] ^ 0x8000          # V: other signs, the same exponents
    return k, v, calibrate(k[:, :, :128], v[:, :, :128])


@pytest.fixture(scope="module")
def small():
    rng = np.random.default_rng(3)
    k, v = (synthetic(rng, LAYERS, 2, 120, 64) for _ in range(2))
    return k, v, calibrate(k[:, :, :64], v[:, :, :64])


def _spy_apply(monkeypatch) -> list:
    """The layers of each transaction (``_apply``) the caches run, in order."""
    calls = []
    real = PagedKVCache._apply

    def spy(self, updates):
        calls.append(sorted(u.layer for u in updates))
        return real(self, updates)

    monkeypatch.setattr(PagedKVCache, "_apply", spy)
    return calls


def _state(cache, seq) -> dict:
    """What a cache holds of ``seq`` and of its rule: contents, lengths, block epochs, epochs, adapters."""
    out = {"lens": cache.host_lengths[:, seq].tolist(), "device_lens": cache.device_lengths[:, seq].tolist(),
           "blocks_encoded": cache.blocks_encoded, "contents": [], "epochs": [], "adapters": []}
    for layer in range(cache.layers):
        out["contents"].append([x[0].numpy().copy() for x in cache.read_layer(layer, [seq])])
        for store in cache.stores(layer):
            n = cache.seq_len(seq, layer) // L.BLOCK_TOKENS
            out["epochs"].append((store.epochs[seq, :n].tolist(),
                                  None if store.epoch is None else store.epoch[seq, :n].tolist(), store.published))
            cache._flush_all()                     # the adapters observe every block they are owed
            a = store.adapter
            out["adapters"].append(None if a is None else (a.finalized, a.epoch, a.hist.tolist(),
                                                           [np.asarray(r).tolist() for r in a._recent]))
    return out


def _same_state(a: dict, b: dict) -> None:
    for key in ("lens", "device_lens", "blocks_encoded", "epochs", "adapters"):
        assert a[key] == b[key], key
    for x, y in zip(a["contents"], b["contents"]):
        assert all(np.array_equal(p, q) for p, q in zip(x, y))


@pytest.mark.parametrize("on_device, start", [(False, 0), (False, 8 * L.BLOCK_TOKENS + 5), (True, 0)],
                         ids=["host rule, new sequence", "host rule, after a tail", "device rule, new sequence"])
def test_a_prompt_by_layer_in_a_deferral_is_what_append_and_update_layer_make(monkeypatch, drift, on_device, start):
    """The same prompt through ``append``, ``update_layer`` a layer at a time, and the same calls in a deferral:
    the deferral's is one transaction over both layers and leaves what the other two leave.  With the
    rule on the device (the CUDA codec, a join's case: a new sequence's blocks encoded where its input holds
    them, read when the queue is applied) and on the host with the reference codec, from a block boundary and
    from a tail."""
    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 8)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    k, v, cal = drift
    calls = _spy_apply(monkeypatch)

    def run(way: str, device_rule: bool):
        cache = PagedKVCache(cal, **every_tile(cal, 1, 40), codec="cuda" if device_rule else "reference")
        cache._rule_on_device = device_rule
        seq = cache.add_sequence(k[:, :, :start], v[:, :, :start]) if start else cache.add_sequence()
        calls.clear()
        rest = k[:, :, start:], v[:, :, start:]
        if way == "append":
            cache.append(seq, *rest)
        elif way == "by layer":
            for layer in range(LAYERS):
                cache.update_layer(layer, [seq], _bits(rest[0][layer][None]), _bits(rest[1][layer][None]))
        else:
            with cache.deferred():
                for layer in range(LAYERS):
                    cache.update_layer(layer, [seq], _bits(rest[0][layer][None]), _bits(rest[1][layer][None]))
                assert len(cache._queued) == LAYERS and calls == []      # queued, nothing written yet
            assert not cache.deferring and not cache._queued
        assert calls == ([[0, 1]] if way != "by layer" else [[0], [1]])
        return cache, _state(cache, seq)

    # What append makes with the host rule and the reference codec is what every way must make (the device rule
    # decides what the host rule decides: test_epochs_device), so the simulator's slow kernels run only for
    # the deferral itself where the rule is on the device.
    anchor, want_state = run("append", False)
    assert anchor.calibration.n_epochs(1, L.KIND_V) > 1                  # epochs were appended
    for way in ("deferred",) if on_device else ("by layer", "deferred"):
        cache, state = run(way, on_device)
        _same_state(state, want_state)
        assert_same_epochs(cache.calibration, anchor.calibration)
    want = [np.concatenate([k[layer], v[layer]]) for layer in range(LAYERS)]
    for layer in range(LAYERS):
        assert np.array_equal(np.concatenate(state["contents"][layer]).view(np.uint16), want[layer])


def test_a_read_inside_the_deferral_applies_the_queue_first(small, monkeypatch):
    k, v, cal = small
    calls = _spy_apply(monkeypatch)
    ref = PagedKVCache(cal, **every_tile(cal, 1, 16))
    r = ref.add_sequence(k[:, :, :100], v[:, :, :100])
    cache = PagedKVCache(cal, **every_tile(cal, 1, 16))
    seq = cache.add_sequence()
    calls.clear()
    with cache.deferred():
        assert cache.deferring
        cache.update_layer(0, [seq], k[0:1, :, :100], v[0:1, :, :100])
        cache.update_layer(1, [seq], k[1:2, :, :100], v[1:2, :, :100])
        assert calls == [] and cache._lens[:, seq].tolist() == [0, 0]
        assert cache.seq_len(seq, 1) == 100               # a read applies both layers, in one transaction
        assert calls == [[0, 1]] and not cache._queued
        for layer in range(LAYERS):
            assert all(torch.equal(a, b) for a, b in zip(cache.read_layer(layer, [seq]), ref.read_layer(layer, [r])))
        # the storage interface where a loop starts a step applies the queue too
        cache.update_layer(0, [seq], k[0:1, :, 100:110], v[0:1, :, 100:110])
        assert cache.host_lengths[0, seq] == 110 and calls == [[0, 1], [0]]
        # a second call for a layer already queued applies the first; a one-token call applies the queue
        cache.update_layer(1, [seq], k[1:2, :, 100:105], v[1:2, :, 100:105])
        cache.update_layer(1, [seq], k[1:2, :, 105:110], v[1:2, :, 105:110])
        assert calls[-1] == [1] and cache._lens[1, seq] == 105 and len(cache._queued) == 1
        cache.update_layer(0, [seq], k[0:1, :, 110:111], v[0:1, :, 110:111])
        assert cache._lens[:, seq].tolist() == [111, 110] and not cache._queued
        cache.update_layer(1, [seq], k[1:2, :, 110:111], v[1:2, :, 110:111])
    ref.append(r, k[:, :, 100:111], v[:, :, 100:111])
    for layer in range(LAYERS):
        assert all(torch.equal(a, b) for a, b in zip(cache.read_layer(layer, [seq]), ref.read_layer(layer, [r])))


def test_another_threads_update_applies_the_queue_and_runs_at_once(small):
    k, v, cal = small
    cache = PagedKVCache(cal, **every_tile(cal, 2, 16))
    a, b = cache.add_sequence(), cache.add_sequence()
    with cache.deferred():
        cache.update_layer(0, [a], k[0:1, :, :40], v[0:1, :, :40])

        def other():
            cache.update_layer(0, [b], k[0:1, :, :20], v[0:1, :, :20])

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert cache._lens[0, [a, b]].tolist() == [40, 20] and not cache._queued


def test_a_block_that_raises_writes_nothing(small):
    k, v, cal = small
    cache = PagedKVCache(cal, **every_tile(cal, 1, 16))
    seq = cache.add_sequence(k[:, :, :37], v[:, :, :37])
    before, encoded = bytes(cache.export_sequence(seq)), cache.blocks_encoded
    with pytest.raises(RuntimeError, match="the model failed"):
        with cache.deferred():
            cache.update_layer(0, [seq], k[0:1, :, 37:90], v[0:1, :, 37:90])
            cache.update_layer(1, [seq], k[1:2, :, 37:90], v[1:2, :, 37:90])
            raise RuntimeError("the model failed")
    assert not cache.deferring and not cache._queued
    assert bytes(cache.export_sequence(seq)) == before and cache.blocks_encoded == encoded
    assert cache.host_lengths[:, seq].tolist() == [37, 37]
    # bad input raises at the call, as outside a deferral, and leaves what was queued queued
    with cache.deferred():
        cache.update_layer(0, [seq], k[0:1, :, 37:90], v[0:1, :, 37:90])
        with pytest.raises(InputError, match="not in the cache"):
            cache.update_layer(1, [5], k[1:2, :, 37:90], v[1:2, :, 37:90])
        with pytest.raises(InputError, match="must both be"):
            cache.update_layer(1, [seq], k[1:2, :, 37:90], v[1:2, :, 37:80])
        with pytest.raises(InputError, match="out of range"):
            cache.update_layer(2, [seq], k[1:2, :, 37:90], v[1:2, :, 37:90])
        with pytest.raises(PoolExhaustedError, match="block table holds 16"):
            cache.update_layer(1, [seq], np.tile(k[1:2], (1, 1, 3, 1)), np.tile(v[1:2], (1, 1, 3, 1)))
        assert len(cache._queued) == 1 and cache._lens[0, seq] == 37
        cache.update_layer(1, [seq], k[1:2, :, 37:90], v[1:2, :, 37:90])
        with pytest.raises(InputError, match="do not nest"):
            cache.deferred().start()
    assert cache.host_lengths[:, seq].tolist() == [90, 90]
    d = cache.deferred().start()
    d.discard()
    with pytest.raises(InputError, match="not open"):
        d.apply()


@pytest.mark.parametrize("codec", ["reference", "cuda"])
def test_a_pool_run_dry_at_the_flush_refuses_every_layer(small, codec):
    """Each layer's tiles alone fit; the flush needs them all, the arena runs dry and nothing is written."""
    k, v, cal = small
    per = cal.kv_heads * L.tiles_per_head(cal.head_dim)
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=16, raw_tiles=8 * per, codec=codec)
    seq = cache.add_sequence(k[:, :, :21], v[:, :, :21])
    other = cache.add_sequence()
    before = [bytes(cache.export_sequence(seq))]
    lens, encoded, free = cache.host_lengths.copy(), cache.blocks_encoded, cache._arena.available()
    with pytest.raises(PoolExhaustedError, match="exhausted"):
        with cache.deferred():
            for layer in range(LAYERS):
                cache.update_layer(layer, [seq], k[layer:layer + 1, :, 21:], v[layer:layer + 1, :, 21:])
    assert not cache.deferring and not cache._queued
    assert bytes(cache.export_sequence(seq)) == before[0]
    assert np.array_equal(cache.host_lengths, lens) and cache.blocks_encoded == encoded
    assert cache._arena.available() == free and cache.seq_len(other) == 0
    # the same calls outside a deferral: the first layer goes in, the second is refused
    cache.update_layer(0, [seq], k[0:1, :, 21:], v[0:1, :, 21:])
    with pytest.raises(PoolExhaustedError, match="exhausted"):
        cache.update_layer(1, [seq], k[1:2, :, 21:], v[1:2, :, 21:])


def test_a_cache_with_an_open_deferral_is_freed(small):
    k, v, cal = small
    with no_gc():
        cache = PagedKVCache(cal, **every_tile(cal, 1, 16))
        seq = cache.add_sequence()
        deferral = cache.deferred().start()
        cache.update_layer(0, [seq], k[0:1, :, :40], v[0:1, :, :40])
        refs = _watch(cache)
        del cache, deferral
        assert _alive(refs) == []
