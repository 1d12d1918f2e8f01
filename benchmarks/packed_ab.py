"""The appended epochs' encoder bases packed on the device or on the host: one process, the two alternated.

    python benchmarks/packed_ab.py --out $OUT/packed-ab-h100.md        # a GPU

A prompt whose adaptation rule appends epochs in many layers and kinds gives the encoders the new epochs' bases
packed on the device from the rule's candidates, where its batch appends ``gaac.cuda.epochs.DEVICE_PACKED``
epochs or more; below that the host packs each epoch and copies it over (one pinned copy an epoch).  This
script times both ways in one process, switching that threshold between runs (``on``: the library's value;
``off``: never), in the order on, off, off, on, ... so that the host's drift moves both alike:

* **prompt**: ``--tokens`` (128K) tokens of every layer into a new cache with ``add_sequence`` (the Llama-3.1-8B
  KV shape and the real content of ``decode_step.py``, calibrated on the first 1024 tokens: the rule appends
  about 65 epochs);
* **joins**: in a batch of 8 sequences of about 16K tokens, a row removed and a 4096-token prompt appended
  layer by layer inside ``cache.deferred()`` (the serving benchmark's join, the device synchronised before
  each), which appends a few epochs or none, so that both ways take the host's path: the check that the
  switch costs a join nothing.

Host wall time to the device's end of each call (synchronised), medians; the first call of each case is a
warm-up.  After the first timed prompt of each way, its last layer reads back bit-exact against the content.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
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
import gaac.cuda.epochs as device_epochs  # noqa: E402
from benchmarks.report import commit, head, table, write  # noqa: E402
from equal_memory import tokens_at as content  # noqa: E402
from prefill_layers import by_layer  # noqa: E402


def measure(args) -> dict:
    s = DS.LLAMA_8B
    k_u, v_u = DS.real_source(DS.find_data(None), s)
    cal = gaac.calibrate(k_u[:, :, :args.cal_tokens], v_u[:, :, :args.cal_tokens], show_progress=False)
    src = DS.Source(k_u, v_u)
    ways = {"on": device_epochs.DEVICE_PACKED, "off": 1 << 30}
    order = ["on", "off", "off", "on"] * args.rounds
    res = {w: {"prompt_ms": [], "join_ms": []} for w in ways}
    res["read_back_exact"] = {}
    kk, vv = zip(*(content(src, layer, 0, 0, args.tokens) for layer in range(s.layers)))
    k, v = torch.stack(kk), torch.stack(vv)
    del kk, vv
    epochs = {}
    for r, way in enumerate(["off"] + order):
        device_epochs.DEVICE_PACKED = ways[way]
        cache = gaac.PagedKVCache(cal, max_blocks=args.tokens // 16 + 2, device="cuda")
        before = sum(cache.calibration.n_epochs(layer, kind) for layer in range(s.layers) for kind in (0, 1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.add_sequence(k, v)
        torch.cuda.synchronize()
        if r:
            res[way]["prompt_ms"].append(round(1e3 * (time.perf_counter() - t0), 2))
            epochs[way] = sum(cache.calibration.n_epochs(layer, kind) for layer in range(s.layers)
                              for kind in (0, 1)) - before
            if way not in res["read_back_exact"]:
                rk, rv = cache.read_layer(s.layers - 1, [0])
                res["read_back_exact"][way] = bool(torch.equal(rk[0].view(torch.int16), k[-1].view(torch.int16))
                                                   and torch.equal(rv[0].view(torch.int16), v[-1].view(torch.int16)))
        del cache
        DS.free()
    del k, v
    DS.free()
    res["epochs_appended"] = epochs
    batch, context, prompt = 8, args.context, 4096
    lens = [context - 97 * i for i in range(batch)]
    cache = gaac.PagedKVCache(cal, max_seqs=batch, max_blocks=(max(lens) + prompt) // 16 + 2, device="cuda")
    for r, n in enumerate(lens):
        seq = cache.add_sequence()
        by_layer(cache, seq, [content(src, layer, r, 0, n) for layer in range(s.layers)], True)
    torch.cuda.synchronize()
    for j, way in enumerate(["off"] + order * 2):
        device_epochs.DEVICE_PACKED = ways[way]
        row = 1 + j % (batch - 1)
        kv = [content(src, layer, batch + row + batch * j, 0, prompt) for layer in range(s.layers)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.remove_sequence(row)
        seq = cache.add_sequence()
        by_layer(cache, seq, kv, True)
        torch.cuda.synchronize()
        if j:
            res[way]["join_ms"].append(round(1e3 * (time.perf_counter() - t0), 2))
    device_epochs.DEVICE_PACKED = ways["on"]
    return res


def render(rep: dict) -> str:
    r = rep["results"]
    rows = []
    for way in ("on", "off"):
        p, j = r[way]["prompt_ms"], r[way]["join_ms"]
        rows.append([f"{way} ({'DEVICE_PACKED ' + str(rep['threshold']) if way == 'on' else 'host packing'})",
                     f"{statistics.median(p):.1f}", f"{min(p):.1f} - {max(p):.1f}", r["epochs_appended"].get(way, "-"),
                     f"{statistics.median(j):.1f}", f"{min(j):.1f} - {max(j):.1f}",
                     "yes" if r["read_back_exact"].get(way) else "NO"])
    lines = head("Appended epochs' encoder bases: packed on the device against on the host", rep)
    lines += [f"- {rep['machine']}, torch {rep['torch']}", "",
              *table(["way", "prompt ms (median)", "prompt ms (range)", "epochs appended", "join ms (median)",
                      "join ms (range)", "read-back bit-exact"], rows), "",
              f"Prompt: {rep['args']['tokens']} tokens x 32 layers (8 x 128) through `add_sequence`, "
              f"{len(r['on']['prompt_ms'])} runs each way; joins: a 4096-token prompt by layer in a deferral into "
              f"8 x ~{rep['args']['context']} tokens, {len(r['on']['join_ms'])} each way; ways alternated in one "
              "process (on, off, off, on, ...).", "",
              f"Every run, ms: {r['on']['prompt_ms']} (on), {r['off']['prompt_ms']} (off); joins "
              f"{r['on']['join_ms']} (on), {r['off']['join_ms']} (off)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--context", type=int, default=16384, help="the joins' batch: tokens a sequence")
    ap.add_argument("--cal-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of on, off, off, on (the joins run two)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("packed_ab.py times the CUDA path: it needs a GPU")
    rep = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               device=torch.cuda.get_device_name(), machine=f"{platform.machine()} {os.cpu_count()} cores",
               commit=commit(), torch=torch.__version__, threshold=device_epochs.DEVICE_PACKED,
               command="python benchmarks/packed_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
               args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    rep["results"] = measure(args)
    write(rep, args.out, render)
    print(render(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
