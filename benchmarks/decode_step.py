"""A serving loop's decode steps on a Llama-3.1-8B-shaped model: BF16 cache + torch flash vs the GAAC cache.

    python benchmarks/decode_step.py --out $OUT/decode-step-h200.md [--batches 1,8] [--equal-memory]
    python benchmarks/decode_step.py --smoke --out /tmp/decode-step-smoke.md      # CPU, numba's simulator

The model has **random BF16 weights** (seeded) in the shape of Llama-3.1-8B: 32 layers, hidden 4096, 32 query /
8 KV heads of 128, SwiGLU MLP 14336, RMSNorm, RoPE theta 500000, vocab 128256 (16 GB of weights).  Its decode step
is plain torch, one new token per sequence: per layer RMSNorm, one fused QKV GEMM, RoPE, **the append of the new
token's K/V to the layer's cache**, attention over the cache, O projection, RMSNorm, gate/up GEMM, SiLU, down GEMM;
final RMSNorm and lm_head.  Every timed step does what a serving loop does:

* ``default``: a preallocated BF16 K/V ``[B, 8, T_max, 128]`` per layer; the new token is written in place and
  ``torch.nn.functional.scaled_dot_product_attention`` under ``sdpa_kernel(FLASH_ATTENTION)`` reads the first
  ``T + 1`` tokens (the 4 query heads of a KV head folded into the query length);
* ``gaac``: a ``gaac.PagedKVCache`` on the GPU; per step ``plan = cache.decode_plan(32)``, per layer
  ``plan.run(q, l, k=k, v=v, out=)``: the token appended (one token per sequence: a tail write; every 16th step
  a block finishes and is encoded into the pools), then attention;
* ``skip``: no append and no attention (the query stands in for the output): what the rest of the step costs.

The appended K/V are the real next tokens of the content (the QKV GEMM runs, its K/V are not used), so both
caches hold the same values.  Steps run eagerly, back to back, as a loop without CUDA graphs runs them: the
step time is wall time over ``--steps`` consecutive steps (a multiple of 16: every block boundary is in it),
synchronised at the end, after ``--warmup`` steps; per-step CUDA-event times give the slowest step (the one that
finishes blocks).  ``host us/layer`` is the host time of GAAC's own calls (append, plan, attention) per layer:
the same loop without the model, timed on the host as the calls return.

The K/V are real: the SmolLM2-135M dumps (``[30 layers, 3 KV heads, tokens, 64]``, four prompts, 1344 tokens) give
each (layer, KV head) of the 8B shape a 128-wide head made of two real 64-wide heads side by side; tokens are the
1344 real tokens tiled to the context (sequence ``b`` starts ``112 b`` tokens later, so batch rows differ).

Correctness: once per context, both caches' attention of layer 0 against float32 attention, after the timed steps
(so over appended tokens and finished blocks), and the GAAC cache's layer 0 read back bit-exact against the BF16
cache.  ``--equal-memory``: in a KV budget (``--budget-gib``, default 60), how many ``--eq-context`` (64K)
sequences fit as BF16 and as GAAC (resident bytes per sequence measured by ``PagedKVCache.memory()``), and the
aggregate tokens/s of each variant's loop at that batch.
(A long prompt entering the cache is ``prefill.py``'s benchmark.)
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
from benchmarks.real_kv import tile_heads  # noqa: E402
from benchmarks.report import commit, table, write  # noqa: E402
from gaac import layout as L  # noqa: E402
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
        """Logits ``[B, vocab]`` of one decode step for tokens ``ids [B]``; ``attend(layer, q [B, Hq, D])`` appends
        the layer's new K/V and attends."""
        s = self.s
        b, d = ids.shape[0], s.head_dim
        x = self.embed[ids]
        for i in range(s.layers):
            h = self.rmsnorm(x, self.ln1[i])
            q, k, _v = F.linear(h, self.wqkv[i]).split([s.q_heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
            q = self.rope(q.view(b, s.q_heads, d))             # a new contiguous tensor
            self.rope(k.view(b, s.kv_heads, d))                 # the new token's K (the real next token is appended)
            o = attend(i, q)
            x = x + F.linear(o.reshape(b, s.q_heads * d), self.wo[i])
            h = self.rmsnorm(x, self.ln2[i])
            gate, up = F.linear(h, self.wgu[i]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, self.wd[i])
        return F.linear(self.rmsnorm(x, self.lnf), self.lm_head)


# ------------------------------------------------------------------------------------------------
# Real K/V content and the two caches.

def common_args(ap) -> None:
    """The options every loop benchmark built on this module takes: ``--smoke``, ``--out``, ``--data``."""
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: tiny shapes, kernels in numba's simulator")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data", default=None, help="SmolLM2 K/V dumps (default .devdata/kv, then ../shared/data/kv)")


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
    cat = [np.concatenate([real[kind][w] for kind in KINDS], axis=2) for w in range(2)]    # [30, 3, 1344, 64]
    return tuple(tile_heads(c, s.layers, s.kv_heads, s.head_dim) for c in cat)


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


def build_gaac(cal, s: Shape, layer_kv, batch: int, tokens: int, raw_frac: float, room: int):
    """A PagedKVCache of ``batch`` sequences of ``tokens`` tokens, prefilled layer by layer from ``layer_kv(l)``,
    with block-table room for ``room`` more tokens.

    The slot pool has one slot per tile of ``tokens + room`` (so it never grows); the raw pool ``raw_frac`` of that
    (grows if short).  Calibration epochs stay off (``adapt=False``): the calibration saw all of the content.
    Prefill goes in chunks of at most 128K tokens per codec call to bound the codec's scratch memory.
    """
    nblk = -(-(tokens + room) // L.BLOCK_TOKENS)
    per = s.kv_heads * L.tiles_per_head(s.head_dim)
    n_tiles = batch * nblk * per
    cache = gaac.PagedKVCache(cal, max_seqs=batch, max_blocks=max(nblk, 1), slots=max(n_tiles, 1),
                              raw_tiles=max(256, int(n_tiles * raw_frac)), device=DEV, grow=True, adapt=False,
                              codec="cuda")      # in the smoke run: numba's simulator
    seqs = [cache.add_sequence() for _ in range(batch)]
    chunk = max(1, (1 << 17) // max(tokens, 1))
    t0 = time.time()
    for layer in range(s.layers):
        k, v = layer_kv(layer)
        for c in range(0, batch, chunk):
            cache.update_layer(layer, seqs[c:c + chunk], k[c:c + chunk, :, :tokens], v[c:c + chunk, :, :tokens])
        del k, v
        if layer == 0 or layer == s.layers - 1:
            log(f"    encoded layer {layer} ({time.time() - t0:.1f} s; {gpu_mem()})")
    sync()
    return cache, seqs


def mem_dict(m) -> dict:
    return {"tokens": m.tokens, "bf16_bytes": m.bf16_bytes, "resident_bytes": m.resident_bytes,
            "slot_bytes": m.slot_bytes, "raw_bytes": m.raw_bytes, "table_bytes": m.table_bytes,
            "tail_bytes": m.tail_bytes, "allocated_bytes": m.allocated_bytes, "ratio": m.ratio}


# ------------------------------------------------------------------------------------------------
# The two caches as a loop uses them: append the step's token, attend.

class Loop:
    """The state both variants share: the step index and the new tokens' real K/V ``[steps, B, 8, D]`` per layer."""

    def __init__(self, new_k, new_v, tokens: int):
        self.new_k, self.new_v, self.tokens, self.i = new_k, new_v, tokens, 0

    def kv(self, layer):
        return self.new_k[layer][self.i], self.new_v[layer][self.i]


class SdpaAttend:
    """BF16: the new token written in place into a preallocated cache, flash over its first ``T + 1`` tokens."""

    def __init__(self, s: Shape, kc, vc, loop: Loop):
        self.s, self.kc, self.vc, self.loop = s, kc, vc, loop

    def begin(self):
        pass

    def __call__(self, layer, q):
        b, s, t = q.shape[0], self.s, self.loop.tokens + self.loop.i
        k, v = self.loop.kv(layer)
        self.kc[layer][:, :, t] = k
        self.vc[layer][:, :, t] = v
        o = F.scaled_dot_product_attention(q.view(b, s.kv_heads, s.group, s.head_dim), self.kc[layer][:, :, :t + 1],
                                           self.vc[layer][:, :, :t + 1])
        return o.reshape(b, s.q_heads, s.head_dim)


class StepAttend:
    """A model step's attention through a plan: per layer one ``plan.run`` with the layer's token (``k=``, ``v=``:
    its append and the attention in one call, the decode loop the README shows)."""

    def __init__(self, cache, loop, plan, out):
        self.cache, self.loop, self.plan, self.out = cache, loop, plan, out

    def __call__(self, layer, q):
        k, v = self.loop.kv(layer)
        return self.plan.run(q, layer, k=k[:, :, None], v=v[:, :, None], out=self.out)


class GaacAttend:
    """GAAC: one plan per step (``begin``), per layer one ``plan.run`` with the layer's token."""

    def __init__(self, s: Shape, cache, seqs, loop: Loop):
        self.s, self.cache, self.seqs, self.loop = s, cache, seqs, loop
        self.plan = None
        self.out = torch.empty((cache.max_seqs, s.q_heads, s.head_dim), dtype=torch.bfloat16, device=DEV)

    def begin(self):
        self.plan = self.cache.decode_plan(self.s.q_heads)

    def __call__(self, layer, q):
        k, v = self.loop.kv(layer)
        return self.plan.run(q, layer, k=k[:, :, None], v=v[:, :, None], out=self.out)

    def check_status(self):
        self.plan.check_status()


class SkipAttend:
    def begin(self):
        pass

    def __call__(self, layer, q):
        return q


class GraphLoop:
    """What a captured step reads instead of the host's step index: a device counter of the steps replayed,
    which picks each layer's real next token (the eager loop's ``Loop.kv``)."""

    def __init__(self, loop: Loop):
        self.loop = loop
        self.i = torch.full((1,), loop.i, dtype=torch.int64, device=DEV)

    def kv(self, layer):
        return self.loop.new_k[layer].index_select(0, self.i)[0], self.loop.new_v[layer].index_select(0, self.i)[0]

    def end(self):
        self.i.add_(1)


PAGE = 256           # flash's paged-KV block size (it takes multiples of 256)
FLASH_MODES = ("q1", "q1-paged", "fold4")


class SdpaGraphAttend:
    """BF16 in a CUDA graph: lengths on the device, each token written in place at its device position, and
    torch's flash kernel (``torch.ops.aten._flash_attention_forward``, varlen with ``seqused_k``) over each
    sequence's tokens.  The cache is ``[B, T, 8, D]`` per layer (flash's layout; a copy of the eager loop's
    ``[B, 8, T, D]`` cache).  ``mode``: ``q1`` one query row of 32 heads per sequence (flash then folds the
    query heads of a KV head itself and splits the keys), ``q1-paged`` the same through a block table of
    256-token pages, ``fold4`` the 4 query heads of a KV head as 4 query rows of 8 heads."""

    def __init__(self, s: Shape, kc, vc, tokens: int, loop: GraphLoop, mode: str = "q1", consume: bool = False):
        self.s, self.loop, self.mode = s, loop, mode
        b, t = kc[0].shape[0], kc[0].shape[2]
        self.t_max = t_max = -(-t // PAGE) * PAGE
        self.k, self.v = [], []
        for src, dst in ((kc, self.k), (vc, self.v)):
            for i, x in enumerate(src):
                y = torch.zeros((b, t_max, s.kv_heads, s.head_dim), dtype=x.dtype, device=DEV)
                y[:, :t].copy_(x.transpose(1, 2))
                dst.append(y)
                if consume:                  # the eager cache's layer is no longer needed (equal memory)
                    src[i] = x = None
        self.lens = torch.full((b,), tokens + loop.loop.i, dtype=torch.int32, device=DEV)
        self.base = torch.arange(b, device=DEV, dtype=torch.int64) * t_max
        self.cum_q = torch.arange(b + 1, device=DEV, dtype=torch.int32) * (s.group if mode == "fold4" else 1)
        self.cum_k = torch.arange(b + 1, device=DEV, dtype=torch.int32) * t_max
        self.table = torch.arange(b * (t_max // PAGE), device=DEV, dtype=torch.int32).view(b, t_max // PAGE)
        self.begin()

    def begin(self):
        self.idx = self.base + self.lens.long()
        self.after = self.lens + 1

    def attend(self, layer, q, lens):
        s, b = self.s, q.shape[0]
        kf = self.k[layer].view(-1, s.kv_heads, s.head_dim)
        vf = self.v[layer].view(-1, s.kv_heads, s.head_dim)
        extra = {}
        if self.mode == "q1-paged":
            kf, vf = kf.view(-1, PAGE, s.kv_heads, s.head_dim), vf.view(-1, PAGE, s.kv_heads, s.head_dim)
            extra["block_table"] = self.table
        if self.mode == "fold4":
            qv = q.view(b, s.kv_heads, s.group, s.head_dim).transpose(1, 2).reshape(b * s.group, s.kv_heads,
                                                                                      s.head_dim)
            o = torch.ops.aten._flash_attention_forward(qv, kf, vf, self.cum_q, self.cum_k, s.group, self.t_max, 0.0,
                                                        False, False, seqused_k=lens)[0]
            return o.view(b, s.group, s.kv_heads, s.head_dim).transpose(1, 2).reshape(b, s.q_heads, s.head_dim)
        o = torch.ops.aten._flash_attention_forward(q.view(b, s.q_heads, s.head_dim), kf, vf, self.cum_q, self.cum_k,
                                                    1, self.t_max, 0.0, False, False, seqused_k=lens, **extra)[0]
        return o.view(b, s.q_heads, s.head_dim)

    def __call__(self, layer, q):
        k, v = self.loop.kv(layer)
        s = self.s
        self.k[layer].view(-1, s.kv_heads, s.head_dim).index_copy_(0, self.idx, k)
        self.v[layer].view(-1, s.kv_heads, s.head_dim).index_copy_(0, self.idx, v)
        return self.attend(layer, q, self.after)

    def end(self):
        self.lens.copy_(self.after)
        self.loop.end()

    def replayed(self):
        pass


def pick_flash_mode(s: Shape, kc, vc, tokens: int, loop: GraphLoop, q) -> tuple:
    """The fastest of :data:`FLASH_MODES` on layer 0 as the cache stands (CUDA events, median of 20 calls),
    among those that run and agree with eager flash SDPA; returns (mode, {mode: us or the error})."""
    b = q.shape[0]
    with sdpa_kernel(BACKEND):
        ref = F.scaled_dot_product_attention(q.view(b, s.kv_heads, s.group, s.head_dim), kc[0][:, :, :tokens],
                                             vc[0][:, :, :tokens]).reshape(b, s.q_heads, s.head_dim).float()
    times = {}
    for mode in FLASH_MODES:
        try:
            att = SdpaGraphAttend(s, kc[:1], vc[:1], tokens, loop, mode)
            att.lens.fill_(tokens)
            out = att.attend(0, q, att.lens)
            err = float((out.float() - ref).abs().max())
            if err > 0.02:
                raise ValueError(f"max abs {err:.3g} from eager flash")
            us = []
            for _ in range(20):
                a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                att.attend(0, q, att.lens)
                z.record()
                z.synchronize()
                us.append(1e3 * a.elapsed_time(z))
            times[mode] = statistics.median(us)
        except Exception as exc:             # a mode this torch's flash does not take
            times[mode] = f"{type(exc).__name__}: {str(exc)[:120]}"
        finally:
            att = None
            free()
    ok = {m: t for m, t in times.items() if isinstance(t, float)}
    if not ok:
        raise SystemExit(f"no flash mode runs in a graph here: {times}")
    return min(ok, key=ok.get), times


class GaacGraphAttend(GaacAttend):
    """GAAC in a CUDA graph: a plan of steps (``cache.decode_plan(q_heads, steps=N)``), recorded with
    ``plan.device_driven()``; after each replay ``plan.replayed()`` (the host's account of the step)."""

    def __init__(self, s: Shape, cache, seqs, loop: GraphLoop, steps: int):
        super().__init__(s, cache, seqs, loop)
        self.plan = cache.decode_plan(s.q_heads, steps=steps)
        assert self.plan.steps == steps, (self.plan.steps, steps)

    def begin(self):
        pass

    def end(self):
        self.loop.end()

    def replayed(self):
        self.plan.replayed()


class SkipGraphAttend(SkipAttend):
    def __init__(self, loop: GraphLoop):
        self.loop = loop

    def end(self):
        self.loop.end()

    def replayed(self):
        pass


def capture(model, ids, attend):
    """One decode step of ``model`` with ``attend`` in a CUDA graph (GAAC's inside ``plan.device_driven()``)."""
    graph = torch.cuda.CUDAGraph()
    ctx = attend.plan.device_driven() if isinstance(attend, GaacGraphAttend) else None
    with torch.no_grad(), torch.cuda.graph(graph):
        if ctx is not None:
            ctx.__enter__()
        try:
            attend.begin()
            logits = model.step(ids, attend)
            attend.end()
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
    return graph, logits


def run_graph_steps(graph, attend, steps: int) -> dict:
    """``steps`` replays back to back, each followed by the host's account (GAAC: ``plan.replayed()``): wall
    ms per step, synchronised at the end, and each replay's CUDA-event ms."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    sync()
    t = time.perf_counter()
    host = 0.0
    for j in range(steps):
        events[j][0].record()
        graph.replay()
        events[j][1].record()
        h = time.perf_counter()
        attend.replayed()
        host += time.perf_counter() - h
    sync()
    wall = (time.perf_counter() - t) / steps * 1e3
    per = [a.elapsed_time(b) for a, b in events]
    return {"ms": wall, "event_median_ms": statistics.median(per), "event_max_ms": max(per), "steps": steps,
            "replayed_us": 1e6 * host / steps}


def graph_variants(model, ids, s: Shape, kc, vc, nk, nv, cache, seqs, tokens: int, start: int, args) -> dict:
    """The three variants' steps as CUDA graphs (BF16 + flash, GAAC, no append and attention), each captured once
    and replayed ``--warmup`` + ``--steps`` times from step ``start`` of the content."""
    res = {}
    n = args.warmup + args.steps
    for name in ("default", "gaac", "skip"):
        loop = GraphLoop(Loop(nk, nv, tokens))
        loop.loop.i = start
        loop.i.fill_(start)
        if name == "default":
            q = torch.randn((kc[0].shape[0], s.q_heads, s.head_dim), device=DEV).to(torch.bfloat16)
            mode, res["flash_modes_us"] = pick_flash_mode(s, kc, vc, tokens + start, loop, q)
            res["flash_mode"] = args.flash_mode = mode
            log(f"  graph BF16 flash: {mode} of {res['flash_modes_us']}")
            attend = SdpaGraphAttend(s, kc, vc, tokens, loop, mode)
        elif name == "gaac":
            t0 = time.perf_counter()
            attend = GaacGraphAttend(s, cache, seqs, loop, n)
            res["gaac_plan_ms"] = 1e3 * (time.perf_counter() - t0)
        else:
            attend = SkipGraphAttend(loop)
        t0 = time.perf_counter()
        graph, _ = capture(model, ids, attend)
        sync()
        res[f"{name}_capture_ms"] = 1e3 * (time.perf_counter() - t0)
        run_graph_steps(graph, attend, args.warmup)
        res[name] = run_graph_steps(graph, attend, args.steps)
        log(f"  graph {name:8s} {res[name]['ms']:.3f} ms/step (events: median {res[name]['event_median_ms']:.3f}, "
            f"max {res[name]['event_max_ms']:.3f}; host after replay {res[name]['replayed_us']:.1f} us; capture "
            f"{res[f'{name}_capture_ms']:.0f} ms)")
        if name == "gaac":
            attend.plan.check_status()
        del graph, attend
        free()
    for layer in range(s.layers):            # the eager BF16 cache takes the tokens the graphs appended
        for c, new in ((kc, nk), (vc, nv)):
            c[layer][:, :, tokens + start:tokens + start + n] = new[layer][start:start + n].permute(1, 2, 0, 3)
    return res


# ------------------------------------------------------------------------------------------------
# Timing.

def run_steps(model, ids, attend, loop: Loop, steps: int) -> dict:
    """``steps`` decode steps back to back from ``loop.i``: wall ms per step (synchronised once, at the end) and
    each step's CUDA-event ms."""
    events = [] if SMOKE else [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                               for _ in range(steps)]
    sync()
    t = time.perf_counter()
    with torch.no_grad(), sdpa_kernel(BACKEND):
        for j in range(steps):
            if events:
                events[j][0].record()
            attend.begin()
            model.step(ids, attend)
            if events:
                events[j][1].record()
            loop.i += 1
    sync()
    wall = (time.perf_counter() - t) / steps * 1e3
    per = [a.elapsed_time(b) for a, b in events] if events else [wall]
    return {"ms": wall, "event_median_ms": statistics.median(per), "event_max_ms": max(per), "steps": steps}


def host_us_per_layer(attend, loop: Loop, q, layers: int, steps: int) -> dict:
    """GAAC's own calls without the model: host us per layer as the calls return, and wall us per layer."""
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        attend.begin()
        for layer in range(layers):
            attend(layer, q)
        loop.i += 1
    host = time.perf_counter() - t
    sync()
    wall = time.perf_counter() - t
    n = steps * layers
    return {"host_us": 1e6 * host / n, "wall_us": 1e6 * wall / n}


def gaac_call_breakdown(attend: "GaacAttend", loop: Loop, q, layers: int, steps: int) -> dict:
    """Host us of each of GAAC's calls as they return: the plan (per step and per layer of the step), the
    benchmark's own token indexing, and the append and the attention timed apart as two calls, ``update_layer``
    and ``plan.run`` (per layer; the loop makes them one call, ``plan.run`` with the token)."""
    sync()
    t = {"plan": [], "kv": [], "append": [], "run": []}
    clock = time.perf_counter
    for _ in range(steps):
        a = clock()
        attend.begin()
        t["plan"].append(clock() - a)
        for layer in range(layers):
            a = clock()
            k, v = attend.loop.kv(layer)
            k, v = k[:, :, None], v[:, :, None]
            b = clock()
            attend.cache.update_layer(layer, attend.seqs, k, v)
            c = clock()
            attend.plan.run(q, layer, out=attend.out)
            t["run"].append(clock() - c)
            t["append"].append(c - b)
            t["kv"].append(b - a)
        loop.i += 1
    sync()
    n = steps * layers
    out = {"plan_us_per_step": 1e6 * sum(t["plan"]) / steps, "plan_us": 1e6 * sum(t["plan"]) / n}
    for key in ("kv", "append", "run"):
        out[f"{key}_us"] = 1e6 * sum(t[key]) / n
        out[f"{key}_median_us"] = 1e6 * statistics.median(t[key])
    return out


# ------------------------------------------------------------------------------------------------
# Checks and runs.

def correctness(sdpa, gaac_att, cache, seqs, s: Shape, loop: Loop) -> dict:
    """Layer 0 read back bit-exact against the BF16 cache; both caches' layer-0 attention of a random query
    (plan for the cache as it is) against float32 attention."""
    t = loop.tokens + loop.i
    k, v = cache.read_layer(0, seqs)
    exact = bool(torch.equal(k, sdpa.kc[0][:, :, :t].contiguous().view(torch.int16))
                 and torch.equal(v, sdpa.vc[0][:, :, :t].contiguous().view(torch.int16)))
    gen = torch.Generator(device=DEV).manual_seed(1)
    b = len(seqs)
    q = torch.randn((b, s.q_heads, s.head_dim), generator=gen, device=DEV).to(torch.bfloat16)
    kc, vc = sdpa.kc[0][:, :, :t], sdpa.vc[0][:, :, :t]
    with torch.no_grad():
        with sdpa_kernel(BACKEND):
            od = F.scaled_dot_product_attention(q.view(b, s.kv_heads, s.group, s.head_dim), kc, vc).reshape(b, s.q_heads, -1)
        plan = cache.decode_plan(s.q_heads, append=0)
        og = plan.run(q, 0).float()
        plan.check_status()
        with sdpa_kernel([SDPBackend.MATH] if SMOKE else [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q.float().view(b, s.kv_heads, s.group, s.head_dim), kc.float(),
                                                 vc.float()).reshape(b, s.q_heads, -1)
    gaac_att.check_status()
    rel = lambda a: float((a.float() - ref).norm() / ref.norm())  # noqa: E731
    return {"layer0_bit_exact": exact, "attn0_flash_rel_err": rel(od), "attn0_gaac_rel_err": rel(og),
            "attn0_gaac_vs_flash_max_abs": float((od.float() - og).abs().max())}


def free():
    gc.collect()
    if not SMOKE:
        torch.cuda.empty_cache()


def bf16_caches(src, s: Shape, batch: int, tokens: int, room: int):
    """Preallocated BF16 K/V ``[batch, 8, tokens + room, D]`` per layer, the first ``tokens`` filled, and the next
    ``room`` real tokens per layer ``[room, batch, 8, D]`` (what the steps append)."""
    kc, vc, nk, nv = [], [], [], []
    for i in range(s.layers):
        k, v = src.dense(i, batch, tokens + room)
        kc.append(k)
        vc.append(v)
        nk.append(k[:, :, tokens:].permute(2, 0, 1, 3).contiguous())
        nv.append(v[:, :, tokens:].permute(2, 0, 1, 3).contiguous())
    return kc, vc, nk, nv


def run_context(model, src, cal, s: Shape, tokens: int, batch: int, raw_frac: float, args) -> dict:
    log(f"== context {tokens} tokens, batch {batch} ==")
    row = {"tokens": tokens, "batch": batch}
    model.set_position(tokens)
    room = args.warmup + 2 * args.steps + 16 + (args.warmup + args.steps if args.graph else 0)
    t0 = time.time()
    kc, vc, nk, nv = bf16_caches(src, s, batch, tokens, room)
    sync()
    log(f"  BF16 cache built ({time.time() - t0:.1f} s; {gpu_mem()})")
    cache, seqs = build_gaac(cal, s, lambda i: (kc[i], vc[i]), batch, tokens, raw_frac, room)
    m = cache.memory()
    row["memory"] = mem_dict(m)
    row["raw_tile_frac"] = m.raw_bytes / L.geometry(s.head_dim).raw_bytes / max(1, 2 * s.layers * batch * (
        tokens // L.BLOCK_TOKENS) * s.kv_heads * L.tiles_per_head(s.head_dim))
    log(f"  GAAC cache: {m.resident_bytes / GIB:.2f} GiB resident vs BF16 {m.bf16_bytes / GIB:.2f} GiB "
        f"(ratio {m.ratio:.3f}; raw tiles {100 * row['raw_tile_frac']:.2f}%) in {time.time() - t0:.1f} s; {gpu_mem()}")
    ids = torch.randint(0, s.vocab, (batch,), generator=torch.Generator().manual_seed(tokens)).to(DEV)
    loops = {name: Loop(nk, nv, tokens) for name in ("default", "gaac", "skip")}
    att = {"default": SdpaAttend(s, kc, vc, loops["default"]), "gaac": GaacAttend(s, cache, seqs, loops["gaac"]),
           "skip": SkipAttend()}
    for name in ("default", "gaac", "skip"):          # warm-up (compiles, allocator), then the timed steps
        run_steps(model, ids, att[name], loops[name], args.warmup)
        row[name] = run_steps(model, ids, att[name], loops[name], args.steps)
        log(f"  {name:8s} {row[name]['ms']:.3f} ms/step (events: median {row[name]['event_median_ms']:.3f}, "
            f"max {row[name]['event_max_ms']:.3f}); {gpu_mem()}")
    loops["gaac"].i = loops["default"].i               # the cache-only loop appends the same tokens the BF16 steps did
    sdpa_only = SdpaAttend(s, kc, vc, Loop(nk, nv, tokens))
    sdpa_only.loop.i = loops["default"].i
    q = torch.randn((batch, s.q_heads, s.head_dim), device=DEV).to(torch.bfloat16)
    with torch.no_grad():
        row["gaac_calls"] = host_us_per_layer(att["gaac"], loops["gaac"], q, s.layers, 16)
        row["gaac_breakdown"] = gaac_call_breakdown(att["gaac"], loops["gaac"], q, s.layers, 16)
        with sdpa_kernel(BACKEND):
            row["default_calls"] = host_us_per_layer(sdpa_only, sdpa_only.loop, q, s.layers, 16)
    if args.profile and not args.profiled:           # where the host time of GAAC's calls goes, once
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        host_us_per_layer(att["gaac"], loops["gaac"], q, s.layers, 16)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        args.out.with_suffix(".profile.txt").write_text(f"context {tokens}, batch {batch}: 16 steps x {s.layers} "
                                                        f"layers of append + plan + attention\n" + text.getvalue())
        args.profiled = True
    br = row["gaac_breakdown"]
    log(f"  gaac host per layer: plan {br['plan_us']:.1f} ({br['plan_us_per_step']:.0f} a step), token indexing "
        f"{br['kv_us']:.1f}, update_layer {br['append_us']:.1f}, run {br['run_us']:.1f} us")
    log(f"  calls per layer: gaac host {row['gaac_calls']['host_us']:.1f} us (wall {row['gaac_calls']['wall_us']:.1f}),"
        f" default host {row['default_calls']['host_us']:.1f} us (wall {row['default_calls']['wall_us']:.1f})")
    sdpa_only.loop.i = loops["gaac"].i
    if args.graph and not SMOKE:
        row["graph"] = graph_variants(model, ids, s, kc, vc, nk, nv, cache, seqs, tokens, loops["gaac"].i, args)
        for lp in (loops["gaac"], sdpa_only.loop):
            lp.i += args.warmup + args.steps
    t0 = time.time()
    row["check"] = correctness(sdpa_only, att["gaac"], cache, seqs, s, loops["gaac"])
    log(f"  check ({time.time() - t0:.1f} s): {row['check']}")
    row["splits"], row["blocks_per_split"] = att["gaac"].plan.n_work, att["gaac"].plan.blocks_per_split
    del att, sdpa_only, cache, kc, vc, nk, nv
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
    room = (args.warmup + args.steps) * (2 if args.graph else 1)
    for key, n in (("default", n_b), ("gaac", n_g)):
        if not n:
            continue
        ids = torch.randint(0, s.vocab, (n,), generator=torch.Generator().manual_seed(5)).to(DEV)
        if key == "default":
            kc, vc, nk, nv = bf16_caches(src, s, n, tokens, room)
            loop = Loop(nk, nv, tokens)
            attend = SdpaAttend(s, kc, vc, loop)
        else:           # layer by layer: the BF16 copy of every layer at once would not fit beside the GAAC cache
            nk, nv = [], []

            def layer_kv(i):
                k, v = src.dense(i, n, tokens + room)
                nk.append(k[:, :, tokens:].permute(2, 0, 1, 3).contiguous())
                nv.append(v[:, :, tokens:].permute(2, 0, 1, 3).contiguous())
                return k, v
            cache, seqs = build_gaac(cal, s, layer_kv, n, tokens, raw_frac, room)
            res["gaac_memory"] = mem_dict(cache.memory())
            loop = Loop(nk, nv, tokens)
            attend = GaacAttend(s, cache, seqs, loop)
        run_steps(model, ids, attend, loop, args.warmup)
        res[key] = run_steps(model, ids, attend, loop, args.steps)
        log(f"  {key} batch {n}: {res[key]['ms']:.3f} ms/step; {gpu_mem()}")
        if args.graph and not SMOKE:
            glp = GraphLoop(loop)
            steps = args.warmup + args.steps
            g_att = (SdpaGraphAttend(s, kc, vc, tokens, glp, getattr(args, "flash_mode", "q1"), consume=True)
                     if key == "default"
                     else GaacGraphAttend(s, cache, seqs, glp, steps))
            graph, _ = capture(model, ids, g_att)
            run_graph_steps(graph, g_att, args.warmup)
            res[f"{key}_graph"] = run_graph_steps(graph, g_att, args.steps)
            log(f"  {key} batch {n}, one CUDA graph a step: {res[f'{key}_graph']['ms']:.3f} ms/step")
            del graph, g_att, glp
        if key == "default":
            del kc, vc
        else:
            del cache
        del attend, loop
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
    lines = [f"# Decode loop, Llama-3.1-8B shape, BF16 cache + torch flash SDPA vs GAAC ({rep['device']})", "",
             f"- date {rep['date']}, commit {rep['commit']}, torch {rep['torch']}, numba-cuda {rep['numba_cuda']}",
             f"- command: `{rep['command']}`",
             f"- model: **random BF16 weights** (seed 0) in the shape {s.layers} layers, hidden {s.hidden}, "
             f"{s.q_heads} query / {s.kv_heads} KV heads of {s.head_dim}, SwiGLU MLP {s.mlp}, RMSNorm, RoPE theta "
             f"{s.theta:g}, vocab {s.vocab} ({rep['params'] / 1e9:.2f} B parameters, "
             f"{rep['params'] * 2 / 1e9:.1f} GB); plain-torch decode steps, one new token per sequence",
             "- every timed step appends the real next token's K/V to every layer of its cache (GAAC: "
             "`update_layer`, a block finished and encoded every 16 steps) and builds its plan "
             "(`cache.decode_plan`, once per step), then attends (`plan.run` per layer; BF16: flash SDPA)",
             f"- KV content: **real** SmolLM2-135M K/V ({rep['data']}): each 128-wide head is two real 64-wide "
             f"heads side by side, the {rep['unique_tokens']} real tokens (4 prompts) tiled to the context, batch "
             f"rows shifted by {SHIFT} tokens",
             f"- calibration: `gaac.calibrate` on the first {rep['cal_tokens']} tokens of that content ({cal_what}); "
             "epochs off in the decode runs (the calibration saw all of the content)",
             f"- times: eager steps back to back (no CUDA graph), wall time over {rep['steps']} steps after "
             f"{rep['warmup']} warm-up steps, synchronised at the end; per-step CUDA events give the slowest step",
             f"- whole script: {rep.get('wall_s', float('nan')):.0f} s; peak GPU memory allocated: "
             + (f"{rep['peak_gpu_bytes'] / GIB:.1f} GiB" if rep.get("peak_gpu_bytes") else "n/a"), ""]
    if rep.get("smoke"):
        lines += ["**SMOKE RUN** (CPU, numba simulator, tiny shapes): the times below mean nothing.", ""]
    rows = rep["contexts"]

    def step_cells(r):
        d, g, k = (r[n]["ms"] for n in ("default", "gaac", "skip"))
        b = r["batch"]
        return (r["tokens"], b, f"{d:.3f}", f"{g:.3f}", f"{d / g:.3f}x", f"{1e3 * b / d:.1f}", f"{1e3 * b / g:.1f}",
                f"{k:.3f}", f"{r['default']['event_max_ms']:.3f} / {r['gaac']['event_max_ms']:.3f}",
                f"{r['gaac_calls']['host_us']:.1f}", f"{r['default_calls']['host_us']:.1f}")

    def memory_cells(r):
        m = r["memory"]
        return (r["tokens"], r["batch"], fmt_gib(m["bf16_bytes"]), fmt_gib(m["resident_bytes"]), f"{m['ratio']:.3f}x",
                f"{100 * r['raw_tile_frac']:.2f}%", fmt_gib(m["allocated_bytes"]))

    def check_cells(r):
        c = r["check"]
        return (r["tokens"], r["batch"], "yes" if c["layer0_bit_exact"] else "NO", f"{c['attn0_flash_rel_err']:.2e}",
                f"{c['attn0_gaac_rel_err']:.2e}", f"{c['attn0_gaac_vs_flash_max_abs']:.3g}")

    lines += ["## Decode step (eager, ms per step, every step appends and plans)", "",
              *table(("context", "batch", "BF16 + flash ms", "GAAC ms", "speedup GAAC/BF16", "BF16 tok/s",
                      "GAAC tok/s", "step without append+attention ms", "slowest step BF16 / GAAC ms",
                      "GAAC host us/layer (append+plan+attention)", "BF16 host us/layer (append+attention)"),
                     map(step_cells, rows))]
    lines += ["", "speedup = BF16 ms / GAAC ms (above 1: GAAC faster). host us/layer: the cache's own calls without "
              "the model, timed on the host as they return (the GPU runs behind).", ""]
    split_rows = [r for r in rows if "gaac_breakdown" in r]
    if split_rows:
        def split_cells(r):
            b = r["gaac_breakdown"]
            med = (f" ({b['append_median_us']:.1f})", f" ({b['run_median_us']:.1f})") if "run_median_us" in b else ("", "")
            return (r["tokens"], r["batch"], f"{b['plan_us']:.1f} ({b['plan_us_per_step']:.0f} a step)",
                    f"{b['append_us']:.1f}{med[0]}", f"{b['run_us']:.1f}{med[1]}",
                    f"{b['plan_us'] + b['append_us'] + b['run_us']:.1f}", f"{b['kv_us']:.1f}")
        lines += ["## Host time of GAAC's eager calls (us per layer, target <= 40 for plan + update_layer + run)", "",
                  *table(("context", "batch", "decode_plan", "update_layer (median)", "plan.run (median)", "total",
                          "the benchmark's token indexing (not counted)"), map(split_cells, split_rows)),
                  "", "Each call timed on the host as it returns, over 16 steps of every layer (one of them finishes "
                  "a block in every sequence): the mean per layer, and in brackets the median call.  A launch "
                  "blocks once the GPU's queue is full, so where the GPU's work per layer outlasts the host's the "
                  "calls take the GPU's time (compare the step's wall time).", ""]
    graph_rows = [r for r in rows if "graph" in r]
    if graph_rows:
        def graph_cells(r):
            g = r["graph"]
            d, a, k = (g[n]["ms"] for n in ("default", "gaac", "skip"))
            b = r["batch"]
            return (r["tokens"], b, f"{d:.3f}", f"{a:.3f}", f"{d / a:.3f}x", f"{1e3 * b / d:.1f}", f"{1e3 * b / a:.1f}",
                    f"{k:.3f}", f"{g['default']['event_max_ms']:.3f} / {g['gaac']['event_max_ms']:.3f}",
                    f"{g['gaac']['replayed_us']:.1f}", f"{g['gaac_plan_ms']:.1f} / {g['gaac_capture_ms']:.0f}")
        lines += ["## Decode step in one CUDA graph (ms per step, every step appends; GAAC: one plan of steps)", "",
                  *table(("context", "batch", "BF16 + flash ms", "GAAC ms", "speedup GAAC/BF16", "BF16 tok/s",
                          "GAAC tok/s", "step without append+attention ms", "slowest step BF16 / GAAC ms",
                          "GAAC host us/step after replay (`plan.replayed()`)", "GAAC plan ms / capture ms"),
                         map(graph_cells, graph_rows))]
        lines += ["", "Each variant's whole step -- every layer's append and attention, and the model -- is one CUDA "
                  "graph, captured once and replayed back to back; the wall time includes GAAC's host account after "
                  "each replay.  BF16: lengths on the device, the token written at its device position, flash "
                  "(`torch.ops.aten._flash_attention_forward`, varlen with `seqused_k`) in the fastest mode that runs "
                  f"here (`{graph_rows[0]['graph']['flash_mode']}`: `SdpaGraphAttend` describes the modes; the .json "
                  "has each context's layer-0 call times of every mode).  GAAC: `cache.decode_plan(32, steps=N)` covers "
                  "the N replays (a work list for the lengths of its last step, each split stopped at the length the "
                  "kernel reads on the device); one kernel a layer appends the token at the position it reads on the "
                  "device and encodes a block the token completes straight from the tail into the pools.", ""]
    lines += ["## Memory (`PagedKVCache.memory()`)", "",
              *table(("context", "batch", "BF16 KV GiB", "GAAC resident GiB", "ratio", "raw-tile fraction",
                      "GAAC allocated GiB"), map(memory_cells, rows))]
    lines += ["", "## Correctness (after the timed steps)", "",
              *table(("context", "batch", "layer 0 reads back bit-exact", "layer-0 attention rel. err vs fp32: flash",
                      "GAAC", "GAAC vs flash max abs"), map(check_cells, rows)), ""]
    eq = rep.get("equal_memory")
    if eq:
        tp, cells = {}, []
        for name, key, n in (("BF16 + flash", "default", eq["bf16_seqs"]), ("GAAC", "gaac", eq["gaac_seqs"])):
            per = eq["bf16_per_seq"] if key == "default" else eq["gaac_per_seq"]
            t = eq.get(key, {}).get("ms")
            tp[key] = 1e3 * n / t if t else 0.0
            cells.append((name, f"{per / GIB:.3f}", n, t if t is None else f"{t:.3f}", f"{tp[key]:.1f}"))
        lines += [f"## Equal memory: {fmt_gib(eq['budget_bytes'])} GiB of KV, {eq['tokens']}-token sequences", "",
                  *table(("cache", "bytes per sequence (GiB)", "sequences that fit", "step ms (eager loop)",
                          "aggregate tok/s"), cells)]
        if tp["default"]:
            lines += ["", f"GAAC / BF16 aggregate throughput: {tp['gaac'] / tp['default']:.3f}x with "
                      f"{eq['gaac_seqs'] - eq['bf16_seqs']:+d} sequences."]
        if eq.get("default_graph") and eq.get("gaac_graph"):
            gd = 1e3 * eq["bf16_seqs"] / eq["default_graph"]["ms"]
            gg = 1e3 * eq["gaac_seqs"] / eq["gaac_graph"]["ms"]
            lines += ["", f"With each step one CUDA graph: BF16 {eq['default_graph']['ms']:.3f} ms a step "
                      f"({gd:.1f} tok/s), GAAC {eq['gaac_graph']['ms']:.3f} ms ({gg:.1f} tok/s): **{gg / gd:.3f}x** "
                      "aggregate throughput."]
        lines.append("")
    return "\n".join(lines) + "\n"


def kernel_profile(run, first: int, steps: int) -> list:
    """``steps`` more steps under torch's profiler: each kernel (and copy) the GPU ran, by name, as
    ``[name, launches a step, us a step]``, the largest first; and the steps' GPU time not inside any of them
    (``"(idle between kernels)"``)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        ev[0].record()
        for j in range(steps):
            run(first + j)
        ev[1].record()
        sync()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append([e.key[:90], e.count / steps, us / steps])
    rows.sort(key=lambda r: -r[2])
    busy = sum(r[2] for r in rows)
    rows.append(["(idle between kernels)", 0, ev[0].elapsed_time(ev[1]) * 1e3 / steps - busy])
    return rows


def profile_lines(profiles: list) -> list:
    """Report lines for ``[(run name, kernel_profile rows)]``: each run's step time in its kernels, the largest."""
    if not profiles:
        return []
    lines = ["", "The kernels of a step (torch's profiler, steps after the window): us a step (launches a step):", ""]
    for name, prof in profiles:
        total = sum(r[2] for r in prof)
        lines.append(f"- {name}: {total:.0f} us a step: "
                     + "; ".join(f"{r[0]} {r[2]:.0f} ({r[1]:g})" for r in prof[:14]))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: tiny shapes, kernels in numba's simulator")
    ap.add_argument("--out", type=Path, required=True, help="markdown results (a .json beside it)")
    ap.add_argument("--data", default=None, help="SmolLM2 K/V dumps (default .devdata/kv, then ../shared/data/kv)")
    ap.add_argument("--contexts", default=None, help="comma-separated context lengths (default 16384,32768,65536,131072)")
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes (default 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 48: three block ends)")
    ap.add_argument("--warmup", type=int, default=None, help="steps before timing (default 4)")
    ap.add_argument("--cal-tokens", type=int, default=None, help="calibrate on the first N real tokens (default all)")
    ap.add_argument("--equal-memory", action="store_true")
    ap.add_argument("--budget-gib", type=float, default=None, help="KV budget for --equal-memory (default 60)")
    ap.add_argument("--eq-context", type=int, default=None, help="sequence length for --equal-memory (default 65536)")
    ap.add_argument("--max-kv-gib", type=float, default=64.0, help="skip a context and batch whose BF16 K/V is larger")
    ap.add_argument("--graph", action="store_true", help="also each variant's step captured in one CUDA graph")
    ap.add_argument("--profile", action="store_true", help="cProfile of GAAC's calls at the first context (.profile.txt)")
    args = ap.parse_args()
    args.profiled = False
    s = SMOKE_SHAPE if SMOKE else LLAMA_8B
    contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else (
        [40, 72] if SMOKE else [16384, 32768, 65536, 131072])
    batches = [int(x) for x in args.batches.split(",")]
    args.steps = args.steps or (16 if SMOKE else 48)
    args.warmup = args.warmup if args.warmup is not None else (1 if SMOKE else 4)
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
           "cal_tokens": cal_tokens, "steps": args.steps, "warmup": args.warmup, "smoke": SMOKE, "contexts": []}
    raw_frac = 0.25
    for batch in batches:
        for tokens in contexts:
            if batch * s.kv_bytes(tokens) > args.max_kv_gib * GIB:
                log(f"== context {tokens}, batch {batch}: skipped, {batch * s.kv_bytes(tokens) / GIB:.0f} GiB of BF16 "
                    f"K/V is over --max-kv-gib {args.max_kv_gib:g} (both caches must fit beside the weights)")
                continue
            row = run_context(model, src, cal, s, tokens, batch, raw_frac, args)
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
