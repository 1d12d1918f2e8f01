"""The serving loop at the cache's defaults: BF16 + flash against GAAC, graph against graph, eager against eager.

    python benchmarks/serving.py --out $OUT/serving-h200.md                 # on the H200, every scenario
    python benchmarks/serving.py --smoke --out /tmp/serving-smoke.md        # CPU, numba's simulator

What a user of an inference engine runs, timed as it runs: the Llama-3.1-8B-shaped step of
``decode_step.py`` (32 layers, 32/8 heads of 128, SwiGLU 14336, random BF16 weights) whose new K/V each step
are real K/V gathered on the device from a step counter (the SmolLM2 captures tiled to the shape).

* **GAAC**: ``gaac.PagedKVCache(cal, max_seqs=B, max_blocks=...)`` with every default (``adapt=True``, pools
  as the cache sizes them), calibrated on the first ``--cal-tokens`` (1024) tokens of the content.  Graph:
  ``gaac.StepGraph(cache, 32, step)``, one call a step; eager: ``plan = cache.decode_plan(32, seqs=...)``
  and per layer one ``plan.run(q, layer, k=, v=)`` (the token appended, then attention).
* **BF16**: a preallocated ``[B, T, 8, 128]`` cache per layer, the token written at its device position,
  torch flash varlen with ``seqused_k`` (the fastest of ``decode_step.FLASH_MODES``); graph: captured once
  and replayed; eager: the same calls each step.

Sequence lengths differ (97 tokens apart).  In the join scenario a sequence (never the first) is replaced
every ``--replace-every`` steps by a ``--prompt``-token prompt: GAAC removes it and prefills the new one into
the freed row (``remove_sequence``, ``add_sequence`` + ``update_layer`` per layer inside ``cache.deferred()``, as a
serving engine hands the cache a prompt a layer at a time: one transaction over the layers, calibration epochs
appended as the rule decides; ``--join-by-layer``: the same calls without the deferral, a transaction a layer),
BF16 copies the prompt into the row and sets its length.  The batch's own prompts go in the same way.  Everything is
inside the timed window: ``--steps`` (256) steps after ``--warmup`` (16), wall time synchronised at the end,
and each step's CUDA-event time; captures and eager steps of ``StepGraph`` are counted in the window.  The
two runs of a scenario and mode are live together and their windows alternate every ``--interleave`` (64)
steps, the order reversed each round: a host's speed drifts by tens of percent within minutes, and an eager
step is host-bound, so one run after the other would compare two hosts (``--interleave 0`` does that).

After each GAAC run: the first sequence's first and last layers read back bit-exact against the content
(prompt and every appended token), and one layer's attention of every sequence against float64 over what
the cache holds (within BF16's own error).

``--host-profile N``: after each run's window, N more of its steps (joins as the schedule has them) under
cProfile, and in a scenario with joins, three more of GAAC's prompts under their own: where the host's time
goes, the waits for the device included (``<out>.profile.txt``).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_step as ds  # noqa: E402  (reads --smoke from sys.argv: the simulator is set before numba loads)
from equal_memory import new_tokens, tokens_at as content  # noqa: E402  (real K/V of a content row; the steps')
import report  # noqa: E402

import torch  # noqa: E402

import gaac  # noqa: E402
from gaac import layout as L  # noqa: E402

DEV, SMOKE, GIB, log = ds.DEV, ds.SMOKE, ds.GIB, ds.log
GAP = 97                   # tokens between the lengths of a batch's sequences

# name -> (batch, context, replace_every, prompt, targets: graph, eager)
SCENARIOS = {
    "b1-64k": (1, 65536, 0, 0, 1.04, 1.04),
    "b1-128k": (1, 131072, 0, 0, 1.04, 1.04),
    "b8-32k": (8, 32768, 0, 0, 1.00, 1.00),
    "b32-8k": (32, 8192, 0, 0, 1.00, 1.00),
    "b8-16k-join": (8, 16384, 16, 4096, 1.00, 1.00),
}
SMOKE_SCENARIOS = {"b2-smoke": (2, 200, 0, 0, 1.0, 1.0), "b2-join-smoke": (2, 160, 3, 40, 1.0, 1.0)}


class GCClock:
    """Python's garbage collections while it is on: how many (of the oldest generation too) and the host ms
    they took (``gc.callbacks``), so that a host time that moves between runs can be told from collections
    of a large heap."""

    def __init__(self):
        self.ms, self.count, self.full, self._t = 0.0, 0, 0, None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.ms += 1e3 * (time.perf_counter() - self._t)
            self.count += 1
            self.full += info.get("generation") == 2
            self._t = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


class Window:
    """The timed loop: ``run(j)`` is step ``j`` (joins included); wall ms a step over the window
    (synchronised at the end) and each step's CUDA-event ms."""

    def __init__(self, run, steps: int, counters=None):
        self.run, self.steps, self.counters = run, steps, counters

    def __call__(self, first: int) -> dict:
        events = [] if SMOKE else [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                                   for _ in range(self.steps)]
        before = self.counters() if self.counters else None
        ds.sync()
        with GCClock() as clock:
            t = time.perf_counter()
            for j in range(self.steps):
                if events:
                    events[j][0].record()
                self.run(first + j)
                if events:
                    events[j][1].record()
            ds.sync()
            wall = (time.perf_counter() - t) / self.steps * 1e3
        per = [a.elapsed_time(b) for a, b in events] if events else [wall]
        res = {"ms": wall, "event_median_ms": statistics.median(per), "event_max_ms": max(per), "steps": self.steps,
               "gc_ms": clock.ms, "gc_collections": clock.count, "gc_full": clock.full, "event_ms": per}
        if self.counters:
            after = self.counters()
            res["captures"], res["eager_steps"] = after[0] - before[0], after[1] - before[1]
        return res


def replaced(j: int, every: int, batch: int):
    """The row replaced before step ``j`` (every ``every`` steps; rows 1.. in turn, never row 0), or None."""
    if not every or batch < 2 or j % every != every - 1:
        return None
    return 1 + (j // every) % (batch - 1)


class Joins:
    """A run's joins: called before step ``j``, it replaces the row due then (:func:`replaced`) through
    ``join(row)`` and keeps the host wall of each join; :meth:`since` gives those from a step on.  GAAC's
    ``join`` gives the cache the prompt a layer at a time inside a deferral (:func:`prompt_by_layer`)."""

    def __init__(self, join, every: int, batch: int, drain: bool = False, prof=None):
        self.join, self.every, self.batch, self.timed = join, every, batch, []
        self.drain, self.prof, self.drained = drain, prof, []

    def __call__(self, j: int) -> None:
        row = replaced(j, self.every, self.batch)
        if row is not None:
            t = time.perf_counter()
            if self.drain:          # the steps queued before the join run first, timed apart
                ds.sync()
                t, drained = time.perf_counter(), 1e3 * (time.perf_counter() - t)
                self.drained.append((j, drained))
            if self.prof is not None:
                self.prof.enable()
            self.join(row)
            if self.prof is not None:
                self.prof.disable()
            self.timed.append((j, 1e3 * (time.perf_counter() - t)))

    def since(self, first: int) -> list:
        return [ms for j, ms in self.timed if j >= first]

    def drained_since(self, first: int) -> list:
        return [ms for j, ms in self.drained if j >= first]


class Arm(NamedTuple):
    """A run set up and warmed (what :func:`run_bf16` and :func:`run_gaac` yield): ``run(j)`` is its step ``j``, joins
    included; ``counters`` gives StepGraph's (captures, eager steps)."""

    run: Callable
    counters: Callable | None = None


def merged(windows: list) -> dict:
    """One run's figures over its timed windows: wall ms a step over all of their steps, the event median and max
    over every step, the collections, captures and eager steps summed."""
    steps = sum(w["steps"] for w in windows)
    events = [e for w in windows for e in w.pop("event_ms")]
    res = {"ms": sum(w["ms"] * w["steps"] for w in windows) / steps, "event_median_ms": statistics.median(events),
           "event_max_ms": max(events), "steps": steps, "windows": len(windows),
           "window_ms": [w["ms"] for w in windows]}
    for key in ("gc_ms", "gc_collections", "gc_full", "captures", "eager_steps"):
        if key in windows[0]:
            res[key] = sum(w[key] for w in windows)
    return res


def window_ratios(bf16: dict, gaac: dict) -> list:
    """BF16's ms a step over GAAC's in each pair of alternating windows (the same steps of each run, timed
    back to back); empty where the two did not alternate."""
    b, g = bf16.get("window_ms") or [], gaac.get("window_ms") or []
    return [x / y for x, y in zip(b, g)] if len(b) == len(g) > 1 else []


def finished(gen, windows: list) -> dict:
    """What a run function returns once it is sent its windows' figures."""
    try:
        gen.send(merged(windows))
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("a run function yields once")


def failed(exc: Exception) -> dict:
    """A run that raised, reported (the other runs still run)."""
    import traceback

    traceback.print_exc()
    return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def run_pair(makers: dict, args) -> dict:
    """BF16's and GAAC's runs of one scenario and mode (``makers``: name -> a call that makes the run's generator),
    their timed windows alternating: ``--interleave`` steps of one, then of the other, the order reversed every
    round (A B B A ...), until each has run ``--steps``.  Each run's state carries on from window to window (its
    joins, re-plans and captures fall where its own step count puts them), and the host's speed, which drifts
    by tens of percent between runs minutes apart on one machine, moves both alike.  Where both runs do not fit
    on the device together (or ``--interleave 0``), they run one after the other, each its steps in one window;
    a note says so."""
    results, live = {}, {}

    def start(name: str, make):
        """A run made and warmed, ``(generator, arm)``; None where it failed (its error reported).  Running out
        of device memory beside another live run is raised, for the caller to run them one after the other."""
        gen = make()
        try:
            return gen, next(gen)
        except Exception as exc:
            gen.close()
            if isinstance(exc, torch.OutOfMemoryError) and live:
                raise
            results[name] = failed(exc)
            return None

    def timed(runs: dict, note: str | None = None) -> None:
        """The timed windows of ``runs`` (name -> a live run), alternating where there are several, and their
        results; ``runs`` is emptied and what they held freed before the next run is made."""
        chunk = args.interleave or args.steps
        windows = {name: [] for name in runs}
        order, done, rounds = list(runs), 0, 0
        while done < args.steps and runs:
            n = min(chunk, args.steps - done)
            for name in order if rounds % 2 == 0 else order[::-1]:
                if name not in runs:
                    continue
                arm = runs[name][1]
                try:
                    windows[name].append(Window(arm.run, n, arm.counters)(args.warmup + done))
                except Exception as exc:
                    results[name] = failed(exc)
                    del runs[name]
            done, rounds = done + n, rounds + 1
        for name, (gen, _) in runs.items():
            try:
                results[name] = finished(gen, windows[name])
            except Exception as exc:
                results[name] = failed(exc)
            if note:
                results[name]["note"] = note
        runs.clear()
        ds.free()

    for name, make in makers.items():
        made = None                 # (not the run before's: it is live or done, and this name would keep it)
        try:
            made, fits = start(name, make), True
        except torch.OutOfMemoryError:
            fits = False
        if not fits:
            # both do not fit: the one made runs first, alone, then this one (here, not in the handler, whose
            # traceback holds the failed set-up's tensors)
            timed(live, "ran alone, before the other run of its scenario (both did not fit)")
            made = start(name, make)
            if made is not None:
                live[name], made = made, None
                timed(live, "ran alone, after the other run of its scenario (both did not fit)")
        elif made is not None:
            live[name], made = made, None
            if not args.interleave:
                timed(live)
    timed(live)
    return {name: results[name] for name in makers if name in results}


# ------------------------------------------------------------------------------------------------
# BF16 + flash

def run_bf16(model, src, _cal, s, lens, args, every: int, prompt: int, graph: bool) -> dict:
    b = len(lens)
    total = args.warmup + args.steps + args.profile + 2 * args.join_phases + args.host_profile + 1
    t_max = max(max(lens), prompt) + total + 1
    kc, vc = [], []
    for layer in range(s.layers):
        k = torch.zeros((b, s.kv_heads, t_max, s.head_dim), dtype=torch.int16, device=DEV)
        v = torch.zeros_like(k)
        for r, n in enumerate(lens):
            k[r, :, :n], v[r, :, :n] = content(src, layer, r, 0, n)
        kc.append(k.view(torch.bfloat16))
        vc.append(v.view(torch.bfloat16))
    nk, nv = new_tokens(src, s, b, max(lens), total)
    loop = ds.GraphLoop(ds.Loop(nk, nv, max(lens)))
    q = torch.randn((b, s.q_heads, s.head_dim), device=DEV).to(torch.bfloat16)
    mode, modes = ds.pick_flash_mode(s, kc, vc, max(lens), loop, q)
    att = ds.SdpaGraphAttend(s, kc, vc, max(lens), loop, mode, consume=True)
    att.lens.copy_(torch.tensor(lens, dtype=torch.int32, device=DEV))
    att.begin()
    del kc, vc
    ids = torch.randint(0, s.vocab, (b,), generator=torch.Generator().manual_seed(5)).to(DEV)

    def join(row: int) -> None:             # a new prompt into the row: its tokens and its length
        for layer in range(s.layers):
            k, v = content(src, layer, b + row, 0, prompt)
            att.k[layer][row, :prompt] = k.transpose(0, 1).view(torch.bfloat16)
            att.v[layer][row, :prompt] = v.transpose(0, 1).view(torch.bfloat16)
        att.lens[row] = prompt

    with torch.no_grad():
        model.step(ids, lambda layer, q: att.attend(layer, q, att.lens))    # warm the kernels outside a capture
        if graph:
            g, _ = ds.capture(model, ids, att)

            def step():
                g.replay()
        else:
            def step():
                att.begin()
                model.step(ids, att)
                att.end()

    joins = Joins(join, every, b, drain=args.join_drain)

    def run(j: int) -> None:
        joins(j)
        with torch.no_grad():
            step()

    Window(run, args.warmup)(0)
    res = yield Arm(run)                    # the timed windows (run_pair)
    res["join_ms"] = joins.since(args.warmup)
    res["join_drain_ms"] = joins.drained_since(args.warmup)
    res.update(flash_mode=mode, flash_modes_us=modes, tok_s=b / res["ms"] * 1e3)
    if args.profile:
        res["profile"] = ds.kernel_profile(run, args.warmup + args.steps, args.profile)
    if args.host_profile:
        host_profile(run, args.warmup + args.steps + args.profile, args.host_profile, args,
                     f"BF16 {'graph' if graph else 'eager'}, {b} x ~{max(lens)} tokens")
    log(f"  BF16 {'graph' if graph else 'eager'}: {res['ms']:.3f} ms/step")
    return res


# ------------------------------------------------------------------------------------------------
# GAAC at the defaults

def prompt_by_layer(cache, seq: int, kv, by_layer: bool) -> None:
    """A prompt into ``seq`` as a model's prefill hands it to the cache: ``update_layer`` a layer at a time
    (``kv(layer)`` gives the layer's K and V ``[kv_heads, tokens, head_dim]``), inside ``cache.deferred()`` (one
    transaction over the layers, applied after the last), or with ``by_layer`` a transaction a layer."""
    with contextlib.nullcontext() if by_layer else cache.deferred():
        for layer in range(cache.layers):
            k, v = kv(layer)
            cache.update_layer(layer, [seq], k[None], v[None])


def run_gaac(model, src, cal, s, lens, args, every: int, prompt: int, graph: bool) -> dict:
    b = len(lens)
    total = args.warmup + args.steps + args.profile + 2 * args.join_phases + args.host_profile + 1
    t_max = max(max(lens), prompt) + total + 1
    t0 = time.perf_counter()
    extra = {"codec": "cuda"} if SMOKE else {}      # the smoke run: the CUDA codec in numba's simulator
    cache = gaac.PagedKVCache(cal, max_seqs=b, max_blocks=t_max // L.BLOCK_TOKENS + 1, device=DEV, **extra)
    seqs = []
    for r, n in enumerate(lens):
        seq = cache.add_sequence()
        prompt_by_layer(cache, seq, lambda layer: content(src, layer, r, 0, n), args.join_by_layer)
        seqs.append(seq)
    ds.sync()
    res = {"prefill_s": time.perf_counter() - t0, "memory": str(cache.memory())}
    assert seqs == list(range(b))               # place i of the batch is cache row i (q and out are by row)
    nk, nv = new_tokens(src, s, b, max(lens), total)
    loop = ds.GraphLoop(ds.Loop(nk, nv, max(lens)))
    out = torch.empty((b, s.q_heads, s.head_dim), dtype=torch.bfloat16, device=DEV)
    ids = torch.randint(0, s.vocab, (b,), generator=torch.Generator().manual_seed(5)).to(DEV)
    held = {seq: (0, n) for seq, n in zip(seqs, lens)}       # row -> (content row, prompt tokens)
    appended = {seq: [] for seq in seqs}                      # row -> the steps whose token it took

    def fill(row: int) -> None:                 # the new sequence, in the row a removal freed, and its prompt
        seq = cache.add_sequence()
        assert seq == row
        prompt_by_layer(cache, seq, lambda layer: content(src, layer, b + row, 0, prompt), args.join_by_layer)
        held[row], appended[row] = (b + row, prompt), []

    def join(row: int) -> None:
        cache.remove_sequence(row)
        fill(row)

    if graph:
        def model_step(plan):
            with torch.no_grad():
                model.step(ids, ds.StepAttend(cache, loop, plan, out))
            loop.end()

        runner = gaac.StepGraph(cache, s.q_heads, model_step)

        def step():
            runner(seqs)
        counters = (lambda: (runner.captures, runner.eager_steps))
    else:
        def step():
            plan = cache.decode_plan(s.q_heads, seqs=seqs)
            with torch.no_grad():
                model.step(ids, ds.StepAttend(cache, loop, plan, out))
            loop.end()
        counters = None

    joins = Joins(join, every, b, drain=args.join_drain,
                  prof=cProfile.Profile() if args.join_profile and every else None)

    def run(j: int) -> None:
        joins(j)
        step()
        for seq in seqs:
            appended[seq].append(j)

    Window(run, args.warmup, counters)(0)
    res.update((yield Arm(run, counters)))  # the timed windows (run_pair)
    res["join_ms"] = joins.since(args.warmup)
    res["join_drain_ms"] = joins.drained_since(args.warmup)
    if joins.prof is not None:
        write_profile(joins.prof, args, f"GAAC {'graph' if graph else 'eager'}, {b} x ~{max(lens)} tokens: its "
                                        f"{len(joins.timed)} joins in the loop (warm-up and window)")
    res["tok_s"] = b / res["ms"] * 1e3
    if args.join_phases and every:
        first = args.warmup + args.steps

        def phase_step(j: int) -> None:
            step()
            for seq in seqs:
                appended[seq].append(j)

        prof = cProfile.Profile() if args.host_profile else None
        res["join_phases"] = join_phases(cache.remove_sequence, fill, phase_step, first, b, args.join_phases, prof)
        if prof is not None:
            write_profile(prof, args, f"GAAC {'graph' if graph else 'eager'}, {b} x ~{max(lens)} tokens: the join "
                          f"phases' {args.join_phases} prompts of {prompt} tokens, each after two steps")
    if args.host_profile and every:
        prof = cProfile.Profile()
        for i in range(3):
            row = 1 + i % max(b - 1, 1)
            cache.remove_sequence(row)
            ds.sync()
            prof.enable()
            fill(row)
            ds.sync()
            prof.disable()
        write_profile(prof, args, f"GAAC {'graph' if graph else 'eager'}, {b} x ~{max(lens)} tokens: 3 prompts of "
                      f"{prompt} tokens (add_sequence and every layer's update_layer in a deferral), the device "
                      "idle before each and synchronised after")
    if args.prompt_trace and every and not SMOKE:
        try:            # a diagnostic: where it fails, the run's figures still stand
            prompt_trace(cache, fill, b, args, f"GAAC {'graph' if graph else 'eager'}, {b} x ~{max(lens)} tokens: "
                         f"a {prompt}-token prompt after a removal, the device idle before and synchronised after")
        except Exception:
            import traceback

            traceback.print_exc()
    after = args.warmup + args.steps + 2 * (args.join_phases if every else 0)
    if args.profile:
        res["profile"] = ds.kernel_profile(run, after, args.profile)
    if args.host_profile:
        host_profile(run, after + args.profile, args.host_profile, args,
                     f"GAAC {'graph' if graph else 'eager'}, {b} x ~{max(lens)} tokens")
    res["epochs_appended"] = int(sum(cache.calibration.n_epochs(layer, kind) - cal.n_epochs(layer, kind)
                                     for layer in range(s.layers) for kind in (0, 1)))
    res["memory_after"] = str(cache.memory())
    log(f"  GAAC {'graph' if graph else 'eager'}: {res['ms']:.3f} ms/step, captures {res.get('captures')}, eager "
        f"steps {res.get('eager_steps')}, epochs appended {res['epochs_appended']}")
    res.update(check(cache, src, s, seqs, held, appended, nk, nv))
    if args.isolate and not SMOKE:
        res["isolate"] = isolate(cache, seqs, s, runner if graph else None)
    return res


def prompt_trace(cache, fill, batch: int, args, title: str) -> None:
    """One more join after the window under torch's profiler (host calls and CUDA runtime calls, with their
    host time: allocations, pinned-memory allocations, waits) and the allocators' counters around it,
    appended to ``<out>.trace.txt``: what a prompt's host time is spent on beyond Python (cProfile shows that)."""
    row = 1 % max(batch, 1)
    cache.remove_sequence(row)
    ds.sync()
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    host_keys = ("num_host_alloc", "num_host_free")

    def counters():
        dev = torch.cuda.memory_stats()
        host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        return {k: dev.get(k, 0) for k in keys} | {k: host.get(k, 0) for k in host_keys}

    before = counters()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        fill(row)
        ds.sync()
    wall = 1e3 * (time.perf_counter() - t0)
    after = counters()
    delta = ", ".join(f"{k} {after[k] - before[k]}" for k in after)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
    with args.out.with_suffix(".trace.txt").open("a") as f:
        f.write(f"## {title}\n\nwall {wall:.1f} ms under the profiler; allocator counters: {delta}\n\n{table}\n\n")


def host_profile(run, first: int, n: int, args, title: str) -> None:
    """Steps ``first`` .. ``first + n`` of a run under cProfile, synchronised at the end (so that the
    device's queue is inside), written to the profile file."""
    prof = cProfile.Profile()
    prof.enable()
    for j in range(first, first + n):
        run(j)
    ds.sync()
    prof.disable()
    write_profile(prof, args, f"{title}: {n} steps")


def write_profile(prof, args, title: str) -> None:
    """A profile's functions by own time and by cumulative time, appended to ``<out>.profile.txt``."""
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    path = args.out.with_suffix(".profile.txt")
    with path.open("a") as f:
        f.write(f"## {title}\n\n{text.getvalue()}\n")


def join_phases(remove, fill, step, first: int, batch: int, n: int, prof=None) -> dict:
    """After the window, ``n`` more joins taken apart, the device synchronised between the parts (so that each
    part's ms is its own, not the queue's): ``remove(row)``, then ``fill(row)`` (the new sequence and its prompt:
    host, then until the device is done), the first step after the join and the one after it (host, then until
    done).  Medians.  ``prof``: a cProfile.Profile the prompts run under (``--host-profile``)."""
    import statistics as st

    parts = {k: [] for k in ("remove_ms", "prompt_host_ms", "prompt_gc_ms", "prompt_done_ms", "first_step_host_ms",
                             "first_step_done_ms", "next_step_host_ms", "next_step_done_ms")}
    for i in range(n):
        row = 1 + i % max(batch - 1, 1)
        ds.sync()
        t0 = time.perf_counter()
        remove(row)
        ds.sync()
        t2 = time.perf_counter()
        with GCClock() as clock:
            if prof is not None:
                prof.enable()
            fill(row)
            if prof is not None:
                prof.disable()
        t3 = time.perf_counter()
        parts["prompt_gc_ms"].append(clock.ms)
        ds.sync()
        t4 = time.perf_counter()
        parts["remove_ms"].append(1e3 * (t2 - t0))
        parts["prompt_host_ms"].append(1e3 * (t3 - t2))
        parts["prompt_done_ms"].append(1e3 * (t4 - t2))
        for name, j in (("first", first + 2 * i), ("next", first + 2 * i + 1)):
            t = time.perf_counter()
            step(j)
            h = time.perf_counter()
            ds.sync()
            parts[f"{name}_step_host_ms"].append(1e3 * (h - t))
            parts[f"{name}_step_done_ms"].append(1e3 * (time.perf_counter() - t))
    res = {k: st.median(v) for k, v in parts.items()}
    log("  join phases (medians, ms): " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()))
    return res


def isolate(cache, seqs, s, runner) -> dict:
    """Attention over what the run's cache holds, apart from the step, every layer in turn (a graph per layer,
    replays rotating): through ``AttentionPlan`` (the attention benchmark's way) whole, its kernel alone and its
    merge alone, and through a one-step plan of the same lengths (``decode_plan(append=0)``: the fused merge);
    with each plan's splits, and those of the bucket's captured plan; and each layer's ``AttentionPlan`` alone, with
    the share of its tiles held raw."""
    from timing import graph_time_us

    from gaac.attention import AttentionPlan

    n = cache.max_seqs
    q = torch.randn((n, s.q_heads, s.head_dim), device=DEV).to(torch.bfloat16)
    out = torch.empty((n, s.q_heads, s.head_dim), dtype=torch.int16, device=DEV)
    lse = torch.empty((n, s.q_heads), dtype=torch.float32, device=DEV)
    plans = [AttentionPlan(cache.layer_view(layer), s.q_heads) for layer in range(s.layers)]
    step = cache.decode_plan(s.q_heads, append=0, seqs=seqs)
    res = {"plan_us": graph_time_us(lambda i: plans[i].run(q, out=out, lse=lse), s.layers, 5),
           "plan_kernel_us": graph_time_us(lambda i: plans[i]._launch_attention(q), s.layers, 5),
           "plan_merge_us": graph_time_us(lambda i: plans[i]._launch_merge(out, lse), s.layers, 5),
           "step_fused_us": graph_time_us(lambda i: step.run(q, i, out=out.view(torch.bfloat16)), s.layers, 5),
           "plan_splits": [plans[0].n_work, plans[0].blocks_per_split],
           "step_splits": [step.n_work, step.blocks_per_split]}
    blocks = int(sum(cache.seq_len(r) for r in seqs)) // L.BLOCK_TOKENS
    res["raw_tiles_share"] = cache._arena.used() / max(blocks * cache.tiles_per_block * cache.layers * 2, 1)
    # each layer apart: its attention through AttentionPlan, and the share of its finalized tiles held raw
    # (block-table entries with the raw flag: negative as int32)
    res["layer_us"], res["layer_raw"] = [], []
    for layer in range(s.layers):
        res["layer_us"].append(round(graph_time_us(lambda i, p=plans[layer]: p.run(q, out=out, lse=lse), 1, 5), 1))
        view = cache.layer_view(layer)
        raw = tiles = 0
        for table in view.table:
            for r in seqs:
                e = table[r, :cache.seq_len(r) // L.BLOCK_TOKENS]
                raw, tiles = raw + int((e < 0).sum()), tiles + e.numel()
        res["layer_raw"].append(round(raw / max(tiles, 1), 4))
    if runner is not None:
        from gaac.attention_launch import layer_launch

        lse_b = torch.empty((n, s.q_heads), dtype=torch.float32, device=DEV)
        outb = out.view(torch.bfloat16)
        for size, bp in runner._plans.items():      # the bucket's launches (kernel, merge), without the model
            res[f"bucket{size}_us"] = graph_time_us(
                lambda i: bp._launch(layer_launch(cache, i, bp.g, False), i, q, outb, lse_b), s.layers, 5)
        for size, bp in runner._plans.items():
            res[f"bucket{size}"] = {"n_work": bp.n_work, "blocks_per_split": bp.blocks_per_split,
                                    "room": bp._room, "grid": list(bp._grid), "merge_grid": str(bp._merge_grid)}
    log(f"  isolated: {res}")
    return res


def check(cache, src, s, seqs, held, appended, nk, nv) -> dict:
    """Row 0 read back bit-exact (first and last layer); layer 0's attention of every row against float64."""
    ok = True
    for layer in (0, s.layers - 1):
        row = seqs[0]
        src_row, n = held[row]
        k, v = cache.read_layer(layer, [row])
        ek, ev = content(src, layer, src_row, 0, n)
        steps = torch.tensor(appended[row], device=DEV)
        ak = nk[layer].index_select(0, steps)[:, row].permute(1, 0, 2).contiguous().view(torch.int16)
        av = nv[layer].index_select(0, steps)[:, row].permute(1, 0, 2).contiguous().view(torch.int16)
        ok &= bool(torch.equal(k[0], torch.cat([ek, ak], dim=1)) and torch.equal(v[0], torch.cat([ev, av], dim=1)))
    q = torch.randn((cache.max_seqs, s.q_heads, s.head_dim), device=DEV).to(torch.bfloat16)
    out = cache.decode_plan(s.q_heads, append=0, seqs=seqs).run(q, 0).float()
    worst = 0.0
    for row in seqs:
        k, v = (x[0].view(torch.bfloat16).double() for x in cache.read_layer(0, [row]))   # [kv_heads, T, D]
        qr = q[row].double().view(s.kv_heads, s.group, s.head_dim)
        p = torch.softmax(torch.einsum("hgd,htd->hgt", qr, k) / s.head_dim ** 0.5, dim=-1)
        ref = torch.einsum("hgt,htd->hgd", p, v).reshape(s.q_heads, s.head_dim)
        worst = max(worst, float((out[row].double() - ref).norm() / ref.norm()))
    return {"bit_exact": ok, "attention_rel_err": worst}


# ------------------------------------------------------------------------------------------------

def keep_earlier(rep: dict, old: dict) -> None:
    """Take the runs of the earlier report ``old`` into ``rep``, each marked as kept and holding the commit it ran
    at (a run of a report from before runs carried their commits gets its header's first commit, or, where it was
    kept there too, the first commit that header names for such runs)."""
    rep["scenarios"] = old["scenarios"]
    heads = re.findall(r"\b[0-9a-f]{7,40}\b", old["commit"])
    for sc in rep["scenarios"].values():
        for val in sc.values():
            if isinstance(val, dict):
                if "commit" not in val:
                    val["commit"] = heads[1 if val.get("earlier") and len(heads) > 1 else 0][:7]
                val["earlier"] = True


def render(rep: dict) -> str:
    kept = sorted({v["commit"] for sc in rep["scenarios"].values() for v in sc.values()
                   if isinstance(v, dict) and v.get("earlier") and v.get("commit")})
    rep = {**rep, "commit": rep["commit"] + (f" (runs marked *: {', '.join(kept)})" if kept else "")}
    lines = report.head("The serving loop at the defaults: GAAC against BF16 + flash", rep)
    lines += [f"- {rep['steps']} timed steps after {rep['warmup']}; GAAC `PagedKVCache` defaults (adapt=True, pools as "
              f"the cache sizes them), calibration from the first {rep['cal_tokens']} tokens; lengths {GAP} tokens "
              "apart; every capture, eager step, re-plan and join inside the window",
              (f"- BF16's and GAAC's windows alternate every {rep['interleave']} steps (A B B A ...), both runs live, "
               "so that the host's drift moves both alike" if rep.get("interleave") else
               "- each run's steps in one window, BF16's run before GAAC's")]
    altered = [what for key, what in (("join_drain", "the device synchronised before each join (`--join-drain`)"),
                                      ("join_profile", "GAAC's joins under cProfile (`--join-profile`)"))
               if rep.get(key)]
    if altered:
        lines.append(f"- a diagnostic run, not the user's loop: {' and '.join(altered)}; its rows are no serving "
                     "figure (those are the runs without these options)")
    if rep.get("interleave") and any(isinstance(v, dict) and v.get("earlier") and v.get("ms") and not v.get("windows")
                                     for sc in rep["scenarios"].values() for v in sc.values()):
        lines.append("- rows marked * whose runs predate the alternating windows ran one after the other, each in "
                     "one window")
    lines.append("")
    rows = []
    for name, sc in rep["scenarios"].items():
        for mode in ("graph", "eager"):
            b, g = sc.get(f"bf16_{mode}", {}), sc.get(f"gaac_{mode}", {})
            x = b["ms"] / g["ms"] if b.get("ms") and g.get("ms") else float("nan")
            target = sc["target_" + mode]
            star = "*" if g.get("earlier") else ""
            rows.append([name + star, mode, f"{b.get('ms', float('nan')):.2f}", f"{g.get('ms', float('nan')):.2f}",
                         f"{x:.3f}x", f">= {target:.2f}x", "yes" if x >= target else "NO",
                         f"{g.get('captures', '-')} / {g.get('eager_steps', '-')}" if mode == "graph" else "-",
                         g.get("epochs_appended", "-"),
                         ("yes" if g["bit_exact"] else "NO") if "bit_exact" in g else "-",
                         f"{g['attention_rel_err']:.1e}" if "attention_rel_err" in g else "-"])
    lines += ds.table(["scenario", "mode", "BF16 ms/step", "GAAC ms/step", "GAAC speed", "target", "met",
                       "captures / eager steps", "epochs appended", "read-back bit-exact", "attention rel. err"],
                      rows)
    errors = [f"- {name} {k}: {v['error']}" for name, sc in rep["scenarios"].items() for k, v in sc.items()
              if isinstance(v, dict) and "error" in v]
    if errors:
        lines += ["", "Runs that failed:", "", *errors]
    notes = [f"- {name} {k}: {v['note']}" for name, sc in rep["scenarios"].items() for k, v in sc.items()
             if isinstance(v, dict) and "note" in v]
    if notes:
        lines += ["", "Notes:", "", *notes]
    how = ("a transaction a layer" if rep.get("join_by_layer") else
           "inside `cache.deferred()`: one transaction over the layers")
    joined = [f"- {name} {k}: {len(v['join_ms'])} joins in the window, host wall of each (the row's removal, the "
              f"new sequence and its prompt through `update_layer`, every layer, {how}; it waits for the GPU where "
              f"the cache does) median {statistics.median(v['join_ms']):.1f} ms, max {max(v['join_ms']):.1f} ms"
              + (f"; the device synchronised before each (`--join-drain`), that wait median "
                 f"{statistics.median(v['join_drain_ms']):.2f} ms" if v.get("join_drain_ms") else "")
              for name, sc in rep["scenarios"].items() for k, v in sc.items()
              if isinstance(v, dict) and v.get("join_ms") and not v.get("earlier")]
    joined += [f"- {name} {k}, a join taken apart after the window (the device synchronised between the parts; "
               "medians, ms): " + ", ".join(f"{part.replace('_ms', '').replace('_', ' ')} {ms:.2f}"
                                            for part, ms in v["join_phases"].items())
               for name, sc in rep["scenarios"].items() for k, v in sc.items()
               if isinstance(v, dict) and v.get("join_phases") and not v.get("earlier")]
    if joined:
        lines += ["", "Joins:", "", *joined]
    spread = []
    for name, sc in rep["scenarios"].items():
        for mode in ("graph", "eager"):
            b, g = sc.get(f"bf16_{mode}", {}), sc.get(f"gaac_{mode}", {})
            ratios = window_ratios(b, g)
            if ratios and not g.get("earlier"):
                spread.append(f"- {name} {mode}: BF16 / GAAC ms of each pair of windows "
                              + ", ".join(f"{x:.3f}" for x in ratios)
                              + f" (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if spread:
        lines += ["", "Window by window (the run's drift within it):", "", *spread]
    lines += ["", "Event medians (ms/step, the steps' GPU time) and GAAC's memory:", ""]
    for name, sc in rep["scenarios"].items():
        med = {k: f"{v.get('event_median_ms', float('nan')):.2f}" for k, v in sc.items() if isinstance(v, dict)}
        lines.append(f"- {name}: {sc['batch']} x ~{sc['context']} tokens"
                     + (f", a sequence replaced by a {sc['prompt']}-token prompt every {sc['every']} steps"
                        if sc["every"] else "") + f"; event medians {med}; GAAC prefill "
                     f"{sc.get('gaac_graph', {}).get('prefill_s', float('nan')):.1f} s; "
                     f"{sc.get('gaac_graph', {}).get('memory', '')}")
    gcs = [f"- {name} {k}: {v['gc_collections']} collections ({v['gc_full']} of the oldest generation), "
           f"{v['gc_ms']:.1f} ms in all, {v['gc_ms'] / v['steps']:.3f} ms a step"
           for name, sc in rep["scenarios"].items() for k, v in sc.items()
           if isinstance(v, dict) and "gc_ms" in v and not v.get("earlier")]
    if gcs:
        lines += ["", "Python's garbage collector inside the window (host time, `gc.callbacks`):", "", *gcs]
    # a run kept from an earlier report keeps its profile and isolated attention, marked * as its row is
    def kept(field):
        return [(f"{name}{'*' if v.get('earlier') else ''} {k}", v[field]) for name, sc in rep["scenarios"].items()
                for k, v in sc.items() if isinstance(v, dict) and v.get(field)]

    lines += ds.profile_lines(kept("profile"))
    isolated = [isolated_line(name, iso) for name, iso in kept("isolate")]
    if isolated:
        lines += ["", "The cache's attention apart from the step (`--isolate`: a graph a layer, replays rotating; us a "
                  "layer):", "", *isolated]
    return "\n".join(lines) + "\n"


def isolated_line(name: str, iso: dict) -> str:
    """One report line of :func:`isolate`'s figures."""
    line = (f"- {name}: AttentionPlan {iso['plan_us']:.1f} (kernel {iso['plan_kernel_us']:.1f}, merge alone "
            f"{iso['plan_merge_us']:.1f}), one-step plan with the fused merge {iso['step_fused_us']:.1f}; splits "
            f"{iso['plan_splits'][0]} of {iso['plan_splits'][1]} blocks; raw tiles {100 * iso['raw_tiles_share']:.2f}%")
    for key, val in iso.items():
        if key.startswith("bucket") and key.endswith("_us"):
            line += f"; the bucket's kernel and merge {val:.1f}"
    if iso.get("layer_us"):
        us, raw = iso["layer_us"], iso["layer_raw"]
        line += (f"; by layer {min(us):.1f}-{max(us):.1f} (raw tiles {100 * min(raw):.2f}-{100 * max(raw):.2f}%, "
                 f"the slowest layer's {100 * raw[us.index(max(us))]:.2f}%)")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ds.common_args(ap)
    ap.add_argument("--scenarios", default=None, help=f"comma-separated, of {list(SCENARIOS)} (default all)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 256; smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="steps before timing (default 16; smoke 1)")
    ap.add_argument("--cal-tokens", type=int, default=1024, help="calibrate on the first N tokens (default 1024)")
    ap.add_argument("--modes", default="graph,eager", help="graph, eager or both")
    ap.add_argument("--interleave", type=int, default=64,
                    help="BF16's and GAAC's timed windows alternate every N steps, both runs live (default 64; "
                         "0: one run after the other, each in one window)")
    ap.add_argument("--runs", default=None, help="only these scenario:mode pairs (comma-separated)")
    ap.add_argument("--profile", type=int, default=0,
                    help="after the window, N steps more under torch's profiler: the kernels of a step (GPU only)")
    ap.add_argument("--host-profile", type=int, default=0,
                    help="after the window, N steps more under cProfile, and the join phases' prompts "
                         "(<out>.profile.txt)")
    ap.add_argument("--isolate", action="store_true",
                    help="after each GAAC run, time its cache's attention apart from the step, whole and layer by "
                         "layer (GPU only)")
    ap.add_argument("--join-phases", type=int, default=0,
                    help="after each GAAC run with joins, N more joins taken apart, the device synchronised "
                         "between the parts (outside the window)")
    ap.add_argument("--join-drain", action="store_true",
                    help="the device synchronised before each join, its wait timed apart from the join (diagnostic: "
                         "what a join's host time is without the steps queued before it)")
    ap.add_argument("--join-profile", action="store_true",
                    help="GAAC's joins in the loop under cProfile (<out>.profile.txt)")
    ap.add_argument("--prompt-trace", action="store_true",
                    help="after each GAAC run with joins, one more join under torch's profiler: CUDA runtime calls "
                         "and the allocators' counters (<out>.trace.txt)")
    ap.add_argument("--join-by-layer", action="store_true",
                    help="GAAC's prompts through update_layer without a deferral: a transaction a layer (the old way)")
    ap.add_argument("--merge", type=Path, default=None,
                    help="a results JSON of an earlier run: its runs are kept where this run does not repeat them "
                         "(a BF16 and GAAC pair is replaced only once both have run; the report names both commits)")
    args = ap.parse_args()
    if args.merge and (args.join_drain or args.join_profile):
        ap.error("--join-drain and --join-profile alter the loop: their runs are not merged into a results file")
    s = ds.SMOKE_SHAPE if SMOKE else ds.LLAMA_8B
    table = SMOKE_SCENARIOS if SMOKE else SCENARIOS
    names = args.scenarios.split(",") if args.scenarios else list(table)
    args.steps = args.steps or (4 if SMOKE else 256)
    args.warmup = args.warmup if args.warmup is not None else (1 if SMOKE else 16)
    modes = args.modes.split(",")
    if not SMOKE:
        torch.backends.cuda.matmul.allow_tf32 = False
    k_u, v_u = ds.real_source(ds.find_data(args.data), s)
    cal = gaac.calibrate(k_u[:, :, :args.cal_tokens], v_u[:, :, :args.cal_tokens], show_progress=False)
    src = ds.Source(k_u, v_u)
    model = ds.Model(s)
    rep = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": "CPU (simulator, smoke)" if SMOKE else
           torch.cuda.get_device_name(), "commit": ds.commit(),
           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "steps": args.steps,
           "warmup": args.warmup, "cal_tokens": args.cal_tokens, "join_by_layer": args.join_by_layer,
           "join_drain": args.join_drain, "join_profile": args.join_profile,
           "interleave": args.interleave, "scenarios": {}}
    only = set(args.runs.split(",")) if args.runs else None
    if args.host_profile:
        args.out.with_suffix(".profile.txt").unlink(missing_ok=True)
    if args.prompt_trace:
        args.out.with_suffix(".trace.txt").unlink(missing_ok=True)
    if args.merge:
        keep_earlier(rep, json.loads(args.merge.read_text()))
    for mode in modes:                  # every scenario's graphs first: a run cut short keeps the most of them
        for name in names:
            batch, context, every, prompt, t_graph, t_eager = table[name]
            lens = [context - GAP * i for i in range(batch)]
            sc = rep["scenarios"].setdefault(name, {"batch": batch, "context": context, "every": every,
                                                    "prompt": prompt, "target_graph": t_graph,
                                                    "target_eager": t_eager})
            log(f"{name} ({mode}): batch {batch}, lengths {lens[0]}..{lens[-1]}")
            graph = mode == "graph"
            if only is not None and f"{name}:{mode}" not in only:
                continue
            # a ratio is of two runs in one process: the pair replaces a merged one only once both have run,
            # so that a run cut short leaves the earlier pair, not a new BF16 beside an old GAAC
            makers = {f"{kind}_{mode}": (lambda run=run: run(model, src, cal, s, lens, args, every, prompt, graph))
                      for kind, run in (("bf16", run_bf16), ("gaac", run_gaac))
                      if not (kind == "bf16" and SMOKE)}          # torch's flash kernel needs a GPU
            pair = run_pair(makers, args)         # (which frees what its runs held)
            for run in pair.values():
                run["commit"] = rep["commit"][:7]
            sc.update(pair)
            ds.write(rep, args.out, render)
    print(render(rep))


if __name__ == "__main__":
    main()
