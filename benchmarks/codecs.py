"""Side-by-side comparison of lossless codecs on real BF16 K/V caches (issue 7).

Benchmark-only dependencies, deliberately not dependencies of the gaac package:

    pip install zstandard lz4 zipnn                 # the CPU codecs
    pip install nvidia-nvcomp-cu13 torch matplotlib  # GPU mode (nvCOMP on a CUDA machine) and the plot

Every codec runs on the same real K/V (``../shared/data/kv``: SmolLM2-135M, four
prompts, K and V) and on any capture passed with ``--capture K V``; every
encoded stream is decoded and compared bit for bit before a number is kept.
For each codec it reports the compression ratio (BF16 bytes / compressed
bytes, everything the decoder needs counted), encode and decode throughput
(BF16 GB/s, medians) and whether the format can be decoded piecewise inside
attention, with the reason.

    python benchmarks/codecs.py cpu      # GAAC reference, SplitZip-style, zstd, lz4, ZipNN -> results/codecs-cpu.md
    python benchmarks/codecs.py pack DIR # the K/V as small files, to carry to a GPU machine
    python benchmarks/codecs.py gpu --packed DIR   # nvCOMP on the GPU (CUDA events) -> results/codecs-h200.md
    python benchmarks/codecs.py report   # both files -> results/codecs-summary.md and results/codecs.png

Each results file ends with its records as JSON, so ``report`` can merge
measurements taken on different machines.
"""
from __future__ import annotations

import argparse
import datetime
import json
import lzma
import os
import platform
import re
import statistics
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))            # run as a script from a checkout: gaac is the repo's own
from benchmarks.report import commit  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
KV_DIR = ROOT.parent / "shared" / "data" / "kv"
DUMP_NAME = re.compile(r"__(?P<dataset>[^_]+)__(?P<kind>[kv])\.npy$")
GB = 1e9

# Why each format can or cannot be decoded piece by piece inside attention, by family.
PIECEWISE = {
    "GAAC": ("yes", "every 16-token tile of every head is a fixed-size slot (or a raw BF16 tile) found through "
                    "the block table and decoded from itself and per-channel bases, so the attention kernel "
                    "rebuilds exactly the tiles it reads"),
    "SplitZip-style": ("no", "the 4-bit codes are addressable, but a chunk's escapes sit at a data-dependent "
                             "offset of one escape stream that must be prefix-summed first, and chunks run over "
                             "the flat tensor rather than per head and token block; it is built to decode a whole "
                             "transfer at once"),
    "nvCOMP": ("no", "decodes whole 64 KiB chunks with its own kernels into a scratch buffer; inside a chunk the "
                     "LZ/entropy/bit-packing stream is sequential, so attention would read a decompressed copy"),
    "zstd": ("no", "CPU codec; an LZ77 + entropy-coded frame decodes front to back, as a whole"),
    "lz4": ("no", "CPU codec; an LZ77 frame decodes front to back, as a whole"),
    "ZipNN": ("no", "CPU codec; Huffman/zstd over byte-grouped 256 KiB chunks, each decoded whole on the host"),
}

# Codecs the GAAC paper compares with that this benchmark does not run, and why.
NOT_RUN = {
    "DietGPU": "no PyPI package (it builds from source against a CUDA toolkit and PyTorch); not attempted",
    "DFloat11": "the dfloat11 package (PyPI) decodes on the GPU only and is built around compressed model "
                "checkpoints rather than a tensor-in, tensor-out codec; not attempted in this run",
    "ZipServ": "no package in the registries searched",
    "SplitZip, the authors' Triton codec": "published as a GitHub repository, not a package; its idea is measured "
                                           "through our NumPy implementation (ratio; that throughput is NumPy's)",
}


# -- data ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    """One K or V cache ``uint16[layers, kv_heads, tokens, head_dim]`` of one prompt."""

    dataset: str
    kind: str
    bits: np.ndarray

    @property
    def name(self) -> str:
        return f"{self.dataset}/{self.kind}"


def load_dumps(kv_dir: Path) -> list[Tensor]:
    out = []
    for path in sorted(kv_dir.glob("*.npy")):
        m = DUMP_NAME.search(path.name)
        if m:
            out.append(Tensor(m["dataset"], m["kind"], np.load(path)))
    if not out:
        raise SystemExit(f"no K/V dumps (*__<prompt>__k.npy) in {kv_dir}")
    return out


def load_captures(pairs) -> list[Tensor]:
    from gaac.io import load_cache

    out = []
    for k_path, v_path in pairs or []:
        name = "capture:" + re.sub(r"[_.-]+k$", "", Path(k_path).stem)
        out += [Tensor(name, "k", load_cache(k_path, "k")), Tensor(name, "v", load_cache(v_path, "v"))]
    return out


def pack(kv_dir: Path, out_dir: Path) -> None:
    """Write the dumps as xz-compressed byte planes (20 MB instead of 30) with shapes and CRCs.

    A GPU machine gets the working tree and what is carried with it, under a
    size limit; the exponent-heavy high bytes compress well, so the four
    prompts fit beside the nvCOMP libraries.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for t in load_dumps(kv_dir):
        stem = f"{t.dataset}__{t.kind}"
        b = np.ascontiguousarray(t.bits).view(np.uint8).reshape(-1, 2)
        for plane, col in (("lo", 0), ("hi", 1)):
            (out_dir / f"{stem}.{plane}.xz").write_bytes(lzma.compress(np.ascontiguousarray(b[:, col]).tobytes()))
        manifest[stem] = {"shape": list(t.bits.shape), "crc32": zlib.crc32(t.bits.tobytes())}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def unpack(packed: Path) -> list[Tensor]:
    out = []
    for stem, meta in json.loads((packed / "manifest.json").read_text()).items():
        lo, hi = (np.frombuffer(lzma.decompress((packed / f"{stem}.{p}.xz").read_bytes()), np.uint8)
                  for p in ("lo", "hi"))
        bits = (lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)).reshape(meta["shape"])
        if zlib.crc32(bits.tobytes()) != meta["crc32"]:
            raise SystemExit(f"{packed}/{stem}: CRC mismatch after unpacking")
        dataset, kind = stem.split("__")
        out.append(Tensor(dataset, kind, bits))
    return out


# -- measuring -----------------------------------------------------------------------------------

def timed(fn: Callable, setup: Callable[[], object] | None = None) -> tuple[float, float, object]:
    """Median process CPU seconds and median wall seconds of ``fn`` (after ``setup``, untimed), and its result.

    CPU time is the headline: the benchmark machine is shared, and the CPU
    seconds a codec spends are steadier than the wall clock when other work
    competes for the cores (a multithreaded codec is charged for every thread).
    The first call is the warm-up; a call of over half a second is its own
    measurement (warming up matters little there), short ones are repeated
    3 to 7 times, about a second in all.
    """
    def once():
        arg = setup() if setup else None
        c, w = time.process_time(), time.perf_counter()
        r = fn(arg) if setup else fn()
        return time.process_time() - c, time.perf_counter() - w, r

    cpu, wall, result = once()
    if wall > 0.5:
        return cpu, wall, result
    cpus, walls = [], []
    for _ in range(min(7, max(3, int(1.0 / max(wall, 1e-6))))):
        cpu, wall, result = once()
        cpus.append(cpu)
        walls.append(wall)
    return statistics.median(cpus), statistics.median(walls), result


@dataclass
class Record:
    """One codec on one tensor."""

    codec: str
    family: str
    device: str
    dataset: str
    kind: str
    bf16_bytes: int
    compressed_bytes: int
    encode_s: float | None
    decode_s: float | None
    lossless: bool
    extra: dict = field(default_factory=dict)


# -- CPU codecs ----------------------------------------------------------------------------------

@dataclass
class Context:
    """What a calibrated codec needs for one tensor: its kind and the calibration in force."""

    kind: str
    calibration: object = None     # gaac.Calibration
    codebook: np.ndarray | None = None


@dataclass
class CpuCodec:
    name: str
    family: str
    encode: Callable                         # (bits, ctx) -> encoded object
    decode: Callable                         # (encoded, ctx) -> bits, same shape
    size: Callable                           # encoded -> bytes
    fresh_input: bool = False                # pass a private copy of the input (the codec writes into it)
    extra: Callable | None = None            # encoded -> dict of more numbers


def byte_planes(bits: np.ndarray) -> tuple[bytes, bytes]:
    """High bytes (sign + 7 exponent bits) and low bytes (1 exponent bit + mantissa) of BF16."""
    b = np.ascontiguousarray(bits).view(np.uint8).reshape(-1, 2)
    return np.ascontiguousarray(b[:, 1]).tobytes(), np.ascontiguousarray(b[:, 0]).tobytes()


def from_planes(hi: bytes, lo: bytes, shape) -> np.ndarray:
    h = np.frombuffer(hi, np.uint8).astype(np.uint16)
    return ((h << 8) | np.frombuffer(lo, np.uint8)).reshape(shape)


def gaac_encode(bits, ctx):
    from gaac import encode_block
    from gaac.layout import BLOCK_TOKENS
    from gaac.tiles import cache_blocks

    blocks = [encode_block(b, ctx.calibration, layer, ctx.kind)
              for layer in range(bits.shape[0]) for b in cache_blocks(bits[layer])]
    whole = bits.shape[2] // BLOCK_TOKENS * BLOCK_TOKENS
    return blocks, np.ascontiguousarray(bits[:, :, whole:]), bits.shape    # the tail stays BF16


def gaac_decode(enc, ctx):
    from gaac import decode_block
    from gaac.layout import BLOCK_TOKENS

    blocks, tail, (layers, heads, _, dim) = enc
    per_layer = len(blocks) // layers
    dec = np.stack([decode_block(b, ctx.calibration) for b in blocks])
    dec = dec.reshape(layers, per_layer, heads, BLOCK_TOKENS, dim)
    body = dec.transpose(0, 2, 1, 3, 4).reshape(layers, heads, per_layer * BLOCK_TOKENS, dim)
    return np.concatenate([body, tail], axis=2)


def gaac_extra(enc):
    blocks, tail, _ = enc
    return {"resident_bytes": sum(b.resident_bytes for b in blocks) + tail.nbytes,
            "raw_tiles": sum(len(b.raw_tiles) for b in blocks), "tiles": sum(b.n_tiles for b in blocks)}


def cpu_codecs() -> tuple[list[CpuCodec], dict[str, str]]:
    """The CPU codecs that can run here, and why any other cannot."""
    import splitzip

    codecs, missing = [], {}
    for cal in ("cross", "self"):
        codecs.append(CpuCodec(
            f"GAAC reference (NumPy), {cal}-calibrated", "GAAC", gaac_encode, gaac_decode,
            lambda e: sum(b.payload_bytes for b in e[0]) + e[1].nbytes, extra=gaac_extra))
    for cal in ("cross", "self"):
        codecs.append(CpuCodec(
            f"SplitZip-style (ours, NumPy), {cal} codebook", "SplitZip-style",
            lambda bits, ctx: splitzip.encode(bits, ctx.codebook), lambda e, ctx: splitzip.decode(e),
            lambda e: e.nbytes, extra=lambda e: {"escapes": e.escapes}))
    try:
        import zstandard
    except ImportError:
        missing["zstd"] = "zstandard is not installed (pip install zstandard)"
    else:
        for level in (3, 19):
            cz, dz = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            codecs.append(_whole(f"zstd -{level}, raw BF16", "zstd", cz.compress, dz.decompress))
            codecs.append(_split(f"zstd -{level}, byte-split", "zstd", cz.compress, dz.decompress))
    try:
        import lz4.frame
    except ImportError:
        missing["lz4"] = "lz4 is not installed (pip install lz4)"
    else:
        codecs.append(_whole("lz4 (frame, default level), raw BF16", "lz4", lz4.frame.compress,
                             lz4.frame.decompress))
        codecs.append(_split("lz4 (frame, default level), byte-split", "lz4", lz4.frame.compress,
                             lz4.frame.decompress))
    try:
        import zipnn
    except ImportError:
        missing["ZipNN"] = "zipnn is not installed (pip install zipnn)"
    else:
        z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16")
        # zipnn 0.5.4 reorders the bytes of the buffer it compresses in place, even of a `bytes`
        # object, so every call gets a private copy (made outside the timed region).
        codecs.append(CpuCodec("ZipNN (byte grouping, auto method)", "ZipNN",
                               lambda src, ctx: (z.compress(src[0]), src[1]),
                               lambda e, ctx: np.frombuffer(bytes(z.decompress(e[0])), np.uint16).reshape(e[1]),
                               lambda e: len(e[0]), fresh_input=True))
    return codecs, missing


def _whole(name, family, compress, decompress) -> CpuCodec:
    """A bytes codec applied to the little-endian BF16 bytes as they are."""
    return CpuCodec(name, family, lambda bits, ctx: (compress(bits.tobytes()), bits.shape),
                    lambda e, ctx: np.frombuffer(decompress(e[0]), np.uint16).reshape(e[1]),
                    lambda e: len(e[0]))


def _split(name, family, compress, decompress) -> CpuCodec:
    """A bytes codec applied to the high and the low byte planes separately (split and merge timed)."""
    def encode(bits, ctx):
        hi, lo = byte_planes(bits)
        return compress(hi), compress(lo), bits.shape

    return CpuCodec(name, family, encode,
                    lambda e, ctx: from_planes(decompress(e[0]), decompress(e[1]), e[2]),
                    lambda e: len(e[0]) + len(e[1]))


def contexts(tensors: list[Tensor], shared: list[Tensor]) -> dict:
    """Per tensor and calibration mode: the GAAC calibration and the SplitZip codebook.

    ``self``: calibrated on the tensor's own prompt.  ``cross``: on the other
    prompts of the shared dumps (leave-one-out), so no byte of the measured
    prompt is seen; a capture is cross-calibrated on all shared dumps when it
    has their shape, else it has no cross row.
    """
    import splitzip
    from gaac import calibrate

    def cat(ts, kind):
        return np.concatenate([t.bits for t in ts if t.kind == kind], axis=2)

    by_dataset = {}
    for t in tensors:
        by_dataset.setdefault(t.dataset, {})[t.kind] = t
    out = {}
    for dataset, kv in by_dataset.items():
        shape = kv["k"].bits.shape
        others = [t for t in shared if t.dataset != dataset
                  and (t.bits.shape[:2], t.bits.shape[3]) == (shape[:2], shape[3])]
        modes = {"self": [kv["k"], kv["v"]]}
        if others:
            modes["cross"] = others
        for mode, source in modes.items():
            cal = calibrate(cat(source, "k"), cat(source, "v"), show_progress=False)
            for kind in ("k", "v"):
                out[dataset, kind, mode] = Context(kind, cal, splitzip.calibrate_codebook(cat(source, kind)))
    return out


def run_cpu(tensors: list[Tensor], shared: list[Tensor]) -> tuple[list[Record], dict[str, str]]:
    codecs, missing = cpu_codecs()
    ctx = contexts(tensors, shared)
    records = []
    for codec in codecs:
        mode = "cross" if "cross" in codec.name else "self"
        for t in tensors:
            if (t.dataset, t.kind, mode) not in ctx:
                continue
            c = ctx[t.dataset, t.kind, mode]
            if codec.fresh_input:
                raw = t.bits.tobytes()
                enc_s, enc_wall, enc = timed(lambda src: codec.encode(src, c),
                                             setup=lambda: (bytearray(raw), t.bits.shape))
            else:
                enc_s, enc_wall, enc = timed(lambda: codec.encode(t.bits, c))
            dec_s, dec_wall, dec = timed(lambda: codec.decode(enc, c))
            ok = dec.shape == t.bits.shape and np.array_equal(dec, t.bits)
            extra = {"encode_wall_s": enc_wall, "decode_wall_s": dec_wall, **(codec.extra(enc) if codec.extra else {})}
            records.append(Record(codec.name, codec.family, "cpu", t.dataset, t.kind, t.bits.nbytes,
                                  codec.size(enc), enc_s, dec_s, bool(ok), extra))
            print(f"{codec.name:48s} {t.name:14s} ratio {t.bits.nbytes / codec.size(enc):.3f} "
                  f"enc {t.bits.nbytes / enc_s / GB:.3f} GB/s dec {t.bits.nbytes / dec_s / GB:.3f} GB/s "
                  f"{'ok' if ok else 'ROUND TRIP FAILED'}", flush=True)
    return records, missing


# -- GPU codecs (nvCOMP) -------------------------------------------------------------------------

# (label, nvCOMP algorithm, options, dtype the buffer is handed over as)
NVCOMP_VARIANTS = [
    ("nvCOMP LZ4", "LZ4", {}, np.uint8),
    ("nvCOMP Snappy", "Snappy", {}, np.uint8),
    ("nvCOMP Zstd", "Zstd", {}, np.uint8),
    ("nvCOMP Deflate", "Deflate", {}, np.uint8),
    ("nvCOMP GDeflate", "GDeflate", {}, np.uint8),
    ("nvCOMP GDeflate (entropy only)", "GDeflate", {"algorithm_type": 0}, np.uint8),
    ("nvCOMP ANS (bytes)", "ANS", {}, np.uint8),
    ("nvCOMP ANS (<f2 mode on BF16 bits)", "ANS", {"data_type": "<f2"}, np.float16),
    ("nvCOMP Cascaded (<u2)", "Cascaded", {"data_type": "<u2"}, np.uint16),
    ("nvCOMP Bitcomp (<u2)", "Bitcomp", {"data_type": "<u2"}, np.uint16),
]


def _host_bytes(arr) -> np.ndarray:
    """An nvCOMP device Array's bytes on the host."""
    host = arr.cpu()
    try:
        return np.asarray(host).view(np.uint8).ravel()
    except (TypeError, ValueError):
        import torch

        return torch.from_dlpack(arr).cpu().numpy().view(np.uint8).ravel()


def run_gpu(tensors: list[Tensor], warmup: int, iters: int) -> tuple[list[Record], dict[str, str], dict]:
    """Ratio per tensor, and encode/decode throughput on all tensors concatenated, timed with CUDA events."""
    import torch

    try:
        from nvidia import nvcomp
    except ImportError as exc:
        return [], {"nvCOMP": f"the nvidia-nvcomp-cu13 module does not load here ({exc})"}, {
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nvcomp": "not loaded", "timing_bytes": 0, "warmup": warmup, "iters": iters}
    stream = torch.cuda.Stream()
    big = np.concatenate([np.ascontiguousarray(t.bits).ravel() for t in tensors])
    records, failed = [], {}

    def device_array(bits: np.ndarray, dtype):
        host = np.ascontiguousarray(bits).ravel().view(dtype)
        return nvcomp.as_array(host).cuda(), host

    def events(fn) -> tuple[float, float]:
        """Median seconds by CUDA events on the codec's stream, and by the host clock to completion."""
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
            stream.synchronize()
            times, walls = [], []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                wall = time.perf_counter()
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()
                walls.append(time.perf_counter() - wall)
                times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times), statistics.median(walls)

    for label, algorithm, options, dtype in NVCOMP_VARIANTS:
        try:
            codec = nvcomp.Codec(algorithm=algorithm, cuda_stream=stream.cuda_stream, **options)
            per = []
            for t in tensors:
                arr, host = device_array(t.bits, dtype)
                enc = codec.encode(arr)
                dec = codec.decode(enc)
                stream.synchronize()
                ok = np.array_equal(_host_bytes(dec), host.view(np.uint8))
                per.append(Record(label, "nvCOMP", "gpu", t.dataset, t.kind, t.bits.nbytes, int(enc.buffer_size),
                                  None, None, bool(ok)))
            arr, host = device_array(big, dtype)
            enc, path = codec.encode(arr), "plain calls"
            dec = codec.decode(enc)
            stream.synchronize()
            big_ok = np.array_equal(_host_bytes(dec), host.view(np.uint8))
            enc_fn, dec_fn = (lambda: codec.encode(arr)), (lambda: codec.decode(enc))
            try:        # preconfigured calls into reused buffers: no allocation or header parse in the loop
                cfg = codec.compression_config(int(arr.buffer_size))
                dcfg = codec.decompression_config(enc)
                codec.encode(arr, out=enc, compression_config=cfg)
                codec.decode(enc, out=dec, decompression_config=dcfg)
                stream.synchronize()
                if np.array_equal(_host_bytes(dec), host.view(np.uint8)):
                    enc_fn = lambda: codec.encode(arr, out=enc, compression_config=cfg)     # noqa: E731
                    dec_fn = lambda: codec.decode(enc, out=dec, decompression_config=dcfg)  # noqa: E731
                    path = "preconfigured, output buffers reused"
                else:
                    path = "plain calls (the preconfigured round trip did not match)"
                    enc = codec.encode(arr)
            except Exception as exc:  # an older nvCOMP without these keywords: time the plain calls
                path = f"plain calls ({type(exc).__name__}: {exc})"
                enc = codec.encode(arr)      # the failed call may have left `enc` half-written
            (enc_s, enc_wall), (dec_s, dec_wall) = events(enc_fn), events(dec_fn)
            records += per
            records.append(Record(label, "nvCOMP", "gpu", "all (timing)", "k+v", big.nbytes, int(enc.buffer_size),
                                  enc_s, dec_s, bool(big_ok),
                                  {"timing_path": path, "encode_wall_s": enc_wall, "decode_wall_s": dec_wall}))
            print(f"{label:40s} ratio {sum(r.bf16_bytes for r in per) / sum(r.compressed_bytes for r in per):.3f} "
                  f"enc {big.nbytes / enc_s / GB:.1f} GB/s dec {big.nbytes / dec_s / GB:.1f} GB/s "
                  f"lossless {all(r.lossless for r in per) and big_ok} [{path}]", flush=True)
        except Exception as exc:  # a codec this nvCOMP build lacks or refuses is listed, not dropped
            failed[label] = f"{type(exc).__name__}: {exc}"
            print(f"{label}: FAILED {failed[label]}", flush=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "nvcomp": getattr(nvcomp, "__version__", "?"), "timing_bytes": int(big.nbytes),
           "warmup": warmup, "iters": iters}
    return records, failed, env


# -- tables, files, plot -------------------------------------------------------------------------

def summarize(records: list[dict]) -> list[dict]:
    """Per codec: overall ratio, per-dataset ratios, throughput and losslessness."""
    rows = {}
    for r in records:
        row = rows.setdefault(r["codec"], {"codec": r["codec"], "family": r["family"], "device": r["device"],
                                           "bf16": 0, "comp": 0, "tbytes": 0, "enc": 0.0, "dec": 0.0,
                                           "lossless": True, "datasets": {}, "resident": 0})
        row["lossless"] &= r["lossless"]
        if r["dataset"] != "all (timing)":
            row["bf16"] += r["bf16_bytes"]
            row["comp"] += r["compressed_bytes"]
            row["resident"] += r["extra"].get("resident_bytes", r["compressed_bytes"])
            d = row["datasets"].setdefault(r["dataset"], [0, 0])
            d[0] += r["bf16_bytes"]
            d[1] += r["compressed_bytes"]
        if r["encode_s"] is not None:
            row["tbytes"] += r["bf16_bytes"]
            row["enc"] += r["encode_s"]
            row["dec"] += r["decode_s"]
    out = []
    for row in rows.values():
        row["ratio"] = row["bf16"] / row["comp"]
        row["resident_ratio"] = row["bf16"] / row["resident"]
        row["enc_gbs"] = row["tbytes"] / row["enc"] / GB if row["enc"] else None
        row["dec_gbs"] = row["tbytes"] / row["dec"] / GB if row["dec"] else None
        row["piecewise"] = PIECEWISE[row["family"]][0]
        out.append(row)
    return sorted(out, key=lambda r: -r["ratio"])


def _gbs(x):
    return "n/a" if x is None else (f"{x:.4f}" if x < 0.1 else f"{x:.2f}" if x < 100 else f"{x:.0f}")


def summary_table(rows: list[dict]) -> str:
    lines = ["| codec | runs on | ratio | encode GB/s | decode GB/s | lossless | decodable piecewise in attention |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        dev = {"cpu": "CPU", "gpu": "GPU"}[r["device"]]
        lines.append(f"| {r['codec']} | {dev} | {r['ratio']:.3f} | {_gbs(r['enc_gbs'])} | {_gbs(r['dec_gbs'])} | "
                     f"{'yes' if r['lossless'] else '**NO**'} | {r['piecewise']} |")
    return "\n".join(lines)


def dataset_table(rows: list[dict]) -> str:
    names = sorted({d for r in rows for d in r["datasets"]}, key=lambda d: (d.startswith("capture"), d))
    lines = ["| codec | " + " | ".join(names) + " | all |", "|---" * (len(names) + 2) + "|"]
    for r in rows:
        cells = [f"{r['datasets'][d][0] / r['datasets'][d][1]:.3f}" if d in r["datasets"] else "-" for d in names]
        lines.append(f"| {r['codec']} | " + " | ".join(cells) + f" | {r['ratio']:.3f} |")
    return "\n".join(lines)


def piecewise_notes() -> str:
    return "\n".join(f"- **{fam}: {yes}.** {why}." for fam, (yes, why) in PIECEWISE.items())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions(names) -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = "not installed"
    return out


def write_results(path: Path, title: str, env: dict, records: list[Record], missing: dict, notes: str,
                  clock: str) -> None:
    recs = [r.__dict__ for r in records]
    rows = summarize(recs)
    env_lines = "\n".join(f"- {k}: {v}" for k, v in env.items())
    missing_lines = "\n".join(f"- {k}: {v}" for k, v in missing.items()) or "- none"
    path.write_text(f"""# {title}

{env_lines}

Ratio = BF16 bytes / compressed bytes over every tensor listed below; throughput = BF16 bytes / median
seconds (GB = 1e9 bytes; {clock}). Every stream was decoded and compared bit for bit ("lossless").

## Summary

{summary_table(rows)}

## Ratio per prompt (K and V together)

{dataset_table(rows)}

## Not run

{missing_lines}

## Notes

{notes}

## Decodable piecewise inside attention?

{piecewise_notes()}

## Records

```json
{json.dumps({"env": env, "missing": missing, "records": recs}, indent=0)}
```
""")
    print(f"wrote {path}")


def read_results(path: Path) -> dict:
    m = re.search(r"```json\n(.*?)\n```", path.read_text(), re.S)
    if not m:
        raise SystemExit(f"{path}: no records block")
    return json.loads(m.group(1))


def plot(rows: list[dict], path: Path, subtitle: str) -> None:
    """Ratio against decode GB/s (log x), one labelled point per codec; labels pushed apart where they collide."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colors = {"GAAC": "tab:red", "SplitZip-style": "tab:purple", "nvCOMP": "tab:green", "zstd": "tab:blue",
              "lz4": "tab:orange", "ZipNN": "tab:brown"}
    fig, ax = plt.subplots(figsize=(12, 7.5))
    points = [r for r in rows if r["dec_gbs"] is not None]
    for r in points:
        ax.scatter(r["dec_gbs"], r["ratio"], s=60, color=colors[r["family"]],
                   marker="^" if r["device"] == "gpu" else "o", zorder=3)
    ax.set_xscale("log")
    xs = [r["dec_gbs"] for r in points]
    ax.set_xlim(min(xs) / 2, max(xs) * 30)        # room for the labels of the fastest codecs
    ax.set_xlabel("decode throughput, GB/s of BF16 (log scale)")
    ax.set_ylabel("compression ratio (BF16 bytes / compressed bytes)")
    ax.set_title("Lossless codecs on real SmolLM2-135M K/V: ratio against decode throughput\n" + subtitle, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], marker="o", ls="", color="gray",
                      label="CPU, per CPU-second (NumPy rows: slow references)"),
               Line2D([], [], marker="^", ls="", color="gray", label="GPU (H200), CUDA events")]
    handles += [Line2D([], [], marker="s", ls="", color=c, label=f) for f, c in colors.items()]
    ax.legend(handles=handles, loc="lower left", fontsize=8)
    fig.tight_layout()
    placed = []
    for r in sorted(points, key=lambda r: (-r["ratio"], r["dec_gbs"])):
        for dy in (3, -11, 14, -22, 25, -33, 36):
            label = ax.annotate(r["codec"], (r["dec_gbs"], r["ratio"]), textcoords="offset points",
                                xytext=(6, dy), fontsize=7)
            box = label.get_window_extent(fig.canvas.get_renderer())
            if not any(box.overlaps(b) for b in placed):
                break
            label.remove()
        else:
            label = ax.annotate(r["codec"], (r["dec_gbs"], r["ratio"]), textcoords="offset points",
                                xytext=(6, 3), fontsize=7)
            box = label.get_window_extent(fig.canvas.get_renderer())
        placed.append(box)
    fig.savefig(path, dpi=130)
    print(f"wrote {path}")


# -- commands ------------------------------------------------------------------------------------

def cmd_cpu(args) -> None:
    shared = load_dumps(args.kv)
    tensors = shared + load_captures(args.capture)
    records, missing = run_cpu(tensors, shared)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    env = {"date": datetime.date.today().isoformat(), "machine": f"{cpu_model()}, {_cores()} cores, no GPU",
           "load average at start (shared machine)": f"{load:.1f}",
           "commit": commit(), "command": "python benchmarks/codecs.py " + " ".join(sys.argv[1:]),
           "versions": versions(["numpy", "zstandard", "lz4", "zipnn"]),
           "data": ", ".join(f"{t.name} {list(t.bits.shape)}" for t in tensors)}
    notes = """- GAAC and SplitZip-style rows are NumPy implementations: their throughput is that of slow, plain
  reference code, not of kernels. GAAC's ratio is its payload (sign/mantissa bytes, 3-bit codes, mode tags,
  used escape bytes, raw tiles at 2 bytes per element) through the public `encode_block` / `decode_block`;
  the resident ratio, which also pays each slot's unused escape capacity and the block-table entries, is in
  the records (`resident_bytes`).
- *cross* = calibrated (GAAC bases and capacities; SplitZip codebook) on the other three prompts, never
  on the measured one; *self* = calibrated on the measured prompt itself.
- Throughput is BF16 bytes per median *process CPU second* (all threads of the process), because this
  machine is shared and its wall clock swings with other work; the wall-clock medians are in the records
  (`encode_wall_s`, `decode_wall_s`).
- zstd and lz4 run single-threaded on one tensor at a time; *byte-split* compresses the high bytes (sign and
  7 exponent bits) and the low bytes (1 exponent bit and the mantissa) as two streams, split and merge timed.
  ZipNN does its own byte grouping and uses its default threads (2 here), each charged in CPU time.
  zipnn 0.5.4 overwrites the buffer it compresses, so each call gets a private copy, made outside the
  timed region."""
    write_results(args.out, "Codec comparison on the CPU", env, records, missing, notes,
                  "process CPU seconds, see the notes")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def cmd_gpu(args) -> None:
    tensors = unpack(args.packed) if args.packed else load_dumps(args.kv)
    records, failed, genv = run_gpu(tensors, args.warmup, args.iters)
    env = {"date": datetime.date.today().isoformat(),
           "machine": f"{genv.pop('gpu')}, host {cpu_model()}, {_cores()} cores",
           "commit": args.commit or commit(), "command": "python benchmarks/codecs.py " + " ".join(sys.argv[1:]),
           "versions": {**versions(["numpy", "nvidia-nvcomp-cu13"]), "torch": genv.pop("torch"),
                        "cuda (torch)": genv.pop("cuda"), "nvcomp (module)": genv.pop("nvcomp")},
           "data": ", ".join(f"{t.name} {list(t.bits.shape)}" for t in tensors)}
    notes = f"""- Ratio: each of the {len(tensors)} tensors compressed on its own (nvCOMP native bitstream, its
  header counted, default 64 KiB chunks). Throughput: all tensors concatenated into one buffer of
  {genv['timing_bytes'] / 1e6:.1f} MB, CUDA events on the codec's stream, {genv['warmup']} warm-up calls,
  median of {genv['iters']}; the timing row's `timing_path` says whether preconfigured calls into reused
  output buffers could be used, and `encode_wall_s` / `decode_wall_s` give the host's clock from the call to
  its completion (Python and launch overhead included).
- Each codec takes the buffer as bytes except where the label names a type: `<u2` hands it over as 16-bit
  integers, `<f2` as 16-bit floats (the BF16 bits unchanged; the round trip is checked all the same)."""
    write_results(args.out, "Codec comparison on the GPU (nvCOMP)", env, records, failed, notes,
                  "GPU seconds by CUDA events")


def cited_kernels(path: Path, shape: str) -> dict | None:
    """GAAC's CUDA kernel throughput for a ``kv_heads x head_dim`` shape, read from ``codec-h200.md``.

    That file belongs to the kernel benchmark (``benchmarks/codec_gpu.py``);
    it is cited, never re-measured here.  Its "Bulk encode / decode" table has
    one row per shape with BF16 GB/s in (encode) and out (decode); anything
    else in the file, or no file, gives None and the report says so.
    """
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("#") and "Bulk encode / decode" in line)
        first = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("|"))
        table = []
        for line in lines[first:]:          # the first table under that heading
            if not line.startswith("|"):
                break
            table.append(line)
        header = [c.strip() for c in table[0].strip("|").split("|")]
        row = next([c.strip() for c in r.strip("|").split("|")] for r in table[2:]
                   if r.strip("|").split("|")[0].strip() == shape)
        return {"encode": float(row[header.index("GB/s BF16 in")]), "decode": float(row[header.index("GB/s BF16 out")]),
                "heading": lines[start].lstrip("# ").strip()}
    except (StopIteration, ValueError, IndexError):
        return None


def cmd_report(args) -> None:
    records, missing, envs = [], {}, []
    for path in args.inputs:
        if path.exists():
            d = read_results(path)
            records += d["records"]
            missing.update(d["missing"])
            envs.append((path.name, d["env"]))
        else:
            missing[path.name] = "file not present: that machine's run has not been made"
    missing.update(NOT_RUN)
    tensors = {f"{r['dataset']}/{r['kind']}": r["bf16_bytes"] for r in records if r["dataset"] != "all (timing)"}
    rows = summarize(records)
    env_lines = "\n".join(f"- `{name}`: {e['date']}, {e['machine']}, commit {e['commit']}, `{e['command']}`"
                          for name, e in envs)
    kernels = RESULTS / "codec-h200.md"
    cited = cited_kernels(kernels, args.kernel_shape)
    reference = next((r for r in rows if r["codec"].startswith("GAAC reference") and "self" in r["codec"]), None)
    if cited and reference:
        rows.append({**reference, "codec": "GAAC CUDA kernels (cited; 64K-token synthetic layer)", "device": "gpu",
                     "enc_gbs": cited["encode"], "dec_gbs": cited["decode"], "datasets": {}})
        rows.sort(key=lambda r: -r["ratio"])
        kernel_line = (f"*GAAC CUDA kernels (cited)* is not measured here: its throughput is the {args.kernel_shape} "
                       f"row of \"{cited['heading']}\" in `benchmarks/results/{kernels.name}` (gaac/cuda/codec.py, "
                       "a 64K-token layer of synthetic data with the real K/V's group mix, bit-exact against the "
                       "reference there), and its ratio is the self-calibrated reference's on the real K/V above "
                       "(same format, same bytes).")
    else:
        kernel_line = (f"GAAC's CUDA kernels: `benchmarks/results/{kernels.name}` has no {args.kernel_shape} bulk "
                       "row to cite, so no GPU row for GAAC.")
    args.out.write_text(f"""# Lossless codecs on real K/V, side by side (issue 7)

Generated by `python benchmarks/codecs.py report` from:

{env_lines}

Ratio = BF16 bytes / compressed bytes over {len(tensors)} real K/V tensors ({', '.join(sorted(tensors))}:
{sum(tensors.values()) / 1e6:.2f} MB of BF16).
Throughput is GB/s of BF16: GPU rows by CUDA events (nvCOMP on all tensors concatenated), CPU rows per
process CPU second on a shared 2-core machine; NumPy rows are slow reference implementations. The
per-machine files hold the details, the notes and every record.

{kernel_line}

## Summary

{summary_table(rows)}

## Ratio per prompt (K and V together)

{dataset_table([r for r in rows if r["datasets"]])}

## Not run, and why

{chr(10).join(f"- {k}: {v}" for k, v in missing.items()) or "- none"}

## Decodable piecewise inside attention?

{piecewise_notes()}

![ratio against decode throughput]({args.plot.name})
""")
    print(f"wrote {args.out}")
    plot(rows, args.plot, "\n".join(f"{name}: {e['machine']}, {e['date']}, commit {e['commit']}" for name, e in envs))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu", help="CPU codecs and the NumPy references")
    c.add_argument("--kv", type=Path, default=KV_DIR, help="folder of *__<prompt>__{k,v}.npy dumps")
    c.add_argument("--capture", nargs=2, action="append", metavar=("K", "V"),
                   help="a captured cache (K and V files: .npy, .safetensors or .pt); repeatable")
    c.add_argument("--out", type=Path, default=RESULTS / "codecs-cpu.md")
    k = sub.add_parser("pack", help="the dumps as xz byte planes, to carry to a GPU machine")
    k.add_argument("dir", type=Path)
    k.add_argument("--kv", type=Path, default=KV_DIR)
    g = sub.add_parser("gpu", help="nvCOMP codecs on a CUDA GPU")
    g.add_argument("--kv", type=Path, default=KV_DIR)
    g.add_argument("--packed", type=Path, help="a folder written by `pack` (instead of --kv)")
    g.add_argument("--out", type=Path, default=RESULTS / "codecs-h200.md")
    g.add_argument("--warmup", type=int, default=3)
    g.add_argument("--iters", type=int, default=20)
    g.add_argument("--commit", help="the commit measured, where the tree has no .git")
    r = sub.add_parser("report", help="merge results files into one table and a plot")
    r.add_argument("inputs", type=Path, nargs="*", default=[RESULTS / "codecs-cpu.md", RESULTS / "codecs-h200.md"])
    r.add_argument("--out", type=Path, default=RESULTS / "codecs-summary.md")
    r.add_argument("--plot", type=Path, default=RESULTS / "codecs.png")
    r.add_argument("--kernel-shape", default="3x64", help="kv_heads x head_dim row of codec-h200.md to cite "
                                                          "(SmolLM2-135M: 3x64)")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        pack(args.kv, args.dir)
    else:
        {"cpu": cmd_cpu, "gpu": cmd_gpu, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
