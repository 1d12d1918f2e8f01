"""The adaptation rule on the device (:mod:`gaac.cuda.epochs`) decides what the host rule decides.

In the simulator (slow), with the warm-up shortened so that a few checks see candidates: the same
epochs per block, the same appended bases, the same histogram and pending blocks afterwards -- from an
adapter that has pending blocks and epochs already -- and a cache whose prefill runs the rule on the
device holds what a cache running it on the host holds.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import gaac.epochs as epochs
from gaac import layout as L
from gaac.cache import PagedKVCache
from gaac.errors import PoolExhaustedError
from gaac.calibration import calibrate
from gaac.cuda import epochs as device_epochs
from gaac.tiles import cache_blocks
from conftest import assert_reads_back, every_tile
from test_cache import assert_same_epochs
from test_epochs import drifting_cache

pytestmark = pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaPerformanceWarning")


def _same_adapter(got: epochs.Adapter, want: epochs.Adapter) -> None:
    assert got.finalized == want.finalized and got.epoch == want.epoch
    assert np.array_equal(got.hist, want.hist)
    assert len(got._recent) == len(want._recent)
    assert all(np.array_equal(a, b) for a, b in zip(got._recent, want._recent))
    assert_same_epochs(got.calibration, want.calibration)


def test_the_device_rule_decides_what_the_host_rule_decides(monkeypatch):
    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 8)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)      # every differing candidate that saves is appended
    x = drifting_cache(40 * L.BLOCK_TOKENS, layers=2)[:, :1]     # one head: the simulator is slow
    x[1] = x[1] ^ 0x8000                                     # V: other signs, the same exponents
    cal = calibrate(x[:, :, :128], x[:, :, :128])
    jobs, want = [], []
    for kind in (L.KIND_K, L.KIND_V):
        blocks = cache_blocks(x[kind])
        adapter = epochs.Adapter(cal.copy(), 0, kind)
        adapter.assign(blocks[:11])                           # three blocks pending, maybe an epoch already
        reference = copy.deepcopy(adapter)
        want.append((reference, reference.assign(blocks[11:])))
        jobs.append((adapter, torch.from_numpy(blocks[11:].view(np.int16))))
    got = device_epochs.assign(jobs)
    for (adapter, _), e, (reference, e_want) in zip(jobs, got, want):
        assert np.array_equal(e, e_want)
        _same_adapter(adapter, reference)
    assert max(int(e.max()) for e in got) >= 1                # the data drifts: epochs were appended


def test_pending_blocks_kept_on_the_device_are_read_there_and_decide_the_same(monkeypatch):
    """An adapter whose pending blocks came with device copies (a decode loop's, a batch's leftovers) has
    the rule's batch gather them on the device instead of uploading the host's: the same decisions, and an
    upload smaller by exactly those blocks; the adapter keeps the batch's leftovers on the device too.  Where
    not every pending block has a device copy, the blocks whose values stay on the device come to the host in
    one read for all the batch's jobs (a read waits for the device)."""
    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 8)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    x = drifting_cache(40 * L.BLOCK_TOKENS, layers=2)[:, :1]
    x[1] = x[1] ^ 0x8000
    cal = calibrate(x[:, :, :128], x[:, :, :128])
    staged = device_epochs._staged
    results = {}
    host_values = epochs.host_values
    for on_device in (False, True):
        uploaded, reads = [], []

        def spy(a, device):
            uploaded.append(a.size)
            return staged(a, device)

        def read(blocks):
            reads.append(sum(isinstance(b, epochs.DeviceBlock) for b in blocks))
            return host_values(blocks)

        monkeypatch.setattr(device_epochs, "_staged", spy)
        jobs, want = [], []
        for kind, pending in ((L.KIND_K, 3), (L.KIND_V, 7)):       # pending runs of different lengths
            blocks = cache_blocks(x[kind])
            adapter = epochs.Adapter(cal.copy(), 0, kind)
            adapter.assign(blocks[:16])                            # one check done, none pending
            for a, z in ((16, 17), (17, 16 + pending)):            # two observations, two device runs
                run = torch.from_numpy(blocks[a:z].view(np.int16)).clone()
                if on_device:
                    adapter.observe(blocks[a:z], device=run)
                elif a == 16:       # values left on the device, but the next observation has no device copy
                    adapter.observe(epochs.device_blocks(run), device=run)
                else:
                    adapter.observe(blocks[a:z])
            assert (adapter.recent_on(torch.device("cpu")) is not None) == on_device
            reference = copy.deepcopy(adapter)
            new = blocks[16 + pending:16 + pending + 17]           # the same count in every job
            want.append((reference, reference.assign(new)))
            jobs.append((adapter, torch.from_numpy(new.view(np.int16))))
        monkeypatch.setattr(epochs, "host_values", read)
        got = device_epochs.assign(jobs)
        monkeypatch.setattr(epochs, "host_values", host_values)
        assert [n for n in reads if n] == ([] if on_device else [2]), reads
        for (adapter, _), e, (reference, e_want) in zip(jobs, got, want):
            assert np.array_equal(e, e_want)
            _same_adapter(adapter, reference)
            runs = adapter.recent_on(torch.device("cpu"))      # the batch's leftovers, on the device as well
            assert runs is not None and np.array_equal(torch.cat(runs).numpy().view(np.uint16),
                                                         np.stack(adapter._recent))
        results[on_device] = uploaded
    rec_words = 2 * 7 * L.BLOCK_TOKENS * x.shape[-1] // 2     # two jobs' pending blocks, padded to 7, in words
    assert results[True] == [results[False][0] - rec_words]


def _steps_then_prompt(monkeypatch, layers: int = 1):
    """Two sequences of drifting content to decode steps of, and a prompt (``layers`` layers, one head of 64), with
    checks every 4 blocks: ``(rng, k, v, calibration, start lengths, steps, heads)``."""
    from test_cache import B, drifting, synthetic

    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 4)
    monkeypatch.setattr(epochs, "ADAPT_EVERY", 4)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    rng = np.random.default_rng(11)
    heads, dim, steps = 1, 64, 3 * B
    start, prompt = [5 * B + 3, 6 * B + 11], 7 * B
    k = [drifting(rng, layers, heads, n, dim, 16.0) for n in (start[0] + steps, start[1] + steps, prompt)]
    v = [synthetic(rng, layers, heads, n, dim) for n in (start[0] + steps, start[1] + steps, prompt)]
    cal = calibrate(k[0][:, :, :32], v[0][:, :, :32])
    return rng, k, v, cal, start, steps, heads


def _two_sequences(cal, k, v, start, on_device: bool):
    """A CUDA-codec cache (the rule on the device or the host) holding :func:`_steps_then_prompt`'s two
    sequences' first ``start`` tokens, and their rows."""
    cache = PagedKVCache(cal, max_seqs=3, max_blocks=16, raw_tiles=96, codec="cuda", adapt=True)
    cache._rule_on_device = on_device
    return cache, [cache.add_sequence(k[i][:, :, :start[i]], v[i][:, :, :start[i]]) for i in range(2)]


def _same_caches(caches, k, v, start, steps) -> None:
    """The host rule's cache and the device rule's (``caches``: ``(cache, rows)`` each) after
    :func:`_steps_then_prompt`'s steps and prompt: the same epochs, block epochs and adapters, both bit-exact."""
    (host, _), (gpu, gpu_rows) = caches
    assert gpu.calibration.n_epochs(0, L.KIND_K) > 1
    assert_same_epochs(gpu.calibration, host.calibration)
    for layer in range(gpu.layers):
        for kind in (L.KIND_K, L.KIND_V):
            np.testing.assert_array_equal(gpu.stores(layer)[kind].epochs, host.stores(layer)[kind].epochs)
            _same_adapter(gpu.stores(layer)[kind].adapter, host.stores(layer)[kind].adapter)
    for i, r in enumerate(gpu_rows):
        got_k, got_v = gpu.read(r)
        want = (k[i][:, :, :start[i] + steps], v[i][:, :, :start[i] + steps]) if i < 2 else (k[2], v[2])
        np.testing.assert_array_equal(got_k, want[0])
        np.testing.assert_array_equal(got_v, want[1])


def test_a_prompt_after_decode_steps_reads_the_pending_blocks_on_the_device(monkeypatch):
    """Decode steps leave every adapter's pending blocks on the device, so the rule's batch of a prompt after
    them gathers them there: every adapter it reads with pending blocks has all of them on the device.  A decode
    step whose blocks complete no adapter's check costs the rule's turn nothing: no adapter observes them on the
    host (they wait in the store's queue, counted), and the decode checks are looked for only at steps where a
    check comes due, each of which launches a rule batch.  The prompt (two layers, one transaction) looks for no
    decode check: its one rule batch takes every store's queued blocks as its job's first blocks (their checks
    the batch's first, where they complete one), and empties the queues.  The cache decides and holds what the
    host rule's cache does."""
    from test_captured import _steps

    from gaac.cache.update import UpdateTransaction, _waiting

    rng, k, v, cal, start, steps, heads = _steps_then_prompt(monkeypatch, layers=2)
    observed, looks, batches = [], [], []
    observe, look, batch_init = epochs.Adapter.observe, UpdateTransaction._launch_decode_checks, device_epochs.Batch.__init__
    caches = []
    for on_device in (False, True):
        cache, rows = _two_sequences(cal, k, v, start, on_device)
        pos = list(start)
        if on_device:
            monkeypatch.setattr(epochs.Adapter, "observe", lambda a, *x, **kw: (observed.append(1), observe(a, *x, **kw))[1])
            monkeypatch.setattr(UpdateTransaction, "_launch_decode_checks",
                                lambda c, upto: (looks.append(c._step_clock), look(c, upto))[1])
            monkeypatch.setattr(device_epochs.Batch, "__init__",
                                lambda b, *x, **kw: (batches.append(cache._step_clock), batch_init(b, *x, **kw))[1])
        assert _steps(cache, rows, k, v, pos, 2 * heads, steps, rng) == steps
        if on_device:
            monkeypatch.setattr(epochs.Adapter, "observe", observe)
            monkeypatch.setattr(device_epochs.Batch, "__init__", batch_init)
            assert observed == [], "an adapter observed a decode step's blocks on the host"
            assert batches, "no decode check was launched"
            assert looks == sorted(set(batches)), "the rule's turn looked for checks at a step that launched none"
            for layer in range(cache.layers):
                for store in cache.stores(layer):
                    assert store.waiting == _waiting(store.deferred) > 0
            del looks[:]                        # (still counted: the prompt's looks below)
        seen, prompt_batches = [], []
        recent_on = epochs.Adapter.recent_on
        queued = sum(_waiting(store.deferred) for layer in range(cache.layers) for store in cache.stores(layer))

        def spy(adapter, device, _seen=seen):
            runs = recent_on(adapter, device)
            _seen.append((len(adapter._recent), runs))
            return runs

        monkeypatch.setattr(epochs.Adapter, "recent_on", spy)
        monkeypatch.setattr(device_epochs.Batch, "__init__",
                            lambda b, *x, **kw: (prompt_batches.append(1), batch_init(b, *x, **kw))[1])
        rows.append(cache.add_sequence(k[2], v[2]))
        monkeypatch.setattr(epochs.Adapter, "recent_on", recent_on)
        monkeypatch.setattr(device_epochs.Batch, "__init__", batch_init)
        if on_device:
            monkeypatch.setattr(UpdateTransaction, "_launch_decode_checks", look)
            assert queued, "no decode block was queued when the prompt came"
            assert looks == [], f"the prompt looked for decode checks {len(looks)} times"
            assert len(prompt_batches) == 1, f"the prompt launched {len(prompt_batches)} rule batches"
            for layer in range(cache.layers):
                for store in cache.stores(layer):
                    assert not store.deferred and store.waiting == 0
            pending = [(n, runs) for n, runs in seen if n]
            assert pending, "no adapter had pending blocks when the prompt's rule ran"
            assert all(runs is not None and sum(len(r) for r in runs) == n for n, runs in pending)
        caches.append((cache, rows))
    _same_caches(caches, k, v, start, steps)


def test_the_phases_decide_what_the_host_rule_decides(monkeypatch):
    """A check every 2 blocks, so that one batch holds many checks: whatever mix of appending, declining
    and capped checks, the phases (:func:`gaac.cuda.epochs.phase_kernel`) pick the host rule's checks.  Two
    rules: a payback that lets checks decline after an epoch is appended, with one phase a round (so several
    rounds); and an epoch at every check until the cap, reached inside the batch."""
    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 8)
    monkeypatch.setattr(epochs, "ADAPT_EVERY", 2)
    x = drifting_cache(32 * L.BLOCK_TOKENS, layers=2)[:, :1]
    x[1] = x[1] ^ 0x8000
    cal = calibrate(x[:, :, :128], x[:, :, :128])
    scanned = None
    for payback, max_epochs, phases in ((10, 256, 1), (10 ** 9, 6, 4)):
        monkeypatch.setattr(epochs, "PAYBACK_CHECKS", payback)
        monkeypatch.setattr(epochs, "MAX_EPOCHS", max_epochs)
        monkeypatch.setattr(device_epochs, "PHASES", phases)
        jobs, want = [], []
        for kind in (L.KIND_K, L.KIND_V):
            blocks = cache_blocks(x[kind])
            adapter = epochs.Adapter(cal.copy(), 0, kind)
            adapter.assign(blocks[:5])                        # one block pending (before the warm-up ends)
            reference = copy.deepcopy(adapter)
            want.append((reference, reference.assign(blocks[5:])))
            jobs.append((adapter, torch.from_numpy(blocks[5:].view(np.int16))))
        batch = device_epochs.Batch(jobs)
        outputs = (batch.hist, batch.cand, batch.saved0, batch.differs0)
        if scanned is None:
            batch.scan()
            scanned = [t.clone() for t in outputs]
        else:       # the scan reads the blocks and the epoch current at the start, not the payback or the cap
            for t, done in zip(outputs, scanned):
                t.copy_(done)
        batch.chain()
        got = batch.finish()
        for (adapter, _), e, (reference, e_want) in zip(jobs, got, want):
            assert np.array_equal(e, e_want)
            _same_adapter(adapter, reference)
        appended = [reference.epoch for reference, _ in want]
        if max_epochs < 256:
            assert appended == [max_epochs - 1] * 2           # the cap stopped both jobs
        else:
            assert min(appended) >= 2
        assert batch.launched >= max(appended) + (0 if max_epochs < 256 else 1)


def _one_drifting_layer(monkeypatch):
    """One layer of drifting K and V (``x[0]``, ``x[1]``: one head, 36 blocks; V with other signs, the same
    exponents), its calibration from the first 128 tokens, and a prompt length past a check (20 blocks and 5
    tokens), with a rule that appends wherever a check's windows differ and save (warm-up of 8 blocks)."""
    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 8)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    x = drifting_cache(36 * L.BLOCK_TOKENS, layers=2)[:, :1]
    x[1] = x[1] ^ 0x8000
    return x, calibrate(x[:1, :, :128], x[1:, :, :128]), 20 * L.BLOCK_TOKENS + 5


def test_a_cache_whose_rule_runs_on_the_device_holds_what_the_host_rule_makes(monkeypatch):
    x, cal, n = _one_drifting_layer(monkeypatch)
    caches = []
    for on_device in (True, False):             # the host rule's cache encodes with the reference codec
        cache = PagedKVCache(cal, **every_tile(cal, 1, 40), codec="cuda" if on_device else "reference")
        cache._rule_on_device = on_device
        seq = cache.add_sequence(x[:1, :, :n], x[1:, :, :n])
        k, v = (torch.from_numpy(np.ascontiguousarray(x[i:i + 1, :, n:]).view(np.int16))
                for i in (0, 1))
        cache.update_layer(0, [seq], k, v)          # the rest, through a tail: the blocks are a copy
        caches.append((cache, seq))
    (gpu, sg), (host, sh) = caches
    assert gpu.calibration.n_epochs(0, L.KIND_K) > 1
    assert_same_epochs(gpu.calibration, host.calibration)
    for kind in (L.KIND_K, L.KIND_V):
        assert np.array_equal(gpu.stores(0)[kind].epochs[sg], host.stores(0)[kind].epochs[sh])
        _same_adapter(gpu.stores(0)[kind].adapter, host.stores(0)[kind].adapter)
    rk, rv = gpu.read_layer(0, [sg])
    assert np.array_equal(rk[0].numpy().view(np.uint16), x[0])
    assert np.array_equal(rv[0].numpy().view(np.uint16), x[1])


@pytest.mark.parametrize("threshold", [1, 1 << 20])
def test_the_encoders_take_the_bases_of_many_appended_epochs_from_the_device(monkeypatch, threshold):
    """A prompt's encodes read the appended epochs' bases from the rule's candidates on the device: nothing is
    packed on the host for them.  Where the rule appends at least ``DEVICE_PACKED`` epochs their packings are
    made on the device and kept for later plans (the decode appends' plans made when the epoch is published);
    below the threshold a later plan packs them on the host.  Either way each store keeps the host's packing of
    the calibration's bases, bit for bit, and the read-back is bit-exact."""
    import gaac.cuda.codec as codec
    from gaac.tiles import tile_bases

    x, cal, n = _one_drifting_layer(monkeypatch)
    monkeypatch.setattr(device_epochs, "DEVICE_PACKED", threshold)
    packed = []
    pack = codec.pack_bases
    monkeypatch.setattr(codec, "pack_bases", lambda *a, **k: (packed.append(1), pack(*a, **k))[1])
    cache = PagedKVCache(cal, **every_tile(cal, 1, 40), codec="cuda")
    cache._rule_on_device = True
    packed.clear()                                          # (the cache packs its calibration's epochs once)
    before = [cache.calibration.n_epochs(0, kind) for kind in (L.KIND_K, L.KIND_V)]
    seq = cache.add_sequence(x[:1, :, :n], x[1:, :, :n])
    held = [cache.calibration.n_epochs(0, kind) for kind in (L.KIND_K, L.KIND_V)]
    appended = sum(held) - sum(before)
    assert min(h - b for h, b in zip(held, before)) > 0
    assert appended >= 2 and packed == []
    for kind in (L.KIND_K, L.KIND_V):
        store = cache.stores(0)[kind]
        # the device's packings are kept for later plans; the host's are packed again where a plan needs them
        assert sorted(store.packed) == list(range(held[kind] if threshold == 1 else before[kind]))
        for e in store.packed:
            want = pack(*tile_bases(*cache.calibration.bases(0, kind, e)))
            np.testing.assert_array_equal(np.asarray(store.packed[e]), np.asarray(want))
    rk, rv = cache.read_layer(0, [seq])
    assert np.array_equal(rk[0].numpy().view(np.uint16), x[0, :, :n])
    assert np.array_equal(rv[0].numpy().view(np.uint16), x[1, :, :n])


def test_shapes_the_device_rule_does_not_take_fall_back_to_the_host_rule(monkeypatch):
    assert device_epochs.supported(8, 128) and device_epochs.supported(32, 256)
    assert not device_epochs.supported(64, 256)               # more channels than its shared tables hold
    monkeypatch.setattr(epochs, "ADAPT_EVERY", 3)              # 48 tokens a check: not whole warps
    assert not device_epochs.supported(8, 128)
    cache = PagedKVCache(calibrate(*(drifting_cache(64)[:, :1],) * 2), codec="cuda")
    cache._rule_on_device = True
    assert not cache._device_rule                              # so an update runs the host rule
    with pytest.raises(ValueError, match="host rule does"):
        device_epochs.assign([(epochs.Adapter(cache.calibration.copy(), 0, 0),
                               torch.zeros((3, 1, L.BLOCK_TOKENS, 64), dtype=torch.int16))])


def test_a_guessed_epoch_that_would_run_a_pool_dry_does_not_refuse_the_update(monkeypatch):
    """The encode starts before the rule decides, with the newest epoch; where that guess needs more raw
    tiles than the pool holds but the rule's epochs do not, the update goes through as the host rule's does."""
    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 8)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)
    monkeypatch.setattr(epochs, "ADAPT_EVERY", 8)
    x = drifting_cache(64 * L.BLOCK_TOKENS, layers=2)[:, :1]
    x[1] = x[1] ^ 0x8000
    cal = calibrate(x[:1, :, :128], x[1:, :, :128])
    plain = PagedKVCache(cal, max_blocks=64, raw_tiles=12 * 2 * cal.layers, codec="reference", adapt=False)
    with pytest.raises(PoolExhaustedError, match="raw-tile arena is exhausted"):
        plain.add_sequence(x[:1], x[1:])                    # the calibration's bases alone need more raw tiles
    host = PagedKVCache(cal, max_blocks=64, raw_tiles=12 * 2 * cal.layers, codec="reference")
    gpu = PagedKVCache(cal, max_blocks=64, raw_tiles=12 * 2 * cal.layers, codec="cuda")
    gpu._rule_on_device = True
    gpu._guess_misses = 0.0                                 # earlier prompts kept the guess: the encodes guess
    sh, sg = host.add_sequence(x[:1], x[1:]), gpu.add_sequence(x[:1], x[1:])
    assert_same_epochs(gpu.calibration, host.calibration)
    for kind in (L.KIND_K, L.KIND_V):
        assert np.array_equal(gpu.stores(0)[kind].epochs[sg], host.stores(0)[kind].epochs[sh])
        assert gpu.stores(0)[kind].raw.used == host.stores(0)[kind].raw.used
    rk, rv = gpu.read_layer(0, [sg])
    assert np.array_equal(rk[0].numpy().view(np.uint16), x[0])
    assert np.array_equal(rv[0].numpy().view(np.uint16), x[1])


def _holds_what_the_host_holds(gpu, sg, host, sh, x) -> None:
    """One layer's cache whose rule ran on the device holds what the host rule's holds: the same epochs appended
    and block epochs, and its sequence ``sg`` reads back ``x`` (K ``x[0]``, V ``x[1]``) bit-exact."""
    assert_same_epochs(gpu.calibration, host.calibration)
    for kind in (L.KIND_K, L.KIND_V):
        assert np.array_equal(gpu.stores(0)[kind].epochs[sg], host.stores(0)[kind].epochs[sh])
    rk, rv = gpu.read_layer(0, [sg])
    assert np.array_equal(rk[0].numpy().view(np.uint16), x[0])
    assert np.array_equal(rv[0].numpy().view(np.uint16), x[1])


def _count_encodes(monkeypatch) -> dict:
    """Tiles each kind of encoder launch codes (``runs``: one epoch's bases; ``rows``: each block's read on the
    device), and ``at_decisions``: the tiles launched when the host first waits for the rule's decisions."""
    import gaac.cuda.codec as codec
    import gaac.cuda.epochs as cuda_epochs

    counts = {"runs": 0, "rows": 0, "at_decisions": []}

    def counted(name, key, at):
        old = getattr(codec.EncodePlan, name)

        def wrapper(self, *a, **k):
            counts[key] += a[at].shape[0]
            return old(self, *a, **k)
        monkeypatch.setattr(codec.EncodePlan, name, wrapper)

    counted("in_place", "runs", 2)
    counted("__call__", "runs", 1)
    counted("in_place_by_rows", "rows", 3)
    finish = cuda_epochs.Batch.finish
    monkeypatch.setattr(cuda_epochs.Batch, "finish",
                        lambda self: (counts["at_decisions"].append(counts["runs"] + counts["rows"]), finish(self))[1])
    return counts


def test_a_prompts_encodes_read_each_blocks_epoch_on_the_device_before_the_decisions(monkeypatch):
    """A prompt whose rule appends (its calibration from other text): every tile is encoded once, in one launch a
    layer and kind, each block with the bases of the epoch the rule decides for it, read from the rule's results on
    the device; the launches are made before the host waits for the decisions, whatever the cache's record of
    earlier guesses.  Both hold what the host rule makes, bit-exact, and the prompt's share of appending jobs joins
    that record."""
    x, cal, n = _one_drifting_layer(monkeypatch)
    counts = _count_encodes(monkeypatch)
    host = PagedKVCache(cal, **every_tile(cal, 1, 40), codec="reference")
    sh = host.add_sequence(x[:1, :, :n], x[1:, :, :n])
    appended = sum(host.calibration.n_epochs(0, kind) > 1 for kind in (L.KIND_K, L.KIND_V))
    assert appended == 2
    for misses in (1.0, 0.0):                               # a new cache's estimate; one whose prompts kept the guess
        gpu = PagedKVCache(cal, **every_tile(cal, 1, 40), codec="cuda")
        gpu._rule_on_device = True
        gpu._guess_misses = misses
        counts.update(runs=0, rows=0, at_decisions=[])
        sg = gpu.add_sequence(x[:1, :, :n], x[1:, :, :n])
        assert (counts["runs"], counts["rows"], counts["at_decisions"]) == (0, 2 * 20, [2 * 20])
        assert gpu._guess_misses == (misses + appended / 2) / 2
        _holds_what_the_host_holds(gpu, sg, host, sh, x[:, :, :n])


def test_an_encode_that_read_fewer_phases_than_the_rule_needed_is_encoded_again(monkeypatch):
    """The encodes read the phases launched with the rule's batch; a job still appending in the last of them may
    append again in a later phase (launched once the host looks).  With one phase launched, the jobs that append
    twice are encoded again with the decisions (their first encode put back), the others kept: bit-exact, as the
    host rule makes."""
    import gaac.cuda.epochs as cuda_epochs

    x, cal, _ = _one_drifting_layer(monkeypatch)
    n = x.shape[2]                                          # 36 blocks: two checks, each appending
    counts = _count_encodes(monkeypatch)
    host = PagedKVCache(cal, **every_tile(cal, 1, 40), codec="reference")
    sh = host.add_sequence(x[:1, :, :n], x[1:, :, :n])
    twice = [kind for kind in (L.KIND_K, L.KIND_V) if host.calibration.n_epochs(0, kind) > 2]
    assert twice
    monkeypatch.setattr(cuda_epochs, "PHASES", 0)           # the batch launches phase 0 only
    gpu = PagedKVCache(cal, **every_tile(cal, 1, 40), codec="cuda")
    gpu._rule_on_device = True
    sg = gpu.add_sequence(x[:1, :, :n], x[1:, :, :n])
    assert counts["rows"] == 2 * 36 and counts["runs"] == 36 * len(twice)
    _holds_what_the_host_holds(gpu, sg, host, sh, x)


def test_decode_steps_and_a_prompt_copy_no_block_to_the_host_where_the_rule_runs_on_the_device(monkeypatch):
    """Where the rule runs on the device, decode steps' finished blocks and the blocks a rule batch leaves for an
    adapter's next check stay on the device: no host copy is made of them (on a GPU a pinned allocation and a copy
    that arrives only when the device reaches the step, which a join's prompt would wait for) and none is read
    back; the adapters keep them as :class:`~gaac.epochs.DeviceBlock`.  The cache decides and holds what the host
    rule's cache does."""
    from test_captured import _steps

    from gaac.cache.update import UpdateTransaction, _on_device
    from gaac.epochs import DeviceBlock

    rng, k, v, cal, start, steps, heads = _steps_then_prompt(monkeypatch)
    copied, read = [], []
    host_copies, host_copy = UpdateTransaction._host_copies, UpdateTransaction._host_copy
    as_array = DeviceBlock.__array__

    def counted_copies(self, tensors):
        if (tensors[0] if isinstance(tensors, list) else tensors).dtype == torch.int16:
            copied.append(len(tensors))
        return host_copies(self, tensors)

    def counted_copy(self, x):
        if x.dtype == torch.int16:
            copied.append(len(x))
        return host_copy(self, x)

    def counted_read(self, *args, **kwargs):
        read.append(1)
        return as_array(self, *args, **kwargs)

    caches = []
    for on_device in (False, True):
        cache, rows = _two_sequences(cal, k, v, start, on_device)
        pos = list(start)
        if on_device:
            copied.clear()
            monkeypatch.setattr(UpdateTransaction, "_host_copies", counted_copies)
            monkeypatch.setattr(UpdateTransaction, "_host_copy", counted_copy)
            monkeypatch.setattr(DeviceBlock, "__array__", counted_read)
        assert _steps(cache, rows, k, v, pos, 2 * heads, steps, rng) == steps
        if on_device:
            # the blocks since each adapter's last check: observed (DeviceBlock) or queued with their device copy
            held = [b for store in cache.stores(0) for b in store.adapter._recent]
            queued = [item for store in cache.stores(0) for item in store.deferred]
            assert held or queued, "no blocks wait for a check"
            assert all(isinstance(b, DeviceBlock) for b in held), "an adapter holds a block on the host"
            assert all(_on_device(item) for item in queued), "a queued block came to the host"
        rows.append(cache.add_sequence(k[2], v[2]))
        if on_device:
            kept = [b for store in cache.stores(0) for b in store.adapter._recent]
            assert all(isinstance(b, DeviceBlock) for b in kept), "a prompt's leftover blocks came to the host"
        monkeypatch.setattr(UpdateTransaction, "_host_copies", host_copies)
        monkeypatch.setattr(UpdateTransaction, "_host_copy", host_copy)
        monkeypatch.setattr(DeviceBlock, "__array__", as_array)
        caches.append((cache, rows))
    assert copied == [] and read == []
    _same_caches(caches, k, v, start, steps)


def test_a_fitted_prompt_is_observed_without_a_wait_and_the_blocks_after_it_decide_as_the_host_rule(monkeypatch):
    """``append(..., fitted=True)`` (the calibration was fitted on the prompt): the device rule's batch only scans
    (no phase, nothing read back from the device), every block keeps epoch 0 and each layer and kind encodes in
    one launch; the adapters leave as the host rule's do, and the blocks after the prompt append the same epochs.
    Both caches read back bit-exact."""
    import gaac.cuda.codec as codec

    x, cal, n = _one_drifting_layer(monkeypatch)
    launches, phases, finish_reads = [], [], []
    in_place = codec.EncodePlan.in_place
    monkeypatch.setattr(codec.EncodePlan, "in_place",
                        lambda self, bits, first, entries, *a, **k: (launches.append(entries.shape[0]),
                                                                     in_place(self, bits, first, entries, *a, **k)))
    real_phases, real_finish = device_epochs.Batch._phases, device_epochs.Batch.finish
    monkeypatch.setattr(device_epochs.Batch, "_phases", lambda self, count: (phases.append(count),
                                                                              real_phases(self, count)))

    def finish(self):
        reads, cpu = [], torch.Tensor.cpu
        monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: (reads.append(t.shape), cpu(t, *a, **k))[1])
        try:
            return real_finish(self)
        finally:
            monkeypatch.setattr(torch.Tensor, "cpu", cpu)
            finish_reads.append(len(reads))

    monkeypatch.setattr(device_epochs.Batch, "finish", finish)
    caches = []
    for on_device in (True, False):
        cache = PagedKVCache(cal, **every_tile(cal, 1, 40), codec="cuda" if on_device else "reference")
        cache._rule_on_device = on_device
        seq = cache.add_sequence()
        cache.append(seq, x[:1, :, :n], x[1:, :, :n], fitted=True)
        if on_device:
            assert launches == [20, 20] and phases == [] and finish_reads == [0], (launches, phases, finish_reads)
            assert cache._guess_misses == 1.0         # a fitted prompt says nothing of whether the next one keeps
            assert cache.calibration.n_epochs(0, L.KIND_K) == cache.calibration.n_epochs(0, L.KIND_V) == 1
        k, v = (torch.from_numpy(np.ascontiguousarray(x[i:i + 1, :, n:]).view(np.int16)) for i in (0, 1))
        cache.update_layer(0, [seq], k, v)          # the blocks after the prompt: the rule decides again
        caches.append((cache, seq))
    (gpu, sg), (host, sh) = caches
    assert gpu.calibration.n_epochs(0, L.KIND_K) > 1          # the drift after the prompt appends
    assert_same_epochs(gpu.calibration, host.calibration)
    for kind in (L.KIND_K, L.KIND_V):
        assert (gpu.stores(0)[kind].epochs[sg][:20] == 0).all()
        assert np.array_equal(gpu.stores(0)[kind].epochs[sg], host.stores(0)[kind].epochs[sh])
        _same_adapter(gpu.stores(0)[kind].adapter, host.stores(0)[kind].adapter)
    for cache, seq in caches:
        rk, rv = cache.read_layer(0, [seq])
        assert np.array_equal(rk[0].numpy().view(np.uint16), x[0])
        assert np.array_equal(rv[0].numpy().view(np.uint16), x[1])


def test_reading_the_calibration_looks_for_the_queued_decode_checks_once(monkeypatch):
    """``cache.calibration`` brings every adapter up to date: where decode blocks wait on the device in every layer
    and kind's queue (none completing a check), it looks for their checks once, not once a store; the adapters
    then hold those blocks, their device copies kept for the rule's next batch."""
    from gaac.cache.update import UpdateTransaction, _Observed

    kv = [drifting_cache(8 * L.BLOCK_TOKENS, seed=s, layers=3)[:, :1] for s in (0, 1)]    # K, V: [3, 1, t, 64]
    cal = calibrate(kv[0], kv[1])
    cache = PagedKVCache(cal, max_blocks=8, codec="cuda", adapt=True)
    cache._rule_on_device = True
    for layer in range(cache.layers):
        for kind in (L.KIND_K, L.KIND_V):
            store = cache.stores(layer)[kind]
            run = torch.from_numpy(cache_blocks(kv[kind][layer])[:2].view(np.int16)).clone()
            store.deferred.append(_Observed(None, 0, run))
            store.waiting += len(run)
            assert store.adapter.until_check > len(run)
    looks = []
    look = UpdateTransaction._launch_decode_checks
    monkeypatch.setattr(UpdateTransaction, "_launch_decode_checks",
                        lambda c, upto: (looks.append(upto), look(c, upto))[1])
    cache.calibration
    assert len(looks) == 1, looks
    for layer in range(cache.layers):
        for store in cache.stores(layer):
            assert not store.deferred and store.waiting == 0
            assert len(store.adapter._recent) == 2 and store.adapter.recent_on(torch.device("cpu")) is not None


def test_a_prompt_takes_the_queued_decode_blocks_as_the_first_of_its_rule_batch(monkeypatch):
    """Decode blocks queued on the device ahead of a prompt (two checks' worth and more here; fewer than a check in
    :func:`test_a_prompt_after_decode_steps_reads_the_pending_blocks_on_the_device`) are the first blocks of the prompt's own rule batch, their checks its first: the prompt launches that one batch and
    no batch of decode checks, and leaves every queue empty.  The cache then holds, decides and keeps what a cache
    that runs those checks in a batch of their own first does, bit-exact; a later prompt too."""
    from gaac.cache.update import UpdateTransaction, _Observed

    monkeypatch.setattr(epochs, "WARMUP_BLOCKS", 4)
    monkeypatch.setattr(epochs, "ADAPT_EVERY", 4)
    monkeypatch.setattr(epochs, "PAYBACK_CHECKS", 10 ** 9)     # every differing candidate that saves is appended
    b, queued = L.BLOCK_TOKENS, 10
    x = drifting_cache(40 * b, layers=4)[:, :1]                 # [K0, K1, V0, V1]: two layers, one head of 64
    k, v = x[:2], x[2:] ^ 0x8000
    cal = calibrate(k[:, :, :2 * b], v[:, :, :2 * b])
    batches, looks = [], []
    batch_init, look = device_epochs.Batch.__init__, UpdateTransaction._launch_decode_checks
    caches = []
    for lead in (True, False):
        cache = PagedKVCache(cal, **every_tile(cal, 3, 24), codec="cuda", adapt=True)
        cache._rule_on_device = True
        if not lead:                    # the way a prompt that checks nothing goes: the decode checks first
            monkeypatch.setattr(UpdateTransaction, "_lead", lambda self, *a: None)
        first = cache.add_sequence(k[:, :, :5 * b], v[:, :, :5 * b])
        for layer in range(cache.layers):                       # a decode step's blocks, not yet checked
            for kind, src in ((L.KIND_K, k), (L.KIND_V, v)):
                store = cache.stores(layer)[kind]
                run = torch.from_numpy(cache_blocks(src[layer])[5:5 + queued].view(np.int16)).clone()
                store.deferred.append(_Observed(None, 0, run))
                store.waiting += queued
        monkeypatch.setattr(device_epochs.Batch, "__init__",
                            lambda bt, jobs, *a, **kw: (batches.append(max(len(ad._recent) for ad, _ in jobs)),
                                                        batch_init(bt, jobs, *a, **kw))[1])
        monkeypatch.setattr(UpdateTransaction, "_launch_decode_checks",
                            lambda c, upto: (looks.append(upto), look(c, upto))[1])
        second = cache.add_sequence(k[:, :, 16 * b:28 * b + 3], v[:, :, 16 * b:28 * b + 3])
        monkeypatch.setattr(device_epochs.Batch, "__init__", batch_init)
        monkeypatch.setattr(UpdateTransaction, "_launch_decode_checks", look)
        monkeypatch.setattr(UpdateTransaction, "_lead", UpdateTransaction.__dict__["_lead"])
        if lead:
            assert looks == [] and len(batches) == 1, (looks, batches)
            assert batches[0] > queued, "the batch did not take the queued blocks first"
            assert not cache._leading
            for layer in range(cache.layers):
                for store in cache.stores(layer):
                    assert not store.deferred and store.waiting == 0
        third = cache.add_sequence(k[:, :, 30 * b:38 * b], v[:, :, 30 * b:38 * b])
        caches.append((cache, [first, second, third]))
        batches.clear(), looks.clear()
    (got, rows), (want, _) = caches
    assert got.calibration.n_epochs(0, L.KIND_K) > 1                # the content drifts: the rule appended
    assert_same_epochs(got.calibration, want.calibration)
    for layer in range(got.layers):
        for kind in (L.KIND_K, L.KIND_V):
            np.testing.assert_array_equal(got.stores(layer)[kind].epochs, want.stores(layer)[kind].epochs)
            _same_adapter(got.stores(layer)[kind].adapter, want.stores(layer)[kind].adapter)
    spans = [(0, 5 * b), (16 * b, 28 * b + 3), (30 * b, 38 * b)]
    assert_reads_back([got, want], rows, [k[:, :, a:z] for a, z in spans], [v[:, :, a:z] for a, z in spans])


@pytest.mark.parametrize("grow", [True, False])
def test_a_prompt_written_before_its_counts_with_epochs_appended_is_undone_where_a_list_ran_dry(monkeypatch, grow):
    """A prompt whose encodes read the rule's epochs on the device is written -- its new epochs included -- before
    the encodes' counts are in.  Where the raw-tile arena then turns out too small, that write is undone: with
    ``grow`` the arena grows, the stores that ran dry are encoded again and the cache holds what the host rule's
    holds, each epoch appended once; without, the update is refused and the cache is as it was (no epoch, its
    base tables, encoders and attention base table as before, the decode blocks queued ahead of the prompt, which
    its rule batch took as its first, queued still; and a later prompt that fits is held bit-exact)."""
    from gaac.cache.update import UpdateTransaction, _EarlyWrite, _Observed

    x, cal, n = _one_drifting_layer(monkeypatch)
    x = x.copy()
    # four blocks whose tiles overflow whatever the bases: a quarter of their elements tiny (exponent field 3)
    span = slice(12 * L.BLOCK_TOKENS, 16 * L.BLOCK_TOKENS)
    x[:, :, span, ::4] = (x[:, :, span, ::4] & 0x807F) | (3 << 7)
    host = PagedKVCache(cal, **every_tile(cal, 1, 40), codec="reference")
    sh = host.add_sequence(x[:1, :, :n], x[1:, :, :n])
    assert host.calibration.n_epochs(0, L.KIND_K) > 1 and host.stores(0)[L.KIND_K].raw.used > 2
    written, undone = [], []
    write, undo = UpdateTransaction._written_early, _EarlyWrite.undo

    def writing(self, updates):
        early = write(self, updates)
        written.append(len(early.appended))
        return early

    monkeypatch.setattr(UpdateTransaction, "_written_early", writing)
    monkeypatch.setattr(_EarlyWrite, "undo", lambda self: (undone.append(True), undo(self))[1])
    gpu = PagedKVCache(cal, max_blocks=40, raw_tiles=2, codec="cuda", grow=grow)
    gpu._rule_on_device = True
    gpu.epoch_table(0)                      # the layer's attention base table, which the write appends to
    before = [tuple(getattr(store, name).clone() for name in ("b3", "b4", "tb3", "tb4")) for store in gpu.stores(0)]
    if grow:
        sg = gpu.add_sequence(x[:1, :, :n], x[1:, :, :n])
        assert written == [2] and undone == [True]              # written with both kinds' epochs, then undone
        _holds_what_the_host_holds(gpu, sg, host, sh, x[:, :, :n])
        for kind, store in enumerate(gpu.stores(0)):
            assert store.tb3.shape[0] == store.b3.shape[0] == gpu.calibration.n_epochs(0, kind)
        return
    for kind, store in enumerate(gpu.stores(0)):       # a decode step's blocks, queued for the rule
        run = torch.from_numpy(cache_blocks(x[kind])[:5].view(np.int16)).clone()
        store.deferred.append(_Observed(None, 0, run))
        store.waiting += 5
    queued = [list(store.deferred) for store in gpu.stores(0)]
    with pytest.raises(PoolExhaustedError, match="raw-tile arena is exhausted"):
        gpu.add_sequence(x[:1, :, :n], x[1:, :, :n])
    assert written == [2] and undone == [True]
    assert [store.deferred for store in gpu.stores(0)] == queued and not gpu._leading
    assert all(store.waiting == 5 and len(store.adapter._recent) == 0 for store in gpu.stores(0))
    assert gpu.calibration.n_epochs(0, L.KIND_K) == gpu.calibration.n_epochs(0, L.KIND_V) == 1
    for store, tables in zip(gpu.stores(0), before):
        for name, table in zip(("b3", "b4", "tb3", "tb4"), tables):
            assert torch.equal(getattr(store, name), table)
        assert all(key[0] < 1 for key in store.encoders) and all(e < 1 for e in store.packed)
    assert gpu.sequences == [] and not gpu.host_lengths.any()
    short = 8 * L.BLOCK_TOKENS                              # before the first check: no epoch, few raw tiles
    seq = gpu.add_sequence(x[:1, :, :short], x[1:, :, :short])
    rk, rv = gpu.read_layer(0, [seq])
    assert np.array_equal(rk[0].numpy().view(np.uint16), x[0, :, :short])
    assert np.array_equal(rv[0].numpy().view(np.uint16), x[1, :, :short])


def test_the_scans_byte_wise_window_test_marks_what_the_exponent_wise_test_marks():
    """Every exponent against every base a window can start at (FORMAT.md 3.2: ``b3 <= 248``, ``b4 <= 240``), four
    exponents a word in every order of the bytes: :func:`gaac.cuda.epochs.outside_bytes` sets a byte's top bit
    exactly where :func:`gaac.cuda.epochs.outside` says the exponent leaves that window."""
    rng = np.random.default_rng(7)
    exps = np.arange(256)
    for width, top, bit in ((L.WINDOW_3BIT, 0x78787878, 1), (L.WINDOW_4BIT, 0x70707070, 2)):
        for b in range(256 - width + 1):
            want = np.array([device_epochs.outside(int(e), b, 0) & 1 if bit == 1 else device_epochs.outside(int(e), 0, b) >> 1
                             for e in exps])
            bl, bh = device_epochs.lows_highs(b)
            for order in (exps, rng.permutation(256)):
                words = order.reshape(-1, 4)
                w = (words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24).astype(np.uint32)
                got = np.array([int(device_epochs.outside_bytes(np.uint32(x | 0x80808080), np.uint32(x & 0x80808080),
                                                                bl, bh, np.uint32(top))) for x in w])
                for j in range(4):
                    assert np.array_equal((got >> (8 * j + 7)) & 1, want[words[:, j]]), (width, b, j)


def test_a_batch_takes_the_queued_runs_of_blocks_without_python_work_for_each():
    """A join after N decode steps finds about N runs of blocks queued on the device in every layer and kind; the
    rule's batch counts, checks and gathers them without a Python call a run: its set-up makes as many calls for
    adapters holding ten runs each as for adapters holding two (a few calls a run and job before)."""
    import sys

    from test_cache import synthetic

    rng = np.random.default_rng(0)
    heads, dim, layers = 1, 64, 2
    cal = calibrate(synthetic(rng, layers, heads, 64, dim), synthetic(rng, layers, heads, 64, dim))
    prompt = torch.from_numpy(synthetic(rng, 1, heads, 32 * L.BLOCK_TOKENS, dim)[0]
                              .reshape(heads, 32, L.BLOCK_TOKENS, dim).transpose(1, 0, 2, 3).copy().view(np.int16))

    def calls(n_runs: int) -> int:
        jobs = []
        for layer in range(layers):
            for kind in (0, 1):
                adapter = epochs.Adapter(cal, layer, kind)
                adapter.finalized = 100
                adapter.keep_hist_on_device(torch.zeros(heads, dim, 256, dtype=torch.int32))
                runs = [torch.from_numpy(synthetic(rng, 1, heads, L.BLOCK_TOKENS, dim).view(np.int16))
                        for _ in range(n_runs)]
                adapter.keep_recent(epochs.device_blocks(*runs), runs)
                jobs.append((adapter, prompt))
        counted = [0]

        def count(frame, event, arg):
            if event in ("call", "c_call"):
                counted[0] += 1

        sys.setprofile(count)
        try:
            batch = device_epochs.Batch(jobs)
        finally:
            sys.setprofile(None)
        assert batch.r0.tolist() == [n_runs] * len(jobs)
        return counted[0]

    assert calls(10) == calls(2)
