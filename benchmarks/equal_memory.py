"""Equal memory at the defaults: one KV budget given the same way to BF16 and to GAAC, graph against graph.

The serving question behind gaac's first promise: in the bytes a server sets aside for KV, how many tokens
does each cache admit, and how many tokens a second does the step then make?  Both caches get one budget
(``--budget-gib``, default 60) and the same list of real-content sequences of different lengths around
``--context`` (default 64K), admitted in order while they fit:

* **BF16**: a sequence takes its tokens and the steps' room in BF16 (a paged BF16 cache's cost, the
  strongest baseline; the timed cache is flash's ``[B, T, 8, D]`` per layer, each row's length on the
  device); the step appends the token at its device position and runs torch's flash kernel (varlen,
  ``seqused_k``), captured once in a CUDA graph and replayed.
* **GAAC**: ``gaac.PagedKVCache(cal, budget=...)`` with every default (``adapt=True``, pools and arena as
  the budget sizes them, no ``slots=``/``raw_tiles=``), a calibration from the first ``--cal-tokens``
  (1024) tokens of the content; a sequence is admitted while ``cache.fits`` and ``cache.free_tokens``
  say it fits with the steps' room for every sequence in, and prefilled layer by layer.  The step runs through ``gaac.StepGraph`` (the user's loop):
  every re-plan, capture and eager step inside the timed window.

The model is ``decode_step.py``'s Llama-3.1-8B-shaped step (random BF16 weights); the content its real
SmolLM2 K/V tiled to the target shape.  Reported: tokens admitted (target: GAAC >= 1.30x BF16), aggregate
tokens/s over ``--steps`` (>= 256) timed steps after ``--warmup`` (target >= 1.20x), captures and eager
steps in the window, ``print(cache.memory())``, and a bit-exact read-back of the first sequence.

    python benchmarks/equal_memory.py --out $OUT/equal-memory-h200.md          # on the H200
    python benchmarks/equal_memory.py --smoke --out /tmp/equal-memory-smoke.md  # CPU, numba's simulator
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_step as ds  # noqa: E402  (reads --smoke from sys.argv: the simulator is set before numba loads)

import torch  # noqa: E402

import gaac  # noqa: E402
from gaac import layout as L  # noqa: E402

DEV, SMOKE, GIB, log = ds.DEV, ds.SMOKE, ds.GIB, ds.log


def lengths(context: int, n: int) -> list[int]:
    """``n`` sequence lengths spread over ``context`` +- 1/16, in a fixed order (every 16th token a block end)."""
    spread = max(context // 8, 2)
    return [context - spread // 2 + (i * 977) % spread for i in range(n)]


def tokens_at(src: ds.Source, layer: int, row: int, start: int, count: int):
    """Real K, V ``[kv_heads, count, D]`` (int16) of content row ``row`` from token ``start`` on."""
    idx = (torch.arange(start, start + count, device=DEV) + ds.SHIFT * row) % src.unique
    return src.k[layer].index_select(1, idx), src.v[layer].index_select(1, idx)


def new_tokens(src: ds.Source, s: ds.Shape, rows: int, start: int, count: int):
    """What the steps append: per layer K, V ``[count, rows, kv_heads, D]`` BF16 (step-major, as Loop reads)."""
    nk, nv = [], []
    for layer in range(s.layers):
        per = [tokens_at(src, layer, r, start, count) for r in range(rows)]
        nk.append(torch.stack([p[0] for p in per]).permute(2, 0, 1, 3).contiguous().view(torch.bfloat16))
        nv.append(torch.stack([p[1] for p in per]).permute(2, 0, 1, 3).contiguous().view(torch.bfloat16))
    return nk, nv


def timed(run, steps: int, captures=None) -> dict:
    """``steps`` calls of ``run()`` back to back: wall ms a step (synchronised at the end) and CUDA-event ms;
    with ``captures`` (a callable counting the captures so far), the event ms of the steps that captured."""
    events = [] if SMOKE else [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                               for _ in range(steps)]
    captured = []
    ds.sync()
    t = time.perf_counter()
    for j in range(steps):
        if events:
            events[j][0].record()
        before = captures() if captures else 0
        run()
        if captures and captures() != before:
            captured.append(j)
        if events:
            events[j][1].record()
    ds.sync()
    wall = (time.perf_counter() - t) / steps * 1e3
    per = [a.elapsed_time(b) for a, b in events] if events else [wall]
    replays = [x for j, x in enumerate(per) if j not in captured] or per
    return {"ms": wall, "event_median_ms": statistics.median(per), "event_max_ms": max(per), "steps": steps,
            "replay_median_ms": statistics.median(replays),
            "capture_step_ms": [round(per[j], 2) for j in captured]}


def run_bf16(model, src, s, seq_lens, budget: int, room: int, args) -> dict:
    per_token = s.kv_bytes(1)
    admitted, used = [], 0
    for n in seq_lens:
        if used + (n + room) * per_token > budget:
            break
        admitted.append(n)
        used += (n + room) * per_token
    res = {"seqs": len(admitted), "tokens": sum(admitted), "bytes": used, "lengths": admitted,
           "capacity_tokens": budget // per_token}
    log(f"BF16: {len(admitted)} sequences, {sum(admitted)} tokens in {used / GIB:.2f} GiB")
    if SMOKE or not admitted:
        return res
    b, t_max = len(admitted), max(admitted)
    kc, vc = [], []
    for layer in range(s.layers):         # each row its own content and length, room for the steps' tokens
        k = torch.zeros((b, s.kv_heads, t_max + room, s.head_dim), dtype=torch.int16, device=DEV)
        v = torch.zeros_like(k)
        for r, n in enumerate(admitted):
            k[r, :, :n], v[r, :, :n] = tokens_at(src, layer, r, 0, n)
        kc.append(k.view(torch.bfloat16))
        vc.append(v.view(torch.bfloat16))
    nk, nv = new_tokens(src, s, b, t_max, args.warmup + args.steps + args.profile + 1)
    loop = ds.GraphLoop(ds.Loop(nk, nv, t_max))
    q = torch.randn((b, s.q_heads, s.head_dim), device=DEV).to(torch.bfloat16)
    mode, res["flash_modes_us"] = ds.pick_flash_mode(s, kc, vc, t_max, loop, q)
    att = ds.SdpaGraphAttend(s, kc, vc, t_max, loop, mode, consume=True)
    att.lens.copy_(torch.tensor(admitted, dtype=torch.int32, device=DEV))
    att.begin()
    del kc, vc
    ds.free()
    ids = torch.randint(0, s.vocab, (b,), generator=torch.Generator().manual_seed(5)).to(DEV)
    with torch.no_grad():
        model.step(ids, lambda layer, q: att.attend(layer, q, att.lens))      # warm the kernels outside a capture
        graph, _ = ds.capture(model, ids, att)
    timed(graph.replay, args.warmup)
    res.update(timed(graph.replay, args.steps), flash_mode=mode, peak_gib=torch.cuda.max_memory_allocated() / GIB)
    res["tok_s"] = b / res["ms"] * 1e3
    if args.profile:
        res["profile"] = ds.kernel_profile(lambda j: graph.replay(), 0, args.profile)
    log(f"BF16 graph, batch {b}: {res['ms']:.3f} ms/step ({res['tok_s']:.0f} tok/s)")
    del graph, att, loop, nk, nv
    ds.free()
    return res


def run_gaac(model, src, cal, s, seq_lens, budget: int, room: int, rows: int, args) -> dict:
    """``rows``: the cache's sequence rows (a serving engine's max batch), which cost their tables and tails."""
    t0 = time.perf_counter()
    extra = {"codec": "cuda"} if SMOKE else {}      # the smoke run: the CUDA codec in numba's simulator
    cache = gaac.PagedKVCache(cal, budget=budget, max_seqs=rows,
                              max_blocks=(max(seq_lens) + room) // L.BLOCK_TOKENS + 1, device=DEV, **extra)
    res = {"capacity": str(cache.capacity), "capacity_expected": cache.capacity.expected,
           "capacity_guaranteed": cache.capacity.guaranteed, "allocated_empty": cache.memory().allocated_bytes,
           "refused": None}
    seqs, admitted = [], []
    for r, n in enumerate(seq_lens):
        # Admission keeps room for the steps of every sequence already in (a serving loop's headroom).
        if not cache.fits(n + room) or cache.free_tokens() < n + room * (len(seqs) + 1):
            break
        seq = cache.add_sequence()
        try:
            for layer in range(s.layers):
                k, v = tokens_at(src, layer, r, 0, n)
                cache.update_layer(layer, [seq], k[None], v[None])
        except gaac.PoolExhaustedError as exc:    # more tiles overflowed than planned: refused, nothing lost
            cache.remove_sequence(seq)
            res["refused"] = str(exc)
            break
        seqs.append(seq)
        admitted.append(n)
    ds.sync()
    m = cache.memory()
    res.update(seqs=len(seqs), tokens=sum(admitted), lengths=admitted, memory=str(m),
               allocated=m.allocated_bytes, resident=m.resident_bytes, prefill_s=time.perf_counter() - t0,
               free_tokens=cache.free_tokens())
    log(f"GAAC: {len(seqs)} sequences, {sum(admitted)} tokens; {m}; capacity {cache.capacity}; prefill "
        f"{res['prefill_s']:.1f} s")
    b = len(seqs)
    if not b:
        return res
    steps = args.warmup + args.steps + args.profile + 1
    # A token for every place of the largest bucket (``StepGraph``'s default buckets end at the cache's rows);
    # the places past the batch are free and their tokens unread.
    nk, nv = new_tokens(src, s, rows, max(admitted), steps)
    loop = ds.GraphLoop(ds.Loop(nk, nv, max(admitted)))
    # The step runs every row of the cache (a plan attends over all of them; an empty row's output is zero).
    out = torch.empty((rows, s.q_heads, s.head_dim), dtype=torch.bfloat16, device=DEV)
    ids = torch.randint(0, s.vocab, (rows,), generator=torch.Generator().manual_seed(5)).to(DEV)

    assert seqs == list(range(b))           # place i of the batch is cache row i (q and out are by row)

    def step(plan):
        with torch.no_grad():
            model.step(ids, ds.StepAttend(cache, loop, plan, out))
        loop.end()

    # One bucket of every row: the model's step runs the cache's rows (q and out are by row).
    graph = gaac.StepGraph(cache, s.q_heads, step, seqs=seqs, buckets=(rows,))   # smoke: every step eager
    run = graph
    timed(run, args.warmup)
    before = (graph.captures, graph.eager_steps)
    res.update(timed(run, args.steps, lambda: graph.captures))
    res["captures"], res["eager_steps"] = graph.captures - before[0], graph.eager_steps - before[1]
    if not SMOKE:
        res["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    res["tok_s"] = b / res["ms"] * 1e3
    if args.profile and not SMOKE:
        res["profile"] = ds.kernel_profile(lambda j: run(), 0, args.profile)
    log(f"GAAC StepGraph, batch {b}: {res['ms']:.3f} ms/step ({res['tok_s']:.0f} tok/s), captures "
        f"{res.get('captures')}, eager steps {res.get('eager_steps')}")
    # Read-back: the first sequence's first and last layer, bit for bit (prefill + every appended token).
    ok = True
    done = args.warmup + args.steps + (args.profile if not SMOKE else 0)
    for layer in (0, s.layers - 1):
        k, v = cache.read_layer(layer, [seqs[0]])
        ek, ev = tokens_at(src, layer, 0, 0, admitted[0])
        ak, av = nk[layer][:done, 0].permute(1, 0, 2), nv[layer][:done, 0].permute(1, 0, 2)
        ok &= bool(torch.equal(k[0], torch.cat([ek, ak.contiguous().view(torch.int16)], dim=1))
                   and torch.equal(v[0], torch.cat([ev, av.contiguous().view(torch.int16)], dim=1)))
    res["bit_exact"] = ok
    res["memory_after"] = str(cache.memory())
    res["epochs_appended"] = int(sum(cache.calibration.n_epochs(layer, kind) - cal.n_epochs(layer, kind)
                                     for layer in range(s.layers) for kind in (0, 1)))
    del graph, cache, loop, nk, nv
    ds.free()
    return res


def render(rep: dict) -> str:
    b, g = rep["bf16"], rep["gaac"]
    adm = g["tokens"] / b["tokens"] if b["tokens"] else float("nan")
    speed = g.get("tok_s", 0) / b["tok_s"] if b.get("tok_s") else float("nan")
    lines = ["# Equal memory at the defaults: one KV budget for BF16 and for GAAC", "",
             f"- date: {rep['date']}", f"- device: {rep['device']}", f"- commit: {rep['commit']}",
             f"- command: `{rep['command']}`",
             f"- budget: {rep['budget'] / GIB:.1f} GiB of KV; sequences around {rep['context']} tokens "
             f"(lengths {rep['lengths'][:4]}...), {rep['steps']} timed steps after {rep['warmup']}",
             f"- GAAC: `PagedKVCache(cal, budget=...)` defaults (adapt=True, pools from the budget), calibration from "
             f"the first {rep['cal_tokens']} tokens; `gaac.StepGraph` with every capture and eager step inside the "
             "window", ""]
    lines += ds.table(["", "BF16 + flash (graph)", "GAAC (StepGraph)", "GAAC / BF16", "target", "met"], [
        ["sequences admitted", b["seqs"], g["seqs"], "", "", ""],
        ["tokens admitted", b["tokens"], g["tokens"], f"{adm:.3f}x", ">= 1.30x", "yes" if adm >= 1.30 else "NO"],
        ["capacity (tokens)", b["capacity_tokens"], g.get("capacity", "-"),
         f"{g.get('capacity_expected', 0) / b['capacity_tokens']:.3f}x", "", ""],
        ["ms / step", f"{b.get('ms', float('nan')):.3f}", f"{g.get('ms', float('nan')):.3f}", "", "", ""],
        ["aggregate tokens / s", f"{b.get('tok_s', float('nan')):.0f}", f"{g.get('tok_s', float('nan')):.0f}",
         f"{speed:.3f}x", ">= 1.20x", "yes" if speed >= 1.20 else "NO"],
        ["captures / eager steps in the window", "1 / 0", f"{g.get('captures', '-')} / {g.get('eager_steps', '-')}",
         "", "", ""],
        ["best case: replays alone (event median ms / step)", f"{b.get('replay_median_ms', float('nan')):.3f}",
         f"{g.get('replay_median_ms', float('nan')):.3f}",
         f"{(g['seqs'] / g['replay_median_ms']) / (b['seqs'] / b['replay_median_ms']):.3f}x tok/s"
         if g.get("replay_median_ms") and b.get("replay_median_ms") else "", "", ""],
        ["read-back bit-exact", "", "yes" if g.get("bit_exact") else "NO", "", "", ""]])
    lines += ["", f"- GAAC steps that captured (event ms each): {g.get('capture_step_ms')}",
              f"- GAAC `print(cache.memory())` after prefill: {g.get('memory')}",
              f"- after the steps: {g.get('memory_after')}; epochs appended: {g.get('epochs_appended')}",
              f"- GAAC refused: {g.get('refused')}", f"- BF16 flash mode: {b.get('flash_mode')}",
              f"- peak GPU memory: BF16 run {b.get('peak_gib', float('nan')):.1f} GiB, GAAC run "
              f"{g.get('peak_gib', float('nan')):.1f} GiB (the weights: {rep['params'] * 2 / GIB:.1f} GiB)"]
    lines += ds.profile_lines([(k, x["profile"]) for k, x in (("BF16", b), ("GAAC", g)) if x.get("profile")])
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ds.common_args(ap)
    ap.add_argument("--budget-gib", type=float, default=None, help="KV budget (default 60; smoke: 0.002)")
    ap.add_argument("--context", type=int, default=None, help="sequence length around which lengths vary (64K)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 256; smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="steps before timing (default 16; smoke 1)")
    ap.add_argument("--profile", type=int, default=0,
                    help="after the window, N steps more under torch's profiler: the kernels of a step (GPU only)")
    ap.add_argument("--cal-tokens", type=int, default=1024, help="calibrate on the first N tokens (default 1024)")
    args = ap.parse_args()
    s = ds.SMOKE_SHAPE if SMOKE else ds.LLAMA_8B
    args.context = args.context or (96 if SMOKE else 65536)
    args.steps = args.steps or (4 if SMOKE else 256)
    args.warmup = args.warmup if args.warmup is not None else (1 if SMOKE else 16)
    budget = int((args.budget_gib or (0.002 if SMOKE else 60.0)) * GIB)
    if not SMOKE:
        torch.backends.cuda.matmul.allow_tf32 = False
    data = ds.find_data(args.data)
    k_u, v_u = ds.real_source(data, s)
    cal = gaac.calibrate(k_u[:, :, :args.cal_tokens], v_u[:, :, :args.cal_tokens], show_progress=False)
    src = ds.Source(k_u, v_u)
    model = ds.Model(s)
    seq_lens = lengths(args.context, 32)
    room = args.warmup + args.steps + 2
    rep = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": "CPU (simulator, smoke)" if SMOKE else
           torch.cuda.get_device_name(), "commit": ds.commit(), "command": " ".join([Path(sys.argv[0]).name] +
                                                                                     sys.argv[1:]),
           "budget": budget, "context": args.context, "lengths": seq_lens, "steps": args.steps,
           "warmup": args.warmup, "cal_tokens": args.cal_tokens, "params": s.params()}
    rep["bf16"] = run_bf16(model, src, s, seq_lens, budget, room, args)
    rep["gaac"] = {"tokens": 0, "seqs": 0}
    ds.write(rep, args.out, render)
    rows = 2 * rep["bf16"]["seqs"] + 2          # twice what BF16 admits: more than GAAC can take
    rep["gaac"] = run_gaac(model, src, cal, s, seq_lens, budget, room, rows, args)
    ds.write(rep, args.out, render)
    print(render(rep))


if __name__ == "__main__":
    main()
