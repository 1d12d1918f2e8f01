"""Compression ratios on the real SmolLM2-135M caches: self- and cross-calibrated (issue 2, "done when").

For every pair (A, B) of the four dumps in ``../shared/data/kv`` (prose, code,
math, list), calibrate on A's K and V and measure B with ``gaac.stats.measure``
(every complete block encoded, decoded and compared bit for bit).  A == B is
self-calibration (the oracle); A != B is cross-task transfer, as in the
paper's Table 3.  Writes a markdown table with the date, machine, commit and
command, by default to ``benchmarks/results/ratios-smollm2.md``.

    python benchmarks/ratios.py [--data DIR] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))      # run from a checkout without installing: the gaac next to this script

from benchmarks.report import commit_with_changes  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.calibration import Calibration, calibrate  # noqa: E402
from gaac.io import load_cache  # noqa: E402
from gaac.stats import measure  # noqa: E402

PROMPTS = ("prose", "code", "math", "list")
PREFIX = "smollm2-135m-instruct-q4_1__"
PAPER = "1.402-1.406"
MARGINS = (L.SLOT_ALIGN, 2 * L.SLOT_ALIGN)     # capacity margins tried, bytes
ALL_3BIT = 16 / (8 + L.CODE_BITS + L.TAG_BITS / L.GROUP_SIZE)


def with_margin(cal: Calibration, margin: int) -> Calibration:
    """``cal`` with every escape capacity ``margin`` bytes larger: how much do tight slots cost elsewhere?"""
    return Calibration(b3=cal.b3, b4=cal.b4, capacity=cal.capacity + margin, model=cal.model)


def span(values) -> str:
    lo, hi = int(np.min(values)), int(np.max(values))
    return str(lo) if lo == hi else f"{lo}-{hi}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "kv"), help="folder of the dumps")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ratios-smollm2.md"))
    args = ap.parse_args(argv)

    data = Path(args.data)
    caches = {p: (load_cache(data / f"{PREFIX}{p}__k.npy", "k"), load_cache(data / f"{PREFIX}{p}__v.npy", "v"))
              for p in PROMPTS}
    cals = {p: calibrate(k, v, model="SmolLM2-135M-Instruct") for p, (k, v) in caches.items()}

    rows, results = [], {}
    t0 = time.perf_counter()
    for a in PROMPTS:
        for b in PROMPTS:
            # adapt=False: the fixed calibration of issue 2's table (epochs, gaac.epochs, are measured in drift.py).
            d = measure(*caches[b], cals[a], adapt=False).as_dict()
            results[a, b] = d
            wider = {m: measure(*caches[b], with_margin(cals[a], m), adapt=False).as_dict() for m in MARGINS}
            for kind in ("k", "v"):
                s = d[kind]
                rows.append(f"| {a} | {b} | {'self' if a == b else 'cross'} | {kind.upper()} | "
                            f"{s['ratio_stream']:.4f} | {s['ratio_resident']:.4f} | {100 * s['frac_3bit']:.2f} | "
                            f"{100 * s['frac_4bit']:.2f} | {100 * s['frac_raw']:.3f} | "
                            f"{100 * s['frac_raw_tiles']:.2f} | {s['exponent_entropy']:.3f} | "
                            f"{'yes' if s['roundtrip'] else 'NO'} | {span(s['capacity'])} | "
                            + " | ".join(f"{wider[m][kind]['ratio_resident']:.4f} "
                                         f"({100 * wider[m][kind]['frac_raw_tiles']:.1f})" for m in MARGINS)
                            + " |")
            print(f"{a:>5} -> {b:<5}  K {d['k']['ratio_stream']:.4f}/{d['k']['ratio_resident']:.4f}  "
                  f"V {d['v']['ratio_stream']:.4f}/{d['v']['ratio_resident']:.4f}", file=sys.stderr)
    seconds = time.perf_counter() - t0

    def both(pairs, field):
        vals = [results[p][kind][field] for p in pairs for kind in ("k", "v")]
        return min(vals), max(vals)

    selfs = [(p, p) for p in PROMPTS]
    cross = [(a, b) for a in PROMPTS for b in PROMPTS if a != b]
    from_prose = [("prose", b) for b in PROMPTS if b != "prose"]
    s_lo, s_hi = both(selfs, "ratio_stream")
    c_lo, c_hi = both(cross, "ratio_stream")
    p_lo, p_hi = both(from_prose, "ratio_stream")
    r_lo, r_hi = both(selfs + cross, "ratio_resident")
    rs_lo, rs_hi = both(selfs, "ratio_resident")
    rp_lo, rp_hi = both(from_prose, "ratio_resident")
    short = [(a, b) for a in ("math", "list") for b in PROMPTS if a != b]
    rq_lo, rq_hi = both(short, "ratio_resident")
    tq_lo, tq_hi = both(short, "frac_raw_tiles")
    all_ok = all(results[p][kind]["roundtrip"] for p in results for kind in ("k", "v"))
    tokens = ", ".join(f"{p} {caches[p][0].shape[2]}" for p in PROMPTS)

    text = f"""# Compression ratios on real SmolLM2-135M-Instruct KV caches

- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}
- machine: {platform.machine()}, {platform.system()} {platform.release()}, Python {platform.python_version()},
  NumPy {np.__version__} (CPU, NumPy reference codec: sizes do not depend on the device)
- commit: {commit_with_changes('benchmarks/ratios.py')}
- command: `python benchmarks/ratios.py` ({seconds:.0f} s for the {len(results)} measurements)
- data: `../shared/data/kv` (30 layers, 3 KV heads, head_dim 64; tokens: {tokens}); every complete
  16-token block of every layer encoded with `gaac.reference`, decoded and compared bit for bit

Each row calibrates on the dump in "calibrated on" (all its tokens; K and V) and measures the dump in
"measured" with `gaac.stats.measure`. `ratio_stream` = BF16 bytes / (sign+mantissa + codes + tags + the
escape bytes each tile needs); `ratio_resident` = BF16 bytes / (fixed-capacity slots + raw BF16 tiles for
slot overflows + 4-byte block-table entries). Fractions are of 8-channel groups (3-bit, 4-bit, raw) and
of tiles (raw tiles). "capacity" is the per-layer escape capacity (bytes) the calibration chose; the
last columns measure again with every capacity {" and ".join(f"+{m}" for m in MARGINS)} bytes, to show what
a capacity fitted tightly to the calibration data costs on other data.

| calibrated on | measured | | kind | ratio_stream | ratio_resident | 3-bit % | 4-bit % | raw % | raw tiles % | entropy (bits) | roundtrip | capacity | {" | ".join(f"resident, capacity +{m} (raw tiles %)" for m in MARGINS)} |
|---|---|---|---|---|---|---|---|---|---|---|---|---|{"---|" * len(MARGINS)}
{chr(10).join(rows)}

**Reading.** Every measurement round-trips bit for bit ({'all' if all_ok else 'NOT all'} {2 * len(results)}).
Self-calibrated stream ratios are {s_lo:.3f}-{s_hi:.3f}, cross-calibrated {c_lo:.3f}-{c_hi:.3f}
(calibrated on prose, measured on the other three: {p_lo:.3f}-{p_hi:.3f}), against the paper's
{PAPER} cross-task on larger models and the all-3-bit bound 16/11.25 = {ALL_3BIT:.3f}.

Resident ratios pay for unused slot capacity, raw-tile fallbacks and block-table entries: {rs_lo:.3f}-{rs_hi:.3f}
self-calibrated, {rp_lo:.3f}-{rp_hi:.3f} calibrated on prose, {r_lo:.3f}-{r_hi:.3f} over all pairs. They are
far more sensitive to the calibration data than the stream ratio: a calibration from the short dumps
(math, list: {caches['math'][0].shape[2]} and {caches['list'][0].shape[2]} tokens) sends {100 * tq_lo:.0f}-{100 * tq_hi:.0f}% of the other dumps' tiles
to the raw pool (resident {rq_lo:.3f}-{rq_hi:.3f}): their windows and their capacity, fitted tightly to few
tokens, miss more of the other texts' exponents (the paper's RoPE positional drift of K is one candidate
cause; this table does not separate it). The last two columns show how much a larger capacity recovers.
"""
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
