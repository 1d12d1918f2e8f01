"""What a join asks of the device: the host's device operations and waits when a serving loop replaces a sequence.

    python benchmarks/join_host.py [--out benchmarks/results/join-host-cpu.md]       # CPU + numba's simulator: counts
    python benchmarks/join_host.py --layers 4,32 --batch 8 --base 64 --steps 16 --calib 512 --joins 0 --calls 0 \\
        --host-ms 12                                                                  # the host's own time
    python benchmarks/join_host.py --device cuda --layers 32 --kv-heads 8 --head-dim 128 --prompt 4096 \\
        --out $OUT/join-host-h200.md                                                  # a GPU: counts and host time

A join is what benchmarks/serving.py's join scenario does between two steps: a sequence leaves and a prompt's K/V
(every layer) take its row,

    cache.remove_sequence(row)
    row = cache.add_sequence(k, v)          # [layers, kv_heads, prompt, head_dim] on the device

in a paged cache with adaptation on (its default) and the adaptation rule on the device.
The content is real: the sample shipped in the package (SmolLM2-135M's K/V on English prose, 768 tokens; its
layers and heads repeated for more, two heads side by side for a head of 128).  The batch holds its first
``--base + 97 i`` tokens, the prompt is its last ``--prompt`` tokens, and the calibration comes from its first
``--calib`` tokens.  In a serving loop the GPU still runs the steps queued before the join: every wait of the host
drains that queue and leaves the GPU idle while the host goes on, so what counts is how many waits a join makes
and whether they grow with the layers; the table also says how many epochs the join appended.

Counted (benchmarks/step_host.py's :class:`StepOps`, the GPU's branches counted as a GPU takes them), by the part
of the join that issues them: ``remove`` (``remove_sequence``), ``prepare`` (each layer's update prepared),
``flush`` (the adapters brought up to date with the blocks decode steps finished: with ``--steps N``, N eager
decode steps of every row before each join, as a serving loop runs them between joins),
``rule`` (the rule's batch launched), ``reserve`` (records reserved, loans from the arena), ``encode`` (the
encodes launched, their counts read where a list might run dry, and the layers whose epochs the rule changed
encoded again), ``decisions`` (the rule's decisions taken up), ``commit`` (tables, tails, epochs appended),
``other`` (the lengths).  On the CPU the wall time is the
simulator's kernels': the counts are the result there, and with ``--calls N`` (``--joins`` by default) N more joins'
Python function calls by part (:class:`PartCalls`: every call but those inside a kernel launch), which make most
of a GPU host's time for a join, and with ``--host-ms N`` the median host time of N more joins whose kernels the
simulator does not run (:func:`no_kernels`: the host's own work, a quick measure of a change to it; the memory
operations a GPU queues are done at the CPU's speed, so it is no GPU host's time); with ``--device cuda`` the host time of the join (no
synchronisation inside it) and the device time after it are measured in a second run without the counter, and
each part's own host time in a third (:class:`PartClock`; ``--fine`` also takes the rule's set-up, scan and chain,
the blocks it copies to the host, the early write and the decisions taken up apart).  The decode steps hold
their plan, as a serving loop does, so that each token goes through the plan's one launch a layer.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1" if "--device" not in sys.argv or "cpu" in sys.argv else "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.construction import patch  # noqa: E402
from benchmarks.report import commit_with_changes, table  # noqa: E402
from benchmarks.step_host import DEVICE_OPS, KINDS, StepOps  # noqa: E402

PARTS = ("remove", "prepare", "flush", "rule", "reserve", "encode", "decisions", "commit", "other")


def sample(layers: int, heads: int, dim: int) -> tuple:
    """The shipped real sample (``gaac/data``, SmolLM2-135M on English prose: 4 layers, 3 KV heads x 64, 768
    tokens) as K and V BF16 bits ``[layers, heads, 768, dim]``: its layers and heads repeated, and for a wider head
    ``dim // 64`` of its heads side by side."""
    data = np.load(ROOT / "gaac" / "data" / "smollm2-135m__prose.npz")
    per = dim // 64
    li = np.arange(layers) % data["k"].shape[0]
    hi = (np.arange(heads * per) % data["k"].shape[1]).reshape(heads, per)

    def tile(x):
        x = x[li][:, hi]                                        # [layers, heads, per, tokens, 64]
        return np.ascontiguousarray(x.transpose(0, 1, 3, 2, 4).reshape(layers, heads, x.shape[3], dim))

    return tile(data["k"]), tile(data["v"])


def make_cache(args, layers: int):
    """A cache holding ``args.batch`` sequences of ``args.base + 97 i`` tokens of the sample's text and the prompt
    that joins (its last ``args.prompt`` tokens), calibrated on the text's first ``args.calib`` tokens."""
    import gaac
    from gaac import PagedKVCache

    k_all, v_all = sample(layers, args.kv_heads, args.head_dim)
    lens = [args.base + 97 * i for i in range(args.batch)]
    if max(lens) > k_all.shape[2] or args.prompt > k_all.shape[2]:
        raise SystemExit(f"the sample holds {k_all.shape[2]} tokens: lengths {lens} and a {args.prompt}-token prompt "
                         "do not fit")
    kv = [(k_all[:, :, :n], v_all[:, :, :n]) for n in lens]
    cal = gaac.calibrate(k_all[:, :, :args.calib], v_all[:, :, :args.calib])
    blocks = -(-max(max(lens), args.prompt) // 16) + 1
    # pools as the cache sizes them for its table; grow=True: the sample's content, calibrated on its first
    # tokens, overflows more tiles than that arena holds (as it does an arena sized from a budget), and the cache
    # then grows it, inside the counted calls as in a user's
    cache = PagedKVCache(cal, max_seqs=args.batch, max_blocks=blocks, device=args.device, codec="cuda", grow=True)
    dev = cache.device
    if args.device == "cpu":
        # the simulator's encoder takes a tenth of a second a tile: the batch is encoded by the reference codec
        # and imported, bytes unchanged (the join's prompt goes through the CUDA codec)
        ref = PagedKVCache(cal, max_seqs=1, max_blocks=blocks, codec="reference", grow=True)
        rows = []
        for k, v in kv:
            ref.add_sequence(k, v)
            rows.append(cache.import_sequence(ref.export_sequence(0)))
            ref.remove_sequence(0)
        cache._rule_on_device = True          # the prompt's rule on the device, as on a GPU
    else:
        rows = [cache.add_sequence(torch.from_numpy(k.view(np.int16)).to(dev),
                                   torch.from_numpy(v.view(np.int16)).to(dev)) for k, v in kv]
    end = k_all.shape[2]
    pk = torch.from_numpy(k_all[:, :, end - args.prompt:].copy().view(np.int16)).to(dev)
    pv = torch.from_numpy(v_all[:, :, end - args.prompt:].copy().view(np.int16)).to(dev)
    # the decode steps' tokens: ``[tokens, layers, kv_heads, dim]`` of the text's middle, the same for every row
    mid = k_all.shape[2] // 2
    tokens = (torch.from_numpy(np.ascontiguousarray(k_all[:, :, mid:mid + 64].transpose(2, 0, 1, 3)).view(np.int16)).to(dev),
              torch.from_numpy(np.ascontiguousarray(v_all[:, :, mid:mid + 64].transpose(2, 0, 1, 3)).view(np.int16)).to(dev))
    return cache, rows, pk, pv, tokens


def decode_steps(cache, rows, tokens, n: int, first: int) -> None:
    """``n`` eager decode steps of every row (a serving loop's steps between joins, without the attention, which
    writes only its outputs): each layer takes one token a row through ``update_layer``, as ``decode_plan``'s
    fast path takes it."""
    tk, tv = tokens
    for t in range(first, first + n):
        # the loop holds its step's plan, as one that attends through it does: the cache keeps only a weak
        # reference, and a token without its plan takes update_layer's full path
        plan = cache.decode_plan(2 * cache.kv_heads, seqs=rows)  # noqa: F841
        k = tk[t % len(tk)]
        v = tv[t % len(tv)]
        for layer in range(cache.layers):
            kl = k[layer][None, :, None].expand(len(rows), -1, -1, -1).contiguous()
            vl = v[layer][None, :, None].expand(len(rows), -1, -1, -1).contiguous()
            cache.update_layer(layer, rows, kl, vl)


def held_epochs(cache) -> int:
    """The epochs every layer and kind's store holds, counted without bringing the adapters up to date (reading
    ``cache.calibration`` would: the queued decode blocks' checks would run before the join, not in it)."""
    return sum(store.tb3.shape[0] for layer in range(cache.layers) for store in cache.stores(layer))


def join(cache, rows, pk, pv, i: int) -> None:
    """Sequence ``i % batch`` leaves and the prompt takes its row."""
    at = i % len(rows)
    cache.remove_sequence(rows[at])
    rows[at] = cache.add_sequence(pk, pv)


# the join's parts, by the methods that do them (as counted; a part called inside another is its own)
HOOKS = (("PagedKVCache", "remove_sequence", "remove"), ("UpdateTransaction", "_prepare", "prepare"),
         ("UpdateTransaction", "_flush", "flush"), ("UpdateTransaction", "_launch_rule", "rule"),
         ("UpdateTransaction", "_reserve", "reserve"), ("UpdateTransaction", "_encode_on_device", "encode"),
         ("UpdateTransaction", "_encode_again", "encode"), ("UpdateTransaction", "_finish_rule", "decisions"),
         ("UpdateTransaction", "_commit_all", "commit"))


# with --fine, the rule's launch taken apart too
FINE = (("Batch", "_setup", "rule setup"), ("Batch", "scan", "rule scan"), ("Batch", "chain", "rule chain"),
        ("epochs", "host_values", "host values"), ("UpdateTransaction", "_written_early", "written early"),
        ("Batch", "_recent_blocks", "recent blocks"), ("Batch", "_finish", "decisions taken"))


def owners() -> dict:
    import gaac.epochs
    from gaac.cache.paged import PagedKVCache
    from gaac.cache.update import UpdateTransaction
    from gaac.cuda.epochs import Batch

    return {"PagedKVCache": PagedKVCache, "UpdateTransaction": UpdateTransaction, "Batch": Batch,
            "epochs": gaac.epochs}


class PartClock:
    """The host time of a join by part (:data:`HOOKS`), each part's own: a part called inside another is taken out of
    the outer one's time, and what no part covers is ``other``.  A clock reading around each hooked call (some two
    hundred in a 32-layer join) is all it adds."""

    def __init__(self, hooks=HOOKS):
        self.hooks = hooks
        self.ms = collections.Counter()
        self._stack, self._t, self._hooked = ["other"], 0.0, contextlib.ExitStack()

    def _enter(self, part: str) -> None:
        now = time.perf_counter()
        self.ms[self._stack[-1]] += (now - self._t) * 1e3
        self._stack.append(part)
        self._t = now

    def _exit(self) -> None:
        now = time.perf_counter()
        self.ms[self._stack.pop()] += (now - self._t) * 1e3
        self._t = now

    def __enter__(self) -> "PartClock":
        found = owners()
        for owner_name, name, part in self.hooks:
            owner = found[owner_name]

            def wrapped(*a, _old=getattr(owner, name), _part=part, **kw):
                self._enter(_part)
                try:
                    return _old(*a, **kw)
                finally:
                    self._exit()

            patch(self._hooked, owner, name, wrapped)
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.ms["other"] += (time.perf_counter() - self._t) * 1e3
        self._hooked.close()


class PartCalls:
    """The Python function calls a join makes on the host, by part (:data:`HOOKS`, each part's own as in
    :class:`PartClock`), counted with :func:`sys.setprofile`: every call of a Python function or a builtin (a
    torch op among them), but none inside a kernel launch (:class:`gaac.cuda.launch.TileLauncher`'s, a rule
    batch's ``_launch``), whose arguments the simulator converts where a GPU's host packs them.  On the CPU these
    counts are the host's work as a GPU's host does it, independent of the simulator's speed: a join's host time
    on a GPU is mostly its calls (tens of thousands at 32 layers, a fraction of a microsecond each, besides the
    device operations :class:`~benchmarks.step_host.StepOps` counts)."""

    def __init__(self, hooks=HOOKS):
        self.hooks = hooks
        self.calls = collections.Counter()
        self._stack, self._off, self._skip, self._hooked = ["other"], 0, False, contextlib.ExitStack()

    def _count(self, frame, event, arg) -> None:
        if self._off or not (event == "call" or event == "c_call"):
            return
        if self._skip and event == "call":      # a hooked method's own call: counted as its wrapper's, once
            self._skip = False
            return
        self.calls[self._stack[-1]] += 1

    def __enter__(self) -> "PartCalls":
        from gaac.cuda.epochs import Batch
        from gaac.cuda.launch import TileLauncher

        found = owners()
        for owner_name, name, part in self.hooks:
            # the wrapper's call counts as the method's, in the caller's part; its own work is not counted
            def in_part(*a, _old=getattr(found[owner_name], name), _part=part, **kw):
                self._off += 1
                self._stack.append(_part)
                self._off -= 1
                self._skip = True
                try:
                    return _old(*a, **kw)
                finally:
                    self._off += 1
                    self._stack.pop()
                    self._off -= 1

            patch(self._hooked, found[owner_name], name, in_part)
        for owner, name in ((TileLauncher, "launch"), (Batch, "_launch")):
            def launch(*a, _old=getattr(owner, name), **kw):     # counted as one call where it is made
                self._off += 1
                try:
                    return _old(*a, **kw)
                finally:
                    self._off -= 1

            patch(self._hooked, owner, name, launch)
        sys.setprofile(self._count)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        self._hooked.close()


@contextlib.contextmanager
def no_kernels():
    """The simulator's kernel launches do nothing (device functions called inside a kernel still run): what is
    left of a join is the host's own work.  Its results are then not a cache's (nothing encoded, the rule's
    decisions its inputs), so these joins come last, and only their time is read."""
    from numba.cuda.simulator import kernel as simulated

    real = simulated.FakeCUDAKernel.__call__

    def launch(self, *args):
        return real(self, *args) if self._device or simulated._kernel_context else None

    simulated.FakeCUDAKernel.__call__ = launch
    try:
        yield
    finally:
        simulated.FakeCUDAKernel.__call__ = real


def measure(args, layers: int) -> dict:
    cache, rows, pk, pv, tokens = make_cache(args, layers)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    epochs_before = held_epochs(cache)
    joins = []
    i = 0
    for j in range(args.joins):
        decode_steps(cache, rows, tokens, args.steps, j * args.steps)
        sync()
        with StepOps(args.device) as ops:
            found = owners()
            for owner, name, part in HOOKS:
                ops.in_phase(found[owner], name, part)
            ops.phase = "other"
            before = held_epochs(cache)
            join(cache, rows, pk, pv, i)
            counts, by_op, _, _ = ops.new_step()
        appended = held_epochs(cache) - before
        joins.append(dict(counts={p: dict(c) for p, c in counts.items()}, by_op={p: dict(c) for p, c in by_op.items()},
                          epochs=appended))
        i += 1
    calls = []
    for j in range(args.calls):      # the CPU (main sets none on a GPU): more joins, their Python calls counted
        decode_steps(cache, rows, tokens, args.steps, (args.joins + j) * args.steps)
        before = held_epochs(cache)
        with PartCalls() as counted:
            join(cache, rows, pk, pv, i)
        calls.append(dict(calls=dict(counted.calls), epochs=held_epochs(cache) - before))
        i += 1
    sync()
    bare = []
    for j in range(0 if cuda else args.host_ms):     # the CPU: the host's own work, the kernels not run
        with no_kernels():
            decode_steps(cache, rows, tokens, args.steps, (args.joins + args.calls + j) * args.steps)
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                join(cache, rows, pk, pv, i)
                bare.append((time.perf_counter() - t0) * 1e3)
            finally:
                gc.enable()
        i += 1
    host_ms, device_ms, parts = [], [], collections.defaultdict(list)
    for r in range(args.runs if cuda else 0):
        decode_steps(cache, rows, tokens, args.steps, (args.joins + r) * args.steps)
        sync()
        t0 = time.perf_counter()
        join(cache, rows, pk, pv, i)
        t1 = time.perf_counter()
        sync()
        host_ms.append((t1 - t0) * 1e3)
        device_ms.append((time.perf_counter() - t0) * 1e3)
        i += 1
    for r in range(args.runs if cuda else 0):       # again, each part's host time clocked
        decode_steps(cache, rows, tokens, args.steps, (args.joins + args.runs + r) * args.steps)
        sync()
        with PartClock(HOOKS + (FINE if args.fine else ())) as clock:
            join(cache, rows, pk, pv, i)
        sync()
        for part in PARTS + tuple(p for _, _, p in FINE if args.fine):
            parts[part].append(clock.ms.get(part, 0.0))
        i += 1
    epochs = held_epochs(cache) - epochs_before
    return dict(layers=layers, joins=joins, calls=calls, epochs_appended=epochs,
                bare_ms=statistics.median(bare) if bare else None,
                host_ms=statistics.median(host_ms) if host_ms else None,
                part_ms={part: statistics.median(v) for part, v in parts.items()},
                done_ms=statistics.median(device_ms) if device_ms else None)


def render(rep: dict) -> str:
    a = rep["args"]
    out = [f"# A join's host side: device operations, waits and Python calls ({rep['device']})", "",
           f"- {rep['machine']}, {rep['date']}, commit {rep['commit']}, torch {rep['torch']}",
           f"- command: `{rep['command']}`",
           f"- a batch of {a['batch']} sequences ({a['base']} + 97 i tokens), {a['kv_heads']} KV heads x {a['head_dim']}; "
           f"a {a['prompt']}-token prompt replaces one, {a['joins']} times counted"
           + (f" (then {a['calls']} more, their Python calls counted)" if a.get("calls") else "")
           + (f" (then {a['host_ms']} more, timed with the simulator's kernels not run)" if a.get("host_ms") else "")
           + (f", each after {a['steps']} eager decode steps of every row" if a.get("steps") else "")
           + "; adaptation on (the cache's default), pools as the cache sizes them for its table, with grow=True "
           "(the sample's content overflows more tiles than the arena plans for), the rule on the device, "
           f"calibration from the text's first {a['calib']} tokens; content: the shipped sample (SmolLM2-135M, prose)",
           "- not a serving loop's figure (a few joins, each after a few eager steps of a small batch, on the shipped "
           "sample's content): the user's figure for joins is benchmarks/serving.py's b8-16k-join rows "
           "(results/serving-<device>.md), graph and eager",
           "- benchmarks/join_host.py says what each part counts; `device ops` sums "
           + ", ".join(DEVICE_OPS) + "; `sync` is the host waiting for the device", ""]
    rows = []
    for r in rep["results"]:
        for j, jn in enumerate(r["joins"]):
            for part in PARTS + ("join",):
                if part == "join":
                    c = collections.Counter()
                    for v in jn["counts"].values():
                        c.update(v)
                else:
                    c = collections.Counter(jn["counts"].get(part, {}))
                if not c and part != "join":
                    continue
                name = f"**{part}**" if part == "join" else part
                rows.append([r["layers"], j, jn["epochs"], name] + [c.get(k, 0) for k in KINDS]
                            + [sum(c.get(k, 0) for k in DEVICE_OPS)])
    if rows:
        out += table(["layers", "join", "epochs appended", "part"] + list(KINDS) + ["device ops"], rows)
        out.append("")
    counted = [r for r in rep["results"] if r.get("calls")]
    if counted:
        parts = [p for p in PARTS if any(p in c["calls"] for r in counted for c in r["calls"])] + ["other"]
        parts = list(dict.fromkeys(parts))
        out += ["Python function calls by part (benchmarks/join_host.py's `PartCalls`: the host's work but for the "
                "kernel launches themselves), in more joins, each after the same number of decode steps:", ""]
        rows = []
        for r in counted:
            for j, c in enumerate(r["calls"]):
                rows.append([r["layers"], j, c["epochs"]] + [c["calls"].get(p, 0) for p in parts]
                            + [sum(c["calls"].values())])
        if len(counted) > 1:
            a, b = counted[0], counted[-1]
            per = b["layers"] - a["layers"]
            for j, (ca, cb) in enumerate(zip(a["calls"], b["calls"])):
                rows.append(["a layer more", j, ""] + [f"{(cb['calls'].get(p, 0) - ca['calls'].get(p, 0)) / per:.0f}"
                                                        for p in parts]
                            + [f"{(sum(cb['calls'].values()) - sum(ca['calls'].values())) / per:.0f}"])
        out += table(["layers", "join", "epochs appended"] + parts + ["calls"], rows)
        out.append("")
    for r in rep["results"]:
        if r["joins"]:
            waits = collections.Counter()
            for part, ops in r["joins"][-1]["by_op"].items():
                for op, n in ops.items():
                    if op.startswith("sync:"):
                        waits[f"{part} {op[5:]}"] += n
            listed = ", ".join(f"{k} {v}" for k, v in waits.most_common()) or "none"
            out.append(f"- {r['layers']} layers, join {len(r['joins']) - 1}: waits by part and op: {listed}")
        if r.get("bare_ms") is not None:
            out.append(f"- {r['layers']} layers: a join's host time with the kernels not run {r['bare_ms']:.2f} ms "
                       f"(median of {a['host_ms']}; this CPU's own work for the join: no GPU time, and memory "
                       "operations a GPU queues done here at the CPU's speed)")
        if r["host_ms"] is not None:
            out.append(f"- {r['layers']} layers: a join's host time {r['host_ms']:.2f} ms (median of {a['runs']}), "
                       f"done on the device {r['done_ms']:.2f} ms")
        if r.get("part_ms"):
            out.append(f"- {r['layers']} layers: host ms by part, each part's own (medians of {a['runs']} more joins, "
                       "each part clocked): " + ", ".join(f"{p} {ms:.2f}" for p, ms in r["part_ms"].items())
                       + f"; sum {sum(r['part_ms'].values()):.2f}")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", default="2,4", help="comma-separated layer counts (the counts must not grow)")
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--base", type=int, default=200, help="the first sequence's length")
    ap.add_argument("--prompt", type=int, default=296, help="the joining prompt's tokens (from the text's end)")
    ap.add_argument("--calib", type=int, default=64, help="calibration tokens (from the text's start)")
    ap.add_argument("--joins", type=int, default=2, help="joins counted")
    ap.add_argument("--steps", type=int, default=0,
                    help="eager decode steps of every row before each join (uncounted), as a serving loop runs them")
    ap.add_argument("--runs", type=int, default=10, help="joins timed (GPU)")
    ap.add_argument("--calls", type=int, default=None,
                    help="CPU: joins whose Python calls are counted by part, after those counted (default --joins; "
                         "none on a GPU)")
    ap.add_argument("--host-ms", type=int, default=0,
                    help="CPU: joins after those counted with the simulator's kernels not run, their host time's median "
                         "reported (the host's own work; memory operations at CPU speed)")
    ap.add_argument("--fine", action="store_true", help="the clocked joins take the rule's parts apart too")
    ap.add_argument("--out", type=Path, help="markdown report (and JSON beside it)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        args.calls = 0          # counted on the CPU only (the simulator's launches are left out there)
    elif args.calls is None:
        args.calls = args.joins
    results = [measure(args, int(n)) for n in args.layers.split(",")]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    rep = dict(device=device, machine=f"{platform.machine()} {os.cpu_count()} cores",
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               commit=commit_with_changes("benchmarks/join_host.py"), torch=torch.__version__,
               command="python benchmarks/join_host.py " + " ".join(sys.argv[1:] if argv is None else argv),
               args=vars(args) | {"out": str(args.out) if args.out else None}, results=results)
    text = render(rep)
    print(text)
    if args.out:
        import json

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
