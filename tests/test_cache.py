"""gaac.PagedKVCache: bit-exact read-back under random appends, prefills and removals; pools; accounting.

The oracle for contents is a plain dict of NumPy arrays (what went in); the
oracle for storage is the block container (gaac.encode_block), which encodes
the same blocks independently of the cache's pools and tables.
"""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from strategies import bf16_bits, drifting

import gaac.cache.codec as codec_mod
import gaac.cache.update as update_mod
from gaac import layout as L
from gaac.format.block import encode_block
from gaac.cache import PagedKVCache, PoolExhaustedError, blocks_to_tiles, tiles_to_tokens
from gaac.calibration import Calibration, calibrate
import gaac.epochs as epochs_mod
from gaac.epochs import EPOCH_INDEX_BYTES, assign_epochs
from gaac.errors import GAACError, InputError
from gaac.io import load_sample
from gaac.tiles import block_tiles, cache_blocks, untile

B = L.BLOCK_TOKENS


def synthetic(rng, layers, heads, tokens, dim, spread=1.5):
    """Random BF16 bits whose exponents scatter around per-channel centres, as real K/V do."""
    centres = rng.integers(110, 135, size=(layers, heads, 1, dim))
    e = np.clip(np.rint(centres + rng.normal(0, spread, size=(layers, heads, tokens, dim))), 0, 255).astype(np.uint16)
    sm = rng.integers(0, 256, size=e.shape, dtype=np.uint16)
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)


def with_capacity(cal: Calibration, capacity) -> Calibration:
    return Calibration(b3=cal.b3, b4=cal.b4, capacity=capacity, model=cal.model)


def independent_memory(cache: PagedKVCache, contents: dict) -> dict:
    """Resident bytes of ``contents`` counted with the block container, not the cache's pools.

    Each block is coded with the epoch the cache recorded for it (whether those are the right
    epochs is tested against gaac.epochs.assign_epochs below).
    """
    cal = cache.calibration
    geo = L.geometry(cal.head_dim)
    slots_tables = raw = epochs = 0
    for seq, (k, v) in contents.items():
        n = k.shape[2] // B
        for layer in range(cal.layers):
            view = cache.layer_view(layer)
            for kind, x in enumerate((k, v)):
                for b in range(n):
                    epoch = 0 if view.epoch is None else int(view.epoch[kind][seq, b])
                    eb = encode_block(x[layer, :, b * B:(b + 1) * B], cal, layer, kind, epoch)
                    slots_tables += eb.resident_bytes
                    raw += len(eb.raw_tiles) * geo.raw_bytes
                    epochs += EPOCH_INDEX_BYTES if cache.adapt else 0
    if cache.adapt:
        epochs += sum(cal.n_epochs(layer, kind) - 1 for layer in range(cal.layers) for kind in (0, 1)) \
            * 2 * cal.kv_heads * cal.head_dim
    tails = len(contents) * cal.layers * 2 * B * cal.kv_heads * cal.head_dim * 2
    tokens = sum(k.shape[2] for k, _ in contents.values())
    return dict(resident=slots_tables + tails + epochs, raw=raw, tokens=tokens,
                bf16=tokens * cal.layers * 2 * cal.kv_heads * cal.head_dim * 2)


def check_accounting(cache, contents):
    m = cache.memory()
    want = independent_memory(cache, contents)
    assert (m.resident_bytes, m.raw_bytes, m.tokens, m.bf16_bytes) == \
        (want["resident"], want["raw"], want["tokens"], want["bf16"])


# ----------------------------------------------------------------------------------------------
# Random appends, prefills and removals.

class CacheMachine(RuleBasedStateMachine):
    """A cache against a dict of what each sequence holds; small pools, so exhaustion happens too."""

    CODEC = "reference"

    @initialize(dim=st.sampled_from((64, 256)), heads=st.integers(1, 2), seed=st.integers(0, 2**32 - 1),
                caps=st.lists(st.sampled_from((0, 16, 32, None)), min_size=4, max_size=4), grow=st.booleans(),
                pool=st.integers(2, 40))
    def setup(self, dim, heads, seed, caps, grow, pool):
        self.rng = np.random.default_rng(seed)
        sample = synthetic(self.rng, 2, heads, 4 * B, dim)
        cal = calibrate(sample, synthetic(self.rng, 2, heads, 4 * B, dim))
        cap = np.array([c if c is not None else cal.capacity.flat[i] for i, c in enumerate(caps)]).reshape(2, 2)
        self.cal = with_capacity(cal, cap)
        self.cache = PagedKVCache(self.cal, max_seqs=3, max_blocks=4, slots=pool, raw_tiles=pool // 2, grow=grow,
                                  codec=self.CODEC)
        self.contents = {}
        self.finished = 0            # blocks of any sequence that ever completed (per layer)

    def tokens(self, t):
        return (synthetic(self.rng, 2, self.cal.kv_heads, t, self.cal.head_dim, spread=self.rng.choice([0.5, 3.0])),
                synthetic(self.rng, 2, self.cal.kv_heads, t, self.cal.head_dim, spread=1.0))

    def attempt(self, action, seq=None):
        """Run ``action``; if a pool runs out, the cache must be exactly as before."""
        before = ({s: self.cache.read(s) for s in self.contents}, self.cache.memory(), self.cache.blocks_encoded)
        try:
            return action(), True
        except PoolExhaustedError:
            event("a pool ran out")
            assert not self.cache.grow
            after = ({s: self.cache.read(s) for s in self.contents}, self.cache.memory(), self.cache.blocks_encoded)
            assert after[1:] == before[1:]
            assert after[0].keys() == before[0].keys()
            for s in before[0]:
                for a, b in zip(after[0][s], before[0][s]):
                    np.testing.assert_array_equal(a, b)
            return None, False

    @rule(t=st.integers(0, 70))
    def add(self, t):
        k, v = self.tokens(t)
        seq, ok = self.attempt(lambda: self.cache.add_sequence(k, v) if t else self.cache.add_sequence())
        if ok:
            assert seq not in self.contents
            self.contents[seq] = (k, v)
            self.finished += t // B

    @rule(data=st.data(), t=st.integers(0, 40))
    def append(self, data, t):
        if not self.contents:
            return
        seq = data.draw(st.sampled_from(sorted(self.contents)))
        k, v = self.tokens(t)
        _, ok = self.attempt(lambda: self.cache.append(seq, k, v))
        if ok:
            old_k, old_v = self.contents[seq]
            self.finished += (old_k.shape[2] + t) // B - old_k.shape[2] // B
            self.contents[seq] = (np.concatenate([old_k, k], axis=2), np.concatenate([old_v, v], axis=2))

    @rule()
    def step(self):
        """A decode step of every live sequence: one plan, then one token each, layer by layer.  The plan
        reserves the step, so it fails before anything is written or not at all."""
        if not self.contents:
            return
        seqs = sorted(self.contents)
        k, v = self.tokens(len(seqs))                      # token i of each is sequence i's
        new = [torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3)[:, :, :, None]).view(np.int16))
               for x in (k, v)]                            # [layers, seqs, heads, 1, dim]

        def go():
            self.cache.decode_plan(self.cal.kv_heads)
            for layer in range(self.cal.layers):
                self.cache.update_layer(layer, seqs, new[0][layer], new[1][layer])
        _, ok = self.attempt(go)
        if ok:
            for i, seq in enumerate(seqs):
                old_k, old_v = self.contents[seq]
                self.finished += (old_k.shape[2] + 1) // B - old_k.shape[2] // B
                self.contents[seq] = (np.concatenate([old_k, k[:, :, i:i + 1]], axis=2),
                                      np.concatenate([old_v, v[:, :, i:i + 1]], axis=2))

    @rule(data=st.data())
    def remove(self, data):
        if not self.contents:
            return
        seq = data.draw(st.sampled_from(sorted(self.contents)))
        self.cache.remove_sequence(seq)
        del self.contents[seq]

    @invariant()
    def reads_back_exactly(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.sequences == sorted(self.contents)
        for seq, (k, v) in self.contents.items():
            got_k, got_v = self.cache.read(seq)
            np.testing.assert_array_equal(got_k, k)
            np.testing.assert_array_equal(got_v, v)
        assert self.cache.blocks_encoded == self.finished * self.cal.layers   # once per finished block, never again

    @invariant()
    def pools_match_tables(self):
        """Every used slot and raw tile is referenced exactly once by a live table entry."""
        if not hasattr(self, "cache"):
            return
        raw_records = []         # every layer and kind's raw tiles: records of the one arena
        for layer in range(self.cal.layers):
            view = self.cache.layer_view(layer)
            for kind in range(2):
                entries = np.concatenate([view.table[kind][s, :self.cache.seq_len(s, layer) // B].reshape(-1).numpy()
                                          for s in self.contents] or [np.zeros(0, np.int32)]).view(np.uint32)
                is_raw = entries >= L.TABLE_RAW_FLAG
                index = entries & L.TABLE_INDEX_MASK
                assert len(set(index[~is_raw])) == (~is_raw).sum()
                raw_records += index[is_raw].tolist()
                store = self.cache.stores(layer)[kind]
                assert store.raw.used == is_raw.sum() and store.slots.used == (~is_raw).sum()
                assert view.raw[kind] is self.cache._arena.data
                if is_raw.any():
                    event("raw tiles in use")
        arena = self.cache._arena
        assert len(set(raw_records)) == len(raw_records) == arena.used()
        assert not set(raw_records) & set(arena.free_records().tolist())
        assert arena.used() + len(arena.free_records()) == arena.size

    @invariant()
    def accounting(self):
        if hasattr(self, "cache"):
            check_accounting(self.cache, self.contents)


CacheMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=12, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCacheMachine = CacheMachine.TestCase


class CudaCacheMachine(CacheMachine):
    """The same interleavings with the CUDA codec (numba's simulator): free lists on the device, the one-token
    append kernel, encodes straight into the pools and their undo when a pool runs dry."""

    CODEC = "cuda"


CudaCacheMachine.TestCase.settings = settings(max_examples=6, stateful_step_count=10, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestCudaCacheMachine = CudaCacheMachine.TestCase


# ----------------------------------------------------------------------------------------------
# The real sample: token-by-token decode after a prefill.

@pytest.fixture(scope="module")
def real():
    k, v, _ = load_sample("prose")
    ck, cv, _ = load_sample("code")
    return k, v, calibrate(ck, cv)


def test_prefill_then_decode_reads_back_and_encodes_each_block_once(real, monkeypatch):
    k, v, cal = real
    encoded = []

    def counting(tiles, *args):
        encoded.append(tiles.copy())
        return encode_tiles(tiles, *args)

    encode_tiles = codec_mod.encode_tiles
    monkeypatch.setattr(codec_mod, "encode_tiles", counting)
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=8)
    prompt = 37
    seq = cache.add_sequence(k[:, :, :prompt], v[:, :, :prompt])
    assert cache.blocks_encoded == cal.layers * (prompt // B)          # prefill: complete blocks, straight away
    assert sum(len(t) for t in encoded) == 2 * cal.layers * (prompt // B) * cache.tiles_per_block
    for t in range(prompt, 100):
        cache.append(seq, k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert cache.seq_len(seq) == t + 1
    got_k, got_v = cache.read(seq)
    np.testing.assert_array_equal(got_k, k[:, :, :100])
    np.testing.assert_array_equal(got_v, v[:, :, :100])
    # Every finished block was encoded exactly once: the encoded tiles are the blocks' tiles, no repeats.
    assert cache.blocks_encoded == cal.layers * (100 // B)
    tiles = np.concatenate(encoded)
    assert len(tiles) == 2 * cal.layers * (100 // B) * cache.tiles_per_block
    expect = [block_tiles(x[layer, :, b * B:(b + 1) * B]) for x in (k, v) for layer in range(cal.layers)
              for b in range(100 // B)]
    assert sorted(t.tobytes() for t in tiles) == sorted(t.tobytes() for e in expect for t in e)
    check_accounting(cache, {seq: (k[:, :, :100], v[:, :, :100])})
    m = cache.memory()
    assert m.resident_bytes < m.bf16_bytes


def test_slots_and_raw_tiles_are_the_block_containers(real):
    """The pools hold, tile for tile, the slots and raw tiles the block container makes of the same block."""
    k, v, cal = real
    cal = with_capacity(cal, np.full_like(cal.capacity, 16))         # a small slot: some tiles go raw
    cache = PagedKVCache(cal, max_seqs=1, max_blocks=4, raw_tiles=64)
    seq = cache.add_sequence(k[:, :, :64], v[:, :, :64])
    raw_seen = 0
    for layer in range(cal.layers):
        view = cache.layer_view(layer)
        for kind, x in enumerate((k, v)):
            for b in range(4):
                eb = encode_block(x[layer, :, b * B:(b + 1) * B], cal, layer, kind)
                entries = view.table[kind][seq, b].numpy().view(np.uint32)
                is_raw = entries >= L.TABLE_RAW_FLAG
                assert tuple(np.flatnonzero(is_raw)) == eb.raw_tiles
                geo = L.geometry(cal.head_dim)
                body = eb.data[L.STREAM_HEADER_BYTES + len(entries) * L.TABLE_ENTRY_BYTES:-L.STREAM_CRC_BYTES]
                n_slot = int((~is_raw).sum())
                size = geo.slot_bytes(view.capacity[kind])
                slots = np.frombuffer(body[:n_slot * size], np.uint8).reshape(n_slot, size)
                raws = np.frombuffer(body[n_slot * size:], "<i2").reshape(-1, B, geo.channels)
                np.testing.assert_array_equal(view.slots[kind][entries[~is_raw].astype(np.int64)].numpy(), slots)
                index = (entries[is_raw] & L.TABLE_INDEX_MASK).astype(np.int64)
                np.testing.assert_array_equal(view.raw[kind][index].numpy(), raws)
                raw_seen += len(index)
    assert raw_seen > 0


def test_layer_view_contract(real):
    k, v, cal = real
    cache = PagedKVCache(cal, max_seqs=3, max_blocks=4)
    a = cache.add_sequence(k[:, :, :40], v[:, :, :40])
    b = cache.add_sequence(k[:, :, :7], v[:, :, :7])
    view = cache.layer_view(2)
    assert view.seq_lens.dtype == torch.int32 and view.seq_lens.tolist() == [40, 7, 0]
    assert view.table[0].shape == (3, 4, cal.kv_heads) and view.table[0].dtype == torch.int32
    assert view.tail_k.dtype == torch.int16 and view.tail_k.shape == (3, cal.kv_heads, B, cal.head_dim)
    np.testing.assert_array_equal(view.tail_k[a, :, :8].numpy().view(np.uint16), k[2, :, 32:40])
    np.testing.assert_array_equal(view.tail_v[b, :, :7].numpy().view(np.uint16), v[2, :, :7])
    assert view.b3[1].dtype == torch.uint8 and view.b3[1].shape == (1, cal.kv_heads, cal.head_dim)
    assert (view.b3[1][0].numpy() == cal.b3[1, 2]).all()                     # epoch 0: the calibration's bases
    assert view.epoch[0].dtype == torch.int16 and view.epoch[0].shape == (3, 4)
    assert view.capacity == (int(cal.capacity[0, 2]), int(cal.capacity[1, 2]))
    # The view is the live storage, not a copy: a later block shows up in it.
    cache.append(b, k[:, :, 7:16], v[:, :, 7:16])
    assert view.seq_lens.tolist() == [40, 16, 0] and view.table[0][b, 0].tolist() != [0] * cal.kv_heads


def test_decode_attention_reads_the_view(real):
    """The fused-attention entry point (CPU path) accepts the cache's views as they are."""
    attention = pytest.importorskip("gaac.attention")
    k, v, cal = real
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=4)
    cache.add_sequence(k[:, :, :50], v[:, :, :50])
    cache.add_sequence(k[:, :, 3:24], v[:, :, 3:24])
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((2, 2 * cal.kv_heads, cal.head_dim)).astype(np.float32).view(np.uint32) >> 16)
    q = q.astype(np.uint16)
    out = attention.decode_attention(q, cache.layer_view(1), backend="cpu")
    ks = [attention.bf16_to_float(k[1, :, :50]), attention.bf16_to_float(k[1, :, 3:24])]
    vs = [attention.bf16_to_float(v[1, :, :50]), attention.bf16_to_float(v[1, :, 3:24])]
    ref, _ = attention.reference_attention(attention.bf16_to_float(q), ks, vs, dtype=np.float32)
    np.testing.assert_array_equal(out, attention.float_to_bf16(ref))


# ----------------------------------------------------------------------------------------------
# Pools, tables and sequence rows that run out.

def snapshot(cache):
    return ({s: cache.read(s) for s in cache.sequences}, cache.memory(), cache.blocks_encoded,
            [[st.slots.free.tolist() for st in layer] for layer in map(cache.stores, range(cache.layers))],
            cache._arena.free_records().tolist())


def assert_same(a, b):
    assert a[1:] == b[1:] and a[0].keys() == b[0].keys()
    for s in a[0]:
        for x, y in zip(a[0][s], b[0][s]):
            np.testing.assert_array_equal(x, y)


def test_slot_pool_exhaustion_leaves_cache_unchanged(real):
    k, v, cal = real
    per = cal.kv_heads
    cache = PagedKVCache(cal, max_seqs=4, max_blocks=8, slots=3 * per, raw_tiles=8)
    a = cache.add_sequence(k[:, :, :40], v[:, :, :40])          # 2 blocks per layer and kind
    cache.add_sequence(k[:, :, :12], v[:, :, :12])
    before = snapshot(cache)
    with pytest.raises(PoolExhaustedError, match="slot pool is exhausted") as err:
        cache.append(a, k[:, :, 40:80], v[:, :, 40:80])          # needs 2 more blocks' slots, 1 left
    assert isinstance(err.value, GAACError)
    assert_same(snapshot(cache), before)
    with pytest.raises(PoolExhaustedError):
        cache.add_sequence(k[:, :, :33], v[:, :, :33])
    assert_same(snapshot(cache), before)
    cache.remove_sequence(a)                                      # frees 2 blocks' slots: now it fits
    c = cache.add_sequence(k[:, :, :48], v[:, :, :48])
    np.testing.assert_array_equal(cache.read(c)[0], k[:, :, :48])


def test_raw_pool_exhaustion_in_one_layer_changes_no_layer(real):
    """Layer 0 has room (big slots), the last layer's tiny slots overflow into an empty raw pool: nothing moves."""
    k, v, cal = real
    cap = np.full_like(cal.capacity, L.geometry(cal.head_dim).max_useful_capacity)
    cap[:, -1] = 0
    cache = PagedKVCache(with_capacity(cal, cap), max_seqs=1, max_blocks=4, raw_tiles=0)
    seq = cache.add_sequence(k[:, :, :10], v[:, :, :10])
    before = snapshot(cache)
    with pytest.raises(PoolExhaustedError, match=f"raw-tile arena is exhausted.*layer {cal.layers - 1} . raw tiles"):
        cache.append(seq, k[:, :, 10:20], v[:, :, 10:20])
    assert_same(snapshot(cache), before)
    assert cache.seq_len(seq, 0) == 10


def test_table_and_rows_exhaustion(real):
    k, v, cal = real
    cache = PagedKVCache(cal, max_seqs=1, max_blocks=2)
    seq = cache.add_sequence(k[:, :, :47], v[:, :, :47])
    before = snapshot(cache)
    with pytest.raises(PoolExhaustedError, match="block table holds 2"):
        cache.append(seq, k[:, :, 47:48], v[:, :, 47:48])
    with pytest.raises(PoolExhaustedError, match="sequence rows"):
        cache.add_sequence()
    assert_same(snapshot(cache), before)


def test_grow_enlarges_instead_of_failing(real):
    k, v, cal = real
    cache = PagedKVCache(cal, max_seqs=1, max_blocks=1, slots=1, raw_tiles=0, grow=True)
    seqs = [cache.add_sequence(k[:, :, :70 + i], v[:, :, :70 + i]) for i in range(3)]
    assert cache.max_seqs >= 3 and cache.max_blocks >= 70 // B
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(cache.read(s)[1], v[:, :, :70 + i])
    check_accounting(cache, {s: (k[:, :, :70 + i], v[:, :, :70 + i]) for i, s in enumerate(seqs)})


# ----------------------------------------------------------------------------------------------
# Inputs.

def test_bad_inputs_are_named(real):
    k, v, cal = real
    cache = PagedKVCache(cal)
    seq = cache.add_sequence()
    with pytest.raises(InputError, match="not in the cache"):
        cache.append(7, k[:, :, :1], v[:, :, :1])
    with pytest.raises(InputError, match="head_dim"):
        cache.append(seq, k[:, :, :1, :32], v[:, :, :1, :32])
    with pytest.raises(InputError, match="layers first"):
        cache.append(seq, k[:2, :, :1], v[:2, :, :1])
    with pytest.raises(InputError, match="not BF16"):
        cache.append(seq, torch.zeros(k[:, :, :1].shape), torch.zeros(v[:, :, :1].shape))
    with pytest.raises(InputError, match="layer 99"):
        cache.layer_view(99)
    with pytest.raises(InputError, match="calibration"):
        PagedKVCache("cal.json")
    with pytest.raises(InputError, match="max_seqs"):
        PagedKVCache(cal, max_seqs=0)
    assert cache.seq_len(seq) == 0


def test_torch_bf16_input_and_batched_layer_update(real):
    k, v, cal = real
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    as_bf16 = lambda x: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)  # noqa: E731
    for layer in range(cal.layers):
        batch_k = np.stack([k[layer, :, :20], k[layer, :, 20:40]])
        batch_v = np.stack([v[layer, :, :20], v[layer, :, 20:40]])
        cache.update_layer(layer, [a, b], as_bf16(batch_k), as_bf16(batch_v))
        got_k, got_v = cache.read_layer(layer, [a, b])
        np.testing.assert_array_equal(got_k.numpy().view(np.uint16), batch_k)
        np.testing.assert_array_equal(got_v.numpy().view(np.uint16), batch_v)
    assert cache.blocks_encoded == 2 * cal.layers


@given(dim=st.sampled_from(L.SUPPORTED_HEAD_DIMS), heads=st.integers(1, 3), seqs=st.integers(1, 2),
       blocks=st.integers(0, 3), data=st.data())
@settings(max_examples=20, deadline=None)
def test_torch_tiling_matches_gaac_tiles(dim, heads, seqs, blocks, data):
    x = data.draw(bf16_bits((seqs, heads, blocks * B, dim)))
    as_blocks = x.reshape(seqs, heads, blocks, B, dim).transpose(0, 2, 1, 3, 4).reshape(-1, heads, B, dim)
    tiles = blocks_to_tiles(torch.from_numpy(as_blocks.view(np.int16)))
    np.testing.assert_array_equal(tiles.numpy().view(np.uint16), block_tiles(as_blocks))
    back = tiles_to_tokens(tiles, seqs, blocks, heads, dim).numpy().view(np.uint16)
    np.testing.assert_array_equal(back, x)
    if blocks:
        per = heads * L.tiles_per_head(dim)
        np.testing.assert_array_equal(untile(tiles[:per].numpy(), heads, dim).view(np.uint16), as_blocks[0])


def test_cuda_codec_path_in_the_simulator():
    """codec='cuda' (gaac.cuda.codec; numba's simulator here) stores the same bytes as the reference codec."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(3)
    k, v = synthetic(rng, 1, 1, 2 * B + 5, 64, spread=2.5), synthetic(rng, 1, 1, 2 * B + 5, 64)
    cal = with_capacity(calibrate(k, v), [[16], [32]])
    caches = [PagedKVCache(cal, max_blocks=2, raw_tiles=4, codec=c) for c in ("reference", "cuda")]
    for cache in caches:
        seq = cache.add_sequence(k[:, :, :B - 3], v[:, :, :B - 3])
        cache.append(seq, k[:, :, B - 3:], v[:, :, B - 3:])
        np.testing.assert_array_equal(cache.read(seq)[0], k)
        np.testing.assert_array_equal(cache.read(seq)[1], v)
    ref, sim = (c.layer_view(0) for c in caches)
    for kind in range(2):
        assert (ref.table[kind] < 0).any() or kind == 1       # K's 16-byte slots overflow somewhere
        for r_entry, s_entry in zip(ref.table[kind][0].reshape(-1).tolist(), sim.table[kind][0].reshape(-1).tolist()):
            assert (r_entry < 0) == (s_entry < 0)
            if r_entry >= 0:
                assert torch.equal(ref.slots[kind][r_entry], sim.slots[kind][s_entry])
    # An empty raw pool (every tile fits the widest slot) is fine too.
    roomy = with_capacity(cal, np.full((2, 1), L.geometry(64).max_useful_capacity))
    cache = PagedKVCache(roomy, max_blocks=2, raw_tiles=0, codec="cuda")
    seq = cache.add_sequence(k, v)
    np.testing.assert_array_equal(cache.read(seq)[1], v)


def test_an_update_written_before_its_counts_is_undone_where_a_list_ran_dry(monkeypatch):
    """The CUDA path writes an update while its encodes' counts are still in flight; where the raw list ran
    dry, that write is undone -- lengths, tail, counts and contents as before -- and the update is refused, or
    with ``grow`` encoded again into a larger pool."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(5)
    k, v = synthetic(rng, 1, 1, 3 * B, 64, spread=2.5), synthetic(rng, 1, 1, 3 * B, 64, spread=2.5)
    cal = with_capacity(calibrate(k, v), [[0], [L.geometry(64).max_useful_capacity]])    # K's escapes go raw
    undone = []
    undo = update_mod._EarlyWrite.undo
    monkeypatch.setattr(update_mod._EarlyWrite, "undo", lambda self: (undone.append(True), undo(self)))
    for grow in (False, True):
        cache = PagedKVCache(cal, max_seqs=1, max_blocks=4, raw_tiles=1, codec="cuda", grow=grow)
        seq = cache.add_sequence(k[:, :, :10], v[:, :, :10])       # a tail of 10 tokens, no block

        def state():        # contents, memory, blocks, each device pool's free records, what the adapters saw
            return ({seq: cache.read(seq)}, cache.memory(), cache.blocks_encoded,
                    [[(p.n_free(), p._rest().tolist()) for st in layer for p in (st.slots, st.raw)]
                     for layer in map(cache.stores, range(cache.layers))],
                    [(st.adapter is not None and st.adapter.finalized, len(st.deferred))
                     for layer in map(cache.stores, range(cache.layers)) for st in layer])
        before = state()
        undone.clear()
        if not grow:
            with pytest.raises(PoolExhaustedError, match="raw-tile arena"):
                cache.append(seq, k[:, :, 10:45], v[:, :, 10:45])  # two blocks (two raw K tiles, one free), a tail
            assert_same(state(), before)
            assert cache.seq_len(seq) == 10 and cache.device_lengths[0, seq] == 10
        else:
            cache.append(seq, k[:, :, 10:45], v[:, :, 10:45])
            np.testing.assert_array_equal(cache.read(seq)[0], k[:, :, :45])
            np.testing.assert_array_equal(cache.read(seq)[1], v[:, :, :45])
            assert cache.blocks_encoded == 2 and cache.memory().raw_bytes > 0
        assert undone == [True]


def test_only_the_stores_whose_list_ran_dry_encode_again():
    """Two layers, one of whose K tiles overflow into a raw arena too small for them: the other layer and kind
    encode once and keep what they wrote, the dry one is encoded again after the arena grows (read back
    bit-exact); without ``grow`` the update is refused with every store as before, those that did not run dry
    too."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(5)
    k, v = synthetic(rng, 2, 1, 3 * B, 64, spread=2.5), synthetic(rng, 2, 1, 3 * B, 64, spread=2.5)
    full = L.geometry(64).max_useful_capacity
    cal = with_capacity(calibrate(k, v), [[0, full], [full, full]])        # only layer 0's K escapes go raw
    launched = []
    count = update_mod.UpdateTransaction._encodes_launched

    def counted(self, store, tiles):
        launched.append(next((layer, kind) for layer in range(self.layers) for kind in range(2)
                             if self._store[layer][kind] is store))
        return count(self, store, tiles)

    update_mod.UpdateTransaction._encodes_launched = counted
    try:
        for grow in (True, False):
            cache = PagedKVCache(cal, max_seqs=1, max_blocks=4, raw_tiles=1, codec="cuda", grow=grow)
            seq = cache.add_sequence(k[:, :, :10], v[:, :, :10])       # a tail of 10 tokens, no block
            before = ({seq: cache.read(seq)}, cache.memory(),
                      [[(p.n_free(), p._rest().tolist()) for st in layer for p in (st.slots, st.raw)]
                       for layer in map(cache.stores, range(cache.layers))])
            launched.clear()
            if grow:
                cache.append(seq, k[:, :, 10:45], v[:, :, 10:45])      # two blocks: K of layer 0 runs the arena dry
                np.testing.assert_array_equal(cache.read(seq)[0], k[:, :, :45])
                np.testing.assert_array_equal(cache.read(seq)[1], v[:, :, :45])
                assert sorted(launched) == [(0, 0), (0, 0), (0, 1), (1, 0), (1, 1)], launched
            else:
                with pytest.raises(PoolExhaustedError, match="raw-tile arena"):
                    cache.append(seq, k[:, :, 10:45], v[:, :, 10:45])
                after = ({seq: cache.read(seq)}, cache.memory(),
                         [[(p.n_free(), p._rest().tolist()) for st in layer for p in (st.slots, st.raw)]
                          for layer in map(cache.stores, range(cache.layers))])
                assert_same(after, before)
                assert sorted(launched) == [(0, 0), (0, 1), (1, 0), (1, 1)], launched
    finally:
        update_mod.UpdateTransaction._encodes_launched = count


# ----------------------------------------------------------------------------------------------
# Calibration epochs: a context that drifts away from its calibration.

@pytest.fixture(scope="module")
def drift():
    """64 blocks of 2 layers; K drifts by 8 exponents, V not; calibrated on the first 256 tokens."""
    rng = np.random.default_rng(8)
    k, v = drifting(rng, 2, 2, 64 * B, 64, 8.0), drifting(rng, 2, 2, 64 * B, 64, 0.0)
    return k, v, calibrate(k[:, :, :256], v[:, :, :256])


def reference_epochs(cal, finalized):
    """gaac.epochs.assign_epochs over each layer's and kind's blocks ``finalized[kind][layer]`` (a copy of cal)."""
    cal = cal.copy()
    return cal, [[assign_epochs(finalized[kind][layer], cal, layer, kind) for layer in range(cal.layers)]
                 for kind in (0, 1)]


def cache_epochs(cache, seq, layer, kind):
    view = cache.layer_view(layer)
    return view.epoch[kind][seq, :cache.seq_len(seq, layer) // B].numpy().astype(np.int64)


def assert_same_epochs(a, b):
    """Two calibrations with the same epochs (same bases), layer by layer and kind by kind."""
    for layer in range(a.layers):
        for kind in (0, 1):
            assert a.n_epochs(layer, kind) == b.n_epochs(layer, kind)
            for e in range(a.n_epochs(layer, kind)):
                for x, y in zip(a.bases(layer, kind, e), b.bases(layer, kind, e)):
                    np.testing.assert_array_equal(x, y)


def test_epochs_token_by_token_prefill_and_chunks_match_the_rule(drift):
    k, v, cal = drift
    tokens = k.shape[2]
    ref_cal, ref = reference_epochs(cal, [[cache_blocks(x[layer]) for layer in range(2)] for x in (k, v)])
    assert sum(ref_cal.n_epochs(layer, kind) - 1 for layer in range(2) for kind in (0, 1)) >= 4

    by_token = PagedKVCache(cal, max_blocks=64, raw_tiles=128 * 2 * cal.layers)
    seq = by_token.add_sequence(k[:, :, :5], v[:, :, :5])
    for t in range(5, tokens):
        by_token.append(seq, k[:, :, t:t + 1], v[:, :, t:t + 1])
    prefill = PagedKVCache(cal, max_blocks=64, raw_tiles=128 * 2 * cal.layers)
    prefill.add_sequence(k, v)
    chunked = PagedKVCache(cal, max_blocks=64, raw_tiles=128 * 2 * cal.layers)   # chunks ending mid-run, mid-block, over checks
    chunked.add_sequence(k[:, :, :37], v[:, :, :37])
    for a, b in ((37, 38), (38, 300), (300, 800), (800, 809), (809, tokens)):
        chunked.append(seq, k[:, :, a:b], v[:, :, a:b])

    for cache in (by_token, prefill, chunked):
        got_k, got_v = cache.read(seq)
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
        assert_same_epochs(cache.calibration, ref_cal)
        for layer in range(2):
            view = cache.layer_view(layer)
            for kind in (0, 1):
                got = cache_epochs(cache, seq, layer, kind)
                np.testing.assert_array_equal(got, ref[kind][layer])
                assert (np.diff(got) >= 0).all()
                assert view.b3[kind].shape == (ref_cal.n_epochs(layer, kind), 2, 64)
                for e in range(ref_cal.n_epochs(layer, kind)):
                    np.testing.assert_array_equal(view.b4[kind][e].numpy(), ref_cal.bases(layer, kind, e)[1])
        assert cache.blocks_encoded == 2 * 64
    assert all(cal.n_epochs(layer, kind) == 1 for layer in range(2) for kind in (0, 1))   # the caller's: untouched

    # Memory: the appended epochs' tables and a 2-byte index per block, on top of what the blocks occupy.
    check_accounting(prefill, {seq: (k, v)})
    appended = sum(ref_cal.n_epochs(layer, kind) - 1 for layer in range(2) for kind in (0, 1))
    assert prefill.memory().epoch_bytes == appended * 2 * 2 * 64 + 64 * 2 * 2 * EPOCH_INDEX_BYTES
    fixed = PagedKVCache(cal, max_blocks=64, raw_tiles=128 * 2 * cal.layers, adapt=False)
    fixed.add_sequence(k, v)
    assert prefill.memory().resident_bytes < fixed.memory().resident_bytes     # adaptation pays for itself here


def test_batched_update_finalizes_in_the_order_of_seqs(drift):
    """update_layer with seqs [b, a]: the adapter sees b's new blocks, then a's, every call."""
    k, v, cal = drift
    half = 32 * B
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=32, raw_tiles=128 * 2 * cal.layers)
    a, b = cache.add_sequence(), cache.add_sequence()
    rows = {a: (k[:, :, :half], v[:, :, :half]), b: (k[:, :, half:], v[:, :, half:])}
    cuts = (0, 200, 203, 450, half)
    for layer in range(2):
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            cache.update_layer(layer, [b, a], *(np.stack([rows[s][kind][layer, :, lo:hi] for s in (b, a)])
                                                for kind in (0, 1)))
    order = [(s, j) for lo, hi in zip(cuts[:-1], cuts[1:]) for s in (b, a) for j in range(lo // B, hi // B)]
    ref_cal, ref = reference_epochs(cal, [[np.stack([cache_blocks(rows[s][kind][layer])[j] for s, j in order])
                                           for layer in range(2)] for kind in (0, 1)])
    assert_same_epochs(cache.calibration, ref_cal)
    for layer in range(2):
        for kind in (0, 1):
            for s in (a, b):
                want = [e for (t, _), e in zip(order, ref[kind][layer]) if t == s]
                np.testing.assert_array_equal(cache_epochs(cache, s, layer, kind), want)
    for s in (a, b):
        np.testing.assert_array_equal(cache.read(s)[0], rows[s][0])


def adapter_state(cache):
    """What a failed update must not change, epochs included (beyond :func:`snapshot`)."""
    return [[(st.adapter.finalized, st.adapter.until_check, st.adapter.hist.copy(), st.b3.clone(), st.epochs.copy())
             for st in layer] for layer in map(cache.stores, range(cache.layers))], \
        [[cache.calibration.n_epochs(layer, kind) for kind in (0, 1)] for layer in range(cache.layers)]


def test_exhausted_update_leaves_adapters_and_epochs_unchanged(drift):
    k, v, cal = drift
    small, big = (PagedKVCache(cal, max_blocks=n, raw_tiles=128 * 2 * cal.layers) for n in (58, 64))
    for cache in (small, big):
        cache.add_sequence(k[:, :, :40 * B + 3], v[:, :, :40 * B + 3])
    before, before_state = snapshot(small), adapter_state(small)
    with pytest.raises(PoolExhaustedError, match="block table holds 58"):
        small.append(0, k[:, :, 40 * B + 3:64 * B], v[:, :, 40 * B + 3:64 * B])
    big.append(0, k[:, :, 40 * B + 3:64 * B], v[:, :, 40 * B + 3:64 * B])
    assert big.calibration.n_epochs(0, 0) > small.calibration.n_epochs(0, 0)   # the refused update appends one
    assert_same(snapshot(small), before)
    after_blocks, after_epochs = adapter_state(small)
    assert after_epochs == before_state[1]
    for x, y in zip(sum(after_blocks, []), sum(before_state[0], [])):
        assert x[:2] == y[:2] and (x[2] == y[2]).all() and torch.equal(x[3], y[3]) and (x[4] == y[4]).all()
    # ... so the cache goes on exactly as if the refused update had never been tried.
    small.append(0, k[:, :, 40 * B + 3:58 * B], v[:, :, 40 * B + 3:58 * B])
    ref_cal, ref = reference_epochs(cal, [[cache_blocks(x[layer, :, :58 * B]) for layer in range(2)] for x in (k, v)])
    assert_same_epochs(small.calibration, ref_cal)
    np.testing.assert_array_equal(cache_epochs(small, 0, 1, 0), ref[0][1])


def test_adapt_false_codes_every_block_with_the_calibrations_bases(drift):
    k, v, cal = drift
    cache = PagedKVCache(cal, max_blocks=64, raw_tiles=128 * 2 * cal.layers, adapt=False)
    seq = cache.add_sequence(k[:, :, :700], v[:, :, :700])
    cache.append(seq, k[:, :, 700:], v[:, :, 700:])
    view = cache.layer_view(1)
    assert view.epoch is None and view.b3[0].shape == (2, 64)
    np.testing.assert_array_equal(view.b3[0].numpy(), cal.b3[0, 1])
    assert cache.calibration.n_epochs(1, 0) == 1 and cache.memory().epoch_bytes == 0
    np.testing.assert_array_equal(cache.read(seq)[0], k)
    check_accounting(cache, {seq: (k, v)})          # every block as encode_block codes it with epoch 0


def test_decode_attention_reads_epochs(drift):
    """The CPU attention path decodes each block with its epoch's bases, as the cache's own read does."""
    attention = pytest.importorskip("gaac.attention")
    k, v, cal = drift
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=64, raw_tiles=256 * 2 * cal.layers)
    cache.add_sequence(k, v)
    cache.add_sequence(k[:, :, :40], v[:, :, :40])
    view = cache.layer_view(0)
    assert int(view.epoch[0][0].max()) > 0
    q = (np.random.default_rng(1).standard_normal((2, 4, 64)).astype(np.float32).view(np.uint32) >> 16)
    out = attention.decode_attention(q.astype(np.uint16), view, backend="cpu")
    ks = [attention.bf16_to_float(k[0]), attention.bf16_to_float(k[0, :, :40])]
    vs = [attention.bf16_to_float(v[0]), attention.bf16_to_float(v[0, :, :40])]
    ref, _ = attention.reference_attention(attention.bf16_to_float(q.astype(np.uint16)), ks, vs, dtype=np.float32)
    np.testing.assert_array_equal(out, attention.float_to_bf16(ref))


def test_cuda_codec_path_with_epochs_in_the_simulator(monkeypatch):
    """codec='cuda' codes and decodes each block with its epoch's bases, as the reference codec does."""
    pytest.importorskip("numba")
    for name in ("WARMUP_BLOCKS", "ADAPT_EVERY"):                # epochs within a few blocks: the simulator is slow
        monkeypatch.setattr(epochs_mod, name, 4)
    rng = np.random.default_rng(5)
    k, v = drifting(rng, 1, 1, 13 * B + 7, 64, 10.0), drifting(rng, 1, 1, 13 * B + 7, 64, 0.0)
    cal = calibrate(k[:, :, :64], v[:, :, :64])
    caches = [PagedKVCache(cal, max_blocks=13, raw_tiles=26 * 2 * cal.layers, codec=c) for c in ("reference", "cuda")]
    for cache in caches:
        seq = cache.add_sequence(k[:, :, :100], v[:, :, :100])
        cache.append(seq, k[:, :, 100:], v[:, :, 100:])
        got_k, got_v = cache.read(seq)
        np.testing.assert_array_equal(got_k, k)
        np.testing.assert_array_equal(got_v, v)
    assert caches[0].calibration.n_epochs(0, 0) > 2
    assert_same_epochs(caches[0].calibration, caches[1].calibration)
    ref, sim = (c.layer_view(0) for c in caches)
    for kind in range(2):
        assert torch.equal(ref.epoch[kind], sim.epoch[kind])
        assert torch.equal(ref.table[kind] < 0, sim.table[kind] < 0)


def test_real_kv_with_epochs_reads_back():
    """Real SmolLM2 K/V (the dumps), four prompts' caches one after another: epochs as the rule says, bit-exact."""
    from conftest import kv_dump

    prompts = ("prose", "code", "math", "list")
    k = np.concatenate([kv_dump(p, "k")[:2] for p in prompts], axis=2)
    v = np.concatenate([kv_dump(p, "v")[:2] for p in prompts], axis=2)
    cal = calibrate(k[:, :, :256], v[:, :, :256])
    # Two layers and 256 calibration tokens: later prompts overflow many tiles; the arena has room for every one.
    cache = PagedKVCache(cal, max_blocks=k.shape[2] // B, raw_tiles=k.shape[2] // B * cal.kv_heads * 2 * cal.layers)
    seq = cache.add_sequence(k[:, :, :300], v[:, :, :300])
    for a in range(300, k.shape[2], 64):
        cache.append(seq, k[:, :, a:a + 64], v[:, :, a:a + 64])
    got_k, got_v = cache.read(seq)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    ref_cal, ref = reference_epochs(cal, [[cache_blocks(x[layer]) for layer in range(2)] for x in (k, v)])
    assert_same_epochs(cache.calibration, ref_cal)
    assert cache.calibration.n_epochs(0, 0) > 1 and cache.calibration.n_epochs(0, 1) > 1
    for layer in range(2):
        for kind in (0, 1):
            np.testing.assert_array_equal(cache_epochs(cache, seq, layer, kind), ref[kind][layer])
    check_accounting(cache, {seq: (k, v)})


def test_a_sequence_longer_than_the_table_is_refused_before_encoding_naming_max_blocks(real, monkeypatch):
    k, v, cal = real
    cache = PagedKVCache(cal, max_blocks=4)
    prepared = []
    prepare = cache._prepare
    monkeypatch.setattr(cache, "_prepare", lambda *a, **k: prepared.append(a[0]) or prepare(*a, **k))
    with pytest.raises(PoolExhaustedError, match=r"max_blocks=5 or more, or with grow=True") as info:
        cache.add_sequence(k[:, :, :80], v[:, :, :80])
    assert "block table holds 4 (64 tokens)" in str(info.value) and not prepared and cache.sequences == []
    seq = cache.add_sequence(k[:, :, :60], v[:, :, :60])
    with pytest.raises(PoolExhaustedError, match="would hold 80 tokens = 5 blocks"):
        cache.append(seq, k[:, :, 60:80], v[:, :, 60:80])
    assert prepared == list(range(cal.layers))                # only the prefill that fits was encoded


def test_a_long_prefill_shows_progress(real, capsys):
    k, v, cal = real
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=4)
    cache.add_sequence(k[:, :, :40], v[:, :, :40], show_progress=True)
    err = capsys.readouterr().err
    assert "encode 40 tokens" in err and "layer" in err
    cache.add_sequence(k[:, :, :40], v[:, :, :40])          # not a terminal: no bar
    assert capsys.readouterr().err == ""


def test_both_codecs_implement_the_tile_codec_protocol():
    """The reference and CUDA codecs are TileCodecs that encode one block's tiles to the same slots and fits
    (K with no escape room, so that some tiles go raw) and decode pools built from them to the same tiles."""
    pytest.importorskip("numba")
    from gaac.cache.codec import CudaCodec, ReferenceCodec, TileCodec
    from gaac.tiles import tile_bases

    rng = np.random.default_rng(11)
    k, v = synthetic(rng, 1, 2, B, 64, spread=2.5), synthetic(rng, 1, 2, B, 64, spread=2.5)
    cal = with_capacity(calibrate(k, v), [[0], [L.geometry(64).max_useful_capacity]])
    reference, cuda = ReferenceCodec(), CudaCodec()
    assert isinstance(reference, TileCodec) and isinstance(cuda, TileCodec)
    assert (reference.pools_on_device, cuda.pools_on_device) == (False, True)
    for kind, x in enumerate((k, v)):
        block = torch.from_numpy(x[0].view(np.int16))[None]                      # [1, heads, 16, 64]
        tiles = blocks_to_tiles(block)
        tb3, tb4 = (torch.from_numpy(np.ascontiguousarray(t)) for t in tile_bases(*cal.bases(0, kind)))
        capacity = int(cal.capacity[kind, 0])
        slots, fits = reference.encode(tiles, tb3, tb4, capacity)
        cuda_slots, cuda_fits = cuda.encode(tiles, tb3, tb4, capacity)
        assert isinstance(fits, np.ndarray) and isinstance(cuda_fits, np.ndarray)
        assert np.array_equal(fits, cuda_fits) and torch.equal(slots, cuda_slots)
        if kind == 0:
            assert not fits.all()
        entries = np.empty(len(fits), np.int64)
        entries[fits] = np.arange(int(fits.sum()))
        entries[~fits] = np.arange(int((~fits).sum())) | L.TABLE_RAW_FLAG
        entries = torch.from_numpy(entries.astype(np.uint32).view(np.int32))
        raw = tiles[torch.from_numpy(~fits)].contiguous()
        for codec in (reference, cuda):
            assert torch.equal(codec.decode(slots, raw, entries, tb3, tb4, capacity), tiles)
