"""What making a paged cache asks of the device: the device operations the host issues, by kind, and the time.

    python benchmarks/construction.py [--out benchmarks/results/construction-cpu.md]     # CPU + numba's simulator
    python benchmarks/construction.py --device cuda --out $OUT/construction-h200.md     # a GPU: counts and timings

Cases (every cache with the CUDA codec: device free lists and encoder plans, as on a GPU):

* ``sample``: ``PagedKVCache`` of the shipped sample's calibration (``gaac/data``: 4 layers, 3 KV heads x 64), the
  table's default size;
* ``synthetic-32x8x128``: ``PagedKVCache`` of a synthetic calibration of 32 layers, 8 KV heads x 128 (Llama-3.1-8B's
  shape), 8 sequences of 256 blocks;
* ``gaaccache-30x3x64``: ``gaac.hf.GAACCache`` with SmolLM2-135M's shape (30 layers, 3 KV heads x 64) and a synthetic
  calibration of that shape, set up for a 4096-token prompt: the cache object and ``_open`` (the paged cache it
  makes before its first encode, and the batch row's sequence).

Counted (:class:`DeviceOps`), for the construction alone:

* ``alloc``: torch ops that allocate device memory (a factory, a copy into a new tensor, ``cat``, ``clone``...);
* ``write``: torch ops that write device memory in place (``fill_``, ``copy_`` of device data, ``zero_``...);
* ``h2d`` / ``d2h``: copies from host to device and back (``.to``, ``copy_`` from a host tensor, ``.cpu()``,
  ``.tolist()``, ``int(t)``; a 0-dimensional host tensor passed to an op is a scalar argument, not a copy);
* ``pinned``: pinned host allocations (``pin_memory``);
* ``sync``: synchronisations (a read of device data into pageable host memory, ``torch.cuda.synchronize``, an event's
  or stream's ``synchronize``);
* ``numba``: numba device allocations, copies and kernel launches (``cuda.to_device``, ``device_array``,
  ``pinned_array``, the codec's launches).

A torch op is counted where the tensors it writes are device tensors.  On a GPU that is their device.  On the CPU
every tensor is on the CPU, so the host's tensors are told apart by where they come from: a tensor made from host
data (``torch.from_numpy``, ``torch.tensor``; torch's ``lift_fresh``) is a host tensor, as is what ops on host
tensors alone make; ``.to(device)`` of a host tensor is a host-to-device copy, and ``gaac.arrays.upload``
(which on a GPU pins its array and copies it asynchronously) counts a pinned allocation and a copy.  The CPU's
counts are then the GPU's: the same code runs either way.

``wall ms`` is the host's wall clock of the construction (median of ``--runs`` after one untimed run); with
``--device cuda`` it is synchronised before and after (``cuda ms``: the same, device included).
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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.report import commit_with_changes, table  # noqa: E402

KINDS = ("alloc", "write", "h2d", "d2h", "pinned", "sync", "numba")
_HOST = "_gaac_host"          # attribute of a CPU tensor that holds host data (CPU runs)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return -1


def patch(stack: contextlib.ExitStack, owner, name: str, new) -> None:
    """``owner.name`` replaced by ``new`` until ``stack`` closes, then put back (the counters' and clocks' hooks)."""
    old = getattr(owner, name)
    setattr(owner, name, new)
    stack.callback(setattr, owner, name, old)


class DeviceOps:
    """Counts the device operations the host issues inside ``with ops:``, by kind (``counts``), and by op
    (``by_op``, ``kind:name``).  ``device``: the device the counted code's tensors live on (``cpu`` or ``cuda``)."""

    def __init__(self, device: str = "cpu"):
        self.cuda = device.startswith("cuda")
        self.counts = collections.Counter()
        self.by_op = collections.Counter()
        self._stack = contextlib.ExitStack()

    # -- what is a device tensor ------------------------------------------------------------------
    def on_device(self, t: torch.Tensor) -> bool:
        if self.cuda:
            return t.device.type == "cuda"
        return t.device.type == "cpu" and not getattr(t, _HOST, False)

    def host(self, t: torch.Tensor) -> bool:
        return not self.on_device(t)

    def count(self, kind: str, name: str, n: int = 1) -> None:
        self.counts[kind] += n
        self.by_op[f"{kind}:{name}"] += n

    # -- torch ops -----------------------------------------------------------------------------------
    def op(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        outs = list(_tensors(out))
        if name == "lift_fresh" or name == "lift_fresh_copy":
            if not self.cuda:
                for t in outs:
                    setattr(t, _HOST, True)
            return
        if name in ("_pin_memory", "pin_memory"):
            self.count("pinned", name)
            return
        if name == "is_pinned":
            return
        if name == "_local_scalar_dense":
            if ins and self.on_device(ins[0]):
                self.count("d2h", name)
                self.count("sync", name)
            return
        dev_in = [t for t in ins if self.on_device(t)]
        host_in = [t for t in ins if self.host(t) and t.dim() > 0]          # a 0-dim host tensor is a scalar
        dev_out = [t for t in outs if self.on_device(t)]
        if not self.cuda and not dev_in and ins and all(self.host(t) for t in ins):
            for t in outs:                  # host work on host tensors: its results are host tensors
                setattr(t, _HOST, True)
            return
        if self.cuda and dev_in and not dev_out and outs:          # a copy of device data to the host
            self.count("d2h", name)
            if not (kwargs.get("non_blocking") and all(t.is_pinned() for t in outs)):
                self.count("sync", name)
            return
        if not dev_out and not (not self.cuda and outs):
            return
        if host_in:
            self.count("h2d", name)
            blocking = not (kwargs.get("non_blocking") or (name == "copy_" and len(args) > 2 and args[2]))
            if blocking and (self.cuda or name == "copy_"):     # torch waits for the stream after a blocking copy
                self.count("sync", name)
        known = {_storage(t) for t in ins}
        if any(_storage(t) not in known or _storage(t) == 0 for t in (dev_out or outs)):
            self.count("alloc", name)
        elif not host_in and (name.endswith("_") or "out" in kwargs or func._schema.is_mutable):
            self.count("write", name)

    # -- host-side entry points ------------------------------------------------------------------------
    def __enter__(self):
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                counter.op(func, args, kwargs, out)
                return out

        s = self._stack
        s.enter_context(Mode())
        patch = self._patch
        orig_tolist = torch.Tensor.tolist

        def tolist(t):
            if counter.on_device(t):
                counter.count("d2h", "tolist")
                counter.count("sync", "tolist")
            return orig_tolist(t)

        patch(torch.Tensor, "tolist", tolist)
        if not self.cuda:
            orig_to, orig_cpu = torch.Tensor.to, torch.Tensor.cpu

            def to(t, *args, **kwargs):
                out = orig_to(t, *args, **kwargs)
                device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
                if device is not None and getattr(t, _HOST, False):
                    counter.count("h2d", "to")
                    if not non_blocking:             # torch waits for the stream after a blocking copy
                        counter.count("sync", "to")
                    if out is t:
                        out = t.view(t.shape)
                    setattr(out, _HOST, False)       # the device's copy: not a host tensor
                return out

            def cpu(t, *args, **kwargs):
                out = orig_cpu(t, *args, **kwargs)
                if counter.on_device(t):
                    counter.count("d2h", "cpu")
                    counter.count("sync", "cpu")
                    out = t.view(t.shape)
                    setattr(out, _HOST, True)
                return out

            patch(torch.Tensor, "to", to)
            patch(torch.Tensor, "cpu", cpu)
            from gaac import arrays

            orig_upload = arrays.upload

            def upload(a, device):
                if device.type != "cpu":
                    return orig_upload(a, device)
                # on a GPU: pinned, then an asynchronous copy; here the host's array, as the device's
                counter.count("pinned", "upload")
                counter.count("h2d", "upload")
                out = torch.from_numpy(np.ascontiguousarray(a))
                out = out.view(out.shape)
                setattr(out, _HOST, False)
                return out

            patch(arrays, "upload", upload)
        else:
            for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                                (torch.cuda.Stream, "synchronize")):
                self._count_calls(owner, name, "sync")
        from numba import cuda

        for name, kind in (("to_device", "numba"), ("device_array", "numba"), ("device_array_like", "numba"),
                           ("pinned_array", "numba"), ("mapped_array", "numba"), ("synchronize", "sync")):
            if hasattr(cuda, name):
                self._count_calls(cuda, name, kind)
        from gaac.cuda import launch

        for name in ("launch_args",):
            if hasattr(launch, name):
                self._count_calls(launch, name, "numba")
        if hasattr(launch, "TileLauncher"):
            self._count_calls(launch.TileLauncher, "launch", "numba")
        return self

    def _patch(self, owner, name, new) -> None:
        patch(self._stack, owner, name, new)

    def _count_calls(self, owner, name, kind) -> None:
        old = getattr(owner, name)
        counter = self

        def counted(*args, **kwargs):
            counter.count(kind, name)
            return old(*args, **kwargs)

        self._patch(owner, name, counted)

    def __exit__(self, *exc):
        self._stack.close()
        return False

    @property
    def total(self) -> int:
        return sum(self.counts[k] for k in KINDS)


# ----------------------------------------------------------------------------------------------
# The cases.

def sample_calibration():
    import gaac

    k, v = gaac.sample("prose")
    return gaac.calibrate(k, v)


def synthetic_calibration(layers: int, heads: int, dim: int, seed: int = 0):
    """A calibration of the given shape with bases as real K/V have them (narrow 3-bit windows a few below
    per-channel centres, wide ones below those), a 16-byte escape capacity and a 1% raw rate."""
    from gaac.calibration import Calibration

    rng = np.random.default_rng(seed)
    centre = rng.integers(112, 130, size=(2, layers, heads, dim))
    cal = Calibration(b3=centre - 3, b4=centre - 7, capacity=np.full((2, layers), 16), model="synthetic")
    return cal


def smollm2_config(layers: int = 30):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)


def cases(device: str, tokens: int):
    """``(name, what, make)``: ``make()`` builds what is counted and returns it."""
    from gaac import PagedKVCache

    sample = sample_calibration()
    big = synthetic_calibration(32, 8, 128)
    small = synthetic_calibration(30, 3, 64)

    def paged(cal, **kw):
        return lambda: PagedKVCache(cal, device=device, codec="cuda", **kw)

    out = [("sample", "PagedKVCache, shipped sample's calibration (4 layers, 3x64), default table", paged(sample)),
           ("sample-grow", "the same with grow=True", paged(sample, grow=True)),
           ("synthetic-32x8x128", "PagedKVCache, 32 layers, 8x128, max_seqs=8, max_blocks=256",
            paged(big, max_seqs=8, max_blocks=256))]
    try:
        from gaac.hf import GAACCache
    except ImportError:          # transformers not installed
        return out
    config = smollm2_config()
    k = torch.zeros((1, 3, tokens, 64), dtype=torch.bfloat16, device=device)

    def gaac_cache():
        cache = GAACCache(config=config, calibration=small, codec="cuda")
        cache._open(k)
        return cache

    out.append(("gaaccache-30x3x64", f"GAACCache(SmolLM2-135M shape) set up for a {tokens}-token prompt", gaac_cache))
    return out


def measure(device: str, make, runs: int) -> dict:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    make()                                     # untimed: imports, kernel specialisations, allocator warm-up
    with DeviceOps(device) as ops:
        make()
    times, cuda_times = [], []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        make()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        times.append((t1 - t0) * 1e3)
        cuda_times.append((t2 - t0) * 1e3)
    return dict(counts={k: ops.counts[k] for k in KINDS}, total=ops.total, by_op=dict(ops.by_op.most_common()),
                wall_ms=statistics.median(times), cuda_ms=statistics.median(cuda_times))


def render(rep: dict) -> str:
    cuda = rep["device"].startswith("cuda")
    lines = [f"# Making a paged cache: device operations the host issues ({rep['device']})", "",
             f"- {rep['machine']}, {rep['date']}, commit {rep['commit']}, torch {rep['torch']}",
             f"- command: `{rep['command']}`",
             "- counts of one construction (benchmarks/construction.py says what each kind counts); "
             f"time: median of {rep['runs']} constructions after an untimed one", ""]
    header = ["case", *KINDS, "total", "wall ms"] + (["cuda ms"] if cuda else [])
    rows = [[c["name"], *(c["counts"][k] for k in KINDS), c["total"], f"{c['wall_ms']:.2f}"]
            + ([f"{c['cuda_ms']:.2f}"] if cuda else []) for c in rep["cases"]]
    lines += table(header, rows) + [""]
    for c in rep["cases"]:
        lines += [f"- `{c['name']}`: {c['what']}; by op: "
                  + ", ".join(f"{k} {v}" for k, v in c["by_op"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=4096, help="the GAACCache case's prompt")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, help="markdown report (and JSON beside it)")
    args = ap.parse_args(argv)
    rep = dict(device=args.device, runs=args.runs, date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
               machine=(torch.cuda.get_device_name() if args.device.startswith("cuda")
                        else f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, numba's "
                             "CUDA simulator"),
               commit=commit_with_changes("benchmarks/construction.py"), torch=torch.__version__,
               command="python benchmarks/construction.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               cases=[])
    for name, what, make in cases(args.device, args.tokens):
        r = measure(args.device, make, args.runs)
        rep["cases"].append(dict(name=name, what=what, **r))
        print(f"{name:22s} " + " ".join(f"{k}={r['counts'][k]}" for k in KINDS)
              + f" total={r['total']} wall={r['wall_ms']:.2f} ms", flush=True)
    print(render(rep))
    if args.out:
        import json

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(render(rep))
        args.out.with_suffix(".json").write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
