"""The raw-tile arena's lending (gaac.cache.pools.RawArena): what each share is lent where the arena can and cannot
cover every share's ask, device shares' free lists written in place, and a prompt that every layer and kind
asks more of than the arena holds encoded once."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gaac import layout as L  # noqa: E402
from gaac.calibration import Calibration, calibrate  # noqa: E402
from gaac.cache.pools import RawArena  # noqa: E402

CPU = torch.device("cpu")


def host_arena(n, shares):
    arena = RawArena(n, 64, CPU)
    return arena, [arena.share(f"share {i}") for i in range(shares)]


def device_arena(n, shares):
    arena = RawArena(n, 64, CPU)
    return arena, [arena.share(f"share {i}", torch.zeros(2, dtype=torch.int32), 1) for i in range(shares)]


def free_lists(shares):
    return [sorted(s.free.tolist()) for s in shares]


def records(arena, shares):
    """Every record once: the reserve's and each share's free ones (no share holds a tile here)."""
    held = [r for s in shares for r in s.free.tolist()] + arena._stack[:arena.reserve].tolist()
    return sorted(held)


def test_a_reserve_that_covers_every_lack_lends_each_share_what_it_lacks():
    arena, shares = host_arena(40, 4)
    assert arena.cover([(s, arena.chunk) for s in shares]) == [] and arena.chunk == 2
    assert arena.cover([(shares[0], 5), (shares[2], 1)]) == []
    assert [s.n_free() for s in shares] == [5, 2, 2, 2]                 # at least chunk more where lent at all
    assert records(arena, shares) == list(range(40))


def test_where_every_free_record_covers_every_ask_they_return_first():
    arena, shares = host_arena(16, 4)
    arena.cover([(s, 4) for s in shares])                              # the whole arena lent, 4 each
    assert arena.reserve == 0
    assert arena.cover([(shares[0], 9), (shares[1], 3)]) == []          # 12 asked, 16 free in all
    assert [s.n_free() for s in shares[:2]] == [9, 3] and shares[2].n_free() == shares[3].n_free() == 0
    assert records(arena, shares) == list(range(16))


def test_where_the_arena_cannot_cover_every_ask_it_spreads_the_reserve_and_moves_no_record():
    """Each share short is lent the reserve in proportion to what it lacks (the first share is not served
    whole while the last gets nothing), the records shares hold stay where they are, and what each still
    lacks is returned."""
    arena, shares = host_arena(20, 4)
    arena.cover([(s, 1) for s in shares])                              # chunk 1 each, 16 in the reserve
    before = free_lists(shares)
    short = arena.cover([(shares[0], 11), (shares[1], 11), (shares[2], 6), (shares[3], 1)])
    # lacks 10, 10, 5 (share 3 holds its record): 25 > 16 + 4 free.  16 * (10, 10, 5) / 25 = 6.4, 6.4, 3.2:
    # 6, 6, 3 and the one left over to the first of the largest remainders.
    assert [s.n_free() for s in shares] == [1 + 7, 1 + 6, 1 + 3, 1]
    assert arena.reserve == 0
    assert [(shares.index(s), n) for s, n in short] == [(0, 3), (1, 4), (2, 2)]
    for s, held in zip(shares, before):                                 # what a share held, it still holds
        assert set(held) <= set(s.free.tolist())
    assert records(arena, shares) == list(range(20))
    # more than every record of the arena, with an empty reserve: nothing moves, the lack is returned
    before = free_lists(shares)
    short = arena.cover([(shares[3], 25)])
    assert [(shares.index(s), n) for s, n in short] == [(3, 24)] and free_lists(shares) == before


def test_a_device_share_is_given_room_so_that_later_loans_write_its_list_in_place():
    """The first loan that outgrows a device share's free-list array gives it room for twice an even split of
    the arena; loans within that room keep the array (launches made with it stay valid)."""
    arena, shares = device_arena(64, 4)
    assert arena.cover([(s, arena.chunk) for s in shares]) == []        # chunk 4 each
    kept = [(s.order, s.version) for s in shares]
    assert all(s.order.shape[0] >= 2 * 64 // 4 for s in shares)
    assert arena.cover([(s, 16) for s in shares]) == []                 # 12 more each: the whole arena
    assert all(s.order is order and s.version == version for s, (order, version) in zip(shares, kept))
    assert [s.n_free() for s in shares] == [16] * 4
    assert sorted(r for s in shares for r in s._rest().tolist()) == list(range(64))
    short = arena.cover([(s, 40) for s in shares])                      # more than the arena: nothing moves
    assert [n for _, n in short] == [24] * 4 and [s.n_free() for s in shares] == [16] * 4


# ----------------------------------------------------------------------------------------------
# The arena as the cache lends it: a prompt whose guesses exceed the arena.

def one_exponent_per_channel(rng, layers, tokens, outliers):
    """BF16 bits ``[layers, 1, tokens, 64]`` with one exponent per channel (no escapes with its calibration),
    but for one value far below at each ``(layer, token)`` of ``outliers``: that token's tile escapes."""
    e = np.broadcast_to(rng.integers(118, 124, size=(layers, 1, 1, 64)), (layers, 1, tokens, 64)).astype(np.uint16)
    sm = rng.integers(0, 256, size=e.shape, dtype=np.uint16)
    x = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    for layer, t in outliers:
        x[layer, 0, t, 5] = (x[layer, 0, t, 5] & 0x807F) | (1 << 7)
    return x


def test_a_prompt_whose_guesses_exceed_the_arena_is_encoded_once(monkeypatch):
    """Every layer and kind of a 16-block prompt asks the arena for more raw records than it holds (the CUDA
    encoder's guess); its three escaping tiles sit in the last layers' shares.  Each share keeps a part of the
    arena, so no free list runs dry and every tile is encoded once (CUDA codec, in the simulator); the cache
    reads back bit-exact."""
    pytest.importorskip("numba")
    import gaac.cuda.codec as codec
    from gaac.cache import PagedKVCache

    rng = np.random.default_rng(1)
    blocks = 16
    k = one_exponent_per_channel(rng, 4, blocks * L.BLOCK_TOKENS, [(3, 40)])
    v = one_exponent_per_channel(rng, 4, blocks * L.BLOCK_TOKENS, [(3, 100), (2, 7)])
    fitted = calibrate(k, v)
    cal = Calibration(b3=fitted.b3, b4=fitted.b4, capacity=np.zeros_like(fitted.capacity), model=fitted.model)
    cache = PagedKVCache(cal, max_blocks=blocks, raw_tiles=8, codec="cuda")
    arena = cache._arena
    assert arena.chunk == 1 and arena.reserve == 0                     # a record each, lent as the cache is made
    assert cache._raw_guess(arena.shares[0], blocks) == 2             # the prompt's guess: 8 shares x 2 > 8
    encoded = []                                                       # tiles per encoder launch
    in_place, call = codec.EncodePlan.in_place, codec.EncodePlan.__call__

    def counting_in_place(self, bits, first, entries, *args, **kwargs):
        encoded.append(entries.shape[0])
        return in_place(self, bits, first, entries, *args, **kwargs)

    def counting_call(self, bits, entries, *args, **kwargs):
        encoded.append(entries.shape[0])
        return call(self, bits, entries, *args, **kwargs)

    monkeypatch.setattr(codec.EncodePlan, "in_place", counting_in_place)
    monkeypatch.setattr(codec.EncodePlan, "__call__", counting_call)
    seq = cache.add_sequence(k, v)
    assert sum(encoded) == 2 * 4 * blocks                               # every tile once
    assert arena.used() == 3 and cache.memory().raw_bytes > 0
    got = cache.read(seq)
    np.testing.assert_array_equal(got[0], k)
    np.testing.assert_array_equal(got[1], v)


def test_records_given_back_to_a_device_pool_join_its_list_in_place_and_in_order():
    """A slot pool's free list on the device: records given back follow the free ones, lowest first.  A list
    whose array has no room past its end is rebuilt from its start (the taken count reset), which leaves
    room for every record in use; later gives are written past the list's end in place (no new array, the
    taken count kept); either way ``take`` hands out the same records."""
    from gaac.cache.pools import DevicePool

    heads = torch.zeros(2, dtype=torch.int32)
    pool = DevicePool("slots", 6, (4,), torch.uint8, CPU, heads, 0)
    order = pool.order
    assert order.shape[0] == 6 and pool.n_free() == 6
    assert pool.take(4).tolist() == [0, 1, 2, 3] and int(heads[0]) == 4
    pool.give(np.array([3, 1]))                         # no room past the end: rebuilt
    assert int(heads[0]) == 0 and pool.taken == 0 and pool.order is order
    assert pool.n_free() == 4 and pool.upcoming(4).tolist() == [4, 5, 1, 3]
    version = pool.version
    assert pool.take(3).tolist() == [4, 5, 1] and int(heads[0]) == 3
    pool.give(np.array([], dtype=np.int64))             # nothing given: nothing changes
    pool.give(np.array([5]))
    pool.give(np.array([0]))                            # past the list's end, in place
    assert pool.order is order and pool.version == version and int(heads[0]) == 3 and pool.listed == 6
    assert pool.n_free() == 3 and pool.upcoming(3).tolist() == [3, 5, 0]
    pool.give(np.array([4]))                            # the array is full again: rebuilt
    assert int(heads[0]) == 0 and pool.take(4).tolist() == [3, 5, 0, 4]


@pytest.mark.parametrize("seed", range(4))
def test_list_writes_put_every_value_where_one_copy_a_write_would(seed):
    """ListWrites: writes into lists that are views of one allocation (at random offsets and starts, some empty,
    in any order) and one into a list of its own leave every array as a copy a write leaves it."""
    from gaac.cache.pools import ListWrites

    rng = np.random.default_rng(seed)
    whole = torch.zeros(4096, dtype=torch.int32)
    alone = torch.zeros(100, dtype=torch.int32)
    want_whole, want_alone = whole.clone(), alone.clone()
    lists = [whole[a:a + 300] for a in rng.choice(12, 6, replace=False) * 320]
    writes = ListWrites()
    values = torch.from_numpy(rng.integers(1, 2 ** 31 - 1, 900, dtype=np.int64).astype(np.int32))
    used = 0
    for i, order in enumerate(lists):
        at, n = int(rng.integers(0, 150)), 0 if i == 2 else int(rng.integers(1, 150))
        writes.add(order, at, values[used:used + n])
        want_whole[order.data_ptr() // 4 - whole.data_ptr() // 4 + at:][:n] = values[used:used + n]
        used += n
    writes.add(alone, 7, values[used:used + 20])
    want_alone[7:27] = values[used:used + 20]
    writes.apply()
    assert torch.equal(whole, want_whole) and torch.equal(alone, want_alone)
    assert int((whole != 0).sum()) == used and not writes.items
