"""Device primitives of gaac's kernels, written once for the GPU and the CUDA simulator.

Every primitive is PTX (inline assembly or a numba intrinsic) on the GPU and a plain-Python twin with the
same per-lane semantics under ``NUMBA_ENABLE_CUDASIM=1``, which has no inline PTX, no libdevice, no bf16
and no warp primitives; a kernel's source is the same on both.  Two groups:

* **Shared memory, tensor cores and warps** (the attention kernel and its tile decoder): 32-bit
  shared-window addresses, ``ldmatrix``, ``mma.sync``, ``cp.async``, warp votes, shuffles and scans.  In the
  simulator the warp-wide ones (``mma``, ``ldmatrix``, ``movmatrix``, shuffles, scans) exchange values
  through a shared ``scratch`` array of :data:`SCRATCH_WORDS` words and ``syncthreads``.  That is correct
  because every block that calls them is one warp with warp-uniform control flow around those calls.
* **The 32-bit toolkit** (the tile codecs' kernels): byte permutes, population counts, funnel shifts and
  vector loads and stores of 2-D ``uint32`` arrays.  On the GPU a 64-bit integer operation costs two
  instructions, and a byte permute does in one instruction what takes five shifts and masks.
"""
from __future__ import annotations

import functools
import threading

import numpy as np
from numba import config, cuda, float32, int32, int64, uint32, uint64

SIMULATOR = bool(config.ENABLE_CUDASIM)
WARP = 32
FULL_MASK = 0xFFFFFFFF

if SIMULATOR:
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    # The simulator hands a kernel numba.cuda's per-kernel API (threadIdx, syncthreads, local arrays, atomics)
    # in the kernel's own module only, and the device functions here and in the tile decoder, plain Python
    # there, live in other modules: they use this stand-in, every part of which is the running thread's or
    # stateless, so that one instance serves every launch.  On the GPU it is numba.cuda itself.
    kernel_api = FakeCUDAModule((1, 1, 1), (1, 1, 1), 0)

    # Fixed-width casts that wrap like the GPU's registers (numba's own casts raise on overflow in
    # the simulator, and are slow there).  A value already of the type is returned as it is: most casts in
    # a kernel's source are of such values, and the simulator's scan makes millions of them.
    _U32, _I32, _U64, _I64 = np.uint32, np.int32, np.uint64, np.int64

    def u32(x):
        return x if type(x) is _U32 else _U32(int(x) & 0xFFFFFFFF)

    def i32(x):
        return x if type(x) is _I32 else _I32(((int(x) + 0x80000000) & 0xFFFFFFFF) - 0x80000000)

    def u64(x):
        return x if type(x) is _U64 else _U64(int(x) & 0xFFFFFFFFFFFFFFFF)

    def i64(x):
        return x if type(x) is _I64 else _I64(((int(x) + (1 << 63)) & 0xFFFFFFFFFFFFFFFF) - (1 << 63))

    f32 = np.float32
else:
    kernel_api = cuda
    u32, i32, u64, i64, f32 = uint32, int32, uint64, int64, float32


def device(fn):
    """A device function on the GPU (inlined); a plain Python function in the simulator, where every
    call of a ``cuda.jit`` device function takes a module-wide lock that the 32 threads of a block
    contend for."""
    return fn if SIMULATOR else cuda.jit(device=True, inline=True)(fn)


# ----------------------------------------------------------------------------------------------
# Shared memory, tensor cores and warps.
#
# Shared memory is addressed in bytes through 32-bit shared-window addresses: ``smem_base(smem)``
# is the address of ``smem[0]`` (0 in the simulator, where the functions index ``smem`` itself),
# so that address arithmetic stays in 32-bit registers.  Global sources of ``cp16`` are 64-bit
# addresses from ``gaddr(array, byte)`` (in the simulator, the byte index into the array).

if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice
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

    def _load_intrinsic(text: str, ret, at):
        """A one-register load ``text`` (PTX, ``$0`` the value, ``$1`` the address) as an intrinsic returning numba
        type ``ret`` from an address of numba type ``at`` (uint32: shared memory; int64: global)."""
        reg = _F32 if ret == types.float32 else _I32
        constraints = f"={'f' if reg is _F32 else 'r'},{'l' if at == types.int64 else 'r'},~{{memory}}"

        @intrinsic
        def load(typingctx, addr):
            def codegen(context, builder, sig, args):
                return _asm(builder, reg, list(args), text, constraints, side_effect=True)
            return ret(at), codegen
        return load

    _lds = _load_intrinsic("ld.shared.u32 $0, [$1];", types.uint32, types.uint32)
    _lds_u8 = _load_intrinsic("ld.shared.u8 $0, [$1];", types.uint32, types.uint32)

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
    def _ldcg4(typingctx, gptr):
        rt = types.UniTuple(types.float32, 4)

        def codegen(context, builder, sig, args):
            r = _asm(builder, ir.LiteralStructType([_F32] * 4), list(args),
                     "ld.global.cg.v4.f32 {$0,$1,$2,$3}, [$4];", "=f,=f,=f,=f,l,~{memory}", side_effect=True)
            return _tuple(context, builder, rt, r, 4)
        return rt(types.int64), codegen

    _ldcg = _load_intrinsic("ld.global.cg.f32 $0, [$1];", types.float32, types.int64)
    _ldcg_s32 = _load_intrinsic("ld.global.cg.s32 $0, [$1];", types.int32, types.int64)
    _ldcg_s16 = _load_intrinsic("ld.global.cg.s16 $0, [$1];", types.int32, types.int64)

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
    def ldg4_at(src, gptr):
        """16 bytes of read-only global memory at address ``gptr`` (``src``: the array, for the simulator)."""
        return _ldg4(gptr)

    @device
    def ldcg4f(arr, i):
        """Four float32 of ``arr`` from element ``i`` (16-byte aligned), read from L2 (not L1): values that other
        thread blocks of the grid wrote, made visible by their fence and an atomic this warp read after them."""
        return _ldcg4(gaddr(arr, u64(i) * u64(4)))

    @device
    def ldcgf(arr, i):
        """One float32 of ``arr``, read from L2 as :func:`ldcg4f` reads."""
        return _ldcg(gaddr(arr, u64(i) * u64(4)))

    @device
    def ldcg_i32(arr, i):
        """``arr[i]`` of an int32 array, read from L2 (not L1): a value the grid a programmatic dependent launch
        follows may have written, read after :func:`grid_wait` where this grid may have cached its line before."""
        return _ldcg_s32(gaddr(arr, u64(i) * u64(4)))

    @device
    def ldcg_i16(arr, i):
        """``arr[i]`` of an int16 array (as int32), read from L2 as :func:`ldcg_i32` reads."""
        return _ldcg_s16(gaddr(arr, u64(i) * u64(2)))

    @device
    def cp_commit():
        _cp_commit()

    @device
    def prefetch_l2(src, gptr):
        """Start bringing the 128-byte line of global ``gptr`` into L2 (``src``: the array, for the simulator)."""
        _prefetch_l2(gptr)

    @device
    def prmt0(a, sel):
        """Byte permute of ``a`` and a zero word: :func:`prmt` ``(a, 0, sel)``."""
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
        """Set bits of ``x`` as an int32 (escape offsets are signed arithmetic; :func:`popc32` is the
        toolkit's)."""
        return i32(cuda.popc(u32(x)))

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
        return kernel_api.threadIdx.x % WARP

    def _exchange(scr, *words):
        """Publish up to 8 words of this lane; returns the area: lane ``l``'s word ``i`` is ``area[8l + i]``."""
        lane = _lane()
        count = int(scr[2 * _AREA + lane])
        area = scr[_AREA * (count & 1):_AREA * ((count & 1) + 1)]
        for i, w in enumerate(words):
            area[8 * lane + i] = int(w) & 0xFFFFFFFF
        scr[2 * _AREA + lane] = count + 1
        kernel_api.syncthreads()
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
        kernel_api.syncthreads()

    @device
    def warp_sync(scr):
        kernel_api.syncthreads()

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
    def ldcg4f(arr, i):
        i = int(i)
        return f32(arr[i]), f32(arr[i + 1]), f32(arr[i + 2]), f32(arr[i + 3])

    @device
    def ldcgf(arr, i):
        return f32(arr[int(i)])

    @device
    def ldcg_i32(arr, i):
        return i32(arr[int(i)])

    @device
    def ldcg_i16(arr, i):
        return i32(arr[int(i)])

    @device
    def ldg4_at(src, gptr):
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
    def prmt0(a, sel):
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


# ----------------------------------------------------------------------------------------------
# 32-bit toolkit.
#
# Rules that keep the GPU code 32-bit and the simulator in step with it: values are ``uint32``
# (NumPy ``uint32`` scalars in the simulator, where kernels see arrays as ``uint32`` views);
# constants are ``np.uint32`` module globals (numba freezes them as 32-bit constants); a sum or
# product is wrapped in ``u32(...)`` in kernel code (numba types ``uint32 + uint32`` as 64-bit;
# the wrap lets NVVM narrow it back; in the simulator the cast wraps as the GPU's register does), or goes through :func:`mul32` when it may exceed 32 bits
# (NumPy would warn on the wrap-around); array indices are unsigned (numba adds a compare and a
# select per index for negative-index wrap-around otherwise).


if SIMULATOR:
    def prmt(x, y, s):
        """Byte permute (CUDA ``__byte_perm``): byte k of the result is byte ``(s >> 4k) & 7`` of
        ``y:x`` (bytes 0..3 from ``x``, 4..7 from ``y``)."""
        v = (int(y) << 32) | int(x)
        s = int(s)
        return u32(sum(((v >> (8 * ((s >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4)))

    def popc32(x):
        """Set bits of a 32-bit word."""
        return bin(int(x) & FULL_MASK).count("1")

    def mul32(a, b):
        """Low 32 bits of ``a * b``."""
        return u32(int(a) * int(b))

    def funnel_r(lo, hi, r):
        """Bits ``r .. r+31`` of the 64-bit value ``hi:lo`` (``0 <= r < 32``)."""
        return u32(((int(hi) << 32) | int(lo)) >> int(r))

    def ldg2(a, row, col):
        """Words ``col, col+1`` of row ``row`` of a 2-D 32-bit array (one 8-byte load on the GPU)."""
        return a[row, col], a[row, col + 1]

    def ldg4(a, row, col):
        """Words ``col .. col+3`` of row ``row`` (one 16-byte load on the GPU; ``col % 4 == 0``)."""
        return a[row, col], a[row, col + 1], a[row, col + 2], a[row, col + 3]

    def stg2(a, row, col, x, y):
        """Store two words at ``col, col+1`` of row ``row`` (one 8-byte store on the GPU)."""
        a[row, col] = x
        a[row, col + 1] = y

    def stg4(a, row, col, x, y, z, w):
        """Store four words at ``col .. col+3`` of row ``row`` (one 16-byte store; ``col % 4 == 0``)."""
        a[row, col] = x
        a[row, col + 1] = y
        a[row, col + 2] = z
        a[row, col + 3] = w

    def syncwarp():
        """Warp barrier.  The simulator's block barrier waits for every *live* thread of the block,
        so it acts as a warp barrier as long as all 32 threads of each warp that is still running
        reach their barriers in the same order (threads that returned do not hold it up)."""
        threading.current_thread().syncthreads()
else:
    @cuda.jit(device=True, inline=True)
    def prmt(x, y, s):
        """Byte permute: one PRMT instruction (see the simulator twin for the semantics)."""
        return uint32(libdevice.byte_perm(x, y, s))

    @cuda.jit(device=True, inline=True)
    def popc32(x):
        """Set bits of a 32-bit word: one POPC."""
        return libdevice.popc(x)

    @cuda.jit(device=True, inline=True)
    def mul32(a, b):
        """Low 32 bits of ``a * b``: one IMAD."""
        return uint32(uint32(a) * uint32(b))

    @cuda.jit(device=True, inline=True)
    def funnel_r(lo, hi, r):
        """Bits ``r .. r+31`` of ``hi:lo``: one SHF.R."""
        return uint32(((uint64(hi) << uint64(32)) | uint64(lo)) >> uint64(r))

    def _pointer(context, builder, sig, args):
        """Address of element ``[row, col]`` of the 2-D array in ``args[0..2]``, no wrap-around."""
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, value=args[0])
        idx = [context.cast(builder, args[i], sig.args[i], types.intp) for i in (1, 2)]
        return cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False)

    def _load(width):
        regs = ",".join(f"${i}" for i in range(width))
        text = f"ld.global.nc.v{width}.u32 {{{regs}}}, [${width}];"
        constraints = ",".join(["=r"] * width) + ",l"

        @intrinsic
        def load(typingctx, a, row, col):
            """Words ``col .. col+width-1`` of row ``row``: one read-only (``.nc``) vector load."""
            rt = types.UniTuple(types.uint32, width)

            def codegen(context, builder, sig, args):
                r = _asm(builder, ir.LiteralStructType([_I32] * width), [_pointer(context, builder, sig, args)],
                         text, constraints)
                return context.make_tuple(builder, rt, [builder.extract_value(r, i) for i in range(width)])
            return rt(a, row, col), codegen
        return load

    def _store_codegen(width):
        regs = ",".join(f"${i + 1}" for i in range(width))
        text = f"st.global.v{width}.u32 [$0], {{{regs}}};"
        constraints = "l," + ",".join(["r"] * width) + ",~{memory}"

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[3:], sig.args[3:])]
            _asm(builder, ir.VoidType(), [_pointer(context, builder, sig, args)] + vals, text, constraints,
                 side_effect=True)
            return context.get_dummy_value()
        return codegen

    @intrinsic
    def stg2(typingctx, a, row, col, x, y):
        """Store two words at ``col, col+1`` of row ``row``: one 8-byte store."""
        return types.void(a, row, col, x, y), _store_codegen(2)

    @intrinsic
    def stg4(typingctx, a, row, col, x, y, z, w):
        """Store four words at ``col .. col+3`` of row ``row``: one 16-byte store (``col % 4 == 0``)."""
        return types.void(a, row, col, x, y, z, w), _store_codegen(4)

    ldg2 = _load(2)
    ldg4 = _load(4)

    @cuda.jit(device=True, inline=True)
    def syncwarp():
        """Warp barrier (``bar.warp.sync``)."""
        cuda.syncwarp(FULL_MASK)
