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

from format_spec.make_vectors import Rand  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac import transfer  # noqa: E402
from gaac.cache import PagedKVCache  # noqa: E402
from gaac.calibration import Calibration  # noqa: E402

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
        c = transfer.read_head(data)
        meta = {"name": name, "covers": covers, "calibration": f"../{cal_file}",
                "calibration_id": f"{cal.id:08x}", "calibration_embedded": embed, "layers": cal.layers,
                "kv_heads": cal.kv_heads, "head_dim": cal.head_dim, "tokens": tokens, "bytes": len(data),
                "body_offset": c.layout.body_offset, "body_bytes": c.layout.body_bytes,
                "sections": [{"layer": s.layer, "kind": L.KIND_NAMES[s.kind], "escape_capacity": s.capacity,
                              "slot_tiles": s.slot_tiles, "raw_tiles": s.raw_tiles,
                              "epochs": [{"epoch": r.epoch, "bases_id": f"{r.bases_id:08x}"} for r in s.epochs]}
                             for s in c.layout.sections],
                "expected": {"k": rows(k), "v": rows(v)}}
        (out / f"{name}.bin").write_bytes(data)
        (out / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
        written += [f"{name}.bin", f"{name}.json"]
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    for name in generate(args.out):
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
