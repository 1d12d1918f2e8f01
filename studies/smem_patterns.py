"""What a warp-wide shared-memory load costs for the access patterns of the attention kernel's decoder.

    python studies/smem_patterns.py [--out benchmarks/results/smem-patterns-h200.md]

Every SM runs many warps that repeat one load of one pattern (a byte offset per lane) as fast as the
shared-memory pipe allows; the time per warp-instruction, relative to a conflict-free 16-byte load of
32 distinct chunks (4 wavefronts by the hardware's rule), gives the wavefronts a pattern costs.  It is
meant to decide a layout before the kernel is changed (not yet run; docs/design/attention.md, "Open
leads"): ncu counts wavefronts per instruction, but only of the layout a kernel already has,
and Nsight's "ideal" column does not say whether broadcast reads of a few distinct 16-byte chunks merge.

Patterns (``t = lane % 16``, ``h = lane // 16``, as in the decoder):
- ``distinct`` 16 l; ``same`` one address; ``halves_same_bank``: 128 h; ``halves_apart``: 48 h;
- ``bases_now_{2,3}``: a group's base row as laid out now, ``272 m + 128 h`` with m one of 2 (3) mode rows
  drawn per lane; ``bases_apart_{2,3}``: the half-rows of h = 1 moved to other banks, ``144 m + 432 h``;
- ``code_now`` (8-byte loads at ``48 t + 24 h``), ``code_new_128`` (``48 t + 32 h``) and ``code_new_64``
  (8 bytes at ``48 t + 16 + 8 h``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import cuda, uint32  # noqa: E402

from benchmarks.report import commit, table, write  # noqa: E402
from gaac.cuda.primitives import lds2, lds4, smem_base  # noqa: E402

SMEM_WORDS = 2048                       # 8 KB of shared memory a block
UNROLL = 8
WARPS = 8                               # warps a block


def patterns(seed: int = 1) -> dict[str, tuple[int, np.ndarray]]:
    """name -> (load width in words, byte offset per lane)."""
    rng = np.random.default_rng(seed)
    lane = np.arange(32)
    t, h = lane % 16, lane // 16
    m2, m3 = rng.integers(0, 2, 32), rng.integers(0, 3, 32)
    return {
        "distinct": (4, 16 * lane),
        "same": (4, 0 * lane),
        "halves_same_bank": (4, 128 * h),
        "halves_apart": (4, 48 * h),
        "bases_now_2": (4, 272 * m2 + 128 * h),
        "bases_now_3": (4, 272 * m3 + 128 * h),
        "bases_apart_2": (4, 144 * m2 + 432 * h),
        "bases_apart_3": (4, 144 * m3 + 432 * h),
        "code_now": (2, 48 * t + 24 * h),
        "code_new_128": (4, 48 * t + 32 * h),
        "code_new_64": (2, 48 * t + 16 + 8 * h),
        "distinct_64": (2, 8 * lane),
    }


def kernel(width: int):
    load = lds4 if width == 4 else lds2

    @cuda.jit
    def k(offsets, iters, out):
        smem = cuda.shared.array(SMEM_WORDS, uint32)
        for i in range(cuda.threadIdx.x, SMEM_WORDS, cuda.blockDim.x):
            smem[i] = uint32(i)
        cuda.syncthreads()
        addr = uint32(smem_base(smem) + offsets[cuda.threadIdx.x % 32])
        acc = uint32(0)
        for _ in range(iters):
            for _u in range(UNROLL):
                w = load(smem, addr)
                acc ^= w[0] ^ w[1]
        out[cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x] = acc
    return k


def render(rep: dict) -> str:
    rows = [(name, r["width_bytes"], f"{r['ns_per_warp_instr_sm']:.3f}", f"{r['wavefronts']:.2f}")
            for name, r in rep["rows"].items()]
    return "\n".join([f"# Shared-memory read patterns ({rep['device']}, commit {rep['commit']})", "",
                      *table(("pattern", "load bytes", "ns per warp-instruction an SM",
                              "wavefronts (16-byte distinct = 4, 8-byte = 2)"), rows), ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, help="markdown report (and its JSON beside it)")
    args = ap.parse_args()
    dev = cuda.get_current_device()
    sms = dev.MULTIPROCESSOR_COUNT
    blocks = 8 * sms
    out = cuda.device_array(blocks * WARPS * 32, np.uint32)
    kernels = {w: kernel(w) for w in (2, 4)}
    rows = {}
    for name, (width, offs) in patterns().items():
        d_off = cuda.to_device(offs.astype(np.uint32))
        k = kernels[width]
        k[blocks, WARPS * 32](d_off, 10, out)
        times = []
        for _ in range(args.repeats):
            e0, e1 = cuda.event(), cuda.event()
            e0.record()
            k[blocks, WARPS * 32](d_off, args.iters, out)
            e1.record()
            e1.synchronize()
            times.append(cuda.event_elapsed_time(e0, e1) * 1e3)
        per = statistics.median(times) * 1e-6 * sms / (blocks * WARPS * args.iters * UNROLL)   # s per instr per SM
        rows[name] = {"width_bytes": 4 * width, "us": statistics.median(times), "ns_per_warp_instr_sm": per * 1e9,
                      "offsets": offs.tolist()}
    ref = {4: rows["distinct"]["ns_per_warp_instr_sm"] / 4, 2: rows["distinct_64"]["ns_per_warp_instr_sm"] / 2}
    for r in rows.values():
        r["wavefronts"] = r["ns_per_warp_instr_sm"] / ref[r["width_bytes"] // 4]
    name = dev.name
    rep = {"device": name.decode() if isinstance(name, bytes) else name, "commit": commit(), "rows": rows}
    print(render(rep))
    if args.out:
        write(rep, args.out, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
