"""The adaptation rule's scan kernel of a long prompt: this checkout's against another tree's, one process, alternated.

    git archive <rev> gaac | tar -x -C /tmp/base                        # the other tree (any folder with gaac/)
    python benchmarks/scan_ab.py --base /tmp/base --out $OUT/scan-ab-h200.md   # a GPU

The scan (:func:`gaac.cuda.epochs.scan_kernel`) is the longest kernel of a prompt whose calibration drifts: for a
128K-token prompt into 32 layers of 8 x 128 (64 jobs, 512 checks each) it is the largest part of the prompt's GPU
work (benchmarks/results/scan-ab-*.md).  Both trees' kernels run on the same inputs, made once by this checkout's
:class:`gaac.cuda.epochs.Batch` (the real content of ``decode_step.py`` at the Llama-3.1-8B KV shape, adapters
calibrated on its first ``--cal-tokens`` tokens, as a new cache's prompt has them): the histograms, every check's
candidate windows, what each saves and whether it differs are compared bit for bit, and each launch is timed with
CUDA events in the order base, this, this, base, ...; the first round is a warm-up (it compiles).

A kernel's time, not a user's: the prompt a user waits for (scan, phases, encodes and the host's work, with the
cache's defaults) is ``prompt_ab.py``'s and ``prefill_layers.py``'s figure; this one says whether a change to the
scan moves the scan.

Only the other tree's ``gaac/cuda/epochs.py`` is loaded (as ``gaac.cuda.epochs_base``, beside this checkout's
modules): the trees must share the kernel's arguments, which ``Batch.scan_args`` gives.
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
from prompt_ab import long_prompt  # noqa: E402


def other_tree(base: Path):
    """The other tree's ``gaac/cuda/epochs.py`` as a module inside this checkout's ``gaac.cuda``."""
    path = base / "gaac" / "cuda" / "epochs.py"
    if not path.is_file():
        raise SystemExit(f"{path} not found: --base names a folder holding a gaac package")
    spec = importlib.util.spec_from_file_location("gaac.cuda.epochs_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def scan_batch(tokens: int, cal_tokens: int):
    """The rule's batch of prompt_ab.py's long prompt (:func:`prompt_ab.long_prompt`): a job per layer and kind,
    each adapter calibrated on the content's first ``cal_tokens`` tokens, its blocks ``[n, kv_heads, 16,
    head_dim]`` a view of the prompt as the cache's prefill hands it over."""
    cal, _, k, v = long_prompt(tokens, cal_tokens)
    layers, heads, _, dim = k.shape
    n = tokens // L.BLOCK_TOKENS

    def blocks(x):
        return x.view(heads, n, L.BLOCK_TOKENS, dim).permute(1, 0, 2, 3)

    return here.Batch([(E.Adapter(cal.copy(), layer, kind), blocks((k, v)[kind][layer])) for kind in (0, 1)
                       for layer in range(layers)])


def measure(args) -> dict:
    base = other_tree(args.base)
    batch = scan_batch(args.tokens, args.cal_tokens)
    scan_args = batch.scan_args
    hist, cand, saved0, differs0 = scan_args[6], scan_args[7], scan_args[10], scan_args[11]
    kernels = {"base": base.scan_kernel(E.ADAPT_EVERY, E.DECAY_SHIFT, base.SCAN_REGISTERS),
               "this": here.scan_kernel(E.ADAPT_EVERY, E.DECAY_SHIFT, here.SCAN_REGISTERS)}
    block = L.GROUP_SIZE * here.WARP
    # each tree's kernel on its own grid: this tree's as Batch.scan launches it; the other tree's from its own
    # Batch where it has scan_grid, else the (jobs, groups) grid of the trees before it
    grids = {"this": batch.scan_grid,
             "base": (base.Batch.scan_grid.fget(batch) if hasattr(base.Batch, "scan_grid")
                      else (len(batch.jobs), batch.channels // L.GROUP_SIZE))}
    ms, outputs = {w: [] for w in kernels}, {}
    for r in range(args.rounds + 1):
        for way in (("base", "this") if r % 2 == 0 else ("this", "base")):
            for t in (hist, cand, saved0, differs0):
                t.zero_()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            batch._launch(kernels[way], grids[way], block, scan_args)
            end.record()
            torch.cuda.synchronize()
            if r:
                ms[way].append(round(start.elapsed_time(end), 3))
            outputs[way] = [t.clone() for t in (hist, cand, saved0, differs0)]
    same = all(torch.equal(a, b) for a, b in zip(outputs["base"], outputs["this"]))
    return dict(ms=ms, identical=same, jobs=len(batch.jobs), checks=int(batch.checks.max()))


def render(rep: dict) -> str:
    r = rep["results"]
    rows = [[way, f"{statistics.median(r['ms'][way]):.2f}", f"{min(r['ms'][way]):.2f} - {max(r['ms'][way]):.2f}"]
            for way in ("base", "this")]
    lines = head("The rule's scan kernel: this checkout against another tree", rep)
    lines += [f"- {rep['machine']}, torch {rep['torch']}; the other tree: {rep['args']['base']}", "",
              *table(["kernel", "ms (median)", "ms (range)"], rows), "",
              f"{rep['args']['tokens']} tokens x {r['jobs']} jobs ({r['checks']} checks each), "
              f"calibration from the first {rep['args']['cal_tokens']} tokens; {len(r['ms']['this'])} launches each, "
              "alternated, after a warm-up round.  Outputs (histograms, candidates, savings, flags) identical: "
              + ("yes" if r["identical"] else "**NO**") + ".  One kernel's time, not a user's: the prompt a user "
              "waits for is prompt_ab.py's figure (benchmarks/results/prompt-ab-rows-*.md), taken on the same machine.", "",
              f"Every launch, ms: {r['ms']['this']} (this), {r['ms']['base']} (base)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="a folder holding the other tree's gaac package")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--cal-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds (each runs both kernels)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    rep = gpu_run("scan_ab.py", "times the scan kernel", argv, args, measure, render)
    return 0 if rep["results"]["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
