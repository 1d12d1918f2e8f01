"""Generate the sequence-container test vectors in this folder (FORMAT.md section 11, appendix A).

Run from the repository root::

    python format_spec/vectors/sequence/make_sequence_vectors.py            # rewrites this folder
    python format_spec/vectors/sequence/make_sequence_vectors.py --out DIR  # writes elsewhere

Each vector is a sequence of synthetic BF16 K/V in a ``gaac.PagedKVCache``
made with one of the block vectors' calibrations (``../cal_*.json``),
exported with ``export_sequence``; its JSON records the calibration, the
dimensions, the epoch records and raw tiles per section, and the K and V it
must import (or unpack) to.  Data come from the splitmix64 generator of
format_spec/make_vectors.py, so the bytes never depend on library versions:

* ``seq_epochs``: 2 layers x 2 KV heads x head_dim 64, 53 tokens (3 blocks and
  a tail of 5), in a cache made with ``cal_epochs.json``, whose layer 0 K and
  layer 1 V blocks are coded with epochs 2 and 1 (a cache starts at the newest
  epoch of its calibration): a container with epoch records; layer 0 V's
  capacity 0 sends its tiles with a 4-bit or raw group to raw tiles.
* ``seq_embedded``: the same shape, 37 tokens, ``cal_d64.json`` embedded
  (flag bit 0): the file form, which unpacks without a calibration.

Slices by KV head (FORMAT.md 11.12), each with the sliced calibration it is
read with, ``cal_*_head1.json`` (``Calibration.slice_heads``):

* ``seq_heads``: KV head 1 of ``seq_epochs``'s sequence (the same data, the
  same cache), exported with ``heads=(1, 2)``: the epoch records of the
  slice carry head 1's bases and the epoch ids of the sliced calibration.
* ``seq_heads_d256``: KV head 1 of a sequence of ``cal_d256.json`` (head_dim
  256: two tiles per head), 37 tokens, the sliced calibration embedded.

And the must-reject containers ``reject_*.bin``, indexed by ``reject.json``
(FORMAT.md 11.7, appendix A): each breaks one rule S1-S16 or C1-C5 of a small
valid container -- ``cal_one_head.json``, 17 tokens (a block and a tail
token), with an epoch 1 of layer 0 K that the blocks use (so an epoch record)
and a raw V tile; or the same calibration embedded -- with its head CRC and
chunk CRCs recomputed unless a CRC is what breaks.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from typing import NamedTuple
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from format_spec.make_vectors import Rand  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac import transfer  # noqa: E402
from gaac.cache import PagedKVCache  # noqa: E402
from gaac.calibration import Calibration, epoch_canonical_bytes  # noqa: E402

VECTORS = HERE.parent


def bf16_data(rand: Rand, cal: Calibration, tokens: int, kind: int) -> np.ndarray:
    """uint16 ``[layers, heads, tokens, dim]`` around the bases a cache codes them with (each layer's newest
    epoch): per token and group of 8 channels, 90% of groups wholly in the 3-bit window, 8% with one exponent
    in the 4-bit window only, 2% with one anywhere (a raw group if outside both); random signs and mantissas.
    Tiles then need some escape bytes each, so that some fit their slots and others go raw."""
    layers, heads, dim = cal.layers, cal.kv_heads, cal.head_dim
    x = np.empty((layers, heads, tokens, dim), dtype=np.uint16)
    for layer in range(layers):
        b3, b4 = (b.astype(int) for b in cal.bases(layer, kind, cal.n_epochs(layer, kind) - 1))
        for h in range(heads):
            for t in range(tokens):
                for g in range(0, dim, L.GROUP_SIZE):
                    r, odd = rand.below(100), g + rand.below(L.GROUP_SIZE)
                    for c in range(g, g + L.GROUP_SIZE):
                        if c == odd and r >= 90:
                            e = int(b4[h, c]) + rand.below(16) if r < 98 else rand.below(256)
                        else:
                            e = int(b3[h, c]) + rand.below(8)
                        x[layer, h, t, c] = (rand.below(2) << 15) | (e << 7) | rand.below(128)
    return x


def rows(x: np.ndarray) -> list:
    """Per layer, per head, per token: the head_dim BF16 patterns as one hex string, 4 digits each."""
    return [[["".join(f"{int(e):04x}" for e in token) for token in head] for head in layer] for layer in x]


VECTOR_SPECS = {
    "seq_epochs": ("cal_epochs.json", 53, False, 11,
                   "a container with epoch records (layer 0 K epoch 2, layer 1 V epoch 1), raw tiles and a tail"),
    "seq_embedded": ("cal_d64.json", 37, True, 12,
                     "the file form: the calibration embedded (flag bit 0); unpacks with no calibration given"),
}


def generate(out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (cal_file, tokens, embed, seed, covers) in VECTOR_SPECS.items():
        cal = Calibration.load(VECTORS / cal_file)
        rand = Rand(seed)
        k, v = bf16_data(rand, cal, tokens, L.KIND_K), bf16_data(rand, cal, tokens, L.KIND_V)
        cache = PagedKVCache(cal, max_blocks=max(1, tokens // L.BLOCK_TOKENS), grow=True)
        data = bytes(cache.export_sequence(cache.add_sequence(k, v), calibration=embed))
        meta = describe(name, covers, f"../{cal_file}", cal, embed, tokens, data, k, v)
        (out / f"{name}.bin").write_bytes(data)
        (out / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
        written += [f"{name}.bin", f"{name}.json"]
    return written + sliced_vectors(out) + reject_vectors(out)


def describe(name: str, covers: str, cal_file: str, cal: Calibration, embed: bool, tokens: int, data: bytes,
             k: np.ndarray, v: np.ndarray) -> dict:
    """A valid vector's JSON: what FORMAT.md appendix A lists for ``seq_*``."""
    c = transfer.read_head(data)
    return {"name": name, "covers": covers, "calibration": cal_file,
            "calibration_id": f"{cal.id:08x}", "calibration_embedded": embed, "layers": cal.layers,
            "kv_heads": cal.kv_heads, "head_dim": cal.head_dim, "tokens": tokens, "bytes": len(data),
            "body_offset": c.layout.body_offset, "body_bytes": c.layout.body_bytes,
            "sections": [{"layer": s.layer, "kind": L.KIND_NAMES[s.kind], "escape_capacity": s.capacity,
                          "slot_tiles": s.slot_tiles, "raw_tiles": s.raw_tiles,
                          "epochs": [{"epoch": r.epoch, "bases_id": f"{r.bases_id:08x}"} for r in s.epochs]}
                         for s in c.layout.sections],
            "expected": {"k": rows(k), "v": rows(v)}}


SLICED_SPECS = {    # name: source vector (or None), source calibration, tokens, embedded, seed, heads, the sliced
    #                calibration's file, covers
    "seq_heads": ("seq_epochs", "cal_epochs.json", 53, False, 11, (1, 2), "cal_epochs_head1.json",
                  "KV head 1 of seq_epochs's sequence (FORMAT.md 11.12): epoch records with head 1's bases and the "
                  "sliced calibration's epoch ids, raw tiles and a tail"),
    "seq_heads_d256": (None, "cal_d256.json", 37, True, 13, (1, 2), "cal_d256_head1.json",
                       "KV head 1 of a head_dim 256 sequence (FORMAT.md 11.12: two tiles per head), the sliced "
                       "calibration embedded"),
}


def sliced_vectors(out: Path) -> list[str]:
    """The slices by KV head and their sliced calibrations; returns the file names written."""
    written = []
    for name, (vector, cal_file, tokens, embed, seed, (a, b), sliced_file, covers) in SLICED_SPECS.items():
        assert vector is None or VECTOR_SPECS[vector][:2] == (cal_file, tokens) and VECTOR_SPECS[vector][3] == seed
        cal = Calibration.load(VECTORS / cal_file)
        rand = Rand(seed)
        k, v = bf16_data(rand, cal, tokens, L.KIND_K), bf16_data(rand, cal, tokens, L.KIND_V)
        cache = PagedKVCache(cal, max_blocks=max(1, tokens // L.BLOCK_TOKENS), grow=True)
        data = bytes(transfer.export_sequence(cache, cache.add_sequence(k, v), calibration=embed, heads=(a, b)))
        sliced = cache.calibration.slice_heads(a, b)
        meta = describe(name, covers, sliced_file, sliced, embed, tokens, data, k[:, a:b], v[:, a:b])
        meta = {**meta, "sliced_from": {"vector": vector, "calibration": f"../{cal_file}", "heads": [a, b]}}
        sliced.save(out / sliced_file)
        (out / f"{name}.bin").write_bytes(data)
        (out / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
        written += [sliced_file, f"{name}.bin", f"{name}.json"]
    return written


# ----------------------------------------------------------------------------------------------
# Must-reject containers: a container cut into the fields of FORMAT.md 11.1-11.6, changed, and put back.

class Parts(NamedTuple):
    """A container's fields: header values (11.1), section records (11.2), epoch records (11.3: epoch, reserved,
    bases id, b3 and b4 bytes), the embedded calibration (11.4) or None, the chunk CRCs and the body."""

    header: tuple                # magic, version, element, flags, layers, heads, dim, tokens, cal id, E, reserved, B
    sections: tuple              # (capacity, epoch records, raw tiles) per section
    records: tuple               # (epoch, reserved, bases id, b3, b4) in container order
    calibration: bytes | None
    chunk_crcs: tuple
    body: bytes
    head_crc: int | None = None  # None: the CRC-32 of the head as written

    @classmethod
    def of(cls, data: bytes) -> "Parts":
        c = transfer.read_head(data)
        lay = c.layout
        table = lay.kv_heads * lay.head_dim
        records, at = [], L.SEQUENCE_HEADER.size + 2 * lay.layers * L.SEQUENCE_SECTION.size
        for _ in range(sum(len(s.epochs) for s in lay.sections)):
            epoch, zero, bases_id = L.SEQUENCE_EPOCH.unpack_from(data, at)
            at += L.SEQUENCE_EPOCH.size
            records.append((epoch, zero, bases_id, data[at:at + table], data[at + table:at + 2 * table]))
            at += 2 * table
        size = len(c.calibration.canonical_bytes()) if c.calibration is not None else 0
        sections = tuple(L.SEQUENCE_SECTION.unpack_from(data, L.SEQUENCE_HEADER.size + i * L.SEQUENCE_SECTION.size)
                         for i in range(2 * lay.layers))
        return cls(header=L.SEQUENCE_HEADER.unpack_from(data), sections=sections, records=tuple(records),
                   calibration=data[at:at + size] if size else None,
                   chunk_crcs=tuple(int(x) for x in c.chunk_crcs), body=data[lay.body_offset:])

    def rechunked(self) -> "Parts":
        """The same parts with the chunk CRCs of the body as it is."""
        chunk = L.SEQUENCE_CHUNK_BYTES
        return self._replace(chunk_crcs=tuple(zlib.crc32(self.body[i:i + chunk])
                                              for i in range(0, len(self.body), chunk)))

    def pack(self) -> bytes:
        head = L.SEQUENCE_HEADER.pack(*self.header) + b"".join(L.SEQUENCE_SECTION.pack(*r) for r in self.sections)
        head += b"".join(L.SEQUENCE_EPOCH.pack(*r[:3]) + r[3] + r[4] for r in self.records)
        head += (self.calibration or b"") + struct.pack(f"<{len(self.chunk_crcs)}I", *self.chunk_crcs)
        head += struct.pack("<I", zlib.crc32(head) if self.head_crc is None else self.head_crc)
        return head + bytes(-len(head) % L.SEQUENCE_ALIGN) + self.body


def _header(parts: Parts, **values) -> Parts:
    names = ("magic", "version", "element", "flags", "layers", "heads", "dim", "tokens", "cal_id", "records",
             "reserved", "body")
    return parts._replace(header=tuple(values.get(n, v) for n, v in zip(names, parts.header)))


def _body(parts: Parts, offset: int, value: bytes) -> Parts:
    """The body with ``value`` at ``offset`` and the chunk CRCs that cover it."""
    body = parts.body[:offset] + value + parts.body[offset + len(value):]
    return parts._replace(body=body).rechunked()


def _with_calibration(parts: Parts, canonical: bytes) -> Parts:
    """Embedded canonical bytes ``canonical``, and the header naming their CRC-32 as the calibration id."""
    return _header(parts._replace(calibration=canonical), cal_id=zlib.crc32(canonical))


def _epoch_base_cache() -> tuple[Calibration, PagedKVCache]:
    """``cal_one_head.json`` with an epoch 1 of layer 0 K (each base one above epoch 0's), in a cache that codes
    its K blocks with it."""
    cal = Calibration.load(VECTORS / "cal_one_head.json")
    b3, b4 = cal.bases(0, L.KIND_K)
    cal.add_epoch(0, L.KIND_K, np.minimum(b3.astype(int) + 1, L.B3_MAX), np.minimum(b4.astype(int) + 1, L.B4_MAX))
    return cal, PagedKVCache(cal, max_blocks=2, grow=True)


REJECT_TOKENS = 17


def reject_vectors(out: Path) -> list[str]:
    """The must-reject containers and their index ``reject.json``; returns the file names written."""
    cal, cache = _epoch_base_cache()
    rand = Rand(21)
    k, v = (bf16_data(rand, cal, REJECT_TOKENS, kind) for kind in (L.KIND_K, L.KIND_V))
    epochs = bytes(cache.export_sequence(cache.add_sequence(k, v)))
    plain = Calibration.load(VECTORS / "cal_one_head.json")
    cache = PagedKVCache(plain, max_blocks=2, grow=True)
    embedded = bytes(cache.export_sequence(cache.add_sequence(k, v), calibration=True))
    a, b = Parts.of(epochs), Parts.of(embedded)
    lay = transfer.read_head(epochs).layout
    k_sec, v_sec = lay.sections
    assert [len(s.epochs) for s in lay.sections] == [1, 0] and (v_sec.raw_tiles, v_sec.slot_tiles) == (1, 0)
    assert lay.head_bytes % L.SEQUENCE_ALIGN and a.pack() == epochs and b.pack() == embedded
    epoch, zero, _, r3, r4 = a.records[0]
    high = bytes([249]) + r3[1:]                     # b3 above B3_MAX: a base 3.2 rule 2 refuses
    high_id = zlib.crc32(epoch_canonical_bytes(plain.id, 0, L.KIND_K, epoch, np.frombuffer(high, np.uint8),
                                               np.frombuffer(r4, np.uint8)))
    cal_bytes = b.calibration
    b3_at = 20                                       # FORMAT.md 3.3: the first b3 of the canonical bytes

    one_head, A, B = "../cal_one_head.json", "epoch record", "embedded"
    cases = [   # name, rule, error, message, base, mutation, container, calibration, adapt
        ("reject_s1_truncated", "S1", "FormatError", "truncated sequence container", A,
         "the last body byte removed", epochs[:-1], one_head, True),
        ("reject_s2_magic", "S2", "FormatError", "bad magic", A, "magic GAACSEX",
         _header(a, magic=b"GAACSEX").pack(), one_head, True),
        ("reject_s3_version", "S3", "FormatError", "sequence container version", A, "version 3",
         _header(a, version=3).pack(), one_head, True),
        ("reject_s4_element", "S4", "FormatError", "element format", A, "element format 2 (FP8 E4M3)",
         _header(a, element=2).pack(), one_head, True),
        ("reject_s5_flags", "S5", "FormatError", "reserved flags or field", A, "flag bit 1 set",
         _header(a, flags=2).pack(), one_head, True),
        ("reject_s6_head_dim", "S6", "FormatError", "bad header", A, "head_dim 96",
         _header(a, dim=96).pack(), one_head, True),
        ("reject_s7_capacity", "S7", "FormatError", "bad section record", A,
         "layer 0 K's escape capacity 24, not a multiple of 16",
         a._replace(sections=((24,) + a.sections[0][1:],) + a.sections[1:]).pack(), one_head, True),
        ("reject_s8_records", "S8", "FormatError", "bad header", A,
         "the header's epoch record count 0; layer 0 K's section record lists 1",
         _header(a, records=0).pack(), one_head, True),
        ("reject_s9_head_crc", "S9", "FormatError", "head CRC-32 mismatch", A, "the head CRC's low byte flipped",
         a._replace(head_crc=zlib.crc32(a.pack()[:lay.head_bytes - 4]) ^ 0xFF).pack(), one_head, True),
        ("reject_s10_padding", "S10", "FormatError", "padding after the head CRC", A,
         "the last padding byte before the body 1",
         epochs[:lay.body_offset - 1] + b"\x01" + epochs[lay.body_offset:], one_head, True),
        ("reject_s11_reserved", "S11", "FormatError", "bad epoch record", A, "the epoch record's reserved field 1",
         a._replace(records=((epoch, 1) + a.records[0][2:],)).pack(), one_head, True),
        ("reject_s12_crc", "S12", "FormatError", "embedded calibration", B,
         "the embedded calibration's first b3 one higher (the header's id unchanged)",
         b._replace(calibration=cal_bytes[:b3_at] + bytes([cal_bytes[b3_at] + 1]) + cal_bytes[b3_at + 1:]).pack(),
         None, True),
        ("reject_s12_magic", "S12", "FormatError", "embedded calibration", B,
         "the embedded calibration's magic GAACCAX (the header names its CRC-32)",
         _with_calibration(b, b"GAACCAX" + cal_bytes[7:]).pack(), None, True),
        ("reject_s12_dimensions", "S12", "FormatError", "embedded calibration", B,
         "the embedded calibration's head_dim 128, the header's 64 (the header names its CRC-32)",
         _with_calibration(b, cal_bytes[:16] + struct.pack("<I", 128) + cal_bytes[20:]).pack(), None, True),
        ("reject_s13_chunk_crc", "S13", "FormatError", "CRC-32 mismatch", A,
         "a slot byte of layer 0 K flipped, the chunk CRC table unchanged",
         a._replace(body=a.body[:k_sec.slots + 100] + bytes([a.body[k_sec.slots + 100] ^ 0x10])
                 + a.body[k_sec.slots + 101:]).pack(), one_head, True),
        ("reject_s14_padding", "S14", "FormatError", "padding after its block table", A,
         "the last padding byte after layer 0 K's block table 1",
         _body(a, k_sec.block_epochs - 1, b"\x01").pack(), one_head, True),
        ("reject_s15_epoch", "S15", "FormatError", "block epochs", A,
         "layer 0 K's block of epoch 1 says epoch 2, which has no record",
         _body(a, k_sec.block_epochs, struct.pack("<H", 2)).pack(), one_head, True),
        ("reject_s16_unused_record", "S16", "FormatError", "no block uses", A,
         "layer 0 K's block of epoch 1 says epoch 0: the section's record of epoch 1 is then used by no block",
         _body(a, k_sec.block_epochs, struct.pack("<H", 0)).pack(), one_head, True),
        ("reject_c1_calibration", "C1", "CalibrationError", "exported from a cache with calibration", A,
         "none: the container read with cal_edge.json, another calibration", epochs, "../cal_edge.json", True),
        ("reject_c2_capacity", "C2", "CalibrationError", "differs from the calibration", A,
         "layer 0 V's escape capacity 16, the calibration's 0 (its one tile is raw: no size changes)",
         a._replace(sections=a.sections[:1] + ((16,) + a.sections[1][1:],)).pack(), one_head, True),
        ("reject_c3_bases", "C3", "CalibrationError", "bases above", A,
         "the epoch record's first b3 249, its bases id recomputed",
         a._replace(records=((epoch, zero, high_id, high, r4),)).pack(), one_head, True),
        ("reject_c4_embedded", "C4", "CalibrationError", "embedded calibration breaks", B,
         "the embedded calibration's first b3 249 (the header names its CRC-32)",
         _with_calibration(b, cal_bytes[:b3_at] + bytes([249]) + cal_bytes[b3_at + 1:]).pack(), None, True),
        ("reject_c5_no_epochs", "C5", "CalibrationError", "adapt=True", A,
         "none: the container imported into a cache that keeps no epochs", epochs, one_head, False),
    ]
    index, written = [], []
    for name, rule, error, message, base, mutation, data, calibration, adapt in cases:
        (out / f"{name}.bin").write_bytes(data)
        written.append(f"{name}.bin")
        index.append({"name": name, "covers": f"must reject: rule {rule} of FORMAT.md 11.7",
                      "derived_from": f"{REJECT_TOKENS} tokens of cal_one_head.json, {base}", "mutation": mutation,
                      "rule": rule, "error": error, "message": message, "calibration": calibration, "adapt": adapt})
    (out / "reject.json").write_text(json.dumps(index, indent=1) + "\n")
    return written + ["reject.json"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    for name in generate(args.out):
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
