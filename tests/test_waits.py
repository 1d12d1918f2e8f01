"""The cache's bookkeeping waits for the device once where it must read it, however many layers and kinds are
involved: lending raw records after reading the shares' counts, taking every free record back, removing a
sequence and appending epochs.  A serving loop joins a sequence (a removal and a prompt) while captured steps
are queued on the GPU; each wait drains that queue and leaves the GPU idle while the host goes on, so a wait
per layer and kind shows here as a failure rather than as a slower join.

Counted on the CPU with benchmarks/construction.py's counter (the numba simulator's CUDA codec: device free
lists, whose counts a GPU reads back), as tests/test_construction.py counts making a cache.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba")

from gaac.cache.paged import PagedKVCache  # noqa: E402
from gaac.cache.pools import RawArena  # noqa: E402
from gaac.tiles import tile_bases  # noqa: E402
from tests.test_construction import calibration, counting, make_all  # noqa: E402

CPU = torch.device("cpu")


def device_arena(n, shares):
    arena = RawArena(n, 64, CPU)
    return arena, [arena.share(f"share {i}", torch.zeros(2, dtype=torch.int32), 1) for i in range(shares)]


def records(arena, shares):
    """Every record once: the reserve's and each share's free ones (no share holds a tile here)."""
    held = [r for s in shares for r in s._rest().tolist()] + arena._stack[:arena.reserve].tolist()
    return sorted(held)


def _taken(shares, k):
    """The device takes ``k`` records of each share (an encode), unseen by the host until it reads the counts."""
    for s in shares:
        s.heads[s.cls] += k
        s.pending += k


@pytest.mark.parametrize("n_shares", [4, 8])
def test_lending_to_shares_that_hold_records_waits_once(n_shares):
    """Every share short, each holding records an encode took from: one read of their counts, then the loans
    (before, each loan read its share's count again)."""
    arena, shares = device_arena(64 * n_shares, n_shares)
    assert arena.cover([(s, arena.chunk) for s in shares]) == []
    _taken(shares, 1)
    with counting() as ops:
        assert arena.cover([(s, 2 * arena.chunk) for s in shares]) == []
    assert ops.counts["sync"] == 1, ops.by_op
    assert [s.n_free() for s in shares] == [2 * arena.chunk] * n_shares
    assert len(records(arena, shares)) == 64 * n_shares - n_shares        # the taken ones are held


def test_loans_that_fit_the_lists_are_one_read_and_one_copy():
    """Loans to shares whose free-list arrays have room: the counts read once, every loan brought to the device
    in one copy and written past its list's end (the arrays, and the plans made with them, stay)."""
    arena, shares = device_arena(256, 4)
    assert arena.cover([(s, arena.chunk) for s in shares]) == []
    arrays_before = [(s.order, s.version) for s in shares]
    with counting() as later:
        assert arena.cover([(s, 3 * arena.chunk) for s in shares]) == []
    assert later.counts["sync"] == 1, later.by_op
    # the later loans fit the lists' arrays: brought to the device in one copy, written past each list's end,
    # no new array
    assert later.counts["h2d"] == 1 and later.counts["write"] == 4, later.by_op
    assert later.counts["alloc"] == later.by_op["alloc:stack"] == 1, later.by_op     # only the counts' read
    assert all(s.order is order and s.version == version for s, (order, version) in zip(shares, arrays_before))
    assert [s.n_free() for s in shares] == [3 * arena.chunk] * 4
    assert len(records(arena, shares)) == 256


def test_a_guess_lent_in_place_by_the_lower_bounds_reads_no_count():
    """A guess's loans (``read=False``) to shares whose lists have room, each holding records an encode took
    unseen: lent by the lower bounds past each list's end without reading a count (a join's reservation then
    does not wait for the steps queued ahead); every share holds at least what it asked, every record once.  A
    loan that does not fit its list's array reads the counts, as without ``read=False``."""
    arena, shares = device_arena(256, 4)
    assert arena.cover([(s, arena.chunk) for s in shares]) == []
    _taken(shares, 1)
    arrays_before = [s.order for s in shares]
    fresh = device_arena(256, 4)
    assert not fresh[0].covers_unread([(s, 1) for s in fresh[1]])      # empty lists: their first loans read
    assert arena.covers_unread([(s, 2 * arena.chunk) for s in shares])
    with counting() as ops:
        assert arena.cover([(s, 2 * arena.chunk) for s in shares], read=False) == []
    assert ops.counts["sync"] == 0, ops.by_op
    assert all(s.order is order for s, order in zip(shares, arrays_before))
    assert all(s.n_free() >= 2 * arena.chunk for s in shares)
    assert len(records(arena, shares)) == 256 - 4                       # the taken ones are held
    _taken(shares, 1)
    assert not arena.covers_unread([(shares[0], shares[0].order.shape[0] + 1)])
    with counting() as ops:
        assert arena.cover([(shares[0], shares[0].order.shape[0] + 1)], read=False) == []
    assert ops.counts["sync"] >= 1, ops.by_op
    assert len(records(arena, shares)) == 256 - 8


@pytest.mark.parametrize("n_shares", [4, 8])
def test_taking_every_free_record_back_reads_them_in_one_copy(n_shares):
    """An ask the reserve cannot cover but every free record can: the shares' free records return in one copy
    to the host, whatever the shares, and the one share asked is lent all it asks."""
    n = 16 * n_shares
    arena, shares = device_arena(n, n_shares)
    assert arena.cover([(s, n // n_shares) for s in shares]) == []     # the whole arena lent
    assert arena.reserve == 0
    _taken(shares, 1)
    ask = n - n_shares - 1
    with counting() as ops:
        assert arena.cover([(shares[0], ask)]) == []
    assert ops.counts["sync"] <= 3, ops.by_op                         # the ask, every count, the records
    assert shares[0].n_free() == ask and all(s.n_free() == 0 for s in shares[1:])
    assert len(records(arena, shares)) == n - n_shares


def test_appending_epochs_waits_for_nothing():
    """A store's new epochs reach the device in one asynchronous copy (four blocking copies a store before)."""
    cal = calibration(2)
    stores, _ = make_all(cal)
    store = stores[1][0]
    rng = np.random.default_rng(0)
    tables = [tuple(rng.integers(100, 130, size=(cal.kv_heads, cal.head_dim)).astype(np.uint8) for _ in range(2))
              for _ in range(3)]
    with counting() as ops:
        store.add_epochs(tables)
    assert ops.counts["sync"] == 0 and ops.counts["h2d"] == 1, ops.by_op
    assert store.b3.shape[0] == store.tb4.shape[0] == 4
    assert ops.by_op.get("alloc:cat", 0) == 1, ops.by_op                # the four tables: one concatenation
    for e, (b3, b4) in enumerate(tables, start=1):
        np.testing.assert_array_equal(store.b3[e].numpy(), b3)
        np.testing.assert_array_equal(store.b4[e].numpy(), b4)
        tb3, tb4 = tile_bases(b3, b4)
        np.testing.assert_array_equal(store.tb3[e].numpy(), tb3)
        np.testing.assert_array_equal(store.tb4[e].numpy(), tb4)
    np.testing.assert_array_equal(store.b3[0].numpy(), cal.bases(1, 0, 0)[0])   # epoch 0 kept
    np.testing.assert_array_equal(store.tb4[0].numpy(), tile_bases(*cal.bases(1, 0, 0))[1])
    assert all(getattr(store, name).is_contiguous() for name in ("b3", "b4", "tb3", "tb4"))


def test_every_stores_new_epochs_are_one_copy_and_one_concatenation():
    """A prompt that appends epochs in every layer and kind joins every store's four tables, old rows and new, in
    one concatenation (one a store before), each store's tables views of it holding what they held and the new
    epochs; a later append to one store moves its tables alone, the others' unchanged."""
    from gaac.cache.store import add_epochs_all

    cal = calibration(4)
    stores, _ = make_all(cal)
    rng = np.random.default_rng(1)

    def new_tables(n):
        return [tuple(rng.integers(100, 130, size=(cal.kv_heads, cal.head_dim)).astype(np.uint8) for _ in range(2))
                for _ in range(n)]

    items = [(store, new_tables(1 + (layer + kind) % 3)) for layer in range(4) for kind, store in enumerate(stores[layer])]
    with counting() as ops:
        add_epochs_all(items)
    assert ops.counts["sync"] == 0 and ops.counts["h2d"] == 1, ops.by_op
    assert ops.by_op.get("alloc:cat", 0) == 1, ops.by_op

    def check(store, layer, kind, tables):
        assert store.b3.shape[0] == store.tb4.shape[0] == 1 + len(tables)
        np.testing.assert_array_equal(store.b3[0].numpy(), cal.bases(layer, kind, 0)[0])
        np.testing.assert_array_equal(store.tb4[0].numpy(), tile_bases(*cal.bases(layer, kind, 0))[1])
        for e, (b3, b4) in enumerate(tables, start=1):
            np.testing.assert_array_equal(store.b3[e].numpy(), b3)
            np.testing.assert_array_equal(store.b4[e].numpy(), b4)
            np.testing.assert_array_equal(store.tb3[e].numpy(), tile_bases(b3, b4)[0])
        assert all(getattr(store, name).is_contiguous() for name in ("b3", "b4", "tb3", "tb4"))

    for (store, tables), (layer, kind) in zip(items, [(l, k) for l in range(4) for k in (0, 1)]):
        check(store, layer, kind, tables)
    more = new_tables(2)
    stores[2][1].add_epochs(more)
    for (store, tables), (layer, kind) in zip(items, [(l, k) for l in range(4) for k in (0, 1)]):
        check(store, layer, kind, tables + more if (layer, kind) == (2, 1) else tables)


def content(rng, centres: np.ndarray, tokens: int) -> np.ndarray:
    """BF16 bits ``[layers, kv_heads, tokens, head_dim]``: exponents about ``centres`` ``[layers, kv_heads, 1,
    head_dim]``, random signs and mantissas."""
    shape = centres.shape[:2] + (tokens, centres.shape[3])
    e = np.clip(np.rint(centres + rng.normal(0, 1.5, size=shape)), 1, 254).astype(np.uint16)
    sm = rng.integers(0, 256, size=shape, dtype=np.uint16)
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)


def _filled(layers: int, seqs: int = 2, tokens: int = 40, spread: int = 3):
    """A CUDA-codec cache (the simulator's) holding ``seqs`` sequences, imported from a reference cache."""
    cal = calibration(layers)
    rng = np.random.default_rng(layers)
    # exponents about the calibration's centres: most tiles take slots, a few the arena
    k_c, v_c = ((cal.b_narrow[kind] + spread)[:, :, None, :].astype(np.float64) for kind in (0, 1))
    kv = [(content(rng, k_c, tokens), content(rng, v_c, tokens)) for _ in range(seqs)]
    raw = 2 * layers * 8 * 2 * seqs          # room for every tile raw: synthetic content overflows often
    ref = PagedKVCache(cal, max_seqs=1, max_blocks=8, codec="reference", adapt=False, raw_tiles=raw)
    cache = PagedKVCache(cal, max_seqs=seqs, max_blocks=8, codec="cuda", raw_tiles=raw)
    rows = []
    for k, v in kv:
        ref.add_sequence(k, v)
        rows.append(cache.import_sequence(ref.export_sequence(0)))
        ref.remove_sequence(0)
    return cache, rows


def test_removing_a_sequence_waits_for_nothing_and_gives_back_with_one_wait_whatever_the_layers():
    """A removal sorts its records on the device and starts their copy to the host without waiting for it (in a
    serving loop that wait would drain the steps queued before the removal).  The records stay out of every free
    list until the next call that reads the pools gives them back, with at most one wait whatever the layers
    (the counts of the lists that cannot take them past their end, read together); the cache then holds and
    takes back what it did before.  Where every layer is as long, the removal copies nothing to the device."""
    counts = {}
    for layers in (2, 4):
        cache, rows = _filled(layers)
        export = cache.export_sequence(rows[1])
        held = cache.memory().resident_bytes
        free = [store.slots.free_lower() for layer_store in cache._store for store in layer_store]
        with counting() as ops:
            cache.remove_sequence(rows[0])
        assert ops.counts["sync"] == 0, ops.by_op
        # every layer as long: the entries read as one view of the tables, nothing copied from the host (a pinned
        # copy of each store's count of entries before)
        assert ops.counts["pinned"] == ops.counts["h2d"] == 0, ops.by_op
        assert len(cache._returning) == 1
        assert [store.slots.free_lower() for layer_store in cache._store for store in layer_store] == free
        with counting() as ops:
            cache._take_returns()
        counts[layers] = ops.counts["sync"]
        assert not cache._returning
        assert sum(store.slots.free_lower() for layer_store in cache._store for store in layer_store) > sum(free)
        assert cache.memory().resident_bytes < held
        assert cache.export_sequence(rows[1]) == export          # the other sequence is untouched
        # every record of the removed sequence is free again: the cache takes the same sequence back
        again = cache.import_sequence(export)
        assert cache.export_sequence(again) == export
    assert counts[2] == counts[4] <= 1, counts


def test_a_removals_records_reach_every_slot_pools_list_in_one_write_whatever_the_layers():
    """The slot pools' free lists are views of one allocation: where every list has room past its end (after a
    first removal rebuilt them, as in a serving loop's later joins) the records a removal gives back are written
    there by one indexed write for all of them (a copy a list before), and each list then holds what a write of
    its own would have left: its records before, then the removed sequence's, sorted."""
    writes = {}
    for layers in (2, 4):
        cache, rows = _filled(layers, seqs=3)
        export = cache.export_sequence(rows[2])
        cache.remove_sequence(rows[0])
        cache._take_returns()                   # the first removal rebuilds the full lists, leaving room
        pools = [store.slots for layer_store in cache._store for store in layer_store]
        before = [(pool.order, pool.order[:pool.listed].tolist()) for pool in pools]
        cache.remove_sequence(rows[1])
        with counting() as ops:
            cache._take_returns()
        writes[layers] = {op: n for op, n in ops.by_op.items() if op.startswith("write:")}
        for pool, (order, listed) in zip(pools, before):
            assert pool.order is order                              # written in place
            got = pool.order[:pool.listed].tolist()
            assert got[:len(listed)] == listed and len(got) > len(listed)
            assert got[len(listed):] == sorted(got[len(listed):])
        again = cache.import_sequence(export)
        assert cache.export_sequence(again) == export
        assert cache.export_sequence(rows[2]) == export
    assert writes[2] == writes[4] == {"write:index_copy_": 1}, writes


def test_loans_to_every_share_of_a_cache_are_one_write_whatever_the_layers():
    """A cache's raw shares' free lists start as views of one allocation (their first loans, in one copy): a
    prompt's later loans to every share, written past each list's end, are one indexed write for all of them,
    and each share holds its records before and then its loan."""
    writes = {}
    for layers in (2, 4):
        cache = PagedKVCache(calibration(layers), max_seqs=8, max_blocks=256, codec="cuda")
        shares = [store.raw for layer_store in cache._store for store in layer_store]
        before = [(share.order, share.order[:share.listed].tolist()) for share in shares]
        k = cache._arena.chunk
        assert all(share.lends_in_place(k) for share in shares)
        with counting() as ops:
            assert cache._arena.cover([(share, share.free_lower() + k) for share in shares], read=False) == []
        writes[layers] = {op: n for op, n in ops.by_op.items() if op.startswith("write:")}
        for share, (order, listed) in zip(shares, before):
            assert share.order is order
            got = share.order[:share.listed].tolist()
            assert got[:len(listed)] == listed and len(got) == len(listed) + k
        every = sorted(r for share in shares for r in share.order[:share.listed].tolist())
        assert len(set(every)) == len(every)                    # no record lent twice
    assert writes[2] == writes[4] == {"write:index_copy_": 1}, writes


def test_a_full_cache_takes_a_sequence_into_the_room_a_removal_frees():
    """The records a removal gives back are taken up by the next call that needs them, with no call of the
    caller's: a cache whose slot pools its two sequences fill takes an import, and then a prompt, into the room
    the removal of one of them frees, and holds them bit-exact."""
    cache, rows = _filled(2, tokens=8 * 16)
    export = cache.export_sequence(rows[0])
    k, v = cache.read(rows[0])
    need = 8 * cache.tiles_per_block
    for add in (lambda: cache.import_sequence(export), lambda: cache.add_sequence(k, v)):
        cache.remove_sequence(rows[0])
        assert cache._returning
        assert min(store.slots.free_lower() for layer_store in cache._store for store in layer_store) < need
        rows[0] = add()
        assert not cache._returning
        assert cache.export_sequence(rows[0]) == export


def test_a_prompts_reservation_reads_no_count_where_the_bounds_cover_it(monkeypatch):
    """A prompt into a cache whose counts the host knows only as bounds (decode steps' encodes in flight may
    have taken records): where the free slots, the raw records and the arena's reserve cover its tiles by
    those bounds, its reservation lends each raw share its guess without reading a count (a serving loop's
    join would otherwise drain the steps queued ahead there, before the rule and the encodes are launched);
    the encode's check reads the counts after, and the cache holds the prompt bit-exact."""
    from gaac.cache.update import UpdateTransaction

    cache, rows = _filled(2, tokens=8 * 16)
    k, v = cache.read(rows[1])
    cache.remove_sequence(rows[1])
    cache._take_returns()
    for layer_store in cache._store:             # a record of each pool taken by an encode the host has not read
        for store in layer_store:
            for pool in (store.slots, store.raw):
                pool.heads[pool.cls] += 1
                pool.pending += 1
    reserve, waits = UpdateTransaction._reserve, []

    def counted(self, updates, jobs):
        with counting() as ops:
            reserve(self, updates, jobs)
        waits.append(ops.counts["sync"])

    monkeypatch.setattr(UpdateTransaction, "_reserve", counted)
    row = cache.add_sequence(k, v)
    assert waits == [0]
    got_k, got_v = cache.read(row)
    assert np.array_equal(got_k, k) and np.array_equal(got_v, v)


@pytest.mark.parametrize("n_shares", [4, 8])
def test_growing_pools_waits_once(n_shares):
    """Shares and slot pools too small for an update (``grow=True``): their counts are read in one wait, the
    arena grows once and every loan reaches the device in one copy (before, each share and pool read its count
    on its own and the arena grew for each share)."""
    from gaac.cache.pools import DevicePool, grow_pools, grown
    arena, shares = device_arena(8 * n_shares, n_shares)
    assert arena.cover([(s, 8) for s in shares]) == []                 # the whole arena lent
    _taken(shares, 2)
    slots = DevicePool("slots", 16, (64,), torch.uint8, CPU, torch.zeros(2, dtype=torch.int32), 0)
    slots.heads[0] += 3
    slots.pending += 3
    size = arena.size
    with counting() as ops:
        grow_pools([(s, 40) for s in shares] + [(slots, 30)])
    assert ops.counts["sync"] == 1, ops.by_op
    assert ops.counts["h2d"] == 1, ops.by_op           # every share's loan in one copy
    assert arena.size == grown(size, 40 * n_shares) == arena.data.shape[0]     # one growth step for all of them
    assert all(s.n_free() >= 40 for s in shares) and slots.n_free() >= 30
    held = records(arena, shares)
    assert len(held) == len(set(held)) == arena.size - 2 * n_shares     # every record once; the taken ones held


def test_a_prompt_too_large_for_small_pools_waits_a_fixed_few_times():
    """A cache whose pools are far too small (``grow=True``, as a cache made without a budget starts): the
    prompt's encode runs dry and every pool grows, each with a wait of its own before.  Now the pools' counts
    are read together, so the waits and the storage changes (each one a re-plan of attention) stay the same
    whatever the layers, and the cache holds the prompt exactly."""
    waits, changes = {}, {}
    for layers in (2, 4):
        cal = calibration(layers)
        rng = np.random.default_rng(layers)
        k_c, v_c = ((cal.b_narrow[kind] + 6)[:, :, None, :].astype(np.float64) for kind in (0, 1))
        k, v = content(rng, k_c, 64), content(rng, v_c, 64)
        cache = PagedKVCache(cal, max_seqs=2, max_blocks=2, codec="cuda", slots=4, raw_tiles=4, grow=True)
        version = cache.storage_version
        with counting() as ops:
            seq = cache.add_sequence(k, v)
        waits[layers], changes[layers] = ops.counts["sync"], cache.storage_version - version
        got_k, got_v = cache.read(seq)
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
    assert changes[2] == changes[4] <= 3, changes
    # the reservation may read the counts once more where its guess falls short (content, not layers)
    assert waits[4] <= waits[2] + 2 and waits[4] <= 12, waits


def test_a_removal_sorted_on_the_device_gives_back_what_the_host_sort_gives():
    """The removed sequence's entries are sorted on the device, every layer and kind in one sort: each pool's
    free list and the arena's reserve end as the host's sort pool by pool leaves them."""
    from gaac.cache.paged import _give_back, _read_back
    from gaac.cache.store import give_back_all
    (cache, rows), (twin, _) = _filled(2, 2, 72, spread=4), _filled(2, 2, 72, spread=4)
    results = []
    for c, give in ((cache, lambda stores, r: _give_back(stores, r)),
                    (twin, lambda stores, r: give_back_all(stores, _read_back(stores, r)))):
        stores = [store for layer_store in c._store for store in layer_store]
        entries = [store.table[rows[0], :int(c._lens[layer, rows[0]]) // 16].reshape(-1)
                   for layer, layer_store in enumerate(c._store) for store in layer_store]
        assert any(bool((e < 0).any()) for e in entries) and any(bool((e >= 0).any()) for e in entries)
        give(stores, entries)
        results.append(([(s.slots._rest().tolist(), s.raw._rest().tolist()) for s in stores],
                        sorted(c._arena._stack[:c._arena.reserve].tolist())))
    assert results[0] == results[1]


def test_a_share_that_ran_dry_is_lent_its_observed_rate_next_time():
    """Content that overflows far more than the calibration plans (a cache made without a budget, ``grow=True``):
    the first prompt's encode runs the arena dry and is redone after the loans; each share keeps the rate it
    took, so the next prompt of such content is lent that much before its encode and is encoded once."""
    from gaac.cache.update import UpdateTransaction
    cal = calibration(2)
    rng = np.random.default_rng(7)
    k_c, v_c = ((cal.b_narrow[kind] + 6)[:, :, None, :].astype(np.float64) for kind in (0, 1))
    k, v = content(rng, k_c, 128), content(rng, v_c, 128)
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=8, codec="cuda", grow=True)
    redone, waits = [], []
    put_back = UpdateTransaction._put_back

    def counted(self, undo):
        redone[-1] += 1
        return put_back(self, undo)

    UpdateTransaction._put_back = counted
    try:
        for _ in range(3):
            redone.append(0)
            with counting() as ops:
                seq = cache.add_sequence(k, v)
            waits.append(ops.counts["sync"])
            got_k, got_v = cache.read(seq)
            np.testing.assert_array_equal(got_k, k)
            np.testing.assert_array_equal(got_v, v)
            cache.remove_sequence(seq)
    finally:
        UpdateTransaction._put_back = put_back
    assert redone == [1, 0, 0], redone
    # the later prompts read the counts a removal left inexact, but run no list dry and wait less
    assert max(waits[1:]) < waits[0], waits
    assert all(share.seen_rate > 2 * cache._raw_share for share in cache._arena.shares)


def test_an_encode_the_rule_redoes_puts_its_counts_back_without_waiting(monkeypatch):
    """The device rule appends epochs to a prompt in more phases than its encodes read (one phase launched with
    the rule's batch): the layers and kinds that appended again later are encoded again, their free lists first
    put back to the counts saved before the encode.  The saved counts travel to the host ahead of the encodes,
    so putting them back reads nothing from the device; the host's counts are then the device's, and the cache
    reads back bit-exact."""
    import gaac.cuda.epochs as device_epochs
    import gaac.epochs as epochs
    from gaac import layout as L
    from gaac.cache.pools import sync_pools
    from gaac.cache.update import UpdateTransaction
    from gaac.calibration import calibrate
    from tests.conftest import every_tile
    from tests.test_epochs import drifting_cache

    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 8)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    x = drifting_cache(36 * L.BLOCK_TOKENS, layers=2)[:, :1]
    x[1] = x[1] ^ 0x8000                             # one layer: x[0] is its K, x[1] its V
    cal = calibrate(x[:1, :, :128], x[1:, :, :128])
    cache = PagedKVCache(cal, **every_tile(cal, 1, 40), codec="cuda")
    cache._rule_on_device = True
    monkeypatch.setattr(device_epochs, "PHASES", 0)   # the encodes read phase 0 only
    put_back, seen = UpdateTransaction._put_back, []

    def counted(self, undo):
        with counting() as ops:
            put_back(self, undo)
        pools = [pool for u, kind, _ in undo for pool in self._pools(u.layer, kind)]
        seen.append((ops.counts["sync"], [p.taken for p in pools]))
        seen[-1] += ([pool.taken for pool, _ in zip(pools, sync_pools(pools))],)

    monkeypatch.setattr(UpdateTransaction, "_put_back", counted)
    seq = cache.add_sequence(x[:1], x[1:])                # 36 blocks: two checks
    assert cache.calibration.n_epochs(0, L.KIND_K) > 2 and seen          # appended twice: encoded again
    for waits, host, device in seen:
        assert waits == 0
        assert host == device
    k, v = cache.read_layer(0, [seq])
    np.testing.assert_array_equal(k[0].numpy().view(np.uint16), x[0])
    np.testing.assert_array_equal(v[0].numpy().view(np.uint16), x[1])


def test_a_prompts_tails_and_block_epochs_are_written_for_every_layer_at_once(monkeypatch):
    """A prompt's layers add the same tokens to one sequence: its tails and the device's block-epoch indices
    are written with one copy each for every layer and kind (their arrays lie evenly spaced in one
    allocation), so committing it issues as many device operations at 2 layers as at 4, and the cache reads
    back bit-exact, its device epoch index equal to the host's."""
    from gaac.cache.update import UpdateTransaction
    commit_all, writes = UpdateTransaction._commit_all, {}

    def counted(self, updates, observe=True):
        with counting() as ops:
            commit_all(self, updates, observe)
        writes[self.layers] = sum(ops.counts[k] for k in ("alloc", "write", "h2d", "pinned"))

    monkeypatch.setattr(UpdateTransaction, "_commit_all", counted)
    for layers in (2, 4):
        cal = calibration(layers)
        rng = np.random.default_rng(layers)
        k_c, v_c = ((cal.b_narrow[kind] + 2)[:, :, None, :].astype(np.float64) for kind in (0, 1))
        k, v = content(rng, k_c, 3 * 16 + 5), content(rng, v_c, 3 * 16 + 5)       # three blocks and a tail
        cache = PagedKVCache(cal, max_seqs=2, max_blocks=4, codec="cuda", raw_tiles=2 * layers * 2 * 4 * 2)
        seq = cache.add_sequence(k, v)
        got_k, got_v = cache.read(seq)
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
        for layer in range(layers):
            for store in cache.stores(layer):
                np.testing.assert_array_equal(store.epoch[seq, :3].numpy(), store.epochs[seq, :3])
    assert 0 < writes[2] == writes[4], writes


def test_the_state_of_a_cache_takes_up_a_removals_records_first():
    """The state a copy or pickle of a cache takes holds no records on their way back: a removal's are given back
    first, so the state's pools are the cache's; a state saved before the records travelled (no such attribute)
    restores as a cache with none on their way, holding what it held."""
    cache, rows = _filled(2)
    export = cache.export_sequence(rows[1])
    cache.remove_sequence(rows[0])
    assert cache._returning
    state = cache.__getstate__()
    assert not cache._returning and state["_returning"] == []
    del state["_returning"], state["_guess_misses"]
    old = PagedKVCache.__new__(PagedKVCache)
    old.__setstate__(dict(state))
    assert old._returning == [] and old._guess_misses == 1.0
    assert old.export_sequence(rows[1]) == export
    assert old.memory() == cache.memory()


class _NotArrived:
    """The event of a copy to the host that has not arrived (as a GPU's is while steps queued before it run):
    queried False until it is waited for."""

    def __init__(self):
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def test_a_step_gives_a_removals_records_back_only_where_its_pools_fall_short_without_them():
    """A step's reservation does not wait for a removal's records whose copy has not arrived where its pools hold
    enough without them (a step after a removal in a serving loop); where they fall short it waits, gives them
    back and the step fits (a full cache's slot pools hold 2 free slots, the step needs 8 of each, the removal
    frees 15)."""
    cache, rows = _filled(2, tokens=8 * 16)
    cache.remove_sequence(rows[0])
    cache._returning[0].event = late = _NotArrived()
    cache.reserve_step(np.array([0]), np.array([16]))              # 2 tiles a store: room without them
    assert cache._returning and not late.waited
    need = 4 * cache.tiles_per_block
    assert min(store.slots.free_lower() for layer_store in cache._store for store in layer_store) < need
    cache.reserve_step(np.array([0]), np.array([4 * 16]))
    assert late.waited and not cache._returning
    assert min(store.slots.free_lower() for layer_store in cache._store for store in layer_store) >= need


def test_a_prompt_launches_its_rule_before_its_reservation_where_the_reservation_cannot_wait(monkeypatch):
    """A prompt into a cache whose slot pools hold every tile by their bounds and whose raw shares take their
    loans past their lists' ends without a read: the rule's kernels are launched before the reservation (whose
    host work then runs while the GPU scans) and the histograms' copies are made before the host waits for the
    decisions.  A prompt into pools too small for it (``grow=True``: it reads counts and grows) reserves first.
    Every prompt reads back bit-exact."""
    import gaac.cuda.epochs as device_epochs
    import gaac.epochs as epochs
    from gaac import layout as L
    from gaac.cache.update import UpdateTransaction
    from gaac.calibration import calibrate
    from tests.conftest import every_tile
    from tests.test_epochs import drifting_cache

    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 8)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    x = drifting_cache(20 * L.BLOCK_TOKENS, layers=2)[:, :1]       # 20 blocks: one check
    x[1] = x[1] ^ 0x8000                             # one layer: x[0] is its K, x[1] its V
    cal = calibrate(x[:1, :, :128], x[1:, :, :128])
    order = []
    reserve, launch, finish = UpdateTransaction._reserve, UpdateTransaction._launch_rule, device_epochs.Batch.finish

    def reserving(self, updates, jobs):
        order.append("reserve")
        return reserve(self, updates, jobs)

    def launching(self, updates):
        order.append("rule")
        return launch(self, updates)

    def finishing(self):
        order.append("copied" if self.own_hist is not None else "not copied")
        return finish(self)

    monkeypatch.setattr(UpdateTransaction, "_reserve", reserving)
    monkeypatch.setattr(UpdateTransaction, "_launch_rule", launching)
    monkeypatch.setattr(device_epochs.Batch, "finish", finishing)
    roomy = PagedKVCache(cal, **every_tile(cal, 1, 24), codec="cuda")
    small = PagedKVCache(cal, max_seqs=1, max_blocks=24, codec="cuda", slots=4, raw_tiles=4, grow=True)
    for cache, want in ((roomy, ["rule", "reserve", "copied"]), (small, ["reserve", "rule", "copied"])):
        cache._rule_on_device = True
        order.clear()
        seq = cache.add_sequence(x[:1], x[1:])
        assert order == want
        assert cache.calibration.n_epochs(0, L.KIND_K) > 1            # the rule appended: its batch decided
        k, v = cache.read_layer(0, [seq])
        np.testing.assert_array_equal(k[0].numpy().view(np.uint16), x[0])
        np.testing.assert_array_equal(v[0].numpy().view(np.uint16), x[1])


def test_a_prompt_reserves_without_reading_a_count_where_the_host_knows_the_counts(monkeypatch):
    """A cache's exact counts are the device's unless a plan of device-driven steps was made for it (their steps pop
    records that the host accounts only when told).  A prompt whose raw shares' guesses fit neither their lists
    nor the arena's reserve (a small cache's default arena) then reserves without reading a count, into a new
    cache as into one holding an imported sequence: the rule's kernels are launched first (the reservation's host
    work then runs while the GPU scans) and the reservation waits for nothing.  Once a plan of device-driven
    steps is made, or with the counts taken as unknown, the same prompt's reservation reads the counts, before the
    rule.  Every prompt reads back bit-exact."""
    import gaac.epochs as epochs
    from gaac import layout as L
    from gaac.cache.update import UpdateTransaction
    from gaac.calibration import calibrate
    from tests.test_epochs import drifting_cache

    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 8)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    x = drifting_cache(20 * L.BLOCK_TOKENS, layers=2)[:, :1]       # 20 blocks: one check
    x[1] = x[1] ^ 0x8000
    cal = calibrate(x[:1, :, :128], x[1:, :, :128])
    ref = PagedKVCache(cal, max_seqs=1, max_blocks=24, codec="reference", adapt=False)
    ref.add_sequence(x[:1, :, :2 * L.BLOCK_TOKENS], x[1:, :, :2 * L.BLOCK_TOKENS])
    held = ref.export_sequence(0)
    order, waits = [], []
    reserve, launch = UpdateTransaction._reserve, UpdateTransaction._launch_rule

    def reserving(self, updates, jobs):
        order.append("reserve")
        with counting() as ops:
            reserve(self, updates, jobs)
        waits.append(ops.counts["sync"])

    def launching(self, updates):
        order.append("rule")
        return launch(self, updates)

    monkeypatch.setattr(UpdateTransaction, "_reserve", reserving)
    monkeypatch.setattr(UpdateTransaction, "_launch_rule", launching)

    def cache(imported: bool):
        c = PagedKVCache(cal, max_seqs=2, max_blocks=24, codec="cuda")
        c._rule_on_device = True
        if imported:
            c.import_sequence(held)
        return c

    def prompt(c, want_order, no_wait):
        order.clear()
        waits.clear()
        seq = c.add_sequence(x[:1], x[1:])
        assert order == want_order
        assert (waits == [0]) == no_wait, waits
        assert c.calibration.n_epochs(0, L.KIND_K) > 1                # the rule appended: its batch decided
        k, v = c.read_layer(0, [seq])
        np.testing.assert_array_equal(k[0].numpy().view(np.uint16), x[0])
        np.testing.assert_array_equal(v[0].numpy().view(np.uint16), x[1])

    new = cache(False)
    guesses = [(store.raw, new._raw_guess(store.raw, 20 * new.tiles_per_block)) for store in new.stores(0)]
    assert not new._arena.covers_unread(guesses)           # without the host's counts, the loans would read
    prompt(new, ["rule", "reserve"], True)
    prompt(cache(True), ["rule", "reserve"], True)

    stepped = cache(True)
    assert not stepped.serving.device_steps
    plan = stepped.decode_plan(2, steps=1)                 # device-driven steps of the imported sequence
    assert stepped.serving.device_steps
    prompt(stepped, ["reserve", "rule"], False)
    del plan

    monkeypatch.setattr(UpdateTransaction, "_counts_known", property(lambda self: False))
    prompt(cache(False), ["reserve", "rule"], False)


def test_the_bases_of_an_epoch_a_prompt_appended_are_packed_on_the_device(monkeypatch):
    """An encoder for an epoch the store holds (the one a prompt appended, which the cache then publishes for its
    decode appends) packs its bases on the device from the store's per-tile tables, copying nothing from the host
    (a pinned copy costs a quarter of a millisecond behind queued steps, for each epoch a join appends); the bases
    are those the host packs from the calibration, for every epoch of both kinds."""
    import gaac.arrays as arrays
    import gaac.epochs as epochs
    from gaac import layout as L
    from gaac.calibration import calibrate
    from gaac.cuda.codec import pack_bases
    from tests.test_epochs import drifting_cache

    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 8)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    x = drifting_cache(40 * L.BLOCK_TOKENS, layers=2)[:, :1]
    x[1] = x[1] ^ 0x8000
    cal = calibrate(x[:1, :, :128], x[1:, :, :128])
    cache = PagedKVCache(cal, max_seqs=1, max_blocks=48, codec="cuda", grow=True)
    cache._rule_on_device = True
    cache.add_sequence(x[:1], x[1:])
    uploads = []
    upload = arrays.upload
    monkeypatch.setattr(arrays, "upload", lambda a, device: uploads.append(a.shape) or upload(a, device))
    for kind, store in enumerate(cache.stores(0)):
        held = store.tb3.shape[0]
        assert held == cache.calibration.n_epochs(0, kind) > 2          # the prompt appended epochs
        for epoch in range(held):
            store.packed.pop(epoch, None)
            store.encoders = {}
            bases = cache._encoder(store, None, epoch, 0, kind).bases
            want = pack_bases(*(np.ascontiguousarray(t) for t in tile_bases(*cache.calibration.bases(0, kind, epoch))))
            np.testing.assert_array_equal(bases.numpy(), want)
    assert uploads == [], uploads
