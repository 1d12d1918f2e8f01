"""Timing variants of the attention kernel: kernels of the shipped kernel's structure that skip or repeat a
stage, or time each split, for benchmarks/attention.py's breakdown and ``--timeline``.

    from benchmarks.attention_variants import plan_options
    plan = AttentionPlan(view, q_heads, **plan_options({"variant": "load_only", "nstage": 2}))

Each variant is a :class:`gaac.cuda.attention.KernelHooks` subclass (:data:`VARIANTS`):

- ``full``: the shipped kernel;
- ``load_only``: stage the tiles (``cp.async``) and nothing else;
- ``no_decode``: stage, then run the MMAs on the staged bytes as if they were BF16;
- ``decode_twice``: decode every compressed tile twice;
- ``timeline``: the full kernel; each split's start and end times (``%globaltimer``, ns: bits 0..15, then
  16..31) and its SM written over ``o_part[row * D ..]`` of its first head (5 floats).

The overlapped V decode calls the decoder's stages directly, so only ``full`` and ``timeline`` run with it
(:data:`OVERLAPS`); the others run without it unless ``overlap`` is given, which they refuse.
"""
from __future__ import annotations

import functools
import time

from gaac.cuda.attention import KernelHooks, attention_kernel
from gaac.cuda.primitives import SIMULATOR, device, f32, u32, u64, warp_sync
from gaac.cuda.tile_decoder import decode_tile_fn

if SIMULATOR:
    def globaltimer():
        return u64(time.perf_counter_ns())

    def smid():
        return u32(0)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _register(ret, text):
        """An intrinsic that reads one special register with ``text`` (``$0``: the result)."""
        @intrinsic
        def read(typingctx):
            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ret, []), text, "=l" if ret.width == 64 else "=r",
                                   side_effect=True)
                return builder.call(asm, [])
            return (types.uint64 if ret.width == 64 else types.uint32)(), codegen
        return read

    _globaltimer = _register(ir.IntType(64), "mov.u64 $0, %globaltimer;")
    _smid = _register(ir.IntType(32), "mov.u32 $0, %smid;")

    @device
    def globaltimer():
        """The device's nanosecond clock (``%globaltimer``), common to all SMs."""
        return _globaltimer()

    @device
    def smid():
        return _smid()


@functools.lru_cache(maxsize=None)
def _decode_twice_fn(channels: int):
    """The tile decoder's device functions, its ``decode`` run twice (a warp barrier between)."""
    decode, *stages = decode_tile_fn(channels)

    @device
    def twice(smem, src, dst, base, base_stride, cap, status, scr):
        decode(smem, src, dst, base, base_stride, cap, status, scr)
        warp_sync(scr)
        decode(smem, src, dst, base, base_stride, cap, status, scr)
    return (twice, *stages)


@device
def _timeline_start():
    return globaltimer()


@device
def _timeline_finish(o_part, at, t_start, lane, scr):
    warp_sync(scr)
    if lane == 0:
        t0 = u32(t_start)
        t1 = u32(globaltimer())
        o_part[at] = f32(t0 & 0xFFFF)
        o_part[at + 1] = f32(t0 >> 16)
        o_part[at + 2] = f32(t1 & 0xFFFF)
        o_part[at + 3] = f32(t1 >> 16)
        o_part[at + 4] = f32(smid())


class LoadOnly(KernelHooks):
    decodes = False
    stage_only = True


class NoDecode(KernelHooks):
    decodes = False


class DecodeTwice(KernelHooks):
    decoder = staticmethod(_decode_twice_fn)


class Timeline(KernelHooks):
    start = staticmethod(_timeline_start)
    finish = staticmethod(_timeline_finish)


VARIANTS = {"full": KernelHooks, "load_only": LoadOnly, "no_decode": NoDecode, "decode_twice": DecodeTwice,
            "timeline": Timeline}
OVERLAPS = ("full", "timeline")


def builder(variant: str):
    """A ``build_kernel`` for :class:`gaac.attention.AttentionPlan` that builds ``variant``'s kernel."""
    hooks = VARIANTS[variant]

    def build(head_dim, plain, nstage, stage_bytes, overlap, max_registers):
        if overlap and variant not in OVERLAPS:
            raise ValueError(f"variant {variant!r} runs without the overlapped V decode")
        return attention_kernel(head_dim, plain, nstage, stage_bytes, overlap, max_registers, hooks)
    return build


def plan_options(cfg: dict) -> dict:
    """:class:`gaac.attention.AttentionPlan` options for a benchmark configuration: its ``variant`` (default
    ``full``) becomes the plan's ``build_kernel``, and a variant outside :data:`OVERLAPS` runs without the
    overlapped V decode unless ``overlap`` is given."""
    cfg = dict(cfg)
    variant = cfg.pop("variant", "full")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {tuple(VARIANTS)}")
    if variant != "full":
        cfg["build_kernel"] = builder(variant)
    if variant not in OVERLAPS and cfg.get("overlap") is None:
        cfg["overlap"] = False
    return cfg
