"""A cache sized by a byte budget, one raw-tile arena for every layer and kind, running dry without loss,
swapping sequences out and in, and what a cache with its defaults allocates (gaac.budget, gaac.cache.pools)."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cache import B, synthetic, with_capacity

import gaac
from gaac import budget as budget_mod
from gaac import layout as L
from gaac.cache import PagedKVCache
from gaac.calibration import calibrate
from gaac.errors import InputError, PoolExhaustedError


def small_cal(rng, layers=3, heads=2, dim=64):
    return calibrate(synthetic(rng, layers, heads, 4 * B, dim), synthetic(rng, layers, heads, 4 * B, dim))


def bf16(cal, tokens):
    return tokens * cal.layers * 2 * cal.kv_heads * cal.head_dim * 2


def exports(cache):
    return {s: bytes(cache.export_sequence(s)) for s in cache.sequences}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), budget=st.integers(40_000, 4_000_000), max_seqs=st.integers(1, 6),
       adapt=st.booleans(), max_blocks=st.one_of(st.none(), st.integers(1, 64)))
def test_a_budget_bounds_what_the_cache_allocates(seed, budget, max_seqs, adapt, max_blocks):
    """Pools, arena, tables, epoch indices and tails fit the budget; the capacity is what the pools hold."""
    cal = small_cal(np.random.default_rng(seed))
    try:
        cache = PagedKVCache(cal, budget=budget, max_seqs=max_seqs, max_blocks=max_blocks, adapt=adapt)
    except InputError as exc:            # too small for one block: said so, naming the budget
        assert "budget" in str(exc)
        return
    m = cache.memory()
    assert m.allocated_bytes <= budget
    cap = cache.capacity
    per = cal.kv_heads                               # head_dim 64: one tile a head
    blocks = cache.stores(0)[0].slots.size // per
    assert all(st.slots.size == blocks * per for layer in map(cache.stores, range(cache.layers)) for st in layer)
    assert cache._arena.size == np.ceil(budget_mod.raw_share(cal) * blocks * per * 2 * cal.layers)
    assert cap.expected == B * min(blocks, cache.max_seqs * cache.max_blocks,
                                   int(cache._arena.size / (budget_mod.raw_share(cal) * per * 2 * cal.layers)))
    assert cap.guaranteed == B * min(cache._arena.size // (per * 2 * cal.layers), cache.max_seqs * cache.max_blocks)
    # the budget is spent: two more blocks of capacity would not have fitted (one, but for the arena's rounding)
    extra = budget_mod.block_bytes(cal, budget_mod.raw_share(cal))
    if max_blocks is None:
        extra += max_seqs * budget_mod.row_block_bytes(cal, adapt)
    assert m.allocated_bytes + 2 * extra > budget
    assert cache.free_tokens() == cap.expected


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), raw_layers=st.lists(st.booleans(), min_size=6, max_size=6))
def test_one_arena_serves_whichever_layers_overflow(seed, raw_layers):
    """Random per-layer raw rates (a layer and kind of capacity 0 sends every tile to the arena, a roomy one
    none): the cache holds what the arena can take in total, wherever it overflows, and refuses the first
    update past that with nothing written."""
    rng = np.random.default_rng(seed)
    base = small_cal(rng)
    caps = np.where(np.array(raw_layers).reshape(2, 3), 0, L.geometry(64).max_escapes)     # all raw, or none
    cal = with_capacity(base, caps)
    raw_per_block = int(np.sum(raw_layers)) * cal.kv_heads            # raw tiles one block takes, all layers
    cache = PagedKVCache(cal, max_seqs=4, max_blocks=8, raw_tiles=3 * raw_per_block)
    k, v = synthetic(rng, 3, 2, 4 * B, 64), synthetic(rng, 3, 2, 4 * B, 64)
    a = cache.add_sequence(k[:, :, :2 * B], v[:, :, :2 * B])          # 2 blocks
    b = cache.add_sequence(k[:, :, :B + 3], v[:, :, :B + 3])          # 1 block: the arena is full if any overflow
    assert cache._arena.used() == 3 * raw_per_block
    before = exports(cache)
    if raw_per_block:
        with pytest.raises(PoolExhaustedError, match="raw-tile arena is exhausted") as err:
            cache.append(a, k[:, :, 2 * B:3 * B], v[:, :, 2 * B:3 * B])
        assert f"{3 * raw_per_block} records" in str(err.value)
        assert exports(cache) == before                          # bit-exact: nothing written, nothing lost
        cache.remove_sequence(b)                                 # its raw tiles go back for any layer to take
    cache.append(a, k[:, :, 2 * B:3 * B], v[:, :, 2 * B:3 * B])
    np.testing.assert_array_equal(cache.read(a)[0], k[:, :, :3 * B])


@pytest.mark.parametrize("codec", ["reference", "cuda"])
def test_a_pool_run_dry_refuses_with_the_cache_unchanged(codec):
    """An append the pools cannot hold is refused before anything is written, naming the pool, its size and
    what was asked; every sequence exports the same bytes afterwards (CUDA codec: in the simulator)."""
    rng = np.random.default_rng(3)
    cal = small_cal(rng, layers=2, heads=1)
    k, v = synthetic(rng, 2, 1, 6 * B, 64), synthetic(rng, 2, 1, 6 * B, 64)
    # 6 blocks of slots per layer and kind; synthetic content overflows many tiles: the arena takes every one
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=3, raw_tiles=6 * 4, codec=codec)
    a = cache.add_sequence(k[:, :, :3 * B], v[:, :, :3 * B])
    b = cache.add_sequence(k[:, :, :2 * B + 5], v[:, :, :2 * B + 5])
    assert not cache.fits(1)                               # every row holds a sequence
    assert cache.fits(B - 6, seq=b) and not cache.fits(B, seq=a)     # a's table is full
    before = exports(cache)
    with pytest.raises(PoolExhaustedError, match=r"block table holds 3 .*48 tokens"):
        cache.append(a, k[:, :, 3 * B:4 * B], v[:, :, 3 * B:4 * B])
    assert exports(cache) == before
    roomy = with_capacity(cal, np.full((2, 2), L.geometry(64).max_escapes))       # every tile takes a slot
    small = PagedKVCache(roomy, max_seqs=2, max_blocks=3, slots=4, codec=codec)
    s = small.add_sequence(k[:, :, :3 * B], v[:, :, :3 * B])
    before = exports(small)
    with pytest.raises(PoolExhaustedError, match=r"slot pool is exhausted: it needs \d+ more records than the "
                                                 r"\d+ of 4 free"):
        small.add_sequence(k[:, :, :2 * B], v[:, :, :2 * B])
    assert exports(small) == before and small.sequences == [s]


def test_swap_out_and_in_is_bit_exact_and_attends_the_same():
    """A sequence exported to the host, removed and imported again (preemption by swapping) reads back bit for
    bit, and attention over it gives the same output as before (the reference path)."""
    k, v = gaac.sample("prose")
    cal = calibrate(k[:, :, :256], v[:, :, :256])
    cache = PagedKVCache(cal, max_seqs=2, max_blocks=24, raw_tiles=2 * 24 * 3 * 2 * cal.layers)
    keep = cache.add_sequence(k[:, :, 300:500], v[:, :, 300:500])
    out = cache.add_sequence(k[:, :, :333], v[:, :, :333])
    q = torch.randn(cache.max_seqs, 9, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = gaac.decode_attention(q, cache.layer_view(2))
    data = cache.export_sequence(out)
    cache.remove_sequence(out)
    assert cache.sequences == [keep] and cache.free_tokens() > 0
    back = cache.import_sequence(data)
    assert back == out                       # the free row comes back; its records may be others
    for got, sent in zip(cache.read(back), (k[:, :, :333], v[:, :, :333])):
        np.testing.assert_array_equal(got, sent)
    assert torch.equal(gaac.decode_attention(q, cache.layer_view(2)), want)


def test_the_defaults_allocate_what_the_sample_takes():
    """With its table's arguments and no budget, a cache holding the shipped sample allocates at most 0.78x the
    BF16 bytes of the tokens it promises (max_blocks blocks and a tail of up to 15 tokens a sequence);
    print(cache.memory()) says both ratios on one line."""
    k, v = gaac.sample("prose")
    cal = calibrate(k, v)
    cache = PagedKVCache(cal, max_blocks=k.shape[2] // B)
    seq = cache.add_sequence(k, v)
    m = cache.memory()
    assert m.allocated_bytes <= 0.78 * bf16(cal, cache.max_blocks * B + B - 1)
    assert m.tokens == k.shape[2] and cache.read(seq)[0].shape == k.shape
    line = str(m)
    assert "\n" not in line and f"BF16/resident {m.ratio:.3f}x" in line
    assert f"BF16/allocated {m.allocated_ratio:.3f}x" in line and "allocated" in line and "MiB" in line


def test_gaac_cache_grows_by_a_step_that_keeps_its_allocation_near_its_tokens():
    """gaac.hf.GAACCache after a 4096-token prompt and at every one of 512 generated tokens allocates at most
    0.80x their BF16 bytes (the shipped sample's 768 tokens, repeated)."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from gaac.hf import GAACCache

    k, v = (np.tile(x, (1, 1, 6, 1)) for x in gaac.sample("prose"))          # 4608 tokens
    layers, heads, _, dim = k.shape
    cfg = SimpleNamespace(num_hidden_layers=layers, num_attention_heads=3 * heads, num_key_value_heads=heads,
                          head_dim=dim, hidden_size=3 * heads * dim, layer_types=None, sliding_window=None,
                          _attn_implementation="sdpa", name_or_path="")
    cfg.get_text_config = lambda decoder=True: cfg
    cache = GAACCache(cfg, fused=True)
    kt, vt = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (k, v))
    prompt = 4096
    for layer in range(layers):
        cache.update(kt[layer, :, :prompt][None], vt[layer, :, :prompt][None], layer)
    ratios = [cache.memory().allocated_bytes / cache.memory().bf16_bytes]
    for t in range(prompt, k.shape[2]):
        for layer in range(layers):
            cache.update(kt[layer, :, t:t + 1][None], vt[layer, :, t:t + 1][None], layer)
        ratios.append(cache.memory().allocated_bytes / cache.memory().bf16_bytes)
    assert max(ratios) <= 0.80, ratios
    np.testing.assert_array_equal(cache.store.read(cache.rows[0])[1], v)


def test_budget_arguments_are_checked():
    cal = small_cal(np.random.default_rng(1))
    for bad in (0, -5, 1.5, 0.0, "1G", True):
        with pytest.raises(InputError, match="budget"):
            PagedKVCache(cal, budget=bad)
    with pytest.raises(InputError, match="grow=True"):
        PagedKVCache(cal, budget=10**6, grow=True)
    with pytest.raises(InputError, match="do not hold one block"):
        PagedKVCache(cal, budget=1000)
    cache = PagedKVCache(cal, budget=0.001)          # a fraction of the host's available memory on the CPU
    assert 0 < cache.memory().allocated_bytes <= 0.001 * budget_mod.free_memory(torch.device("cpu")) * 1.01
    with pytest.raises(InputError, match="tokens"):
        cache.fits(-1)
