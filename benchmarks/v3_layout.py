"""An offline study of a version-3 in-tile layout: a slot whose bytes are ordered so that
the attention kernel's decoder builds the ``mma.sync m16n8k16`` A fragments of K and V in registers, with no
decoded BF16 tile and no ``ldmatrix``.  Nothing here ships; benchmarks/results/v3-layout-offline.md has the results.

    python benchmarks/v3_layout.py check       # simulator (NUMBA_ENABLE_CUDASIM=1): v3 decode == the tile
    python benchmarks/v3_layout.py sass        # SASS opcode classes per block (K+V), v2 (today) and v3
    python benchmarks/v3_layout.py smem        # shared-memory wavefronts per tile from the address patterns

The layout (C = 128; lane ``l = 4r + q``, the MMA's groupID ``r`` and thread-in-group ``q``):

* Lane ownership (as v18's decoder, commit 2d828c8): K lane owns tokens ``r, r+8`` x channels ``32q..32q+31``
  (its local groups ``G = 4i + gg``: token ``r + 8i``, channel group ``4q + gg``), the query's channels permuted
  to match; V lane owns tokens ``2q, 2q+1, 2q+8, 2q+9`` x channels ``16r..16r+15`` (``G = 2 ti + cg``: token
  ``[2q, 2q+1, 2q+8, 2q+9][ti]``, channel group ``2r + cg``), the output's channels permuted to match.
* Fragment word ``f = 4 kk + j`` (``a_j`` of MMA chunk ``kk``).  K: lo/hi = elements ``2p, 2p+1`` of group
  ``G = 4 (j & 1) + kk // 2``, ``p = 2 (kk & 1) + (j >> 1)``.  V: lo/hi = element ``mt = kk`` of groups
  ``G = 4 (j >> 1) + (j & 1)`` and ``G + 2`` (two tokens, one channel).
* sign+mantissa (2048 bytes): lane ``l``'s 16 words at ``16 (32 k + l) + 4 i`` (word ``w = 4k + i``); word ``w``
  serves fragment words ``2w`` (bits 0-6 / 15 / 16-22 / 31: lo mantissa, lo sign, hi mantissa, hi sign) and
  ``2w + 1`` (bits 8-14 / 23 / 24-30 / 7, the same after a rotation right by 8).
* codes (768 bytes): lane ``l``'s 6 words at ``2048 + 16 l + 4 c`` (``c < 4``) and ``2560 + 8 l + 4 (c - 4)``;
  word ``c`` holds fragment word ``5c + s``'s lo code at bits ``3s..3s+2`` and hi code at ``16 + 3s``
  (``s < 5``); fragment words 30 and 31 keep their code bits ``b`` in bits 15 (lo) and 31 (hi) of words
  ``b`` and ``3 + b``.
* tags (64 bytes): lane ``l``'s 16 bits at ``2816 + 2 l``, nibble ``k`` = tag of ``G = k`` (bits 0-1) and of
  ``G = k + 4`` (bits 2-3).
* escapes: plane-3 bytes (a 4-bit group's byte, a raw group's first) of every non-3-bit group, lanes in the
  order of ``escape_scan`` (``2 (l % 16) + l // 16``), groups in ``G`` order, from the front of the escape
  area; planes 4..7 of each raw group as one aligned word, transposed (nibble ``i`` = exponent bits 4..7 of
  element ``i``), from the back (raw group ``n`` of the tile
  at ``capacity - 4 (n + 1)``, a lane's raw groups in the order of their tag bits: G = 0, 4, 1, 5, ..);
  zeros between.  Same bytes as version 2, so the same capacity rule.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if sys.argv[1:2] == ["check"]:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"     # before numba is imported
else:
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

from numba import cuda  # noqa: E402  (module-level: the simulator swaps this name in a kernel's module)

C = 128
T = 16
SM_OFF, CODE_OFF, TAG_OFF, ESC_OFF = 0, 2048, 2816, 2880
CODE_HI_OFF = CODE_OFF + 512
K_STRIDE = 4 * (C // 2 + 16)         # K base rows (b3, b4, zero; pair words of channels c, c+1; 320 bytes, so that
                                     # rows m and m+1 fall in other banks), 16-byte chunk 4 gg + q = channels
                                     # 32 q + 8 gg .. + 7: a quarter-warp's 4 chunks are 64 contiguous bytes
V_ROW = 4 * (C + 4)                  # V base rows, 9 of them: (mode_lo, mode_hi), word of channel c = b_lo << 7 | b_hi << 23
K_BASE_BYTES = 4 * K_STRIDE          # 3 rows and the reserved tag's row
V_BASE_BYTES = 16 * V_ROW            # 9 rows; reserved tags read up to row 12


# ----------------------------------------------------------------------------------------------
# The layout as maps (host side).

def k_element(lane: int, f: int, half: int) -> tuple[int, int, int]:
    """(token, channel, local group G) of half ``half`` of K fragment word ``f`` of ``lane``."""
    r, q = lane >> 2, lane & 3
    kk, j = f >> 2, f & 3
    i = j & 1
    gg = kk >> 1
    p = 2 * (kk & 1) + (j >> 1)
    return r + 8 * i, 32 * q + 8 * gg + 2 * p + half, 4 * i + gg


def v_element(lane: int, f: int, half: int) -> tuple[int, int, int]:
    r, q = lane >> 2, lane & 3
    mt, j = f >> 2, f & 3
    ti = 2 * (j >> 1) + half
    cg = j & 1
    tok = [2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9][ti]
    return tok, 16 * r + 8 * cg + mt, 2 * ti + cg


def element(kind: int, lane: int, f: int, half: int):
    return (k_element if kind == 0 else v_element)(lane, f, half)


def group_of(kind: int, lane: int, g: int) -> tuple[int, int]:
    """(token, first channel) of local group ``g`` of ``lane``."""
    r, q = lane >> 2, lane & 3
    if kind == 0:
        return r + 8 * (g >> 2), 32 * q + 8 * (g & 3)
    tok = [2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9][g >> 1]
    return tok, 16 * r + 8 * (g & 1)


def scan_order(lane: int) -> int:
    return 2 * (lane & 15) + (lane >> 4)


def encode_v3(kind: int, tile: np.ndarray, b3: np.ndarray, b4: np.ndarray, capacity: int) -> bytes | None:
    """A [16, 128] uint16 BF16 tile as a v3 slot (None on slot overflow), canonical modes (FORMAT.md 5.2)."""
    tile = tile.astype(np.int64)
    e = (tile >> 7) & 0xFF
    sm = ((tile >> 8) & 0x80) | (tile & 0x7F)
    slot = bytearray(ESC_OFF + capacity)
    modes = np.zeros((32, 8), np.int64)
    for lane in range(32):
        for g in range(8):
            t, c0 = group_of(kind, lane, g)
            x = e[t, c0:c0 + 8]
            if np.all((x >= b3[c0:c0 + 8]) & (x <= b3[c0:c0 + 8] + 7)):
                modes[lane, g] = 0
            elif np.all((x >= b4[c0:c0 + 8]) & (x <= b4[c0:c0 + 8] + 15)):
                modes[lane, g] = 1
            else:
                modes[lane, g] = 2

    def code(t, c, lane, g):
        m = modes[lane, g]
        return int(e[t, c] - (b3[c] if m == 0 else b4[c] if m == 1 else 0))

    for lane in range(32):
        # sign+mantissa
        for w in range(16):
            word = 0
            for f, pos in ((2 * w, ((0, 15), (16, 31))), (2 * w + 1, ((8, 23), (24, 7)))):
                for half in range(2):
                    t, c, _ = element(kind, lane, f, half)
                    s = int(sm[t, c])
                    word |= (s & 0x7F) << pos[half][0] | (s >> 7) << pos[half][1]
            at = SM_OFF + 16 * (32 * (w >> 2) + lane) + 4 * (w & 3)
            slot[at:at + 4] = word.to_bytes(4, "little")
        # codes
        cw = [0] * 6
        for f in range(32):
            lo = [code(*element(kind, lane, f, h)[:2], lane, element(kind, lane, f, h)[2]) & 7 for h in range(2)]
            if f < 30:
                c, s = divmod(f, 5)
                cw[c] |= lo[0] << (3 * s) | lo[1] << (16 + 3 * s)
            else:
                w0 = 3 * (f - 30)
                for b in range(3):
                    cw[w0 + b] |= ((lo[0] >> b) & 1) << 15 | ((lo[1] >> b) & 1) << 31
        for c in range(6):
            at = CODE_OFF + 16 * lane + 4 * c if c < 4 else CODE_HI_OFF + 8 * lane + 4 * (c - 4)
            slot[at:at + 4] = cw[c].to_bytes(4, "little")
        # tags
        tw = 0
        for g in range(8):
            tw |= int(modes[lane, g]) << (4 * (g & 3) + 2 * (g >> 2))
        slot[TAG_OFF + 2 * lane:TAG_OFF + 2 * lane + 2] = tw.to_bytes(2, "little")
    # escapes
    front, back = [], []
    for lane in sorted(range(32), key=scan_order):
        for g in range(8):                      # plane-3 bytes in G order
            m = modes[lane, g]
            if m == 0:
                continue
            t, c0 = group_of(kind, lane, g)
            codes = [code(t, c0 + i, lane, g) for i in range(8)]
            front.append(sum(((cd >> 3) & 1) << i for i, cd in enumerate(codes)))
        for g in (0, 4, 1, 5, 2, 6, 3, 7):      # raw groups in the order of their tag bits
            if modes[lane, g] == 2:
                t, c0 = group_of(kind, lane, g)
                codes = [code(t, c0 + i, lane, g) for i in range(8)]
                back.append(sum(((cd >> 4) & 0xF) << (4 * i) for i, cd in enumerate(codes)))
    if len(front) + 4 * len(back) > capacity:
        return None
    slot[ESC_OFF:ESC_OFF + len(front)] = bytes(front)
    for n, word in enumerate(back):
        at = ESC_OFF + capacity - 4 * (n + 1)
        slot[at:at + 4] = word.to_bytes(4, "little")
    return bytes(slot)


def bases_v3(b3: np.ndarray, b4: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Shared-memory base tables as uint32 words: K (rows b3, b4, 0: pair words of channels 2i, 2i+1) and V
    (row 3 m_lo + m_hi: word of channel c = base_{m_lo}[c] << 7 | base_{m_hi}[c] << 23)."""
    rows = [b3.astype(np.int64), b4.astype(np.int64), np.zeros(C, np.int64)]
    k = np.zeros(K_BASE_BYTES // 4, np.uint32)
    for m in range(3):
        pairs = rows[m][0::2] << 7 | rows[m][1::2] << 23          # pair word i: channels 2i, 2i+1
        for q in range(4):
            for gg in range(4):
                at = m * K_STRIDE // 4 + 4 * (4 * gg + q)
                k[at:at + 4] = pairs[16 * q + 4 * gg:16 * q + 4 * gg + 4]
    v = np.zeros(V_BASE_BYTES // 4, np.uint32)
    for a in range(3):
        for b in range(3):
            at = (3 * a + b) * V_ROW // 4
            v[at:at + C] = rows[a] << 7 | rows[b] << 23
    return k, v


def expected_fragments(kind: int, tile: np.ndarray) -> np.ndarray:
    out = np.zeros((32, 32), np.uint32)
    for lane in range(32):
        for f in range(32):
            lo = element(kind, lane, f, 0)
            hi = element(kind, lane, f, 1)
            out[lane, f] = int(tile[lo[0], lo[1]]) | int(tile[hi[0], hi[1]]) << 16
    return out


# ----------------------------------------------------------------------------------------------
# The device decoder (GPU or simulator, through gaac.cuda.primitives).

def _code_expr(f: int) -> str:
    """Fragment word f's two 3-bit codes at bits 7-9 and 23-25, as an expression of ``cw0..cw5``."""
    if f < 30:
        s = 7 - 3 * (f % 5)
        y = f"u32(cw{f // 5} << {s})" if s >= 0 else f"u32(cw{f // 5} >> {-s})"
    else:
        b = 3 * (f - 30)
        y = (f"u32(((cw{b} >> 8) & 0x00800080) | ((cw{b + 1} >> 7) & 0x01000100) | "
             f"((cw{b + 2} >> 6) & 0x02000200))")
    return f"u32({y} & 0x03800380)"


def _sm_expr(f: int) -> str:
    w = f"smw{f // 2}"
    return w if f % 2 == 0 else f"u32(({w} >> 8) | u32({w} << 24))"


def _compute_source(kind: int) -> str:
    """Straight-line source (every index a literal, so that the arrays stay in registers) of the common path
    of one kind: ``compute(smw, cw, bw, evl, evh, frag)``."""
    lines = ["def compute(smw, cw, bw, evl, evh, frag):"]
    lines += [f"    smw{w} = smw[{w}]" for w in range(16)] + [f"    cw{c} = cw[{c}]" for c in range(6)]
    if kind == 0:
        for g in range(8):
            lines.append(f"    e = prmt0({'evl' if g < 4 else 'evh'}, {0x4440 | (g & 3)})")
            for p in range(4):
                f = 4 * (2 * (g & 3) + p // 2) + 2 * (p % 2) + (g >> 2)
                mult = (1 << (10 - 2 * p)) + (1 << (25 - 2 * p))
                lines.append(f"    frag[{f}] = u32(({_sm_expr(f)} & 0x807F807F) | u32({_code_expr(f)} + bw[{4 * g + p}]"
                             f" + u32(mul32(e, {mult}) & 0x04000400)))")
    else:
        for j in range(4):
            ga = 4 * (j >> 1) + (j & 1)
            lines.append(f"    e = prmt0({'evl' if j < 2 else 'evh'}, {0x4040 | (ga & 3) | (((ga + 2) & 3) << 8)})")
            for mt in range(8):
                f = 4 * mt + j
                lines.append(f"    frag[{f}] = u32(({_sm_expr(f)} & 0x807F807F) | u32({_code_expr(f)} + bw[{8 * j + mt}]"
                             f" + u32(u32(e << {10 - mt}) & 0x04000400)))")
    return "\n".join(lines) + "\n"


def _fix_source(kind: int) -> str:
    """Straight-line source of the raw groups' fix-up: ``fix(smem, end, raw, roff, frag)`` (``end``: the escape
    area's end; ``roff``: the raw groups of the lanes before this one).  A raw group's extra word holds exponent
    bits 4..7 of its element ``i`` in nibble ``i``."""
    def word_of(g: int) -> str:
        bit = 4 * (g & 3) + 2 * (g >> 2) + 1
        return f"lds(smem, u32(end - u32(4 * (roff + popc(raw & {(1 << bit) - 1}) + 1))))"

    def bit_of(g: int) -> int:
        return 4 * (g & 3) + 2 * (g >> 2) + 1

    lines = ["def fix(smem, end, raw, roff, frag):"]
    if kind == 0:
        for g in range(8):
            lines.append(f"    if (raw >> {bit_of(g)}) & 1:")
            lines.append(f"        pw = {word_of(g)}")
            for p in range(4):
                f = 4 * (2 * (g & 3) + p // 2) + 2 * (p % 2) + (g >> 2)
                lines.append(f"        frag[{f}] = u32(frag[{f}] + u32(mul32(prmt0(pw, {0x4440 | p}), 0x00800800) "
                             f"& 0x78007800))")
    else:
        for j in range(4):
            ga = 4 * (j >> 1) + (j & 1)
            gb = ga + 2
            lines.append(f"    if (raw >> {bit_of(ga)}) & 1 or (raw >> {bit_of(gb)}) & 1:")
            lines.append(f"        pa = {word_of(ga)} if (raw >> {bit_of(ga)}) & 1 else u32(0)")
            lines.append(f"        pb = {word_of(gb)} if (raw >> {bit_of(gb)}) & 1 else u32(0)")
            for mt in range(8):
                f = 4 * mt + j
                lines.append(f"        frag[{f}] = u32(frag[{f}] + u32(u32(u32(pa >> {4 * mt}) & 0xF) << 11) "
                             f"+ u32(u32(u32(pb >> {4 * mt}) & 0xF) << 27))")
    return "\n".join(lines) + "\n"


def decoder_v3(rare: bool = True):
    from numba import uint32

    from gaac.cuda import primitives as P
    from gaac.cuda.primitives import (device, escape_scan, funnel_r, i32, kernel_api, lane_id, lds, lds4, mul32, popc,
                                      prmt, u32, warp_any)

    def build(source: str, name: str):
        space = {"u32": u32, "mul32": mul32, "prmt0": P.prmt0, "lds": lds, "popc": popc}
        exec(compile(source, f"<v3 {name}>", "exec"), space)
        return device(space[name])

    compute_k, compute_v = build(_compute_source(0), "compute"), build(_compute_source(1), "compute")
    fix_k, fix_v = build(_fix_source(0), "fix"), build(_fix_source(1), "fix")

    @device
    def tags_v3(smem, src):
        """This lane's 16 tag bits and its plane-3 escape bytes (non-3-bit groups)."""
        lane = lane_id()
        t = u32((lds(smem, u32(src + TAG_OFF + 4 * (lane >> 1))) >> (16 * (lane & 1))) & 0xFFFF)
        return t, i32(popc((t | (t >> 1)) & 0x5555))

    @device
    def escapes_v3(smem, src, t, cnt, off, cap):
        """Plane-3 escape bytes of the lane's groups 0..3 and 4..7 (a 3-bit group's byte is 0): one read
        of the lane's run of bytes, a nibble prefix by one multiply and two byte permutes."""
        nz = u32((t | (t >> 1)) & 0x5555)
        f = u32((nz & 0x1111) | (((nz >> 2) & 0x1111) << 16))          # nibble k: group k non-3-bit
        sel = u32(mul32(f, 0x11111110) | u32(0x77777777 - mul32(f, 7)))  # its byte's index, else 7 (a zero)
        a = u32(src + ESC_OFF + u32(min(off, i32(cap))))
        a0 = u32(a & ~u32(3))
        w0 = lds(smem, a0)
        w1 = lds(smem, u32(a0 + 4))
        w2 = lds(smem, u32(a0 + 8))
        sh = u32(8 * (a & 3))
        x0 = funnel_r(w0, w1, sh)
        x1 = funnel_r(w1, w2, sh)
        x1 = x1 if cnt == 8 else u32(x1 & 0x00FFFFFF)
        return prmt(x0, x1, sel & 0xFFFF), prmt(x0, x1, sel >> 16)

    @device
    def loads_v3(smem, src, smw, cw):
        lane = lane_id()
        for k in range(4):
            w0, w1, w2, w3 = lds4(smem, u32(src + SM_OFF + 16 * (32 * k + lane)))
            smw[4 * k], smw[4 * k + 1], smw[4 * k + 2], smw[4 * k + 3] = w0, w1, w2, w3
        c0, c1, c2, c3 = lds4(smem, u32(src + CODE_OFF + 16 * lane))
        cw[0], cw[1], cw[2], cw[3] = c0, c1, c2, c3
        cw[4] = lds(smem, u32(src + CODE_HI_OFF + 8 * lane))
        cw[5] = lds(smem, u32(src + CODE_HI_OFF + 8 * lane + 4))

    @device
    def raw_fix(smem, src, t, cap, frag, kind, scr):
        """Exponent bits 4..7 of raw groups (rare: a warp-uniform branch, then a scan of raw counts)."""
        raw = u32(t & 0xAAAA)
        if warp_any(raw != 0, scr):
            roff = escape_scan(i32(popc(raw)), scr)
            end = u32(src + ESC_OFF + u32(cap))
            if kind == 0:
                fix_k(smem, end, raw, roff, frag)
            else:
                fix_v(smem, end, raw, roff, frag)

    @device
    def decode_k_v3(smem, src, kbase, t, cnt, off, cap, kf, status, scr):
        """K tile at ``src`` into q.k's A fragments ``kf[32]`` (``kbase``: the K base table)."""
        lane = lane_id()
        smw = kernel_api.local.array(16, uint32)
        cw = kernel_api.local.array(6, uint32)
        bw = kernel_api.local.array(32, uint32)
        loads_v3(smem, src, smw, cw)
        evl, evh = escapes_v3(smem, src, t, cnt, off, cap)
        q = lane & 3
        for g in range(8):
            m = u32((t >> (4 * (g & 3) + 2 * (g >> 2))) & 3)
            b0, b1, b2, b3 = lds4(smem, u32(kbase + m * K_STRIDE + 16 * (4 * (g & 3) + q)))
            bw[4 * g], bw[4 * g + 1], bw[4 * g + 2], bw[4 * g + 3] = b0, b1, b2, b3
        compute_k(smw, cw, bw, evl, evh, kf)
        if rare:
            if t & (t >> 1) & 0x5555:
                kernel_api.atomic.or_(status, 0, 1)
            if off + cnt > cap:                 # (the raw groups' words from the back: checked in the fix-up)
                kernel_api.atomic.or_(status, 0, 2)
            raw_fix(smem, src, t, cap, kf, 0, scr)

    @device
    def decode_v_v3(smem, src, vbase, t, cnt, off, cap, vf, status, scr):
        """V tile at ``src`` into p.v's A fragments ``vf[32]`` (``vbase``: the V base table)."""
        lane = lane_id()
        smw = kernel_api.local.array(16, uint32)
        cw = kernel_api.local.array(6, uint32)
        bw = kernel_api.local.array(32, uint32)
        loads_v3(smem, src, smw, cw)
        evl, evh = escapes_v3(smem, src, t, cnt, off, cap)
        r = lane >> 2
        for j in range(4):
            ga = 4 * (j >> 1) + (j & 1)
            ma = u32((t >> (4 * (ga & 3) + 2 * (ga >> 2))) & 3)
            mb = u32((t >> (4 * ((ga + 2) & 3) + 2 * ((ga + 2) >> 2))) & 3)
            a = u32(vbase + (3 * ma + mb) * V_ROW + 4 * (16 * r + 8 * (j & 1)))
            b0, b1, b2, b3 = lds4(smem, a)
            bw[8 * j], bw[8 * j + 1], bw[8 * j + 2], bw[8 * j + 3] = b0, b1, b2, b3
            b0, b1, b2, b3 = lds4(smem, u32(a + 16))
            bw[8 * j + 4], bw[8 * j + 5], bw[8 * j + 6], bw[8 * j + 7] = b0, b1, b2, b3
        compute_v(smw, cw, bw, evl, evh, vf)
        if rare:
            if t & (t >> 1) & 0x5555:
                kernel_api.atomic.or_(status, 0, 1)
            if off + cnt > cap:                 # (the raw groups' words from the back: checked in the fix-up)
                kernel_api.atomic.or_(status, 0, 2)
            raw_fix(smem, src, t, cap, vf, 1, scr)

    return tags_v3, decode_k_v3, decode_v_v3


# ----------------------------------------------------------------------------------------------
# Harness kernels: one block's K and V tiles staged in shared memory, decoded to the 64 fragment words of a
# lane (v3: in registers; v2: today's decoder, the decoded tile, then ldmatrix), stored to global memory.

CAP = 704                                        # escape capacity of the harness' slots (slot: 3584 bytes)
SLOT = ESC_OFF + CAP
SLOT_WORDS = SLOT // 4


def harness(version: int, null: bool = False, rare: bool = True):
    """``rare=False``: without the raw-group fix-ups and the status checks (the common path's code)."""
    from numba import uint32

    from gaac.cuda.primitives import SCRATCH_WORDS, lane_id, scratch_init, smem_base, u32, warp_sync, ldsm_rows, ldsm_cols
    from gaac.cuda.tile_decoder import BASE_ROWS, base_row_words, decode_tile_fn, escape_scan2, row_bytes

    if version == 3:
        tags_v3, decode_k, decode_v = decoder_v3(rare)
        base_words = (K_BASE_BYTES + V_BASE_BYTES) // 4
        extra = 0
    else:
        _, decode_tags, decode_loads, decode_compute, decode_fix, sizes = decode_tile_fn(C)
        SM_WORDS, CODE_ARRAY, GPL, BASE_WORDS = sizes
        RS = base_row_words(C)
        base_words = 2 * BASE_ROWS * RS + RS     # and a row after them (the reserved tag's)
        extra = T * row_bytes(C) // 4            # the decode tile
        ROWB = row_bytes(C)
    BASE_COPY = -(-base_words // 32)
    SMEM = 2 * SLOT_WORDS + 32 * BASE_COPY + extra

    @cuda.jit
    def kernel(slot_k, slot_v, bases, out, status):
        smem = cuda.shared.array(SMEM, uint32)
        scr = cuda.shared.array(SCRATCH_WORDS, uint32)
        scratch_init(scr)
        lane = lane_id()
        for i in range(SLOT_WORDS // 32):
            smem[u32(32 * i + lane)] = slot_k[u32(32 * i + lane)]
            smem[u32(SLOT_WORDS + 32 * i + lane)] = slot_v[u32(32 * i + lane)]
        for i in range(BASE_COPY):
            smem[u32(2 * SLOT_WORDS + 32 * i + lane)] = bases[u32(32 * i + lane)]
        warp_sync(scr)
        sb = smem_base(smem)
        src_k = u32(sb)
        src_v = u32(sb + 4 * SLOT_WORDS)
        bb = u32(sb + 8 * SLOT_WORDS)
        kf = cuda.local.array(32, uint32)
        vf = cuda.local.array(32, uint32)
        if null:
            for f in range(32):
                kf[f] = smem[u32(32 * f + lane)]
                vf[f] = smem[u32(SLOT_WORDS + 32 * f + lane)]
        elif version == 3:
            tk, ck = tags_v3(smem, src_k)
            tv, cv = tags_v3(smem, src_v)
            ok, ov = escape_scan2(ck, cv, scr)
            decode_k(smem, src_k, bb, tk, ck, ok, CAP, kf, status, scr)
            decode_v(smem, src_v, u32(bb + K_BASE_BYTES), tv, cv, ov, CAP, vf, status, scr)
        else:
            smw = cuda.local.array(SM_WORDS, uint32)
            cw = cuda.local.array(CODE_ARRAY, uint32)
            ev = cuda.local.array(GPL, uint32)
            bw = cuda.local.array(BASE_WORDS, uint32)
            dec = u32(sb + 4 * (SMEM - extra))
            base_k = u32(bb + C * (lane >> 4))
            base_v = u32(base_k + 4 * BASE_ROWS * RS)
            tk, ck = decode_tags(smem, src_k)
            tv, cv = decode_tags(smem, src_v)
            ok, ov = escape_scan2(ck, cv, scr)
            decode_loads(smem, src_k, base_k, 4 * RS, tk, ok, CAP, smw, cw, ev, bw)
            decode_compute(smem, dec, tk, smw, cw, ev, bw)
            if rare:
                decode_fix(smem, src_k, dec, tk, ok, ck, CAP, status)
            warp_sync(scr)
            for kk in range(C // 16):
                a0, a1, a2, a3 = ldsm_rows(smem, u32(dec + 32 * kk), ROWB, scr)
                kf[4 * kk], kf[4 * kk + 1], kf[4 * kk + 2], kf[4 * kk + 3] = a0, a1, a2, a3
            warp_sync(scr)
            decode_loads(smem, src_v, base_v, 4 * RS, tv, ov, CAP, smw, cw, ev, bw)
            decode_compute(smem, dec, tv, smw, cw, ev, bw)
            if rare:
                decode_fix(smem, src_v, dec, tv, ov, cv, CAP, status)
            warp_sync(scr)
            for mt in range(C // 16):
                a0, a1, a2, a3 = ldsm_cols(smem, u32(dec + 32 * mt), ROWB, scr)
                vf[4 * mt], vf[4 * mt + 1], vf[4 * mt + 2], vf[4 * mt + 3] = a0, a1, a2, a3
        for f in range(32):
            out[u32(64 * lane + f)] = kf[f]
            out[u32(64 * lane + 32 + f)] = vf[f]
    return kernel


def signature():
    from numba import types
    a32 = types.Array(types.uint32, 1, "C")
    return (a32, a32, a32, a32, types.Array(types.int32, 1, "C"))


# ----------------------------------------------------------------------------------------------
# Commands.

def random_tile(rng, kind: int, raw_groups: int = 3, wide_share: float = 0.12):
    """A BF16 tile whose exponents mostly sit in the 3-bit window of per-channel bases, some groups in the
    4-bit window, ``raw_groups`` groups far outside (the zero exponent and 255 included)."""
    b3 = rng.integers(100, 130, C)
    b4 = b3 - rng.integers(0, 8, C)
    e = b3[None, :] + rng.integers(0, 8, (T, C))
    wide = rng.random((T, C // 8)) < wide_share
    for t, g in zip(*np.nonzero(wide)):
        c = slice(8 * g, 8 * g + 8)
        e[t, c] = b4[c] + rng.integers(0, 16, 8)
    for _ in range(raw_groups):
        t, g = rng.integers(0, T), rng.integers(0, C // 8)
        e[t, 8 * g:8 * g + 8] = rng.choice([0, 1, 255, 254, 3, 200], 8)
    sm = rng.integers(0, 256, (T, C))
    tile = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    return tile.astype(np.uint16), b3, b4


def check():
    rng = np.random.default_rng(25)
    for trial in range(4):
        wide = 0.97 if trial == 3 else 0.12      # trial 3: lanes with all 8 groups 4-bit
        tk, b3k, b4k = random_tile(rng, 0, raw_groups=3 * trial, wide_share=wide)
        tv, b3v, b4v = random_tile(rng, 1, raw_groups=2 * trial + 1, wide_share=wide)
        # one set of bases per kind: the harness has one table of each
        sk = encode_v3(0, tk, b3k, b4k, CAP)
        sv = encode_v3(1, tv, b3v, b4v, CAP)
        assert sk is not None and sv is not None
        kb, _ = bases_v3(b3k, b4k)
        _, vb = bases_v3(b3v, b4v)
        bases = np.zeros(32 * -(-(len(kb) + len(vb)) // 32), np.uint32)
        bases[:len(kb)] = kb
        bases[len(kb):len(kb) + len(vb)] = vb
        out = np.zeros(32 * 64, np.uint32)
        status = np.zeros(1, np.int32)
        harness(3)[1, 32](np.frombuffer(sk, np.uint32).copy(), np.frombuffer(sv, np.uint32).copy(), bases, out,
                          status)
        out = out.reshape(32, 64)
        ek, ev = expected_fragments(0, tk), expected_fragments(1, tv)
        nk = int((out[:, :32] != ek).sum())
        nv = int((out[:, 32:] != ev).sum())
        raw_k = sum(1 for x in range(T) for g in range(C // 8) if not (
            np.all(((tk[x, 8 * g:8 * g + 8] >> 7) & 0xFF) - b4k[8 * g:8 * g + 8] <= 15)
            and np.all(((tk[x, 8 * g:8 * g + 8] >> 7) & 0xFF) >= b4k[8 * g:8 * g + 8])))
        wide_k = int((np.frombuffer(sk[TAG_OFF:ESC_OFF], np.uint8) != 0).sum())
        print(f"trial {trial}: K tag bytes not 0: {wide_k} of 64, K raw groups {raw_k}: {nk} wrong words of 1024; V: {nv} wrong; status {status[0]}")
        assert nk == 0 and nv == 0 and status[0] == 0


CLASSES = (("shared loads", ("LDS", "LDSM")), ("shared stores", ("STS",)), ("PRMT", ("PRMT",)),
           ("IMAD", ("IMAD", "IMAD.WIDE", "IMAD.SHL", "IMAD.IADD", "IMAD.MOV", "IMAD.HI", "IMAD.U32", "IMAD.X")),
           ("LOP3", ("LOP3",)), ("SHF", ("SHF",)), ("IADD3/LEA", ("IADD3", "LEA", "LEA.HI", "IADD3.X")),
           ("POPC", ("POPC",)), ("SHFL", ("SHFL",)), ("SEL/ISETP/MOV", ("SEL", "ISETP", "MOV", "PLOP3", "VIMNMX")),
           ("control", ("BRA", "BSSY", "BSYNC", "WARPSYNC", "BAR", "EXIT", "NOP", "VOTE", "RET", "CALL")))


def sass():
    """Opcode counts of the harness kernels: full (with the rare paths' code), common (without), and the
    harness alone (null: copies and stores), for v2 (today) and v3."""
    import tempfile
    from collections import Counter

    from benchmarks.kernel_resources import _ptxas_version, _tool, resources

    ptxas, cuobjdump = _tool("ptxas"), _tool("cuobjdump")
    isa = _ptxas_version(ptxas)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for version in (2, 3):
            for label, kw in (("common", dict(rare=False)), ("full", {}), ("null", dict(null=True))):
                res = resources(harness(version, **kw).py_func, signature(), Path(tmp), ptxas, cuobjdump, isa)
                # The decode region: after the harness' last 32-bit copy store to shared memory, less the
                # global stores of the fragments and the kernel's end.
                last = max(i for i, line in enumerate(res["lines"]) if re.match(r"(@!?P\w+\s+)?STS ", line))
                region = [line for line in res["lines"][last + 1:]
                          if not re.match(r"(@!?P\w+\s+)?(STG|EXIT|BRA|NOP)", line)]
                ops = Counter()
                for line in region:
                    m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
                    if m:
                        ops[m.group(1)] += 1
                rows[(version, label)] = (res, ops)
                dump = Path(os.environ.get("V3_SASS_DIR", tmp))
                dump.mkdir(parents=True, exist_ok=True)
                (dump / f"v{version}-{label}.sass").write_text("\n".join(res["lines"]) + "\n")
                mem = {k: v for k, v in sorted(ops.items()) if k.startswith(("LDS", "STS", "LDSM", "SHFL"))}
                print(f"v{version} {label}: {res['sass']} SASS, region {sum(ops.values())}, {res['registers']} registers, "
                      f"spill {res['spill_bytes']}; {mem}", flush=True)

    def cls(ops, names):
        return sum(v for k, v in ops.items() if k.split(".")[0] in {n.split(".")[0] for n in names})

    print()
    head = ["class"] + [f"v{v} {label}" for v in (2, 3) for label in ("common", "full", "null")]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, names in CLASSES:
        print(f"| {name} | " + " | ".join(str(cls(rows[(v, label)][1], names)) for v in (2, 3)
                                          for label in ("common", "full", "null")) + " |")
    rest = {}
    known = {n.split(".")[0] for _, names in CLASSES for n in names}
    for key, (_, ops) in rows.items():
        rest[key] = sum(v for k, v in ops.items() if k.split(".")[0] not in known)
    print("| other | " + " | ".join(str(rest[(v, label)]) for v in (2, 3) for label in ("common", "full", "null")) + " |")
    print("| total | " + " | ".join(str(sum(rows[(v, label)][1].values())) for v in (2, 3)
                                   for label in ("common", "full", "null")) + " |")
    others = Counter()
    for key, (_, ops) in rows.items():
        for k, v in ops.items():
            if k.split(".")[0] not in known:
                others[(key, k)] += v
    print("other opcodes:", sorted({k for (_, k) in others}))


def wavefronts(addrs, width: int) -> int:
    """Shared-memory wavefronts of one warp-wide access (the usual model: 32 lanes a phase for accesses of up
    to 4 bytes, 16 for 8 bytes, 8 for 16 bytes; a phase costs the largest number of distinct 32-bit words
    it touches in one bank, at least 1).  ``ldmatrix`` is counted as 16-byte accesses of the 32 row
    addresses."""
    per = 32 if width <= 4 else 16 if width == 8 else 8
    total = 0
    for p0 in range(0, 32, per):
        banks = {}
        for a in addrs[p0:p0 + per]:
            for w in range(max(1, width // 4)):
                word = a // 4 + w
                banks.setdefault(word % 32, set()).add(word)
        total += max(len(v) for v in banks.values())
    return total


def sample_modes(rng, probs=(0.89, 0.107, 0.003)):
    """Modes of a tile's 256 groups, drawn independently (FORMAT.md 9.3: about 89 % of groups 3-bit; the tile
    decoder: raw groups about 0.3 %), as [lane][local group] of each layout's lane ownership."""
    return rng.choice(3, size=(32, 8), p=probs)


def smem_counts(rng, tiles: int = 400) -> dict:
    """Mean wavefronts per tile, by access, for v2 (today's decoder + decoded tile + ldmatrix) and v3."""
    from collections import defaultdict
    acc = defaultdict(float)
    lanes = range(32)
    ROWB, RS_B = 2 * C + 16, 4 * (C // 2 + 4)
    for _ in range(tiles):
        m = sample_modes(rng)                    # v2: lane t + 16h's groups k = 0..7; v3: the lane's G
        cnt = [(m[l] > 0).sum() for l in lanes]
        cnt2 = [sum((1, 0, 1, 5)[x] if x else 0 for x in m[l]) for l in lanes]
        # -- v2 (today): lane l = t + 16 h owns row t, channels 64 h ..
        t_, h_ = [l & 15 for l in lanes], [l >> 4 for l in lanes]
        for k in range(4):
            c0 = [8 * t_[l] + 4 * h_[l] for l in lanes]
            acc["v2 sign+mantissa LDS.128 x4"] += wavefronts([16 * (c ^ ((c >> 3) & 7)) ^ (16 * k) for c in c0], 16)
        for i in range(3):
            acc["v2 codes LDS.64 x3"] += wavefronts([2048 + 48 * t_[l] + 24 * h_[l] + 8 * i for l in lanes], 8)
        acc["v2 tags LDS.32"] += wavefronts([2816 + 4 * t_[l] for l in lanes], 4)
        order = sorted(lanes, key=scan_order)
        off, run = {}, 0
        for l in order:
            off[l] = run
            run += cnt2[l]
        pos = {l: off[l] for l in lanes}
        for k in range(8):
            acc["v2 escapes LDS.U8 x8"] += wavefronts([2880 + pos[l] for l in lanes], 1)
            for l in lanes:
                pos[l] += (0, 1, 5)[m[l][k]]
        for k in range(8):
            acc["v2 bases LDS.128 x8"] += wavefronts([128 * h_[l] + m[l][k] * RS_B + 16 * k for l in lanes], 16)
        for k in range(8):
            acc["v2 decoded tile STS.128 x8"] += wavefronts([t_[l] * ROWB + 128 * h_[l] + 16 * k for l in lanes], 16)
        for kk in range(8):
            acc["v2 ldmatrix x8"] += wavefronts([32 * kk + ((l & 7) + 8 * ((l >> 3) & 1)) * ROWB + 16 * (l >> 4)
                                                 for l in lanes], 16)
        # -- v3: lane l = 4 r + q
        for k in range(4):
            acc["v3 sign+mantissa LDS.128 x4"] += wavefronts([16 * (32 * k + l) for l in lanes], 16)
        acc["v3 codes LDS.128 + LDS.64"] += wavefronts([2048 + 16 * l for l in lanes], 16) + \
            wavefronts([2560 + 8 * l for l in lanes], 8)
        acc["v3 tags LDS.32"] += wavefronts([2816 + 4 * (l >> 1) for l in lanes], 4)
        off, run = {}, 0
        for l in order:
            off[l] = run
            run += cnt[l]
        for w in range(3):
            acc["v3 escapes LDS.32 x3"] += wavefronts([2880 + ((off[l]) & ~3) + 4 * w for l in lanes], 4)
        for g in range(8):
            q_ = [l & 3 for l in lanes]
            acc["v3 K bases LDS.128 x8 (rows as today, 272 B)"] += wavefronts(
                [m[l][g] * 272 + 4 * (16 * q_[l] + 4 * (g & 3)) for l in lanes], 16)
            acc["v3 K bases LDS.128 x8 (chunk 4 gg + q, rows 320 B)"] += wavefronts(
                [m[l][g] * K_STRIDE + 16 * (4 * (g & 3) + q_[l]) for l in lanes], 16)
        for j in range(4):
            ga = 4 * (j >> 1) + (j & 1)
            for half in range(2):
                acc["v3 V bases LDS.128 x8 (9 rows, 528 B)"] += wavefronts(
                    [(3 * m[l][ga] + m[l][ga + 2]) * V_ROW + 4 * (16 * (l >> 2) + 8 * (j & 1)) + 16 * half
                     for l in lanes], 16)
    return {k: v / tiles for k, v in acc.items()}


def smem():
    rng = np.random.default_rng(25)
    counts = smem_counts(rng)
    for version in ("v2", "v3"):
        print(f"| {version} access | wavefronts a tile |")
        print("|---|---|")
        for k, v in counts.items():
            if k.startswith(version):
                print(f"| {k[3:]} | {v:.1f} |")
        print()
    v2 = 2 * sum(v for k, v in counts.items() if k.startswith("v2"))
    common = sum(v for k, v in counts.items() if k.startswith("v3") and "bases" not in k)
    v3 = 2 * common + counts["v3 K bases LDS.128 x8 (chunk 4 gg + q, rows 320 B)"] + \
        counts["v3 V bases LDS.128 x8 (9 rows, 528 B)"]
    print(f"a block (K + V tiles, the copies excluded): v2 {v2:.1f}, v3 {v3:.1f} (K bases swizzled)")


if __name__ == "__main__":
    {"check": check, "sass": sass, "smem": smem}[sys.argv[1]]()
