"""Sequences sliced by KV head (FORMAT.md 11.12): a container of some KV heads of every layer, for a worker of
another tensor-parallel size, read back bit for bit by a cache made with the sliced calibration.

Only the CPU path runs here; a CUDA cache's export gathers through the same torch code on the device, which
tests/test_transfer_gpu.py covers for whole sequences, not for slices.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import gaac
from conftest import every_tile
from gaac import layout as L
from gaac import transfer
from gaac.cache import PagedKVCache
from gaac.errors import CalibrationError, InputError

VECTORS = Path(__file__).resolve().parents[1] / "format_spec" / "vectors"
SLICES = [(0, 1), (1, 3), (0, 3), (2, 3)]


@pytest.fixture(scope="module")
def prose():
    """The shipped sample, then the same tokens backwards less 11 (1525 tokens: 95 blocks and a tail of 5), in a
    cache that adapts from a calibration of its first 256 tokens: the blocks after the first check at 48 blocks
    are coded with appended epochs, so every section has an epoch record."""
    k, v = gaac.sample("prose")
    k, v = (np.concatenate([x, x[:, :, ::-1][:, :, :-11]], axis=2) for x in (k, v))
    cal = gaac.calibrate(k[:, :, :256], v[:, :, :256])
    cache = PagedKVCache(cal, adapt=True, **every_tile(cal, 2, 96))
    seq = cache.add_sequence(k, v)
    whole = transfer.read_head(bytes(cache.export_sequence(seq))).layout
    assert all(s.epochs for s in whole.sections) and {s.raw_tiles > 0 for s in whole.sections} == {True, False}
    return cache, seq, k, v


def _import(cal: gaac.Calibration, data) -> tuple[PagedKVCache, int]:
    cache = PagedKVCache(cal, adapt=True, **every_tile(cal, 1, 96))
    return cache, cache.import_sequence(data)


@pytest.mark.parametrize("heads", SLICES)
def test_a_slice_reads_back_the_heads_it_holds_bit_for_bit(prose, heads):
    cache, seq, k, v = prose
    a, b = heads
    data = transfer.export_sequence(cache, seq, heads=heads)
    c = transfer.read_head(data)
    sliced = cache.calibration.slice_heads(a, b)
    assert (c.layout.kv_heads, c.layout.tokens, c.calibration_id) == (b - a, k.shape[2], sliced.id)
    # epoch records: the epochs of the whole's, with the sliced bases and the sliced calibration's epoch ids
    whole = transfer.read_head(bytes(cache.export_sequence(seq))).layout
    for s, w in zip(c.layout.sections, whole.sections):
        assert [r.epoch for r in s.epochs] == [r.epoch for r in w.epochs]
        for r, rw in zip(s.epochs, w.epochs):
            assert np.array_equal(r.b3, rw.b3[a:b]) and np.array_equal(r.b4, rw.b4[a:b])
            assert r.bases_id == sliced.epoch_id(s.layer, s.kind, r.epoch)
    # into a cache of the sliced calibration with its epochs (matched), and of its epoch 0 only (appended)
    for cal in (sliced, gaac.Calibration(b3=sliced.b3, b4=sliced.b4, capacity=sliced.capacity)):
        target, got = _import(cal, data)
        rk, rv = target.read(got)
        np.testing.assert_array_equal(rk, k[:, a:b])
        np.testing.assert_array_equal(rv, v[:, a:b])
        assert bytes(target.export_sequence(got)) == bytes(data)     # as stored: the same container again


def test_all_heads_is_the_whole_container_and_the_unsliced_calibration(prose):
    cache, seq, _, _ = prose
    whole = bytes(cache.export_sequence(seq))
    assert bytes(transfer.export_sequence(cache, seq, heads=(0, cache.kv_heads))) == whole
    assert bytes(transfer.export_sequence(cache, seq, heads=(0, 3), calibration=True)) == \
        bytes(cache.export_sequence(seq, calibration=True))
    assert cache.calibration.slice_heads(0, 3).to_dict() == cache.calibration.to_dict()
    assert transfer.exported_layout(cache, seq, heads=(1, 3)).nbytes == \
        len(transfer.export_sequence(cache, seq, heads=(1, 3)))


def _tiles(data) -> dict:
    """Per (layer, kind, block, tile of the block): the tile's stored bytes and whether it is raw; per (layer, kind):
    the block epochs and the tail ``[heads, t, D]``."""
    c = transfer.read_head(data)
    lay, body = c.layout, c.body
    geo = L.geometry(lay.head_dim)
    per, nb = lay.tiles_per_block, lay.blocks
    tiles, rest = {}, {}
    for s in lay.sections:
        entries = np.frombuffer(body, "<u4", nb * per, s.table)
        for i, e in enumerate(entries.tolist()):
            raw, n = bool(e >> 31), e & 0x7FFFFFFF
            size = geo.raw_bytes if raw else geo.slot_bytes(s.capacity)
            at = (s.raw if raw else s.slots) + n * size
            tiles[(s.layer, s.kind, i // per, i % per)] = (raw, bytes(body[at:at + size]))
        epochs = np.frombuffer(body, "<u2", nb, s.block_epochs)
        tail = np.frombuffer(body, "<u2", lay.kv_heads * lay.tail_tokens * lay.head_dim, s.tail)
        rest[(s.layer, s.kind)] = (epochs.tolist(), tail.reshape(lay.kv_heads, lay.tail_tokens, lay.head_dim))
    return tiles, rest


def test_a_slice_with_its_calibration_embedded_unpacks_on_its_own(prose):
    cache, seq, k, v = prose
    data = transfer.export_sequence(cache, seq, heads=(1, 3), calibration=True)
    assert transfer.read_head(data).calibration.id == cache.calibration.slice_heads(1, 3).id
    rk, rv = transfer.unpack(data)
    np.testing.assert_array_equal(rk, k[:, 1:3])
    np.testing.assert_array_equal(rv, v[:, 1:3])


def test_two_halves_hold_what_the_whole_does(prose):
    """Heads 0 and 1-2 of the sample: every tile of the whole, slot or raw, is the tile of one half at its
    head's place, byte for byte (no re-encoding); the block epochs are the whole's and the tails its heads."""
    cache, seq, _, _ = prose
    whole, whole_rest = _tiles(cache.export_sequence(seq))
    halves = [(a, *_tiles(transfer.export_sequence(cache, seq, heads=(a, b)))) for a, b in ((0, 1), (1, 3))]
    joined = {(layer, kind, block, a + tile): t for a, tiles, _ in halves
              for (layer, kind, block, tile), t in tiles.items()}
    assert joined == whole
    for key, (epochs, tail) in whole_rest.items():
        assert all(rest[key][0] == epochs for _, _, rest in halves)
        np.testing.assert_array_equal(np.concatenate([rest[key][1] for _, _, rest in halves]), tail)
    sizes = [transfer.read_head(transfer.export_sequence(cache, seq, heads=h)).layout for h in ((0, 1), (1, 3))]
    whole_lay = transfer.read_head(cache.export_sequence(seq)).layout
    for i, s in enumerate(whole_lay.sections):
        assert s.raw_tiles == sum(lay.sections[i].raw_tiles for lay in sizes)
        assert s.slot_tiles == sum(lay.sections[i].slot_tiles for lay in sizes)


def test_head_dim_256_slices_both_tiles_of_each_head():
    """Two tiles per head: a slice's blocks hold tiles 2 * start .. 2 * stop - 1 of each block."""
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn((2, 3, 53, 256), generator=g).mul(4).bfloat16() for _ in range(2))
    cal = gaac.calibrate(k, v)
    cache = PagedKVCache(cal, **every_tile(cal, 1, 4))
    seq = cache.add_sequence(k, v)
    whole, _ = _tiles(cache.export_sequence(seq))
    for a, b in ((1, 2), (0, 2), (2, 3)):
        data = transfer.export_sequence(cache, seq, heads=(a, b))
        assert transfer.read_head(data).layout.tiles_per_block == 2 * (b - a)
        target = PagedKVCache(cal.slice_heads(a, b), **every_tile(cal.slice_heads(a, b), 1, 4))
        rk, rv = target.read(target.import_sequence(data))
        np.testing.assert_array_equal(rk, k[:, a:b].view(torch.int16).numpy().view(np.uint16))
        np.testing.assert_array_equal(rv, v[:, a:b].view(torch.int16).numpy().view(np.uint16))
        tiles, _ = _tiles(data)
        assert len(tiles) == 2 * 2 * 3 * 2 * (b - a)
        assert all(whole[(layer, kind, block, 2 * a + t)] == x for (layer, kind, block, t), x in tiles.items())


def test_an_empty_sequence_slices_to_an_empty_container(prose):
    cache, _, k, v = prose
    seq = cache.add_sequence(k[:, :, :0], v[:, :, :0])
    try:
        data = transfer.export_sequence(cache, seq, heads=(1, 2))
        target, got = _import(cache.calibration.slice_heads(1, 2), data)
        assert target.read(got)[0].shape == (k.shape[0], 1, 0, k.shape[3])
    finally:
        cache.remove_sequence(seq)


@pytest.mark.parametrize("heads", [(0, 0), (2, 1), (-1, 2), (0, 4), (3, 4), (1,), (0, 1, 2), (0, 1.0),
                                   (True, 2), "01"])
def test_a_slice_out_of_range_or_empty_is_refused(prose, heads):
    cache, seq, _, _ = prose
    with pytest.raises(InputError, match="heads"):
        transfer.export_sequence(cache, seq, heads=heads)
    if isinstance(heads, tuple) and len(heads) == 2:
        with pytest.raises(InputError, match="heads"):
            cache.calibration.slice_heads(*heads)


def test_a_slice_imports_only_into_a_cache_of_the_sliced_calibration(prose):
    cache, seq, _, _ = prose
    data = transfer.export_sequence(cache, seq, heads=(1, 2))
    for cal in (cache.calibration, cache.calibration.slice_heads(0, 1), cache.calibration.slice_heads(2, 3)):
        target = PagedKVCache(cal, adapt=True, **every_tile(cal, 1, 96))
        with pytest.raises(CalibrationError, match="exported from a cache with calibration"):
            target.import_sequence(data)
        assert target.sequences == []
    # heads 1..1 and 2..2 of this calibration have different tables, hence different ids
    assert len({cache.calibration.slice_heads(h, h + 1).id for h in range(3)} | {cache.calibration.id}) == 4


def test_slicing_a_calibration_keeps_it_whole_and_is_a_calibration():
    """The slice's id is that of its own canonical bytes; its epochs' ids follow from it; the source is unchanged."""
    cal = gaac.Calibration.load(VECTORS / "cal_epochs.json")
    before = cal.to_dict()
    part = cal.slice_heads(1, 2)
    assert cal.to_dict() == before
    assert part.kv_heads == 1 and np.array_equal(part.capacity, cal.capacity)
    assert np.array_equal(part.b3, cal.b3[:, :, 1:2]) and np.array_equal(part.b4, cal.b4[:, :, 1:2])
    assert gaac.Calibration.from_canonical_bytes(part.canonical_bytes()).id == part.id
    again = gaac.Calibration.from_dict(part.to_dict())         # its file checks every id it names
    assert again.to_dict() == part.to_dict()
    for (kind, layer), tables in cal.epochs.items():
        for e, (b3, b4) in enumerate(tables, start=1):
            assert all(np.array_equal(x, y[1:2]) for x, y in zip(part.bases(layer, kind, e), (b3, b4)))
    part.add_epoch(0, 0, part.b3[0, 0], part.b4[0, 0])
    assert cal.n_epochs(0, 0) == part.n_epochs(0, 0) - 1
