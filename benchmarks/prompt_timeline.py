"""Where a long prompt's time goes: one 128K-token prompt into a new cache under torch's profiler.

    python benchmarks/prompt_timeline.py --out $OUT/prompt-timeline-h100.md      # a GPU

The prompt of ``prompt_ab.py`` (the Llama-3.1-8B KV shape, the real content of ``decode_step.py``, the cache's
defaults, a calibration from the first ``--cal-tokens`` tokens, ``add_sequence`` of every layer), three times
unprofiled (the first compiles), then once under torch's profiler: each kernel and copy by name (how many, the
time it ran, and from when to when after the first CUDA call of the prompt), the host's synchronisations longer
than 0.2 ms, and the GPU's idle gaps of 0.3 ms or more (the host's turns).  A diagnostic of one prompt, not a
user's figure: the user's figure is ``prompt_ab.py``'s (medians of several prompts, unprofiled).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import gaac  # noqa: E402
from benchmarks.report import gpu_run, head  # noqa: E402
from prompt_ab import long_prompt  # noqa: E402


def measure(args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cal, _, k, v = long_prompt(args.tokens, args.cal_tokens)

    def new_cache():
        return gaac.PagedKVCache(cal, max_blocks=args.tokens // 16 + 2, device="cuda")

    warm = []
    for _ in range(3):
        cache = new_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.add_sequence(k, v)
        torch.cuda.synchronize()
        warm.append(round(1e3 * (time.perf_counter() - t0), 1))
    cache = new_cache()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        cache.add_sequence(k, v)
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t0)
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    os.unlink(path)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    t0 = min(e["ts"] for e in runtime + gpu)
    by = collections.OrderedDict()
    for e in sorted(gpu, key=lambda e: e["ts"]):
        d = by.setdefault(e["name"][:70], [0, 0.0, 1e18, 0.0])
        d[0] += 1
        d[1] += e["dur"]
        d[2] = min(d[2], e["ts"])
        d[3] = max(d[3], e["ts"] + e["dur"])
    kernels = [[name, n, dur / 1e3, (a - t0) / 1e3, (z - t0) / 1e3] for name, (n, dur, a, z) in by.items()]
    waits = [[e["name"], (e["ts"] - t0) / 1e3, e["dur"] / 1e3] for e in sorted(runtime, key=lambda e: e["ts"])
             if ("Synchronize" in e["name"] or "Query" in e["name"]) and e["dur"] > 200]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    idle, end = [], spans[0][1]
    for a, z in spans[1:]:
        if a - end > 300:
            idle.append([(end - t0) / 1e3, (a - t0) / 1e3])
        end = max(end, z)
    return dict(warm_ms=warm, profiled_ms=round(wall, 1), kernels=kernels, waits=waits, idle=idle,
                gpu_end_ms=(end - t0) / 1e3)


def render(rep: dict) -> str:
    r = rep["results"]
    lines = head("Where a 128K-token prompt's time goes (torch's profiler, one prompt)", rep)
    lines += [f"- {rep['machine']}, torch {rep['torch']}", "",
              f"Unprofiled prompts, ms (the first compiles): {r['warm_ms']}; under the profiler {r['profiled_ms']} ms.",
              "", "```"]
    lines += [f"GPU {name:70s} n={n:4d} busy {busy:7.2f} ms  span {a:7.2f}-{z:7.2f}" for name, n, busy, a, z in r["kernels"]]
    lines += [f"HOST {name} at {at:7.2f} ms for {ms:.2f} ms" for name, at, ms in r["waits"]]
    lines += [f"IDLE {a:7.2f} - {z:7.2f} ms ({z - a:.2f})" for a, z in r["idle"]]
    lines += [f"GPU last end {r['gpu_end_ms']:.2f} ms", "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--cal-tokens", type=int, default=1024)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    gpu_run("prompt_timeline.py", "profiles a prompt", argv, args, measure, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
