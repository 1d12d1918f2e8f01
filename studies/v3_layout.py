"""An offline study of a version-3 in-tile layout: a slot whose bytes are ordered so that
the attention kernel's decoder builds the ``mma.sync m16n8k16`` A fragments of K and V in registers, with no
decoded BF16 tile and no ``ldmatrix``.  Nothing here ships; benchmarks/results/v3-layout-offline.md has the results.

    python studies/v3_layout.py check       # simulator (NUMBA_ENABLE_CUDASIM=1): v3 and v3r decodes == the tile
    python studies/v3_layout.py sass        # SASS opcode classes per block (K+V), v2 (today) and v3
    python studies/v3_layout.py smem        # shared-memory wavefronts per tile from the address patterns
    python studies/v3_layout.py sass-loop   # registers, spills and a pass's SASS of the loop harness' variants
    python studies/v3_layout.py gpu --out DIR     # device: bit-exact check, then decode throughput of v2 and v3
                                                     # (CUDA events; ncu counts if ncu is there): DIR/v3-gpu.md, .json
    python studies/v3_layout.py gpu --sim-check   # simulator: the loop kernels on 2 blocks, reps 1 and 3

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
* version "3r" (``encode_v3(..., raw_layout="lane")``, harness version "3r"): the same slot but for the escapes:
  a lane's run is its plane-3 bytes, then one unaligned 4-byte word per raw group (K: G order, nibbles
  ``e0 e2 e4 e6 e1 e3 e5 e7``; V: G = 0, 2, 1, 3, 4, 6, 5, 7, nibble ``i`` = element ``i``); the runs back
  to back in the scan order.  The one escape scan (of the runs' bytes) places them: no vote, no second scan.
  Same bytes again.  v3-layout-offline.md section 7.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if sys.argv[1:2] == ["check"] or (sys.argv[1:2] == ["gpu"] and "--sim-check" in sys.argv):
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


def raw_order(kind: int) -> tuple[int, ...]:
    """raw_layout="lane": the order of a lane's raw words in its run (the order its fix-up visits them)."""
    return tuple(range(8)) if kind == 0 else (0, 2, 1, 3, 4, 6, 5, 7)


def raw_nibble(kind: int, i: int) -> int:
    """raw_layout="lane": the nibble of a raw word that holds exponent bits 4..7 of the group's element ``i``
    (K: elements 0, 2, 4, 6 in nibbles 0..3 and 1, 3, 5, 7 in nibbles 4..7, so that pair ``p``'s two nibbles
    sit 16 bits apart at bits ``4p``: one shift and one masked OR place them; V: nibble ``i``)."""
    return (i >> 1) + 4 * (i & 1) if kind == 0 else i


def encode_v3(kind: int, tile: np.ndarray, b3: np.ndarray, b4: np.ndarray, capacity: int,
              raw_layout: str = "back") -> bytes | None:
    """A [16, 128] uint16 BF16 tile as a v3 slot (None on slot overflow), canonical modes (FORMAT.md 5.2).

    ``raw_layout="back"``: planes 4..7 of the raw groups as aligned words from the back of the escape area
    (the module docstring).  ``"lane"``: in the lane's own escape run, right after its plane-3 bytes: lane
    ``l``'s run = its plane-3 bytes (G order), then one 4-byte word per raw group (unaligned, in
    :func:`raw_order`, nibbles as :func:`raw_nibble`); runs back to back in the scan order from the front of
    the escape area.  The same bytes as "back" (and v2): (non-3-bit groups) + 4 x (raw groups)."""
    assert raw_layout in ("back", "lane")
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
    if raw_layout == "lane":
        run = bytearray()
        for lane in sorted(range(32), key=scan_order):
            for g in range(8):                  # plane-3 bytes in G order
                if modes[lane, g] == 0:
                    continue
                t, c0 = group_of(kind, lane, g)
                run.append(sum(((code(t, c0 + i, lane, g) >> 3) & 1) << i for i in range(8)))
            for g in raw_order(kind):           # then the raw groups' words
                if modes[lane, g] == 2:
                    t, c0 = group_of(kind, lane, g)
                    word = sum(((code(t, c0 + i, lane, g) >> 4) & 0xF) << (4 * raw_nibble(kind, i))
                               for i in range(8))
                    run += word.to_bytes(4, "little")
        if len(run) > capacity:
            return None
        slot[ESC_OFF:ESC_OFF + len(run)] = bytes(run)
        return bytes(slot)
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


def block_bases_v3(b3k, b4k, b3v, b4v) -> np.ndarray:
    """The harness' v3 base words of a block: K's table (of the K tile's bases), V's (of the V tile's), zeros to
    a multiple of 32 words (the harness copies 32 words a step)."""
    kb, _ = bases_v3(b3k, b4k)
    _, vb = bases_v3(b3v, b4v)
    bases = np.zeros(32 * -(-(len(kb) + len(vb)) // 32), np.uint32)
    bases[:len(kb)] = kb
    bases[len(kb):len(kb) + len(vb)] = vb
    return bases


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


def bit_of(g: int) -> int:
    """The high bit of local group ``g``'s tag in a lane's 16 tag bits (set: a raw group)."""
    return 4 * (g & 3) + 2 * (g >> 2) + 1


def _fix_source(kind: int) -> str:
    """Straight-line source of the raw groups' fix-up: ``fix(smem, end, raw, roff, frag)`` (``end``: the escape
    area's end; ``roff``: the raw groups of the lanes before this one).  A raw group's extra word holds exponent
    bits 4..7 of its element ``i`` in nibble ``i``."""
    def word_of(g: int) -> str:
        return f"lds(smem, u32(end - u32(4 * (roff + popc(raw & {(1 << bit_of(g)) - 1}) + 1))))"

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


def _fix_lane_source(kind: int) -> str:
    """raw_layout="lane": straight-line source of the raw groups' fix-up, ``fix(smem, pa, sh, raw, frag)``
    (``pa``: the aligned address at or before the lane's first raw word, ``sh``: 8 x its misalignment; a
    lane's raw words are consecutive, so ``sh`` holds for all of them).  K: a body per group, entered where its
    raw bit is set: the word (2 LDS and a funnel shift), then a shift and a masked OR per fragment word.  V: a
    body per pair of groups (``G``, ``G + 2``: the lo and hi halves of the same 8 fragment words): 3 LDS, then
    a PRMT per 2 fragment words and a shift and a masked OR per fragment word."""
    def shifted(w: str, s: int) -> str:                  # a funnel shift for s < 0 (one SHF)
        return f"u32({w} << {s})" if s >= 0 else f"funnel_r({w}, {w}, {-s})"

    lines = ["def fix(smem, pa, sh, raw, frag):"]
    if kind == 0:
        for g in raw_order(0):
            lines.append(f"    if raw & {1 << bit_of(g)}:")
            lines.append("        w = funnel_r(lds(smem, pa), lds(smem, u32(pa + 4)), sh)")
            lines.append("        pa = u32(pa + 4)")
            for p in range(4):
                f = 4 * (2 * (g & 3) + p // 2) + 2 * (p % 2) + (g >> 2)
                lines.append(f"        frag[{f}] = u32(frag[{f}] | u32({shifted('w', 11 - 4 * p)} & 0x78007800))")
    else:
        for j in range(4):
            ga = 4 * (j >> 1) + (j & 1)
            gb = ga + 2
            lines.append(f"    if raw & {(1 << bit_of(ga)) | (1 << bit_of(gb))}:")
            lines.append(f"        ra = u32((raw >> {bit_of(ga)}) & 1)")
            lines.append(f"        rb = u32((raw >> {bit_of(gb)}) & 1)")
            lines.append("        l0 = lds(smem, pa)")
            lines.append("        l1 = lds(smem, u32(pa + 4))")
            lines.append("        l2 = lds(smem, u32(pa + 8))")
            lines.append("        w0 = funnel_r(l0, l1, sh)")
            lines.append("        w1 = funnel_r(l1, l2, sh)")
            lines.append("        wa = w0 if ra else u32(0)")
            lines.append("        wb = (w1 if ra else w0) if rb else u32(0)")
            lines.append("        pa = u32(pa + 4 * (ra + rb))")
            for k in range(4):
                lines.append(f"        x = prmt(wa, wb, {k | k << 4 | (4 + k) << 8 | (4 + k) << 12})")
                for h in range(2):
                    f = 4 * (2 * k + h) + j
                    lines.append(f"        frag[{f}] = u32(frag[{f}] | u32(u32(x << {11 - 4 * h}) & 0x78007800))")
    return "\n".join(lines) + "\n"


def decoder_v3(rare: bool = True, raw_layout: str = "back"):
    """The v3 device functions ``(tags, decode_k, decode_v)``.  ``raw_layout`` as :func:`encode_v3`: with
    "lane", ``tags`` also returns the lane's escape run (plane-3 bytes + 4 per raw group: what the caller's
    scan sums), and the rare code (status checks and the fix-up) is one branch per lane at the end of each
    decode, entered where the lane has a raw (or reserved) tag or its run overflows; no vote, no second scan."""
    from numba import uint32

    from gaac.cuda import primitives as P
    from gaac.cuda.primitives import (device, escape_scan, funnel_r, i32, kernel_api, lane_id, lds, lds4, mul32, popc,
                                      prmt, u32, warp_any)

    def build(source: str, name: str):
        space = {"u32": u32, "mul32": mul32, "prmt0": P.prmt0, "lds": lds, "popc": popc}
        exec(compile(source, f"<v3 {name}>", "exec"), space)
        return device(space[name])

    compute_k, compute_v = build(_compute_source(0), "compute"), build(_compute_source(1), "compute")
    if raw_layout == "lane":
        space = {"u32": u32, "lds": lds, "funnel_r": funnel_r, "prmt": prmt}
        for kind in (0, 1):
            exec(compile(_fix_lane_source(kind), f"<v3 lane fix {kind}>", "exec"), space)
            space[f"fix{kind}"] = device(space.pop("fix"))
        fix_k, fix_v = space["fix0"], space["fix1"]
    else:
        fix_k, fix_v = build(_fix_source(0), "fix"), build(_fix_source(1), "fix")

    @device
    def tags_v3(smem, src):
        """This lane's 16 tag bits and its plane-3 escape bytes (non-3-bit groups)."""
        lane = lane_id()
        t = u32((lds(smem, u32(src + TAG_OFF + 4 * (lane >> 1))) >> (16 * (lane & 1))) & 0xFFFF)
        return t, i32(popc((t | (t >> 1)) & 0x5555))

    @device
    def tags_lane(smem, src):
        """raw_layout="lane": this lane's tag bits, plane-3 bytes and escape run (+ 4 bytes a raw group)."""
        t, cnt = tags_v3(smem, src)
        return t, cnt, i32(cnt + 4 * popc(t & 0xAAAA))

    @device
    def rare_lane(smem, src, t, cnt, off, cap, frag, kind, status):
        """raw_layout="lane": a lane's rare code, entered where its tags hold a raw or reserved tag or its
        run overflows: the status checks, then its raw words, read from its own run, into the fragments."""
        raw = u32(t & 0xAAAA)
        over = u32(i32(cap - (off + cnt + 4 * popc(raw))) >> 31)          # all ones if the run overflows
        bad = u32(u32(t & (t >> 1) & 0x5555) | u32(over & 0x10000))
        if bad:                                 # one branch for both status bits
            kernel_api.atomic.or_(status, 0, i32(1 if bad & 0x5555 else 0) | i32(2 if bad >> 16 else 0))
        p = u32(src + ESC_OFF + u32(min(i32(off + cnt), i32(cap))))
        pa = u32(p & ~u32(3))
        sh = u32(8 * (p & 3))
        if kind == 0:
            fix_k(smem, pa, sh, raw, frag)
        else:
            fix_v(smem, pa, sh, raw, frag)

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
        if rare and raw_layout == "lane":
            if (t & 0xAAAA) != 0 or off + cnt > cap:
                rare_lane(smem, src, t, cnt, off, cap, kf, 0, status)
        elif rare:
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
        if rare and raw_layout == "lane":
            if (t & 0xAAAA) != 0 or off + cnt > cap:
                rare_lane(smem, src, t, cnt, off, cap, vf, 1, status)
        elif rare:
            if t & (t >> 1) & 0x5555:
                kernel_api.atomic.or_(status, 0, 1)
            if off + cnt > cap:                 # (the raw groups' words from the back: checked in the fix-up)
                kernel_api.atomic.or_(status, 0, 2)
            raw_fix(smem, src, t, cap, vf, 1, scr)

    return (tags_lane if raw_layout == "lane" else tags_v3), decode_k_v3, decode_v_v3


# ----------------------------------------------------------------------------------------------
# Harness kernels: one block's K and V tiles staged in shared memory, decoded to the 64 fragment words of a
# lane (v3: in registers; v2: today's decoder, the decoded tile, then ldmatrix), stored to global memory.

CAP = 704                                        # escape capacity of the harness' slots (slot: 3584 bytes)
SLOT = ESC_OFF + CAP
SLOT_WORDS = SLOT // 4


def harness(version, null: bool = False, rare: bool = True, loop: bool = False):
    """``version``: 2 (today's decoder), 3 (v3, raw words from the back of the escape area) or "3r" (v3 with
    the raw words in the lane's own escape run, :func:`encode_v3`'s ``raw_layout="lane"``).

    ``rare=False``: without the raw-group fix-ups and the status checks (the common path's code).

    ``loop=False``: ``kernel(slot_k, slot_v, bases, out, status)``, one block decoded once.  ``loop=True``: the
    throughput form ``decode_loop(slot_k, slot_v, bases, out, status, pairs, reps)``: block ``b`` stages tile
    pair ``b % pairs`` (the inputs hold ``pairs`` of them back to back), decodes it ``reps`` times and XORs
    each decode's fragment words into registers, stored once at the end (``out``: 64 words a lane, 2048 a
    block); with an odd ``reps`` they equal one decode's.  Its null body reads two 16-byte words of the
    staged K and V slots a pass (with ``lds4``, which is not hoisted) and XORs them in, so that it keeps the
    loop and the accumulation of the decoders' loops."""
    from numba import uint32

    from gaac.cuda.primitives import (SCRATCH_WORDS, device, kernel_api, lane_id, lds4, scratch_init, smem_base, u32,
                                      warp_sync, ldsm_rows, ldsm_cols)
    from gaac.cuda.tile_decoder import BASE_ROWS, base_row_words, decode_tile_fn, escape_scan2, row_bytes

    if version in (3, "3r"):
        tags_v3, decode_k, decode_v = decoder_v3(rare, "lane" if version == "3r" else "back")
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

    @device
    def decode_block(smem, sb, lane, kf, vf, status, scr):
        """The staged K and V tiles (slots at ``sb``, then the bases) to lane ``lane``'s fragment words."""
        src_k = u32(sb)
        src_v = u32(sb + 4 * SLOT_WORDS)
        bb = u32(sb + 8 * SLOT_WORDS)
        if version == "3r":
            tk, ck, rk = tags_v3(smem, src_k)
            tv, cv, rv = tags_v3(smem, src_v)
            ok, ov = escape_scan2(rk, rv, scr)             # the runs: plane-3 bytes and raw words
            decode_k(smem, src_k, bb, tk, ck, ok, CAP, kf, status, scr)
            decode_v(smem, src_v, u32(bb + K_BASE_BYTES), tv, cv, ov, CAP, vf, status, scr)
        elif version == 3:
            tk, ck = tags_v3(smem, src_k)
            tv, cv = tags_v3(smem, src_v)
            ok, ov = escape_scan2(ck, cv, scr)
            decode_k(smem, src_k, bb, tk, ck, ok, CAP, kf, status, scr)
            decode_v(smem, src_v, u32(bb + K_BASE_BYTES), tv, cv, ov, CAP, vf, status, scr)
        else:
            smw = kernel_api.local.array(SM_WORDS, uint32)
            cw = kernel_api.local.array(CODE_ARRAY, uint32)
            ev = kernel_api.local.array(GPL, uint32)
            bw = kernel_api.local.array(BASE_WORDS, uint32)
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

    if loop:
        @cuda.jit
        def decode_loop(slot_k, slot_v, bases, out, status, pairs, reps):
            smem = cuda.shared.array(SMEM, uint32)
            scr = cuda.shared.array(SCRATCH_WORDS, uint32)
            scratch_init(scr)
            lane = lane_id()
            blk = u32(cuda.blockIdx.x)
            pair = u32(blk % u32(pairs))
            s0 = u32(pair * SLOT_WORDS)
            b0 = u32(pair * (32 * BASE_COPY))
            for i in range(SLOT_WORDS // 32):
                smem[u32(32 * i + lane)] = slot_k[u32(s0 + 32 * i + lane)]
                smem[u32(SLOT_WORDS + 32 * i + lane)] = slot_v[u32(s0 + 32 * i + lane)]
            for i in range(BASE_COPY):
                smem[u32(2 * SLOT_WORDS + 32 * i + lane)] = bases[u32(b0 + 32 * i + lane)]
            warp_sync(scr)
            sb = smem_base(smem)
            kf = cuda.local.array(32, uint32)
            vf = cuda.local.array(32, uint32)
            ak = cuda.local.array(32, uint32)
            av = cuda.local.array(32, uint32)
            for f in range(32):
                ak[f] = u32(0)
                av[f] = u32(0)
            for _ in range(reps):
                if null:
                    k0, k1, k2, k3 = lds4(smem, u32(sb + 16 * lane))
                    v0, v1, v2, v3 = lds4(smem, u32(sb + 4 * SLOT_WORDS + 16 * lane))
                    for f in range(0, 32, 4):
                        kf[f], kf[f + 1], kf[f + 2], kf[f + 3] = k0, k1, k2, k3
                        vf[f], vf[f + 1], vf[f + 2], vf[f + 3] = v0, v1, v2, v3
                else:
                    decode_block(smem, sb, lane, kf, vf, status, scr)
                for f in range(32):
                    ak[f] = u32(ak[f] ^ kf[f])
                    av[f] = u32(av[f] ^ vf[f])
                if version == 2 and not null:
                    warp_sync(scr)              # the next pass's K decode overwrites the decode tile
            o = u32(2048 * blk + 64 * lane)
            for f in range(32):
                out[u32(o + f)] = ak[f]
                out[u32(o + 32 + f)] = av[f]
        return decode_loop

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
        kf = cuda.local.array(32, uint32)
        vf = cuda.local.array(32, uint32)
        if null:
            for f in range(32):
                kf[f] = smem[u32(32 * f + lane)]
                vf[f] = smem[u32(SLOT_WORDS + 32 * f + lane)]
        else:
            decode_block(smem, sb, lane, kf, vf, status, scr)
        for f in range(32):
            out[u32(64 * lane + f)] = kf[f]
            out[u32(64 * lane + 32 + f)] = vf[f]
    return kernel


def signature(loop: bool = False):
    from numba import types
    a32 = types.Array(types.uint32, 1, "C")
    return (a32, a32, a32, a32, types.Array(types.int32, 1, "C")) + ((types.int32, types.int32) if loop else ())


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
        bases = block_bases_v3(b3k, b4k, b3v, b4v)
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
    check_lane()


def escape_bytes(kind: int, tile, b3, b4) -> int:
    m = lane_modes(kind, tile, b3, b4)
    return int((m > 0).sum() + 4 * (m == 2).sum())


def tile_with_escape_bytes(rng, kind: int, target: int):
    """A tile of :func:`random_tile` with raw groups and 4-bit groups added until its escapes take exactly
    ``target`` bytes (many raw groups: lanes with several)."""
    tile, b3, b4 = random_tile(rng, kind, raw_groups=0)
    tile = tile.astype(np.int64)

    def set_group(t, g, exps):
        c = slice(8 * g, 8 * g + 8)
        tile[t, c] = (tile[t, c] & 0x807F) | (np.asarray(exps) << 7)

    while True:
        m = lane_modes(kind, tile.astype(np.uint16), b3, b4)
        left = target - int((m > 0).sum() + 4 * (m == 2).sum())
        if left == 0:
            return tile.astype(np.uint16), b3, b4
        assert left > 0
        want = 0 if left > 12 or left < 4 else 1            # turn a 3-bit (+5) or a 4-bit (+4) group raw,
        if left < 4:                                         # or a 3-bit group 4-bit (+1)
            want = 2
        lanes, gs = np.nonzero(m == (1 if want == 1 else 0))
        k = rng.integers(len(lanes))
        t, c0 = group_of(kind, int(lanes[k]), int(gs[k]))
        g = c0 // 8
        if want == 2:
            e = b3[c0:c0 + 8] + rng.integers(0, 8, 8)
            j = int(rng.integers(8))
            e[j] = b4[c0 + j] + 15                             # outside the 3-bit window, inside the 4-bit one
        else:
            e = rng.choice([0, 1, 255, 254, 3, 200], 8)
            e[0] = 255
        set_group(t, g, e)


def run_block(version, sk: bytes, sv: bytes, bases) -> tuple[np.ndarray, int]:
    out = np.zeros(32 * 64, np.uint32)
    status = np.zeros(1, np.int32)
    harness(version)[1, 32](np.frombuffer(sk, np.uint32).copy(), np.frombuffer(sv, np.uint32).copy(), bases, out,
                            status)
    return out.reshape(32, 64), int(status[0])


def check_lane():
    """raw_layout="lane" (version "3r"): the decode of K and V tiles bit for bit, raw-free and raw-heavy
    tiles, lanes with all 8 groups raw, tiles whose escapes fill the capacity exactly, and the status bit of a
    slot whose escapes overflow it."""
    rng = np.random.default_rng(26)
    cases = []
    for trial in range(4):
        wide = 0.97 if trial == 3 else 0.12
        cases.append((f"trial {trial}", random_tile(rng, 0, raw_groups=3 * trial, wide_share=wide),
                      random_tile(rng, 1, raw_groups=2 * trial + 1, wide_share=wide)))
    cases.append(("no raw group", random_tile(rng, 0, raw_groups=0), random_tile(rng, 1, raw_groups=0)))
    cases.append(("40 / 30 planted raw groups", random_tile(rng, 0, raw_groups=40), random_tile(rng, 1, raw_groups=30)))
    full = []
    for kind in (0, 1):                         # lanes 0, 5, 18, 31: all 8 groups raw; lane 9: groups 0, 3, 6
        tile, b3, b4 = random_tile(rng, kind, raw_groups=2)
        for lane, gs in ((0, range(8)), (5, range(8)), (18, range(8)), (31, range(8)), (9, (0, 3, 6))):
            for g in gs:
                t, c0 = group_of(kind, lane, g)
                tile[t, c0:c0 + 8] = (tile[t, c0:c0 + 8] & 0x807F) | (np.array([255, 0, 1, 254, 3, 200, 128, 7]) << 7)
        full.append((tile, b3, b4))
    cases.append(("lanes with all 8 groups raw", *full))
    cases.append((f"escapes of exactly {CAP} bytes", tile_with_escape_bytes(rng, 0, CAP),
                  tile_with_escape_bytes(rng, 1, CAP)))
    for name, (tk, b3k, b4k), (tv, b3v, b4v) in cases:
        sk, sv = encode_v3(0, tk, b3k, b4k, CAP, "lane"), encode_v3(1, tv, b3v, b4v, CAP, "lane")
        assert sk is not None and sv is not None, name
        assert len(sk) == len(encode_v3(0, tk, b3k, b4k, CAP)), name
        out, status = run_block("3r", sk, sv, block_bases_v3(b3k, b4k, b3v, b4v))
        nk = int((out[:, :32] != expected_fragments(0, tk)).sum())
        nv = int((out[:, 32:] != expected_fragments(1, tv)).sum())
        mk, mv = lane_modes(0, tk, b3k, b4k), lane_modes(1, tv, b3v, b4v)
        print(f"3r {name}: K raw groups {int((mk == 2).sum())} (most a lane {int((mk == 2).sum(1).max())}), "
              f"escapes {escape_bytes(0, tk, b3k, b4k)} bytes: {nk} wrong words of 1024; V raw groups "
              f"{int((mv == 2).sum())} (most a lane {int((mv == 2).sum(1).max())}), escapes "
              f"{escape_bytes(1, tv, b3v, b4v)} bytes: {nv} wrong; status {status}")
        assert nk == 0 and nv == 0 and status == 0, name
    # one byte over: both layouts refuse it; written with room to spare and cut to the slot, the decoder flags it
    for kind in (0, 1):
        tile, b3, b4 = tile_with_escape_bytes(rng, kind, CAP + 1)
        assert encode_v3(kind, tile, b3, b4, CAP, "lane") is None and encode_v3(kind, tile, b3, b4, CAP) is None
        cut = encode_v3(kind, tile, b3, b4, CAP + 8, "lane")[:SLOT]
        other, ob3, ob4 = random_tile(rng, 1 - kind, raw_groups=1)
        good = encode_v3(1 - kind, other, ob3, ob4, CAP, "lane")
        slots = (cut, good) if kind == 0 else (good, cut)
        bb = block_bases_v3(b3, b4, ob3, ob4) if kind == 0 else block_bases_v3(ob3, ob4, b3, b4)
        _, status = run_block("3r", *slots, bb)
        print(f"3r {'KV'[kind]} escapes of {CAP + 1} bytes: the encoders refuse the slot; cut to it, the decoder's "
              f"status {status}")
        assert status == 2


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

    # v3r (raw words in the lane's run): a second table, so that the one above stays as it was
    with tempfile.TemporaryDirectory() as tmp:
        r3 = {}
        for label, kw in (("common", dict(rare=False)), ("full", {})):
            res = resources(harness("3r", **kw).py_func, signature(), Path(tmp), ptxas, cuobjdump, isa)
            last = max(i for i, line in enumerate(res["lines"]) if re.match(r"(@!?P\w+\s+)?STS ", line))
            ops = Counter()
            for line in res["lines"][last + 1:]:
                if re.match(r"(@!?P\w+\s+)?(STG|EXIT|BRA|NOP)", line):
                    continue
                m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
                if m:
                    ops[m.group(1)] += 1
            r3[label] = (res, ops)
            print(f"v3r {label}: {res['sass']} SASS, region {sum(ops.values())}, {res['registers']} registers, "
                  f"spill {res['spill_bytes']}", flush=True)
    print()
    print("| class | v3 common | v3 full | v3r common | v3r full |")
    print("|---|---|---|---|---|")
    for name, names in CLASSES:
        print(f"| {name} | {cls(rows[(3, 'common')][1], names)} | {cls(rows[(3, 'full')][1], names)} | "
              f"{cls(r3['common'][1], names)} | {cls(r3['full'][1], names)} |")
    print(f"| total | {sum(rows[(3, 'common')][1].values())} | {sum(rows[(3, 'full')][1].values())} | "
          f"{sum(r3['common'][1].values())} | {sum(r3['full'][1].values())} |")


def lane_modes(kind: int, tile: np.ndarray, b3: np.ndarray, b4: np.ndarray) -> np.ndarray:
    """[32, 8]: the mode (0: 3-bit, 1: 4-bit, 2: raw) of each lane's local group ``G`` (v3's ownership)."""
    e = (tile.astype(np.int64) >> 7) & 0xFF
    modes = np.zeros((32, 8), np.int64)
    for lane in range(32):
        for g in range(8):
            t, c0 = group_of(kind, lane, g)
            x, lo3, lo4 = e[t, c0:c0 + 8], b3[c0:c0 + 8], b4[c0:c0 + 8]
            modes[lane, g] = 0 if np.all((x >= lo3) & (x <= lo3 + 7)) else \
                1 if np.all((x >= lo4) & (x <= lo4 + 15)) else 2
    return modes


def rare_regions(lines: list[str], addrs: list[int]):
    """The forward conditional branches of a loop body (``lines``, ``addrs``: its SASS), as regions
    ``(first, end)`` of the instructions a taken branch skips, sorted.  Returns ``(status, handlers, other)``:
    the innermost regions holding a global atomic (the status bits: never entered on good slots); per kind, in program
    order, a handler (the outermost region that holds the raw groups' bodies, entered when any lane of the
    warp has a raw group) with its bodies (innermost regions holding an LDS, in program order: K's groups
    ``G = 0..7``, V's pairs ``j = 0..3``, the order of the source); and the rest."""
    at = {a: i for i, a in enumerate(addrs)}
    regions = []
    for i, line in enumerate(lines):
        m = re.match(r"@!?U?P\w+\s+BRA\s+.*?(0x[0-9a-f]+)", line)
        if m and int(m.group(1), 16) > addrs[i] and int(m.group(1), 16) in at:
            regions.append((i + 1, at[int(m.group(1), 16)]))
    regions = sorted(set(regions))

    def holds(r, pat):
        return any(re.match(rf"(?:@!?U?P\w+\s+)?{pat}", x) for x in lines[r[0]:r[1]])

    atomic = r"(REDG|RED|ATOMG|ATOM)\b"
    status = [r for r in regions if holds(r, atomic) and
              not any(o != r and r[0] <= o[0] and o[1] <= r[1] and holds(o, atomic) for o in regions)]
    leaves = [r for r in regions if r not in status and holds(r, r"LDS\b") and
              not any(o != r and r[0] <= o[0] and o[1] <= r[1] and holds(o, r"LDS\b") for o in regions)]
    outer = [r for r in regions if r not in status and any(r[0] <= b[0] and b[1] <= r[1] and b != r for b in leaves)]
    handlers = [r for r in outer if not any(o != r and o[0] <= r[0] and r[1] <= o[1] for o in outer)]
    handlers = [(h, [b for b in leaves if h[0] <= b[0] and b[1] <= h[1]]) for h in handlers]
    other = [r for r in regions if r not in status and r not in leaves and all(r != h for h, _ in handlers)]
    return status, handlers, other


def executed_estimate(lines: list[str], addrs: list[int], tiles) -> tuple[float, str]:
    """Warp instructions a pass executes, averaged over ``tiles`` (a list of (K modes, V modes), [32, 8]
    each): the loop body less what its taken branches skip: the status regions always; a kind's raw
    handler where no lane of the tile has a raw group; a body where no lane has a raw group in its
    position (K: group G; V: G or G + 2 of pair j).  Other forward branches are counted as not taken.
    Returns the mean and a line on the structure found."""
    status, handlers, other = rare_regions(lines, addrs)
    size = lambda r: r[1] - r[0]                  # noqa: E731
    want = (8, 4)
    if len(handlers) != 2 or tuple(len(b) for _, b in handlers) != want:
        return float("nan"), f"structure not recognised: {len(handlers)} handlers, bodies " \
                             f"{[len(b) for _, b in handlers]}"
    total = 0.0
    for modes in tiles:
        n = len(lines) - sum(size(r) for r in status)
        for kind, ((h, bodies), m) in enumerate(zip(handlers, modes)):
            raw = (np.asarray(m) == 2).any(axis=0)                    # [8]: any lane raw in group G
            if not raw.any():
                n -= size(h)
                continue
            for k, b in enumerate(bodies):
                hit = raw[k] if kind == 0 else raw[4 * (k >> 1) + (k & 1)] or raw[4 * (k >> 1) + (k & 1) + 2]
                if not hit:
                    n -= size(b)
        total += n
    info = (f"handlers K {size(handlers[0][0])}, V {size(handlers[1][0])} instructions; bodies K "
            f"{[size(b) for b in handlers[0][1]]}, V {[size(b) for b in handlers[1][1]]}; status regions "
            f"{[size(r) for r in status]}; other forward branches {[size(r) for r in other]} (counted as run)")
    return total / len(tiles), info


def realistic_tiles():
    """Two samples of (K modes, V modes): the gpu command's 8 tile pairs (what the next GPU run times), and
    4000 pairs of independent group modes (89% 3-bit; raw groups 0.3% of K's groups, so that 54% of K tiles
    have one, and 0.087% of V's, 20% of V tiles)."""
    gpu_pairs = [(lane_modes(0, p["k"], p["b3k"], p["b4k"]), lane_modes(1, p["v"], p["b3v"], p["b4v"]))
                 for p in tile_pairs(8)]
    rng = np.random.default_rng(11)
    sampled = [(sample_modes(rng, (0.89, 0.107, 0.003)), sample_modes(rng, (0.89, 0.10913, 0.00087)))
               for _ in range(4000)]
    return {"gpu tile pairs": gpu_pairs, "sampled (54% / 20%)": sampled}


def sass_loop():
    """Every variant of the loop harness (``loop=True``) compiled for sm_90: registers, spills, SASS, and the
    loop's body (the longest backward branch's span: a decode pass, its XOR accumulation and the loop control;
    static, so the rare variants count their rare code too) by opcode class."""
    import tempfile
    from collections import Counter

    from benchmarks.kernel_resources import _ptxas_version, _tool, resources

    ptxas, cuobjdump = _tool("ptxas"), _tool("cuobjdump")
    isa = _ptxas_version(ptxas)
    rows, bodies = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, version, null, rare in LOOP_VARIANTS:
            res = resources(harness(version, null=null, rare=rare, loop=True).py_func, signature(loop=True), Path(tmp),
                            ptxas, cuobjdump, isa)
            lines, addrs = res["lines"], res["addresses"]
            spans = []
            for i, line in enumerate(lines):
                m = re.match(r"(?:@!?U?P\w+\s+)?BRA\s+.*?(0x[0-9a-f]+)", line)
                if m and int(m.group(1), 16) < addrs[i]:
                    spans.append((addrs[i] - int(m.group(1), 16), addrs.index(int(m.group(1), 16)), i))
            _, lo, hi = max(spans)
            ops = Counter()
            for line in lines[lo:hi + 1]:
                m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
                if m:
                    ops[m.group(1)] += 1
            rows[key] = ops
            bodies[key] = (lines[lo:hi + 1], addrs[lo:hi + 1], version, rare, res)
            dump = os.environ.get("V3_SASS_DIR")
            if dump:
                Path(dump).mkdir(parents=True, exist_ok=True)
                (Path(dump) / f"loop-{key}.sass").write_text("\n".join(lines) + "\n")
            mem = {k: v for k, v in sorted(ops.items()) if k.startswith(("LDS", "STS", "LDSM", "SHFL"))}
            print(f"loop {key}: {res['sass']} SASS, loop body {sum(ops.values())}, {res['registers']} registers, "
                  f"spill {res['spill_bytes']}, smem {res['smem']}, {res['warps_per_sm']} warps/SM; {mem}", flush=True)

    def cls(ops, names):
        return sum(v for k, v in ops.items() if k.split(".")[0] in {n.split(".")[0] for n in names})

    known = {n.split(".")[0] for _, names in CLASSES for n in names}
    print()
    print("| loop body (a pass) | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name, names in CLASSES:
        print(f"| {name} | " + " | ".join(str(cls(ops, names)) for ops in rows.values()) + " |")
    print("| other | " + " | ".join(str(sum(v for k, v in ops.items() if k.split(".")[0] not in known))
                                   for ops in rows.values()) + " |")
    print("| total | " + " | ".join(str(sum(ops.values())) for ops in rows.values()) + " |")

    # Executed instructions a pass on realistic tiles (the static body misleads: the rare code runs only where
    # a tile has raw groups).  The common variants run their whole body.
    samples = realistic_tiles()
    print()
    print("Executed warp instructions a pass (estimate from the SASS: the loop body less the regions its taken "
          "branches skip; see executed_estimate):")
    print()
    print("| variant | static body | registers | " + " | ".join(samples) + " |")
    print("|---|---|---|" + "---|" * len(samples))
    for key, (lines, addrs, version, rare, res) in bodies.items():
        if version == 2 and rare:
            cells = ["-"] * len(samples)                 # (its structure is not modelled)
        elif not rare:
            cells = [str(len(lines))] * len(samples)
        else:
            est = [executed_estimate(lines, addrs, tiles) for tiles in samples.values()]
            cells = [f"{e:.1f}" for e, _ in est]
            print(f"({key}: {est[0][1]})")
        print(f"| {key} | {len(lines)} | {res['registers']} | " + " | ".join(cells) + " |")
    for tiles_name, tiles in samples.items():
        k = np.mean([(np.asarray(a) == 2).any() for a, _ in tiles])
        v = np.mean([(np.asarray(b) == 2).any() for _, b in tiles])
        print(f"{tiles_name}: raw groups in {100 * k:.0f}% of K tiles, {100 * v:.0f}% of V tiles; raw groups a "
              f"tile K {np.mean([(np.asarray(a) == 2).sum() for a, _ in tiles]):.2f}, "
              f"V {np.mean([(np.asarray(b) == 2).sum() for _, b in tiles]):.2f}")


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


# ----------------------------------------------------------------------------------------------
# The first GPU run (v3-layout-offline.md section 5, step 1): the throughput form of the harness (``loop=True``)
# on the same tiles in both layouts, checked bit for bit, timed with CUDA events and counted by ncu.

LOOP_VARIANTS = (           # key, version, null, rare
    ("null", 2, True, True),
    ("v2", 2, False, True),
    ("v2-common", 2, False, False),
    ("v3", 3, False, True),
    ("v3-common", 3, False, False),
    ("v3r", "3r", False, True),         # raw words in the lane's own escape run (v3-layout-offline.md section 7)
    ("v3r-common", "3r", False, False),
)
BLOCKS_PER_SM = 12          # one-warp blocks an SM, as the attention kernel runs
NCU_METRICS = ("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "smsp__inst_executed.sum", "gpu__time_duration.sum")
NCU_REPS = 17               # the ncu pass launches reps 1 and NCU_REPS; per decode = the difference / (NCU_REPS - 1)
NCU_TIMEOUT = 60            # seconds for one variant's ncu subprocess
PREDICTED = {               # v3-layout-offline.md: shared wavefronts and SASS of the decode region, a block (K + V)
    "v2-common": (266.0, 785),
    "v3-common": (119.4, 635),
}
LOOP_SASS = {               # ``sass-loop`` here (numba-cuda 0.30.4, ptxas 13.0, sm_90): SASS of a pass of the loop
    "null": 73, "v2": 1023, "v2-common": 824, "v3": 1198, "v3-common": 671, "v3r": 1051, "v3r-common": 677,
}
EXECUTED = {                # ``sass-loop``'s estimate of the instructions a pass executes on the gpu tile pairs
    "v3": 768.9, "v3-common": 671, "v3r": 737.5, "v3r-common": 677,
}
RAW_K = (2, 0, 1, 0, 3, 0, 1, 0)    # raw groups planted in tile pair i's K tile (i % 8): half the K tiles have any
RAW_V = (1, 0, 0, 0, 0, 2, 0, 0)    # and in its V tile: a quarter


def say(*args):
    print(*args, flush=True)


def staged_v2(slot: np.ndarray) -> np.ndarray:
    """A v2 slot (bytes) as today's kernel stages it (:func:`gaac.cuda.tile_decoder.stage_slot_fn`), as uint32
    words: sign+mantissa chunk ``c`` (16 bytes) at chunk ``c ^ ((c >> 3) & 7)``, the rest in place."""
    b = np.asarray(slot, np.uint8)
    out = b.copy()
    c = np.arange(C)                                     # the sign+mantissa section is C chunks
    out[:16 * C].reshape(C, 16)[c ^ ((c >> 3) & 7)] = b[:16 * C].reshape(C, 16)
    return out.view(np.uint32)


def slot_v2(tile: np.ndarray, b3: np.ndarray, b4: np.ndarray) -> np.ndarray:
    """A tile's v2 slot of escape capacity CAP (the reference encoder, :func:`gaac.reference.codec.encode_tiles`),
    staged."""
    from gaac.reference.codec import encode_tiles

    enc = encode_tiles(tile[None], b3[None], b4[None], CAP)
    if not enc.fits[0]:
        raise SystemExit(f"a v2 slot overflows its {CAP} escape bytes ({enc.escape_used[0]} needed)")
    assert enc.slots.shape[1] == SLOT
    return staged_v2(enc.slots[0])


def block_bases_v2(b3k, b4k, b3v, b4v) -> np.ndarray:
    """The harness' v2 base words of a block, as the attention kernel's ``store_bases`` lays them out: the pair
    words of :func:`gaac.attention._pair_base_words` (rows b3, b4, 0), row ``m`` of kind ``kind`` at word
    ``(3 kind + m) * base_row_words(C)``; then the reserved tag's row (zeros) and zeros to a multiple of 32."""
    from gaac.attention import _pair_base_words
    from gaac.cuda.tile_decoder import BASE_ROWS, base_row_words

    rs = base_row_words(C)
    words = np.zeros(32 * -(-(2 * BASE_ROWS * rs + rs) // 32), np.uint32)
    for kind, (b3, b4) in enumerate(((b3k, b4k), (b3v, b4v))):
        rows = _pair_base_words(np.asarray(b3)[None], np.asarray(b4)[None])[0]      # [3, C/2] int32
        for m in range(BASE_ROWS):
            at = (kind * BASE_ROWS + m) * rs
            words[at:at + C // 2] = rows[m].astype(np.int64).astype(np.uint32)
    return words


def v2_fragments(kind: int, tile: np.ndarray) -> np.ndarray:
    """Lane ``l = 4r + q``'s 32 fragment words from today's decoder: step ``s`` (16 channels) of ``ldmatrix.x4``
    (K, ``ldsm_rows``) or ``ldmatrix.x4.trans`` (V, ``ldsm_cols``) of the decoded tile (row = token).  K word
    ``4s + i``: token ``r + 8 (i & 1)``, channels ``16 s + 8 (i >> 1) + 2q`` (lo) and ``+1`` (hi); V word ``4s + i``:
    channel ``16 s + 8 (i & 1) + r`` of tokens ``8 (i >> 1) + 2q`` (lo) and ``+1`` (hi)."""
    t = tile.astype(np.uint32)
    out = np.zeros((32, 32), np.uint32)
    for lane in range(32):
        r, q = lane >> 2, lane & 3
        for s in range(C // 16):
            for i in range(4):
                if kind == 0:
                    tok, ch = r + 8 * (i & 1), 16 * s + 8 * (i >> 1) + 2 * q
                    out[lane, 4 * s + i] = t[tok, ch] | t[tok, ch + 1] << 16
                else:
                    tok, ch = 8 * (i >> 1) + 2 * q, 16 * s + 8 * (i & 1) + r
                    out[lane, 4 * s + i] = t[tok, ch] | t[tok + 1, ch] << 16
    return out


def common_path(tile: np.ndarray, b3: np.ndarray, b4: np.ndarray) -> np.ndarray:
    """The tile that both decoders give without their rare code (``rare=False``): a raw group's exponent bits
    4..7 (BF16 bits 11..14) stay 0, the rest as the tile."""
    from gaac.reference.codec import choose_modes, tile_exponents

    from gaac import layout as L

    modes = choose_modes(tile_exponents(tile[None]), np.asarray(b3)[None], np.asarray(b4)[None])[0]
    raw = np.repeat(modes.reshape(T, C // 8) == L.MODE_RAW, 8, axis=1)
    return np.where(raw, tile & np.uint16(0x87FF), tile).astype(np.uint16)


def tile_pairs(n: int, seed: int = 7) -> list[dict]:
    """``n`` (K, V) tile pairs of :func:`random_tile` (mostly 3-bit, ~11% 4-bit groups), each tile with its own
    bases; pair ``i`` plants ``RAW_K[i % 8]`` and ``RAW_V[i % 8]`` raw groups."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(n):
        tk, b3k, b4k = random_tile(rng, 0, raw_groups=RAW_K[i % 8])
        tv, b3v, b4v = random_tile(rng, 1, raw_groups=RAW_V[i % 8])
        pairs.append(dict(k=tk, b3k=b3k, b4k=b4k, v=tv, b3v=b3v, b4v=b4v))
    return pairs


def loop_inputs(version: int, pairs: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The loop harness' ``slot_k``, ``slot_v`` and ``bases`` of one layout: every pair's, back to back."""
    sk, sv, bs = [], [], []
    for p in pairs:
        if version in (3, "3r"):
            lay = "lane" if version == "3r" else "back"
            k = encode_v3(0, p["k"], p["b3k"], p["b4k"], CAP, lay)
            v = encode_v3(1, p["v"], p["b3v"], p["b4v"], CAP, lay)
            if k is None or v is None:
                raise SystemExit(f"a v3 slot overflows its {CAP} escape bytes")
            sk.append(np.frombuffer(k, np.uint32))
            sv.append(np.frombuffer(v, np.uint32))
            bs.append(block_bases_v3(p["b3k"], p["b4k"], p["b3v"], p["b4v"]))
        else:
            sk.append(slot_v2(p["k"], p["b3k"], p["b4k"]))
            sv.append(slot_v2(p["v"], p["b3v"], p["b4v"]))
            bs.append(block_bases_v2(p["b3k"], p["b4k"], p["b3v"], p["b4v"]))
    return np.concatenate(sk), np.concatenate(sv), np.concatenate(bs)


def loop_expected(version: int, null: bool, rare: bool, pairs: list[dict], slot_k: np.ndarray,
                  slot_v: np.ndarray) -> np.ndarray:
    """``[pairs, 32, 64]``: what a block of each pair stores (lane, K words then V words) after an odd number of
    passes: the fragments of the tiles (of their common-path decode without the rare code) in v3's or
    ldmatrix's lane order; for null, the lane's 16-byte word of each staged slot, 8 times."""
    out = np.zeros((len(pairs), 32, 64), np.uint32)
    for i, p in enumerate(pairs):
        if null:
            for f0, slot in ((0, slot_k), (32, slot_v)):
                words = slot[i * SLOT_WORDS:i * SLOT_WORDS + 128].reshape(32, 4)
                out[i, :, f0:f0 + 32] = np.tile(words, (1, 8))
            continue
        tk, tv = p["k"], p["v"]
        if not rare:
            tk, tv = common_path(tk, p["b3k"], p["b4k"]), common_path(tv, p["b3v"], p["b4v"])
        frag = v2_fragments if version == 2 else expected_fragments
        out[i, :, :32] = frag(0, tk)
        out[i, :, 32:] = frag(1, tv)
    return out


def mismatches(key: str, out: np.ndarray, status: int, expected: np.ndarray, blocks: int) -> str | None:
    """None if every block stored its pair's words and the status word is 0, else what differs."""
    got = out.reshape(blocks, 32, 64)
    want = expected[np.arange(blocks) % len(expected)]
    bad = got != want
    if not bad.any() and status == 0:
        return None
    msg = f"{key}: {int(bad.sum())} wrong words of {bad.size}, status {status}"
    if bad.any():
        b, lane, f = (int(x) for x in np.argwhere(bad)[0])
        msg += (f" (first: block {b}, lane {lane}, {'K' if f < 32 else 'V'} word {f % 32}: "
                f"{int(got[b, lane, f]):#010x}, expected {int(want[b, lane, f]):#010x})")
    return msg


class LoopRun:
    """One variant's loop kernel with its device inputs, launched on ``blocks`` one-warp blocks."""

    def __init__(self, key: str, version: int, null: bool, rare: bool, pairs: list[dict], blocks: int, host=None):
        self.key, self.version, self.null, self.rare, self.blocks = key, version, null, rare, blocks
        self.kernel = harness(version, null=null, rare=rare, loop=True)
        sk, sv, bs = host if host is not None else loop_inputs(version, pairs)
        self.expected = loop_expected(version, null, rare, pairs, sk, sv)
        self.npairs = len(pairs)
        self.args = [cuda.to_device(sk), cuda.to_device(sv), cuda.to_device(bs),
                     cuda.device_array(2048 * blocks, np.uint32), cuda.to_device(np.zeros(1, np.int32))]

    def launch(self, reps: int):
        self.kernel[self.blocks, 32](*self.args, np.int32(self.npairs), np.int32(reps))

    def check(self) -> str | None:
        cuda.synchronize()
        return mismatches(self.key, self.args[3].copy_to_host(), int(self.args[4].copy_to_host()[0]), self.expected,
                          self.blocks)

    def resources(self, sms: int) -> dict:
        """Registers, local memory (spills), static shared memory and resident blocks an SM (occupancy API)."""
        k = self.kernel
        res = {}
        for name, fn in (("registers", "get_regs_per_thread"), ("local_bytes", "get_local_mem_per_thread"),
                         ("shared_bytes", "get_shared_mem_per_block")):
            try:
                v = getattr(k, fn)()
                res[name] = int(next(iter(v.values())) if isinstance(v, dict) else v)
            except Exception as e:          # noqa: BLE001  (a report line, not a failure)
                res[name] = f"? ({type(e).__name__})"
        try:
            res["blocks_per_sm"] = int(next(iter(k.overloads.values())).max_cooperative_grid_blocks(32)) // sms
        except Exception as e:              # noqa: BLE001
            res["blocks_per_sm"] = f"? ({type(e).__name__})"
        return res


def sim_check(args) -> None:
    """The loop kernels of every variant in the simulator: 2 blocks (pairs 0 and 1: raw groups in both kinds,
    and none), reps 1 and 3, against the expected words."""
    pairs = tile_pairs(2)
    host = {v: loop_inputs(v, pairs) for v in (2, 3, "3r")}
    failed = []
    for key, version, null, rare in LOOP_VARIANTS:
        if key not in args.variants:
            continue
        run = LoopRun(key, version, null, rare, pairs, 2, host[version])
        for reps in (1, 3):
            run.args[4] = cuda.to_device(np.zeros(1, np.int32))
            run.launch(reps)
            err = run.check()
            say(f"sim-check {key:9s} reps {reps}: " + (err or "2 blocks x 2048 words as expected, status 0"))
            if err:
                failed.append(err)
    if failed:
        raise SystemExit("sim-check FAILED:\n" + "\n".join(failed))
    say("sim-check: all variants bit-exact")


def find_ncu() -> str | None:
    import glob
    import shutil

    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/usr/local/cuda-*/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def ncu_child(args) -> None:
    """The target of one variant's ncu pass: reps 1, then NCU_REPS, on ``--blocks`` blocks."""
    key, version, null, rare = next(v for v in LOOP_VARIANTS if v[0] == args.ncu_child)
    run = LoopRun(key, version, null, rare, tile_pairs(args.pairs), args.blocks)
    for reps in (1, NCU_REPS):
        run.launch(reps)
    err = run.check()
    say(f"ncu child {key}: launched reps 1 and {NCU_REPS} on {args.blocks} blocks; " + (err or "output as expected"))


def ncu_pass(ncu: str, keys: list[str], args, blocks: int, budget: float) -> dict:
    """Per variant: each metric per block-decode, ``(value at NCU_REPS - value at 1) / (blocks * (NCU_REPS - 1))``
    (the staging and the stores cancel), or ``{"error": ...}``.  One subprocess per variant, NCU_TIMEOUT
    seconds each, none started after ``budget`` seconds."""
    import csv
    import signal
    import subprocess
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    start = time.monotonic()
    results = {}
    for key in keys:
        left = budget - (time.monotonic() - start)
        if left < 15:
            results[key] = {"error": f"skipped: the ncu pass' {budget:.0f} s were spent"}
            say(f"ncu {key}: {results[key]['error']}")
            continue
        cmd = [ncu, "--csv", "--print-units", "base", "--clock-control", "none", "--kernel-name-base", "mangled",
               "--kernel-name", "regex:decode_loop", "--metrics", ",".join(NCU_METRICS),
               sys.executable, str(Path(__file__).resolve()), "gpu", "--ncu-child", key, "--pairs", str(args.pairs),
               "--blocks", str(blocks)]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=min(NCU_TIMEOUT, left))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)          # ncu and its target: the session this call started
            text, _ = proc.communicate()
            results[key] = {"error": f"timed out after {min(NCU_TIMEOUT, left):.0f} s"}
            say(f"ncu {key}: {results[key]['error']}; its last lines:\n" + "\n".join(text.splitlines()[-5:]))
            continue
        rows = [line for line in text.splitlines() if line.startswith('"')]
        per = {}
        try:
            for row in csv.DictReader(rows):
                unit = (row.get("Metric Unit") or "").strip()
                value = float(row["Metric Value"].replace(",", ""))
                scale = {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9,
                         "second": 1e9}.get(unit, 1) if row["Metric Name"].startswith("gpu__time") else 1
                per.setdefault(int(row["ID"]), {})[row["Metric Name"]] = value * scale
        except (KeyError, ValueError) as e:
            per = {}
            say(f"ncu {key}: unreadable CSV ({type(e).__name__}: {e})")
        launches = [per[i] for i in sorted(per)]
        if proc.returncode or len(launches) != 2 or any(set(NCU_METRICS) - set(x) for x in launches):
            results[key] = {"error": f"ncu exit {proc.returncode}, {len(launches)} launches profiled"}
            say(f"ncu {key}: {results[key]['error']}; its last lines:\n" + "\n".join(text.splitlines()[-8:]))
            continue
        one, many = launches
        results[key] = {m: (many[m] - one[m]) / (blocks * (NCU_REPS - 1)) for m in NCU_METRICS}
        results[key].update({f"{m} (reps 1)": one[m] for m in NCU_METRICS})
        say(f"ncu {key} ({time.monotonic() - t0:.0f} s): " + ", ".join(f"{m} {v:.1f}" for m, v in results[key].items()
                                                                      if "reps 1" not in m) + " per block-decode")
    return results


def git_commit() -> str:
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return "unknown (no git metadata)"
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "studies/v3_layout.py"], cwd=root,
                              timeout=10)
        return head.stdout.strip() + (" (studies/v3_layout.py modified)" if diff.returncode else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not run)"


def report(meta: dict, rows: list[dict], ncu: dict | None) -> str:
    """The run as markdown: the setup, then a row per variant."""
    def fmt(x, spec=".1f"):
        return format(x, spec) if isinstance(x, (int, float)) else ("-" if x is None else str(x))

    lines = ["# v3 layout: decode throughput on the GPU (studies/v3_layout.py gpu)", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "Per block-decode = one warp decoding one block's K and V tiles (2 tiles) in the loop harness; "
              "GPU ns = kernel time / (blocks x reps); SM ns = GPU ns x SMs (one SM's time per decode, "
              f"{BLOCKS_PER_SM} warps sharing it). Every pass also XORs 64 fragment words into registers "
              "(64 LOP3) and counts the loop (v2 adds a warp barrier); null is that loop with two LDS.128 "
              "(8 wavefronts) in place of a decode. ncu values: (launch at reps "
              f"{NCU_REPS} - launch at reps 1) / (blocks x {NCU_REPS - 1}). Predicted: v3-layout-offline.md "
              "(model wavefronts; SASS of the decode region, without the loop's XOR and control); offline SASS a pass: "
              "the loop's body as `sass-loop` compiles it here (static: the rare variants count their rare code, "
              "which a pass skips where its tiles have no raw group; the common variants' passes run it all).", ""]
    head = ["variant", "GPU ns / decode", "SM ns / decode", "minus null (SM ns)", "tiles/s", "registers",
            "local bytes", "blocks/SM"]
    if ncu is not None:
        head += ["ncu shared wavefronts", "ncu instructions", "ncu GPU ns"]
    head += ["offline SASS a pass", "predicted wavefronts", "predicted instructions"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    null = next((r for r in rows if r["key"] == "null"), None)
    for r in rows:
        cells = [r["name"], fmt(r["ns_per_decode"], ".3f"), fmt(r["sm_ns_per_decode"]),
                 fmt(r["sm_ns_per_decode"] - null["sm_ns_per_decode"]) if null and r is not null else "-",
                 f"{r['tiles_per_s']:.3e}", fmt(r["registers"], "d"), fmt(r["local_bytes"], "d"),
                 fmt(r["blocks_per_sm"], "d")]
        if ncu is not None:
            n = ncu.get(r["key"], {"error": "not run"})
            if "error" in n:
                cells += [n["error"], "", ""]
            else:
                cells += [fmt(n[NCU_METRICS[0]]), fmt(n[NCU_METRICS[1]]), fmt(n[NCU_METRICS[2]], ".3f")]
        pw, pi = PREDICTED.get(r["key"], (None, None))
        cells += [fmt(LOOP_SASS.get(r["key"]), "d"), fmt(pw), fmt(pi, "d")]
        lines.append("| " + " | ".join(cells) + " |")
    by = {r["key"]: r for r in rows}
    if "v2-common" in by and "v3-common" in by:
        a, b = by["v2-common"], by["v3-common"]
        line = (f"v2 - v3, common path: {a['sm_ns_per_decode'] - b['sm_ns_per_decode']:.1f} SM ns a decode "
                f"(v3/v2 = {b['sm_ns_per_decode'] / a['sm_ns_per_decode']:.3f})")
        if ncu and all("error" not in ncu.get(k, {"error": 1}) for k in ("v2-common", "v3-common")):
            dw = ncu["v2-common"][NCU_METRICS[0]] - ncu["v3-common"][NCU_METRICS[0]]
            di = ncu["v2-common"][NCU_METRICS[1]] - ncu["v3-common"][NCU_METRICS[1]]
            line += f"; {dw:.1f} wavefronts and {di:.1f} instructions fewer (predicted 146.6 and 150)"
        lines += ["", line]
    if "v2" in by and "v3" in by:
        a, b = by["v2"], by["v3"]
        lines += ["", f"v2 - v3, with the rare code (these tiles' raw groups): "
                      f"{a['sm_ns_per_decode'] - b['sm_ns_per_decode']:.1f} SM ns a decode "
                      f"(v3/v2 = {b['sm_ns_per_decode'] / a['sm_ns_per_decode']:.3f})"]
    for x, y, what in (("v2", "v3r", "with the rare code, raw words in the lane run"),
                       ("v3r-common", "v3r", "v3r's rare code on these tiles"),
                       ("v3", "v3r", "the two raw layouts, rare code in")):
        if x in by and y in by:
            a, b = by[x], by[y]
            line = (f"{x} - {y}, {what}: {a['sm_ns_per_decode'] - b['sm_ns_per_decode']:.1f} SM ns a decode "
                    f"({y}/{x} = {b['sm_ns_per_decode'] / a['sm_ns_per_decode']:.3f})")
            if ncu and all("error" not in ncu.get(k, {"error": 1}) for k in (x, y)):
                line += (f"; instructions {ncu[x][NCU_METRICS[1]]:.1f} -> {ncu[y][NCU_METRICS[1]]:.1f} "
                         f"(estimated from the SASS: {EXECUTED.get(x, '-')} -> {EXECUTED.get(y, '-')})")
            lines += ["", line]
    return "\n".join(lines) + "\n"


def gpu(argv: list[str]) -> None:
    """Decode throughput of v2 (today's decoder) and v3 on the device, after a bit-exact check of every variant's
    loop kernel; then, if ncu is there, shared wavefronts, instructions and time per block-decode."""
    import argparse
    import datetime
    import json
    import statistics
    import time

    keys = [v[0] for v in LOOP_VARIANTS]
    ap = argparse.ArgumentParser(prog="v3_layout.py gpu")
    ap.add_argument("--out", type=Path, help="folder for v3-gpu.md and v3-gpu.json")
    ap.add_argument("--reps", type=int, default=1025,
                    help="decodes a block a timed launch (odd: its output is checked)")
    ap.add_argument("--rounds", type=int, default=21, help="timed launches a variant (interleaved; the median is kept)")
    ap.add_argument("--pairs", type=int, default=8, help="distinct (K, V) tile pairs spread over the blocks")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=keys, help=f"comma-separated, of {keys}")
    ap.add_argument("--no-ncu", action="store_true", help="skip the ncu pass")
    ap.add_argument("--ncu-budget", type=float, default=150.0, help="seconds for the whole ncu pass")
    ap.add_argument("--sim-check", action="store_true", help="the loop kernels in the simulator, 2 blocks, no timing")
    ap.add_argument("--ncu-child", choices=keys, help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = set(args.variants) - set(keys)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {keys}")
    if args.reps < 1 or args.reps % 2 == 0:
        ap.error("--reps must be odd (an even number of XORed decodes is 0)")
    if args.sim_check:
        return sim_check(args)
    if args.ncu_child:
        return ncu_child(args)
    if args.out is None:
        ap.error("--out DIR is needed")
    if not cuda.is_available():
        raise SystemExit("no CUDA device (for the simulator check: gpu --sim-check)")
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    sms = int(dev.MULTIPROCESSOR_COUNT)
    blocks = BLOCKS_PER_SM * sms
    import numba
    import numba_cuda
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{name}, {sms} SMs, cc {dev.compute_capability[0]}.{dev.compute_capability[1]}",
        "commit": git_commit(),
        "command": "python " + " ".join(["studies/v3_layout.py", "gpu"] + argv),
        "versions": f"numba {numba.__version__}, numba-cuda {getattr(numba_cuda, '__version__', '?')}, "
                    f"numpy {np.__version__}, Python {sys.version.split()[0]}",
        "launch": f"{blocks} one-warp blocks ({BLOCKS_PER_SM} x {sms} SMs), reps {args.reps} a block, "
                  f"{args.rounds} timed launches a variant (median; interleaved, 2 warm-up launches each)",
        "tiles": f"{args.pairs} (K, V) pairs of random_tile (seed 7), block b decodes pair b % {args.pairs}; "
                 f"raw groups K {[RAW_K[i % 8] for i in range(args.pairs)]}, "
                 f"V {[RAW_V[i % 8] for i in range(args.pairs)]}; escape capacity {CAP} both layouts",
    }
    for k, v in meta.items():
        say(f"{k}: {v}")

    say("encoding the tiles (v2: gaac.reference.codec, staged; v3: encode_v3) ...")
    pairs = tile_pairs(args.pairs)
    host = {v: loop_inputs(v, pairs) for v in sorted({x[1] for x in LOOP_VARIANTS if x[0] in args.variants}, key=str)}
    runs = []
    for key, version, null, rare in LOOP_VARIANTS:
        if key not in args.variants:
            continue
        t0 = time.monotonic()
        run = LoopRun(key, version, null, rare, pairs, blocks, host[version])
        run.launch(3)                                       # compiles, then the check at reps 3
        err = run.check()
        run.res = run.resources(sms)
        say(f"{key}: compiled and launched in {time.monotonic() - t0:.1f} s; {run.res}; check at reps 3: "
            + (err or "bit-exact, status 0"))
        if err:
            raise SystemExit(f"FAILED before timing: {err}")
        runs.append(run)

    say(f"timing: {args.rounds} rounds x {len(runs)} variants ...")
    for run in runs:
        for _ in range(2):
            run.launch(args.reps)
    cuda.synchronize()
    times = {run.key: [] for run in runs}
    for _ in range(args.rounds):
        events = []
        for run in runs:
            e0, e1 = cuda.event(), cuda.event()
            e0.record()
            run.launch(args.reps)
            e1.record()
            events.append((run.key, e0, e1))
        cuda.synchronize()
        for key, e0, e1 in events:
            times[key].append(cuda.event_elapsed_time(e0, e1))
    rows = []
    for run in runs:
        err = run.check()                                   # the last timed launch's output (reps odd)
        if err:
            raise SystemExit(f"FAILED after timing: {err}")
        ms = statistics.median(times[run.key])
        ns = ms * 1e6 / (blocks * args.reps)
        name = ("null (harness only)" if run.null else
                f"v{run.version} ({'today' if run.version == 2 else 'fragments'}"
                f"{', raw words in the lane run' if run.version == '3r' else ''}) rare={run.rare}")
        rows.append(dict(key=run.key, name=name, ms_median=ms, ms_min=min(times[run.key]), ms_max=max(times[run.key]),
                         ns_per_decode=ns, sm_ns_per_decode=ns * sms, tiles_per_s=2e9 / ns, **run.res))
        say(f"{run.key:9s}: {ms:.3f} ms a launch (min {min(times[run.key]):.3f}, max {max(times[run.key]):.3f}); "
            f"{ns:.3f} ns a block-decode, {ns * sms:.1f} SM ns, {2e9 / ns:.3e} tiles/s; output bit-exact")

    def write(ncu):
        (args.out / "v3-gpu.md").write_text(report(meta, rows, ncu))
        (args.out / "v3-gpu.json").write_text(json.dumps(dict(meta=meta, predicted=PREDICTED, variants=rows, ncu=ncu),
                                                         indent=1, default=str) + "\n")
    write(None)
    say(f"wrote {args.out / 'v3-gpu.md'} and v3-gpu.json ({time.monotonic() - t_start:.0f} s so far)")

    ncu = None
    path = find_ncu()
    if args.no_ncu:
        say("ncu pass skipped (--no-ncu)")
    elif path is None:
        say("ncu not found (PATH, /usr/local/cuda/bin): no ncu pass")
    else:
        say(f"ncu pass with {path}: {len(runs)} variants, reps 1 and {NCU_REPS} on {blocks} blocks, "
            f"{NCU_TIMEOUT} s each ...")
        ncu = ncu_pass(path, [run.key for run in runs], args, blocks, args.ncu_budget)
        meta["ncu"] = f"{path}, metrics {', '.join(NCU_METRICS)}, --clock-control none"
        write(ncu)
    text = report(meta, rows, ncu)
    say("\n" + text)
    say(f"wrote {args.out / 'v3-gpu.md'} and v3-gpu.json; {time.monotonic() - t_start:.0f} s in all")


if __name__ == "__main__":
    if sys.argv[1:2] == ["gpu"]:
        gpu(sys.argv[2:])
    else:
        {"check": check, "sass": sass, "smem": smem, "sass-loop": sass_loop}[sys.argv[1]]()
