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
2. decodes each slot into a padded BF16 tile in shared memory (the device
   functions of :func:`_decode_tile_fn`: each lane rebuilds 8 groups of 8
   consecutive channels, two BF16 elements per 32-bit operation); a raw tile
   (slot overflow, rare) or the sequence's BF16 tail is loaded into that tile
   when it is used, from L2 (prefetched there with the copies of the block ahead;
   not with ``nstage=1``, whose refills have no block ahead to prefetch for);
3. loads MMA fragments with ``ldmatrix`` (``.trans`` for V), computes the 16
   scores of every query head of the group, updates the online softmax in the
   log2 domain (the accumulators are rescaled only when a head's maximum rose),
   and accumulates ``P.V`` in FP32 registers.

Each split writes its normalised partial output and log-sum-exp; a second small
kernel merges the splits of a sequence (:func:`merge_kernel`).  The BF16
baseline (``plain=True``) is the same kernel with every tile raw: step 1 stages
BF16 tiles and step 2 is compiled out.

Performance: the compressed slots are fewer bytes to load than the BF16 twin's
tiles, and the decode hides most of its work under those loads; what remains
bounds the kernel by its shared-memory traffic (the L1 data pipe) and its integer
instructions (the ALU pipe), at 12 one-warp blocks per SM (168 registers and
18 KB of shared memory each).  A split's prologue and epilogue run in every warp
at once with nothing to overlap them, so their instruction counts and round trips
to memory are kept short; the staging areas start on 128-byte lines
(:data:`LINE`).  benchmarks/DESIGN-attention.md has the analysis, and
benchmarks/results/attention-h200.md the measurements.

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
import time

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
TIMELINE = "timeline"        # the full kernel; each split's start and end times (%globaltimer, ns: bits 0..15, then
                             # 16..31) and its SM written over o_part[row * D ..] of its first head (5 floats)
VARIANTS = (FULL, LOAD_ONLY, NO_DECODE, DECODE_TWICE, TIMELINE)

# The staging areas start on 128-byte lines of shared memory: a cp.async copy's 16-byte chunks are written a
# line at a time, and a group of 8 lanes whose destinations straddle two lines costs two wavefronts of the L1
# data pipe instead of one, and the copies are a large share of the kernel's shared-memory wavefronts
# (benchmarks/DESIGN-attention.md).  A slot's source is best on a line too: gaac.calibrate's slot_line
# chooses a capacity whose slots are whole lines.  Every area is on a line when the stage size is a multiple
# of 128 bytes (the real caches' 2944); the plan does not round it up, which would cost shared memory, so
# occupancy.
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
STATUS_BAD_ENTRY = 8         # a finalized block's table entry points past its slot or raw-tile pool (read: entry 0)



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

    @intrinsic
    def _prefetch_l2(typingctx, gptr):
        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), list(args), "prefetch.global.L2 [$0];", "l", side_effect=True)
            return context.get_dummy_value()
        return types.void(types.int64), codegen

    @intrinsic
    def _globaltimer(typingctx):
        def codegen(context, builder, sig, args):
            return _asm(builder, _I64, [], "mov.u64 $0, %globaltimer;", "=l", side_effect=True)
        return types.uint64(), codegen

    @intrinsic
    def _smid(typingctx):
        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, [], "mov.u32 $0, %smid;", "=r", side_effect=True)
        return types.uint32(), codegen

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
    def prefetch_l2(src, gptr):
        """Start bringing the 128-byte line of global ``gptr`` into L2 (``src``: the array, for the simulator)."""
        _prefetch_l2(gptr)

    @device
    def globaltimer():
        """The device's nanosecond clock (``%globaltimer``), common to all SMs."""
        return _globaltimer()

    @device
    def smid():
        return _smid()

    @device
    def prmt(a, sel):
        """Byte permute of ``a`` (bytes 4..7 are zero)."""
        return _prmt(a, sel)

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
        smem[int(addr) >> 2:(int(addr) >> 2) + 4] = np.asarray(src[b:b + 16]).view(np.uint8).view(np.uint32)

    @device
    def cp_commit():
        pass

    @device
    def prefetch_l2(src, gptr):
        pass

    @device
    def globaltimer():
        return u64(time.perf_counter_ns())

    @device
    def smid():
        return u32(0)

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
    """Bytes per row of a staged or decoded BF16 tile: 2C plus 16 bytes of padding."""
    return 2 * channels + 4 * PAD_WORDS


def tile_bytes(channels: int) -> int:
    """Bytes of one staging area: a padded BF16 tile, which also holds any slot (slot <= raw bytes)."""
    return L.BLOCK_TOKENS * row_bytes(channels)


def base_row_words(head_dim: int) -> int:
    """Words per pre-shifted base row in shared memory: D/2 pair words and 16 bytes of padding, so that
    the rows of one channel group (read by lanes of different mode tags) fall in different banks."""
    return head_dim // 2 + PAD_WORDS


def bases_bytes(head_dim: int) -> int:
    """Shared bytes of the pre-shifted bases (2 kinds x :data:`BASE_ROWS` rows of :func:`base_row_words`),
    rounded up to a :data:`LINE` so that the staging areas after them start on one."""
    return -(-4 * 2 * BASE_ROWS * base_row_words(head_dim) // LINE) * LINE


def smem_bytes(channels: int, tph: int, nstage: int, plain: bool, stage_bytes: int) -> int:
    """Shared bytes of the tile area of one block: unless ``plain``, the bases (:func:`bases_bytes`); the
    stages (K and V, ``tph`` areas of ``stage_bytes`` each); unless ``plain``, one decode tile."""
    stages = nstage * 2 * tph * stage_bytes
    return stages if plain else bases_bytes(tph * channels) + stages + tile_bytes(channels)


# ----------------------------------------------------------------------------------------------
# The decode of one staged slot into a padded BF16 tile.

@device
def escape_pair(e, p):
    """Bits ``2p``, ``2p+1`` of escape byte ``e`` -> bits 10 and 26 (exponent bit 3 of pair word ``p``'s
    two elements): one multiply and one mask.  The multiplier places two copies of the byte, shifted
    by ``10 - 2p`` and ``25 - 2p``; they occupy disjoint bits, so the product has no carries."""
    return u32(mul_lo(e, (1 << (10 - 2 * p)) + (1 << (25 - 2 * p))) & 0x04000400)


@functools.lru_cache(maxsize=None)
def _decode_tile_fn(channels: int):
    """Device functions for C-wide tiles: ``decode(smem, src, dst, base, base_stride, cap, status, scr)``,
    and its stages (tags, reads, compute+stores, fix-up) for callers that interleave two decodes with
    other work (:func:`attention_kernel`'s ``overlap``); last, the sizes of the stages' local arrays.

    Lane ``l`` decodes row ``t = l % 16``, channels ``(l // 16) * C/2 ..`` (``C/16`` groups): with the
    staging swizzle of the sign+mantissa chunks (chunk ``c`` at ``c ^ ((c >> 3) & SWZ)``) and the
    16 bytes of row padding, every 16-byte shared access of a phase of 8 lanes is conflict-free.
    ``src``/``dst``: byte addresses of the staged slot and of the BF16 tile; ``base``: of this lane's
    first b3 pair word (rows b3, b4, zeros ``base_stride`` bytes apart: row = mode tag; the reserved tag
    reads the row after them, which must be shared memory: its output is garbage, its status flagged).
    """
    geo = L.TileGeometry(channels)
    C = channels
    GPL = C // 16                       # groups per lane
    CPL = C // 32                       # 16-byte sign+mantissa chunks per lane
    SM_WORDS = 2 * GPL                  # sign+mantissa words per lane
    CODE_WORDS = 3 * C // 64            # code words per lane (8-byte aligned for C=128, 4 for C=64)
    CODE_ARRAY = CODE_WORDS + 1         # and a zero word after them
    BASE_WORDS = 4 * GPL                # base pair words of a lane's groups
    ROWB = row_bytes(C)
    SWZ = 7 if C == 128 else 3
    CODE_OFF, TAG_OFF, ESC_OFF = geo.code_offset, geo.tag_offset, geo.escape_offset
    ESC_MAX = i32(2 * L.BLOCK_TOKENS * C - ESC_OFF - L.RAW_PLANES)   # escape reads stay in a raw tile's size
    K_EVEN = (1 << 7) | (1 << 20)       # codes at bits 0-2, 3-5 of a 12-bit field -> bits 7, 23
    K_ODD = (1 << 1) | (1 << 14)        # codes at bits 6-8, 9-11 -> bits 7, 23
    ESC4 = L.ESCAPE_BYTES[L.MODE_4BIT]
    ESCR = L.ESCAPE_BYTES[L.MODE_RAW]

    @device
    def decode_tags(smem, src):
        """This lane's mode tags (2 bits a group) and the escape bytes its groups need."""
        lane = lane_id()
        t = lane & 15
        if C == 128:
            tags = u32(lds(smem, u32(src + TAG_OFF + 4 * t)) >> (16 * (lane >> 4)))
        else:
            tags = u32(lds(smem, u32(src + TAG_OFF + 4 * (t >> 1))) >> (16 * (t & 1) + 8 * (lane >> 4)))
        tags = u32(tags & (0xFFFF if C == 128 else 0xFF))
        return tags, i32(popc(tags & 0x5555) * ESC4 + popc(tags & 0xAAAA) * ESCR)

    @device
    def decode_loads(smem, src, base, base_stride, tags, off, cap, smw, cw, ev, bw):
        """Every other shared-memory read of this lane's part of a tile, issued back to back so that
        their latencies overlap (the compiler cannot move a read above the decoder's stores, which
        might alias): sign+mantissa words ``smw``, code words ``cw``, each group's first escape byte
        ``ev`` (``off`` = escape bytes of the tile's earlier groups) and base pair words ``bw``."""
        lane = lane_id()
        t = lane & 15
        h = lane >> 4
        # Chunks c0 + k (k < CPL) share c >> 3, and c0 is a multiple of CPL: chunk k's swizzled offset
        # is chunk 0's xor 16k.
        c0 = u32(t * (C // 16) + h * CPL)
        sm0 = u32(16 * (c0 ^ ((c0 >> 3) & SWZ)))
        for k in range(CPL):
            w0, w1, w2, w3 = lds4(smem, u32(src + (sm0 ^ (16 * k))))
            smw[4 * k] = w0
            smw[4 * k + 1] = w1
            smw[4 * k + 2] = w2
            smw[4 * k + 3] = w3
        code = u32(src + CODE_OFF + t * (3 * C // 8) + h * (4 * CODE_WORDS))
        if C == 128:
            for i in range(CODE_WORDS // 2):
                u0, u1 = lds2(smem, u32(code + 8 * i))
                cw[2 * i] = u0
                cw[2 * i + 1] = u1
        else:
            for i in range(CODE_WORDS):
                cw[i] = lds(smem, u32(code + 4 * i))
        cw[CODE_WORDS] = u32(0)
        # In a valid slot off + (this lane's escape bytes) <= cap.  Clamped to cap, a corrupt ``off``
        # still reads inside shared memory: at most 6 * GPL bytes past the slot (the decode tile, or the
        # next stage, follows every staged slot), and the status word reports it.
        pos = i32(min(off, i32(cap)))
        esc = u32(src + ESC_OFF)
        for k in range(GPL):
            m = u32((tags >> (2 * k)) & 3)
            ev[k] = lds_u8(smem, u32(esc + pos))                  # read even for a 3-bit group, then dropped
            pos = i32(pos + m + 3 * (m >> 1))                     # escape bytes of mode m: 0, 1, 5
            b0, b1, b2, b3 = lds4(smem, u32(base + m * base_stride + 16 * k))
            bw[4 * k] = b0
            bw[4 * k + 1] = b1
            bw[4 * k + 2] = b2
            bw[4 * k + 3] = b3

    @device
    def decode_compute(smem, dst, tags, smw, cw, ev, bw):
        """Branch-free over the groups: the BF16 words of 3-bit and 4-bit groups; a raw group gets
        exponent bits 0..3 here and bits 4..7 in :func:`decode_fix`."""
        lane = lane_id()
        out = u32(dst + (lane & 15) * ROWB + (lane >> 4) * C)
        for k in range(GPL):
            bit = 24 * k
            sh = bit % 32
            y = cw[bit // 32] >> sh
            if sh > 8:
                y = u32(y | (cw[bit // 32 + 1] << (32 - sh)))
            y_lo = u32(y & 0xFFF)
            y_hi = u32((y >> 12) & 0xFFF)
            sp = ev[k] if (tags >> (2 * k)) & 3 else u32(0)
            s0 = smw[2 * k]
            s1 = smw[2 * k + 1]
            sts4(smem, u32(out + 16 * k),
                 u32((prmt(s0, 0x1100) & 0x807F807F) | u32(((y_lo * K_EVEN) & 0x03800380) + bw[4 * k]
                                                            + escape_pair(sp, 0))),
                 u32((prmt(s0, 0x3322) & 0x807F807F) | u32(((y_lo * K_ODD) & 0x03800380) + bw[4 * k + 1]
                                                            + escape_pair(sp, 1))),
                 u32((prmt(s1, 0x1100) & 0x807F807F) | u32(((y_hi * K_EVEN) & 0x03800380) + bw[4 * k + 2]
                                                            + escape_pair(sp, 2))),
                 u32((prmt(s1, 0x3322) & 0x807F807F) | u32(((y_hi * K_ODD) & 0x03800380) + bw[4 * k + 3]
                                                            + escape_pair(sp, 3))))

    @device
    def decode_fix(smem, src, dst, tags, off, cnt, cap, status):
        """The rare part: format checks (status word) and exponent bits 4..7 of raw groups."""
        lane = lane_id()
        if off + cnt > cap:
            cuda.atomic.or_(status, 0, STATUS_BAD_ESCAPES)
        if tags & (tags >> 1) & 0x5555:
            cuda.atomic.or_(status, 0, STATUS_BAD_TAG)
        raw = u32(tags & 0xAAAA)                                  # bit 2k+1: group k is raw
        if raw:
            # Raw groups (about 0.3% of groups): exponent bits 4..7 from bit planes 1..4, added to the
            # words just stored (the exponent field has no carry out: exponents are at most 255).  Only
            # the raw groups are visited, lowest first: a tile with raw groups makes the whole warp
            # take this branch (half of the K tiles of real caches), so the warp runs as many passes
            # as its lane with the most raw groups has (usually one), not one pass per group.
            esc = u32(src + ESC_OFF)
            out = u32(dst + (lane & 15) * ROWB + (lane >> 4) * C)
            while raw:
                low = u32(raw & u32(~raw + 1))                       # bit 2k+1 alone
                raw = u32(raw ^ low)
                below = u32(tags & ((low >> 1) - 1))                 # the tags of groups 0..k-1
                pos = u32(esc + min(i32(off + popc(below & 0x5555) * ESC4 + popc(below & 0xAAAA) * ESCR),
                                    ESC_MAX))
                at = u32(out + 8 * (popc(low - 1) - 1))              # 16 k bytes into the lane's row
                w0, w1, w2, w3 = lds4(smem, at)
                for j in range(1, L.RAW_PLANES):
                    pj = lds_u8(smem, u32(pos + j))
                    w0 = u32(w0 + (escape_pair(pj, 0) << j))
                    w1 = u32(w1 + (escape_pair(pj, 1) << j))
                    w2 = u32(w2 + (escape_pair(pj, 2) << j))
                    w3 = u32(w3 + (escape_pair(pj, 3) << j))
                sts4(smem, at, w0, w1, w2, w3)

    @device
    def decode(smem, src, dst, base, base_stride, cap, status, scr):
        smw = cuda.local.array(SM_WORDS, uint32)
        cw = cuda.local.array(CODE_ARRAY, uint32)
        ev = cuda.local.array(GPL, uint32)
        bw = cuda.local.array(BASE_WORDS, uint32)
        tags, cnt = decode_tags(smem, src)
        off = escape_scan(cnt, scr)
        decode_loads(smem, src, base, base_stride, tags, off, cap, smw, cw, ev, bw)
        decode_compute(smem, dst, tags, smw, cw, ev, bw)
        decode_fix(smem, src, dst, tags, off, cnt, cap, status)

    return decode, decode_tags, decode_loads, decode_compute, decode_fix, (SM_WORDS, CODE_ARRAY, GPL, BASE_WORDS)


def _stage_slot_fn(channels: int, max_bytes: int):
    """Device function ``stage_slot(smem, dst, entry, slots, slot_bytes, lane)``: start copying slot
    ``entry`` (of at most ``max_bytes``) to the staging area at byte ``dst``, sign+mantissa chunk ``c``
    at ``c ^ ((c >> 3) & SWZ)`` (the layout :func:`_decode_tile_fn` reads without bank conflicts).

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
    """Stage and decode slots exactly as the attention kernel does and write the BF16 tiles out.

    For the decoder's bit-exact tests against the reference codec: grid = one warp per slot;
    ``slots`` uint8 ``[n*slot_bytes]``, ``bases`` int32 ``[3*C/2]`` (pair-word rows b3, b4, 0 of
    one tile), ``cap``; out ``tiles`` int32 ``[n*16*C/2]`` (BF16 pairs) and ``status`` int32 ``[1]``.
    """
    C = channels
    ROWB = row_bytes(C)
    TB = tile_bytes(C)
    STAGE = -(-slot_bytes // 16) * 16
    PAIRS = C // 2
    RS = base_row_words(C)
    BASE_BYTES = 4 * BASE_ROWS * RS     # the bases first: the reserved tag reads the row after them
    SMEM_WORDS = (BASE_BYTES + STAGE + TB) // 4
    decode = _decode_tile_fn(C)[0]
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
        for i in range(lane, BASE_ROWS * PAIRS, WARP):
            smem[(i // PAIRS) * RS + i % PAIRS] = bases[i]
        stage_slot(smem, u32(sb + BASE_BYTES), n, slots, slot_bytes, lane)
        cp_commit()
        wait_all()
        warp_sync(scr)
        decode(smem, u32(sb + BASE_BYTES), u32(sb + BASE_BYTES + STAGE), u32(sb + C * (lane >> 4)), 4 * RS, cap, status,
               scr)
        warp_sync(scr)
        for i in range(lane, L.BLOCK_TOKENS * PAIRS, WARP):
            tiles[n * L.BLOCK_TOKENS * PAIRS + i] = i32(smem[(BASE_BYTES + STAGE + (i // PAIRS) * ROWB) // 4 + i % PAIRS])
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
    return tuple([array(a) for a in arrays] + [types.int64] * 13 + [types.float32])

@functools.lru_cache(maxsize=None)
def attention_kernel(head_dim: int, plain: bool, variant: str = FULL, nstage: int = 3, stage_bytes: int = 0,
                     overlap: bool = False, max_registers: int | None = None):
    """The split-KV decode kernel for ``head_dim``; ``plain`` = every tile is BF16 (the baseline).

    ``overlap`` (compressed, head_dim <= 128): when both tiles of a block are slots, one escape scan
    serves K and V, and the V tile's reads, then its decode, sit in one straight-line region with the
    q.k MMAs and the softmax, so that the compiler overlaps their latencies.  ``max_registers``
    caps registers per thread (more resident warps, possibly spills).

    ``stage_bytes``: bytes of a staging area, at least the larger slot of K and V (compressed kernel;
    raw tiles and the tail are loaded when used, so the stages only hold slots); the plain kernel
    stages padded BF16 tiles.  Arguments (all 1-D, C-contiguous; ``D = head_dim``,
    ``C = min(D, 128)``, ``T = D // C``): ``q32`` int32 ``[B*Hq*D/2]`` (BF16 pairs); ``slots_k/v``
    uint8 slot pools (flat); ``raw_k/v`` uint8 raw-tile pools (flat, 32*C bytes a tile);
    ``table_k/v`` int32 ``[B*MB*Hkv*T]``; ``tail_k/v`` uint8 ``[B*Hkv*16*D*2]``; ``bases`` int32
    ``[2, E, Hkv, 3, D/2]`` pair words (b3, b4, zeros) of each calibration epoch;
    ``epoch_k/v`` int16 ``[B*MB]`` each block's epoch (FORMAT.md 3.5); ``seq_lens`` int32 ``[B]``;
    ``work`` int32 ``[W*3]`` (sequence, first block, end block); out ``o_part`` float32
    ``[W*Hkv*g*D]``, ``lse_part`` float32 ``[W*Hkv*g]`` (log2 domain); ``status`` int32 ``[1]``; then
    ``max_blocks, kv_heads, g, slot_bytes_k, slot_bytes_v, cap_k, cap_v, epochs_k, epochs_v`` (epoch
    counts; ``E = max``), ``n_slots_k, n_slots_v, n_raw_k, n_raw_v`` (records in the pools: a
    finalized block's entry at or past its pool's is flagged, :data:`STATUS_BAD_ENTRY`, and entry 0
    is read instead, so each pool needs a record) and ``scale_log2``.  Grid ``(W, Hkv)``, one warp per block.

    Epochs: the plan cuts splits where a sequence's K or V epoch changes (``AttentionPlan``), so every
    split reads one epoch's bases per kind: loaded into shared memory once, from its first block's
    epoch, and the block loop is the same as without epochs.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")
    D = head_dim
    C = L.tile_channels(D)
    T = D // C
    NS = nstage
    ROWB = row_bytes(C)
    TB = tile_bytes(C)
    SB = TB if plain else stage_bytes
    if not plain and (stage_bytes % 16 or not L.TileGeometry(C).fixed_bytes <= stage_bytes <= 2 * L.BLOCK_TOKENS * C):
        raise ValueError(f"stage_bytes {stage_bytes}: a multiple of 16 that holds a slot of {C}-channel tiles")
    NCHUNK = D // 16                    # k-chunks of the score MMA (16 channels each)
    KF_WORDS = C // 4                   # K fragment words of one tile (4 per 16 channels)
    NACC = D // 4                       # O^T accumulators: 4 per 16 channels
    ROW_CHUNKS = C // 8                 # 16-byte chunks of a BF16 row
    RAW_PER_LANE = L.BLOCK_TOKENS * ROW_CHUNKS // WARP
    RAW_WORDS = 4 * RAW_PER_LANE        # a lane's words of a BF16 tile loaded through registers
    if overlap and (T != 1 or plain or variant not in (FULL, TIMELINE)):
        raise ValueError("overlap is for the full compressed kernel with head_dim <= 128")
    BASES = 0                           # byte offsets in the shared array: the bases, the stages, the decode tile
    STG = 0 if plain else bases_bytes(D)
    DEC = STG + NS * 2 * T * SB
    PAIRS = D // 2                      # base pair words per row of one kind
    RS = base_row_words(D)              # words per base row in shared memory
    SMEM_WORDS = smem_bytes(C, T, NS, plain, SB) // 4
    NENT = MAX_BLOCKS_PER_SPLIT * 2 * T
    KIND_BASE = BASE_ROWS * PAIRS       # base words of one kind, one head, one epoch
    KIND_PER_LANE = 0 if plain else KIND_BASE // WARP
    BASE_REGS = max(1, 2 * KIND_PER_LANE)  # a lane's base words of both kinds, held while the first copies go out
    TILE_BYTES = L.BLOCK_TOKENS * C * 2
    ROW_LINES = 2 * C // LINE           # 128-byte lines of a BF16 tile row (the tail's rows are 2D bytes apart)
    TILE_LINES = L.BLOCK_TOKENS * ROW_LINES
    decode, decode_tags, decode_loads, decode_compute, decode_fix, SIZES = _decode_tile_fn(C)
    SM_WORDS, CODE_ARRAY, GPL, BASE_WORDS = SIZES
    stage_slot = _stage_slot_fn(C, SB)
    REFILL = NS == 1                    # one area per kind, refilled as soon as it is read (see refill_fn)
    cp_wait = cp_wait_fn(1 if REFILL else NS - 1)
    do_decode = not plain and variant in (FULL, DECODE_TWICE, TIMELINE)
    do_math = variant != LOAD_ONLY

    @device
    def copy_bf16_tile(smem, dst, is_tail, entry, raw, tail, tail_byte, valid, lane, wait):
        """Copy a raw tile or the tail to the padded BF16 tile at byte ``dst`` (tail rows at or after
        ``valid`` are zeroed so that 0 * garbage cannot make a NaN): asynchronously (``cp.async``), or
        with ``wait``, through registers so that the tile is ready after the next warp barrier."""
        g0 = gaddr(tail, tail_byte) if is_tail else gaddr(raw, (entry & 0x7FFFFFFF) * TILE_BYTES)
        if wait:
            # Every load before the first store: one round trip to memory, not one per chunk.  (The
            # tail's rows at or after ``valid`` are read too, inside its 16-row buffer, and dropped.)
            words = cuda.local.array(RAW_WORDS, uint32)
            for k in range(RAW_PER_LANE):
                i = u32(lane + WARP * k)
                r = i // ROW_CHUNKS
                ga = g0 + i32(r * (2 * D) + 16 * (i % ROW_CHUNKS)) if is_tail else g0 + i32(16 * i)
                words[4 * k], words[4 * k + 1], words[4 * k + 2], words[4 * k + 3] = ldg4(tail if is_tail else raw,
                                                                                          ga)
            for k in range(RAW_PER_LANE):
                i = u32(lane + WARP * k)
                r = i // ROW_CHUNKS
                keep = u32(0) if is_tail and r >= valid else u32(0xFFFFFFFF)
                sts4(smem, u32(dst + r * ROWB + 16 * (i % ROW_CHUNKS)), u32(words[4 * k] & keep),
                     u32(words[4 * k + 1] & keep), u32(words[4 * k + 2] & keep), u32(words[4 * k + 3] & keep))
            return
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
    def prefetch_bf16_tiles(ents, i, is_tail, raw_k, raw_v, tail_k, tail_v, tail_base, lane):
        """Bring block ``i``'s raw tiles, or its tail, into L2 (a line a lane) when its slots would be staged:
        they are read when used (:func:`copy_bf16_tile` with ``wait``), and a read from L2 stalls the split
        less than one from DRAM.  (Even so, a split holding a raw tile ends later than one without:
        benchmarks/results/attention-timeline-h200.md.)"""
        if lane < TILE_LINES:
            for kind in range(2):
                for j in range(T):
                    if is_tail:
                        tail = tail_k if kind == 0 else tail_v
                        prefetch_l2(tail, gaddr(tail, tail_base + j * C * 2)
                                    + i32((lane // ROW_LINES) * (2 * D) + LINE * (lane % ROW_LINES)))
                    else:
                        e = ents[u32((i * 2 + kind) * T + j)]
                        if e < 0:
                            raw = raw_k if kind == 0 else raw_v
                            prefetch_l2(raw, gaddr(raw, (e & 0x7FFFFFFF) * TILE_BYTES) + i32(LINE * lane))

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
                    copy_bf16_tile(smem, dst, is_tail, e, raw, tail, tail_base + j * C * 2, tail_valid, lane, False)
                elif not is_tail and e >= 0:
                    stage_slot(smem, dst, e, slots, slot_bytes, lane)
        return issue

    issue_k, issue_v = issue_fn(0), issue_fn(1)

    def refill_fn(issue, kind: int):
        """``nstage=1``: start block i+1's copies of one kind into the area block i's tiles of that kind
        have just left (read into registers or decoded, then a warp barrier), as one copy group."""
        @device
        def refill(smem, sb, ents, i, blk, blk1, nfull, slots, slot_bytes, raw, tail, tail_base, tail_valid, lane):
            if blk + 1 < blk1:
                issue(smem, sb, ents, i32(i + 1), 0, i32(blk + 1), nfull, slots, slot_bytes, raw, tail, tail_base,
                      tail_valid, lane, entry(ents, i + 1, kind))
            cp_commit()
        return refill

    refill_k, refill_v = refill_fn(issue_k, 0), refill_fn(issue_v, 1)

    @device
    def tile_of(smem, sb, ents, i, st, kind, j, is_tail, raw, tail, tail_byte, tail_valid, cap, status, scr, sync):
        """Byte address of the BF16 tile (kind, j) of the block in stage ``st``: the staged tile (plain),
        or the kind's decode tile after decoding the slot / loading the raw tile or tail into it (ready
        after a warp barrier: this one if ``sync``)."""
        src = u32(sb + STG + ((st * 2 + kind) * T + j) * SB)
        if plain:
            return src
        e = i32(-1) if is_tail else ents[u32((i * 2 + kind) * T + j)]
        dec = u32(sb + DEC)
        if is_tail or e < 0:
            copy_bf16_tile(smem, dec, is_tail, e, raw, tail, tail_byte, tail_valid, lane_id(), True)
        elif do_decode:
            base = u32(sb + BASES + 4 * (kind * BASE_ROWS * RS + j * (C // 2)) + C * (lane_id() >> 4))
            decode(smem, src, dec, base, 4 * RS, cap, status, scr)
            if variant == DECODE_TWICE:
                warp_sync(scr)
                decode(smem, src, dec, base, 4 * RS, cap, status, scr)
        else:
            return src
        if sync:
            warp_sync(scr)
        return dec

    @device
    def load_k_frags(smem, tile, kf, scr):
        """A fragments of q.k for a K tile: 16 tokens x 16 channels a ``ldmatrix.x4``."""
        for kk in range(C // 16):
            a0, a1, a2, a3 = ldsm_rows(smem, u32(tile + 32 * kk), ROWB, scr)
            kf[4 * kk] = a0
            kf[4 * kk + 1] = a1
            kf[4 * kk + 2] = a2
            kf[4 * kk + 3] = a3

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
    def pv_mma(smem, tile, j, pb0, pb1, acc, scr):
        """O^T[channel][head] += V^T . P for V tile j (``ldmatrix.trans``): ``acc[4 t + i]`` holds channel
        ``16 t + r + 8 (i // 2)``, head ``2q + i % 2``."""
        for mt in range(C // 16):
            o = 4 * (j * (C // 16) + mt)
            a0, a1, a2, a3 = ldsm_cols(smem, u32(tile + 32 * mt), ROWB, scr)
            acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma(a0, a1, a2, a3, pb0, pb1, acc[o], acc[o + 1],
                                                             acc[o + 2], acc[o + 3], scr)

    @device
    def store_head(o_part, lse_part, acc, i, row, r, m, l_):
        """The normalised output of partial row ``row`` (this lane's head ``2q + i``: channels ``16 t + r``
        and ``+ 8`` from ``acc[4 t + i]``, ``acc[4 t + i + 2]``) and, from lane r = 0, its log2-sum-exp."""
        inv = rcp(l_) if l_ > 0 else f32(0)
        o = u32(row * D + r)                # unsigned indices: no negative-index fix-up a store
        for t in range(NACC // 4):
            o_part[u32(o + 16 * t)] = acc[4 * t + i] * inv
            o_part[u32(o + 16 * t + 8)] = acc[4 * t + i + 2] * inv
        if r == 0:
            lse_part[u32(row)] = m + lg2(l_) if l_ > 0 else m

    @device
    def load_bases(bases, kind, e, ne, h, kv_heads, lane, words):
        """This lane's words of epoch ``e``'s base rows of ``kind`` and head ``h`` into ``words`` (``ne`` = the
        larger epoch count of K and V); :func:`store_bases` puts them in shared memory after the first stages'
        copies are issued: loaded after the copies, they would arrive only after them."""
        src = u32(((kind * ne + e) * kv_heads + h) * KIND_BASE)
        for k in range(KIND_PER_LANE):
            words[kind * KIND_PER_LANE + k] = bases[u32(src + lane + WARP * k)]

    @device
    def store_bases(smem, words, lane):
        for kind in range(2):
            for k in range(KIND_PER_LANE):
                i = lane + WARP * k
                smem[BASES // 4 + (kind * BASE_ROWS + i // PAIRS) * RS + i % PAIRS] = words[kind * KIND_PER_LANE + k]

    @device
    def checked_epoch(e, n, status):
        """A block's epoch, or 0 with :data:`STATUS_BAD_EPOCH` flagged if the view has no bases for it."""
        if e < 0 or e >= n:
            cuda.atomic.or_(status, 0, STATUS_BAD_EPOCH)
            return i32(0)
        return i32(e)

    @device
    def checked_entry(e, finalized, n_slots, n_raw, status):
        """A block-table entry, or entry 0 with :data:`STATUS_BAD_ENTRY` flagged if it belongs to a finalized
        block and points past its pool (the plain kernel reads every entry as a raw-tile index).  Entries of
        the tail block are not read, whatever they hold."""
        if finalized and (e & 0x7FFFFFFF) >= (n_raw if plain or e < 0 else n_slots):
            cuda.atomic.or_(status, 0, STATUS_BAD_ENTRY)
            return i32(0)
        return i32(e)

    jit = cuda.jit if max_registers is None or SIMULATOR else cuda.jit(max_registers=max_registers)

    @jit
    def kernel(q32, slots_k, slots_v, raw_k, raw_v, table_k, table_v, tail_k, tail_v, bases, epoch_k, epoch_v,
               seq_lens, work, o_part, lse_part, status, max_blocks, kv_heads, g, slot_bytes_k, slot_bytes_v, cap_k,
               cap_v, epochs_k, epochs_v, n_slots_k, n_slots_v, n_raw_k, n_raw_v, scale_log2):
        smem = cuda.shared.array(SMEM_WORDS, uint32, alignment=SMEM_ALIGN)
        ents = cuda.shared.array(NENT, int32)
        scr = cuda.shared.array(SCRATCH_WORDS, uint32)
        scratch_init(scr)
        # The merge kernel may be scheduled from now on (it waits for this grid before it reads): its
        # launch and its first loads overlap this grid's last blocks.
        grid_launch_dependents()
        t_start = globaltimer() if variant == TIMELINE else u64(0)
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
        # Query fragments (B operand of q.k: column r = query head r of the group; columns >= g zero),
        # loaded with the block-table entries: they depend on the work item only.
        qb0 = cuda.local.array(NCHUNK, uint32)
        qb1 = cuda.local.array(NCHUNK, uint32)
        qrow = u32((b * hq + h * g + r) * (D // 2))
        for kk in range(NCHUNK):
            qb0[kk] = u32(q32[u32(qrow + 8 * kk + q)]) if r < g else u32(0)
            qb1[kk] = u32(q32[u32(qrow + 8 * kk + 4 + q)]) if r < g else u32(0)

        # Block-table entries of this split (K then V, T tiles each).  The loads depend on the work item
        # only (not on the sequence length, which would put a second round trip to memory before them)
        # and are unconditional (a lane past the split's entries reloads its last one): all of them in
        # flight at once, where a load and store per lane under a condition made a round trip each.
        # Each is checked against its pool as it is stored (checked_entry).
        ntab = i32((min(blk1, max_blocks) - blk0) * 2 * T)
        if ntab > 0:
            last = i32(min(blk1, max_blocks) - 1)
            for k in range(NENT // WARP):
                i = i32(lane + WARP * k)
                blk_i = i32(min(blk0 + i // (2 * T), last))
                row = u32((b * max_blocks + blk_i) * (kv_heads * T) + h * T + i % T)
                if (i // T) % 2 == 0:
                    ents[i] = checked_entry(table_k[row], blk_i < nfull, n_slots_k, n_raw_k, status)
                else:
                    ents[i] = checked_entry(table_v[row], blk_i < nfull, n_slots_v, n_raw_v, status)
        # The split's epochs (one per kind: see the plan); a split of only the tail reads epoch 0.
        # (Loaded before the sequence length is known, like the table entries, and checked after.)
        ek = i32(epoch_k[u32(b * max_blocks + blk0)]) if not plain and blk0 < max_blocks else i32(0)
        ev_ = i32(epoch_v[u32(b * max_blocks + blk0)]) if not plain and blk0 < max_blocks else i32(0)
        tail_base = (b * kv_heads + h) * (L.BLOCK_TOKENS * D * 2)
        bw0 = cuda.local.array(BASE_REGS, int32)
        if not plain:
            ne = max(epochs_k, epochs_v)
            ek = checked_epoch(ek, epochs_k, status) if blk0 < nfull else i32(0)
            ev_ = checked_epoch(ev_, epochs_v, status) if blk0 < nfull else i32(0)
            load_bases(bases, 0, ek, ne, h, kv_heads, lane, bw0)
            load_bases(bases, 1, ev_, ne, h, kv_heads, lane, bw0)
        warp_sync(scr)
        # The first stages' copies start as soon as the entries are in shared memory, right behind the
        # bases' loads above (the first decode waits for both; the bases are stored after the copies).
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
        if not plain:
            store_bases(smem, bw0, lane)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = f32(0)
        m0 = f32(_NEG_INF)                      # running maxima and this lane's sums, heads 2q and 2q + 1
        m1 = f32(_NEG_INF)
        l0 = f32(0)
        l1 = f32(0)
        sc = cuda.local.array(8, float32)           # score accumulators (see qk_mma)
        kf = cuda.local.array(KF_WORDS, uint32)      # K fragments of one tile
        smw = cuda.local.array(SM_WORDS, uint32)     # decoder state (overlap path)
        cw = cuda.local.array(CODE_ARRAY, uint32)
        ev = cuda.local.array(GPL, uint32)
        bw = cuda.local.array(BASE_WORDS, uint32)
        warp_sync(scr)

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
                    # (ek_n, ev_n: tile 0's entries; a head of two tiles tests its entries there)
                    ahead_tail = blk0 + ahead >= nfull
                    if not plain and (T > 1 or i32(ek_n | ev_n) < 0 or ahead_tail):
                        prefetch_bf16_tiles(ents, ahead, ahead_tail, raw_k, raw_v, tail_k, tail_v, tail_base, lane)
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
                # Both tiles compressed: one escape scan; K decoded; then the V tile's reads, the q.k
                # MMAs, the softmax and the V decode in one straight-line region.
                src_k = u32(sb + STG + 2 * st * SB)
                src_v = u32(src_k + SB)
                base_k = u32(sb + BASES + C * (lane >> 4))
                base_v = u32(base_k + 4 * BASE_ROWS * RS)
                dec = u32(sb + DEC)
                tags_k, cnt_k = decode_tags(smem, src_k)
                if REFILL:
                    off_k = escape_scan(cnt_k, scr)
                else:
                    tags_v, cnt_v = decode_tags(smem, src_v)
                    off_k, off_v = escape_scan2(cnt_k, cnt_v, scr)
                decode_loads(smem, src_k, base_k, 4 * RS, tags_k, off_k, cap_k, smw, cw, ev, bw)
                decode_compute(smem, dec, tags_k, smw, cw, ev, bw)
                decode_fix(smem, src_k, dec, tags_k, off_k, cnt_k, cap_k, status)
                warp_sync(scr)
                if REFILL:
                    refill_k(smem, sb, ents, i, blk, blk1, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                             tail_valid, lane)
                load_k_frags(smem, dec, kf, scr)
                warp_sync(scr)                  # the V decode below overwrites the decode tile
                if REFILL:
                    cp_wait()
                    warp_sync(scr)
                    tags_v, cnt_v = decode_tags(smem, src_v)
                    off_v = escape_scan(cnt_v, scr)
                decode_loads(smem, src_v, base_v, 4 * RS, tags_v, off_v, cap_v, smw, cw, ev, bw)
                qk_mma(kf, 0, qb0, qb1, sc, scr)
                m0, m1, l0, l1, pb0, pb1, al0, al1 = softmax_update(sc, valid, r, m0, m1, l0, l1, scale_log2, scr)
                decode_compute(smem, dec, tags_v, smw, cw, ev, bw)
                decode_fix(smem, src_v, dec, tags_v, off_v, cnt_v, cap_v, status)
                warp_sync(scr)
                if REFILL:
                    refill_v(smem, sb, ents, i, blk, blk1, nfull, slots_v, slot_bytes_v, raw_v, tail_v, tail_base,
                             tail_valid, lane)
                rescale(acc, al0, al1, scr)
                pv_mma(smem, dec, 0, pb0, pb1, acc, scr)
                warp_sync(scr)
                continue
            for j in range(T):
                tile = tile_of(smem, sb, ents, i, st, 0, j, is_tail, raw_k, tail_k, tail_base + j * C * 2,
                               tail_valid, cap_k, status, scr, True)
                load_k_frags(smem, tile, kf, scr)
                qk_mma(kf, j, qb0, qb1, sc, scr)
                warp_sync(scr)
            if REFILL:
                refill_k(smem, sb, ents, i, blk, blk1, nfull, slots_k, slot_bytes_k, raw_k, tail_k, tail_base,
                         tail_valid, lane)
            m0, m1, l0, l1, pb0, pb1, al0, al1 = softmax_update(sc, valid, r, m0, m1, l0, l1, scale_log2, scr)
            rescale(acc, al0, al1, scr)
            if REFILL:
                cp_wait()
                warp_sync(scr)
            for j in range(T):
                tile = tile_of(smem, sb, ents, i, st, 1, j, is_tail, raw_v, tail_v, tail_base + j * C * 2,
                               tail_valid, cap_v, status, scr, True)
                pv_mma(smem, tile, j, pb0, pb1, acc, scr)
                warp_sync(scr)
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
        if variant == TIMELINE:
            warp_sync(scr)
            if lane == 0:
                t0 = u32(t_start)
                t1 = u32(globaltimer())
                at = u32((w * kv_heads + h) * g * D)
                o_part[at] = f32(t0 & 0xFFFF)
                o_part[at + 1] = f32(t0 >> 16)
                o_part[at + 2] = f32(t1 & 0xFFFF)
                o_part[at + 3] = f32(t1 >> 16)
                o_part[at + 4] = f32(smid())
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


@device
def merge_pair(m, d, a0, a1, a2, a3, m2, d2, b0, b1, b2, b3):
    """Two partial softmax states (log2 maximum, sum, 4 weighted channel sums) as one."""
    mn = max(m, m2)
    s1 = ex2(m - mn) if m != _NEG_INF else f32(0)
    s2 = ex2(m2 - mn) if m2 != _NEG_INF else f32(0)
    return mn, d * s1 + d2 * s2, a0 * s1 + b0 * s2, a1 * s1 + b1 * s2, a2 * s1 + b2 * s2, a3 * s1 + b3 * s2


if SIMULATOR:
    def merge_shuffle(x, off, mask, scr):
        """``merge_pair`` of this thread's state (a 6-tuple) and thread ``tid ^ off``'s, every thread of the
        block taking part: through ``scr`` (6 words a thread) in the simulator, which has no shuffles."""
        tid = cuda.threadIdx.x
        for c in range(6):
            scr[6 * tid + c] = x[c]
        cuda.syncthreads()
        y = [scr[6 * (tid ^ off) + c] for c in range(6)]
        cuda.syncthreads()
        return merge_pair(*x, *y)
else:
    @device
    def merge_shuffle(x, off, mask, scr):
        """``merge_pair`` of this lane's state (a 6-tuple) and lane ``lane ^ off``'s (``scr``: unused here)."""
        m, d, a0, a1, a2, a3 = x
        return merge_pair(m, d, a0, a1, a2, a3, cuda.shfl_xor_sync(mask, m, off), cuda.shfl_xor_sync(mask, d, off),
                          cuda.shfl_xor_sync(mask, a0, off), cuda.shfl_xor_sync(mask, a1, off),
                          cuda.shfl_xor_sync(mask, a2, off), cuda.shfl_xor_sync(mask, a3, off))


@functools.lru_cache(maxsize=None)
def merge_kernel(head_dim: int, lanes: int):
    """Merge split partials (grid, threads and ``lanes`` from :func:`merge_launch`).  Each thread folds
    its splits into a running (max, sum, 4 channels) :data:`MERGE_UNROLL` splits at a time (their loads
    in flight together); then the lanes of a channel quad are combined by shuffles within each warp and
    across the warps through shared memory with one barrier (a pairwise tree in shared memory needs one a
    level).
    Indices are 32-bit and unsigned: numba's signed indexing adds a negative-index fix-up to every load.
    Launched as a programmatic dependent of the split kernel (``AttentionPlan``'s ``pdl``), it reads its
    split range, then waits for that grid (``griddepcontrol.wait``) before it reads the partials.

    ``o_part`` float32 ``[W*Hkv*g*D]``, ``lse_part`` float32 ``[W*Hkv*g]`` (log2), ``split0`` int32
    ``[B+1]`` (the splits of sequence ``b`` are ``split0[b] .. split0[b+1]-1``), out ``out`` int16
    ``[B*Hq*D]`` (BF16 bits) and ``lse`` float32 ``[B*Hq]`` (natural log, written by the first channel block).
    """
    D = head_dim
    QUADS = MERGE_CHANNELS // 4
    LANES = lanes
    THREADS = QUADS * LANES
    WARPS = -(-THREADS // WARP)
    MASK = (1 << min(THREADS, WARP)) - 1
    UNROLL = MERGE_UNROLL
    OS = 4 * UNROLL
    STATE = 6                           # max, sum, 4 channel sums
    PART = WARPS * QUADS * STATE if WARPS > 1 else 1
    SCR = STATE * THREADS if SIMULATOR else 1

    @cuda.jit
    def kernel(o_part, lse_part, split0, out, lse, kv_heads, g):
        part = cuda.shared.array(PART, float32)
        scr = cuda.shared.array(SCR, float32)
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
        x = (m, den, acc[0], acc[1], acc[2], acc[3])
        # The lanes of a quad: within a warp (lanes 8 apart), then across the warps.
        if THREADS > QUADS:
            x = merge_shuffle(x, QUADS, MASK, scr)
        if THREADS > 2 * QUADS:
            x = merge_shuffle(x, 2 * QUADS, MASK, scr)
        if WARPS > 1:
            wid = tid // WARP
            if tid % WARP < QUADS:
                at = (wid * QUADS + quad) * STATE
                for c in range(STATE):
                    part[at + c] = x[c]
            cuda.syncthreads()
            x = (f32(_NEG_INF), f32(0), f32(0), f32(0), f32(0), f32(0))
            if wid == 0:
                for k in range(tid // QUADS, WARPS, WARP // QUADS):     # warps k, k + 4, ...: 4 lanes a quad
                    at = (k * QUADS + quad) * STATE
                    m, d, a0, a1, a2, a3 = x
                    x = merge_pair(m, d, a0, a1, a2, a3, part[at], part[at + 1], part[at + 2], part[at + 3],
                                   part[at + 4], part[at + 5])
            # (every warp shuffles, as the simulator's exchange needs; only warp 0's lanes 0..7 are kept)
            x = merge_shuffle(x, QUADS, 0xFFFFFFFF, scr)
            x = merge_shuffle(x, 2 * QUADS, 0xFFFFFFFF, scr)
        m, den, a0, a1, a2, a3 = x
        if tid < QUADS:
            inv = f32(1) / den if den > 0 else f32(0)   # no split: an empty sequence, output 0
            base = (b * kv_heads * g + hq) * D + cuda.blockIdx.z * MERGE_CHANNELS + 4 * tid
            lo = pack_bf16x2(a0 * inv, a1 * inv)
            hi = pack_bf16x2(a2 * inv, a3 * inv)
            out[base] = as_int16(lo & 0xFFFF)
            out[base + 1] = as_int16(lo >> 16)
            out[base + 2] = as_int16(hi & 0xFFFF)
            out[base + 3] = as_int16(hi >> 16)
            if tid == 0 and cuda.blockIdx.z == 0:
                lse[b * kv_heads * g + hq] = ((m + math.log2(den)) * f32(1 / _LOG2E) if den > 0
                                              else f32(_NEG_INF))
    return kernel
