"""What an eager decode step asks of the device: the host's device operations, launches, copies and waits per step.

    python benchmarks/step_host.py [--out benchmarks/results/step-host-cpu.md]       # CPU + numba's simulator: counts
    python benchmarks/step_host.py --device cuda --layers 32 --kv-heads 8 --head-dim 128 --base 8192 \\
        --out $OUT/step-host-h200.md                                                   # a GPU: counts and host time

The loop is a serving loop's eager step without a model (benchmarks/serving.py's ``--modes eager``): random K/V
tokens and queries made once, and per step

    plan = cache.decode_plan(q_heads)
    for layer in range(layers):
        cache.update_layer(layer, seqs, k, v)        # one token per sequence
        plan.run(q, layer)

over a paged cache with adaptation on (its defaults), calibrated on the first ``--calib`` tokens of the first
sequence's content, at batch 1, 8 and 32 with lengths ``--base + 97 * i``: at batch 32 about two sequences finish
a block every step in every layer, and a check of the adaptation rule comes due for every (layer, kind) about every
eight steps.  The content is synthetic (exponents scattered about per-channel centres, K's drifting with the
position, as RoPE drift makes them), which the counts do not depend on.

Counted per step (:class:`StepOps`, benchmarks/construction.py's :class:`DeviceOps` plus kernel launches), by the
part of the step that issues it: ``plan`` (``decode_plan``), ``layers`` (``update_layer`` and ``run``, reported per
layer), ``account`` (the step's account of the blocks it finished, at its last layer), ``observe`` (finished blocks
that complete no check, observed by the adapters on the host), ``checks`` (the decode checks' GPU rule batch
launched) and ``decisions`` (a batch's decisions taken up); steps are grouped as ``steady`` (no rule batch),
``checks launched``, ``decisions taken`` (no epoch appended) and ``epochs appended``.  Kinds: ``alloc``, ``write``, ``h2d``, ``d2h``,
``pinned``, ``sync`` (the host waits for the device: a read of device data into pageable memory, an event's or a
stream's ``synchronize``), ``numba`` (numba's allocations and copies), ``launch`` (kernel launches), ``event``
(events recorded), ``wait`` (a stream made to wait for another: on the device, not the host).

On the CPU every tensor is the "device's" (construction.py says how host tensors are told apart), and the cache's
few branches that differ on a GPU are counted as the GPU takes them: a pinned host copy (``_host_copy``,
``_host_copies``, ``_ask_counts``) is run as its GPU form with a clone for the pinned buffer and an event whose
``synchronize`` counts a wait (a ``query`` finds it arrived); the rule batch's upload of its small inputs counts as
``gaac.cuda.epochs._upload`` does (an allocation, a copy, an event) and its stream's two waits as ``wait``.  The attention
kernel's launches are counted but, unless ``--simulate-attention``, not run in the simulator (they write only the
step's outputs, never the cache).  The CPU's wall times are the simulator's kernels' more than the host's: the
counts are the result there, and the host time of the parts a steady step runs without a kernel (``plan``, and
``account`` with the ``observe`` and ``checks`` it holds), timed in the counted run, the counter's cost included.
With ``--device cuda`` the times are the host's (``wall``: the step's calls as they return, no synchronisation
inside the step), measured in a second run of the steps without the counter.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
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

from benchmarks.construction import _HOST, DeviceOps  # noqa: E402
from benchmarks.report import commit_with_changes, table  # noqa: E402

KINDS = ("alloc", "write", "h2d", "d2h", "pinned", "sync", "numba", "launch", "event", "wait")
DEVICE_OPS = ("alloc", "write", "h2d", "d2h", "pinned", "numba", "launch")     # what the host asks the device to do
PHASES = ("plan", "layers", "account", "observe", "checks", "decisions")
TIMED = ("plan", "account", "observe", "checks", "decisions")     # the parts whose host time is reported
SPACING = 97                 # tokens between the batch's lengths


class _FakeEvent:
    """A CPU run's stand-in for the CUDA event of a pinned copy: its ``synchronize`` counts a wait."""

    def __init__(self, ops):
        self.ops = ops

    def synchronize(self) -> None:
        self.ops.count("sync", "event.synchronize")

    def query(self) -> bool:
        return True

    def record(self, *args) -> None:
        pass


class StepOps(DeviceOps):
    """:class:`DeviceOps` with kernel launches, events and stream waits, counted by the part of the step that
    issues them (:data:`PHASES`; ``phase`` is the current one) and, for a CPU run, the cache's GPU-only
    branches counted as a GPU takes them (the module docstring).  ``run_attention``: the simulator runs the
    attention kernel's launches (else counts them only)."""

    def __init__(self, device: str = "cpu", run_attention: bool = False):
        super().__init__(device)
        self.run_attention = run_attention
        self.phase = "other"
        self.step = collections.defaultdict(collections.Counter)        # phase -> kind -> count, this step
        self.step_ops = collections.defaultdict(collections.Counter)    # phase -> "kind:name" -> count
        self.marks = set()                                              # "batch", "finish": this step's rule work
        self.seconds = collections.Counter()                            # phase -> host seconds, this step
        self._quiet = 0

    def count(self, kind: str, name: str, n: int = 1) -> None:
        if self._quiet:
            return
        super().count(kind, name, n)
        self.step[self.phase][kind] += n
        self.step_ops[self.phase][f"{kind}:{name}"] += n

    def op(self, func, args, kwargs, out) -> None:
        if not self._quiet:
            super().op(func, args, kwargs, out)

    @contextlib.contextmanager
    def quiet(self):
        """Count nothing inside: the CPU's stand-ins for what a GPU does in one counted operation."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def new_step(self) -> tuple:
        """This step's counts (phase -> Counter) and rule marks; the next step starts from zero."""
        got = ({p: collections.Counter(c) for p, c in self.step.items()},
               {p: collections.Counter(c) for p, c in self.step_ops.items()}, set(self.marks),
               collections.Counter(self.seconds))
        self.step.clear()
        self.step_ops.clear()
        self.marks.clear()
        self.seconds.clear()
        return got

    def in_phase(self, owner, name: str, phase: str, when=None) -> None:
        """Count what ``owner.name`` issues under ``phase`` (``when(args, kwargs)``: only those calls)."""
        old = getattr(owner, name)
        ops = self

        def wrapped(*args, **kwargs):
            if when is not None and not when(args, kwargs):
                return old(*args, **kwargs)
            before, ops.phase = ops.phase, phase
            t0 = time.perf_counter()
            try:
                return old(*args, **kwargs)
            finally:
                ops.phase = before
                ops.seconds[phase] += time.perf_counter() - t0

        self._patch(owner, name, wrapped)

    def __enter__(self):
        from gaac.cache.update import UpdateTransaction
        from gaac.cuda import epochs as rule
        from gaac.cuda import launch
        from gaac.cuda.primitives import SIMULATOR
        from gaac.serving.plan import StepPlan

        originals = {name: getattr(launch, name) for name in ("launch_args",) if hasattr(launch, name)}
        tile_launch = getattr(launch, "TileLauncher", None)
        tile_launch = tile_launch.launch if tile_launch is not None else None
        super().__enter__()
        ops = self
        # kernel launches (counted as ``launch``, not among numba's allocations and copies)
        for name, old in originals.items():
            self._patch(launch, name, self._counting(old, "launch", name))
        if tile_launch is not None:
            self._patch(launch.TileLauncher, "launch", self._counting(tile_launch, "launch", "TileLauncher.launch"))
        self._patch(launch.FastLaunch, "run", self._counting(launch.FastLaunch.run, "launch", "FastLaunch.run"))
        if SIMULATOR:
            from numba.cuda.simulator import kernel as sim

            call = sim.FakeCUDAKernel.__call__

            def simulated(kernel, *args):
                if kernel._device or sim._kernel_context:          # a device function inside a kernel
                    return call(kernel, *args)
                name = kernel.fn.__qualname__.split(".<locals>")[0]
                ops.count("launch", name)
                if name == "attention_kernel" and not ops.run_attention:
                    return None
                return call(kernel, *args)

            self._patch(sim.FakeCUDAKernel, "__call__", simulated)
        else:
            from numba.cuda.dispatcher import _LaunchConfiguration

            self._patch(_LaunchConfiguration, "__call__", self._counting(_LaunchConfiguration.__call__, "launch",
                                                                        "numba dispatch"))
            self._patch(torch.cuda.Event, "record", self._counting(torch.cuda.Event.record, "event", "record"))
            self._patch(torch.cuda.Stream, "wait_stream", self._counting(torch.cuda.Stream.wait_stream, "wait",
                                                                         "wait_stream"))
        # the parts of the step
        from gaac.cache.paged import PagedKVCache

        self.in_phase(PagedKVCache, "decode_plan", "plan")
        self.in_phase(StepPlan, "settle", "account")
        self.in_phase(UpdateTransaction, "_launch_decode_checks", "checks")
        self.in_phase(UpdateTransaction, "_finish_rule_batches", "decisions")
        self.in_phase(UpdateTransaction, "_flush", "observe",
                      when=lambda a, kw: (a[4] if len(a) > 4 else kw.get("upto")) is not None)
        batch_init, batch_finish, setup = rule.Batch.__init__, rule.Batch.finish, rule.Batch._setup

        def init(batch, *args, **kwargs):
            ops.marks.add("batch")
            if not self.cuda:
                ops.count("wait", "wait_stream")          # the rule's stream waits for the current one
            return batch_init(batch, *args, **kwargs)

        def finish(batch, *args, **kwargs):
            ops.marks.add("finish")
            if not self.cuda:
                ops.count("wait", "wait_stream")          # the current stream waits for the rule's
            return batch_finish(batch, *args, **kwargs)

        appended = UpdateTransaction._epochs_appended

        def epochs_appended(cache, layer):
            ops.marks.add("epoch")
            return appended(cache, layer)

        self._patch(UpdateTransaction, "_epochs_appended", epochs_appended)
        self._patch(rule.Batch, "__init__", init)
        self._patch(rule.Batch, "finish", finish)
        if not self.cuda:
            def staged_setup(batch, jobs):
                # _upload on a GPU: a wait for the staging buffer's last copy, the tensor, the copy, an event
                for kind in ("sync", "alloc", "h2d", "event"):
                    ops.count(kind, "_upload")
                return setup(batch, jobs)

            if not hasattr(rule, "_staged"):
                self._patch(rule.Batch, "_setup", staged_setup)
            else:
                def staged(flat, device):
                    # _upload on a GPU: the tensor, the copy, an event (the staging buffer's last copy is
                    # queried, long done: no wait)
                    for kind in ("alloc", "h2d", "event"):
                        ops.count(kind, "_upload")
                    out = torch.from_numpy(flat)
                    out = out.view(out.shape)
                    setattr(out, _HOST, False)          # the device's tensor
                    return out

                self._patch(rule, "_staged", staged)
            self._gpu_host_copies(UpdateTransaction)
        return self

    def _counting(self, old, kind: str, name: str):
        ops = self

        def counted(*args, **kwargs):
            ops.count(kind, name)
            return old(*args, **kwargs)

        return counted

    def _gpu_host_copies(self, owner) -> None:
        """A CPU run: the cache's pinned host copies as a GPU makes them (a clone stands in for the pinned copy,
        :class:`_FakeEvent` for its event), counted as there."""
        from gaac.cache.pools import Arrival

        ops = self

        def host_copy(cache, x):
            for kind in ("pinned", "d2h", "event"):
                ops.count(kind, "_host_copy")
            with ops.quiet():
                return x.clone(), _FakeEvent(ops)

        def host_copies(cache, tensors):
            if not isinstance(tensors, torch.Tensor):
                ops.count("alloc", "_host_copies stack")
            for kind in ("pinned", "d2h", "event"):
                ops.count(kind, "_host_copies")
            with ops.quiet():
                host = tensors.clone() if isinstance(tensors, torch.Tensor) else torch.stack(tensors)
            arrival = Arrival(_FakeEvent(ops))
            return [(host[i], arrival) for i in range(len(tensors))]

        self._patch(owner, "_host_copy", host_copy)
        self._patch(owner, "_host_copies", host_copies)
        self._patch(owner, "_counts_copied", True)       # the pools' counts copied as on a GPU (_ask_counts)


# ----------------------------------------------------------------------------------------------
# The loop.

def content(rng, centres: np.ndarray, start: int, tokens: int, drift: float) -> np.ndarray:
    """BF16 bits ``[layers, kv_heads, tokens, head_dim]`` of positions ``start..start + tokens``: exponents about
    ``centres`` ``[layers, kv_heads, 1, head_dim]``, moving ``drift`` per 1024 positions."""
    pos = (start + np.arange(tokens)) / 1024.0
    shape = centres.shape[:2] + (tokens, centres.shape[3])
    e = np.rint(centres + drift * pos[None, None, :, None] + rng.normal(0, 1.5, size=shape))
    e = np.clip(e, 1, 254).astype(np.uint16)
    sm = rng.integers(0, 256, size=shape, dtype=np.uint16)
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)


def make_cache(args, batch: int, rng):
    """A cache of ``batch`` sequences, lengths ``args.base + args.spacing * i``, calibrated on the first ``args.calib``
    tokens of the first's content; and the steps' tokens and queries (made once)."""
    import gaac
    from gaac import PagedKVCache

    layers, heads, dim = args.layers, args.kv_heads, args.head_dim
    ck = rng.integers(112, 128, size=(layers, heads, 1, dim)).astype(np.float64)
    cv = rng.integers(112, 128, size=(layers, heads, 1, dim)).astype(np.float64)
    lens = [args.base + args.spacing * i for i in range(batch)]
    seqs_kv = [(content(rng, ck, 0, n, args.drift), content(rng, cv, 0, n, 0.0)) for n in lens]
    k0, v0 = seqs_kv[0]
    cal = gaac.calibrate(k0[:, :, :args.calib], v0[:, :, :args.calib])
    most = max(lens) + args.warmup + 2 * args.steps + 64
    blocks = -(-most // 16)
    # room for every tile raw: the counts do not depend on how well the synthetic content compresses
    cache = PagedKVCache(cal, max_seqs=batch, max_blocks=blocks, raw_tiles=2 * layers * batch * blocks * heads,
                         device=args.device, codec="cuda")
    dev = cache.device
    if args.device == "cpu":
        # the simulator's encoder takes a tenth of a second a tile: the sequences are encoded by the reference
        # codec (epoch 0) and imported, bytes unchanged
        ref = PagedKVCache(cal, max_seqs=1, max_blocks=blocks, raw_tiles=2 * layers * blocks * heads,
                           codec="reference", adapt=False)
        rows = []
        for k, v in seqs_kv:
            ref.add_sequence(k, v)
            rows.append(cache.import_sequence(ref.export_sequence(0)))
            ref.remove_sequence(0)
    else:
        rows = [cache.add_sequence(torch.from_numpy(k.view(np.int16)).to(dev),
                                   torch.from_numpy(v.view(np.int16)).to(dev)) for k, v in seqs_kv]
    if args.device == "cpu":
        cache._rule_on_device = True         # the decode checks in GPU rule batches, as on a GPU (the prefill's
                                             # rule on the host: the simulator's scan is slow)
    end = max(lens)
    # 16 positions' tokens (cycled), in content's distribution at the batch's far end
    tk = content(rng, ck, end, 16 * batch, args.drift).reshape(layers, heads, 16, batch, dim).transpose(2, 3, 1, 0, 4)
    tv = content(rng, cv, end, 16 * batch, 0.0).reshape(layers, heads, 16, batch, dim).transpose(2, 3, 1, 0, 4)
    # [16, batch, heads, layers, dim] -> per position and layer: [batch, heads, 1, dim]
    tokens = [[(torch.from_numpy(np.ascontiguousarray(tk[p, :, :, layer, None]).view(np.int16)).to(dev),
                torch.from_numpy(np.ascontiguousarray(tv[p, :, :, layer, None]).view(np.int16)).to(dev))
               for layer in range(layers)] for p in range(16)]
    q_heads = heads * args.group
    q = torch.from_numpy((rng.standard_normal((batch, q_heads, dim)).astype(np.float32).view(np.uint32) >> 16)
                         .astype(np.uint16).view(np.int16)).to(dev).view(torch.bfloat16)
    return cache, rows, tokens, q, q_heads


def step(cache, rows, tokens, q, q_heads, i: int, times=None) -> None:
    """One eager step (position ``i`` of the cycled tokens); ``times``: append the layers' host seconds."""
    plan = cache.decode_plan(q_heads)
    for layer in range(cache.layers):
        k, v = tokens[i % 16][layer]
        t0 = time.perf_counter()
        cache.update_layer(layer, rows, k, v)
        plan.run(q, layer)
        if times is not None:
            times.append(time.perf_counter() - t0)


def measure(args, batch: int) -> dict:
    rng = np.random.default_rng(args.seed + batch)
    cache, rows, tokens, q, q_heads = make_cache(args, batch, rng)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    i = 0
    with StepOps(args.device, args.simulate_attention):      # (counts dropped; the attention as counted)
        for _ in range(args.warmup):          # compiles, first launches, parameter buffers
            step(cache, rows, tokens, q, q_heads, i)
            i += 1
    sync()
    steps = []
    with StepOps(args.device, args.simulate_attention) as ops:
        ops.new_step()
        for _ in range(args.steps):
            ops.phase = "layers"
            step(cache, rows, tokens, q, q_heads, i)
            ops.phase = "other"
            i += 1
            steps.append(ops.new_step())
    sync()
    walls, layer_times = [], []
    timing = contextlib.nullcontext() if cuda else StepOps(args.device, args.simulate_attention)
    with timing:
        for _ in range(args.steps if cuda or args.time else 0):
            t0 = time.perf_counter()
            step(cache, rows, tokens, q, q_heads, i, layer_times)
            walls.append(time.perf_counter() - t0)
            i += 1
    sync()
    epochs = sum(cache.calibration.n_epochs(layer, kind) - 1 for layer in range(cache.layers) for kind in range(2))
    return dict(batch=batch, steps=steps, layers=cache.layers, epochs_appended=epochs,
                wall_ms=statistics.median(walls) * 1e3 if walls else None,
                layer_us=statistics.median(layer_times) * 1e6 if layer_times else None)


def summary(r: dict) -> dict:
    """Per-step averages by phase and kind, over all steps, the steady ones and those with rule work."""
    layers = r["layers"]
    groups = {"steady": [s for s in r["steps"] if not s[2]],
              "checks launched": [s for s in r["steps"] if "batch" in s[2]],
              "decisions taken": [s for s in r["steps"] if "finish" in s[2] and "epoch" not in s[2]],
              "epochs appended": [s for s in r["steps"] if "epoch" in s[2]],
              "all": r["steps"]}
    out = {}
    for name, steps in groups.items():
        if not steps:
            continue
        mean = {}
        for phase in PHASES:
            c = collections.Counter()
            for s in steps:
                c.update(s[0].get(phase, {}))
            mean[phase] = {k: c[k] / len(steps) / (layers if phase == "layers" else 1) for k in KINDS}
        ops = collections.Counter()
        for s in steps:
            for phase, c in s[1].items():
                ops.update({f"{phase} {k}": v for k, v in c.items()})
        host_ms = {phase: sum(s[3][phase] for s in steps) / len(steps) * 1e3 for phase in TIMED}
        finishing = [s[3]["account"] * 1e3 for s in steps if sum(s[0].get("account", {}).values())]
        out[name] = dict(n=len(steps), mean=mean, by_op={k: v / len(steps) for k, v in ops.most_common()},
                         host_ms=host_ms, account_finishing_ms=statistics.median(finishing) if finishing else None)
    return out


def _fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"


def render(rep: dict) -> str:
    lines = [f"# An eager decode step's host side: device operations, launches, copies, waits ({rep['device']})", "",
             f"- {rep['machine']}, {rep['date']}, commit {rep['commit']}, torch {rep['torch']}",
             f"- command: `{rep['command']}`",
             f"- {rep['layers']} layers, {rep['kv_heads']} KV heads x {rep['head_dim']}, {rep['q_heads']} query heads; "
             f"lengths {rep['base']} + {rep['spacing']} i; adaptation on, calibration from the first {rep['calib']} tokens; "
             f"{rep['warmup']} steps of warm-up, then {rep['steps']} counted",
             "- benchmarks/step_host.py says what each kind and part counts; `layers` is per layer, the other parts "
             "per step; `device ops` sums alloc, write, h2d, d2h, pinned, numba and launch", ""]
    header = ["batch", "steps", "part", *KINDS, "device ops"]
    for r in rep["results"]:
        s = r["summary"]
        rows = []
        for group, g in s.items():
            for phase in PHASES:
                m = g["mean"][phase]
                if not any(m.values()) and phase not in ("layers", "plan"):
                    continue
                rows.append([r["batch"], f"{group} ({g['n']})", phase, *(_fmt(m[k]) for k in KINDS),
                             _fmt(sum(m[k] for k in DEVICE_OPS))])
            tot = {k: sum(g["mean"][p][k] * (r["layers"] if p == "layers" else 1) for p in PHASES) for k in KINDS}
            rows.append([r["batch"], f"{group} ({g['n']})", "**step**", *(_fmt(tot[k]) for k in KINDS),
                         _fmt(sum(tot[k] for k in DEVICE_OPS))])
        lines += [f"## Batch {r['batch']}", ""] + table(header, rows) + [""]
        extra = [f"epochs appended over the run: {r['epochs_appended']}"]
        if r["wall_ms"] is not None:
            extra.append(f"host wall a step {r['wall_ms']:.2f} ms (median), a layer's update_layer + run "
                         f"{r['layer_us']:.1f} us (median)")
        lines += ["- " + "; ".join(extra)]
        g = s["steady"] if "steady" in s else s["all"]
        lines += [f"- host ms a step, steady steps (the counted run: the counter's own cost is included; `account` "
                  f"holds `observe` and `checks`): " + ", ".join(f"{p} {g['host_ms'][p]:.3f}" for p in TIMED)
                  + (f"; `account` of a steady step that finishes blocks {g['account_finishing_ms']:.3f} (median)"
                     if g["account_finishing_ms"] is not None else "")]
        for group in ("steady", "checks launched", "decisions taken", "epochs appended"):
            if group in s:
                lines += [f"- {group}, by op (per step): " + ", ".join(f"{k} {_fmt(v)}" for k, v in
                                                                        s[group]["by_op"].items())]
        lines += [""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--group", type=int, default=2, help="query heads per KV head")
    ap.add_argument("--base", type=int, default=40, help="the first sequence's length")
    ap.add_argument("--spacing", type=int, default=SPACING, help="tokens between the batch's lengths")
    ap.add_argument("--calib", type=int, default=32, help="calibration tokens (from the first sequence's start)")
    ap.add_argument("--drift", type=float, default=4.0, help="K's exponent drift per 1024 positions")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", action="store_true", help="on the CPU too, time a second run of the steps")
    ap.add_argument("--simulate-attention", action="store_true",
                    help="run the attention kernel in the simulator (else its launches are counted only)")
    ap.add_argument("--out", type=Path, help="markdown report (and JSON beside it)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    rep = dict(device=args.device, date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
               machine=(torch.cuda.get_device_name() if cuda
                        else f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, numba's "
                             "CUDA simulator"),
               commit=commit_with_changes("benchmarks/step_host.py"), torch=torch.__version__,
               command="python benchmarks/step_host.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, q_heads=args.kv_heads * args.group,
               base=args.base, spacing=args.spacing, calib=args.calib, warmup=args.warmup, steps=args.steps, results=[])
    for batch in (int(b) for b in args.batches.split(",")):
        t0 = time.perf_counter()
        r = measure(args, batch)
        r["summary"] = summary(r)
        del r["steps"]
        rep["results"].append(r)
        g = r["summary"]["all"]["mean"]
        per_step = sum(g[p][k] * (r["layers"] if p == "layers" else 1) for p in PHASES for k in DEVICE_OPS)
        print(f"batch {batch}: {per_step:.1f} device ops a step, sync "
              f"{sum(g[p]['sync'] * (r['layers'] if p == 'layers' else 1) for p in PHASES):.2f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    text = render(rep)
    print(text)
    if args.out:
        import json

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
