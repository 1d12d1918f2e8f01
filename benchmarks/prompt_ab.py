"""A prompt's two ways through the cache, in one process, alternated: a library switch on and off.

    python benchmarks/prompt_ab.py --switch rows --out $OUT/prompt-ab-rows-h100.md      # a GPU
    python benchmarks/prompt_ab.py --switch packed --out $OUT/prompt-ab-packed-h100.md

The switches (``on`` is what the library does):

* ``rows``: a prompt's encodes read each block's epoch from the adaptation rule's results on the device and are
  launched before the host waits for the decisions (``gaac.cuda.epochs.Batch.encode_rows``); ``off``: the
  encodes take the epochs from the host, after the decisions (or guess the newest epoch and code the layers
  the rule appended to again, where the cache's earlier prompts kept the guess);
* ``packed``: the appended epochs' encoder bases packed on the device from the rule's candidates where a batch
  appends ``gaac.cuda.epochs.DEVICE_PACKED`` epochs or more; ``off``: the host packs each epoch and copies it over.
* ``positions``: a removal's records go back to their free lists at positions made on the device from each
  list's start and length (``gaac.cache.pools._positions``); ``off``: every position made on the host and uploaded.
* ``known``: a cache for which no plan of device-driven steps was made takes its pools' exact counts as the
  device's, so a new cache's first prompt reserves without reading a count and launches its rule first
  (``UpdateTransaction._counts_known``); ``off``: the reservation reads the counts, before the rule.

Both ways run in the order on, off, off, on, ... so that the host's drift moves both alike:

* **prompt**: ``--tokens`` (128K) tokens of every layer into a new cache with ``add_sequence`` (the Llama-3.1-8B
  KV shape and the real content of ``decode_step.py``, calibrated on the first 1024 tokens: the rule appends
  about 65 epochs);
* **joins**: in a batch of 8 sequences of about 16K tokens, a row removed and a 4096-token prompt appended
  layer by layer inside ``cache.deferred()`` (the serving benchmark's join, the device synchronised before
  each), which appends a few epochs or none.  No decode steps run between these joins, so nothing is queued
  ahead of them: a best case for a join, which compares the two ways; the user's figure is ``serving.py``'s join
  scenario, whose joins run inside the decode loop.

Host wall time to the device's end of each call (synchronised), medians; the first two calls of each case, one
each way, are a warm-up (a way's first call compiles its kernels).  After the first timed prompt of each way, its
last layer reads back bit-exact against the content.
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
import gaac.cache.pools as pools  # noqa: E402
import gaac.cuda.epochs as device_epochs  # noqa: E402
from gaac.cache.update import UpdateTransaction  # noqa: E402
from benchmarks.report import gpu_run, head, table  # noqa: E402
from equal_memory import tokens_at as content  # noqa: E402
from prefill_layers import by_layer  # noqa: E402


_LIBRARY = {"packed": device_epochs.DEVICE_PACKED, "rows": device_epochs.Batch.encode_rows}


def _packed(on: bool) -> None:
    device_epochs.DEVICE_PACKED = _LIBRARY["packed"] if on else 1 << 30


def _no_rows(batch, current: list) -> list:
    return [(None, None)] * len(current)


def _rows(on: bool) -> None:
    device_epochs.Batch.encode_rows = _LIBRARY["rows"] if on else _no_rows


def _host_positions(group: list, base: int, device) -> torch.Tensor:
    """``gaac.cache.pools._positions`` made on the host: every position in one array, uploaded."""
    import numpy as np

    from gaac import arrays

    where = np.concatenate([np.arange(values.numel(), dtype=np.int64) + ((order.data_ptr() - base) // 4 + at)
                            for order, at, values in group])
    return arrays.upload(where, device)


_LIBRARY["positions"] = pools._positions


def _positions(on: bool) -> None:
    pools._positions = _LIBRARY["positions"] if on else _host_positions


_LIBRARY["known"] = UpdateTransaction._counts_known


def _known(on: bool) -> None:
    UpdateTransaction._counts_known = _LIBRARY["known"] if on else property(lambda self: False)


SWITCHES = {"packed": _packed, "rows": _rows, "positions": _positions, "known": _known}
WAYS = {"packed": ("DEVICE_PACKED " + str(device_epochs.DEVICE_PACKED), "host packing"),
        "rows": ("epochs read on the device", "epochs from the host"),
        "positions": ("list positions made on the device", "list positions uploaded"),
        "known": ("a new cache's counts taken as the host's", "counts read")}


def long_prompt(tokens: int, cal_tokens: int) -> tuple:
    """The long prompt of this script, scan_ab.py, scan_variants.py and prompt_timeline.py: ``tokens`` tokens of
    decode_step.py's real content at the Llama-3.1-8B KV shape, every layer, as K and V BF16 ``[layers, kv_heads,
    tokens, head_dim]`` on the GPU, with a calibration from the content's first ``cal_tokens`` tokens (as a user
    calibrates) and the content's source: ``(cal, src, k, v)``."""
    s = DS.LLAMA_8B
    k_u, v_u = DS.real_source(DS.find_data(None), s)
    cal = gaac.calibrate(k_u[:, :, :cal_tokens], v_u[:, :, :cal_tokens], show_progress=False)
    src = DS.Source(k_u, v_u)
    kk, vv = zip(*(content(src, layer, 0, 0, tokens) for layer in range(s.layers)))
    return cal, src, torch.stack(kk), torch.stack(vv)


def measure(args) -> dict:
    s = DS.LLAMA_8B
    cal, src, k, v = long_prompt(args.tokens, args.cal_tokens)
    switch = SWITCHES[args.switch]
    order = ["on", "off", "off", "on"] * args.rounds
    res = {w: {"prompt_ms": [], "join_ms": []} for w in ("on", "off")}
    res["read_back_exact"] = {}
    epochs = {}
    warm = ["off", "on"]            # each way once untimed: a way's first prompt compiles its kernels
    for r, way in enumerate(warm + order):
        switch(way == "on")
        cache = gaac.PagedKVCache(cal, max_blocks=args.tokens // 16 + 2, device="cuda")
        before = sum(cache.calibration.n_epochs(layer, kind) for layer in range(s.layers) for kind in (0, 1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.add_sequence(k, v)
        torch.cuda.synchronize()
        if r >= len(warm):
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
    for j, way in enumerate(warm + order * 2):
        switch(way == "on")
        row = 1 + j % (batch - 1)
        kv = [content(src, layer, batch + row + batch * j, 0, prompt) for layer in range(s.layers)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.remove_sequence(row)
        seq = cache.add_sequence()
        by_layer(cache, seq, kv, True)
        torch.cuda.synchronize()
        if j >= len(warm):
            res[way]["join_ms"].append(round(1e3 * (time.perf_counter() - t0), 2))
    switch(True)
    return res


def render(rep: dict) -> str:
    r = rep["results"]
    rows = []
    for way in ("on", "off"):
        p, j = r[way]["prompt_ms"], r[way]["join_ms"]
        rows.append([f"{way} ({WAYS[rep['args']['switch']][way == 'off']})",
                     f"{statistics.median(p):.1f}", f"{min(p):.1f} - {max(p):.1f}", r["epochs_appended"].get(way, "-"),
                     f"{statistics.median(j):.1f}", f"{min(j):.1f} - {max(j):.1f}",
                     "yes" if r["read_back_exact"].get(way) else "NO"])
    lines = head(f"A prompt's two ways: {WAYS[rep['args']['switch']][0]} against {WAYS[rep['args']['switch']][1]}",
                 rep)
    lines += [f"- {rep['machine']}, torch {rep['torch']}", "",
              *table(["way", "prompt ms (median)", "prompt ms (range)", "epochs appended", "join ms (median)",
                      "join ms (range)", "read-back bit-exact"], rows), "",
              f"Prompt: {rep['args']['tokens']} tokens x 32 layers (8 x 128) through `add_sequence`, "
              f"{len(r['on']['prompt_ms'])} runs each way; joins: a 4096-token prompt by layer in a deferral into "
              f"8 x ~{rep['args']['context']} tokens, {len(r['on']['join_ms'])} each way; ways alternated in one "
              "process (on, off, off, on, ...).  The joins run with no decode step between them (a best case: "
              "serving.py's join scenario times them inside the loop).", "",
              f"Every run, ms: {r['on']['prompt_ms']} (on), {r['off']['prompt_ms']} (off); joins "
              f"{r['on']['join_ms']} (on), {r['off']['join_ms']} (off)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--context", type=int, default=16384, help="the joins' batch: tokens a sequence")
    ap.add_argument("--cal-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of on, off, off, on (the joins run two)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    gpu_run("prompt_ab.py", "times the cache's CUDA path", argv, args, measure, render,
            threshold=device_epochs.DEVICE_PACKED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
