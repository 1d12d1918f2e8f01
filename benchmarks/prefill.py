"""A long prompt entering the GAAC cache: ``add_sequence`` of one sequence into every layer, epochs off and on.

    python benchmarks/prefill.py --out $OUT/prefill-h200.md [--tokens 131072] [--check-tokens 8192]
    python benchmarks/prefill.py --smoke --out /tmp/prefill-smoke.md        # CPU, numba's simulator

The cache has the Llama-3.1-8B KV shape (32 layers, 8 KV heads of 128) and the real SmolLM2 K/V of
``decode_step.py`` tiled to ``--tokens``.  Timed, wall clock from the call to the device's last write
(synchronised; the cache is made before, as a server makes it once, its pools as it sizes them for the prompt,
``grow=True``), best and median of ``--runs``:

* ``add_sequence`` with calibration epochs off: the blocks are encoded where the prompt holds them, one
  launch per kind and layer;
* the same with epochs on (the cache's default): the adaptation rule runs on the GPU for every (layer,
  kind) at once while the encodes are launched with each layer's newest epoch, and a layer and kind where
  the rule appends an epoch is encoded again, one launch per epoch run; once with the calibration of every
  real token (few epochs) and once with a calibration of the first 256 tokens (the content then drifts
  away from it and the rule appends epochs);
* the rule alone (``gaac.cuda.epochs.assign`` on fresh adapters of every layer and kind);
* the BF16 copy of the same bytes (one device-to-device copy per layer and kind), and the encode kernel alone
  over the same tiles: the floors a prefill is measured against.

Correctness, before the timing: at ``--check-tokens`` in a four-layer cache calibrated on the first 256 tokens
(so that epochs follow the content), a cache whose rule runs on the GPU and one whose rule runs on the host
append the same epochs, code every block with the same epoch, and both read back bit-exact.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_step as DS  # noqa: E402  (sets up the simulator for --smoke)
import torch  # noqa: E402

import gaac  # noqa: E402
from benchmarks.report import commit, table, write  # noqa: E402
from gaac import layout as L  # noqa: E402
from gaac.capture import package_version  # noqa: E402
from gaac.epochs import Adapter  # noqa: E402

log, sync, free = DS.log, DS.sync, DS.free


def new_cache(cal, s, tokens: int, adapt: bool):
    """A cache for the prompt, its pools as the cache sizes them for its table; ``grow=True``: a calibration from
    the first 256 tokens overflows more tiles than that arena holds before the rule's first epochs, and the
    prefill then grows it (inside the timed call, as a user's would)."""
    return gaac.PagedKVCache(cal, max_blocks=tokens // L.BLOCK_TOKENS + 1, device=DS.DEV, adapt=adapt, codec="cuda",
                             grow=True)


def epochs_appended(cache, layers) -> int:
    return sum(cache.calibration.n_epochs(l, kind) - 1 for l in range(layers) for kind in (0, 1))


def timed(fn, runs: int, setup=None) -> list:
    """Wall ms of ``fn(setup())`` (or ``fn()``), from the call to the device's last write; ``setup`` untimed."""
    times = []
    for _ in range(runs):
        arg = setup() if setup is not None else None
        sync()
        t = time.perf_counter()
        fn(arg) if setup is not None else fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def check(k, v, k_u, v_u, tokens: int, layers: int) -> dict:
    """Device rule vs host rule in a ``layers``-layer cache calibrated on the first 256 real tokens (so that
    epochs follow the content): epochs, per-block epochs, read-back bits."""
    cal = gaac.calibrate(k_u[:layers, :, :256], v_u[:layers, :, :256], show_progress=False)
    kk, vv = k[:layers, :, :tokens], v[:layers, :, :tokens]
    caches = {}
    for where, on_device in (("device", True), ("host", False)):
        # grow=True: a calibration from 256 tokens overflows more tiles than the default arena holds
        c = gaac.PagedKVCache(cal, max_blocks=tokens // L.BLOCK_TOKENS + 1, device=DS.DEV, codec="cuda", grow=True)
        c._rule_on_device = on_device
        sync()
        t = time.perf_counter()
        seq = c.add_sequence(kk, vv)
        sync()
        caches[where] = (c, seq, time.perf_counter() - t)
    (cd, sd, td), (ch, sh, th) = caches["device"], caches["host"]
    kinds = [(l, kind) for l in range(layers) for kind in (0, 1)]
    same_epochs = all(cd.calibration.n_epochs(l, kind) == ch.calibration.n_epochs(l, kind)
                      and all(np.array_equal(a, b) for e in range(1, cd.calibration.n_epochs(l, kind))
                              for a, b in zip(cd.calibration.bases(l, kind, e), ch.calibration.bases(l, kind, e)))
                      for l, kind in kinds)
    same_blocks = all(np.array_equal(cd.stores(l)[kind].epochs[sd], ch.stores(l)[kind].epochs[sh])
                      for l, kind in kinds)
    exact = True
    for l in range(layers):
        for c, seq in ((cd, sd), (ch, sh)):
            rk, rv = c.read_layer(l, [seq])
            exact &= bool(torch.equal(rk[0], kk[l]) and torch.equal(rv[0], vv[l]))
    appended = epochs_appended(cd, layers)
    res = {"tokens": tokens, "layers": layers, "same_epochs": bool(same_epochs),
           "same_block_epochs": bool(same_blocks), "read_back_exact": bool(exact), "epochs_appended": int(appended), "device_s": td, "host_s": th}
    log(f"  check at {tokens} tokens x {layers} layers: same epochs {same_epochs}, same block epochs {same_blocks}, "
        f"bit-exact {exact}; {appended} epochs appended; wall: device rule {td:.2f} s, host rule {th:.2f} s")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: tiny shapes, kernels in numba's simulator")
    ap.add_argument("--out", type=Path, required=True, help="markdown results (a .json beside it)")
    ap.add_argument("--data", default=None, help="SmolLM2 K/V dumps (default .devdata/kv, then ../shared/data/kv)")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length (default 131072)")
    ap.add_argument("--check-tokens", type=int, default=None, help="prompt length of the correctness check (8192)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per variant (default 3)")
    ap.add_argument("--profile", action="store_true", help="cProfile of one epochs-on add_sequence (.profile.txt)")
    ap.add_argument("--scan-registers", default=None,
                    help="the rule's scan kernel's register caps timed besides gaac's, comma-separated, 0 for the "
                         "compiler's choice (default 0,40,48,64,80)")
    args = ap.parse_args()
    smoke = DS.SMOKE
    s = DS.SMOKE_SHAPE if smoke else DS.LLAMA_8B
    tokens = args.tokens or (64 if smoke else 131072)
    check_tokens = args.check_tokens or (64 if smoke else 8192)
    runs = args.runs or (1 if smoke else 3)
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --smoke for a CPU dry run)")
    t_start = time.time()
    k_u, v_u = DS.real_source(DS.find_data(args.data), s)
    cal = gaac.calibrate(k_u, v_u, model="llama-3.1-8b-shape/smollm2-kv", show_progress=False)
    src = DS.Source(k_u, v_u)
    ks, vs = zip(*(src.dense(i, 1, tokens) for i in range(s.layers)))
    k = torch.stack(ks)[:, 0].view(torch.int16)           # [layers, 8, T, D]
    v = torch.stack(vs)[:, 0].view(torch.int16)
    del ks, vs
    rep = {"device": "CPU (numba simulator, smoke)" if smoke else torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit(), "torch": torch.__version__,
           "numba_cuda": package_version("numba-cuda"), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "layers": s.layers, "kv_heads": s.kv_heads, "head_dim": s.head_dim, "tokens": tokens,
           "bytes": 2 * k.numel() * 2, "smoke": smoke}
    log("== check: device rule vs host rule ==")
    rep["check"] = check(k, v, k_u, v_u, min(check_tokens, tokens), min(4, s.layers))

    log(f"== prefill {tokens} tokens x {s.layers} layers ==")
    from gaac.cuda import epochs as GE

    blocks = {kind: x[:, :, : tokens // L.BLOCK_TOKENS * L.BLOCK_TOKENS].reshape(
        s.layers, s.kv_heads, tokens // L.BLOCK_TOKENS, L.BLOCK_TOKENS, s.head_dim).transpose(1, 2)
        for kind, x in ((0, k), (1, v))}
    default = GE.SCAN_REGISTERS
    caps = [int(c) or None for c in args.scan_registers.split(",")] if args.scan_registers else [None, 40, 48, 64, 80]
    variants = [default] + [v for v in caps if v != default and not smoke]
    rep["rule"], names, decided = {}, {}, None
    for regs in variants:               # the scan kernel's register cap
        GE.SCAN_REGISTERS = regs
        stages = {"prepare": [], "scan": [], "chain": [], "finish": [], "total": []}
        for run in range(runs + 1):
            jobs = [(Adapter(cal.copy(), l, kind), blocks[kind][l]) for kind in (0, 1) for l in range(s.layers)]
            sync()
            t0 = time.perf_counter()
            batch = GE.Batch(jobs)
            sync()
            t1 = time.perf_counter()
            if smoke:
                batch.scan()
                t2 = time.perf_counter()
                batch.chain()
                t3 = time.perf_counter()
                ms = [(t2 - t1) * 1e3, (t3 - t2) * 1e3]
            else:
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                ev[0].record()
                batch.scan()
                ev[1].record()
                batch.chain()
                ev[2].record()
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                ms = [ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])]
            batch.finish()
            t4 = time.perf_counter()
            if run:                              # the first run compiles
                for key, x in zip(stages, [(t1 - t0) * 1e3, *ms, (t4 - t3) * 1e3, (t4 - t0) * 1e3]):
                    stages[key].append(x)
        # every variant must compute the same: windows, savings, decisions and histograms
        out = (batch.cand, batch.saved0, batch.differs0, batch.nxt, batch.hist)
        decided = decided or out
        same = all(torch.equal(a, b) for a, b in zip(out, decided))
        name = names[regs] = f"scan kernel at most {regs} registers" if regs else "scan kernel, the compiler's registers"
        rep["rule"][name] = {**{key: statistics.median(x) for key, x in stages.items()}, "same": same}
        log(f"  the rule alone, every layer and kind ({name}): "
            + ", ".join(f"{key} {statistics.median(x):.1f} ms" for key, x in stages.items())
            + f"; the same results as the first: {same}")
        del batch, out
    decided = None
    # the add_sequence timings below run the fastest configuration that computes the same
    best = min((v for v in variants if rep["rule"][names[v]]["same"]), key=lambda v: rep["rule"][names[v]]["total"])
    GE.SCAN_REGISTERS = best
    rep["rule_used"] = names[best]
    log(f"  add_sequence runs with: {rep['rule_used']}")

    early = gaac.calibrate(k_u[:, :, :256], v_u[:, :, :256], show_progress=False)
    for key, adapt, c_used in (("adapt_False", False, cal), ("adapt_True", True, cal), ("adapt_early", True, early)):
        def run(cache):
            cache.add_sequence(k, v)
            run.cache = cache
        # The cache is made before the clock starts, as a server makes it once: the prefill is the add.
        times = timed(run, runs + 1, lambda: new_cache(c_used, s, tokens, adapt))[1:]   # the first run compiles
        c = run.cache
        n_ep = epochs_appended(c, s.layers) if adapt else 0
        ratio = c.memory().ratio
        del run.cache, c
        free()
        rep[key] = {"best_ms": min(times), "median_ms": statistics.median(times), "runs": times, "epochs": n_ep,
                    "ratio": ratio}
        label = f"epochs {'on' if adapt else 'off'}" + (" (calibrated on 256 tokens)" if c_used is early else "")
        log(f"  add_sequence, {label}: best {min(times):.1f} ms, median {statistics.median(times):.1f} ms ({n_ep} epochs, ratio {ratio:.4f})")

    if args.profile:
        import cProfile
        import io
        import pstats

        text = io.StringIO()
        for adapt in (False, True):
            prof = cProfile.Profile()
            cache = new_cache(cal, s, tokens, adapt)
            sync()
            prof.enable()
            cache.add_sequence(k, v)
            sync()
            prof.disable()
            del cache
            free()
            text.write(f"add_sequence, epochs {'on' if adapt else 'off'}\n")
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            if adapt:
                pstats.Stats(prof, stream=text).sort_stats("cumtime").print_callees("_launch_rule|_setup|_finish$")
        text.write(phases(cal, s, tokens, k, v))
        args.out.with_suffix(".profile.txt").write_text(text.getvalue())
        log(text.getvalue()[-3000:])

    dst = torch.empty_like(k[0])

    def copy():
        for layer in range(s.layers):
            dst.copy_(k[layer])
            dst.copy_(v[layer])
    times = timed(copy, 5)
    rep["bf16_copy_ms"] = min(times)
    log(f"  BF16 copy of the same bytes: {min(times):.2f} ms")

    from gaac.cache import blocks_to_tiles
    from gaac.cuda.codec import EncodePlan, pack_bases
    from gaac.tiles import tile_bases

    per = s.kv_heads * L.tiles_per_head(s.head_dim)
    n = tokens // L.BLOCK_TOKENS * per
    tiles = blocks_to_tiles(blocks[0][0])
    cap = int(cal.capacity[0, 0])
    geo = L.geometry(s.head_dim)
    slots = torch.empty((n, geo.slot_bytes(cap)), dtype=torch.uint8, device=DS.DEV)
    raw = torch.empty((n, L.BLOCK_TOKENS, geo.channels), dtype=torch.int16, device=DS.DEV)
    order = torch.arange(n, dtype=torch.int32, device=DS.DEV)
    heads = torch.zeros(2, dtype=torch.int32, device=DS.DEV)
    bases = torch.from_numpy(pack_bases(*tile_bases(*cal.bases(0, 0)))).to(DS.DEV)
    enc = EncodePlan(geo.channels, cap, bases, slots, order, raw, order, heads)
    entries, used = (torch.empty(n, dtype=torch.int32, device=DS.DEV) for _ in range(2))

    def encode():
        heads.zero_()
        enc(tiles, entries, used)
    times = timed(encode, 6)[1:]
    rep["encode_one_ms"] = min(times)
    rep["encode_floor_ms"] = min(times) * 2 * s.layers
    log(f"  encode kernel, one layer and kind: {min(times):.2f} ms; x {2 * s.layers} = {rep['encode_floor_ms']:.1f} ms")
    rep["wall_s"] = time.time() - t_start
    write(rep, args.out, render)
    log(f"done in {rep['wall_s']:.0f} s -> {args.out}")


PHASES = ("_prepare", "_launch_rule", "_reserve", "_encode_on_device", "_finish_rule", "_encode_again", "_commit_all")


def phases(cal, s, tokens: int, k, v) -> str:
    """Where one epochs-on ``add_sequence`` spends its wall time: each of the cache's phases timed on the
    host as it returns (no profiler), and the wait for the device at the end."""
    cache = new_cache(cal, s, tokens, True)
    spans = []
    for name in PHASES:
        method = getattr(cache, name)

        def timed_phase(*a, _method=method, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _method(*a, **kw)
            finally:
                spans.append((_name, t, time.perf_counter()))
        setattr(cache, name, timed_phase)
    sync()
    t0 = time.perf_counter()
    cache.add_sequence(k, v)
    t_host = time.perf_counter()
    sync()
    t_end = time.perf_counter()
    lines = [f"\nphases of one epochs-on add_sequence (host ms from the call; {len(spans)} spans)"]
    for name in PHASES:
        mine = [(a - t0, b - t0) for n, a, b in spans if n == name]
        if mine:
            lines.append(f"  {name:18s} x{len(mine):3d}  first start {1e3 * mine[0][0]:7.2f}  last end "
                         f"{1e3 * mine[-1][1]:7.2f}  total {1e3 * sum(b - a for a, b in mine):7.2f}")
    lines.append(f"  host returns at {1e3 * (t_host - t0):.2f} ms, the device finishes at {1e3 * (t_end - t0):.2f} ms")
    del cache
    free()
    return "\n".join(lines) + "\n"


def render(rep: dict) -> str:
    c = rep["check"]
    lines = [f"# Prefill: one {rep['tokens']}-token sequence into {rep['layers']} layers x {rep['kv_heads']} KV heads "
             f"x {rep['head_dim']}", "",
             f"{rep['device']}, {rep['date']}, commit {rep['commit']}, torch {rep['torch']}, numba-cuda "
             f"{rep['numba_cuda']}.", f"Command: `{rep['command']}`.", "",
             f"Check at {c['tokens']} tokens x {c['layers']} layers (rule on the GPU vs on the host): same epochs "
             f"{c['same_epochs']}, same per-block epochs {c['same_block_epochs']}, read back bit-exact {c['read_back_exact']}; "
             f"{c['epochs_appended']} epochs appended; wall {c['device_s']:.2f} s vs {c['host_s']:.2f} s.", ""]
    prefills = (("adapt_False", "epochs off"), ("adapt_True", "epochs on"),
                ("adapt_early", "epochs on, calibrated on the first 256 tokens"))
    rows = [*((f"add_sequence, {label}", f"{rep[key]['best_ms']:.1f}", f"{rep[key]['median_ms']:.1f}",
               (f"{rep[key]['epochs']} epochs, " if key != "adapt_False" else "") + f"ratio {rep[key]['ratio']:.4f}")
              for key, label in prefills),
            *((f"the rule alone, {name}: total (prepare / scan kernel / chain kernel / finish)",
               "", f"{r['total']:.1f}",
               f"{r['prepare']:.1f} / {r['scan']:.1f} / {r['chain']:.1f} / {r['finish']:.1f}"
               + ("" if r.get("same", True) else "; differs from the first: not used"))
              for name, r in rep["rule"].items()),
            ("encode kernel alone (one layer and kind x layers x 2)", f"{rep['encode_floor_ms']:.1f}", "", "floor"),
            ("BF16 copy of the same bytes", f"{rep['bf16_copy_ms']:.2f}", "", "floor")]
    lines += table(("", "best ms", "median ms", ""), rows)
    lines += ["", f"`add_sequence` ran the rule with the {rep.get('rule_used', 'the default configuration')}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
