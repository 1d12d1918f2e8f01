"""Generate the GAAC BF16 test vectors (versions 1 and 2) in ``format_spec/vectors/`` (FORMAT.md appendix A).

Run from the repository root::

    python -m format_spec.make_vectors            # rewrites format_spec/vectors/
    python -m format_spec.make_vectors --out DIR  # writes elsewhere

The valid streams are made by ``gaac.encode_block``; their JSON records what
they must decode to, so an independent decoder can be checked against them.
Must-reject streams are valid streams with one rule of FORMAT.md section 8
broken and, except for the CRC vector, the CRC-32 recomputed so that the rule
under test is the one that trips.

Why no NumPy random generator: its streams are allowed to change between NumPy
versions, and the vectors must regenerate byte for byte.  A splitmix64 in plain
Python is stable forever.  The two real-data vectors need the real SmolLM2
dumps (../shared/data/kv); everything else is synthetic.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from collections import namedtuple
from pathlib import Path

import numpy as np

import gaac
from gaac import layout as L
from gaac.format.block import parse_kind
from gaac.tiles import block_tiles, cache_blocks

HERE = Path(__file__).resolve().parent
VECTORS = HERE / "vectors"
KV_DIR = HERE.parents[1] / "shared" / "data" / "kv"
REAL_DUMP = "smollm2-135m-instruct-q4_1__prose__{}.npy"
REAL_BLOCK = 18   # block of layer 0 whose K and V both have raw groups under the layer-0 calibration

Header = namedtuple("Header", "magic version element kind tokens layer kv_heads head_dim capacity cal_id epoch reserved")


class Rand:
    """splitmix64: a tiny deterministic generator whose output never depends on library versions."""

    def __init__(self, seed: int):
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def below(self, n: int) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return (z ^ (z >> 31)) % n


# -- calibrations -------------------------------------------------------------

def synthetic_calibration(layers: int, heads: int, dim: int, capacity, stride: int, model: str) -> gaac.Calibration:
    """Bases that differ by channel, head, layer and kind, with each 8-wide window inside its 16-wide one.

    ``b4 = b3 - 4 - (c % 3)`` puts ``b3 - 1`` and ``b3 + 8`` inside the 4-bit
    window and ``b4 - 1``, ``b4 + 16`` outside both: the boundary cases of
    vector ``out_of_window``.
    """
    k, l, h, c = np.meshgrid(np.arange(2), np.arange(layers), np.arange(heads), np.arange(dim), indexing="ij")
    b3 = 116 + (stride * c + 3 * h + 5 * l + 2 * k) % 10
    b4 = b3 - 4 - c % 3
    return gaac.Calibration(b3=b3, b4=b4, capacity=capacity, model=model)


def edge_calibration() -> gaac.Calibration:
    """Head 0 has windows at the bottom of the exponent range (0..7, 0..15), head 1 at the top (248..255, 240..255)."""
    b3 = np.zeros((2, 1, 2, 64), dtype=np.int64)
    b4 = np.zeros_like(b3)
    b3[:, :, 1], b4[:, :, 1] = L.B3_MAX, L.B4_MAX
    return gaac.Calibration(b3=b3, b4=b4, capacity=[[16], [0]], model="synthetic: exponent windows at 0 and 255")


def epoch_calibration(base: gaac.Calibration, k_epoch_2_shift: int, model: str) -> gaac.Calibration:
    """``base`` (its epoch 0, so the same calibration id) with epochs appended as a cache would (FORMAT.md 3.5).

    Layer 0 K gets epochs 1 (bases 2 up) and 2 (bases ``k_epoch_2_shift`` from
    epoch 0); layer 1 V gets epoch 1 (``b3`` 5 up, ``b4`` 1 up).  Two calibrations
    that differ only in ``k_epoch_2_shift`` are two caches of one model whose
    epoch 2 differs: vector ``reject_epoch_id``.
    """
    cal = base.copy()
    cal.model = model
    b3, b4 = (b.astype(np.int64) for b in base.bases(0, L.KIND_K))
    cal.add_epoch(0, L.KIND_K, b3 + 2, b4 + 2)
    cal.add_epoch(0, L.KIND_K, b3 + k_epoch_2_shift, b4 + k_epoch_2_shift)
    b3, b4 = (b.astype(np.int64) for b in base.bases(1, L.KIND_V))
    cal.add_epoch(1, L.KIND_V, b3 + 5, b4 + 1)
    return cal


def calibrations(kv_dir: Path | None) -> dict[str, gaac.Calibration]:
    d64 = synthetic_calibration(2, 2, 64, [[32, 16], [0, 48]], 7, "synthetic head_dim 64")
    cals = {
        "cal_d64": d64,
        "cal_epochs": epoch_calibration(d64, -3, "synthetic head_dim 64, with epochs"),
        "cal_epochs_other": epoch_calibration(d64, -2, "synthetic head_dim 64, with another cache's epochs"),
        "cal_d128": synthetic_calibration(1, 1, 128, [[32], [112]], 5, "synthetic head_dim 128"),
        "cal_d256": synthetic_calibration(1, 2, 256, [[48], [16]], 11, "synthetic head_dim 256"),
        "cal_edge": edge_calibration(),
        "cal_one_head": synthetic_calibration(1, 1, 64, [[32], [0]], 3, "synthetic: one KV head, head_dim 64"),
    }
    if kv_dir is not None:
        k, v = (np.load(kv_dir / REAL_DUMP.format(x))[:1] for x in "kv")
        cals["cal_prose_l0"] = gaac.calibrate(k, v, model="SmolLM2-135M-Instruct, layer 0 of the prose K/V dumps",
                                              show_progress=False)
    return cals


# -- synthetic blocks ---------------------------------------------------------

class BlockBuilder:
    """A block ``[kv_heads, 16, head_dim]`` built group by group, remembering each group's intended mode."""

    def __init__(self, cal: gaac.Calibration, layer: int, kind: str, seed: int, epoch: int = 0):
        self.b3, self.b4 = (b.astype(np.int64) for b in cal.bases(layer, parse_kind(kind), epoch))
        self.heads, self.dim = self.b3.shape
        self.geo = L.geometry(self.dim)
        self.per = L.tiles_per_head(self.dim)
        self.rng = Rand(seed)
        self.bits = np.zeros((self.heads, L.BLOCK_TOKENS, self.dim), dtype=np.uint16)
        self.intent = np.zeros((self.heads * self.per, self.geo.groups), dtype=np.uint8)
        for t in range(self.heads * self.per):
            for g in range(self.geo.groups):
                self.group(t, g, L.MODE_3BIT)

    def _where(self, tile: int, group: int):
        """(head, token, first head channel) of a group (FORMAT.md section 4)."""
        h, j = divmod(tile, self.per)
        r, col = divmod(group, self.geo.groups_per_row)
        return h, r, j * self.geo.channels + col * L.GROUP_SIZE

    def group(self, tile: int, group: int, mode: int, *, exponents=None, patterns=None) -> None:
        """Fill one group with random sign+mantissa bytes and exponents of ``mode`` (or the given ones)."""
        h, r, c0 = self._where(tile, group)
        b3, b4 = self.b3[h, c0:c0 + 8], self.b4[h, c0:c0 + 8]
        if patterns is None:
            e = list(exponents) if exponents is not None else self._random_exponents(mode, b3, b4)
            sm = [self.rng.below(256) for _ in range(L.GROUP_SIZE)]
            patterns = [((s & 0x80) << 8) | (x << 7) | (s & 0x7F) for s, x in zip(sm, e)]
        self.bits[h, r, c0:c0 + 8] = patterns
        self.intent[tile, group] = mode

    def _random_exponents(self, mode: int, b3, b4) -> list[int]:
        if mode == L.MODE_3BIT:
            return [int(b) + self.rng.below(L.WINDOW_3BIT) for b in b3]
        i = self.rng.below(L.GROUP_SIZE)
        if mode == L.MODE_4BIT:
            e = [int(b) + self.rng.below(L.WINDOW_4BIT) for b in b4]
            outside = [int(b4[i]) + x for x in range(L.WINDOW_4BIT) if not b3[i] <= b4[i] + x < b3[i] + 8]
        else:
            e = [self.rng.below(256) for _ in b3]
            outside = [x for x in range(256) if not (b3[i] <= x < b3[i] + 8 or b4[i] <= x < b4[i] + 16)]
        e[i] = outside[self.rng.below(len(outside))]
        return e

    def offsets(self, tile: int, group: int, mode: int, which: str, rel) -> None:
        """A group whose exponents are ``base + rel[i]`` for the ``which`` ('b3' or 'b4') bases of its channels."""
        h, _, c0 = self._where(tile, group)
        base = (self.b3 if which == "b3" else self.b4)[h, c0:c0 + 8]
        self.group(tile, group, mode, exponents=[int(b) + d for b, d in zip(base, rel)])


# -- vectors -----------------------------------------------------------------

def describe(name: str, covers: str, data: bytes, cal_file: str, cal: gaac.Calibration, layer: int, kind: int,
             block: np.ndarray, modes: np.ndarray, *, canonical: bool = True, epoch: int = 0) -> dict:
    """The JSON of a valid vector (FORMAT.md appendix A).

    ``modes`` are the tags the encoder gave every tile (for a raw tile: the ones
    that overflowed it).  Sizes follow FORMAT.md 6.5 from the table and the modes,
    independently of what ``encode_block`` reports.
    """
    heads, _, dim = block.shape
    geo = L.geometry(dim)
    per = L.tiles_per_head(dim)
    n_tiles = heads * per
    table = struct.unpack_from(f"<{n_tiles}I", data, L.STREAM_HEADER_BYTES)
    esc = [int(sum(L.ESCAPE_BYTES[int(m)] for m in row)) for row in modes]
    raw = [t for t in range(n_tiles) if table[t] & L.TABLE_RAW_FLAG]
    slot_tiles = [t for t in range(n_tiles) if t not in raw]
    capacity = int(cal.capacity[kind, layer])
    stored = np.concatenate([modes[t] for t in slot_tiles]) if slot_tiles else np.zeros(0, np.uint8)
    tiles = [{"tile": t, "head": t // per,
              "channels": [(t % per) * geo.channels, (t % per + 1) * geo.channels],
              "storage": "raw" if t in raw else "slot", "table_entry": f"{table[t]:08x}",
              "modes": "".join(str(int(m)) for m in modes[t]), "escape_bytes": esc[t]} for t in range(n_tiles)]
    return {
        "name": name, "valid": True, "covers": covers,
        "calibration": cal_file, "calibration_id": f"{cal.id:08x}", "version": data[4], "epoch": epoch,
        "bases_id": f"{cal.epoch_id(layer, kind, epoch):08x}",
        "layer": layer, "kind": L.KIND_NAMES[kind], "kv_heads": heads, "head_dim": dim,
        "tile_channels": geo.channels, "escape_capacity": capacity, "canonical": canonical,
        "bytes": len(data), "tiles": tiles, "raw_tiles": raw,
        "mode_counts": {L.MODE_NAMES[m]: int((stored == m).sum()) for m in L.MODE_NAMES},
        "payload_bytes": sum(geo.raw_bytes if t in raw else geo.fixed_bytes + esc[t] for t in range(n_tiles)),
        "resident_bytes": len(raw) * geo.raw_bytes + len(slot_tiles) * geo.slot_bytes(capacity)
        + n_tiles * L.TABLE_ENTRY_BYTES,
        "expected": [["".join(f"{int(x):04x}" for x in row) for row in head] for head in block],
    }


def described(name: str, covers: str, enc: gaac.EncodedBlock, cal_file: str, cal: gaac.Calibration,
              block: np.ndarray) -> tuple[str, bytes, dict]:
    """A canonical vector made by ``encode_block``, whose own size report must agree with :func:`describe`."""
    meta = describe(name, covers, enc.data, cal_file, cal, enc.layer, enc.kind, block, enc.modes, epoch=enc.epoch)
    assert (meta["payload_bytes"], meta["resident_bytes"], tuple(meta["raw_tiles"])) == \
        (enc.payload_bytes, enc.resident_bytes, enc.raw_tiles), name
    return name, enc.data, meta


def split_container(data: bytes) -> tuple[Header, list[int], bytes]:
    """(header, block table, slots + raw tiles) of a well-formed container."""
    head = Header(*L.STREAM_HEADER_V2.unpack_from(data))
    n = head.kv_heads * L.tiles_per_head(head.head_dim)
    table = list(struct.unpack_from(f"<{n}I", data, L.STREAM_HEADER_BYTES))
    return head, table, data[L.STREAM_HEADER_BYTES + 4 * n:-L.STREAM_CRC_BYTES]


def join_container(head: Header, table, body: bytes) -> bytes:
    """Header + table + body, with a freshly computed CRC-32 (FORMAT.md 7.4)."""
    data = L.STREAM_HEADER_V2.pack(*head) + struct.pack(f"<{len(table)}I", *table) + body
    return data + struct.pack("<I", zlib.crc32(data))


def synthetic_vectors(cals) -> list[tuple[str, bytes, dict]]:
    """Every valid synthetic vector: (name, container, JSON)."""
    out = []

    def add(name, covers, cal_name, layer, kind, builder: BlockBuilder):
        cal = cals[cal_name]
        enc = gaac.encode_block(builder.bits, cal, layer, kind)
        assert np.array_equal(enc.modes, builder.intent), f"{name}: modes differ from the intended ones"
        out.append(described(name, covers, enc, cal_name + ".json", cal, builder.bits))
        return enc

    d64 = cals["cal_d64"]
    b = BlockBuilder(d64, 0, "k", seed=1)
    add("all_3bit", "every group 3-bit: no escape bytes, escape areas all zero; head_dim 64, 2 heads",
        "cal_d64", 0, "k", b)
    all3 = b

    b = BlockBuilder(d64, 1, "k", seed=2)
    for i in range(16):
        b.group(0, 8 * i + i % 8, L.MODE_4BIT)
    for g in (3, 40, 77, 100, 127):
        b.group(1, g, L.MODE_4BIT)
    add("modes_4bit", "4-bit groups; tile 0 has 16 of them and fills its capacity of 16 exactly; layer 1",
        "cal_d64", 1, "k", b)

    b = BlockBuilder(d64, 0, "k", seed=3)
    for g in (0, 9, 31, 64, 101, 127):
        b.group(0, g, L.MODE_RAW)
    for g in (50, 51):
        b.group(0, g, L.MODE_4BIT)
    for g in (7, 70):
        b.group(1, g, L.MODE_RAW)
    b.group(1, 90, L.MODE_4BIT)
    add("raw_groups", "raw groups with exponents far outside both windows: tile 0 uses its 32 escape bytes "
        "exactly, tile 1 uses 11 and zero-pads the rest", "cal_d64", 0, "k", b)

    b = BlockBuilder(d64, 1, "v", seed=4)
    boundary = [  # (mode, which base, offsets of the 8 elements) -- window edges and just outside them
        (L.MODE_3BIT, "b3", [0, 7, 0, 7, 7, 0, 7, 0]),
        (L.MODE_4BIT, "b3", [0, 1, 2, -1, 3, 4, 5, 6]),       # one element at b3 - 1
        (L.MODE_4BIT, "b3", [7, 6, 8, 5, 4, 3, 2, 1]),        # one element at b3 + 8
        (L.MODE_4BIT, "b4", [0, 15, 0, 15, 15, 0, 15, 0]),    # 4-bit window edges, b4 < b3
        (L.MODE_RAW, "b4", [4, 5, 6, 7, 8, 9, -1, 10]),       # one element at b4 - 1
        (L.MODE_RAW, "b4", [16, 4, 5, 6, 7, 8, 9, 10]),       # one element at b4 + 16
    ]
    for t in range(2):
        for k, (mode, which, rel) in enumerate(boundary):
            b.offsets(t, 5 + 21 * k + t, mode, which, rel[t:] + rel[:t])
        h, r, c0 = b._where(t, 126 - t)
        b.group(t, 126 - t, L.MODE_RAW, exponents=[0 if t == 0 else 255] + [int(x) for x in b.b3[h, c0 + 1:c0 + 8]])
    add("out_of_window", "exponents at the edges of both windows and one step outside them, and exponents 0 "
        "and 255 next to in-window ones; layer 1 V", "cal_d64", 1, "v", b)

    b = BlockBuilder(d64, 1, "v", seed=5)
    for g in range(10):
        b.group(0, 12 * g + 3, L.MODE_RAW)
    for g in range(9):
        b.group(1, 13 * g + 1, L.MODE_RAW)
    for g in (2, 60, 99):
        b.group(1, g, L.MODE_4BIT)
    add("slot_overflow", "tile 0 needs 50 escape bytes, capacity 48: it stays a raw tile (table entry "
        "80000000); tile 1 needs exactly 48 and is slot 0", "cal_d64", 1, "v", b)

    b = BlockBuilder(d64, 0, "v", seed=6)
    b.group(1, 33, L.MODE_4BIT)
    add("capacity_0", "escape capacity 0: the all-3-bit tile 0 is a slot with no escape area, tile 1 has one "
        "4-bit group and is a raw tile", "cal_d64", 0, "v", b)

    d128 = cals["cal_d128"]
    b = BlockBuilder(d128, 0, "k", seed=7)
    for g in (0, 17, 100, 255):
        b.group(0, g, L.MODE_4BIT)
    for g in (15, 128, 200):
        b.group(0, g, L.MODE_RAW)
    add("d128_mixed", "head_dim 128: one 128-channel tile per head, 16 groups per token row, all three modes",
        "cal_d128", 0, "k", b)

    d256 = cals["cal_d256"]
    b = BlockBuilder(d256, 0, "k", seed=8)
    for g in (1, 66, 130):
        b.group(0, g, L.MODE_4BIT)
    for g in (5, 250):
        b.group(0, g, L.MODE_RAW)
    for g in range(9):
        b.group(1, 27 * g + 4, L.MODE_RAW)
    for g in (10, 20, 30, 40):
        b.group(1, g, L.MODE_4BIT)
    for g in range(L.geometry(256).groups):
        b.group(3, g, L.MODE_RAW)
    add("d256_half_heads", "head_dim 256: two 128-channel half-head tiles per head, head-major (tile 2h+j); "
        "tiles 1 and 3 overflow (49 and 1280 escape bytes, capacity 48), tile 3 has every group raw: the "
        "table is slot 0, raw 0, slot 1, raw 1", "cal_d256", 0, "k", b)

    b = BlockBuilder(cals["cal_one_head"], 0, "k", seed=11)
    for g in (2, 19, 60, 61, 127):
        b.group(0, g, L.MODE_RAW)
    for g in (0, 33, 64, 90):
        b.group(0, g, L.MODE_4BIT)
    add("one_tile", "one KV head, so one tile: 29 of its 32 escape bytes used; the base of the must-reject vectors",
        "cal_one_head", 0, "k", b)

    out.append(edge_vector(cals))
    out.extend(noncanonical_vectors(cals, all3))
    out.extend(epoch_vectors(cals, all3))
    return out


def epoch_vectors(cals, all3: BlockBuilder) -> list[tuple[str, bytes, dict]]:
    """Version 2 containers: blocks coded with a later calibration epoch (FORMAT.md 3.5), and epoch 0 in v2."""
    cal = cals["cal_epochs"]
    out = []
    b = BlockBuilder(cal, 0, "k", seed=12, epoch=2)
    for g in (4, 50, 99):
        b.group(0, g, L.MODE_4BIT)
    b.group(1, 17, L.MODE_RAW)
    enc = gaac.encode_block(b.bits, cal, 0, "k", epoch=2)
    assert np.array_equal(enc.modes, b.intent)
    assert not np.array_equal(gaac.encode_block(b.bits, cal, 0, "k").modes, b.intent)   # epoch 0 codes it otherwise
    out.append(described("epoch_k", "version 2: layer 0 K coded with epoch 2 of cal_epochs.json (its bases 3 below "
                         "epoch 0's); the header names epoch 2 and carries epoch 2's id", enc, "cal_epochs.json",
                         cal, b.bits))

    b = BlockBuilder(cal, 1, "v", seed=13, epoch=1)
    for g in range(10):
        b.group(0, 12 * g + 5, L.MODE_RAW)
    b.group(1, 64, L.MODE_4BIT)
    enc = gaac.encode_block(b.bits, cal, 1, "v", epoch=1)
    assert np.array_equal(enc.modes, b.intent) and enc.raw_tiles == (0,)
    out.append(described("epoch_v", "version 2: layer 1 V coded with epoch 1 of cal_epochs.json; tile 0 needs 50 "
                         "escape bytes and stays a raw tile (the capacity, 48, is the calibration's in every "
                         "epoch)", enc, "cal_epochs.json", cal, b.bits))

    d64 = cals["cal_d64"]
    head, table, body = split_container(gaac.encode_block(all3.bits, d64, 0, "k").data)
    data = join_container(head._replace(version=2), table, body)
    out.append(("v2_epoch0", data, describe(
        "v2_epoch0", "not canonical: block all_3bit in a version 2 header with epoch 0 (an encoder writes "
        "version 1 for epoch 0); a decoder must accept it and read it as version 1 (FORMAT.md 7.1)", data,
        "cal_d64.json", d64, 0, L.KIND_K, all3.bits, gaac.encode_block(all3.bits, d64, 0, "k").modes,
        canonical=False)))
    return out


EDGE_GROUPS = [  # (tile, group, mode, BF16 patterns)
    (0, 0, L.MODE_3BIT, [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x8080]),
    (0, 1, L.MODE_3BIT, [0x0380, 0x83FF, 0x0100, 0x8000, 0x0000, 0x0001, 0x0200, 0x0300]),
    (0, 9, L.MODE_4BIT, [0x0400, 0x87FF, 0x0000, 0x8000, 0x0040, 0x0080, 0x0780, 0x8001]),
    (0, 18, L.MODE_RAW, [0x7F80, 0xFF80, 0x0000, 0x8000, 0x7F7F, 0x0001, 0x7FC1, 0xFFBF]),
    (0, 27, L.MODE_RAW, [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF]),
    (1, 0, L.MODE_3BIT, [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFBF, 0x7F7F, 0xFC00]),
    (1, 1, L.MODE_3BIT, [0x7FC1, 0xFFFF, 0x7FBF, 0xFF81, 0x7C7F, 0x7D00, 0xFE80, 0x7F00]),
    (1, 9, L.MODE_4BIT, [0x7800, 0xFBFF, 0x7F80, 0x7FFF, 0x7A00, 0xF9FF, 0x7F7F, 0x7801]),
    (1, 18, L.MODE_RAW, [0x0000, 0x8000, 0x7F80, 0x0001, 0x3F80, 0xBF80, 0x7FFF, 0x807F]),
    (1, 27, L.MODE_RAW, [0x0080, 0x8080, 0x7F7F, 0xFF7F, 0x0000, 0x7FA0, 0xFFE0, 0x3F81]),
]


def edge_vector(cals):
    """+-0, subnormals, +-Inf, quiet and signalling NaNs of both signs, max/min normals, in every mode."""
    cal = cals["cal_edge"]
    b = BlockBuilder(cal, 0, "k", seed=9)
    for tile, group, mode, patterns in EDGE_GROUPS:
        b.group(tile, group, mode, patterns=patterns)
    enc = gaac.encode_block(b.bits, cal, 0, "k")
    assert np.array_equal(enc.modes, b.intent)
    covers = ("edge bit patterns: +0, -0, subnormals, +-Inf, quiet and signalling NaNs with payloads of both "
              "signs, max and min normals; exponent 0 coded in 3-bit (b3 = 0), 4-bit (b4 = 0) and raw groups, "
              "exponent 255 in 3-bit (b3 = 248), 4-bit (b4 = 240, code 15) and raw groups")
    return described("edge_patterns", covers, enc, "cal_edge.json", cal, b.bits)


def noncanonical_vectors(cals, all3: BlockBuilder):
    """Streams a decoder must accept although no v1 encoder makes them (FORMAT.md 5.2 and section 8)."""
    cal = cals["cal_d128"]
    b = BlockBuilder(cal, 0, "v", seed=10)
    # Encode with bases that no group of channels 0..7 (resp. 120..127) fits: those columns come out 4-bit
    # (resp. raw) although every group is 3-bit under the real calibration.  4-bit and raw codes do not
    # depend on b3, so the slot is a valid, wider-than-needed coding under the real calibration.
    b3, b4 = cal.b3.copy(), cal.b4.copy()
    b3[L.KIND_V, 0, 0, :8] = L.B3_MAX
    b3[L.KIND_V, 0, 0, 120:], b4[L.KIND_V, 0, 0, 120:] = L.B3_MAX, L.B4_MAX
    wide = gaac.encode_block(b.bits, gaac.Calibration(b3=b3, b4=b4, capacity=cal.capacity), 0, "v")
    head, table, body = split_container(wide.data)
    data = join_container(head._replace(cal_id=cal.id), table, body)
    modes = describe("noncanonical_modes", "not canonical: the groups of channels 0..7 are tagged 4-bit and those "
                     "of channels 120..127 raw although all fit 3-bit; a decoder must accept wider modes "
                     "(FORMAT.md 5.2)", data, "cal_d128.json", cal, 0, L.KIND_V, b.bits, wide.modes,
                     canonical=False)
    out = [("noncanonical_modes", data, modes)]

    cal = cals["cal_d64"]
    enc = gaac.encode_block(all3.bits, cal, 0, "k")
    head, table, body = split_container(enc.data)
    slot = L.geometry(64).slot_bytes(int(cal.capacity[L.KIND_K, 0]))
    raw1 = block_tiles(all3.bits)[1].astype("<u2").tobytes()
    data = join_container(head, [table[0], L.TABLE_RAW_FLAG | 0], body[:slot] + raw1)
    out.append(("noncanonical_raw_tile", data, describe(
        "noncanonical_raw_tile", "not canonical: block all_3bit with tile 1 stored as a raw tile although it "
        "fits its slot; a decoder must accept it (FORMAT.md section 8)", data, "cal_d64.json", cal, 0, L.KIND_K,
        all3.bits, enc.modes, canonical=False)))
    return out


def real_vectors(cals, kv_dir: Path):
    """Block ``REAL_BLOCK`` of layer 0 of the real prose K and V dumps, with the layer-0 calibration."""
    cal = cals["cal_prose_l0"]
    out = []
    for kind in "kv":
        block = cache_blocks(np.load(kv_dir / REAL_DUMP.format(kind))[0])[REAL_BLOCK]
        enc = gaac.encode_block(block, cal, 0, kind)
        name = f"prose_layer0_{kind}"
        covers = (f"real data: tokens {16 * REAL_BLOCK}..{16 * REAL_BLOCK + 15} of layer 0 of SmolLM2-135M's "
                  f"{kind.upper()} cache on the prose prompt, with a calibration made by gaac.calibrate on layer 0 "
                  "of the prose K and V dumps")
        out.append(described(name, covers, enc, "cal_prose_l0.json", cal, block))
    return out


# -- must-reject vectors --------------------------------------------------------

class RejectBase:
    """A valid vector that must-reject vectors are derived from, and the ways of breaking one rule in it.

    The FP8 generator (vectors/fp8/make_fp8_vectors.py) derives its must-reject
    vectors the same way, so both take this one class: ``spec`` names the rule
    list their JSON cites, and ``element_format``, where given, is recorded as
    FORMAT-FP8.md appendix A asks.  Every stream but :meth:`flipped`'s gets a
    freshly computed CRC-32, so that the rule under test, not the CRC check,
    is the one that trips.
    """

    def __init__(self, name: str, valid: dict, spec: str = "FORMAT.md section 8",
                 element_format: str | None = None):
        self.name = name
        self.data, self.meta = valid[name]
        self.head, self.table, self.body = split_container(self.data)
        self.spec, self.element_format = spec, element_format

    def stream(self, body: bytes | None = None, table: list[int] | None = None, **header) -> bytes:
        """The base with the given header fields, block table or body (slots + raw tiles) replaced."""
        return join_container(self.head._replace(**header), self.table if table is None else table,
                              self.body if body is None else body)

    def retagged(self, tag_offset: int, groups, tag: int) -> bytes:
        """The base, a single slot with its tag stream at ``tag_offset``, with the tags of ``groups`` set to ``tag``."""
        body = bytearray(self.body)
        for g in groups:
            byte, shift = tag_offset + g // 4, 2 * (g % 4)
            body[byte] = (body[byte] & ~(3 << shift)) | (tag << shift)
        return self.stream(bytes(body))

    def dirty_padding(self) -> bytes:
        """The base, a single slot with unused escape bytes, with the last byte of its escape area set to 01."""
        return self.stream(self.body[:-1] + b"\x01")

    def flipped(self, byte: int, mask: int) -> bytes:
        """The base with the bits of ``mask`` flipped in byte ``byte`` after the block table, the CRC left as it was."""
        data = bytearray(self.data)
        data[L.STREAM_HEADER_BYTES + 4 * len(self.table) + byte] ^= mask
        return bytes(data)

    def rejected(self, name: str, rule: str, error: str, message: str, mutation: str, data: bytes,
                 calibration: str | None = None) -> tuple[str, bytes, dict]:
        """A must-reject vector: (name, stream, JSON of appendix A), read with the base's calibration by default."""
        meta = {"name": name, "valid": False}
        if self.element_format is not None:
            meta["element_format"] = self.element_format
        meta.update({"covers": f"must reject: rule {rule} of {self.spec}",
                     "calibration": calibration or self.meta["calibration"], "derived_from": self.name,
                     "mutation": mutation, "rule": rule, "error": error, "message": message})
        return name, data, meta


def reject_vectors(valid: dict, cals) -> list[tuple[str, bytes, dict]]:
    """Streams breaking one rule of FORMAT.md section 8 each, derived from vector ``one_tile``."""
    base = RejectBase("one_tile", valid)
    head = base.head
    geo = L.geometry(head.head_dim)
    assert base.table == [0] and len(base.body) == geo.slot_bytes(head.capacity), "the base must be a single slot"
    plain = base.meta["tiles"][0]["modes"].index(str(L.MODE_3BIT))      # its first 3-bit group
    used = base.meta["tiles"][0]["escape_bytes"]

    cases = [  # name, rule, error class, message, mutation, stream
        ("reject_short", "R1", "FormatError", "truncated stream", "only the 24 header bytes", base.data[:24]),
        ("reject_bad_magic", "R2", "FormatError", "bad magic", "magic 'GAAX'", base.stream(magic=b"GAAX")),
        ("reject_version", "R3", "FormatError", "stream version", "version 3", base.stream(version=3)),
        ("reject_element_format", "R4", "FormatError", "element format", "element format 2",
         base.stream(element=2)),
        ("reject_kind", "R5", "FormatError", "bad header", "kind 2", base.stream(kind=2)),
        ("reject_tokens", "R6", "FormatError", "bad header", "tokens 15", base.stream(tokens=15)),
        ("reject_reserved_field", "R7", "FormatError", "bad header", "version 1 reserved header field (bytes "
         "20..23) 1", base.stream(epoch=1)),
        ("reject_head_dim", "R8", "FormatError", "bad header", "head_dim 96", base.stream(head_dim=96)),
        ("reject_zero_heads", "R9", "FormatError", "bad header", "kv_heads 0", base.stream(kv_heads=0)),
        ("reject_capacity_unaligned", "R10", "FormatError", "is not a multiple of 16", "escape capacity 40",
         base.stream(capacity=40)),
        ("reject_truncated", "R11", "FormatError", "truncated stream", "last 100 bytes before the CRC cut off",
         base.stream(base.body[:-100])),
        ("reject_trailing", "R11", "FormatError", "trailing bytes after stream",
         "16 zero bytes appended before the CRC", base.stream(base.body + bytes(16))),
        ("reject_crc", "R12", "FormatError", "CRC-32 mismatch", "bit 4 of sign+mantissa byte 5 of slot 0 "
         "flipped, CRC left as it was", base.flipped(5, 0x10)),
        ("reject_table_order", "R13", "FormatError", "tile table entry", "block-table entry 0 set to slot 1",
         base.stream(table=[1])),
        ("reject_calibration_id", "R14", "CalibrationError", "stream was encoded with calibration",
         "header calibration id replaced by the id of cal_d128.json", base.stream(cal_id=cals["cal_d128"].id)),
        ("reject_calibration_shape", "R15", "CalibrationError", "calibration is for",
         "kv_heads 2 with a second slot (a copy of slot 0): the calibration has 1 head",
         base.stream(base.body + base.body, [0, 1], kv_heads=2)),
        ("reject_layer", "R16", "CalibrationError", "out of range", "layer 1; the calibration has 1 layer",
         base.stream(layer=1)),
        ("reject_capacity_mismatch", "R17", "CalibrationError", "differs from the calibration",
         f"escape capacity {head.capacity + L.SLOT_ALIGN} with the slot zero-padded by {L.SLOT_ALIGN} bytes; "
         f"the calibration says {head.capacity}",
         base.stream(base.body + bytes(L.SLOT_ALIGN), capacity=head.capacity + L.SLOT_ALIGN)),
        ("reject_reserved_tag", "R18", "FormatError", "is reserved", f"tag of group {plain} set to 3",
         base.retagged(geo.tag_offset, [plain], 3)),
        ("reject_escape_overflow", "R19", "FormatError", "escape bytes but the slot holds",
         f"tag of group {plain} (3-bit) set to 2 (raw): {used + 5} escape bytes, capacity {head.capacity}",
         base.retagged(geo.tag_offset, [plain], L.MODE_RAW)),
        ("reject_escape_padding", "R20", "FormatError", "is not zero after",
         f"last byte of the escape area ({used} bytes used) set to 01", base.dirty_padding()),
    ]
    return [base.rejected(*case) for case in cases] + epoch_reject_vectors(valid)


def epoch_reject_vectors(valid: dict) -> list[tuple[str, bytes, dict]]:
    """The version 2 rules: reserved u16, unknown epoch, and a stream read with another cache's epochs."""
    base = RejectBase("epoch_k", valid)
    assert base.head.epoch == 2 and base.meta["calibration"] == "cal_epochs.json"
    return [
        base.rejected("reject_reserved_v2", "R7", "FormatError", "bad header", "version 2 reserved header field "
                      "(bytes 22..23) 1", base.stream(reserved=1)),
        base.rejected("reject_unknown_epoch", "R23", "CalibrationError", "unknown epoch", "epoch 3; the "
                      "calibration has epochs 0..2 for layer 0 K", base.stream(epoch=3)),
        base.rejected("reject_epoch_id", "R22", "CalibrationError", "another cache's epochs", "none: the stream "
                      "of epoch_k read with cal_epochs_other.json, whose epoch 0 (the calibration id) and epoch 1 "
                      "are cal_epochs.json's but whose epoch 2 of layer 0 K differs", base.data,
                      "cal_epochs_other.json"),
    ]


# -- driver --------------------------------------------------------------------

def dump_json(meta: dict) -> str:
    """One key per line, one tile or one head of expected values per line: readable and small."""
    def value(key, v):
        if key in ("tiles", "expected"):
            return "[\n  " + ",\n  ".join(json.dumps(x) for x in v) + "\n ]"
        return json.dumps(v)
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(k, v)}" for k, v in meta.items()) + "\n}\n"


def generate(out: Path, kv_dir: Path | None = KV_DIR) -> list[str]:
    """Write every calibration and vector into ``out``; without ``kv_dir`` the real-data ones are left out.

    Returns the names of the files written.
    """
    out.mkdir(parents=True, exist_ok=True)
    cals = calibrations(kv_dir)
    written = []
    for name, cal in cals.items():
        cal.save(out / f"{name}.json")
        written.append(f"{name}.json")
    vectors = synthetic_vectors(cals)
    if kv_dir is not None:
        vectors += real_vectors(cals, kv_dir)
    valid = {name: (data, meta) for name, data, meta in vectors}
    for name, data, meta in vectors + reject_vectors(valid, cals):
        (out / f"{name}.bin").write_bytes(data)
        (out / f"{name}.json").write_text(dump_json(meta))
        written += [f"{name}.bin", f"{name}.json"]
    return sorted(written)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=VECTORS, help="folder to write (default: format_spec/vectors)")
    ap.add_argument("--kv", type=Path, default=KV_DIR, help="folder of the real K/V dumps")
    args = ap.parse_args(argv)
    if not (args.kv / REAL_DUMP.format("k")).exists():
        print(f"make_vectors: the real dumps are not in {args.kv} (use --kv)", file=sys.stderr)
        return 2
    names = generate(args.out, args.kv)
    print(f"wrote {len(names)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
