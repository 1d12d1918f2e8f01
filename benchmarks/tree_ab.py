"""Two gaac trees side by side on a prompt's host path: a 128K-token ``add_sequence`` and deferred 4K joins.

    python benchmarks/tree_ab.py path/to/tree_a both        # one process per tree; alternate them in a script:
    python benchmarks/tree_ab.py .               both        #   A, B, A, B on one machine in one call

``tree`` is a folder holding a ``gaac`` package (``git archive <rev> gaac | tar -x -C <folder>`` makes one), put
first on ``sys.path``; the benchmarks' helpers come from this checkout.  The Llama-3.1-8B KV shape (32 layers, 8
KV heads of 128) and the real K/V of ``decode_step.py``, calibrated on the first 1024 tokens; ``prefill``: a
131072-token prompt into a new cache, 5 runs, the first (compilation) dropped; ``joins``: a batch of 8 x ~16384
tokens, then ``--joins`` times a row removed and a 4096-token prompt appended layer by layer inside
``cache.deferred()``, the first dropped; ``both``: the two.  The device is synchronised before each and at its
end.  Prints one ``RESULT`` line of JSON (milliseconds).
"""
import argparse
import json
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("tree", help="a folder holding the gaac package to time")
ap.add_argument("what", choices=("prefill", "joins", "both"))
ap.add_argument("--joins", type=int, default=9, help="joins timed, plus one dropped (default 9)")
args = ap.parse_args()
sys.path.insert(0, os.path.abspath(args.tree))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, ROOT)
sys.path.insert(2, os.path.join(ROOT, "benchmarks"))

import gaac  # noqa: E402
import torch  # noqa: E402

import decode_step as DS  # noqa: E402
import prefill_layers as PL  # noqa: E402

if not os.path.abspath(gaac.__file__).startswith(os.path.abspath(args.tree)):
    raise SystemExit(f"gaac came from {gaac.__file__}, not from {args.tree}")
s = DS.LLAMA_8B
k_u, v_u = DS.real_source(DS.find_data(None), s)
cal = gaac.calibrate(k_u[:, :, :1024], v_u[:, :, :1024], show_progress=False)
src = DS.Source(k_u, v_u)
res = {"tree": args.tree, "device": torch.cuda.get_device_name(), "prefill_ms": [], "joins_ms": []}
if args.what in ("prefill", "both"):
    tokens = 131072
    kk, vv = zip(*(PL.content(src, layer, 0, 0, tokens) for layer in range(s.layers)))
    k, v = torch.stack(kk), torch.stack(vv)
    del kk, vv
    for r in range(5):
        cache = gaac.PagedKVCache(cal, max_blocks=tokens // 16 + 2, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.add_sequence(k, v)
        torch.cuda.synchronize()
        if r:
            res["prefill_ms"].append(1e3 * (time.perf_counter() - t0))
        res["epochs"] = int(sum(cache.calibration.n_epochs(layer, kind) for layer in range(s.layers) for kind in (0, 1)))
        del cache
        DS.free()
    del k, v
    DS.free()
if args.what in ("joins", "both"):
    batch, context, prompt = 8, 16384, 4096
    lens = [context - 97 * i for i in range(batch)]
    cache = gaac.PagedKVCache(cal, max_seqs=batch, max_blocks=(max(lens) + prompt) // 16 + 2, device="cuda")
    for r, n in enumerate(lens):
        seq = cache.add_sequence()
        PL.by_layer(cache, seq, [PL.content(src, layer, r, 0, n) for layer in range(s.layers)], True)
    for j in range(args.joins + 1):
        row = 1 + j % (batch - 1)
        kv = [PL.content(src, layer, batch + row + batch * j, 0, prompt) for layer in range(s.layers)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.remove_sequence(row)
        seq = cache.add_sequence()
        PL.by_layer(cache, seq, kv, True)
        torch.cuda.synchronize()
        if j:
            res["joins_ms"].append(1e3 * (time.perf_counter() - t0))
for key in ("prefill_ms", "joins_ms"):
    if res[key]:
        res[key.replace("_ms", "_median")] = statistics.median(res[key])
print("RESULT", json.dumps(res), flush=True)
