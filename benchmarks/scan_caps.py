"""The adaptation rule's scan kernel at several register caps, on a 128K-token prompt's jobs (GPU only).

    python benchmarks/scan_caps.py --caps 64,72,80,96,64 --out $OUT/scan-caps-h100.md

The Llama-3.1-8B KV shape (32 layers x K and V: 64 jobs of 8 KV heads x 128) holding the real K/V of
``decode_step.py``, calibration from the first 1024 tokens, new adapters (a new cache's prefill).  Per cap: a
:class:`gaac.cuda.epochs.Batch` made and its scan timed with CUDA events, ``--runs`` times after one dropped
(the compile), the median kept; the scan's outputs (histograms, candidate windows, savings, flags) compared bit
for bit with the first cap's.  The kernel's register cap is :data:`gaac.cuda.epochs.SCAN_REGISTERS`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_step as DS  # noqa: E402
import torch  # noqa: E402

import gaac  # noqa: E402
import gaac.cuda.epochs as E  # noqa: E402
from gaac import epochs as GE  # noqa: E402
from benchmarks.report import commit, table, write  # noqa: E402
from equal_memory import tokens_at as content  # noqa: E402


def render(rep: dict) -> str:
    rows = [[str(r["cap"]), " ".join(f"{x:.2f}" for x in r["ms"]), f"{r['median']:.2f}", "yes" if r["same"] else "NO"]
            for r in rep["rows"]]
    return "\n".join([f"# The rule's scan kernel at register caps ({rep['device']})", "",
                      f"- date: {rep['date']}", f"- commit: {rep['commit']}", f"- command: `{rep['command']}`",
                      f"- {rep['tokens']} tokens x {rep['jobs']} jobs (8 x 128 channels each), calibration from the "
                      "first 1024 tokens, new adapters; CUDA events around the scan's launch", "",
                      *table(["register cap", "ms (runs)", "median ms", "outputs as the first cap's"], rows), ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", default="64,72,80,96,64", help="register caps, in the order timed")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--runs", type=int, default=3, help="timed scans a cap, after one dropped")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    s = DS.LLAMA_8B
    k_u, v_u = DS.real_source(DS.find_data(None), s)
    cal = gaac.calibrate(k_u[:, :, :1024], v_u[:, :, :1024], show_progress=False)
    src = DS.Source(k_u, v_u)
    kk, vv = zip(*(content(src, layer, 0, 0, args.tokens) for layer in range(s.layers)))
    k, v = torch.stack(kk), torch.stack(vv)
    del kk, vv
    n = args.tokens // 16

    def jobs():
        c = cal.copy()
        return [(GE.Adapter(c, layer, kind), x[layer].view(s.kv_heads, n, 16, s.head_dim).transpose(0, 1))
                for kind, x in ((0, k), (1, v)) for layer in range(s.layers)]

    rep = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(), "commit": commit(),
           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "tokens": args.tokens,
           "jobs": 2 * s.layers, "rows": []}
    first = None
    for cap in (int(c) for c in args.caps.split(",")):
        E.SCAN_REGISTERS = cap
        times = []
        for r in range(args.runs + 1):
            batch = E.Batch(jobs())
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            batch.scan()
            end.record()
            torch.cuda.synchronize()
            if r:
                times.append(start.elapsed_time(end))
        out = [t.clone() for t in (batch.hist, batch.cand, batch.saved0, batch.differs0)]
        same = first is None or all(torch.equal(a, b) for a, b in zip(out, first))
        first = first or out
        rep["rows"].append({"cap": cap, "ms": times, "median": statistics.median(times), "same": same})
        DS.log(f"  cap {cap}: {statistics.median(times):.2f} ms")
        del batch, out
    write(rep, args.out, render)
    print(render(rep))


if __name__ == "__main__":
    main()
