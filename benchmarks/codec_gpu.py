"""Bit-exactness checks and timings of the numba.cuda tile codec (gaac.cuda.codec) on a GPU.

    python benchmarks/codec_gpu.py --check --bench --kv .devdata/kv --out results/

``--check``  real K/V (every layer, K and V, of every dump in ``--kv``, calibrated on itself) and
             >= 10^8 synthetic elements in four forced mixes: for EVERY tile the kernel's escape
             count, storage class, slot bytes (or raw copy) equal ``gaac.reference.codec.encode_tiles``
             run on the host CPU (in parallel processes), and decode(encode(x)) == x on the device.
``--bench``  for 8 KV heads x d128, 4 x d256 and 3 x d64: encode latency of one block (K and V of
             one layer), host overhead per launch (fast path, numba's path), CUDA-graph capture,
             and bulk encode/decode of a 64K-token cache (plain launches, and replayed from CUDA
             graphs, which leaves out the host's launch cost) against the floor
             (bytes read + written) / copy bandwidth and against a BF16 device copy (torch clone).
             Timing data is synthetic with the real KV's group-mode mix (about 90% 3-bit, 9.7%
             4-bit, 0.3% raw; printed as measured); inputs rotate over >= 3x the L2 size.
``--variants`` with --bench: the same bulk encode/decode timed for kernel variants on the same data
             in the same run -- tiles per block 1, 2, 4, 8 other than the default, the decoder on raw
             entries only (its copy path: what the kernel's memory pattern reaches without
             decoding), and, with ``--baseline FILE``, an older ``gaac/cuda/codec.py`` (e.g.
             ``git show c84d444:gaac/cuda/codec.py``, the v1 kernels).  Every variant's decode must
             give the input back and its slots must hold the default kernel's bytes.
``--out DIR``  also the log, the JSON report and the PTX/SASS of the kernels (with --bench).

Without CUDA (``--sim``, tiny sizes) the same code runs in numba's simulator as a dry run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if "--sim" in sys.argv:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import torch  # noqa: E402

from benchmarks.timing import copy_bandwidth, gpu_time_us, graph_time_us, sync  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.calibration import best_capacity, calibrate  # noqa: E402
from gaac.cuda import codec as cuda_codec  # noqa: E402
from gaac.reference.codec import encode_tiles as ref_encode_tiles  # noqa: E402
from gaac.tiles import block_tiles, cache_blocks, tile_bases  # noqa: E402

L2_BYTES = 60 * 2**20
COPY_TBPS = 4.2                     # measured device copy (read + write) on the H200, brief; re-measured below
SHAPES = ((8, 128), (4, 256), (3, 64))
# Per-element probabilities that give the real KV's group mix: (1 - q4 - qr)^8 = 0.90, 1 - (1 - qr)^8 = 0.003.
KV_LIKE = dict(q4=1 - 0.9 ** (1 / 8) - (1 - 0.997 ** (1 / 8)), qr=1 - 0.997 ** (1 / 8))


# ------------------------------------------------------------------------------------------------
# Data

def synth_tiles(n, channels, rows, mix, gen, dev):
    """``n`` tiles ``int16[n, 16, C]`` and per-row bases ``uint8[rows, C]`` (tile i uses row i % rows).

    Mixes: ``kv`` -- exponents in the 3-bit window, a fraction ``q4`` just above it (inside the
    4-bit window) and ``qr`` at exponent 0 (raw), bases 100..130 like real K/V; ``stress`` -- many
    4-bit and raw groups, bases anywhere; ``uniform`` -- all 65536 patterns, bases anywhere;
    ``edges`` -- bases at 0 or at the top, exponents at both ends of the range.
    """
    r = lambda lo, hi, shape: torch.randint(lo, hi, shape, generator=gen, device=dev)  # noqa: E731
    shape = (n, L.BLOCK_TOKENS, channels)
    q4, qr, lo, hi = dict(kv=(KV_LIKE["q4"], KV_LIKE["qr"], 100, 131), stress=(0.08, 0.01, 0, L.B3_MAX + 1),
                          uniform=(0, 0, 0, L.B3_MAX + 1), edges=(0.05, 0.01, 0, 2))[mix]
    b3 = r(lo, hi, (rows, channels))
    if mix == "edges":
        b3 = b3 * L.B3_MAX
    b4 = (b3 - r(0, 5, (rows, channels))).clamp(0, L.B4_MAX)       # 4-bit window holds b3 .. b3+11
    idx = torch.arange(n, device=dev) % rows
    t3 = b3[idx][:, None, :]
    e = t3 + r(0, L.WINDOW_3BIT, shape)
    u = torch.rand(shape, generator=gen, device=dev)
    e = torch.where(u < q4, t3 + L.WINDOW_3BIT + r(0, 4, shape), e)
    far = torch.where(t3 > 128, 0, 255) if mix == "edges" else torch.zeros_like(t3)
    e = torch.where(u > 1 - qr, far, e)
    sm = r(0, 256, shape)
    bits = ((sm & 0x80) << 8) | ((e & 0xFF) << 7) | (sm & 0x7F)
    if mix == "uniform":
        bits = r(0, 1 << 16, shape)
        b4 = r(0, L.B4_MAX + 1, (rows, channels))
    return (bits - ((bits >> 15) << 16)).to(torch.int16), b3.to(torch.uint8), b4.to(torch.uint8)


def mode_fractions(bits, b3, b4):
    """Fractions of 3-bit / 4-bit / raw groups (computed with torch from the definition, FORMAT.md 5.2)."""
    n, _, c = bits.shape
    idx = torch.arange(n, device=bits.device) % b3.shape[0]
    e = ((bits.to(torch.int32) >> 7) & 0xFF).view(n, L.BLOCK_TOKENS, c // L.GROUP_SIZE, L.GROUP_SIZE)
    d3 = e - b3[idx].to(torch.int32).view(n, 1, -1, L.GROUP_SIZE)
    d4 = e - b4[idx].to(torch.int32).view(n, 1, -1, L.GROUP_SIZE)
    f3 = ((d3 >= 0) & (d3 < L.WINDOW_3BIT)).all(-1)
    f4 = ((d4 >= 0) & (d4 < L.WINDOW_4BIT)).all(-1) & ~f3
    total = f3.numel()
    return f3.sum().item() / total, f4.sum().item() / total, 1 - (f3.sum() + f4.sum()).item() / total


class Pools:
    """Pools of ``n`` slots and ``n`` raw tiles, a plan pair, and the per-call outputs, on ``dev``.

    ``codec`` is the module whose plans are used (default gaac.cuda.codec); ``plan`` holds extra
    keyword arguments of its plans (the kernel variants' ``tiles_per_block``).
    """

    def __init__(self, n, channels, capacity, b3, b4, dev, codec=None, **plan):
        geo = L.TileGeometry(channels)
        z = lambda shape, dt: torch.zeros(shape, dtype=dt, device=dev)  # noqa: E731
        self.slots = z((n, geo.slot_bytes(capacity)), torch.uint8)
        self.raw = z((n, L.BLOCK_TOKENS, channels), torch.int16)
        self.heads = z((2,), torch.int32)
        free = torch.arange(n, dtype=torch.int32, device=dev)
        m = codec or cuda_codec
        bases = m.pack_bases(b3, b4)
        self.enc = m.EncodePlan(channels, capacity, bases, self.slots, free, self.raw, free.clone(), self.heads, **plan)
        self.dec = m.DecodePlan(channels, capacity, bases, self.slots, self.raw, **plan)
        self.entries, self.used, self.status = z((n,), torch.int32), z((n,), torch.int32), z((n,), torch.int32)
        self.out = z((n, L.BLOCK_TOKENS, channels), torch.int16)

    def encode(self, bits, fast=True):
        self.heads.zero_()
        self.enc(bits, self.entries[: bits.shape[0]], self.used[: bits.shape[0]], fast=fast)

    def decode(self, n, fast=True):
        self.dec(self.entries[:n], self.out[:n], self.status[:n], fast=fast)


# ------------------------------------------------------------------------------------------------
# Checks

_WORK = {}


def _ref_chunk(lo, hi):
    """Compare tiles lo..hi of the job in _WORK (inherited by fork) with the reference; count mismatches."""
    w = _WORK
    tiles, rows = w["tiles"][lo:hi], np.arange(lo, hi) % w["b3"].shape[0]
    ref = ref_encode_tiles(tiles, w["b3"][rows], w["b4"][rows], w["capacity"])
    entries = w["entries"][lo:hi].astype(np.int64)
    bad_used = int((ref.escape_used != w["used"][lo:hi]).sum())
    bad_class = int(((entries >= 0) != ref.fits).sum())
    index = entries & L.TABLE_INDEX_MASK
    fit = ref.fits & (entries >= 0)
    bad_slot = int((w["slots"][index[fit]] != ref.slots[fit]).any(axis=1).sum())
    spill = ~ref.fits & (entries < 0)
    bad_raw = int((w["raw"][index[spill]] != tiles[spill]).any(axis=(1, 2)).sum())
    return bad_used, bad_class, bad_slot, bad_raw, int(ref.fits.sum())


def check_against_reference(tiles_dev, b3, b4, capacity, workers):
    """Encode on the device; compare every tile with the reference on the host; round-trip on the device."""
    n, _, c = tiles_dev.shape
    p = Pools(n, c, capacity, b3, b4, tiles_dev.device)
    p.slots.fill_(0xA5)
    p.encode(tiles_dev)
    p.decode(n)
    roundtrip = bool(torch.equal(p.out, tiles_dev)) and int(p.status.abs().sum()) == 0
    _WORK.update(tiles=tiles_dev.cpu().numpy().view(np.uint16), b3=b3.cpu().numpy(), b4=b4.cpu().numpy(),
                 capacity=capacity, entries=p.entries.cpu().numpy(), used=p.used.cpu().numpy(),
                 slots=p.slots.cpu().numpy(), raw=p.raw.cpu().numpy().view(np.uint16))
    step = max(1, -(-n // (4 * workers)))
    chunks = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
            parts = list(ex.map(_ref_chunk, *zip(*chunks)))
    else:
        parts = [_ref_chunk(lo, hi) for lo, hi in chunks]
    bad = [sum(x[i] for x in parts) for i in range(4)]
    heads = p.heads.tolist()
    return dict(tiles=n, elements=n * L.BLOCK_TOKENS * c, fits=sum(x[4] for x in parts), capacity=capacity,
                mismatched_escape_counts=bad[0], mismatched_storage_class=bad[1], mismatched_slots=bad[2],
                mismatched_raw_tiles=bad[3], heads=heads, roundtrip_exact=roundtrip,
                ok=roundtrip and not any(bad) and heads[0] + heads[1] == n)


def run_checks(args, dev, log):
    gen = torch.Generator(device=dev).manual_seed(1234)
    results = []
    # Real K/V: every layer and kind of every dump, calibrated on the dump itself.
    for kpath in sorted(Path(args.kv).glob("*__k.npy")):
        k, v = np.load(kpath), np.load(str(kpath).replace("__k.npy", "__v.npy"))
        if args.sim:
            k, v = k[:1, :, :32], v[:1, :, :32]
        cal = calibrate(k, v, show_progress=False)
        allx = dict(k=k, v=v)
        tot = dict(tiles=0, elements=0, fits=0, ok=True, bad=0)
        for kind, x in allx.items():
            kd = L.KIND_K if kind == "k" else L.KIND_V
            for layer in range(x.shape[0]):
                b3, b4 = tile_bases(*cal.bases(layer, kd))
                tiles = block_tiles(cache_blocks(x[layer]))
                r = check_against_reference(torch.from_numpy(tiles.view(np.int16)).to(dev),
                                            torch.from_numpy(b3).to(dev), torch.from_numpy(b4).to(dev),
                                            int(cal.capacity[kd, layer]), 1)
                for key in ("tiles", "elements", "fits"):
                    tot[key] += r[key]
                tot["ok"] &= r["ok"]
        name = kpath.name.split("__")[1]
        results.append(dict(data=f"real KV {name} (all layers, K+V)", **tot))
        log(f"check real {name}: {tot}")
    # Synthetic: >= 10^8 elements in four mixes, capacities that make some tiles spill.
    sizes = dict(kv=(24576, 128), stress=(16384, 128), uniform=(8192, 64), edges=(8192, 64))
    for mix, (n, c) in sizes.items():
        if args.sim:
            n = 3
        bits, b3, b4 = synth_tiles(n, c, 8, mix, gen, dev)
        probe = Pools(n, c, L.TileGeometry(c).groups * L.ESCAPE_BYTES[L.MODE_RAW], b3, b4, dev)
        probe.encode(bits)
        used = probe.used.cpu().numpy()
        capacity = int(np.quantile(used, 0.9)) // 16 * 16 if mix != "uniform" else int(used.min()) // 16 * 16
        del probe
        t = time.perf_counter()
        r = check_against_reference(bits, b3, b4, capacity, args.workers)
        r["seconds"] = round(time.perf_counter() - t, 1)
        r["modes"] = [round(f, 4) for f in mode_fractions(bits, b3, b4)]
        results.append(dict(data=f"synthetic {mix} (C={c})", **r))
        log(f"check synthetic {mix}: {r}")
    return results


# ------------------------------------------------------------------------------------------------
# Timings

def load_baseline(path):
    """An older ``gaac/cuda/codec.py`` (a file copied out of git history) as module
    ``gaac.cuda._baseline``: it imports gaac's layout, errors and device primitives like the current one (a
    codec.py older than gaac.cuda.primitives imports gaac.cuda.bitops, which is gone: point its import at
    primitives)."""
    spec = importlib.util.spec_from_file_location("gaac.cuda._baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_variants(n, c, capacity, data, pools, floors, args, dev, log):
    """Bulk encode/decode of the same data with other kernel variants; each checked against the default.

    Per variant: encode and decode time (median of the same repetitions as the default) and their
    share of the floors, decode(encode(x)) == x, and every fitting tile's slot bytes equal to the
    default kernel's slot for that tile (the default's bytes are checked against the reference by
    ``--check``).  ``raw-only decode`` decodes raw entries that point at copies of the input.
    """
    sets, reps = len(data), (1 if args.sim else 20)
    variants = [(f"tiles/block {t}", None, dict(tiles_per_block=t)) for t in (1, 2, 4, 8)
                if t != cuda_codec.TILES_PER_BLOCK]
    if args.baseline:
        variants.append((f"baseline {Path(args.baseline).name}", load_baseline(args.baseline), {}))
    want = [p.slots[p.entries.long().clamp(min=0)] for p in pools[0]]   # default's slot of each tile
    out = []
    for name, codec, plan in variants:
        try:
            t = time.perf_counter()
            vp = [[Pools(n, c, capacity, b3, b4, dev, codec, **plan) for (_, b3, b4) in kv] for kv in data]
            vp[0][0].encode(data[0][0][0])                   # compile outside the timing
            vp[0][0].decode(n)
            sync()
            compile_s = time.perf_counter() - t
            t_enc = gpu_time_us(lambda i: [p.encode(bits) for p, (bits, _, _) in zip(vp[i % sets], data[i % sets])],
                                reps)
            t_dec = gpu_time_us(lambda i: [p.decode(n) for p in vp[i % sets]], reps)
            sync()
            exact = all(torch.equal(p.out, bits) and int(p.status.abs().sum()) == 0
                        for p, (bits, _, _) in zip(vp[0], data[0]))
            same = True
            for p, w, p0 in zip(vp[0], want, pools[0]):
                fit = (p.entries >= 0) & (p0.entries >= 0)
                same &= bool(torch.equal((p0.entries >= 0), (p.entries >= 0)))
                same &= bool(torch.equal(p.slots[p.entries.long().clamp(min=0)][fit], w[fit]))
            out.append(dict(variant=name, encode_us=round(t_enc, 1), encode_of_floor=round(floors["enc"] / t_enc, 3),
                            decode_us=round(t_dec, 1), decode_of_floor=round(floors["dec"] / t_dec, 3),
                            roundtrip_exact=exact, slots_equal_default=same, setup_s=round(compile_s, 1)))
            vp = None                                         # free the pools before the next variant
        except Exception as exc:                              # report, keep going
            out.append(dict(variant=name, error=f"{type(exc).__name__}: {exc}"[:300]))
        log(f"variant {c}: {out[-1]}")
    # The decoder's copy path: every entry a raw tile holding the input (same bytes read as written).
    raw_entries = [(torch.arange(n, dtype=torch.int32, device=dev) - (1 << 31)).to(torch.int32) for _ in range(2)]
    for p, (bits, _, _) in zip(pools[0], data[0]):
        p.raw.copy_(bits)
        p.out.fill_(0)

    def dec_raw(i):
        for p, e in zip(pools[0], raw_entries):
            p.dec(e, p.out, p.status)

    t_raw = gpu_time_us(dec_raw, reps)
    sync()
    exact = all(torch.equal(p.out, bits) for p, (bits, _, _) in zip(pools[0], data[0]))
    copy_floor = 2 * 2 * n * L.TileGeometry(c).raw_bytes / (floors["copy_tbps"] * 1e6)
    out.append(dict(variant="raw-only decode (copy path)", decode_us=round(t_raw, 1), roundtrip_exact=exact,
                    decode_of_copy_floor=round(copy_floor / t_raw, 3)))
    log(f"variant {c}: {out[-1]}")
    return out


def bench_shape(heads, dim, args, dev, log):
    gen = torch.Generator(device=dev).manual_seed(heads * dim)
    c, tph = L.tile_channels(dim), L.tiles_per_head(dim)
    per_block = heads * tph
    tokens = L.BLOCK_TOKENS if args.sim else 65536
    n = tokens // L.BLOCK_TOKENS * per_block                      # tiles of one kind
    geo = L.TileGeometry(c)
    bytes_in = n * geo.raw_bytes
    sets = 1 if args.sim else max(2, math.ceil(3 * L2_BYTES / (2 * bytes_in)))  # rotate K+V sets over 3x L2
    row = dict(shape=f"{heads}x{dim}", tiles_per_kind=n, rotation_sets=sets)

    data = []
    for s in range(sets):
        kv = [synth_tiles(n, c, per_block, "kv", gen, dev) for _ in range(2)]
        data.append(kv)
    row["modes"] = [round(f, 4) for f in mode_fractions(*data[0][0])]
    # Capacity: calibrated on the synthetic K the way gaac.calibration chooses it.
    probe = Pools(n, c, geo.groups * L.ESCAPE_BYTES[L.MODE_RAW], data[0][0][1], data[0][0][2], dev)
    probe.encode(data[0][0][0])
    capacity = best_capacity(probe.used.cpu().numpy(), dim)
    del probe
    row["capacity"] = capacity
    pools = [[Pools(n, c, capacity, b3, b4, dev) for (_, b3, b4) in kv] for kv in data]

    # Bulk encode / decode of the 64K cache, K then V (2 launches), rotating over sets.
    def enc_all(i):
        for p, (bits, _, _) in zip(pools[i % sets], data[i % sets]):
            p.encode(bits)

    def dec_all(i):
        for p in pools[i % sets]:
            p.decode(n)

    reps = 1 if args.sim else 20
    t_enc = gpu_time_us(enc_all, reps)
    sync()
    spilled = sum(int((p.entries < 0).sum()) for p in pools[0])
    slot_bytes = geo.slot_bytes(capacity)
    written = sum(int((p.entries >= 0).sum()) * slot_bytes + int((p.entries < 0).sum()) * geo.raw_bytes
                  for p in pools[0]) + 2 * n * 8                # + entries and escape counts
    t_dec = gpu_time_us(dec_all, reps)
    sync()
    exact = all(torch.equal(p.out, bits) for p, (bits, _, _) in zip(pools[0], data[0]))
    exact = exact and all(int(p.status.abs().sum()) == 0 for p in pools[0])
    t_copy, copy_tbps = copy_bandwidth(data, reps)
    enc_floor = (2 * bytes_in + written) / (copy_tbps * 1e6)
    dec_floor = (written + 2 * bytes_in) / (copy_tbps * 1e6)
    row.update(roundtrip_exact=exact, spilled_tiles=spilled, copy_us=round(t_copy, 1), copy_tbps=round(copy_tbps, 2),
               encode_us=round(t_enc, 1), encode_gbps=round(2 * bytes_in / t_enc / 1e3, 1),
               encode_floor_us=round(enc_floor, 1), encode_of_floor=round(enc_floor / t_enc, 3),
               decode_us=round(t_dec, 1), decode_gbps=round(2 * bytes_in / t_dec / 1e3, 1),
               decode_floor_us=round(dec_floor, 1), decode_of_floor=round(dec_floor / t_dec, 3),
               resident_ratio=round(2 * bytes_in / written, 4))
    if torch.cuda.is_available():
        try:
            g_enc, g_dec = graph_time_us(enc_all, sets, reps), graph_time_us(dec_all, sets, reps)
            row["graph_bulk"] = dict(encode_us=round(g_enc, 1), encode_of_floor=round(enc_floor / g_enc, 3),
                                     decode_us=round(g_dec, 1), decode_of_floor=round(dec_floor / g_dec, 3))
        except Exception as exc:                              # report what happened, keep going
            row["graph_bulk"] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
            sync()
    log(f"bulk {heads}x{dim}: {row}")
    if args.variants:
        floors = dict(enc=enc_floor, dec=dec_floor, copy_tbps=copy_tbps)
        row["variants"] = bench_variants(n, c, capacity, data, pools, floors, args, dev, log)
        log(f"variants {heads}x{dim}: {row['variants']}")

    # One block: all KV heads of one layer, K and V (2 launches of per_block tiles).
    calls = 1 if args.sim else 2000
    blk = [Pools((calls + 8) * per_block, c, capacity, b3, b4, dev) for (_, b3, b4) in data[0]]
    one = [bits[:per_block].clone() for bits, _, _ in data[0]]
    ent = [torch.zeros(per_block, dtype=torch.int32, device=dev) for _ in range(2)]
    used = [torch.zeros(per_block, dtype=torch.int32, device=dev) for _ in range(2)]

    def block_pair(fast=True):
        for p, x, e, u in zip(blk, one, ent, used):
            p.enc(x, e, u, fast=fast)

    for fast in (True, False):
        for p in blk:
            p.heads.zero_()
        block_pair(fast)
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            block_pair(fast)
        host = (time.perf_counter() - t) / calls / 2 * 1e6
        sync()
        wall = (time.perf_counter() - t) / calls * 1e6
        row["host_us_per_launch_" + ("fast" if fast else "numba")] = round(host, 2)
        row["stream_us_per_block_" + ("fast" if fast else "numba")] = round(wall, 2)
    ok = True
    for p in blk:
        p.heads.zero_()
    row["block_kv_us_events"] = round(gpu_time_us(lambda i: block_pair(), 1 if args.sim else 200), 2)
    sync()
    ref = [ref_encode_tiles(x.cpu().numpy().view(np.uint16), b3.cpu().numpy(), b4.cpu().numpy(), capacity)
           for x, (_, b3, b4) in zip(one, data[0])]
    for p, r, e in zip(blk, ref, ent):
        p.heads.zero_()
    block_pair()
    sync()
    for p, r, e in zip(blk, ref, ent):
        idx = e.cpu().numpy().astype(np.int64)
        sl = p.slots.cpu().numpy()
        ok &= all((idx[t] >= 0) == r.fits[t] and (not r.fits[t] or (sl[idx[t]] == r.slots[t]).all())
                  for t in range(per_block))
    row["block_bytes_match_reference"] = bool(ok)

    # CUDA graph: capture the pair (and the free-list resets) through torch, replay.
    if torch.cuda.is_available():
        for fast in (True, False):
            key = "graph_" + ("fast" if fast else "numba")
            try:
                for p in blk:
                    p.heads.zero_()
                    p.slots.fill_(0)
                g = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    block_pair(fast)
                torch.cuda.current_stream().wait_stream(side)
                sync()
                with torch.cuda.graph(g):
                    for p in blk:
                        p.heads.zero_()
                    block_pair(fast)
                for p in blk:
                    p.slots.fill_(0)
                g.replay()
                sync()
                same = True
                for p, r, e in zip(blk, ref, ent):
                    idx = e.cpu().numpy().astype(np.int64)
                    sl = p.slots.cpu().numpy()
                    same &= all(not r.fits[t] or (sl[idx[t]] == r.slots[t]).all() for t in range(per_block))
                t_graph = gpu_time_us(lambda i: g.replay(), 200)
                sync()
                t = time.perf_counter()
                for _ in range(500):
                    g.replay()
                host_graph = (time.perf_counter() - t) / 500 * 1e6
                sync()
                row[key] = dict(captured=True, replay_correct=bool(same), replay_us_events=round(t_graph, 2),
                                replay_host_us=round(host_graph, 2))
            except Exception as exc:                     # report what happened, keep going
                row[key] = dict(captured=False, error=f"{type(exc).__name__}: {exc}"[:300])
                torch.cuda.synchronize()
    log(f"block {heads}x{dim}: {row}")
    return row


def dump_kernels(out, log):
    """PTX and SASS of the four default kernels into ``out/kernels.txt``; log the instruction counts."""
    import re

    from gaac.cuda.codec import decode_kernel, encode_kernel
    text = []
    for ch in (64, 128):
        for name, k in (("encode", encode_kernel(ch)), ("decode", decode_kernel(ch))):
            counts = {}
            for kind, fn in (("ptx", k.inspect_asm), ("sass", k.inspect_sass)):
                try:
                    code = "\n".join(fn().values())
                except Exception as exc:                      # nvdisasm may be missing: informative only
                    code = f"unavailable: {exc!r}"
                pattern = (r"^\s+[a-z@][\w.]*\s" if kind == "ptx" else        # instructions, not data or NOPs
                           r"^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?(?!NOP)[A-Z][A-Z0-9_.]*[ ;]")
                counts[kind] = len(re.findall(pattern, code, flags=re.M))
                text.append(f"===== {name} C={ch} {kind}\n{code}\n")
            log(f"{name} C={ch}: instructions {counts}")
    (out / "kernels.txt").write_text("".join(text))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--kv", default=".devdata/kv")
    ap.add_argument("--out", default=None)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--sim", action="store_true", help="dry run in numba's CUDA simulator, tiny sizes")
    ap.add_argument("--variants", action="store_true", help="with --bench: time the kernel variants too")
    ap.add_argument("--baseline", default=None, help="with --variants: an older gaac/cuda/codec.py to time")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.sim else "cuda")
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)
        if out:
            (out / "codec_gpu.log").write_text("\n".join(lines) + "\n")

    info = dict(device=torch.cuda.get_device_name() if not args.sim else "simulator", torch=torch.__version__,
                numpy=np.__version__)
    import numba_cuda
    info["numba_cuda"] = numba_cuda.__version__
    log(f"info {info}")
    t = time.perf_counter()
    from gaac.cuda.codec import decode_kernel, encode_kernel
    for ch in (64, 128):
        encode_kernel(ch), decode_kernel(ch)
    log(f"compile {time.perf_counter() - t:.1f} s")
    if not args.sim:
        for ch in (64, 128):
            for name, k in (("encode", encode_kernel(ch)), ("decode", decode_kernel(ch))):
                try:
                    log(f"{name} C={ch}: registers/thread {k.get_regs_per_thread()}, "
                        f"local bytes/thread {k.get_local_mem_per_thread()}")
                except Exception as exc:         # resource queries are informative only
                    log(f"{name} C={ch}: resource query failed: {exc!r}")
        if args.bench and out:
            dump_kernels(out, log)
    report = dict(info=info)
    if args.check:
        report["check"] = run_checks(args, dev, log)
    if args.bench:
        report["bench"] = [bench_shape(h, d, args, dev, log) for h, d in SHAPES]
    if out:
        (out / "codec_gpu.json").write_text(json.dumps(report, indent=1) + "\n")

    print("\n== summary ==")
    for r in report.get("check", []):
        print(f"check {r['data']:38s} tiles {r['tiles']:6d} elements {r['elements']:10d} ok {r['ok']}")
    for r in report.get("bench", []):
        print(f"{r['shape']:6s} modes {r['modes']} cap {r['capacity']} | enc {r['encode_us']} us "
              f"({r['encode_gbps']} GB/s, {r['encode_of_floor']:.0%} of floor) | dec {r['decode_us']} us "
              f"({r['decode_of_floor']:.0%}) | copy {r['copy_us']} us {r['copy_tbps']} TB/s | exact {r['roundtrip_exact']}")
        print(f"       block K+V {r['block_kv_us_events']} us events; host/launch fast "
              f"{r['host_us_per_launch_fast']} numba {r['host_us_per_launch_numba']} us; "
              f"graph {r.get('graph_fast')} | {r.get('graph_numba')}")
        print(f"       bulk from CUDA graphs: {r.get('graph_bulk')}")
        for v in r.get("variants", []):
            print(f"       variant {v}")


if __name__ == "__main__":
    main()
