"""Slot capacities on 128-byte lines against the fewest bytes: each layer's fused attention, one GPU.

    python benchmarks/slot_line.py --out benchmarks/results/slot-line-h100.md

The serving benchmark's content (benchmarks/decode_step.py's ``real_source``: real SmolLM2 K/V tiled to 8 KV
heads of 128) in its first ``--layers`` layers, calibrated on its first 1024 tokens as a user calibrates, one
``--tokens``-token sequence in a ``PagedKVCache`` (its defaults), each layer's attention through
``AttentionPlan`` timed from CUDA-graph replays (median of 9).  The calibration's capacities are chosen three ways:
``fewest`` (``slot_line=None``: the fewest resident bytes), ``default`` (``gaac.calibrate``'s default: a lined
capacity where it costs at most 1% more) and ``lined`` (``slot_line=128``: lined whatever it costs); the rounds
alternate, twice.  Reports each layer's microseconds and capacities and the cache's ``memory()``.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

import report  # noqa: E402

from gaac.calibration import PREFERRED_LINE  # noqa: E402

CHOICES = {"fewest": None, "default": PREFERRED_LINE, "lined": 128}     # gaac.calibrate's slot_line


def measure(args) -> dict:
    import torch

    import decode_step as ds
    import gaac
    from gaac.attention import AttentionPlan
    from timing import graph_time_us

    s = ds.LLAMA_8B
    k_u, v_u = ds.real_source(ds.find_data(args.data), s)
    k_u, v_u = k_u[:args.layers], v_u[:args.layers]
    src = ds.Source(k_u, v_u)
    runs = []
    for rnd in range(args.rounds):
        for name, line in CHOICES.items():
            cal = gaac.calibrate(k_u[:, :, :1024], v_u[:, :, :1024], slot_line=line, show_progress=False)
            cache = gaac.PagedKVCache(cal, max_seqs=1, max_blocks=args.tokens // 16 + 2, device="cuda")
            dense = [src.dense(layer, 1, args.tokens) for layer in range(args.layers)]
            cache.add_sequence(torch.stack([d[0][0] for d in dense]).view(torch.int16),
                               torch.stack([d[1][0] for d in dense]).view(torch.int16))
            del dense
            q = torch.randn((1, s.q_heads, s.head_dim), device="cuda").to(torch.bfloat16)
            out = torch.empty((1, s.q_heads, s.head_dim), dtype=torch.int16, device="cuda")
            lse = torch.empty((1, s.q_heads), dtype=torch.float32, device="cuda")
            us = []
            for layer in range(args.layers):
                plan = AttentionPlan(cache.layer_view(layer), s.q_heads)
                us.append(round(graph_time_us(lambda i, p=plan: p.run(q, out=out, lse=lse), 1, 9), 1))
            runs.append(dict(round=rnd, choice=name, capacity=np.asarray(cal.capacity).tolist(), us=us,
                             mean_us=round(statistics.mean(us), 2), memory=str(cache.memory())))
            print(f"{name}: mean {runs[-1]['mean_us']} us, by layer {us}; {runs[-1]['memory']}", flush=True)
            del cache
            torch.cuda.empty_cache()
    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=torch.cuda.get_device_name(),
                machine=f"{platform.machine()} {platform.node()}", commit=report.commit(),
                command="slot_line.py " + " ".join(sys.argv[1:]), layers=args.layers, tokens=args.tokens, runs=runs)


def render(rep: dict) -> str:
    lines = report.head("Slot capacities on 128-byte lines against the fewest bytes: the fused attention by layer",
                        rep)
    lines += [f"- the serving benchmark's content in its first {rep['layers']} layers (8 KV heads x 128), one "
             f"{rep['tokens']}-token sequence, a calibration from its first 1024 tokens; each layer's "
             "`AttentionPlan` from CUDA-graph replays (median of 9), us",
             "- one component's time, a best case beside the user's loop: the serving loop at the defaults is "
             "serving.py's (`benchmarks/results/serving-*.md`)", ""]
    rows = [[r["round"], f"{r['choice']}: K " + " ".join(map(str, r["capacity"][0])) + " / V "
             + " ".join(map(str, r["capacity"][1])), " ".join(f"{u:.1f}" for u in r["us"]), f"{r['mean_us']:.1f}",
             r["memory"].split(";")[-1].strip()] for r in rep["runs"]]
    lines += report.table(["round", "capacities", "us by layer", "mean us", "memory"], rows)
    means = {}
    for r in rep["runs"]:
        means.setdefault(r["choice"], []).append(r["mean_us"])
    lines += ["", "Means over the rounds: " + ", ".join(f"{k} {statistics.mean(v):.1f} us" for k, v in means.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data", default=None, help="the K/V dumps' folder (default: .devdata/kv or ../shared/data/kv)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    report.write(measure(args), args.out, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
