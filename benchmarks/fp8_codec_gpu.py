"""Bit-exactness checks and throughput of the numba.cuda GAAC-FP8 kernels (gaac/fp8/cuda.py) on a GPU.

    python3 benchmarks/fp8_codec_gpu.py --check --bench --out results/fp8-codec-h200.md
    python3 benchmarks/fp8_codec_gpu.py --smoke --check --bench         # CPU, numba's CUDA simulator

``--check``  for E4M3 and E5M2: every layer, K and V, of every real KV dump in ``--data`` (BF16 bits
             ``[layers, kv_heads, tokens, head_dim]``) converted to FP8 as gaac/fp8/convert.py does (round to
             nearest even, saturating, one power-of-two scale per layer and kind) with a calibration made
             on the dump itself (gaac/calibration.py), plus four large synthetic mixes (KV-like, stress,
             all byte patterns, window edges): for EVERY tile the kernel's escape count, storage class and
             slot bytes (or raw copy) equal gaac/reference/codec.py's, run on the host CPU in parallel processes,
             and decode(encode(x)) == x on the device with status 0.
``--bench``  for each format, 64K tokens x 8 KV heads x head_dim 128, K and V (2 launches): bulk encode
             and decode, plain launches and replayed from CUDA graphs (medians of torch event times),
             against the floor (bytes read + written) / measured copy bandwidth.  The data is the real
             dumps' FP8 tiles (one layer, 64-channel heads paired into 128-channel ones, every dump's
             blocks) repeated up to 64K tokens, with that layer's calibration; inputs rotate over >= 3x L2.
``--smoke``  tiny shapes in numba's CUDA simulator (no GPU): the same code paths end to end.
``--out F``  the markdown result file (default: printed to stdout).

Progress goes to stderr-free stdout as it happens; the exit status is 1 when a check fails.
"""
from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if "--smoke" in sys.argv:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import torch  # noqa: E402

from benchmarks.report import commit  # noqa: E402
from benchmarks.timing import copy_bandwidth, gpu_time_us, graph_time_us, sync  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.calibration import best_capacity  # noqa: E402
from gaac.cuda import codec  # noqa: E402
from gaac.fp8 import cuda as fc  # noqa: E402
from gaac.fp8 import calibrate_fp8  # noqa: E402
from gaac.reference.codec import encode_tiles as ref_encode_tiles  # noqa: E402
from gaac.fp8.convert import cache_to_fp8  # noqa: E402
from gaac.layout import FP8_MODE_SETS as MODE_SETS, MODE_NARROW, MODE_RAW, MODE_WIDE  # noqa: E402
from gaac.tiles import block_tiles, cache_blocks, tile_bases  # noqa: E402

L2_BYTES = 60 * 2**20               # H200 L2 (50 MiB) with a margin
BENCH = dict(tokens=65536, heads=8, head_dim=128)
DATA_DIRS = (ROOT / ".devdata" / "kv", ROOT.parent / "shared" / "data" / "kv")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------
# Data

def find_dumps(data: str | None) -> list[tuple[str, Path, Path]]:
    """(name, K path, V path) of every ``*__k.npy`` with its ``__v.npy`` in ``data`` or the default folders."""
    dirs = [Path(data)] if data else list(DATA_DIRS)
    for d in dirs:
        ks = sorted(d.glob("*__k.npy")) if d.is_dir() else []
        pairs = [(k.name.split("__")[1] if k.name.count("__") >= 2 else k.stem, k,
                  k.with_name(k.name[:-len("k.npy")] + "v.npy")) for k in ks]
        pairs = [p for p in pairs if p[2].exists()]
        if pairs:
            log(f"real KV dumps in {d}: {', '.join(p[0] for p in pairs)}")
            return pairs
    log(f"no real KV dumps (*__k.npy with *__v.npy) in {' or '.join(map(str, dirs))}: real-data checks skipped, "
        "the benchmark uses synthetic KV-like tiles")
    return []


def load_bf16(path: Path, smoke: bool) -> np.ndarray:
    x = np.load(path)
    if x.dtype != np.uint16 or x.ndim != 4:
        raise SystemExit(f"{path}: expected uint16 BF16 bits [layers, kv_heads, tokens, head_dim], "
                         f"got {x.dtype} {list(x.shape)}")
    return x[:2, :, :32] if smoke else x


def synth_tiles(n, channels, rows, mix, ms, gen, dev):
    """``n`` FP8 tiles ``uint8[n, 16, C]`` and per-row bases ``[rows, C]`` (tile i uses row i % rows).

    ``kv``: exponents in the narrow window, some just above it (wide), a few far (raw); ``stress``:
    many wide and raw groups; ``uniform``: all 256 byte patterns; ``edges``: bases at 0 or at the top,
    exponents at both ends of the field (zeros, subnormals, NaN/Inf), sign and mantissa random.
    """
    fmt = ms.fmt
    r = lambda lo, hi, shape: torch.randint(lo, hi, shape, generator=gen, device=dev)  # noqa: E731
    shape = (n, L.BLOCK_TOKENS, channels)
    qw, qr = dict(kv=(0.012, 0.0004), stress=(0.06, 0.01), uniform=(0, 0), edges=(0.05, 0.02))[mix]
    bn = r(0, ms.narrow_base_max + 1, (rows, channels))
    if mix == "edges":
        bn = (bn % 2) * ms.narrow_base_max
    bw = (bn - r(0, ms.wide_window - ms.narrow_window + 1, (rows, channels))).clamp(0, ms.wide_base_max)
    idx = torch.arange(n, device=dev) % rows
    tn, tw = bn[idx][:, None, :], bw[idx][:, None, :]
    e = tn + r(0, ms.narrow_window, shape)
    u = torch.rand(shape, generator=gen, device=dev)
    e = torch.where(u < qw, tw + r(0, ms.wide_window, shape), e)
    far = torch.where(tn > fmt.max_exponent_field // 2, 0, fmt.max_exponent_field)
    e = torch.where(u > 1 - qr, far, e).clamp(0, fmt.max_exponent_field)
    sm = r(0, 256, shape)
    bits = (sm & 0x80) | (e << fmt.mantissa_bits) | (sm & ((1 << fmt.mantissa_bits) - 1))
    if mix == "uniform":
        bits = r(0, 256, shape)
        bw = r(0, ms.wide_base_max + 1, (rows, channels))
    return bits.to(torch.uint8), bn.to(torch.uint8), bw.to(torch.uint8)


def mode_fractions(tiles: np.ndarray, bn: np.ndarray, bw: np.ndarray, ms) -> list[float]:
    """Fractions of narrow / wide / raw groups (reference codec on the host; ``bn``, ``bw`` per tile)."""
    modes = ref_encode_tiles(tiles, bn, bw, 0, ms).modes
    return [round(float((modes == m).mean()), 4) for m in (MODE_NARROW, MODE_WIDE, MODE_RAW)]


class Pools:
    """``n`` slots and ``n`` raw tiles, an encode/decode plan pair and the per-call outputs, on ``dev``."""

    def __init__(self, ms, n, channels, capacity, bn, bw, dev):
        geo = ms.geometry(channels)
        z = lambda shape, dt: torch.zeros(shape, dtype=dt, device=dev)  # noqa: E731
        self.slots = z((n, geo.slot_bytes(capacity)), torch.uint8)
        self.raw = z((n, L.BLOCK_TOKENS, channels), torch.uint8)
        self.heads = z((2,), torch.int32)
        free = torch.arange(n, dtype=torch.int32, device=dev)
        bases = codec.pack_bases(bn, bw, ms)
        self.enc = codec.EncodePlan(channels, capacity, bases, self.slots, free, self.raw, free.clone(), self.heads,
                                    fmt=ms)
        self.dec = codec.DecodePlan(channels, capacity, bases, self.slots, self.raw, fmt=ms)
        self.entries, self.used, self.status = z((n,), torch.int32), z((n,), torch.int32), z((n,), torch.int32)
        self.out = z((n, L.BLOCK_TOKENS, channels), torch.uint8)

    def encode(self, bits):
        self.heads.zero_()
        self.enc(bits, self.entries, self.used)

    def decode(self):
        self.dec(self.entries, self.out, self.status)


# ------------------------------------------------------------------------------------------------
# Checks

_WORK = {}


def _ref_chunk(lo, hi):
    """Compare tiles lo..hi of the job in _WORK (inherited by fork) with the reference: mismatch counts."""
    w = _WORK
    rows = np.arange(lo, hi) % w["bn"].shape[0]
    tiles = w["tiles"][lo:hi]
    ref = ref_encode_tiles(tiles, w["bn"][rows], w["bw"][rows], w["capacity"], w["ms"])
    entries = w["entries"][lo:hi].astype(np.int64)
    index = entries & L.TABLE_INDEX_MASK
    fit = ref.fits & (entries >= 0)
    spill = ~ref.fits & (entries < 0)
    return (int((ref.escape_used != w["used"][lo:hi]).sum()), int(((entries >= 0) != ref.fits).sum()),
            int((w["slots"][index[fit]] != ref.slots[fit]).any(axis=1).sum()),
            int((w["raw"][index[spill]] != tiles[spill]).any(axis=(1, 2)).sum()), int(ref.fits.sum()))


def check_tiles(ms, tiles, bn, bw, capacity, dev, workers) -> dict:
    """Encode ``tiles`` (host uint8 [n,16,C]; bases [P,C], tile i row i % P) on the device, decode them
    there, and compare every tile with the reference codec on the host."""
    n, _, c = tiles.shape
    p = Pools(ms, n, c, capacity, torch.from_numpy(bn).to(dev), torch.from_numpy(bw).to(dev), dev)
    p.slots.fill_(0xA5)
    x = torch.from_numpy(np.ascontiguousarray(tiles)).to(dev)
    p.encode(x)
    p.decode()
    exact = bool(torch.equal(p.out, x)) and int(p.status.abs().sum()) == 0
    entries = p.entries.cpu().numpy()
    _WORK.update(ms=ms, tiles=tiles, bn=bn, bw=bw, capacity=capacity, entries=entries, used=p.used.cpu().numpy(),
                 slots=p.slots.cpu().numpy(), raw=p.raw.cpu().numpy())
    step = max(256, -(-n // (4 * workers)))
    chunks = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    if workers > 1 and len(chunks) > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
            parts = list(ex.map(_ref_chunk, *zip(*chunks)))
    else:
        parts = [_ref_chunk(lo, hi) for lo, hi in chunks]
    bad = [sum(x[i] for x in parts) for i in range(4)]
    fits = sum(x[4] for x in parts)
    index = entries.astype(np.int64) & L.TABLE_INDEX_MASK
    distinct = all(len(np.unique(index[m])) == int(m.sum()) for m in (entries >= 0, entries < 0))
    heads = p.heads.tolist()
    ok = exact and not any(bad) and distinct and heads == [fits, n - fits]
    return dict(tiles=n, elements=int(tiles.size), slot_tiles=fits, raw_tiles=n - fits, escapes=bad[0],
                storage=bad[1], slots=bad[2], raw=bad[3], decode_exact=exact, ok=ok)


def add(total: dict | None, r: dict) -> dict:
    if total is None:
        return dict(r)
    out = {k: total[k] + r[k] for k in ("tiles", "elements", "slot_tiles", "raw_tiles", "escapes", "storage",
                                        "slots", "raw")}
    out.update(decode_exact=total["decode_exact"] and r["decode_exact"], ok=total["ok"] and r["ok"])
    return out


def run_checks(args, dumps, dev) -> list[dict]:
    rows = []
    gen = torch.Generator(device=dev).manual_seed(1234)
    for fmt, ms in MODE_SETS.items():
        for name, kpath, vpath in dumps:
            t = time.perf_counter()
            k, v = load_bf16(kpath, args.smoke), load_bf16(vpath, args.smoke)
            cal = calibrate_fp8(k, v, fmt)
            total = None
            for kind, x in ((L.KIND_K, k), (L.KIND_V, v)):
                fp8 = cache_to_fp8(x, ms.fmt, cal.scale_log2[kind])
                for layer in range(x.shape[0]):
                    bn, bw = tile_bases(*cal.bases(layer, kind))
                    tiles = block_tiles(cache_blocks(fp8[layer]))
                    if len(tiles) == 0:
                        continue
                    r = check_tiles(ms, tiles, bn.astype(np.uint8), bw.astype(np.uint8),
                                    int(cal.capacity[kind, layer]), dev, 1)
                    total = add(total, r)
            if total is None:
                log(f"check {fmt} real {name}: no complete 16-token block, skipped")
                continue
            rows.append(dict(format=fmt, data=f"real {name}, {k.shape[0]} layers x K+V, self-calibrated", **total,
                             seconds=round(time.perf_counter() - t, 1)))
            log(f"check {fmt} real {name}: {rows[-1]}")
        sizes = dict(kv=(16384, 128), stress=(8192, 128), uniform=(8192, 64), edges=(8192, 64))
        for mix, (n, c) in sizes.items():
            if args.smoke:
                n = 3
            t = time.perf_counter()
            bits, bn, bw = synth_tiles(n, c, 8, mix, ms, gen, dev)
            probe = Pools(ms, n, c, ms.geometry(c).max_escapes, bn, bw, dev)
            probe.encode(bits)
            used = probe.used.cpu().numpy()
            del probe
            capacity = (int(np.quantile(used, 0.9)) if mix != "uniform" else int(used.min())) // 16 * 16
            tiles, bnh, bwh = bits.cpu().numpy(), bn.cpu().numpy(), bw.cpu().numpy()
            r = check_tiles(ms, tiles, bnh, bwh, capacity, dev, args.workers)
            rows.append(dict(format=fmt, data=f"synthetic {mix}, C={c}, capacity {capacity}", **r,
                             seconds=round(time.perf_counter() - t, 1)))
            log(f"check {fmt} synthetic {mix}: {rows[-1]}")
    return rows


# ------------------------------------------------------------------------------------------------
# Throughput

def bench_data(ms, dumps, args, dev):
    """K and V FP8 tiles ``[n, 16, 128]`` (n = tokens/16 x heads) with per-block bases ``[heads, 128]`` and
    capacities: one real layer, 64-channel heads paired into 128-channel heads, every dump's blocks
    repeated; synthetic KV-like tiles without real dumps."""
    heads, c = BENCH["heads"], BENCH["head_dim"]
    tokens = L.BLOCK_TOKENS if args.smoke else BENCH["tokens"]
    n = tokens // L.BLOCK_TOKENS * heads
    if not dumps:
        gen = torch.Generator(device=dev).manual_seed(7)
        out = []
        for _ in range(2):
            bits, bn, bw = synth_tiles(n, c, heads, "kv", ms, gen, dev)
            out.append((bits, bn, bw))
        return out, "synthetic KV-like tiles (no real dumps found)"
    kv = [[load_bf16(p, args.smoke) for p in (kp, vp)] for _, kp, vp in dumps]
    k = np.concatenate([x[0] for x in kv], axis=2)
    v = np.concatenate([x[1] for x in kv], axis=2)
    layer = args.layer if args.layer is not None else k.shape[0] // 2
    cal = calibrate_fp8(k, v, ms.fmt.name)
    out = []
    for kind, x in ((L.KIND_K, k), (L.KIND_V, v)):
        fp8 = cache_to_fp8(x[layer:layer + 1], ms.fmt, cal.scale_log2[kind, layer:layer + 1])[0]
        bn, bw = cal.bases(layer, kind)
        src_heads, dim = fp8.shape[0], fp8.shape[2]
        per = c // dim                                  # source heads side by side in one 128-channel head
        pick = [[(h * per + i) % src_heads for i in range(per)] for h in range(heads)]
        wide = np.stack([np.concatenate([fp8[i] for i in p], axis=-1) for p in pick])     # [heads, T, 128]
        bnw = np.stack([np.concatenate([bn[i] for i in p]) for p in pick]).astype(np.uint8)
        bww = np.stack([np.concatenate([bw[i] for i in p]) for p in pick]).astype(np.uint8)
        blocks = cache_blocks(wide)                                                       # [B, heads, 16, 128]
        reps = -(-(tokens // L.BLOCK_TOKENS) // len(blocks))
        blocks = np.concatenate([blocks] * reps)[: tokens // L.BLOCK_TOKENS]
        out.append((torch.from_numpy(block_tiles(blocks)).to(dev), torch.from_numpy(bnw).to(dev),
                    torch.from_numpy(bww).to(dev)))
    what = (f"real FP8 tiles of layer {layer} ({len(dumps)} dumps, {src_heads}x{dim} heads paired into "
            f"{heads}x{c}), repeated to {tokens} tokens; calibrated on all dumps")
    return out, what


def bench_format(ms, dumps, args, dev) -> dict:
    c = BENCH["head_dim"]
    geo = ms.geometry(c)
    data0, what = bench_data(ms, dumps, args, dev)
    n = data0[0][0].shape[0]
    bytes_in = n * geo.raw_bytes                            # FP8 bytes of one kind
    sets = 1 if args.smoke else max(2, math.ceil(3 * L2_BYTES / (2 * bytes_in)))
    # Capacity per kind as the calibration chooses it for this data: the one minimising resident bytes.
    caps = []
    for bits, bn, bw in data0:
        probe = Pools(ms, n, c, geo.max_escapes, bn, bw, dev)
        probe.encode(bits)
        caps.append(best_capacity(probe.used.cpu().numpy(), geo))
        del probe
    data = [data0] + [[(bits.clone(), bn, bw) for bits, bn, bw in data0] for _ in range(sets - 1)]
    pools = [[Pools(ms, n, c, cap, bn, bw, dev) for cap, (_, bn, bw) in zip(caps, kv)] for kv in data]
    sample = data0[0][0][: min(n, 4096)].cpu().numpy()
    rows_b = np.arange(len(sample)) % data0[0][1].shape[0]
    fr = mode_fractions(sample, data0[0][1].cpu().numpy()[rows_b], data0[0][2].cpu().numpy()[rows_b], ms)

    def enc_all(i):
        for p, (bits, _, _) in zip(pools[i % sets], data[i % sets]):
            p.encode(bits)

    def dec_all(i):
        for p in pools[i % sets]:
            p.decode()

    reps = 1 if args.smoke else 30
    t_enc = gpu_time_us(enc_all, reps)
    sync()
    t_dec = gpu_time_us(dec_all, reps)
    sync()
    exact = all(torch.equal(p.out, bits) and int(p.status.abs().sum()) == 0
                for s in range(sets) for p, (bits, _, _) in zip(pools[s], data[s]))
    spilled = sum(int((p.entries < 0).sum()) for p in pools[0])
    written = sum(int((p.entries >= 0).sum()) * geo.slot_bytes(cap) + int((p.entries < 0).sum()) * geo.raw_bytes
                  for p, cap in zip(pools[0], caps)) + 2 * n * 8   # + entries and escape counts
    t_copy, copy_tbps = copy_bandwidth(data, reps)
    enc_floor = (2 * bytes_in + written) / (copy_tbps * 1e6)
    dec_floor = (written + 2 * bytes_in) / (copy_tbps * 1e6)
    row = dict(format=ms.fmt.name, data=what, tokens=n // BENCH["heads"] * L.BLOCK_TOKENS, tiles_per_kind=n,
               rotation_sets=sets, modes=fr, capacity=caps,
               spilled_tiles=spilled, resident_ratio=round(2 * bytes_in / written, 4), roundtrip_exact=exact,
               copy_us=round(t_copy, 1), copy_tbps=round(copy_tbps, 2),
               encode_us=round(t_enc, 1), encode_floor_us=round(enc_floor, 1),
               decode_us=round(t_dec, 1), decode_floor_us=round(dec_floor, 1))
    if torch.cuda.is_available():
        try:
            g_enc, g_dec = graph_time_us(enc_all, sets, reps), graph_time_us(dec_all, sets, reps)
            row.update(graph_encode_us=round(g_enc, 1), graph_decode_us=round(g_dec, 1))
            exact = all(torch.equal(p.out, bits) for p, (bits, _, _) in zip(pools[0], data[0]))
            row["roundtrip_exact"] = row["roundtrip_exact"] and exact
        except Exception as exc:                                 # report what happened, keep going
            row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            sync()
    best_enc, best_dec = row.get("graph_encode_us", t_enc), row.get("graph_decode_us", t_dec)
    row.update(encode_gbps=round(2 * bytes_in / best_enc / 1e3, 1), encode_of_floor=round(enc_floor / best_enc, 3),
               decode_gbps=round(2 * bytes_in / best_dec / 1e3, 1), decode_of_floor=round(dec_floor / best_dec, 3))
    log(f"bench {ms.fmt.name}: {row}")
    return row


# ------------------------------------------------------------------------------------------------
# Report

def markdown(info: dict, checks: list[dict], bench: list[dict]) -> str:
    lines = [f"# GAAC-FP8 CUDA codec: {info['device']}", "",
             f"- date: {info['date']}", f"- commit: {info['commit']}", f"- command: `{info['command']}`",
             f"- versions: {info['versions']}", f"- kernel compile: {info['compile_s']} s", ""]
    if checks:
        ok = all(r["ok"] for r in checks)
        lines += ["## Bit-exactness against gaac/reference/codec.py", "",
                  f"**{'all checks passed' if ok else 'CHECK FAILED'}**: for every tile, escape count, storage class "
                  "and slot bytes (or raw tile) equal the reference's, and the device decode gives the FP8 bits back.",
                  "", "| format | data | tiles | elements | slot / raw tiles "
                  "| mismatched escapes / class / slots / raw | decode exact | ok |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in checks:
            lines.append(f"| {r['format']} | {r['data']} | {r['tiles']} | {r['elements']} | {r['slot_tiles']} / "
                         f"{r['raw_tiles']} | {r['escapes']} / {r['storage']} / {r['slots']} / {r['raw']} | "
                         f"{r['decode_exact']} | {r['ok']} |")
        lines.append("")
    if bench:
        b0 = bench[0]
        lines += [f"## Throughput: {b0['tokens']} tokens x {BENCH['heads']} KV heads x {BENCH['head_dim']}, "
                  "K + V (2 launches)", "", f"Data: {b0['data']}.", "",
                  "Times are medians of torch CUDA events; 'graph' = replayed from CUDA graphs (no host launch cost), "
                  "used for GB/s and % of floor when available. Floor = (bytes read + written) / measured copy "
                  "bandwidth; GB/s counts FP8 input bytes.", "",
                  "| format | groups narrow / wide / raw (K sample) | capacity K / V | raw tiles | resident ratio "
                  "| encode us (plain / graph) | encode GB/s | encode % floor "
                  "| decode us (plain / graph) | decode GB/s | decode % floor | copy TB/s | exact |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in bench:
            fr = " / ".join(f"{100 * f:.1f}%" for f in r["modes"])
            caps = " / ".join(map(str, r["capacity"]))
            lines.append(f"| {r['format']} | {fr} | {caps} | {r['spilled_tiles']} of {2 * r['tiles_per_kind']}"
                         f" | {r['resident_ratio']} | {r['encode_us']} / {r.get('graph_encode_us', '-')} | "
                         f"{r['encode_gbps']} | {100 * r['encode_of_floor']:.0f}% | {r['decode_us']} / "
                         f"{r.get('graph_decode_us', '-')} | {r['decode_gbps']} | {100 * r['decode_of_floor']:.0f}% | "
                         f"{r['copy_tbps']} | {r['roundtrip_exact']} |")
            if "graph_error" in r:
                lines.append(f"\nCUDA graph capture failed for {r['format']}: `{r['graph_error']}`\n")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="bit-exactness against the reference codec")
    ap.add_argument("--bench", action="store_true", help="encode/decode throughput at 64K x 8 x 128")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in numba's CUDA simulator (no GPU needed)")
    ap.add_argument("--data", default=None,
                    help="folder of real KV dumps (default .devdata/kv, then ../shared/data/kv)")
    ap.add_argument("--out", default=None, help="markdown result file (default: stdout)")
    ap.add_argument("--layer", type=int, default=None, help="--bench: the real layer to tile up (default: middle)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args()
    if not (args.check or args.bench):
        ap.error("nothing to do: give --check and/or --bench")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch; run with --smoke for the CPU simulator")
    dev = torch.device("cuda" if not args.smoke else "cpu")

    import numba
    import numba_cuda
    info = dict(device=torch.cuda.get_device_name() if not args.smoke else "numba CUDA simulator (--smoke)",
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit(),
                command="python3 " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}"] + sys.argv[1:]),
                versions=f"Python {platform.python_version()}, torch {torch.__version__}, numba {numba.__version__}, "
                         f"numba-cuda {numba_cuda.__version__}, numpy {np.__version__}")
    log(f"{info['device']}; {info['versions']}; commit {info['commit']}")
    t = time.perf_counter()
    for ms in MODE_SETS.values():
        for ch in (64, 128):
            fc.encode_kernel(ms, ch), fc.decode_kernel(ms, ch)
    info["compile_s"] = round(time.perf_counter() - t, 1)
    log(f"kernels built in {info['compile_s']} s (compiled on first launch)")
    dumps = find_dumps(args.data)

    checks = run_checks(args, dumps, dev) if args.check else []
    bench = [bench_format(ms, dumps, args, dev) for ms in MODE_SETS.values()] if args.bench else []
    text = markdown(info, checks, bench)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        log(f"wrote {args.out}")
    else:
        print(text)
    failed = [r for r in checks if not r["ok"]] + [r for r in bench if not r["roundtrip_exact"]]
    if failed:
        log(f"FAILED: {len(failed)} check(s) or round trip(s); see the table")
        return 1
    log("all checks passed" if checks else "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
