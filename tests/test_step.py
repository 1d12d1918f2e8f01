"""The decode-step API: one plan per step for every layer, one-token appends, attention per layer.

The loop is the one a serving engine runs (``plan = cache.decode_plan(...)``; per layer
``update_layer`` then ``plan.run``).  Its contents are checked bit for bit against a cache
filled by the reference codec, its attention against the float64 reference, on the CPU
(reference path) and with the CUDA codec and fused kernel (numba's simulator here).
"""
import numpy as np
import pytest
import torch
from conftest import assert_reads_back, every_tile
from test_cache import B, drifting, synthetic, with_capacity

import gaac.epochs as epochs_mod
from gaac import layout as L
from gaac.attention import bf16_to_float, reference_attention
from gaac.cache import PagedKVCache
from gaac.calibration import calibrate
from gaac.errors import InputError, PoolExhaustedError
from gaac.cache.pools import grown


def _q(rng, batch, heads, dim):
    return torch.from_numpy((rng.standard_normal((batch, heads, dim)).astype(np.float32).view(np.uint32) >> 16)
                            .astype(np.uint16).view(np.int16)).view(torch.bfloat16)


def _check_attention(out, q, contents, layer, rows):
    """``out`` against float64 attention over each row's tokens: within BF16 rounding of the output."""
    qf = bf16_to_float(q.view(torch.int16).numpy())
    ks = [bf16_to_float(contents[r][0][layer]) for r in rows]
    vs = [bf16_to_float(contents[r][1][layer]) for r in rows]
    ref, _ = reference_attention(qf[rows], ks, vs)
    got = bf16_to_float(out.view(torch.int16).numpy()[rows])
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 8e-3, err


@pytest.mark.parametrize("codec", ["reference", "cuda"])
def test_decode_loop_reads_back_and_attends(codec, monkeypatch):
    """Prefill two sequences, then one-token steps through a block boundary and an epoch: every layer
    reads back bit-exact, and each step's attention matches float64 over what the layer holds."""
    for name in ("WARMUP_BLOCKS", "ADAPT_EVERY"):                # epochs within a few blocks: the simulator is slow
        monkeypatch.setattr(epochs_mod, name, 2)
    rng = np.random.default_rng(11)
    layers, heads, dim, steps = 2, 1, 64, 18
    total = [2 * B + 9, B + 14]
    k = [drifting(rng, layers, heads, n + steps, dim, 8.0) for n in total]
    v = [synthetic(rng, layers, heads, n + steps, dim) for n in total]
    cal = calibrate(k[0][:, :, :32], v[0][:, :, :32])
    cache = PagedKVCache(cal, **every_tile(cal, 3, 8), codec=codec)
    ref = PagedKVCache(cal, **every_tile(cal, 3, 8), codec="reference")     # updated in full, layer by layer
    rows = [cache.add_sequence(k[i][:, :, :total[i]], v[i][:, :, :total[i]]) for i in range(2)]
    assert [ref.add_sequence(k[i][:, :, :total[i]], v[i][:, :, :total[i]]) for i in range(2)] == rows
    on_device = 0                 # steps finishing a block whose appends encoded it on the device
    for step in range(steps):
        plan = cache.decode_plan(2 * heads)
        q = _q(rng, cache.max_seqs, 2 * heads, dim)
        finishing = any((total[i] + step + 1) % B == 0 for i in range(2))
        on_device += finishing and getattr(plan, "_appender", None) is not None
        for layer in range(layers):
            pos = [total[i] + step for i in range(2)]
            kn = torch.from_numpy(np.stack([k[i][layer, :, pos[i]:pos[i] + 1] for i in range(2)]).view(np.int16))
            vn = torch.from_numpy(np.stack([v[i][layer, :, pos[i]:pos[i] + 1] for i in range(2)]).view(np.int16))
            cache.update_layer(layer, rows, kn, vn)
            ref._apply([ref._prepare(layer, rows, kn, vn)])
            if step % 7 == 6 or step == steps - 1:         # attention where checked (the simulator is slow)
                out = plan.run(q, layer)
                held = {r: (k[i][:, :, :pos[i] + 1], v[i][:, :, :pos[i] + 1]) for i, r in enumerate(rows)}
                _check_attention(out, q, held, layer, rows)
        plan.check_status()
    assert max(cache.calibration.n_epochs(layer, 0) for layer in range(layers)) > 1
    assert on_device == (3 if codec == "cuda" else 0)       # the CUDA codec's steps encode block ends in the append
    cache._flush_all(), ref._flush_all()
    for layer in range(layers):                             # the same epochs, appended after the same blocks
        for kind in range(2):
            assert cache.calibration.n_epochs(layer, kind) == ref.calibration.n_epochs(layer, kind)
            np.testing.assert_array_equal(cache.stores(layer)[kind].epochs, ref.stores(layer)[kind].epochs)
    assert cache.memory() == ref.memory()
    assert_reads_back([cache], rows, k, v)


def test_plan_refuses_a_layer_without_its_token():
    rng = np.random.default_rng(2)
    k, v = synthetic(rng, 2, 1, 20, 64), synthetic(rng, 2, 1, 20, 64)
    cal = calibrate(k, v)
    cache = PagedKVCache(cal, **every_tile(cal, 1, 4))
    seq = cache.add_sequence(k, v)
    plan = cache.decode_plan(2)
    with pytest.raises(InputError, match="append the step's tokens"):
        plan.run(_q(rng, 1, 2, 64), 0)
    cache.update_layer(0, [seq], torch.from_numpy(k[None, 0, :, :1].view(np.int16)),
                       torch.from_numpy(v[None, 0, :, :1].view(np.int16)))
    with pytest.raises(InputError, match="finish the step"):
        cache.decode_plan(2)
    plan.run(_q(rng, 1, 2, 64), 0)
    with pytest.raises(InputError, match="query heads"):
        cache.decode_plan(9)


@pytest.mark.parametrize("codec", ["reference", "cuda"])
def test_plan_reserves_the_step_before_anything_is_written(codec):
    """A step whose finished blocks cannot fit raises at planning, before any layer is touched."""
    rng = np.random.default_rng(4)
    k, v = synthetic(rng, 2, 1, 2 * B, 64), synthetic(rng, 2, 1, 2 * B, 64)
    roomy = with_capacity(calibrate(k, v), np.full((2, 2), L.geometry(64).max_useful_capacity))
    cache = PagedKVCache(roomy, max_blocks=4, slots=1, raw_tiles=0, codec=codec)
    seq = cache.add_sequence(k[:, :, :2 * B - 1], v[:, :, :2 * B - 1])      # one block (the one slot) + 15
    with pytest.raises(PoolExhaustedError, match="exhausted"):
        cache.decode_plan(2)                    # this step would finish a second block in every layer
    assert [cache.seq_len(seq, layer) for layer in range(2)] == [2 * B - 1] * 2
    got_k, got_v = cache.read(seq)
    np.testing.assert_array_equal(got_k, k[:, :, :2 * B - 1])
    np.testing.assert_array_equal(got_v, v[:, :, :2 * B - 1])
    out = cache.decode_plan(2, append=0).run(_q(rng, 1, 2, 64), 1)      # attention over what is held still runs
    assert out.shape == (1, 2, 64)


@pytest.mark.parametrize("codec", ["reference", "cuda"])
def test_attention_covers_a_tail_past_the_tables_last_block(codec):
    """A sequence may hold a full block table and a tail after it: each step's attention covers the tail's
    tokens too (with the work list an eager step reuses for later lengths), on a cache that never grows and
    on one that grows its table at the next finished block."""
    rng = np.random.default_rng(8)
    k, v = synthetic(rng, 1, 1, 3 * B + 2, 64, spread=2.5), synthetic(rng, 1, 1, 3 * B + 2, 64)
    cal = calibrate(k, v)
    for grow in (False, True):
        cache = PagedKVCache(cal, **every_tile(cal, 1, 2), codec=codec, grow=grow)
        seq = cache.add_sequence(k[:, :, :2 * B - 1], v[:, :, :2 * B - 1])
        steps = B + 3 if grow else B
        for step in range(steps):              # the table fills, then the tail holds up to B - 1 tokens past it
            n = 2 * B - 1 + step
            plan = cache.decode_plan(2)
            cache.update_layer(0, [seq], torch.from_numpy(k[None, 0, :, n:n + 1].view(np.int16)),
                               torch.from_numpy(v[None, 0, :, n:n + 1].view(np.int16)))
            if step in (2, B - 1, steps - 1):
                q = _q(rng, 1, 2, 64)
                _check_attention(plan.run(q, 0), q, {seq: (k[:, :, :n + 1], v[:, :, :n + 1])}, 0, [seq])
        assert cache.max_blocks == (grown(2, 1) if grow else 2)           # a growth step past the third block
        np.testing.assert_array_equal(cache.read(seq)[0], k[:, :, :2 * B - 1 + steps])


def test_a_step_accounts_its_finished_blocks_once_and_a_call_part_way_settles_them(monkeypatch):
    """The host's account of the blocks a step's appends finish (pool counts, block epochs, the adapters'
    copies) is made once a step, at its last layer; a step stopped part way is accounted by the cache's next
    call, and the layers appended after it by the step's last layer.  Epochs and contents then match a
    cache updated in full, layer by layer."""
    from gaac.serving.append import StepAppend

    for name in ("WARMUP_BLOCKS", "ADAPT_EVERY"):
        monkeypatch.setattr(epochs_mod, name, 1)
    rng = np.random.default_rng(12)
    layers, n = 3, 2 * B - 1
    k, v = drifting(rng, layers, 1, n + 2, 64, 8.0), synthetic(rng, layers, 1, n + 2, 64)
    cal = calibrate(k[:, :, :B], v[:, :, :B])
    cache = PagedKVCache(cal, **every_tile(cal, 1, 4), codec="cuda")
    ref = PagedKVCache(cal, **every_tile(cal, 1, 4), codec="reference")
    seq = cache.add_sequence(k[:, :, :n], v[:, :, :n])
    ref.add_sequence(k[:, :, :n], v[:, :, :n])
    accounts = []
    account = StepAppend.account

    def counted(self, layers_, *args):
        accounts.append(list(layers_))
        return account(self, layers_, *args)
    monkeypatch.setattr(StepAppend, "account", counted)

    def token(layer, pos):
        return (torch.from_numpy(k[None, layer, :, pos:pos + 1].view(np.int16)),
                torch.from_numpy(v[None, layer, :, pos:pos + 1].view(np.int16)))

    plan = cache.decode_plan(2)                 # this step finishes block 1 in every layer
    assert plan._appender is not None
    cache.update_layer(0, [seq], *token(0, n))
    ref.update_layer(0, [seq], *token(0, n))
    assert accounts == []                       # pending until the step's last layer ...
    assert cache.seq_len(seq, 0) == n + 1       # ... or the cache's next call
    assert accounts == [[0]]
    for layer in range(1, layers):
        cache.update_layer(layer, [seq], *token(layer, n))
        ref.update_layer(layer, [seq], *token(layer, n))
    assert accounts == [[0], [1, 2]]
    assert cache.blocks_encoded == ref.blocks_encoded == 2 * layers
    cache._flush_all(), ref._flush_all()
    for layer in range(layers):
        for kind in range(2):
            assert cache.calibration.n_epochs(layer, kind) == ref.calibration.n_epochs(layer, kind)
            np.testing.assert_array_equal(cache.stores(layer)[kind].epochs, ref.stores(layer)[kind].epochs)
    assert cache.memory() == ref.memory()
    got_k, got_v = cache.read(seq)
    np.testing.assert_array_equal(got_k, k[:, :, :n + 1])
    np.testing.assert_array_equal(got_v, v[:, :, :n + 1])


def test_a_plan_follows_the_previous_step_where_only_the_lengths_advanced(monkeypatch):
    """A step's plan is made from the previous step's where that step's token reached every layer through its
    fast path, nothing else changed the cache and neither step finishes a block; otherwise (a layer appended
    through the full path, a new sequence, a finished block) the plan is made in full.  Either way the cache
    holds the same bits and attends over what it holds."""
    from gaac.serving.plan import StepPlan

    rng = np.random.default_rng(14)
    layers, n = 2, B + 8
    k, v = synthetic(rng, layers, 1, n + 8, 64), synthetic(rng, layers, 1, n + 8, 64)
    cal = calibrate(k, v)
    cache = PagedKVCache(cal, **every_tile(cal, 2, 4), codec="cuda")
    seq = cache.add_sequence(k[:, :, :n], v[:, :, :n])
    full = []
    plan_kernel = StepPlan._plan_kernel

    def counted(self, *args):
        full.append(len(full))
        return plan_kernel(self, *args)
    monkeypatch.setattr(StepPlan, "_plan_kernel", counted)

    def step(pos, seqs=None, slow_layer=None):
        plan = cache.decode_plan(2, seqs=seqs)
        made = len(full)
        for layer in range(layers):
            kn = torch.from_numpy(k[None, layer, :, pos:pos + 1].view(np.int16))
            vn = torch.from_numpy(v[None, layer, :, pos:pos + 1].view(np.int16))
            cache.update_layer(layer, (seq,) if layer == slow_layer else [seq], kn, vn)
        return plan, made

    plan, made = step(n)
    assert made == 1
    plan, made = step(n + 1)                      # the successor: only the lengths advanced
    assert made == 1 and plan.lens[seq] == n + 2 and plan._appender is not None
    plan, made = step(n + 2, slow_layer=1)        # follows; its layer 1 takes the full path ...
    assert made == 1
    plan, made = step(n + 3)                      # ... so the next plan is made in full
    assert made == 2
    plan, made = step(n + 4, seqs=[seq])          # the same sequences, named: follows
    assert made == 2
    plan, made = step(n + 5)                      # the live ones again (the same): follows
    assert made == 2
    empty = cache.add_sequence()                  # a new live sequence: in full, and the plan covers it
    plan = cache.decode_plan(2, append=0)
    assert len(full) == 3 and plan.seqs == [seq, empty]
    cache.remove_sequence(empty)
    plan, made = step(n + 6)                      # after a removal: in full
    assert made == 4
    plan, made = step(n + 7)                      # a step that finishes block 2: in full
    assert made == 5 and (n + 8) % B == 0
    q = _q(rng, 2, 2, 64)
    _check_attention(plan.run(q, 1), q, {seq: (k[:, :, :n + 8], v[:, :, :n + 8])}, 1, [seq])
    np.testing.assert_array_equal(cache.read(seq)[0], k)
    np.testing.assert_array_equal(cache.read(seq)[1], v)


def test_a_plan_the_caller_dropped_is_followed_as_one_it_holds(monkeypatch):
    """A serving loop that makes each step's plan inside a function drops the plan before the next one is made:
    the next plan follows the cache's record of the finished step as it follows a plan held, making the same
    plans in full (the first step, those that finish a block and the next ones), and the two caches hold the
    same bits and attend alike."""
    from gaac.serving.plan import StepPlan

    rng = np.random.default_rng(15)
    layers, n = 2, B + 5
    k, v = synthetic(rng, layers, 1, n + 2 * B, 64), synthetic(rng, layers, 1, n + 2 * B, 64)
    cal = calibrate(k, v)
    made = {True: [], False: []}
    plan_kernel = StepPlan._plan_kernel
    loop = [None]

    def counted(self, *args):
        made[loop[0]].append(int(self.lens.max()))
        return plan_kernel(self, *args)
    monkeypatch.setattr(StepPlan, "_plan_kernel", counted)

    def step(cache, seq, pos):
        plan = cache.decode_plan(2)
        for layer in range(layers):
            cache.update_layer(layer, [seq], torch.from_numpy(k[None, layer, :, pos:pos + 1].view(np.int16)),
                               torch.from_numpy(v[None, layer, :, pos:pos + 1].view(np.int16)))
        return plan

    caches, q = {}, _q(rng, 2, 2, 64)
    for hold in (True, False):
        loop[0] = hold
        cache = PagedKVCache(cal, **every_tile(cal, 2, 4), codec="cuda")
        seq = cache.add_sequence(k[:, :, :n], v[:, :, :n])
        held = None
        for pos in range(n, n + 2 * B - 3):
            if hold:
                held = step(cache, seq, pos)
            else:
                step(cache, seq, pos)                # its plan dropped as the function returns
                assert cache.serving.eager_plan is None
        caches[hold] = (cache, seq)
    # in full: the first step, the two that finish a block and the two after them
    assert made[True] == [n + 1, 2 * B, 2 * B + 1, 3 * B, 3 * B + 1] and made[False] == made[True], made
    (a, sa), (b, sb) = caches[True], caches[False]
    end = n + 2 * B - 3
    for cache, seq in ((a, sa), (b, sb)):
        np.testing.assert_array_equal(cache.read(seq)[0], k[:, :, :end])
        np.testing.assert_array_equal(cache.read(seq)[1], v[:, :, :end])
    assert torch.equal(a.decode_plan(2, append=0).run(q, 1), b.decode_plan(2, append=0).run(q, 1))
    # a record whose lengths the cache no longer holds (a captured step's account advances them without a new
    # generation) is not followed
    step(b, sb, end)
    record = b.serving.last_step
    assert record is not None and record.lens[sb] == end + 1
    loop[0] = False
    made[False].clear()
    b.host_lengths[:, sb] += 1                  # as a replayed step's account leaves them
    try:
        b.decode_plan(2)
        assert made[False] == [end + 3]          # made in full, for the lengths the cache holds
    finally:
        b.host_lengths[:, sb] -= 1


def test_fused_merge_work_gives_every_row_a_split_and_groups_the_splits():
    from gaac.attention import split_work
    from gaac.serving.plan import fused_merge_work

    split = split_work([(0, 0, 20), (2, 0, 3)], 4, 2, None, blocks_per_split=1)     # rows 1 and 3 hold nothing
    work, mrg, group = fused_merge_work(split, 4, 2)
    work = work.reshape(-1, 3)
    assert mrg[:5].tolist() == [0, 20, 21, 24, 25] and group == 8                    # each row's first split
    assert work[:, 0].tolist() == [0] * 20 + [1] + [2] * 3 + [3]
    assert work[20].tolist() == [1, 0, 0] and work[24].tolist() == [3, 0, 0]        # a split of no blocks
    assert work[:20, 1].tolist() == list(range(20)) and work[21:24, 1].tolist() == [0, 1, 2]
    assert mrg[5:10].tolist() == [0, 3, 4, 5, 6]                                      # 20 splits: 3 groups of 8
    assert len(mrg) == 10 + (6 + 4) * 2 and not mrg[10:].any()


@pytest.mark.parametrize("fused", [True, False])
def test_an_eager_step_merges_in_the_kernel_over_groups_and_empty_rows(fused, monkeypatch):
    """The eager step's attention merges its splits in the kernel (two levels where a sequence has more splits
    than a group): each live row matches float64, and a row without a sequence gives 0 and LSE -inf.  The same
    with the merge kernel (``FUSED_MERGE`` off, as a captured step runs)."""
    import gaac.serving.plan as step_mod

    monkeypatch.setattr(step_mod, "FUSED_MERGE", fused)
    monkeypatch.setattr(step_mod, "wave_target", lambda kernel, like: (256, None))   # a split a block
    monkeypatch.setattr(step_mod, "PLAN_AHEAD", B)                                   # of the blocks held
    rng = np.random.default_rng(15)
    lens = [9 * B + 5, 3 * B]
    k = [synthetic(rng, 1, 1, n + 1, 64) for n in lens]
    v = [synthetic(rng, 1, 1, n + 1, 64) for n in lens]
    cal = calibrate(k[0], v[0])
    cache = PagedKVCache(cal, **every_tile(cal, 3, 16), codec="cuda")
    a = cache.add_sequence(k[0][:, :, :lens[0]], v[0][:, :, :lens[0]])
    gap = cache.add_sequence()
    c = cache.add_sequence(k[1][:, :, :lens[1]], v[1][:, :, :lens[1]])
    cache.remove_sequence(gap)
    plan = cache.decode_plan(4)
    assert plan._fused == fused
    if fused:
        # a split a block: 10 (2 groups), the empty row's, 4
        assert plan._group == 8 and plan.n_work == 10 + 1 + 4
    kn = torch.from_numpy(np.stack([k[0][0, :, lens[0]:], k[1][0, :, lens[1]:]]).view(np.int16))
    vn = torch.from_numpy(np.stack([v[0][0, :, lens[0]:], v[1][0, :, lens[1]:]]).view(np.int16))
    cache.update_layer(0, [a, c], kn, vn)
    q = _q(rng, 3, 4, 64)
    out, lse = plan.run(q, 0, return_lse=True)
    _check_attention(out, q, {a: (k[0], v[0]), c: (k[1], v[1])}, 0, [a, c])
    assert not out[gap].view(torch.int16).any() and torch.isneginf(lse[gap]).all()
    assert torch.isfinite(lse[[a, c]]).all()
    if fused:
        assert not plan._mrg[2 * 4:].any()                            # the counters are left at zero


def test_block_table_limit_names_max_blocks():
    rng = np.random.default_rng(6)
    k, v = synthetic(rng, 1, 1, B, 64), synthetic(rng, 1, 1, B, 64)
    cal = calibrate(k, v)
    cache = PagedKVCache(cal, **every_tile(cal, 1, 1))
    cache.add_sequence(k, v)
    with pytest.raises(PoolExhaustedError, match="max_blocks"):
        cache.decode_plan(1, append=B)
    assert L.BLOCK_TOKENS == B


def test_step_status_names_the_faulty_layer():
    """A table entry past its pool (simulator kernel): the serving path reports it at check_status, naming the layer."""
    from gaac.errors import FormatError

    rng = np.random.default_rng(8)
    k, v = synthetic(rng, 2, 1, 2 * B + 3, 64), synthetic(rng, 2, 1, 2 * B + 3, 64)
    cal = calibrate(k, v)
    cache = PagedKVCache(cal, **every_tile(cal, 1, 4), codec="cuda")
    seq = cache.add_sequence(k, v)
    store = cache.stores(1)[0]
    store.table[seq, 1, 0] = store.slots.data.shape[0] + 3          # past the slot pool
    plan = cache.decode_plan(2, append=0)
    q = _q(rng, 1, 2, 64)
    plan.run(q, 0)
    plan.check_status()                                            # layer 0 is sound
    plan.run(q, 1)
    with pytest.raises(FormatError, match="layer 1.*past its slot or raw-tile pool"):
        plan.check_status()


def test_counts_and_blocks_asked_for_in_one_copy_reach_their_own_stores(monkeypatch):
    """On a GPU the host asks for every store's free-list counts, and copies every adapter's finished blocks,
    in one pinned copy each (in flight, with one event; the counts copied from where the cache keeps them, no
    gather first): each pool takes up its own store's counts once the copy has arrived, and each store gets its
    own blocks.  The copy is made on the CPU here, with an event that arrives when the test says so."""
    rng = np.random.default_rng(9)
    k, v = synthetic(rng, 2, 1, 3 * B, 64), synthetic(rng, 2, 1, 3 * B, 64)
    cal = calibrate(k, v)
    cache = PagedKVCache(cal, **every_tile(cal, 1, 4), codec="cuda")
    cache.add_sequence(k, v)

    class Arrival:
        done = False
        queries_after = 0                   # queries once arrived: the pools share one answer

        def query(self):
            self.queries_after += self.done
            return self.done

    arrival = Arrival()
    copies = []

    sources = []

    def one_copy(x):
        copies.append(x.shape)
        sources.append(x.untyped_storage().data_ptr())
        return x.clone(), arrival
    monkeypatch.setattr(cache, "_host_copy", one_copy)
    monkeypatch.setattr(cache, "device", torch.device("cuda"))
    stores = [store for layer in map(cache.stores, range(cache.layers)) for store in layer]
    for i, store in enumerate(stores):                     # counts the device would hold after new encodes
        store.heads.copy_(torch.tensor([i + 1, 2 * i], dtype=torch.int32))
        cache._encodes_launched(store, 3)
    before = [[pool.free_lower() for pool in (s.slots, s.raw)] for s in stores]
    cache._ask_counts(stores)
    assert copies == [(len(stores), 2)]                     # one copy for every store, from where the counts lie
    assert sources == [stores[0].heads.untyped_storage().data_ptr()]
    for store, lower in zip(stores, before):                # not arrived: the bounds stay
        assert [pool.free_lower() for pool in (store.slots, store.raw)] == lower
    arrival.done = True
    for i, store in enumerate(stores):
        assert store.slots.free_lower() == store.slots.listed - (i + 1)
        assert store.raw.free_lower() == store.raw.listed - 2 * i
    assert arrival.queries_after == 1
    blocks = [torch.full((2, 3), i, dtype=torch.int16) for i in range(len(stores))]
    got = cache._host_copies(blocks)
    assert copies[1:] == [(len(stores), 2, 3)]
    assert all(event.event is arrival and torch.equal(host, block) for (host, event), block in zip(got, blocks))


def test_attention_follows_an_append_only_right_after_that_layers_append():
    """The plan launches a layer's attention as a programmatic dependent of the append only where the launch
    before it on the same stream was that layer's one-token append of this step and nothing in the cache
    changed since; the note is used once."""
    rng = np.random.default_rng(3)
    k, v = synthetic(rng, 2, 1, 3 * B, 64), synthetic(rng, 2, 1, 3 * B, 64)
    cal = calibrate(k[:, :, :32], v[:, :, :32])
    cache = PagedKVCache(cal, **every_tile(cal, 2, 8), codec="cuda")
    cache.add_sequence(k, v)
    plan = cache.decode_plan(2)
    assert plan._current_stream is None            # the simulator launches through numba: no note is made
    plan.appended_last(1)
    assert not plan._follows_append(1, 7)
    stream = [7]
    plan._current_stream = lambda: stream[0]       # as on a GPU, where the plan launches through the driver
    plan.appended_last(1)
    assert plan._follows_append(1, 7)
    assert not plan._follows_append(1, 7)              # used once
    plan.appended_last(1)
    assert not plan._follows_append(0, 7)              # another layer's attention
    plan.appended_last(1)
    assert not plan._follows_append(1, 8)              # another stream
    plan.appended_last(1)
    cache.serving.lengths_changed()                    # the cache changed in between
    assert not plan._follows_append(1, 7)
    stream[0] = 8
    plan.appended_last(0)
    assert plan._follows_append(0, 8)


@pytest.mark.parametrize("codec", ["reference", "cuda"])
def test_run_with_the_token_appends_as_update_layer_does(codec):
    """``plan.run(q, layer, k=, v=)`` (one call a layer) leaves the cache and the attention bit for bit as
    ``update_layer`` then ``run`` do, across block ends; half a token, or a token of the wrong shape, is
    refused before anything is written, naming what is wrong."""
    rng = np.random.default_rng(5)
    layers, heads, dim, steps = 2, 1, 64, 6
    start = [B - 3, 2 * B - 1]
    k = [synthetic(rng, layers, heads, n + steps, dim) for n in start]
    v = [synthetic(rng, layers, heads, n + steps, dim) for n in start]
    cal = calibrate(k[0][:, :, :32], v[0][:, :, :32])
    caches = [PagedKVCache(cal, **every_tile(cal, 2, 8), codec=codec) for _ in range(2)]
    rows = [[c.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) for i in range(2)] for c in caches][0]
    for step in range(steps):
        plans = [c.decode_plan(2 * heads) for c in caches]
        q = _q(rng, 2, 2 * heads, dim)
        for layer in range(layers):
            pos = [start[i] + step for i in range(2)]
            kn = torch.from_numpy(np.stack([k[i][layer, :, pos[i]:pos[i] + 1] for i in range(2)]).view(np.int16))
            vn = torch.from_numpy(np.stack([v[i][layer, :, pos[i]:pos[i] + 1] for i in range(2)]).view(np.int16))
            if step == 0 and layer == 0:
                lens = caches[1].host_lengths.copy()
                with pytest.raises(InputError, match="k and v"):
                    plans[1].run(q, layer, k=kn)
                with pytest.raises(InputError, match="k"):
                    plans[1].run(q, layer, k=kn[:, :, :, :dim // 2], v=vn[:, :, :, :dim // 2])
                np.testing.assert_array_equal(caches[1].host_lengths, lens)
            caches[0].update_layer(layer, rows, kn, vn)
            want = plans[0].run(q, layer)
            got = plans[1].run(q, layer, k=kn, v=vn)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (step, layer)
        for p in plans:
            p.check_status()
    caches[0]._flush_all(), caches[1]._flush_all()
    assert caches[0].memory() == caches[1].memory()
    assert_reads_back(caches, rows, k, v, [n + steps for n in start])
