"""Generate the GAAC-FP8 test vectors in this folder (FORMAT-FP8.md appendix A).

Run from the repository root::

    python format_spec/vectors/fp8/make_fp8_vectors.py            # rewrites format_spec/vectors/fp8/
    python format_spec/vectors/fp8/make_fp8_vectors.py --out DIR  # writes elsewhere

Valid streams are made by :func:`gaac.fp8.encode_fp8_block`; their JSON
records what they must decode to.  Data are built group by group so that each
group needs the mode the vector says (a witness exponent outside the narrower
windows), from the same splitmix64 generator as the BF16 vectors
(format_spec/make_vectors.py), so the bytes never depend on library versions.
Must-reject streams break one rule of FORMAT-FP8.md section 7 each, with the
CRC recomputed (except the CRC vector).  The ``*_real_*`` vectors need the
SmolLM2 dumps in ``../shared/data/kv``; without them the existing files are kept.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from format_spec.make_vectors import Rand, RejectBase  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.calibration import Calibration, fit_windows  # noqa: E402
from gaac.fp8 import calibrate_fp8, decode_fp8_block, encode_bf16_block, encode_fp8_block  # noqa: E402
from gaac.reference.bits import join_elements  # noqa: E402
from gaac.reference.codec import choose_modes, escape_bytes, tile_exponents  # noqa: E402
from gaac.fp8.convert import fp8_values  # noqa: E402
from gaac.layout import (FP8_FORMATS, MODE_NARROW, MODE_RAW, MODE_RESERVED, MODE_SETS, MODE_WIDE,  # noqa: E402
                             ModeSet)
from gaac.tiles import tile_bases, untile  # noqa: E402

KV_DIR = ROOT.parent / "shared" / "data" / "kv"
REAL_DUMP = "smollm2-135m-instruct-q4_1__prose__{}.npy"
REAL_BLOCK = 18


def short(fmt: str) -> str:
    return fmt.removeprefix("fp8_")


def ceil16(n: int) -> int:
    return -(-int(n) // L.SLOT_ALIGN) * L.SLOT_ALIGN


# -- data, group by group -----------------------------------------------------

class TileBuilder:
    """FP8 tiles ``[n, 16, C]`` whose groups are filled one by one with a chosen mode."""

    def __init__(self, modes: ModeSet, bn: np.ndarray, bw: np.ndarray, rand: Rand):
        self.ms, self.bn, self.bw, self.rand = modes, np.asarray(bn, int), np.asarray(bw, int), rand
        n, c = self.bn.shape
        self.e = np.zeros((n, L.BLOCK_TOKENS * c), dtype=np.int64)
        self.sm = np.zeros_like(self.e)

    def group(self, tile: int, g: int, mode: int) -> None:
        ms, r = self.ms, self.rand
        c = self.bn.shape[1]
        chans = [(g * L.GROUP_SIZE + i) % c for i in range(L.GROUP_SIZE)]
        bn, bw = self.bn[tile, chans], self.bw[tile, chans]
        if mode == MODE_NARROW:
            e = [int(b) + r.below(ms.narrow_window) for b in bn]
        elif mode == MODE_WIDE:
            e = [int(b) + r.below(ms.wide_window) for b in bw]
        else:
            e = [r.below(ms.fmt.exponent_values) for _ in range(L.GROUP_SIZE)]
        if mode != MODE_NARROW:                    # one witness that only this mode holds
            i = r.below(L.GROUP_SIZE)
            allowed = [x for x in range(ms.fmt.exponent_values) if not bn[i] <= x < bn[i] + ms.narrow_window
                       and (mode == MODE_WIDE) == (bw[i] <= x < bw[i] + ms.wide_window)]
            e[i] = allowed[r.below(len(allowed))]
        self.e[tile, g * L.GROUP_SIZE:(g + 1) * L.GROUP_SIZE] = e
        self.sm[tile, g * L.GROUP_SIZE:(g + 1) * L.GROUP_SIZE] = [r.below(1 << ms.fmt.sm_bits) for _ in e]

    def scattered(self, tile: int, modes: list[int]) -> None:
        """Give ``modes`` to randomly placed groups of a tile and the narrow mode to the rest.

        What such a vector tests is how many escape bytes a tile needs against its
        capacity; the places are drawn from ``rand`` so that the wider groups spread
        over the tile instead of packing its first rows, and regenerate exactly.
        """
        groups = self.e.shape[1] // L.GROUP_SIZE
        order = sorted(range(groups), key=lambda _: self.rand.below(1 << 30))
        for g, mode in zip(order, modes + [MODE_NARROW] * (groups - len(modes))):
            self.group(tile, g, mode)

    def patterns(self, tile: int, g: int, fp8: list[int]) -> None:
        """Put 8 given FP8 patterns in a group."""
        f = self.ms.fmt
        b = np.array(fp8, dtype=np.int64)
        self.e[tile, g * L.GROUP_SIZE:(g + 1) * L.GROUP_SIZE] = (b >> f.mantissa_bits) & f.max_exponent_field
        self.sm[tile, g * L.GROUP_SIZE:(g + 1) * L.GROUP_SIZE] = ((b >> 7) << f.mantissa_bits) | (
            b & ((1 << f.mantissa_bits) - 1))

    def tiles(self) -> np.ndarray:
        n, c = self.bn.shape
        return join_elements(self.sm, self.e, self.ms.fmt).reshape(n, L.BLOCK_TOKENS, c)


# -- calibrations -------------------------------------------------------------

def calibration(fmt: str, bn, bw, capacity, scale_log2=None, model="synthetic") -> Calibration:
    bn = np.asarray(bn)
    scale = np.zeros(bn.shape[:3], dtype=np.int64) if scale_log2 is None else scale_log2
    return Calibration(format=fmt, scale_log2=scale, b_narrow=bn, b_wide=bw, capacity=capacity, model=model)


def synthetic_bases(fmt: str, heads: int, dim: int):
    """Bases ``[2, 1, heads, dim]`` that differ by channel, head and kind, each narrow window inside its wide one."""
    k, _, h, c = np.meshgrid(np.arange(2), np.arange(1), np.arange(heads), np.arange(dim), indexing="ij")
    low = 6 if fmt == "fp8_e4m3" else 14
    bn = low + (c + 2 * h + k) % 4
    return bn, bn - 1 - c % 3


# -- description of a valid vector ---------------------------------------------

def describe(name: str, covers: str, enc, cal_file: str, cal: Calibration, block: np.ndarray) -> dict:
    """The JSON of a valid vector; sizes recomputed from the table and the modes, checked against the encoder."""
    heads, _, dim = block.shape
    geo = cal.geometry
    per = L.tiles_per_head(dim)
    n_tiles = heads * per
    table = np.frombuffer(enc.data, dtype="<u4", count=n_tiles, offset=L.STREAM_HEADER_BYTES)
    esc = escape_bytes(enc.modes, cal.modes)
    raw = [t for t in range(n_tiles) if table[t] & L.TABLE_RAW_FLAG]
    slot_tiles = [t for t in range(n_tiles) if t not in raw]
    capacity = int(cal.capacity[enc.kind, enc.layer])
    stored = enc.modes[slot_tiles].ravel()
    names = cal.modes.mode_names
    meta = {
        "name": name, "valid": True, "covers": covers, "element_format": cal.format.name,
        "calibration": cal_file, "calibration_id": f"{cal.id:08x}",
        "layer": enc.layer, "kind": L.KIND_NAMES[enc.kind], "kv_heads": heads, "head_dim": dim,
        "scale_log2": cal.scale_log2[enc.kind, enc.layer].tolist(),
        "tile_channels": geo.channels, "escape_capacity": capacity, "canonical": True, "bytes": len(enc.data),
        "tiles": [{"tile": t, "head": t // per, "channels": [(t % per) * geo.channels, (t % per + 1) * geo.channels],
                   "storage": "raw" if t in raw else "slot", "table_entry": f"{int(table[t]):08x}",
                   "modes": "".join(str(int(m)) for m in enc.modes[t]), "escape_bytes": int(esc[t])}
                  for t in range(n_tiles)],
        "raw_tiles": raw,
        "mode_counts": {names[m]: int((stored == m).sum()) for m in (MODE_NARROW, MODE_WIDE, MODE_RAW)},
        "payload_bytes": sum(geo.raw_bytes if t in raw else geo.fixed_bytes + int(esc[t]) for t in range(n_tiles)),
        "resident_bytes": len(raw) * geo.raw_bytes + len(slot_tiles) * geo.slot_bytes(capacity)
        + n_tiles * L.TABLE_ENTRY_BYTES,
        "expected": [["".join(f"{int(x):02x}" for x in row) for row in head] for head in block],
    }
    assert (meta["payload_bytes"], meta["resident_bytes"], tuple(raw)) == \
        (enc.payload_bytes, enc.resident_bytes, enc.raw_tiles), name
    return meta


# -- the vectors ---------------------------------------------------------------

def format_vectors(fmt: str, kv_dir: Path | None):
    """(calibrations {file: cal}, valid vectors [(name, bytes, json)]) of one format."""
    ms = MODE_SETS[fmt]
    f = ms.fmt
    s = short(fmt)
    rand = Rand({"fp8_e4m3": 0xE4, "fp8_e5m2": 0xE5}[fmt])
    cals, out = {}, []

    def add(name, covers, cal_file, cal, block, layer, kind):
        enc = encode_fp8_block(block, cal, layer, kind)
        out.append((name, enc.data, describe(name, covers, enc, cal_file, cal, block)))
        return enc

    # 1. all 256 patterns, 4 times each, sorted by exponent field so that windows catch some rows.
    order = sorted(range(256), key=lambda b: ((b >> f.mantissa_bits) & f.max_exponent_field, b))
    tile = np.array([b for b in order for _ in range(4)], dtype=np.uint8).reshape(1, 1, L.BLOCK_TOKENS, 64)
    w = fit_windows(tile, ms, capacity=0)
    need = int(escape_bytes(_modes_of(tile[0, 0], w.b_narrow[0, 0], w.b_wide[0, 0], ms), ms))
    cal1 = calibration(fmt, np.stack([w.b_narrow] * 2), np.stack([w.b_wide] * 2),
                       [[ceil16(need) + L.SLOT_ALIGN], [ceil16(need) + L.SLOT_ALIGN]], [[[-3]], [[2]]])
    cals[f"cal_{s}_one_head.json"] = cal1
    add(f"{s}_all_patterns", "every one of the 256 FP8 patterns 4 times in one tile (NaNs, infinities, zeros, "
        "subnormals, largest finite), sorted by exponent; all three modes; the base of the must-reject vectors",
        f"cal_{s}_one_head.json", cal1, tile[0], 0, "k")

    # 2. specials under windows at the bottom (head 0) and the top (head 1) of the exponent range.
    top = f.max_exponent_field
    bn = np.zeros((2, 1, 2, 64), dtype=np.int64)
    bw = np.zeros_like(bn)
    bn[:, :, 1], bw[:, :, 1] = ms.narrow_base_max, ms.wide_base_max
    zero_sub = [0x00, 0x80] + [m | sg for m in range(1, 1 << f.mantissa_bits) for sg in (0, 0x80)]
    nans = [b for b in range(256) if np.isnan(_value(f, b))]
    infs = [b for b in range(256) if np.isinf(_value(f, b))]
    maxf = [f.max_finite_bits, f.max_finite_bits | 0x80]
    tops = nans + infs + maxf
    b = TileBuilder(ms, *tile_bases(bn[0, 0], bw[0, 0]), rand)

    def draw(pool, n):
        return [pool[rand.below(len(pool))] for _ in range(n)]

    low3 = [(e << f.mantissa_bits) | m for e in (1, 2, 3) for m in range(1 << f.mantissa_bits)]
    high3 = [((top - e) << f.mantissa_bits) | m for e in (1, 2, 3) for m in range(1 << f.mantissa_bits)]
    for g in range(128):
        # head 0 (window 0..3 / 0..7): zeros and subnormals; 2-bit, 3-bit, raw groups in turn.
        # head 1 (top windows): NaN, Inf, largest finite; the same cycle.
        mode = (MODE_NARROW, MODE_NARROW, MODE_WIDE, MODE_RAW)[g % 4]
        if mode == MODE_NARROW:
            lo, hi = draw(zero_sub + (low3 if g % 8 == 1 else []), 8), draw(tops + (high3 if g % 8 == 1 else []), 8)
        elif mode == MODE_WIDE:      # one exponent 4..7 above the bottom (below the top)
            lo = draw(zero_sub, 7) + [(4 + g // 4 % 4) << f.mantissa_bits]
            hi = draw(tops, 7) + [(top - 4 - g // 4 % 4) << f.mantissa_bits]
        else:                        # the far end of the range in the same group
            lo = draw(zero_sub, 7) + [tops[g // 4 % len(tops)]]
            hi = draw(tops, 7) + [zero_sub[g // 4 % len(zero_sub)]]
        b.patterns(0, g, lo)
        b.patterns(1, g, hi)
    tiles = b.tiles()
    need = max(int(escape_bytes(_modes_of(t, x, y, ms), ms)) for t, x, y in zip(tiles, *tile_bases(bn[0, 0], bw[0, 0])))
    cal2 = calibration(fmt, bn, bw, [[ceil16(need)], [0]])
    cals[f"cal_{s}_edge.json"] = cal2
    add(f"{s}_specials", "NaN" + ("" if f.has_inf else " (S.1111.111, no Inf)") + (", +-Inf" if f.has_inf else "")
        + ", largest finite, +-0 and every subnormal, under windows at the bottom (head 0) and the top (head 1) "
        "of the exponent range, in all three modes", f"cal_{s}_edge.json", cal2, untile(tiles, 2, 64), 0, "k")

    # 3. synthetic bases, 4 heads: all narrow / all wide / all raw / mixed (kind V, capacity for all raw),
    #    and slot overflow at the capacity's edge (kind K, capacity 32).
    bn, bw = synthetic_bases(fmt, 4, 64)
    full = ceil16(128 * ms.escape_bytes[MODE_RAW])
    cal3 = calibration(fmt, bn, bw, [[32], [full]], [[[-5, -5, -4, -4]], [[-7, -6, -6, -7]]])
    cals[f"cal_{s}_synthetic.json"] = cal3
    tb = tile_bases(*cal3.bases(0, L.KIND_V))
    b = TileBuilder(ms, *tb, rand)
    for g in range(128):
        b.group(0, g, MODE_NARROW)
        b.group(1, g, MODE_WIDE)
        b.group(2, g, MODE_RAW)
        b.group(3, g, (MODE_NARROW, MODE_NARROW, MODE_WIDE, MODE_NARROW, MODE_WIDE, MODE_RAW)[rand.below(6)])
    add(f"{s}_modes", "one tile per mode (all 2-bit, all 3-bit, all raw: its escape area full) and a mixed tile",
        f"cal_{s}_synthetic.json", cal3, untile(b.tiles(), 4, 64), 0, "v")

    raw_b = ms.escape_bytes[MODE_RAW]
    b = TileBuilder(ms, *tile_bases(*cal3.bases(0, L.KIND_K)), rand)
    plan = {0: [MODE_RAW] + [MODE_WIDE] * (33 - raw_b),      # 33 escape bytes: one more than the capacity
            1: [MODE_WIDE] * 32,                              # exactly the capacity: fits
            2: [MODE_WIDE] * 5,
            3: [MODE_RAW] * 20}                               # far beyond
    for t, modes in plan.items():
        b.scattered(t, modes)
    add(f"{s}_overflow", "slot overflow: tile 0 needs 33 escape bytes and tile 3 far more than the capacity of "
        "32, so both stay raw; tile 1 uses exactly 32 and tile 2 five, so they are slots",
        f"cal_{s}_synthetic.json", cal3, untile(b.tiles(), 4, 64), 0, "k")

    b = TileBuilder(ms, *tile_bases(*cal3.bases(0, L.KIND_K)), rand)
    for t in range(4):
        for g in range(128):
            b.group(t, g, MODE_RAW if g % (t + 2) == 0 else MODE_NARROW)
    add(f"{s}_all_raw", "every tile overflows the capacity of 32 (at least 22 raw groups each): a container "
        "with no slot, only raw FP8 tiles", f"cal_{s}_synthetic.json", cal3, untile(b.tiles(), 4, 64), 0, "k")

    # 4. head_dim 256: two 128-channel half-head tiles.
    bn, bw = synthetic_bases(fmt, 1, 256)
    cal4 = calibration(fmt, bn, bw, [[64], [64]])
    cals[f"cal_{s}_d256.json"] = cal4
    b = TileBuilder(ms, *tile_bases(*cal4.bases(0, L.KIND_K)), rand)
    for t, modes in enumerate(([MODE_WIDE] * 40, [MODE_WIDE] * 40 + [MODE_RAW] * 20)):
        b.scattered(t, modes)
    add(f"{s}_d256", "head_dim 256: two 128-channel tiles (lower and upper half-head); the lower one "
        "(40 3-bit groups) is a slot, the upper one (40 3-bit and 20 raw groups) overflows the capacity of 64",
        f"cal_{s}_d256.json", cal4, untile(b.tiles(), 1, 256), 0, "k")

    # 5. real data: the prose K and V of layer 0, converted with the calibration's scales.
    if kv_dir is not None and (kv_dir / REAL_DUMP.format("k")).exists():
        k = np.load(kv_dir / REAL_DUMP.format("k"))[:1]
        v = np.load(kv_dir / REAL_DUMP.format("v"))[:1]
        cal5 = calibrate_fp8(k, v, fmt, model="smollm2-135m-instruct-q4_1, layer 0, prose prompt")
        cals[f"cal_{s}_prose_l0.json"] = cal5
        for kind, x in (("k", k), ("v", v)):
            bits = x[0, :, REAL_BLOCK * 16:(REAL_BLOCK + 1) * 16]
            enc = encode_bf16_block(bits, cal5, 0, kind)
            block = decode_fp8_block(enc, cal5)
            out.append((f"{s}_real_{kind}", enc.data,
                        describe(f"{s}_real_{kind}", f"block {REAL_BLOCK} of layer 0 of the real SmolLM2 prose "
                                 f"{kind.upper()} cache, converted to {fmt} with the calibration's scales",
                                 enc, f"cal_{s}_prose_l0.json", cal5, block)))
    return cals, out


def _value(f, b: int) -> float:
    return float(fp8_values(f)[b])


def _modes_of(tile: np.ndarray, bn: np.ndarray, bw: np.ndarray, ms: ModeSet) -> np.ndarray:
    return choose_modes(tile_exponents(tile[None], ms.fmt), bn[None], bw[None], ms)[0]


def reject_vectors(fmt: str, valid: dict, cals: dict):
    """Streams breaking one rule of FORMAT-FP8.md section 7 each, derived from ``*_all_patterns``."""
    s = short(fmt)
    ms = MODE_SETS[fmt]
    base = RejectBase(f"{s}_all_patterns", valid, "FORMAT-FP8.md section 7", fmt)
    head = base.head
    geo = ms.geometry(head.head_dim)
    assert base.table == [0] and len(base.body) == geo.slot_bytes(head.capacity), "the base must be a single slot"
    used = base.meta["tiles"][0]["escape_bytes"]
    narrow = [g for g, t in enumerate(base.meta["tiles"][0]["modes"]) if t == str(MODE_NARROW)]
    grow = -(-(head.capacity - used + 1) // ms.escape_bytes[MODE_RAW])     # narrow -> raw groups to overflow
    other = FP8_FORMATS["fp8_e5m2" if fmt == "fp8_e4m3" else "fp8_e4m3"].element
    cases = [
        ("reject_version_1", "R3", "FormatError", "stream version", "version byte 1 (a BF16 stream's)",
         base.stream(version=1)),
        ("reject_element_bf16", "R4", "FormatError", "element format", "element format 1 (BF16)",
         base.stream(element=1)),
        ("reject_element_4", "R4", "FormatError", "element format", "element format 4 (undefined)",
         base.stream(element=4)),
        ("reject_crc", "R12", "FormatError", "CRC-32 mismatch", "bit 2 of sign+mantissa byte 3 of slot 0 flipped, "
         "CRC left as it was", base.flipped(3, 0x04)),
        ("reject_calibration_id", "R14", "CalibrationError", "stream was encoded with calibration",
         f"header calibration id replaced by the id of cal_{s}_synthetic.json",
         base.stream(cal_id=cals[f"cal_{s}_synthetic.json"].id)),

        ("reject_reserved_tag", "R18", "FormatError", "is reserved", f"tag of group {narrow[0]} set to 3",
         base.retagged(geo.tag_offset, narrow[:1], MODE_RESERVED)),
        ("reject_escape_overflow", "R19", "FormatError", "escape bytes but the slot holds",
         f"tags of groups {narrow[:grow]} (2-bit) set to 2 (raw): "
         f"{used + grow * ms.escape_bytes[MODE_RAW]} escape bytes, capacity {head.capacity}",
         base.retagged(geo.tag_offset, narrow[:grow], MODE_RAW)),
        ("reject_escape_padding", "R20", "FormatError", "is not zero after",
         f"last byte of the escape area ({used} of {head.capacity} bytes used) set to 01", base.dirty_padding()),
    ]
    out = [base.rejected(f"{s}_{name}", *case) for name, *case in cases]
    # R21 needs a stream that is well formed in both FP8 formats: only raw tiles (N bytes in either).
    raw = RejectBase(f"{s}_all_raw", valid, "FORMAT-FP8.md section 7", fmt)
    out.append(raw.rejected(f"{s}_reject_other_fp8", "R21", "CalibrationError", "element format",
                            f"element format {other} (the other FP8 format), calibration id kept",
                            raw.stream(element=other)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--kv-dir", type=Path, default=KV_DIR)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    count = 0
    for fmt in FP8_FORMATS:
        cals, valid = format_vectors(fmt, args.kv_dir)
        rejects = reject_vectors(fmt, {n: (d, m) for n, d, m in valid}, cals)
        for name, cal in cals.items():
            cal.save(args.out / name)
        for name, data, meta in valid + rejects:
            (args.out / f"{name}.bin").write_bytes(data)
            (args.out / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
            count += 1
    print(f"wrote {count} vectors to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
