"""Making a paged cache asks the device for a few operations, however many layers it has: every layer and kind's
arrays are views of a few allocations and one copy from the host brings every base table and first free list
(gaac.cache.store.make_stores).  On a GPU each device allocation, write or copy costs the host microseconds
and a pinned allocation or a synchronisation far more, so a count that grows with the layers shows here as a
failure rather than as a slower time to first token.

The count runs on the CPU with the CUDA codec (numba's simulator), where every tensor is on the CPU: a tensor
made from host data (torch's ``lift_fresh``: ``torch.from_numpy``, ``torch.tensor``) and what ops on such tensors
alone make are the host's; every other op that makes or writes a tensor is a device operation, ``.to`` of a host
tensor a copy to the device, ``.cpu()``/``.tolist()``/``int()`` of a device tensor a copy back, and the cache's
``gaac.arrays.upload`` (a pinned allocation and a copy on a GPU) two operations: benchmarks/construction.py's counter, which
this test uses; that script also times it.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba")


from gaac import layout as L  # noqa: E402
from gaac.cache.paged import PagedKVCache  # noqa: E402
from gaac.cache.pools import RawArena  # noqa: E402
from gaac.cache.store import make_stores  # noqa: E402
from gaac.calibration import Calibration  # noqa: E402
from conftest import benchmark_module  # noqa: E402

MOST = 10            # device operations making a cache that cannot grow may take, whatever its layers


def calibration(layers: int, heads: int = 2, dim: int = 64, seed: int = 0) -> Calibration:
    rng = np.random.default_rng(seed)
    centre = rng.integers(112, 130, size=(2, layers, heads, dim))
    return Calibration(b3=centre - 3, b4=centre - 7, capacity=np.full((2, layers), 16), model="synthetic")


def _device_ops():
    """benchmarks/construction.py's counter (the one benchmarks/step_host.py counts with too)."""
    return benchmark_module("construction").DeviceOps


@contextlib.contextmanager
def counting():
    """Count the device operations of the block's code (``ops.total``; ``ops.by_op`` says which)."""
    with _device_ops()("cpu") as ops:
        yield ops


def make_all(cal: Calibration, grow: bool = False):
    geo = L.geometry(cal.head_dim)
    arena = RawArena(4 * cal.layers * 16, geo.channels, torch.device("cpu"))
    stores = make_stores(cal, arena, device=torch.device("cpu"), cuda=True, adapt=True, max_seqs=2, max_blocks=8,
                         n_slots=64, grow=grow)
    return stores, arena


def test_the_counter_counts_device_work():
    with counting() as ops:
        a = torch.zeros(4, dtype=torch.int32)                       # an allocation
        a[1] = 3                                                    # a write
        b = torch.from_numpy(np.arange(4, dtype=np.int32)).to("cpu")    # a copy to the device
        a.copy_(b)                                                  # a write
        int(a[0])                                                   # a copy back (and a wait)
        torch.from_numpy(np.ones(3)).long()                         # host work only
    assert dict(ops.counts) == {"alloc": 1, "write": 2, "h2d": 1, "d2h": 1, "sync": 2}, ops.by_op    # a wait each way


@pytest.mark.parametrize("grow", [False, True])
def test_making_every_layers_records_takes_a_few_device_operations(grow):
    """make_stores: independent of the layers (one allocation a slot pool where the pools may grow)."""
    counts = {}
    for layers in (2, 6):
        cal = calibration(layers)
        with counting() as ops:
            stores, arena = make_all(cal, grow)
        counts[layers] = ops.total
        assert all(s.raw.listed == arena.chunk for layer in stores for s in layer)     # every share lent its chunk
        assert all(0 in s.packed for layer in stores for s in layer)                    # the encoder's bases
    if grow:
        assert counts[6] - counts[2] == 2 * 4, counts          # one allocation per slot pool, nothing else
    else:
        assert counts[2] == counts[6] <= MOST, counts


def test_records_are_those_made_one_by_one():
    """The records' arrays hold what making them one at a time gave: zeros, the calibration's bases, the slot
    pools' lists in index order and the arena's loans in record order, each exactly its own size."""
    from gaac.tiles import tile_bases

    cal = calibration(3)
    stores, arena = make_all(cal)
    per = cal.kv_heads * L.tiles_per_head(cal.head_dim)
    for layer in range(cal.layers):
        for kind in (0, 1):
            s = stores[layer][kind]
            assert s.table.shape == (2, 8, per) and s.table.dtype == torch.int32 and not s.table.any()
            assert s.tail.shape == (2, cal.kv_heads, 16, cal.head_dim) and not s.tail.any()
            b3, b4 = cal.bases(layer, kind, 0)
            np.testing.assert_array_equal(s.b3[0].numpy(), b3)
            np.testing.assert_array_equal(s.b4[0].numpy(), b4)
            np.testing.assert_array_equal(s.tb3[0].numpy(), tile_bases(b3, b4)[0])
            assert s.slots.order.tolist() == list(range(64)) and s.slots.data.shape[0] == 64
            assert int(s.heads.abs().sum()) == 0
            i = 2 * layer + kind
            assert s.raw.order[:arena.chunk].tolist() == list(range(i * arena.chunk, (i + 1) * arena.chunk))
    assert arena.reserve == arena.size - 2 * cal.layers * arena.chunk


def test_making_a_cache_takes_a_few_device_operations():
    """PagedKVCache: the same count for 2 layers as for 6, at most MOST; with grow=True one more a slot pool."""
    counts = {}
    for grow in (False, True):
        for layers in (2, 6):
            cal = calibration(layers)
            with counting() as ops:
                PagedKVCache(cal, max_seqs=2, max_blocks=8, codec="cuda", grow=grow)
            counts[grow, layers] = ops.total
    assert counts[False, 2] == counts[False, 6] <= MOST, counts
    assert counts[True, 6] - counts[True, 2] == 2 * 4, counts


@pytest.mark.parametrize("what", ["blocks", "rows"])
def test_growth_leaves_no_shared_allocation_behind(what):
    """A cache that grows replaces every array one shared allocation holds, so that allocation goes whole and
    memory() (which counts the arrays the records hold) counts every byte still allocated."""
    cal = calibration(2)
    cache = PagedKVCache(cal, max_seqs=1, max_blocks=2, codec="cuda", grow=True)

    # the arrays before, held here so that no later allocation can take their addresses
    old = [t for layer in range(cache.layers) for s in cache.stores(layer) for t in (s.table, s.tail, s.epoch)]
    before = {t.untyped_storage().data_ptr() for t in old}
    x = np.zeros((cal.layers, cal.kv_heads, 3 * L.BLOCK_TOKENS, cal.head_dim), np.uint16)
    seq = cache.add_sequence(x, x)
    if what == "rows":
        cache.add_sequence()                     # a second row: the tables, tails and epoch indices grow
    else:
        cache.append(seq, x, x)                  # past the block table: the tables and epoch indices grow
    held = {t.untyped_storage().data_ptr() for layer in range(cache.layers) for s in cache.stores(layer)
            for t in (s.table, s.tail, s.epoch, s.heads, s.slots.data)}
    stale = before & held - ({s.tail.untyped_storage().data_ptr() for s in cache.stores(0)} if what == "blocks"
                             else set())
    assert not stale, "a replaced array's shared allocation is still held by another array"
