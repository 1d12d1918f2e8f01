"""Fused decode attention on the GAAC cache: correctness and timings on a GPU (gaac.attention).

    python benchmarks/attention.py --check --bench --kv .devdata/kv --out $OUT [--quick]

``--check``  every run draws fresh random queries (and fresh sequence lengths) and compares
             ``AttentionPlan.run`` (GAAC kernel and the BF16 kernel of the same structure) with a
             float64 reference of attention over the *original* dense cache, next to torch's own
             BF16 SDPA on the same inputs; outputs are poisoned (NaN) before each launch and must
             be fully written; the kernel's status word must stay 0.  Cases: the real SmolLM2
             K/V (d=64, 3 KV heads, g=3, every prompt of several layers, self-calibrated), and
             caches built from the real K/V for d=128 (8 KV heads; g = 1, 4, 8; ragged lengths
             from 1 token up) and d=256.
``--bench``  32/8 and 64/8 query/KV heads, d=128, contexts 4K..128K, batch 1, 2, 4, 8: the GAAC
             kernel, our BF16 kernel (same structure, ``plain``), torch SDPA (flash backend, the query
             group folded into the query length) and the floor = bytes the GAAC kernel must read /
             copy bandwidth.  Times are GPU times (CUDA events around back-to-back launches queued
             behind a sleep kernel; median of repeats) of the attention + merge kernels; inputs
             rotate over >= 3x the L2.  Also: the kernel's configurations and calibration epochs at 64K,
             host launch overhead, and CUDA-graph replay of a 32-layer decode step.

Benchmark caches are built from the real K/V: a d=128 "head" is the channels of two real 64-wide
heads side by side (d=256: four), so every exponent statistic is the real model's; the 84
distinct blocks per head are encoded once with the reference codec and copied to every block
position of the cache (distinct addresses, so no cache line is read twice).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIM = "--sim" in sys.argv
if SIM:
    import os

    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import torch  # noqa: E402

import gaac  # noqa: E402
from benchmarks.report import table  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.attention import (AttentionPlan, bf16_to_float, float_to_bf16, kernel_options,  # noqa: E402
                            reference_attention)
from gaac.cache.view import LayerView  # noqa: E402
from gaac.testing import plain_view, view_from_dense, view_to  # noqa: E402

KINDS = ("prose", "code", "math", "list")
L2_BYTES = 60 * 2**20
COPY_TBPS = 4.2
NAN_BITS = 0x7FC1
DEV = "cpu" if SIM else "cuda"        # --sim: a dry run of this script in numba's simulator on tiny sizes


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------
# Data

def load_real(kv_dir: Path):
    """Real K/V: dict kind -> (k, v) uint16 ``[layers, 3, T, 64]``."""
    out = {}
    for kind in KINDS:
        k = np.load(kv_dir / f"smollm2-135m-instruct-q4_1__{kind}__k.npy")
        v = np.load(kv_dir / f"smollm2-135m-instruct-q4_1__{kind}__v.npy")
        out[kind] = (k, v)
    return out


def pseudo_heads(real, kv_heads: int, d: int, first_layer: int = 0):
    """Dense caches ``[kv_heads, T, d]`` (K, V) whose heads are ``d/64`` real heads side by side.

    All four prompts are concatenated along tokens (1344 tokens); slice ``s`` is (layer, head)
    ``divmod(first_layer * 3 + s, 3)``, so the heads are distinct real heads of distinct layers.
    """
    per = d // 64
    ks, vs = [], []
    for i in range(kv_heads):
        kh, vh = [], []
        for j in range(per):
            layer, head = divmod((first_layer * 3 + i * per + j) % 90, 3)
            kh.append(np.concatenate([real[kind][0][layer, head] for kind in KINDS], axis=0))
            vh.append(np.concatenate([real[kind][1][layer, head] for kind in KINDS], axis=0))
        ks.append(np.concatenate(kh, axis=1))
        vs.append(np.concatenate(vh, axis=1))
    return np.stack(ks), np.stack(vs)


SLOT_LINE = [None]       # --slot-line: gaac.calibrate's slot_line for the benchmark caches


def calibrated(k, v):
    """(b3, b4, capacity) for dense ``[H, T, d]`` caches, from gaac.calibrate."""
    cal = gaac.calibrate(k[None], v[None], slot_line=SLOT_LINE[0], show_progress=False)
    return ((cal.b3[0, 0], cal.b3[1, 0]), (cal.b4[0, 0], cal.b4[1, 0]),
            (int(cal.capacity[0, 0]), int(cal.capacity[1, 0])))


class BenchCache:
    """A batch of equal-length sequences built from a unique set of real blocks, on the GPU.

    ``views(r)`` gives ``r`` LayerViews over disjoint slots (rotation), ``dense(r)`` the matching
    BF16 ``[B, H, T, d]`` tensors for torch, ``plain(r)`` BF16 LayerViews for our baseline kernel.
    """

    def __init__(self, real, kv_heads: int, d: int):
        self.kv_heads, self.d = kv_heads, d
        k, v = pseudo_heads(real, kv_heads, d)
        self.unique_tokens = k.shape[1] // L.BLOCK_TOKENS * L.BLOCK_TOKENS
        k, v = k[:, :self.unique_tokens], v[:, :self.unique_tokens]
        self.b3, self.b4, self.capacity = calibrated(k, v)
        self.uview = view_from_dense([k], [v], self.b3, self.b4, self.capacity)   # one sequence, all blocks
        self.k = torch.from_numpy(k.view(np.int16)).to(DEV)
        self.v = torch.from_numpy(v.view(np.int16)).to(DEV)
        self.nu = self.unique_tokens // L.BLOCK_TOKENS

    def _block_ids(self, batch, nblk):
        """Unique block used at (sequence b, block i): shifted per sequence."""
        b = torch.arange(batch, device=DEV)[:, None]
        i = torch.arange(nblk, device=DEV)[None, :]
        return (i + 7 * b) % self.nu                                       # [B, nblk]

    def view(self, batch: int, tokens: int) -> LayerView:
        """A compressed LayerView of ``batch`` sequences of ``tokens`` tokens (a multiple of 16): block
        (b, i) holds unique block ``(i + 7b) % 84``, copied to a slot (or raw tile) of its own."""
        nblk = tokens // L.BLOCK_TOKENS
        per = self.kv_heads * L.tiles_per_head(self.d)
        ub = self._block_ids(batch, nblk)
        slots, raws, tables = [], [], []
        for kind in range(2):
            ut = torch.from_numpy(self.uview.table[kind][0, :self.nu].view(np.uint32).astype(np.int64)).to(DEV)
            ent = ut[ub].reshape(-1)                                        # unique entries, table order
            is_raw = ent >= L.TABLE_RAW_FLAG
            idx = ent & L.TABLE_INDEX_MASK
            us = torch.from_numpy(self.uview.slots[kind]).to(DEV)
            ur = torch.from_numpy(self.uview.raw[kind]).to(DEV)
            slots.append(us[idx[~is_raw]].contiguous() if bool((~is_raw).any()) else us[:1].clone())
            raws.append(ur[idx[is_raw]].contiguous() if bool(is_raw.any()) else ur[:1].clone())
            pos_raw = torch.cumsum(is_raw.to(torch.int64), 0) - 1
            pos_slot = torch.cumsum((~is_raw).to(torch.int64), 0) - 1
            entry = torch.where(is_raw, pos_raw - 2**31, pos_slot)          # raw flag as a negative int32
            tables.append(entry.to(torch.int32).reshape(batch, nblk, per).contiguous())
        tail = torch.zeros((batch, self.kv_heads, L.BLOCK_TOKENS, self.d), dtype=torch.int16, device=DEV)
        dev = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(DEV)  # noqa: E731
        return LayerView(slots=tuple(slots), raw=tuple(raws), table=tuple(tables),
                         b3=tuple(dev(x) for x in self.b3), b4=tuple(dev(x) for x in self.b4),
                         capacity=self.capacity, tail_k=tail, tail_v=tail.clone(),
                         seq_lens=torch.full((batch,), tokens, dtype=torch.int32, device=DEV),
                         kv_heads=self.kv_heads, head_dim=self.d)

    def dense(self, batch: int, tokens: int):
        """BF16 K, V ``[B, H, T, d]`` with the same content as :meth:`view`."""
        nblk = tokens // L.BLOCK_TOKENS
        ub = self._block_ids(batch, nblk)                                   # [B, nblk]
        tok = (ub[:, :, None] * L.BLOCK_TOKENS + torch.arange(L.BLOCK_TOKENS, device=DEV)).reshape(batch, -1)
        k = self.k[:, tok].permute(1, 0, 2, 3).contiguous().view(torch.bfloat16)
        v = self.v[:, tok].permute(1, 0, 2, 3).contiguous().view(torch.bfloat16)
        return k, v

    def plain(self, k, v) -> LayerView:
        """The BF16 cache ``k, v [B, H, T, d]`` as a plain paged view (every tile raw)."""
        batch, heads, tokens, d = k.shape
        nblk = tokens // L.BLOCK_TOKENS
        c, tph = L.tile_channels(d), L.tiles_per_head(d)

        def tiles(x):
            x = x.view(torch.int16).reshape(batch, heads, nblk, L.BLOCK_TOKENS, tph, c)
            return x.permute(0, 2, 1, 4, 3, 5).contiguous().reshape(-1, L.BLOCK_TOKENS, c)
        n = batch * nblk * heads * tph
        table = (torch.arange(n, device=DEV, dtype=torch.int64) - 2**31).to(torch.int32)   # raw flag | index
        table = table.reshape(batch, nblk, heads * tph)
        zeros = torch.zeros((heads, d), dtype=torch.uint8, device=DEV)
        empty = torch.zeros((1, L.TileGeometry(c).slot_bytes(0)), dtype=torch.uint8, device=DEV)
        tail = torch.zeros((batch, heads, L.BLOCK_TOKENS, d), dtype=torch.int16, device=DEV)
        return LayerView(slots=(empty, empty), raw=(tiles(k), tiles(v)), table=(table, table.clone()),
                         b3=(zeros, zeros), b4=(zeros, zeros), capacity=(0, 0), tail_k=tail, tail_v=tail.clone(),
                         seq_lens=torch.full((batch,), tokens, dtype=torch.int32, device=DEV),
                         kv_heads=heads, head_dim=d)


def view_bytes(view: LayerView) -> int:
    """Bytes the kernel must read for a view of full-length sequences: slots and raw tiles referenced
    by the table, and the table entries."""
    total = 0
    for kind in range(2):
        ents = view.table[kind].reshape(-1)
        nraw = int((ents < 0).sum())
        raw_b = 2 * L.BLOCK_TOKENS * view.raw[kind].shape[2]
        total += nraw * raw_b + (ents.numel() - nraw) * view.slots[kind].shape[1] + 4 * ents.numel()
    return total


# ------------------------------------------------------------------------------------------------
# Correctness

def torch_sdpa_ref(q_bits, ks, vs, scale):
    """torch's own BF16 SDPA per sequence (the query group folded into the query length)."""
    outs = []
    for b in range(q_bits.shape[0]):
        k = torch.from_numpy(ks[b].view(np.int16)).to(DEV).view(torch.bfloat16)[None]
        v = torch.from_numpy(vs[b].view(np.int16)).to(DEV).view(torch.bfloat16)[None]
        hk = k.shape[1]
        q = torch.from_numpy(q_bits[b].view(np.int16)).to(DEV).view(torch.bfloat16)
        q = q.reshape(1, hk, -1, q.shape[-1])
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        outs.append(o.reshape(-1, q.shape[-1]).float().cpu().numpy())
    return np.stack(outs)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


CHECK_CONFIGS = [{}]     # AttentionPlan options the checks run the GAAC kernel with (--check --configs)


def check_case(name, ks, vs, b3, b4, cap, g, rng, results, blocks_per_split=None, epochs=None):
    """GAAC and plain kernels vs float64 over the dense caches ``ks[b]``, ``vs[b]`` (uint16 [H, L_b, d]);
    ``epochs``: per-block calibration epochs (``b3``/``b4`` then hold one row per epoch)."""
    hk, _, d = ks[0].shape
    batch = len(ks)
    q = float_to_bf16(rng.standard_normal((batch, hk * g, d)).astype(np.float32))
    scale = 1.0 / math.sqrt(d)
    ref, lse_ref = reference_attention(bf16_to_float(q), [bf16_to_float(x) for x in ks],
                                       [bf16_to_float(x) for x in vs], scale)
    err_torch = rel(torch_sdpa_ref(q, ks, vs, scale), ref)
    row = {"case": name, "d": d, "kv_heads": hk, "g": g, "lens": [int(x.shape[1]) for x in ks], "torch_err": err_torch}
    qd = torch.from_numpy(q.view(np.int16)).to(DEV)
    if not SIM:
        qd = qd.view(torch.bfloat16)
    gaac_view = view_from_dense(ks, vs, b3, b4, cap, rng=rng, epochs=epochs)
    runs = [("gaac" if n == 0 else f"gaac_{label(cfg)}", gaac_view, cfg) for n, cfg in enumerate(CHECK_CONFIGS)
            if d <= 128 or not cfg.get("overlap")]
    for name_, view, cfg in runs + [("plain", plain_view(ks, vs), {})]:
        dv = view_to(view, DEV)
        plan = AttentionPlan(dv, hk * g, plain=name_ == "plain", blocks_per_split=blocks_per_split,
                             **cfg)
        out = torch.full((batch, hk * g, d), NAN_BITS, dtype=torch.int16, device=DEV)
        lse = torch.full((batch, hk * g), float("nan"), device=DEV)
        if SIM:
            out, lse = out.numpy(), lse.numpy()
        plan.run(qd.numpy() if SIM else qd, out=out, lse=lse)
        sync()
        out, lse = (torch.from_numpy(out), torch.from_numpy(lse)) if SIM else (out, lse)
        o = bf16_to_float(out.cpu().numpy()).astype(np.float64)
        written = bool(np.isfinite(o).all() and torch.isfinite(lse).all())
        row[f"{name_}_err"] = rel(o, ref)
        row[f"{name_}_lse_err"] = float(np.abs(lse.cpu().numpy() - lse_ref).max())
        row[f"{name_}_written"] = written
        row[f"{name_}_status"] = int(plan.status[0])
        row[f"{name_}_splits"] = plan.n_work
    ok = all(row[f"{n}_written"] and row[f"{n}_status"] == 0 and row[f"{n}_err"] <= max(2 * err_torch, 2e-3)
             and row[f"{n}_lse_err"] < 1e-3 for n, _, _ in runs + [("plain", None, None)])
    row["ok"] = ok
    results.append(row)
    log(f"  {name:28s} d={d:3d} H={hk} g={g} splits={row['gaac_splits']:4d} err gaac {row['gaac_err']:.2e} "
        f"plain {row['plain_err']:.2e} torch {err_torch:.2e} lse {row['gaac_lse_err']:.1e} "
        f"{'ok' if ok else 'FAIL'}")
    return ok


def run_checks(real, rng):
    results = []
    log("== correctness (fresh random q and lengths each run) ==")
    if SIM:
        k, v = pseudo_heads(real, 2, 128)
        b3, b4, cap = calibrated(k, v)
        ks, vs = [np.ascontiguousarray(k[:, :n]) for n in (21, 3)], [np.ascontiguousarray(v[:, :n]) for n in (21, 3)]
        check_case("sim dry run", ks, vs, b3, b4, cap, 4, rng, results, blocks_per_split=1)
        two = tuple(np.stack([b, b]) for b in b3), tuple(np.stack([b, b]) for b in b4)
        check_case("sim dry run, epochs", ks, vs, *two, cap, 4, rng, results, blocks_per_split=1,
                   epochs=(np.array([[0], [1]], np.int16), np.array([[1], [1]], np.int16)))
        return results
    # Real SmolLM2 caches, calibrated per layer on all four prompts, 9 query heads (g = 3).
    for layer in (0, 13, 29):
        k_all = np.concatenate([real[kind][0][layer] for kind in KINDS], axis=1)
        v_all = np.concatenate([real[kind][1][layer] for kind in KINDS], axis=1)
        b3, b4, cap = calibrated(k_all, v_all)
        ks, vs = [], []
        for kind in KINDS:
            n = int(rng.integers(1, real[kind][0].shape[2] + 1))
            ks.append(np.ascontiguousarray(real[kind][0][layer][:, :n]))
            vs.append(np.ascontiguousarray(real[kind][1][layer][:, :n]))
        check_case(f"real smollm2 layer {layer}", ks, vs, b3, b4, cap, 3, rng, results)
    # Pseudo-heads from the real K/V: d=128 (8 heads) and d=256 (2 heads).
    for d, hk, gs in ((128, 8, (1, 4, 8)), (256, 2, (2,)), (64, 4, (8,))):
        k, v = pseudo_heads(real, hk, d, first_layer=int(rng.integers(0, 30)))
        b3, b4, cap = calibrated(k, v)
        for g in gs:
            lens = [1, int(rng.integers(2, 40)), int(rng.integers(40, 700)), k.shape[1]]
            ks = [np.ascontiguousarray(k[:, :n]) for n in lens]
            vs = [np.ascontiguousarray(v[:, :n]) for n in lens]
            check_case("pseudo-heads ragged", ks, vs, b3, b4, cap, g, rng, results)
            check_case("pseudo-heads 1-block splits", ks, vs, b3, b4, cap, g, rng, results, blocks_per_split=1)
    # Calibration epochs (FORMAT.md 3.5): epoch 0 calibrated on the prose prompt's tokens, epoch 1 on the
    # others; blocks from 48 on (K) / 40 on (V) are encoded with epoch 1, so splits cross the boundary.
    k, v = pseudo_heads(real, 8, 128)
    split = real["prose"][0].shape[2]
    cals = [calibrated(k[:, a:b], v[:, a:b]) for a, b in ((0, split), (split, None))]
    b3 = tuple(np.stack([c[0][kind] for c in cals]) for kind in range(2))
    b4 = tuple(np.stack([c[1][kind] for c in cals]) for kind in range(2))
    cap = tuple(max(c[2][kind] for c in cals) for kind in range(2))
    lens = [k.shape[1], int(rng.integers(700, k.shape[1]))]
    mb = k.shape[1] // L.BLOCK_TOKENS
    epochs = tuple(np.repeat((np.arange(mb) >= first)[None], 2, 0).astype(np.int16) for first in (48, 40))
    for bps in (None, 8):
        check_case("real, 2 calibration epochs", [np.ascontiguousarray(k[:, :n]) for n in lens],
                   [np.ascontiguousarray(v[:, :n]) for n in lens], b3, b4, cap, 4, rng, results,
                   blocks_per_split=bps, epochs=epochs)
    # A long sequence (many splits) from repeated real blocks.
    k, v = pseudo_heads(real, 8, 128)
    b3, b4, cap = calibrated(k, v)
    reps = 6
    kl, vl = np.concatenate([k] * reps, axis=1), np.concatenate([v] * reps, axis=1)
    n = kl.shape[1] - int(rng.integers(0, 16))
    check_case("long (8K tokens)", [np.ascontiguousarray(kl[:, :n])], [np.ascontiguousarray(vl[:, :n])],
               b3, b4, cap, 4, rng, results)
    return results


# ------------------------------------------------------------------------------------------------
# Timing

def sync():
    if not SIM:
        torch.cuda.synchronize()


def gpu_time(calls, iters=20, reps=7, sleep_cycles=None):
    """Median GPU time (us) per call of the callables ``calls`` (used in rotation), launched back to back
    behind a sleep kernel so that host launch cost does not show."""
    for c in calls:
        c()
    if SIM:
        t = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t) * 1e6, []
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = sleep_cycles if sleep_cycles is not None else int(2e9 * iters * 150e-6)
    times = []
    for _ in range(reps):
        torch.cuda._sleep(cycles)
        start.record()
        for i in range(iters):
            calls[i % len(calls)]()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times), times


def graph_time(calls, replays=10, reps=7):
    """Median GPU time (us) per call: the calls (in rotation) captured once in a CUDA graph, whose
    replays are timed with CUDA events (no host launch cost inside; a graph node costs ~1 us)."""
    for c in calls:
        c()
        c()
    if SIM:
        t = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    return statistics.median(times)


def eager_time(calls, n=40):
    """Wall time per call (us) of calls launched back to back from Python, synchronised at the end:
    what a decode step without CUDA graphs pays (the larger of host launch time and GPU time)."""
    for c in calls:
        c()
    sync()
    n = 1 if SIM else n
    t = time.perf_counter()
    for i in range(n):
        calls[i % len(calls)]()
    sync()
    return (time.perf_counter() - t) / n * 1e6


def host_time(call, n=200):
    """Host time per call (us), with the queue far from full."""
    call()
    sync()
    n = 1 if SIM else n
    t = time.perf_counter()
    for _ in range(n):
        call()
    host = (time.perf_counter() - t) / n * 1e6
    sync()
    return host


def rotation(nbytes):
    return max(1, math.ceil(3 * L2_BYTES / max(nbytes, 1)))


def label(cfg: dict, plain: bool = False) -> str:
    """Short name of a kernel configuration (AttentionPlan options, defaults resolved for head_dim 128):
    kernel, stages, overlapped V decode, register cap, planned blocks per SM, blocks per split, whole waves
    (``_waves`` forced, ``_partial`` forced off; neither: the plan's choice), merge without PDL (``_nopdl``).
    The kernel's name is ``full`` (the whole kernel), as in the results' keys."""
    overlap, regs = kernel_options(128, plain, cfg.get("overlap"), cfg.get("max_registers", -1))
    return (f"full_ns{cfg.get('nstage', 2)}" + ("_overlap" if overlap else "") + (f"_r{regs}" if regs else "")
            + (f"_b{cfg['blocks_per_sm']}" if cfg.get("blocks_per_sm") else "")
            + (f"_s{cfg['blocks_per_split']}" if cfg.get("blocks_per_split") else "")
            + {True: "_waves", False: "_partial"}.get(cfg.get("whole_waves"), "")
            + ("_nopdl" if cfg.get("pdl") is False else ""))


def with_epochs_view(view: LayerView, n_epochs: int) -> LayerView:
    """The same cache with ``n_epochs`` calibration epochs whose bases are all the calibration's own, and
    block ``i`` recorded as epoch ``i * n_epochs // blocks``: the kernel reloads a kind's bases at every
    epoch change (the content stays decodable, so the output must be bit-identical to the view's)."""
    import dataclasses

    batch, nblk = view.table[0].shape[:2]
    ep = (torch.arange(nblk, device=DEV) * n_epochs // nblk).to(torch.int16)[None].repeat(batch, 1).contiguous()
    rep = lambda b: b[None].repeat(n_epochs, 1, 1).contiguous()  # noqa: E731
    return dataclasses.replace(view, b3=tuple(rep(b) for b in view.b3), b4=tuple(rep(b) for b in view.b4),
                               epoch=(ep, ep.clone()))


def epoch_timing(views, plans, hq, cfg, q, out, lse):
    """GPU time with 16 and with 256 calibration epochs (256: the per-layer cap) spread evenly over the
    context, against the same views without epochs.  Splits depend on the lengths only, so both plans split
    alike and the kernel reloads a split's bases where a block's epoch changes: the output bits must be the
    same."""
    res = {}
    for n in (16, 256):
        eplans = [AttentionPlan(with_epochs_view(v, n), hq, **cfg) for v in views]
        ref_plans = [AttentionPlan(v, hq, **cfg) for v in views]
        ref_plans[0].run(q, out=out, lse=lse)
        ref = out.clone() if not SIM else out.copy()
        eplans[0].run(q, out=out, lse=lse)
        res[f"epochs{n}_same_output"] = bool((out == ref).all())
        res[f"epochs{n}_us"] = graph_time([lambda p=p: p.run(q, out=out, lse=lse) for p in eplans])
        res[f"epochs{n}_none_us"] = graph_time([lambda p=p: p.run(q, out=out, lse=lse) for p in ref_plans])
        res[f"epochs{n}_status"] = int(eplans[0].status[0])
        res[f"epochs{n}_blocks_per_change"] = views[0].table[0].shape[1] / n
        res[f"epochs{n}_splits"] = (eplans[0].n_work, ref_plans[0].n_work)
        res[f"epochs{n}_blocks_per_split"] = eplans[0].blocks_per_split
        del eplans, ref_plans
    return res


def twin_configs(start: list, candidates) -> list:
    """``start`` plus each candidate's options that apply to the BF16 twin (``overlap`` is the compressed
    kernel's), each configuration once."""
    plain = list(start)
    for c in candidates:
        c = {k: v for k, v in c.items() if k != "overlap"}
        if all(label(c, True) != label(x, True) for x in plain):
            plain.append(c)
    return plain


def bench_config(cache, hq, batch, ctx, configs=({},), with_torch=True, plain_configs=({},), rng=None,
                 with_epochs=False):
    """GPU times (us, CUDA-graph replay) for one shape: GAAC kernel configurations (dicts of
    AttentionPlan options; the first is the headline), our BF16 kernel (same), torch flash; host
    launch time; bytes read."""
    d, hk = cache.d, cache.kv_heads
    res = {"hq": hq, "hk": hk, "d": d, "batch": batch, "ctx": ctx}
    view = cache.view(batch, ctx)
    nbytes = view_bytes(view)
    bf16_bytes = 2 * batch * hk * ctx * d * 2
    res["gaac_bytes"] = nbytes
    res["bf16_bytes"] = bf16_bytes
    res["floor_us"] = nbytes / (COPY_TBPS * 1e12) * 1e6
    res["bf16_floor_us"] = bf16_bytes / (COPY_TBPS * 1e12) * 1e6
    r = 1 if SIM else rotation(nbytes)
    views = [view] + [cache.view(batch, ctx) for _ in range(r - 1)]
    q = torch.from_numpy(float_to_bf16(rng.standard_normal((batch, hq, d)).astype(np.float32)).view(np.int16))
    q = q.numpy() if SIM else q.to(DEV).view(torch.bfloat16)
    out = torch.empty((batch, hq, d), dtype=torch.int16, device=DEV)
    lse = torch.empty((batch, hq), dtype=torch.float32, device=DEV)
    if SIM:
        out, lse = out.numpy(), lse.numpy()
    qb = q if SIM else q.view(torch.int16)
    for n, cfg in enumerate(configs):
        plans = [AttentionPlan(v, hq, **cfg) for v in views]
        res[f"gaac_{label(cfg)}_us"] = graph_time([lambda p=p: p.run(q, out=out, lse=lse) for p in plans])
        res[f"gaac_{label(cfg)}_splits"] = plans[0].n_work
        res[f"gaac_{label(cfg)}_resources"] = plans[0].resources
        if n == 0:
            p0 = plans[0]
            res["gaac_us"] = res[f"gaac_{label(cfg)}_us"]
            res["gaac_config"] = label(cfg)
            res["splits"] = p0.n_work
            res["blocks_per_split"] = p0.blocks_per_split
            res["host_us"] = host_time(lambda: p0.run(q, out=out, lse=lse))
            res["gaac_kernel_only_us"] = graph_time([lambda p=p: p._launch_attention(qb) for p in plans])
            res["merge_us"] = graph_time([lambda: p0._launch_merge(out, lse)])
            res["sleep_timed_us"] = gpu_time([lambda p=p: p.run(q, out=out, lse=lse) for p in plans],
                                             sleep_cycles=int(2e9 * 20 * 200e-6))[0]
            res["eager_us"] = eager_time([lambda p=p: p.run(q, out=out, lse=lse) for p in plans])
            if with_epochs:
                res.update(epoch_timing(views, plans, hq, cfg, q, out, lse))
        del plans
    del views
    if plain_configs or with_torch:
        rb = 1 if SIM else rotation(bf16_bytes)
        dense = [cache.dense(batch, ctx) for _ in range(rb)]
        for n, cfg in enumerate(plain_configs):
            pplans = [AttentionPlan(cache.plain(k, v), hq, plain=True, **cfg) for k, v in dense]
            res[f"plain_{label(cfg, True)}_us"] = graph_time([lambda p=p: p.run(q, out=out, lse=lse) for p in pplans])
            res[f"plain_{label(cfg, True)}_resources"] = pplans[0].resources
            if n == 0:
                res["plain_us"] = res[f"plain_{label(cfg, True)}_us"]
            del pplans
        if with_torch:
            qt = torch.from_numpy(q).view(torch.bfloat16) if SIM else q
            qt = qt.reshape(batch, hk, hq // hk, d)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = SDPBackend.MATH if SIM else SDPBackend.FLASH_ATTENTION
            with sdpa_kernel(backend):
                res["torch_flash_us"] = graph_time([lambda kv=kv: torch.nn.functional.scaled_dot_product_attention(
                    qt, kv[0], kv[1]) for kv in dense])
            # the copy ceiling on the same bytes: a device-to-device copy of the BF16 cache
            res["copy_tbps"] = None if SIM else 2 * bf16_bytes / graph_time(
                [lambda kv=kv: (kv[0].clone(), kv[1].clone()) for kv in dense]) / 1e6
        del dense
    if not SIM:
        torch.cuda.empty_cache()
    return res


def ncu_target(cache, cfg):
    """A few launches of the attention kernel alone (64K, batch 1, 32/8 heads), for ncu."""
    view = cache.view(1, 65536)
    plan = AttentionPlan(view, 32, **cfg)
    q = torch.zeros((1, 32, cache.d), dtype=torch.int16, device=DEV)
    for _ in range(4):
        plan._launch_attention(q)
    torch.cuda.synchronize()


def render(report: dict) -> str:
    """The markdown tables of a results JSON (``--out``'s attention.json)."""
    lines = []
    if report.get("checks"):
        lines += ["## Correctness (fresh random queries and lengths; output poisoned with NaN before each launch)", "",
                  *table(("case", "d", "KV heads", "g", "lengths", "splits", "GAAC err", "BF16-twin err",
                          "torch SDPA err", "LSE err", "written, status 0"),
                         ((c["case"], c["d"], c["kv_heads"], c["g"], c["lens"], c["gaac_splits"],
                           f"{c['gaac_err']:.2e}", f"{c['plain_err']:.2e}", f"{c['torch_err']:.2e}",
                           f"{max(c['gaac_lse_err'], c['plain_lse_err']):.1e}", "yes" if c["ok"] else "NO")
                          for c in report["checks"])), ""]
    rows = report.get("bench", [])
    if rows:
        first = rows[0]
        us = lambda k: f"{first.get(k) or float('nan'):.1f}"  # noqa: E731

        def variant(prefix):
            """The time of the first configuration of a timing variant (key names hold the configuration), in
            the results that hold them (docs/design/attention.md: the breakdown)."""
            return us(next((k for k in first if k.startswith(prefix) and k.endswith("_us")), ""))
        variants = any(k.startswith("gaac_load_only_") for k in first)
        if variants or "epochs16_us" in first:                       # the 64K study (not with --shapes)
            stages = [*([("KV loading (variant that only stages the tiles)", variant("gaac_load_only_"),
                          variant("plain_load_only_")),
                         ("+ ldmatrix, MMAs, softmax on the undecoded bytes", variant("gaac_no_decode_"), "-")]
                        if variants else []),
                      (f"full kernel + merge (the configuration the sweep uses: {first.get('gaac_config')})",
                       us("gaac_us"), us("plain_us")),
                      *([("decode done twice", variant("gaac_decode_twice_"), "-")] if variants else []),
                      ("of which the merge kernel", us("merge_us"), "-"),
                      *[(f"full kernel with {n} calibration epochs (a change every "
                         f"{first.get(f'epochs{n}_blocks_per_change', 0):.0f} blocks; {first.get(f'epochs{n}_splits')} "
                         f"splits; the same cache without epochs and the same splits: "
                         f"{us(f'epochs{n}_same_split_us')} us, output bit-identical: "
                         f"{first.get(f'epochs{n}_same_output')})", us(f"epochs{n}_us"), "-")
                        for n in (16, 256) if first.get(f"epochs{n}_us")],
                      (f"floor: bytes / {COPY_TBPS} TB/s", us("floor_us"), us("bf16_floor_us")),
                      ("torch flash SDPA", "-", us("torch_flash_us"))]
            lines += [f"## Time breakdown ({first['hq']}/{first['hk']} heads, d={first['d']}, batch {first['batch']}, "
                      f"{first['ctx'] // 1024}K tokens; us)", "",
                      *table(("stage", "GAAC", "BF16 twin"), stages), "",
                      "Configurations tried at this shape (us): " + ", ".join(
                          f"{k[5:-3]} {v:.1f}" for k, v in first.items()
                          if k.startswith("gaac_full") and k.endswith("_us")), ""]
        lines += ["## Decode attention, GPU time per call (CUDA-graph replay of attention + merge kernels, us)", "",
                  *table(("heads q/kv", "batch", "context", "GAAC", "BF16 twin", "torch flash", "GAAC floor",
                          "GAAC / floor", "speedup vs flash", "speedup vs BF16 twin", "splits x blocks"),
                         ((f"{r['hq']}/{r['hk']}", r["batch"], f"{r['ctx'] // 1024}K", f"{r['gaac_us']:.1f}",
                           f"{r['plain_us']:.1f}", f"{r['torch_flash_us']:.1f}", f"{r['floor_us']:.1f}",
                           f"{r['gaac_us'] / r['floor_us']:.2f}", f"{r['torch_flash_us'] / r['gaac_us']:.2f}x",
                           f"{r['plain_us'] / r['gaac_us']:.2f}x", f"{r['splits']} x {r['blocks_per_split']}")
                          for r in rows))]
        lines += ["", "## Host launch overhead (us per call)", "",
                  *table(("heads q/kv", "batch", "context", "host time per run() (2 launches)",
                          "eager wall time per call", "GPU time (graph)"),
                         ((f"{r['hq']}/{r['hk']}", r["batch"], f"{r['ctx'] // 1024}K", f"{r['host_us']:.1f}",
                           f"{r.get('eager_us', float('nan')):.1f}", f"{r['gaac_us']:.1f}") for r in rows))]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a few configurations only")
    ap.add_argument("--epochs", action="store_true", help="only the calibration-epoch timing at 64K, batch 1")
    ap.add_argument("--sim", action="store_true", help="dry run in numba's CUDA simulator (tiny sizes)")
    ap.add_argument("--ncu", default=None, help="launch only the kernel of this JSON configuration (for ncu)")
    ap.add_argument("--render", type=Path, default=None, help="print the markdown tables of a results JSON")
    ap.add_argument("--configs", type=json.loads, default=None,
                    help="JSON list of AttentionPlan options to compare at 64K, batch 1 (default: the study's); "
                         "with --shapes, at each of those shapes (the first is the headline)")
    ap.add_argument("--no-sweep", action="store_true", help="--bench: the 64K study only, no sweep")
    ap.add_argument("--shapes", default=None,
                    help="--bench: only these shapes ('q_heads:batch:context,...'), no 64K study; the --configs given or the default")
    ap.add_argument("--slot-line", type=int, default=None,
                    help="--bench: calibrate the benchmark caches with gaac.calibrate(slot_line=...) (128: K and V "
                         "slots of whole 128-byte lines)")
    ap.add_argument("--kv", type=Path, default=Path(__file__).resolve().parents[1] / ".devdata" / "kv")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.render is not None:
        print(render(json.loads(args.render.read_text())), end="")
        return
    rng = np.random.default_rng()
    SLOT_LINE[0] = args.slot_line
    real = load_real(args.kv)
    if args.ncu is not None:
        ncu_target(BenchCache(real, 8, 128), json.loads(args.ncu))
        return
    report = {"device": "simulator" if SIM else torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.epochs:
        shapes = [(16, 1, 64)] if SIM else [(32, 1, 65536), (32, 8, 32768), (32, 1, 131072), (32, 1, 16384)]
        cache = BenchCache(real, 8, 128)
        report["epochs"] = []
        for shape in shapes:
            res = bench_config(cache, *shape, [{}], with_torch=False, plain_configs=(), rng=rng, with_epochs=True)
            log(json.dumps(res))
            report["epochs"].append(res)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "attention-epochs.json").write_text(json.dumps(report, indent=1, default=str))
    if args.check:
        t = time.time()
        if args.configs:
            CHECK_CONFIGS[:] = [{}] + [c for c in args.configs if c]
        report["checks"] = run_checks(real, rng)
        log(f"checks: {sum(r['ok'] for r in report['checks'])}/{len(report['checks'])} ok in {time.time() - t:.0f} s")
    if args.bench:
        rows = []
        cache = BenchCache(real, 8, 128)
        log(f"== timings (capacity K/V {cache.capacity}) ==")
        report["capacity"], report["slot_line"] = list(cache.capacity), args.slot_line
        candidates = args.configs or [{}, {"nstage": 3, "max_registers": None}, {"overlap": False}]
        # The BF16 twin runs every candidate too (its own options: overlap is for the compressed kernel).
        plain_candidates = twin_configs([{}], candidates[1:] + [{"nstage": 3, "max_registers": None}])
        if SIM:
            candidates = [{}, {"overlap": False}]
            plain_candidates = [{}]
            first = (16, 1, 32)
        else:
            first = (32, 1, 65536)
        if args.shapes:
            first, one = None, args.configs or [{}]
            configs = [tuple(int(x) for x in shape.split(":")) for shape in args.shapes.split(",")]
        else:
            # The configuration study at 64K, batch 1; the sweep then uses the fastest full configuration.
            res = bench_config(cache, *first, candidates, plain_configs=plain_candidates, rng=rng, with_epochs=True)
            rows.append(res)
            log(json.dumps(res))
            best = min(candidates, key=lambda c: res[f"gaac_{label(c)}_us"])
            res["gaac_us"] = res[f"gaac_{label(best)}_us"]
            res["gaac_config"] = label(best)
            report["best_config"] = best
            log(f"fastest configuration: {label(best)}")
            one = [best]
            if SIM or args.no_sweep:
                configs = []
            elif args.quick:
                configs = [(32, 1, 16384), (32, 1, 131072), (32, 4, 32768), (64, 1, 65536)]
            else:
                configs = [(hq, b, ctx) for hq in (32, 64) for b in (1, 2, 4, 8)
                           for ctx in (4096, 16384, 32768, 65536, 131072)]
        for hq, b, ctx in configs:
            if (hq, b, ctx) == first:
                continue
            res = bench_config(cache, hq, b, ctx, one, plain_configs=twin_configs([{}], one), rng=rng)
            rows.append(res)
            log(json.dumps(res))
            if args.out:                        # keep what is measured if the run is cut short
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "attention.json").write_text(json.dumps({**report, "bench": rows}, indent=1, default=str))
        report["bench"] = rows
        first = rows[0]
        log("\nconfigurations at " + f"{first['hq']}/{first['hk']} heads, batch {first['batch']}, {first['ctx'] // 1024}K:")
        for k, v in first.items():
            if k.endswith("_us") and v is not None:
                log(f"  {k:40s} {v:8.1f}")
        log("\n| heads q/kv | batch | ctx | GAAC us | BF16 kernel us | torch flash us | floor us | vs flash | vs BF16 |")
        log("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            g = r["gaac_us"]
            log(f"| {r['hq']}/{r['hk']} | {r['batch']} | {r['ctx'] // 1024}K | {g:.1f} | {r.get('plain_us', 0):.1f} | "
                f"{r.get('torch_flash_us', 0):.1f} | {r['floor_us']:.1f} | {r['torch_flash_us'] / g:.2f}x | "
                f"{r['plain_us'] / g:.2f}x |")
        if args.shapes and len(one) > 1:
            log("\n| heads q/kv | batch | ctx | " + " | ".join(f"{label(c)} us (splits)" for c in one) + " |")
            log("|---|---|---|" + "---|" * len(one))
            for r in rows:
                log(f"| {r['hq']}/{r['hk']} | {r['batch']} | {r['ctx'] // 1024}K | " + " | ".join(
                    f"{r[f'gaac_{label(c)}_us']:.1f} ({r[f'gaac_{label(c)}_splits']})" for c in one) + " |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
