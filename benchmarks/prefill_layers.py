"""A prompt through ``update_layer``, a layer at a time, as a model's forward pass hands it to the cache.

    python benchmarks/prefill_layers.py --out $OUT/prefill-layers-h200.md
    python benchmarks/prefill_layers.py --smoke --out /tmp/prefill-layers-smoke.md    # CPU, numba's simulator

The Llama-3.1-8B KV shape (32 layers, 8 KV heads of 128) and the real SmolLM2 K/V of ``decode_step.py``; the
cache at its defaults (adaptation on), calibrated on the first ``--cal-tokens`` (1024) tokens of the content,
as the serving benchmark makes it.  The layer-by-layer calls are timed two ways: inside ``cache.deferred()``
(``deferred``: each call checked and queued, one transaction over every layer when the deferral ends, what a
serving engine and ``gaac.hf.GAACCache`` do) and without it (``by layer``: a transaction a layer).  Two cases:

* **joins**: a batch of ``--batch`` sequences of about ``--context`` tokens (97 apart), then ``--joins`` times
  each way, alternating, a row removed, a sequence added and its ``--prompt``-token prompt appended layer by
  layer (what the serving benchmark's join does, here with the device synchronised before each join, so that a
  join's time is its own and not the queued steps').  Reported: removing and adding, the prompt's
  ``update_layer`` calls (host time as they return, the deferral's end included; the device's end), a call's
  median and maximum;
* **a long prompt**: ``--tokens`` tokens into a new cache, layer by layer both ways, against ``add_sequence``
  of every layer in one call.

With ``--timeline`` (GPU), one more ``add_sequence`` of the long prompt runs under torch's profiler: the report
gives the GPU's busy time in that call, the gaps of half a millisecond or more in which it ran nothing (the
host's turns) and the kernels by name; ``<out>.timeline.txt`` lists every run of same-named kernels and copies.

For each, the host time of the cache's phases (each method timed as it returns, summed over the calls):
cutting the blocks (``_prepare``), the adaptation rule's setup and launches (``_launch_rule``) and the wait
for its decisions (``_finish_rule``), the encodes (``_encode_on_device``, which includes the rule's wait
where an encode's guess is checked), the writes (``_commit_all``, ``_written_early``), the pools' counts
(``sync_pools``).
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

import decode_step as DS  # noqa: E402  (sets up the simulator for --smoke)
import torch  # noqa: E402

import gaac  # noqa: E402
from benchmarks.report import commit, table, timeline, write  # noqa: E402
from equal_memory import tokens_at as content  # noqa: E402

log, free = DS.log, DS.free
GAP = 97
WAYS = ("by layer", "deferred")
PHASES = ("_prepare", "_launch_rule", "_finish_rule", "_encode_on_device", "_encode_again", "_commit_all",
          "_written_early")


def sync() -> None:
    if DS.DEV == "cuda":
        torch.cuda.synchronize()


class Phases:
    """The host time of the cache's phases, each method timed as it returns, summed until :meth:`take`."""

    def __init__(self):
        import gaac.cache.paged as paged
        import gaac.cache.pools as pools
        import gaac.cache.update as update

        self.spans = {}
        cls = gaac.PagedKVCache
        for name in PHASES:
            setattr(cls, name, self._timed(getattr(cls, name), name))
        counted = self._timed(pools.sync_pools, "sync_pools")
        for module in (pools, update, paged):
            module.sync_pools = counted

    def _timed(self, fn, name):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spans.setdefault(name, []).append(time.perf_counter() - t)
        return timed

    def take(self) -> dict:
        out = {name: [len(v), 1e3 * sum(v)] for name, v in self.spans.items()}
        self.spans = {}
        return out


def by_layer(cache, seq: int, kv, deferred: bool) -> list:
    """The prompt ``kv[layer] = (k, v)`` through ``update_layer`` a layer at a time, inside a deferral or not;
    the host ms of each call (the deferral's end, where the transaction runs, added to the last)."""
    per = []
    deferral = cache.deferred().start() if deferred else None
    for layer in range(len(kv)):
        t = time.perf_counter()
        cache.update_layer(layer, [seq], kv[layer][0][None], kv[layer][1][None])
        if deferral is not None and layer == len(kv) - 1:
            deferral.apply()
        per.append(1e3 * (time.perf_counter() - t))
    return per


def joins(cal, src, s, args, phases) -> dict:
    lens = [args.context - GAP * i for i in range(args.batch)]
    cache = gaac.PagedKVCache(cal, max_seqs=args.batch, max_blocks=(max(lens) + args.prompt) // 16 + 2,
                              device=DS.DEV)
    for r, n in enumerate(lens):
        seq = cache.add_sequence()
        by_layer(cache, seq, [content(src, layer, r, 0, n) for layer in range(s.layers)], True)
    sync()
    phases.take()
    runs = []
    for j in range(2 * args.joins):
        way = WAYS[j % 2]
        row = 1 + j % max(args.batch - 1, 1)
        kv = [content(src, layer, args.batch + row + args.batch * j, 0, args.prompt) for layer in range(s.layers)]
        sync()
        t0 = time.perf_counter()
        cache.remove_sequence(row)
        seq = cache.add_sequence()
        t1 = time.perf_counter()
        per = by_layer(cache, seq, kv, way == "deferred")
        t_host = time.perf_counter()
        sync()
        t_end = time.perf_counter()
        runs.append({"how": way, "remove_add_ms": 1e3 * (t1 - t0), "update_layer_ms": 1e3 * (t_host - t1),
                     "device_done_ms": 1e3 * (t_end - t1), "layer_median_ms": statistics.median(per),
                     "layer_max_ms": max(per), "phases": phases.take()})
        log(f"  join {j} ({way}): remove+add {runs[-1]['remove_add_ms']:.1f} ms, update_layer "
            f"{runs[-1]['update_layer_ms']:.1f} ms")
    del cache
    free()
    return {"batch": args.batch, "context": args.context, "prompt": args.prompt, "runs": runs}


def long_prompt(cal, src, s, args, phases) -> dict:
    kk, vv = zip(*(content(src, layer, 0, 0, args.tokens) for layer in range(s.layers)))
    blocks = args.tokens // 16 + 2
    out = {"tokens": args.tokens, "by_layer": [], "add_sequence": []}
    for _ in range(args.runs):
        for way in WAYS:
            cache = gaac.PagedKVCache(cal, max_blocks=blocks, device=DS.DEV)
            seq = cache.add_sequence()
            sync()
            phases.take()
            t0 = time.perf_counter()
            per = by_layer(cache, seq, list(zip(kk, vv)), way == "deferred")
            sync()
            out["by_layer"].append({"how": way, "ms": 1e3 * (time.perf_counter() - t0),
                                    "layer_median_ms": statistics.median(per),
                                    "epochs_appended": appended(cache, cal, s), "phases": phases.take()})
            log(f"  {way}: {out['by_layer'][-1]['ms']:.1f} ms")
            del cache
            free()
    k, v = torch.stack(kk), torch.stack(vv)
    del kk, vv
    for _ in range(args.runs):
        cache = gaac.PagedKVCache(cal, max_blocks=blocks, device=DS.DEV)
        sync()
        phases.take()
        t0 = time.perf_counter()
        cache.add_sequence(k, v)
        sync()
        out["add_sequence"].append({"ms": 1e3 * (time.perf_counter() - t0), "epochs_appended": appended(cache, cal, s),
                                    "phases": phases.take()})
        log(f"  add_sequence: {out['add_sequence'][-1]['ms']:.1f} ms")
        del cache
        free()
    if args.timeline and DS.DEV == "cuda":
        out["timeline"] = profiled(lambda cache: cache.add_sequence(k, v), cal, blocks)
    return out


def profiled(call, cal, blocks: int) -> dict:
    """``call(cache)`` on a new cache under torch's profiler: the call's host ms (to the device's end, the profiler
    slowing the host) and the GPU's :func:`benchmarks.report.timeline` of its kernels and copies."""
    from torch.profiler import ProfilerActivity, profile

    cache = gaac.PagedKVCache(cal, max_blocks=blocks, device=DS.DEV)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        call(cache)
        sync()
        ms = 1e3 * (time.perf_counter() - t0)
    gpu = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    del cache
    free()
    return {"host_ms": ms, **timeline(gpu)}


def timeline_lines(t: dict) -> list:
    """The report's summary of a :func:`profiled` timeline: busy time, idle gaps, the largest kernels by name."""
    by_name = {}
    for a, b, n, name in t["runs"]:
        got = by_name.setdefault(name, [0, 0.0])
        got[0], got[1] = got[0] + n, got[1] + (b - a)
    top = sorted(by_name.items(), key=lambda x: -x[1][1])[:8]
    lines = [f"One more `add_sequence` of it under torch's profiler ({t['host_ms']:.1f} ms with the profiler): the GPU "
             f"ran something for {t['busy_us'] / 1e3:.1f} ms of its {t['span_us'] / 1e3:.1f} ms from the first kernel "
             "to the last; it ran nothing (the host's turn) in", ""]
    lines += [f"- {a / 1e3:.1f} - {b / 1e3:.1f} ms ({(b - a) / 1e3:.1f} ms), after `{before[:60]}`, "
              f"before `{after[:60]}`" for a, b, before, after in t["idle"]] or ["- no gap of 0.5 ms or more"]
    lines += ["", "Kernels and copies by name (ms from the first to the last of each run, summed; count):", ""]
    lines += [f"- `{name[:70]}` {us / 1e3:.1f} ms ({n})" for name, (n, us) in top]
    return lines


def appended(cache, cal, s) -> int:
    return int(sum(cache.calibration.n_epochs(layer, kind) - cal.n_epochs(layer, kind)
                   for layer in range(s.layers) for kind in (0, 1)))


def phase_cell(phases: dict) -> str:
    return ", ".join(f"{name.strip('_')} {ms:.1f} (x{n})" for name, (n, ms) in phases.items())


def render(rep: dict) -> str:
    j, p = rep["joins"], rep["long"]
    lines = [f"# A prompt through update_layer, a layer at a time ({rep['layers']} layers x {rep['kv_heads']} KV heads "
             f"x {rep['head_dim']})", "", f"- date: {rep['date']}", f"- device: {rep['device']}",
             f"- commit: {rep['commit']}", f"- command: `{rep['command']}`",
             f"- the cache's defaults (adaptation on), calibration from the first {rep['cal_tokens']} tokens; "
             "host ms as the calls return, the device synchronised before each join and prompt",
             "- `by layer`: a transaction a call; `deferred`: the calls inside `cache.deferred()`, one transaction "
             "over the layers when it ends (timed with the last call)", "",
             f"## Joins: a {j['prompt']}-token prompt into a batch of {j['batch']} x ~{j['context']} tokens", ""]
    lines += table(["join", "how", "remove + add ms", "update_layer ms (all layers)", "device done ms",
                    "a call: median / max ms", "host ms by phase (calls)"],
                   [[i, r.get("how", WAYS[0]), f"{r['remove_add_ms']:.1f}", f"{r['update_layer_ms']:.1f}",
                     f"{r['device_done_ms']:.1f}", f"{r['layer_median_ms']:.2f} / {r['layer_max_ms']:.2f}",
                     phase_cell(r["phases"])]
                    for i, r in enumerate(j["runs"])])
    lines += ["", f"## A {p['tokens']}-token prompt into a new cache", ""]
    names = {"by layer": "update_layer, a layer at a time", "deferred": "update_layer, a layer at a time, deferred"}
    rows = [[names[r.get("how", WAYS[0])], f"{r['ms']:.1f}", f"{r['layer_median_ms']:.2f}", r["epochs_appended"],
             phase_cell(r["phases"])] for r in p["by_layer"]]
    rows += [["add_sequence, every layer in one call", f"{r['ms']:.1f}", "-", r["epochs_appended"], phase_cell(r["phases"])]
             for r in p["add_sequence"]]
    lines += table(["how", "ms", "a call (median) ms", "epochs appended", "host ms by phase (calls)"], rows)
    if p.get("timeline"):
        lines += [""] + timeline_lines(p["timeline"])
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    DS.common_args(ap)
    ap.add_argument("--batch", type=int, default=None, help="sequences in the joined batch (default 8)")
    ap.add_argument("--context", type=int, default=None, help="their tokens (default 16384)")
    ap.add_argument("--prompt", type=int, default=None, help="a join's prompt tokens (default 4096)")
    ap.add_argument("--joins", type=int, default=4, help="joins timed each way (default 4)")
    ap.add_argument("--tokens", type=int, default=None, help="the long prompt's tokens (default 131072)")
    ap.add_argument("--runs", type=int, default=2, help="runs of each long-prompt way (default 2)")
    ap.add_argument("--cal-tokens", type=int, default=1024, help="calibrate on the first N tokens (default 1024)")
    ap.add_argument("--timeline", action="store_true",
                    help="one more add_sequence of the long prompt under torch's profiler: the GPU's timeline "
                         "(GPU only; every run in <out>.timeline.txt)")
    args = ap.parse_args()
    smoke = DS.SMOKE
    s = DS.SMOKE_SHAPE if smoke else DS.LLAMA_8B
    args.batch = args.batch or (2 if smoke else 8)
    args.context = args.context or (320 if smoke else 16384)
    args.prompt = args.prompt or (64 if smoke else 4096)
    args.tokens = args.tokens or (640 if smoke else 131072)
    if smoke:
        args.joins, args.runs = min(args.joins, 2), 1
    k_u, v_u = DS.real_source(DS.find_data(args.data), s)
    cal = gaac.calibrate(k_u[:, :, :args.cal_tokens], v_u[:, :, :args.cal_tokens], show_progress=False)
    src = DS.Source(k_u, v_u)
    phases = Phases()
    rep = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "device": "CPU (simulator, smoke)" if smoke else torch.cuda.get_device_name(), "commit": commit(),
           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "layers": s.layers, "kv_heads": s.kv_heads,
           "head_dim": s.head_dim, "cal_tokens": args.cal_tokens}
    log("joins")
    rep["joins"] = joins(cal, src, s, args, phases)
    log("a long prompt")
    rep["long"] = long_prompt(cal, src, s, args, phases)
    write(rep, args.out, render)
    if rep["long"].get("timeline"):
        t = rep["long"]["timeline"]
        args.out.with_suffix(".timeline.txt").write_text(
            "start_ms end_ms count name (the GPU's kernels and copies of one add_sequence, runs of one name merged)\n"
            + "".join(f"{a / 1e3:9.3f} {b / 1e3:9.3f} {n:5d} {name}\n" for a, b, n, name in t["runs"]))
    print(render(rep))


if __name__ == "__main__":
    main()
