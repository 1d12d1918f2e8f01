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
from strategies import bf16_bits

import gaac.cache as cache_mod
from gaac import layout as L
from gaac.block import encode_block
from gaac.cache import PagedKVCache, PoolExhaustedError, blocks_to_tiles, tiles_to_tokens
from gaac.calibration import Calibration, calibrate
from gaac.errors import GAACError, InputError
from gaac.io import load_sample
from gaac.tiles import block_tiles, untile

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
    """Resident bytes of ``contents`` counted with the block container, not the cache's pools."""
    cal = cache.calibration
    geo = L.geometry(cal.head_dim)
    slots_tables = raw = 0
    for k, v in contents.values():
        n = k.shape[2] // B
        for layer in range(cal.layers):
            for kind, x in enumerate((k, v)):
                for b in range(n):
                    eb = encode_block(x[layer, :, b * B:(b + 1) * B], cal, layer, kind)
                    slots_tables += eb.resident_bytes
                    raw += len(eb.raw_tiles) * geo.raw_bytes
    tails = len(contents) * cal.layers * 2 * B * cal.kv_heads * cal.head_dim * 2
    tokens = sum(k.shape[2] for k, _ in contents.values())
    return dict(resident=slots_tables + tails, raw=raw, tokens=tokens,
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

    @initialize(dim=st.sampled_from((64, 256)), heads=st.integers(1, 2), seed=st.integers(0, 2**32 - 1),
                caps=st.lists(st.sampled_from((0, 16, 32, None)), min_size=4, max_size=4), grow=st.booleans(),
                pool=st.integers(2, 40))
    def setup(self, dim, heads, seed, caps, grow, pool):
        self.rng = np.random.default_rng(seed)
        sample = synthetic(self.rng, 2, heads, 4 * B, dim)
        cal = calibrate(sample, synthetic(self.rng, 2, heads, 4 * B, dim))
        cap = np.array([c if c is not None else cal.capacity.flat[i] for i, c in enumerate(caps)]).reshape(2, 2)
        self.cal = with_capacity(cal, cap)
        self.cache = PagedKVCache(self.cal, max_seqs=3, max_blocks=4, slots=pool, raw_tiles=pool // 2, grow=grow)
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
        for layer in range(self.cal.layers):
            view = self.cache.layer_view(layer)
            for kind in range(2):
                entries = np.concatenate([view.table[kind][s, :self.cache.seq_len(s, layer) // B].reshape(-1).numpy()
                                          for s in self.contents] or [np.zeros(0, np.int32)]).view(np.uint32)
                is_raw = entries >= L.TABLE_RAW_FLAG
                index = entries & L.TABLE_INDEX_MASK
                assert len(set(index[is_raw])) == is_raw.sum() and len(set(index[~is_raw])) == (~is_raw).sum()
                store = self.cache._store[layer][kind]
                assert store.raw.used == is_raw.sum() and store.slots.used == (~is_raw).sum()
                if is_raw.any():
                    event("raw tiles in use")

    @invariant()
    def accounting(self):
        if hasattr(self, "cache"):
            check_accounting(self.cache, self.contents)


CacheMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=12, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCacheMachine = CacheMachine.TestCase


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

    encode_tiles = cache_mod.encode_tiles
    monkeypatch.setattr(cache_mod, "encode_tiles", counting)
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
    assert view.b3[1].dtype == torch.uint8 and (view.b3[1].numpy() == cal.b3[1, 2]).all()
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
            [[(st.slots.free.copy(), st.raw.free.copy()) for st in layer] for layer in cache._store])


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
    with pytest.raises(PoolExhaustedError, match=f"layer {cal.layers - 1} . raw-tile pool"):
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
