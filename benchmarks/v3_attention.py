"""The fragment-order slot layout ("v3r", benchmarks/v3_layout.py) inside the attention kernel, beside today's.

The attention kernel built with :class:`V3RHooks` decodes each slot straight into the MMA fragments of q.k
and p.v (no decoded BF16 tile, no ``ldmatrix``); raw tiles and the tail are read into the same fragments from
L2.  The slots are today's caches re-encoded with the v3r byte order (the same bytes and capacity), and the
base tables are laid out for that decoder.  Nothing here ships: this is the measurement that decides
whether the format moves to that layout.

    NUMBA_ENABLE_CUDASIM=1 python benchmarks/v3_attention.py --sim     # simulator: the checks, tiny shapes
    python benchmarks/v3_attention.py --out DIR                        # device: checks, then times beside v2

Checks (both kernels, the same caches): real K/V with a tail and raw tiles (a small escape capacity), output
poisoned first, against float64 attention within twice torch's own BF16 error; the kernel's status word 0.
Timing: CUDA-graph replay of plan.run (attention and merge), views rotated past L2, v2 and v3r interleaved,
torch SDPA flash on the same content in the same process, and the floors of both caches' bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

SIM = "--sim" in sys.argv
if SIM:
    import os

    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import torch  # noqa: E402

from benchmarks import attention as A  # noqa: E402
from benchmarks import v3_layout as V  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.attention import AttentionPlan, bf16_to_float, float_to_bf16, reference_attention  # noqa: E402
from gaac.cuda.attention import SIMULATOR, KernelHooks, attention_kernel  # noqa: E402
from gaac.testing import view_from_dense, view_to  # noqa: E402

TABLE_K = V.K_STRIDE * 3 // 4                    # K base table: rows b3, b4, 0 (words)
TABLE_V = V.V_ROW * 9 // 4                       # V base table: rows 3 m_lo + m_hi (words)
TABLE_WORDS = -(-(TABLE_K + TABLE_V) // 4) * 4


class V3RFragments:
    """The v3r decoder as :class:`gaac.cuda.attention.KernelHooks` ``fragments`` (with its rare code)."""
    k_words, v_words, table_words = TABLE_K, TABLE_V, TABLE_WORDS
    tags, decode_k, decode_v = (staticmethod(f) for f in V.decoder_v3(rare=True, raw_layout="lane"))


class V3RHooks(KernelHooks):
    fragments = V3RFragments


def build_v3r(head_dim, plain, nstage, stage_bytes, overlap, max_registers):
    return attention_kernel(head_dim, plain, nstage, stage_bytes, overlap, max_registers, V3RHooks)


# ------------------------------------------------------------------------------------------------
# A v2 view re-encoded as v3r (host).

def _np(x):
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


def unswizzled(slot: np.ndarray) -> np.ndarray:
    """A v3r slot as stored for today's staging copy (:func:`gaac.cuda.tile_decoder.stage_slot_fn`), which puts
    sign+mantissa chunk ``c`` at ``c ^ ((c >> 3) & 7)``: stored chunk ``c`` holds v3r chunk ``c ^ ((c >> 3) & 7)``
    (an involution), so the staged bytes are in v3r's order.  (A v3r kernel would copy without the swizzle, at
    the same cost a copy; the stored format of a v3r cache is :func:`benchmarks.v3_layout.encode_v3`'s.)"""
    out = slot.copy()
    c = np.arange(V.C)
    out[:16 * V.C].reshape(V.C, 16)[:] = slot[:16 * V.C].reshape(V.C, 16)[c ^ ((c >> 3) & 7)]
    return out


def v3r_view(view, ks, vs):
    """``view`` (host, epoch 0, built from the dense ``ks[b]``/``vs[b]`` ``[Hkv, L_b, 128]``) with every slot
    re-encoded in the v3r order at the same index; raw tiles, tables and tails unchanged."""
    hk, d = view.kv_heads, view.head_dim
    assert d == 128 and view.epoch is None
    slots = []
    for kind, xs in enumerate((ks, vs)):
        old = _np(view.slots[kind])
        new = np.zeros_like(old)
        table = _np(view.table[kind]).astype(np.int64)
        b3, b4 = (_np(x) for x in view.bases(kind))
        for b, x in enumerate(xs):
            for blk in range(x.shape[1] // L.BLOCK_TOKENS):
                for h in range(hk):
                    e = int(table[b, blk, h])
                    if e < 0:
                        continue
                    tile = x[h, L.BLOCK_TOKENS * blk:L.BLOCK_TOKENS * (blk + 1)]
                    s = V.encode_v3(kind, tile, b3[h], b4[h], int(view.capacity[kind]), "lane")
                    if s is None:
                        raise SystemExit(f"a v3r slot overflows where the v2 slot fits (kind {kind}, block {blk})")
                    new[e, :len(s)] = unswizzled(np.frombuffer(s, np.uint8))
        slots.append(new)
    return dataclasses.replace(view, slots=tuple(slots))


def v3r_tables(view) -> np.ndarray:
    """``[1, Hkv, TABLE_WORDS]`` uint32: per head, the K table of K's bases, then the V table of V's."""
    out = np.zeros((1, view.kv_heads, TABLE_WORDS), np.uint32)
    (b3k, b4k), (b3v, b4v) = (tuple(_np(x) for x in view.bases(kind)) for kind in range(2))
    for h in range(view.kv_heads):
        kt, _ = V.bases_v3(b3k[h], b4k[h])
        _, vt = V.bases_v3(b3v[h], b4v[h])
        out[0, h, :TABLE_K] = kt[:TABLE_K]
        out[0, h, TABLE_K:TABLE_K + TABLE_V] = vt[:TABLE_V]
    return out


def v3r_plan(view, tables, q_heads: int, **options) -> AttentionPlan:
    """An AttentionPlan of the v3r kernel over a v3r view, launched with the v3r base tables in place of the
    plan's pair words (the kernel's ``bases`` argument)."""
    plan = AttentionPlan(view, q_heads, build_kernel=build_v3r, **options)
    if SIMULATOR:
        tab = tables.reshape(-1).view(np.uint8)        # the simulator's copies index bytes
    else:
        tab = torch.from_numpy(tables.view(np.int32).reshape(-1)).to(view.slots[0].device)
    plan._bases = tab
    arrays = list(plan._arrays)
    arrays[8] = tab
    plan._arrays = tuple(arrays)
    if not SIMULATOR:
        plan._pack_main()
    return plan


# ------------------------------------------------------------------------------------------------
# Checks.

def check(real, rng, lens, hk: int, g: int, cap=None) -> dict:
    """v2 and v3r kernels on real K/V of lengths ``lens`` against float64 (``cap``: escape capacities, small
    ones to make raw tiles)."""
    d = 128
    k, v = A.pseudo_heads(real, hk, d)
    ks = [np.ascontiguousarray(np.roll(k, -37 * b, axis=1)[:, :n]) for b, n in enumerate(lens)]
    vs = [np.ascontiguousarray(np.roll(v, -37 * b, axis=1)[:, :n]) for b, n in enumerate(lens)]
    b3, b4, capacity = A.calibrated(k, v)
    capacity = capacity if cap is None else cap
    view2 = view_from_dense(ks, vs, b3, b4, capacity, rng=rng)
    view3 = v3r_view(view2, ks, vs)
    tables = v3r_tables(view2)
    q = float_to_bf16(rng.standard_normal((len(lens), hk * g, d)).astype(np.float32))
    scale = 1.0 / np.sqrt(d)
    ref, lse_ref = reference_attention(bf16_to_float(q), [bf16_to_float(x) for x in ks],
                                       [bf16_to_float(x) for x in vs], scale)
    err_torch = A.rel(A.torch_sdpa_ref(q, ks, vs, scale), ref)
    qd = torch.from_numpy(q.view(np.int16))
    qd = qd.numpy() if SIM else qd.to("cuda").view(torch.bfloat16)
    row = {"lens": list(lens), "kv_heads": hk, "g": g, "capacity": list(map(int, capacity)),
           "raw_tiles": [int(_np(view2.raw[kind]).shape[0]) for kind in range(2)], "torch_err": err_torch}
    for name, view in (("v2", view2), ("v3r", view3)):
        dv = view if SIM else view_to(view, "cuda")
        plan = (AttentionPlan(dv, hk * g) if name == "v2" else
                v3r_plan(dv, tables, hk * g))
        out = np.full((len(lens), hk * g, d), A.NAN_BITS, np.int16)
        lse = np.full((len(lens), hk * g), np.nan, np.float32)
        if not SIM:
            out, lse = torch.from_numpy(out).cuda(), torch.from_numpy(lse).cuda()
        plan.run(qd, out=out, lse=lse)
        A.sync()
        o = bf16_to_float(_np(out)).astype(np.float64)
        row[f"{name}_err"] = A.rel(o, ref)
        row[f"{name}_lse_err"] = float(np.abs(_np(lse) - lse_ref).max())
        row[f"{name}_written"] = bool(np.isfinite(o).all() and np.isfinite(_np(lse)).all())
        row[f"{name}_status"] = int(_np(plan.status)[0])
    row["ok"] = all(row[f"{n}_written"] and row[f"{n}_status"] == 0 and row[f"{n}_lse_err"] < 1e-3
                    and row[f"{n}_err"] <= max(2 * err_torch, 2e-3) for n in ("v2", "v3r"))
    A.log(f"  lens {lens} H={hk} g={g} raw tiles {row['raw_tiles']}: err v2 {row['v2_err']:.2e} "
          f"v3r {row['v3r_err']:.2e} torch {err_torch:.2e}, status {row['v2_status']}/{row['v3r_status']} "
          f"{'ok' if row['ok'] else 'FAIL'}")
    return row


def checks(real, rng) -> list[dict]:
    if SIM:
        return [check(real, rng, [40], 1, 2, cap=(32, 32)), check(real, rng, [64, 23], 1, 2)]
    return [check(real, rng, [1000, 517], 8, 4), check(real, rng, [700, 333, 96], 8, 4, cap=(64, 64)),
            check(real, rng, [2048], 8, 8, cap=(48, 48))]


# ------------------------------------------------------------------------------------------------
# Timing.

def timing(real, rng, shapes, slot_line) -> list[dict]:
    A.SLOT_LINE[0] = slot_line
    cache = A.BenchCache(real, 8, 128)
    k, v = A.pseudo_heads(real, 8, 128)
    n = cache.unique_tokens
    t0 = time.time()
    uview3 = v3r_view(cache.uview, [k[:, :n]], [v[:, :n]])
    tables = v3r_tables(cache.uview)
    A.log(f"  v3r re-encode of {cache.nu} unique blocks x 8 heads x 2 kinds: {time.time() - t0:.1f} s "
          f"(slot_line {slot_line}, capacity {cache.capacity})")
    rows = []
    for hq, batch, ctx in shapes:
        view = cache.view(batch, ctx)
        nbytes = A.view_bytes(view)
        r = 1 if SIM else A.rotation(nbytes)
        views2 = [view] + [cache.view(batch, ctx) for _ in range(r - 1)]
        u2 = cache.uview
        cache.uview = uview3
        views3 = [cache.view(batch, ctx) for _ in range(r)]
        cache.uview = u2
        q = torch.from_numpy(float_to_bf16(rng.standard_normal((batch, hq, 128)).astype(np.float32)).view(np.int16))
        q = q.numpy() if SIM else q.to("cuda").view(torch.bfloat16)
        out = torch.empty((batch, hq, 128), dtype=torch.int16, device=A.DEV)
        lse = torch.empty((batch, hq), dtype=torch.float32, device=A.DEV)
        if SIM:
            out, lse = out.numpy(), lse.numpy()
        p2 = [AttentionPlan(x, hq) for x in views2]
        p3 = [v3r_plan(x, tables, hq) for x in views3]
        res = {"hq": hq, "batch": batch, "ctx": ctx, "gaac_bytes": nbytes, "rotation": r,
               "floor_us": nbytes / (A.COPY_TBPS * 1e12) * 1e6,
               "bf16_floor_us": 2 * batch * 8 * ctx * 128 * 2 / (A.COPY_TBPS * 1e12) * 1e6,
               "splits_v2": p2[0].n_work, "splits_v3r": p3[0].n_work,
               "resources_v2": p2[0].resources, "resources_v3r": p3[0].resources}
        # agreement of the two kernels on this content (the same values, channels summed in another order)
        o2 = p2[0].run(q, out=out.clone() if not SIM else out.copy())
        o3 = p3[0].run(q, out=out.clone() if not SIM else out.copy())
        A.sync()
        a2, a3 = (bf16_to_float(_np(x.view(torch.int16) if not SIM else x)).astype(np.float64) for x in (o2, o3))
        res["v3r_vs_v2_rel"] = A.rel(a3, a2)
        res["status"] = [int(_np(p2[0].status)[0]), int(_np(p3[0].status)[0])]
        t2, t3 = [], []
        for _ in range(3):                    # interleaved
            t2.append(A.graph_time([lambda p=p: p.run(q, out=out, lse=lse) for p in p2]))
            t3.append(A.graph_time([lambda p=p: p.run(q, out=out, lse=lse) for p in p3]))
        res["v2_us"], res["v3r_us"] = float(np.median(t2)), float(np.median(t3))
        res["v2_runs"], res["v3r_runs"] = t2, t3
        del p2, p3, views2, views3
        if not SIM:
            dense = [cache.dense(batch, ctx) for _ in range(A.rotation(2 * batch * 8 * ctx * 256))]
            qt = q.reshape(batch, 8, hq // 8, 128)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                res["torch_flash_us"] = A.graph_time([lambda kv=kv: torch.nn.functional.scaled_dot_product_attention(
                    qt, kv[0], kv[1]) for kv in dense])
            del dense
            torch.cuda.empty_cache()
        A.log(f"  {hq}/8 heads, batch {batch}, {ctx}: v2 {res['v2_us']:.1f} us, v3r {res['v3r_us']:.1f} us "
              f"({res['v3r_us'] / res['v2_us']:.3f}x), torch flash {res.get('torch_flash_us', float('nan')):.1f}, "
              f"floor {res['floor_us']:.1f}; v3r vs v2 rel {res['v3r_vs_v2_rel']:.1e}, status {res['status']}")
        rows.append(res)
    return rows


NCU_SECTIONS = ("SpeedOfLight", "WarpStateStats", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis",
                "InstructionStats", "LaunchStats", "Occupancy")
NCU_PICK = ("launch__registers_per_thread", "gpu__time_duration.sum", "smsp__inst_executed.sum",
            "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
            "sm__throughput.avg.pct_of_peak_sustained_elapsed", "smsp__issue_active.avg.pct_of_peak_sustained_active")


def ncu_child(real, rng) -> None:
    """ncu's target: 64K, batch 1, 32/8 heads (slot_line 128): today's kernel launched 3 times, then v3r's."""
    A.SLOT_LINE[0] = 128
    cache = A.BenchCache(real, 8, 128)
    k, v = A.pseudo_heads(real, 8, 128)
    n = cache.unique_tokens
    uview3, tables = v3r_view(cache.uview, [k[:, :n]], [v[:, :n]]), v3r_tables(cache.uview)
    p2 = AttentionPlan(cache.view(1, 65536), 32)
    cache.uview = uview3
    p3 = v3r_plan(cache.view(1, 65536), tables, 32)
    qb = torch.from_numpy(float_to_bf16(rng.standard_normal((1, 32, 128)).astype(np.float32)).view(np.int16)).cuda()
    for p in (p2, p3):
        for _ in range(3):
            p._launch_attention(qb)
        torch.cuda.synchronize()
    A.log(f"ncu child: 3 launches each, status {int(p2.status[0])}/{int(p3.status[0])}")


def ncu_pass(out: Path) -> dict:
    """The attention kernels of :func:`ncu_child` under ncu (the third launch of each): the raw metrics of
    ``NCU_SECTIONS`` to ``out/v3-attention-ncu.csv``, a few of them returned per kernel."""
    import csv
    import os
    import subprocess

    ncu = V.find_ncu()
    if ncu is None:
        return {"error": "no ncu"}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [ncu, "--csv", "--page", "raw", "--clock-control", "none", "--kernel-name-base", "mangled", "-k", "regex:attention",
           "--launch-skip", "2", "--launch-count", "4"]
    for sec in NCU_SECTIONS:
        cmd += ["--section", sec]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--ncu-child", "--kv-dir", KV_DIR[0]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    text = proc.stdout
    (out / "v3-attention-ncu.csv").write_text(text + "\n# stderr\n" + proc.stderr[-4000:])
    rows = [line for line in text.splitlines() if line.startswith('"')]
    recs = list(csv.DictReader(rows))[1:]            # (the first row after the header holds the units)
    if len(recs) < 4:
        return {"error": f"ncu exit {proc.returncode}, {len(recs)} kernels: {text[-500:]} {proc.stderr[-500:]}"}
    res = {}
    for name, rec in (("v2", recs[0]), ("v3r", recs[-1])):
        res[name] = {m: rec.get(m) for m in NCU_PICK}
        res[name].update({m: rec[m] for m in rec if "issue_stalled" in m and m.endswith("per_warp_active.pct")})
        res[name].update({m: rec[m] for m in rec if m.startswith("smsp__average_warps_issue_stalled")
                          and m.endswith("_per_issue_active.ratio")})
    return res


KV_DIR = [".devdata/kv"]


def report(meta, check_rows, timing_rows) -> str:
    lines = ["# The v3r slot layout inside the attention kernel (benchmarks/v3_attention.py)", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "## Checks (float64 reference; output poisoned first)", "",
              "| lengths | KV heads | g | capacity K/V | raw tiles K/V | torch err | v2 err | v3r err | status v2/v3r | ok |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in check_rows:
        lines.append(f"| {r['lens']} | {r['kv_heads']} | {r['g']} | {r['capacity']} | {r['raw_tiles']} | "
                     f"{r['torch_err']:.2e} | {r['v2_err']:.2e} | {r['v3r_err']:.2e} | "
                     f"{r['v2_status']}/{r['v3r_status']} | {'yes' if r['ok'] else 'NO'} |")
    lines += ["", "## Attention + merge, CUDA-graph replay (us, median of 3 interleaved runs of 7 x 10 replays)", "",
              "| slot_line | q/kv heads | batch | context | v2 (today) | v3r | v3r / v2 | torch flash | v2 speedup over flash | "
              "v3r speedup over flash | floor (cache bytes) | BF16 floor | registers v2 / v3r | blocks/SM v2 / v3r |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in timing_rows:
        f = r.get("torch_flash_us")
        s2 = "" if f is None else f"{f / r['v2_us']:.3f}x"
        s3 = "" if f is None else f"{f / r['v3r_us']:.3f}x"
        reg = lambda x: (x or {}).get("registers", "?")
        bps = lambda x: (x or {}).get("blocks_per_sm", "?")
        lines.append(f"| {r['slot_line']} | {r['hq']}/8 | {r['batch']} | {r['ctx']} | {r['v2_us']:.1f} | "
                     f"{r['v3r_us']:.1f} | {r['v3r_us'] / r['v2_us']:.3f} | {f if f is None else round(f, 1)} | "
                     f"{s2} | {s3} | "
                     f"{r['floor_us']:.1f} | {r['bf16_floor_us']:.1f} | {reg(r['resources_v2'])} / "
                     f"{reg(r['resources_v3r'])} | {bps(r['resources_v2'])} / {bps(r['resources_v3r'])} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sim", action="store_true", help="simulator: the checks on tiny shapes")
    ap.add_argument("--kv-dir", default=".devdata/kv")
    ap.add_argument("--shapes", default="32:1:65536,32:1:131072,32:1:16384,32:8:16384,64:1:65536",
                    help="q_heads:batch:context,... (8 KV heads of 128)")
    ap.add_argument("--slot-lines", default="none,128", help="gaac.calibrate slot_line values to time")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--ncu", action="store_true", help="only ncu's raw metrics of both kernels at 64K, batch 1")
    ap.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="DIR: DIR/v3-attention-h200.md and .json")
    args = ap.parse_args()
    t0 = time.time()
    KV_DIR[0] = args.kv_dir
    real = A.load_real(Path(args.kv_dir))
    rng = np.random.default_rng(3)
    if args.ncu_child:
        return ncu_child(real, rng)
    if args.ncu:
        out = Path(args.out or ".")
        out.mkdir(parents=True, exist_ok=True)
        res = ncu_pass(out)
        (out / "v3-attention-ncu.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    A.log("checks:")
    check_rows = [] if args.no_checks else checks(real, rng)
    timing_rows = []
    if not SIM:
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
        for sl in args.slot_lines.split(","):
            slot_line = None if sl == "none" else int(sl)
            A.log(f"timing, slot_line {slot_line}:")
            for row in timing(real, rng, shapes, slot_line):
                row["slot_line"] = slot_line
                timing_rows.append(row)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": "simulator" if SIM else torch.cuda.get_device_name(),
            "commit": V.git_commit(),
            "command": "python benchmarks/v3_attention.py " + " ".join(sys.argv[1:]),
            "versions": f"torch {torch.__version__}, numpy {np.__version__}, Python {platform.python_version()}",
            "wall": f"{time.time() - t0:.0f} s"}
    text = report(meta, check_rows, timing_rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "v3-attention-h200.md").write_text(text)
        (out / "v3-attention-h200.json").write_text(json.dumps(
            {"meta": meta, "checks": check_rows, "timing": timing_rows}, indent=1, default=str))
    if not all(r["ok"] for r in check_rows):
        raise SystemExit("a check failed")


if __name__ == "__main__":
    main()
