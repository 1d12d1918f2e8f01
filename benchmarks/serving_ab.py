"""A/B of the serving loop's GAAC side: the loop as shipped against one part of it changed, interleaved in one process.

    python benchmarks/serving_ab.py b1-64k graph 256 bf16,pdl,off,pdl,off,bf16,pdl,off
    python benchmarks/serving_ab.py b1-64k,b1-128k eager 256 bf16,one,two,one,two,bf16,one,two
    python benchmarks/serving_ab.py b8-16k-join eager 256 bf16,one,settle,one,settle,bf16
    python benchmarks/serving_ab.py b8-16k-join eager 256 bf16,one,unknown,unknown,one,bf16

benchmarks/serving.py's runs of a scenario (its user's loop: the cache's defaults, a calibration from the first 1024
tokens, every capture and re-plan inside 256 timed steps, read-back and attention checked after each run), in one
process and interleaved: ``bf16`` (BF16 + flash); ``pdl`` and ``one`` (GAAC as shipped: per layer one
``plan.run(q, layer, k=, v=)``, the attention launched as a programmatic dependent of the layer's one-token append,
gaac/serving/plan.py); ``off`` (GAAC with every attention launched in plain stream order); ``two`` (GAAC with the
append and the attention as two calls a layer, ``cache.update_layer`` then ``plan.run``); ``settle`` (GAAC with a
joining prompt's rule batch not taking the decode steps' queued blocks as its first: their checks run first in a
rule batch of their own, which the host waits for, and the adapters observe the rest a step at a time,
``UpdateTransaction._lead``); ``unknown`` (GAAC with the pools' exact counts never taken as the device's, so
that every reservation that needs them reads them, and goes before the rule: ``UpdateTransaction._counts_known``).
Arguments: scenarios, modes, timed steps, the runs in order (a last argument ``--smoke``: the smoke scenarios, GAAC
only, in numba's simulator on the CPU).  Prints each run's ms a step and the means."""
import sys, argparse, statistics
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "benchmarks"))
import torch
import serving as SV
import decode_step as ds
import gaac
from gaac.cache.update import UpdateTransaction
from gaac.serving.plan import StepPlan

shipped = StepPlan._launch


def off(self, state, layer, q, out, lse, handle=None, follows=None):
    """The layer's attention launched in plain stream order, whatever launch came before it."""
    self._after_append = None
    return shipped(self, state, layer, q, out, lse, handle, False)


one_call = ds.StepAttend.__call__
lead = UpdateTransaction._lead
known = UpdateTransaction._counts_known


def two_calls(self, layer, q):
    """The step's token through ``update_layer``, then ``plan.run``: two calls a layer."""
    k, v = self.loop.kv(layer)
    self.cache.update_layer(layer, self.plan.seqs, k[:, :, None], v[:, :, None])
    return self.plan.run(q, layer, out=self.out)


# each run alone, its steps in one window (serving.run_pair with interleave 0)
args = argparse.Namespace(warmup=1 if ds.SMOKE else 16, steps=int(sys.argv[3]) if len(sys.argv) > 3 else 256,
                          interleave=0, profile=0, join_phases=0, host_profile=0, join_by_layer=False,
                          prompt_trace=False, isolate=False, join_drain=False, join_profile=False)
torch.backends.cuda.matmul.allow_tf32 = False
s = ds.SMOKE_SHAPE if ds.SMOKE else ds.LLAMA_8B
k_u, v_u = ds.real_source(ds.find_data(None), s)
cal = gaac.calibrate(k_u[:, :, :1024], v_u[:, :, :1024], show_progress=False)
src = ds.Source(k_u, v_u)
model = ds.Model(s)
for name in sys.argv[1].split(","):
    batch, context, every, prompt, tg, te = (SV.SMOKE_SCENARIOS if ds.SMOKE else SV.SCENARIOS)[name]
    lens = [context - SV.GAP * i for i in range(batch)]
    for mode in sys.argv[2].split(","):
        graph = mode == "graph"
        res = {}
        for tag in (sys.argv[4].split(",") if len(sys.argv) > 4 else ["bf16", "pdl", "off", "pdl", "off", "bf16"]):
            StepPlan._launch = shipped if tag != "off" else off
            ds.StepAttend.__call__ = two_calls if tag == "two" else one_call
            UpdateTransaction._lead = (lambda self, *a: None) if tag == "settle" else lead
            UpdateTransaction._counts_known = property(lambda self: False) if tag == "unknown" else known
            fn = SV.run_bf16 if tag == "bf16" else SV.run_gaac
            r = SV.run_pair({tag: lambda: fn(model, src, cal, s, lens, args, every, prompt, graph)}, args)[tag]
            if "error" in r:
                print(f"{name} {mode} {tag}: {r['error']}", flush=True)
                continue
            res.setdefault(tag, []).append(r["ms"])
            print(f"{name} {mode} {tag}: {r['ms']:.3f} ms/step, event median {r.get('event_median_ms', 0):.3f}, "
                  f"captures {r.get('captures')}, eager {r.get('eager_steps')}, bit-exact {r.get('bit_exact')}, "
                  f"err {r.get('attention_rel_err')}", flush=True)
        StepPlan._launch = shipped
        ds.StepAttend.__call__ = one_call
        UpdateTransaction._lead = lead
        UpdateTransaction._counts_known = known
        b = statistics.mean(res.get("bf16", [float("nan")]))
        print(f"== {name} {mode}: bf16 {b:.3f}; " + "; ".join(
            f"{t} {statistics.mean(v):.3f} ({b / statistics.mean(v):.4f}x)" for t, v in res.items() if t != "bf16"),
            flush=True)
