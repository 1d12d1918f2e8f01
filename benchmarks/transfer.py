"""Moving a compressed sequence: export + import of one sequence of a paged cache against a plain copy of its bytes.

    python benchmarks/transfer.py --out benchmarks/results/transfer-h200.md            # H200: 64K tokens, Llama-3.1-8B
    python benchmarks/transfer.py --small --out /tmp/transfer-cpu.md                   # CPU: a small shape, minutes

One sequence of ``--tokens`` (65536) tokens of the Llama-3.1-8B KV shape (32 layers, 8 KV heads of 128) lives in
a ``gaac.PagedKVCache`` on the GPU, prefilled with the CUDA codec from real K/V: the SmolLM2-135M dumps (the
1344 real tokens of ``../shared/data/kv``, two real 64-wide heads side by side per 128-wide head, tiled to the
context, as ``benchmarks/decode_step.py`` builds them; ``--synthetic`` or no dumps: random BF16 with per-channel
exponent spreads).  Calibration epochs are off (the calibration saw the content; epochs add only a few hundred
bytes of bases to a container).

Timed, in one process, each after warm-up, medians of ``--repeats`` (CUDA events around each call, which
synchronises before it returns; wall clock on the CPU):

* ``export``: ``cache.export_sequence(seq, out=pinned)``: the gathers into a device buffer and the chunk CRCs,
  piece by piece, each piece copied into a preallocated pinned buffer while the next is gathered, the head;
* ``import``: ``target.import_sequence(data)`` from that pinned buffer into a second cache with room: the head
  checks, the pieces copied to the device while the one before has its chunk CRCs and block tables checked and
  is scattered into the pools, one wait for the verdict, the tables, epochs and tails (the sequence is removed
  again between repeats, outside the timing);
* ``d2h`` / ``h2d``: ``Tensor.copy_`` of as many bytes as the container between a device buffer and a pinned
  host buffer: what moving those bytes costs at the least.

The report gives each as GB/s of container bytes and as a fraction of the plain copy in the same direction
(the target: export and import each at 80% or more of the device-to-host copy bandwidth), the round trip
against a copy there and back, and what moving the BF16 cache (1.39x more bytes) at the copy bandwidth would
take.  The imported sequence is checked once, bit for bit (a re-export gives the same bytes).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import gaac  # noqa: E402
from benchmarks.real_kv import tile_heads  # noqa: E402
from benchmarks.report import commit_with_changes, table, write  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac import transfer  # noqa: E402
from gaac.capture import package_version  # noqa: E402

MODEL = "smollm2-135m-instruct-q4_1"
PROMPTS = ("prose", "code", "math", "list")
GB = 1e9


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def find_data(arg: str | None) -> Path | None:
    for c in ([Path(arg)] if arg else [ROOT / ".devdata" / "kv", ROOT.parent / "shared" / "data" / "kv"]):
        if (c / f"{MODEL}__prose__k.npy").is_file():
            return c
    return None


def real_unique(data: Path, layers: int, heads: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """uint16 ``[layers, heads, 1344, dim]`` K and V: each (layer, head) the channels of ``dim / 64`` real
    (layer, head) slices of the four SmolLM2 prompts side by side (as benchmarks/decode_step.py)."""
    return tuple(tile_heads(np.concatenate([np.load(data / f"{MODEL}__{p}__{w}.npy") for p in PROMPTS], axis=2),
                            layers, heads, dim) for w in "kv")


def synthetic_unique(layers: int, heads: int, dim: int, tokens: int = 1344, seed: int = 0):
    """Random BF16 bits whose exponents scatter around per-channel centres, as real K/V do."""
    rng = np.random.default_rng(seed)
    out = []
    for spread in (1.6, 1.2):
        centres = rng.integers(112, 128, size=(layers, heads, 1, dim))
        e = np.clip(np.rint(centres + rng.normal(0, spread, (layers, heads, tokens, dim))), 0, 255).astype(np.uint16)
        sm = rng.integers(0, 256, size=e.shape, dtype=np.uint16)
        out.append(((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F))
    return out[0], out[1]


def build_cache(cal, k_u, v_u, tokens: int, device: str):
    """A cache holding one sequence of ``tokens`` tokens tiled from the unique ones, and an empty twin with the
    same pools (the import target)."""
    layers, heads, unique, dim = k_u.shape
    nblk = tokens // L.BLOCK_TOKENS
    tiles = max(1, nblk * heads * L.tiles_per_head(dim))
    caches = [gaac.PagedKVCache(cal, max_blocks=max(1, nblk), slots=tiles, raw_tiles=tiles // 4 + 64,
                                device=device, grow=True, adapt=False) for _ in range(2)]
    cache = caches[0]
    seq = cache.add_sequence()
    idx = torch.arange(tokens, device=device) % unique
    ku = torch.from_numpy(k_u.view(np.int16)).to(device)
    vu = torch.from_numpy(v_u.view(np.int16)).to(device)
    t0 = time.time()
    for layer in range(layers):
        cache.update_layer(layer, [seq], ku[layer].index_select(1, idx)[None], vu[layer].index_select(1, idx)[None])
    sync(device)
    log(f"prefilled {tokens} tokens x {layers} layers in {time.time() - t0:.1f} s")
    return cache, seq, caches[1]


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int, warmup: int, device: str, between=None) -> dict:
    """Median and spread of ``fn()``'s time in ms: CUDA events on a GPU, the wall clock on the CPU.
    ``between()`` runs after each call, outside the timing."""
    times = []
    for i in range(warmup + repeats):
        sync(device)
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t) * 1e3
        if between is not None:
            between()
        if i >= warmup:
            times.append(ms)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "n": len(times)}


def render(rep: dict) -> str:
    r = rep["result"] if "result" in rep else None
    lines = [f"# Moving one compressed sequence: export + import vs a plain copy ({rep['device']})", "",
             f"{rep['date']}, commit {rep['commit']}, torch {rep['torch']}, numba-cuda {rep['numba_cuda']}; "
             f"`{rep['command']}`", "",
             f"One sequence of {rep['tokens']} tokens, {rep['layers']} layers x {rep['kv_heads']} KV heads x "
             f"head_dim {rep['head_dim']} ({rep['data']}), in a `gaac.PagedKVCache` on {rep['device']}; "
             f"{rep['repeats']} timed repeats after {rep['warmup']} warm-up, medians "
             f"({'CUDA events' if rep['cuda'] else 'wall clock'}).", ""]
    if r is None:
        return "\n".join(lines + ["(no result yet)", ""])
    lines += table(["bytes", "value"], [
        ("BF16 K+V of the sequence", f"{r['bf16_bytes']:,}"),
        ("resident in the cache (`memory().resident_bytes`)", f"{r['resident_bytes']:,}"),
        ("container (`export_sequence`)", f"{r['container_bytes']:,} ({r['bf16_bytes'] / r['container_bytes']:.3f}x"
                                          " smaller than BF16)"),
    ])
    lines.append("")
    rows = []
    for name, what in (("export", "export_sequence into pinned memory"), ("import", "import_sequence from pinned"),
                       ("d2h", "plain device-to-host copy, same bytes"), ("h2d", "plain host-to-device copy")):
        t = r[name]
        rows.append((name, what, f"{t['median_ms']:.2f}", f"{t['min_ms']:.2f}-{t['max_ms']:.2f}",
                     f"{r['container_bytes'] / t['median_ms'] / 1e6:.1f}"))
    lines += table(["step", "what", "median ms", "range ms", "GB/s (container bytes)"], rows)
    lines += ["", *table(["measure", "value", "target"], [
        ("export / d2h bandwidth", f"{r['export_vs_d2h']:.3f}", ">= 0.80"),
        ("import / d2h bandwidth", f"{r['import_vs_d2h']:.3f}", ">= 0.80"),
        ("import / h2d bandwidth", f"{r['import_vs_h2d']:.3f}", ""),
        ("round trip (export + import) / (d2h + h2d)", f"{r['round_trip_vs_copies']:.3f}", ""),
        ("export time / BF16 bytes at the d2h bandwidth", f"{r['export_vs_bf16_copy']:.3f}",
         "below 1: moving the sequence compressed beats copying it as BF16"),
        ("re-export of the imported sequence: same bytes", "yes" if r["bit_exact"] else "NO", "yes"),
    ])]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="markdown results (a .json beside it)")
    ap.add_argument("--small", action="store_true", help="a small shape on the CPU (or the GPU with --device)")
    ap.add_argument("--device", default=None, help="torch device (default cuda, or cpu with --small)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens of the sequence (default 65536; --small 2048)")
    ap.add_argument("--layers", type=int, default=None, help="default 32 (--small 4)")
    ap.add_argument("--kv-heads", type=int, default=None, help="default 8 (--small 2)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 20; --small 3)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--data", default=None, help="SmolLM2 K/V dumps (default .devdata/kv, then ../shared/data/kv)")
    ap.add_argument("--synthetic", action="store_true", help="random BF16 instead of the real dumps")
    args = ap.parse_args()
    device = args.device or ("cpu" if args.small else "cuda")
    tokens = args.tokens or (2048 if args.small else 65536)
    layers = args.layers or (4 if args.small else 32)
    heads = args.kv_heads or (2 if args.small else 8)
    repeats = args.repeats or (3 if args.small else 20)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --small for a CPU run)")
    data = None if args.synthetic else find_data(args.data)
    if data is not None:
        k_u, v_u = real_unique(data, layers, heads, args.head_dim)
        source = f"real SmolLM2 K/V from {data}, tiled"
    else:
        k_u, v_u = synthetic_unique(layers, heads, args.head_dim)
        source = "synthetic BF16"
    cal = gaac.calibrate(k_u, v_u, model="llama-3.1-8b-shape", show_progress=False)
    cache, seq, target = build_cache(cal, k_u, v_u, tokens, device)
    m = cache.memory()
    size = transfer.exported_layout(cache, seq).nbytes
    cuda = device == "cuda"
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    rep = {"device": torch.cuda.get_device_name() if cuda else "CPU", "cuda": cuda,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit_with_changes("benchmarks/transfer.py"),
           "torch": torch.__version__, "numba_cuda": package_version("numba-cuda"),
           "command": " ".join(["python benchmarks/transfer.py", *sys.argv[1:]]), "tokens": tokens,
           "layers": layers, "kv_heads": heads, "head_dim": args.head_dim, "data": source, "repeats": repeats,
           "warmup": args.warmup}
    write(rep, args.out, render)

    holder = {}

    def export():
        holder["data"] = cache.export_sequence(seq, out=pinned)

    def do_import():
        holder["seq"] = target.import_sequence(holder["data"])

    t_export = timed(export, repeats, args.warmup, device)
    log(f"export: {t_export['median_ms']:.2f} ms for {size:,} bytes")
    t_import = timed(do_import, repeats, args.warmup, device, between=lambda: target.remove_sequence(holder["seq"]))
    log(f"import: {t_import['median_ms']:.2f} ms")
    do_import()
    again = bytes(target.export_sequence(holder["seq"]))
    exact = again == bytes(holder["data"])
    dev_buf = torch.empty(size, dtype=torch.uint8, device=device)
    host_buf = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    t_d2h = timed(lambda: host_buf.copy_(dev_buf, non_blocking=True), repeats, args.warmup, device)
    t_h2d = timed(lambda: dev_buf.copy_(host_buf, non_blocking=True), repeats, args.warmup, device)
    bw = {name: size / t["median_ms"] for name, t in (("export", t_export), ("import", t_import), ("d2h", t_d2h),
                                                       ("h2d", t_h2d))}
    rep["result"] = {
        "bf16_bytes": m.bf16_bytes, "resident_bytes": m.resident_bytes, "container_bytes": size,
        "export": t_export, "import": t_import, "d2h": t_d2h, "h2d": t_h2d,
        "export_vs_d2h": bw["export"] / bw["d2h"], "import_vs_d2h": bw["import"] / bw["d2h"],
        "import_vs_h2d": bw["import"] / bw["h2d"],
        "round_trip_vs_copies": (t_d2h["median_ms"] + t_h2d["median_ms"]) / (t_export["median_ms"]
                                                                             + t_import["median_ms"]),
        "export_vs_bf16_copy": t_export["median_ms"] / (m.bf16_bytes / bw["d2h"]),
        "bit_exact": exact,
    }
    write(rep, args.out, render)
    log(render(rep))
    if not exact:
        raise SystemExit("the imported sequence does not re-export to the same bytes")


if __name__ == "__main__":
    main()
