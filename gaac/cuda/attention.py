"""Fused split-KV decode attention on the GAAC paged cache, and a BF16 kernel of the same structure.

Why this shape
==============
On an H200 the cache streams at ~4 TB/s, so the kernel has about 5 integer
operations per element for reconstruction before it stops being memory-bound;
CUDA-core FMAs for ``q.k`` and ``p.v`` alone would cost 2*g more per element
(g = query heads per KV head).  So the arithmetic of attention goes to the
tensor cores (``mma.sync m16n8k16`` BF16 -> FP32 with the 16 tokens of a block
as the M dimension and the query heads as N: ``S^T = K.Q^T`` and ``O^T = V^T.P``,
so that no MMA row is padding for g <= 8; P goes from the C layout of the first
product to the B layout of the second by one ``movmatrix`` transpose per 8
tokens), and the CUDA cores only rebuild BF16 bits.  BF16 products are exact in
FP32, so the scores are those of the exact cache.

One thread block = one warp = one *split*: a run of 16-token blocks of one
sequence and one KV head.  Per block the warp

1. copies the K and V slots of the block ``NSTAGE - 1`` blocks ahead into shared
   memory with ``cp.async`` (16-byte copies, no registers, so the loads of later
   blocks are in flight while this one is computed; ``nstage=1`` instead keeps one
   area per kind and refills it with the next block as soon as it has been read);
2. decodes each slot straight into the MMA A fragments of ``q.k`` and ``p.v`` in
   registers (:func:`_frag_decoder_fn`: each lane owns whole groups of rows and
   channels, and the query and the output follow the fragments' channel order); a raw
   tile (slot overflow, rare) or the sequence's BF16 tail is loaded from global memory
   into the same fragments when it is used;
3. computes the 16 scores of every query head of the group, updates the online softmax
   in the log2 domain (the accumulators are rescaled only when a head's maximum rose),
   and accumulates ``P.V`` in FP32 registers.

Each split writes its normalised partial output and log-sum-exp; a second small
kernel merges the splits of a sequence (:func:`merge_kernel`).  The BF16
baseline (``plain=True``) is the same kernel with every tile raw: step 1 stages
BF16 tiles and step 2 is compiled out.

Performance (H200, benchmarks/results/attention-v17-h200.md): the compressed
loads run 1.4x faster than the BF16 twin's, and the decode hides most of its work
under them; the rest leaves the kernel bound by its shared-memory traffic (the L1
data pipe, ~70% busy) and its integer instructions (the ALU pipe, ~56%) at 12
one-warp blocks per SM (168 registers and 18 KB of shared memory each): at 64K
tokens it is 1.15x the speed of its BF16 twin and 1.18x torch's flash kernel.
A split's prologue and epilogue run in every warp at once with nothing to overlap
them, so their instruction counts and round trips to memory are kept short (v16);
the staging areas start on 128-byte lines (v17, :data:`LINE`).
benchmarks/NOTES-attention.md has the analysis.

Pair words
==========
Decoding builds each output word (two BF16 elements ``c, c+1`` of one token)
directly: ``(prmt(sm, dup) & 0x807F807F) | (e_c << 7 | e_{c+1} << 23)``.  The
exponent pair ``Z`` is ``code pair + base pair + escape bits``: the 3-bit codes
of two elements move from bits ``0..5`` of a 12-bit code field to bits 7 and 23
with one multiply (the two shifted copies cannot overlap, so no carries), the
bases are stored pre-shifted per channel pair (rows b3, b4 and a zero row for
raw groups, selected by the mode tag), and an escape byte's bits land on bits
10 and 26 (exponent bit 3) by one more multiply.  Raw groups add bit planes 1..4 on a slow path.

Simulator
=========
Under ``NUMBA_ENABLE_CUDASIM=1`` the PTX intrinsics (``mma``, ``ldmatrix``,
``cp.async``, ``prmt``, shuffles) are replaced by Python functions with the
same per-lane semantics that exchange values through a shared ``scratch``
array and ``syncthreads`` (the simulator has no warp primitives).  That is
correct because every block is one warp with warp-uniform control flow
around those calls, so the kernel source is the same on both.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import config, cuda, float32, int32, uint32, uint64

from .. import layout as L

SIMULATOR = bool(config.ENABLE_CUDASIM)
WARP = 32

if SIMULATOR:
    # Fixed-width casts that wrap like the GPU's registers (numba's own casts raise on overflow in
    # the simulator, and are slow there).
    def u32(x):
        return np.uint32(int(x) & 0xFFFFFFFF)

    def i32(x):
        v = int(x) & 0xFFFFFFFF
        return np.int32(v - (1 << 32) if v >= 1 << 31 else v)

    def u64(x):
        return np.uint64(int(x) & 0xFFFFFFFFFFFFFFFF)

    f32 = np.float32
else:
    u32, i32, u64, f32 = uint32, int32, uint64, float32

# Kernel variants: the full kernel, and the stage-skipping / stage-repeating ones that give the time breakdown.
FULL = "full"
LOAD_ONLY = "load_only"      # stage the tiles (cp.async) and nothing else
NO_DECODE = "no_decode"      # stage, then run the MMAs on the staged bytes as if they were BF16
DECODE_TWICE = "decode_twice"  # decode every compressed tile twice
VARIANTS = (FULL, LOAD_ONLY, NO_DECODE, DECODE_TWICE)

# The staging areas start on 128-byte lines of shared memory: a cp.async copy's 16-byte chunks are written a
# line at a time, and a group of 8 lanes whose destinations straddle two lines costs two wavefronts of the L1
# data pipe instead of one.  ncu, v16 at 64K: a warp-wide copy of a V slot took 8 wavefronts for 4 ideal (the
# areas sat at 96 mod 128), of a K slot 15.75 (its source, 2928-byte slots, is off the lines too: 10.5 with
# the areas on lines, 4 with slots of whole lines, gaac.calibrate's slot_line); the copies were 29% of the
# kernel's shared-memory wavefronts.  Every area is on a line when the stage size is a multiple of 128 bytes
# (the real caches' 2944); the plan does not round it up, which would cost shared memory, so occupancy.
LINE = 128
SMEM_ALIGN = None if SIMULATOR else LINE   # (the simulator takes no alignment)
MAX_BLOCKS_PER_SPLIT = 64    # the split's block-table entries are staged in shared memory
BASE_ROWS = 3                # pre-shifted base rows per kind, indexed by the mode tag: b3, b4, 0 (raw); the
                             # reserved tag 3 (flagged) reads the next row, so shared memory follows the bases
PAD_WORDS = 4                # 16 bytes of padding per BF16 row: ldmatrix and the decoder's stores are conflict-free
GROUPS_MAX = 8               # MMA N = 8 query heads per KV head at most

_LOG2E = 1.4426950408889634
_NEG_INF = float("-inf")

# Status bits (``status[0]``, OR-ed in): set by the kernel when a slot breaks FORMAT.md section 8.
STATUS_BAD_TAG = 1
STATUS_BAD_ESCAPES = 2
STATUS_BAD_EPOCH = 4         # a block's epoch is not below the view's epoch count (its bases: epoch 0's)



def device(fn):
    """A device function on the GPU (inlined); a plain Python function in the simulator, where every
    call of a ``cuda.jit`` device function takes a module-wide lock that the 32 threads of a block
    contend for."""
    return fn if SIMULATOR else cuda.jit(device=True, inline=True)(fn)


# ----------------------------------------------------------------------------------------------
# Primitives: PTX on the GPU, Python in the simulator.
#
# Shared memory is addressed in bytes through 32-bit shared-window addresses: ``smem_base(smem)``
# is the address of ``smem[0]`` (0 in the simulator, where the functions index ``smem`` itself),
# so that address arithmetic stays in 32-bit registers.  Global sources of ``cp16`` are 64-bit
# addresses from ``gaddr(array, byte)`` (in the simulator, the byte index into the array).

if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    _F32 = ir.FloatType()

    def _asm(builder, ret, args, text, constraints, side_effect=False):
        fn = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(ir.InlineAsm(fn, text, constraints, side_effect=side_effect), args)

    def _tuple(context, builder, rt, r, n):
        return context.make_tuple(builder, rt, [builder.extract_value(r, i) for i in range(n)])

    @intrinsic
    def smem_base(typingctx, arr):
        """32-bit shared-window address of ``arr[0]``."""
        def codegen(context, builder, sig, args):
            a = context.make_array(sig.args[0])(context, builder, value=args[0])
            p = builder.ptrtoint(a.data, _I64)
            return _asm(builder, _I32, [p], "{ .reg .u64 a; cvta.to.shared.u64 a, $1; cvt.u32.u64 $0, a; }",
                        "=r,l")
        return types.uint32(arr), codegen

    @intrinsic
    def gaddr(typingctx, arr, byte):
        """64-bit global address of byte ``byte`` of ``arr``'s data."""
        def codegen(context, builder, sig, args):
            a = context.make_array(sig.args[0])(context, builder, value=args[0])
            off = context.cast(builder, args[1], sig.args[1], types.int64)
            return builder.add(builder.ptrtoint(a.data, _I64), off)
        return types.int64(arr, byte), codegen

    @intrinsic
    def _mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        rt = types.UniTuple(types.float32, 4)

        def codegen(context, builder, sig, args):
            r = _asm(builder, ir.LiteralStructType([_F32] * 4), list(args),
                     "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                     "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            return _tuple(context, builder, rt, r, 4)
        u, f = types.uint32, types.float32
        return rt(u, u, u, u, u, u, f, f, f, f), codegen

    @intrinsic
    def _movt(typingctx, x):
        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, list(args), "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r")
        return types.uint32(types.uint32), codegen

    def _ldsm_intrinsic(trans):
        text = f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0,$1,$2,$3}}, [$4];"

        @intrinsic
        def ldsm(typingctx, addr):
            rt = types.UniTuple(types.uint32, 4)

            def codegen(context, builder, sig, args):
                r = _asm(builder, ir.LiteralStructType([_I32] * 4), list(args), text, "=r,=r,=r,=r,r,~{memory}",
                         side_effect=True)
                return _tuple(context, builder, rt, r, 4)
            return rt(types.uint32), codegen
        return ldsm

    _ldsm = _ldsm_intrinsic(False)
    _ldsm_t = _ldsm_intrinsic(True)

    @intrinsic
    def _lds4(typingctx, addr):
        rt = types.UniTuple(types.uint32, 4)

        def codegen(context, builder, sig, args):
            r = _asm(builder, ir.LiteralStructType([_I32] * 4), list(args), "ld.shared.v4.u32 {$0,$1,$2,$3}, [$4];",
                     "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            return _tuple(context, builder, rt, r, 4)
        return rt(types.uint32), codegen

    @intrinsic
    def _lds2(typingctx, addr):
        rt = types.UniTuple(types.uint32, 2)

        def codegen(context, builder, sig, args):
            r = _asm(builder, ir.LiteralStructType([_I32] * 2), list(args), "ld.shared.v2.u32 {$0,$1}, [$2];",
                     "=r,=r,r,~{memory}", side_effect=True)
            return _tuple(context, builder, rt, r, 2)
        return rt(types.uint32), codegen

    @intrinsic
    def _lds(typingctx, addr):
        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, list(args), "ld.shared.u32 $0, [$1];", "=r,r,~{memory}", side_effect=True)
        return types.uint32(types.uint32), codegen

    @intrinsic
    def _lds_u8(typingctx, addr):
        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, list(args), "ld.shared.u8 $0, [$1];", "=r,r,~{memory}", side_effect=True)
        return types.uint32(types.uint32), codegen

    @intrinsic
    def _sts4(typingctx, addr, w0, w1, w2, w3):
        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), list(args), "st.shared.v4.u32 [$0], {$1,$2,$3,$4};", "r,r,r,r,r,~{memory}",
                 side_effect=True)
            return context.get_dummy_value()
        u = types.uint32
        return types.void(u, u, u, u, u), codegen

    @intrinsic
    def _ldg4(typingctx, gptr):
        rt = types.UniTuple(types.uint32, 4)

        def codegen(context, builder, sig, args):
            r = _asm(builder, ir.LiteralStructType([_I32] * 4), list(args), "ld.global.nc.v4.u32 {$0,$1,$2,$3}, [$4];",
                     "=r,=r,=r,=r,l", side_effect=True)
            return _tuple(context, builder, rt, r, 4)
        return rt(types.int64), codegen

    @intrinsic
    def _cp16(typingctx, addr, gptr):
        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), list(args), "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}",
                 side_effect=True)
            return context.get_dummy_value()
        return types.void(types.uint32, types.int64), codegen

    def _void_asm_fn(text: str):
        """A device function that emits one PTX statement with no operands (and clobbers memory)."""
        @intrinsic
        def fn(typingctx):
            def codegen(context, builder, sig, args):
                _asm(builder, ir.VoidType(), [], text, "~{memory}", side_effect=True)
                return context.get_dummy_value()
            return types.void(), codegen
        return fn

    _cp_commit = _void_asm_fn("cp.async.commit_group;")

    @functools.lru_cache(maxsize=None)
    def cp_wait_fn(count: int):
        """``cp.async.wait_group count``: all but this lane's ``count`` newest copy groups are done."""
        return _void_asm_fn(f"cp.async.wait_group {count};")

    # Programmatic dependent launch (sm_90): the attention kernel lets the merge kernel's blocks be
    # scheduled early; the merge waits for the attention grid's completion (and its memory) before it
    # reads the partials.  Without the launch attribute both are no-ops.
    grid_launch_dependents = _void_asm_fn("griddepcontrol.launch_dependents;")
    grid_wait = _void_asm_fn("griddepcontrol.wait;")

    @intrinsic
    def _prmt(typingctx, a, sel):
        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, [args[0], ir.Constant(_I32, 0), args[1]], "prmt.b32 $0, $1, $2, $3;",
                        "=r,r,r,r")
        return types.uint32(types.uint32, types.uint32), codegen

    @intrinsic
    def _prmt2(typingctx, a, b, sel):
        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, list(args), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
        return types.uint32(types.uint32, types.uint32, types.uint32), codegen

    @intrinsic
    def _pack_bf16x2(typingctx, lo, hi):
        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, [args[1], args[0]], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
        return types.uint32(types.float32, types.float32), codegen

    def _f32_asm_fn(text: str):
        """A float32 -> float32 device function of one PTX instruction (``$0`` = result, ``$1`` = x)."""
        @intrinsic
        def fn(typingctx, x):
            def codegen(context, builder, sig, args):
                return _asm(builder, _F32, list(args), text, "=f,f")
            return types.float32(types.float32), codegen
        return fn

    _ex2 = _f32_asm_fn("ex2.approx.ftz.f32 $0, $1;")
    # The split's epilogue: one MUFU instruction each where numba's 1 / x and math.log2 are a
    # correctly rounded division and libdevice's log2f (~40 and ~30 SASS, run by every warp at the end).
    lg2 = _f32_asm_fn("lg2.approx.ftz.f32 $0, $1;")
    rcp = _f32_asm_fn("rcp.approx.ftz.f32 $0, $1;")

    SCRATCH_WORDS = 1                   # the simulator's exchange area; unused on the GPU

    @device
    def lane_id():
        return u32(cuda.threadIdx.x & 31)

    @device
    def scratch_init(scr):
        pass

    @device
    def warp_sync(scr):
        cuda.syncwarp()

    @device
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr):
        """One m16n8k16 BF16 MMA with FP32 accumulation, ``C + A.B``: returns (d0, d1, d2, d3)."""
        return _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    @device
    def transpose8(x, scr):
        """``movmatrix.trans`` of the 8x8 BF16 matrix whose row ``r``, columns ``2q, 2q+1`` lane ``4r+q``
        holds (an MMA C fragment packed to BF16 pairs; the result is a B fragment)."""
        return _movt(x)

    @device
    def ldsm_rows(smem, base, rowb, scr):
        """``ldmatrix.x4`` of a 16x16 BF16 block (rows ``rowb`` bytes apart) as an MMA A operand: lane ``i``
        gives row ``i%8 + 8*(i//8 % 2)``, column byte ``16*(i//16)``."""
        lane = lane_id()
        return _ldsm(u32(base + ((lane & 7) + 8 * ((lane >> 3) & 1)) * rowb + 16 * (lane >> 4)))

    @device
    def ldsm_cols(smem, base, rowb, scr):
        """``ldmatrix.x4.trans``: the transpose of a 16x16 BF16 block as an MMA A operand: lane ``i`` gives
        row ``i%8 + 8*(i//16)``, column byte ``16*(i//8 % 2)``."""
        lane = lane_id()
        return _ldsm_t(u32(base + ((lane & 7) + 8 * (lane >> 4)) * rowb + 16 * ((lane >> 3) & 1)))

    @device
    def lds4(smem, addr):
        return _lds4(addr)

    @device
    def lds2(smem, addr):
        return _lds2(addr)

    @device
    def lds(smem, addr):
        return _lds(addr)

    @device
    def lds_u8(smem, addr):
        return _lds_u8(addr)

    @device
    def sts4(smem, addr, w0, w1, w2, w3):
        _sts4(addr, w0, w1, w2, w3)

    @device
    def cp16(smem, addr, src, gptr):
        """Asynchronous 16-byte copy from global ``gptr`` to shared ``addr``."""
        _cp16(addr, gptr)

    @device
    def ldg4(src, gptr):
        """16 bytes of read-only global memory at ``gptr`` (``src``: the array, for the simulator)."""
        return _ldg4(gptr)

    @device
    def cp_commit():
        _cp_commit()

    @device
    def prmt(a, sel):
        """Byte permute of ``a`` (bytes 4..7 are zero)."""
        return _prmt(a, sel)

    @device
    def prmt2(a, b, sel):
        """Byte permute of the 8 bytes ``b:a`` (selector nibbles 0..3 pick ``a``'s bytes, 4..7 ``b``'s)."""
        return _prmt2(a, b, sel)

    @device
    def shfl_idx(x, src, scr):
        """Lane ``src``'s ``x`` (32-bit)."""
        return u32(cuda.shfl_sync(0xFFFFFFFF, i32(x), i32(src)))

    @device
    def shfl_up(x, d, scr):
        """Lane ``lane - d``'s ``x`` (this lane's own below ``d``)."""
        return u32(cuda.shfl_up_sync(0xFFFFFFFF, i32(x), i32(d)))

    @device
    def pack_bf16x2(lo, hi):
        """Two floats -> a BF16 pair (round to nearest even), ``lo`` in bits 0..15."""
        return _pack_bf16x2(lo, hi)

    @device
    def ex2(x):
        return _ex2(x)

    @device
    def popc(x):
        return i32(cuda.popc(u32(x)))

    @device
    def mul_lo(a, b):
        """The low 32 bits of ``a * b``."""
        return u32(u32(a) * u32(b))

    @device
    def warp_any(pred, scr):
        return cuda.any_sync(0xFFFFFFFF, pred)

    @device
    def col_max(x, scr):
        """Max over the 8 lanes ``q, q+4, .. q+28`` (one column of an MMA C fragment)."""
        x = max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, 4))
        x = max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, 8))
        return max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, 16))

    @device
    def col_sum(x, scr):
        x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 4)
        x += cuda.shfl_xor_sync(0xFFFFFFFF, x, 8)
        return x + cuda.shfl_xor_sync(0xFFFFFFFF, x, 16)

    @device
    def escape_scan(cnt, scr):
        """Exclusive prefix of ``cnt`` in group order: lane ``t + 16h`` holds row t, half h (order 2t + h)."""
        lane = i32(lane_id())
        t = lane & 15
        other = cuda.shfl_xor_sync(0xFFFFFFFF, cnt, 16)
        row = i32(cnt + other)
        incl = row
        for d in (1, 2, 4, 8):
            v = cuda.shfl_up_sync(0xFFFFFFFF, incl, d)
            if t >= d:
                incl = i32(incl + v)
        return i32(incl - row + (other if lane >= 16 else 0))

else:
    # The simulator: an exchange publishes this lane's words in one of two alternating areas of a
    # shared scratch array and synchronises once (a lane reuses an area only after the next
    # exchange's barrier, when every lane has read it); the last WARP words count exchanges.
    _AREA = 8 * WARP
    SCRATCH_WORDS = 2 * _AREA + WARP

    def _lane():
        return cuda.threadIdx.x % WARP

    def _exchange(scr, *words):
        """Publish up to 8 words of this lane; returns the area: lane ``l``'s word ``i`` is ``area[8l + i]``."""
        lane = _lane()
        count = int(scr[2 * _AREA + lane])
        area = scr[_AREA * (count & 1):_AREA * ((count & 1) + 1)]
        for i, w in enumerate(words):
            area[8 * lane + i] = int(w) & 0xFFFFFFFF
        scr[2 * _AREA + lane] = count + 1
        cuda.syncthreads()
        return np.asarray(area)

    def _pairs(words):
        """BF16 pair words -> their 2n floats (low half first), as float64 (NaN and Inf pass silently,
        as on the GPU)."""
        w = np.asarray(words, dtype=np.uint32)
        with np.errstate(invalid="ignore", over="ignore"):
            return np.stack([w << 16, w & 0xFFFF0000], axis=-1).view(np.float32).reshape(-1).astype(np.float64)

    def _float_to_bf16(x) -> int:
        f = int(np.float32(x).view(np.uint32))
        if (f & 0x7F800000) == 0x7F800000 and f & 0x7FFFFF:
            return 0x7FC0 | ((f >> 16) & 0x8000)
        return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16) & 0xFFFF

    def _mma_sim(area, lane, c):
        """Lane's (d0..d3) of ``C + A.B`` from the exchanged words a0..a3 (0..3) and b0, b1 (4, 5): row ``m``
        of A is k = 0..7 from a0 (a1 for m >= 8) of lanes 4(m%8) .. +3, k = 8..15 from a2 (a3); column
        ``n`` of B is b0, then b1, of lanes 4n .. 4n+3.  Each product is summed in float64 and added to C."""
        r, q = lane // 4, lane % 4
        out = [float(x) for x in c]
        for half in range(2):
            a = _pairs(np.concatenate([area[32 * r + half:32 * r + 32:8], area[32 * r + 2 + half:32 * r + 32:8]]))
            for j in range(2):
                n = 2 * q + j
                col = _pairs(np.concatenate([area[32 * n + 4:32 * n + 32:8], area[32 * n + 5:32 * n + 32:8]]))
                with np.errstate(invalid="ignore", over="ignore"):
                    out[2 * half + j] += float(a @ col)
        with np.errstate(invalid="ignore", over="ignore"):
            return f32(out[0]), f32(out[1]), f32(out[2]), f32(out[3])

    @device
    def lane_id():
        return u32(_lane())

    @device
    def scratch_init(scr):
        """Zero this lane's exchange counter (shared memory starts undefined)."""
        scr[2 * _AREA + _lane()] = 0
        cuda.syncthreads()

    @device
    def warp_sync(scr):
        cuda.syncthreads()

    @device
    def smem_base(arr):
        return u32(0)

    @device
    def gaddr(arr, byte):
        return int(byte)

    @device
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, scr):
        return _mma_sim(_exchange(scr, a0, a1, a2, a3, b0, b1), _lane(), (c0, c1, c2, c3))

    @device
    def transpose8(x, scr):
        area = _exchange(scr, x)
        r, q = _lane() // 4, _lane() % 4
        el = lambda i, j: (int(area[8 * (4 * i + j // 2)]) >> (16 * (j % 2))) & 0xFFFF  # noqa: E731  (row i, col j)
        return u32(el(2 * q, r) | (el(2 * q + 1, r) << 16))

    def _ldsm_sim(smem, row_of, trans):
        """Lane's 4 fragment words; ``row_of(i)`` is the row byte address lane ``i`` would give."""
        lane = _lane()
        r, q = lane // 4, lane % 4
        out = []
        for i in range(4):
            if not trans:
                out.append(u32(smem[(row_of(8 * i + r) >> 2) + q]))
            else:
                lo = (int(smem[(row_of(8 * i + 2 * q) >> 2) + r // 2]) >> (16 * (r % 2))) & 0xFFFF
                hi = (int(smem[(row_of(8 * i + 2 * q + 1) >> 2) + r // 2]) >> (16 * (r % 2))) & 0xFFFF
                out.append(u32(lo | (hi << 16)))
        return out[0], out[1], out[2], out[3]

    @device
    def ldsm_rows(smem, base, rowb, scr):
        return _ldsm_sim(smem, lambda i: int(base) + ((i & 7) + 8 * ((i >> 3) & 1)) * int(rowb) + 16 * (i >> 4), False)

    @device
    def ldsm_cols(smem, base, rowb, scr):
        return _ldsm_sim(smem, lambda i: int(base) + ((i & 7) + 8 * (i >> 4)) * int(rowb) + 16 * ((i >> 3) & 1), True)

    @device
    def lds4(smem, addr):
        w = int(addr) >> 2
        return u32(smem[w]), u32(smem[w + 1]), u32(smem[w + 2]), u32(smem[w + 3])

    @device
    def lds2(smem, addr):
        w = int(addr) >> 2
        return u32(smem[w]), u32(smem[w + 1])

    @device
    def lds(smem, addr):
        return u32(smem[int(addr) >> 2])

    @device
    def lds_u8(smem, addr):
        i = int(addr)
        return u32((int(smem[i >> 2]) >> (8 * (i & 3))) & 0xFF)

    @device
    def sts4(smem, addr, w0, w1, w2, w3):
        w = int(addr) >> 2
        smem[w:w + 4] = (int(w0), int(w1), int(w2), int(w3))

    @device
    def ldg4(src, gptr):
        b = int(gptr)
        w = np.asarray(src[b:b + 16]).view(np.uint8).view(np.uint32)
        return u32(w[0]), u32(w[1]), u32(w[2]), u32(w[3])

    @device
    def cp16(smem, addr, src, gptr):
        b = int(gptr)
        if src.dtype != np.uint8:           # (gptr is a byte offset: the bases are int32)
            src = np.asarray(src).view(np.uint8)
        smem[int(addr) >> 2:(int(addr) >> 2) + 4] = np.asarray(src[b:b + 16]).view(np.uint8).view(np.uint32)

    @device
    def cp_commit():
        pass

    @device
    def grid_launch_dependents():
        pass

    @device
    def grid_wait():
        pass

    def cp_wait_fn(count: int):
        @device
        def cp_wait():
            pass
        return cp_wait

    @device
    def prmt(a, sel):
        x = int(a)
        out = 0
        for i in range(4):
            out |= ((x >> (8 * ((int(sel) >> (4 * i)) & 7))) & 0xFF) << (8 * i)
        return u32(out & 0xFFFFFFFF)

    @device
    def prmt2(a, b, sel):
        x = int(a) | (int(b) << 32)
        out = 0
        for i in range(4):
            out |= ((x >> (8 * ((int(sel) >> (4 * i)) & 7))) & 0xFF) << (8 * i)
        return u32(out)

    @device
    def shfl_idx(x, src, scr):
        area = _exchange(scr, u32(x))
        return u32(area[8 * (int(src) & 31)])

    @device
    def shfl_up(x, d, scr):
        area = _exchange(scr, u32(x))
        lane = _lane()
        return u32(area[8 * (lane - d)] if lane >= d else x)

    @device
    def pack_bf16x2(lo, hi):
        return u32(_float_to_bf16(lo) | (_float_to_bf16(hi) << 16))

    @device
    def ex2(x):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.exp2(np.float32(x))

    @device
    def lg2(x):
        return np.float32(np.log2(np.float32(x)))

    @device
    def rcp(x):
        return np.float32(np.float32(1) / np.float32(x))

    @device
    def popc(x):
        return np.int32(bin(int(x) & 0xFFFFFFFF).count("1"))

    @device
    def mul_lo(a, b):
        return u32(int(a) * int(b))

    @device
    def warp_any(pred, scr):
        area = _exchange(scr, 1 if pred else 0)
        return any(int(area[8 * i]) for i in range(WARP))

    def _column(x, scr):
        """The 8 values of this lane's C-fragment column (lanes q, q+4, .. q+28), in lane order."""
        area = _exchange(scr, np.float32(x).view(np.uint32))
        return [np.uint32(area[8 * (_lane() % 4 + 4 * i)]).view(np.float32) for i in range(8)]

    @device
    def col_max(x, scr):
        return np.float32(np.fmax.reduce(_column(x, scr)))     # NaN-ignoring, like the GPU's max

    @device
    def col_sum(x, scr):
        v = _column(x, scr)
        # The butterfly order of the GPU version (xor 4, 8, 16 over the lanes = 1, 2, 4 over the column).
        v = [v[i] + v[i ^ 1] for i in range(8)]
        v = [v[i] + v[i ^ 2] for i in range(8)]
        return f32(v[_lane() // 4] + v[(_lane() // 4) ^ 4])

    @device
    def escape_scan(cnt, scr):
        area = _exchange(scr, cnt)
        lane = _lane()
        order = lambda i: 2 * (i & 15) + (i >> 4)  # noqa: E731
        mine = order(lane)
        return i32(sum(int(area[8 * i]) for i in range(WARP) if order(i) < mine))



@device
def escape_scan2(a, b, scr):
    """Two exclusive escape scans in one: the counts packed in 16-bit halves (a tile needs at most
    256 x 5 escape bytes, so the low half never carries into the high one)."""
    x = escape_scan(i32(a | (b << 16)), scr)
    return i32(x & 0xFFFF), i32(x >> 16)


# ----------------------------------------------------------------------------------------------
# Shared-memory layout (bytes).

def row_bytes(channels: int) -> int:
    """Bytes per row of a staged BF16 tile (the plain kernel): 2C plus 16 bytes of padding."""
    return 2 * channels + 4 * PAD_WORDS


def tile_bytes(channels: int) -> int:
    """Bytes of one staging area of the plain kernel: a padded BF16 tile."""
    return L.BLOCK_TOKENS * row_bytes(channels)


def k_base_row_words(head_dim: int) -> int:
    """Words of one of K's pre-shifted base rows (b3, b4, zeros; pair words): the D/2 pair words in 16-byte
    chunks, chunk ``j`` at ``j + j // 8`` (a spare chunk after every 8, so that the lanes of one 8-lane
    phase, which read chunks ``4q + g``, fall in 8 different bank groups), and a spare chunk at the end."""
    return 4 * (head_dim // 8 + head_dim // 64 + 1)


def v_base_strides(head_dim: int) -> tuple:
    """Word strides ``(S0, S1)`` of V's base table: the word of channel ``c`` for a token pair whose groups
    have modes ``m0``, ``m1`` is at ``m0 * S0 + m1 * S1 + c``.  ``S1`` is 1 chunk mod 8 and ``S0`` 2 mod 4, so
    that the four common rows (modes 3-bit and 4-bit) start in four different bank groups."""
    s1 = head_dim + 4
    return 3 * s1 + 12, s1


def base_words(head_dim: int) -> tuple:
    """Words ``(K rows, V table)`` of one head's bases in shared memory (both multiples of 4)."""
    s0, s1 = v_base_strides(head_dim)
    return BASE_ROWS * k_base_row_words(head_dim), 2 * s0 + 3 * s1


def bases_bytes(head_dim: int) -> int:
    """Shared bytes of one head's bases, rounded up to a :data:`LINE` so that the stages after them start
    on one."""
    return -(-4 * sum(base_words(head_dim)) // LINE) * LINE


def smem_bytes(channels: int, tph: int, nstage: int, plain: bool, stage_bytes: int) -> int:
    """Shared bytes of the tile area of one block: unless ``plain``, the bases (:func:`bases_bytes`); the
    stages (K and V, ``tph`` areas of ``stage_bytes`` each); unless ``plain``, :data:`END_PAD`."""
    stages = nstage * 2 * tph * stage_bytes
    return stages if plain else bases_bytes(tph * channels) + stages + END_PAD


END_PAD = 32        # a corrupt slot's escape reads (clamped to its capacity) end at most 20 bytes past it


def kernel_bases(b3, b4) -> np.ndarray:
    """Per-channel bases ``[..., D]`` (uint8) -> the shared-memory image of one kind's bases, int32
    ``[..., K rows + V table]`` (:func:`base_words`): K's part is used for K, V's for V.

    K: rows b3, b4, 0 of pair words ``b[2p] << 7 | b[2p+1] << 23`` (the exponent fields of two channels of
    one token, added to a code pair), row = the group's mode tag, chunks placed as
    :func:`k_base_row_words` says.  V: the words of token pairs, ``b_m0[c] << 7 | b_m1[c] << 23`` at
    ``m0 * S0 + m1 * S1 + c`` (:func:`v_base_strides`; the base of a raw group is 0).  The reserved tag 3
    reads past a kind's rows, which must be shared memory: the kernel flags it."""
    b3 = np.asarray(b3).astype(np.int32)
    b4 = np.asarray(b4).astype(np.int32)
    d = b3.shape[-1]
    lead = b3.shape[:-1]
    kw, vw = base_words(d)
    out = np.zeros(lead + (kw + vw,), np.int32)
    rs = k_base_row_words(d)
    chunk = np.arange(d // 8)
    at = 4 * (chunk + chunk // 8)
    for m, b in enumerate((b3, b4)):
        pairs = (b[..., 0::2] << 7) | (b[..., 1::2] << 23)             # [..., D/2]
        for i in range(4):
            out[..., m * rs + at + i] = pairs[..., 4 * chunk + i]
    s0, s1 = v_base_strides(d)
    half = [b3 << 7, b4 << 7, np.zeros_like(b3)]
    for m0 in range(3):
        for m1 in range(3):
            o = kw + m0 * s0 + m1 * s1
            out[..., o:o + d] = half[m0] | (half[m1] << 16)
    return out


# ----------------------------------------------------------------------------------------------
# The decoder: a staged slot straight into MMA fragments.

@device
def escape_pair(e, p):
    """Bits ``2p``, ``2p+1`` of escape byte ``e`` -> bits 10 and 26 (exponent bit 3 of pair word ``p``'s
    two elements): one multiply and one mask.  The multiplier places two copies of the byte, shifted
    by ``10 - 2p`` and ``25 - 2p``; they occupy disjoint bits, so the product has no carries."""
    return u32(mul_lo(e, (1 << (10 - 2 * p)) + (1 << (25 - 2 * p))) & 0x04000400)


@device
def escape_count(tags):
    """Escape bytes of the groups whose 2-bit tags ``tags`` holds: 1 a 4-bit group, 5 a raw one."""
    return i32(popc(tags & 0x55555555) + 5 * popc(tags & 0xAAAAAAAA))


@device
def shift(x, s):
    """``x << s`` for a compile-time ``s``, ``x >> -s`` for a negative one."""
    return u32(x << s) if s >= 0 else u32(x >> -s)


@functools.lru_cache(maxsize=None)
def _frag_decoder_fn(channels: int, head_dim: int):
    """Device functions that decode a staged slot of C-wide tiles straight into the MMA A fragments of
    :func:`attention_kernel`: no decoded tile in shared memory, no ``ldmatrix``.

    Lane ``4r + q`` owns whole groups, so that every group's mode tag, codes and escape bytes are read by
    one lane, and the fragments' element order is chosen to fit (``q.k`` and ``p.v`` tolerate any order
    that the query and the output follow):

    * K (A of ``S^T = K.Q^T``, pairs along channels): rows ``r`` and ``r + 8``, channels
      ``C/4 q .. C/4 q + C/4``; chunk ``kk`` of the MMA's k dimension is channels ``C/4 q + 4 kk`` .. +3.
    * V (A of ``O^T = V^T.P``, pairs along tokens): tokens ``2q, 2q+1, 2q+8, 2q+9``, channels
      ``C/8 r .. C/8 r + C/8``; rows ``r`` and ``r + 8`` of M chunk ``mt`` are channels ``C/8 r + 2 mt``, +1.
      A word is two tokens' elements of one channel: bytes from two rows' sign+mantissa words (one
      ``prmt``), codes of two rows side by side (one ``prmt`` a half group), a base word of the token
      pair's two modes (V's base table).

    A lane's groups form *runs* of consecutive groups of one row (K: 2 runs of ``C/32`` groups, V: 4 of
    ``C/64``): each run's first escape byte is the row's offset (a 16-row prefix over lanes, one shuffle
    scan for K and V together) plus the escape bytes of the row's groups before it (a masked ``popc``).
    """
    C, D = channels, head_dim
    geo = L.TileGeometry(C)
    GK, GV = C // 32, C // 64            # groups of a K run, of a V run
    CODE_OFF, TAG_OFF, ESC_OFF = geo.code_offset, geo.tag_offset, geo.escape_offset
    ROW_CODE = 3 * C // 8                # code bytes of a row
    SWZ = 7 if C == 128 else 3           # sign+mantissa chunk c is staged at c ^ ((c >> 3) & SWZ)
    RS = k_base_row_words(D)
    KW, _ = base_words(D)
    S0, S1 = v_base_strides(D)
    K_EVEN = (1 << 7) | (1 << 20)        # codes at bits 0-2, 3-5 of a 12-bit field -> bits 7, 23
    K_ODD = (1 << 1) | (1 << 14)         # codes at bits 6-8, 9-11 -> bits 7, 23
    RUN_K = (1 << 2 * GK) - 1
    RUN_V = (1 << 2 * GV) - 1
    KSM, VSM = 2 * GK, 2 * GV            # sign+mantissa words of a run
    KCW = 3 if C == 128 else 2           # code words of a K run (C=128: 12 aligned bytes)
    SIZES = (2 * KSM, 8, 2 * GK, 8 * GK)   # sizes of the loads' local arrays (the larger of K's and V's)

    @device
    def row_tags(smem, src, t):
        """Row ``t``'s mode tags: 2 bits a group, group 0 lowest."""
        if C == 128:
            return lds(smem, u32(src + TAG_OFF + 4 * t))
        return u32((lds(smem, u32(src + TAG_OFF + 4 * (t >> 1))) >> (16 * (t & 1))) & 0xFFFF)

    @device
    def row_prefix(smem, src_k, src_v, cap_k, cap_v, status, scr):
        """The escape bytes of the rows before each row, K's in bits 0..15 and V's in 16..31, in lanes
        ``t`` and ``t + 16``; flags the tiles' reserved tags and escapes past their capacities."""
        t = i32(lane_id() & 15)
        tk = row_tags(smem, src_k, t)
        tv = row_tags(smem, src_v, t)
        x = u32(escape_count(tk) | (escape_count(tv) << 16))
        incl = x
        for d in (1, 2, 4, 8):
            v = shfl_up(incl, d, scr)
            if t >= d:
                incl = u32(incl + v)
        if ((tk & (tk >> 1)) | (tv & (tv >> 1))) & 0x55555555:
            cuda.atomic.or_(status, 0, STATUS_BAD_TAG)
        if t == 15 and (i32(incl & 0xFFFF) > cap_k or i32(incl >> 16) > cap_v):
            cuda.atomic.or_(status, 0, STATUS_BAD_ESCAPES)
        return u32(incl - x)

    @device
    def k_runs(smem, src, pre, cap, offs, scr):
        """This lane's K runs (rows r, r + 8): their tags (run i in bits 8i..) and first escape bytes,
        clamped to ``cap`` (a corrupt slot then reads at most 20 bytes past itself: :data:`END_PAD`)."""
        lane = lane_id()
        q = lane & 3
        below = u32((1 << (2 * GK * q)) - 1)
        tags = u32(0)
        for i in range(2):
            t = i32((lane >> 2) + 8 * i)
            tr = row_tags(smem, src, t)
            offs[i] = min(i32(i32(shfl_idx(pre, t, scr) & 0xFFFF) + escape_count(tr & below)), i32(cap))
            tags = u32(tags | (((tr >> (2 * GK * q)) & RUN_K) << (8 * i)))
        return tags

    @device
    def v_runs(smem, src, pre, cap, offs, scr):
        """This lane's V runs (rows 2q, 2q+1, 2q+8, 2q+9): tags (run i in bits 8i..) and first escape
        bytes, as :func:`k_runs`."""
        lane = lane_id()
        r = lane >> 2
        below = u32((1 << (2 * GV * r)) - 1)
        tags = u32(0)
        for i in range(4):
            t = i32(2 * (lane & 3) + (i & 1) + 8 * (i >> 1))
            tr = row_tags(smem, src, t)
            offs[i] = min(i32(i32(shfl_idx(pre, t, scr) >> 16) + escape_count(tr & below)), i32(cap))
            tags = u32(tags | (((tr >> (2 * GV * r)) & RUN_V) << (8 * i)))
        return tags

    @device
    def escapes(smem, src, tags, offs, runs, per_run, ev):
        """Each group's first escape byte (read for 3-bit groups too, then dropped)."""
        esc = u32(src + ESC_OFF)
        for i in range(runs):
            pos = offs[i]
            for g in range(per_run):
                m = u32((tags >> (8 * i + 2 * g)) & 3)
                ev[i * per_run + g] = lds_u8(smem, u32(esc + pos))
                pos = i32(pos + m + 3 * (m >> 1))          # escape bytes of mode m: 0, 1, 5

    @device
    def code_words(smem, at, cw, o):
        """The 2 code words at byte ``at`` rounded down to a word, into ``cw[o]``, ``cw[o+1]``."""
        a = u32(at & ~u32(3))
        cw[o] = lds(smem, a)
        cw[o + 1] = lds(smem, u32(a + 4))

    @device
    def code24(cw, o, g):
        """The 24 code bits of group ``g`` of a run whose code words ``cw[o..]`` start with it (K, C=128)."""
        bit = 24 * g
        y = u32(cw[o + bit // 32] >> (bit % 32))
        if bit % 32 > 8:
            y = u32(y | (cw[o + bit // 32 + 1] << (32 - bit % 32)))
        return u32(y & 0xFFFFFF)

    @device
    def code24_at(cw, o, sh, g):
        """The same for a run that starts ``sh`` bits into its two code words ``cw[o], cw[o+1]``."""
        v = u64(u64((u64(cw[o + 1]) << u64(32)) | u64(cw[o])) >> u64(sh))
        return u32(u32(v >> u64(24 * g)) & 0xFFFFFF)

    # -- K ---------------------------------------------------------------------------------------

    @device
    def k_loads(smem, src, kbase, tags, offs, smw, cw, ev, bw):
        """Every shared-memory read of this lane's K groups, issued back to back: sign+mantissa words,
        code words, escape bytes, base pair words (``kbase``: its first group's b3 chunk)."""
        lane = lane_id()
        q = lane & 3
        for i in range(2):
            t = u32((lane >> 2) + 8 * i)
            if C == 128:
                for k in range(2):
                    c = u32(8 * t + ((2 * q + k) ^ (t & 7)))
                    w0, w1, w2, w3 = lds4(smem, u32(src + 16 * c))
                    smw[KSM * i + 4 * k], smw[KSM * i + 4 * k + 1] = w0, w1
                    smw[KSM * i + 4 * k + 2], smw[KSM * i + 4 * k + 3] = w2, w3
                code = u32(src + CODE_OFF + ROW_CODE * t + 12 * q)
                for k in range(3):
                    cw[3 * i + k] = lds(smem, u32(code + 4 * k))
            else:
                c = u32(4 * t + q)
                w0, w1, w2, w3 = lds4(smem, u32(src + 16 * (c ^ ((t >> 1) & 3))))
                smw[KSM * i], smw[KSM * i + 1], smw[KSM * i + 2], smw[KSM * i + 3] = w0, w1, w2, w3
                code_words(smem, u32(src + CODE_OFF + ROW_CODE * t + 6 * q), cw, 2 * i)
        escapes(smem, src, tags, offs, 2, GK, ev)
        for i in range(2):
            for g in range(GK):
                m = u32((tags >> (8 * i + 2 * g)) & 3)
                b0, b1, b2, b3 = lds4(smem, u32(kbase + m * (4 * RS) + 16 * g))
                k = 4 * (i * GK + g)
                bw[k], bw[k + 1], bw[k + 2], bw[k + 3] = b0, b1, b2, b3

    @device
    def k_compute(tags, smw, cw, ev, bw, kf):
        """K's fragment words: the word of pair ``p`` of group ``g`` of run ``i`` (row r + 8i) is
        ``kf[4 (2g + p // 2) + 2 (p % 2) + i]``.  Raw groups get exponent bits 0..3 here, 4..7 in
        :func:`k_fix`."""
        sh = u32(16 * (lane_id() & 1))                   # C=64: a run starts at byte 6q of its row
        for i in range(2):
            for g in range(GK):
                y = code24(cw, KCW * i, g) if C == 128 else code24_at(cw, KCW * i, sh, g)
                y_lo = u32(y & 0xFFF)
                y_hi = u32(y >> 12)
                k = i * GK + g
                sp = ev[k] if (tags >> (8 * i + 2 * g)) & 3 else u32(0)
                s0 = smw[KSM * i + 2 * g]
                s1 = smw[KSM * i + 2 * g + 1]
                o = 8 * g + i
                kf[o] = u32((prmt(s0, 0x1100) & 0x807F807F) | u32(((y_lo * K_EVEN) & 0x03800380) + bw[4 * k]
                                                                   + escape_pair(sp, 0)))
                kf[o + 2] = u32((prmt(s0, 0x3322) & 0x807F807F) | u32(((y_lo * K_ODD) & 0x03800380) + bw[4 * k + 1]
                                                                       + escape_pair(sp, 1)))
                kf[o + 4] = u32((prmt(s1, 0x1100) & 0x807F807F) | u32(((y_hi * K_EVEN) & 0x03800380) + bw[4 * k + 2]
                                                                       + escape_pair(sp, 2)))
                kf[o + 6] = u32((prmt(s1, 0x3322) & 0x807F807F) | u32(((y_hi * K_ODD) & 0x03800380) + bw[4 * k + 3]
                                                                       + escape_pair(sp, 3)))

    @device
    def planes(smem, at):
        """Bit planes 1..4 of a raw group (escape bytes ``at + 1 .. at + 4``) as ``p4 | p3 << 8 | p2 << 16 |
        p1 << 24``, for :func:`high_bits`."""
        return u32(lds_u8(smem, u32(at + 4)) | (lds_u8(smem, u32(at + 3)) << 8) | (lds_u8(smem, u32(at + 2)) << 16)
                   | (lds_u8(smem, u32(at + 1)) << 24))

    @device
    def high_bits(pw, e, half):
        """Exponent bits 4..7 of element ``e`` of a raw group (:func:`planes`) at bits 11..14 of a BF16 pair
        word's ``half``: bits e, 8+e, 16+e, 24+e gathered into bits 24..27 by one multiply (its four shifted
        copies of each bit never meet, so there are no carries)."""
        nib = u32(mul_lo(u32((pw >> e) & 0x01010101), 0x08040201) >> 24)
        return u32((nib & 0xF) << (11 + 16 * half))

    @device
    def k_fix(smem, src, tags, offs, kf):
        """Exponent bits 4..7 of raw K groups (about 0.3% of groups), added to their words (the exponent
        field has no carry out: a raw group's bits 0..3 are all it holds so far)."""
        if tags & 0xAAAAAAAA:
            esc = u32(src + ESC_OFF)
            for i in range(2):
                for g in range(GK):
                    if (tags >> (8 * i + 2 * g + 1)) & 1:
                        pw = planes(smem, u32(esc + offs[i] + escape_count((tags >> (8 * i)) & ((1 << 2 * g) - 1))))
                        for p in range(4):
                            o = 8 * g + i + 2 * p
                            kf[o] = u32(kf[o] + (high_bits(pw, 2 * p, 0) | high_bits(pw, 2 * p + 1, 1)))

    # -- V ---------------------------------------------------------------------------------------

    @device
    def v_loads(smem, src, vbase, tags, offs, smw, cw, ev, bw):
        """Every shared-memory read of this lane's V groups (``vbase``: the address of its first channel's
        word in V's base table, modes 0, 0)."""
        lane = lane_id()
        r = lane >> 2
        for i in range(4):
            t = u32(2 * (lane & 3) + (i & 1) + 8 * (i >> 1))
            if C == 128:
                w0, w1, w2, w3 = lds4(smem, u32(src + 16 * (8 * t + (r ^ (t & 7)))))
                smw[4 * i], smw[4 * i + 1], smw[4 * i + 2], smw[4 * i + 3] = w0, w1, w2, w3
                code_words(smem, u32(src + CODE_OFF + ROW_CODE * t + 6 * r), cw, 2 * i)
            else:
                c = u32(4 * t + (r >> 1))
                w0, w1 = lds2(smem, u32(src + 16 * (c ^ ((t >> 1) & 3)) + 8 * (r & 1)))
                smw[2 * i], smw[2 * i + 1] = w0, w1
                code_words(smem, u32(src + CODE_OFF + ROW_CODE * t + 3 * r), cw, 2 * i)
        escapes(smem, src, tags, offs, 4, GV, ev)
        for p in range(2):
            for g in range(GV):
                m0 = u32((tags >> (16 * p + 2 * g)) & 3)
                m1 = u32((tags >> (16 * p + 8 + 2 * g)) & 3)
                a = u32(vbase + 4 * (m0 * S0 + m1 * S1) + 32 * g)
                k = 8 * (p * GV + g)
                bw[k], bw[k + 1], bw[k + 2], bw[k + 3] = lds4(smem, a)
                bw[k + 4], bw[k + 5], bw[k + 6], bw[k + 7] = lds4(smem, u32(a + 16))

    @device
    def v_compute(tags, smw, cw, ev, bw, vf):
        """V's fragment words: element ``e`` of group ``g`` of runs ``2p`` (low halves) and ``2p + 1``
        (high halves) is ``vf[4 (4g + e // 2) + e % 2 + 2p]``."""
        lane = lane_id()
        r = lane >> 2
        sh = u32(16 * (r & 1)) if C == 128 else u32(8 * ((3 * r) & 3))
        for p in range(2):
            for g in range(GV):
                ka = 2 * p * GV + g
                kb = ka + GV
                ea = ev[ka] if (tags >> (16 * p + 2 * g)) & 3 else u32(0)
                eb = ev[kb] if (tags >> (16 * p + 8 + 2 * g)) & 3 else u32(0)
                esc = u32(ea | (eb << 16))
                y0 = code24_at(cw, 4 * p, sh, g)
                y1 = code24_at(cw, 4 * p + 2, sh, g)
                lo = prmt2(y0, y1, 0x5410)                   # codes of elements 0..4 at bits 3e, 16 + 3e
                hi = prmt2(y0, y1, 0x6521)                   # of elements 3..7 at bits 3e - 8, 8 + 3e
                for e in range(8):
                    code = shift(lo, 7 - 3 * e) if e < 5 else shift(hi, 15 - 3 * e)
                    j = e & 3
                    sm = prmt2(smw[VSM * 2 * p + 2 * g + e // 4], smw[VSM * (2 * p + 1) + 2 * g + e // 4],
                               j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12))
                    vf[4 * (4 * g + e // 2) + e % 2 + 2 * p] = u32(
                        (sm & 0x807F807F) | u32((code & 0x03800380) + ((esc << (10 - e)) & 0x04000400)
                                                + bw[8 * (p * GV + g) + e]))

    @device
    def v_fix(smem, src, tags, offs, vf):
        """Exponent bits 4..7 of raw V groups, as :func:`k_fix`: runs ``2p`` and ``2p + 1`` give the low and
        the high halves of the same words, so they are fixed together (one loop over the words they share,
        which the compiler unrolls: a larger one was left a loop and put ``vf`` in local memory)."""
        if tags & 0xAAAAAAAA:
            esc = u32(src + ESC_OFF)
            for p in range(2):
                for g in range(GV):
                    pa = u32(0)
                    pb = u32(0)
                    below = (1 << 2 * g) - 1
                    if (tags >> (16 * p + 2 * g + 1)) & 1:
                        pa = planes(smem, u32(esc + offs[2 * p] + escape_count((tags >> (16 * p)) & below)))
                    if (tags >> (16 * p + 8 + 2 * g + 1)) & 1:
                        pb = planes(smem, u32(esc + offs[2 * p + 1] + escape_count((tags >> (16 * p + 8)) & below)))
                    if pa | pb:
                        for e in range(8):
                            o = 4 * (4 * g + e // 2) + e % 2 + 2 * p
                            vf[o] = u32(vf[o] + (high_bits(pa, e, 0) | high_bits(pb, e, 1)))

    return row_prefix, k_runs, v_runs, k_loads, k_compute, k_fix, v_loads, v_compute, v_fix, SIZES


def _stage_slot_fn(channels: int, max_bytes: int):
    """Device function ``stage_slot(smem, dst, entry, slots, slot_bytes, lane)``: start copying slot
    ``entry`` (of at most ``max_bytes``) to the staging area at byte ``dst``, sign+mantissa chunk ``c``
    at ``c ^ ((c >> 3) & SWZ)`` (the layout :func:`_frag_decoder_fn` reads without bank conflicts).

    Lane ``l`` copies chunks ``l + 32k``.  Their swizzle is ``l ^ ((l >> 3) & SWZ) ^ ((4k) & SWZ)`` (``l >> 3``
    is below 4, so adding ``4k`` only flips bit 2), so every copy's shared and global addresses are one
    per-lane value plus a constant: one 64-bit multiply-add per slot for the source, immediates for the
    rest.  The tail of the slot takes a fixed number of predicated copies.  (Written per copy, the
    swizzle and 64-bit address arithmetic cost ~90 instructions a slot in the attention kernel's block
    loop, more than the copies themselves.)"""
    C = channels
    SM_PER_LANE = C // WARP             # the sign+mantissa section is C chunks of 16 bytes
    REST_PER_LANE = -(-(max_bytes // 16 - C) // WARP)
    SWZ = 7 if C == 128 else 3

    @device
    def stage_slot(smem, dst, entry, slots, slot_bytes, lane):
        g0 = gaddr(slots, u64(u32(entry)) * u64(u32(slot_bytes)) + u64(16 * lane))
        sw = u32(16 * (lane ^ ((lane >> 3) & SWZ)))
        for k in range(SM_PER_LANE):
            cp16(smem, u32(dst + (sw ^ (16 * ((4 * k) & SWZ))) + 512 * k), slots, g0 + 512 * k)
        left = i32(i32(slot_bytes >> 4) - C - i32(lane))     # chunks of the tail from this lane's first one
        rest = u32(dst + 16 * (C + lane))
        for k in range(REST_PER_LANE):
            if 32 * k < left:
                cp16(smem, u32(rest + 512 * k), slots, g0 + 16 * (C + 32 * k))
    return stage_slot


def decode_check_kernel(channels: int, slot_bytes: int):
    """Stage and decode slots exactly as the attention kernel does, as K and as V, and write out the tiles
    that the fragments hold.

    For the decoder's bit-exact tests against the reference codec: grid = one warp per slot;
    ``slots`` uint8 ``[n*slot_bytes]``, ``bases`` int32 (:func:`kernel_bases` of one tile's channels),
    ``cap``; out ``tiles`` uint16 ``[2, n, 16, C]`` (BF16 bits: as K, as V) and ``status`` int32 ``[1]``."""
    C = channels
    STAGE = -(-slot_bytes // 16) * 16
    KW, VW = base_words(C)
    BASE_BYTES = bases_bytes(C)
    SMEM_WORDS = (BASE_BYTES + STAGE + END_PAD) // 4
    TILE = L.BLOCK_TOKENS * C
    row_prefix, k_runs, v_runs, k_loads, k_compute, k_fix, v_loads, v_compute, v_fix, SIZES = \
        _frag_decoder_fn(C, C)
    NSM, NCW, NEV, NBW = SIZES
    stage_slot = _stage_slot_fn(C, slot_bytes)
    wait_all = cp_wait_fn(0)

    @cuda.jit
    def kernel(slots, bases, cap, tiles, status):
        smem = cuda.shared.array(SMEM_WORDS, uint32, alignment=SMEM_ALIGN)
        scr = cuda.shared.array(SCRATCH_WORDS, uint32)
        scratch_init(scr)
        sb = smem_base(smem)
        n = i32(cuda.blockIdx.x)
        lane = lane_id()
        r = i32(lane >> 2)
        q = i32(lane & 3)
        for i in range(lane, KW + VW, WARP):
            smem[i] = bases[i]
        src = u32(sb + BASE_BYTES)
        stage_slot(smem, src, n, slots, slot_bytes, lane)
        cp_commit()
        wait_all()
        warp_sync(scr)
        smw = cuda.local.array(NSM, uint32)
        cw = cuda.local.array(NCW, uint32)
        ev = cuda.local.array(NEV, uint32)
        bw = cuda.local.array(NBW, uint32)
        offs = cuda.local.array(4, int32)
        frag = cuda.local.array(C // 4, uint32)
        pre = row_prefix(smem, src, src, cap, cap, status, scr)
        tags = k_runs(smem, src, pre, cap, offs, scr)
        k_loads(smem, src, u32(sb + 16 * ((C // 32) * q + (q >> 1) * (C // 128))), tags, offs, smw, cw, ev, bw)
        k_compute(tags, smw, cw, ev, bw, frag)
        k_fix(smem, src, tags, offs, frag)
        out = n * TILE
        for kk in range(C // 16):          # word 4 kk + 2 p + i: row r + 8 i, channels C/4 q + 4 kk + 2 p, +1
            for w in range(4):
                x = frag[4 * kk + w]
                at = out + (r + 8 * (w & 1)) * C + (C // 4) * q + 4 * kk + 2 * (w >> 1)
                tiles[at] = u32(x & 0xFFFF)
                tiles[at + 1] = u32(x >> 16)
        tags = v_runs(smem, src, pre, cap, offs, scr)
        v_loads(smem, src, u32(sb + 4 * (KW + (C // 8) * r)), tags, offs, smw, cw, ev, bw)
        v_compute(tags, smw, cw, ev, bw, frag)
        v_fix(smem, src, tags, offs, frag)
        out = (cuda.gridDim.x + n) * TILE
        for mt in range(C // 16):          # word 4 mt + b + 2 p: channel C/8 r + 2 mt + b, tokens 2q + 8p, +1
            for w in range(4):
                x = frag[4 * mt + w]
                at = out + (2 * q + 8 * (w >> 1)) * C + (C // 8) * r + 2 * mt + (w & 1)
                tiles[at] = u32(x & 0xFFFF)
                tiles[at + C] = u32(x >> 16)
    return kernel


# ----------------------------------------------------------------------------------------------
# The attention kernel.

def kernel_signature() -> tuple:
    """The argument types :class:`gaac.attention.AttentionPlan` launches :func:`attention_kernel` with
    (to compile it before the first launch: its occupancy sizes the plan's splits)."""
    from numba import types

    def array(dtype):
        return types.Array(dtype, 1, "C")
    arrays = [types.int32] + [types.uint8] * 4 + [types.int32] * 2 + [types.uint8] * 2 + [types.int32] + \
        [types.int16] * 2 + [types.int32] * 2 + [types.float32] * 2 + [types.int32]
    return tuple([array(a) for a in arrays] + [types.int64] * 9 + [types.float32])

@functools.lru_cache(maxsize=None)
def attention_kernel(head_dim: int, plain: bool, variant: str = FULL, nstage: int = 3, stage_bytes: int = 0,
                     overlap: bool = False, max_registers: int | None = None):
    """The split-KV decode kernel for ``head_dim``; ``plain`` = every tile is BF16 (the baseline).

    ``overlap`` (compressed, head_dim <= 128): when both tiles of a block are slots, one escape prefix
    serves K and V, and the V tile's reads, then its decode, sit in one straight-line region with the
    q.k MMAs and the softmax, so that the compiler overlaps their latencies.  ``max_registers``
    caps registers per thread (more resident warps, possibly spills).

    ``stage_bytes``: bytes of a staging area, at least the larger slot of K and V (compressed kernel;
    raw tiles and the tail are loaded from global memory into fragments when used, so the stages only
    hold slots); the plain kernel stages padded BF16 tiles.  Arguments (all 1-D, C-contiguous;
    ``D = head_dim``, ``C = min(D, 128)``, ``T = D // C``): ``q32`` int32 ``[B*Hq*D/2]`` (BF16 pairs);
    ``slots_k/v`` uint8 slot pools (flat); ``raw_k/v`` uint8 raw-tile pools (flat, 32*C bytes a tile);
    ``table_k/v`` int32 ``[B*MB*Hkv*T]``; ``tail_k/v`` uint8 ``[B*Hkv*16*D*2]``; ``bases`` int32
    ``[E, Hkv, KW + VW]``: each epoch's shared-memory image of the bases (:func:`kernel_bases`; K's part
    from K's bases, V's from V's); ``epoch_k/v`` int16 ``[B*MB]`` each block's epoch (FORMAT.md 3.5);
    ``seq_lens`` int32 ``[B]``; ``work`` int32 ``[W*3]`` (sequence, first block, end block); out
    ``o_part`` float32 ``[W*Hkv*g*D]``, ``lse_part`` float32 ``[W*Hkv*g]`` (log2 domain); ``status`` int32
    ``[1]``; then ``max_blocks, kv_heads, g, slot_bytes_k, slot_bytes_v, cap_k, cap_v, epochs_k, epochs_v``
    (epoch counts; ``E = max``) and ``scale_log2``.  Grid ``(W, Hkv)``, one warp per block.

    Epochs: the plan cuts splits where a sequence's K or V epoch changes (``AttentionPlan``), so every
    split reads one epoch's bases per kind: copied into shared memory once, from its first block's
    epoch, and the block loop is the same as without epochs.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")
    D = head_dim
    C = L.tile_channels(D)
    T = D // C
    NS = nstage
    ROWB = row_bytes(C)
    SB = tile_bytes(C) if plain else stage_bytes
    if not plain and (stage_bytes % 16 or not L.TileGeometry(C).fixed_bytes <= stage_bytes <= 2 * L.BLOCK_TOKENS * C):
        raise ValueError(f"stage_bytes {stage_bytes}: a multiple of 16 that holds a slot of {C}-channel tiles")
    NCHUNK = D // 16                    # k-chunks of the score MMA (16 channels each)
    FRAG = C // 4                       # fragment words of one tile (K or V)
    NACC = D // 4                       # O^T accumulators: 4 per 16 channels
    ROW_CHUNKS = C // 8                 # 16-byte chunks of a BF16 row
    RAW_PER_LANE = L.BLOCK_TOKENS * ROW_CHUNKS // WARP
    if overlap and (T != 1 or plain or variant != FULL):
        raise ValueError("overlap is for the full compressed kernel with head_dim <= 128")
    STG = 0 if plain else bases_bytes(D)   # byte offsets in the shared array: the bases, then the stages
    SMEM_WORDS = smem_bytes(C, T, NS, plain, SB) // 4
    NENT = MAX_BLOCKS_PER_SPLIT * 2 * T
    KW, VW = base_words(D)
    KCH, VCH = KW // 4, VW // 4         # 16-byte chunks of K's and V's bases
    TILE_BYTES = L.BLOCK_TOKENS * C * 2
    (row_prefix, k_runs, v_runs, k_loads, k_compute, k_fix, v_loads, v_compute, v_fix,
     (NSM, NCW, NEV, NBW)) = _frag_decoder_fn(C, D)
    stage_slot = _stage_slot_fn(C, SB)
    REFILL = NS == 1                    # one area per kind, refilled as soon as it is read (see refill_fn)
    cp_wait = cp_wait_fn(1 if REFILL else NS - 1)
    do_decode = not plain and variant in (FULL, DECODE_TWICE)
    do_math = variant != LOAD_ONLY

    @device
    def copy_bf16_tile(smem, dst, is_tail, entry, raw, tail, tail_byte, valid, lane):
        """Start copying a raw tile or the tail to the padded BF16 tile at byte ``dst`` (plain kernel; tail
        rows at or after ``valid`` are zeroed so that 0 * garbage cannot make a NaN)."""
        g0 = gaddr(tail, tail_byte) if is_tail else gaddr(raw, (entry & 0x7FFFFFFF) * TILE_BYTES)
        for k in range(RAW_PER_LANE):
            i = u32(lane + WARP * k)
            r = i // ROW_CHUNKS
            a = u32(dst + r * ROWB + 16 * (i % ROW_CHUNKS))
            ga = g0 + i32(r * (2 * D) + 16 * (i % ROW_CHUNKS)) if is_tail else g0 + i32(16 * i)
            if is_tail and r >= valid:
                sts4(smem, a, u32(0), u32(0), u32(0), u32(0))
            else:
                cp16(smem, a, tail if is_tail else raw, ga)

    @device
    def entry(ents, i, kind):
        """Block-table entry of tile 0 of kind ``kind`` of split-relative block ``i`` (clamped to the staged
        entries: past the split's last block the value is not used)."""
        return ents[u32(min(i32(i), i32(MAX_BLOCKS_PER_SPLIT - 1)) * 2 * T + kind * T)]

    def issue_fn(kind: int):
        """Device function starting the copies of kind ``kind``'s tiles of block ``blk`` (split-relative
        ``i``) into stage ``st``: every tile for the plain kernel, the slots for the compressed one.  With
        one tile a head (T = 1) the caller passes the tile's block-table entry ``e1`` (see :func:`entry`)."""
        @device
        def issue(smem, sb, ents, i, st, blk, nfull, slots, slot_bytes, raw, tail, tail_base, tail_valid, lane, e1):
            is_tail = blk >= nfull
            for j in range(T):
                e = i32(-1) if is_tail else (i32(e1) if T == 1 else ents[u32((i * 2 + kind) * T + j)])
                dst = u32(sb + STG + ((st * 2 + kind) * T + j) * SB)
                if plain:
                    copy_bf16_tile(smem, dst, is_tail, e, raw, tail, tail_base + j * C * 2, tail_valid, lane)
                elif not is_tail and e >= 0:
                    stage_slot(smem, dst, e, slots, slot_bytes, lane)
        return issue

    issue_k, issue_v = issue_fn(0), issue_fn(1)

    def refill_fn(issue, kind: int):
        """``nstage=1``: start block i+1's copies of one kind into the area block i's tiles of that kind
        have just left (read into registers, then a warp barrier), as one copy group."""
        @device
        def refill(smem, sb, ents, i, blk, blk1, nfull, slots, slot_bytes, raw, tail, tail_base, tail_valid, lane):
            if blk + 1 < blk1:
                issue(smem, sb, ents, i32(i + 1), 0, i32(blk + 1), nfull, slots, slot_bytes, raw, tail, tail_base,
                      tail_valid, lane, entry(ents, i + 1, kind))
            cp_commit()
        return refill

    refill_k, refill_v = refill_fn(issue_k, 0), refill_fn(issue_v, 1)

    # -- fragments -------------------------------------------------------------------------------

    @device
    def k_from_bf16(arr, byte, stride, valid, kf):
        """K fragments of a raw tile or the tail (global memory, row 0 at ``byte``, rows ``stride`` bytes
        apart, rows at or after ``valid`` zero): rows r, r + 8, channels C/4 q ..; word ``w`` of row r + 8 i
        (channels C/4 q + 2w) is ``kf[4 (w // 2) + 2 (w % 2) + i]``.  Every load before the first use."""
        lane = lane_id()
        g0 = gaddr(arr, byte) + i32((C // 2) * (lane & 3))
        for i in range(2):
            t = i32((lane >> 2) + 8 * i)
            keep = u32(0xFFFFFFFF) if t < valid else u32(0)
            for k in range(C // 32):
                w0, w1, w2, w3 = ldg4(arr, g0 + i32(t * stride + 16 * k))
                o = 8 * k + i
                kf[o], kf[o + 2], kf[o + 4], kf[o + 6] = (u32(w0 & keep), u32(w1 & keep), u32(w2 & keep),
                                                          u32(w3 & keep))

    @device
    def v_from_bf16(arr, byte, stride, valid, vf):
        """V fragments of a raw tile or the tail: rows 2q, 2q+1, 2q+8, 2q+9, channels C/8 r ..; the pair
        words of two rows become words of token pairs by one ``prmt`` each."""
        lane = lane_id()
        g0 = gaddr(arr, byte) + i32((C // 4) * (lane >> 2))
        words = cuda.local.array(FRAG, uint32)
        for i in range(4):
            t = i32(2 * (lane & 3) + (i & 1) + 8 * (i >> 1))
            keep = u32(0xFFFFFFFF) if t < valid else u32(0)
            for k in range(C // 64):
                w0, w1, w2, w3 = ldg4(arr, g0 + i32(t * stride + 16 * k))
                o = (C // 16) * i + 4 * k
                words[o], words[o + 1], words[o + 2], words[o + 3] = (u32(w0 & keep), u32(w1 & keep),
                                                                      u32(w2 & keep), u32(w3 & keep))
        for p in range(2):
            for w in range(C // 16):
                a = words[(C // 16) * 2 * p + w]
                b = words[(C // 16) * (2 * p + 1) + w]
                vf[4 * w + 2 * p] = prmt2(a, b, 0x5410)
                vf[4 * w + 1 + 2 * p] = prmt2(a, b, 0x7632)

    @device
    def perturb(words, n, frag, z):
        """``words[i] ^ (frag[i] & z)``, ``z`` a zero the compiler cannot see: the second decode of
        DECODE_TWICE depends on the first, so neither is merged away."""
        for i in range(n):
            words[i] = u32(words[i] ^ (frag[i % FRAG] & z))

    @device
    def decode_k(smem, sb, src, j, pre, cap, kf, smw, cw, ev, bw, offs, scr):
        """K tile j's fragments from its staged slot (``pre``: :func:`row_prefix`)."""
        q = lane_id() & 3
        kc = u32(j * (C // 8) + (C // 32) * q)
        kbase = u32(sb + 16 * (kc + (kc >> 3)))
        if variant == NO_DECODE:
            for i in range(4):
                offs[i] = i32(0)
            k_loads(smem, src, kbase, u32(0), offs, smw, cw, ev, bw)
            for i in range(FRAG):
                kf[i] = u32(smw[i % NSM] ^ bw[i % NBW])
            return
        tags = k_runs(smem, src, pre, cap, offs, scr)
        k_loads(smem, src, kbase, tags, offs, smw, cw, ev, bw)
        k_compute(tags, smw, cw, ev, bw, kf)
        if variant == DECODE_TWICE:
            perturb(smw, NSM, kf, u32(cuda.threadIdx.x >> 5))
            k_compute(tags, smw, cw, ev, bw, kf)
        k_fix(smem, src, tags, offs, kf)

    @device
    def v_base(sb, j):
        return u32(sb + 4 * (KW + j * C + (C // 8) * (lane_id() >> 2)))

    @device
    def decode_v(smem, sb, src, j, pre, cap, vf, smw, cw, ev, bw, offs, scr):
        """V tile j's fragments from its staged slot."""
        if variant == NO_DECODE:
            for i in range(4):
                offs[i] = i32(0)
            v_loads(smem, src, v_base(sb, j), u32(0), offs, smw, cw, ev, bw)
            for i in range(FRAG):
                vf[i] = u32(smw[i % NSM] ^ bw[i % NBW])
            return
        tags = v_runs(smem, src, pre, cap, offs, scr)
        v_loads(smem, src, v_base(sb, j), tags, offs, smw, cw, ev, bw)
        v_compute(tags, smw, cw, ev, bw, vf)
        if variant == DECODE_TWICE:
            perturb(smw, NSM, vf, u32(cuda.threadIdx.x >> 5))
            v_compute(tags, smw, cw, ev, bw, vf)
        v_fix(smem, src, tags, offs, vf)

    @device
    def tile_frags(smem, sb, ents, i, st, kind, j, is_tail, raw, tail, tail_byte, tail_valid, cap, status, frag,
                   smw, cw, ev, bw, offs, scr):
        """Fragments of tile (kind, j) of the block in stage ``st`` (compressed kernel): decoded from its
        slot, or loaded from its raw tile or the tail."""
        src = u32(sb + STG + ((st * 2 + kind) * T + j) * SB)
        e = i32(-1) if is_tail else ents[u32((i * 2 + kind) * T + j)]
        if is_tail or e < 0:
            arr = tail if is_tail else raw
            byte = tail_byte if is_tail else (e & 0x7FFFFFFF) * TILE_BYTES
            stride = 2 * D if is_tail else 2 * C
            valid = tail_valid if is_tail else i32(L.BLOCK_TOKENS)
            if kind == 0:
                k_from_bf16(arr, byte, stride, valid, frag)
            else:
                v_from_bf16(arr, byte, stride, valid, frag)
            return
        pre = row_prefix(smem, src, src, cap, cap, status, scr) if variant != NO_DECODE else u32(0)
        if kind == 0:
            decode_k(smem, sb, src, j, pre, cap, frag, smw, cw, ev, bw, offs, scr)
        else:
            decode_v(smem, sb, src, j, pre, cap, frag, smw, cw, ev, bw, offs, scr)

    @device
    def load_k_frags(smem, tile, kf, scr):
        """Plain kernel: A fragments of q.k for a staged K tile, 16 tokens x 16 channels a ``ldmatrix.x4``."""
        for kk in range(C // 16):
            a0, a1, a2, a3 = ldsm_rows(smem, u32(tile + 32 * kk), ROWB, scr)
            kf[4 * kk], kf[4 * kk + 1], kf[4 * kk + 2], kf[4 * kk + 3] = a0, a1, a2, a3

    @device
    def load_v_frags(smem, tile, vf, scr):
        """Plain kernel: A fragments of p.v for a staged V tile (``ldmatrix.x4.trans``)."""
        for mt in range(C // 16):
            a0, a1, a2, a3 = ldsm_cols(smem, u32(tile + 32 * mt), ROWB, scr)
            vf[4 * mt], vf[4 * mt + 1], vf[4 * mt + 2], vf[4 * mt + 3] = a0, a1, a2, a3

    @device
    def qk_mma(kf, j, qb0, qb1, sc, scr):
        """Scores S^T[token][head] += K . Q^T for tile j: ``sc[4 par + i]`` holds token ``r + 8 (i // 2)``,
        head ``2q + i % 2``, accumulated in two chains (par) so that an MMA waits for half as many."""
        for kk in range(C // 16):
            c = 4 * (kk & 1)
            kq = j * (C // 16) + kk
            sc[c], sc[c + 1], sc[c + 2], sc[c + 3] = mma(kf[4 * kk], kf[4 * kk + 1], kf[4 * kk + 2], kf[4 * kk + 3],
                                                         qb0[kq], qb1[kq], sc[c], sc[c + 1], sc[c + 2], sc[c + 3], scr)

    @device
    def softmax_update(sc, valid, r, m0, m1, l0, l1, scale_log2, scr):
        """Online softmax in the log2 domain over the block's tokens (those at or after ``valid`` masked)
        for this lane's heads ``2q`` and ``2q+1``: returns their maxima, this lane's partial sums, P as
        the two B fragments of p.v (tokens 0..7, 8..15) and the factors :func:`rescale` applies."""
        x0 = (sc[0] + sc[4]) * scale_log2 if r < valid else f32(_NEG_INF)
        x1 = (sc[1] + sc[5]) * scale_log2 if r < valid else f32(_NEG_INF)
        x2 = (sc[2] + sc[6]) * scale_log2 if r + 8 < valid else f32(_NEG_INF)
        x3 = (sc[3] + sc[7]) * scale_log2 if r + 8 < valid else f32(_NEG_INF)
        n0 = max(m0, col_max(max(x0, x2), scr))
        n1 = max(m1, col_max(max(x1, x3), scr))
        al0 = ex2(m0 - n0)
        al1 = ex2(m1 - n1)
        p0 = ex2(x0 - n0)
        p1 = ex2(x1 - n1)
        p2 = ex2(x2 - n0)
        p3 = ex2(x3 - n1)
        return (n0, n1, l0 * al0 + (p0 + p2), l1 * al1 + (p1 + p3),
                transpose8(pack_bf16x2(p0, p1), scr), transpose8(pack_bf16x2(p2, p3), scr), al0, al1)

    @device
    def rescale(acc, al0, al1, scr):
        """The accumulators times the heads' factors, skipped (one warp vote) when no head's maximum
        rose: past a split's first blocks that is most blocks, and the factors are then exactly 1."""
        if warp_any(al0 != f32(1) or al1 != f32(1), scr):
            for t in range(NACC // 4):
                acc[4 * t] *= al0
                acc[4 * t + 1] *= al1
                acc[4 * t + 2] *= al0
                acc[4 * t + 3] *= al1

    @device
    def pv_mma(vf, j, pb0, pb1, acc, scr):
        """O^T[channel][head] += V^T . P for V tile j: ``acc[4 (j C/16 + mt) + i]`` holds head ``2q + i % 2``
        of M row ``r + 8 (i // 2)`` of chunk mt (:func:`out_channel`)."""
        for mt in range(C // 16):
            o = 4 * (j * (C // 16) + mt)
            acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma(vf[4 * mt], vf[4 * mt + 1], vf[4 * mt + 2],
                                                             vf[4 * mt + 3], pb0, pb1, acc[o], acc[o + 1],
                                                             acc[o + 2], acc[o + 3], scr)

    @device
    def out_channel(t, half, r):
        """Channel of M row ``r + 8 half`` of O^T chunk ``t`` (16 channels of tile ``t // (C/16)``): in
        order for the plain kernel (``ldmatrix``), ``C/8 r + 2 mt + half`` for the decoded fragments."""
        if plain:
            return 16 * t + r + 8 * half
        return C * (t // (C // 16)) + (C // 8) * r + 2 * (t % (C // 16)) + half

    @device
    def store_head(o_part, lse_part, acc, i, row, r, m, l_):
        """The normalised output of partial row ``row`` (this lane's head ``2q + i``, from ``acc[4 t + i]``
        and ``acc[4 t + i + 2]``) and, from lane r = 0, its log2-sum-exp."""
        inv = rcp(l_) if l_ > 0 else f32(0)
        o = u32(row * D)                    # unsigned indices: no negative-index fix-up a store
        for t in range(NACC // 4):
            o_part[u32(o + out_channel(t, 0, r))] = acc[4 * t + i] * inv
            o_part[u32(o + out_channel(t, 1, r))] = acc[4 * t + i + 2] * inv
        if r == 0:
            lse_part[u32(row)] = m + lg2(l_) if l_ > 0 else m

    @device
    def copy_bases(smem, sb, bases, ek, ev_, h, kv_heads, lane):
        """Start copying K's part of epoch ``ek``'s bases and V's part of epoch ``ev_`` (head ``h``) into
        shared memory: 16-byte ``cp.async`` copies in the first stages' group, no registers held."""
        row = u64(KW + VW) * u64(4)
        gk = gaddr(bases, u64(u32(ek * kv_heads + h)) * row + u64(16 * lane))
        gv = gaddr(bases, u64(u32(ev_ * kv_heads + h)) * row + u64(4 * KW + 16 * lane))
        for k in range(-(-KCH // WARP)):
            if lane + WARP * k < KCH:
                cp16(smem, u32(sb + 16 * lane + 512 * k), bases, gk + 512 * k)
        for k in range(-(-VCH // WARP)):
            if lane + WARP * k < VCH:
                cp16(smem, u32(sb + 4 * KW + 16 * lane + 512 * k), bases, gv + 512 * k)

    @device
    def checked_epoch(e, n, status):
        """A block's epoch, or 0 with :data:`STATUS_BAD_EPOCH` flagged if the view has no bases for it."""
        if e < 0 or e >= n:
            cuda.atomic.or_(status, 0, STATUS_BAD_EPOCH)
            return i32(0)
        return i32(e)

    jit = cuda.jit if max_registers is None or SIMULATOR else cuda.jit(max_registers=max_registers)

    @jit
    def kernel(q32, slots_k, slots_v, raw_k, raw_v, table_k, table_v, tail_k, tail_v, bases, epoch_k, epoch_v,
               seq_lens, work, o_part, lse_part, status, max_blocks, kv_heads, g, slot_bytes_k, slot_bytes_v, cap_k,
               cap_v, epochs_k, epochs_v, scale_log2):
        smem = cuda.shared.array(SMEM_WORDS, uint32, alignment=SMEM_ALIGN)
        ents = cuda.shared.array(NENT, int32)
        scr = cuda.shared.array(SCRATCH_WORDS, uint32)
        scratch_init(scr)
        # The merge kernel may be scheduled from now on (it waits for this grid before it reads): its
        # launch and its first loads overlap this grid's last blocks.
        grid_launch_dependents()
        sb = smem_base(smem)
        w = i32(cuda.blockIdx.x)
        h = i32(cuda.blockIdx.y)
        lane = lane_id()
        r = i32(lane >> 2)
        q = i32(lane & 3)
        # Unsigned indices in the prologue and epilogue: numba's signed ones add a negative-index fix-up
        # to every load and store, and every warp runs these at the same time (nothing overlaps them).
        b = work[u32(3 * w)]
        blk0 = work[u32(3 * w + 1)]
        blk1 = work[u32(3 * w + 2)]
        seq = seq_lens[u32(b)]
        nfull = i32(seq // L.BLOCK_TOKENS)
        tail_valid = i32(seq - nfull * L.BLOCK_TOKENS)
        hq = i32(kv_heads * g)
        # Query fragments (B operand of q.k: column r = query head r of the group; columns >= g zero), in
        # the channel order of the K fragments (natural for ldmatrix, C/4 q + 4 kk .. for the decoder's),
        # loaded with the block-table entries: they depend on the work item only.
        qb0 = cuda.local.array(NCHUNK, uint32)
        qb1 = cuda.local.array(NCHUNK, uint32)
        qrow = u32((b * hq + h * g + r) * (D // 2))
        for kk in range(NCHUNK):
            if plain:
                p0 = u32(qrow + 8 * kk + q)
                p1 = u32(p0 + 4)
            else:
                p0 = u32(qrow + (C // 2) * (kk // (C // 16)) + (C // 8) * q + 2 * (kk % (C // 16)))
                p1 = u32(p0 + 1)
            qb0[kk] = u32(q32[p0]) if r < g else u32(0)
            qb1[kk] = u32(q32[p1]) if r < g else u32(0)

        # Block-table entries of this split (K then V, T tiles each).  The loads depend on the work item
        # only (not on the sequence length, which would put a second round trip to memory before them)
        # and are unconditional (a lane past the split's entries reloads its last one): all of them in
        # flight at once, where a load and store per lane under a condition made a round trip each.
        ntab = i32((min(blk1, max_blocks) - blk0) * 2 * T)
        if ntab > 0:
            last = i32(min(blk1, max_blocks) - 1)
            for k in range(NENT // WARP):
                i = i32(lane + WARP * k)
                row = u32((b * max_blocks + min(blk0 + i // (2 * T), last)) * (kv_heads * T) + h * T + i % T)
                ents[i] = table_k[row] if (i // T) % 2 == 0 else table_v[row]
        # The split's epochs (one per kind: see the plan); a split of only the tail reads epoch 0.
        # (Loaded before the sequence length is known, like the table entries, and checked after.)
        ek = i32(epoch_k[u32(b * max_blocks + blk0)]) if not plain and blk0 < max_blocks else i32(0)
        ev_ = i32(epoch_v[u32(b * max_blocks + blk0)]) if not plain and blk0 < max_blocks else i32(0)
        tail_base = (b * kv_heads + h) * (L.BLOCK_TOKENS * D * 2)
        if not plain:
            ek = checked_epoch(ek, epochs_k, status) if blk0 < nfull else i32(0)
            ev_ = checked_epoch(ev_, epochs_v, status) if blk0 < nfull else i32(0)
            copy_bases(smem, sb, bases, ek, ev_, h, kv_heads, lane)
        warp_sync(scr)
        # The first stages' copies start as soon as the entries are in shared memory, in the bases' group.
        if REFILL:                              # prologue: block blk0, K and V in copy groups of their own
            if blk0 < blk1:
                issue_k(smem, sb, ents, 0, 0, blk0, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                        tail_valid, lane, entry(ents, 0, 0))
            cp_commit()
            if blk0 < blk1:
                issue_v(smem, sb, ents, 0, 0, blk0, nfull, slots_v, slot_bytes_v, raw_v, tail_v, tail_base,
                        tail_valid, lane, entry(ents, 0, 1))
            cp_commit()
        for s in range(NS - 1):                 # prologue: blocks blk0 .. blk0 + NS - 2
            if blk0 + s < blk1:
                issue_k(smem, sb, ents, s, s, blk0 + s, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                        tail_valid, lane, entry(ents, s, 0))
                issue_v(smem, sb, ents, s, s, blk0 + s, nfull, slots_v, slot_bytes_v, raw_v, tail_v, tail_base,
                        tail_valid, lane, entry(ents, s, 1))
            cp_commit()
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = f32(0)
        m0 = f32(_NEG_INF)                      # running maxima and this lane's sums, heads 2q and 2q + 1
        m1 = f32(_NEG_INF)
        l0 = f32(0)
        l1 = f32(0)
        sc = cuda.local.array(8, float32)           # score accumulators (see qk_mma)
        kf = cuda.local.array(FRAG, uint32)         # K fragments of one tile
        vf = cuda.local.array(FRAG, uint32)         # V fragments of one tile
        smw = cuda.local.array(NSM, uint32)         # decoder state
        cw = cuda.local.array(NCW, uint32)
        ev = cuda.local.array(NEV, uint32)
        bw = cuda.local.array(NBW, uint32)
        offs_k = cuda.local.array(4, int32)
        offs_v = cuda.local.array(4, int32)

        # 32-bit counters: numba's int64 loop arithmetic and `i % NS` cost ~60 instructions a block.
        st = i32(NS - 1)                        # stage of block i - 1 (that of block i + NS - 1)
        for i in range(i32(blk1 - blk0)):
            blk = i32(blk0 + i)
            ahead = i32(i + (NS - 1))
            sa = st                             # into the stage the previous iteration finished with
            st = i32(st + 1) if st < NS - 1 else i32(0)
            # The block-table entries this iteration uses, read together before any of them is needed: read
            # where each is used, they put two shared-memory round trips one after the other in the
            # copies' path and a third before the overlap test (the profile's top stalls of a block).
            ek_n = entry(ents, ahead, 0)
            ev_n = entry(ents, ahead, 1)
            ek_c = entry(ents, i, 0)
            ev_c = entry(ents, i, 1)
            if not REFILL:
                if blk0 + ahead < blk1:
                    issue_k(smem, sb, ents, ahead, sa, i32(blk0 + ahead), nfull, slots_k, slot_bytes_k, raw_k, tail_k,
                            tail_base, tail_valid, lane, ek_n)
                    issue_v(smem, sb, ents, ahead, sa, i32(blk0 + ahead), nfull, slots_v, slot_bytes_v, raw_v, tail_v,
                            tail_base, tail_valid, lane, ev_n)
                cp_commit()
            cp_wait()                           # REFILL: block i's K (its V may still be in flight)
            warp_sync(scr)
            if not do_math:
                if REFILL:
                    refill_k(smem, sb, ents, i, blk, blk1, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                             tail_valid, lane)
                    cp_wait()
                    warp_sync(scr)
                    refill_v(smem, sb, ents, i, blk, blk1, nfull, slots_v, slot_bytes_v, raw_v, tail_v, tail_base,
                             tail_valid, lane)
                continue
            is_tail = blk >= nfull
            valid = tail_valid if is_tail else i32(L.BLOCK_TOKENS)
            for c in range(8):
                sc[c] = f32(0)
            if overlap and not is_tail and ek_c >= 0 and ev_c >= 0:
                # Both tiles compressed: one escape prefix; K decoded; then the V tile's reads, the q.k
                # MMAs, the softmax and the V decode in one straight-line region.
                src_k = u32(sb + STG + 2 * st * SB)
                src_v = u32(src_k + SB)
                if REFILL:
                    pre = row_prefix(smem, src_k, src_k, cap_k, cap_k, status, scr)
                else:
                    pre = row_prefix(smem, src_k, src_v, cap_k, cap_v, status, scr)
                decode_k(smem, sb, src_k, 0, pre, cap_k, kf, smw, cw, ev, bw, offs_k, scr)
                if REFILL:
                    warp_sync(scr)
                    refill_k(smem, sb, ents, i, blk, blk1, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                             tail_valid, lane)
                    cp_wait()
                    warp_sync(scr)
                    pre = row_prefix(smem, src_v, src_v, cap_v, cap_v, status, scr)
                tags_v = v_runs(smem, src_v, pre, cap_v, offs_v, scr)
                v_loads(smem, src_v, v_base(sb, 0), tags_v, offs_v, smw, cw, ev, bw)
                qk_mma(kf, 0, qb0, qb1, sc, scr)
                m0, m1, l0, l1, pb0, pb1, al0, al1 = softmax_update(sc, valid, r, m0, m1, l0, l1, scale_log2, scr)
                v_compute(tags_v, smw, cw, ev, bw, vf)
                v_fix(smem, src_v, tags_v, offs_v, vf)
                warp_sync(scr)
                if REFILL:
                    refill_v(smem, sb, ents, i, blk, blk1, nfull, slots_v, slot_bytes_v, raw_v, tail_v, tail_base,
                             tail_valid, lane)
                rescale(acc, al0, al1, scr)
                pv_mma(vf, 0, pb0, pb1, acc, scr)
                continue
            for j in range(T):
                if plain:
                    load_k_frags(smem, u32(sb + STG + (2 * st * T + j) * SB), kf, scr)
                else:
                    tile_frags(smem, sb, ents, i, st, 0, j, is_tail, raw_k, tail_k, tail_base + j * C * 2, tail_valid,
                               cap_k, status, kf, smw, cw, ev, bw, offs_k, scr)
                qk_mma(kf, j, qb0, qb1, sc, scr)
            if REFILL:
                warp_sync(scr)
                refill_k(smem, sb, ents, i, blk, blk1, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                         tail_valid, lane)
            m0, m1, l0, l1, pb0, pb1, al0, al1 = softmax_update(sc, valid, r, m0, m1, l0, l1, scale_log2, scr)
            rescale(acc, al0, al1, scr)
            if REFILL:
                cp_wait()
                warp_sync(scr)
            for j in range(T):
                if plain:
                    load_v_frags(smem, u32(sb + STG + ((2 * st + 1) * T + j) * SB), vf, scr)
                else:
                    tile_frags(smem, sb, ents, i, st, 1, j, is_tail, raw_v, tail_v, tail_base + j * C * 2, tail_valid,
                               cap_v, status, vf, smw, cw, ev, bw, offs_v, scr)
                pv_mma(vf, j, pb0, pb1, acc, scr)
            warp_sync(scr)                      # this stage's reads are done before the next copies into it
            if REFILL:
                refill_v(smem, sb, ents, i, blk, blk1, nfull, slots_v, slot_bytes_v, raw_v, tail_v, tail_base,
                         tail_valid, lane)

        # This split's normalised partial output and log-sum-exp (log2 domain).
        l0 = col_sum(l0, scr)
        l1 = col_sum(l1, scr)
        row = (w * kv_heads + h) * g + 2 * q
        if 2 * q < g:
            store_head(o_part, lse_part, acc, 0, row, r, m0, l0)
        if 2 * q + 1 < g:
            store_head(o_part, lse_part, acc, 1, row + 1, r, m1, l1)
    return kernel


# ----------------------------------------------------------------------------------------------
# Merging the splits of each sequence.

@device
def as_int16(x):
    """A 16-bit pattern as the int16 value with those bits."""
    return i32((i32(x) ^ 0x8000) - 0x8000)


MERGE_CHANNELS = 32                 # channels of one merge block
MERGE_UNROLL = 4                    # splits a merge thread loads at once


def merge_launch(batch: int, q_heads: int, head_dim: int, max_splits: int) -> tuple:
    """Grid, threads and split lanes of :func:`merge_kernel`: a block per (sequence, query head, 32
    channels), so that a batch-1 merge of 32 heads fills 128 SMs, not 32; 8 channel quads x ``lanes``
    split lanes, as many as make the longest sequence's splits one round of loads (64 at most; one
    lane in the simulator, where every barrier costs milliseconds).  More lanes than splits would only
    lengthen the reduction and cut the blocks that fit an SM."""
    lanes = 1
    while not SIMULATOR and lanes < 64 and lanes * MERGE_UNROLL < max_splits:
        lanes *= 2
    return (batch, q_heads, head_dim // MERGE_CHANNELS), MERGE_CHANNELS // 4 * lanes, lanes


@functools.lru_cache(maxsize=None)
def merge_kernel(head_dim: int, lanes: int):
    """Merge split partials (grid, threads and ``lanes`` from :func:`merge_launch`).  Each thread folds
    its splits into a running (max, sum, 4 channels) :data:`MERGE_UNROLL` splits at a time (their loads
    in flight together), then the lanes are combined in shared memory.  Indices are 32-bit and
    unsigned: numba's signed indexing adds a negative-index fix-up to every load.  Launched as a
    programmatic dependent of the split kernel (``AttentionPlan``'s ``pdl``), it reads its split range,
    then waits for that grid (``griddepcontrol.wait``) before it reads the partials.

    ``o_part`` float32 ``[W*Hkv*g*D]``, ``lse_part`` float32 ``[W*Hkv*g]`` (log2), ``split0`` int32
    ``[B+1]`` (the splits of sequence ``b`` are ``split0[b] .. split0[b+1]-1``), out ``out`` int16
    ``[B*Hq*D]`` (BF16 bits) and ``lse`` float32 ``[B*Hq]`` (natural log, written by the first channel block).
    """
    D = head_dim
    QUADS = MERGE_CHANNELS // 4
    LANES = lanes
    THREADS = QUADS * LANES
    RED = 4 * THREADS
    UNROLL = MERGE_UNROLL
    OS = 4 * UNROLL

    @cuda.jit
    def kernel(o_part, lse_part, split0, out, lse, kv_heads, g):
        red = cuda.shared.array(RED, float32)
        mx = cuda.shared.array(THREADS, float32)
        sm = cuda.shared.array(THREADS, float32)
        b = cuda.blockIdx.x
        hq = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        quad = tid % QUADS
        sl = tid // QUADS
        ch = u32(cuda.blockIdx.z * MERGE_CHANNELS + 4 * quad)
        s0 = split0[b]
        s1 = split0[b + 1]
        grid_wait()                     # the split kernel's partials (a no-op without the launch attribute)
        m = f32(_NEG_INF)
        den = f32(0)
        acc = cuda.local.array(4, float32)
        for c in range(4):
            acc[c] = f32(0)
        nq = u32(kv_heads * g)
        for s in range(s0 + sl, s1, UNROLL * LANES):
            ls = cuda.local.array(UNROLL, float32)
            os_ = cuda.local.array(OS, float32)
            for u in range(UNROLL):
                su = s + u * LANES
                row = u32(u32(su) * nq + hq)
                ls[u] = lse_part[row] if su < s1 else f32(_NEG_INF)
                for c in range(4):
                    os_[4 * u + c] = o_part[u32(row * D + ch + c)] if su < s1 else f32(0)
            mu = ls[0]
            for u in range(1, UNROLL):
                mu = max(mu, ls[u])
            m_new = max(m, mu)
            scale = ex2(m - m_new)
            den *= scale
            for c in range(4):
                acc[c] *= scale
            for u in range(UNROLL):
                wgt = ex2(ls[u] - m_new)
                den += wgt
                for c in range(4):
                    acc[c] += wgt * os_[4 * u + c]
            m = m_new
        mx[tid] = m
        cuda.syncthreads()
        step = THREADS // 2
        while step >= QUADS:
            if tid < step:
                mx[tid] = max(mx[tid], mx[tid + step])
            cuda.syncthreads()
            step //= 2
        scale = ex2(m - mx[quad]) if m != _NEG_INF else f32(0)
        for c in range(4):
            red[4 * tid + c] = acc[c] * scale
        sm[tid] = den * scale
        cuda.syncthreads()
        step = THREADS // 2
        while step >= QUADS:
            if tid < step:
                for c in range(4):
                    red[4 * tid + c] += red[4 * (tid + step) + c]
                sm[tid] += sm[tid + step]
            cuda.syncthreads()
            step //= 2
        if tid < QUADS:
            inv = f32(1) / sm[tid] if sm[tid] > 0 else f32(0)   # no split: an empty sequence, output 0
            base = (b * kv_heads * g + hq) * D + cuda.blockIdx.z * MERGE_CHANNELS + 4 * tid
            lo = pack_bf16x2(red[4 * tid] * inv, red[4 * tid + 1] * inv)
            hi = pack_bf16x2(red[4 * tid + 2] * inv, red[4 * tid + 3] * inv)
            out[base] = as_int16(lo & 0xFFFF)
            out[base + 1] = as_int16(lo >> 16)
            out[base + 2] = as_int16(hi & 0xFFFF)
            out[base + 3] = as_int16(hi >> 16)
            if tid == 0 and cuda.blockIdx.z == 0:
                lse[b * kv_heads * g + hq] = ((mx[0] + math.log2(sm[0])) * f32(1 / _LOG2E) if sm[0] > 0
                                              else f32(_NEG_INF))
    return kernel
