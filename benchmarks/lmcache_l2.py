"""LMCache's fs L2 adapter with the gaac serde, against no serde and LMCache's fp8 serde: real KV chunks stored
and loaded, in one run.

    python benchmarks/lmcache_l2.py --out $OUT/lmcache-h200.md                 # on the H200 (prologue below)
    python benchmarks/lmcache_l2.py --smoke --out /tmp/lmcache-smoke.md        # CPU: reference codec, small chunks

On the H200 (no network there): LMCache 0.5.6 and the packages it imports that the machine lacks travel as
wheels in ``.whl/lmcache/`` (``lmcache``, ``cryptography``, ``cffi``, ``pycparser``, ``cachetools``: cp312
manylinux wheels, installed with ``--no-deps``), numpy 2.4.6 as before (numba-cuda needs numpy < 2.5), and the
data in ``.devdata/lmcache/`` (the prose dump and the calibrations made here).  Prologue, from the repository
root (what ``.devdata/run/lmcache.sh`` runs)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/numpy-*.whl .whl/lmcache/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NUMBA_ENABLE_CUDASIM=0 LMCACHE_LOG_LEVEL=WARNING
    python3 benchmarks/lmcache_l2.py --data .devdata/lmcache --calibrations .devdata/lmcache --out $OUT/lmcache-h200.md

Before a device run, make the calibrations here (they need the ``code`` dump, which does not travel)::

    mkdir -p .devdata/lmcache && cp .devdata/kv/*__prose__[kv].npy .devdata/lmcache/
    python benchmarks/lmcache_l2.py --make-calibrations --calibrations .devdata/lmcache

What runs is LMCache's own code: the adapter is parsed from its JSON spec by LMCache's
``parse_args_to_l2_adapters_config`` (what ``--l2-adapter`` takes), made by ``create_l2_adapter`` and, with a
``"serde"`` key, wrapped in ``SerdeL2AdapterWrapper`` with a serde processor from ``create_serde_processor``,
as ``StorageManager`` builds its L2 adapters; the chunks live in LMCache's ``L1Manager`` (host memory, pinned
on a CUDA machine), as ``MemoryObj`` s of ``[2, layers, tokens, kv_heads * head_dim]`` BF16 (KV_2LTD).  Per
serde, in one process:

* ``{"type": "fs", "base_path": ...}``: no serde, the chunk's bytes as they are;
* ``"serde": {"type": "fp8"}``: LMCache's fp8 serde (float8_e4m3fn, lossy);
* ``"serde": {"type": "gaac", "calibration": FILE}``: the gaac serde, a calibration made on another prompt
  (the ``code`` dump), containers without it;
* ``"serde": {"type": "gaac", "head_dim": D}``: calibrated on the first chunk, embedded in every container.

With a GPU the gaac serde codes on it (``"device": "cuda"``: each host chunk is copied to the GPU, coded by the
CUDA codec, and the container written back into LMCache's host buffer); without one, the reference codec codes
on the CPU.  Each serde's steps, timed after a warm-up on ``--warmup`` chunks, over ``--chunks`` chunks submitted
as tasks of ``--batch`` keys, all in flight at once:

* **serialize**: the serde processor alone, chunk to temp buffer (sized by ``estimate_serialized_size``);
* **store**: the adapter's ``submit_store_task``: serialize and write the file (no serde: write the chunk);
* **LMCache load**: the adapter's ``submit_load_task``, as LMCache loads: a temp buffer of the estimate's size,
  the fs read, deserialize; how many keys it serves, and in what time when it serves them all;
* **read** and **deserialize**: the same load with the temp buffer narrowed (``MemoryObj.set_used_size``) to
  the bytes the adapter stored for the key (what it reported to its listeners), read by the inner fs adapter,
  then the serde processor's deserialize.  LMCache 0.5.6's fs adapter serves a key only when its file fills
  the buffer, so a gaac chunk, shorter than the estimate, is a miss in the LMCache load; the narrowed load is
  the same chain with a buffer that a size-aware load would allocate.

Speeds are GB/s of BF16 KV (the chunks' bytes), so that the serdes compare; stored bytes are the files'
sizes.  Files are read back through the page cache (written just before).  Every chunk loaded is compared with
its source: bit-exact, or for fp8 the fraction of values that differ and the largest relative error.

The chunks are the real SmolLM2-135M-Instruct K/V (``--data``: the dumps of ``.devdata/kv``), cut into chunks
of ``--chunk-tokens`` (256, LMCache's default) tokens, in two shapes (``--shapes``): ``smollm2``, the model's own
(30 layers, 3 KV heads of 64: 5.9 MB a chunk), and ``llama8b``, Llama-3.1-8B's (32 layers, 8 KV heads of 128:
33.5 MB a chunk), each 128-wide head two real 64-wide heads side by side, (layer, head) pairs taken in turn as
``benchmarks/decode_step.py`` tiles them.  ``--chunks`` chunks are stored under distinct keys, cycling
through the real ones.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import gaac  # noqa: E402
from benchmarks.real_kv import tile_heads  # noqa: E402
from benchmarks.report import commit, table, write  # noqa: E402
from gaac.capture import package_version  # noqa: E402

MODEL = "smollm2-135m-instruct-q4_1"
SHAPES = {"smollm2": (30, 3, 64), "llama8b": (32, 8, 128)}     # layers, KV heads, head_dim
SERDES = ("none", "fp8", "gaac", "gaac-embedded")
GB = 1e9
TAG = "lmcache_l2_bench"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The chunks: real K/V in LMCache's layout.

def find_data(arg: str | None) -> Path:
    cands = [Path(arg)] if arg else [ROOT / ".devdata" / "lmcache", ROOT / ".devdata" / "kv",
                                     ROOT.parent / "shared" / "data" / "kv", Path("/work/shared/data/kv")]
    for c in cands:
        if (c / f"{MODEL}__prose__k.npy").is_file():
            return c
    raise SystemExit(f"no SmolLM2 K/V dumps in {[str(c) for c in cands]} (pass --data)")


def load_dump(data: Path, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """uint16 K and V ``[30, 3, tokens, 64]`` of one prompt."""
    return tuple(np.load(data / f"{MODEL}__{kind}__{w}.npy") for w in "kv")


def chunks_of(k: np.ndarray, v: np.ndarray, tokens: int) -> list[torch.Tensor]:
    """Every complete ``tokens``-token chunk of K, V ``[layers, heads, T, dim]`` as LMCache holds one: BF16
    ``[2, layers, tokens, heads * dim]``."""
    layers, heads, total, dim = k.shape
    kv = torch.from_numpy(np.stack([k, v]).view(np.int16)).view(torch.bfloat16)
    return [kv[:, :, :, i:i + tokens].permute(0, 1, 3, 2, 4).reshape(2, layers, tokens, heads * dim).contiguous()
            for i in range(0, total - tokens + 1, tokens)]


def calibration_path(folder: Path, shape: str) -> Path:
    return folder / f"cal-{shape}.json"


def make_calibrations(data: Path, folder: Path, kind: str) -> None:
    """A calibration per shape, made on prompt ``kind`` (not the one the chunks come from)."""
    k, v = load_dump(data, kind)
    folder.mkdir(parents=True, exist_ok=True)
    for shape, (layers, heads, dim) in SHAPES.items():
        cal = gaac.calibrate(tile_heads(k, layers, heads, dim), tile_heads(v, layers, heads, dim),
                             model=f"SmolLM2-135M ({kind}) as {shape}", show_progress=False)
        cal.save(calibration_path(folder, shape))
        log(f"calibration {calibration_path(folder, shape)}: {shape}, made on the {kind} prompt")


# ----------------------------------------------------------------------------------------------
# LMCache: L1 memory, adapters, tasks.

class L1:
    """LMCache's ``L1Manager`` (host memory) and the objects this run reserves in it."""

    def __init__(self, nbytes: int):
        from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
        from lmcache.v1.distributed.l1_manager import L1Manager

        self.manager = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(
            size_in_bytes=nbytes, use_lazy=False, shm_name="")))
        self._serial = 0

    def keys(self, n: int, name: str) -> list:
        from lmcache.v1.distributed.api import ObjectKey

        self._serial += 1
        return [ObjectKey(chunk_hash=self._serial.to_bytes(8, "little") + i.to_bytes(8, "little") + bytes(16),
                          model_name=name, kv_rank=0) for i in range(n)]

    def reserve(self, keys: list, layout, temporary: bool = True) -> list:
        from lmcache.v1.distributed.error import L1Error

        got = self.manager.reserve_write(keys, [temporary] * len(keys), layout, tag=TAG)
        bad = [str(got[k][0]) for k in keys if got[k][0] != L1Error.SUCCESS]
        if bad:
            self.manager.finish_write_and_delete([k for k in keys if got[k][0] == L1Error.SUCCESS], tag=TAG)
            raise RuntimeError(f"L1 reserve_write failed for {len(bad)} of {len(keys)} objects: {bad[0]}")
        return [got[k][1] for k in keys]

    def release(self, keys: list) -> None:
        self.manager.finish_write_and_delete(keys, tag=TAG)


def layout_of(shape) -> object:
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    return MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[torch.bfloat16])


def build_adapter(spec: dict, l1: L1):
    """The L2 adapter of JSON ``spec`` as LMCache's StorageManager builds it, and its serde config."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
    from lmcache.v1.distributed.serde import create_serde_processor

    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    adapter = create_l2_adapter(config, l1.manager.get_l1_memory_desc())
    if config.serde_config is not None:
        adapter = SerdeL2AdapterWrapper(inner=adapter, serde=create_serde_processor(config.serde_config),
                                        l1_manager=l1.manager)
    return adapter, config.serde_config


def stored_sizes(adapter) -> dict:
    """The bytes the adapter reports storing, per key (its listener notifications)."""
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    sizes = {}

    class Sizes(L2AdapterListener):
        def on_l2_keys_stored(self, keys, nbytes):
            sizes.update(zip(keys, nbytes))

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            pass

    adapter.register_listener(Sizes())
    return sizes


def wait_all(poll, ids: list, what: str, timeout: float) -> list:
    """The results of task ``ids`` (``poll(id)``: None while pending), in order."""
    done = {}
    end = time.perf_counter() + timeout
    while len(done) < len(ids):
        for i in ids:
            if i not in done:
                r = poll(i)
                if r is not None:
                    done[i] = r
        if time.perf_counter() > end:
            raise RuntimeError(f"{what}: {len(ids) - len(done)} of {len(ids)} tasks unfinished after {timeout:.0f} s")
        time.sleep(0.0002)
    return [done[i] for i in ids]


def batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def timed(submit, poll, n: int, size: int, what: str, timeout: float) -> tuple[list, float]:
    """Every batch submitted at once, then waited for: (results, seconds)."""
    t = time.perf_counter()
    ids = [submit(b) for b in batches(n, size)]
    results = wait_all(poll, ids, what, timeout)
    return results, time.perf_counter() - t


def store_poller(adapter):
    """``poll(id)`` over ``pop_completed_store_tasks``, which hands each result out once."""
    popped = {}

    def poll(i):
        popped.update(adapter.pop_completed_store_tasks())
        return popped.pop(i, None)
    return poll


def compare(src: list, dst: list) -> dict:
    """Loaded chunks against their sources: how many are bit-exact, and for the others the fraction of values
    that differ and the largest error relative to the chunk's largest magnitude."""
    exact, differ, total, rel = 0, 0, 0, 0.0
    for a, b in zip(src, dst):
        a, b = a.tensor, b.tensor
        if torch.equal(a.view(torch.int16), b.view(torch.int16)):
            exact += 1
        else:
            af, bf = a.float(), b.float()
            differ += int((a.view(torch.int16) != b.view(torch.int16)).sum())
            rel = max(rel, float((af - bf).abs().max() / af.abs().max()))
        total += a.numel()
    return {"exact": exact, "of": len(src), "values_differ": differ / total, "max_rel_err": rel}


# ----------------------------------------------------------------------------------------------
# One serde: its steps over n chunks.

def steps(adapter, proc, sizes: dict, l1: L1, src: list, shape, n: int, batch: int,
          timeout: float) -> dict:
    """Store ``n`` chunks (``src`` in turn) under new keys and load them back, each step timed (module docstring)."""
    from lmcache.v1.distributed.serde import serialized_layout_desc

    chunk_bytes = src[0].tensor.numel() * 2
    kv_gb = n * chunk_bytes / GB
    keys = l1.keys(n, "bench")
    objs = [src[i % len(src)] for i in range(n)]
    layout = layout_of(shape)
    r = {"chunks": n, "chunk_bytes": chunk_bytes}

    if proc is not None:                                 # serialize, the processor alone
        temp_layout = serialized_layout_desc(layout, proc)
        r["estimate_bytes"] = int(temp_layout.shapes[0][0])
        tkeys = l1.keys(n, "temp")
        temps = l1.reserve(tkeys, temp_layout)
        try:
            ok, s = timed(lambda b: proc.submit_serialize(objs[b], temps[b], keys[b]),
                          proc.query_serialize_result, n, batch, "serialize", timeout)
            if not all(ok):
                raise RuntimeError(f"serialize: {ok.count(False)} of {len(ok)} tasks failed (LMCache's log says why)")
            r["serialize_s"] = s
            r["serialize_gbps"] = kv_gb / s
            r["serialized_bytes"] = sum(t.get_size() for t in temps)
        finally:
            l1.release(tkeys)

    ok, s = timed(lambda b: adapter.submit_store_task(keys[b], objs[b]), store_poller(adapter), n, batch, "store",
                  timeout)
    if not all(x.is_successful() for x in ok):
        raise RuntimeError(f"store: {sum(not x.is_successful() for x in ok)} of {len(ok)} tasks failed")
    r["store_s"] = s
    r["store_gbps"] = kv_gb / s
    missing = [k for k in keys if k not in sizes]
    if missing:
        raise RuntimeError(f"store: the adapter reported no size for {len(missing)} of {n} keys")
    r["stored_bytes"] = sum(sizes[k] for k in keys)
    r["ratio"] = n * chunk_bytes / r["stored_bytes"]

    dkeys = l1.keys(n, "dst")
    dst = l1.reserve(dkeys, layout)
    try:                                                 # LMCache's load, as it is
        for d in dst:
            d.tensor.view(torch.int16).fill_(0x7FC1)     # a NaN pattern: nothing stale passes as loaded
        bitmaps, s = timed(lambda b: adapter.submit_load_task(keys[b], dst[b]), adapter.query_load_result, n, batch,
                           "LMCache load", timeout)
        hits = [b.start + i for b, bm in zip(batches(n, batch), bitmaps) for i in bm.get_indices_list()]
        r["lmcache_load_hits"] = len(hits)
        if len(hits) == n:
            r["lmcache_load_s"] = s
            r["lmcache_load_gbps"] = kv_gb / s
        if hits:
            r["lmcache_load_check"] = compare([objs[i] for i in hits], [dst[i] for i in hits])
    finally:
        l1.release(dkeys)

    if proc is not None:                                 # the same load, the temp narrowed to the stored bytes
        inner = adapter.inner_adapter
        tkeys, dkeys = l1.keys(n, "temp"), l1.keys(n, "dst")
        temps = l1.reserve(tkeys, serialized_layout_desc(layout, proc))
        try:
            dst = l1.reserve(dkeys, layout)
            try:
                for t, k in zip(temps, keys):
                    t.set_used_size(sizes[k])
                for d in dst:
                    d.tensor.view(torch.int16).fill_(0x7FC1)
                bitmaps, s = timed(lambda b: inner.submit_load_task(keys[b], temps[b]), inner.query_load_result, n,
                                   batch, "read", timeout)
                served = sum(len(bm.get_indices_list()) for bm in bitmaps)
                if served != n:
                    raise RuntimeError(f"read: the fs adapter served {served} of {n} keys into buffers of their size")
                r["read_s"] = s
                r["read_gbps"] = kv_gb / s
                ok, s = timed(lambda b: proc.submit_deserialize(temps[b], dst[b], keys[b]),
                              proc.query_deserialize_result, n, batch, "deserialize", timeout)
                if not all(ok):
                    raise RuntimeError(f"deserialize: {ok.count(False)} of {len(ok)} tasks failed (LMCache's log "
                                       "says why)")
                r["deserialize_s"] = s
                r["deserialize_gbps"] = kv_gb / s
                r["load_gbps"] = kv_gb / (r["read_s"] + s)
                r["check"] = compare(objs, dst)
            finally:
                l1.release(dkeys)
        finally:
            l1.release(tkeys)
    else:
        r["load_gbps"] = r.get("lmcache_load_gbps")
        r["check"] = r.get("lmcache_load_check")
    return r


def run_serde(name: str, serde: dict | None, shape: str, l1: L1, src: list, chunk_shape, args, work: Path) -> dict:
    """One serde on one shape: an adapter of its own, a warm-up, then the timed steps."""
    from lmcache.v1.distributed.serde import create_serde_processor

    spec = {"type": "fs", "base_path": str(work / f"{shape}-{name}")}
    if serde is not None:
        spec["serde"] = serde
    adapter, serde_config = build_adapter(spec, l1)
    proc = create_serde_processor(serde_config) if serde_config is not None else None
    sizes = stored_sizes(adapter)
    try:
        t = time.perf_counter()
        steps(adapter, proc, sizes, l1, src, chunk_shape, args.warmup, args.batch, args.timeout)
        warm = time.perf_counter() - t
        r = steps(adapter, proc, sizes, l1, src, chunk_shape, args.chunks, args.batch, args.timeout)
        r["warmup_s"] = warm
        on_disk = sum(f.stat().st_size for f in Path(spec["base_path"]).glob("*.data"))
        r["files_bytes"] = on_disk                      # warm-up and timed chunks: the sizes the adapter reported
        if on_disk != sum(sizes.values()):
            r["files_mismatch"] = f"files hold {on_disk} bytes, the adapter reported {sum(sizes.values())}"
        r["spec"] = spec
        return r
    finally:
        adapter.close()
        if proc is not None:
            proc.close()
        shutil.rmtree(spec["base_path"], ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# The report.

def fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def check_cell(c: dict | None) -> str:
    if not c:
        return "-"
    if c["exact"] == c["of"]:
        return f"yes ({c['of']})"
    return f"NO: {c['of'] - c['exact']} of {c['of']} chunks; {100 * c['values_differ']:.1f}% of values, max rel. err " \
           f"{c['max_rel_err']:.1e}"


def render(rep: dict) -> str:
    lines = ["# LMCache's fs L2 adapter: the gaac serde against no serde and fp8", "",
             f"- date: {rep['date']}", f"- device: {rep['device']}", f"- commit: {rep['commit']}",
             f"- command: `{rep['command']}`",
             f"- LMCache {rep['lmcache']}, torch {rep['torch']}; gaac codes on {rep['gaac_device']}",
             f"- chunks: {rep['chunk_tokens']} tokens of the real SmolLM2-135M-Instruct {rep['kinds']} K/V, "
             f"{rep['chunks']} a serde and shape under distinct keys (after {rep['warmup']} of warm-up), tasks of "
             f"{rep['batch']} keys all in flight; GB/s of BF16 KV; files read back through the page cache", ""]
    rows = []
    for shape, per in rep["shapes"].items():
        for name in SERDES:
            r = per.get(name)
            if r is None:
                continue
            if "error" in r:
                rows.append([shape, name, "error: " + r["error"], *["-"] * 10])
                continue
            n = r["chunks"]
            hits = f"{r['lmcache_load_hits']} of {n}"
            rows.append([shape, name, f"{r['stored_bytes'] / n / 1e6:.3f}", f"{r['ratio']:.3f}x",
                         fmt(r.get("serialize_gbps")), fmt(r["store_gbps"]), hits, fmt(r.get("lmcache_load_gbps")),
                         fmt(r.get("read_gbps")), fmt(r.get("deserialize_gbps")), fmt(r.get("load_gbps")),
                         check_cell(r.get("check"))])
    lines += table(["shape", "serde", "stored MB / chunk", "BF16 / stored", "serialize GB/s", "store GB/s",
                    "LMCache load: keys served", "LMCache load GB/s", "read GB/s (narrowed)", "deserialize GB/s",
                    "load GB/s (read + deserialize)", "bit-exact"], rows)
    lines += ["", "Columns: *serialize*, the serde processor alone; *store*, the adapter's store (serialize and "
              "write); *LMCache load*, the adapter's load as LMCache 0.5.6 runs it (a temp buffer of the estimate's "
              "size, which its fs adapter fills only from a file that long); *read*, the inner fs adapter reading "
              "each key into that buffer narrowed to the bytes stored; *deserialize*, the serde processor alone. "
              "No serde: the load is the adapter's read into the chunk itself.", ""]
    for shape, per in rep["shapes"].items():
        for name, r in per.items():
            if isinstance(r, dict) and "files_mismatch" in r:
                lines.append(f"- {shape} {name}: {r['files_mismatch']}")
    lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="the markdown report (JSON beside it)")
    ap.add_argument("--smoke", action="store_true", help="small: the smollm2 shape, 64-token chunks, 4 of them, CPU")
    ap.add_argument("--data", default=None, help="folder of the SmolLM2 K/V dumps (default: .devdata/lmcache, "
                    ".devdata/kv, ../shared/data/kv)")
    ap.add_argument("--kinds", default="prose", help="the prompts whose chunks are stored (comma-separated)")
    ap.add_argument("--calibrations", type=Path, default=None,
                    help="folder of cal-<shape>.json (default: made in the run's folder from --cal-kind)")
    ap.add_argument("--cal-kind", default="code", help="the prompt the gaac serde's calibration file is made on")
    ap.add_argument("--make-calibrations", action="store_true", help="write the calibrations to --calibrations, stop")
    ap.add_argument("--shapes", default=None, help=f"of {list(SHAPES)} (default: both; smoke: smollm2)")
    ap.add_argument("--serdes", default=",".join(SERDES), help=f"of {list(SERDES)}")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="tokens a chunk (default 256; smoke 64)")
    ap.add_argument("--chunks", type=int, default=None, help="chunks timed per serde and shape (default: 96 of "
                    "smollm2, 24 of llama8b; smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="chunks of warm-up per serde and shape (default 4; "
                    "smoke 1)")
    ap.add_argument("--batch", type=int, default=None, help="keys a task (default 8; smoke 2)")
    ap.add_argument("--device", default=None, help="where the gaac serde codes (default: cuda when there is a GPU)")
    ap.add_argument("--dir", type=Path, default=None, help="where the adapters' files go (default: a temp folder)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a step may take")
    args = ap.parse_args()
    data = find_data(args.data)
    if args.make_calibrations:
        if args.calibrations is None:
            raise SystemExit("--make-calibrations needs --calibrations FOLDER")
        make_calibrations(data, args.calibrations, args.cal_kind)
        return
    if args.out is None:
        raise SystemExit("--out is required")
    smoke = args.smoke
    shapes = (args.shapes or ("smollm2" if smoke else "smollm2,llama8b")).split(",")
    serdes = args.serdes.split(",")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: {s!r} is not one of {list(SHAPES)}")
    for s in serdes:
        if s not in SERDES:
            raise SystemExit(f"--serdes: {s!r} is not one of {list(SERDES)}")
    tokens = args.chunk_tokens or (64 if smoke else 256)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 4)
    args.batch = args.batch or (2 if smoke else 8)
    device = args.device or ("cuda" if torch.cuda.is_available() and not smoke else "cpu")

    import lmcache  # noqa: F401  (before gaac.lmcache, so that a missing LMCache says so here)

    import gaac.lmcache  # noqa: F401  (registers the serde "gaac")

    work = Path(tempfile.mkdtemp(prefix="lmcache-l2-", dir=args.dir))
    cal_dir = args.calibrations or work
    if any(not calibration_path(cal_dir, s).is_file() for s in shapes):
        make_calibrations(data, cal_dir, args.cal_kind)
    kinds = args.kinds.split(",")
    real = [load_dump(data, kind) for kind in kinds]
    rep = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "device": ("CPU (smoke)" if smoke else "CPU") if device == "cpu" else torch.cuda.get_device_name(),
           "commit": commit(), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "lmcache": package_version("lmcache"), "torch": torch.__version__,
           "gaac_device": "the CPU (reference codec)" if device == "cpu" else f"{device} (CUDA codec)",
           "chunk_tokens": tokens, "kinds": "+".join(kinds), "warmup": args.warmup, "batch": args.batch,
           "chunks": args.chunks or ("4" if smoke else "96 (smollm2), 24 (llama8b)"), "shapes": {}}
    try:
        for shape in shapes:
            layers, heads, dim = SHAPES[shape]
            chunks = [c for k, v in real
                      for c in chunks_of(tile_heads(k, layers, heads, dim), tile_heads(v, layers, heads, dim), tokens)]
            if not chunks:
                raise SystemExit(f"no complete {tokens}-token chunk in {kinds}")
            n = args.chunks or (4 if smoke else 96 if shape == "smollm2" else 24)
            chunk_shape = chunks[0].shape
            chunk_bytes = chunks[0].numel() * 2
            # L1: the chunks, and per step at most a temp and a destination per chunk (the estimate is ~1.01x BF16)
            l1 = L1(int(n * chunk_bytes * 3.2) + (256 << 20))
            skeys = l1.keys(n, "src")
            src = l1.reserve(skeys, layout_of(chunk_shape), temporary=False)
            for i, obj in enumerate(src):
                obj.tensor.copy_(chunks[i % len(chunks)])
            l1.manager.finish_write(skeys, tag=TAG)
            l1.manager.reserve_read(skeys)               # held, as a store controller holds what it stores
            serde_specs = {"none": None, "fp8": {"type": "fp8"},
                           "gaac": {"type": "gaac", "calibration": str(calibration_path(cal_dir, shape))},
                           "gaac-embedded": {"type": "gaac", "head_dim": dim}}
            per = rep["shapes"].setdefault(shape, {"chunk_shape": list(chunk_shape), "real_chunks": len(chunks)})
            for name in serdes:
                spec = serde_specs[name]
                if spec is not None and spec["type"] == "gaac" and device != "cpu":
                    spec["device"] = device
                log(f"{shape} {name}: {n} chunks of {list(chunk_shape)} ({chunk_bytes / 1e6:.1f} MB)")
                try:
                    per[name] = run_serde(name, spec, shape, l1, src, chunk_shape, argparse.Namespace(
                        warmup=args.warmup, chunks=n, batch=args.batch, timeout=args.timeout), work)
                    r = per[name]
                    log(f"  stored {r['ratio']:.3f}x, serialize {fmt(r.get('serialize_gbps'))} GB/s, store "
                        f"{fmt(r['store_gbps'])}, LMCache load {r['lmcache_load_hits']}/{n} "
                        f"{fmt(r.get('lmcache_load_gbps'))}, read {fmt(r.get('read_gbps'))}, deserialize "
                        f"{fmt(r.get('deserialize_gbps'))}; {check_cell(r.get('check'))}")
                except Exception as exc:                 # a failed serde is reported, and the others still run
                    import traceback

                    traceback.print_exc()
                    per[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                write(rep, args.out, render)
            l1.manager.finish_read(skeys)
            l1.manager.delete(skeys)
            del src, l1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write(rep, args.out, render)
    print(render(rep))


if __name__ == "__main__":
    main()
