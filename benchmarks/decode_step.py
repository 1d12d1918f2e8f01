"""One decode step of a Llama-3.1-8B-shaped model: BF16 KV cache + torch flash SDPA vs the GAAC cache + fused kernel.

    python benchmarks/decode_step.py --out $OUT/decode-step-h200.md [--equal-memory] [--budget-gib 60]
    python benchmarks/decode_step.py --smoke --out /tmp/decode-step-smoke.md      # CPU, numba's simulator

The model has **random BF16 weights** (seeded) in the shape of Llama-3.1-8B: 32 layers, hidden 4096, 32 query /
8 KV heads of 128, SwiGLU MLP 14336, RMSNorm, RoPE theta 500000, vocab 128256 (16 GB of weights).  Its decode step
is written in plain torch (HF eager is host-bound), one new token per sequence: per layer RMSNorm, one fused QKV
GEMM, RoPE, attention over the cache, O projection, RMSNorm, gate/up GEMM, SiLU, down GEMM; final RMSNorm and
lm_head.  Three attention variants run inside the same step:

* ``default``: a contiguous BF16 K/V ``[B, 8, T, 128]`` per layer and
  ``torch.nn.functional.scaled_dot_product_attention`` under ``sdpa_kernel(FLASH_ATTENTION)``, the 4 query heads
  of a KV head folded into the query length (as benchmarks/attention.py does);
* ``gaac``: a ``gaac.PagedKVCache`` on the GPU (prefilled with the CUDA codec), its ``layer_view(l)`` and one
  ``gaac.attention.AttentionPlan`` per layer (built before timing), ``plan.run(q, out=, lse=)``;
* ``skip``: no attention at all (the query stands in for its output), to show what share attention takes.

The K/V are real: the SmolLM2-135M dumps (``[30 layers, 3 KV heads, tokens, 64]``, four prompts, 1344 tokens) give
each (layer, KV head) of the 8B shape a 128-wide head made of two real 64-wide heads side by side; tokens are the
1344 real tokens tiled to the context (sequence ``b`` starts ``112 b`` tokens later, so batch rows differ).  The
new token's K/V are computed (the QKV GEMM and RoPE run) but not appended: every timed replay is the same step
over the same ``T`` cached tokens in both variants (an append is a 2 KB copy per layer for BF16; for GAAC a tail
write, plus one block encode every 16 steps -- excluded from both).

Each variant's whole step (32 layers) is captured in one CUDA graph; replays are timed one by one with CUDA events
(median of ``--replays``).  Eager (no graph) time = wall time of back-to-back steps, synchronised at the end.
Correctness: once per context, the default and GAAC steps' logits on the same token (same weights, same cached
values) and layer 0's attention output against float32 attention.

``--equal-memory``: in a KV budget (``--budget-gib``, default 60), how many ``--eq-context`` (64K) sequences fit
as BF16 and as GAAC (resident bytes per sequence as measured by ``PagedKVCache.memory()``), and the aggregate
tokens/s of each variant's graph-captured step at that batch (every sequence in memory of its own).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import gaac  # noqa: E402
from benchmarks.report import commit, table, write  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.attention import AttentionPlan  # noqa: E402
from gaac.capture import package_version  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
BACKEND = SDPBackend.MATH if SMOKE else SDPBackend.FLASH_ATTENTION
KINDS = ("prose", "code", "math", "list")
MODEL = "smollm2-135m-instruct-q4_1"
GIB = 2**30
SHIFT = 7 * L.BLOCK_TOKENS            # token offset between the batch rows' content


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def gpu_mem() -> str:
    if SMOKE:
        return "cpu"
    return (f"GPU {torch.cuda.memory_allocated() / GIB:.1f} GiB allocated, "
            f"peak {torch.cuda.max_memory_allocated() / GIB:.1f} GiB")


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    vocab: int = 128256
    theta: float = 500000.0
    eps: float = 1e-5

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    def params(self) -> int:
        per = (self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim + self.q_heads * self.head_dim
               * self.hidden + 3 * self.hidden * self.mlp + 2 * self.hidden)
        return self.layers * per + 2 * self.vocab * self.hidden + self.hidden

    def kv_bytes(self, tokens: int) -> int:
        """BF16 K+V bytes of one sequence of ``tokens`` tokens over all layers."""
        return 2 * self.layers * self.kv_heads * tokens * self.head_dim * 2


LLAMA_8B = Shape()
SMOKE_SHAPE = Shape(layers=2, hidden=512, q_heads=4, kv_heads=2, head_dim=128, mlp=768, vocab=1000)


# ------------------------------------------------------------------------------------------------
# The model: random BF16 weights and a plain-torch decode step.

class Model:
    def __init__(self, s: Shape, seed: int = 0):
        self.s = s
        gen = torch.Generator(device=DEV).manual_seed(seed)

        def rand(*shape, std):
            return torch.randn(shape, generator=gen, device=DEV, dtype=torch.bfloat16).mul_(std)

        def norm():
            return (1 + rand(s.hidden, std=0.1))

        d = s.head_dim
        self.embed = rand(s.vocab, s.hidden, std=1.0)
        self.ln1, self.ln2, self.wqkv, self.wo, self.wgu, self.wd = [], [], [], [], [], []
        for _ in range(s.layers):
            self.ln1.append(norm())
            self.wqkv.append(rand((s.q_heads + 2 * s.kv_heads) * d, s.hidden, std=s.hidden ** -0.5))
            self.wo.append(rand(s.hidden, s.q_heads * d, std=(s.q_heads * d) ** -0.5))
            self.ln2.append(norm())
            self.wgu.append(rand(2 * s.mlp, s.hidden, std=s.hidden ** -0.5))
            self.wd.append(rand(s.hidden, s.mlp, std=s.mlp ** -0.5))
        self.lnf = norm()
        self.lm_head = rand(s.vocab, s.hidden, std=s.hidden ** -0.5)
        self.cos = self.sin = None
        self.set_position(0)

    def set_position(self, pos: int) -> None:
        """RoPE (HF Llama convention, rotate_half) of the new token at position ``pos``; static buffers."""
        d = self.s.head_dim
        inv = 1.0 / (self.s.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.cat([pos * inv, pos * inv])
        cos, sin = ang.cos().to(torch.bfloat16).to(DEV), ang.sin().to(torch.bfloat16).to(DEV)
        if self.cos is None:
            self.cos, self.sin = cos, sin
        else:
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def rmsnorm(self, x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.s.eps)).to(torch.bfloat16)

    def rope(self, x):
        h = x.shape[-1] // 2
        rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
        return x * self.cos + rot * self.sin

    def step(self, ids, attend):
        """Logits ``[B, vocab]`` of one decode step for tokens ``ids [B]``; ``attend(layer, q [B, Hq, D])``."""
        s = self.s
        b, d = ids.shape[0], s.head_dim
        x = self.embed[ids]
        for i in range(s.layers):
            h = self.rmsnorm(x, self.ln1[i])
            q, k, _v = F.linear(h, self.wqkv[i]).split([s.q_heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
            q = self.rope(q.view(b, s.q_heads, d))             # a new contiguous tensor
            self.rope(k.view(b, s.kv_heads, d))                 # the new token's K (not appended; see docstring)
            o = attend(i, q)
            x = x + F.linear(o.reshape(b, s.q_heads * d), self.wo[i])
            h = self.rmsnorm(x, self.ln2[i])
            gate, up = F.linear(h, self.wgu[i]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, self.wd[i])
        return F.linear(self.rmsnorm(x, self.lnf), self.lm_head)


# ------------------------------------------------------------------------------------------------
# Real K/V content and the two caches.

def find_data(arg: str | None) -> Path:
    cands = [Path(arg)] if arg else [ROOT / ".devdata" / "kv", ROOT.parent / "shared" / "data" / "kv",
                                     ROOT / "shared" / "data" / "kv"]
    for c in cands:
        if (c / f"{MODEL}__prose__k.npy").is_file():
            return c
    raise SystemExit(f"no SmolLM2 K/V dumps in {[str(c) for c in cands]} (pass --data; on the H200 carry .devdata)")


def real_source(data: Path, s: Shape):
    """Unique real K/V per layer of the target shape: uint16 ``[layers, kv_heads, 1344, head_dim]`` (K, V).

    Head ``h`` of layer ``l`` is the channels of ``head_dim / 64`` real (layer, head) slices side by side, slice
    ``j`` being real (layer, head) ``divmod((l * kv_heads + h) * per + j) % 90, 3)``; tokens are the four prompts
    concatenated (each a multiple of 16 tokens, so blocks never straddle two prompts).
    """
    real = {}
    for kind in KINDS:
        real[kind] = tuple(np.load(data / f"{MODEL}__{kind}__{w}.npy") for w in "kv")
    rl, rh, _, rd = real[KINDS[0]][0].shape
    per = s.head_dim // rd
    cat = [np.concatenate([real[kind][w] for kind in KINDS], axis=2) for w in range(2)]    # [30, 3, 1344, 64]
    out = []
    for w in range(2):
        x = np.empty((s.layers, s.kv_heads, cat[w].shape[2], s.head_dim), np.uint16)
        for layer in range(s.layers):
            for h in range(s.kv_heads):
                for j in range(per):
                    a, b = divmod(((layer * s.kv_heads + h) * per + j) % (rl * rh), rh)
                    x[layer, h, :, j * rd:(j + 1) * rd] = cat[w][a, b]
        out.append(x)
    return out[0], out[1]


class Source:
    """The unique real tokens on the device and the dense per-layer caches tiled from them."""

    def __init__(self, k: np.ndarray, v: np.ndarray):
        self.k = torch.from_numpy(k.view(np.int16)).to(DEV)
        self.v = torch.from_numpy(v.view(np.int16)).to(DEV)
        self.unique = k.shape[2]

    def dense(self, layer: int, batch: int, tokens: int):
        """BF16 K, V ``[batch, kv_heads, tokens, head_dim]`` of ``layer``: token t of row b is unique token
        ``(t + 112 b) % 1344``."""
        t = torch.arange(tokens, device=DEV)[None] + SHIFT * torch.arange(batch, device=DEV)[:, None]
        idx = (t % self.unique).reshape(-1)
        out = []
        for x in (self.k, self.v):
            y = x[layer].index_select(1, idx).view(x.shape[1], batch, tokens, x.shape[3])
            out.append(y.permute(1, 0, 2, 3).contiguous().view(torch.bfloat16))
        return out[0], out[1]


def build_gaac(cal, s: Shape, layer_kv, batch: int, tokens: int, raw_frac: float):
    """A PagedKVCache of ``batch`` sequences of ``tokens`` tokens, prefilled layer by layer from ``layer_kv(l)``.

    The slot pool has one slot per tile (so it never grows); the raw pool ``raw_frac`` of that (grows if short).
    Calibration epochs stay off where the cache has them (``adapt=False``): the calibration saw all of the content.
    Prefill goes in chunks of at most 128K tokens per codec call to bound the codec's scratch memory.
    """
    nblk = tokens // L.BLOCK_TOKENS
    per = s.kv_heads * L.tiles_per_head(s.head_dim)
    n_tiles = batch * nblk * per
    kw = {"adapt": False}
    cache = gaac.PagedKVCache(cal, max_seqs=batch, max_blocks=max(nblk, 1), slots=max(n_tiles, 1),
                              raw_tiles=max(256, int(n_tiles * raw_frac)), device=DEV, grow=True, **kw)
    seqs = [cache.add_sequence() for _ in range(batch)]
    chunk = max(1, (1 << 17) // max(tokens, 1))
    t0 = time.time()
    for layer in range(s.layers):
        k, v = layer_kv(layer)
        for c in range(0, batch, chunk):
            cache.update_layer(layer, seqs[c:c + chunk], k[c:c + chunk], v[c:c + chunk])
        del k, v
        if layer == 0 or layer == s.layers - 1:
            log(f"    encoded layer {layer} ({time.time() - t0:.1f} s; {gpu_mem()})")
    sync()
    return cache


def mem_dict(m) -> dict:
    return {"tokens": m.tokens, "bf16_bytes": m.bf16_bytes, "resident_bytes": m.resident_bytes,
            "slot_bytes": m.slot_bytes, "raw_bytes": m.raw_bytes, "table_bytes": m.table_bytes,
            "tail_bytes": m.tail_bytes, "allocated_bytes": m.allocated_bytes, "ratio": m.ratio}


# ------------------------------------------------------------------------------------------------
# Attention variants.

class SdpaAttend:
    def __init__(self, s: Shape, kc, vc):
        self.s, self.kc, self.vc = s, kc, vc

    def __call__(self, layer, q):
        b, s = q.shape[0], self.s
        o = F.scaled_dot_product_attention(q.view(b, s.kv_heads, s.group, s.head_dim), self.kc[layer], self.vc[layer])
        return o.reshape(b, s.q_heads, s.head_dim)


class GaacAttend:
    def __init__(self, s: Shape, cache, batch: int):
        self.s = s
        self.plans = [AttentionPlan(cache.layer_view(i), s.q_heads) for i in range(s.layers)]
        if SMOKE:          # the simulator writes host arrays; the torch tensors share their memory
            self.out_np = np.zeros((batch, s.q_heads, s.head_dim), np.int16)
            self.lse_np = np.zeros((batch, s.q_heads), np.float32)
            self.out = torch.from_numpy(self.out_np)
        else:
            self.out = torch.empty((batch, s.q_heads, s.head_dim), dtype=torch.int16, device=DEV)
            self.lse = torch.empty((batch, s.q_heads), dtype=torch.float32, device=DEV)

    def __call__(self, layer, q):
        if SMOKE:
            self.plans[layer].run(q, out=self.out_np, lse=self.lse_np)
            return self.out.view(torch.bfloat16)
        return self.plans[layer].run(q, out=self.out, lse=self.lse)

    def check_status(self):
        for p in self.plans:
            p.check_status()


def skip_attend(layer, q):
    return q


# ------------------------------------------------------------------------------------------------
# Timing.

def make_step(model, ids, attend):
    def fn():
        with sdpa_kernel(BACKEND):
            return model.step(ids, attend)
    return fn


def graph_ms(fn, replays: int, warmup: int = 3) -> dict:
    """Capture ``fn`` in a CUDA graph; median/min/max ms of ``replays`` replays, each timed with CUDA events."""
    if SMOKE:          # no graphs in the simulator: a wall-clock dry run of the same code
        t = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t) * 1e3
        return {"median_ms": ms, "min_ms": ms, "max_ms": ms, "n": 1}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for a, b in events:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    t = [a.elapsed_time(b) for a, b in events]
    del graph
    return {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t), "n": len(t)}


def eager_ms(fn, steps: int = 5, reps: int = 3) -> float:
    """Wall ms per step of ``steps`` eager steps back to back, synchronised at the end (median of ``reps``)."""
    if SMOKE:          # the simulator: one call, no warm-up
        steps, reps = 1, 1
    else:
        fn()
        sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        out.append((time.perf_counter() - t) / steps * 1e3)
    return statistics.median(out)


# ------------------------------------------------------------------------------------------------
# Checks and runs.

def correctness(model, ids, sdpa, gaac_att, s: Shape) -> dict:
    """Both steps' logits on the same token; layer 0's attention of one random query vs float32 attention."""
    with torch.no_grad():
        ld = make_step(model, ids, sdpa)().float()
        lg = make_step(model, ids, gaac_att)().float()
        sync()
        gen = torch.Generator(device=DEV).manual_seed(1)
        q = torch.randn((ids.shape[0], s.q_heads, s.head_dim), generator=gen, device=DEV).to(torch.bfloat16)
        with sdpa_kernel(BACKEND):
            od = sdpa(0, q).float()
        og = gaac_att(0, q).float()
        b = q.shape[0]
        with sdpa_kernel([SDPBackend.MATH] if SMOKE else [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q.float().view(b, s.kv_heads, s.group, s.head_dim),
                                                 sdpa.kc[0].float(), sdpa.vc[0].float()).reshape(b, s.q_heads, -1)
    gaac_att.check_status()
    rel = lambda a: float((a - ref).norm() / ref.norm())  # noqa: E731
    return {"logits_max_abs_diff": float((ld - lg).abs().max()), "logits_max_abs": float(ld.abs().max()),
            "argmax_agree": bool(torch.equal(ld.argmax(-1), lg.argmax(-1))),
            "argmax_default": ld.argmax(-1).tolist(), "argmax_gaac": lg.argmax(-1).tolist(),
            "attn0_flash_rel_err": rel(od), "attn0_gaac_rel_err": rel(og),
            "attn0_gaac_vs_flash_max_abs": float((od - og).abs().max())}


def free():
    gc.collect()
    if not SMOKE:
        torch.cuda.empty_cache()


def run_context(model, src, cal, s: Shape, tokens: int, batch: int, raw_frac: float, args) -> dict:
    log(f"== context {tokens} tokens, batch {batch} ==")
    row = {"tokens": tokens, "batch": batch}
    model.set_position(tokens)
    t0 = time.time()
    dense = [src.dense(i, batch, tokens) for i in range(s.layers)]
    kc, vc = [d[0] for d in dense], [d[1] for d in dense]
    del dense
    sync()
    log(f"  BF16 cache built ({time.time() - t0:.1f} s; {gpu_mem()})")
    cache = build_gaac(cal, s, lambda i, kc=kc, vc=vc: (kc[i], vc[i]), batch, tokens, raw_frac)
    m = cache.memory()
    row["memory"] = mem_dict(m)
    row["raw_tile_frac"] = m.raw_bytes / L.geometry(s.head_dim).raw_bytes / max(1, 2 * s.layers * batch * (
        tokens // L.BLOCK_TOKENS) * s.kv_heads * L.tiles_per_head(s.head_dim))
    log(f"  GAAC cache: {m.resident_bytes / GIB:.2f} GiB resident vs BF16 {m.bf16_bytes / GIB:.2f} GiB "
        f"(ratio {m.ratio:.3f}; raw tiles {100 * row['raw_tile_frac']:.2f}%; allocated {m.allocated_bytes / GIB:.2f} "
        f"GiB) in {time.time() - t0:.1f} s; {gpu_mem()}")
    ids = torch.randint(0, s.vocab, (batch,), generator=torch.Generator().manual_seed(tokens)).to(DEV)
    sdpa = SdpaAttend(s, kc, vc)
    t0 = time.time()
    gaac_att = GaacAttend(s, cache, batch)
    row["splits"] = gaac_att.plans[0].n_work
    row["blocks_per_split"] = gaac_att.plans[0].blocks_per_split
    log(f"  {s.layers} plans in {time.time() - t0:.1f} s ({row['splits']} splits x {row['blocks_per_split']} blocks)")
    t0 = time.time()
    row["check"] = correctness(model, ids, sdpa, gaac_att, s)
    c = row["check"]
    log(f"  check ({time.time() - t0:.1f} s): logits max |diff| {c['logits_max_abs_diff']:.4f} (max |logit| "
        f"{c['logits_max_abs']:.2f}), argmax agree {c['argmax_agree']}; layer-0 attention rel err flash "
        f"{c['attn0_flash_rel_err']:.2e} gaac {c['attn0_gaac_rel_err']:.2e}")
    steps = {"default": make_step(model, ids, sdpa), "gaac": make_step(model, ids, gaac_att),
             "skip": make_step(model, ids, skip_attend)}
    for name, fn in steps.items():
        with torch.no_grad():
            row[f"{name}_graph"] = graph_ms(fn, args.replays)
            if name != "skip" or args.eager_skip:
                row[f"{name}_eager_ms"] = eager_ms(fn)
        log(f"  {name:8s} graph {row[f'{name}_graph']['median_ms']:.3f} ms"
            + (f", eager {row[f'{name}_eager_ms']:.3f} ms" if f"{name}_eager_ms" in row else "") + f"; {gpu_mem()}")
    del steps, sdpa, gaac_att, cache, kc, vc
    free()
    return row


def run_equal_memory(model, src, cal, s: Shape, per_seq_gaac: float, raw_frac: float, args) -> dict:
    tokens = args.eq_context
    budget = args.budget_gib * GIB if args.budget_gib is not None else 2.9 * s.kv_bytes(tokens)
    per_bf16 = s.kv_bytes(tokens)
    n_b, n_g = int(budget // per_bf16), int(budget // per_seq_gaac)
    res = {"tokens": tokens, "budget_bytes": budget, "bf16_per_seq": per_bf16, "gaac_per_seq": per_seq_gaac,
           "bf16_seqs": n_b, "gaac_seqs": n_g}
    log(f"== equal memory: {budget / GIB:.2f} GiB of KV, {tokens}-token sequences: BF16 {per_bf16 / GIB:.3f} GiB "
        f"each -> {n_b}; GAAC {per_seq_gaac / GIB:.3f} GiB each -> {n_g} ==")
    model.set_position(tokens)
    if n_b:
        ids = torch.randint(0, s.vocab, (n_b,), generator=torch.Generator().manual_seed(5)).to(DEV)
        dense = [src.dense(i, n_b, tokens) for i in range(s.layers)]
        sdpa = SdpaAttend(s, [d[0] for d in dense], [d[1] for d in dense])
        del dense
        log(f"  BF16 cache of {n_b} sequences built; {gpu_mem()}")
        with torch.no_grad():
            res["default_graph"] = graph_ms(make_step(model, ids, sdpa), args.replays)
            res["skip_default_batch_graph"] = graph_ms(make_step(model, ids, skip_attend), args.replays)
        log(f"  default batch {n_b}: {res['default_graph']['median_ms']:.3f} ms/step; {gpu_mem()}")
        del sdpa
        free()
    if n_g:
        ids = torch.randint(0, s.vocab, (n_g,), generator=torch.Generator().manual_seed(5)).to(DEV)
        cache = build_gaac(cal, s, lambda i: src.dense(i, n_g, tokens), n_g, tokens, raw_frac)
        m = cache.memory()
        res["gaac_memory"] = mem_dict(m)
        log(f"  GAAC cache of {n_g} sequences: {m.resident_bytes / GIB:.2f} GiB resident, "
            f"{m.allocated_bytes / GIB:.2f} GiB allocated; {gpu_mem()}")
        gaac_att = GaacAttend(s, cache, n_g)
        with torch.no_grad():
            res["gaac_graph"] = graph_ms(make_step(model, ids, gaac_att), args.replays)
            res["skip_gaac_batch_graph"] = graph_ms(make_step(model, ids, skip_attend), args.replays)
        gaac_att.check_status()
        log(f"  gaac batch {n_g}: {res['gaac_graph']['median_ms']:.3f} ms/step; {gpu_mem()}")
        del gaac_att, cache
        free()
    return res


# ------------------------------------------------------------------------------------------------
# Report.

def fmt_gib(b) -> str:
    return f"{b / GIB:.2f}"


def render(rep: dict) -> str:
    s = Shape(**rep["shape"])
    cal_what = ("all of the unique tokens: a self-calibrated best case" if rep["cal_tokens"] >= rep["unique_tokens"]
                else "a sample")
    lines = [f"# Decode step, Llama-3.1-8B shape, BF16 cache + torch flash SDPA vs GAAC ({rep['device']})", "",
             f"- date {rep['date']}, commit {rep['commit']}, torch {rep['torch']}, numba-cuda {rep['numba_cuda']}",
             f"- command: `{rep['command']}`",
             f"- model: **random BF16 weights** (seed 0) in the shape {s.layers} layers, hidden {s.hidden}, "
             f"{s.q_heads} query / {s.kv_heads} KV heads of {s.head_dim}, SwiGLU MLP {s.mlp}, RMSNorm, RoPE theta "
             f"{s.theta:g}, vocab {s.vocab} ({rep['params'] / 1e9:.2f} B parameters, "
             f"{rep['params'] * 2 / 1e9:.1f} GB); decode step in plain torch, one new token per sequence; the new "
             "token's K/V are computed but not appended (both variants attend to the same T cached tokens)",
             f"- KV content: **real** SmolLM2-135M K/V ({rep['data']}): each 128-wide head is two real 64-wide "
             f"heads side by side, the {rep['unique_tokens']} real tokens (4 prompts) tiled to the context, batch "
             f"rows shifted by {SHIFT} tokens; every block position has its own slot / memory",
             f"- calibration: `gaac.calibrate` on the first {rep['cal_tokens']} tokens of that content "
             f"({cal_what}); "
             "GAAC cache = `gaac.PagedKVCache(..., device='cuda')` prefilled layer by layer with the CUDA codec, "
             "attention = one `AttentionPlan` per layer on `layer_view(l)`",
             "- times: each variant's whole step captured in one CUDA graph, replays timed one by one with CUDA "
             f"events, median of {rep['replays']}; eager = wall time per step of back-to-back steps without a graph",
             f"- whole script: {rep.get('wall_s', float('nan')):.0f} s; peak GPU memory allocated: "
             + (f"{rep['peak_gpu_bytes'] / GIB:.1f} GiB" if rep.get("peak_gpu_bytes") else "n/a"), ""]
    if rep.get("smoke"):
        lines += ["**SMOKE RUN** (CPU, numba simulator, tiny shapes): the times below mean nothing.", ""]
    rows = rep["contexts"]

    def memory_cells(r):
        m = r["memory"]
        return (r["tokens"], r["batch"], fmt_gib(m["bf16_bytes"]), fmt_gib(m["resident_bytes"]), f"{m['ratio']:.3f}x",
                fmt_gib(m["slot_bytes"]), fmt_gib(m["raw_bytes"]), fmt_gib(m["table_bytes"]),
                f"{m['tail_bytes'] / 2**20:.2f} MiB", f"{100 * r['raw_tile_frac']:.2f}%", fmt_gib(m["allocated_bytes"]))

    def check_cells(r):
        c = r["check"]
        return (r["tokens"], f"{c['logits_max_abs_diff']:.4g}", f"{c['logits_max_abs']:.3g}",
                "yes" if c["argmax_agree"] else "NO", f"{c['attn0_flash_rel_err']:.2e}",
                f"{c['attn0_gaac_rel_err']:.2e}", f"{c['attn0_gaac_vs_flash_max_abs']:.3g}")

    def step_cells(r):
        d, g, k = (r[f"{n}_graph"]["median_ms"] for n in ("default", "gaac", "skip"))
        b = r["batch"]
        return (r["tokens"], b, f"{d:.3f}", f"{g:.3f}", f"{d / g:.3f}x", f"{1e3 * b / d:.1f}", f"{1e3 * b / g:.1f}",
                f"{k:.3f}", f"{100 * (d - k) / d:.1f}%", f"{100 * (g - k) / g:.1f}%",
                f"{1e3 * (d - k) / s.layers:.1f} / {1e3 * (g - k) / s.layers:.1f}", f"{r['default_eager_ms']:.3f}",
                f"{r['gaac_eager_ms']:.3f}")

    lines += ["## Memory (batch 1 unless said; `PagedKVCache.memory()`)", "",
              *table(("context", "batch", "BF16 KV GiB", "GAAC resident GiB", "ratio", "slots", "raw tiles", "table",
                      "tails", "raw-tile fraction", "GAAC allocated GiB"), map(memory_cells, rows))]
    lines += ["", "## Correctness (same weights, same token, caches holding the same values)", "",
              *table(("context", "logits max abs diff GAAC vs default", "max abs logit", "argmax agrees",
                      "layer-0 attention rel. err vs fp32: flash", "GAAC", "GAAC vs flash max abs"),
                     map(check_cells, rows))]
    lines += ["", "Not bit-identical by design: two different kernels (split-KV with a merge vs flash), both "
              "accumulating in FP32 from BF16; the GAAC cache itself is lossless.", ""]
    lines += ["## Decode step time (CUDA graph, GPU ms per step)", "",
              *table(("context", "batch", "default ms", "GAAC ms", "speedup GAAC/default", "default tok/s",
                      "GAAC tok/s", "step without attention ms", "attention share default", "attention share GAAC",
                      "attention per layer default / GAAC us", "eager default ms", "eager GAAC ms"),
                     map(step_cells, rows))]
    lines += ["", "speedup = default ms / GAAC ms (above 1: GAAC faster). attention share = (step - step without "
              "attention) / step. Eager = no graph: the step then costs the larger of its host launch time and its "
              "GPU time.", ""]
    eq = rep.get("equal_memory")
    if eq:
        tp, cells = {}, []
        for name, key, n in (("BF16 + flash", "default", eq["bf16_seqs"]), ("GAAC", "gaac", eq["gaac_seqs"])):
            per = eq["bf16_per_seq"] if key == "default" else eq["gaac_per_seq"]
            t = eq.get(f"{key}_graph", {}).get("median_ms")
            k = eq.get(f"skip_{key}_batch_graph", {}).get("median_ms")
            tp[key] = 1e3 * n / t if t else 0.0
            cells.append((name, f"{per / GIB:.3f}", n, t if t is None else f"{t:.3f}", f"{tp[key]:.1f}",
                          k if k is None else f"{k:.3f}"))
        lines += [f"## Equal memory: {fmt_gib(eq['budget_bytes'])} GiB of KV, {eq['tokens']}-token sequences", "",
                  *table(("cache", "bytes per sequence (GiB)", "sequences that fit", "step ms (graph)",
                          "aggregate tok/s", "step without attention ms"), cells)]
        if tp["default"]:
            lines += ["", f"GAAC / BF16 aggregate throughput: {tp['gaac'] / tp['default']:.3f}x with "
                      f"{eq['gaac_seqs'] - eq['bf16_seqs']:+d} sequences (the paper reports one more sequence and "
                      "+13-29%). GAAC bytes per sequence = resident bytes measured at batch 1 (slots, raw tiles, "
                      "table entries, tails); a pool sized to the budget also holds its free records."]
        lines.append("")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: tiny shapes, kernels in numba's simulator")
    ap.add_argument("--out", type=Path, required=True, help="markdown results (a .json beside it)")
    ap.add_argument("--data", default=None, help="SmolLM2 K/V dumps (default .devdata/kv, then ../shared/data/kv)")
    ap.add_argument("--contexts", default=None, help="comma-separated context lengths (default 32768,65536,131072)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--replays", type=int, default=None, help="timed graph replays per variant (default 30)")
    ap.add_argument("--cal-tokens", type=int, default=None, help="calibrate on the first N real tokens (default all)")
    ap.add_argument("--equal-memory", action="store_true")
    ap.add_argument("--budget-gib", type=float, default=None, help="KV budget for --equal-memory (default 60)")
    ap.add_argument("--eq-context", type=int, default=None, help="sequence length for --equal-memory (default 65536)")
    ap.add_argument("--eager-skip", action="store_true", help="also time the attention-free step eagerly")
    args = ap.parse_args()
    s = SMOKE_SHAPE if SMOKE else LLAMA_8B
    contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else (
        [40, 72] if SMOKE else [32768, 65536, 131072])
    args.replays = args.replays or (1 if SMOKE else 30)
    args.eq_context = args.eq_context or (40 if SMOKE else 65536)
    if args.budget_gib is None and not SMOKE:
        args.budget_gib = 60.0
    t_start = time.time()
    if not SMOKE:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device (use --smoke for a CPU dry run)")
        torch.backends.cuda.matmul.allow_tf32 = False
    data = find_data(args.data)
    k_u, v_u = real_source(data, s)
    unique = k_u.shape[2]
    cal_tokens = min(args.cal_tokens or unique, unique)
    t0 = time.time()
    cal = gaac.calibrate(k_u[:, :, :cal_tokens], v_u[:, :, :cal_tokens], model="llama-3.1-8b-shape/smollm2-kv",
                         show_progress=False)
    log(f"calibrated on {cal_tokens} tokens x {s.layers} layers in {time.time() - t0:.1f} s; capacities K "
        f"{sorted(set(cal.capacity[0].tolist()))} V {sorted(set(cal.capacity[1].tolist()))}")
    src = Source(k_u, v_u)
    t0 = time.time()
    model = Model(s)
    sync()
    log(f"random weights: {s.params() / 1e9:.2f} B parameters in {time.time() - t0:.1f} s; {gpu_mem()}")
    rep = {"device": "CPU (numba simulator, smoke)" if SMOKE else torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit(), "torch": torch.__version__,
           "numba_cuda": package_version("numba-cuda"), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "shape": asdict(s), "params": s.params(), "data": str(data), "unique_tokens": unique,
           "cal_tokens": cal_tokens, "replays": args.replays, "smoke": SMOKE, "contexts": []}
    raw_frac = 0.25
    for tokens in contexts:
        row = run_context(model, src, cal, s, tokens, args.batch, raw_frac, args)
        rep["contexts"].append(row)
        raw_frac = min(0.25, 1.25 * row["raw_tile_frac"] + 0.002)      # size later raw pools from what was seen
        write(rep, args.out, render)
    if args.equal_memory:
        per = [r for r in rep["contexts"] if r["tokens"] == args.eq_context]
        if not per:
            per = [run_context(model, src, cal, s, args.eq_context, 1, raw_frac, args)]
            rep["contexts"].append(per[0])
        per_seq = per[0]["memory"]["resident_bytes"] / per[0]["batch"]
        rep["equal_memory"] = run_equal_memory(model, src, cal, s, per_seq, raw_frac, args)
    rep["wall_s"] = time.time() - t_start
    rep["peak_gpu_bytes"] = None if SMOKE else torch.cuda.max_memory_allocated()
    write(rep, args.out, render)
    log(f"done in {rep['wall_s']:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
