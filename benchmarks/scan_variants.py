"""The adaptation rule's scan kernel and variants of it that leave a part out: where its time goes.

    python benchmarks/scan_variants.py --out $OUT/scan-variants-h100.md      # a GPU

Each variant is this checkout's ``gaac/cuda/epochs.py`` with one part of :func:`gaac.cuda.epochs.scan_kernel`'s
loop replaced in its source: ``match`` counts the exponents a warp at a time (``match_any_sync``, one atomic per
distinct exponent: same outputs); the others, marked ``*``, are for timing only and give wrong outputs:
``noload*`` makes the next check's tokens from registers instead of loading them, ``nowin*`` drops the windows'
reads of the next lanes' bins, ``nomark*`` replaces the marks' window tests by one operation, ``plain*`` counts
with plain shared-memory adds instead of atomics, ``bare*`` all four.  All run on scan_ab.py's inputs (a
``--tokens`` prompt of the Llama-3.1-8B KV shape, the real content, adapters calibrated on its first
``--cal-tokens`` tokens), with CUDA events, in the order of the list and then reversed, round after round; the
first round is a warm-up (it compiles).  Whether each variant's outputs equal the kernel's is reported.

A kernel's time, not a user's: the prompt is ``prompt_ab.py``'s figure.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import gaac.cuda.epochs as here  # noqa: E402
import gaac.epochs as E  # noqa: E402
from gaac import layout as L  # noqa: E402
from benchmarks.report import gpu_run, head, table  # noqa: E402
from scan_ab import scan_batch  # noqa: E402

SOURCE = ROOT / "gaac" / "cuda" / "epochs.py"
ATOM = "                cuda.atomic.add(cnt, u32(row32 + u32(e + (e >> u32(3)))), ONE)   # unsigned: no wrap-around\n"
MATCH = ("                mk = u32(cuda.match_any_sync(i32(-1), i32(e)))\n"
         "                if u32(mk & u32(u32(u32(1) << u32(lane)) - u32(1))) == u32(0):\n"
         "                    cuda.atomic.add(cnt, u32(row32 + u32(e + (e >> u32(3)))), i32(popc(mk)))\n")
PLAIN = "                cnt[u32(row32 + u32(e + (e >> u32(3))))] += ONE\n"
LOAD = ("                xw0, xw1, xw2, xw3 = token(xa, xb, ja, rec, job, r, i32(i32(i32(j + ONE) * i32(every)) + b0), "
        "h, t, d0)\n")
NOLOAD = "                xw0, xw1, xw2, xw3 = u32(xw1 + u32(j)), u32(xw2 ^ u32(tid)), u32(xw3 + u32(7)), u32(xw0 ^ u32(j))\n"
WIN = ("                first = hb[k]\n"
       "                a3 = i32(a3 + i32(hs[nextu + u64(k)] - first))\n"
       "                a4 = i32(a4 + i32(hs[next2u + u64(k)] - first))\n")
NOWIN = ("                first = hb[k]\n"
         "                a3 = i32(a3 - first)\n"
         "                a4 = i32(a4 - first)\n")
MARK = ("                m = u32(m | u32(word_marks(w, wi, cl3, ch3, cl4, ch4, nl3, nh3, nl4, nh4)\n"
        "                                & u32(0xFFFFFFFF >> (8 * (4 - n)))))\n")
NOMARK = "                m = u32(m ^ u32(w + u32(nl3)))\n"


def variants(src: str) -> dict:
    """Each variant's source: the kernel's with its parts replaced (a part the kernel no longer has is an error)."""
    for part in (ATOM, LOAD, WIN, MARK):
        if src.count(part) != 1:
            raise SystemExit(f"gaac/cuda/epochs.py no longer holds this part of the scan's loop:\n{part}")
    return {"match": src.replace(ATOM, MATCH), "noload*": src.replace(LOAD, NOLOAD), "nowin*": src.replace(WIN, NOWIN),
            "nomark*": src.replace(MARK, NOMARK), "plain*": src.replace(ATOM, PLAIN),
            "bare*": src.replace(LOAD, NOLOAD).replace(WIN, NOWIN).replace(MARK, NOMARK).replace(ATOM, PLAIN)}


def module(name: str, text: str):
    """``text`` as a module beside this checkout's ``gaac.cuda.epochs`` (its relative imports resolve)."""
    spec = importlib.util.spec_from_loader(f"gaac.cuda.epochs_{name.strip('*')}", loader=None)
    m = importlib.util.module_from_spec(spec)
    m.__file__ = str(SOURCE)
    sys.modules[spec.name] = m
    exec(compile(text, m.__file__, "exec"), m.__dict__)
    return m


def measure(args) -> dict:
    batch = scan_batch(args.tokens, args.cal_tokens)
    a = batch.scan_args
    outs = (a[6], a[7], a[10], a[11])              # histograms (also an input), candidates, savings, flags
    hist0 = a[6].clone()
    kernels = {"this": here.scan_kernel(E.ADAPT_EVERY, E.DECAY_SHIFT, here.SCAN_REGISTERS)}
    for name, text in variants(SOURCE.read_text()).items():
        kernels[name] = module(name, text).scan_kernel(E.ADAPT_EVERY, E.DECAY_SHIFT, here.SCAN_REGISTERS)
    names = list(kernels)
    ms, got = {w: [] for w in names}, {}
    for r in range(args.rounds + 1):
        for w in (names if r % 2 == 0 else names[::-1]):
            a[6].copy_(hist0)
            for t in outs[1:]:
                t.zero_()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            batch._launch(kernels[w], batch.scan_grid, L.GROUP_SIZE * here.WARP, a)
            end.record()
            torch.cuda.synchronize()
            if r:
                ms[w].append(round(start.elapsed_time(end), 3))
            got[w] = [t.clone() for t in outs]
    same = {w: all(torch.equal(x, y) for x, y in zip(got[w], got["this"])) for w in names}
    return dict(ms=ms, identical=same, jobs=len(batch.jobs), checks=int(batch.checks.max()))


def render(rep: dict) -> str:
    r = rep["results"]
    rows = [[w, f"{statistics.median(v):.2f}", f"{min(v):.2f} - {max(v):.2f}", "yes" if r["identical"][w] else "no"]
            for w, v in r["ms"].items()]
    lines = head("The rule's scan kernel and variants of it that leave a part out", rep)
    lines += [f"- {rep['machine']}, torch {rep['torch']}", "",
              *table(["kernel", "ms (median)", "ms (range)", "outputs as the kernel's"], rows), "",
              f"{rep['args']['tokens']} tokens x {r['jobs']} jobs ({r['checks']} checks each), calibration from the "
              f"first {rep['args']['cal_tokens']} tokens; the variants marked * are for timing only "
              "(benchmarks/scan_variants.py says what each leaves out).  A kernel's time, not a user's."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--cal-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each runs every kernel)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    rep = gpu_run("scan_variants.py", "times the scan kernel", argv, args, measure, render)
    return 0 if rep["results"]["identical"]["match"] else 1


if __name__ == "__main__":
    sys.exit(main())
